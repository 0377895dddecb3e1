"""Which engines hold which prefix blocks: the gateway's cache index, by index-block key.

Owns: `PrefixIndex`, a map from index-block key (`switchyard.prefix`, 256-token blocks chained from the
prompt's start) to the set of engines holding it, kept as a bitmask over engine slots, and `match`, the
longest cached prefix of a request on each engine. Two ways to keep it, one class:
- reported (`apply`): the agents' KV events, stored / removed / cleared, so the index is what the engines
  actually cache (kv_aware, PRISM's prefix factor);
- sent (`record`): what this gateway dispatched where, with a least-recently-used bound per engine sized to
  the engine's KV capacity (the approx_prefix baseline: no events, SGLang's and llm-d's approximate scorers).
Must not: read clocks, do I/O or know asyncio; decide anything (policies read `match`'s result).

Storage (issue 18: a dict cost 112 bytes per indexed block, the target is 64 at 64 engines and 1 M blocks):
an open-addressing hash table in two numpy arrays, linear probing from a Fibonacci hash of the key.
- keys: uint32 while every key fits (`switchyard.prefix.KEY_MASK` is 32 bits), widened once to uint64 by
  the first larger key (this module may not import `switchyard`, so it follows the keys it is given);
  0 marks an empty slot, so the real key 0 is kept beside the table (`_zero`).
- masks: `words` uint64 per slot, row-major, bit s of a row = engine slot s holds the key. One word covers
  64 engines; the first engine given slot 64 adds a word to every row (a copy of the mask array), and so on:
  any number of engines works, at 8 bytes per slot per 64 engine slots (1,024 engines: 16 words). Freed
  slots are reused before new ones, so the words follow the most engines indexed at once; they never shrink.
- load: at most 2/3 of the slots hold a key (CPython's dict bound; a miss probes 5 slots expected at the
  bound, 2 at half of it); past it the table doubles. It never shrinks. So a block costs (key bytes + 8 x
  words) / load: 18-36 bytes up to 64 engines with 32-bit keys (25 at 1 M blocks, the bound's default),
  24-48 with 64-bit keys. Many engines cost dense words: at 1,024 engines ~277 bytes per block at 1 M,
  more than the dict of int masks (~190); if fleets that large ever share one index, a table per 64-engine
  group (holding only the keys that group holds) is the fix.
- deletion: backward shift (the entries after the freed slot that may move back do), so there are no
  tombstones and a miss stops at the first empty slot. Clearing an engine clears its bit column with numpy;
  if that empties over 1/8 of the keys, the table is rebuilt (vectorised, sorted by home slot) instead of
  shifting key by key.
The approx mode's per-engine LRU (`record`) stays an OrderedDict per engine: its memory (about 100 bytes per
key sent, bounded by each engine's KV capacity) is not in the index's per-block figure.

Costs: `match` walks the request's keys once, probing the table in Python through memoryviews (one slot, or
a few, per key) and intersecting bitmasks, and stops at the first key no candidate engine holds (O(prefix
length), not O(engines x keys)); `engines` is made a set unless it is one (or a dict): O(engines), ~15 us at
1,024. Measured against numpy probing all of a request's keys at once (a vectorised window per key): that
spends ~10 us in numpy call overhead whatever the prefix, the walk ~0.45 us per key walked, so the walk
stays (benchmarks/prefix_index_cost.py: 9 us median at 64 engines and 1 M blocks, as the dict's). Removing
an engine or clearing its blocks scans the whole mask column once (rare: a reconnect's resync). Memory is
bounded by `max_keys`; events past it are dropped and counted (`dropped`), so the index can under-report,
never grow without bound. Keys are ints in [0, 2**64); storing one outside raises ValueError (a lookup of
one finds nothing).
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from gateway.domain import EngineId

DEFAULT_MAX_KEYS = 1 << 20

_MIN_CAPACITY = 1 << 10  # slots of a new index (12 KiB); a power of two, as every capacity
_MAX_LOAD = 2 / 3
_FIB = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: multiplicative (Fibonacci) hashing spreads any keys
_M64 = (1 << 64) - 1
_M32 = (1 << 32) - 1
_ORDER = sys.byteorder  # the mask arrays are native uint64


class PrefixIndex:
    """Index-block key -> engines holding it (see the module docstring)."""

    __slots__ = ("_keys", "_masks", "_words", "_kv", "_mv", "_bv", "_shift", "_limit", "_live", "_zero",
                 "_slot", "_engine_of", "_free", "_counts", "_lru", "_capacity", "max_keys", "dropped")

    def __init__(self, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        if max_keys <= 0:
            raise ValueError(f"max_keys must be positive, got {max_keys}")
        self._keys: npt.NDArray[np.unsignedinteger[Any]] = np.zeros(_MIN_CAPACITY, np.uint32)
        self._masks: npt.NDArray[np.uint64] = np.zeros(_MIN_CAPACITY, np.uint64)  # slots x words, flat
        self._words = 1
        self._live = 0  # keys in the table (the key 0 is not: it lives in `_zero`)
        self._zero = 0  # the engines holding key 0
        self._kv = self._mv = self._bv = memoryview(b"")
        self._shift = self._limit = 0
        self._views()
        self._slot: dict[EngineId, int] = {}
        self._engine_of: dict[int, EngineId] = {}
        self._free: list[int] = []  # released slots, reused before new ones
        self._counts: dict[EngineId, int] = {}  # keys held per engine
        self._lru: dict[EngineId, OrderedDict[int, None]] = {}  # `record`'s per-engine order
        self._capacity: dict[EngineId, int] = {}
        self.max_keys = max_keys
        self.dropped = 0

    def __len__(self) -> int:
        return self._live + (1 if self._zero else 0)

    def engines(self) -> tuple[EngineId, ...]:
        return tuple(self._slot)

    def held(self, engine_id: EngineId) -> int:
        """Keys indexed for this engine."""
        return self._counts.get(engine_id, 0)

    def apply(self, engine_id: EngineId, stored: Iterable[int], removed: Iterable[int],
              cleared: bool = False) -> None:
        """One batch of an engine's KV events: `cleared` first (forget everything it held), then removals,
        then stores."""
        if cleared:
            self.clear(engine_id)
        bit = 1 << self._slot_of(engine_id)
        count = self._counts[engine_id]
        lookup = self._lookup
        try:
            for key in removed:
                i, mask = lookup(key)
                if mask & bit:
                    if i < 0:
                        self._zero = mask & ~bit
                    elif mask == bit:
                        self._delete(i)
                    else:
                        self._put_mask(i, mask & ~bit)
                    count -= 1
            for key in stored:
                i, mask = lookup(key)
                if mask & bit:
                    continue
                if not mask and len(self) >= self.max_keys:
                    self.dropped += 1
                    continue
                if i >= 0:
                    self._put_mask(i, mask | bit)
                elif key:
                    self._insert(key, bit)
                else:
                    self._zero = mask | bit
                count += 1
        finally:
            self._counts[engine_id] = count

    def record(self, engine_id: EngineId, keys: Sequence[int], capacity: int) -> None:
        """This gateway sent a request with these keys to `engine_id`: the engine will hold them (approx
        mode). Keeps at most `capacity` keys per engine, evicting its least recently sent; the prompt's
        first keys are refreshed last, so they are the last to go, as on the engine."""
        lru = self._lru.get(engine_id)
        if lru is None:
            lru = self._lru[engine_id] = OrderedDict()
        self._capacity[engine_id] = capacity
        fresh = []
        for key in reversed(keys):
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = None
                fresh.append(key)
        evicted = []
        while len(lru) > capacity:
            evicted.append(lru.popitem(last=False)[0])
        self.apply(engine_id, (k for k in fresh if k in lru), evicted)

    def clear(self, engine_id: EngineId) -> None:
        """Forget every key of this engine (a resync, or its blocks all cleared): one scan of its bit
        column."""
        slot = self._slot.get(engine_id)
        if slot is None:
            return
        self._zero &= ~(1 << slot)
        word, bit = divmod(slot, 64)
        rows = self._masks.reshape(-1, self._words)
        column = rows[:, word]
        held = np.flatnonzero(column & np.uint64(1 << bit))
        if held.size:
            column[held] &= np.uint64(_M64 ^ (1 << bit))
            emptied = held[~rows[held].any(axis=1)]
            if emptied.size * 8 > self._live:
                self._rebuild(len(self._keys))  # drops the emptied keys
            else:
                for key in self._keys[emptied].tolist():
                    self._delete(self._lookup(key)[0])
        self._counts[engine_id] = 0
        lru = self._lru.get(engine_id)
        if lru is not None:
            lru.clear()

    def remove_engine(self, engine_id: EngineId) -> None:
        """The engine left: forget it and free its slot."""
        if engine_id not in self._slot:
            return
        self.clear(engine_id)
        slot = self._slot.pop(engine_id)
        del self._engine_of[slot]
        del self._counts[engine_id]
        self._lru.pop(engine_id, None)
        self._capacity.pop(engine_id, None)
        self._free.append(slot)

    def match(self, keys: Sequence[int], engines: Iterable[EngineId]) -> dict[EngineId, int]:
        """For each of `engines` the index holds anything for, how many of `keys`, from the first, it holds
        (engines matching none are left out)."""
        out: dict[EngineId, int] = {}
        if not keys or not self._slot:
            return out
        walk = iter(keys)
        current = self._lookup(next(walk))[1]
        if current:
            current = self._among(current, engines)
        if not current:
            return out
        depth = 1
        if self._words == 1:  # the hot path: the probe inlined, masks read as one word
            kv, mv, last, shift, zero = self._kv, self._mv, len(self._kv) - 1, self._shift, self._zero
            for key in walk:
                held = 0
                if key:
                    i = ((key * _FIB) & _M64) >> shift
                    while s := kv[i]:
                        if s == key:
                            held = mv[i] & current
                            break
                        i = (i + 1) & last
                else:
                    held = zero & current
                if held != current:
                    self._credit(current & ~held, depth, out)
                    current = held
                    if not current:
                        return out
                depth += 1
        else:
            lookup = self._lookup
            for key in walk:
                held = lookup(key)[1] & current
                if held != current:
                    self._credit(current & ~held, depth, out)
                    current = held
                    if not current:
                        return out
                depth += 1
        self._credit(current, depth, out)
        return out

    def _among(self, holders: int, engines: Iterable[EngineId]) -> int:
        """The bits of `holders` whose engines are in `engines`: walks whichever of the two is smaller."""
        allowed: Collection[EngineId]
        allowed = engines if isinstance(engines, (set, frozenset, dict)) else set(engines)
        if holders.bit_count() <= len(allowed):
            engine_of = self._engine_of
            out = 0
            while holders:
                low = holders & -holders
                if engine_of[low.bit_length() - 1] in allowed:
                    out |= low
                holders ^= low
            return out
        slot = self._slot
        candidates = 0
        for engine_id in allowed:
            s = slot.get(engine_id)
            if s is not None:
                candidates |= 1 << s
        return holders & candidates

    def _credit(self, mask: int, depth: int, out: dict[EngineId, int]) -> None:
        engine_of = self._engine_of
        while mask:
            low = mask & -mask
            out[engine_of[low.bit_length() - 1]] = depth
            mask ^= low

    # -- engine slots and the mask words --------------------------------------------------------------------

    def _slot_of(self, engine_id: EngineId) -> int:
        slot = self._slot.get(engine_id)
        if slot is None:
            slot = self._free.pop() if self._free else len(self._slot)
            if slot >= 64 * self._words:
                self._widen_masks(slot // 64 + 1)
            self._slot[engine_id] = slot
            self._engine_of[slot] = engine_id
            self._counts[engine_id] = 0
        return slot

    def _widen_masks(self, words: int) -> None:
        rows = np.zeros((len(self._keys), words), np.uint64)
        rows[:, :self._words] = self._masks.reshape(-1, self._words)
        self._masks, self._words = rows.reshape(-1), words
        self._views()

    # -- the hash table ---------------------------------------------------------------------------------

    def _views(self) -> None:
        """Refresh what derives from the arrays: memoryviews for scalar access, the hash shift, the bound."""
        capacity = len(self._keys)
        self._kv = self._keys.data
        self._mv = self._masks.data
        self._bv = self._mv.cast("B")
        self._shift = 65 - capacity.bit_length()  # home slot = the hash's top log2(capacity) bits
        self._limit = int(capacity * _MAX_LOAD)

    def _lookup(self, key: int) -> tuple[int, int]:
        """(slot, mask) of `key`: (-1, 0) when absent, (-1, its mask) for the key 0 (kept off the table)."""
        if not key:
            return -1, self._zero
        kv, last = self._kv, len(self._kv) - 1
        i = ((key * _FIB) & _M64) >> self._shift
        while s := kv[i]:
            if s == key:
                return i, self._mv[i] if self._words == 1 else self._wide_mask(i)
            i = (i + 1) & last
        return -1, 0

    def _wide_mask(self, i: int) -> int:
        """The mask in slot `i` when it spans several words."""
        size = 8 * self._words
        return int.from_bytes(self._bv[i * size:(i + 1) * size], _ORDER)

    def _put_mask(self, i: int, mask: int) -> None:
        if self._words == 1:
            self._mv[i] = mask
        else:
            size = 8 * self._words
            self._bv[i * size:(i + 1) * size] = mask.to_bytes(size, _ORDER)

    def _insert(self, key: int, mask: int) -> None:
        """Add nonzero `key`, absent from the table; doubles the table first when it is full."""
        if not 0 < key <= _M64:
            raise ValueError(f"prefix keys are 64-bit unsigned ints, got {key}")
        if key > _M32 and self._keys.dtype == np.uint32:
            self._keys = self._keys.astype(np.uint64)
            self._views()
        if self._live >= self._limit:
            self._rebuild(2 * len(self._keys))
        self._place(key, mask)

    def _place(self, key: int, mask: int) -> None:
        kv, last = self._kv, len(self._kv) - 1
        i = ((key * _FIB) & _M64) >> self._shift
        while kv[i]:
            i = (i + 1) & last
        kv[i] = key
        self._put_mask(i, mask)
        self._live += 1

    def _delete(self, i: int) -> None:
        """Empty slot `i`, shifting back the entries after it that may move, so no probe chain breaks."""
        kv, last, shift = self._kv, len(self._kv) - 1, self._shift
        size = 8 * self._words
        bv = self._bv
        j = i
        while True:
            j = (j + 1) & last
            key = kv[j]
            if not key:
                break
            home = ((key * _FIB) & _M64) >> shift
            if (j - home) & last >= (j - i) & last:  # slot i lies on its probe path: move it back there
                kv[i] = key
                bv[i * size:(i + 1) * size] = bv[j * size:(j + 1) * size]
                i = j
        kv[i] = 0
        self._put_mask(i, 0)
        self._live -= 1

    def _rebuild(self, capacity: int) -> None:
        """Rehash the keys with any holder into `capacity` slots (a power of two): sorted by home slot, each
        goes to the first slot past its home and its predecessor's (linear probing's layout, vectorised);
        the few whose run passes the table's end wrap around one by one."""
        rows = self._masks.reshape(-1, self._words)
        live = np.flatnonzero(self._keys)
        live = live[rows[live].any(axis=1)]
        keys, masks = self._keys[live], rows[live]
        shift = 65 - capacity.bit_length()
        home = ((keys.astype(np.uint64) * np.uint64(_FIB)) >> np.uint64(shift)).astype(np.intp)
        order = np.argsort(home, kind="stable")
        step = np.arange(order.size)
        at = np.maximum.accumulate(home[order] - step) + step if order.size else step
        fits = at < capacity
        new_keys = np.zeros(capacity, self._keys.dtype)
        new_rows = np.zeros((capacity, self._words), np.uint64)
        new_keys[at[fits]] = keys[order[fits]]
        new_rows[at[fits]] = masks[order[fits]]
        self._keys, self._masks, self._live = new_keys, new_rows.reshape(-1), int(np.count_nonzero(fits))
        self._views()
        for n in order[~fits].tolist():
            self._place(int(keys[n]), int.from_bytes(masks[n].tobytes(), _ORDER))
