"""Cascadia's deployment MILP (§3.2) on hand-made latency tables, against brute force."""

from __future__ import annotations

import itertools
import math

import pytest

from gateway.cascade.plan.milp import (
    Allocation,
    AllocationProblem,
    ExhaustiveAllocationSolver,
    MemoSolver,
    PulpCbcAllocationSolver,
)

INF = math.inf
CBC = PulpCbcAllocationSolver()
BRUTE = ExhaustiveAllocationSolver()


def brute_force(problem: AllocationProblem) -> tuple[float, tuple[int, ...]] | None:
    """min over f with sum = N of (max latency, sum latency), written apart from the solver under test."""
    best: tuple[tuple[float, float], tuple[int, ...]] | None = None
    for combo in itertools.product(range(problem.gpus + 1), repeat=len(problem.tables)):
        if sum(combo) != problem.gpus:
            continue
        if any((f == 0) != problem.is_idle(i) for i, f in enumerate(combo)):
            continue
        latencies = [problem.tables[i][f] for i, f in enumerate(combo)]
        if any(math.isinf(v) for v in latencies):
            continue
        key = (max(latencies), sum(latencies))
        if best is None or key < best[0]:
            best = (key, combo)
    return None if best is None else (best[0][0], best[1])


# Two stages on 6 GPUs: stage 0 (a small model) fits on 1 GPU, stage 1 (a large one) needs 2.
TWO_STAGES = AllocationProblem(
    tables=((INF, 9.0, 5.0, 4.0, 3.5, 3.2, 3.0),
            (INF, INF, 12.0, 8.0, 6.0, 5.5, 5.0)),
    gpus=6)


def test_two_stages_balance_the_max() -> None:
    allocation = CBC.solve(TWO_STAGES)
    # f = (2, 4): max(5.0, 6.0) = 6.0; (3, 3): 8.0; (1, 5): 9.0; (4, 2): 12.0.
    assert allocation == Allocation("optimal", (2, 4), 6.0)
    assert allocation.stage_latencies(TWO_STAGES) == (5.0, 6.0)
    assert brute_force(TWO_STAGES) == (6.0, (2, 4))


def test_infeasible_pairs_are_never_chosen() -> None:
    # Stage 1 holds its model only on 4 or 5 GPUs (6 would leave stage 0 none): (2, 4) beats (1, 5).
    problem = AllocationProblem(
        tables=((INF, 10.0, 6.0, 5.0, 4.0, 3.0, 2.0),
                (INF, INF, INF, INF, 7.0, 6.5, INF)),
        gpus=6)
    allocation = CBC.solve(problem)
    assert allocation == Allocation("optimal", (2, 4), 7.0)
    assert brute_force(problem) == (7.0, (2, 4))


def test_three_stages_match_brute_force_on_a_grid_of_tables() -> None:
    n = 8
    for a, b, c in itertools.product((1.0, 2.0, 3.5), (4.0, 6.0), (8.0, 15.0)):
        tables = (
            tuple([INF] + [a * 3.0 / f + 0.5 for f in range(1, n + 1)]),
            tuple([INF] + [b * 4.0 / f + 1.0 for f in range(1, n + 1)]),
            tuple([INF, INF] + [c * 6.0 / f + 2.0 for f in range(2, n + 1)]),
        )
        problem = AllocationProblem(tables, n)
        expected = brute_force(problem)
        assert expected is not None
        for solver in (CBC, BRUTE):
            allocation = solver.solve(problem)
            assert allocation.status == "optimal"
            assert allocation.latency_s == pytest.approx(expected[0], rel=1e-9)
            assert allocation.gpus == expected[1]
            assert sum(allocation.gpus) == n


def test_zero_gpus_only_for_a_stage_without_traffic() -> None:
    # Table 2's (80, 3): the third stage gets no traffic and no GPUs; the others share all of them.
    problem = AllocationProblem(
        tables=((INF, 9.0, 6.0, 4.0, 3.0, 2.5, 2.2),
                (INF, 8.0, 5.0, 3.5, 2.8, 2.4, 2.1),
                (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)),
        gpus=6, idle=(False, False, True))
    allocation = CBC.solve(problem)
    assert allocation == Allocation("optimal", (3, 3, 0), 4.0)
    assert BRUTE.solve(problem) == allocation
    assert brute_force(problem) == (4.0, (3, 3, 0))


def test_a_stage_with_traffic_never_gets_zero_gpus() -> None:
    # l(0) = 0 for a stage with traffic would be a wrong table; the rule still keeps f >= 1 for it.
    problem = AllocationProblem(tables=((0.0, 5.0, 4.0), (0.0, 5.0, 1.0)), gpus=2)
    assert CBC.solve(problem) == Allocation("optimal", (1, 1), 5.0)


def test_no_feasible_allocation_is_reported_as_infeasible() -> None:
    # The large model needs 4 GPUs and the small one at least 1: 4 GPUs cannot hold both.
    problem = AllocationProblem(tables=((INF, 1.0, 1.0, 1.0, 1.0), (INF, INF, INF, INF, 2.0)), gpus=4)
    assert CBC.solve(problem).status == "infeasible"
    assert BRUTE.solve(problem).status == "infeasible"
    assert brute_force(problem) is None


def test_ties_on_the_max_prefer_the_smallest_sum() -> None:
    # (1, 3) and (2, 2) both give max 5.0; (2, 2) has the smaller sum (4.0 + 5.0 < 5.0 + 5.0).
    problem = AllocationProblem(tables=((INF, 5.0, 4.0, 3.0, 3.0), (INF, 6.0, 5.0, 5.0, 5.0)), gpus=4)
    assert CBC.solve(problem) == Allocation("optimal", (2, 2), 5.0)
    assert BRUTE.solve(problem) == Allocation("optimal", (2, 2), 5.0)


def test_memo_solver_answers_a_repeated_problem_from_memory() -> None:
    memo = MemoSolver(BRUTE)
    first = memo.solve(TWO_STAGES)
    again = memo.solve(AllocationProblem(TWO_STAGES.tables, 6))
    assert first == again and memo.solves == 1


def test_malformed_problems_are_rejected() -> None:
    with pytest.raises(ValueError, match="latencies for f"):
        AllocationProblem(tables=((INF, 1.0),), gpus=2)
    with pytest.raises(ValueError, match="gpus"):
        AllocationProblem(tables=((INF,),), gpus=0)
    with pytest.raises(ValueError, match=">= 0"):
        AllocationProblem(tables=((INF, -1.0),), gpus=1)


def test_ties_on_l_take_the_smallest_latency_sum_not_idle_gpus() -> None:
    """The repro's hard case: the 70B's p95 is the same on 24..31 GPUs (one tp8 x pp3 replica), the 8B's
    falls from 4 to 8 GPUs; both give L = 7.469, only (8, 24) uses its GPUs."""
    inf = math.inf
    small = tuple(inf if f < 1 else 5.0 if f < 4 else 3.288 if f < 8 else 2.076 for f in range(33))
    large = tuple(inf if f < 24 else 7.469 for f in range(33))
    problem = AllocationProblem((small, large), 32)
    for solver in (PulpCbcAllocationSolver(), ExhaustiveAllocationSolver()):
        allocation = solver.solve(problem)
        assert allocation.gpus == (8, 24), type(solver).__name__
        assert allocation.latency_s == pytest.approx(7.469)
