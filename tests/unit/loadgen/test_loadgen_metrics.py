"""Metric definitions against hand-computed cases, matching vLLM ``bench serve``."""

from __future__ import annotations

import math

import numpy as np
import pytest

from loadgen.metrics import Outcome, Slo, parse_slo, percentile_label, summarize


def outcomes() -> list[Outcome]:
    return [
        Outcome("a", True, prompt_tokens=100, output_tokens=10, ttft_s=0.1, e2e_s=1.0, itl_s=(0.1,) * 9),
        Outcome("b", True, prompt_tokens=200, output_tokens=5, ttft_s=0.2, e2e_s=1.0, itl_s=(0.2,) * 4),
        Outcome("c", True, prompt_tokens=300, output_tokens=1, ttft_s=0.3, e2e_s=0.3),
        Outcome("d", False, prompt_tokens=400, error="engine failed"),
    ]


def approx(x: float) -> object:
    return pytest.approx(x, rel=1e-12, abs=1e-12)


def test_counts_and_throughputs_count_successes_only() -> None:
    s = summarize(outcomes(), duration_s=2.0).to_dict()
    assert (s["completed"], s["failed"], s["total_input_tokens"], s["total_output_tokens"]) == (3, 1, 600, 16)
    assert (s["request_throughput"], s["output_throughput"], s["total_token_throughput"]) == (1.5, 8.0, 308.0)
    assert s["duration"] == 2.0


def test_ttft_stats_use_population_std_and_linear_percentiles() -> None:
    s = summarize(outcomes(), duration_s=2.0).to_dict()
    assert s["mean_ttft_ms"] == approx(200.0) and s["median_ttft_ms"] == approx(200.0)
    assert s["std_ttft_ms"] == approx(math.sqrt(0.02 / 3) * 1000)
    assert s["p50_ttft_ms"] == approx(200.0)
    assert (s["p90_ttft_ms"], s["p99_ttft_ms"]) == (approx(280.0), approx(298.0))


def test_tpot_formula_excludes_single_token_outputs() -> None:
    s = summarize(outcomes(), duration_s=2.0).to_dict()
    # a: (1.0 - 0.1) / 9 = 0.1 s; b: (1.0 - 0.2) / 4 = 0.2 s; c has one output token and is excluded
    assert s["mean_tpot_ms"] == approx(150.0) and s["std_tpot_ms"] == approx(50.0)
    assert (s["p90_tpot_ms"], s["p99_tpot_ms"]) == (approx(190.0), approx(199.0))
    assert outcomes()[2].tpot_s is None and outcomes()[3].tpot_s is None


def test_itl_pools_every_gap_rather_than_averaging_per_request() -> None:
    s = summarize(outcomes(), duration_s=2.0).to_dict()
    assert s["mean_itl_ms"] == approx(1.7 / 13 * 1000)  # 9 gaps of 0.1 and 4 of 0.2; not (100 + 200) / 2
    assert (s["median_itl_ms"], s["p90_itl_ms"]) == (approx(100.0), approx(200.0))


def test_e2el_and_percentiles_match_numpy_linear() -> None:
    s = summarize(outcomes(), duration_s=2.0, percentiles=(25, 99.9)).to_dict()
    e2e = np.array([1.0, 1.0, 0.3])
    assert s["mean_e2el_ms"] == approx(float(np.mean(e2e)) * 1000)
    assert s["p25_e2el_ms"] == approx(float(np.percentile(e2e, 25, method="linear")) * 1000)
    assert s["p99.9_e2el_ms"] == approx(float(np.percentile(e2e, 99.9)) * 1000)
    assert "p99_e2el_ms" not in s
    assert (percentile_label(99), percentile_label(99.0), percentile_label(99.9)) == ("p99", "p99", "p99.9")


def test_goodput_and_attainment_count_failures_as_misses() -> None:
    slo = parse_slo("ttft=300,tpot=150,e2e=1000")
    s = summarize(outcomes(), duration_s=2.0, slo=slo).to_dict()
    # a meets all (e2e 1.0 s <= 1000 ms, inclusive); b misses TPOT (200 ms); c has TPOT 0 for this test and
    # TTFT exactly 300 ms; d failed.
    assert s["request_goodput"] == 1.0
    assert s["slo_attainment"] == 0.5
    assert s["slo"] == {"ttft_ms": 300.0, "tpot_ms": 150.0, "e2e_ms": 1000.0}
    tight = summarize(outcomes(), duration_s=2.0, slo=Slo(ttft_ms=150)).to_dict()
    assert (tight["request_goodput"], tight["slo_attainment"]) == (0.5, 0.25)


def test_no_slo_leaves_goodput_unset() -> None:
    s = summarize(outcomes(), duration_s=2.0).to_dict()
    assert s["request_goodput"] is None and s["slo_attainment"] is None and s["slo"] is None


def test_vllm_result_field_names_are_present() -> None:
    s = summarize(outcomes(), duration_s=2.0).to_dict()
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p90", "p99"):
            assert f"{stat}_{metric}_ms" in s
    assert {"completed", "total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput",
            "output_throughput", "total_token_throughput", "slo_attainment", "failed"} <= set(s)


def test_no_samples_give_zero_like_vllm() -> None:
    only_failures = summarize([Outcome("x", False)], duration_s=1.0, slo=Slo(e2e_ms=10)).to_dict()
    assert only_failures["completed"] == 0 and only_failures["failed"] == 1
    assert only_failures["mean_ttft_ms"] == 0.0 and only_failures["p99_itl_ms"] == 0.0
    assert only_failures["slo_attainment"] == 0.0
    empty = summarize([], duration_s=1.0, slo=Slo(e2e_ms=10)).to_dict()
    assert empty["completed"] == 0 and empty["slo_attainment"] == 0.0 and empty["request_goodput"] == 0.0


def test_summarize_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="duration_s"):
        summarize(outcomes(), duration_s=0.0)
    with pytest.raises(ValueError, match="percentiles"):
        summarize(outcomes(), duration_s=1.0, percentiles=(101,))
    with pytest.raises(ValueError, match="needs ttft_s and e2e_s"):
        Outcome("bad", True, ttft_s=0.1)


@pytest.mark.parametrize(("text", "expected"), [
    ("ttft=500,tpot=50,e2e=10000", Slo(ttft_ms=500, tpot_ms=50, e2e_ms=10000)),
    ("ttft:500 e2el:2000", Slo(ttft_ms=500, e2e_ms=2000)),
    (" TPOT = 12.5 ", Slo(tpot_ms=12.5)),
])
def test_parse_slo_accepts(text: str, expected: Slo) -> None:
    assert parse_slo(text) == expected


@pytest.mark.parametrize(("text", "message"), [
    ("", "empty SLO"),
    ("ttft", "expected KEY=MS"),
    ("latency=5", "expected KEY=MS with KEY one of ttft, tpot, e2e"),
    ("ttft=5,ttft=6", "more than once"),
    ("e2e=5,e2el=6", "more than once"),
    ("tpot=fast", "not a number"),
    ("ttft=-1", "positive"),
    ("ttft=inf", "positive"),
])
def test_parse_slo_errors_are_clear(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_slo(text)
