"""The gateway's prefix index: events, netting across engines, resync (cleared), engine removal with slot
reuse, the longest-prefix match per engine, the approx mode's per-engine LRU, and the key bound."""

from __future__ import annotations

import random

from gateway.cluster.prefix_index import PrefixIndex
from gateway.domain import EngineId

A, B, C = EngineId("a"), EngineId("b"), EngineId("c")


def brute_match(held: dict[EngineId, set[int]], keys: list[int]) -> dict[EngineId, int]:
    out = {}
    for engine, have in held.items():
        n = 0
        for key in keys:
            if key not in have:
                break
            n += 1
        if n:
            out[engine] = n
    return out


def test_match_is_the_longest_held_prefix_per_engine() -> None:
    index = PrefixIndex()
    index.apply(A, [1, 2, 3, 4], [])
    index.apply(B, [1, 2], [])
    index.apply(C, [2, 3, 4], [])  # holds later keys but not the first: no prefix
    assert index.match([1, 2, 3, 4, 5], [A, B, C]) == {A: 4, B: 2}
    assert index.match([1, 2, 3, 4, 5], [B, C]) == {B: 2}
    assert index.match([9, 1], [A, B, C]) == {}
    assert index.match([], [A]) == {}
    index.apply(A, [], [3])  # a hole: the prefix ends before it
    assert index.match([1, 2, 3, 4], [A]) == {A: 2}
    assert index.held(A) == 3 and len(index) == 4


def test_cleared_forgets_only_that_engine_and_resyncs() -> None:
    index = PrefixIndex()
    index.apply(A, [1, 2, 3], [])
    index.apply(B, [1, 2], [])
    index.apply(A, [7, 8], [], cleared=True)  # a resync: what A holds now, nothing else
    assert index.match([1, 2, 3], [A, B]) == {B: 2}
    assert index.match([7, 8], [A, B]) == {A: 2}
    assert index.held(A) == 2 and len(index) == 4


def test_a_removed_engine_frees_its_slot_for_the_next() -> None:
    index = PrefixIndex()
    index.apply(A, [1, 2], [])
    index.apply(B, [1], [])
    index.remove_engine(A)
    assert index.engines() == (B,)
    index.apply(C, [5], [])  # takes A's slot: none of A's keys may show up as C's
    assert index.match([1, 2], [B, C]) == {B: 1}
    assert index.match([5], [B, C]) == {C: 1}
    assert len(index) == 2


def test_random_events_match_a_brute_force_model() -> None:
    rng = random.Random(7)
    engines = [EngineId(f"e{i}") for i in range(70)]  # more than 64 slots: masks are Python ints
    index = PrefixIndex()
    held: dict[EngineId, set[int]] = {e: set() for e in engines}
    for _ in range(3000):
        engine = rng.choice(engines)
        stored = [rng.randrange(40) for _ in range(rng.randrange(4))]
        removed = [rng.randrange(40) for _ in range(rng.randrange(3))]
        cleared = rng.random() < 0.02
        index.apply(engine, stored, removed, cleared)
        if cleared:
            held[engine].clear()
        held[engine] -= set(removed)
        held[engine] |= set(stored)
        if rng.random() < 0.01:
            index.remove_engine(engine)
            held[engine].clear()
        keys = [rng.randrange(40) for _ in range(rng.randrange(1, 6))]
        assert index.match(keys, engines) == brute_match(held, keys)
    assert len(index) == len(set().union(*held.values()))


def test_sent_mode_keeps_the_most_recent_keys_per_engine_and_the_prompt_start_last() -> None:
    index = PrefixIndex()
    index.record(A, [1, 2, 3], capacity=4)
    index.record(A, [1, 5, 6], capacity=4)  # 1 refreshed; 2 and 3 are the oldest, 3 (a tail) goes first
    assert index.held(A) == 4
    assert index.match([1, 2], [A]) == {A: 2}
    assert index.match([1, 5, 6], [A]) == {A: 3}
    index.record(A, [9], capacity=4)  # evicts 2 (the only key older than 1's refresh)
    assert index.match([1, 2], [A]) == {A: 1}
    index.record(B, list(range(100, 110)), capacity=3)  # longer than the capacity: its first 3 stay
    assert index.match(list(range(100, 110)), [B]) == {B: 3}


def test_the_key_bound_drops_and_counts_new_keys() -> None:
    index = PrefixIndex(max_keys=3)
    index.apply(A, [1, 2, 3, 4], [])
    assert len(index) == 3 and index.dropped == 1
    index.apply(B, [1], [])  # a key already indexed costs nothing
    assert index.match([1, 2, 3], [A, B]) == {A: 3, B: 1}
