"""CAUCHY §4.6 in the simulator: the combo autoscaler (Algorithm 1) against the same initial plan kept fixed,
over the Azure LLM inference conversation trace (issue 14).

Steps, in one invocation:
1. the trace's first `--duration` seconds (Azure conv: 37-507 req/min over its hour), replayed at its own
   timestamps with its own prompt and output lengths;
2. the initial plan: `switchyard plan` over `--gpus` with the measured `--goodput-table` (make it with
   `switchyard profile-combos`, the same SLO and workload), for the mean QPS of the first local window
   (120 s), objective co, as `plan --autoscale` sizes its start;
3. two simulations of that trace on the plan's combos, routed by goodput_rr with the table's goodput:
   "fixed" (the plan all along) and "autoscaled" (`loadgen simulate --plan --autoscale`: engines join after
   90 s of provisioning and leave by draining after a 30 s grace).
Reported per arm: mean and P90 E2E, SLO attainment, goodput, cost (USD) and tokens per USD, the actions; JSON.
Stand-ins: the simulated GPU, and goodput measured on it with data-parallel replicas (no prefill-decode
handoff: a P:D combo's engines all serve whole requests).

    .venv/bin/python -m launcher.cli profile-combos --model llama3-8b --workload azure-conv \
        --slo ttft=2000,tpot=100 --gpus h800,a800,h20 --json results/goodput_azure-conv.json
    .venv/bin/python benchmarks/cauchy_autoscale.py --goodput-table results/goodput_azure-conv.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from json_out import write_json

from gateway.planning.plan_file import parse_plan
from launcher.planning_cli import plan as plan_cli
from loadgen.arrivals import ArrivalSpec, schedule
from loadgen.datasets.registry import load_dataset
from loadgen.metrics import parse_slo, summarize
from loadgen.paths import resolve_data_dir
from loadgen.simulate import Scaling, SimOptions, simulate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--goodput-table", required=True, type=Path)
    parser.add_argument("--dataset", default="azure-conv")
    parser.add_argument("--data-dir")
    parser.add_argument("--duration", type=float, default=3600.0)
    parser.add_argument("--gpus", default="h800:8,a800:8,h20:8")
    parser.add_argument("--slo", default="ttft=2000,tpot=100")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="results/cauchy_autoscale.json")
    args = parser.parse_args()
    requests = load_dataset(args.dataset, resolve_data_dir(args.data_dir), duration_s=args.duration,
                            seed=args.seed)
    runs = schedule(requests, ArrivalSpec(timestamps=True, duration_s=args.duration, seed=args.seed))
    t0 = runs[0][0]
    demand = sum(1 for t, _ in runs if t - t0 < 120.0) / 120.0
    model = "llama3-8b"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.json"
        workload = f"in={_mean(r.prompt_tokens for _, r in runs):.0f},out=" \
                   f"{_mean(r.output_tokens or 0 for _, r in runs):.0f}"
        code = plan_cli(["--model", model, "--workload", workload, "--slo", args.slo, "--gpus", args.gpus,
                         "--goodput-rps", f"{demand:.3f}", "--goodput-table", str(args.goodput_table),
                         "--json", str(path)])
        if code != 0:
            raise SystemExit(code)
        plan = parse_plan(json.loads(path.read_text()))
    table = json.loads(args.goodput_table.read_text())
    slo = parse_slo(args.slo)
    options = SimOptions(policy="goodput_rr", policy_params={"goodput": table}, seed=args.seed,
                         slo_ttft_s=(slo.ttft_ms or 0) / 1e3, slo_tpot_s=(slo.tpot_ms or 0) / 1e3)
    arms: dict[str, dict[str, Any]] = {}
    for arm, autoscale in (("fixed", False), ("autoscaled", True)):
        result = simulate(runs, [], options, scaling=Scaling(plan, autoscale=autoscale))
        summary = summarize(result.outcomes, max(result.duration_s, 1e-9), slo).to_dict()
        arms[arm] = {"mean_e2e_s": summary["mean_e2el_ms"] / 1e3, "p90_e2e_s": summary["p90_e2el_ms"] / 1e3,
                     "slo_attainment": summary["slo_attainment"], "goodput_rps": summary["request_goodput"],
                     "completed": summary["completed"], "failed": summary["failed"],
                     "cost_usd": result.cost_usd, "tokens_per_usd": result.tokens_per_usd,
                     "actions": result.fleet_actions, "engines_ever": len(result.per_engine),
                     "sim_wall_s": result.wall_s}
        a = arms[arm]
        print(f"{arm:<11} mean E2E {a['mean_e2e_s']:6.2f} s  P90 {a['p90_e2e_s']:6.2f} s  SLO "
              f"{a['slo_attainment']:.1%}  cost ${a['cost_usd']:.2f}  "
              f"{a['tokens_per_usd'] / 1e6:.2f}M tok/$  "
              f"{len(a['actions'])} actions  ({a['sim_wall_s']:.0f} s wall)")
    out = {"benchmark": "cauchy_autoscale", "dataset": args.dataset, "duration_s": args.duration,
           "requests": len(runs), "initial_demand_rps": demand, "plan": dict(plan.combos),
           "goodput_table": str(args.goodput_table), "slo": args.slo, "gpus": args.gpus,
           "stand_in": "simulated GPU; goodput measured by profile-combos on it; no prefill-decode handoff",
           "arms": arms}
    write_json(args.output, out)
    print(f"initial plan {dict(plan.combos)} for {demand:.2f} req/s; wrote {args.output}")


def _mean(values: Any) -> float:
    items = list(values)
    return sum(items) / len(items)


if __name__ == "__main__":
    main()
