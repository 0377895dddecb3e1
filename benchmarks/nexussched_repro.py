"""NexusSched's end-to-end comparisons (§7.2-7.4) reproduced in the cluster simulator (`loadgen.simulate`).

Scenarios: homogeneous 8 x h100-llama3-8b; heterogeneous h100-llama3-8b + a100-llama3-8b + 2 x
a6000x2-llama3-8b (the paper ran TP 2 across two A6000s). Workloads (the paper's Table 2, from the data that
ships in ../shared/data): ShareGPT (the 500 real conversations, replayed 3 times with fresh ids: prompts
~127 tokens, outputs ~438), coding (Azure code trace lengths), summarization (arXiv length statistics, prompts
~2.6k tokens), the Azure conversation trace at a fixed Poisson rate and in timestamp mode (its own bursty
arrivals, sped up to reach the load). --requests per point (default 1500), seed 0, every arm on the
identical schedule.

Arms: round_robin, least_loaded, latency_based (2 s window), static_weighted (no configured weights: LENS's
P_max when every engine reports one, else GPU-class weights), all with the static token budget, and prism
with LENS planning on every engine (NexusSched). Every engine runs LENS's model and state vector in every arm
(as deployed: the state vector is always on); only planning differs. Ablation at the highest load of each
workload: static budget or LENS x round robin or PRISM.

SLOs (ms; a request is good when it meets both; the same values travel with each request to PRISM and LENS):
- interactive (ShareGPT, coding, conv): TTFT 1000; TPOT 15 homogeneous, 30 heterogeneous. The paper's 12 ms
  TPOT is not feasible on the simulated A6000 pair (a single decoding sequence takes 16.3 ms per step) and
  leaves the H100 (7.5 ms per step alone, 11 ms at 64 sequences, 60 ms for a 2048-token prefill chunk) almost
  no room for chunked prefill; 15 ms is 2x the H100's single-sequence step, 30 ms ~2x the A6000 pair's.
- summarization: TTFT 2000 (the paper's), TPOT 100 (loose: the paper sets none, LENS needs one).

Output: a printed table per scenario x workload (SLO attainment, P50/P90 E2E, P50 TTFT, P50 TPOT per arm and
rate), the ablation table, the request share per engine type in the heterogeneous scenario (Fig. 4b), and
PRISM+LENS vs round robin at the highest load with the relative gain; JSON to results/nexussched_repro.json.
Runs on two processes; about 10 minutes on a 2-core machine with the defaults.

    .venv/bin/python benchmarks/nexussched_repro.py [--requests 1500] [--jobs 2] [--quick] [--output PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

SCENARIOS: dict[str, str] = {
    "homogeneous": "h100-llama3-8b:8",
    "heterogeneous": "h100-llama3-8b:1,a100-llama3-8b:1,a6000x2-llama3-8b:2",
}
# workload -> (dataset, timestamps, {scenario: load points}, SLO kind). Load points are req/s, or the
# timestamp replay's speedup for the bursty trace.
WORKLOADS: dict[str, tuple[str, bool, dict[str, tuple[float, ...]], str]] = {
    "sharegpt": ("sharegpt", False, {"homogeneous": (200, 400, 600), "heterogeneous": (25, 50, 75)},
                 "interactive"),
    "coding": ("azure-code", False, {"homogeneous": (40, 80, 120), "heterogeneous": (10, 20, 30)},
               "interactive"),
    "summarization": ("arxiv", False, {"homogeneous": (40, 80, 120), "heterogeneous": (10, 20, 30)},
                      "summarization"),
    "conv-fixed": ("azure-conv", False, {"homogeneous": (80, 160, 240), "heterogeneous": (20, 40, 60)},
                   "interactive"),
    "conv-bursty": ("azure-conv", True, {"homogeneous": (15, 30, 45), "heterogeneous": (4, 8, 12)},
                    "interactive"),
}
# (TTFT ms, TPOT ms) per SLO kind and scenario (see the module docstring).
SLOS: dict[tuple[str, str], tuple[float, float]] = {
    ("interactive", "homogeneous"): (1000.0, 15.0),
    ("interactive", "heterogeneous"): (1000.0, 30.0),
    ("summarization", "homogeneous"): (2000.0, 100.0),
    ("summarization", "heterogeneous"): (2000.0, 100.0),
}
# arm -> (policy, policy params, LENS planning)
ARMS: dict[str, tuple[str, dict[str, Any], bool]] = {
    "round_robin": ("round_robin", {}, False),
    "least_loaded": ("least_loaded", {}, False),
    "latency_based": ("latency_based", {}, False),
    "static_weighted": ("static_weighted", {}, False),
    "prism+lens": ("prism", {}, True),
    # ablation only
    "lens+round_robin": ("round_robin", {}, True),
    "static+prism": ("prism", {}, False),
}
SWEEP_ARMS = ("round_robin", "least_loaded", "latency_based", "static_weighted", "prism+lens")
ABLATION = (("static+round_robin", "round_robin"), ("lens+round_robin", "lens+round_robin"),
            ("static+prism", "static+prism"), ("lens+prism", "prism+lens"))

_CACHE: dict[tuple[str, int], list[Any]] = {}


def _requests(dataset: str, count: int) -> list[Any]:
    from engine_agent.tokenization import Tokenizer  # noqa: PLC0415 (in the worker)
    from loadgen.datasets import load_dataset  # noqa: PLC0415
    from loadgen.live import EngineTokenizer, prepare_requests  # noqa: PLC0415
    from loadgen.paths import resolve_data_dir  # noqa: PLC0415

    key = (dataset, count)
    if key not in _CACHE:
        data_dir = resolve_data_dir(None)
        if dataset == "sharegpt":  # 500 conversations: replayed with fresh ids up to `count`
            base = load_dataset(dataset, data_dir, seed=0)
            raw = [dataclasses.replace(r, request_id=f"{r.request_id}-c{i // len(base)}")
                   for i, r in ((i, base[i % len(base)]) for i in range(count))]
        else:
            raw = load_dataset(dataset, data_dir, num_requests=count, seed=0)
        _CACHE[key] = prepare_requests(raw, EngineTokenizer(Tokenizer.load_sim()), seed=0, synthesize=False)
    return _CACHE[key]


def simulate_point(requests: list[Any], timestamps: bool, load: float, scenario: str, policy: str,
                   params: dict[str, Any], planning: bool, slo_ms: tuple[float, float]) -> dict[str, Any]:
    """Replay `requests` at `load` (req/s, or the timestamp replay's speedup) on the scenario's fleet under
    `policy` with the SLO (TTFT, TPOT ms) on every request: the plan, the `SimResult`, its summary
    (attainment over all arrivals), the offered rate and the simulation's wall time."""
    from loadgen.arrivals import ArrivalSpec, schedule  # noqa: PLC0415
    from loadgen.metrics import Slo, summarize  # noqa: PLC0415
    from loadgen.simulate import SimOptions, parse_engines, simulate  # noqa: PLC0415

    spec = (ArrivalSpec(timestamps=True, speedup=load, seed=0) if timestamps
            else ArrivalSpec(rate_per_s=load, seed=0))
    plan = schedule(requests, spec)
    ttft_ms, tpot_ms = slo_ms
    options = SimOptions(policy=policy, policy_params=params, seed=0, lens_planning=planning,
                         slo_ttft_s=ttft_ms / 1e3, slo_tpot_s=tpot_ms / 1e3)
    started = time.perf_counter()
    result = simulate(plan, parse_engines(SCENARIOS[scenario]), options)
    wall_s = time.perf_counter() - started
    summary = summarize(result.outcomes, max(result.duration_s, 1e-9), Slo(ttft_ms=ttft_ms, tpot_ms=tpot_ms))
    offered = len(plan) / max(plan[-1][0] - plan[0][0], 1e-9)
    return {"plan": plan, "result": result, "summary": summary, "offered": offered, "wall_s": wall_s}


def run_point(task: tuple[str, str, float, str, int]) -> dict[str, Any]:
    """One simulation: (scenario, workload, load, arm, requests) -> figures."""
    from loadgen.compare import share_by_profile  # noqa: PLC0415

    scenario, workload, load, arm, count = task
    dataset, timestamps, _, kind = WORKLOADS[workload]
    ttft_ms, tpot_ms = SLOS[(kind, scenario)]
    policy, params, planning = ARMS[arm]
    point = simulate_point(_requests(dataset, count), timestamps, load, scenario, policy, params, planning,
                           (ttft_ms, tpot_ms))
    plan, result, offered, wall_s = point["plan"], point["result"], point["offered"], point["wall_s"]
    s = point["summary"].to_dict()
    return {
        "scenario": scenario, "workload": workload, "load": load, "arm": arm, "requests": len(plan),
        "offered_req_per_s": offered, "slo_ttft_ms": ttft_ms, "slo_tpot_ms": tpot_ms,
        "slo_attainment": s["slo_attainment"], "completed": s["completed"],
        "p50_e2e_ms": s["median_e2el_ms"], "p90_e2e_ms": s["p90_e2el_ms"], "p50_ttft_ms": s["median_ttft_ms"],
        "p50_tpot_ms": s["median_tpot_ms"], "output_tok_per_s": s["output_throughput"],
        "share_by_profile": share_by_profile(result.per_engine), "sim_wall_s": wall_s,
    }


def tasks(count: int, quick: bool) -> list[tuple[str, str, float, str, int]]:
    out = []
    for scenario in SCENARIOS:
        for workload, (_, _, loads, _) in WORKLOADS.items():
            points = loads[scenario][-1:] if quick else loads[scenario]
            for load in points:
                out += [(scenario, workload, float(load), arm, count) for arm in SWEEP_ARMS]
            out += [(scenario, workload, float(points[-1]), arm, count)
                    for arm in ("lens+round_robin", "static+prism")]
    return out


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def report(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by = {(r["scenario"], r["workload"], r["load"], r["arm"]): r for r in rows}
    lines: list[str] = []
    headline: list[dict[str, Any]] = []
    ablation: list[dict[str, Any]] = []
    for scenario in SCENARIOS:
        for workload, (_, timestamps, _loads, kind) in WORKLOADS.items():
            present = sorted({r["load"] for r in rows
                              if r["scenario"] == scenario and r["workload"] == workload})
            if not present:
                continue
            ttft, tpot = SLOS[(kind, scenario)]
            unit = "x speedup" if timestamps else "req/s"
            lines.append(f"\n== {scenario} / {workload}  (SLO TTFT {ttft:.0f} ms, TPOT {tpot:.0f} ms; "
                         f"load in {unit})")
            lines.append(f"{'arm':<18}{'load':>7}{'offered':>9}{'SLO att':>9}{'E2E p50':>9}{'E2E p90':>9}"
                         f"{'TTFT p50':>10}{'TPOT p50':>10}")
            for load in present:
                for arm in SWEEP_ARMS:
                    r = by.get((scenario, workload, load, arm))
                    if r is None:
                        continue
                    lines.append(f"{arm:<18}{load:>7g}{r['offered_req_per_s']:>9.1f}"
                                 f"{_fmt(r['slo_attainment'], '.1%'):>9}{r['p50_e2e_ms']:>9.0f}"
                                 f"{r['p90_e2e_ms']:>9.0f}{r['p50_ttft_ms']:>10.0f}{r['p50_tpot_ms']:>10.1f}")
            high = present[-1]
            rr, nx = by.get((scenario, workload, high, "round_robin")), by.get((scenario, workload, high,
                                                                               "prism+lens"))
            if rr and nx:
                gain = (nx["slo_attainment"] / rr["slo_attainment"] - 1.0) if rr["slo_attainment"] else None
                headline.append({"scenario": scenario, "workload": workload, "load": high,
                                 "round_robin": rr["slo_attainment"], "prism+lens": nx["slo_attainment"],
                                 "abs_gain_pts": (nx["slo_attainment"] - rr["slo_attainment"]) * 100,
                                 "rel_gain": gain})
            arms = {}
            for label, arm in ABLATION:
                r = by.get((scenario, workload, high, arm))
                if r is not None:
                    arms[label] = r["slo_attainment"]
            if arms:
                ablation.append({"scenario": scenario, "workload": workload, "load": high, **arms})
    lines.append("\n== ablation at the highest load (SLO attainment)")
    lines.append(f"{'scenario/workload':<30}" + "".join(f"{label:>20}" for label, _ in ABLATION))
    for a in ablation:
        lines.append(f"{a['scenario'] + '/' + a['workload']:<30}"
                     + "".join(f"{_fmt(a.get(label), '.1%'):>20}" for label, _ in ABLATION))
    lines.append("\n== request share per engine type, heterogeneous, highest load (Fig. 4b)")
    profiles = sorted({p for r in rows if r["scenario"] == "heterogeneous" for p in r["share_by_profile"]})
    lines.append(f"{'workload':<16}{'arm':<18}" + "".join(f"{p:>20}" for p in profiles))
    shares = []
    for workload in WORKLOADS:
        present = sorted({r["load"] for r in rows if r["scenario"] == "heterogeneous"
                          and r["workload"] == workload})
        if not present:
            continue
        for arm in SWEEP_ARMS:
            r = by.get(("heterogeneous", workload, present[-1], arm))
            if r is not None:
                shares.append({"workload": workload, "arm": arm, **r["share_by_profile"]})
                lines.append(f"{workload:<16}{arm:<18}"
                             + "".join(f"{r['share_by_profile'].get(p, 0.0):>20.1%}" for p in profiles))
    lines.append("\n== PRISM+LENS vs round robin, SLO attainment at the highest load")
    for h in headline:
        rel = "-" if h["rel_gain"] is None else f"{h['rel_gain']:+.1%}"
        lines.append(f"{h['scenario'] + '/' + h['workload']:<30}RR {h['round_robin']:>7.1%}  "
                     f"PRISM+LENS {h['prism+lens']:>7.1%}  ({h['abs_gain_pts']:+.1f} pts, {rel})")
    gains = [h["rel_gain"] for h in headline if h["rel_gain"] is not None]
    mean_gain = sum(gains) / len(gains) if gains else None
    pts = [h["abs_gain_pts"] for h in headline]
    lines.append(f"mean relative gain {_fmt(mean_gain, '+.1%')}, mean absolute gain "
                 f"{(sum(pts) / len(pts)) if pts else 0.0:+.1f} pts (the paper: +43% on average)")
    print("\n".join(lines))
    return {"headline": headline, "mean_relative_gain": mean_gain, "ablation": ablation, "shares": shares}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="only the highest load of each workload")
    ap.add_argument("--output", type=Path, default=REPO / "results" / "nexussched_repro.json")
    args = ap.parse_args()
    todo = tasks(args.requests, args.quick)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
        for i, row in enumerate(pool.imap_unordered(run_point, todo, chunksize=1), 1):
            rows.append(row)
            if i % 10 == 0 or i == len(todo):
                print(f"[{i}/{len(todo)}] {time.perf_counter() - started:.0f} s", flush=True)
    wall_s = time.perf_counter() - started
    rows.sort(key=lambda r: (list(SCENARIOS).index(r["scenario"]), list(WORKLOADS).index(r["workload"]),
                             r["load"], list(ARMS).index(r["arm"])))
    figures = report(rows)
    print(f"\n{len(rows)} simulations, {wall_s:.0f} s wall on {args.jobs} processes")
    doc = {"config": {"requests_per_point": args.requests, "scenarios": SCENARIOS,
                      "workloads": {k: {"dataset": v[0], "timestamps": v[1], "loads": v[2], "slo_kind": v[3]}
                                    for k, v in WORKLOADS.items()},
                      "slos_ms": {f"{k[0]}/{k[1]}": v for k, v in SLOS.items()}, "seed": 0},
           "wall_s": wall_s, **figures, "runs": rows}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
