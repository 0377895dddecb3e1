"""Least loaded, by in-flight tokens (default) or by queue length (NexusSched §7.4's baseline).

Owns: `LeastLoadedPolicy`, its parameters `LeastLoadedParams` (`measure`), and `load_tokens`, the load
measure other policies reuse.
Formula, measure "tokens": load(e) = e.inflight_tokens + e.pending_prefill_tokens, where
  - inflight_tokens is this gateway's optimistic account: prompt + max_tokens of every request it dispatched
    to e and has not seen finish (an upper bound on the work it sent there, visible before the engine reports
    it);
  - pending_prefill_tokens is what the engine last reported as admitted but not yet prefilled (this also
    covers requests from other gateways sharing the engine).
A request of ours that is still prefilling is counted in both terms; the bias is the same on every engine and
vanishes once its prefill is done.
Formula, measure "requests": load(e) = e.queue_length = reported running + waiting + requests dispatched since
that report (the paper's "queue length as a proxy for load").
Pick argmin over eligible engines of (load, engine_id): ties go to the lowest engine id, so the result is
deterministic.
Must not: import asyncio, aiohttp, grpc, prometheus or time; keep mutable state.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from gateway.domain import ClusterSnapshot, EngineId, EngineView, RequestFeatures
from gateway.policies.base import eligible
from gateway.policies.params import PolicyParams

LoadMeasure = Literal["tokens", "requests"]


class LeastLoadedParams(PolicyParams):
    measure: LoadMeasure = "tokens"


def load_tokens(engine: EngineView) -> int:
    """The load measure of this module's formula."""
    return engine.inflight_tokens + engine.pending_prefill_tokens


class LeastLoadedPolicy:
    NAME: ClassVar[str] = "least_loaded"

    def __init__(self, params: LeastLoadedParams | None = None) -> None:
        self._params = params if params is not None else LeastLoadedParams()
        self.measure: LoadMeasure = self._params.measure

    @property
    def params(self) -> LeastLoadedParams:
        return self._params

    def pick(self, features: RequestFeatures, snapshot: ClusterSnapshot) -> EngineId | None:
        engines = eligible(features, snapshot)
        if not engines:
            return None
        if self.measure == "requests":
            return min(engines, key=lambda e: (e.queue_length, e.engine_id)).engine_id
        return min(engines, key=lambda e: (load_tokens(e), e.engine_id)).engine_id
