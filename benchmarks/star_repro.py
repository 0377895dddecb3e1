"""STAR's evaluation (paper 003, §6) reproduced in the cluster simulator (`loadgen simulate --reschedule`).

EVERY FIGURE HERE IS FROM THE SIMULATED GPU (engine_agent/sim: a roofline timing model of an H800 serving
DeepSeek-R1-Distill-Qwen-7B), not from a real GPU; the rescheduler, the mover's limits and the splice's
decisions are the gateway's own code (docs/star.md, "Simulator").

Setup, as far as the simulator goes (§6.1, the large cluster):
- 6 engines `h800-deepseek-r1-distill-qwen-7b` (the paper's 6 H800 decode instances). Not prefill/decode
  split: the simulated engines run their own prefill, so decode iterations carry prefill chunks too.
- Dispatch: `least_loaded` by queue length (`measure=requests`), a real-time balancer that, like the paper's
  KV-cache balancing, does not know output lengths. (least_loaded's default token measure counts each
  request's max_tokens, and the simulator sends a forced output length as max_tokens: an oracle dispatch.)
- Workloads: ShareGPT prompts (the 500 conversations of ../shared/data, replayed with fresh ids) and Alpaca
  prompts, each with output lengths drawn to match Table 2 (`--output-lengths star-sharegpt|star-alpaca`,
  prompt + output <= 32K); Poisson arrivals at each rate for `--window-s` seconds (requests = rate x
  window), then the fleet drains.
- Rates. The paper's 0.1-0.2 req/s saturate its six H800s; the simulated H800 is faster, so the same regime
  (decode KV full, preemptions, TPOT past its SLO without rescheduling) sits at higher rates. They were chosen
  on seed 0 with ShareGPT and the `none` arm only (300 s windows): 5 req/s ran at 99.9 % SLO attainment, peak
  KV 96 %, no preemption; 5.5 req/s at 84 %, KV full 34 % of the time; 6.5 at 66 %; 8 at 55 %. Hence 4.5, 5.5
  and 6.5 (below, at and past the knee) and 5.5 for the tables. Every figure is reported on `--seed` 1 (other
  arrivals, prompt order and output lengths), both workloads.
- SLO: TTFT 1 s, TPOT 25 ms (§6.2, DeepSeek-R1-Distill-Qwen-7B). Goodput = requests meeting both per second
  of the run (first arrival to last finish, vLLM's definition); SLO attainment = their share.
- STAR: reschedule every 0.5 s, k = 20 decode steps per prediction round, H = 32, theta = 0.1, link 25 Gbit/s
  (+2 ms per transfer), at most 2 moves per request, 5 s request and 1 s engine cooldown.
- Arms: none, star-nopred, star, star-oracle. "star" reads `--predictor FILE` (a trained length predictor on
  the sim's synthetic hidden states) when given; otherwise the exact remaining length quantised to its
  6-bin midpoint (Table 3's 6-bin setting), because no predictor trained for d = 3584 ships in this repo.

Figures (JSON: results/star_repro.json):
1. Fig. 10: goodput, SLO attainment, P99 TPOT and throughput per arm, rate and workload, with ratios against
   the `none` arm of the same invocation (goodput x, P99 TPOT change).
2. Fig. 12: preemptions, peak KV use (the fullest engine) and the share of samples with an engine >= 99% full.
3. Table 3 (ShareGPT, `--table-rate`): oracle, 6-, 4-, 2-bin and no prediction: execution-time variance
   (ms^2, mean over 1 s samples during the arrivals), P99 TPOT, goodput and its gain over no prediction. With
   the rescheduler's H = 32 rounds of k = 20 (640 tokens ahead) every bin midpoint (>= 1,024) runs through
   the whole horizon, so the bins cannot differ; a second block repeats the table at H = 400 (8,000 tokens).
4. Table 4 (same point): the prediction interval k (decode steps per round) for the "star" source.
5. Fig. 13: execution-time variance and the rescheduler's time per `propose` call against the number of
   engines (rate scaled linearly with it, a short burst of `--scale-requests-per-engine` requests per engine
   each: not a steady state; the variance is over the whole run, drain included).

    .venv/bin/python benchmarks/star_repro.py [--quick] [--jobs 2] [--rates 4.5,5.5,6.5] [--window-s 300]
        [--seed 1] [--predictor FILE] [--scale-sizes 8,32,128,256] [--output results/star_repro.json]

`--quick` runs one rate (`--table-rate`), Tables 3-4 without k = 1 and Fig. 13 at 8 and 32 engines.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
NOTE = ("every figure is from the simulated GPU (engine_agent/sim, h800-deepseek-r1-distill-qwen-7b), not a "
        "real one; the rescheduler (gateway/rescheduling/star.py), the mover's limits and the splice "
        "decisions are the gateway's own code run in virtual time")
PROFILE = "h800-deepseek-r1-distill-qwen-7b"
ENGINES = 6
POLICY = ("least_loaded", {"measure": "requests"})
SLO_MS = (1000.0, 25.0)  # TTFT, TPOT (§6.2, the 7B model)
WORKLOADS = {"sharegpt": ("sharegpt", "star-sharegpt"), "alpaca": ("alpaca", "star-alpaca")}
ARMS = ("none", "star-nopred", "star", "star-oracle")
BINS = (6, 4, 2)
INTERVALS = (1, 5, 20, 100)

SENSITIVITY_HORIZON = 400  # rounds: 8,000 tokens at k = 20, about the mean output (Table 3's second run)


@dataclasses.dataclass(frozen=True)
class Task:
    """One simulation: which figure it feeds, the workload and rate, the arm, the fleet size, the requests,
    the "star" arm's bins (None: the predictor file, else 6), k and Algorithm 1's horizon H (None: 32)."""

    figure: str
    workload: str
    rate: float
    arm: str
    engines: int
    requests: int
    bins: int | None = None
    interval: int = 20
    horizon: int | None = None
    seed: int = 1

_CACHE: dict[tuple[str, int, int], list[Any]] = {}
_PREDICTOR: dict[str, Any] = {}


def _requests(workload: str, count: int, seed: int) -> list[Any]:
    from engine_agent.tokenization import Tokenizer  # noqa: PLC0415 (in the worker)
    from loadgen.datasets import load_dataset, with_output_lengths  # noqa: PLC0415
    from loadgen.live import EngineTokenizer, prepare_requests  # noqa: PLC0415
    from loadgen.paths import resolve_data_dir  # noqa: PLC0415

    key = (workload, count, seed)
    if key not in _CACHE:
        dataset, lengths = WORKLOADS[workload]
        data_dir = resolve_data_dir(None)
        base = load_dataset(dataset, data_dir, seed=seed)
        raw = [dataclasses.replace(base[i % len(base)], request_id=f"{base[i % len(base)].request_id}-c{i}")
               for i in range(count)]
        prepared = prepare_requests(raw, EngineTokenizer(Tokenizer.load_sim()), seed=seed, synthesize=False)
        _CACHE[key] = with_output_lengths(prepared, lengths, seed=seed)
    return _CACHE[key]


def _predictor(path: str | None) -> Any:
    if path is None:
        return None
    if path not in _PREDICTOR:
        from engine_agent.star.predictor import LengthPredictor  # noqa: PLC0415
        from switchyard.profiles import get_profile  # noqa: PLC0415

        _PREDICTOR[path] = LengthPredictor.load(Path(path),
                                                expected_hidden_size=get_profile(PROFILE).model.hidden_size)
    return _PREDICTOR[path]


def run_point(task: Task, predictor_path: str | None) -> dict[str, Any]:
    """One simulation -> its figures."""
    from loadgen.arrivals import ArrivalSpec, schedule  # noqa: PLC0415
    from loadgen.metrics import Slo, summarize  # noqa: PLC0415
    from loadgen.simulate import EngineSpec, SimOptions, simulate  # noqa: PLC0415

    arm, bins = task.arm, task.bins
    plan = schedule(_requests(task.workload, task.requests, task.seed),
                    ArrivalSpec(rate_per_s=task.rate, seed=task.seed))
    predictor = _predictor(predictor_path) if arm == "star" and bins is None else None
    if arm == "star" and predictor is None and bins is None:
        bins = 6
    ttft_ms, tpot_ms = SLO_MS
    options = SimOptions(policy=POLICY[0], policy_params=POLICY[1], seed=task.seed, slo_ttft_s=ttft_ms / 1e3,
                         slo_tpot_s=tpot_ms / 1e3, reschedule=arm,  # type: ignore[arg-type]
                         predictor=predictor, predictor_bins=bins if arm == "star" else None,
                         prediction_interval=task.interval, balance_figures=True,
                         reschedule_params={} if task.horizon is None else {"horizon": task.horizon})
    started = time.perf_counter()
    result = simulate(plan, [EngineSpec(PROFILE, task.engines)], options)
    wall_s = time.perf_counter() - started
    slo = Slo(ttft_ms=ttft_ms, tpot_ms=tpot_ms)
    s = summarize(result.outcomes, max(result.duration_s, 1e-9), slo).to_dict()
    b = result.balance or {}
    window_s = plan[-1][0] - plan[0][0]
    during = [row["exec_time_var_ms2"] for row in result.timeline if row["t_s"] <= window_s]
    return {
        "figure": task.figure, "workload": task.workload, "rate": task.rate, "arm": arm,
        "engines": task.engines, "requests": len(plan), "bins": bins if arm == "star" else None,
        "predictor": "file" if predictor is not None else ("bins" if arm == "star" else None),
        "prediction_interval": task.interval, "horizon": options.star_params().horizon,
        "duration_s": result.duration_s,
        "completed": s["completed"], "failed": s["failed"],
        "goodput": s["request_goodput"], "slo_attainment": s["slo_attainment"],
        "throughput": s["request_throughput"], "output_tok_per_s": s["output_throughput"],
        "p99_tpot_ms": s["p99_tpot_ms"], "p50_tpot_ms": s["median_tpot_ms"], "p99_ttft_ms": s["p99_ttft_ms"],
        "migrations": b.get("migrations"), "kv_gb_moved": b.get("kv_bytes_moved", 0) / 1e9,
        "requests_moved": b.get("requests_moved"), "splice_stall_ms": b.get("splice_stall_ms"),
        "preemptions": b.get("preemptions"), "peak_kv_used_ratio": b.get("peak_kv_used_ratio"),
        "kv_over_99_share": b.get("kv_over_99_share"),
        "exec_var_ms2_arrivals": sum(during) / len(during) if during else None,
        "exec_var_ms2_run": b.get("exec_time_var_ms2"), "propose_ms": b.get("propose_ms"),
        "peak_kv_per_engine": [t["peak_kv_used_ratio"] for t in result.per_engine.values()],
        "preemptions_per_engine": [t["preemptions"] for t in result.per_engine.values()],
        "sim_wall_s": wall_s,
    }


def _run(args: tuple[Task, str | None]) -> dict[str, Any]:
    return run_point(*args)


def tasks(rates: list[float], table_rate: float, window_s: float, sizes: list[int], per_engine: int,
          quick: bool, seed: int = 1) -> list[Task]:
    out: list[Task] = []
    for workload in WORKLOADS:
        for rate in rates:
            out += [Task("fig10", workload, rate, arm, ENGINES, round(rate * window_s)) for arm in ARMS]
    count = round(table_rate * window_s)
    if table_rate not in rates:
        out += [Task("fig10", "sharegpt", table_rate, arm, ENGINES, count) for arm in ARMS]
    out += [Task("table3", "sharegpt", table_rate, "star", ENGINES, count, bins=b) for b in BINS]
    out += [Task("table3", "sharegpt", table_rate, arm, ENGINES, count, bins=b, horizon=SENSITIVITY_HORIZON)
            for arm, b in (("star-oracle", None), *(("star", b) for b in BINS))]
    out += [Task("table4", "sharegpt", table_rate, "star", ENGINES, count, interval=k)
            for k in INTERVALS if k != 20 and not (quick and k == 1)]
    scale_rate = table_rate / ENGINES
    for size in sizes:
        out += [Task("fig13", "sharegpt", scale_rate * size, arm, size, per_engine * size)
                for arm in ("none", "star-nopred", "star-oracle")]
    return [dataclasses.replace(t, seed=seed) for t in out]


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def report(rows: list[dict[str, Any]], table_rate: float) -> dict[str, Any]:
    lines: list[str] = []
    fig10 = [r for r in rows if r["figure"] == "fig10"]
    base = {(r["workload"], r["rate"]): r for r in fig10 if r["arm"] == "none"}
    ratios = []
    for workload in WORKLOADS:
        lines.append(f"\n== Fig. 10 / 12: {workload} (6 x {PROFILE}; SLO TTFT {SLO_MS[0]:.0f} ms, TPOT "
                     f"{SLO_MS[1]:.0f} ms; simulated)")
        lines.append(f"{'arm':<13}{'rate':>6}{'goodput':>9}{'x none':>8}{'SLO att':>9}{'TPOT p99':>10}"
                     f"{'vs none':>9}{'req/s':>7}{'moves':>7}{'KV GB':>7}{'stall p99':>10}{'preempt':>8}"
                     f"{'peak KV':>9}{'>=99%':>7}{'exec var':>10}")
        for r in (r for r in fig10 if r["workload"] == workload):
            none = base.get((workload, r["rate"]))
            g = _ratio(r["goodput"], none["goodput"]) if none else None
            t = (r["p99_tpot_ms"] / none["p99_tpot_ms"] - 1.0) if none and none["p99_tpot_ms"] else None
            var = _ratio(r["exec_var_ms2_arrivals"], none["exec_var_ms2_arrivals"]) if none else None
            ratios.append({"workload": workload, "rate": r["rate"], "arm": r["arm"], "goodput_x_none": g,
                           "p99_tpot_change_vs_none": t, "exec_var_x_none": var})
            moves = r["migrations"]["cut"] if r["migrations"] else 0
            stall = (r["splice_stall_ms"] or {}).get("p99")
            lines.append(f"{r['arm']:<13}{r['rate']:>6g}{r['goodput']:>9.3f}{_fmt(g, '.3f'):>8}"
                         f"{r['slo_attainment']:>9.1%}{r['p99_tpot_ms']:>10.1f}{_fmt(t, '+.1%'):>9}"
                         f"{r['throughput']:>7.2f}{moves:>7}{r['kv_gb_moved']:>7.1f}{_fmt(stall, '.1f'):>10}"
                         f"{r['preemptions']:>8}{_fmt(r['peak_kv_used_ratio'], '.1%'):>9}"
                         f"{_fmt(r['kv_over_99_share'], '.1%'):>7}"
                         f"{_fmt(r['exec_var_ms2_arrivals'], '.2f'):>10}")
    point = {r["arm"]: r for r in fig10 if r["workload"] == "sharegpt" and r["rate"] == table_rate}
    nopred = point.get("star-nopred")
    table3 = []
    lines.append(f"\n== Table 3: prediction accuracy (sharegpt, {table_rate:g} req/s; simulated). H = 32 "
                 f"rounds of k = 20 sees 640 tokens ahead, every bin midpoint is >= 1024: the bins coincide;")
    lines.append(f"   the second block uses H = {SENSITIVITY_HORIZON} (8,000 tokens)")
    lines.append(f"{'H':>4} {'setting':<17}{'exec var ms2':>13}{'TPOT p99':>10}{'goodput':>9}{'gain':>8}"
                 f"{'moves':>7}")
    for horizon in sorted({r["horizon"] for r in rows if r["figure"] == "table3"}):
        three = [r for r in rows if r["figure"] == "table3" and r["horizon"] == horizon]
        oracle = next((r for r in three if r["arm"] == "star-oracle"), point.get("star-oracle"))
        rows3: list[tuple[str, dict[str, Any] | None]] = [
            ("oracle", oracle), *((f"{r['bins']}-bin", r) for r in three if r["arm"] == "star")]
        rows3 += [("no pred.", nopred), ("no rescheduling", point.get("none"))]
        for label, row in rows3:
            if row is None:
                continue
            gain = _ratio(row["goodput"], nopred["goodput"]) if nopred else None
            gain = None if gain is None else gain - 1.0
            table3.append({"horizon": horizon, "setting": label, "exec_var_ms2": row["exec_var_ms2_arrivals"],
                           "p99_tpot_ms": row["p99_tpot_ms"], "goodput": row["goodput"],
                           "goodput_gain_vs_nopred": gain})
            moves = row["migrations"]["cut"] if row["migrations"] else 0
            lines.append(f"{horizon:>4} {label:<17}{_fmt(row['exec_var_ms2_arrivals'], '.2f'):>13}"
                         f"{row['p99_tpot_ms']:>10.1f}{row['goodput']:>9.3f}{_fmt(gain, '+.1%'):>8}"
                         f"{moves:>7}")
    table4 = []
    rows4 = [r for r in rows if r["figure"] == "table4"]
    if point.get("star") is not None:
        rows4.append(point["star"])
    lines.append(f"\n== Table 4: prediction interval, 'star' arm (sharegpt, {table_rate:g} req/s; simulated)")
    lines.append(f"{'k':>5}{'exec var ms2':>13}{'TPOT p99':>10}{'goodput':>9}{'gain':>8}{'moves':>7}")
    for r in sorted(rows4, key=lambda r: r["prediction_interval"]):
        gain = _ratio(r["goodput"], nopred["goodput"]) if nopred else None
        gain = None if gain is None else gain - 1.0
        table4.append({"interval": r["prediction_interval"], "exec_var_ms2": r["exec_var_ms2_arrivals"],
                       "p99_tpot_ms": r["p99_tpot_ms"], "goodput": r["goodput"],
                       "goodput_gain_vs_nopred": gain})
        lines.append(f"{r['prediction_interval']:>5}{_fmt(r['exec_var_ms2_arrivals'], '.2f'):>13}"
                     f"{r['p99_tpot_ms']:>10.1f}{r['goodput']:>9.3f}{_fmt(gain, '+.1%'):>8}"
                     f"{r['migrations']['cut']:>7}")
    fig13 = []
    lines.append("\n== Fig. 13: scaling (sharegpt burst, rate scaled with the engines; simulated)")
    lines.append(f"{'engines':>8}{'arm':>13}{'exec var ms2':>13}{'propose p50 ms':>15}{'p99 ms':>8}"
                 f"{'moves':>7}{'sim wall s':>11}")
    scaled = sorted((r for r in rows if r["figure"] == "fig13"),
                    key=lambda r: (r["engines"], ARMS.index(r["arm"])))
    for r in scaled:
        p = r["propose_ms"] or {}
        fig13.append({"engines": r["engines"], "arm": r["arm"], "exec_var_ms2": r["exec_var_ms2_run"],
                      "propose_ms": p, "migrations": r["migrations"]["cut"], "sim_wall_s": r["sim_wall_s"]})
        lines.append(f"{r['engines']:>8}{r['arm']:>13}{_fmt(r['exec_var_ms2_run'], '.2f'):>13}"
                     f"{_fmt(p.get('p50'), '.2f'):>15}{_fmt(p.get('p99'), '.2f'):>8}"
                     f"{r['migrations']['cut']:>7}"
                     f"{r['sim_wall_s']:>11.1f}")
    print("\n".join(lines))
    return {"ratios_vs_none": ratios, "table3": table3, "table4": table4, "fig13": fig13}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="4.5,5.5,6.5", help="request rates (req/s) for Fig. 10")
    ap.add_argument("--table-rate", type=float, default=5.5, help="the rate of Tables 3-4 and Fig. 13's base")
    ap.add_argument("--window-s", type=float, default=300.0, help="seconds of arrivals per point")
    ap.add_argument("--seed", type=int, default=1,
                    help="arrivals, prompt order and output lengths (the rates were chosen on seed 0)")
    ap.add_argument("--scale-sizes", default="8,32,128,256", help="engine counts for Fig. 13")
    ap.add_argument("--scale-requests-per-engine", type=int, default=4)
    ap.add_argument("--predictor", help="a trained length predictor (d = 3584) for the 'star' arm")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--quick", action="store_true",
                    help="one rate (--table-rate), a 300 s window, Fig. 13 at 8 and 32 engines, no k = 1")
    ap.add_argument("--output", type=Path, default=REPO / "results" / "star_repro.json")
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    sizes = [int(s) for s in args.scale_sizes.split(",") if s.strip()]
    window_s = args.window_s
    if args.quick:
        rates, window_s, sizes = [args.table_rate], min(window_s, 300.0), [s for s in sizes if s <= 32]
    pending = tasks(rates, args.table_rate, window_s, sizes, args.scale_requests_per_engine, args.quick,
                 args.seed)
    pending.sort(key=lambda t: -t.requests)  # longest first
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
        work = [(t, args.predictor) for t in pending]
        for i, row in enumerate(pool.imap_unordered(_run, work, chunksize=1), 1):
            rows.append(row)
            print(f"[{i}/{len(pending)}] {time.perf_counter() - started:.0f} s: {row['figure']} "
                  f"{row['workload']} "
                  f"{row['rate']:g} {row['arm']} ({row['sim_wall_s']:.1f} s)", flush=True)
    wall_s = time.perf_counter() - started
    order = {"fig10": 0, "table3": 1, "table4": 2, "fig13": 3}
    rows.sort(key=lambda r: (order[r["figure"]], list(WORKLOADS).index(r["workload"]), r["engines"],
                             r["rate"], r["horizon"], ARMS.index(r["arm"]), -(r["bins"] or 0),
                             r["prediction_interval"]))
    figures = report(rows, args.table_rate)
    print(f"\n{len(rows)} simulations, {wall_s:.0f} s wall on {args.jobs} processes")
    doc = {"note": NOTE,
           "config": {"profile": PROFILE, "engines": ENGINES, "policy": POLICY[0], "policy_params": POLICY[1],
                      "slo_ms": {"ttft": SLO_MS[0], "tpot": SLO_MS[1]}, "workloads": WORKLOADS,
                      "rates": rates, "table_rate": args.table_rate, "window_s": window_s,
                      "scale_sizes": sizes, "scale_requests_per_engine": args.scale_requests_per_engine,
                      "star_arm": "predictor file" if args.predictor else "6-bin quantised oracle",
                      "predictor": args.predictor, "reschedule_interval_s": 0.5, "kv_link_gbps": 25.0,
                      "seed": args.seed, "quick": args.quick},
           "wall_s": wall_s, **figures, "runs": rows}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0 if all(math.isfinite(r["goodput"]) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
