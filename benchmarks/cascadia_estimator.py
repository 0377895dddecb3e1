"""Cascadia's planner, measured: the analytic Sim(w, f) against the discrete-event simulator, and solver time.

(a) Table 1 (App. B): Llama3-70B on H100, every request 1600 prompt / 16 output tokens, (DP, TP, PP) in
(1,4,1), (1,2,2), (1,1,4), (2,1,2), (2,2,1), (2,4,1), (2,2,2). The baseline is the DES: `SimEngine` replicas
(the simulated GPU, stepped in virtual time, the same engine model the planner reads) fed round robin from a
backlog large enough to keep every replica saturated; its throughput is the completions per second from the
10th percentile completion to the end of the last step that still admits a prompt (the saturated span; the
decode-only drain after it is left out). The estimate is the planner's capacity of one replica
times DP (`StageLatencyModel.capacity_rps`). Both run at gpu_memory_utilization 0.95: at vLLM's default 0.9,
(2,1,2) -- 70B on two 80 GB GPUs -- leaves no KV room in our memory model. The paper's "real" column (vLLM on
H100s, their own setup) is printed alongside for reference, not compared: our figures are the roofline's.
(b) Solver time of `plan_cascade` (MILP on CBC) at 16, 32 and 80 H100s: llama3-8b -> llama3-70b on
mt-bench-hard at a rate scaled with the GPUs, q_min 85 (wall clock of the whole Algorithm 1, tables included),
and the three-model cascade at 32.

    .venv/bin/python benchmarks/cascadia_estimator.py [--requests 400] [--output PATH]

(default PATH: results/cascadia_estimator.json)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from engine_agent.domain import BackendRequest, RequestId, SamplingSpec
from engine_agent.sim.engine import SimEngine
from gateway.cascade.plan import PlanRequest, plan_cascade
from gateway.cascade.plan.stage_latency import ReplicaShape, StageLatencyModel, StageWorkload
from gateway.cascade.quality import mt_bench_profile
from switchyard.hardware import GPUS, MODELS
from switchyard.profiles import build_profile

CONFIGS = ((1, 4, 1), (1, 2, 2), (1, 1, 4), (2, 1, 2), (2, 2, 1), (2, 4, 1), (2, 2, 2))
PAPER_REAL_RPS = (0.21, 0.26, 0.27, 0.33, 0.40, 0.41, 0.55)
PAPER_ESTIMATED_RPS = (0.219, 0.280, 0.287, 0.347, 0.408, 0.437, 0.559)
PROMPT, OUTPUT = 1600, 16
UTILISATION = 0.95


def des_throughput(dp: int, tp: int, pp: int, requests: int) -> float:
    """Saturated throughput of dp SimEngine replicas, requests dealt round robin at t = 0."""
    profile = build_profile(GPUS["h100"], MODELS["llama3-70b"], tp, pp, min_full_contexts=1,
                            gpu_memory_utilization=UTILISATION)
    assert profile is not None, (dp, tp, pp)
    engines = [SimEngine(profile, engine_id=f"r{i}", seed=i) for i in range(dp)]
    for n in range(requests * dp):
        request = BackendRequest(RequestId(f"q{n}"), tuple(range(1, PROMPT + 1)),
                                 SamplingSpec(max_tokens=OUTPUT, ignore_eos=True))
        engines[n % dp].add_request(request, 0.0)
    finish_times: list[float] = []
    clocks = [0.0] * dp
    saturated_until = []
    for i, engine in enumerate(engines):
        last_prefill = 0.0
        while engine.has_work():
            result = engine.step(clocks[i])
            clocks[i] += result.duration_s
            finish_times.extend(clocks[i] for _ in result.finished)
            if result.record.num_prefill_seqs:
                last_prefill = clocks[i]
        saturated_until.append(last_prefill)
    finish_times.sort()
    lo, hi = finish_times[len(finish_times) // 10], min(saturated_until)
    done = sum(1 for t in finish_times if lo < t <= hi)
    return done / (hi - lo)


def estimator_rows(requests: int) -> list[dict[str, Any]]:
    est = StageLatencyModel(GPUS["h100"], gpu_memory_utilization=UTILISATION)
    workload = StageWorkload(1.0, (PROMPT,), (OUTPUT,))
    rows = []
    for (dp, tp, pp), real, paper_est in zip(CONFIGS, PAPER_REAL_RPS, PAPER_ESTIMATED_RPS, strict=True):
        estimated = dp * est.capacity_rps("llama3-70b", ReplicaShape(tp, pp), workload)
        measured = des_throughput(dp, tp, pp, requests)
        rows.append({"config": [dp, tp, pp], "des_rps": measured, "estimated_rps": estimated,
                     "abs_pct_error": abs(estimated - measured) / measured * 100.0,
                     "paper_real_rps": real, "paper_estimated_rps": paper_est})
    return rows


def solver_rows() -> list[dict[str, Any]]:
    hard = mt_bench_profile().subset("mt-bench-hard")
    cases = [(("llama3-8b", "llama3-70b"), 16, 5.0), (("llama3-8b", "llama3-70b"), 32, 10.0),
             (("llama3-8b", "llama3-70b"), 80, 25.0), (("llama3-8b", "qwen2.5-14b", "llama3-70b"), 32, 10.0)]
    rows = []
    for models, gpus, rate in cases:
        started = time.perf_counter()
        plan = plan_cascade(PlanRequest(models, "h100", gpus, rate, q_min=85.0), hard)
        rows.append({"models": list(models), "gpus": gpus, "rate_rps": rate,
                     "solver_s": time.perf_counter() - started, "iterations": plan.iterations,
                     "evaluations": plan.evaluations, "milp_solves": plan.milp_solves,
                     "thresholds": list(plan.thresholds), "allocation": list(plan.gpus), "L": plan.latency_s,
                     "Q": plan.quality})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--requests", type=int, default=400, help="backlog per replica for the DES")
    parser.add_argument("--output", type=Path, default=Path("results/cascadia_estimator.json"))
    args = parser.parse_args()
    estimator = estimator_rows(args.requests)
    print("config (dp,tp,pp)   DES req/s   estimated   abs % error   (paper: real / estimated)")
    for row in estimator:
        print(f"{str(tuple(row['config'])):18} {row['des_rps']:10.3f} {row['estimated_rps']:11.3f} "
              f"{row['abs_pct_error']:12.2f}   ({row['paper_real_rps']} / {row['paper_estimated_rps']})")
    mean_error = sum(r["abs_pct_error"] for r in estimator) / len(estimator)
    print(f"mean abs % error {mean_error:.2f}")
    solver = solver_rows()
    for row in solver:
        print(f"{'->'.join(row['models'])} on {row['gpus']} H100 at {row['rate_rps']} req/s: "
              f"{row['solver_s']:.3f} s ({row['iterations']} iterations, {row['milp_solves']} MILP solves), "
              f"thresholds {row['thresholds']}, GPUs {row['allocation']}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"estimator": estimator, "mean_abs_pct_error": mean_error,
                                       "solver": solver}, indent=2) + "\n")
    print(f"-> {args.output}")


if __name__ == "__main__":
    main()
