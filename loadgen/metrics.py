"""Per-request outcomes and the benchmark summary, with vLLM ``bench serve``'s metric definitions.

Owns: ``Outcome`` (what one replayed request measured), ``Slo`` and ``parse_slo``, and ``summarize``:
TTFT; TPOT = (E2E - TTFT) / (output_tokens - 1) for successful requests with output_tokens > 1; ITL pooled
over every inter-chunk gap of every successful request; E2E latency; mean / median / std (population) /
percentiles (numpy's linear method) in ms, each 0 when there is no sample (vLLM's ``np.mean(xs or 0)``);
throughputs over the given duration; goodput and SLO attainment. Token totals count successful requests
only, as vLLM does.
Must not: measure time, talk HTTP, or write files (``loadgen.results`` does).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

MS_PER_S = 1000.0
SLO_KEYS: Mapping[str, str] = MappingProxyType(
    {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2e": "e2e_ms", "e2el": "e2e_ms"}
)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request's result. Times are seconds; ``arrival_s`` (scheduled) and ``start_s`` (actually sent) are
    relative to the run start; ``itl_s`` are the gaps between successive content chunks after the first."""

    request_id: str
    success: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    arrival_s: float | None = None
    start_s: float | None = None
    ttft_s: float | None = None
    itl_s: tuple[float, ...] = ()
    e2e_s: float | None = None
    error: str | None = None
    engine_id: str | None = None
    migrations: int | None = None  # times its stream moved to another engine; None: not known (live runs)
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache; None: not reported

    def __post_init__(self) -> None:
        if self.success and (self.ttft_s is None or self.e2e_s is None):
            raise ValueError(f"outcome {self.request_id}: a successful request needs ttft_s and e2e_s")
        if self.prompt_tokens < 0 or self.output_tokens < 0:
            raise ValueError(f"outcome {self.request_id}: token counts must be >= 0")
        if self.migrations is not None and self.migrations < 0:
            raise ValueError(f"outcome {self.request_id}: migrations must be >= 0")
        if not isinstance(self.itl_s, tuple):
            object.__setattr__(self, "itl_s", tuple(float(x) for x in self.itl_s))

    @property
    def tpot_s(self) -> float | None:
        """(E2E - TTFT) / (output_tokens - 1) for a successful request with more than one output token."""
        if not self.success or self.output_tokens <= 1 or self.ttft_s is None or self.e2e_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency objectives in ms; a request is good when it meets every one that is set."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def __post_init__(self) -> None:
        values = (self.ttft_ms, self.tpot_ms, self.e2e_ms)
        if all(v is None for v in values):
            raise ValueError("an SLO needs at least one of ttft_ms, tpot_ms, e2e_ms")
        for key, value in zip(("ttft_ms", "tpot_ms", "e2e_ms"), values, strict=True):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"SLO {key} must be a positive finite number of ms, got {value}")

    def is_met(self, outcome: Outcome) -> bool:
        """vLLM's goodput test: success, and each set SLO (converted to s) >= the request's value; a request
        with at most one output token has TPOT 0 for this test."""
        if not outcome.success or outcome.ttft_s is None or outcome.e2e_s is None:
            return False
        tpot_s = outcome.tpot_s or 0.0
        checks = ((self.ttft_ms, outcome.ttft_s), (self.tpot_ms, tpot_s), (self.e2e_ms, outcome.e2e_s))
        return all(slo_ms / MS_PER_S >= value_s for slo_ms, value_s in checks if slo_ms is not None)


def parse_slo(text: str) -> Slo:
    """Parse ``"ttft=500,tpot=50,e2e=10000"`` (ms). Pairs may be split by commas or spaces, ``:`` may replace
    ``=`` (vLLM's ``--goodput ttft:500``), and ``e2el`` is accepted for ``e2e``."""
    pairs = [p for p in re.split(r"[,\s]+", re.sub(r"\s*([=:])\s*", r"\1", text.strip())) if p]
    if not pairs:
        raise ValueError("empty SLO: expected e.g. 'ttft=500,tpot=50,e2e=10000' (milliseconds)")
    values: dict[str, float] = {}
    for pair in pairs:
        key, sep, raw = pair.replace(":", "=", 1).partition("=")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"bad SLO item {pair!r}: expected KEY=MS with KEY one of ttft, tpot, e2e")
        target = SLO_KEYS[key]
        if target in values:
            raise ValueError(f"SLO {key!r} given more than once in {text!r}")
        try:
            value = float(raw)
        except ValueError as exc:
            raise ValueError(f"SLO {key!r}: {raw!r} is not a number of milliseconds") from exc
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"SLO {key!r}: must be a positive number of milliseconds, got {raw!r}")
        values[target] = value
    return Slo(**values)


@dataclass(frozen=True, slots=True)
class LatencyStats:
    """One latency metric in ms: mean, median, population std and (percentile, value) pairs."""

    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: tuple[tuple[float, float], ...]

    @classmethod
    def of(cls, samples_s: Sequence[float], percentiles: Sequence[float]) -> LatencyStats:
        data: Any = list(samples_s) or 0  # vLLM: np.mean(xs or 0), so no sample gives 0
        return cls(
            mean_ms=float(np.mean(data)) * MS_PER_S,
            median_ms=float(np.median(data)) * MS_PER_S,
            std_ms=float(np.std(data)) * MS_PER_S,
            percentiles_ms=tuple((float(p), float(np.percentile(data, p)) * MS_PER_S) for p in percentiles),
        )


def percentile_label(p: float) -> str:
    """vLLM's key spelling: ``p99`` for 99 and 99.0, ``p99.9`` for 99.9."""
    return f"p{int(p)}" if int(p) == p else f"p{p}"


@dataclass(frozen=True, slots=True)
class Summary:
    """Aggregate results; ``to_dict`` gives vLLM-style flat keys (mean_ttft_ms, p99_e2el_ms, ...)."""

    duration_s: float
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats
    request_goodput: float | None = None
    slo_attainment: float | None = None
    slo: Slo | None = field(default=None)
    mean_migrations: float | None = None  # per completed request that records them (simulated runs)
    # Prefix caching: cached prompt tokens / prompt tokens over the completed requests that report them (None:
    # none does), and the share of completed requests served by the busiest engine (None: engines unknown).
    prefix_hit_rate: float | None = None
    max_engine_share: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "duration": self.duration_s,
            "completed": self.completed,
            "failed": self.failed,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "request_goodput": self.request_goodput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
        }
        for name in LATENCY_METRICS:
            stats: LatencyStats = getattr(self, name)
            out[f"mean_{name}_ms"] = stats.mean_ms
            out[f"median_{name}_ms"] = stats.median_ms
            out[f"std_{name}_ms"] = stats.std_ms
            for p, value in stats.percentiles_ms:
                out[f"{percentile_label(p)}_{name}_ms"] = value
        out["slo_attainment"] = self.slo_attainment
        out["mean_migrations"] = self.mean_migrations
        out["prefix_hit_rate"] = self.prefix_hit_rate
        out["max_engine_share"] = self.max_engine_share
        out["slo"] = None if self.slo is None else {
            "ttft_ms": self.slo.ttft_ms, "tpot_ms": self.slo.tpot_ms, "e2e_ms": self.slo.e2e_ms}
        return out


def summarize(
    outcomes: Sequence[Outcome],
    duration_s: float,
    slo: Slo | None = None,
    percentiles: Sequence[float] = (50, 90, 99),
) -> Summary:
    """Aggregate outcomes over a run of ``duration_s`` seconds (the benchmark's wall time)."""
    if not (math.isfinite(duration_s) and duration_s > 0):
        raise ValueError(f"duration_s must be a positive finite number, got {duration_s}")
    for p in percentiles:
        if not 0 <= p <= 100:
            raise ValueError(f"percentiles must lie in [0, 100], got {p}")
    done = [o for o in outcomes if o.success]
    ttfts_s = [o.ttft_s for o in done if o.ttft_s is not None]
    e2els_s = [o.e2e_s for o in done if o.e2e_s is not None]
    tpots_s = [t for t in (o.tpot_s for o in done) if t is not None]
    itls_s = [gap for o in done for gap in o.itl_s]
    total_input = sum(o.prompt_tokens for o in done)
    total_output = sum(o.output_tokens for o in done)
    good = sum(1 for o in outcomes if slo is not None and slo.is_met(o))
    moves = [o.migrations for o in done if o.migrations is not None]
    reporting = [o for o in done if o.cached_tokens is not None]
    reported_prompt = sum(o.prompt_tokens for o in reporting)
    served = Counter(o.engine_id for o in done if o.engine_id is not None)
    return Summary(
        duration_s=duration_s,
        completed=len(done),
        failed=len(outcomes) - len(done),
        total_input_tokens=total_input,
        total_output_tokens=total_output,
        request_throughput=len(done) / duration_s,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        ttft=LatencyStats.of(ttfts_s, percentiles),
        tpot=LatencyStats.of(tpots_s, percentiles),
        itl=LatencyStats.of(itls_s, percentiles),
        e2el=LatencyStats.of(e2els_s, percentiles),
        request_goodput=None if slo is None else good / duration_s,
        slo_attainment=None if slo is None else (good / len(outcomes) if outcomes else 0.0),
        slo=slo,
        mean_migrations=sum(moves) / len(moves) if moves else None,
        prefix_hit_rate=(sum(o.cached_tokens or 0 for o in reporting) / reported_prompt
                         if reported_prompt else None),
        max_engine_share=max(served.values()) / sum(served.values()) if served else None,
    )
