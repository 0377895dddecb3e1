"""benchmarks/prism_overload.py's sweep rule: a value replaces PRISM's default only when it gains more than
the noise margin over the default's mean attainment; the defaults it compares against are PrismParams'."""

from __future__ import annotations

from benchmarks import prism_overload as bench
from gateway.policies.prism import PrismParams


def _scored(*pairs: tuple[float, float]) -> list[dict[str, float]]:
    return [{"value": value, "mean_attainment": mean} for value, mean in pairs]


def test_a_gain_within_the_margin_keeps_the_default() -> None:
    scored = _scored((64, 0.319), (128, 0.3210), (512, 0.3212))
    assert bench.choose(scored, 128.0, 0.005) == 128.0


def test_a_gain_past_the_margin_replaces_the_default() -> None:
    scored = _scored((64, 0.319), (128, 0.3210), (512, 0.33))
    assert bench.choose(scored, 128.0, 0.005) == 512.0


def test_an_unscored_default_yields_to_the_best() -> None:
    assert bench.choose(_scored((1, 0.2), (2, 0.25)), 4.0, 0.005) == 2.0


def test_the_defaults_are_prism_params() -> None:
    params = PrismParams()
    assert bench._default("decode_work_tokens") == params.decode_work_tokens
    assert bench._default("weights.load") == params.weights.load
    assert all(bench._default(key) in values for key, values in bench.SWEEP)
