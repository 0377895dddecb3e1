"""PRISM's per-decision arithmetic, compiled (numba): the formulas of `gateway.policies.prism`'s module
docstring over the rows of its `_Table`, one loop per decision instead of about 40 numpy calls.

Owns: `terms` (per row: t_first, the margin, the TPOT margin and the three state factors' logs), `totals`
(the log scores: weighted, confidence-blended, affinity), `decide` (the pick, the no-feasible fallback and the
shed test in one call), and the positions of a table row's columns.

Why compiled (issue 17, item 6: <= 20 us a decision at 64 engines): with numpy each of the ~40 vector
operations of a decision cost 0.3-1 us on arrays of 64 rows whatever their length, 29-32 us in all; the same
arithmetic as one compiled loop costs about 1 us (benchmarks/prism_pick_cost.py). numba compiles the kernels
when this module is imported (explicit signatures, so the first request never waits for a compiler) and caches
the machine code on disk (`cache=True`: next to this file, else numba's user cache directory, or
NUMBA_CACHE_DIR); NUMBA_DISABLE_JIT=1 runs the same functions as Python (slow, for debugging).
Numerics: the order of operations follows the numpy version it replaced (m^4 by squaring twice, log1p of each
factor); the confidence blend's mean is a plain sum (it was math.fsum), a difference in the last bits that the
tie tolerance covers.
Must not: import asyncio, aiohttp, grpc, prometheus or time; keep state.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar, cast

import numba
import numpy as np
import numpy.typing as npt

from gateway.policies.prism import CAPACITY_EPSILON, TABLE_COLUMNS, TIE_TOLERANCE

FloatArray = npt.NDArray[np.float64]
_F = TypeVar("_F", bound=Callable[..., object])

# The columns of a table row (`prism.TABLE_COLUMNS`), by position: numba reads them as compile-time constants.
LATENCY, FIRST_BASE, INV_RATE, LOAD_BASE, INV_PEAK_SCALED, FREE_KV, KV_WAIT_FREE, BLOCK_SIZE, DRAIN, AHEAD, \
    BLOCKED_SLOTS, PER_REQUEST, RISK, REPORTED_AT, STALE = (TABLE_COLUMNS.index(name) for name in (
        "latency", "first_base", "inv_rate", "load_base", "inv_peak_scaled", "free_kv", "kv_wait_free",
        "block_size", "drain", "ahead", "blocked_slots", "per_request", "risk", "reported_at", "stale"))
# `consts` (one array per policy: `constants`).
K, MAX_MARGIN, KAPPA, W_LATENCY, W_LOAD, W_CAPACITY, AFFINITY_LOG, HALF_LIFE_S, SHED_MARGIN = range(9)
# `terms` rows.
T_FIRST, T_MARGIN, T_TPOT_MARGIN, T_LATENCY, T_LOAD, T_CAPACITY = range(6)
# `decide` reasons.
SCORED, NO_FEASIBLE, SHED = 0, 1, 2

LOG_EPSILON = math.log(CAPACITY_EPSILON)


def _compiled(signature: str) -> Callable[[_F], _F]:
    """numba.njit with an explicit signature (compiled at import) and the on-disk cache, typed for mypy.
    Where numba finds no writable cache location (a read-only install, a user without a home directory and
    no NUMBA_CACHE_DIR) it compiles without the cache: every process then pays the compile (about 2 s)."""

    def decorate(function: _F) -> _F:
        try:
            return cast(_F, numba.njit(signature, cache=True)(function))
        except RuntimeError:  # numba's "cannot cache function ...: no locator available"
            return cast(_F, numba.njit(signature)(function))

    return decorate


def constants(k: float, max_margin: float, kappa: float, w_latency: float, w_load: float, w_capacity: float,
              affinity_log: float, half_life_s: float, shed_margin: float) -> FloatArray:
    """A policy's constants, in the order `decide` reads them."""
    return np.array([k, max_margin, kappa, w_latency, w_load, w_capacity, affinity_log, half_life_s,
                     shed_margin], dtype=np.float64)


@_compiled("float64(float64, float64)")
def _power(m: float, k: float) -> float:
    """m ** k, by squaring for k = 2 and 4 (the numpy version's rounding)."""
    if k == 4.0:
        m2 = m * m
        return m2 * m2
    if k == 2.0:
        return m * m
    return float(m**k)


_TERMS = "float64[:, :](float64[:, :], float64[:], float64, float64, float64, float64, float64[:])"


@_compiled(_TERMS)
def terms(data: FloatArray, prompt_rows: FloatArray, prompt: float, demand_tokens: float, inv_ttft: float,
          inv_tpot: float, consts: FloatArray) -> FloatArray:
    """Per row of `data` (columns of this module), what PRISM prices for a request: t_first, the margin
    max(t_first / T_ttft, L_e / T_tpot), L_e / T_tpot, log S_latency, log S_load and log S_capacity.
    `prompt_rows`: the prompt tokens per row (with `prefix`; empty: `prompt` everywhere)."""
    n = data.shape[0]
    out = np.empty((6, n))
    k, max_margin, kappa = consts[K], consts[MAX_MARGIN], consts[KAPPA]
    per_row = prompt_rows.shape[0] > 0
    for i in range(n):
        p = prompt_rows[i] if per_row else prompt
        latency = data[i, LATENCY]
        first = data[i, FIRST_BASE] + p * data[i, INV_RATE]
        free_kv = data[i, FREE_KV]
        log_capacity = 0.0
        if demand_tokens > 0.0 and free_kv != np.inf:  # the KV size is known: r may wait for blocks
            blocks = math.ceil(demand_tokens / data[i, BLOCK_SIZE])
            wait_free = data[i, KV_WAIT_FREE]
            if wait_free < blocks:  # completions until r's blocks are free, one running request's each
                blocked_kv = data[i, AHEAD] + math.ceil((blocks - wait_free) / data[i, PER_REQUEST])
                first = first + max(blocked_kv - data[i, BLOCKED_SLOTS], 0.0) * data[i, DRAIN]
            exponent = (1.0 / kappa) - free_kv * (1.0 / (kappa * blocks))  # (1 - x) / kappa, x = M_e / D_r
            if exponent > 0.0:  # r does not fit: eps (1 + max(x, 0)) / 2
                x = 1.0 - kappa * exponent
                log_capacity = LOG_EPSILON + math.log((1.0 + max(x, 0.0)) * 0.5)
            else:
                log_capacity = math.log1p((CAPACITY_EPSILON - 1.0) * math.exp(exponent))
        m_ttft = first * inv_ttft
        m_tpot = latency * inv_tpot
        out[T_FIRST, i] = first
        out[T_MARGIN, i] = max(m_ttft, m_tpot)
        out[T_TPOT_MARGIN, i] = m_tpot
        out[T_LATENCY, i] = (data[i, RISK] - math.log1p(_power(min(m_tpot, max_margin), k))
                             - math.log1p(_power(min(m_ttft, max_margin), k)))
        out[T_LOAD, i] = -math.log1p(data[i, LOAD_BASE] + p * data[i, INV_PEAK_SCALED])
        out[T_CAPACITY, i] = log_capacity
    return out


_CONFIDENCE = "boolean(float64[:, :], float64, float64, float64[:])"


@_compiled(_CONFIDENCE)
def confidence(data: FloatArray, fresh_after_s: float, half_life_s: float, out: FloatArray) -> bool:
    """c_e of every row into `out`; False (out all 1) when every row is fresh and none is flagged stale."""
    n = data.shape[0]
    blend = False
    for i in range(n):
        if data[i, STALE] > 0.0 or data[i, REPORTED_AT] < fresh_after_s:
            blend = True
    for i in range(n):
        if not blend:
            out[i] = 1.0
        elif data[i, STALE] > 0.0:
            out[i] = 0.0
        else:
            out[i] = 0.5 ** (max(fresh_after_s - data[i, REPORTED_AT], 0.0) / half_life_s)
    return blend


_TOTALS = ("float64[:](float64[:, :], float64[:], boolean, float64[:], boolean, int64, "
           "float64[:])")


@_compiled(_TOTALS)
def totals(t: FloatArray, conf: FloatArray, blend: bool, overlap: FloatArray, session: bool,
           session_index: int, consts: FloatArray) -> FloatArray:
    """The log scores of the rows of `terms`: w_lat log S_latency + w_load log S_load + w_cap log S_capacity
    (a weight of 0 leaves its factor out), blended toward the mean by `conf` when `blend`, plus affinity:
    w_aff log(beta) (overlap - 1) with `overlap` (non-empty), else -w_aff log(beta) on every row but the
    session's (`session`; `session_index` -1: not a candidate)."""
    n = t.shape[1]
    out = np.empty(n)
    w_latency, w_load, w_capacity = consts[W_LATENCY], consts[W_LOAD], consts[W_CAPACITY]
    affinity_log = consts[AFFINITY_LOG]
    total = 0.0
    for i in range(n):
        s = t[T_LATENCY, i] if w_latency == 1.0 else w_latency * t[T_LATENCY, i]
        if w_load != 0.0:
            s += w_load * t[T_LOAD, i]
        if w_capacity != 0.0:
            s += w_capacity * t[T_CAPACITY, i]
        out[i] = s
        total += s
    if blend:
        mean = total / n
        for i in range(n):
            out[i] = conf[i] * out[i] + (1.0 - conf[i]) * mean
    if affinity_log != 0.0:
        if overlap.shape[0] > 0:
            for i in range(n):
                out[i] += affinity_log * (overlap[i] - 1.0)
        elif session:
            for i in range(n):
                if i != session_index:
                    out[i] -= affinity_log
    return out


_PICK = "int64(float64[:], boolean, float64, float64[:], boolean)"


@_compiled(_PICK)
def pick_tied(values: FloatArray, above: bool, rand: float, conf: FloatArray, by_conf: bool) -> int:
    """The row with the highest value (`above`; else the lowest), ties within a relative TIE_TOLERANCE broken
    by the highest `conf` (when `by_conf`), then by the one at floor(rand * n) of those left, in row order."""
    n = values.shape[0]
    best = 0
    for i in range(1, n):
        if (values[i] > values[best]) if above else (values[i] < values[best]):
            best = i
    value = values[best]
    slack = TIE_TOLERANCE * max(1.0, abs(value))
    tied = np.empty(n, dtype=np.int64)
    count = 0
    top_conf = -1.0
    for i in range(n):
        if (values[i] >= value - slack) if above else (values[i] <= value + slack):
            tied[count] = i
            count += 1
            if by_conf and conf[i] > top_conf:
                top_conf = conf[i]
    if count == 1:
        return best
    if by_conf:  # the most confident of the tied rows
        kept = 0
        for j in range(count):
            if conf[tied[j]] == top_conf:
                tied[kept] = tied[j]
                kept += 1
        count = kept
    return int(tied[min(int(rand * count), count - 1)])


_DECIDE = ("UniTuple(int64, 2)(float64[:, :], float64[:], float64, float64, float64, float64, float64, "
           "float64[:], boolean, int64, float64, float64, boolean, float64[:])")


@_compiled(_DECIDE)
def decide(data: FloatArray, prompt_rows: FloatArray, prompt: float, demand_tokens: float, output: float,
           inv_ttft: float, inv_tpot: float, overlap: FloatArray, session: bool, session_index: int,
           fresh_after_s: float, rand: float, shed: bool, consts: FloatArray) -> tuple[int, int]:
    """(row, reason) of `prism.PrismPolicy.decide` for a non-empty table: the highest score among tied rows
    (SCORED) when some row's margin is <= 1; else, with `shed` (overload "shed" and a new request), (-1, SHED)
    when the best margin exceeds `shed_margin` and every row is busy (requests ahead, or L_e / T_tpot past
    `shed_margin`); else the row that finishes r soonest (t_first + o L_e; NO_FEASIBLE)."""
    t = terms(data, prompt_rows, prompt, demand_tokens, inv_ttft, inv_tpot, consts)
    n = data.shape[0]
    best_margin = np.inf
    for i in range(n):
        best_margin = min(best_margin, t[T_MARGIN, i])
    conf = np.empty(n)
    if best_margin <= 1.0:
        blend = confidence(data, fresh_after_s, consts[HALF_LIFE_S], conf)
        scores = totals(t, conf, blend, overlap, session, session_index, consts)
        return pick_tied(scores, True, rand, conf, blend), SCORED
    limit = consts[SHED_MARGIN]
    if shed and best_margin > limit:
        busy = True
        for i in range(n):
            if data[i, AHEAD] < 1.0 and t[T_TPOT_MARGIN, i] <= limit:
                busy = False
        if busy:
            return -1, SHED
    finish = np.empty(n)
    for i in range(n):
        finish[i] = t[T_FIRST, i] + output * data[i, LATENCY]
    return pick_tied(finish, False, rand, conf, False), NO_FEASIBLE
