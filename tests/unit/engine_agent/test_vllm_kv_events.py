"""`IndexKeyMapper`: vLLM's KV events (stand-ins with vLLM's class names and fields, as vLLM 0.32's
`BlockPool` emits them) become exactly the index keys the gateway computes for the same prompts."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from engine_agent.backends.vllm.kv_events import IndexKeyMapper
from switchyard.prefix import INDEX_SPAN_TOKENS, index_keys

BS = 16


@dataclass
class BlockStored:
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    group_idx: int | None = 0


@dataclass
class BlockRemoved:
    block_hashes: list[Any]
    group_idx: int | None = 0


@dataclass
class AllBlocksCleared:
    pass


@dataclass
class FakePool:
    """vLLM's side: hash-chained 16-token blocks (its hashes are opaque bytes here; `salt` stands for the
    extra keys, LoRA or cache salt, that change vLLM's hash but not the tokens)."""

    salt: bytes = b""
    hashes: dict[tuple[int, ...], bytes] = field(default_factory=dict)

    def chain(self, ids: tuple[int, ...]) -> list[bytes]:
        out, parent = [], self.salt
        for start in range(0, len(ids) - len(ids) % BS, BS):
            parent = hashlib.sha256(parent + repr(ids[start:start + BS]).encode()).digest()
            out.append(parent)
        return out

    def store(self, ids: tuple[int, ...], first: int, last: int) -> BlockStored:
        """The event for blocks [first, last) of `ids` computed in one step."""
        chain = self.chain(ids)
        return BlockStored(chain[first:last], chain[first - 1] if first else None,
                           list(ids[first * BS:last * BS]), BS)


def prompt(tag: int, n: int) -> tuple[int, ...]:
    return tuple(7 + (tag * 1_000_003 + i * 7919) % 30_000 for i in range(n))


def test_stored_blocks_become_the_gateway_keys_of_the_prompt_over_chunked_steps() -> None:
    pool, mapper = FakePool(), IndexKeyMapper(BS)
    ids = prompt(1, 9 * INDEX_SPAN_TOKENS + 40)  # 146 full blocks, 9 spans: keys at spans 0-3 and 7
    # prefill in chunks of 50, 50 and 46 blocks, and vLLM's trailing partial block (ignored)
    mapper.feed([pool.store(ids, 0, 50)])
    mapper.feed([pool.store(ids, 50, 100), pool.store(ids, 100, 146),
                 BlockStored([b"partial"], pool.chain(ids)[-1], list(ids[146 * BS:]), 8)])
    stored, removed, cleared = mapper.drain()
    assert stored == index_keys(ids) and len(stored) == 5
    assert removed == [] and not cleared and mapper.unplaced == 0
    assert mapper.drain() == ([], [], False)


def test_a_branch_off_mid_span_keys_from_the_shared_tokens() -> None:
    pool, mapper = FakePool(), IndexKeyMapper(BS)
    first = prompt(2, 3 * INDEX_SPAN_TOKENS)
    second = first[:INDEX_SPAN_TOKENS + 80] + prompt(3, 2 * INDEX_SPAN_TOKENS)  # shares 21 blocks
    mapper.feed([pool.store(first, 0, 48)])
    mapper.drain()
    # vLLM re-announces the hit blocks (parent None, all known: nothing new), then stores the new ones
    mapper.feed([pool.store(second, 0, 21), pool.store(second, 21, len(second) // BS)])
    stored, _, _ = mapper.drain()
    assert index_keys(second)[0] == index_keys(first)[0]
    assert stored == index_keys(second)[1:]  # the shared first span was held already


def test_evictions_remove_keys_once_no_block_holds_them_and_net_per_drain() -> None:
    plain, salted, mapper = FakePool(), FakePool(salt=b"lora-a"), IndexKeyMapper(BS)
    ids = prompt(4, 2 * INDEX_SPAN_TOKENS)
    mapper.feed([plain.store(ids, 0, 32), salted.store(ids, 0, 32)])  # one prompt cached twice
    keys = index_keys(ids)
    assert mapper.drain() == (keys, [], False)
    ends = [plain.chain(ids)[15], plain.chain(ids)[31]]
    mapper.feed([BlockRemoved(list(reversed(ends)))])
    assert mapper.drain() == ([], [], False)  # the salted copy still holds both keys
    mapper.feed([BlockRemoved(list(reversed(salted.chain(ids))))])  # tail first, as vLLM's free queue evicts
    assert sorted(mapper.drain()[1]) == sorted(keys)
    # stored and evicted between two drains: never reported
    mapper.feed([plain.store(ids, 0, 32), BlockRemoved(plain.chain(ids))])
    assert mapper.drain() == ([], [], False)
    assert mapper.snapshot() == [] and len(mapper) == 0


def test_a_cache_reset_clears_and_an_unknown_parent_is_skipped_not_guessed() -> None:
    pool, mapper = FakePool(), IndexKeyMapper(BS)
    ids = prompt(5, INDEX_SPAN_TOKENS)
    mapper.feed([pool.store(ids, 0, 16)])
    mapper.feed([AllBlocksCleared()])
    assert mapper.drain() == ([], [], True) and mapper.snapshot() == []
    other = prompt(6, 2 * INDEX_SPAN_TOKENS)
    mapper.feed([pool.store(other, 16, 32)])  # its first 16 blocks were never seen
    assert mapper.drain() == ([], [], False) and mapper.unplaced == 16
    mapper.feed([pool.store(other, 0, 16), BlockStored([b"x"], None, list(other[:BS]), BS, group_idx=1)])
    assert mapper.drain() == ([index_keys(other)[0]], [], False)  # another cache group is not ours
    assert mapper.snapshot() == [index_keys(other)[0]]
