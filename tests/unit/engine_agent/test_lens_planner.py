"""Algorithm 1 (`plan_batch`) on hand-made queues and against a literal transcription; `LensController`."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import pytest

from engine_agent.lens.controller import LensConfig, LensController
from engine_agent.lens.perf_model import (
    SATURATED_K,
    LatencyModel,
    LatencyParams,
    predict_array,
    predict_scalar,
)
from engine_agent.lens.planner import (
    BatchPlan,
    PlanLimits,
    QueueView,
    allocate,
    peak_tokens_per_s,
    plan_batch,
)

# T(B, S) = 10 ms + S / 10,000 tok/s + 1 ms * B: saturated throughput makes the arithmetic exact by hand.
LINEAR = LatencyParams(tau0_s=0.010, w0_tokens=0.0, ws=1.0, pmax_tokens_per_s=10_000.0,
                       kb_per_seq=SATURATED_K, ks_per_token=SATURATED_K, tau_b_s=0.001, tau_s_s=0.0)
CURVED = LatencyParams(tau0_s=0.004, w0_tokens=50.0, ws=1.0, pmax_tokens_per_s=40_000.0, kb_per_seq=0.3,
                       ks_per_token=0.003, tau_b_s=5e-5, tau_s_s=2e-6)
LIMITS = PlanLimits(max_num_seqs=8, max_batched_tokens=512, block_size=16)


def view(running: list[int], waiting: list[int], free_kv_blocks: int = 10_000) -> QueueView:
    return QueueView.of(running, waiting, free_kv_blocks)


def test_empty_queues_give_no_plan() -> None:
    assert plan_batch(view([], []), LIMITS, LINEAR, 0.03) is None


def test_picks_the_candidate_closest_to_the_target_and_exits_early() -> None:
    # Target 30.5 ms: S*(B) = (20.5 ms - 1 ms * B) / 0.1 ms = 205 - 10 B. Two decodes run, four 50-token
    # prompts wait, so the candidates start at B=3 (B=2 would admit none of them): B=3: +50, 18.2 ms; B=4:
    # +100, 24.2 ms; B=5: S*=155 -> 2 + 3 x 50 = 152 tokens, 30.2 ms: 0.3 ms off, under 5% of the target, so
    # the loop stops there.
    plan = plan_batch(view([1, 1], [50, 50, 50, 50]), LIMITS, LINEAR, 0.0305)
    assert plan == BatchPlan(token_budget=152, num_seqs=5, predicted_latency_s=pytest.approx(0.0302),
                             candidates_tried=3, target_latency_s=0.0305)
    # Without the early exit B=6 is tried too (S*=145: 2 + 50 + 50 + a 43-token chunk, 5 sequences, 29.5 ms,
    # 1 ms off) and loses to B=5.
    exhaustive = plan_batch(view([1, 1], [50, 50, 50, 50]), LIMITS, LINEAR, 0.0305, eps_ratio=0.0)
    assert exhaustive is not None
    assert (exhaustive.num_seqs, exhaustive.token_budget, exhaustive.candidates_tried) == (5, 152, 4)
    # A loose epsilon (25%: 7.6 ms) stops at the first candidate within it, B=4 (24.2 ms, 6.3 ms off).
    loose = plan_batch(view([1, 1], [50, 50, 50, 50]), LIMITS, LINEAR, 0.0305, eps_ratio=0.25)
    assert loose is not None
    assert (loose.num_seqs, loose.token_budget, loose.candidates_tried) == (4, 102, 2)


def test_keeps_an_earlier_candidate_when_later_ones_are_worse() -> None:
    # Prompts of 150 tokens, target 29 ms, S*(B) = 190 - 10 B (B=2, the decodes alone, is not a candidate
    # while prompts wait): B=3 adds one prompt, 152 tokens, 28.2 ms (0.8 ms off); B=4 (S*=150) can only give
    # the first prompt a 148-token chunk, 28.0 ms (1 ms off); B=5 (S*=140) 27.0 ms. With eps 0 all three are
    # tried and B=3 is kept.
    plan = plan_batch(view([1, 1], [150, 150, 150]), LIMITS, LINEAR, 0.0290, eps_ratio=0.0)
    assert plan is not None
    b3 = predict_scalar(LINEAR, 3, 152)  # 10 + 15.2 + 3 = 28.2 ms
    assert plan.predicted_latency_s == pytest.approx(b3)
    assert (plan.num_seqs, plan.token_budget, plan.candidates_tried) == (3, 152, 3)


def test_budget_never_exceeds_the_token_limit() -> None:
    limits = PlanLimits(max_num_seqs=512, max_batched_tokens=256, block_size=16)
    plan = plan_batch(view([1] * 300, [20] * 10), limits, LINEAR, 10.0)  # more decodes than tokens
    assert plan is not None and plan.token_budget == 256 and plan.num_seqs == 256
    rng = np.random.default_rng(0)
    for _ in range(200):
        n_run, n_wait = int(rng.integers(0, 40)), int(rng.integers(0, 60))
        running = [1 if rng.random() < 0.8 else int(rng.integers(2, 3000)) for _ in range(n_run)]
        waiting = rng.integers(1, 3000, n_wait).tolist()
        limits = PlanLimits(int(rng.integers(1, 64)), int(rng.integers(16, 4096)), 16)
        target = float(rng.uniform(0.005, 0.5))
        plan = plan_batch(view(running, waiting, int(rng.integers(0, 500))), limits, CURVED, target)
        if plan is not None:
            assert 1 <= plan.token_budget <= limits.max_batched_tokens
            assert 1 <= plan.num_seqs <= max(limits.max_num_seqs, n_run)


def test_running_sequences_are_served_before_waiting_ones() -> None:
    # A running prefill with 400 tokens left and a tight target. A request waits and a slot is free, so B=4
    # is the only candidate: S*(4) = 110 - 40 = 70 tokens, all to the running sequences (two decodes and a
    # 68-token chunk); the waiting prompt gets nothing.
    plan = plan_batch(view([1, 1, 400], [10]), LIMITS, LINEAR, 0.021)
    assert plan is not None
    assert (plan.num_seqs, plan.token_budget) == (3, 70)
    assert allocate(view([1, 1, 400], [10]), LIMITS, 8, 80) == (3, 80)
    assert allocate(view([1, 1, 400], [10]), LIMITS, 8, 2) == (2, 2)


def test_waiting_sequences_are_admitted_fcfs_without_skipping() -> None:
    # Two free blocks of 16 tokens: the 10-token prompt fits (1 block); the 500-token one does not, and the
    # 10-token prompt behind it is not admitted past it.
    q = view([], [10, 500, 10], free_kv_blocks=2)
    assert allocate(q, LIMITS, 8, 512) == (1, 10)
    plan = plan_batch(q, LIMITS, LINEAR, 1.0)
    assert plan is not None and (plan.num_seqs, plan.token_budget) == (1, 10)
    # With 32 blocks, 31 are left after the first prompt and the 500-token one needs 32: it stops again. With
    # 33 it fits, and the last prompt's 2-token chunk finds no block left.
    assert allocate(view([], [10, 500, 10], free_kv_blocks=32), LIMITS, 8, 512) == (1, 10)
    assert allocate(view([], [10, 500, 10], free_kv_blocks=33), LIMITS, 8, 512) == (2, 510)
    # A partial chunk is admitted when its own blocks fit: 290 tokens of the 500, 19 blocks.
    assert allocate(view([], [10, 500, 10], free_kv_blocks=20), LIMITS, 8, 300) == (2, 300)
    # The sequence cap B stops admission too.
    assert allocate(view([1], [10, 10, 10]), LIMITS, 2, 512) == (2, 11)


def test_plan_budget_rebuilds_the_planned_batch() -> None:
    # The budget is what was allocated, so re-allocating with it (B unbounded) gives the same batch.
    rng = np.random.default_rng(1)
    for _ in range(200):
        running = [1] * int(rng.integers(0, 30))
        waiting = rng.integers(1, 800, int(rng.integers(0, 40))).tolist()
        q = view(running, waiting, int(rng.integers(0, 300)))
        plan = plan_batch(q, LIMITS, CURVED, float(rng.uniform(0.005, 0.2)))
        if plan is not None:
            rebuilt = allocate(q, LIMITS, LIMITS.max_num_seqs, plan.token_budget)
            assert rebuilt == (plan.num_seqs, plan.token_budget)


@dataclass
class _RefPlan:
    b: int
    s: int
    t: float
    tried: int


def _reference(running: list[int], waiting: list[int], free: int, limits: PlanLimits, p: LatencyParams,
               target: float, iters: int, eps: float) -> _RefPlan | None:
    """Algorithm 1 transcribed line by line, with per-sequence Python loops."""
    if not running and not waiting:
        return None
    best: _RefPlan | None = None
    min_error = math.inf
    tried = 0
    b_hi = max(min(len(running) + len(waiting), limits.max_num_seqs), len(running), 1)
    # Deviation (module docstring of the planner): a free slot and a waiting request start at |Q_run| + 1.
    b_lo = len(running) + 1 if waiting and len(running) < b_hi else max(len(running), 1)
    for b in range(b_lo, b_hi + 1):
        tried += 1
        s_low, s_high, s = b, limits.max_batched_tokens, b
        for _ in range(iters):
            if s_low > s_high:
                break
            s_mid = (s_low + s_high) // 2
            if predict_scalar(p, b, s_mid) <= target:
                s, s_low = s_mid, s_mid + 1
            else:
                s_high = s_mid - 1
        s = min(s, limits.max_batched_tokens)
        budget, seqs, blocks = s, 0, free
        for need in running:
            if budget <= 0:
                break
            budget -= min(need, budget)
            seqs += 1
        for need in waiting:
            if budget <= 0 or seqs >= b:
                break
            chunk = min(need, budget)
            if -(-chunk // limits.block_size) > blocks:
                break
            blocks -= -(-chunk // limits.block_size)
            budget -= chunk
            seqs += 1
        tokens = s - budget
        t = predict_scalar(p, seqs, tokens)
        error = abs(t - target)
        if error < min_error:
            min_error = error
            best = _RefPlan(seqs, tokens, t, tried)
            if min_error < target * eps:
                break
    assert best is not None
    best.tried = tried
    return best


@pytest.mark.parametrize("scalar_candidates", [0, 3, 10_000])
def test_matches_a_literal_transcription_of_algorithm_1(scalar_candidates: int) -> None:
    rng = np.random.default_rng(2)
    for case in range(300):
        big = case % 5 == 0  # hundreds of candidates: several vectorised chunks
        n_run, n_wait = int(rng.integers(0, 30)), int(rng.integers(200, 600) if big else rng.integers(0, 80))
        running = [1 if rng.random() < 0.7 else int(rng.integers(2, 2000)) for _ in range(n_run)]
        waiting = rng.integers(1, 2000 if not big else 40, n_wait).tolist()
        q_max = int(rng.integers(200, 700) if big else rng.integers(1, 128))
        limits = PlanLimits(q_max, int(rng.integers(8, 4096 if not big else 16384)), int(rng.choice([1, 16])))
        free = int(rng.integers(0, 400))
        target = float(rng.uniform(0.003, 0.3))
        iters = int(rng.choice([10, 16]))
        eps = float(rng.choice([0.0, 0.05]))
        params = CURVED if case % 2 else LINEAR
        got = plan_batch(view(running, waiting, free), limits, params, target, search_iters=iters,
                         eps_ratio=eps, scalar_candidates=scalar_candidates)
        ref = _reference(running, waiting, free, limits, params, target, iters, eps)
        if ref is None or ref.b == 0:
            assert got is None, case
            continue
        assert got is not None, case
        assert (got.num_seqs, got.token_budget, got.candidates_tried) == (ref.b, ref.s, ref.tried), case
        assert got.predicted_latency_s == pytest.approx(ref.t, rel=1e-9)


# -- the controller ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Record:
    duration_s: float
    num_prefill_seqs: int
    num_prefill_tokens: int
    num_decode_seqs: int
    num_decode_tokens: int


def _warm_controller(config: LensConfig | None = None) -> LensController:
    ctl = LensController(LIMITS, config, model=LatencyModel(params=LINEAR))
    assert ctl.model.ready
    return ctl


def test_controller_feeds_the_model_and_refits_on_its_policy() -> None:
    ctl = LensController(LIMITS, LensConfig(refit_every_observations=4, refit_interval_s=1.0))
    ctl.on_iteration(_Record(0.0, 0, 0, 0, 0), 0.0)  # empty: ignored
    for i in range(3):
        ctl.on_iteration(_Record(0.02, 1, 100 + i, 2, 2), 0.1 * i)
    assert ctl.model.num_observations == 3
    assert ctl.model.samples().tokens.tolist() == [102.0, 103.0, 104.0]  # S = prefill + decode tokens
    assert ctl.model.samples().batch_size.tolist() == [3.0, 3.0, 3.0]
    assert not ctl.refit_due(0.5)
    assert ctl.refit_due(1.0)  # interval passed with new observations
    ctl.on_iteration(_Record(0.02, 1, 200, 2, 2), 0.3)
    job = ctl.take_refit_job(0.3)  # 4 observations
    assert job is not None and ctl.take_refit_job(0.3) is None  # one at a time
    ctl.on_iteration(_Record(0.02, 1, 200, 2, 2), 0.4)
    assert not ctl.refit_due(5.0)  # still in flight
    ctl.install_refit(job())
    assert ctl.refit_due(5.0)
    assert ctl.maybe_refit(5.0) is not None and ctl.maybe_refit(5.0) is None


def test_controller_plans_only_when_enabled_and_ready() -> None:
    q = view([1, 1], [50, 50, 50, 50])
    cold = LensController(LIMITS)
    assert cold.plan(q, 0.0) is None  # cold model: the backend's default batching
    ctl = _warm_controller(LensConfig(default_slo_tpot_s=0.0305))
    plan = ctl.plan(q, 0.0)
    assert plan is not None and (plan.num_seqs, plan.token_budget) == (5, 152)
    disabled = _warm_controller(LensConfig(enabled=False, default_slo_tpot_s=0.0305))
    assert disabled.plan(q, 0.0) is None and disabled.last_plan is None
    # A model whose recent predictions are off by more than 25% stops steering.
    off = _warm_controller(LensConfig(default_slo_tpot_s=0.0305))
    for i in range(10):
        off.on_iteration(_Record(0.1, 0, 0, 5, 5), 0.1 * i)  # predicted 15.5 ms, observed 100 ms
    assert not off.planning and off.plan(q, 1.0) is None
    # Per-request SLOs in the view override the defaults.
    tight = QueueView.of([1, 1], [50, 50, 50, 50], 10_000, slo_tpot_s=0.0182)
    plan = ctl.plan(tight, 0.0)
    assert plan is not None and plan.target_latency_s == 0.0182 and plan.num_seqs == 3


def test_state_vector_eq_8() -> None:
    ctl = _warm_controller(LensConfig(default_slo_tpot_s=0.0305))
    l_bar = ctl.target.expected_decode_tokens  # the default before any finished request
    q = view([1, 1, 300], [50, 50, 50, 50], free_kv_blocks=100)
    figures = ctl.state_vector(q, 0.0)
    plan = ctl.plan(q, 0.0)
    assert plan is not None
    assert figures.predicted_batch_latency_s == plan.predicted_latency_s
    assert figures.pending_work_tokens == 300 + 200 + l_bar * (4 + 1) + 0.5 * l_bar * 2
    assert figures.effective_free_kv_blocks == 100 - 4 * math.ceil((50 + l_bar) / 16)
    # P_max: M_max tokens over the fastest batch size's predicted iteration (B = 1 here: tau_b > 0).
    assert figures.peak_throughput_tokens_per_s == pytest.approx(512 / (0.010 + 512 / 10_000 + 0.001))
    assert not figures.slo_risk
    # LENS off (static budget): L-hat is the default greedy batch under (Q_max, M_max).
    off = _warm_controller(LensConfig(enabled=False, default_slo_tpot_s=0.0305))
    b, s = allocate(q, LIMITS, LIMITS.max_num_seqs, LIMITS.max_batched_tokens)
    assert off.state_vector(q, 0.0).predicted_batch_latency_s == predict_scalar(LINEAR, b, s)
    # A cold model reports L-hat and P_max as unknown (0); KV is floored at 0.
    cold = LensController(LIMITS).state_vector(view([], [5000], free_kv_blocks=10), 0.0)
    assert cold.predicted_batch_latency_s == 0.0 and cold.peak_throughput_tokens_per_s == 0.0
    assert cold.effective_free_kv_blocks == 0 and cold.pending_work_tokens == 5000 + l_bar


def test_the_prefill_rate_is_planned_then_measured() -> None:
    ctl = _warm_controller(LensConfig(default_slo_tpot_s=0.03055, prefill_window=8, prefill_min_samples=4))
    decoding = view([1, 1], [])
    # No iteration measured yet: the plan with one more request waiting. B = 3 fits S* = floor((30.55 - 10 -
    # 3) / 0.1) = 175 tokens (2 decodes + 173 of the new prompt) in 30.5 ms.
    assert ctl.state_vector(decoding, 0.0).prefill_tokens_per_s == pytest.approx(173 / 0.0305)
    pending = view([1, 1], [400])
    for i in range(3):
        ctl.plan(pending, 0.1 * i)
        ctl.on_iteration(_Record(0.02, 1, 100, 2, 2), 0.1 * i)
    assert ctl.measured_prefill_rate is None  # 3 < prefill_min_samples
    ctl.plan(decoding, 0.3)  # nothing pending: the iteration does not count
    ctl.on_iteration(_Record(0.02, 0, 0, 2, 2), 0.3)
    ctl.plan(pending, 0.4)
    ctl.on_iteration(_Record(0.02, 1, 100, 2, 2), 0.4)
    assert ctl.measured_prefill_rate == pytest.approx(400 / 0.08)
    assert ctl.state_vector(decoding, 0.5).prefill_tokens_per_s == pytest.approx(5000.0)
    # A starved engine (decodes meet the target, prefill gets one token per iteration) reports what it did.
    for i in range(8):
        ctl.plan(pending, 1.0 + 0.1 * i)
        ctl.on_iteration(_Record(0.0133, 1, 1, 2, 2), 1.0 + 0.1 * i)  # T(3, 3), as the model predicts
    assert ctl.planning  # (a model off by > 25% would stop planning and report 0)
    assert ctl.state_vector(pending, 2.0).prefill_tokens_per_s == pytest.approx(1 / 0.0133)  # the window: 8
    # Not planning: 0 (the router falls back to P_max less the decodes).
    off = _warm_controller(LensConfig(enabled=False, default_slo_tpot_s=0.0305))
    assert off.state_vector(decoding, 0.0).prefill_tokens_per_s == 0.0


def test_peak_is_the_full_iteration_rate_whatever_the_fit_s_pmax() -> None:
    """Fits that predict the same iterations report the same P_max even when Eq. 2's Pmax parameter differs
    tenfold (small kS trades against Pmax: only their product is identified), issue 17."""
    base = dataclasses.replace(CURVED, ks_per_token=1e-7, pmax_tokens_per_s=40_000.0 / 1e-7)
    other = dataclasses.replace(CURVED, ks_per_token=1e-8, pmax_tokens_per_s=40_000.0 / 1e-8)
    sizes, tokens = np.array([1, 4, 8]), np.array([8, 200, 512])
    assert predict_array(base, sizes, tokens) == pytest.approx(predict_array(other, sizes, tokens), rel=1e-4)
    assert other.peak_throughput_tokens_per_s == pytest.approx(10 * base.peak_throughput_tokens_per_s)
    peak = peak_tokens_per_s(base, LIMITS)
    assert peak_tokens_per_s(other, LIMITS) == pytest.approx(peak, rel=1e-4)
    # It is the best of M_max / Predict(B, M_max) over B = 1, 2, 4, 8.
    assert peak == pytest.approx(max(512 / predict_scalar(base, b, 512) for b in (1, 2, 4, 8)))
