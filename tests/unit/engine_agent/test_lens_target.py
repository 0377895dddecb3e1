"""The adaptive target (Eq. 3-7): the TTFT-TPOT line, the feasible interval, the L-bar vs beta rule, SLO risk
and the relaxation toward the TPOT bound as the waiting queue grows."""

from __future__ import annotations

import pytest

from engine_agent.lens.target import AdaptiveTarget, TargetConfig, TargetDecision, decide

CFG = TargetConfig(min_tpot_s=0.005, relax_half_queue=8.0, ttft_aim=1.0)  # the paper's Eq. 5: aim at the SLO
# TTFT = 1.0 s - 20 tokens x TPOT: alpha = 1 s, beta = 20.
LINE = (1.0, 20.0)


def learnt(points: list[tuple[float, float]], output_tokens: int = 100,
           config: TargetConfig = CFG) -> AdaptiveTarget:
    target = AdaptiveTarget(config)
    for tpot, ttft in points:
        target.observe_request(ttft, tpot, output_tokens)
    return target


def on_line(n: int, alpha: float = 1.0, beta: float = 20.0) -> list[tuple[float, float]]:
    tpots = [0.01 + 0.04 * i / (n - 1) for i in range(n)]
    return [(t, alpha - beta * t) for t in tpots]


def test_line_is_fitted_from_finished_requests() -> None:
    target = learnt(on_line(32))
    line = target.line()
    assert line is not None
    assert line[0] == pytest.approx(1.0) and line[1] == pytest.approx(20.0)
    assert target.expected_decode_tokens == 100


def test_line_is_unknown_until_enough_varied_points_with_a_trade_off() -> None:
    assert learnt(on_line(15)).line() is None  # below min_requests
    assert learnt([(0.02, 0.5)] * 32).line() is None  # TPOT never varied
    assert learnt([(t, 0.1 + 5 * t) for t, _ in on_line(32)]).line() is None  # slope >= 0: no trade-off
    # Requests with a single output token have no TPOT: they count for L-bar only.
    one_token = learnt(on_line(32), output_tokens=1)
    assert one_token.line() is None and one_token.expected_decode_tokens == 1


def test_the_window_forgets_old_requests() -> None:
    config = TargetConfig(window_requests=64)
    target = learnt(on_line(64, alpha=3.0, beta=50.0), config=config)
    for tpot, ttft in on_line(64, alpha=1.0, beta=20.0):
        target.observe_request(ttft, tpot, 300)
    line = target.line()
    assert line is not None
    assert line[0] == pytest.approx(1.0) and line[1] == pytest.approx(20.0)
    assert target.expected_decode_tokens == 300


def test_feasible_interval_and_long_outputs_take_the_ttft_bound() -> None:
    # Eq. 5: t_d^TTFT = (1.0 - 0.6) / 20 = 20 ms; Eq. 6: t_d^TPOT = 50 ms. L-bar = 100 > beta = 20.
    d = decide(LINE, slo_ttft_s=0.6, slo_tpot_s=0.05, waiting_queue_len=0, decode_tokens=100, config=CFG)
    assert d == TargetDecision(pytest.approx(0.02), pytest.approx(0.02), 0.05, False, "ttft_bound", 1.0, 20.0,
                               100)


@pytest.mark.parametrize("aim", [1.0, 0.5, 0.25])
def test_the_ttft_boundary_is_aimed_at_a_share_of_the_slo(aim: float) -> None:
    """The boundary is the TPOT at which the line predicts TTFT = aim x SLO (a mean fit aimed at the SLO
    itself plans half the TTFTs past it); the default aims at a quarter."""
    config = TargetConfig(min_tpot_s=0.005, relax_half_queue=8.0, ttft_aim=aim)
    d = decide(LINE, slo_ttft_s=0.6, slo_tpot_s=0.05, waiting_queue_len=0, decode_tokens=100, config=config)
    assert d.rule == "ttft_bound"
    assert d.target_latency_s == pytest.approx(min((1.0 - aim * 0.6) / 20.0, 0.05))
    assert LINE[0] - LINE[1] * d.target_latency_s == pytest.approx(max(aim * 0.6, 1.0 - 20.0 * 0.05))
    assert TargetConfig().ttft_aim == 0.25


def test_short_outputs_take_the_tpot_bound() -> None:
    d = decide(LINE, slo_ttft_s=0.6, slo_tpot_s=0.05, waiting_queue_len=0, decode_tokens=20, config=CFG)
    assert (d.target_latency_s, d.rule, d.slo_risk) == (0.05, "tpot_bound", False)


def test_minimum_safety_value_bounds_the_ttft_side() -> None:
    # A loose TTFT SLO: t_d^TTFT = (1.0 - 0.99) / 20 = 0.5 ms < t_d,min = 5 ms.
    d = decide(LINE, slo_ttft_s=0.99, slo_tpot_s=0.05, waiting_queue_len=0, decode_tokens=100, config=CFG)
    assert d.feasible_low_s == d.target_latency_s == 0.005 and not d.slo_risk


def test_empty_interval_reports_slo_risk_and_falls_back_to_the_tpot_bound() -> None:
    # t_d^TTFT = (1.0 - 0.0) / 20 = 50 ms > t_d^TPOT = 30 ms.
    d = decide(LINE, slo_ttft_s=0.0, slo_tpot_s=0.03, waiting_queue_len=0, decode_tokens=100, config=CFG)
    assert d.slo_risk and d.feasible_low_s == pytest.approx(0.05) and d.feasible_high_s == 0.03
    assert d.target_latency_s == 0.03
    # The TPOT SLO below the safety minimum is an empty interval too.
    tiny = decide(LINE, slo_ttft_s=0.99, slo_tpot_s=0.002, waiting_queue_len=0, decode_tokens=100, config=CFG)
    assert tiny.slo_risk and tiny.target_latency_s == 0.002


@pytest.mark.parametrize(("waiting", "expected_s"), [
    (0, 0.020),
    (1, 0.020 + 0.030 * 1 / 9),
    (8, 0.035),  # half way at relax_half_queue
    (24, 0.020 + 0.030 * 24 / 32),
    (10_000, 0.020 + 0.030 * 10_000 / 10_008),
])
def test_target_relaxes_toward_the_tpot_bound_as_the_queue_grows(waiting: int, expected_s: float) -> None:
    d = decide(LINE, slo_ttft_s=0.6, slo_tpot_s=0.05, waiting_queue_len=waiting, decode_tokens=100,
               config=CFG)
    assert d.target_latency_s == pytest.approx(expected_s)
    assert d.feasible_low_s <= d.target_latency_s <= d.feasible_high_s


def test_unknown_line_targets_the_tpot_bound() -> None:
    d = AdaptiveTarget(CFG).target(slo_ttft_s=0.6, slo_tpot_s=0.05, waiting_queue_len=3)
    assert (d.target_latency_s, d.feasible_low_s, d.feasible_high_s, d.slo_risk, d.rule) == (
        0.05, 0.005, 0.05, False, "no_line")
    assert d.decode_tokens == CFG.default_decode_tokens


def test_target_uses_the_learnt_line_and_decode_length() -> None:
    target = learnt(on_line(32), output_tokens=100)
    d = target.target(slo_ttft_s=0.6, slo_tpot_s=0.05, waiting_queue_len=0)
    assert d.rule == "ttft_bound" and d.target_latency_s == pytest.approx(0.02)
    short = target.target(slo_ttft_s=0.6, slo_tpot_s=0.05, waiting_queue_len=0, decode_tokens=10)
    assert short.rule == "tpot_bound" and short.target_latency_s == 0.05
