"""Prefix block keys: the one definition of "the same prefix" that engines, agents and the gateway share.

Owns: `block_keys` (the hash chain over a prompt's full blocks of token ids, vLLM's scheme: a block's key
covers its tokens and its parent's key, so equal keys mean equal prefixes up to and including that block),
`INDEX_SPAN_TOKENS` (the span of one gateway index block), `span_of` (how many engine blocks one index
block covers), which index blocks are indexed at all (`is_indexed`, `index_keys`, `indexed_tokens`), and
`net_event`, how an engine's batch of key events is netted before it is sent.
Must not: hold state, read clocks or do I/O.

Two granularities use the same function:
- an engine caches at its KV block size (`Profile.block_size`, vLLM's `--block-size`): `block_keys(ids, 16)`;
- the gateway's cache index works on index blocks of `INDEX_SPAN_TOKENS` tokens: `block_keys(ids, 256)`.
  An engine reports index block j as cached when its engine block covering the span's last token, at position
  (j + 1) * span_of(block_size) - 1, is cached (the engine's chain makes that block stand for the whole
  prefix up to it), and removed when that block is evicted. The coarse chain is 2x cheaper to compute than
  the fine one (measured: 140 us against 290 us for a 12,000-token prompt in CPython) and 16x smaller to
  index, at the price of not counting up to 255 tokens at the end of a cached prefix.

Not every index block is indexed (`INDEX_TIERS`): all of the first four (the first 1,024 tokens, where shared
system prompts end), then one in four up to 4,096 tokens, then one in eight (one key per 2,048 tokens). A key
still chains every 256-token block before it, so holding the k-th indexed key means holding the whole prefix
up to it; a match is exact to 256 tokens on short prompts, to 1,024 up to 4,096 tokens and to 2,048 beyond
(a quarter of an 8,192-token prompt at worst). Why: KV events are one key per indexed block stored or
evicted, and on long-prompt traffic they outweighed the state they ride on (`benchmarks/prefix_routing.py
traffic`, mooncake-conv, kv_aware: 26 % of the stream's bytes with every block indexed and 64-bit keys,
4.3 % with these tiers, 32-bit keys and the span stated once per stream; the budget is 5 %). The simulated
prefix hit rate went from 0.330 to 0.328 at the same weights.

Keys are Python's `hash` of `(parent key, block tuple)` masked to 32 bits: deterministic across processes and
machines for integer tuples (PYTHONHASHSEED randomises only str and bytes), so an agent and the gateway agree
without exchanging anything but the keys. 32 bits, not 64: half the event bytes and index memory. The index
is advisory (an engine's own cache checks full hashes, so a wrong guess costs a miss, never a wrong answer),
and a collision misleads only when a request's next key equals another block held by an engine that already
matched the request so far: at 20,000 keys held per engine about 5 in a million lookups.
"""

from __future__ import annotations

from collections.abc import Sequence

# Tokens per gateway index block: a multiple of every KV block size vLLM offers (16, 32, 64, 128).
INDEX_SPAN_TOKENS = 256
# Which index blocks are indexed: (up to this many index blocks from the prompt's start, one in this many),
# the last tier open-ended. Index block j is indexed when j + 1 is a multiple of its tier's stride.
INDEX_TIERS: tuple[tuple[int | None, int], ...] = ((4, 1), (16, 4), (None, 8))
KEY_MASK = (1 << 32) - 1
ROOT_KEY = 0  # the parent of a prompt's first block


def block_keys(token_ids: Sequence[int], block_tokens: int, *, limit: int | None = None) -> list[int]:
    """The chain keys of the full `block_tokens`-token blocks of `token_ids` (a trailing partial block has
    none), at most `limit` of them. `token_ids` should be a tuple: slicing a list copies it twice."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    ids = token_ids if isinstance(token_ids, tuple) else tuple(token_ids)
    count = len(ids) // block_tokens
    if limit is not None and limit < count:
        count = limit
    keys: list[int] = []
    parent = ROOT_KEY
    for start in range(0, count * block_tokens, block_tokens):
        parent = hash((parent, ids[start:start + block_tokens])) & KEY_MASK
        keys.append(parent)
    return keys


def span_of(block_size: int, span_tokens: int = INDEX_SPAN_TOKENS) -> int:
    """Engine blocks per index block; ValueError unless the KV block size divides the span."""
    if block_size <= 0 or span_tokens % block_size:
        raise ValueError(f"a KV block of {block_size} tokens does not divide the {span_tokens}-token index "
                         f"span")
    return span_tokens // block_size


def is_indexed(j: int) -> bool:
    """Whether index block `j` (0-based, `INDEX_SPAN_TOKENS` tokens each) has a key in the gateway's index."""
    n = j + 1
    for limit, stride in INDEX_TIERS:
        if limit is None or n <= limit:
            return n % stride == 0
    return False  # unreachable: the last tier has no limit


def index_keys(token_ids: Sequence[int]) -> list[int]:
    """The keys of a prompt's indexed blocks, in order: what the gateway matches and records."""
    keys = block_keys(token_ids, INDEX_SPAN_TOKENS)
    return [key for j, key in enumerate(keys) if is_indexed(j)]


def indexed_tokens(count: int) -> int:
    """The prompt tokens covered by the first `count` indexed keys (a match of `count` keys)."""
    left, covered = count, 0  # keys still to place; index blocks covered by the tiers passed
    if left <= 0:
        return 0
    for limit, stride in INDEX_TIERS:
        if limit is None or left <= limit // stride - covered // stride:
            return (covered // stride + left) * stride * INDEX_SPAN_TOKENS
        left -= limit // stride - covered // stride
        covered = limit
    raise AssertionError("the last tier has no limit")


def net_event(delta: dict[int, bool], key: int, stored: bool) -> None:
    """Add one key event (stored True / removed False) to a batch keyed by index key: an event that undoes
    the batch's earlier one for the key cancels it (stored then removed, or removed then stored, between two
    drains is no change for a receiver)."""
    if delta.get(key) is (not stored):
        del delta[key]
    else:
        delta[key] = stored
