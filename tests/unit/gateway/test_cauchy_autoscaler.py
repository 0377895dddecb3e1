"""CAUCHY's Algorithm 1 (§3.5) on step, spike, steady and falling loads, with the real CBC solver."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from gateway.planning.autoscaler import Action, Autoscaler, AutoscalerParams, Blocked, ScaleIn, ScaleOut
from gateway.planning.combos import Candidate, Combo
from gateway.planning.cost_model import ComboCost, Side
from gateway.planning.ilp import PulpCbcSolver
from switchyard.hardware import GPUS


def fake(combo: Combo, goodput: float, usd: float, ce: float) -> Candidate:
    side = Side(GPUS[combo.decode_gpu], combo.decode_count)
    cost = ComboCost(None, side, 1, 1.0, 1.0, usd, ce, goodput, 0.0)
    return Candidate(combo, cost, goodput, "table", 0.01)


SMALL = fake(Combo("a800", 1), 10.0, 1.19, 1.0e6)  # $0.119/h per req/s
BIG = fake(Combo("h20", 1), 20.0, 1.50, 1.2e6)  # $0.075/h per req/s
CANDIDATES = (SMALL, BIG)


def scaler(initial: dict[str, int], inventory: dict[str, int] | None = None) -> Autoscaler:
    return Autoscaler(CANDIDATES, inventory or {"a800": 4, "h20": 4}, PulpCbcSolver(), initial)


def run(a: Autoscaler, load: Callable[[int], float], seconds: int) -> list[Action]:
    actions: list[Action] = []
    for t in range(1, seconds + 1):
        actions += a.observe(float(t), load(t))
    return actions


def test_a_step_up_is_covered_within_a_few_windows_and_only_by_scale_outs() -> None:
    a = scaler({"1xh20": 1})  # 20 req/s deployed
    actions = run(a, lambda t: 20.0 if t < 600 else 50.0, 1200)
    assert actions and all(isinstance(x, ScaleOut) for x in actions)
    assert actions[0].at_s > 600 and a.capacity_rps() >= 50.0
    assert actions[-1].at_s <= 600 + 4 * 120
    assert all(x.serving_at_s == x.at_s + 90.0 for x in actions if isinstance(x, ScaleOut))


def test_a_short_spike_does_not_scale_and_a_long_one_does() -> None:
    a = scaler({"1xh20": 1})
    assert run(a, lambda t: 40.0 if 300 <= t < 310 else 20.0, 900) == []  # window mean 21.7 < 20 x 1.2
    b = scaler({"1xh20": 1})
    assert any(isinstance(x, ScaleOut) for x in run(b, lambda t: 40.0 if 300 <= t < 400 else 20.0, 900))


def test_a_steady_noisy_load_does_not_oscillate() -> None:
    """AIBrix #637: plans that flap under a steady load. Two hours of 33 +- 10 % req/s on a 40 req/s fleet."""
    rng = random.Random(0)
    a = scaler({"1xh20": 2})  # 40 req/s for ~33
    actions = run(a, lambda t: 33.0 * rng.uniform(0.9, 1.1), 7200)
    assert [x for x in actions if not isinstance(x, ScaleIn | ScaleOut)] == []
    assert len(actions) <= 1


def test_inventory_blocks_a_scale_out_and_says_so() -> None:
    """AIBrix #637: plans that ignore GPU inventory."""
    a = scaler({"1xh20": 1}, inventory={"a800": 1, "h20": 1})
    actions = run(a, lambda t: 100.0, 130)
    assert len(actions) == 1 and isinstance(actions[0], Blocked)
    assert "cannot cover" in actions[0].reason and a.capacity_rps() == 20.0


def test_a_fall_scales_in_keeping_the_load_and_the_gpus_until_drained() -> None:
    a = scaler({"1xh20": 3})  # 60 req/s
    actions = run(a, lambda t: 15.0, 130)
    assert len(actions) == 1 and isinstance(actions[0], ScaleIn)
    assert a.capacity_rps() >= 15.0 and actions[0].combos == {"1xh20": 2}
    assert a.gpus_in_use(actions[0].gone_at_s - 1)["h20"] == 3  # draining
    assert a.gpus_in_use(actions[0].gone_at_s)["h20"] == 1


def test_a_scale_in_keeps_min_copies_even_at_zero_load() -> None:
    a = scaler({"1xh20": 3})
    actions = run(a, lambda t: 0.0, 130)
    assert len(actions) == 1 and isinstance(actions[0], ScaleIn) and actions[0].combos == {"1xh20": 2}
    none_left = Autoscaler(CANDIDATES, {"a800": 4, "h20": 4}, PulpCbcSolver(), {"1xh20": 3},
                           params=AutoscalerParams(min_copies=0))
    assert [x.combos for x in run(none_left, lambda t: 0.0, 130) if isinstance(x, ScaleIn)] == [{"1xh20": 3}]


def test_refinement_makes_before_it_breaks() -> None:
    """AIBrix #637: scale-down that finishes before scale-up. A fleet of small combos re-planned onto big
    ones: the small ones leave only after the big ones serve."""
    params = AutoscalerParams(local_window_s=120, global_window_s=600)
    a = Autoscaler(CANDIDATES, {"a800": 4, "h20": 4}, PulpCbcSolver(), {"1xa800": 4}, params=params)
    actions = run(a, lambda t: 36.0, 700)  # 40 deployed: within 20 %, no scaling; refined at 600 s
    outs = [x for x in actions if isinstance(x, ScaleOut)]
    ins = [x for x in actions if isinstance(x, ScaleIn)]
    assert len(outs) == 1 and len(ins) == 1
    assert outs[0].combos == {"1xh20": 2} and ins[0].combos == {"1xa800": 4}
    assert ins[0].at_s >= outs[0].serving_at_s and ins[0].gone_at_s == ins[0].at_s + 30.0
    assert a.capacity_rps() == 40.0


def test_params_are_checked() -> None:
    with pytest.raises(ValueError, match="ratio"):
        AutoscalerParams(ratio=0)
    with pytest.raises(ValueError, match="initial combos"):
        scaler({"9xb200": 1})
