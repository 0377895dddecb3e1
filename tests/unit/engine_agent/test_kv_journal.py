"""`KvJournal` and `merge`: one backend event source, many WatchState watchers."""

from __future__ import annotations

import random

from engine_agent.domain import KvDelta
from engine_agent.kv_journal import KvJournal, merge


def apply(held: set[int], delta: KvDelta) -> None:
    """What the gateway's index does with a batch (idempotently): cleared, removals, stores."""
    if delta.cleared:
        held.clear()
    held.difference_update(delta.removed)
    held.update(delta.stored)


def test_merge_keeps_the_last_event_per_key_and_a_reset() -> None:
    assert merge([KvDelta((1, 2)), KvDelta((), (1,))]) == KvDelta((2,), (1,))
    assert merge([KvDelta((), (3,)), KvDelta((3,))]) == KvDelta((3,), ())
    merged = merge([KvDelta((1,)), KvDelta((5,), (), True), KvDelta((6,), (5,))])
    assert merged.cleared and set(merged.stored) == {6} and set(merged.removed) == {5}
    assert merge([]) == KvDelta()


def test_a_new_watcher_gets_a_resync_then_only_what_is_new() -> None:
    journal = KvJournal((7, 8))
    cursor, first = journal.since(None)
    assert first == KvDelta((7, 8), (), True)
    assert journal.since(cursor) == (cursor, None)
    journal.append(KvDelta((9,), (7,)))
    journal.append(KvDelta())  # empty: not a batch
    cursor2, delta = journal.since(cursor)
    assert delta == KvDelta((9,), (7,)) and cursor2 == cursor + 1 and journal.held == 2


def test_a_watcher_that_fell_behind_the_log_is_resynced() -> None:
    journal = KvJournal(retain=2)
    cursor, _ = journal.since(None)
    for key in range(5):
        journal.append(KvDelta((key,)))
    _, delta = journal.since(cursor)
    assert delta is not None and delta.cleared and set(delta.stored) == set(range(5))


def test_every_watcher_converges_to_what_the_engine_holds() -> None:
    """Random batches, watchers reading at random moments: each one's applied view equals the engine's
    set after its last read (the property the gateway's index relies on)."""
    rng = random.Random(5)
    engine: set[int] = set()
    journal = KvJournal(retain=3)
    watchers: list[tuple[int | None, set[int]]] = [(None, set()) for _ in range(4)]
    for _ in range(400):
        stored = tuple(rng.randrange(40) for _ in range(rng.randrange(4)))
        removed = tuple(k for k in list(engine) if rng.random() < 0.1)
        cleared = rng.random() < 0.02
        batch = KvDelta(stored, removed, cleared)
        apply(engine, batch)
        journal.append(batch)
        for i, (cursor, view) in enumerate(watchers):
            if rng.random() < 0.3:
                cursor, delta = journal.since(cursor)
                if delta is not None:
                    apply(view, delta)
                assert view == engine
                watchers[i] = (cursor, view)


def test_the_mirror_nets_changes_between_drains_and_resyncs_when_they_outgrow_the_held_set() -> None:
    from engine_agent.kv_journal import KvMirror

    mirror = KvMirror()
    mirror.apply([1, 2, 3], [])
    mirror.apply([4], [2])
    assert mirror.drain() == KvDelta((1, 3, 4), (2,), False)
    assert mirror.drain() == KvDelta()
    mirror.apply([], [], cleared=True)
    mirror.apply([9], [])
    assert mirror.drain() == KvDelta((9,), (), True) and mirror.snapshot() == KvDelta((9,), (), True)
    # Nobody drains while 2,000 keys come and go: the pending changes collapse into a resync of what is held.
    for key in range(100, 2100):
        mirror.apply([key], [])
        mirror.apply([], [key])
    delta = mirror.drain()
    assert delta.cleared and set(delta.stored) == {9} and len(delta.removed) < 1100
