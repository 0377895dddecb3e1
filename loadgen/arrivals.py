"""Arrival processes for replay: gamma/Poisson at a rate, all-at-once, and trace-timestamp replay.

Owns: ``ArrivalSpec`` (the validated arrival configuration, including the runner's concurrency cap, which is
only stored here) and the pure functions that turn a request list into send times (seconds from run start).
Must not: sleep, read clocks, send requests or enforce the concurrency cap (the runner does that).

Rate mode follows vLLM ``bench serve``: inter-arrival gaps are Gamma(shape=K, scale=1/(R*K)), so the mean gap
is 1/R and K=1 is a Poisson process; the first request goes at t=0, request i at the sum of the first i gaps.
``rate_per_s=inf`` sends everything at t=0. Randomness comes only from ``numpy.random.default_rng(seed)``.
Timestamp mode replays ``Request.arrival_s`` inside the trace window ``[start_s, start_s + duration_s)``
(trace seconds) at ``(arrival_s - start_s) / speedup``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from loadgen.datasets.request import Request


class ArrivalSpec(BaseModel):
    """How requests arrive. Rate fields and timestamp fields are mutually exclusive; defaults are inert."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rate_per_s: float = Field(default=math.inf, gt=0, description="requests per second; inf = all at t=0")
    burstiness: float = Field(default=1.0, gt=0, description="gamma shape K; 1 = Poisson, <1 burstier")
    timestamps: bool = Field(default=False, description="replay the trace's own arrival times")
    speedup: float = Field(default=1.0, gt=0, description="timestamp mode: trace seconds per replay second")
    start_s: float = Field(default=0.0, ge=0, description="timestamp mode: window start, trace seconds")
    duration_s: float | None = Field(default=None, gt=0, description="timestamp mode: window length, trace s")
    max_concurrency: int | None = Field(default=None, ge=1, description="in-flight cap (runner)")
    seed: int = 0

    @model_validator(mode="after")
    def _exclusive_modes(self) -> ArrivalSpec:
        if self.timestamps:
            if not math.isinf(self.rate_per_s) or self.burstiness != 1.0:
                raise ValueError("rate_per_s/burstiness cannot be combined with timestamps=true")
            if not math.isfinite(self.speedup) or not math.isfinite(self.start_s):
                raise ValueError("speedup and start_s must be finite")
        elif self.speedup != 1.0 or self.start_s != 0.0 or self.duration_s is not None:
            raise ValueError("speedup/start_s/duration_s apply only with timestamps=true")
        return self


def gamma_arrival_times_s(
    n: int, rate_per_s: float, burstiness: float, rng: np.random.Generator
) -> np.ndarray:
    """``n`` send times: 0, then cumulative Gamma(K, 1/(R*K)) gaps; all zeros when the rate is infinite."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not rate_per_s > 0 or not burstiness > 0:
        raise ValueError(f"rate_per_s and burstiness must be > 0, got {rate_per_s}, {burstiness}")
    if math.isinf(rate_per_s) or n == 0:
        return np.zeros(n, dtype=np.float64)
    gaps_s = rng.gamma(shape=burstiness, scale=1.0 / (rate_per_s * burstiness), size=n - 1)
    return np.concatenate(([0.0], np.cumsum(gaps_s)))


def window_mask(trace_s: np.ndarray, start_s: float, duration_s: float | None) -> np.ndarray:
    """True where a trace time lies in ``[start_s, start_s + duration_s)``."""
    end_s = math.inf if duration_s is None else start_s + duration_s
    return (trace_s >= start_s) & (trace_s < end_s)


def timestamp_arrival_times_s(
    trace_s: Sequence[float] | np.ndarray,
    speedup: float,
    start_s: float = 0.0,
    duration_s: float | None = None,
) -> np.ndarray:
    """``(trace_s - start_s) / speedup``; every time must lie inside the window (filter first)."""
    if not speedup > 0:
        raise ValueError(f"speedup must be > 0, got {speedup}")
    times = np.asarray(trace_s, dtype=np.float64)
    outside = ~window_mask(times, start_s, duration_s)
    if outside.any():
        first = float(times[int(np.argmax(outside))])
        raise ValueError(f"{int(outside.sum())} trace time(s) outside the window [{start_s}, "
                         f"{start_s + duration_s if duration_s is not None else math.inf}), e.g. {first}; "
                         f"load the dataset with the same start_s/duration_s or use schedule()")
    return (times - start_s) / speedup


def arrival_times_s(requests: Sequence[Request], spec: ArrivalSpec) -> np.ndarray:
    """One send time per request (seconds from the run start), in the order given."""
    if spec.timestamps:
        trace_s = _trace_times_s(requests)
        return timestamp_arrival_times_s(trace_s, spec.speedup, spec.start_s, spec.duration_s)
    rng = np.random.default_rng(spec.seed)
    return gamma_arrival_times_s(len(requests), spec.rate_per_s, spec.burstiness, rng)


def schedule(requests: Sequence[Request], spec: ArrivalSpec) -> list[tuple[float, Request]]:
    """(send time s, request) pairs sorted by time (stable); timestamp mode drops out-of-window requests."""
    if spec.timestamps:
        trace_s = _trace_times_s(requests)
        keep = window_mask(trace_s, spec.start_s, spec.duration_s)
        kept = [r for r, k in zip(requests, keep, strict=True) if k]
        times = timestamp_arrival_times_s(trace_s[keep], spec.speedup, spec.start_s, spec.duration_s)
    else:
        kept = list(requests)
        times = arrival_times_s(kept, spec)
    order = np.argsort(times, kind="stable")
    return [(float(times[i]), kept[int(i)]) for i in order]


def _trace_times_s(requests: Sequence[Request]) -> np.ndarray:
    missing = [r.request_id for r in requests if r.arrival_s is None]
    if missing:
        raise ValueError(f"timestamps=true needs timed requests; {len(missing)} have no arrival_s "
                         f"(e.g. {missing[0]}); use a timed trace such as azure-conv")
    return np.asarray([r.arrival_s for r in requests], dtype=np.float64)
