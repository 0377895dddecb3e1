"""PRISM's cost per routing decision the way the gateway pays it (issue 17, item 6: <= 20 µs at 64 engines,
<= 200 µs at 1,024).

A `ClusterState` holds N ready engines that report LENS state vectors (as the sim and vLLM agents do with LENS
on) with varied load. The gateway worker decides `--rate` requests per second (default 2,000) and every engine
reports every `--report-interval-ms` (default 50, the agents' default push interval), so about
N x interval_per_decision / report_interval reports arrive between two decisions (0.64 at 64 engines, 10.24
at 1,024 with the defaults), each engine in its turn. Each decision is one turn of the live loop: the reports
due since the last decision arrive, the gateway takes its snapshot (`ClusterState.snapshot`, timed as
"snapshot"), the policy decides on it (timed as "decide") and the dispatch is recorded (`note_dispatch`; an
older request finishes so the in-flight count stays bounded), with the garbage collector tuned as the serving
gateway tunes it (`gateway.app.collector_tuned`). Nothing repeats a snapshot: every decision sees
the views the events of its turn changed, so a memo only helps where the live gateway's would.

Arms, in the same invocation: round_robin (the baseline ratio), least_loaded, prism (defaults), prism with
`overload="shed"`, and prism without its per-view memo (a new policy object per decision: every row of the
table is built from the views, the cost after a membership change). `--no-lens` runs the fleet without LENS
(PRISM's fallbacks). Before issue 17's rework PRISM's decide cost 75 µs at 64 engines and 1.07 ms at 1,024 and
the snapshot 396 µs / 6.3 ms (views rebuilt for every engine on every change), measured on a fixed snapshot.

    .venv/bin/python benchmarks/prism_pick_cost.py [--sizes 64,1024] [--decisions 20000] [--output PATH]
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from json_out import write_json  # noqa: E402

from gateway.app import collector_tuned  # noqa: E402
from gateway.cluster.state import ClusterState  # noqa: E402
from gateway.domain import EngineId, EngineReport, LensState, RequestFeatures  # noqa: E402
from gateway.policies.registry import make_policy  # noqa: E402

MODEL = "llama3-8b"
ARMS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("round_robin", "round_robin", {}),
    ("least_loaded", "least_loaded", {}),
    ("prism", "prism", {}),
    ("prism_shed", "prism", {"overload": "shed"}),
    ("prism_no_memo", "prism", {}),
)


def report(eid: EngineId, seq: int, rng: random.Random, lens: bool) -> EngineReport:
    running, waiting = rng.randrange(0, 64), rng.randrange(0, 8)
    free = rng.randrange(200, 4000)
    state = LensState(
        predicted_batch_latency_s=0.01 + 0.0004 * running,
        pending_work_tokens=float(rng.randrange(0, 20_000)),
        effective_free_kv_blocks=free - rng.randrange(0, 200),
        peak_throughput_tokens_per_s=rng.uniform(8e3, 2.4e4),
        prediction_error_ratio=rng.uniform(0.0, 0.2), slo_risk=rng.random() < 0.05,
    ) if lens else None
    return EngineReport(
        engine_id=eid, model=MODEL, profile="h100-llama3-8b", backend="sim", role="", seq=seq,
        engine_timestamp_s=seq * 0.05, ready=True, draining=False, num_running=running, num_waiting=waiting,
        kv_blocks_total=4000, kv_blocks_free=free, kv_blocks_reserved=0,
        pending_prefill_tokens=rng.randrange(0, 4096), running_batch_tokens=running * 600,
        last_iteration_s=0.01 + 0.0004 * running, lens=state)


def run_arm(arm: str, name: str, params: dict[str, Any], size: int, decisions: int, rate: float,
            report_interval_s: float, lens: bool, seed: int) -> dict[str, float]:
    with collector_tuned():  # the garbage collector as the serving gateway sets it
        return _run_arm(arm, name, params, size, decisions, rate, report_interval_s, lens, seed)


def _run_arm(arm: str, name: str, params: dict[str, Any], size: int, decisions: int, rate: float,
             report_interval_s: float, lens: bool, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    state = ClusterState(stale_after_s=1e9)
    ids = [EngineId(f"e{i:04d}") for i in range(size)]
    seqs = dict.fromkeys(ids, 1)
    for eid in ids:
        state.add_engine(eid, 0.0)
        state.on_connect(eid)
        state.on_report(eid, report(eid, 1, rng, lens), 0.0)
    policy = make_policy(name, params)
    inflight: deque[tuple[EngineId, str]] = deque()
    snapshot_s: list[float] = []
    decide_s: list[float] = []
    clock = time.perf_counter
    reports_due = 0.0  # reports owed since the last decision (engines report in turn)
    turn = 0
    for i in range(decisions):
        now_s = 1.0 + i / rate
        reports_due += size / (rate * report_interval_s)
        while reports_due >= 1.0:
            reports_due -= 1.0
            eid = ids[turn % size]
            turn += 1
            seqs[eid] += 1
            state.on_report(eid, report(eid, seqs[eid], rng, lens), now_s)
        prompt = rng.choice((64, 256, 1024, 4096))
        features = RequestFeatures(request_id=f"r{i}", model=MODEL, prompt_tokens=prompt, max_tokens=256,
                                   now_s=now_s, dispatch_seq=i, rand=rng.random())
        if arm == "prism_no_memo":
            policy = make_policy(name, params)
        start = clock()
        snapshot = state.snapshot(now_s)
        mid = clock()
        decide = getattr(policy, "decide", None)
        engine = decide(features, snapshot)[0] if decide is not None else policy.pick(features, snapshot)
        end = clock()
        if i >= decisions // 10:  # the first tenth warms caches and the fleet's in-flight load
            snapshot_s.append(mid - start)
            decide_s.append(end - mid)
        if engine is None:
            continue
        state.note_dispatch(engine, features.request_id, prompt, 256, "", now_s)
        inflight.append((engine, features.request_id))
        if len(inflight) > 8 * size:
            state.note_finish(*inflight.popleft())
    return {"snapshot_us_median": statistics.median(snapshot_s) * 1e6,
            "decide_us_median": statistics.median(decide_s) * 1e6,
            "decide_us_mean": statistics.fmean(decide_s) * 1e6,
            "decide_us_p99": sorted(decide_s)[int(0.99 * len(decide_s))] * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,1024")
    parser.add_argument("--decisions", type=int, default=20_000)
    parser.add_argument("--rate", type=float, default=2000.0,
                        help="decisions per second of the gateway worker")
    parser.add_argument("--report-interval-ms", type=float, default=50.0,
                        help="each engine's report interval")
    parser.add_argument("--no-lens", action="store_true", help="engines without LENS (PRISM's fallbacks)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="results/prism_pick_cost.json")
    args = parser.parse_args()
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        baseline = None
        for arm, name, params in ARMS:
            decisions = args.decisions if arm != "prism_no_memo" else max(args.decisions // 10, 1000)
            figures = run_arm(arm, name, params, size, decisions, args.rate, args.report_interval_ms / 1e3,
                              not args.no_lens, args.seed)
            baseline = figures["decide_us_median"] if baseline is None else baseline
            figures["decide_vs_round_robin"] = figures["decide_us_median"] / baseline
            rows.append({"engines": size, "arm": arm, **{k: round(v, 3) for k, v in figures.items()}})
            print(f"{size:>5} {arm:<14} snapshot {figures['snapshot_us_median']:8.1f} µs   decide "
                  f"{figures['decide_us_median']:8.1f} µs (p99 {figures['decide_us_p99']:8.1f})  "
                  f"x{figures['decide_vs_round_robin']:.1f}")
    write_json(args.output, {"benchmark": "prism_pick_cost", "python": platform.python_version(),
                             "machine": platform.machine(), "lens": not args.no_lens,
                             "decisions_per_s": args.rate, "report_interval_ms": args.report_interval_ms,
                             "rows": rows})
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
