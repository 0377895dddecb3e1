"""Which engines hold which prefix blocks: the gateway's cache index, by index-block key.

Owns: `PrefixIndex`, a map from index-block key (`switchyard.prefix`, 256-token blocks chained from the
prompt's start) to the set of engines holding it, kept as an int bitmask over engine slots, and `match`,
the longest cached prefix of a request on each engine. Two ways to keep it, one class:
- reported (`apply`): the agents' KV events, stored / removed / cleared, so the index is what the engines
  actually cache (kv_aware, PRISM's prefix factor);
- sent (`record`): what this gateway dispatched where, with a least-recently-used bound per engine sized to
  the engine's KV capacity (the approx_prefix baseline: no events, SGLang's and llm-d's approximate scorers).
Must not: read clocks, do I/O or know asyncio; decide anything (policies read `match`'s result).

Costs: `match` walks the request's keys once, intersecting bitmasks, and stops at the first key no candidate
engine holds (O(prefix length), not O(engines x keys)). Removing an engine or clearing its blocks scans the
whole index once (rare: a reconnect's resync). Memory is bounded by `max_keys`; events past it are dropped
and counted (`dropped`), so the index can under-report, never grow without bound.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from gateway.domain import EngineId

DEFAULT_MAX_KEYS = 1 << 20


class PrefixIndex:
    """Index-block key -> engines holding it (see the module docstring)."""

    __slots__ = ("_owners", "_slot", "_engine_of", "_free", "_counts", "_lru", "_capacity", "max_keys",
                 "dropped")

    def __init__(self, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        if max_keys <= 0:
            raise ValueError(f"max_keys must be positive, got {max_keys}")
        self._owners: dict[int, int] = {}  # key -> bitmask of engine slots
        self._slot: dict[EngineId, int] = {}
        self._engine_of: dict[int, EngineId] = {}
        self._free: list[int] = []  # released slots, reused before new ones
        self._counts: dict[EngineId, int] = {}  # keys held per engine
        self._lru: dict[EngineId, OrderedDict[int, None]] = {}  # `record`'s per-engine order
        self._capacity: dict[EngineId, int] = {}
        self.max_keys = max_keys
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._owners)

    def engines(self) -> tuple[EngineId, ...]:
        return tuple(self._slot)

    def held(self, engine_id: EngineId) -> int:
        """Keys indexed for this engine."""
        return self._counts.get(engine_id, 0)

    def _bit(self, engine_id: EngineId) -> int:
        slot = self._slot.get(engine_id)
        if slot is None:
            slot = self._free.pop() if self._free else len(self._slot)
            self._slot[engine_id] = slot
            self._engine_of[slot] = engine_id
            self._counts[engine_id] = 0
        return 1 << slot

    def apply(self, engine_id: EngineId, stored: Iterable[int], removed: Iterable[int],
              cleared: bool = False) -> None:
        """One batch of an engine's KV events: `cleared` first (forget everything it held), then removals,
        then stores."""
        if cleared:
            self.clear(engine_id)
        bit = self._bit(engine_id)
        owners = self._owners
        count = self._counts[engine_id]
        for key in removed:
            mask = owners.get(key, 0)
            if mask & bit:
                count -= 1
                if mask == bit:
                    del owners[key]
                else:
                    owners[key] = mask & ~bit
        for key in stored:
            owned = owners.get(key)
            if owned is None:
                if len(owners) >= self.max_keys:
                    self.dropped += 1
                    continue
                owners[key] = bit
                count += 1
            elif not owned & bit:
                owners[key] = owned | bit
                count += 1
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
        """Forget every key of this engine (a resync, or its blocks all cleared); one scan of the index."""
        slot = self._slot.get(engine_id)
        if slot is None:
            return
        bit = 1 << slot
        owners = self._owners
        for key in [k for k, m in owners.items() if m & bit]:
            mask = owners[key] & ~bit
            if mask:
                owners[key] = mask
            else:
                del owners[key]
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
        candidates = 0
        slot = self._slot
        for engine_id in engines:
            s = slot.get(engine_id)
            if s is not None:
                candidates |= 1 << s
        out: dict[EngineId, int] = {}
        if not candidates or not keys:
            return out
        owners = self._owners
        current = candidates
        depth = 0
        for key in keys:
            held = owners.get(key, 0) & current
            if held != current:
                if depth:
                    self._credit(current & ~held, depth, out)
                current = held
                if not current:
                    return out
            depth += 1
        self._credit(current, depth, out)
        return out

    def _credit(self, mask: int, depth: int, out: dict[EngineId, int]) -> None:
        engine_of = self._engine_of
        while mask:
            low = mask & -mask
            out[engine_of[low.bit_length() - 1]] = depth
            mask ^= low
