"""Round robin: the baseline policy.

Owns: `RoundRobinPolicy` and its (empty) parameters `RoundRobinParams`.
Formula: let E be the eligible engines (`base.eligible`: right model, ready, not ejected, not excluded)
sorted by engine id; pick E[dispatch_seq mod |E|]. `dispatch_seq` comes from the dispatcher (one per
decision), so the policy holds no counter and stays a pure function; when the eligible set changes the
rotation simply continues over the new set.
Must not: import asyncio, aiohttp, grpc, prometheus or time; keep mutable state.
"""

from __future__ import annotations

from typing import ClassVar

from gateway.domain import ClusterSnapshot, EngineId, RequestFeatures
from gateway.policies.base import eligible
from gateway.policies.params import PolicyParams


class RoundRobinParams(PolicyParams):
    """No parameters: any key is rejected."""


class RoundRobinPolicy:
    NAME: ClassVar[str] = "round_robin"

    def __init__(self, params: RoundRobinParams | None = None) -> None:
        self._params = params if params is not None else RoundRobinParams()

    @property
    def params(self) -> RoundRobinParams:
        return self._params

    def pick(self, features: RequestFeatures, snapshot: ClusterSnapshot) -> EngineId | None:
        engines = eligible(features, snapshot)  # in engine-id order, as every snapshot lists its engines
        if not engines:
            return None
        return engines[features.dispatch_seq % len(engines)].engine_id
