"""CAUCHY's cost-efficiency model (§3.2) against hand-computed values and Table 1."""

from __future__ import annotations

import math

import pytest

from gateway.planning.cost_model import (
    CostModelError,
    Side,
    Workload,
    a1,
    a2,
    batch_size,
    coefficients,
    decode_tokens_per_s,
    gpu_efficiency,
    prefill_tokens_per_s,
    price_combo,
    with_prices,
)
from switchyard.hardware import GPUS, MODELS

# Llama-3.1-8B has Llama-3-8B's shape (l 32, h 4096, n 32, k 8, s 128, i 14336, v 128256, bf16); only the
# context differs, which the model does not use.
LLAMA = MODELS["llama3-8b"]
SHAREGPT = Workload(input_tokens=337, output_tokens=1330)


def test_coefficients_by_hand() -> None:
    c = coefficients(LLAMA)
    assert c.c1 == 4 * 32 * 4096 == 524_288
    assert c.c2 == 8 * 32 * 4096**2 + 6 * 32 * 4096 * 14336 == 15_569_256_448
    per_layer = 4 * 4096**2 + 3 * 4096 * 14336 + 2 * 4096
    assert c.c3 == 2 * (2 * 128256 * 4096 + per_layer * 32) == 17_671_127_040
    assert c.c4 == 2 * 2 * 32 * 8 * 128 == 131_072 == LLAMA.kv_bytes_per_token


def test_phase_throughputs_by_hand() -> None:
    c = coefficients(LLAMA)
    h800, h20 = Side(GPUS["h800"]), Side(GPUS["h20"])
    # Eq. 5: 989e12 / (524288 * 337 + 15569256448)
    assert prefill_tokens_per_s(c, h800, SHAREGPT) == pytest.approx(62_809.8358, rel=1e-9)
    # B: (96 GB * 0.9 - 16.06 GB of weights) / 131072 B = 536,647 tokens: 321 requests of 1,667; cap 256
    assert batch_size(LLAMA, h20, SHAREGPT) == 256
    assert batch_size(LLAMA, h20, SHAREGPT, max_num_seqs=1024) == 321
    # Eq. 11: 4000e9 / (131072 * 1330 / 2 + 131072 * 337 + 17671127040 / 256)
    assert decode_tokens_per_s(c, h20, SHAREGPT, 256) == pytest.approx(19_963.8670, rel=1e-9)
    # Two H800s prefill twice as fast (GPU_n in Eq. 5).
    two = Side(GPUS["h800"], 2)
    assert prefill_tokens_per_s(c, two, SHAREGPT) == pytest.approx(2 * 62_809.8358, rel=1e-9)


def test_eq_15_equals_eq_14() -> None:
    c = coefficients(LLAMA)
    combo = price_combo(LLAMA, SHAREGPT, decode=Side(GPUS["h20"]), prefill=Side(GPUS["h800"]))
    eq15 = (a1(c, SHAREGPT) * 989e12 / 2.69 + a2(c, SHAREGPT, 256) * 4000e9 / 1.50) * 3600
    assert combo.ce_tokens_per_usd == pytest.approx(eq15, rel=1e-12)
    assert combo.ce_tokens_per_usd == pytest.approx(131_971_053.58, rel=1e-9)
    assert combo.usd_per_hour == pytest.approx(2.69 + 1.50)


def test_relative_advantage_compute_for_prefill_bandwidth_for_decode() -> None:
    """§3.2.2: on a long-output workload H800 -> H20 beats the reversed direction and either GPU alone."""
    long_output = Workload(input_tokens=337, output_tokens=1330)
    forward = price_combo(LLAMA, long_output, decode=Side(GPUS["h20"]), prefill=Side(GPUS["h800"]))
    reverse = price_combo(LLAMA, long_output, decode=Side(GPUS["h800"]), prefill=Side(GPUS["h20"]))
    assert forward.ce_tokens_per_usd > reverse.ce_tokens_per_usd
    assert forward.balanced_tokens_per_usd > reverse.balanced_tokens_per_usd


def test_balanced_rate_is_bounded_by_each_phase() -> None:
    for r_in, r_out in ((702, 42), (337, 1330), (100, 6000)):
        w = Workload(r_in, r_out)
        disagg = price_combo(LLAMA, w, decode=Side(GPUS["h20"]), prefill=Side(GPUS["a800"]))
        assert disagg.balanced_requests_per_s == pytest.approx(
            min(disagg.prefill_tokens_per_s / r_in, disagg.decode_tokens_per_s / r_out))
        agg = price_combo(LLAMA, w, decode=Side(GPUS["a800"], 2))
        assert agg.aggregated and agg.usd_per_hour == pytest.approx(2 * 1.19)
        per_request_s = r_in / agg.prefill_tokens_per_s + r_out / agg.decode_tokens_per_s
        assert agg.balanced_requests_per_s == pytest.approx(1 / per_request_s)
        slower = min(agg.prefill_tokens_per_s / r_in, agg.decode_tokens_per_s / r_out)
        assert agg.balanced_requests_per_s < slower


@pytest.mark.parametrize(
    ("gpu", "ratio", "tflop_per_usd", "gb_per_usd", "role"),
    [  # Table 1's derived columns, as printed (RTX4090's ratio: 165/1008 = 0.16, printed 0.21)
        ("h800", 0.30, 1.32e6, 4.48e6, "prefill"),
        ("a10", 0.21, 600e3, 2.88e6, "prefill"),
        ("rtx4090", 0.16, 861e3, 5.26e6, "aggregated"),
        ("a800", 0.16, 944e3, 5.85e6, "aggregated"),
        ("mi210", 0.11, 465e3, 4.21e6, "decode"),
        ("h20", 0.04, 355e3, 9.60e6, "decode"),
    ],
)
def test_table_1_derived_columns(gpu: str, ratio: float, tflop_per_usd: float, gb_per_usd: float,
                                 role: str) -> None:
    e = gpu_efficiency(GPUS[gpu])
    assert round(e.tflops_per_bandwidth, 2) == ratio
    assert e.tflop_per_usd == pytest.approx(tflop_per_usd, rel=5e-3)
    assert e.gb_per_usd == pytest.approx(gb_per_usd, rel=5e-3)
    assert e.recommended == role


def test_prices_can_be_replaced_and_bad_ones_are_refused() -> None:
    priced = with_prices(GPUS, {"h20": 1.0})
    assert priced["h20"].hourly_price_usd == 1.0 and priced["h800"].hourly_price_usd == 2.69
    assert gpu_efficiency(priced["h20"]).gb_per_usd == pytest.approx(4000 * 3600)
    with pytest.raises(CostModelError, match="unknown GPU b200; known: a10, a100"):
        with_prices(GPUS, {"b200": 5.0})
    with pytest.raises(CostModelError, match="prices must be > 0: h20=0"):
        with_prices(GPUS, {"h20": 0.0})
    with pytest.raises(CostModelError, match="must be > 0"):
        with_prices(GPUS, {"h20": math.nan})


def test_a_model_that_does_not_fit_is_an_error() -> None:
    with pytest.raises(CostModelError, match="does not fit on 1xa10"):
        price_combo(MODELS["llama3-70b"], SHAREGPT, decode=Side(GPUS["a10"]))
    with pytest.raises(CostModelError, match="must be > 0"):
        Workload(0, 10)

