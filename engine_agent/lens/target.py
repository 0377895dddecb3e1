"""LENS's adaptive latency target (NexusSched §4.2.2, Eq. 3-7): the per-iteration latency Algorithm 1 aims at.

Owns: `TargetConfig`, `TargetDecision` and `AdaptiveTarget`, which learns the TTFT-TPOT line and the expected
decode length from finished requests and turns the SLOs and the queue into a target.
Must not: read clocks, plan batches or know a backend.

All times in seconds (the paper writes milliseconds). The target is a TPOT, i.e. one iteration's latency: a
decoding request gains one token per iteration.

- Eq. 3, the TTFT-TPOT line t_p(t_d) = alpha - beta * t_d: ordinary least squares of TTFT on TPOT over the
  last `window_requests` finished requests that produced at least two tokens (TPOT needs two), kept as sliding
  sums so an update and a read are O(1). The line is used only when it has `min_requests` points, TPOT varies
  (relative spread over `min_tpot_spread`) and beta > 0; otherwise it is unknown (see below).
- L-bar: the mean output length over the same window (all finished requests), `default_decode_tokens` before
  any; callers may pass their own estimate.
- Eq. 5-6: t_d^TTFT = (alpha - ttft_aim * tau_p^SLO) / beta and t_d^TPOT = tau_d^SLO. The feasible interval
  is [max(t_d,min, t_d^TTFT), t_d^TPOT] (`feasible_low_s`, `feasible_high_s`); `t_d,min` = `min_tpot_s`.
  Deviation (issue 17): the paper puts the TTFT boundary at the SLO itself (ttft_aim = 1). The line is a
  least-squares mean, so aiming at the SLO plans TTFTs that scatter around it and about half of them miss:
  on a mixed fleet (h100 + a100 + 2 x a6000 pair, simulated) at the Azure conversation trace's own rate
  PRISM + LENS attained 0.874 where round robin over the same engines attained 0.996. `ttft_aim` = 0.25
  (aim at a quarter of the TTFT SLO) was chosen on the training points of benchmarks/prism_overload.py
  (ShareGPT and Azure conv, both fleets, three loads each; Azure code and arXiv held out): mean attainment
  over PRISM and PRISM with shedding 0.686 at 0.25, 0.683 at 0.5 and 0.674 at 1 (that cell: 0.979, 0.925,
  0.874). With it `slo_risk` says the interval for the aimed TTFT is empty.
- Eq. 7: L-bar > beta -> min(t_d^TPOT, max(t_d,min, t_d^TTFT)) (the TTFT boundary); L-bar <= beta -> t_d^TPOT.
- Empty interval (low > high): `slo_risk` is set and Eq. 7 already yields the nearest feasible boundary,
  t_d^TPOT.
- Unknown line (cold start, no trade-off observed yet): target t_d^TPOT, the throughput end that still meets
  the TPOT SLO; interval [t_d,min, t_d^TPOT].
- Relaxation with load (the paragraph after Eq. 7): with q requests waiting, the target moves from Eq. 7's
  value T7 toward t_d^TPOT as T = T7 + (t_d^TPOT - T7) * q / (q + `relax_half_queue`): no change at q = 0,
  half way at q = relax_half_queue, t_d^TPOT as q grows. It never moves down, nor above t_d^TPOT.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

Rule = Literal["ttft_bound", "tpot_bound", "no_line"]


@dataclass(frozen=True, slots=True)
class TargetConfig:
    window_requests: int = 256
    min_requests: int = 16
    min_tpot_spread: float = 0.02  # std(TPOT) / mean(TPOT) needed to trust the slope
    min_tpot_s: float = 0.005  # t_d,min of Eq. 7
    ttft_aim: float = 0.25  # the TTFT boundary of Eq. 5 sits at this share of the TTFT SLO (module docstring)
    relax_half_queue: float = 8.0
    default_decode_tokens: float = 256.0


@dataclass(frozen=True, slots=True)
class TargetDecision:
    target_latency_s: float  # T_adaptive (Eq. 7, relaxed with the waiting queue)
    feasible_low_s: float  # max(t_d,min, t_d^TTFT)
    feasible_high_s: float  # t_d^TPOT
    slo_risk: bool  # the feasible interval is empty
    rule: Rule
    alpha_s: float = math.nan  # the TTFT-TPOT line (nan when unknown)
    beta_tokens: float = math.nan
    decode_tokens: float = 0.0  # L-bar used


class AdaptiveTarget:
    """Eq. 3-7 online: `observe_request` per finished request, `target` per iteration (both O(1))."""

    def __init__(self, config: TargetConfig | None = None) -> None:
        self._config = cfg = config or TargetConfig()
        n = max(cfg.window_requests, 1)
        self._ttft = np.zeros(n)
        self._tpot = np.zeros(n)
        self._line_count = 0
        self._sx = self._sy = self._sxx = self._sxy = 0.0
        self._out = np.zeros(n)
        self._out_count = 0
        self._out_sum = 0.0

    @property
    def config(self) -> TargetConfig:
        return self._config

    @property
    def expected_decode_tokens(self) -> float:
        """L-bar: mean output tokens of the recent finished requests."""
        n = min(self._out_count, self._out.shape[0])
        return self._out_sum / n if n else self._config.default_decode_tokens

    def observe_request(self, ttft_s: float, tpot_s: float, output_tokens: int) -> None:
        """A finished request: its TTFT, mean TPOT (ignored below two output tokens) and output length."""
        cap = self._out.shape[0]
        if output_tokens > 0:
            i = self._out_count % cap
            if self._out_count >= cap:
                self._out_sum -= self._out[i]
            self._out[i] = output_tokens
            self._out_sum += output_tokens
            self._out_count += 1
        if output_tokens < 2 or not (ttft_s >= 0.0 and tpot_s > 0.0):
            return
        i = self._line_count % cap
        if self._line_count >= cap:
            x, y = self._tpot[i], self._ttft[i]
            self._sx -= x
            self._sy -= y
            self._sxx -= x * x
            self._sxy -= x * y
        self._tpot[i], self._ttft[i] = tpot_s, ttft_s
        self._sx += tpot_s
        self._sy += ttft_s
        self._sxx += tpot_s * tpot_s
        self._sxy += tpot_s * ttft_s
        self._line_count += 1
        if self._line_count % cap == 0:  # re-sum once per window to shed floating-point drift
            self._sx, self._sy = float(self._tpot.sum()), float(self._ttft.sum())
            self._sxx = float(self._tpot @ self._tpot)
            self._sxy = float(self._tpot @ self._ttft)

    def line(self) -> tuple[float, float] | None:
        """(alpha_s, beta_tokens) of Eq. 3, or None while unknown (see the module docstring)."""
        cfg = self._config
        n = min(self._line_count, self._tpot.shape[0])
        if n < max(cfg.min_requests, 2):
            return None
        mean_x, mean_y = self._sx / n, self._sy / n
        var_x = self._sxx / n - mean_x * mean_x
        if var_x <= 0.0 or math.sqrt(var_x) < cfg.min_tpot_spread * mean_x:
            return None
        slope = (self._sxy / n - mean_x * mean_y) / var_x
        if slope >= 0.0:
            return None
        return mean_y - slope * mean_x, -slope

    def target(self, slo_ttft_s: float, slo_tpot_s: float, waiting_queue_len: int,
               decode_tokens: float | None = None) -> TargetDecision:
        """T_adaptive for the next iteration (Eq. 5-7 and the queue relaxation)."""
        cfg = self._config
        l_bar = self.expected_decode_tokens if decode_tokens is None else decode_tokens
        return decide(self.line(), slo_ttft_s, slo_tpot_s, waiting_queue_len, l_bar, cfg)


def decide(line: tuple[float, float] | None, slo_ttft_s: float, slo_tpot_s: float, waiting_queue_len: int,
           decode_tokens: float, config: TargetConfig) -> TargetDecision:
    """Eq. 5-7 for a given line (pure; `AdaptiveTarget.target` feeds it the learnt one)."""
    high = slo_tpot_s  # Eq. 6
    if line is None:
        low = config.min_tpot_s
        return TargetDecision(high, low, high, low > high, "no_line", decode_tokens=decode_tokens)
    alpha, beta = line
    td_ttft = (alpha - config.ttft_aim * slo_ttft_s) / beta  # Eq. 5, aimed inside the SLO
    low = max(config.min_tpot_s, td_ttft)
    if decode_tokens > beta:  # Eq. 7, long outputs: the TTFT boundary
        base = min(high, low)
        rule: Rule = "ttft_bound"
    else:  # short outputs: the TPOT boundary
        base = high
        rule = "tpot_bound"
    q = max(waiting_queue_len, 0)
    if q and base < high:
        base += (high - base) * q / (q + config.relax_half_queue)
    return TargetDecision(base, low, high, low > high, rule, alpha, beta, decode_tokens)
