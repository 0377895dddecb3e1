"""The cluster store against in-process fake engine clients and a manual clock."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from gateway.cluster.store import Backoff, ClusterStore
from gateway.domain import (
    EngineDescription,
    EngineEvent,
    EngineId,
    EngineReport,
    EngineRequest,
    EngineUnavailable,
)
from switchyard.clock import ManualClock

A, B = EngineId("a"), EngineId("b")


def report(seq: int, engine_ts_s: float, **fields: object) -> EngineReport:
    base: dict[str, object] = {
        "engine_id": A,
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
    return EngineReport(**(base | fields))  # type: ignore[arg-type]


class FakeEngine:
    """An engine client whose state stream is fed by the test; `None` in the feed breaks the stream."""

    def __init__(self, engine_id: EngineId, model: str = "m") -> None:
        self.engine_id = engine_id
        self.model = model
        self.feed: asyncio.Queue[EngineReport | None] = asyncio.Queue()
        self.connects = 0
        self.fail_describe = 0
        self.closed = False

    @property
    def address(self) -> str:
        return f"fake://{self.engine_id}"

    async def describe(self) -> EngineDescription:
        if self.fail_describe:
            self.fail_describe -= 1
            raise EngineUnavailable("describe refused")
        return EngineDescription(self.engine_id, self.model, "p", "sim", "", 4096, 32, 8)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineEvent]:
        raise EngineUnavailable("not used here")
        yield  # pragma: no cover

    async def abort(self, request_id: str) -> None:
        return None

    async def watch_state(self) -> AsyncIterator[EngineReport]:
        self.connects += 1
        while True:
            item = await self.feed.get()
            if item is None:
                raise EngineUnavailable("stream broke")
            yield item

    async def close(self) -> None:
        self.closed = True


class Sleeps:
    """Records backoff delays and returns at once."""

    def __init__(self) -> None:
        self.delays_s: list[float] = []

    async def __call__(self, delay_s: float) -> None:
        self.delays_s.append(delay_s)
        await asyncio.sleep(0)


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1000.0)


def make_store(
    clock: ManualClock, *engines: FakeEngine, sleep: Callable[[float], Awaitable[None]] | None = None
) -> ClusterStore:
    return ClusterStore(
        {e.engine_id: e for e in engines},
        clock,
        stale_after_s=1.0,
        backoff=Backoff(initial_s=0.1, max_s=0.5, multiplier=2.0, jitter_ratio=0.2),
        rand=random.Random(7).random,
        sleep=sleep or Sleeps(),
        session_ttl_s=60.0,
        snapshot_resolution_s=0.0,
    )


async def test_engine_is_described_then_ready_after_a_report(clock: ManualClock) -> None:
    fake = FakeEngine(A)
    async with make_store(clock, fake) as store:
        assert store.snapshot().engines[0].ready is False
        await settle()
        view = store.snapshot().engines[0]
        assert (view.model, view.ready, view.stale, view.block_size, view.max_num_seqs) == (
            "m",
            False,
            True,
            32,
            8,
        )
        assert store.models() == ("m",)
        assert store.ready_count() == 0
        fake.feed.put_nowait(report(1, 50.0, num_running=3, num_waiting=2, kv_blocks_free=40))
        await settle()
        view = store.snapshot().engines[0]
        assert (view.ready, view.stale, view.num_running, view.num_waiting, view.kv_free_ratio) == (
            True,
            False,
            3,
            2,
            0.4,
        )
        assert store.ready_count() == 1
        assert store.latest_reports()[A].seq == 1
    assert fake.closed


async def test_staleness_marking_from_the_clock(clock: ManualClock) -> None:
    fake = FakeEngine(A)
    async with make_store(clock, fake) as store:
        fake.feed.put_nowait(report(1, 50.0))
        await settle()
        clock.advance(1.0)
        snap = store.snapshot()
        view = snap.engines[0]
        assert (view.stale, snap.state_age_s(view)) == (False, 1.0)
        clock.advance(0.5)
        snap = store.snapshot()
        view = snap.engines[0]
        assert (view.stale, snap.state_age_s(view), view.ready) == (True, 1.5, True)
        assert store.ready_count() == 1  # stale: routed on local accounting, still in the pool
        fake.feed.put_nowait(report(2, 51.5))
        await settle()
        assert store.snapshot().engines[0].stale is False


async def test_snapshot_is_cached_until_change_or_stale_boundary(clock: ManualClock) -> None:
    fake = FakeEngine(A)
    store = ClusterStore({A: fake}, clock, stale_after_s=1.0, snapshot_resolution_s=10.0, sleep=Sleeps())
    async with store:
        fake.feed.put_nowait(report(1, 50.0))
        await settle()
        first = store.snapshot()
        clock.advance(0.5)
        assert store.snapshot() is first
        clock.advance(0.6)  # past the staleness boundary
        second = store.snapshot()
        assert second is not first and second.engines[0].stale
        store.note_dispatch(A, "r1", 10, 5, "", clock.now())
        third = store.snapshot()
        assert third is not second and third.engines[0].inflight_tokens == 15


async def test_optimistic_inflight_cleared_by_a_newer_report(clock: ManualClock) -> None:
    fake = FakeEngine(A)
    async with make_store(clock, fake) as store:
        fake.feed.put_nowait(report(1, 50.0))  # engine clock 50.0 at gateway 1000.0
        await settle()
        clock.advance(0.2)  # dispatch at engine time ~50.2
        store.note_dispatch(A, "r1", 100, 20, "", clock.now())
        store.note_dispatch(A, "r2", 30, 10, "", clock.now())
        view = store.snapshot().engines[0]
        assert (view.inflight_requests, view.inflight_tokens) == (2, 160)
        assert (view.unreported_requests, view.unreported_tokens, view.queue_length) == (2, 160, 2)
        fake.feed.put_nowait(report(2, 50.1, num_running=0))  # taken before the dispatch: still unreported
        await settle()
        assert store.snapshot().engines[0].unreported_requests == 2
        fake.feed.put_nowait(report(3, 50.25, num_running=2))  # taken after it
        await settle()
        view = store.snapshot().engines[0]
        assert (view.unreported_requests, view.unreported_tokens, view.queue_length) == (0, 0, 2)
        assert (view.inflight_requests, view.inflight_tokens) == (2, 160)
        store.note_finish(A, "r1")
        store.note_finish(A, "r1")  # idempotent
        store.note_finish(A, "unknown")
        view = store.snapshot().engines[0]
        assert (view.inflight_requests, view.inflight_tokens) == (1, 40)
        store.note_finish(A, "r2")
        assert store.snapshot().engines[0].inflight_tokens == 0


async def test_note_finish_before_any_report_clears_unreported(clock: ManualClock) -> None:
    fake = FakeEngine(A)
    store = make_store(clock, fake)
    store.note_dispatch(A, "r1", 10, 10, "", clock.now())
    assert store.snapshot().engines[0].unreported_tokens == 20
    store.note_finish(A, "r1")
    view = store.snapshot().engines[0]
    assert (view.inflight_tokens, view.unreported_tokens, view.unreported_requests) == (0, 0, 0)
    with pytest.raises(KeyError):
        store.note_dispatch(EngineId("nope"), "r2", 1, 1, "", clock.now())


async def test_duplicate_and_out_of_order_reports_are_ignored(clock: ManualClock) -> None:
    fake = FakeEngine(A)
    async with make_store(clock, fake) as store:
        fake.feed.put_nowait(report(5, 50.0, num_running=5))
        fake.feed.put_nowait(report(4, 49.0, num_running=4))
        fake.feed.put_nowait(report(5, 50.0, num_running=9))
        await settle()
        view = store.snapshot().engines[0]
        assert (view.seq, view.num_running) == (5, 5)


async def test_reconnect_with_backoff_marks_engine_not_ready_meanwhile(clock: ManualClock) -> None:
    fake = FakeEngine(A)
    sleeps = Sleeps()
    gate = asyncio.Event()

    async def gated_sleep(delay_s: float) -> None:
        await sleeps(delay_s)
        await gate.wait()

    async with make_store(clock, fake, sleep=gated_sleep) as store:  # holds the engine in backoff
        fake.feed.put_nowait(report(1, 50.0, num_running=3))
        await settle()
        assert store.snapshot().engines[0].ready is True
        fake.feed.put_nowait(None)  # the stream breaks
        await settle()
        view = store.snapshot().engines[0]
        assert (view.engine_id, view.ready, view.num_running) == (A, False, 3)  # kept, marked not ready
        assert not store.is_connected(A)
        assert sleeps.delays_s == [pytest.approx(0.1 * (0.8 + 0.4 * random.Random(7).random()))]
        gate.set()
        await settle()
        assert fake.connects == 2
        fake.feed.put_nowait(report(1, 0.5, num_running=1))  # a restarted agent: seq and clock start over
        await settle()
        view = store.snapshot().engines[0]
        assert (view.ready, view.seq, view.num_running) == (True, 1, 1)


async def test_backoff_grows_exponentially_and_resets_after_success(clock: ManualClock) -> None:
    fake = FakeEngine(A)
    fake.fail_describe = 4
    sleeps = Sleeps()
    async with make_store(clock, fake, sleep=sleeps) as store:
        await settle()
        draws = random.Random(7)
        expected = [base * (0.8 + 0.4 * draws.random()) for base in (0.1, 0.2, 0.4, 0.5)]
        assert sleeps.delays_s == pytest.approx(expected)
        fake.feed.put_nowait(report(1, 50.0))
        await settle()
        fake.feed.put_nowait(None)
        await settle()
        assert sleeps.delays_s[4] == pytest.approx(0.1 * (0.8 + 0.4 * draws.random()))
        assert store.snapshot().engines[0].model == "m"


def test_backoff_delays() -> None:
    backoff = Backoff(initial_s=0.1, max_s=1.0, multiplier=3.0, jitter_ratio=0.5)
    assert [backoff.delay_s(n, 0.5) for n in range(4)] == pytest.approx([0.1, 0.3, 0.9, 1.0])
    assert backoff.delay_s(0, 0.0) == pytest.approx(0.05)
    assert backoff.delay_s(10_000, 1.0) == pytest.approx(1.5)


async def test_stop_leaves_no_tasks(clock: ManualClock) -> None:
    fakes = [FakeEngine(A), FakeEngine(B)]
    store = make_store(clock, *fakes)
    before = asyncio.all_tasks()
    await store.start()
    await settle()
    assert len(asyncio.all_tasks() - before) == 2
    await store.stop()
    assert asyncio.all_tasks() - before == set()
    assert all(f.closed for f in fakes)
    assert [v.ready for v in store.snapshot().engines] == [False, False]


async def test_engines_added_after_start_are_watched(clock: ManualClock) -> None:
    async with make_store(clock, FakeEngine(B)) as store:
        late = FakeEngine(A, model="other")
        store.add_engine(A, late)
        await settle()
        late.feed.put_nowait(report(1, 1.0, model="other"))
        await settle()
        assert [(v.engine_id, v.model, v.ready) for v in store.snapshot().engines] == [
            (A, "other", True),
            (B, "m", False),
        ]
        assert store.models() == ("m", "other")
        with pytest.raises(ValueError):
            store.add_engine(A, late)
        await store.remove_engine(A)
        assert late.closed and store.engine_ids() == (B,)


async def test_sessions_lookup_and_ttl_pruning(clock: ManualClock) -> None:
    store = make_store(clock, FakeEngine(A), FakeEngine(B))
    store.note_dispatch(A, "r1", 1, 1, "s1", clock.now())
    clock.advance(30.0)
    store.note_dispatch(B, "r2", 1, 1, "s2", clock.now())
    assert store.session_lookup("s1") == (A, 1000.0)
    assert store.session_lookup("s2") == (B, 1030.0)
    assert store.session_lookup("unknown") == (None, 0.0)
    clock.advance(30.5)  # s1 is 60.5 s old, past the 60 s TTL
    assert store.session_lookup("s1") == (None, 0.0)
    assert store.prune_sessions(clock.now()) == 1
    store.note_dispatch(A, "r3", 1, 1, "s2", clock.now())  # the session moves to A
    assert store.session_lookup("s2") == (A, 1060.5)
    clock.advance(61.0)
    assert store.prune_sessions(clock.now()) == 1
    assert store.session_lookup("s2") == (None, 0.0)


async def test_sessions_are_bounded(clock: ManualClock) -> None:
    store = ClusterStore({A: FakeEngine(A)}, clock, max_sessions=2)
    for i in range(3):
        store.note_dispatch(A, f"r{i}", 1, 1, f"s{i}", clock.now())
    assert [store.session_lookup(f"s{i}")[0] for i in range(3)] == [None, A, A]


async def test_a_reused_request_id_is_counted_per_dispatch(clock: ManualClock) -> None:
    store = make_store(clock, FakeEngine(A))
    store.note_dispatch(A, "dup", 10, 0, "", clock.now())
    store.note_dispatch(A, "dup", 30, 0, "", clock.now())
    view = store.snapshot().engines[0]
    assert (view.inflight_requests, view.inflight_tokens, view.unreported_tokens) == (2, 40, 40)
    store.note_finish(A, "dup")
    view = store.snapshot().engines[0]
    assert (view.inflight_requests, view.inflight_tokens, view.unreported_requests) == (1, 30, 1)
    store.note_finish(A, "dup")
    view = store.snapshot().engines[0]
    assert (view.inflight_requests, view.inflight_tokens, view.unreported_tokens) == (0, 0, 0)
