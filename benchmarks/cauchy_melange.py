"""CAUCHY against Mélange (paper 004, §4.3's "+16.4-38.3 % tokens/$ vs Mélange") on real length distributions.

EVERY FIGURE HERE IS MODELLED: goodput at the SLO comes from the cost model's roofline
(`gateway.planning.combos.modelled_goodput`: no queueing, no KV hand-off time), the same model for every arm;
nothing is served. The allocations are solved by CBC.

Mélange (Griggs et al., 2024; AIBrix's GPU optimizer) profiles each GPU type's throughput per request-size
bucket and solves an ILP: integer instances per GPU type, each bucket's rate split over the types (fractional
slices), an instance's load Σ_b λ_b x_bg / T_bg <= its count, minimum $/h. It serves every phase on one pool
(aggregated only) and plans statically. Built here from its paper's formulation (Mélange's code is not read
or copied), over our aggregated pools (1 or 2 GPUs of one type) as its instance types and our length buckets
(`gateway.planning.combos.length_mix`: base-2 on prompt and output tokens).

Arms, per workload, on the same buckets and SLO, inventory 8 x H800, 8 x A800, 8 x H20, Llama-3-8B:
- `melange`: the ILP above;
- `cauchy-mix`: CO-LP (`switchyard plan`'s Eq. 16, through the shipped planner) over every combo, aggregated
  and P:D, each combo's goodput over the buckets (`mix_goodput`);
- `cauchy-mix-mc`: the same candidates under MC-LP (minimum $/h, Mélange's own objective): what CAUCHY's
  combos (disaggregated ones included) buy against Mélange's bucket splitting over pools;
- `cauchy-means`: CO-LP on the workload's mean lengths (the paper's way), and the goodput its fleet really
  has on the buckets (under the demand: the plan would miss the SLO).
Tokens/$ at the demand: D x (mean in + mean out) x 3600 / ($/h), the same tokens for every arm, so it ranks
plans by cost.

Workloads (lengths from `../shared/data`, see its SOURCES.md): ShareGPT (Sarathi's 30,731 ShareGPT lengths,
the paper's SLO TTFT 5 s / TPOT 30 ms, its 50 req/s), Azure conv and Azure code (1 h each, TTFT 5 s / TPOT 50
ms, 20 req/s), arXiv summarization (28,257 lengths, TTFT 10 s / TPOT 50 ms, 20 req/s: DailyMail's SLO, a
summarization shape). Only ShareGPT is one of the paper's three workloads; the others stand in for the
paper's DailyMail and LongWriter, whose length distributions are not in the data.

    .venv/bin/python benchmarks/cauchy_melange.py [--data-dir DIR] [--output results/cauchy_melange.json]
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import pulp  # noqa: E402

from benchmarks.json_out import write_json  # noqa: E402
from gateway.planning.combos import (  # noqa: E402
    Candidate,
    LengthMix,
    Slo,
    candidates,
    length_mix,
    mix_goodput,
)
from gateway.planning.cost_model import Side, Workload  # noqa: E402
from gateway.planning.ilp import AllocationProblem, Objective, PulpCbcSolver  # noqa: E402
from loadgen.datasets.registry import load_dataset  # noqa: E402
from loadgen.paths import resolve_data_dir  # noqa: E402
from switchyard.hardware import GPUS, MODELS  # noqa: E402

NOTE = ("modelled: every arm's goodput is the cost model's roofline over the same length buckets (no "
        "queueing, no KV hand-off time); Mélange is rebuilt from its paper's ILP; nothing is served")
MODEL = "llama3-8b"
INVENTORY = {"h800": 8, "a800": 8, "h20": 8}
WORKLOADS = {  # name: (loadgen dataset, demand req/s, TTFT s, TPOT s)
    "sharegpt": ("sarathi-sharegpt", 50.0, 5.0, 0.030),
    "azure-conv": ("azure-conv", 20.0, 5.0, 0.050),
    "azure-code": ("azure-code", 20.0, 5.0, 0.050),
    "arxiv": ("arxiv", 20.0, 10.0, 0.050),
}
POOL_SIZES = (1, 2)


def melange(mix: LengthMix, demand: float, slo: Slo, inventory: Mapping[str, int]) -> dict[str, Any]:
    """Mélange's ILP over aggregated pools: min $/h s.t. every bucket's rate is placed and no pool type is
    loaded beyond its instance count."""
    shape = MODELS[MODEL]
    pools = [(g, n) for g in sorted(inventory) for n in POOL_SIZES]
    rate = {(b, p): 0.0 for b in range(len(mix)) for p in range(len(pools))}  # T_bp, req/s of one instance
    for p, (g, n) in enumerate(pools):
        side = Side(GPUS[g], n)
        for b, (_, bucket) in enumerate(mix):
            rate[b, p] = mix_goodput(shape, ((1.0, bucket),), slo, side, None)
    prob = pulp.LpProblem("melange", pulp.LpMinimize)
    count = {p: pulp.LpVariable(f"n{p}", lowBound=0, cat="Integer") for p in range(len(pools))}
    split = {(b, p): pulp.LpVariable(f"x{b}_{p}", lowBound=0, upBound=1)
             for (b, p), t in rate.items() if t > 0}
    prob += pulp.lpSum(count[p] * GPUS[g].hourly_price_usd * n for p, (g, n) in enumerate(pools))
    for b, (share, _) in enumerate(mix):
        if share > 0:
            prob += pulp.lpSum(split[b, p] for p in range(len(pools)) if (b, p) in split) == 1
    for p in range(len(pools)):
        prob += pulp.lpSum(demand * mix[b][0] * split[b, p] / rate[b, p]
                           for b in range(len(mix)) if (b, p) in split) <= count[p]
    for g, have in inventory.items():
        prob += pulp.lpSum(count[p] * n for p, (g2, n) in enumerate(pools) if g2 == g) <= have
    status = prob.solve(pulp.PULP_CBC_CMD(msg=False))
    if pulp.LpStatus[status] != "Optimal":
        return {"status": pulp.LpStatus[status].lower()}
    counts = {f"{n}x{g}": int(round(count[p].value())) for p, (g, n) in enumerate(pools)
              if round(count[p].value()) > 0}
    usd = sum(int(round(count[p].value())) * GPUS[g].hourly_price_usd * n for p, (g, n) in enumerate(pools))
    return {"status": "optimal", "combos": counts, "usd_per_hour": usd}


def cauchy(cands: list[Candidate], demand: float, objective: Objective = "co") -> dict[str, Any]:
    problem = AllocationProblem(tuple(cands), INVENTORY, objective, demand_rps=demand)
    allocation = PulpCbcSolver().solve(problem)
    if allocation.status != "optimal":
        return {"status": allocation.status}
    by_id = {c.combo.id: c for c in cands}
    return {"status": "optimal", "combos": dict(allocation.counts),
            "usd_per_hour": sum(by_id[k].usd_per_hour * n for k, n in allocation.counts.items()),
            "goodput_rps": sum(by_id[k].goodput_rps * n for k, n in allocation.counts.items())}


def run(data_dir: Path | None) -> dict[str, Any]:
    shape = MODELS[MODEL]
    gpus = {g: GPUS[g] for g in INVENTORY}
    out: dict[str, Any] = {}
    for name, (dataset, demand, ttft_s, tpot_s) in WORKLOADS.items():
        requests = load_dataset(dataset, data_dir, seed=0)
        lengths = [(float(r.prompt_tokens), float(r.output_tokens or 1)) for r in requests]
        mix = length_mix(lengths)
        means = Workload(sum(a for a, _ in lengths) / len(lengths), sum(b for _, b in lengths) / len(lengths))
        slo = Slo(ttft_s, tpot_s)
        tokens = means.input_tokens + means.output_tokens
        on_mix = candidates(shape, means, slo, gpus, mix=mix)
        arms = {
            "melange": melange(mix, demand, slo, INVENTORY),
            "cauchy-mix": cauchy(on_mix, demand),
            "cauchy-mix-mc": cauchy(on_mix, demand, "mc"),
        }
        on_means = candidates(shape, means, slo, gpus)
        plan = cauchy(on_means, demand)
        if plan["status"] == "optimal":  # what the means-sized fleet really carries on the buckets
            by_id = {c.combo.id: c for c in on_means}
            plan["goodput_on_mix_rps"] = sum(
                n * mix_goodput(shape, mix, slo, by_id[k].cost.decode, by_id[k].cost.prefill)
                for k, n in plan["combos"].items())
            plan["meets_demand_on_mix"] = plan["goodput_on_mix_rps"] >= demand
        arms["cauchy-means"] = plan
        for arm in arms.values():
            if arm["status"] == "optimal":
                arm["tokens_per_usd_at_demand"] = demand * tokens * 3600.0 / arm["usd_per_hour"]
        gains: dict[str, float | None] = {}
        for arm in ("cauchy-mix", "cauchy-mix-mc", "cauchy-means"):
            ok = arms["melange"]["status"] == arms[arm]["status"] == "optimal"
            gains[arm] = (arms[arm]["tokens_per_usd_at_demand"]
                          / arms["melange"]["tokens_per_usd_at_demand"] - 1 if ok else None)
        out[name] = {"dataset": dataset, "requests": len(lengths), "demand_rps": demand,
                     "slo_ms": {"ttft": ttft_s * 1e3, "tpot": tpot_s * 1e3},
                     "mean_lengths": {"in": means.input_tokens, "out": means.output_tokens},
                     "buckets": len(mix), "arms": arms, "tokens_per_usd_vs_melange": gains}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", help="dataset root (default: SWITCHYARD_DATA_DIR, else ../shared/data)")
    ap.add_argument("--output", type=Path, default=REPO / "results" / "cauchy_melange.json")
    args = ap.parse_args()
    results = run(resolve_data_dir(args.data_dir))
    for name, row in results.items():
        print(f"\n== {name}: {row['requests']} requests, {row['buckets']} buckets, "
              f"{row['demand_rps']:g} req/s, "
              f"means {row['mean_lengths']['in']:.0f}/{row['mean_lengths']['out']:.0f}")
        for arm, p in row["arms"].items():
            if p["status"] != "optimal":
                print(f"  {arm:<14} {p['status']}")
                continue
            extra = ""
            if "goodput_on_mix_rps" in p:
                extra = f"  (carries {p['goodput_on_mix_rps']:.1f} req/s of the mix)"
            print(f"  {arm:<14} ${p['usd_per_hour']:>6.2f}/h  "
                  f"{p['tokens_per_usd_at_demand'] / 1e6:>7.2f} M tok/$  {p['combos']}{extra}")
        print("  tokens/$ vs Mélange: " + ", ".join(
            f"{arm} {g:+.1%}" if g is not None and math.isfinite(g) else f"{arm} -"
            for arm, g in row["tokens_per_usd_vs_melange"].items()))
    write_json(args.output, {"note": NOTE, "model": MODEL, "inventory": INVENTORY, "workloads": results})
    print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
