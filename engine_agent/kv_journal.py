"""The agent's prefix-cache event journal: one backend event source, any number of WatchState watchers.

Owns: `merge` (several batches as one), `KvMirror` (a backend's side of `KvEventSource` for an engine whose
events arrive in batches from elsewhere, vLLM's EngineCore process) and `KvJournal`, which takes the backend's
drained `KvDelta` batches (`append`), keeps the set of index keys the engine holds now (applying every batch)
and a bounded log of recent batches, and answers each watcher with what it has not seen (`since(cursor)`): the
batches after its cursor merged into one, or, for a new watcher or one that fell behind the log, a resync
(`cleared` and every key held now).
Must not: read clocks, do I/O, drain the backend itself (the service calls `append` with what it drained), or
know the wire format (`engine_agent.proto_codec` encodes the result).

Merging: a key's last event wins. That is exact for a receiver that applies a batch idempotently (storing
a key it holds or removing one it lacks changes nothing), as the gateway's `PrefixIndex.apply` does: a key
stored then removed arrives as removed (the receiver never had it), one removed then stored as stored.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from engine_agent.domain import KvDelta

DEFAULT_RETAIN = 64  # batches a slow watcher may lag behind before it gets a resync


def merge(batches: Iterable[KvDelta]) -> KvDelta:
    """Consecutive batches as one (last event per key wins; a `cleared` batch voids what came before it and
    makes the result `cleared`)."""
    events: dict[int, bool] = {}
    cleared = False
    for batch in batches:
        if batch.cleared:
            events.clear()
            cleared = True
        for key in batch.removed:
            events[key] = False
        for key in batch.stored:
            events[key] = True
    stored = tuple(k for k, s in events.items() if s)
    return KvDelta(stored, tuple(k for k, s in events.items() if not s), cleared)


class KvMirror:
    """The keys an engine holds, mirrored from its event batches (`apply`), and what changed since the last
    `drain`, for a backend whose engine reports events in batches of its own (the vLLM backend's scheduler
    reads). Bounded: when the undrained changes outgrow twice the keys held (no watcher drained for a long
    time), they are replaced by a resync batch, `cleared` + every key held, which a receiver applies the same
    way."""

    __slots__ = ("_held", "_pending", "_cleared")

    def __init__(self) -> None:
        self._held: dict[int, None] = {}
        self._pending: dict[int, bool] = {}  # key -> stored (True) / removed (False), last event wins
        self._cleared = False

    @property
    def held(self) -> int:
        return len(self._held)

    def apply(self, stored: Iterable[int], removed: Iterable[int], cleared: bool = False) -> None:
        held, pending = self._held, self._pending
        if cleared:
            held.clear()
            pending.clear()
            self._cleared = True
        for key in removed:
            held.pop(key, None)
            pending[key] = False
        for key in stored:
            held[key] = None
            pending[key] = True
        if len(pending) > 2 * len(held) + 1024:
            pending.clear()
            pending.update(dict.fromkeys(held, True))
            self._cleared = True

    def drain(self) -> KvDelta:
        """Changes since the previous drain, as one batch (empty when none)."""
        pending, cleared = self._pending, self._cleared
        self._pending, self._cleared = {}, False
        stored = tuple(k for k, s in pending.items() if s)
        return KvDelta(stored, tuple(k for k, s in pending.items() if not s), cleared)

    def snapshot(self) -> KvDelta:
        return KvDelta(tuple(self._held), (), True)


class KvJournal:
    """The engine's prefix-cache events for every watcher (see the module docstring)."""

    __slots__ = ("_held", "_log", "_seq")

    def __init__(self, held: Iterable[int] = (), *, retain: int = DEFAULT_RETAIN) -> None:
        """`held`: the index keys the engine holds when the journal starts (its backend's snapshot)."""
        if retain < 1:
            raise ValueError(f"retain must be >= 1, got {retain}")
        self._held: dict[int, None] = dict.fromkeys(held)
        self._log: deque[tuple[int, KvDelta]] = deque(maxlen=retain)
        self._seq = 0  # the number of batches appended

    @property
    def seq(self) -> int:
        return self._seq

    @property
    def held(self) -> int:
        """Index keys the engine holds now."""
        return len(self._held)

    def append(self, delta: KvDelta) -> None:
        """One batch drained from the backend (an empty one is ignored)."""
        if not delta:
            return
        held = self._held
        if delta.cleared:
            held.clear()
        for key in delta.removed:
            held.pop(key, None)
        for key in delta.stored:
            held[key] = None
        self._seq += 1
        self._log.append((self._seq, delta))

    def snapshot(self) -> KvDelta:
        """A resync: everything before is void, and every key held now."""
        return KvDelta(tuple(self._held), (), True)

    def since(self, cursor: int | None) -> tuple[int, KvDelta | None]:
        """What a watcher that has seen every batch up to `cursor` (None: nothing yet) must be sent, and its
        new cursor; None when there is nothing new. A resync when `cursor` is None or older than the log."""
        seq = self._seq
        if cursor is not None and cursor == seq:
            return seq, None
        log = self._log
        oldest = log[0][0] if log else seq + 1
        if cursor is None or cursor + 1 < oldest or cursor > seq:
            return seq, self.snapshot()
        if cursor + 1 == seq:
            return seq, log[-1][1]
        return seq, merge(batch for batch_seq, batch in log if batch_seq > cursor)
