"""`ClusterState`, the pure cluster state: events in, snapshots out, every time passed as an argument."""

from __future__ import annotations

import ast
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gateway.cluster.health import OutlierParams
from gateway.cluster.state import ClusterState
from gateway.domain import (
    EngineDescription,
    EngineId,
    EngineReport,
    FutureLoad,
    LensState,
    QoEReport,
    RequestPrediction,
)

A, B = EngineId("a"), EngineId("b")
STATE_PY = Path(__file__).resolve().parents[3] / "gateway" / "cluster" / "state.py"


def report(seq: int, engine_ts_s: float, engine_id: EngineId = A, **fields: Any) -> EngineReport:
    base: dict[str, Any] = {
        "engine_id": engine_id,
        "model": "m",
        "profile": "p",
        "backend": "sim",
        "role": "",
        "seq": seq,
        "engine_timestamp_s": engine_ts_s,
        "ready": True,
        "draining": False,
        "num_running": 0,
        "num_waiting": 0,
        "kv_blocks_total": 100,
        "kv_blocks_free": 100,
        "kv_blocks_reserved": 0,
        "pending_prefill_tokens": 0,
        "running_batch_tokens": 0,
    }
    return EngineReport(**(base | fields))


def describe(engine_id: EngineId = A) -> EngineDescription:
    return EngineDescription(engine_id, "m", "p", "sim", "", 4096, 32, 8)


def connected(*engine_ids: EngineId, now_s: float = 10.0, **kwargs: Any) -> ClusterState:
    """Engines added, described, connected and reported once at `now_s` (engine clock = now_s)."""
    state = ClusterState(stale_after_s=1.0, session_ttl_s=60.0, snapshot_resolution_s=0.0, **kwargs)
    for engine_id in engine_ids:
        state.add_engine(engine_id, now_s)
        state.on_describe(engine_id, describe(engine_id))
        state.on_connect(engine_id)
        state.on_report(engine_id, report(1, now_s, engine_id), now_s)
    return state


def test_lifecycle_from_added_to_ready_to_disconnected() -> None:
    state = ClusterState(stale_after_s=1.0)
    state.add_engine(A, 5.0)
    snap = state.snapshot(5.5)
    view = snap.engines[0]
    assert (view.model, view.ready, view.stale, snap.state_age_s(view)) == ("", False, True, 0.5)
    assert view.block_size == 16
    state.on_describe(A, describe())
    view = state.snapshot(6.0).engines[0]
    assert (view.model, view.ready, view.block_size, view.max_num_seqs) == ("m", False, 32, 8)
    state.on_connect(A)
    state.on_report(A, report(1, 100.0, num_running=3, kv_blocks_free=40), 6.0)
    snap = state.snapshot(6.25)
    view = snap.engines[0]
    assert (view.ready, view.stale, snap.state_age_s(view), view.num_running, view.kv_free_ratio) == (
        True,
        False,
        0.25,
        3,
        0.4,
    )
    state.on_disconnect(A)
    view = state.snapshot(6.5).engines[0]
    assert (view.engine_id, view.ready, view.num_running) == (A, False, 3)
    assert state.models() == ("m",) and state.latest_reports()[A].seq == 1
    with pytest.raises(ValueError):
        state.add_engine(A, 7.0)
    state.remove_engine(A)
    assert state.engine_ids() == () and A not in state


def test_views_carry_the_hardware_price_and_combo_stale_or_not() -> None:
    """CAUCHY needs each engine's GPU, TP, price (GetInfo) and combo (its identity, on every report)."""
    state = ClusterState(stale_after_s=1.0, snapshot_resolution_s=0.0)
    state.add_engine(A, 5.0)
    state.on_describe(A, replace(describe(), gpu="H20-NVL-96GB", tensor_parallel=2, hourly_price_usd=3.0))
    view = state.snapshot(5.0).engines[0]
    assert (view.gpu, view.tensor_parallel, view.hourly_price_usd, view.combo) == ("H20-NVL-96GB", 2, 3.0, "")
    state.on_connect(A)
    state.on_report(A, report(1, 6.0, combo="1xh800+2xh20"), 6.0)
    fresh, stale = state.snapshot(6.0).engines[0], state.snapshot(9.0).engines[0]
    assert not fresh.stale and stale.stale
    for view in (fresh, stale):
        assert (view.gpu, view.tensor_parallel, view.hourly_price_usd, view.combo) == (
            "H20-NVL-96GB", 2, 3.0, "1xh800+2xh20")


def test_views_carry_the_qoe_fit_and_pull_throughput_stale_or_not() -> None:
    """CascadeInfer: properties of the engine, not of its load, so a stale view keeps them; the agent pushes
    them in every report, so the latest report's values win (None / 0 when it has none)."""
    state = connected(A, now_s=0.0)
    assert (state.snapshot(0.0).engines[0].qoe, state.snapshot(0.0).engines[0].transfer_bytes_per_s) == (
        None, 0.0)
    qoe = QoEReport(d=(7e-3, 3.4e-5, 1.2e-7, 1.4e-12, 0.0), samples=400, mean_relative_error=0.06)
    state.on_report(A, report(2, 0.1, qoe=qoe, transfer_bytes_per_s=2.5e10), 0.1)
    fresh, stale = state.snapshot(0.1).engines[0], state.snapshot(5.0).engines[0]
    assert not fresh.stale and stale.stale
    for view in (fresh, stale):
        assert (view.qoe, view.transfer_bytes_per_s) == (qoe, 2.5e10)
    state.on_report(A, report(3, 5.0), 5.0)  # e.g. a restarted agent: no fit yet
    assert (state.snapshot(5.0).engines[0].qoe, state.snapshot(5.0).engines[0].transfer_bytes_per_s) == (
        None, 0.0)


def test_staleness_follows_the_time_argument() -> None:
    state = connected(A, now_s=10.0)
    assert state.snapshot(11.0).engines[0].stale is False
    snap = state.snapshot(11.5)
    view = snap.engines[0]
    assert (view.stale, snap.state_age_s(view), view.ready) == (True, 1.5, True)
    state.on_report(A, report(2, 11.5), 11.5)
    assert state.snapshot(11.5).engines[0].stale is False


def test_snapshot_cache_until_change_stale_boundary_or_resolution() -> None:
    state = ClusterState(stale_after_s=1.0, snapshot_resolution_s=10.0)
    state.add_engine(A, 0.0)
    state.on_connect(A)
    state.on_report(A, report(1, 0.0), 0.0)
    first = state.snapshot(0.0)
    assert state.snapshot(0.5) is first
    second = state.snapshot(1.1)  # past the staleness boundary
    assert second is not first and second.engines[0].stale
    state.note_dispatch(A, "r1", 10, 5, "", 1.1)
    third = state.snapshot(1.1)
    assert third is not second and third.engines[0].inflight_tokens == 15
    short = ClusterState(snapshot_resolution_s=0.005)
    short.add_engine(A, 0.0)
    cached = short.snapshot(0.0)
    assert short.snapshot(0.004) is cached and short.snapshot(0.005) is not cached


def test_unreported_cleared_by_a_report_taken_after_the_dispatch() -> None:
    state = ClusterState()
    state.add_engine(A, 1000.0)
    state.on_connect(A)
    state.on_report(A, report(2, 50.0), 1000.0)  # engine clock 50.0 at gateway 1000.0
    state.note_dispatch(A, "r1", 100, 20, "", 1000.2)  # engine time ~50.2
    state.note_dispatch(A, "r2", 30, 10, "", 1000.2)
    view = state.snapshot(1000.2).engines[0]
    assert (view.inflight_requests, view.inflight_tokens, view.unreported_tokens, view.queue_length) == (
        2,
        160,
        160,
        2,
    )
    state.on_report(A, report(3, 50.1), 1000.3)  # taken before the dispatch
    assert state.snapshot(1000.3).engines[0].unreported_requests == 2
    state.on_report(A, report(4, 50.25, num_running=2), 1000.35)
    view = state.snapshot(1000.35).engines[0]
    assert (view.unreported_requests, view.unreported_tokens, view.queue_length) == (0, 0, 2)
    state.note_finish(A, "r1")
    state.note_finish(A, "r1")  # idempotent
    state.note_finish(A, "unknown")
    state.note_finish(B, "r2")  # unknown engine: ignored
    assert (state.snapshot(1000.4).engines[0].inflight_tokens) == 40


def test_first_report_of_a_connection_clears_unanchored_dispatches() -> None:
    state = ClusterState()
    state.add_engine(A, 0.0)
    state.note_dispatch(A, "r1", 10, 10, "", 0.0)  # no report yet: no anchor
    assert state.snapshot(0.0).engines[0].unreported_tokens == 20
    state.on_connect(A)
    state.on_report(A, report(7, -5.0), 0.1)  # any first report clears it, whatever its clock
    view = state.snapshot(0.1).engines[0]
    assert (view.unreported_tokens, view.inflight_tokens) == (0, 20)
    with pytest.raises(KeyError):
        state.note_dispatch(B, "r2", 1, 1, "", 0.2)


def test_duplicates_ignored_and_reconnect_restarts_the_sequence() -> None:
    state = connected(A, now_s=0.0)
    state.on_report(A, report(5, 5.0, num_running=5), 0.1)
    state.on_report(A, report(4, 4.0, num_running=4), 0.2)
    state.on_report(A, report(5, 5.0, num_running=9), 0.3)
    snap = state.snapshot(0.3)
    view = snap.engines[0]
    assert (view.seq, view.num_running, snap.state_age_s(view)) == (5, 5, pytest.approx(0.2))
    state.on_disconnect(A)
    state.on_connect(A)
    state.on_report(A, report(1, 0.5, num_running=1), 0.4)  # a restarted agent
    view = state.snapshot(0.4).engines[0]
    assert (view.ready, view.seq, view.num_running) == (True, 1, 1)


def test_sessions_ttl_and_bound() -> None:
    state = connected(A, B, now_s=1000.0)
    state.note_dispatch(A, "r1", 1, 1, "s1", 1000.0)
    state.note_dispatch(B, "r2", 1, 1, "s2", 1030.0)
    assert state.session_lookup("s1", 1030.0) == (A, 1000.0)
    assert state.session_lookup("s1", 1060.5) == (None, 0.0)
    assert state.session_lookup("unknown", 1030.0) == (None, 0.0)
    assert state.prune_sessions(1060.5) == 1
    bounded = connected(A, max_sessions=2)
    for i in range(3):
        bounded.note_dispatch(A, f"r{i}", 1, 1, f"s{i}", 10.0)
    assert [bounded.session_lookup(f"s{i}", 10.0)[0] for i in range(3)] == [None, A, A]


def test_engines_are_ordered_by_id_and_reports_set_identity() -> None:
    state = connected(B, A)
    state.on_report(A, report(2, 10.0, model="other", profile="q"), 10.0)
    views = state.snapshot(10.0).engines
    assert [(v.engine_id, v.model, v.profile) for v in views] == [(A, "other", "q"), (B, "m", "p")]


def test_state_module_imports_no_io_or_clock() -> None:
    tree = ast.parse(STATE_PY.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    assert names & {"asyncio", "aiohttp", "grpc", "prometheus_client", "time"} == set()
    # Of the ground floor, only the pure prefix-key definition (the span of the index's keys).
    switchyard = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
                  and n.module.startswith("switchyard")}
    assert switchyard <= {"switchyard.prefix"}


def test_lens_state_and_last_iteration_reach_the_view() -> None:
    state = connected(A, now_s=0.0)
    lens = LensState(
        predicted_batch_latency_s=0.02,
        pending_work_tokens=900.0,
        effective_free_kv_blocks=70,
        peak_throughput_tokens_per_s=12_000.0,
        prediction_error_ratio=0.1,
        slo_risk=True,
    )
    state.on_report(A, report(2, 0.1, lens=lens, last_iteration_s=0.03), 0.1)
    view = state.snapshot(0.1).engines[0]
    assert (view.lens, view.last_iteration_s) == (lens, 0.03)
    assert view.has_lens
    state.on_report(A, report(3, 0.2), 0.2)  # LENS off
    assert not state.snapshot(0.2).engines[0].has_lens


def test_unreported_prompt_tokens_follow_the_unreported_dispatches() -> None:
    state = connected(A, now_s=0.0)
    state.note_dispatch(A, "r1", 100, 20, "", 0.1)
    state.note_dispatch(A, "r2", 30, 10, "", 0.2)
    view = state.snapshot(0.2).engines[0]
    assert (view.unreported_requests, view.unreported_tokens, view.unreported_prompt_tokens) == (2, 160, 130)
    state.note_finish(A, "r2")  # finished before any report saw it
    assert state.snapshot(0.2).engines[0].unreported_prompt_tokens == 100
    state.on_report(A, report(2, 0.15), 0.25)  # taken after r1's dispatch
    view = state.snapshot(0.25).engines[0]
    assert (view.unreported_requests, view.unreported_prompt_tokens) == (0, 0)


def test_latency_window_means_and_expiry() -> None:
    state = connected(A, B, now_s=0.0, latency_window_s=2.0)
    state.note_latency(A, 0.2, 1.0, 1.0)
    state.note_latency(A, 0.4, 3.0, 2.0)
    state.note_latency(A, -1.0, -1.0, 2.0)  # clamped to 0
    state.note_latency(EngineId("gone"), 1.0, 1.0, 2.0)  # unknown engine: ignored
    view = state.snapshot(2.5).engines[0]
    assert (view.recent_ttft_s, view.recent_e2e_s, view.recent_latency_samples) == (
        pytest.approx(0.2),
        pytest.approx(4 / 3),
        3,
    )
    assert state.snapshot(2.5).engines[1].recent_latency_samples == 0
    view = state.snapshot(3.0).engines[0]  # the sample at 1.0 is 2 s old: out
    assert (view.recent_ttft_s, view.recent_e2e_s, view.recent_latency_samples) == (
        pytest.approx(0.2),
        pytest.approx(1.5),
        2,
    )  # running sums: exact up to rounding
    assert state.snapshot(4.0).engines[0].recent_latency_samples == 0
    with pytest.raises(ValueError):
        ClusterState(latency_window_s=0.0)


def test_a_cached_snapshot_is_not_reused_past_a_latency_sample_s_expiry() -> None:
    state = ClusterState(stale_after_s=100.0, snapshot_resolution_s=10.0, latency_window_s=1.0)
    state.add_engine(A, 0.0)
    state.on_connect(A)
    state.on_report(A, report(1, 0.0), 0.0)
    state.note_latency(A, 0.1, 0.5, 0.0)
    first = state.snapshot(0.5)
    assert first.engines[0].recent_latency_samples == 1 and state.snapshot(0.9) is first
    assert state.snapshot(1.0).engines[0].recent_latency_samples == 0


def test_star_predictions_are_kept_per_round_and_dropped_when_stale_or_disconnected() -> None:
    state = connected(A, now_s=0.0)
    preds = (
        RequestPrediction("r1", current_tokens=500, predicted_remaining_tokens=120.0, generated_tokens=40),
    )
    load = FutureLoad(round=1, round_tokens=20, load=(520.0, 540.0))
    state.on_report(A, report(2, 0.1, predictions=preds, future_load=load), 0.1)
    state.on_report(A, report(3, 0.2), 0.2)  # no new round in this push: the last round's figures stay
    view = state.snapshot(0.2).engines[0]
    assert (view.predictions, view.future_load) == (preds, load)
    assert state.engine_of("r1") is None  # predictions are the engine's; dispatches are the gateway's
    state.note_dispatch(A, "r1", 10, 10, "", 0.2)
    assert state.engine_of("r1") == A
    stale = state.snapshot(5.0).engines[0]
    assert stale.stale and stale.predictions == () and stale.future_load is None
    state.on_disconnect(A)
    state.on_connect(A)
    state.on_report(A, report(1, 6.0), 6.0)
    assert state.snapshot(6.0).engines[0].future_load is None


def test_a_snapshot_reuses_the_views_of_engines_nothing_happened_to() -> None:
    state = connected(A, B, now_s=10.0)
    first = state.snapshot(10.0)
    state.note_dispatch(A, "r1", 100, 10, "", 10.1)
    second = state.snapshot(10.1)
    assert second.engines[1] is first.engines[1]  # b: untouched
    assert second.engines[0] is not first.engines[0] and second.engines[0].inflight_requests == 1
    assert second.state_age_s(second.engines[1]) == pytest.approx(0.1)  # age from the snapshot, not the view
    state.on_report(B, report(2, 10.2, B), 10.2)
    third = state.snapshot(10.2)
    assert third.engines[0] is second.engines[0] and third.engines[1].seq == 2


def test_a_view_is_rebuilt_when_time_alone_changes_it() -> None:
    state = connected(A, B, now_s=10.0, latency_window_s=0.5)
    state.note_latency(A, 0.1, 0.2, 10.0)
    before = state.snapshot(10.0)
    assert before.engines[0].recent_latency_samples == 1
    state.on_report(B, report(2, 10.4, B), 10.4)
    mid = state.snapshot(10.4)
    assert mid.engines[0] is before.engines[0]
    after = state.snapshot(10.5)  # a's sample left the window
    assert after.engines[0].recent_latency_samples == 0 and after.engines[1] is mid.engines[1]
    stale = state.snapshot(11.01)  # a's report (10.0) is older than 1 s, b's (10.4) is not
    assert (stale.engines[0].stale, stale.engines[1].stale) == (True, False)
    assert stale.engines[1] is mid.engines[1]


@pytest.mark.parametrize("seed", range(6))
def test_reused_views_equal_views_built_afresh(seed: int) -> None:
    """Random events on a small fleet; after each snapshot, a state that replays the same events and takes
    its first snapshot then (so builds every view) sees the same views."""
    rng = random.Random(seed)
    engines = [EngineId(e) for e in "abcd"]
    kwargs: dict[str, Any] = {"stale_after_s": 0.3, "latency_window_s": 0.4, "snapshot_resolution_s": 0.0,
                              "outlier": OutlierParams(consecutive_failures=2, base_ejection_s=0.2)}
    events: list[tuple[str, tuple[Any, ...]]] = []

    def apply(target: ClusterState, name: str, args: tuple[Any, ...]) -> None:
        getattr(target, name)(*args)

    state = ClusterState(**kwargs)
    now_s, seqs, inflight = 0.0, dict.fromkeys(engines, 0), []
    for engine_id in engines:
        for name, args in (("add_engine", (engine_id, now_s)),
                           ("on_describe", (engine_id, describe(engine_id))), ("on_connect", (engine_id,))):
            events.append((name, args))
            apply(state, name, args)
    for step in range(160):
        now_s += rng.choice((0.0, 0.01, 0.05, 0.2))
        engine_id = rng.choice(engines)
        kind = rng.random()
        if kind < 0.3:
            seqs[engine_id] += 1
            reported = report(seqs[engine_id], now_s, engine_id, num_running=rng.randrange(5),
                              kv_blocks_free=rng.randrange(100))
            event: tuple[str, tuple[Any, ...]] = ("on_report", (engine_id, reported, now_s))
        elif kind < 0.55:
            request_id = f"r{step}"
            inflight.append((engine_id, request_id))
            event = ("note_dispatch", (engine_id, request_id, rng.randrange(1, 500), 20, "", now_s))
        elif kind < 0.7 and inflight:
            event = ("note_finish", inflight.pop(rng.randrange(len(inflight))))
        elif kind < 0.8:
            event = ("note_latency", (engine_id, rng.random(), rng.random(), now_s))
        elif kind < 0.88:
            event = ("note_failure", (engine_id, "server_errors", now_s))
        elif kind < 0.92:
            event = ("note_success", (engine_id,))
        elif kind < 0.96:
            event = ("on_disconnect", (engine_id,))
        else:
            event = ("on_connect", (engine_id,))
        events.append(event)
        apply(state, *event)
        if step % 3:
            continue
        snapshot = state.snapshot(now_s)
        fresh = ClusterState(**kwargs)
        for name, args in events:
            apply(fresh, name, args)
        assert snapshot.engines == fresh.snapshot(now_s).engines, f"step {step}"
