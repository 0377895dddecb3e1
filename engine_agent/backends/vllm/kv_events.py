"""vLLM's own KV-cache events as the gateway's index keys (runs in vLLM's EngineCore process).

Owns: `IndexKeyMapper`, fed the events vLLM's `BlockPool` queues when `kv_events_config.
enable_kv_cache_events` is on (`BlockStored`: new full blocks with their vLLM hashes, parent hash and token
ids; `BlockRemoved`: evicted hashes; `AllBlocksCleared`: a prefix-cache reset), which the scheduler hands
to its publisher once per step (`engine_side` installs one that calls `feed`). It keeps, per cached vLLM
block, its depth, its parent and its tokens, so that when a block ends an indexed span
(`switchyard.prefix.is_indexed`) it can compute that span's chain key exactly as the gateway does
(`block_keys` over `INDEX_SPAN_TOKENS`-token spans); `drain` hands over the index keys stored and removed
since the last call, netted, and `snapshot` every key held.
Must not: import vLLM (the events are duck-typed: unit tests feed plain objects), the agent, or anything but
`switchyard.prefix`; guess: an event it cannot place (a parent it never saw) is counted and skipped, so
the gateway under-reports rather than invents.

Why not vLLM's block hashes themselves: they are SHA-256 over vLLM's own serialisation with a per-process
random seed unless `PYTHONHASHSEED` is fixed, at 16-token granularity; the gateway cannot compute them from a
request without reproducing vLLM's hashing. The token ids in `BlockStored` let this side compute the
gateway's keys instead, so the scheme stays `switchyard.prefix`'s alone.

What counts: full blocks of the KV cache group 0 (a decoder-only model has one group); partial blocks
(vLLM caches a prompt's trailing partial block too) never end a span, since a span is a whole number of
blocks, and are ignored. A vLLM block is keyed by its hash, so a prompt cached twice under different extra
keys (LoRA, cache salt) gives two vLLM blocks with one index key: the key is held while either is
(a reference count per key). Reuse events (`emit_cached_block_events`: hits re-announced) name blocks already
known and change nothing.

Memory: per cached block a small record and, for blocks that do not end a span, their token ids (needed when
a later request branches off mid-span): about 16 Python ints per block, ~0.6 KB; 60 MB at 100,000 blocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from switchyard.prefix import INDEX_SPAN_TOKENS, KEY_MASK, ROOT_KEY, is_indexed, net_event, span_of


@dataclass(slots=True)
class _Block:
    depth: int  # engine blocks from the prompt's start up to and including this one
    parent: Any  # the parent's vLLM hash (None for a first block)
    tokens: tuple[int, ...]  # () for a block that ends a span (no child needs them)
    span_key: int | None  # the chain key of the span this block ends (None mid-span)
    index_key: int | None  # span_key when that span is indexed: the key reported for this block


class IndexKeyMapper:
    """vLLM KV events -> netted index-key deltas (see the module docstring)."""

    __slots__ = ("_block_size", "_span", "_blocks", "_held", "_delta", "_cleared", "unplaced")

    def __init__(self, block_size: int, span_tokens: int = INDEX_SPAN_TOKENS) -> None:
        self._block_size = block_size
        self._span = span_of(block_size, span_tokens)  # ValueError when the block does not divide the span
        self._blocks: dict[Any, _Block] = {}
        self._held: dict[int, int] = {}  # index key -> vLLM blocks holding it
        self._delta: dict[int, bool] = {}  # index key -> stored (True) / removed (False) since the last drain
        self._cleared = False
        self.unplaced = 0  # stored blocks not keyed: an ancestor was never seen

    def __len__(self) -> int:
        """vLLM blocks tracked."""
        return len(self._blocks)

    def feed(self, events: Iterable[Any]) -> None:
        """One step's events, in vLLM's order."""
        for event in events:
            kind = type(event).__name__
            if kind == "BlockStored":
                self._stored(event)
            elif kind == "BlockRemoved":
                if getattr(event, "group_idx", None) in (None, 0):
                    for block_hash in event.block_hashes:
                        self._removed(block_hash)
            elif kind == "AllBlocksCleared":
                self._blocks.clear()
                self._held.clear()
                self._delta.clear()
                self._cleared = True

    def _stored(self, event: Any) -> None:
        if getattr(event, "group_idx", None) not in (None, 0) or event.block_size != self._block_size:
            return  # another cache group, or a partial block
        blocks = self._blocks
        parent = event.parent_block_hash
        if parent is None:
            depth = 0
        else:
            known = blocks.get(parent)
            if known is None:
                self.unplaced += len(event.block_hashes)
                return
            depth = known.depth
        size, span = self._block_size, self._span
        tokens: Sequence[int] = event.token_ids
        for i, block_hash in enumerate(event.block_hashes):
            depth += 1
            if block_hash not in blocks:
                own = tuple(tokens[i * size:(i + 1) * size])
                if depth % span:
                    blocks[block_hash] = _Block(depth, parent, own, None, None)
                else:
                    key = self._span_key(parent, own)
                    if key is None:
                        self.unplaced += 1
                    index_key = key if key is not None and is_indexed(depth // span - 1) else None
                    blocks[block_hash] = _Block(depth, parent, (), key, index_key)
                    if index_key is not None:
                        self._hold(index_key)
            parent = block_hash

    def _span_key(self, parent: Any, last: tuple[int, ...]) -> int | None:
        """The chain key of the span ending with a block whose tokens are `last` and whose parent is
        `parent`: the span's other blocks are the `span - 1` ancestors, the parent span's key the next one's.
        None when one of them is not known (a block this mapper skipped)."""
        parts = [last]
        blocks = self._blocks
        for _ in range(self._span - 1):
            block = blocks.get(parent)
            if block is None or not block.tokens:
                return None
            parts.append(block.tokens)
            parent = block.parent
        if parent is None:
            parent_key = ROOT_KEY
        else:
            before = blocks.get(parent)
            if before is None or before.span_key is None:
                return None
            parent_key = before.span_key
        span_tokens: tuple[int, ...] = ()
        for part in reversed(parts):
            span_tokens += part
        return hash((parent_key, span_tokens)) & KEY_MASK

    def _removed(self, block_hash: Any) -> None:
        block = self._blocks.pop(block_hash, None)
        if block is None or block.index_key is None:
            return
        key = block.index_key
        count = self._held[key] - 1
        if count:
            self._held[key] = count
        else:
            del self._held[key]
            net_event(self._delta, key, False)

    def _hold(self, key: int) -> None:
        count = self._held.get(key, 0)
        self._held[key] = count + 1
        if not count:
            net_event(self._delta, key, True)

    def drain(self) -> tuple[list[int], list[int], bool]:
        """(stored, removed, cleared) since the last call: `cleared` when vLLM reset its prefix cache, after
        which `stored` is what was cached since."""
        delta, cleared = self._delta, self._cleared
        self._delta, self._cleared = {}, False
        return [k for k, s in delta.items() if s], [k for k, s in delta.items() if not s], cleared

    def snapshot(self) -> list[int]:
        """Every index key held now."""
        return list(self._held)
