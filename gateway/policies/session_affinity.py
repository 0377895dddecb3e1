"""Session affinity: keep a conversation on the engine that holds its prefix cache.

Owns: `SessionAffinityPolicy` and `is_saturated`.
Rule: with s = features.session_engine, pick s when all hold:
  1. s is not None and s is eligible (right model, ready, fresh, not excluded);
  2. the session record is live: features.now_s - features.session_last_used_s <= ttl_s;
  3. s is not saturated: NOT (max_num_seqs > 0 and queue_length >= max_num_seqs) and
     NOT (kv_blocks_total > 0 and kv_free_ratio < min_kv_free_ratio), where queue_length is reported running +
     waiting + requests dispatched since the last report.
Otherwise delegate the whole decision to the fallback policy (default least loaded) over the same snapshot;
the fallback may pick s again (e.g. an expired session on the least loaded engine).
Must not: import asyncio, aiohttp, grpc, prometheus or time; keep mutable state (the session table lives in
the cluster store and reaches the policy through `RequestFeatures`).
"""

from __future__ import annotations

from typing import ClassVar

from gateway.domain import ClusterSnapshot, EngineId, EngineView, RequestFeatures
from gateway.policies.base import Policy, eligible
from gateway.policies.least_loaded import LeastLoadedPolicy

DEFAULT_TTL_S = 600.0
DEFAULT_MIN_KV_FREE_RATIO = 0.05


def is_saturated(engine: EngineView, min_kv_free_ratio: float) -> bool:
    """Rule 3 of the module docstring."""
    if engine.max_num_seqs > 0 and engine.queue_length >= engine.max_num_seqs:
        return True
    return engine.kv_blocks_total > 0 and engine.kv_free_ratio < min_kv_free_ratio


class SessionAffinityPolicy:
    NAME: ClassVar[str] = "session_affinity"

    def __init__(
        self,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        min_kv_free_ratio: float = DEFAULT_MIN_KV_FREE_RATIO,
        fallback: Policy | None = None,
    ) -> None:
        if ttl_s < 0:
            raise ValueError(f"ttl_s must be >= 0, got {ttl_s}")
        if not 0.0 <= min_kv_free_ratio <= 1.0:
            raise ValueError(f"min_kv_free_ratio must be in [0, 1], got {min_kv_free_ratio}")
        self._ttl_s = ttl_s
        self._min_kv_free_ratio = min_kv_free_ratio
        self._fallback: Policy = fallback if fallback is not None else LeastLoadedPolicy()

    @property
    def fallback(self) -> Policy:
        return self._fallback

    def pick(self, features: RequestFeatures, snapshot: ClusterSnapshot) -> EngineId | None:
        sticky = self._sticky_engine(features, snapshot)
        if sticky is not None:
            return sticky
        return self._fallback.pick(features, snapshot)

    def _sticky_engine(self, features: RequestFeatures, snapshot: ClusterSnapshot) -> EngineId | None:
        target = features.session_engine
        if target is None or features.now_s - features.session_last_used_s > self._ttl_s:
            return None
        for engine in eligible(features, snapshot):
            if engine.engine_id == target:
                return None if is_saturated(engine, self._min_kv_free_ratio) else target
        return None
