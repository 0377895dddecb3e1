"""CAUCHY §4.3 with the planner alone: the three LP objectives against homogeneous and aggregated-only fleets.

EVERY FIGURE HERE IS MODELLED: each combo's goodput at the SLO is the cost model's roofline upper bound
(`gateway.planning.combos.modelled_goodput`: no queueing, no KV handoff), not a measurement; the allocation is
the shipped planner (`gateway.planning`, PuLP + CBC). Nothing is served.

Setup (§4.1, §3.3.3): Llama-3.1-8B (Llama-3-8B's shape), 8 x H800, 8 x A800, 8 x H20 at Table 1's prices;
the paper's three workloads by their means and target QPS (§4.1) and SLOs (§3.3.3, in the same order):
DailyMail 702 in / 42 out at 54 req/s (TTFT 10 s, TBT 50 ms), ShareGPT 290 / 207 at 50 req/s (5 s, 30 ms),
LongWriter 337 / 1330 at 6 req/s (1 s, 30 ms).

Per workload:
- CO-LP, MCE-LP and MC-LP (`--objective co|mce|mc`) over all candidates;
- the best homogeneous fleet: CO-LP with one GPU type at a time (its aggregated pools and same-type P:D
  combos), the cheapest of the three;
- an aggregated-only heterogeneous fleet (Mélange's setting: no disaggregation), by MC-LP over the pools.
Two cost efficiencies per plan: at the demand, D x (R_in + R_out) x 3600 / ($/h) (the tokens a fleet serving
exactly the target rate processes per dollar: it ranks plans by cost alone), and at capacity, the plan's
goodput instead of D. Solver time: the median of `--solves` solves of CO-LP.

    .venv/bin/python benchmarks/cauchy_repro.py [--solves 20] [--output results/cauchy_repro.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gateway.planning.combos import Candidate, Slo, candidates  # noqa: E402
from gateway.planning.cost_model import Workload  # noqa: E402
from gateway.planning.ilp import AllocationProblem, Objective, PulpCbcSolver, summarize  # noqa: E402
from switchyard.hardware import GPUS, MODELS  # noqa: E402

NOTE = ("modelled: combo goodput is the cost model's roofline upper bound (no queueing, no KV handoff); the "
        "allocation is gateway.planning's ILP; nothing is served")
MODEL = "llama3-8b"
INVENTORY = {"h800": 8, "a800": 8, "h20": 8}
WORKLOADS = {  # name: (R_in, R_out, demand req/s, TTFT s, TPOT s)
    "dailymail": (702, 42, 54.0, 10.0, 0.050),
    "sharegpt": (290, 207, 50.0, 5.0, 0.030),
    "longwriter": (337, 1330, 6.0, 1.0, 0.030),
}


def plan(cands: list[Candidate], inventory: dict[str, int], objective: Objective, demand: float,
         tokens: float) -> dict[str, Any]:
    problem = AllocationProblem(tuple(cands), inventory, objective, demand_rps=demand)
    allocation = PulpCbcSolver().solve(problem)
    if allocation.status != "optimal":
        return {"status": allocation.status}
    s = summarize(allocation, cands, tokens)
    return {
        "status": "optimal", "combos": dict(allocation.counts), "usd_per_hour": s.total_usd_per_h,
        "goodput_rps": s.goodput_rps, "gpus": dict(s.gpus),
        "tokens_per_usd_at_demand": demand * tokens * 3600.0 / s.total_usd_per_h,
        "tokens_per_usd_at_capacity": s.tokens_per_usd, "solver_ms": allocation.solver_ms,
    }


def run(solves: int) -> dict[str, Any]:
    shape = MODELS[MODEL]
    gpus = {g: GPUS[g] for g in INVENTORY}
    out: dict[str, Any] = {}
    for name, (r_in, r_out, demand, ttft_s, tpot_s) in WORKLOADS.items():
        workload, slo, tokens = Workload(r_in, r_out), Slo(ttft_s, tpot_s), float(r_in + r_out)
        cands = candidates(shape, workload, slo, gpus)
        lps = {o: plan(cands, INVENTORY, o, demand, tokens) for o in ("co", "mce", "mc")}
        row: dict[str, Any] = {"demand_rps": demand, "candidates": len(cands), "lp": lps}
        homogeneous = {}
        for g in INVENTORY:
            only = [c for c in cands if set(c.combo.gpus()) == {g}]
            homogeneous[g] = (plan(only, {g: INVENTORY[g]}, "co", demand, tokens) if only
                              else {"status": "none"})
        feasible = {g: p for g, p in homogeneous.items() if p["status"] == "optimal"}
        best = min(feasible, key=lambda g: feasible[g]["usd_per_hour"]) if feasible else None
        row["homogeneous"] = homogeneous
        row["best_homogeneous"] = best
        pools = [c for c in cands if c.combo.aggregated]
        row["aggregated_only"] = plan(pools, INVENTORY, "mc", demand, tokens)
        times = [PulpCbcSolver().solve(AllocationProblem(tuple(cands), INVENTORY, "co", demand_rps=demand))
                 .solver_ms for _ in range(solves)]
        row["solver_ms"] = {"median": statistics.median(times), "max": max(times), "solves": solves}
        co = row["lp"]["co"]

        def ratio(other: dict[str, Any] | None, key: str, co: dict[str, Any] = co) -> float | None:
            if other is None or other.get("status") != "optimal" or co.get("status") != "optimal":
                return None
            return float(co[key] / other[key] - 1.0)

        row["co_gain"] = {
            key: {"vs_mce": ratio(row["lp"]["mce"], key), "vs_mc": ratio(row["lp"]["mc"], key),
                  "vs_best_homogeneous": ratio(homogeneous.get(best) if best else None, key),
                  "vs_aggregated_only": ratio(row["aggregated_only"], key)}
            for key in ("tokens_per_usd_at_demand", "tokens_per_usd_at_capacity")
        }
        out[name] = row
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--solves", type=int, default=20)
    ap.add_argument("--output", type=Path, default=REPO / "results" / "cauchy_repro.json")
    args = ap.parse_args()
    results = run(args.solves)
    for name, row in results.items():
        print(f"\n== {name}: {row['demand_rps']:g} req/s, {row['candidates']} candidates (modelled goodput)")
        print(f"{'plan':<22}{'$/h':>8}{'goodput':>9}{'tok/$ @D':>10}{'tok/$ @cap':>12}  combos")
        plans = {**{f"{o}-lp": p for o, p in row["lp"].items()},
                 **{f"homogeneous {g}": p for g, p in row["homogeneous"].items()},
                 "aggregated-only (mc)": row["aggregated_only"]}
        for label, p in plans.items():
            if p.get("status") != "optimal":
                print(f"{label:<22}  {p.get('status')}")
                continue
            print(f"{label:<22}{p['usd_per_hour']:>8.2f}{p['goodput_rps']:>9.1f}"
                  f"{p['tokens_per_usd_at_demand'] / 1e6:>9.1f}M"
                  f"{p['tokens_per_usd_at_capacity'] / 1e6:>11.1f}M"
                  f"  {p['combos']}")
        gains = row["co_gain"]["tokens_per_usd_at_demand"]
        print("CO-LP tokens/$ at demand: " + ", ".join(
            f"{k} {v:+.1%}" if v is not None else f"{k} -" for k, v in gains.items()))
        print(f"solver: median {row['solver_ms']['median']:.1f} ms, max {row['solver_ms']['max']:.1f} ms "
              f"over {row['solver_ms']['solves']} solves")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"note": NOTE, "model": MODEL, "inventory": INVENTORY,
                                       "workloads": results}, indent=2) + "\n")
    print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
