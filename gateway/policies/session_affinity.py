"""Session affinity: keep a conversation on the engine that holds its prefix cache.

Owns: `SessionAffinityPolicy`, its parameters `SessionAffinityParams` and `is_saturated`.
Rule: with s = features.session_engine, pick s when all hold:
  1. s is not None and s is eligible (right model, ready, not ejected, not excluded);
  2. the session record is live: features.now_s - features.session_last_used_s <= ttl_s;
  3. s is not saturated: NOT (max_num_seqs > 0 and queue_length >= max_num_seqs) and
     NOT (kv_blocks_total > 0 and kv_free_ratio < min_kv_free_ratio), where queue_length is reported running +
     waiting + requests dispatched since the last report.
Otherwise delegate the whole decision to the fallback policy (default least loaded) over the same snapshot;
the fallback may pick s again (e.g. an expired session on the least loaded engine).
Parameters: `ttl_s` >= 0, `min_kv_free_ratio` in [0, 1], `fallback` (a policy name, not this one) and
`fallback_params`. The registry builds the fallback from those two (`make_policy`) and hands it in; this
module builds only the default one, least loaded with default parameters.
Must not: import asyncio, aiohttp, grpc, prometheus or time; keep mutable state (the session table lives in
the cluster store and reaches the policy through `RequestFeatures`).
"""

from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import Field, StrictFloat, StrictStr, field_validator

from gateway.domain import ClusterSnapshot, EngineId, EngineView, RequestFeatures, RouteTag
from gateway.policies.base import Policy, eligible, prefix_source
from gateway.policies.least_loaded import LeastLoadedPolicy
from gateway.policies.params import NonNegative, PolicyParams

_NAME = "session_affinity"


class SessionAffinityParams(PolicyParams):
    ttl_s: NonNegative = 600.0
    min_kv_free_ratio: Annotated[StrictFloat, Field(ge=0, le=1)] = 0.05
    fallback: StrictStr = LeastLoadedPolicy.NAME
    fallback_params: dict[str, object] = Field(default_factory=dict)

    @field_validator("fallback")
    @classmethod
    def _not_itself(cls, value: str) -> str:
        if value == _NAME:
            raise ValueError(f"{_NAME} cannot fall back to itself")
        return value


def is_saturated(engine: EngineView, min_kv_free_ratio: float) -> bool:
    """Rule 3 of the module docstring."""
    if engine.max_num_seqs > 0 and engine.queue_length >= engine.max_num_seqs:
        return True
    return engine.kv_blocks_total > 0 and engine.kv_free_ratio < min_kv_free_ratio


class SessionAffinityPolicy:
    NAME: ClassVar[str] = _NAME

    def __init__(
        self, params: SessionAffinityParams | None = None, *, fallback: Policy | None = None
    ) -> None:
        """`fallback` is the policy `params` names, built from `params.fallback_params`; it may be left out
        only when `params` keep the default fallback (least loaded, no parameters)."""
        params = params if params is not None else SessionAffinityParams()
        if fallback is None:
            if params.fallback != LeastLoadedPolicy.NAME or params.fallback_params:
                raise ValueError(
                    f"build the configured fallback {params.fallback!r} with make_policy and pass it in"
                )
            fallback = LeastLoadedPolicy()
        elif fallback.NAME != params.fallback:
            raise ValueError(f"fallback is a {fallback.NAME!r} policy, but params name {params.fallback!r}")
        self._params = params
        self._ttl_s = params.ttl_s
        self._min_kv_free_ratio = params.min_kv_free_ratio
        self._fallback: Policy = fallback

    @property
    def params(self) -> SessionAffinityParams:
        return self._params

    @property
    def fallback(self) -> Policy:
        return self._fallback

    @property
    def prefix_source(self) -> str | None:
        """The fallback's prefix lookup (`base.prefix_source`): a KV-cache-aware fallback gets its hits."""
        return prefix_source(self._fallback)

    @property
    def in_place(self) -> bool:
        """The fallback's say on in-place execution in disaggregated combos (`gateway.dispatch.life`)."""
        return bool(getattr(self._fallback, "in_place", False))

    def pick(self, features: RequestFeatures, snapshot: ClusterSnapshot) -> EngineId | None:
        sticky = self._sticky_engine(features, snapshot)
        if sticky is not None:
            return sticky
        return self._fallback.pick(features, snapshot)

    def choose(
        self, features: RequestFeatures, snapshot: ClusterSnapshot
    ) -> tuple[EngineId | None, RouteTag | None]:
        """`pick`, with the fallback's `RouteTag` when it is a weighted policy (goodput_rr), so the picks it
        makes are counted; a sticky pick carries none (it is not the fallback's)."""
        sticky = self._sticky_engine(features, snapshot)
        if sticky is not None:
            return sticky, None
        choose = getattr(self._fallback, "choose", None)
        if choose is not None:
            engine_id, route = choose(features, snapshot)
            return engine_id, route
        return self._fallback.pick(features, snapshot), None

    def _sticky_engine(self, features: RequestFeatures, snapshot: ClusterSnapshot) -> EngineId | None:
        target = features.session_engine
        if target is None or features.now_s - features.session_last_used_s > self._ttl_s:
            return None
        for engine in eligible(features, snapshot):
            if engine.engine_id == target:
                return None if is_saturated(engine, self._min_kv_free_ratio) else target
        return None
