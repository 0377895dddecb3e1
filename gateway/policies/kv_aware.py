"""KV-cache-aware routing: send a request where its prompt prefix is already cached, within a load balance.

Owns: `KvAwarePolicy` / `KvAwareParams` (`kv_aware`: cached prefix against load, from the engines' KV
events) and `ApproxPrefixPolicy` / `ApproxPrefixParams` (`approx_prefix`: the baseline that needs no events,
matching what this gateway sent where), and `imbalanced`, the balance threshold both share.
Must not: import asyncio, aiohttp, grpc, prometheus or time; keep mutable state; compute keys or read the
index (the executor looks the prefix up once per request: `RequestFeatures.prefix_hits`, engine -> index
blocks of the prompt it holds, from the first; `prefix_source` says from which index).

Terms, for request r with p = prompt_tokens and engine e among the eligible ones:
  cached_e = min(indexed_tokens(prefix_hits[e]), p): the prompt tokens e need not prefill;
  load_e, by `load` ("active", default: Dynamo's) = the engine's pending prefill tokens + prompt tokens
    dispatched since its report + its running sequences' context tokens (the KV its decode batch reads), or
    ("inflight") `least_loaded.load_tokens(e)` (prompt + max tokens of what this gateway has in flight there,
    + pending prefill);
  q_e = e.queue_length (reported running + waiting + dispatched since).
Balance threshold (SGLang's router): the engines are imbalanced when max q - min q > `balance_abs` and
max q > `balance_rel` x min q; then the cache is ignored and the engine with the fewest queued requests is
taken (ties by load_e, then id). A hot prefix cannot pin all traffic on one engine: once that engine's queue
runs `balance_abs` ahead of the shortest, requests go elsewhere (and seed the prefix there).
kv_aware (Dynamo's KV router cost): otherwise pick argmin of
  cost_e = overlap_weight x (p - cached_e) + load_e
in tokens: the prefill e would still do for r against the work already queued on it (ties by id). With
`index` "sent" the same rule reads the sent index (an ablation: the rule without events).
approx_prefix (SGLang's approximate radix-tree router, with this gateway's sent index for its trees):
otherwise, when the best match ratio max_e cached_e / p exceeds `cache_threshold`, the engine with that
match (ties by load_e, then id); else the least loaded (load_e, then id). SGLang sends a cache miss to the
engine with the smallest tree; the sent index does not expose tree sizes to policies, so least loaded
stands in.
A prompt the gateway has no keys for (text and chat prompts: the gateway does not tokenize) has no hits:
both policies then route by load alone.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from gateway.domain import PREFIX_EVENTS, PREFIX_SENT, ClusterSnapshot, EngineId, EngineView, RequestFeatures
from gateway.policies.base import eligible
from gateway.policies.least_loaded import load_tokens
from gateway.policies.params import NonNegative, NonNegativeFinite, PolicyParams
from switchyard.prefix import indexed_tokens


class _BalanceParams(PolicyParams):
    balance_abs: NonNegative = 32.0  # requests (SGLang's balance_abs_threshold)
    balance_rel: NonNegativeFinite = 1.5  # SGLang's balance_rel_threshold


class KvAwareParams(_BalanceParams):
    # Tokens of load one uncached prompt token is worth; chosen on mooncake-synth and loadgen's sessions by
    # benchmarks/prefix_routing.py sweep (benchmarks/prefix_routing_sweep.json), as are the defaults below.
    # The mean hit rate flattens at the grid's top: 0.657 at 8, 0.670 at 16, 0.671 at 32 (all attain 1.0).
    overlap_weight: NonNegativeFinite = 32.0
    load: Literal["active", "inflight"] = "active"
    index: Literal["events", "sent"] = "events"


def active_tokens(engine: EngineView) -> int:
    """load_e "active" of the module docstring."""
    return engine.pending_prefill_tokens + engine.unreported_prompt_tokens + engine.running_batch_tokens


class ApproxPrefixParams(_BalanceParams):
    # SGLang's cache_threshold (its default 0.5): the match ratio that routes by cache; 0.3 from the sweep
    # (0.7 lost attainment on sessions, 0.981, where a new turn adds a large share of a prompt)
    cache_threshold: NonNegativeFinite = 0.3


def imbalanced(engines: tuple[EngineView, ...], balance_abs: float, balance_rel: float) -> bool:
    """The balance threshold of the module docstring, over the engines' queue lengths."""
    queues = [e.queue_length for e in engines]
    low, high = min(queues), max(queues)
    return high - low > balance_abs and high > balance_rel * low


def _shortest_queue(engines: tuple[EngineView, ...]) -> EngineId:
    return min(engines, key=lambda e: (e.queue_length, load_tokens(e), e.engine_id)).engine_id


def _screen(features: RequestFeatures, snapshot: ClusterSnapshot, params: _BalanceParams
            ) -> tuple[tuple[EngineView, ...], tuple[EngineId | None, str] | None]:
    """The eligible engines, and the decision when it is made before the cache is read: none eligible, or
    the balance threshold tripped (the shortest queue, "balance")."""
    engines = eligible(features, snapshot)
    if not engines:
        return engines, (None, "")
    if len(engines) > 1 and imbalanced(engines, params.balance_abs, params.balance_rel):
        return engines, (_shortest_queue(engines), "balance")
    return engines, None


def cached_tokens(features: RequestFeatures, engine_id: EngineId) -> int:
    """cached_e of the module docstring."""
    hits = features.prefix_hits.get(engine_id, 0)
    return min(indexed_tokens(hits), features.prompt_tokens)


class KvAwarePolicy:
    NAME: ClassVar[str] = "kv_aware"

    def __init__(self, params: KvAwareParams | None = None) -> None:
        self._params = params if params is not None else KvAwareParams()
        self.prefix_source = PREFIX_EVENTS if self._params.index == "events" else PREFIX_SENT
        self._load = active_tokens if self._params.load == "active" else load_tokens

    @property
    def params(self) -> KvAwareParams:
        return self._params

    def costs(self, features: RequestFeatures, snapshot: ClusterSnapshot) -> list[tuple[EngineId, float]]:
        """(engine, cost_e) per eligible engine, in engine-id order (for tests and diagnostics)."""
        weight, p, load = self._params.overlap_weight, features.prompt_tokens, self._load
        return [(e.engine_id, weight * (p - cached_tokens(features, e.engine_id)) + load(e))
                for e in eligible(features, snapshot)]

    def pick(self, features: RequestFeatures, snapshot: ClusterSnapshot) -> EngineId | None:
        return self.decide(features, snapshot)[0]

    def decide(self, features: RequestFeatures, snapshot: ClusterSnapshot) -> tuple[EngineId | None, str]:
        """The pick and why: "balance" (the threshold tripped: shortest queue), "cached" (the cost's argmin
        holds part of the prompt) or "load" (it holds none)."""
        params = self._params
        engines, early = _screen(features, snapshot, params)
        if early is not None:
            return early
        weight, p, hits, load = (params.overlap_weight, features.prompt_tokens, features.prefix_hits,
                                 self._load)
        best: EngineView | None = None
        best_cost = 0.0
        for e in engines:
            cached = min(indexed_tokens(hits.get(e.engine_id, 0)), p) if hits else 0
            cost = weight * (p - cached) + load(e)
            if best is None or cost < best_cost:  # engines come in id order: ties keep the lowest id
                best, best_cost = e, cost
        assert best is not None
        return best.engine_id, "cached" if hits.get(best.engine_id, 0) else "load"


class ApproxPrefixPolicy:
    NAME: ClassVar[str] = "approx_prefix"
    prefix_source: ClassVar[str] = PREFIX_SENT

    def __init__(self, params: ApproxPrefixParams | None = None) -> None:
        self._params = params if params is not None else ApproxPrefixParams()

    @property
    def params(self) -> ApproxPrefixParams:
        return self._params

    def pick(self, features: RequestFeatures, snapshot: ClusterSnapshot) -> EngineId | None:
        return self.decide(features, snapshot)[0]

    def decide(self, features: RequestFeatures, snapshot: ClusterSnapshot) -> tuple[EngineId | None, str]:
        """The pick and why: "balance", "cached" (the best match is above the threshold) or "load"."""
        params = self._params
        engines, early = _screen(features, snapshot, params)
        if early is not None:
            return early
        p = features.prompt_tokens
        if features.prefix_hits and p > 0:
            best = min(engines, key=lambda e: (-cached_tokens(features, e.engine_id), load_tokens(e),
                                                e.engine_id))
            if cached_tokens(features, best.engine_id) / p > params.cache_threshold:
                return best.engine_id, "cached"
        return min(engines, key=lambda e: (load_tokens(e), e.engine_id)).engine_id, "load"
