"""CascadeInfer's evaluation (paper 000, §6) reproduced in the cluster simulator (`loadgen simulate --policy
length_stages --reschedule length_stages`).

EVERY FIGURE HERE IS FROM THE SIMULATED GPU (engine_agent/sim: a roofline timing model of a 141 GB H20
serving Llama-3.2-3B), not from a real GPU; the policy, the rescheduler (stages, refinement, hand-over,
bid-ask), the mover and the splice are the gateway's own code run in virtual time (docs/cascadeinfer.md).

Setup (§6.1 as far as the simulator goes):
- 16 engines `h20e-llama3.2-3b` (the paper's 16 H20s; batch cap 1024, 8192 tokens per iteration).
- Workload: ShareGPT lengths (`sarathi-sharegpt`: the 30,731 conversations' prompt and output token counts),
  Poisson arrivals at each rate for `--window-s` seconds, then the fleet drains. Rates light to heavy.
- Systems: round robin, least loaded (tokens), a Llumnix stand-in (`layout=single`: one stage, the same
  bid-ask routing and intra-stage rebalancing on KV demand; Llumnix's own pairing is not reproduced), and
  CascadeInfer (`layout=dp`, `refine=qoe`, `balance=bidask`).
- CascadeInfer's first plan comes from `STAGES_HISTORY` requests of the dataset disjoint from the run's (the
  loadgen's rule), QoE D from §4.1's profile of this engine (`benchmarks/cascadeinfer_profile.py --profile
  h20e-llama3.2-3b`, `QOE_D`), re-planned every 60 s on the requests seen.
- SLO (§6.4): the mean TTFT and TPOT of requests served one at a time (`--base-requests` at a very low rate on
  one engine), scaled by 5 and 20; attainment = share of requests meeting both.
- Link: 400 Gbit/s per KV pull plus 2 ms: the paper's testbed's ConnectX-7 between nodes (§6.1). The
  simulator's migration is stop-and-copy (the request stalls for the whole pull); the paper pipelines it
  with decoding (Llumnix's live migration), so our hand-overs cost the request more than theirs.

Figures (JSON, `--output`):
1. Per rate and system: mean/P95 TTFT, mean/P95 TPOT, normalised latency (E2E / output tokens, mean),
   throughput (output tokens/s), SLO attainment at 5x and 20x, migrations per request, hand-over stall.
2. §6.5 ablations at `--ablation-rate`: layouts dp/chain/single (Fig. 14), refinement qoe/count/memory
   (Fig. 15), balancing bidask/handover/round_robin over a four-stage, four-engine-per-stage plan (Fig. 16:
   CV of output tokens per engine within each stage, averaged over stages).
3. The same main table with the simulator's heterogeneity term off (`heterogeneity_alpha` 0: the attention
   slowdown of mixed lengths, which came from the paper's Fig. 2): the gain must shrink.
4. `plan_ms` of the stage partition at 16/64/256 instances and 128K, heuristic and exact, and the gap.

    .venv/bin/python benchmarks/cascadeinfer_repro.py [--quick] [--jobs 2] [--rates 24,40,52]
        [--window-s 60] [--seed 1] [--output results/cascadeinfer_repro.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import statistics
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
NOTE = ("every figure is from the simulated GPU (engine_agent/sim, h20e-llama3.2-3b), not a real one; the "
        "policy, the rescheduler, the mover and the splice are the gateway's own code in virtual time")
PROFILE = "h20e-llama3.2-3b"
ENGINES = 16
DATASET = "sarathi-sharegpt"
# §4.1's profile of this engine (benchmarks/cascadeinfer_profile.py --profile h20e-llama3.2-3b, 2026-11-25:
# held-out error 14.0 % against 410 % for the static mean).
QOE_D = (0.00248, 9.434e-05, 2.339e-07, 0.0, 0.0)
STAGES_HISTORY = 2000
LINK_GBPS = 400.0
SYSTEMS: dict[str, tuple[str, dict[str, Any], dict[str, Any] | None]] = {
    # name: (policy, policy params, length_stages params or None: no rescheduling)
    "round_robin": ("round_robin", {}, None),
    "least_loaded": ("least_loaded", {}, None),
    "llumnix_standin": ("length_stages", {}, {"layout": "single", "balance": "bidask"}),
    "cascadeinfer": ("length_stages", {}, {"layout": "dp", "refine": "qoe", "balance": "bidask"}),
}
ABLATIONS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "layout_dp": ("length_stages", {}, {"layout": "dp"}),
    "layout_chain": ("length_stages", {}, {"layout": "chain"}),
    "layout_single": ("length_stages", {}, {"layout": "single"}),
    "refine_qoe": ("length_stages", {}, {"refine": "qoe"}),
    "refine_count": ("length_stages", {}, {"refine": "count"}),
    "refine_memory": ("length_stages", {}, {"refine": "memory"}),
    "balance_bidask": ("length_stages", {}, {"balance": "bidask", "fixed4x4": True}),
    "balance_handover": ("length_stages", {}, {"balance": "handover", "fixed4x4": True}),
    "balance_round_robin": ("length_stages", {"within": "round_robin"},
                            {"balance": "round_robin", "fixed4x4": True}),
}


@dataclasses.dataclass(frozen=True)
class Task:
    figure: str
    system: str
    rate: float
    requests: int
    seed: int
    heterogeneity: bool = True
    engines: int = ENGINES


_CACHE: dict[tuple[int, int], tuple[list[Any], list[tuple[int, int]]]] = {}


def _requests(count: int, seed: int) -> tuple[list[Any], list[tuple[int, int]]]:
    """The run's requests (the dataset shuffled with `seed`, the first `count`) and the next
    `STAGES_HISTORY`'s (I, O): the first plan's disjoint slice."""
    from loadgen.datasets import load_dataset  # noqa: PLC0415 (in the worker)
    from loadgen.paths import resolve_data_dir  # noqa: PLC0415

    key = (count, seed)
    if key not in _CACHE:
        base = load_dataset(DATASET, resolve_data_dir(None), seed=seed)
        history = [(r.prompt_tokens, r.output_tokens) for r in base[count:count + STAGES_HISTORY]
                   if r.output_tokens]
        _CACHE[key] = (base[:count], history)
    return _CACHE[key]


def _fixed_plan(history: list[tuple[int, int]]) -> Any:
    """Fig. 16's pipeline: the best four-stage chain's ranges, four engines each."""
    from gateway.planning.stages import StageProblem, TransferCost, chain  # noqa: PLC0415
    from gateway.rescheduling.length_stages import StagesPlanFile  # noqa: PLC0415
    from switchyard.profiles import get_profile  # noqa: PLC0415
    from switchyard.qoe import QoEModel  # noqa: PLC0415

    shape = get_profile(PROFILE).model
    problem = StageProblem(4, 8192, history, QoEModel(QOE_D), TransferCost.for_model(shape, LINK_GBPS / 8))
    plan = chain(problem)
    return StagesPlanFile.parse({"stages": [{"lo": s.lo, "hi": s.hi, "instances": 4} for s in plan.stages]})


def _set_heterogeneity(on: bool) -> None:
    """The simulated engine's mixed-length attention slowdown on (the profile's) or off (alpha 0), in this
    process: the registry entry of `PROFILE` is replaced."""
    from switchyard import profiles  # noqa: PLC0415

    original = profiles._registry()[PROFILE]  # noqa: SLF001 (benchmark-only override)
    profiles._PROFILES[PROFILE] = (original if on  # noqa: SLF001
                                   else dataclasses.replace(original, heterogeneity_alpha=0.0))


def run_point(task: Task) -> dict[str, Any]:
    from loadgen.arrivals import ArrivalSpec, schedule  # noqa: PLC0415
    from loadgen.simulate import EngineSpec, SimOptions, simulate  # noqa: PLC0415

    _set_heterogeneity(task.heterogeneity)
    requests, history = _requests(task.requests, task.seed)
    plan = schedule(requests, ArrivalSpec(rate_per_s=task.rate, seed=task.seed))
    policy, policy_params, stages = {**SYSTEMS, **ABLATIONS}[task.system]
    options: dict[str, Any] = {"policy": policy, "policy_params": policy_params, "seed": task.seed,
                               "balance_figures": True}
    if stages is not None:
        params = {k: v for k, v in stages.items() if k != "fixed4x4"}
        params.update({f"d{k}": v for k, v in enumerate(QOE_D)})
        options.update(reschedule="length_stages", reschedule_params=params, prediction_interval=5,
                       kv_link_gbps=LINK_GBPS)
        if stages.get("fixed4x4"):
            options["stages_plan"] = _fixed_plan(history)
        else:
            options["stages_history"] = tuple(history)
    started = time.perf_counter()
    result = simulate(plan, [EngineSpec(PROFILE, task.engines)], SimOptions(**options))
    wall_s = time.perf_counter() - started
    done = [o for o in result.outcomes if o.success]
    row: dict[str, Any] = {
        "figure": task.figure, "system": task.system, "rate": task.rate, "heterogeneity": task.heterogeneity,
        "engines": task.engines, "requests": len(plan), "completed": len(done),
        "failed": len(result.outcomes) - len(done), "duration_s": result.duration_s, "sim_wall_s": wall_s,
        "output_tok_per_s": sum(o.output_tokens for o in done) / max(result.duration_s, 1e-9),
        "ttft_s": [o.ttft_s for o in done], "tpot_s": [o.tpot_s for o in done],
        "e2e_per_token_s": [o.e2e_s / o.output_tokens for o in done if o.e2e_s and o.output_tokens],
    }
    per_decider = result.per_decider[0].get("reschedule", {}) if result.per_decider else {}
    balance = result.balance or {}
    row.update(migrations=balance.get("migrations", {}), reasons=per_decider.get("reasons", {}),
               splice_stall_ms=balance.get("splice_stall_ms"),
               layout=per_decider.get("layout", {}),
               output_tokens_per_engine={e: t["output_tokens"] for e, t in result.per_engine.items()})
    return row


def _percentile(values: list[float], p: float) -> float | None:
    clean = sorted(v for v in values if v is not None)
    if not clean:
        return None
    k = (len(clean) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(clean) - 1)
    return clean[lo] + (clean[hi] - clean[lo]) * (k - lo)


def summarize_row(row: dict[str, Any], base: tuple[float, float]) -> dict[str, Any]:
    """A run's figures: latencies, throughput, attainment at 5x/20x of `base` (TTFT s, TPOT s)."""
    ttft, tpot, norm = row["ttft_s"], [t for t in row["tpot_s"] if t is not None], row["e2e_per_token_s"]
    pairs = list(zip(row["ttft_s"], row["tpot_s"], strict=True))
    out = {k: v for k, v in row.items() if k not in ("ttft_s", "tpot_s", "e2e_per_token_s")}
    out.update(
        mean_ttft_ms=1e3 * statistics.fmean(ttft), p95_ttft_ms=1e3 * (_percentile(ttft, 95) or 0),
        mean_tpot_ms=1e3 * statistics.fmean(tpot) if tpot else None,
        p95_tpot_ms=1e3 * (_percentile(tpot, 95) or 0),
        mean_normalised_latency_ms=1e3 * statistics.fmean(norm) if norm else None,
    )
    for scale in (5, 20):
        ok = sum(1 for a, b in pairs if a <= scale * base[0] and (b is None or b <= scale * base[1]))
        out[f"slo_attainment_{scale}x"] = ok / max(row["requests"], 1)
    moved = sum((row.get("migrations") or {}).get(k, 0) for k in ("resumed", "fallback"))
    out["migrations_per_request"] = moved / max(row["requests"], 1)
    return out


def base_slo(seed: int, requests: int) -> tuple[float, float]:
    """§6.4's baseline: mean TTFT and TPOT of requests served one at a time on one engine."""
    row = run_point(Task("base", "round_robin", 0.02, requests, seed, engines=1))
    tpot = [t for t in row["tpot_s"] if t is not None]
    return statistics.fmean(row["ttft_s"]), statistics.fmean(tpot)


def stage_cv(row: dict[str, Any]) -> float | None:
    """Fig. 16: the coefficient of variation of output tokens over a stage's engines, averaged over stages
    with two engines or more (the last layout published)."""
    tokens = row["output_tokens_per_engine"]
    cvs = []
    for stages in row["layout"].values():
        for stage in stages:
            values = [tokens.get(e, 0) for e in stage["engines"]]
            if len(values) >= 2 and statistics.fmean(values) > 0:
                cvs.append(statistics.pstdev(values) / statistics.fmean(values))
    return statistics.fmean(cvs) if cvs else None


def plan_costs() -> list[dict[str, Any]]:
    """`plan_ms` of the partition at 128K (heuristic and exact) and the heuristic's gap, on the history."""
    from gateway.planning.stages import TransferCost, plan_stages  # noqa: PLC0415
    from switchyard.profiles import get_profile  # noqa: PLC0415
    from switchyard.qoe import QoEModel  # noqa: PLC0415

    _, history = _requests(2000, 1)
    transfer = TransferCost.for_model(get_profile(PROFILE).model, LINK_GBPS / 8)
    out = []
    for instances in (16, 64, 256):
        times = {}
        plans = {}
        for method in ("heuristic", "exact"):
            started = time.perf_counter()
            plans[method] = plan_stages(instances, 131072, history, QoEModel(QOE_D), transfer, method)  # type: ignore[arg-type]
            times[method] = 1e3 * (time.perf_counter() - started)
        out.append({"instances": instances, "max_len": 131072, "plan_ms": times["heuristic"],
                    "exact_ms": times["exact"], "quality": plans["heuristic"].quality,
                    "exact_quality": plans["exact"].quality,
                    "gap": plans["heuristic"].quality / plans["exact"].quality - 1,
                    "stages": [(s.lo, s.hi, s.instances) for s in plans["heuristic"].stages]})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rates", default="24,40,52")
    parser.add_argument("--ablation-rate", type=float, default=40.0)
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--base-requests", type=int, default=20)
    parser.add_argument("--quick", action="store_true",
                        help="one rate, 30 s windows, no heterogeneity-off rerun")
    parser.add_argument("--output", default=str(REPO / "results" / "cascadeinfer_repro.json"))
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    window_s = 30.0 if args.quick else args.window_s
    if args.quick:
        rates = rates[1:2] or rates
    started = time.perf_counter()
    base = base_slo(args.seed, args.base_requests)
    tasks = [Task("main", s, r, int(r * window_s), args.seed) for r in rates for s in SYSTEMS]
    tasks += [Task("ablation", s, args.ablation_rate, int(args.ablation_rate * window_s), args.seed)
              for s in ABLATIONS]
    if not args.quick:
        tasks += [Task("heterogeneity_off", s, r, int(r * window_s), args.seed, heterogeneity=False)
                  for r in rates for s in SYSTEMS]
    with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
        rows = pool.map(run_point, tasks)
    summaries = [summarize_row(row, base) for row in rows]
    for s, row in zip(summaries, rows, strict=True):
        if row["figure"] == "ablation":
            s["stage_cv"] = stage_cv(row)
    doc = {"note": NOTE, "profile": PROFILE, "engines": ENGINES, "dataset": DATASET, "qoe_d": QOE_D,
           "base_slo_s": {"ttft": base[0], "tpot": base[1]}, "window_s": window_s, "seed": args.seed,
           "runs": summaries, "ratios": ratios(summaries), "plan_costs": plan_costs(),
           "wall_s": time.perf_counter() - started}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(doc, indent=1))
    print_tables(doc)
    print(f"wrote {args.output} ({doc['wall_s']:.0f} s)")
    return 0


def ratios(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """CascadeInfer against each baseline at each rate (and heterogeneity setting): TTFT and normalised
    latency change, throughput and attainment ratios."""
    out = []
    by = {(r["figure"], r["system"], r["rate"]): r for r in runs}
    for (figure, system, rate), ci in by.items():
        if system != "cascadeinfer":
            continue
        for other in ("round_robin", "least_loaded", "llumnix_standin"):
            b = by.get((figure, other, rate))
            if b is None:
                continue
            out.append({
                "figure": figure, "rate": rate, "baseline": other,
                "mean_ttft_change": ci["mean_ttft_ms"] / b["mean_ttft_ms"] - 1,
                "p95_ttft_change": ci["p95_ttft_ms"] / b["p95_ttft_ms"] - 1,
                "normalised_latency_change": (ci["mean_normalised_latency_ms"]
                                              / b["mean_normalised_latency_ms"] - 1),
                "throughput_ratio": ci["output_tok_per_s"] / b["output_tok_per_s"],
                "slo5_ratio": (ci["slo_attainment_5x"] / b["slo_attainment_5x"]
                               if b["slo_attainment_5x"] else None),
                "slo20_ratio": (ci["slo_attainment_20x"] / b["slo_attainment_20x"]
                                if b["slo_attainment_20x"] else None),
            })
    return out


def print_tables(doc: dict[str, Any]) -> None:
    print(f"{NOTE}\nbase SLO: TTFT {doc['base_slo_s']['ttft'] * 1e3:.1f} ms, TPOT "
          f"{doc['base_slo_s']['tpot'] * 1e3:.2f} ms")
    head = (f"{'figure':18} {'system':20} {'rate':>5} {'TTFT mean/p95 ms':>18} {'TPOT mean/p95 ms':>17} "
            f"{'norm ms':>8} {'tok/s':>8} {'SLO5x':>6} {'SLO20x':>6} {'mig/req':>7} {'CV':>5}")
    print(head)
    for r in doc["runs"]:
        cv = r.get("stage_cv")
        print(f"{r['figure']:18} {r['system']:20} {r['rate']:5.0f} "
              f"{r['mean_ttft_ms']:8.0f}/{r['p95_ttft_ms']:<9.0f} {r['mean_tpot_ms'] or 0:7.1f}/"
              f"{r['p95_tpot_ms']:<9.1f} {r['mean_normalised_latency_ms'] or 0:8.1f} "
              f"{r['output_tok_per_s']:8.0f} {r['slo_attainment_5x']:6.3f} {r['slo_attainment_20x']:6.3f} "
              f"{r['migrations_per_request']:7.2f} {'' if cv is None else f'{cv:5.3f}'}")
    for x in doc["ratios"]:
        print(f"{x['figure']:18} rate {x['rate']:4.0f} vs {x['baseline']:16} "
              f"TTFT {x['mean_ttft_change']:+.1%} "
              f"norm {x['normalised_latency_change']:+.1%} thr {x['throughput_ratio']:.2f}x "
              f"SLO5 {x['slo5_ratio'] or 0:.2f}x SLO20 {x['slo20_ratio'] or 0:.2f}x")
    for p in doc["plan_costs"]:
        print(f"plan {p['instances']:4} instances 128K: heuristic {p['plan_ms']:.1f} ms, exact "
              f"{p['exact_ms']:.1f} ms, gap {p['gap']:.2%}")


if __name__ == "__main__":
    raise SystemExit(main())
