"""Speed of the discrete-event simulator (`loadgen.simulate`) on the Azure LLM conversation trace.

For each fleet size (default 64 and 256 x h100-llama3-8b) and trace speed-up (default 1x, the trace's
own hour, and 4x, the same requests four times denser so engines batch more), replays the trace with its
timestamps under the round-robin policy and reports simulated seconds per wall-clock second, iterations
per second and requests per second. The baseline, measured in the same run on the same requests: the
engine model alone (`SimEngine.step` over each engine's share of the requests, as the simulation assigned
them, with no gateway, reports or snapshots), so `overhead_x` = simulator wall time / engine-only wall
time is the cost of everything around the engine model. Results are printed and written as JSON (default
results/simulator_speed.json).

    .venv/bin/python benchmarks/simulator_speed.py [--engines 64,256] [--speedups 1,4] [--policy round_robin]
        [--num-requests N] [--data-dir DIR] [--output PATH]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine_agent.domain import BackendRequest, RequestId, SamplingSpec
from engine_agent.sim.engine import SimEngine
from loadgen.arrivals import ArrivalSpec, schedule
from loadgen.datasets import Request, load_dataset
from loadgen.paths import resolve_data_dir
from loadgen.simulate import EngineSpec, SimOptions, simulate
from switchyard.profiles import get_profile

REPO = Path(__file__).resolve().parents[1]
PROFILE = "h100-llama3-8b"


def engine_only_s(plan: Sequence[tuple[float, Request, str]], options: SimOptions) -> float:
    """Wall time of stepping each engine through its assigned requests, back to back, with nothing else."""
    by_engine: dict[str, list[tuple[float, Request]]] = defaultdict(list)
    for arrival_s, request, engine_id in plan:
        by_engine[engine_id].append((arrival_s, request))
    profile = get_profile(PROFILE)
    started = time.perf_counter()
    for engine_id, items in by_engine.items():
        engine = SimEngine(profile, seed=options.seed, engine_id=engine_id)
        now_s, i = items[0][0], 0
        while i < len(items) or engine.has_work():
            while i < len(items) and items[i][0] <= now_s:
                request = items[i][1]
                forced = request.output_tokens is not None and request.output_tokens > 0
                max_tokens = request.output_tokens if forced else options.max_output_tokens_default
                sampling = SamplingSpec(max_tokens=max_tokens or 1, ignore_eos=forced)
                ids = (0,) * request.prompt_tokens
                engine.add_request(BackendRequest(RequestId(request.request_id), ids, sampling), now_s)
                i += 1
            if not engine.has_work():
                now_s = items[i][0]
                continue
            now_s += engine.step(now_s).duration_s
    return time.perf_counter() - started


def measure(requests: list[Request], engines: int, speedup: float, options: SimOptions) -> dict[str, Any]:
    timed = schedule(requests, ArrivalSpec(timestamps=True, speedup=speedup))
    result = simulate(timed, [EngineSpec(PROFILE, engines)], options)
    iterations = sum(e["iterations"] for e in result.per_engine.values())
    plan = [(t, r, o.engine_id) for (t, r), o in zip(timed, result.outcomes, strict=True) if o.success
            and o.engine_id is not None]
    baseline_s = engine_only_s(plan, options)
    return {
        "engines": engines,
        "speedup": speedup,
        "requests": len(timed),
        "completed": sum(o.success for o in result.outcomes),
        "simulated_s": result.duration_s,
        "wall_s": result.wall_s,
        "simulated_s_per_wall_s": result.duration_s / result.wall_s,
        "iterations": iterations,
        "iterations_per_wall_s": iterations / result.wall_s,
        "requests_per_wall_s": len(timed) / result.wall_s,
        "engine_only_wall_s": baseline_s,
        "overhead_x": result.wall_s / baseline_s,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="64,256", help="comma-separated fleet sizes")
    ap.add_argument("--speedups", default="1,4", help="comma-separated trace speed-ups")
    ap.add_argument("--policy", default="round_robin")
    ap.add_argument("--num-requests", type=int, default=None, help="first N requests only (quick runs)")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--output", type=Path, default=REPO / "results" / "simulator_speed.json")
    args = ap.parse_args()
    requests = load_dataset("azure-conv", resolve_data_dir(args.data_dir), num_requests=args.num_requests)
    options = SimOptions(policy=args.policy)
    runs = []
    for engines in (int(x) for x in args.engines.split(",")):
        for speedup in (float(x) for x in args.speedups.split(",")):
            row = measure(requests, engines, speedup, options)
            print(f"{engines:4d} engines, {speedup:g}x: {row['simulated_s']:7.0f} simulated s in "
                  f"{row['wall_s']:5.1f} wall s = {row['simulated_s_per_wall_s']:6.1f} sim s / wall s, "
                  f"{row['iterations_per_wall_s']:8.0f} iterations/s, overhead {row['overhead_x']:.2f}x "
                  f"over the engine model alone ({row['engine_only_wall_s']:.1f} s)", flush=True)
            runs.append(row)
    result = {"trace": "azure-conv", "profile": PROFILE, "policy": args.policy, "runs": runs}
    print(json.dumps(result, indent=2))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
