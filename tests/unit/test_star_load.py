"""STAR's shared token-load arithmetic: one request's trace, an engine's summary (= the sum of traces)."""

from __future__ import annotations

import random

import pytest

from switchyard.star_load import engine_summary, horizon_weights, request_trace, weighted_load


def test_a_request_contributes_its_growing_context_until_its_predicted_end() -> None:
    # N = 100 tokens now, 50 more predicted, rounds of 20 steps: still running at 20 and 40, done by 60.
    assert request_trace(100, 50, 20, 4) == [120.0, 140.0, 0.0, 0.0]
    assert request_trace(100, 40, 20, 3) == [120.0, 0.0, 0.0]  # 40 tokens left: finished exactly at 40
    assert request_trace(100, 0, 20, 2) == [0.0, 0.0]
    assert request_trace(7, 1e9, 10, 2) == [17.0, 27.0]


def test_the_summary_is_the_sum_of_the_requests_traces() -> None:
    rng = random.Random(3)
    for _ in range(200):
        k, horizon = rng.randint(1, 30), rng.randint(0, 40)
        reqs = [(rng.uniform(1, 5000), rng.choice([0.0, rng.uniform(0, 2000), float(rng.randint(0, 40) * k)]))
                for _ in range(rng.randint(0, 30))]
        naive = [sum(col) for col in zip(*(request_trace(n, r, k, horizon) for n, r in reqs), strict=True)]
        assert engine_summary(reqs, k, horizon) == pytest.approx(naive or [0.0] * horizon)


def test_weights_and_weighted_load() -> None:
    w = horizon_weights(3, 0.5)
    assert w == [0.5, 0.25, 0.125]
    assert weighted_load([8.0, 8.0, 8.0], w) == pytest.approx(7.0)
    with pytest.raises(ValueError):
        horizon_weights(3, 0.0)
