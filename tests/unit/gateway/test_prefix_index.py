"""The gateway's prefix index: events, netting across engines, resync (cleared), engine removal with slot
reuse, the longest-prefix match per engine, the approx mode's per-engine LRU, and the key bound; and its hash
table: growth, removals that keep colliding keys findable (a random comparison against a dict-of-sets model),
the key 0, 64-bit keys, and more engines than one mask word holds."""

from __future__ import annotations

import random

import pytest

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
    engines = [EngineId(f"e{i}") for i in range(70)]  # more than 64 slots: two mask words
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


def wrapping_keys(count: int) -> list[int]:
    """Keys whose home is the last slot of a new index's 1,024 (its hash: the top 10 bits of key x
    0x9E3779B97F4A7C15 mod 2**64), so their probe run wraps to the table's start. Any keys would test the
    same behaviour; these reach the wrap-around paths of probing, removal and rehashing for sure."""
    out: list[int] = []
    key = 1
    while len(out) < count:
        if ((key * 0x9E3779B97F4A7C15) & ((1 << 64) - 1)) >> 54 == 1023:
            out.append(key)
        key += 1
    return out


def test_random_operations_match_a_dict_of_sets_model() -> None:
    rng = random.Random(18)
    engines = [EngineId(f"e{i}") for i in range(70)]  # slots past 64: a second mask word
    universe = [rng.getrandbits(32) for _ in range(2500)] + wrapping_keys(40) + [0]
    index = PrefixIndex()
    held: dict[EngineId, set[int]] = {e: set() for e in engines}
    for step in range(3000):
        engine = rng.choice(engines)
        roll = rng.random()
        if roll < 0.03:
            index.clear(engine)
            held[engine].clear()
        elif roll < 0.05:
            index.remove_engine(engine)
            held[engine].clear()
        else:
            mine = sorted(held[engine])
            removed = rng.sample(mine, min(len(mine), rng.randrange(12)))
            stored = [rng.choice(universe) for _ in range(rng.randrange(40))]
            stored += rng.sample(removed, len(removed) // 2)  # removed, then stored again in the same batch
            cleared = rng.random() < 0.01
            index.apply(engine, stored, removed, cleared)
            if cleared:
                held[engine].clear()
            held[engine] -= set(removed)
            held[engine] |= set(stored)
        assert index.held(engine) == len(held[engine])
        assert len(index) == len(set().union(*held.values()))
        if step % 100 == 0:  # every key held anywhere is found: each engine's keys, as one request
            for owner in engines:
                keys = sorted(held[owner])
                assert index.match(keys, engines) == brute_match(held, keys)
        keys = rng.sample(universe, 3)
        assert index.match(keys, engines) == brute_match(held, keys)
    assert index.dropped == 0


def test_the_table_grows_and_keeps_every_key() -> None:
    rng = random.Random(3)
    chains = [[rng.getrandbits(32) | 1 for _ in range(16)] for _ in range(1500)]  # 24,000 keys
    index = PrefixIndex()
    for n, chain in enumerate(chains):
        index.apply(A, chain, [])
        if n % 2:
            index.apply(B, chain[:8], [])
    assert len(index) == 24_000 and index.held(A) == 24_000 and index.held(B) == 750 * 8
    for n, chain in enumerate(chains):
        assert index.match(chain, [A, B]) == ({A: 16, B: 8} if n % 2 else {A: 16})
    for chain in chains[::2]:  # half the chains go, then come back
        index.apply(A, [], chain)
    assert len(index) == 12_000
    for chain in chains[::2]:
        assert index.match(chain, [A, B]) == {}
        index.apply(A, chain, [])
    assert all(index.match(chain, [A]) == {A: 16} for chain in chains)


def test_removals_keep_colliding_keys_findable() -> None:
    keys = wrapping_keys(30)  # one home slot: a run of 30 that wraps past the table's end
    index = PrefixIndex()
    index.apply(A, keys, [])
    for gone in (keys[0], keys[14], keys[29], keys[1]):
        index.apply(A, [], [gone])
        left = [k for k in keys if k != gone]
        assert all(index.match([k], [A]) == {A: 1} for k in left)
        assert index.match([gone], [A]) == {}
        index.apply(A, [gone], [])
    assert index.match(keys, [A]) == {A: 30} and len(index) == 30


def test_clearing_most_keys_rebuilds_and_keeps_the_rest() -> None:
    rng = random.Random(5)
    keys = [rng.getrandbits(32) | 1 for _ in range(3000)] + wrapping_keys(20)
    index = PrefixIndex()
    index.apply(A, keys, [])
    index.apply(B, keys[::6], [])
    index.apply(C, [*keys[1:4], *wrapping_keys(25)[20:]], [])
    index.clear(C)  # a few keys of its own: shifted out one by one
    index.clear(A)  # most keys: the table is rebuilt without them
    assert len(index) == len(keys[::6]) == index.held(B)
    assert index.held(A) == index.held(C) == 0
    assert all(index.match([k], [A, B, C]) == {B: 1} for k in keys[::6])
    assert index.match(keys[1:6], [A, B, C]) == {}
    index.apply(A, keys, [])
    assert index.match(keys, [A]) == {A: len(keys)} and len(index) == len(keys)


def test_key_zero_is_a_key_like_any_other() -> None:
    index = PrefixIndex(max_keys=3)
    index.apply(A, [0, 5], [])
    index.apply(B, [0], [])
    assert len(index) == 2 and index.held(A) == 2
    assert index.match([0, 5, 6], [A, B]) == {A: 2, B: 1}
    assert index.match([5, 0], [B]) == {}
    index.apply(A, [], [0])
    assert index.match([0, 5], [A, B]) == {B: 1} and len(index) == 2
    index.apply(C, [7, 8], [])  # the bound counts the key 0 too
    assert len(index) == 3 and index.dropped == 1
    index.remove_engine(B)
    assert index.match([0], [A, B, C]) == {} and len(index) == 2
    index.apply(C, [0], [])
    assert index.match([0, 7], [C]) == {C: 2}


def test_keys_past_32_bits_widen_the_table_and_bad_keys_raise() -> None:
    index = PrefixIndex()
    index.apply(A, [1, 2], [])
    wide = [(1 << 64) - 1, 1 << 32, 3]
    index.apply(A, wide, [])
    assert index.match([1, 2, *wide], [A]) == {A: 5}
    assert index.match([(1 << 32) + 1], [A]) == {}
    with pytest.raises(ValueError):
        index.apply(B, [9, -1], [])
    with pytest.raises(ValueError):
        index.apply(B, [1 << 64], [])
    assert index.held(B) == 1 and index.match([9], [B]) == {B: 1}  # what came before the bad key stands
    assert index.match([-1, 1 << 64], [A, B]) == {}


def test_a_thousand_engines_each_with_their_own_bit() -> None:
    engines = [EngineId(f"e{i}") for i in range(1024)]
    index = PrefixIndex()
    shared = [11, 12, 13]
    index.apply(engines[0], shared, [])  # stored with one mask word: kept as the words grow
    for n, engine in enumerate(engines):
        index.apply(engine, shared[:1 + n % 3] + [100_000 + n], [])
    assert index.match(shared, engines) == {e: 1 + n % 3 for n, e in enumerate(engines)} | {engines[0]: 3}
    assert index.match([11, 100_999], engines) == {e: 1 for e in engines} | {engines[999]: 2}
    assert index.match([100_500, 11], engines[501:]) == {}  # its only holder is not among the engines
    index.clear(engines[1000])
    tail = engines[990:]
    assert index.match([11, 101_000], tail) == {e: 1 for e in tail if e != engines[1000]}
    index.remove_engine(engines[700])
    late = EngineId("late")
    index.apply(late, [11], [])  # takes slot 700: nothing of engine 700 shows up as its
    assert index.match([11, 100_700], [late]) == {late: 1}
    assert index.match([11, 12], [late, engines[701]]) == {late: 1, engines[701]: 2}
    assert len(index) == 3 + 1024 - 2
