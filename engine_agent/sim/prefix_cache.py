"""The simulated engine's prefix cache: which KV blocks hold a computed prompt prefix, by chain key.

Owns: `PrefixCache` (reference counts of cached blocks, the least-recently-used order of the evictable ones,
eviction, and the KV events an agent forwards: index blocks stored and removed since the last drain, as
`engine_agent.domain.KvDelta` batches).
Must not: schedule, time, allocate blocks (the engine's free count is `SimEngine`'s) or read clocks.

vLLM's scheme (`vllm/v1/core/kv_cache_utils.py`): a full block of a prompt is cached under its chain key
(`switchyard.prefix.block_keys`) once computed; a request whose prompt starts with cached keys reuses those
blocks at admission; a cached block no running request holds stays in KV until its space is needed. Two
differences from vLLM, both deliberate:
- A free block holding no cached prefix is always used before a cached one is evicted (vLLM's free queue may
  evict an older cached block while a newer empty one is free); among cached free blocks the least recently
  used goes first, and a finished request's blocks enter that order tail first (as vLLM frees them), so a
  prefix loses its end before its start.
- Only prompt blocks are cached, not blocks of generated tokens: in the simulator a later turn's prompt is
  given by its trace, never by the tokens this engine drew.

Events are kept at the gateway's index granularity: only engine blocks at the end of an indexed span
(`switchyard.prefix.span_of`, `is_indexed`) carry an index key, and storing or evicting one is an event. A
batch is netted: a key stored and removed between two drains is not reported, one removed and stored again is
not either.
An engine keeps events only when it is asked to (`SimEngine(kv_events=True)`): undrained, they would grow with
every key ever evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from engine_agent.domain import KvDelta
from switchyard.prefix import net_event


class PrefixCache:
    """Cached prompt blocks by chain key (see the module docstring)."""

    __slots__ = ("_refs", "_lru", "_anchor", "_delta", "hit_blocks_total", "queried_blocks_total",
                 "evicted_total")

    def __init__(self) -> None:
        self._refs: dict[int, int] = {}  # key -> running requests holding the block (0: evictable)
        self._lru: OrderedDict[int, None] = OrderedDict()  # the evictable keys, least recently used first
        self._anchor: dict[int, int] = {}  # engine-block key -> its index-block key, at index span ends
        self._delta: dict[int, bool] = {}  # index key -> stored (True) / removed (False) since the last drain
        self.hit_blocks_total = 0  # blocks reused at admission
        self.queried_blocks_total = 0  # full prompt blocks looked up at admission
        self.evicted_total = 0

    @property
    def evictable(self) -> int:
        """Cached blocks no request holds: free space that still holds a prefix."""
        return len(self._lru)

    @property
    def cached_blocks(self) -> int:
        return len(self._refs)

    def match(self, keys: Sequence[int], limit: int | None = None) -> int:
        """How many of `keys` (of the first `limit`), from the first, are cached."""
        refs = self._refs
        count = len(keys) if limit is None else min(limit, len(keys))
        n = 0
        while n < count and keys[n] in refs:
            n += 1
        return n

    def evictable_among(self, keys: Sequence[int], count: int) -> int:
        """How many of the first `count` keys (all cached) no request holds: acquiring them takes that many
        free blocks."""
        refs = self._refs
        return sum(1 for i in range(count) if refs[keys[i]] == 0)

    def acquire(self, keys: Sequence[int]) -> None:
        """A request reuses these cached blocks (its prefix hit)."""
        refs, lru = self._refs, self._lru
        for key in keys:
            held = refs[key]
            if held == 0:
                del lru[key]
            refs[key] = held + 1

    def insert(self, key: int, index_key: int | None) -> bool:
        """A running request computed the block `key` (its only holder); `index_key` when the block ends an
        index span. False when the key is already cached (another request computed the same block first:
        this request's copy stays private)."""
        refs = self._refs
        if key in refs:
            return False
        refs[key] = 1
        if index_key is not None:
            self._anchor[key] = index_key
            net_event(self._delta, index_key, True)
        return True

    def release(self, keys: Sequence[int]) -> int:
        """A request lets go of these blocks (finished, preempted, aborted, cut), given in prompt order; the
        ones no request holds any more become evictable, tail first. Returns how many."""
        refs, lru = self._refs, self._lru
        freed = 0
        for key in reversed(keys):
            held = refs[key] - 1
            refs[key] = held
            if held == 0:
                lru[key] = None
                freed += 1
        return freed

    def evict(self, count: int) -> int:
        """Drop the `count` least recently used evictable blocks (fewer if there are fewer); how many."""
        lru, refs, anchor = self._lru, self._refs, self._anchor
        n = min(count, len(lru))
        for _ in range(n):
            key, _ = lru.popitem(last=False)
            del refs[key]
            index_key = anchor.pop(key, None)
            if index_key is not None:
                net_event(self._delta, index_key, False)
        self.evicted_total += n
        return n

    def drain(self) -> KvDelta:
        """The events since the last drain (netted), and forget them."""
        delta = self._delta
        if not delta:
            return KvDelta()
        self._delta = {}
        return KvDelta(tuple(k for k, s in delta.items() if s), tuple(k for k, s in delta.items() if not s))

    def snapshot(self) -> KvDelta:
        """Every index key held now, as a batch that clears what the receiver had (a resync); pending events
        are folded in and forgotten."""
        self._delta = {}
        return KvDelta(tuple(self._anchor.values()), (), True)
