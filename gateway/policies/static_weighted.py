"""Static weighted: weighted random routing by offline per-engine weights (NexusSched §7.4's baseline).

Owns: `StaticWeightedPolicy`, its parameters `StaticWeightedParams` (`weights` and `default_weight`, each
>= 0 and finite), `GPU_CLASS_WEIGHTS` and `gpu_class_weight`.
Weights, over the eligible engines E (`base.eligible`):
  1. configured (`weights`: {engine id or profile name: weight}, e.g. offline-profiled QPS): an engine's
     weight is the entry for its id (the live gateway's engine ids are the agents' host:port addresses;
     simulated ones are `{profile}-{i}`), else the entry for its profile, else `default_weight`;
  2. none configured: every engine's profile names a GPU class in `GPU_CLASS_WEIGHTS` -> that class weight
     times the tensor-parallel degree (profile names `{gpu}-{model}` or `{gpu}x{tp}-{model}`); otherwise 1
     each (round-robin-like). Live figures (LENS's P_max) are deliberately not used: the baseline is static,
     and an early, still-converging P_max made the weights swing (measured in the simulator: it sent most
     traffic to whichever engine's model had fitted highest first).
Pick: with total = sum of weights, the first engine (in engine-id order) whose cumulative weight exceeds
rand * total, so over many requests engine e receives weight(e) / total of them. Engines of weight 0 get no
request unless every weight is 0, when the pick is uniform. The policy ignores load entirely, by design.
Must not: import asyncio, aiohttp, grpc, prometheus or time; keep mutable state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import ClassVar

from pydantic import Field

from gateway.domain import ClusterSnapshot, EngineId, EngineView, RequestFeatures
from gateway.policies.base import eligible
from gateway.policies.params import NonNegativeFinite, PolicyParams
from switchyard.hardware import GPUS, GpuSpec


def _relative(gpu: GpuSpec) -> float:
    h100 = GPUS["h100"]
    return math.sqrt(gpu.dense_bf16_tflops * gpu.memory_bandwidth_gb_s
                     / (h100.dense_bf16_tflops * h100.memory_bandwidth_gb_s))


# Relative serving throughput of one GPU of each class, H100 = 1: the geometric mean of its dense BF16 compute
# and its memory bandwidth relative to the H100 (LLM serving is compute-bound in prefill and bandwidth-bound
# in decode), from the shared datasheet catalogue (switchyard/hardware.py). A stand-in for offline profiling:
# configure `weights` for real fleets.
GPU_CLASS_WEIGHTS: Mapping[str, float] = MappingProxyType({name: _relative(g) for name, g in GPUS.items()})


def gpu_class_weight(profile: str) -> float | None:
    """GPU class weight times tensor parallelism for a profile name, None when the class is unknown."""
    head = profile.split("-", 1)[0].lower()
    gpu, _, tp_text = head.partition("x")
    weight = GPU_CLASS_WEIGHTS.get(gpu)
    if weight is None:
        return None
    if not tp_text:
        return weight
    return weight * int(tp_text) if tp_text.isdigit() and int(tp_text) > 0 else None


class StaticWeightedParams(PolicyParams):
    weights: dict[str, NonNegativeFinite] = Field(default_factory=dict)  # engine id or profile -> weight
    default_weight: NonNegativeFinite = 1.0


class StaticWeightedPolicy:
    NAME: ClassVar[str] = "static_weighted"

    def __init__(self, params: StaticWeightedParams | None = None) -> None:
        self._params = params if params is not None else StaticWeightedParams()
        self._weights: Mapping[str, float] = MappingProxyType(dict(self._params.weights))
        self._default_weight = self._params.default_weight

    @property
    def params(self) -> StaticWeightedParams:
        return self._params

    def weights(self, engines: tuple[EngineView, ...]) -> list[float]:
        """Each engine's weight by the module docstring's rules."""
        configured = self._weights
        if configured:
            default = self._default_weight
            return [configured.get(e.engine_id, configured.get(e.profile, default)) for e in engines]
        of_profile: dict[str, float | None] = {}  # parsed once per profile in this call
        by_class: list[float] = []
        for e in engines:
            profile = e.profile
            if profile not in of_profile:
                of_profile[profile] = gpu_class_weight(profile)
            weight = of_profile[profile]
            if weight is None:
                return [1.0] * len(engines)
            by_class.append(weight)
        return by_class

    def pick(self, features: RequestFeatures, snapshot: ClusterSnapshot) -> EngineId | None:
        engines = eligible(features, snapshot)
        if not engines:
            return None
        weights = self.weights(engines)
        total = math.fsum(weights)
        if total <= 0:
            return engines[min(int(features.rand * len(engines)), len(engines) - 1)].engine_id
        target = features.rand * total
        cumulative = 0.0
        for e, w in zip(engines, weights, strict=True):
            cumulative += w
            if cumulative > target and w > 0:
                return e.engine_id
        return next(e.engine_id for e, w in zip(reversed(engines), reversed(weights), strict=True) if w > 0)
