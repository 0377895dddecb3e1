"""Microseconds per routing decision of each policy (issue 14: goodput_rr's goal is <= 5 µs at 16 engines).

For each fleet size N (default 16, 64, 256) and combo layout, a `ClusterState` holds N ready simulated engines
(profile h100-llama3-8b, `combo` labels as agents send them) with varied in-flight load; the snapshot is
taken from it, as the gateway and the simulator do, so `ClusterSnapshot.membership` is set and routing
counts (`routes`) hold a few hundred earlier goodput_rr picks. Each policy's `pick` (goodput_rr: `choose`,
what the request's life calls) is timed over the same snapshot, best of `--repeat` runs of `--picks` calls;
round_robin in the same invocation is the baseline (ratio). Layouts: "engines" (every engine its own combo,
the worst case: one group per engine) and "combos4" (combos of 4 engines, e.g. 1 prefill-side + 3
decode-side GPUs).

    .venv/bin/python benchmarks/policy_pick_cost.py [--sizes 16,64,256] [--output PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

from gateway.cluster.state import ClusterState
from gateway.dispatch.features import RoutingHints
from gateway.dispatch.life import ChoiceLife, Dispatch, Moment, record_dispatch
from gateway.domain import EngineId, EngineReport, EngineRequest, RequestFeatures
from gateway.policies.registry import make_policy

MODEL = "llama3-8b"
COMBO_TYPES = ("1xh800+3xh20", "4xa800", "2xh800+2xh20", "4xh20")
POLICIES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("round_robin", {}),
    ("least_loaded", {}),
    ("static_weighted", {}),
    ("goodput_rr", {"goodput": {t: float(i + 1) for i, t in enumerate(COMBO_TYPES)}}),
    ("goodput_rr", {"goodput": {t: float(i + 1) for i, t in enumerate(COMBO_TYPES)}, "intra": "rr"}),
    ("goodput_rr", {"weights": "equal"}),
    ("goodput_rr", {"weights": "measured", "slo_ttft_s": 1.0}),
    ("prism", {}),
)


def fleet(size: int, layout: str) -> ClusterState:
    state = ClusterState(stale_after_s=1e9)
    for i in range(size):
        eid = EngineId(f"e{i:04d}")
        group = i if layout == "engines" else i // 4
        combo = f"{COMBO_TYPES[group % len(COMBO_TYPES)]}#{group}"
        state.add_engine(eid, 0.0)
        state.on_connect(eid)
        state.on_report(eid, EngineReport(
            engine_id=eid, model=MODEL, profile="h100-llama3-8b", backend="sim", role="", seq=1,
            engine_timestamp_s=0.0, ready=True, draining=False, num_running=i % 7, num_waiting=i % 3,
            kv_blocks_total=4000, kv_blocks_free=4000 - 37 * (i % 11), kv_blocks_reserved=0,
            pending_prefill_tokens=64 * (i % 5), running_batch_tokens=128 * (i % 9), combo=combo), 0.0)
    return state


def warm(state: ClusterState, policy_name: str, params: dict[str, Any], picks: int) -> None:
    policy = make_policy(policy_name, params)
    for i in range(picks):
        life = ChoiceLife(EngineRequest(request_id=f"w{i}", model=MODEL, prompt_token_ids=(1,) * 100,
                                        max_tokens=50), RoutingHints(arrival_s=1.0))
        decision = life.route(policy, Moment(1.0, i, (i * 0.618) % 1.0, state.snapshot(1.0)))
        assert isinstance(decision, Dispatch)
        record_dispatch(state, decision)


def time_policy(name: str, params: dict[str, Any], size: int, layout: str, picks: int, repeat: int) -> float:
    state = fleet(size, layout)
    warm(state, name, params, 300)
    snapshot = state.snapshot(2.0)
    policy = make_policy(name, params)
    call = getattr(policy, "choose", None) or policy.pick
    features = RequestFeatures(request_id="r", model=MODEL, prompt_tokens=100, max_tokens=50, now_s=2.0,
                               dispatch_seq=7, rand=0.3)
    call(features, snapshot)  # the first call builds goodput_rr's layout memo
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(picks):
            call(features, snapshot)
        best = min(best, (time.perf_counter() - start) / picks)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="16,64,256")
    parser.add_argument("--picks", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--output", default="results/policy_pick_cost.json")
    args = parser.parse_args()
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        for layout in ("engines", "combos4"):
            baseline = None
            for name, params in POLICIES:
                us = time_policy(name, params, size, layout, args.picks, args.repeat)
                baseline = us if baseline is None else baseline
                rows.append({"engines": size, "layout": layout, "policy": name, "params": params,
                             "us_per_pick": round(us, 3), "vs_round_robin": round(us / baseline, 3)})
                label = name + ("" if not params else " " + ",".join(
                    f"{k}={v}" for k, v in params.items() if k != "goodput"))
                print(f"{size:>4} {layout:<8} {label:<46} {us:7.2f} µs  x{us / baseline:.2f}")
    out = {"benchmark": "policy_pick_cost", "python": platform.python_version(),
           "machine": platform.machine(), "rows": rows}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
