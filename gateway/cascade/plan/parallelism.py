"""Cascadia's parallelism strategy search (§3.2): for a stage and f GPUs, the replicas that minimise its p95.

Owns: `ReplicaGroup` / `StageStrategy` (replicas of at most two distinct (tp, pp) shapes, Table 3), the search
of the best strategy for every GPU count (`latency_table`: l_i(f) for f = 0..N, precomputed as §3.2 says, with
the strategy behind each entry) and `LatencyTable`.
Must not: estimate a replica (`stage_latency`), allocate GPUs across stages (`milp`), route, or do I/O.

Rules:
- A strategy is DP replicas, each of a memory-feasible shape tp in {1,2,4,8} x pp in {1,2,3,4} of the stage's
  GPU type, sum of tp * pp <= f, at most two distinct shapes.
- Requests reach a stage's replicas round robin (App. B, and the gateway's `round_robin` policy): each of the
  R replicas gets rate / R whatever its shape. The stage's p95 is the p95 of the mixture of the replicas'
  latency distributions, each weighted 1 / R; a strategy with any overloaded replica is infeasible (infinite).
- l(f) is the best over strategies using at most f GPUs, so it never increases with f; l(0) is 0 for a stage
  without traffic and infinite otherwise.
Search: every single-shape strategy is evaluated; a two-shape one is evaluated only when the better of its two
shapes' p95 at the same replica count (a lower bound of the mixture's p95) beats the best single-shape entry
for its GPU count, which prunes nearly all of them exactly (the bound is a true lower bound).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.cascade.plan.stage_latency import (
    INF,
    ReplicaEstimate,
    ReplicaShape,
    StageLatencyModel,
    StageWorkload,
    mixture_p95,
)

MAX_SHAPES = 2


@dataclass(frozen=True, slots=True)
class ReplicaGroup:
    shape: ReplicaShape
    count: int

    @property
    def gpus(self) -> int:
        return self.shape.gpus * self.count


@dataclass(frozen=True, slots=True)
class StageStrategy:
    """One stage's replicas and what they achieve on its workload (p95_s infinite: infeasible)."""

    groups: tuple[ReplicaGroup, ...]
    p95_s: float
    capacity_rps: float  # round robin: R * the slowest replica's capacity

    @property
    def gpus(self) -> int:
        return sum(g.gpus for g in self.groups)

    @property
    def replicas(self) -> int:
        return sum(g.count for g in self.groups)

    @property
    def feasible(self) -> bool:
        return not math.isinf(self.p95_s)

    def shapes(self) -> tuple[tuple[int, int, int], ...]:
        """(tp, pp, count) per group, as the plan file writes it."""
        return tuple((g.shape.tensor_parallel, g.shape.pipeline_parallel, g.count) for g in self.groups)


NO_REPLICAS = StageStrategy((), 0.0, 0.0)
INFEASIBLE = StageStrategy((), INF, 0.0)


@dataclass(frozen=True, slots=True)
class LatencyTable:
    """l_i(f) for f = 0..max_gpus and the strategy achieving each (f = 0: no replicas)."""

    model: str
    workload: StageWorkload
    strategies: tuple[StageStrategy, ...]

    @property
    def latencies_s(self) -> tuple[float, ...]:
        return tuple(s.p95_s for s in self.strategies)

    @property
    def max_gpus(self) -> int:
        return len(self.strategies) - 1


def strategy_estimates(est: StageLatencyModel, model: str, workload: StageWorkload,
                       strategy: StageStrategy) -> list[tuple[ReplicaEstimate, float]]:
    """Each group's replica estimate under round robin, with its share of the stage's requests."""
    replicas = strategy.replicas
    return [(est.replica(model, g.shape, workload, replicas), g.count / replicas) for g in strategy.groups]


def evaluate(est: StageLatencyModel, model: str, workload: StageWorkload,
             groups: tuple[ReplicaGroup, ...]) -> StageStrategy:
    """The stage's p95 and capacity with these replicas (round robin over all of them)."""
    if not groups:
        return NO_REPLICAS if workload.idle else INFEASIBLE
    replicas = sum(g.count for g in groups)
    parts = [(est.replica(model, g.shape, workload, replicas), g.count / replicas) for g in groups]
    capacity = replicas * min(est.capacity_rps(model, g.shape, workload) for g in groups)
    if workload.idle:
        return StageStrategy(groups, 0.0, capacity)
    first = groups[0].shape
    return StageStrategy(groups, mixture_p95(parts, est.stats(model, first, workload)), capacity)


def latency_table(est: StageLatencyModel, model: str, workload: StageWorkload, max_gpus: int) -> LatencyTable:
    """Best strategy for each f = 0..max_gpus (module docstring)."""
    if max_gpus < 0:
        raise ValueError(f"max_gpus must be >= 0, got {max_gpus}")
    if workload.idle:
        return LatencyTable(model, workload, (NO_REPLICAS,) * (max_gpus + 1))
    shapes = est.shapes(model, max_gpus)
    exact: list[StageStrategy] = [INFEASIBLE] * (max_gpus + 1)  # best using exactly f GPUs

    def p95(shape: ReplicaShape, replicas: int) -> float:
        return est.replica(model, shape, workload, replicas).p95_s

    for shape in shapes:
        for count in range(1, max_gpus // shape.gpus + 1):
            latency = p95(shape, count)
            gpus = shape.gpus * count
            if latency < exact[gpus].p95_s:
                exact[gpus] = evaluate(est, model, workload, (ReplicaGroup(shape, count),))
    best = _prefix_best(exact)
    for i, a in enumerate(shapes):
        for b in shapes[i + 1:]:
            for count_a in range(1, (max_gpus - b.gpus) // a.gpus + 1):
                room = max_gpus - count_a * a.gpus
                for count_b in range(1, room // b.gpus + 1):
                    gpus = count_a * a.gpus + count_b * b.gpus
                    replicas = count_a + count_b
                    bound = min(p95(a, replicas), p95(b, replicas))
                    if bound >= best[gpus].p95_s:
                        continue
                    candidate = evaluate(est, model, workload,
                                         (ReplicaGroup(a, count_a), ReplicaGroup(b, count_b)))
                    if candidate.p95_s < exact[gpus].p95_s:
                        exact[gpus] = candidate
            best = _prefix_best(exact)
    return LatencyTable(model, workload, tuple(_prefix_best(exact)))


def _prefix_best(exact: list[StageStrategy]) -> list[StageStrategy]:
    """l(f) = the best using at most f GPUs (l(0) keeps exact[0]: no replicas, infeasible with traffic)."""
    out: list[StageStrategy] = []
    current = exact[0]
    for strategy in exact:
        if strategy.p95_s < current.p95_s:
            current = strategy
        out.append(current)
    return out
