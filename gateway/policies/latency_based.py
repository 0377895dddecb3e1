"""Latency based: route to the engine with the lowest recent average latency (NexusSched §7.4's baseline).

Owns: `LatencyBasedPolicy` and its parameters `LatencyBasedParams` (`metric`).
Formula: over the eligible engines E, latency(e) = e.recent_e2e_s (metric "e2e", default) or e.recent_ttft_s
(metric "ttft"): the mean over requests that finished on e within the cluster state's latency window
(2 s by default, see `gateway.cluster.state`), measured by this gateway from dispatch to finish / first token.
An engine with no sample in the window gets the mean latency of the engines that have samples (0 when none
has): unknown is treated as typical, so an idle engine is neither starved nor flooded. Pick argmin; exact
ties go to E[floor(rand * n)] among the tied engines in engine-id order (no bias to the first engine).
The figures lag by construction: they describe requests dispatched up to a whole request's lifetime ago,
which is the reactive behaviour the paper compares against. The windowing happens outside the policy.
Must not: import asyncio, aiohttp, grpc, prometheus or time; keep mutable state.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from gateway.domain import ClusterSnapshot, EngineId, EngineView, RequestFeatures
from gateway.policies.base import eligible
from gateway.policies.params import PolicyParams

LatencyMetric = Literal["e2e", "ttft"]


class LatencyBasedParams(PolicyParams):
    metric: LatencyMetric = "e2e"


class LatencyBasedPolicy:
    NAME: ClassVar[str] = "latency_based"

    def __init__(self, params: LatencyBasedParams | None = None) -> None:
        self._params = params if params is not None else LatencyBasedParams()
        self.metric: LatencyMetric = self._params.metric

    @property
    def params(self) -> LatencyBasedParams:
        return self._params

    def latency_s(self, engine: EngineView) -> float | None:
        """The engine's windowed latency, None without a sample in the window."""
        return engine.recent_e2e_s if self.metric == "e2e" else engine.recent_ttft_s

    def pick(self, features: RequestFeatures, snapshot: ClusterSnapshot) -> EngineId | None:
        engines = eligible(features, snapshot)
        if not engines:
            return None
        observed = [self.latency_s(e) for e in engines]
        known = [v for v in observed if v is not None]
        typical = sum(known) / len(known) if known else 0.0
        values = [typical if v is None else v for v in observed]
        best = min(values)
        tied = [e for e, v in zip(engines, values, strict=True) if v == best]
        return tied[min(int(features.rand * len(tied)), len(tied) - 1)].engine_id
