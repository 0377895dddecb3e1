"""`ClusterState`'s prefix indexes: the agents' KV events (with resync, reconnect and staleness) and what
this gateway sent where, as `prefix_match` gives them to KV-cache-aware policies."""

from __future__ import annotations

from typing import Any

from gateway.cluster.state import ClusterState
from gateway.domain import PREFIX_EVENTS, PREFIX_SENT, EngineDescription, EngineId, EngineReport, KvEvents
from switchyard.prefix import INDEX_SPAN_TOKENS

A, B = EngineId("a"), EngineId("b")
KEYS = (11, 12, 13, 14)


def report(seq: int, ts_s: float, engine_id: EngineId, kv: KvEvents | None = None, **fields: Any
           ) -> EngineReport:
    base: dict[str, Any] = dict(
        engine_id=engine_id, model="m", profile="p", backend="sim", role="", seq=seq, engine_timestamp_s=ts_s,
        ready=True, draining=False, num_running=0, num_waiting=0, kv_blocks_total=1600, kv_blocks_free=1600,
        kv_blocks_reserved=0, pending_prefill_tokens=0, running_batch_tokens=0, kv_events=kv)
    return EngineReport(**(base | fields))


def events(stored: tuple[int, ...] = (), removed: tuple[int, ...] = (), cleared: bool = False) -> KvEvents:
    return KvEvents(stored, removed, cleared, INDEX_SPAN_TOKENS)


def fleet(now_s: float = 10.0) -> ClusterState:
    """A and B connected; A's stream resynced with the first 3 keys, B's with nothing."""
    state = ClusterState(stale_after_s=1.0, snapshot_resolution_s=0.0)
    for engine_id, held in ((A, KEYS[:3]), (B, ())):
        state.add_engine(engine_id, now_s)
        state.on_describe(engine_id, EngineDescription(engine_id, "m", "p", "sim", "", 8192, 16, 64))
        state.on_connect(engine_id)
        state.on_report(engine_id, report(1, now_s, engine_id, events(held, cleared=True)), now_s)
    return state


def test_events_build_the_index_and_its_deltas_apply() -> None:
    state = fleet()
    assert state.prefix_match(KEYS, PREFIX_EVENTS, 10.0) == {A: 3}
    state.on_report(A, report(2, 10.1, A, events((), (13,))), 10.1)
    state.on_report(B, report(2, 10.1, B, events(KEYS)), 10.1)
    assert state.prefix_match(KEYS, PREFIX_EVENTS, 10.2) == {A: 2, B: 4}
    state.on_report(A, report(3, 10.2, A), 10.2)  # a report without events changes nothing
    assert state.prefix_match(KEYS, PREFIX_EVENTS, 10.3)[A] == 2


def test_reconnect_drops_the_engine_until_its_resync() -> None:
    state = fleet()
    state.on_disconnect(A)
    state.on_connect(A)
    assert state.prefix_match(KEYS, PREFIX_EVENTS, 10.1) == {}
    # A delta before the resync cannot be trusted (this stream has not said what it holds): ignored.
    state.on_report(A, report(1, 0.5, A, events((11,))), 10.1)
    assert state.prefix_match(KEYS, PREFIX_EVENTS, 10.1) == {}
    state.on_report(A, report(2, 0.6, A, events((11, 12), cleared=True)), 10.2)
    assert state.prefix_match(KEYS, PREFIX_EVENTS, 10.2) == {A: 2}


def test_events_keyed_over_another_span_are_ignored_and_counted() -> None:
    state = fleet()
    state.on_report(A, report(2, 10.1, A, KvEvents(KEYS, (), True, 128)), 10.1)
    assert A not in state.prefix_match(KEYS, PREFIX_EVENTS, 10.1)  # its keys from the old span are gone too
    # A delta states no span (the resync did): the rest of this stream is ignored as well.
    state.on_report(A, report(3, 10.2, A, KvEvents(KEYS[3:], (), False, 0)), 10.2)
    assert A not in state.prefix_match(KEYS, PREFIX_EVENTS, 10.2)
    assert state.kv_events_ignored == 2


def test_a_stale_engine_falls_back_to_what_was_sent_there() -> None:
    state = fleet()
    state.note_dispatch(B, "r1", 4 * INDEX_SPAN_TOKENS, 10, "", 10.0, prefix_keys=KEYS)
    # B's events say nothing yet, so the fresh events index has no B; the sent index does.
    assert state.prefix_match(KEYS, PREFIX_EVENTS, 10.5) == {A: 3}
    assert state.prefix_match(KEYS, PREFIX_SENT, 10.5) == {B: 4}
    # Both reports are 2 s old at 12.0 (stale after 1 s): the sent index stands in for both engines.
    assert state.prefix_match(KEYS, PREFIX_EVENTS, 12.0) == {B: 4}


def test_the_sent_index_keeps_what_fits_in_the_engine_kv() -> None:
    state = fleet()
    # 1,600 blocks of 16 tokens = 25,600 tokens = 50 indexed keys (one per 512 tokens, ClusterState's
    # middle between short and long prompts): the oldest prompt's keys go first.
    first = tuple(range(1000, 1030))
    second = tuple(range(2000, 2030))
    state.note_dispatch(A, "r1", 3_000, 10, "", 10.0, prefix_keys=first)
    state.note_dispatch(A, "r2", 3_000, 10, "", 10.0, prefix_keys=second)
    assert state.prefix_match(second, PREFIX_SENT, 10.0) == {A: 30}
    assert state.prefix_match(first, PREFIX_SENT, 10.0) == {A: 20}  # its tail evicted first


def test_removing_an_engine_forgets_its_blocks() -> None:
    state = fleet()
    state.note_dispatch(A, "r1", 4 * INDEX_SPAN_TOKENS, 10, "", 10.0, prefix_keys=KEYS)
    state.remove_engine(A)
    assert state.prefix_match(KEYS, PREFIX_EVENTS, 10.0) == {}
    assert state.prefix_match(KEYS, PREFIX_SENT, 10.0) == {}
    assert state.prefix_index_sizes()[:2] == (0, 0)
