"""`kv_aware`, `approx_prefix` and PRISM's prefix factor on hand-made snapshots (the policies are pure: the
prefix lookup arrives in `RequestFeatures.prefix_hits`)."""

from __future__ import annotations

import pytest
from builders import engine, features, snapshot

from gateway.domain import PREFIX_EVENTS, PREFIX_SENT, EngineId
from gateway.policies.base import prefix_source
from gateway.policies.kv_aware import (
    ApproxPrefixParams,
    ApproxPrefixPolicy,
    KvAwareParams,
    KvAwarePolicy,
)
from gateway.policies.prism import PrismParams, PrismPolicy
from gateway.policies.registry import make_policy
from switchyard.prefix import INDEX_SPAN_TOKENS as SPAN
from switchyard.prefix import indexed_tokens

A, B, C = EngineId("a"), EngineId("b"), EngineId("c")
PROMPT = 8 * SPAN  # 2,048 tokens


def hits(**held: int) -> dict[EngineId, int]:
    """`prefix_hits` (indexed keys matched per engine) for engines holding these many prompt tokens."""
    keys = {indexed_tokens(n): n for n in range(200)}
    return {EngineId(k): keys[tokens] for k, tokens in held.items()}


@pytest.mark.parametrize(
    ("loads", "held", "weight", "expected", "why"),
    [
        # equal load: the engine holding more of the prompt wins
        ((0, 0, 0), {"b": 1024}, 1.0, B, "cached"),
        # b holds half the prompt (1,024 tokens saved) but carries 2,000 more tokens of work: a wins ...
        ((0, 2000, 0), {"b": 1024}, 1.0, A, "load"),
        # ... unless an uncached token is worth 2 tokens of queued work (2,048 saved > 2,000)
        ((0, 2000, 0), {"b": 1024}, 2.0, B, "cached"),
        # nothing cached anywhere: least loaded, lowest id on ties
        ((300, 100, 100), {}, 1.0, B, "load"),
        # a cache hit on the busier of two: the partial match decides against a full one on a loaded engine
        ((0, 1600, 0), {"a": 512, "b": 2048}, 1.0, A, "cached"),  # 1,536 to prefill on a < 1,600 queued on b
    ],
)
def test_kv_aware_prices_the_cached_prefix_against_queued_work(
    loads: tuple[int, int, int], held: dict[str, int], weight: float, expected: EngineId, why: str
) -> None:
    engines = [engine(name, pending_prefill_tokens=load) for name, load in zip("abc", loads, strict=True)]
    policy = KvAwarePolicy(KvAwareParams(overlap_weight=weight))
    f = features(prompt_tokens=PROMPT, prefix_hits=hits(**held))
    assert policy.decide(f, snapshot(*engines)) == (expected, why)


def test_kv_aware_a_hot_prefix_cannot_pin_every_request() -> None:
    """Every request shares a prefix only a holds. While the queues are balanced a takes them; once a's
    queue runs `balance_abs` requests ahead of the shortest (and `balance_rel` times it), the threshold trips
    and the shortest queue takes the request (where the prefix then gets cached too)."""
    policy = KvAwarePolicy(KvAwareParams(overlap_weight=100.0, balance_abs=8.0, balance_rel=1.5))
    f = features(prompt_tokens=PROMPT, prefix_hits=hits(a=PROMPT))
    near = snapshot(engine("a", num_running=8), engine("b", num_running=2), engine("c", num_running=3))
    assert policy.decide(f, near) == (A, "cached")
    far = snapshot(engine("a", num_running=12), engine("b", num_running=2), engine("c", num_running=3))
    assert policy.decide(f, far) == (B, "balance")


def test_kv_aware_load_measures_and_sources() -> None:
    busy = engine("a", running_batch_tokens=5000)
    idle = engine("b", inflight_tokens=6000)  # this gateway's upper bound; its batch reads no KV
    f = features(prompt_tokens=PROMPT)
    assert KvAwarePolicy().pick(f, snapshot(busy, idle)) == B  # "active": what the engine is doing
    assert KvAwarePolicy(KvAwareParams(load="inflight")).pick(f, snapshot(busy, idle)) == A
    assert prefix_source(KvAwarePolicy()) == PREFIX_EVENTS
    assert prefix_source(KvAwarePolicy(KvAwareParams(index="sent"))) == PREFIX_SENT
    assert prefix_source(ApproxPrefixPolicy()) == PREFIX_SENT
    assert prefix_source(make_policy("least_loaded")) is None
    assert prefix_source(make_policy("session_affinity", {"fallback": "kv_aware"})) == PREFIX_EVENTS
    assert KvAwarePolicy().pick(f, snapshot()) is None


@pytest.mark.parametrize(
    ("held", "loads", "expected", "why"),
    [
        ({"b": 1024}, (0, 900, 0), B, "cached"),  # 1,024 / 2,048 = 0.5 > 0.4: the best match, any load
        ({"b": 768}, (0, 900, 0), A, "load"),  # 0.375 is not above the threshold: least loaded
        ({"b": 1024, "c": 1024}, (0, 900, 100), C, "cached"),  # equal matches: the less loaded
        ({}, (500, 0, 100), B, "load"),
    ],
)
def test_approx_prefix_routes_by_match_ratio_above_the_threshold(
    held: dict[str, int], loads: tuple[int, int, int], expected: EngineId, why: str
) -> None:
    engines = [engine(name, pending_prefill_tokens=load) for name, load in zip("abc", loads, strict=True)]
    f = features(prompt_tokens=PROMPT, prefix_hits=hits(**held))
    assert ApproxPrefixPolicy(ApproxPrefixParams(cache_threshold=0.4)).decide(f, snapshot(*engines)) == (
        expected, why)


def test_approx_prefix_balance_threshold() -> None:
    f = features(prompt_tokens=PROMPT, prefix_hits=hits(a=PROMPT))
    fleet = snapshot(engine("a", num_running=40), engine("b", num_running=2))
    assert ApproxPrefixPolicy().decide(f, fleet) == (B, "balance")


def test_prism_prefix_factor_prices_the_prefill_a_cache_saves() -> None:
    """Two LENS engines, b a little busier; a long prompt b holds 7/8 of. Without the prefix factor PRISM
    takes the idler a; with it, b's predicted first token (1 block to prefill instead of 8) and its affinity
    win. A prefix on neither engine changes nothing."""
    lens = dict(peak_throughput_tokens_per_s=10_000.0, prefill_tokens_per_s=8_000.0,
                predicted_batch_latency_s=0.02)
    fleet = snapshot(engine("a", **lens), engine("b", pending_prefill_tokens=800, num_running=2, **lens))
    long_prompt = 64 * SPAN
    f = features(prompt_tokens=long_prompt, prefix_hits=hits(b=56 * SPAN), slo_ttft_s=5.0, slo_tpot_s=0.1)
    plain, prefix = PrismPolicy(), PrismPolicy(PrismParams(prefix=True))
    assert plain.pick(f, fleet) == A and prefix_source(plain) is None
    assert prefix.pick(f, fleet) == B and prefix_source(prefix) == PREFIX_EVENTS
    first = {e: t for e, t, _, _ in prefix.timings(f, fleet)}
    assert first[B] < first[A]
    cold = features(prompt_tokens=long_prompt, slo_ttft_s=5.0, slo_tpot_s=0.1)
    assert prefix.scores(cold, fleet) == plain.scores(cold, fleet)
