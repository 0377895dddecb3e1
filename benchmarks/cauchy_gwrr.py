"""CAUCHY §4.4 in the simulator: goodput-weighted round robin across heterogeneous combos vs basic and
token-weighted round robin (issue 14), on the simulated GPU.

Fleet: `--combos` (default 2 x 1xh800, 2 x 1xa800, 2 x 1xh20: aggregated combos, llama3-8b), built through the
simulator's plan path (`Scaling`, labels `C#k`). Each GPU type's capacity is measured first, in the same
invocation: one engine alone, every request of the dataset at t = 0, completed requests per second (a
stand-in for `switchyard profile-combos`, which is not built). The arms replay one Poisson schedule at
`--load` x the summed capacity:
  - rr: goodput_rr weights=equal (basic round robin over combos), the baseline;
  - tokens: weights=tokens (the combo with the most free KV tokens, §4.4's Token-Weighted RR);
  - gwrr-catalogue: weights=plan without figures (the catalogue's GPU weights);
  - gwrr-measured: weights=plan with the measured capacities as goodput (§3.4.1);
  - least_loaded, for reference.
Every arm uses intra=opportunistic. Output: mean and P90 E2E, mean TTFT, and each arm's ratio to rr, as JSON.

    .venv/bin/python benchmarks/cauchy_gwrr.py [--dataset azure-conv] [--num-requests 1500] [--load 0.85] \
        [--seed 1] [--output results/cauchy_gwrr.json]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from json_out import write_json

from gateway.planning.combos import Slo
from gateway.planning.cost_model import Workload
from gateway.planning.plan_file import Plan
from loadgen.arrivals import ArrivalSpec, schedule
from loadgen.datasets.registry import load_dataset
from loadgen.paths import resolve_data_dir
from loadgen.simulate import EngineSpec, Scaling, SimOptions, simulate
from switchyard.hardware import MODELS


def capacity_rps(profile: str, requests: list[Any], seed: int) -> float:
    result = simulate([(0.0, r) for r in requests], [EngineSpec(profile, 1)], SimOptions(seed=seed))
    return sum(1 for o in result.outcomes if o.success) / result.duration_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="azure-conv")
    parser.add_argument("--data-dir")
    parser.add_argument("--num-requests", type=int, default=1500)
    parser.add_argument("--combos", default="1xh800:2,1xa800:2,1xh20:2")
    parser.add_argument("--load", type=float, default=0.85, help="Poisson rate / summed measured capacity")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--output", default="results/cauchy_gwrr.json")
    args = parser.parse_args()
    model = MODELS["llama3-8b"]
    requests = load_dataset(args.dataset, resolve_data_dir(args.data_dir), num_requests=args.num_requests,
                            seed=args.seed)
    combos = {c: int(n) for c, _, n in (item.partition(":") for item in args.combos.split(","))}
    capacity = {c: capacity_rps(f"{c.partition('x')[2]}-{model.name}", requests[:300], args.seed)
                for c in combos}
    total = sum(capacity[c] * n for c, n in combos.items())
    rate = args.load * total
    plan = Plan(model=model, workload=Workload(1.0, 1.0), slo=Slo(1.0, 1.0), objective="co",
                inventory={c.partition("x")[2]: n for c, n in combos.items()}, prices={}, combos=combos,
                goodput_rps=capacity)
    runs = schedule(requests, ArrivalSpec(rate_per_s=rate, seed=args.seed))
    arms: dict[str, tuple[str, dict[str, Any]]] = {
        "rr": ("goodput_rr", {"weights": "equal"}),
        "tokens": ("goodput_rr", {"weights": "tokens"}),
        "gwrr-catalogue": ("goodput_rr", {"weights": "plan"}),
        "gwrr-measured": ("goodput_rr", {"weights": "plan", "goodput": capacity}),
        "least_loaded": ("least_loaded", {}),
    }
    rows: dict[str, dict[str, Any]] = {}
    for arm, (policy, params) in arms.items():
        result = simulate(runs, [], SimOptions(policy=policy, policy_params=params, seed=args.seed),
                          scaling=Scaling(plan))
        ok = [o for o in result.outcomes if o.success]
        e2e = sorted(o.e2e_s for o in ok)
        rows[arm] = {"completed": len(ok), "mean_e2e_s": statistics.fmean(e2e),
                     "p90_e2e_s": e2e[int(0.9 * (len(e2e) - 1))],
                     "mean_ttft_s": statistics.fmean(o.ttft_s for o in ok if o.ttft_s is not None),
                     "share": {c: sum(v["requests"] for v in result.per_engine.values()
                                      if v.get("combo", "").startswith(c + "#")) / len(ok) for c in combos},
                     "cost_usd": result.cost_usd, "tokens_per_usd": result.tokens_per_usd}
    base = rows["rr"]["mean_e2e_s"]
    for arm, row in rows.items():
        row["mean_e2e_vs_rr"] = row["mean_e2e_s"] / base - 1.0
        shares = ", ".join(f"{c} {s:.0%}" for c, s in row["share"].items())
        print(f"{arm:<15} mean E2E {row['mean_e2e_s']:7.2f} s ({row['mean_e2e_vs_rr']:+.1%} vs rr)  "
              f"P90 {row['p90_e2e_s']:7.2f} s  TTFT {row['mean_ttft_s']:6.2f} s  [{shares}]")
    out = {"benchmark": "cauchy_gwrr", "dataset": args.dataset, "num_requests": len(requests),
           "combos": combos, "capacity_rps": capacity, "rate_rps": rate, "load": args.load, "seed": args.seed,
           "stand_in": "simulated GPU; capacity measured by saturating one engine, not profile-combos",
           "arms": rows}
    write_json(args.output, out)
    print(f"capacity (req/s): {capacity}; Poisson {rate:.2f} req/s; wrote {args.output}")


if __name__ == "__main__":
    main()
