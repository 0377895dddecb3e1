"""CAUCHY's combos (§3.3.1) and allocation (§3.3.2, Eq. 16) with PuLP + CBC."""

from __future__ import annotations

import pytest

from gateway.planning.combos import (
    Candidate,
    Combo,
    Slo,
    candidates,
    decode_step_s,
    enumerate_combos,
    length_bucket,
    length_mix,
    mix_goodput,
    modelled_goodput,
)
from gateway.planning.cost_model import ComboCost, Side, Workload, price_combo
from gateway.planning.ilp import AllocationProblem, PulpCbcSolver, explain_infeasible, summarize
from switchyard.hardware import GPUS, MODELS

LLAMA = MODELS["llama3-8b"]
THREE = {name: GPUS[name] for name in ("h800", "a800", "h20")}
SHAREGPT = Workload(337, 1330)
SLO = Slo(ttft_s=5.0, tpot_s=0.030)


def fake(combo: Combo, goodput: float, usd: float, ce: float) -> Candidate:
    side = Side(GPUS[combo.decode_gpu], combo.decode_count)
    cost = ComboCost(None, side, 1, 1.0, 1.0, usd, ce, goodput, 0.0)
    return Candidate(combo, cost, goodput, "table", 0.01)


def test_the_papers_example_co_picks_the_a800_combo_and_mce_the_h20_one() -> None:
    """§3.3.2: for a residual 0.80 req/s, the A800 combo (0.82 req/s, $1.09/h, 1.07M tokens/$) beats the H20
    combo (1.23 req/s, $1.50/h, 1.15M tokens/$) on cost; MCE-LP takes the H20 one for its higher CE."""
    a800 = fake(Combo("a800", 1), 0.82, 1.09, 1.07e6)
    h20 = fake(Combo("h20", 1), 1.23, 1.50, 1.15e6)
    solver = PulpCbcSolver()
    inventory = {"a800": 8, "h20": 8}
    picks = {obj: solver.solve(AllocationProblem((a800, h20), inventory, obj, demand_rps=0.80)).counts
             for obj in ("co", "mce", "mc")}
    assert picks == {"co": {"1xa800": 1}, "mce": {"1xh20": 1}, "mc": {"1xa800": 1}}


def test_inventory_bounds_the_plan_and_the_demand_is_met() -> None:
    cands = tuple(candidates(LLAMA, SHAREGPT, SLO, THREE))
    inventory = {"h800": 1, "a800": 8, "h20": 2}
    plan = PulpCbcSolver().solve(AllocationProblem(cands, inventory, "co", demand_rps=40.0))
    assert plan.status == "optimal"
    summary = summarize(plan, cands, 337 + 1330)
    assert summary.goodput_rps >= 40.0
    assert all(summary.gpus.get(g, 0) <= n for g, n in inventory.items())
    assert set(summary.gpus) <= set(inventory)


def test_a_budget_alone_maximises_goodput_within_it() -> None:
    cands = tuple(candidates(LLAMA, SHAREGPT, SLO, THREE))
    plan = PulpCbcSolver().solve(AllocationProblem(cands, {"h800": 8, "a800": 8, "h20": 8}, "co",
                                                   budget_usd_per_h=20.0))
    summary = summarize(plan, cands, 337 + 1330)
    assert plan.status == "optimal" and 0 < summary.total_usd_per_h <= 20.0
    best_per_dollar = max(c.goodput_rps / c.usd_per_hour for c in cands)
    assert summary.goodput_rps >= 0.8 * best_per_dollar * 20.0 - max(c.goodput_rps for c in cands)


def test_infeasible_inputs_say_why_in_one_line() -> None:
    cands = tuple(candidates(LLAMA, SHAREGPT, SLO, THREE))
    solver = PulpCbcSolver()
    over_budget = AllocationProblem(cands, {"h800": 8, "a800": 8, "h20": 8}, demand_rps=500.0,
                                    budget_usd_per_h=30.0)
    assert solver.solve(over_budget).status == "infeasible"
    assert explain_infeasible(over_budget).startswith("500 req/s needs >= $")
    assert "budget $30/h" in explain_infeasible(over_budget)
    short = AllocationProblem(cands, {"h800": 1, "a800": 0, "h20": 1}, demand_rps=500.0)
    assert solver.solve(short).status == "infeasible"
    reason = explain_infeasible(short)
    assert reason.startswith("500 req/s needs ") and "available" in reason and "\n" not in reason


def test_reversed_directions_are_dropped_and_candidates_rank_by_ce() -> None:
    cands = candidates(LLAMA, SHAREGPT, SLO, THREE)
    ids = {c.combo.id for c in cands}
    assert "1xh800+1xh20" in ids and "1xh20+1xh800" not in ids  # compute prefills, bandwidth decodes
    ces = [c.ce_tokens_per_usd for c in cands]
    assert ces == sorted(ces, reverse=True)
    assert len(enumerate_combos(THREE)) == 3 * 2 + 9 * (6 + 5)  # pools; P:D pairs with P <= D, 1:1..2:6


def test_modelled_goodput_respects_the_slo() -> None:
    cost = price_combo(LLAMA, SHAREGPT, decode=Side(GPUS["h20"]), prefill=Side(GPUS["h800"]))
    loose, step = modelled_goodput(LLAMA, SHAREGPT, Slo(5.0, 0.050), cost)
    tight, tight_step = modelled_goodput(LLAMA, SHAREGPT, Slo(5.0, 0.008), cost)
    assert 0 < tight < loose and tight_step <= 0.008 < step <= 0.050
    impossible, fastest = modelled_goodput(LLAMA, SHAREGPT, Slo(5.0, 0.003), cost)
    assert impossible == 0.0 and fastest > 0.003
    assert fastest == pytest.approx(decode_step_s(LLAMA, cost.decode, SHAREGPT, 1))
    assert modelled_goodput(LLAMA, SHAREGPT, Slo(0.001, 0.05), cost)[0] == 0.0  # prefill exceeds TTFT


@pytest.mark.parametrize("objective", ["co", "mce", "mc"])
def test_the_plan_is_no_worse_than_any_one_combo_plan(objective: str) -> None:
    """Brute force over single-combo plans: the ILP's objective is at most the best of them (the weights are
    ~1e-8 before normalising; CBC then took any feasible plan as optimal)."""
    cands = tuple(candidates(LLAMA, SHAREGPT, SLO, THREE))
    inventory = {"h800": 8, "a800": 8, "h20": 8}
    problem = AllocationProblem(cands, inventory, objective, demand_rps=40.0)  # type: ignore[arg-type]
    plan = PulpCbcSolver().solve(problem)
    by_id = {c.combo.id: c for c in cands}
    value = sum(problem.weight(by_id[k]) * n for k, n in plan.counts.items())
    singles = []
    for c in cands:
        copies = -(-40.0 // c.goodput_rps)
        if all(copies * m <= inventory[g] for g, m in c.combo.gpus().items()):
            singles.append(problem.weight(c) * copies)
    assert value <= min(singles) * (1 + 1e-9)


def test_a_length_mix_buckets_base_2_on_both_lengths() -> None:
    mix = length_mix([(100, 10), (120, 14), (1000, 10), (0, 0)])
    assert [share for share, _ in mix] == [0.25, 0.5, 0.25]
    assert mix[0][1] == Workload(1, 1)  # below one token: bucket 0, one token
    assert mix[1][1] == Workload(110, 12) and mix[2][1] == Workload(1000, 10)
    assert (length_bucket(1), length_bucket(2), length_bucket(127), length_bucket(128)) == (0, 1, 6, 7)
    with pytest.raises(ValueError, match="at least one request"):
        length_mix([])


def test_mix_goodput_shares_one_instance_between_the_buckets() -> None:
    side = Side(GPUS["a800"])
    short, long_ = Workload(200, 100), Workload(2000, 800)

    def alone(w: Workload) -> float:
        return modelled_goodput(LLAMA, w, SLO, price_combo(LLAMA, w, decode=side))[0]

    assert mix_goodput(LLAMA, ((1.0, short),), SLO, side, None) == pytest.approx(alone(short))
    both = mix_goodput(LLAMA, ((0.75, short), (0.25, long_)), SLO, side, None)
    assert both == pytest.approx(1.0 / (0.75 / alone(short) + 0.25 / alone(long_)))
    assert alone(long_) < both < alone(short)
    # A bucket no GPU of the combo can prefill within the TTFT makes the combo unfit for the mix.
    huge = Workload(60000, 10)
    assert mix_goodput(LLAMA, ((0.99, short), (0.01, huge)), Slo(1.0, 0.030), side, None) == 0.0
    cands = candidates(LLAMA, Workload(650, 275), SLO, THREE, mix=((0.75, short), (0.25, long_)))
    assert cands and {c.goodput_source for c in cands} == {"modelled-mix"}
