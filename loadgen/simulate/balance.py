"""Load-balance figures of a simulated run (STAR §6.3-6.4): what the rescheduling arms are compared on.

Owns: `balance_figures` (one run's figures from its `per_engine`, `per_decider` and `timeline`, so a result
file or a comparison run, which keep those, can be summarised the same way), `exec_time_variance_ms2` (one
timeline sample's execution-time variance across engines) and `format_balance_table`.
Must not: run simulations, read clocks or files, or compute the latency summary (`loadgen.metrics` does:
goodput and P99 TPOT come from there).

Definitions:
- Execution-time variance (STAR's "Exec. Var.", Table 3, Fig. 11/13): at each timeline sample, the population
  variance across the run's engines of their latest iteration time in ms (an idle engine counts 0), in ms^2;
  the run's figure is the mean over the samples up to its last finish.
- Peak KV use (Fig. 12): per engine the fullest its cache was after any iteration; the run's is the largest.
  `kv_over_99_share`: the share of timeline samples whose fullest engine used >= 99% of its cache (Fig. 12's
  threshold).
- Migrations, pooled over the gateway's workers: counts by outcome, KV bytes moved, requests moved, splice
  stall percentiles (ms), and the rescheduler's wall-clock time per `propose` call (ms).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

MS_PER_S = 1000.0
KV_FULL_RATIO = 0.99


def exec_time_variance_ms2(iteration_s: Sequence[float]) -> float:
    """Population variance of the engines' iteration times (seconds in, ms^2 out); 0 for no engine."""
    if not iteration_s:
        return 0.0
    return float(np.var(np.asarray(iteration_s, dtype=np.float64) * MS_PER_S))


def percentiles_ms(samples_s: Sequence[float]) -> dict[str, float | None]:
    if not samples_s:
        return {"p50": None, "p99": None, "max": None}
    data = np.asarray(samples_s, dtype=np.float64) * MS_PER_S
    return {"p50": float(np.percentile(data, 50)), "p99": float(np.percentile(data, 99)),
            "max": float(data.max())}


def balance_figures(per_engine: Mapping[str, Mapping[str, Any]], per_decider: Sequence[Mapping[str, Any]],
                    timeline: Sequence[Mapping[str, float]],
                    duration_s: float | None = None) -> dict[str, Any]:
    """The run's load-balance figures (see the module docstring). `duration_s`: the run's end, relative to
    its first arrival (timeline samples after it are left out); None keeps every sample."""
    rows = [d["reschedule"] for d in per_decider if "reschedule" in d]
    migrations = {key: sum(int(r["migrations"].get(key, 0)) for r in rows)
                  for key in (rows[0]["migrations"] if rows else {})}
    not_started: dict[str, int] = {}
    for r in rows:
        for key, count in r["not_started"].items():
            not_started[key] = not_started.get(key, 0) + int(count)
    samples = [row for row in timeline if "exec_time_var_ms2" in row
               and (duration_s is None or row["t_s"] <= duration_s + 1e-9)]
    peaks = [float(t["peak_kv_used_ratio"]) for t in per_engine.values() if "peak_kv_used_ratio" in t]
    return {
        "migrations": migrations,
        "not_started": not_started,
        "proposals": sum(int(r["proposals"]) for r in rows),
        "propose_calls": sum(int(r["propose_calls"]) for r in rows),
        "kv_bytes_moved": sum(int(r["kv_bytes_moved"]) for r in rows),
        "requests_moved": sum(int(r["requests_moved"]) for r in rows),
        "max_moves_per_request": max((int(r["max_moves_per_request"]) for r in rows), default=0),
        "splice_stall_ms": percentiles_ms([s for r in rows for s in r["splice_stall_s"]]),
        "propose_ms": percentiles_ms([s for r in rows for s in r["propose_s"]]),
        "preemptions": sum(int(t.get("preemptions", 0)) for t in per_engine.values()),
        "peak_kv_used_ratio": max(peaks, default=None),
        "exec_time_var_ms2": (math.fsum(row["exec_time_var_ms2"] for row in samples) / len(samples)
                              if samples else None),
        "kv_over_99_share": (sum(1 for row in samples if row["max_kv_used_ratio"] >= KV_FULL_RATIO)
                             / len(samples) if samples else None),
    }


# (header, figure, format) of the balance table's columns after the label and rate.
BALANCE_COLUMNS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("cuts", ("migrations", "cut"), "{:d}"),
    ("resumed", ("migrations", "resumed"), "{:d}"),
    ("fallback", ("migrations", "fallback"), "{:d}"),
    ("refused", ("migrations", "refused"), "{:d}"),
    ("KV GB", ("kv_bytes_moved",), "{:.1f}"),
    ("stall p99 ms", ("splice_stall_ms", "p99"), "{:.1f}"),
    ("preempt", ("preemptions",), "{:d}"),
    ("peak KV", ("peak_kv_used_ratio",), "{:.1%}"),
    ("KV>=99%", ("kv_over_99_share",), "{:.1%}"),
    ("exec var ms2", ("exec_time_var_ms2",), "{:.2f}"),
    ("propose p50 ms", ("propose_ms", "p50"), "{:.2f}"),
)


def _figure(balance: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = balance
    for key in path:
        if not isinstance(value, Mapping) or key not in value:
            return None
        value = value[key]
    if path == ("kv_bytes_moved",) and value is not None:
        return value / 1e9
    return value


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    return fmt.format(int(value)) if fmt == "{:d}" else fmt.format(float(value))


def format_balance_table(runs: Sequence[Mapping[str, Any]]) -> str:
    """One row per run that has `balance` figures: migrations, KV moved, splice stall, preemptions, KV use,
    execution-time variance and the rescheduler's time; empty when no run has them."""
    shown = [run for run in runs if run.get("balance") is not None]
    if not shown:
        return ""
    headers = ["variant", "rate", *(h for h, _, _ in BALANCE_COLUMNS)]
    rows = [[str(run["label"]), f"{float(run['rate']):g}",
             *(_cell(_figure(run["balance"], path), fmt) for _, path, fmt in BALANCE_COLUMNS)]
            for run in shown]
    widths = [max(len(headers[i]), *(len(r[i]) for r in rows)) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths,
                                                                                               strict=True)))

    return "\n".join(["load balance and migrations", line(headers), line(["-" * w for w in widths]),
                      *(line(r) for r in rows)])
