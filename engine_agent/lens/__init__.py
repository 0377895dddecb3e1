"""LENS, NexusSched's engine layer (§4): online latency model, adaptive target, SLO-aware batch planning.

Owns: the pure, backend-independent decision core the sim and vLLM backends call around their schedulers:
`perf_model` (Eq. 1-2 fitted online), `target` (Eq. 3-7), `planner` (Algorithm 1) and `controller` (the glue,
the refit policy and the Eq. 8 state vector).
Must not: import asyncio, grpc, aiohttp, prometheus or `time`, read clocks, start threads, or know a backend's
internals (backends translate their queues into a `QueueView` and their iterations into `IterationSample`s).
"""

from engine_agent.lens.controller import IterationSample, LensConfig, LensController
from engine_agent.lens.perf_model import (
    FitOutcome,
    LatencyModel,
    LatencyModelConfig,
    LatencyParams,
    Samples,
    r2_score,
)
from engine_agent.lens.planner import BatchPlan, PlanLimits, QueueView, allocate, plan_batch
from engine_agent.lens.target import AdaptiveTarget, TargetConfig, TargetDecision

__all__ = [
    "AdaptiveTarget",
    "BatchPlan",
    "FitOutcome",
    "IterationSample",
    "LatencyModel",
    "LatencyModelConfig",
    "LatencyParams",
    "LensConfig",
    "LensController",
    "PlanLimits",
    "QueueView",
    "Samples",
    "TargetConfig",
    "TargetDecision",
    "allocate",
    "plan_batch",
    "r2_score",
]
