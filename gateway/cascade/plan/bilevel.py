"""Cascadia's Algorithm 1: routing and deployment optimised in alternation, and the cascade plan it returns.

Owns: `PlanRequest` (the cascade, the GPUs, the rate, q_min or L_max, the judge's latency), `stage_workloads`
((W, Q) from θ and the profile sample, footnote 1), `DeploymentSolver` (parallelism tables + the MILP, §3.2),
`plan_cascade` (Algorithm 1 with `RoutingSolver`, §3.3) and `CascadePlan` with both objectives: the min-max
stage p95 the MILP minimises (L, per stage L_s) and an end-to-end p95 estimate with the judge.
Must not: read clocks (a caller may pass a timer; the CLI does), do I/O, or know the gateway's live state.

The loop: θ ← θ0; each iteration derives (W, Q) for every routing the routing solver asked for, solves the
deployment for each (L), and lets the routing solver keep the best J and propose the next routings; it stops
when the best J has not changed for K = 3 consecutive iterations (App. D: "best-so-far objective unchanged for
K consecutive iterations"), or after `max_iterations`.

Stage i's workload: the profile items that reach it (answering stage >= i), with stage i's model's prompt
(turn 2 carries its own turn-1 answer) and answer lengths, at rate * (share reaching i). Q is the profile's
Q(θ).

End-to-end estimate: per item, the sum over the stages it passes of its mean latency there (round robin over
the stage's replicas: sum_r w_r (T_r (k + 1/2) + E[wait_r]), k its iterations on that stage's model), plus the
judge's latency once per judged stage (every stage it passes but the last of the cascade); its 95th percentile
(nearest rank) over the items. App. H's judge latency, 0.27 s, is the default.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gateway.cascade.plan.milp import AllocationProblem, AllocationSolver, MemoSolver, PulpCbcAllocationSolver
from gateway.cascade.plan.parallelism import INFEASIBLE, LatencyTable, StageStrategy, latency_table
from gateway.cascade.plan.routing import (
    ACCEPT_ALL,
    ESCALATE_ALL,
    Evaluation,
    LatencyBudget,
    Objective,
    QualityFloor,
    RoutingSolver,
    Thresholds,
    initial_thresholds,
    threshold_lattice,
)
from gateway.cascade.plan.stage_latency import PERCENTILE, StageLatencyModel, StageWorkload
from gateway.cascade.quality import QualityProfile, Routing, prompt_tokens, stage_models
from switchyard.hardware import GPUS

K_STABLE = 3
JUDGE_LATENCY_S = 0.27  # App. H: one GPT-4o rating
MAX_ITERATIONS = 100


@dataclass(frozen=True, slots=True)
class PlanRequest:
    models: tuple[str, ...]
    gpu: str
    gpus: int
    rate_rps: float
    q_min: float | None = None
    l_max_s: float | None = None  # App. C: maximise Q subject to L <= l_max_s (q_min is then only reported)
    judge_latency_s: float = JUDGE_LATENCY_S
    mu: float = 100.0
    nu: float = 100.0
    k_stable: int = K_STABLE
    max_iterations: int = MAX_ITERATIONS

    def __post_init__(self) -> None:
        if len(self.models) < 2:
            raise ValueError("a cascade needs at least two models")
        if self.gpu not in GPUS:
            raise ValueError(f"unknown GPU {self.gpu!r}; known: {', '.join(sorted(GPUS))}")
        if self.gpus < 1:
            raise ValueError(f"gpus must be >= 1, got {self.gpus}")
        if not (self.rate_rps > 0 and math.isfinite(self.rate_rps)):
            raise ValueError(f"rate must be > 0 req/s, got {self.rate_rps}")
        if self.q_min is None and self.l_max_s is None:
            raise ValueError("give a quality floor (q_min), a latency budget (l_max_s), or both")
        if self.l_max_s is not None and not self.l_max_s > 0:
            raise ValueError(f"l_max_s must be > 0, got {self.l_max_s}")
        if self.judge_latency_s < 0:
            raise ValueError(f"judge latency must be >= 0, got {self.judge_latency_s}")
        if self.k_stable < 1 or self.max_iterations < 1:
            raise ValueError("k_stable and max_iterations must be >= 1")


@dataclass(frozen=True, slots=True)
class Deployment:
    """The deployment solver's answer for one routing: GPUs, strategy and p95 per stage, L = max_i L_i."""

    gpus: tuple[int, ...]
    strategies: tuple[StageStrategy, ...]
    latency_s: float

    @property
    def feasible(self) -> bool:
        return math.isfinite(self.latency_s)

    @property
    def stage_p95_s(self) -> tuple[float, ...]:
        return tuple(s.p95_s for s in self.strategies)


@dataclass(frozen=True, slots=True)
class CascadePlan:
    models: tuple[str, ...]
    gpu: str
    thresholds: Thresholds
    gpus: tuple[int, ...]
    shapes: tuple[tuple[tuple[int, int, int], ...], ...]  # per stage: (tp, pp, count) per replica group
    stage_p95_s: tuple[float, ...]  # L_s
    latency_s: float  # L = max_s L_s (the MILP's objective)
    quality: float  # Q
    objective: float  # J (or App. C's score)
    iterations: int
    evaluations: int  # routings evaluated (each one deployment solve)
    milp_solves: int
    stage_share: tuple[float, ...]
    answer_share: tuple[float, ...]
    stage_rate_rps: tuple[float, ...]
    stage_capacity_rps: tuple[float, ...]
    e2e_p95_s: float  # the end-to-end estimate with the judge
    judge_latency_s: float
    history: tuple[tuple[Thresholds, float, float, float], ...] = field(default=())  # (θ, L, Q, J)
    solver_s: float | None = None

    @property
    def feasible(self) -> bool:
        return math.isfinite(self.latency_s)


def stage_workloads(profile: QualityProfile, models: Sequence[str], thresholds: Thresholds,
                    rate_rps: float) -> tuple[tuple[StageWorkload, ...], Routing]:
    """(W, Q) from θ and the sample (footnote 1): what reaches each stage, and the routing with Q(θ)."""
    routing = profile.route(models, thresholds)
    workloads = []
    for stage, model in enumerate(models):
        reached = [j for j, s in enumerate(routing.answering_stage) if s >= stage]
        scores = profile.scores(model)
        workloads.append(StageWorkload(
            rate_rps * routing.stage_share[stage] if reached else 0.0,
            tuple(max(1, prompt_tokens(profile.items[j], profile, model)) for j in reached),
            tuple(max(1, scores[j].answer_tokens) for j in reached)))
    return tuple(workloads), routing


class Deployer(Protocol):
    """Algorithm 1's DeploymentSolver role: (W, N) -> (D, L)."""

    @property
    def milp_solves(self) -> int: ...

    def solve(self, models: Sequence[str], workloads: Sequence[StageWorkload], gpus: int) -> Deployment: ...


class DeploymentSolver:
    """§3.2: parallelism tables per stage (memoised per (model, workload)), then the MILP over them."""

    def __init__(self, latency_model: StageLatencyModel, solver: AllocationSolver) -> None:
        self.latency_model = latency_model
        self._solver = MemoSolver(solver)
        self._tables: dict[tuple[str, StageWorkload, int], LatencyTable] = {}

    @property
    def milp_solves(self) -> int:
        return self._solver.solves

    def table(self, model: str, workload: StageWorkload, gpus: int) -> LatencyTable:
        key = (model, workload, gpus)
        found = self._tables.get(key)
        if found is None:
            found = self._tables[key] = latency_table(self.latency_model, model, workload, gpus)
        return found

    def solve(self, models: Sequence[str], workloads: Sequence[StageWorkload], gpus: int) -> Deployment:
        tables = [self.table(m, w, gpus) for m, w in zip(models, workloads, strict=True)]
        problem = AllocationProblem(tuple(t.latencies_s for t in tables), gpus,
                                    tuple(w.idle for w in workloads))
        allocation = self._solver.solve(problem)
        if allocation.status != "optimal":
            return Deployment(tuple(0 for _ in models), tuple(INFEASIBLE for _ in models), math.inf)
        strategies = tuple(t.strategies[f] for t, f in zip(tables, allocation.gpus, strict=True))
        return Deployment(allocation.gpus, strategies, allocation.latency_s)


def plan_cascade(request: PlanRequest, profile: QualityProfile, *, solver: AllocationSolver | None = None,
                 latency_model: StageLatencyModel | None = None, deployer: Deployer | None = None,
                 timer: Callable[[], float] | None = None) -> CascadePlan:
    """Algorithm 1 (module docstring). `solver` defaults to the MILP on CBC; `deployer` replaces the whole
    deployment solver (tests script one); `timer` (seconds, e.g. the CLI's perf_counter) fills `solver_s`."""
    started = timer() if timer is not None else None
    models = request.models
    stage_models(profile, models)
    est = latency_model or StageLatencyModel(GPUS[request.gpu])
    deployer = deployer or DeploymentSolver(est, solver or PulpCbcAllocationSolver())
    results: dict[Thresholds, tuple[Deployment, Routing]] = {}

    def evaluate(thresholds: Thresholds) -> Evaluation:
        if thresholds not in results:
            workloads, routing = stage_workloads(profile, models, thresholds, request.rate_rps)
            results[thresholds] = (deployer.solve(models, workloads, request.gpus), routing)
        deployment, routing = results[thresholds]
        return Evaluation(thresholds, deployment.latency_s, routing.quality)

    lattice = threshold_lattice(profile, models)
    objective = _objective(request, profile, evaluate)
    routing_solver = RoutingSolver(lattice, objective)
    pending = [initial_thresholds(profile, models, lattice)]
    if request.l_max_s is not None:  # App. C's anchors were evaluated for the objective: candidates too
        stages = len(models) - 1
        pending += [t for t in ((ACCEPT_ALL,) * stages, (ESCALATE_ALL,) * stages) if t not in pending]
    best_j = math.inf
    stable = iterations = 0
    while stable < request.k_stable and iterations < request.max_iterations:
        iterations += 1
        j = routing_solver.observe([evaluate(t) for t in pending])
        if j < best_j:
            best_j, stable = j, 0
        else:
            stable += 1
        pending = routing_solver.propose()
    # Every J infinite (no routing keeps up at this rate on these GPUs): the plan of θ0, infeasible (L = inf).
    best = routing_solver.best or routing_solver.evaluations[0]
    deployment, routing = results[best.thresholds]
    workloads, _ = stage_workloads(profile, models, best.thresholds, request.rate_rps)
    history = tuple((e.thresholds, e.latency_s, e.quality, routing_solver.score(e))
                    for e in routing_solver.evaluations)
    return CascadePlan(
        models=models, gpu=request.gpu, thresholds=best.thresholds, gpus=deployment.gpus,
        shapes=tuple(s.shapes() for s in deployment.strategies), stage_p95_s=deployment.stage_p95_s,
        latency_s=deployment.latency_s, quality=routing.quality, objective=routing_solver.best_score,
        iterations=iterations, evaluations=len(results), milp_solves=deployer.milp_solves,
        stage_share=routing.stage_share, answer_share=routing.answer_share,
        stage_rate_rps=tuple(w.rate_rps for w in workloads),
        stage_capacity_rps=tuple(s.capacity_rps for s in deployment.strategies),
        e2e_p95_s=e2e_p95_s(est, profile, models, workloads, routing, deployment, request.judge_latency_s),
        judge_latency_s=request.judge_latency_s, history=history,
        solver_s=None if started is None or timer is None else timer() - started)


def _objective(request: PlanRequest, profile: QualityProfile,
               evaluate: Callable[[Thresholds], Evaluation]) -> Objective:
    models = request.models
    if request.l_max_s is None:
        assert request.q_min is not None
        return QualityFloor(request.q_min, profile.mean_score(models[-1]), profile.mean_score(models[0]),
                            request.mu)
    stages = len(models) - 1
    anchors = [evaluate((ACCEPT_ALL,) * stages).latency_s, evaluate((ESCALATE_ALL,) * stages).latency_s]
    finite = [a for a in anchors if math.isfinite(a)]
    best, worst = (min(finite), max(finite)) if finite else (math.inf, math.inf)
    return LatencyBudget(request.l_max_s, best, worst, request.nu)


def e2e_p95_s(est: StageLatencyModel, profile: QualityProfile, models: Sequence[str],
              workloads: Sequence[StageWorkload], routing: Routing, deployment: Deployment,
              judge_latency_s: float) -> float:
    """The end-to-end p95 estimate with the judge (module docstring); infinite when a stage is overloaded."""
    if not deployment.feasible:
        return math.inf
    last = len(models) - 1
    per_stage: list[list[tuple[float, float, float]]] = []  # (weight, step_s, mean wait) per replica group
    for model, workload, strategy in zip(models, workloads, deployment.strategies, strict=True):
        replicas = strategy.replicas
        groups = []
        for group in strategy.groups:
            part = est.replica(model, group.shape, workload, replicas)
            groups.append((group.count / replicas, part.step_s, part.mean_wait_s()))
        per_stage.append(groups)
    totals: list[float] = []
    for j, answered in enumerate(routing.answering_stage):
        total = judge_latency_s * min(answered + 1, last)
        for stage in range(answered + 1):
            model = models[stage]
            chunk = _chunk_tokens(est, model, deployment.strategies[stage])
            p = max(1, prompt_tokens(profile.items[j], profile, model))
            o = max(1, profile.scores(model)[j].answer_tokens)
            k = -(-p // chunk) + o - 1
            total += sum(w * (step * (k + 0.5) + wait) for w, step, wait in per_stage[stage])
        totals.append(total)
    totals.sort()
    return totals[min(len(totals) - 1, math.ceil(PERCENTILE * len(totals)) - 1)]


def _chunk_tokens(est: StageLatencyModel, model: str, strategy: StageStrategy) -> int:
    for group in strategy.groups:
        profile = est.profile(model, group.shape)
        if profile is not None:
            return profile.max_batched_tokens
    return 1 << 30
