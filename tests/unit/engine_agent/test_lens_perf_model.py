"""LENS's performance model (Eq. 1-2): the formula, the two fits, the cold start and the refit seam."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine_agent.lens.perf_model import (
    SATURATED_K,
    LatencyModel,
    LatencyModelConfig,
    LatencyParams,
    Samples,
    fit_structural,
    predict_array,
    predict_scalar,
    prior_params,
    r2_score,
)

TRUE = LatencyParams(tau0_s=0.004, w0_tokens=50.0, ws=1.0, pmax_tokens_per_s=40_000.0, kb_per_seq=0.05,
                     ks_per_token=0.003, tau_b_s=5e-5, tau_s_s=2e-6)
NOISE = 0.02


def synthetic(params: LatencyParams, n: int, seed: int, start_s: float = 0.0,
              step_s: float = 0.03) -> Samples:
    """Eq. 1-2 with 2% multiplicative Gaussian noise over B in [1, 256], S in [B, 4096]."""
    rng = np.random.default_rng(seed)
    b = rng.integers(1, 257, n).astype(np.float64)
    s = np.maximum(b, rng.integers(1, 4097, n)).astype(np.float64)
    t = predict_array(params, b, s) * (1.0 + NOISE * rng.standard_normal(n))
    return Samples(b, s, t, start_s + step_s * np.arange(1, n + 1))


def feed(model: LatencyModel, data: Samples, refit_every: int = 0) -> None:
    for i in range(len(data)):
        model.observe(int(data.batch_size[i]), int(data.tokens[i]), float(data.latency_s[i]),
                      float(data.time_s[i]))
        if refit_every and model.num_observations % refit_every == 0:
            model.refit(float(data.time_s[i]))


def test_predict_is_eq_1_and_2() -> None:
    b, s = 8, 512
    thr = (TRUE.pmax_tokens_per_s * (1 - math.exp(-TRUE.kb_per_seq * b))
           * (1 - math.exp(-TRUE.ks_per_token * s)))
    expected = TRUE.tau0_s + (TRUE.w0_tokens + TRUE.ws * s) / thr + TRUE.tau_b_s * b + TRUE.tau_s_s * s
    assert predict_scalar(TRUE, b, s) == pytest.approx(expected, rel=1e-12)
    model = LatencyModel(params=TRUE)
    assert model.predict(b, s) == pytest.approx(expected, rel=1e-12)
    arr = model.predict(np.array([b, 1, 0]), np.array([s, 1, 5]))
    assert arr[0] == pytest.approx(expected, rel=1e-12)
    assert arr[1] == pytest.approx(predict_scalar(TRUE, 1, 1), rel=1e-12)
    assert arr[2] == 0.0  # empty batch
    assert model.predict(0, 100) == 0.0
    assert model.peak_throughput == TRUE.pmax_tokens_per_s


def test_peak_throughput_is_pmax_over_ws() -> None:
    params = LatencyParams(0.0, 0.0, 2.0, 1000.0, 1.0, 1.0, 0.0, 0.0)
    assert LatencyModel(params=params).peak_throughput == 500.0


def test_structural_fit_recovers_known_parameters() -> None:
    cfg = LatencyModelConfig()
    fitted = fit_structural(synthetic(TRUE, 2000, seed=1), prior_params(cfg), cfg)
    assert fitted.pmax_tokens_per_s == pytest.approx(TRUE.pmax_tokens_per_s, rel=0.10)
    assert fitted.kb_per_seq == pytest.approx(TRUE.kb_per_seq, rel=0.10)
    assert fitted.ks_per_token == pytest.approx(TRUE.ks_per_token, rel=0.10)
    held_out = synthetic(TRUE, 1000, seed=2)
    assert r2_score(held_out.latency_s, predict_array(fitted, held_out.batch_size, held_out.tokens)) > 0.98


def test_cold_model_is_the_prior_then_converges_online() -> None:
    cfg = LatencyModelConfig()
    model = LatencyModel(cfg)
    assert not model.ready
    assert model.params == prior_params(cfg)
    held_out = synthetic(TRUE, 1000, seed=2)
    stream = synthetic(TRUE, 512, seed=3)
    feed(model, stream.tail(512).where(np.arange(512) < cfg.min_samples_ready - 1), refit_every=16)
    assert not model.ready  # 31 samples: fitted, but below min_samples_ready
    model = LatencyModel(cfg)
    feed(model, stream, refit_every=16)
    assert model.ready and model.structural
    assert model.r2(held_out) > 0.98
    assert model.recent_error_ratio < 2.5 * NOISE


def test_saturated_cold_start_is_linear_in_tokens() -> None:
    cfg = LatencyModelConfig()
    model = LatencyModel(cfg)
    linear = LatencyParams(0.01, 0.0, 1.0, 20_000.0, SATURATED_K, SATURATED_K, 1e-4, 0.0)
    feed(model, synthetic(linear, 40, seed=4), refit_every=0)
    outcome = model.refit(10.0)
    assert outcome.kind == "saturated" and not model.structural and model.ready
    p = model.params
    assert p.kb_per_seq == p.ks_per_token == SATURATED_K and p.w0_tokens == 0.0
    assert p.tau0_s == pytest.approx(0.01, rel=0.2)
    assert p.pmax_tokens_per_s == pytest.approx(20_000.0, rel=0.1)


def test_short_window_refit_tracks_a_drift_in_the_linear_parameters() -> None:
    cfg = LatencyModelConfig(structural_interval_s=1e9)
    model = LatencyModel(cfg)
    feed(model, synthetic(TRUE, 1024, seed=5), refit_every=16)
    assert model.structural
    drifted = LatencyParams(TRUE.tau0_s + 0.006, TRUE.w0_tokens, 1.2, TRUE.pmax_tokens_per_s, TRUE.kb_per_seq,
                            TRUE.ks_per_token, TRUE.tau_b_s * 1.5, TRUE.tau_s_s)
    later = synthetic(drifted, 48, seed=6, start_s=100.0)
    test = synthetic(drifted, 500, seed=7)
    before = model.r2(test)
    feed(model, later)
    outcome = model.refit(later.time_s[-1])
    assert outcome.kind == "linear"  # structural not due: only the short window moved
    assert model.r2(test) > 0.98 > before
    assert model.params.pmax_tokens_per_s == outcome.anchor.pmax_tokens_per_s


def test_recent_error_ratio_is_a_priori() -> None:
    exact = LatencyModel(params=TRUE)
    feed(exact, synthetic(TRUE, 200, seed=8))
    assert exact.recent_error_ratio == pytest.approx(NOISE * math.sqrt(2 / math.pi), rel=0.3)
    cold = LatencyModel()
    feed(cold, synthetic(TRUE, 200, seed=8))
    assert cold.recent_error_ratio > 0.5


def test_refit_job_is_pure_until_installed() -> None:
    model = LatencyModel()
    feed(model, synthetic(TRUE, 100, seed=9))
    before = model.params
    job = model.refit_job(3.0)
    feed(model, synthetic(TRUE, 10, seed=10, start_s=3.0))  # the serving path keeps observing
    outcome = job()
    assert model.params is before and not model.ready
    assert outcome.kind == "structural" and outcome.num_samples == 100
    model.install(outcome)
    assert model.params is outcome.params and model.ready and model.structural


def test_structural_cadence_doubles_then_follows_the_interval() -> None:
    cfg = LatencyModelConfig(min_samples_structural=64, long_window_samples=256, structural_interval_s=10.0)
    model = LatencyModel(cfg)
    data = synthetic(TRUE, 1000, seed=11, step_s=0.01)
    feed(model, data.tail(1000).where(np.arange(1000) < 63))
    assert not model.structural_due(1.0)
    feed(model, synthetic(TRUE, 1, seed=12, start_s=0.63))
    assert model.structural_due(1.0)
    assert model.refit(1.0).kind == "structural"
    assert not model.structural_due(1.0)
    feed(model, synthetic(TRUE, 64, seed=13, start_s=1.0))  # 128 = 2 x 64: the cold start doubles
    assert model.structural_due(1.7)
    assert model.refit(1.7).kind == "structural"
    feed(model, synthetic(TRUE, 200, seed=14, start_s=1.7))  # 328 >= cap 256: doubling stops
    assert model.refit(4.0).kind == "structural"
    feed(model, synthetic(TRUE, 400, seed=15, start_s=4.0))
    assert not model.structural_due(13.9)
    assert model.structural_due(14.0)


def test_observe_ignores_empty_iterations_and_windows_are_bounded() -> None:
    cfg = LatencyModelConfig(long_window_samples=100, short_window_samples=10, min_samples_structural=20)
    model = LatencyModel(cfg)
    model.observe(0, 0, 0.01, 0.0)
    model.observe(4, 10, 0.0, 0.0)
    assert model.num_observations == 0
    feed(model, synthetic(TRUE, 250, seed=16))
    kept = model.samples()
    assert len(kept) == 100 and model.num_observations == 250
    assert np.all(np.diff(kept.time_s) > 0)


def test_coverage_reservoir_keeps_shapes_the_time_window_has_forgotten() -> None:
    cfg = LatencyModelConfig(long_window_s=10.0, long_window_samples=2000)
    model = LatencyModel(cfg)
    rng = np.random.default_rng(17)
    small_b = rng.integers(1, 8, 300).astype(np.float64)
    small_s = small_b.copy()  # decode-only batches: one token per sequence
    small = Samples(small_b, small_s, predict_array(TRUE, small_b, small_s), np.linspace(0.0, 3.0, 300))
    big_b = rng.integers(128, 257, 1500).astype(np.float64)
    big_s = rng.integers(2048, 4097, 1500).astype(np.float64)
    big = Samples(big_b, big_s, predict_array(TRUE, big_b, big_s), np.linspace(100.0, 160.0, 1500))
    feed(model, small)
    feed(model, big)
    kept = model.coverage(model.num_observations - 1500, 160.0 - cfg.coverage_max_age_s)
    assert len(kept) > 0 and float(kept.batch_size.max()) < 8  # older than the time window, still there
    model.refit(160.0)
    assert model.structural
    errors = np.abs(model.predict(small.batch_size, small.tokens) / small.latency_s - 1.0)
    assert float(errors.max()) < 0.05
