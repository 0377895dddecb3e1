"""Fitting CascadeInfer's QoE model (`switchyard.qoe`: `LifetimeLoad`, `fit`, `OnlineFit`,
`relative_errors`): known coefficients recovered from synthetic batches (seeded), the sign constraint where
unconstrained least squares goes negative, the lifetime average, the online fitter's bound and cache, and
exact relative errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

from switchyard.qoe import (
    NUM_FEATURES,
    Features,
    LifetimeLoad,
    OnlineFit,
    QoEModel,
    Sample,
    features,
    fit,
    relative_errors,
)

# Each term contributes milliseconds on the batches below, so all five are identifiable.
TRUE_D: Features = (5e-3, 1e-4, 1e-7, 3e-11, 5e-8)


def synthetic(d: Features, count: int, noise: float, seed: int) -> list[Sample]:
    """`count` batches: prompts in one of [100, 200), ..., [3200, 6400), n in 1..256, generated tokens in a
    batch-wide range drawn independently (so ΣL is not a function of ΣI and n); q = Σ D_k F_k (1 + noise)."""
    rng = np.random.default_rng(seed)
    out: list[Sample] = []
    for _ in range(count):
        low = 100 * 2 ** int(rng.integers(0, 6))
        n = 2 ** int(rng.integers(0, 9))
        generated = 16 * 2 ** int(rng.integers(0, 9))
        inputs = rng.integers(low, 2 * low, size=n)
        lengths = inputs + rng.integers(0, generated, size=n)
        f = features(inputs.tolist(), lengths.tolist())
        q = float(np.dot(d, f)) * (1.0 + noise * float(rng.standard_normal()))
        out.append((f, q))
    return out


def _relative_gap(fitted: Features, true: Features) -> list[float]:
    return [abs(a - b) / b for a, b in zip(fitted, true, strict=True)]


@pytest.mark.parametrize("relative", [True, False])
def test_noise_free_batches_give_the_coefficients_back(relative: bool) -> None:
    result = fit(synthetic(TRUE_D, 300, 0.0, seed=1), relative=relative)
    assert result.model.d == pytest.approx(TRUE_D, rel=1e-6)
    assert result.mean_relative_error < 1e-9
    assert result.num_samples == 300


@pytest.mark.parametrize(("relative", "tolerance"), [(True, 0.05), (False, 0.10)])
def test_noisy_batches_give_the_coefficients_back(relative: bool, tolerance: float) -> None:
    result = fit(synthetic(TRUE_D, 2000, 0.05, seed=0), relative=relative)
    assert max(_relative_gap(result.model.d, TRUE_D)) < tolerance
    # |N(0, 0.05)| has mean 0.05 * sqrt(2 / pi) ~ 0.040: the fit leaves only the noise.
    assert result.mean_relative_error == pytest.approx(0.05 * math.sqrt(2 / math.pi), abs=0.003)


def _sum_squares(d: np.ndarray, x: np.ndarray, q: np.ndarray) -> float:
    return float(np.sum((x @ d - q) ** 2))


def test_nnls_never_goes_negative_where_least_squares_would() -> None:
    # Latency that falls with ΣI: unconstrained least squares fits a negative D_2, rewarding longer prompts.
    rng = np.random.default_rng(3)
    samples: list[Sample] = []
    for _ in range(200):
        n = int(rng.integers(1, 64))
        inputs = rng.integers(100, 400, size=n)
        f = features(inputs.tolist(), (inputs + rng.integers(0, 500, size=n)).tolist())
        samples.append((f, 0.02 + 1e-4 * f[1] - 5e-7 * f[2] + 1e-7 * f[4]))
    x = np.array([f for f, _ in samples])
    q = np.array([v for _, v in samples])
    assert np.all(q > 0)
    ols = np.linalg.lstsq(x, q, rcond=None)[0]
    assert ols[2] < 0  # the premise: the unconstrained fit does go negative here

    for relative in (True, False):
        assert all(v >= 0 for v in fit(samples, relative=relative).model.d)
    # And it is the constrained optimum, not clipped least squares: the KKT conditions hold (in scaled
    # columns: zero gradient where D_k > 0, a non-negative one where D_k = 0), and it fits far better.
    d = np.array(fit(samples, relative=False).model.d)
    scale = x.max(axis=0)
    gradient = (x / scale).T @ (x @ d - q)
    tolerance = 1e-9 * float(np.linalg.norm(q))
    assert np.all(np.abs(gradient[d > 0]) < tolerance)
    assert np.all(gradient[d == 0] > -tolerance)
    assert _sum_squares(d, x, q) < 0.01 * _sum_squares(np.maximum(ols, 0.0), x, q)


def test_the_relative_objective_is_not_dragged_by_the_slowest_requests() -> None:
    samples = synthetic(TRUE_D, 500, 0.0, seed=4)
    # Every tenth request 30x slower than its batch explains (a two-token answer behind a long prompt).
    skewed = [(f, q * 30.0 if j % 10 == 0 else q) for j, (f, q) in enumerate(samples)]
    relative, absolute = fit(skewed), fit(skewed, relative=False)
    assert relative.mean_relative_error < absolute.mean_relative_error
    typical = [s for j, s in enumerate(skewed) if j % 10 != 0]
    assert float(np.median(relative_errors(relative.model, typical))) < 0.05
    assert float(np.median(relative_errors(absolute.model, typical))) > 0.5


@pytest.mark.parametrize(
    ("samples", "message"),
    [
        ([((1.0, 1.0, 100.0, 1e4, 150.0), 0.01)] * (NUM_FEATURES - 1), "cannot fit"),
        ([((1.0, 1.0, 100.0, 1e4, 150.0), 0.01)] * 5 + [((1.0, 1.0, 100.0, 1e4, 150.0), 0.0)], "sample 5"),
        ([((1.0, 1.0, 100.0, 1e4, 150.0), -0.01)] * 6, "positive"),
        ([((1.0, 1.0, 100.0, 1e4, 150.0), math.nan)] * 6, "positive"),
        ([((1.0, 1.0, -100.0, 1e4, 150.0), 0.01)] * 6, "non-negative"),
        ([((1.0, 1.0, 100.0, math.inf, 150.0), 0.01)] * 6, "finite"),
    ],
)
def test_fit_rejects_what_it_cannot_fit(samples: list[Sample], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fit(samples)


def test_lifetime_load_averages_the_iterations_it_saw() -> None:
    load = LifetimeLoad()
    with pytest.raises(ValueError, match="no iterations"):
        load.mean()
    load.add(features([100, 300], [150, 310]))  # (1, 2, 400, 100000, 460)
    load.add(features([100], [151]))  # (1, 1, 100, 10000, 151)
    load.add(features([100, 300, 200], [152, 311, 200]))  # (1, 3, 600, 140000, 663)
    assert load.iterations == 3
    assert load.mean() == pytest.approx((1.0, 2.0, 1100 / 3, 250000 / 3, 1274 / 3))


def test_online_fit_keeps_only_the_last_capacity_samples() -> None:
    old_d: Features = (2e-2, 0.0, 0.0, 0.0, 0.0)
    online = OnlineFit(capacity=40, min_samples=10)
    assert online.capacity == 40
    for f, q in synthetic(old_d, 100, 0.0, seed=5):
        online.observe(f, q)
    for f, q in synthetic(TRUE_D, 40, 0.0, seed=6):
        online.observe(f, q)
    assert len(online) == 40
    latest = online.refit()
    assert latest is not None and latest.num_samples == 40
    # Only the 40 newest survive: the old regime left no trace in the coefficients.
    assert latest.model.d == pytest.approx(TRUE_D, rel=1e-6)


def test_online_fit_waits_for_its_minimum_and_refits_only_when_observed() -> None:
    online = OnlineFit(capacity=100, min_samples=8)
    samples = synthetic(TRUE_D, 9, 0.0, seed=7)
    for f, q in samples[:7]:
        online.observe(f, q)
    assert online.refit() is None
    online.observe(*samples[7])
    first = online.refit()
    assert first is not None and first.num_samples == 8
    assert online.refit() is first  # nothing new: the same fit, no solve
    online.observe(*samples[8])
    second = online.refit()
    assert second is not first and second is not None and second.num_samples == 9


def test_online_fit_rejects_bad_settings_and_samples() -> None:
    with pytest.raises(ValueError, match="min_samples"):
        OnlineFit(min_samples=NUM_FEATURES - 1)
    with pytest.raises(ValueError, match="capacity"):
        OnlineFit(capacity=10, min_samples=20)
    online = OnlineFit()
    with pytest.raises(ValueError, match="positive"):
        online.observe((1.0, 1.0, 100.0, 1e4, 150.0), 0.0)
    with pytest.raises(ValueError, match="features"):
        online.observe((1.0, 1.0, -1.0, 1e4, 150.0), 0.01)
    assert len(online) == 0


def test_relative_errors_are_exact() -> None:
    model = QoEModel((0.01, 0.001, 0.0, 0.0, 0.0))
    f_one: Features = (1.0, 1.0, 100.0, 1e4, 150.0)  # predicts 0.011
    f_ten: Features = (1.0, 10.0, 1000.0, 1e5, 1500.0)  # predicts 0.020
    samples: list[Sample] = [(f_one, 0.011), (f_one, 0.022), (f_ten, 0.010), (f_ten, 0.025)]
    assert relative_errors(model, samples).tolist() == pytest.approx([0.0, 0.5, 1.0, 0.2])
    result = fit(synthetic(TRUE_D, 50, 0.1, seed=8))
    assert result.mean_relative_error == pytest.approx(
        float(np.mean(relative_errors(result.model, synthetic(TRUE_D, 50, 0.1, seed=8)))))
