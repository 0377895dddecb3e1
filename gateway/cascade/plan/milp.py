"""Cascadia's deployment MILP (§3.2) over precomputed latency tables, behind a `Solver` seam.

Owns: `AllocationProblem` (l_i(f) for every stage i and f = 0..N), `Allocation`, the `AllocationSolver` role,
`PulpCbcAllocationSolver` (the MILP, PuLP + CBC) and `ExhaustiveAllocationSolver` (enumeration: the golden
reference of the tests, exact for small N).
Must not: estimate latencies or search parallelism (`stage_latency`, `parallelism`), route, or read a clock.

The MILP, exactly as §3.2: binary x_{i,f}; sum_f x_{i,f} = 1 for every stage i; sum_i sum_f f x_{i,f} = N;
L >= sum_f l_i(f) x_{i,f} for every i; L >= 0; minimise L. A pair whose latency is infinite (the model does
not fit in f GPUs, or f GPUs cannot keep up with the stage's traffic) is fixed to x_{i,f} = 0, i.e. left out.
Ties on L are broken by the smallest sum of stage latencies, lexicographically: a second solve minimises the
sum over the allocations whose stages all meet L* (the enumeration uses the same order). A secondary term
weighted 1e-6 in one solve, as before, sat below CBC's tolerance: on mt-bench-hard at 141 req/s it returned
(4, 28) GPUs with the 70B using 24 of its 28, where (8, 24) has the same L and a 1.2 s smaller sum.

f = 0: App. D writes sum_i f_i <= N and Table 2 shows f_3 = 0. Here f = 0 is allowed only for a stage whose
traffic share is 0 (its l_i(0) is 0, every other stage's is infinite), and such a stage is given exactly f =
0: its GPUs serve better on a stage with traffic. Every GPU is allocated (the equality), which costs nothing
since l_i(f) counts the best strategy using at most f GPUs. `PulpCbcAllocationSolver` is this package's only
effect: it runs CBC's binary (cbcbox), as `gateway.planning.ilp` does.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

TIE_TOLERANCE = 1e-9  # relative: stage latencies within L*(1 + this) count as meeting L*


@dataclass(frozen=True, slots=True)
class AllocationProblem:
    """tables[i][f] = l_i(f) in seconds for f = 0..gpus (math.inf: infeasible); `idle[i]`: stage i has no
    traffic."""

    tables: tuple[tuple[float, ...], ...]
    gpus: int
    idle: tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ValueError(f"gpus must be >= 1, got {self.gpus}")
        if not self.tables:
            raise ValueError("an allocation needs at least one stage")
        for i, row in enumerate(self.tables):
            if len(row) != self.gpus + 1:
                raise ValueError(f"stage {i}: {len(row)} latencies for f = 0..{self.gpus}")
            if any(v < 0 or math.isnan(v) for v in row):
                raise ValueError(f"stage {i}: latencies must be >= 0")
        if self.idle and len(self.idle) != len(self.tables):
            raise ValueError("idle must give one flag per stage")

    def is_idle(self, stage: int) -> bool:
        return bool(self.idle) and self.idle[stage]

    def allowed(self, stage: int) -> list[int]:
        """The f worth a variable for this stage: finite latency, f = 0 exactly when the stage is idle."""
        if self.is_idle(stage):
            return [0]
        return [f for f in range(1, self.gpus + 1) if math.isfinite(self.tables[stage][f])]


@dataclass(frozen=True, slots=True)
class Allocation:
    status: Literal["optimal", "infeasible"]
    gpus: tuple[int, ...] = ()  # f_i per stage
    latency_s: float = math.inf  # L = max_i l_i(f_i)

    def stage_latencies(self, problem: AllocationProblem) -> tuple[float, ...]:
        return tuple(problem.tables[i][f] for i, f in enumerate(self.gpus))


class AllocationSolver(Protocol):
    def solve(self, problem: AllocationProblem) -> Allocation: ...


def _key(problem: AllocationProblem, gpus: Sequence[int]) -> tuple[float, float]:
    latencies = [problem.tables[i][f] for i, f in enumerate(gpus)]
    return (max(latencies), sum(latencies))


class ExhaustiveAllocationSolver:
    """Every allocation with sum f_i = N over the allowed pairs; min L, then min sum of latencies, then the
    lexicographically smallest f."""

    def solve(self, problem: AllocationProblem) -> Allocation:
        options = [problem.allowed(i) for i in range(len(problem.tables))]
        best: tuple[tuple[float, float], tuple[int, ...]] | None = None
        for combo in itertools.product(*options):
            if sum(combo) != problem.gpus:
                continue
            key = _key(problem, combo)
            if best is None or key < best[0]:
                best = (key, combo)
        if best is None:
            return Allocation("infeasible")
        return Allocation("optimal", best[1], best[0][0])


class PulpCbcAllocationSolver:
    """§3.2's MILP in PuLP, solved silently by CBC (cbcbox's binary) within a time limit."""

    def __init__(self, time_limit_s: float = 10.0) -> None:
        self._time_limit_s = time_limit_s

    def solve(self, problem: AllocationProblem) -> Allocation:
        stages = range(len(problem.tables))
        allowed = [problem.allowed(i) for i in stages]
        if any(not a for a in allowed):
            return Allocation("infeasible")
        found = self._solve(problem, allowed, minimise_sum=False)
        if found is None:
            return Allocation("infeasible")
        first = max(problem.tables[i][f] for i, f in enumerate(found))
        # Second pass, lexicographic: the smallest sum of stage latencies among allocations whose every stage
        # is within L* (a weighted tie-break term sat below CBC's tolerance and left GPUs idle).
        bound = first * (1.0 + TIE_TOLERANCE)
        within = [[f for f in allowed[i] if problem.tables[i][f] <= bound] for i in stages]
        gpus = self._solve(problem, within, minimise_sum=True) or found  # `found` is within: never None
        return Allocation("optimal", gpus, max(problem.tables[i][f] for i, f in enumerate(gpus)))

    def _solve(self, problem: AllocationProblem, allowed: Sequence[Sequence[int]], *,
               minimise_sum: bool) -> tuple[int, ...] | None:
        """The allocation of min L (first pass) or of min sum of latencies (second); None if none."""
        import cbcbox  # type: ignore[import-untyped]  # noqa: PLC0415 (imported only where a plan is made)
        import pulp  # type: ignore[import-untyped]  # noqa: PLC0415

        stages = range(len(problem.tables))
        lp = pulp.LpProblem("cascadia_deployment", pulp.LpMinimize)
        latency = lp.add_variable("L", lowBound=0)
        x = {(i, f): lp.add_variable(f"x_{i}_{f}", cat="Binary") for i in stages for f in allowed[i]}
        if minimise_sum:
            lp += pulp.lpSum(problem.tables[i][f] * v for (i, f), v in x.items())
        else:
            lp += latency
        for i in stages:
            lp += pulp.lpSum(x[i, f] for f in allowed[i]) == 1
            lp += latency >= pulp.lpSum(problem.tables[i][f] * x[i, f] for f in allowed[i])
        lp += pulp.lpSum(f * v for (_, f), v in x.items()) == problem.gpus
        lp.solve(pulp.COIN_CMD(path=cbcbox.cbc_bin_path(), msg=False, timeLimit=self._time_limit_s))
        if pulp.LpStatus[lp.status] != "Optimal":
            return None
        return tuple(next(f for f in allowed[i] if (x[i, f].value() or 0.0) > 0.5) for i in stages)


class MemoSolver:
    """Answers a problem seen before from memory (the routing search revisits the same tables), else asks the
    wrapped solver."""

    def __init__(self, inner: AllocationSolver) -> None:
        self._inner = inner
        self._seen: dict[AllocationProblem, Allocation] = {}
        self.solves = 0

    def solve(self, problem: AllocationProblem) -> Allocation:
        found = self._seen.get(problem)
        if found is None:
            found = self._seen[problem] = self._inner.solve(problem)
            self.solves += 1
        return found
