"""SimEngine's prefix cache: hits on full blocks, exact cached_tokens, partial blocks, LRU eviction under
pressure, KV events at index granularity, and that the timing charges only the uncached prefill."""

from __future__ import annotations

import dataclasses

from engine_agent.domain import BackendRequest, FinishEvent, KvDelta, RequestId, SamplingSpec
from engine_agent.sim.engine import SimEngine, StepResult
from engine_agent.sim.prefix_cache import PrefixCache
from switchyard.prefix import INDEX_SPAN_TOKENS, KEY_MASK, block_keys, index_keys, indexed_tokens, span_of
from switchyard.profiles import get_profile

BASE = get_profile("h100-llama3-8b")
BS = BASE.block_size


def engine(**changes: object) -> SimEngine:
    return SimEngine(dataclasses.replace(BASE, **changes),  # type: ignore[arg-type]
                     prefix_caching=True, kv_events=True)


def prompt(tag: int, n: int) -> tuple[int, ...]:
    """n tokens that share nothing with another tag's."""
    return tuple(1000 * tag + i % 997 + 3 for i in range(n))


def request(rid: str, ids: tuple[int, ...], out: int = 4) -> BackendRequest:
    return BackendRequest(RequestId(rid), ids, SamplingSpec(max_tokens=out, ignore_eos=True))


def run(e: SimEngine, now_s: float = 0.0) -> tuple[float, list[StepResult], dict[str, FinishEvent]]:
    steps: list[StepResult] = []
    finished: dict[str, FinishEvent] = {}
    while e.has_work():
        result = e.step(now_s)
        now_s += result.duration_s
        steps.append(result)
        finished.update(result.finished)
    return now_s, steps, finished


def test_block_keys_chain_full_blocks_only_and_depend_on_every_earlier_token() -> None:
    ids = prompt(1, 100)
    keys = block_keys(ids, BS)
    assert len(keys) == 100 // BS
    assert block_keys(ids[:64] + (5,) * 36, BS)[:4] == keys[:4]  # same first 64 tokens: same 4 keys
    changed = (ids[0] + 1,) + ids[1:]
    assert not set(block_keys(changed, BS)) & set(keys)  # a different first token changes every key
    assert block_keys(list(ids), BS) == keys
    assert block_keys(ids, BS, limit=2) == keys[:2]
    assert span_of(16) == 16 and span_of(64) == 4


def test_a_repeated_prompt_reuses_its_full_blocks_and_reports_cached_tokens_exactly() -> None:
    e = engine(max_batched_tokens=8192)
    ids = prompt(1, 4000)
    e.add_request(request("a", ids), 0.0)
    now_s, first_steps, done = run(e)
    assert done["a"].usage.cached_tokens == 0
    e.add_request(request("b", ids), now_s)
    _, steps, done = run(e, now_s)
    # 250 full blocks (4,000 tokens) are cached; vLLM recomputes the last, so 3,984 hit and 16 are computed.
    assert done["b"].usage.cached_tokens == 3984
    assert steps[0].record.num_prefill_tokens == 16
    assert first_steps[0].record.num_prefill_tokens == 4000
    # Timing charges only the uncached prefill (a compute-bound 4,000-token prefill against a 16-token one
    # reading 3,984 cached tokens).
    assert steps[0].duration_s < 0.5 * first_steps[0].duration_s
    stats = e.stats(now_s)
    assert stats.kv_blocks_free == stats.kv_blocks_total  # cached blocks nobody holds count as free


def test_a_fully_cached_prompt_recomputes_its_last_block() -> None:
    e = engine()
    ids = prompt(2, 6 * BS)  # exactly 6 blocks: vLLM recomputes at least the last token
    e.add_request(request("a", ids), 0.0)
    now_s, _, _ = run(e)
    e.add_request(request("b", ids), now_s)
    _, steps, done = run(e, now_s)
    assert done["b"].usage.cached_tokens == 5 * BS
    assert steps[0].record.num_prefill_tokens == BS


def test_partial_sharing_hits_only_the_shared_full_blocks() -> None:
    e = engine()
    shared = prompt(3, 40)  # 2 full blocks + 8 tokens of a third
    e.add_request(request("a", shared + prompt(4, 60)), 0.0)
    now_s, _, _ = run(e)
    e.add_request(request("b", shared + prompt(5, 60)), now_s)
    _, steps, done = run(e, now_s)
    assert done["b"].usage.cached_tokens == 2 * BS
    assert steps[0].record.num_prefill_tokens == 100 - 2 * BS


def test_requests_in_flight_share_blocks_and_kv_returns_in_full() -> None:
    e = engine(max_batched_tokens=512)
    ids = prompt(6, 300)
    e.add_request(request("a", ids, out=8), 0.0)
    e.add_request(request("b", ids, out=8), 0.0)
    first = e.step(0.0)
    # a computes 300 tokens and caches 18 full blocks; b, scheduled in the same iteration, reuses them (as in
    # vLLM, whose scheduler caches a block when it allocates it) and computes the 12 tokens left.
    assert first.record.num_prefill_tokens == 300 + 12
    stats = e.stats(0.0)
    assert stats.kv_blocks_total - stats.kv_blocks_free == 19 + 1  # 18 shared + a's and b's own last block
    _, _, done = run(e, first.duration_s)
    assert done["b"].usage.cached_tokens == 288
    stats = e.stats(1.0)
    assert stats.kv_blocks_free == stats.kv_blocks_total
    cache = e.prefix_cache
    assert cache is not None and cache.evictable == cache.cached_blocks == 18


def test_eviction_under_pressure_takes_empty_blocks_first_then_the_least_recently_used() -> None:
    e = engine(num_gpu_blocks_override=40, max_batched_tokens=4096)
    a, b, c = prompt(7, 10 * BS + 1), prompt(8, 10 * BS + 1), prompt(9, 19 * BS + 1)
    e.add_request(request("a", a, out=1), 0.0)
    now_s, _, _ = run(e)
    e.add_request(request("b", b, out=1), now_s)
    now_s, _, _ = run(e, now_s)
    cache = e.prefix_cache
    assert cache is not None and cache.evictable == 20  # 10 full blocks each; the partial ones are empty
    # 20 empty blocks are left: c's 20 blocks fit without evicting anything.
    e.add_request(request("c", c, out=1), now_s)
    now_s, _, _ = run(e, now_s)
    assert cache.match(block_keys(a, BS)) == 10 and cache.match(block_keys(b, BS)) == 10
    assert cache.evicted_total == 0
    # A hit on a moves its blocks to most recently used; then d needs 16 blocks with 1 empty: the 15 least
    # recently used go, all of b's and c's last 5 (a released prompt enters the order tail first, so a
    # prefix loses its end, not its start).
    e.add_request(request("a2", a, out=1), now_s)
    now_s, _, done = run(e, now_s)
    assert done["a2"].usage.cached_tokens == 10 * BS
    e.add_request(request("d", prompt(10, 16 * BS), out=1), now_s)
    run(e, now_s)
    assert cache.evicted_total == 15
    assert cache.match(block_keys(a, BS)) == 10
    assert cache.match(block_keys(b, BS)) == 0
    assert cache.match(block_keys(c, BS)) == 14


def test_index_events_are_emitted_at_span_ends_and_netted_per_drain() -> None:
    e = engine(num_gpu_blocks_override=64)
    ids = prompt(12, 2 * INDEX_SPAN_TOKENS + 10)
    e.add_request(request("a", ids, out=1), 0.0)
    now_s, _, _ = run(e)
    delta = e.drain_kv_events()
    assert delta == KvDelta(tuple(block_keys(ids, INDEX_SPAN_TOKENS)), (), False)
    assert not e.drain_kv_events()
    # Another prompt of 64 blocks evicts all of a's: both index keys are removed.
    e.add_request(request("b", prompt(13, 63 * BS + 1), out=1), now_s)
    run(e, now_s)
    delta = e.drain_kv_events()
    assert set(delta.removed) == set(block_keys(ids, INDEX_SPAN_TOKENS))
    assert len(delta.stored) == 63 // span_of(BS)
    snapshot = e.kv_snapshot()
    assert snapshot.cleared and set(snapshot.stored) == set(delta.stored)


def test_indexed_blocks_thin_out_with_depth_and_the_engine_reports_exactly_those() -> None:
    ids = prompt(14, 31 * INDEX_SPAN_TOKENS + 5)  # index blocks 0..30
    every = block_keys(ids, INDEX_SPAN_TOKENS)
    keys = index_keys(ids)
    # all of the first 4, one in 4 up to the 16th, one in 8 beyond
    assert keys == [every[j] for j in (0, 1, 2, 3, 7, 11, 15, 23)]
    assert all(0 <= k <= KEY_MASK for k in keys) and KEY_MASK == 2**32 - 1
    # a match of n keys covers the prompt up to the n-th indexed block's end
    spans = [indexed_tokens(n) // INDEX_SPAN_TOKENS for n in range(11)]
    assert spans == [0, 1, 2, 3, 4, 8, 12, 16, 24, 32, 40]
    e = engine()
    e.add_request(request("a", ids, out=1), 0.0)
    run(e)
    assert e.drain_kv_events() == KvDelta(tuple(keys), (), False)


def test_a_key_stored_and_removed_between_drains_is_not_reported() -> None:
    cache = PrefixCache()
    assert cache.insert(1, 101) and cache.release([1]) == 1
    assert cache.evict(1) == 1
    assert cache.drain() == KvDelta()
    assert cache.insert(2, 102)
    assert cache.drain() == KvDelta((102,), (), False)
    cache.release([2])
    cache.evict(1)
    assert cache.insert(2, 102)  # removed, then stored again: no net change
    assert cache.drain() == KvDelta()
    assert not cache.insert(2, 102)  # already cached: the caller keeps its copy private


def test_preemption_releases_cached_blocks_and_readmission_hits_them() -> None:
    e = engine(num_gpu_blocks_override=24, max_batched_tokens=4096)
    e.add_request(request("a", prompt(14, 10 * BS), out=60), 0.0)
    e.add_request(request("b", prompt(15, 10 * BS), out=60), 0.0)
    now_s, steps, done = run(e)
    assert sum(s.record.num_preempted for s in steps) > 0
    assert set(done) == {"a", "b"}
    stats = e.stats(now_s)
    assert stats.kv_blocks_free == stats.kv_blocks_total
    cache = e.prefix_cache
    assert cache is not None and cache.hit_blocks_total > 0  # the preempted one found its prompt cached


def test_prefix_caching_off_hashes_nothing_and_never_hits() -> None:
    e = SimEngine(BASE)
    ids = prompt(16, 100)
    e.add_request(request("a", ids), 0.0)
    now_s, _, _ = run(e)
    e.add_request(request("b", ids), now_s)
    _, steps, done = run(e, now_s)
    assert done["b"].usage.cached_tokens == 0 and steps[0].record.num_prefill_tokens == 100
    assert e.prefix_cache is None and not e.drain_kv_events()
