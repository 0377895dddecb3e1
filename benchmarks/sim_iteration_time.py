"""Simulated iteration times and the speed of `SimEngine.step()`.

For h100-llama3-8b, a6000-llama3-8b and h100x4-llama3-70b, measured side by side in the same run:
- the modelled iteration time of decode batches (1/8/32/128 sequences at 512 and 2048 context), single
  prefills of 512/2048/8192 tokens (one iteration, whatever the profile's token budget) and a mixed batch
  (one 512-token prefill chunk with 32 decodes at 2048), each also as a ratio to one decode at 512 context;
- the length-heterogeneity penalty: mixed vs homogeneous decode batches with equal total context, on the whole
  iteration and on its attention part;
- the engine's speed: iterations per wall-clock second of `step()` over a Poisson workload, and the cost of
  one step relative to one bare `iteration_time_s` call (the baseline);
- the hidden-state tap (what the sim backend builds in its executor every k decode steps): wall time of one
  batch of 256 x hidden-size vectors, relative to one `step()` of the run above (the baseline), and the
  one-off set-up of `SyntheticHiddenStates` (tens of ms of numpy: the backend builds it off the loop).
Results are printed and written as JSON (default results/sim_iteration_time.json).

    .venv/bin/python benchmarks/sim_iteration_time.py [--requests 3000] [--rate 12] [--output PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from engine_agent.domain import BackendRequest, RequestId, SamplingSpec
from engine_agent.sim.engine import SimEngine
from engine_agent.sim.hidden_states import SyntheticHiddenStates
from switchyard.perf_model import (
    BatchShape,
    PerfCoefficients,
    batch_time_s,
    decode_attention_time_s,
    iteration_time_s,
)
from switchyard.profiles import get_profile

REPO = Path(__file__).resolve().parents[1]
PROFILES = ("h100-llama3-8b", "a6000-llama3-8b", "h100x4-llama3-70b")


def shapes() -> dict[str, BatchShape]:
    out: dict[str, BatchShape] = {}
    for context in (512, 2048):
        for batch in (1, 8, 32, 128):
            out[f"decode_b{batch}_ctx{context}"] = BatchShape(decode_context_tokens=(context,) * batch)
    for tokens in (512, 2048, 8192):
        out[f"prefill_{tokens}"] = BatchShape(prefill_chunks=((tokens, 0),))
    out["mixed_prefill512_decode32_ctx2048"] = BatchShape(prefill_chunks=((512, 0),),
                                                          decode_context_tokens=(2048,) * 32)
    return out


def heterogeneity(c: PerfCoefficients) -> dict[str, Any]:
    """Mixed vs homogeneous decode batches with the same number of sequences and the same total context."""
    rng = random.Random(0)
    lognormal = [max(16, min(8000, round(rng.lognormvariate(6.5, 1.0)))) for _ in range(64)]
    cases = {
        "half_256_half_3840_vs_32x2048": ([256] * 16 + [3840] * 16, [2048] * 32),
        "one_8000_among_63x64_vs_64x188": ([64] * 63 + [8000], [188] * 64),
        "lognormal64_vs_equal": (lognormal, [sum(lognormal) // 64] * 63
                                 + [sum(lognormal) - 63 * (sum(lognormal) // 64)]),
    }
    out: dict[str, Any] = {}
    for name, (mixed, even) in cases.items():
        assert sum(mixed) == sum(even) and len(mixed) == len(even)
        mixed_s = batch_time_s(c, BatchShape(decode_context_tokens=tuple(mixed)))
        even_s = batch_time_s(c, BatchShape(decode_context_tokens=tuple(even)))
        out[name] = {
            "total_context_tokens": sum(mixed),
            "iteration_ratio": mixed_s / even_s,
            "attention_ratio": decode_attention_time_s(c, mixed) / decode_attention_time_s(c, even),
            "mixed_ms": mixed_s * 1e3,
            "homogeneous_ms": even_s * 1e3,
        }
    return out


def step_rate(profile_name: str, num_requests: int, rate_per_s: float) -> dict[str, Any]:
    """Drive one engine through a Poisson workload in virtual time and time `step()` on the wall clock."""
    rng = random.Random(1)
    arrivals: list[tuple[float, BackendRequest]] = []
    t = 0.0
    for i in range(num_requests):
        t += rng.expovariate(rate_per_s)
        prompt = max(4, min(4096, round(rng.lognormvariate(5.5, 1.0))))
        sampling = SamplingSpec(max_tokens=min(2048, 8192 - prompt))
        arrivals.append((t, BackendRequest(RequestId(f"r{i}"), (100,) * prompt, sampling)))
    engine = SimEngine(get_profile(profile_name), seed=0)
    now_s, index, steps, seq_steps, tokens = 0.0, 0, 0, 0, 0
    wall_start = time.perf_counter()
    while index < len(arrivals) or engine.has_work():
        while index < len(arrivals) and arrivals[index][0] <= now_s:
            engine.add_request(arrivals[index][1], arrivals[index][0])
            index += 1
        if not engine.has_work():
            now_s = arrivals[index][0]
            continue
        result = engine.step(now_s)
        now_s += result.duration_s
        steps += 1
        seq_steps += result.record.num_prefill_seqs + result.record.num_decode_seqs
        tokens += len(result.tokens)
    wall_s = time.perf_counter() - wall_start

    c = PerfCoefficients.from_profile(get_profile(profile_name))
    calls = 200_000
    base_start = time.perf_counter()
    for _ in range(calls):
        iteration_time_s(c, 1, 128, 8256, 0, 32, 40_000, 3000)
    base_per_call_s = (time.perf_counter() - base_start) / calls
    stats = engine.stats(now_s)
    return {
        "profile": profile_name,
        "requests": num_requests,
        "arrival_rate_per_s": rate_per_s,
        "virtual_s": now_s,
        "wall_s": wall_s,
        "iterations": steps,
        "iterations_per_wall_s": steps / wall_s,
        "mean_batch_seqs": seq_steps / steps,
        "seq_iterations_per_wall_s": seq_steps / wall_s,
        "tokens_per_wall_s": tokens / wall_s,
        "virtual_to_wall_speedup": now_s / wall_s,
        "preemptions": stats.num_preempted_total,
        "baseline_iteration_time_call_us": base_per_call_s * 1e6,
        "step_cost_vs_baseline_call": (wall_s / steps) / base_per_call_s,
    }


def hidden_state_tap(profile_name: str, step_wall_s: float, requests: int = 256,
                     runs: int = 10) -> dict[str, Any]:
    """Wall time of one tap batch of `requests` vectors, median of `runs`, after a warm-up that builds the
    noise bank; `step_wall_s` (one `SimEngine.step`, measured in the same run) is the baseline."""
    model = get_profile(profile_name).model
    rng = random.Random(3)
    ids = [f"req-{i}" for i in range(requests)]
    prompt = [rng.randrange(10, 4000) for _ in ids]
    generated = [rng.randrange(1, 1000) for _ in ids]
    remaining = [rng.randrange(1, 1000) for _ in ids]
    setup_start = time.perf_counter()
    hidden = SyntheticHiddenStates(model.hidden_size, model.name)
    setup_s = time.perf_counter() - setup_start
    hidden.vectors(ids, prompt, generated, remaining)
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        hidden.vectors(ids, prompt, generated, remaining)
        samples.append(time.perf_counter() - started)
    median_s = statistics.median(samples)
    return {
        "profile": profile_name,
        "requests": requests,
        "hidden_size": model.hidden_size,
        "batch_median_ms": median_s * 1e3,
        "batch_max_ms": max(samples) * 1e3,
        "batch_vs_one_step": median_s / step_wall_s,
        "setup_ms": setup_s * 1e3,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--rate", type=float, default=12.0, help="Poisson arrival rate for the step-rate run")
    ap.add_argument("--output", type=Path, default=REPO / "results" / "sim_iteration_time.json")
    args = ap.parse_args()

    result: dict[str, Any] = {"iteration_ms": {}, "ratio_to_decode_b1_ctx512": {}, "heterogeneity": {}}
    for name in PROFILES:
        c = PerfCoefficients.from_profile(get_profile(name))
        times = {shape: batch_time_s(c, batch) for shape, batch in shapes().items()}
        base = times["decode_b1_ctx512"]
        result["iteration_ms"][name] = {k: round(v * 1e3, 3) for k, v in times.items()}
        result["ratio_to_decode_b1_ctx512"][name] = {k: round(v / base, 3) for k, v in times.items()}
        result["heterogeneity"][name] = heterogeneity(c)
    result["step_rate"] = step_rate("h100-llama3-8b", args.requests, args.rate)
    step_wall_s = result["step_rate"]["wall_s"] / result["step_rate"]["iterations"]
    result["hidden_state_tap"] = hidden_state_tap("h100-llama3-8b", step_wall_s)

    print(json.dumps(result, indent=2))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
