"""Cascadia §4.4's re-planning core: windows, the shift rule, and the rollout of a new deployment."""

from __future__ import annotations

import random

import pytest

from gateway.cascade.plan.replan import (
    Baseline,
    ReplanParams,
    Replica,
    ShadowRow,
    WorkloadMonitor,
    replicas,
    rollout,
    shadow_item,
)
from gateway.cascade.quality import ItemScore, mt_bench_profile

PAIR = ("llama3-8b", "llama3-70b")
PARAMS = ReplanParams(window_s=300.0, min_shadow=20)


def baseline(subset: str, rate: float) -> Baseline:
    return Baseline.of_profile(mt_bench_profile().subset(subset), PAIR, [90.0], rate)


def feed(
    monitor: WorkloadMonitor, subset: str, rate: float, start_s: float, seed: int, shadow_every: int = 10
) -> None:
    """One window of `subset` traffic at `rate`: arrivals, answers, every `shadow_every`-th one shadowed."""
    profile = mt_bench_profile().subset(subset)
    rng = random.Random(seed)
    base = Baseline.of_profile(profile, PAIR, [90.0], rate)
    for n in range(int(rate * PARAMS.window_s)):
        monitor.on_arrival()
        i = rng.randrange(len(profile.items))
        monitor.on_answer(base.prompt_tokens[i], base.answer_tokens[i])
        if n % shadow_every == 0:
            monitor.on_shadow(ShadowRow(profile.items[i], {m: profile.scores(m)[i] for m in PAIR}))


def test_a_steady_workload_does_not_shift() -> None:
    shifts = 0
    monitor = WorkloadMonitor(PAIR, baseline("mt-bench", 4.0), PARAMS, start_s=0.0, seed=1)
    for w in range(12):
        feed(monitor, "mt-bench", 4.0, w * 300.0, seed=w)
        shifts += monitor.close((w + 1) * 300.0) is not None
    assert monitor.windows == 12
    assert shifts == 0
    assert set(monitor.last_tests) == {
        "rate",
        "prompt_tokens",
        "answer_tokens",
        "scores:llama3-8b",
        "scores:llama3-70b",
    }


def test_the_hard_to_all_shift_is_seen_in_one_window_of_90_shadowed_rows() -> None:
    seen = 0
    for seed in range(8):
        monitor = WorkloadMonitor(PAIR, baseline("mt-bench-hard", 6.0), PARAMS, start_s=0.0, seed=seed)
        feed(monitor, "mt-bench", 6.0, 0.0, seed=100 + seed, shadow_every=20)
        shift = monitor.close(300.0)
        seen += shift is not None and any("scores" in r for r in shift.reasons)
    assert seen >= 7


def test_a_rate_change_shifts_and_carries_the_new_rate() -> None:
    monitor = WorkloadMonitor(PAIR, baseline("mt-bench", 4.0), PARAMS, start_s=0.0, seed=2)
    feed(monitor, "mt-bench", 6.0, 0.0, seed=3)
    shift = monitor.close(300.0)
    assert shift is not None
    assert shift.rate_rps == pytest.approx(6.0)
    assert any(r.startswith("rate 4 -> 6") for r in shift.reasons)


def test_a_complexity_change_shifts_with_a_profile_of_the_shadowed_rows() -> None:
    monitor = WorkloadMonitor(PAIR, baseline("mt-bench-easy", 4.0), PARAMS, start_s=0.0, seed=4)
    feed(monitor, "mt-bench-hard", 4.0, 0.0, seed=5)
    shift = monitor.close(300.0)
    assert shift is not None
    assert any("llama3-8b scores" in r for r in shift.reasons)
    assert shift.profile is not None
    assert len(shift.profile.items) == 120  # every 10th of 1200 arrivals shadowed
    assert all(item.hard for item in shift.profile.items)
    # Adopting a plan made for the new workload stops the shift from firing again.
    monitor.adopt(Baseline.of_profile(shift.profile, PAIR, [90.0], shift.rate_rps))
    feed(monitor, "mt-bench-hard", 4.0, 300.0, seed=6)
    assert monitor.close(600.0) is None


def test_too_few_shadowed_rows_pool_windows_before_testing_complexity() -> None:
    monitor = WorkloadMonitor(PAIR, baseline("mt-bench-easy", 1.0), PARAMS, start_s=0.0, seed=7)
    feed(monitor, "mt-bench-hard", 1.0, 0.0, seed=8, shadow_every=25)  # 12 shadowed < min_shadow 20
    first = monitor.close(300.0)
    assert "scores:llama3-8b" not in monitor.last_tests
    assert first is None or first.profile is None
    feed(monitor, "mt-bench-hard", 1.0, 300.0, seed=9, shadow_every=25)
    monitor.close(600.0)
    assert "scores:llama3-8b" in monitor.last_tests  # 24 pooled rows


def test_shadowing_follows_the_share_and_the_sample_is_bounded() -> None:
    params = ReplanParams(shadow_share=0.05, sample_size=50)
    monitor = WorkloadMonitor(PAIR, baseline("mt-bench", 10.0), params, start_s=0.0, seed=10)
    shadowed = sum(monitor.on_arrival() for _ in range(20_000))
    assert 900 < shadowed < 1100
    for n in range(500):
        monitor.on_answer(n, n)
    assert monitor.next_close_s == 300.0
    shift = monitor.close(300.0)
    assert shift is not None and len(shift.prompt_tokens) == 50  # the rate is far off: shift, with the sample
    assert max(shift.prompt_tokens) > 100  # a uniform sample of all 500, not the first 50


def test_rows_missing_a_model_count_for_the_others_but_not_for_the_replan_profile() -> None:
    monitor = WorkloadMonitor(PAIR, baseline("mt-bench-easy", 4.0), PARAMS, start_s=0.0, seed=11)
    hard = mt_bench_profile().subset("mt-bench-hard")
    for n in range(40):  # the 70B has no replica: only the 8B's score comes back
        monitor.on_arrival()
        monitor.on_shadow(ShadowRow(hard.items[n], {"llama3-8b": hard.scores("llama3-8b")[n]}))
    shift = monitor.close(300.0)
    assert shift is not None and any("llama3-8b scores" in r for r in shift.reasons)
    assert "scores:llama3-70b" not in monitor.last_tests
    assert shift.profile is None  # no row scores both models: the caller plans on its last profile
    with pytest.raises(ValueError, match="qwen"):
        monitor.on_shadow(ShadowRow(shadow_item(0, ["hi"]), {"qwen2.5-14b": ItemScore(80.0, 10)}))
    with pytest.raises(ValueError, match="none"):
        monitor.on_shadow(ShadowRow(shadow_item(0, ["hi"]), {}))


def test_params_are_checked() -> None:
    with pytest.raises(ValueError):
        ReplanParams(window_s=0)
    with pytest.raises(ValueError):
        ReplanParams(shadow_share=1.5)
    with pytest.raises(ValueError):
        ReplanParams(alpha=0.0)


def test_rollout_keeps_common_replicas_and_fills_idle_gpus_first() -> None:
    old = replicas(PAIR, [[[1, 1, 4]], [[8, 3, 1]]])  # 4 + 24 = 28 of 32 GPUs
    new = replicas(PAIR, [[[1, 1, 8]], [[8, 1, 3]]])  # 8 + 24
    steps = rollout(old, new, 32)
    assert steps[0].remove is None and len(steps[0].add) == 4  # the 4 idle GPUs take new 8B replicas first
    assert (
        steps[1].remove == Replica("llama3-70b", 8, 3) and steps[1].add == (Replica("llama3-70b", 8, 1),) * 3
    )
    assert steps[1].gap  # the only 70B replica: nothing of the 70B serves until a new one loads
    assert sum(1 for s in steps if s.remove is not None) == 1


def test_rollout_drains_replicas_of_well_served_models_first_and_one_at_a_time() -> None:
    old = replicas(PAIR, [[[1, 1, 8]], [[8, 1, 3]]])
    new = replicas(PAIR, [[[1, 1, 4]], [[8, 3, 1]]])
    steps = rollout(old, new, 32)
    removed = [s.remove for s in steps]
    assert all(r is not None for r in removed) and len(removed) == 7  # 4 small + 3 large, one per step
    assert [r.model for r in removed if r is not None][:4] == ["llama3-8b"] * 4
    assert [s.gap for s in steps] == [False] * 6 + [True]
    assert steps[-1].add == (Replica("llama3-70b", 8, 3),)
    assert rollout(old, old, 32) == ()


def test_rollout_never_needs_a_gap_when_a_model_keeps_a_replica() -> None:
    old = replicas(PAIR, [[[1, 1, 8]], [[8, 1, 3]]])
    new = replicas(PAIR, [[[2, 1, 4]], [[8, 1, 3]]])  # the 8B changes shape, the 70B stays
    steps = rollout(old, new, 32)
    assert not any(s.gap for s in steps)
    assert all(s.remove is None or s.remove.model == "llama3-8b" for s in steps)
    assert sorted(a for s in steps for a in s.add) == [Replica("llama3-8b", 2, 1)] * 4
    with pytest.raises(ValueError, match="more than 16"):
        rollout(old, new, 16)
