"""STAR's reasoning-model output lengths: Table 2's figures and a seeded sampler that reproduces them.

Owns: the workload statistics of STAR (§6, Table 2: ShareGPT and Alpaca answered by DeepSeek-R1-Distill-
Qwen-7B) as named constants, `LengthDistribution` (a piecewise log-linear quantile function with closed-form
moments), the two fitted output-length distributions by name, and `with_output_lengths`, which replaces every
request's forced output length by a seeded draw.
Must not: read files, know engines, tokenizers or arrival times, or touch prompt lengths.

Table 2 as printed (tokens; P50/P90/P95 are percentiles "starting from the shortest request"):

    ShareGPT  Input   mean 305   std 1053   P50 36     P90 920    P95 1609
              Output  mean 7542  std 12008  P50 1536   P90 32670  P95 32679
    Alpaca    Input   mean 11    std 4      P50 10     P90 15     P95 18
              Output  mean 8596  std 13354  P50 987    P90 32690  P95 32691

The model serves "up to 32K tokens for both prompt and output" and "over 15% of requests generate over 25K
tokens": the top of each output column is the length cap (32768 tokens minus the prompt, hence P90 ~ P95).

The distribution: the quantile function Q(u) is log-linear between knots (u, tokens). Knots: a floor at u = 0
(an assumption: the table gives nothing below P50), Table 2's P50, a body top at u = p_cap, then a jump to the
cap segment, which is the straight line through Table 2's P90 and P95 from u = p_cap to u = 1 (the capped
requests' lengths are 32768 minus their prompts). p_cap and the body top were solved so that the closed-form
mean and standard deviation equal Table 2's (to 0.02 %); `LengthDistribution.moments` recomputes them. So
every figure of the output rows is matched: P50/P90/P95 exactly, mean and std by the fit; the capped share is
18.0 % (ShareGPT) and 23.3 % (Alpaca), consistent with "over 15 % over 25K tokens".
Prompts keep the dataset's lengths: Table 2's input columns are given as constants for reference only (a
log-linear quantile through them cannot meet their mean and std together without invented tail knots).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from loadgen.datasets.request import Request


@dataclass(frozen=True, slots=True)
class LengthStats:
    """One row of STAR Table 2 (tokens)."""

    mean: float
    std: float
    p50: float
    p90: float
    p95: float


# STAR Table 2, "Workload Statistics" (DeepSeek-R1-Distill-Qwen-7B tokenizer and generations).
STAR_SHAREGPT_INPUT = LengthStats(mean=305, std=1053, p50=36, p90=920, p95=1609)
STAR_SHAREGPT_OUTPUT = LengthStats(mean=7542, std=12008, p50=1536, p90=32670, p95=32679)
STAR_ALPACA_INPUT = LengthStats(mean=11, std=4, p50=10, p90=15, p95=18)
STAR_ALPACA_OUTPUT = LengthStats(mean=8596, std=13354, p50=987, p90=32690, p95=32691)

# STAR §6: "supports up to 32K tokens for both prompt and output" (one 32K context for prompt plus output).
STAR_MAX_MODEL_LEN = 32768
# The shortest output (the quantile at u = 0). Not in the paper: an assumed floor for a reasoning model's
# answer (an empty think block and a few words); the fitted p_cap moves by < 0.4 % between floors 1 and 100.
STAR_OUTPUT_FLOOR_TOKENS = 32
# Solved (scipy fsolve on the closed-form moments, floor 32) so that mean and std equal Table 2's.
STAR_SHAREGPT_CAP_QUANTILE = 0.8198
STAR_SHAREGPT_BODY_TOP_TOKENS = 10154
STAR_ALPACA_CAP_QUANTILE = 0.7674
STAR_ALPACA_BODY_TOP_TOKENS = 7424

# The seed stream of the draws: `default_rng([seed, 2])` (0 shuffles datasets, 1 fills ShareGPT lengths).
_SEED_STREAM = 2


@dataclass(frozen=True, slots=True)
class LengthDistribution:
    """A length distribution given by its quantile function, log-linear between `knots` (u, tokens).

    `knots` run from u = 0 to u = 1 with u non-decreasing and tokens positive and non-decreasing; two knots at
    the same u make a jump (a point mass spread over the next segment).
    """

    name: str
    knots: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        us = [u for u, _ in self.knots]
        xs = [x for _, x in self.knots]
        if len(self.knots) < 2 or us[0] != 0.0 or us[-1] != 1.0:
            raise ValueError(f"{self.name}: knots must run from u=0 to u=1")
        if any(b < a for a, b in zip(us, us[1:], strict=False)) or any(
                b < a for a, b in zip(xs, xs[1:], strict=False)) or xs[0] <= 0:
            raise ValueError(f"{self.name}: knots must be non-decreasing with positive lengths")

    def quantile(self, u: npt.ArrayLike) -> npt.NDArray[np.float64]:
        """Q(u) for u in [0, 1] (continuous tokens)."""
        uu = np.clip(np.asarray(u, dtype=np.float64), 0.0, 1.0)
        us = np.array([k[0] for k in self.knots])
        logs = np.log(np.array([k[1] for k in self.knots]))
        # The segment whose left knot is the last one at or below u (a jump's right knot, past a jump).
        i = np.clip(np.searchsorted(us, uu, side="right") - 1, 0, len(us) - 2)
        width = us[i + 1] - us[i]
        frac = np.divide(uu - us[i], width, out=np.zeros_like(uu), where=width > 0)
        return np.asarray(np.exp(logs[i] + frac * (logs[i + 1] - logs[i])), dtype=np.float64)

    def sample(self, rng: np.random.Generator, n: int) -> npt.NDArray[np.int64]:
        """`n` lengths (whole tokens, at least 1) by inverse transform of `n` uniform draws."""
        tokens: npt.NDArray[np.int64] = np.maximum(np.rint(self.quantile(rng.random(n))), 1).astype(np.int64)
        return tokens

    def moments(self) -> tuple[float, float]:
        """(mean, standard deviation) of the continuous distribution, in closed form."""
        m1 = m2 = 0.0
        for (u0, x0), (u1, x1) in zip(self.knots, self.knots[1:], strict=False):
            m1 += _segment_integral(u1 - u0, x0, x1)
            m2 += _segment_integral(u1 - u0, x0 * x0, x1 * x1)
        return m1, math.sqrt(max(m2 - m1 * m1, 0.0))


def _segment_integral(width: float, a: float, b: float) -> float:
    """Integral over a segment of width `width` of a log-linear function from a to b."""
    if width <= 0.0:
        return 0.0
    if math.isclose(a, b, rel_tol=1e-12):
        return width * a
    return width * (b - a) / math.log(b / a)


def _cap_line(stats: LengthStats, u: float) -> float:
    """The capped requests' lengths: the line through (0.90, P90) and (0.95, P95), at most 32768."""
    slope = (stats.p95 - stats.p90) / 0.05
    return min(float(STAR_MAX_MODEL_LEN), stats.p90 + slope * (u - 0.90))


def star_output_distribution(name: str, stats: LengthStats, cap_quantile: float,
                             body_top_tokens: float) -> LengthDistribution:
    """Floor -> P50 -> body top (log-linear), then the cap line from `cap_quantile` through P90, P95 to 1."""
    return LengthDistribution(name, (
        (0.0, float(STAR_OUTPUT_FLOOR_TOKENS)),
        (0.5, stats.p50),
        (cap_quantile, body_top_tokens),
        (cap_quantile, _cap_line(stats, cap_quantile)),
        (0.90, stats.p90),
        (0.95, stats.p95),
        (1.0, _cap_line(stats, 1.0)),
    ))


OUTPUT_LENGTH_DISTRIBUTIONS: dict[str, LengthDistribution] = {
    "star-sharegpt": star_output_distribution("star-sharegpt", STAR_SHAREGPT_OUTPUT,
                                              STAR_SHAREGPT_CAP_QUANTILE, STAR_SHAREGPT_BODY_TOP_TOKENS),
    "star-alpaca": star_output_distribution("star-alpaca", STAR_ALPACA_OUTPUT,
                                            STAR_ALPACA_CAP_QUANTILE, STAR_ALPACA_BODY_TOP_TOKENS),
}
TABLE_2_OUTPUT: dict[str, LengthStats] = {"star-sharegpt": STAR_SHAREGPT_OUTPUT,
                                          "star-alpaca": STAR_ALPACA_OUTPUT}


def output_distribution(name: str) -> LengthDistribution:
    try:
        return OUTPUT_LENGTH_DISTRIBUTIONS[name]
    except KeyError:
        known = ", ".join(OUTPUT_LENGTH_DISTRIBUTIONS)
        raise ValueError(f"unknown output-length distribution {name!r}; known: {known}") from None


def with_output_lengths(requests: Sequence[Request], name: str, *, seed: int,
                        max_model_len: int = STAR_MAX_MODEL_LEN) -> list[Request]:
    """`requests` with forced output lengths drawn from the distribution `name` (the i-th request gets the
    i-th draw of `default_rng([seed, 2])`), each cut so that prompt plus output fit `max_model_len` (as in
    STAR's 32K setting; at least 1 token)."""
    drawn = output_distribution(name).sample(np.random.default_rng([seed, _SEED_STREAM]), len(requests))
    return [dataclasses.replace(r, output_tokens=max(1, min(int(n), max_model_len - r.prompt_tokens)))
            for r, n in zip(requests, drawn, strict=True)]
