"""Why PRISM loses to round robin at overload (issue 17, item 1): the simulator's view of every decision.

EVERY FIGURE HERE IS FROM THE SIMULATED GPU (engine_agent/sim), with PRISM's own code routing.

Runs the mixed fleet (h100 + a100 + 2 x a6000x2, Llama-3-8B, LENS planning on every engine) on a training
workload (ShareGPT or the Azure conversation trace; never Azure code or arXiv, the held-out ones) at a load
point, under `prism` and `round_robin`, and records, at every PRISM decision, for every engine:
- its queue as the snapshot shows it (running, waiting, dispatched since the last report), pending prefill;
- the four factors, the predicted time to first token and finish PRISM priced (`PrismPolicy.timings`) and
  whether the engine was feasible (both margins within the SLO);
and, per request, the TTFT it actually got on the engine PRISM chose: the predicted vs actual latency margin.
Per-engine queue lengths come from the simulator's state reports (what the gateway sees) every `--sample-s`.

Output: a JSON next to the results (`results/prism_diagnose_<workload>_<load>.json`) with per-engine series
and summary figures (mean predicted and actual TTFT per engine, share of picks per engine over time), and a
plot per run (`.png`, four panels: queue per engine, pick share per engine, predicted vs actual TTFT of the
chosen engine, the factors of each engine's picks over time).

The instrumentation wraps `PrismPolicy.decide` in this process only (it calls the module's `factors` and the
policy's `timings` on the same snapshot); routing is unchanged.

    .venv/bin/python benchmarks/prism_diagnose.py [--workload sharegpt|conv] [--load 75] [--requests 1500]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from nexussched_repro import SCENARIOS, SLOS, WORKLOADS, _requests  # noqa: E402

from gateway.domain import ClusterSnapshot, RequestFeatures  # noqa: E402
from gateway.policies import prism  # noqa: E402
from loadgen.arrivals import ArrivalSpec, schedule  # noqa: E402
from loadgen.metrics import Slo, summarize  # noqa: E402
from loadgen.simulate import SimOptions, parse_engines, simulate  # noqa: E402

SCENARIO = "heterogeneous"
TRAINING = {"sharegpt": "sharegpt", "conv": "conv-fixed"}  # held out: coding (Azure code), summarization


class Recorder:
    """Wraps `PrismPolicy.decide`: one row per decision and engine."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self._orig = prism.PrismPolicy.decide

    def __enter__(self) -> Recorder:
        recorder = self

        def decide(policy: prism.PrismPolicy, features: RequestFeatures, snapshot: ClusterSnapshot) -> Any:
            chosen, why = recorder._orig(policy, features, snapshot)
            recorder.note(policy, features, snapshot, chosen)
            return chosen, why

        prism.PrismPolicy.decide = decide  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        prism.PrismPolicy.decide = self._orig  # type: ignore[method-assign]

    def note(self, policy: prism.PrismPolicy, features: RequestFeatures, snapshot: ClusterSnapshot,
             chosen: Any) -> None:
        params = policy.params
        engines = policy.candidates(features, snapshot)
        timings = {engine: (first, finish, margin <= 1.0)
                   for engine, first, finish, margin in policy.timings(features, snapshot)}
        for e in engines:
            f = prism.factors(e, features, snapshot, params)
            first_s, finish_s, feasible = timings[e.engine_id]
            self.rows.append({
                "t": snapshot.taken_at_s, "request": features.request_id, "engine": str(e.engine_id),
                "chosen": e.engine_id == chosen,
                "queue": e.num_running + e.num_waiting + e.unreported_requests,
                "waiting": e.num_waiting, "unreported": e.unreported_requests,
                "pending_prefill": e.pending_prefill_tokens + e.unreported_prompt_tokens,
                "predicted_ttft_s": first_s, "predicted_finish_s": finish_s, "feasible": feasible,
                "latency": f.latency, "load": f.load, "capacity": f.capacity, "affinity": f.affinity,
            })


def run(workload: str, load: float, count: int, policy: str) -> tuple[Any, list[dict[str, Any]], Slo]:
    dataset, timestamps, _, kind = WORKLOADS[workload]
    ttft_ms, tpot_ms = SLOS[(kind, SCENARIO)]
    spec = (ArrivalSpec(timestamps=True, speedup=load, seed=0) if timestamps
            else ArrivalSpec(rate_per_s=load, seed=0))
    plan = schedule(_requests(dataset, count), spec)
    options = SimOptions(policy=policy, seed=0, lens_planning=True, slo_ttft_s=ttft_ms / 1e3,
                         slo_tpot_s=tpot_ms / 1e3, record_timeline_s=1.0)
    with Recorder() as recorder:
        result = simulate(plan, parse_engines(SCENARIOS[SCENARIO]), options)
    return result, recorder.rows, Slo(ttft_ms=ttft_ms, tpot_ms=tpot_ms)


def analyse(result: Any, rows: list[dict[str, Any]], slo: Slo, bucket_s: float) -> dict[str, Any]:
    ttft = {o.request_id: o.ttft_s for o in result.outcomes if o.success}
    chosen = [r for r in rows if r["chosen"]]
    t0 = min((r["t"] for r in rows), default=0.0)
    per_engine: dict[str, dict[str, Any]] = {}
    series: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    buckets: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        buckets[(r["engine"], int((r["t"] - t0) // bucket_s))].append(r)
    for (engine, b), items in sorted(buckets.items()):
        s = series[engine]
        s["t_s"].append(b * bucket_s)
        s["queue"].append(statistics.fmean(i["queue"] for i in items))
        s["pending_prefill"].append(statistics.fmean(i["pending_prefill"] for i in items))
        s["picks"].append(sum(1 for i in items if i["chosen"]))
        for factor in ("latency", "load", "capacity"):
            s[factor].append(statistics.fmean(i[factor] for i in items))
        s["predicted_ttft_s"].append(statistics.fmean(i["predicted_ttft_s"] for i in items))
        actual = [ttft[i["request"]] for i in items if i["chosen"] and i["request"] in ttft]
        s["actual_ttft_s"].append(statistics.fmean(actual) if actual else math.nan)
    for engine in series:
        mine = [r for r in chosen if r["engine"] == engine]
        pairs = [(r["predicted_ttft_s"], ttft[r["request"]]) for r in mine if r["request"] in ttft]
        per_engine[engine] = {
            "picks": len(mine), "share": len(mine) / max(len(chosen), 1),
            "mean_predicted_ttft_s": statistics.fmean(p for p, _ in pairs) if pairs else None,
            "mean_actual_ttft_s": statistics.fmean(a for _, a in pairs) if pairs else None,
            "actual_over_predicted": (statistics.fmean(a for _, a in pairs)
                                      / max(statistics.fmean(p for p, _ in pairs), 1e-9)) if pairs else None,
            "max_queue_seen": max(series[engine]["queue"]),
        }
    summary = summarize(result.outcomes, max(result.duration_s, 1e-9), slo).to_dict()
    decisions = {r["request"] for r in rows}
    infeasible = {r["request"] for r in rows if r["chosen"] and not r["feasible"]}
    return {"slo_attainment": summary["slo_attainment"],
            "no_feasible_share": len(infeasible) / max(len(decisions), 1),
            "p50_ttft_ms": summary["median_ttft_ms"],
            "p99_ttft_ms": summary["p99_ttft_ms"], "per_engine": per_engine, "series": series}


def queue_series(result: Any) -> dict[str, Any]:
    """Round robin has no PRISM decisions: its per-engine request counts from the simulator instead."""
    return {engine: {"requests": totals["requests"]} for engine, totals in result.per_engine.items()}


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    series = doc["prism"]["series"]
    fig, axes = plt.subplots(4, 1, figsize=(10, 12), sharex=True)
    for engine, s in sorted(series.items()):
        axes[0].plot(s["t_s"], s["queue"], label=engine)
        total = [sum(series[e]["picks"][i] if i < len(series[e]["picks"]) else 0 for e in series)
                 for i in range(len(s["t_s"]))]
        axes[1].plot(s["t_s"], [p / t if t else 0.0 for p, t in zip(s["picks"], total, strict=False)],
                     label=engine)
        axes[2].plot(s["t_s"], s["predicted_ttft_s"], "--", label=f"{engine} predicted")
        axes[2].plot(s["t_s"], s["actual_ttft_s"], label=f"{engine} actual")
        axes[3].plot(s["t_s"], [a * b * c for a, b, c in zip(s["latency"], s["load"], s["capacity"],
                                                                  strict=True)], label=engine)
    axes[0].set_ylabel("queue (req)")
    axes[1].set_ylabel("pick share")
    axes[2].set_ylabel("TTFT s")
    axes[2].set_yscale("log")
    axes[3].set_ylabel("state score")
    axes[3].set_yscale("log")
    axes[3].set_xlabel("simulated s")
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    fig.suptitle(f"PRISM at overload: {doc['workload']} load {doc['load']} (simulated GPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--workload", choices=sorted(TRAINING), default="sharegpt")
    parser.add_argument("--load", type=float, default=75.0)
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--bucket-s", type=float, default=2.0)
    parser.add_argument("--output", default="")
    args = parser.parse_args()
    workload = TRAINING[args.workload]
    started = time.perf_counter()
    prism_result, rows, slo = run(workload, args.load, args.requests, "prism")
    rr_result, _, _ = run(workload, args.load, args.requests, "round_robin")
    rr = summarize(rr_result.outcomes, max(rr_result.duration_s, 1e-9), slo).to_dict()
    doc = {"note": "simulated GPU; PRISM's own code routing", "workload": workload, "load": args.load,
           "requests": args.requests, "scenario": SCENARIOS[SCENARIO],
           "prism": analyse(prism_result, rows, slo, args.bucket_s),
           "round_robin": {"slo_attainment": rr["slo_attainment"], "p50_ttft_ms": rr["median_ttft_ms"],
                           "p99_ttft_ms": rr["p99_ttft_ms"], "per_engine": queue_series(rr_result)},
           "wall_s": time.perf_counter() - started}
    out = Path(args.output or REPO / "results" / f"prism_diagnose_{args.workload}_{args.load:g}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, default=float))
    plot(doc, out.with_suffix(".png"))
    p = doc["prism"]
    print(f"SLO attainment: prism {p['slo_attainment']:.1%}, round robin {rr['slo_attainment']:.1%}; "
          f"no feasible engine for {p['no_feasible_share']:.1%} of PRISM's decisions")
    for engine, e in sorted(p["per_engine"].items()):
        predicted, actual = e["mean_predicted_ttft_s"] or 0.0, e["mean_actual_ttft_s"] or 0.0
        print(f"{engine:<28} share {e['share']:6.1%}  predicted TTFT {predicted:7.3f} s  "
              f"actual {actual:7.3f} s  max queue {e['max_queue_seen']:.0f}")
    print(f"wrote {out} and {out.with_suffix('.png').name} ({doc['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
