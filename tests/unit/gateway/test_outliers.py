"""Availability decided by the transport: outlier ejection and return (`gateway.cluster.health` through
`ClusterState`), stale engines kept in the pool on local accounting, and the dispatcher's use of both (retry
budget, stall detection) behind the real app."""

from __future__ import annotations

import asyncio
import logging

import orjson
import pytest
from fake_engines import FakeEngine, ok_script, script, serving

from gateway.app import DISPATCHER_KEY
from gateway.cluster.health import OutlierParams
from gateway.cluster.state import ClusterState
from gateway.domain import Admitted, Delta, EngineId, EngineReport, EngineUnavailable, Finished

A, B, C = EngineId("a"), EngineId("b"), EngineId("c")
PARAMS = OutlierParams(
    consecutive_failures=3, base_ejection_s=10.0, max_ejection_s=25.0, max_ejected_ratio=0.5
)


def report(engine_id: EngineId, seq: int = 1, **fields: object) -> EngineReport:
    base: dict[str, object] = {
        "engine_id": engine_id, "model": "m", "profile": "p", "backend": "sim", "role": "", "seq": seq,
        "engine_timestamp_s": 0.0, "ready": True, "draining": False, "num_running": 7, "num_waiting": 3,
        "kv_blocks_total": 100, "kv_blocks_free": 90, "kv_blocks_reserved": 0,
        "pending_prefill_tokens": 500, "running_batch_tokens": 900,
    }
    base.update(fields)
    return EngineReport(**base)  # type: ignore[arg-type]


def fleet(*engines: EngineId, params: OutlierParams = PARAMS) -> ClusterState:
    state = ClusterState(stale_after_s=1.0, snapshot_resolution_s=0.0, outlier=params)
    for e in engines:
        state.add_engine(e, 0.0)
        state.on_connect(e)
        state.on_report(e, report(e), 0.0)
    return state


def serving_ids(state: ClusterState, now_s: float) -> list[str]:
    return [e.engine_id for e in state.snapshot(now_s).serving("m")]


def test_consecutive_failures_eject_then_a_half_open_probe_brings_the_engine_back() -> None:
    state = fleet(A, B, C)
    assert not state.note_failure(A, "connect_failures", 0.1)
    assert not state.note_failure(A, "connect_failures", 0.2)
    assert state.note_failure(A, "connect_failures", 0.3)  # the third in a row ejects
    assert serving_ids(state, 0.4) == [B, C]
    assert state.snapshot(0.4).get(A).ejected  # type: ignore[union-attr]
    assert serving_ids(state, 10.3) == [A, B, C]  # half-open: in the pool for one probe
    state.note_dispatch(A, "probe", 10, 10, "", 10.3)
    assert serving_ids(state, 10.4) == [B, C]  # the probe is in flight: nothing else goes there
    assert state.note_success(A)  # the probe answered
    assert serving_ids(state, 10.5) == [A, B, C]
    state.note_finish(A, "probe")


def test_a_failed_probe_ejects_for_twice_as_long_capped() -> None:
    state = fleet(A, B, C)
    for t in (0.1, 0.2, 0.3):
        state.note_failure(A, "server_errors", t)
    state.note_dispatch(A, "p1", 10, 10, "", 10.3)
    assert state.note_failure(A, "server_errors", 10.4)  # the probe failed: 20 s now
    assert serving_ids(state, 30.3) == [B, C]
    assert serving_ids(state, 30.4) == [A, B, C]
    state.note_finish(A, "p1")
    state.note_dispatch(A, "p2", 10, 10, "", 30.4)
    assert state.note_failure(A, "server_errors", 30.5)  # 40 s, capped at 25
    assert serving_ids(state, 55.4) == [B, C] and serving_ids(state, 55.5) == [A, B, C]


def test_a_probe_that_ends_without_a_verdict_frees_the_probe_slot() -> None:
    state = fleet(A, B)
    for t in (0.1, 0.2, 0.3):
        state.note_failure(A, "stall", t)
    state.note_dispatch(A, "probe", 10, 10, "", 11.0)
    assert serving_ids(state, 11.1) == [B]
    state.note_finish(A, "probe")  # the client went away before the engine answered
    assert serving_ids(state, 11.2) == [A, B]


def test_failures_that_are_not_consecutive_never_eject() -> None:
    state = fleet(A, B)
    for i in range(10):
        state.note_failure(A, "connect_failures", float(i))
        state.note_failure(A, "connect_failures", i + 0.1)
        state.note_success(A)
    assert serving_ids(state, 11.0) == [A, B]


def test_at_most_the_configured_share_of_a_models_engines_is_ejected() -> None:
    state = fleet(A, B, C, params=OutlierParams(consecutive_failures=1, max_ejected_ratio=0.5))
    assert state.note_failure(A, "connect_failures", 0.1)  # one of three may go (at least one always may)
    assert not state.note_failure(B, "connect_failures", 0.2)  # a second would be more than half
    assert serving_ids(state, 0.3) == [B, C]
    lone = fleet(A, params=OutlierParams(consecutive_failures=1, max_ejected_ratio=0.0))
    assert lone.note_failure(A, "connect_failures", 0.1)  # even a ratio of 0 lets one go
    assert serving_ids(lone, 0.2) == []


def test_a_success_ends_an_ejection_at_once() -> None:
    state = fleet(A, B)
    for t in (0.1, 0.2, 0.3):
        state.note_failure(A, "connect_failures", t)
    assert serving_ids(state, 1.0) == [B]
    assert state.note_success(A)  # a request sent before the ejection answered after all
    assert serving_ids(state, 1.1) == [A, B]


def test_a_stale_engine_stays_in_the_pool_with_local_accounting() -> None:
    state = fleet(A, B)
    state.note_dispatch(A, "r1", 100, 60, "", 0.5)  # 160 tokens = 10 blocks of 16
    state.on_report(B, report(B, seq=2, engine_timestamp_s=1.5), 1.5)
    snap = state.snapshot(2.0)
    a, b = snap.get(A), snap.get(B)
    assert a is not None and b is not None
    assert [e.engine_id for e in snap.serving("m")] == [A, B]
    assert (a.stale, a.ready, a.num_running, a.num_waiting) == (True, True, 1, 0)
    assert (a.pending_prefill_tokens, a.unreported_requests) == (0, 0)
    assert (a.kv_blocks_total, a.kv_blocks_free, a.lens, a.queue_length) == (100, 90, None, 1)
    assert (b.stale, b.num_running, b.num_waiting) == (False, 7, 3)
    state.on_report(A, report(A, seq=2, engine_timestamp_s=2.0, draining=True), 2.1)
    assert serving_ids(state, 2.2) == [B]  # the engine's own status still takes it out


# ---- the dispatcher behind the real app --------------------------------------------------------------------

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def test_a_failing_engine_is_ejected_and_no_longer_costs_a_retry() -> None:
    broken = FakeEngine("a", script(EngineUnavailable("connection refused")))
    healthy = FakeEngine("b", ok_script("ok"))
    async with serving(broken, healthy, outlier={"consecutive_failures": 2}) as client:
        for _ in range(8):
            resp = await client.post("/v1/chat/completions", json=CHAT)
            assert resp.status == 200
        metrics = await (await client.get("/metrics")).text()
    assert len(broken.requests) == 2  # ejected after its second failure: later requests go straight to b
    assert len(healthy.requests) == 8
    assert 'switchyard_outlier_ejections_total{engine="a",reason="connect_failures"} 1.0' in metrics
    assert 'switchyard_engine_ejected{engine="a"} 1.0' in metrics
    assert "switchyard_dispatch_retries_total 2.0" in metrics


async def test_a_spent_retry_budget_answers_503_without_retrying() -> None:
    broken = FakeEngine("a", script(EngineUnavailable("HTTP 503", server_error=True)))
    healthy = FakeEngine("b", ok_script("ok"))
    budget = {"budget_ratio": 0.0, "min_retries_per_s": 0.0}
    async with serving(broken, healthy, retry=budget, outlier={"consecutive_failures": 100}) as client:
        resp = await client.post("/v1/chat/completions", json=CHAT)  # round robin: a first
        body = orjson.loads(await resp.read())
        metrics = await (await client.get("/metrics")).text()
    assert resp.status == 503 and body["error"]["code"] == "no_engine_available"
    assert "retry budget exhausted" not in body["error"]["message"]  # internals stay in the log
    assert healthy.requests == []
    assert "switchyard_retry_budget_exhausted_total 1.0" in metrics
    assert 'switchyard_routing_decisions_total{policy="round_robin",reason="retry_budget"} 1.0' in metrics


async def wait_for(condition: object, tries: int = 2000) -> None:
    for _ in range(tries):
        if callable(condition) and condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition never held")


async def test_an_engine_that_stalls_after_its_first_event_ends_the_stream_with_an_error() -> None:
    stalled = FakeEngine("a", script(Admitted(5), 3600.0))  # admitted, then nothing: no retry after Admitted
    async with serving(stalled, engine_stall_timeout_s=5.0) as client:
        watch = client.server.app[DISPATCHER_KEY].stall_watch
        assert watch is not None

        async def stream_text() -> tuple[int, str]:
            resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
            return resp.status, await resp.text()

        first = asyncio.create_task(stream_text())
        clock = watch.clock  # the app's manual clock: the watch's own task scans by it too
        await wait_for(lambda: len(stalled.requests) == 1)
        watch.scan(clock.now())
        clock.advance(4.9)
        watch.scan(clock.now())
        await asyncio.sleep(0.01)
        assert not first.done()
        clock.advance(0.1)
        watch.scan(clock.now())
        status, text = await first
        metrics = await (await client.get("/metrics")).text()
    assert status == 200 and '"code":"engine_failure"' in text and "no event for 5 s" in text
    assert text.count('"error"') == 1 and text.endswith("data: [DONE]\n\n")
    assert stalled.closed_streams == 1  # the engine stream was closed (the engine aborts the request)
    assert 'switchyard_stream_errors_total{reason="stall"} 1.0' in metrics
    assert 'switchyard_outlier_ejections_total{engine="a",reason="stall"} 1.0' not in metrics  # one strike


async def test_an_engine_silent_before_its_first_event_is_retried_elsewhere() -> None:
    silent = FakeEngine("a", script(3600.0))  # not even admitted
    healthy = FakeEngine("b", ok_script("fine"))
    one_strike = {"consecutive_failures": 1}
    async with serving(silent, healthy, engine_stall_timeout_s=5.0, outlier=one_strike) as client:
        watch = client.server.app[DISPATCHER_KEY].stall_watch
        assert watch is not None
        clock = watch.clock
        pending = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))  # round robin: a first
        await wait_for(lambda: len(silent.requests) == 1)
        watch.scan(clock.now())
        clock.advance(5.0)
        watch.scan(clock.now())
        resp = await pending
        body = orjson.loads(await resp.read())
        metrics = await (await client.get("/metrics")).text()
    assert resp.status == 200 and body["choices"][0]["message"]["content"] == "fine"
    assert silent.closed_streams == 1 and len(healthy.requests) == 1
    assert 'switchyard_outlier_ejections_total{engine="a",reason="stall"} 1.0' in metrics
    assert "switchyard_dispatch_retries_total 1.0" in metrics


async def test_a_slow_consumer_is_not_a_stalled_engine() -> None:
    watch_engine = FakeEngine("a", script(Admitted(5), Delta("x", num_tokens=1), Finished("stop", 5, 1)))
    async with serving(watch_engine, engine_stall_timeout_s=5.0) as client:
        dispatcher = client.server.app[DISPATCHER_KEY]
        watch = dispatcher.stall_watch
        assert watch is not None
        # Drive the dispatcher directly with a sink that blocks: the attempt is not awaiting its engine.
        release = asyncio.Event()

        class SlowSink:
            async def on_event(self, index: int, event: object) -> None:
                await release.wait()

        from gateway.dispatch.features import RoutingHints  # noqa: PLC0415
        from gateway.domain import ChatTurn, EngineRequest  # noqa: PLC0415

        request = EngineRequest(request_id="slow", model="m", messages=(ChatTurn("user", "hi"),))
        task = asyncio.create_task(dispatcher.run([request], RoutingHints(arrival_s=0.0), SlowSink()))
        await wait_for(lambda: len(watch_engine.requests) == 1)
        await asyncio.sleep(0.01)
        for t in (0.0, 10.0, 20.0):
            assert watch.scan(t) == 0
        release.set()
        await task


async def test_each_routing_decision_is_logged_with_its_reason_and_scores_at_debug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engines = FakeEngine("a", ok_script("x")), FakeEngine("b", ok_script("y"))
    caplog.set_level(logging.DEBUG, logger="gateway.dispatch.dispatcher")
    async with serving(*engines, policy={"name": "prism"}) as client:
        resp = await client.post("/v1/chat/completions", json=CHAT)
        assert resp.status == 200
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("routing: ")]
    assert len(lines) == 1
    assert "policy=prism reason=dispatch" in lines[0] and "scores=a:" in lines[0] and ", b:" in lines[0]
