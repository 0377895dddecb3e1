"""Cascadia's routing solver (§3.3, App. C) and Algorithm 1's stop rule, with a scripted deployment solver."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest

from gateway.cascade.plan.bilevel import Deployment, PlanRequest, plan_cascade, stage_workloads
from gateway.cascade.plan.parallelism import NO_REPLICAS
from gateway.cascade.plan.routing import (
    ACCEPT_ALL,
    ESCALATE_ALL,
    Evaluation,
    LatencyBudget,
    QualityFloor,
    RoutingSolver,
    budget_score,
    chebyshev_score,
    initial_thresholds,
    threshold_lattice,
)
from gateway.cascade.plan.stage_latency import StageWorkload
from gateway.cascade.quality import Item, ItemScore, QualityProfile, mt_bench_profile

# §3.3's illustrative example.
EXAMPLE = QualityFloor(q_min=0.90, utopia=0.95, nadir=0.75, mu=100.0)
THETA_1 = Evaluation((1.0,), 11.0, 0.88)
THETA_2 = Evaluation((2.0,), 11.4, 0.91)
THETA_3 = Evaluation((3.0,), 12.2, 0.93)


def test_the_worked_example_scores_21_0_11_4_12_2() -> None:
    assert EXAMPLE.score(11.0, 0.88) == pytest.approx(21.0)
    assert EXAMPLE.score(11.4, 0.91) == pytest.approx(11.4)
    assert EXAMPLE.score(12.2, 0.93) == pytest.approx(12.2)
    assert chebyshev_score(11.0, 0.88, 0.90, 0.95, 0.75) == pytest.approx(21.0)


def test_the_routing_solver_chooses_theta_2() -> None:
    solver = RoutingSolver([(1.0, 2.0, 3.0)], EXAMPLE)
    best = solver.observe([THETA_1, THETA_2, THETA_3])
    assert best == pytest.approx(11.4)
    assert solver.best == THETA_2


def test_an_infinite_latency_never_wins() -> None:
    solver = RoutingSolver([(1.0, 2.0)], EXAMPLE)
    solver.observe([Evaluation((1.0,), math.inf, 0.99), Evaluation((2.0,), 50.0, 0.80)])
    assert solver.best == Evaluation((2.0,), 50.0, 0.80)
    assert solver.best_score == pytest.approx(50.0 + 100 * 0.5)


def test_latency_budget_variant_maximises_quality_under_l_max() -> None:
    budget = LatencyBudget(l_max_s=11.5, latency_best_s=10.0, latency_worst_s=15.0, nu=100.0)
    assert budget.score(11.4, 0.91) == pytest.approx(-0.91)
    assert budget.score(12.2, 0.93) == pytest.approx(-0.93 + 100 * 0.7 / 5.0)
    assert budget_score(11.0, 0.88, 11.5, 10.0, 15.0) == pytest.approx(-0.88)
    solver = RoutingSolver([(1.0, 2.0, 3.0)], budget)
    solver.observe([THETA_1, THETA_2, THETA_3])
    assert solver.best == THETA_2  # θ3 is better but over budget; θ2 beats θ1 on quality


def test_proposals_are_unvisited_neighbours_and_the_radius_doubles_without_progress() -> None:
    lattice = [(0.0, 10.0, 20.0, 30.0, 40.0, 50.0, 101.0)]
    solver = RoutingSolver(lattice, EXAMPLE)
    assert solver.propose() == []
    solver.observe([Evaluation((30.0,), 5.0, 0.95)])
    assert solver.propose() == [(20.0,), (40.0,)]
    solver.observe([Evaluation((20.0,), 6.0, 0.95), Evaluation((40.0,), 7.0, 0.95)])  # no progress: r = 2
    assert solver.propose() == [(10.0,), (50.0,)]
    solver.observe([Evaluation((10.0,), 9.0, 0.95), Evaluation((50.0,), 4.0, 0.95)])  # progress: r = 1
    assert solver.best is not None and solver.best.thresholds == (50.0,)
    assert solver.propose() == [(101.0,)]


def test_three_stage_proposals_move_each_threshold_and_both_together() -> None:
    solver = RoutingSolver([(0.0, 50.0, 101.0), (0.0, 50.0, 101.0)], EXAMPLE)
    solver.observe([Evaluation((50.0, 50.0), 5.0, 0.95)])
    assert solver.propose() == [(0.0, 50.0), (101.0, 50.0), (50.0, 0.0), (50.0, 101.0), (0.0, 0.0),
                                (101.0, 101.0)]


def _profile(weak: Sequence[float], strong: Sequence[float]) -> QualityProfile:
    items = [Item(i, 1, "math", (f"question {i}",)) for i in range(len(weak))]
    return QualityProfile(items, {"llama3-8b": [ItemScore(s, 100) for s in weak],
                                  "llama3-70b": [ItemScore(s, 200) for s in strong]})


TOY = _profile([20.0, 40.0, 60.0, 80.0], [90.0, 90.0, 90.0, 90.0])


def test_lattice_and_initial_routing_send_half_to_the_second_stage() -> None:
    lattice = threshold_lattice(TOY, ("llama3-8b", "llama3-70b"))
    assert lattice == ((ACCEPT_ALL, 40.0, 60.0, 80.0, ESCALATE_ALL),)
    # h = 60 escalates the scores 20 and 40: half the requests reach stage 2 (θ0 sends 1/2 there).
    assert initial_thresholds(TOY, ("llama3-8b", "llama3-70b"), lattice) == (60.0,)
    mt = mt_bench_profile()
    models3 = ("llama3-8b", "qwen2.5-14b", "llama3-70b")
    theta = initial_thresholds(mt, models3, threshold_lattice(mt, models3))
    shares = mt.route(models3, theta).stage_share
    assert abs(shares[1] - 1 / 2) < 0.1 and abs(shares[2] - 1 / 3) < 0.1


def test_stage_workloads_follow_the_routing() -> None:
    workloads, routing = stage_workloads(TOY, ("llama3-8b", "llama3-70b"), (60.0,), 8.0)
    assert routing.stage_share == (1.0, 0.5)
    assert workloads[0].rate_rps == 8.0 and workloads[1].rate_rps == 4.0
    assert workloads[1].answer_tokens == (200, 200)
    assert len(workloads[0].prompt_tokens) == 4
    idle, _ = stage_workloads(TOY, ("llama3-8b", "llama3-70b"), (0.0,), 8.0)
    assert idle[1] == StageWorkload(0.0, (), ())


class ScriptedDeployer:
    """L as a function of the rate reaching stage 2 (a table the test writes), counting its calls."""

    def __init__(self, latency_by_stage2_rate: dict[float, float]) -> None:
        self._latency = latency_by_stage2_rate
        self.calls: list[float] = []

    @property
    def milp_solves(self) -> int:
        return len(self.calls)

    def solve(self, models: Sequence[str], workloads: Sequence[StageWorkload], gpus: int) -> Deployment:
        rate = workloads[1].rate_rps
        self.calls.append(rate)
        return Deployment((gpus - 1, 1), (NO_REPLICAS, NO_REPLICAS), self._latency[rate])


def _plan(deployer: ScriptedDeployer, q_min: float) -> tuple[tuple[float, ...], int, float]:
    request = PlanRequest(("llama3-8b", "llama3-70b"), "h100", 8, 4.0, q_min=q_min)
    plan = plan_cascade(request, TOY, deployer=deployer)
    return plan.thresholds, plan.iterations, plan.objective


def test_stops_after_k_iterations_without_a_better_j() -> None:
    # Rates at stage 2 for h = 0 / 40 / 60 / 80 / 101: 0, 1, 2, 3, 4 req/s. θ0 (h = 60) is already best.
    deployer = ScriptedDeployer({0.0: 9.0, 1.0: 8.0, 2.0: 5.0, 3.0: 6.0, 4.0: 7.0})
    thresholds, iterations, objective = _plan(deployer, q_min=0.0)
    assert thresholds == (60.0,)
    assert objective == pytest.approx(5.0)
    assert iterations == 1 + 3  # θ0, then K = 3 iterations that leave the best J unchanged
    assert deployer.calls == [2.0, 1.0, 3.0, 0.0, 4.0]  # θ0, radius 1, radius 2 (radius 4: nothing new)


def test_an_improvement_resets_the_count() -> None:
    # The best is h = 80 (rate 3): found in iteration 2, then three iterations without change.
    deployer = ScriptedDeployer({0.0: 9.0, 1.0: 8.0, 2.0: 5.0, 3.0: 4.0, 4.0: 7.0})
    thresholds, iterations, objective = _plan(deployer, q_min=0.0)
    assert thresholds == (80.0,) and objective == pytest.approx(4.0)
    assert iterations == 2 + 3


def test_quality_floor_pushes_escalation() -> None:
    # Q(h): h = 60 -> (90 + 90 + 60 + 80) / 4 = 80; h = 101 -> 90. q_min = 90 needs everything escalated.
    deployer = ScriptedDeployer({0.0: 1.0, 1.0: 2.0, 2.0: 3.0, 3.0: 4.0, 4.0: 5.0})
    thresholds, _, objective = _plan(deployer, q_min=90.0)
    assert thresholds == (ESCALATE_ALL,) and objective == pytest.approx(5.0)
