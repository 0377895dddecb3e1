"""Queued requests past their TTFT deadline: the admission gate with expiry (`AdmissionParams.shed_expired`,
the default) against the same gate without it, in the same invocation, on the simulator (simulated GPUs).

One simulated engine (`--engine`, default one A100 serving Llama-3-8B, 256 sequence slots) takes Poisson
arrivals of fixed-shape requests (`--prompt-tokens`, `--output-tokens`) for `--duration-s` at each of
`--loads` times its capacity; capacity is measured first, as the finish rate of `--capacity-requests` sent at
once (4x the slots by default). Each request carries a TTFT SLO (`--slo-ttft-s`). Per load and arm it reports,
over all arrivals (a shed request is a miss, so shedding is never a free win): requests that met the SLO (TTFT
within it), served requests, TTFT p50/p99 of served ones, and the gate's queued/shed counts by reason; and the
ratio of requests within SLO, expiry over no expiry. Results are printed and written as JSON (default
results/admission_expiry.json).

    .venv/bin/python benchmarks/admission_expiry.py [--loads 1.5,2,4] [--duration-s 60] [--output PATH]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np

from gateway.admission.core import AdmissionParams
from loadgen.datasets import Request
from loadgen.simulate import EngineSpec, SimOptions, simulate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from json_out import write_json  # noqa: E402


def requests(n: int, prompt: int, output: int, start: int = 0) -> list[Request]:
    return [Request(request_id=f"r{start + i}", prompt_tokens=prompt, output_tokens=output) for i in range(n)]


def capacity_rps(engine: str, prompt: int, output: int, n: int) -> float:
    """Finish rate of `n` requests sent at once (the gate queues what the slots cannot hold)."""
    result = simulate([(0.0, r) for r in requests(n, prompt, output)], [EngineSpec(engine, 1)],
                      SimOptions(admission=AdmissionParams(max_queue=n)))
    end_s = max(o.arrival_s + (o.e2e_s or 0.0) for o in result.outcomes if o.success)
    return n / end_s


def run_arm(schedule: list[tuple[float, Request]], engine: str, slo_s: float, expire: bool) -> dict[str, Any]:
    result = simulate(schedule, [EngineSpec(engine, 1)],
                      SimOptions(admission=AdmissionParams(shed_expired=expire), slo_ttft_s=slo_s))
    served = [o for o in result.outcomes if o.success]
    ttft = np.array([o.ttft_s for o in served]) if served else np.array([np.nan])
    met = sum(1 for o in served if (o.ttft_s or np.inf) <= slo_s)
    return {
        "arrivals": len(result.outcomes),
        "met_slo": met,
        "attainment": met / len(result.outcomes),
        "served": len(served),
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "gate": result.per_decider[0].get("admission", {}),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="a100-llama3-8b")
    ap.add_argument("--capacity-requests", type=int, default=1024, help="the burst that measures capacity")
    ap.add_argument("--prompt-tokens", type=int, default=500)
    ap.add_argument("--output-tokens", type=int, default=400)
    ap.add_argument("--slo-ttft-s", type=float, default=1.0)
    ap.add_argument("--loads", default="1.5,2,4", help="offered load as multiples of the measured capacity")
    ap.add_argument("--duration-s", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--output", default="results/admission_expiry.json")
    args = ap.parse_args(argv)
    cap = capacity_rps(args.engine, args.prompt_tokens, args.output_tokens, args.capacity_requests)
    print(f"capacity: {cap:.2f} req/s ({args.engine}, {args.prompt_tokens}/{args.output_tokens} tokens)")
    points = []
    for load in (float(x) for x in args.loads.split(",")):
        rng = random.Random(args.seed)
        rate = load * cap
        n = max(1, round(rate * args.duration_s))
        t, schedule = 0.0, []
        for r in requests(n, args.prompt_tokens, args.output_tokens):
            t += rng.expovariate(rate)
            schedule.append((t, r))
        arms = {name: run_arm(schedule, args.engine, args.slo_ttft_s, expire)
                for name, expire in (("expiry", True), ("no_expiry", False))}
        ratio = arms["expiry"]["met_slo"] / max(1, arms["no_expiry"]["met_slo"])
        points.append({"load": load, "rate_rps": rate, **arms, "met_slo_ratio": ratio})
        for name, arm in arms.items():
            print(f"load {load:g}x ({rate:.2f} req/s) {name:9s}: met SLO {arm['met_slo']}/{arm['arrivals']} "
                  f"served {arm['served']} TTFT p50 {arm['ttft_p50_s']:.2f} s p99 {arm['ttft_p99_s']:.2f} s "
                  f"gate {arm['gate']}")
        print(f"  within SLO, expiry / no expiry: {ratio:.2f}x")
    write_json(args.output, {
        "benchmark": "admission_expiry", "stand_in": "simulated GPU (loadgen simulate)",
        "engine": args.engine, "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
        "slo_ttft_s": args.slo_ttft_s, "duration_s": args.duration_s, "seed": args.seed,
        "capacity_rps": cap, "points": points,
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
