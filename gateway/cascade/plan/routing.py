"""Cascadia's Chebyshev-guided routing solver (§3.3, App. C): thresholds scored by latency and quality.

Owns: the scalarised objectives (`QualityFloor`: J = L + mu * max(0, (q_min - Q) / (z1* - z2*)), §3.3;
`LatencyBudget`: -Q + nu * max(0, L - L_max) / (z_lat_max - z_lat_min), App. C), the threshold lattice
(`threshold_lattice`: each non-last stage's candidate thresholds are its model's score levels in the profile,
with 0 for accept-all and 101 for escalate-all), the initial routing θ0 (`initial_thresholds`) and
`RoutingSolver`, which keeps every (θ, L, Q) evaluated, returns the best θ by its objective and proposes the
next thresholds to evaluate.
Must not: estimate latencies or allocate GPUs (the deployment solver gives L), read clocks or do I/O.

θ0 (§3.3): "the i-th model receives 1/i of requests": stage i (1-based) is reached by the share closest to
1/i, thresholds chosen stage by stage on the lattice (later thresholds do not change an earlier stage's
share).

The search: a pattern search over the lattice, in index steps. Each round proposes the unvisited neighbours of
the best θ so far at radius r: every threshold alone moved by +-r, and (three stages or more) all together by
+-r. The radius goes back to 1 when the best improves and doubles when it does not, so the rounds that leave
the best J unchanged (Algorithm 1 stops after K of them) look further each time. Ties keep the θ found first.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.cascade.quality import QualityProfile

Thresholds = tuple[float, ...]
ACCEPT_ALL = 0.0
ESCALATE_ALL = 101.0
MU = 100.0
NU = 100.0


@dataclass(frozen=True, slots=True)
class Evaluation:
    """One routing θ (its thresholds) with the deployment solver's L and the profile's Q."""

    thresholds: Thresholds
    latency_s: float
    quality: float


class Objective(Protocol):
    def score(self, latency_s: float, quality: float) -> float: ...


def chebyshev_score(latency_s: float, quality: float, q_min: float, utopia: float, nadir: float,
                    mu: float = MU) -> float:
    """§3.3: J = L + mu * max(0, (q_min - Q) / (z1* - z2*)); infinite when L is (no deployment keeps up)."""
    span = utopia - nadir
    if span <= 0.0:
        span = 1.0  # a profile whose strongest model is no better: the shortfall counts unnormalised
    return latency_s + mu * max(0.0, (q_min - quality) / span)


def budget_score(latency_s: float, quality: float, l_max_s: float, latency_best_s: float,
                 latency_worst_s: float, nu: float = NU) -> float:
    """App. C: -Q + nu * max(0, L - L_max) / (z_lat_max - z_lat_min); infinite when L is."""
    if math.isinf(latency_s):
        return math.inf
    span = latency_worst_s - latency_best_s
    if not (span > 0.0 and math.isfinite(span)):
        span = l_max_s  # anchors that do not span a range: normalise by the budget itself
    return -quality + nu * max(0.0, latency_s - l_max_s) / span


@dataclass(frozen=True, slots=True)
class QualityFloor:
    """Minimise latency subject to Q >= q_min (§3.3); utopia z1* = last model only, nadir z2* = first only."""

    q_min: float
    utopia: float
    nadir: float
    mu: float = MU

    def score(self, latency_s: float, quality: float) -> float:
        return chebyshev_score(latency_s, quality, self.q_min, self.utopia, self.nadir, self.mu)


@dataclass(frozen=True, slots=True)
class LatencyBudget:
    """Maximise quality subject to L <= l_max_s (App. C); the latency anchors are the best and worst L seen at
    the extreme routings (accept-all, escalate-all)."""

    l_max_s: float
    latency_best_s: float
    latency_worst_s: float
    nu: float = NU

    def score(self, latency_s: float, quality: float) -> float:
        return budget_score(latency_s, quality, self.l_max_s, self.latency_best_s, self.latency_worst_s,
                            self.nu)


def threshold_lattice(profile: QualityProfile, models: Sequence[str]) -> tuple[tuple[float, ...], ...]:
    """Per non-last stage, its candidate thresholds ascending: 0 (accept all), each score level of the stage's
    model above its lowest (the lowest accepts all, like 0), 101 (escalate all)."""
    lattice: list[tuple[float, ...]] = []
    for model in models[:-1]:
        levels = profile.score_levels(model)
        lattice.append((ACCEPT_ALL, *[v for v in levels[1:] if ACCEPT_ALL < v < ESCALATE_ALL], ESCALATE_ALL))
    return tuple(lattice)


def initial_thresholds(profile: QualityProfile, models: Sequence[str],
                       lattice: Sequence[Sequence[float]]) -> Thresholds:
    """θ0: stage i (1-based) reached by the share closest to 1/i, chosen stage by stage."""
    chosen: list[float] = []
    stages = len(models)
    for i, candidates in enumerate(lattice):
        target = 1.0 / (i + 2)
        rest = [ESCALATE_ALL] * (stages - 2 - i)
        best = min(candidates, key=lambda h: abs(
            profile.route(models, (*chosen, h, *rest)).stage_share[i + 1] - target))
        chosen.append(best)
    return tuple(chosen)


class RoutingSolver:
    """The archive of evaluated routings, the best by the objective, and the next ones to try (module
    docstring)."""

    def __init__(self, lattice: Sequence[Sequence[float]], objective: Objective) -> None:
        if not lattice or any(not c for c in lattice):
            raise ValueError("the lattice needs candidates for every non-last stage")
        self._lattice = tuple(tuple(c) for c in lattice)
        self.objective = objective
        self._seen: dict[Thresholds, Evaluation] = {}
        self._best: Evaluation | None = None
        self._best_score = math.inf
        self._radius = 1

    @property
    def best(self) -> Evaluation | None:
        return self._best

    @property
    def best_score(self) -> float:
        return self._best_score

    @property
    def evaluations(self) -> tuple[Evaluation, ...]:
        return tuple(self._seen.values())

    def score(self, evaluation: Evaluation) -> float:
        return self.objective.score(evaluation.latency_s, evaluation.quality)

    def observe(self, evaluations: Iterable[Evaluation]) -> float:
        """Record evaluations; returns the best objective so far. The radius resets when it improved."""
        improved = False
        for evaluation in evaluations:
            self._seen.setdefault(evaluation.thresholds, evaluation)
            value = self.score(evaluation)
            if value < self._best_score:
                self._best, self._best_score, improved = evaluation, value, True
        if improved:
            self._radius = 1
        elif self._best is not None:
            self._radius *= 2
        return self._best_score

    def visited(self, thresholds: Thresholds) -> bool:
        return thresholds in self._seen

    def propose(self) -> list[Thresholds]:
        """Unvisited lattice neighbours of the best θ at the current radius (empty before any evaluation)."""
        if self._best is None:
            return []
        index = [self._index(i, h) for i, h in enumerate(self._best.thresholds)]
        r = self._radius
        moves: list[list[int]] = []
        for i in range(len(index)):
            for step in (-r, r):
                moved = list(index)
                moved[i] += step
                moves.append(moved)
        if len(index) > 1:
            moves.append([k - r for k in index])
            moves.append([k + r for k in index])
        out: list[Thresholds] = []
        for move in moves:
            clamped = tuple(self._lattice[i][min(max(k, 0), len(self._lattice[i]) - 1)]
                            for i, k in enumerate(move))
            if clamped not in self._seen and clamped not in out:
                out.append(clamped)
        return out

    def _index(self, stage: int, threshold: float) -> int:
        candidates = self._lattice[stage]
        return min(range(len(candidates)), key=lambda k: abs(candidates[k] - threshold))
