"""LENS's SLO-aware batch planning (NexusSched §4.2.1, Algorithm 1) over a backend-neutral queue view.

Owns: `QueueView` (what a backend shows of its scheduler queues), `PlanLimits`, `BatchPlan` and `plan_batch`,
the pure function that picks the next iteration's token budget, and `peak_tokens_per_s`, the throughput the
model predicts for a full iteration (Eq. 8's P_max as LENS reports it).
Must not: read clocks, hold state between calls, fit models or know a backend; it takes the model's parameters
and the adaptive target as arguments.

Algorithm 1, as implemented:
- Candidates B = max(|Q_run|, 1) .. min(|Q_run| + |Q_wait|, Q_max), ascending (line 12; B = 0 would be an
  empty batch, so the first candidate is 1 when nothing runs), except that the first is |Q_run| + 1 while a
  request waits and a sequence slot is free. Deviation: B = |Q_run| admits nothing, and under a tight target
  a decode-only batch comes within eps of it, so the early exit ended the search there on every iteration
  and waiting prompts starved (issue 17: a simulated H100 planned to 8 ms iterations prefilled at a median
  125 tokens/s with requests waiting, against 42,000 it can do, and PRISM + LENS attained 0.88-0.96 on
  mixed fleets at loads round robin served at 0.996-1.0).
- For each B, binary search of the largest S in [B, M_max] with Predict(B, S) <= T_adaptive, S = B when none
  is (lines 14-25); at most `search_iters` halvings, which (default 16) lets the search converge for any
  M_max <= 65535 (the paper caps it at 10, pass 10 to match). S is then clamped to M_max (when |Q_run| > M_max
  the range is empty and the paper's S = B would break the token limit).
- AllocateTokens(Q_run, Q_wait, B, S) (line 28), greedy as in vLLM: running sequences first, in order, each
  taking min(its need, budget left) (1 for a decode, the rest of its prompt for a chunked prefill); then
  waiting sequences FCFS while fewer than B are scheduled, each taking min(its uncomputed tokens, budget
  left), admitted only if ceil(chunk / block_size) blocks are free, stopping at the first that does not fit.
  KV growth of running sequences is not modelled (the backend preempts as it always does).
- The batch's latency is Predict(B_A, S_A) on what was actually allocated (line 30); the candidate with the
  smallest |T - T_adaptive| wins (first on ties), and the loop stops at the first whose error is below
  `eps_ratio` x T_adaptive (lines 33-37; the paper gives no value for eps_ratio, we use 5%).
- The plan's `token_budget` is S_A, the allocated tokens (not the searched S): a backend that applies it as
  its per-iteration token budget and schedules greedily in the same order rebuilds exactly the planned batch
  (an allocation cut short by B, KV or the queue leaves budget unused that the backend would otherwise spend).
  `num_seqs` is B_A. No plan (None) when both queues are empty (line 3) or nothing can be scheduled.

Cost: cumulative sums over the running queue and over the waiting prefix that can matter (at most
Q_max - |Q_run| sequences, up to the one that exhausts M_max), then per candidate O(search_iters + log n).
The first `scalar_candidates` candidates run in plain Python, about 3 us each (the early exit usually ends the
loop there: 1 to 8 candidates on the benchmark's queues), the rest at once vectorised over numpy arrays with
the same semantics (the first candidate under eps, else the first argmin): numpy's per-call overhead makes
that pass cost 150-300 us whatever its size, cheaper than Python only beyond ~50-100 candidates.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from engine_agent.lens.perf_model import LatencyParams

IntArray = npt.NDArray[np.int64]
_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class QueueView:
    """The scheduler's queues at the start of an iteration, as token counts."""

    # Tokens each running sequence would compute now, in scheduling order (1 for a decode, the uncomputed rest
    # of the prompt for a sequence in chunked prefill).
    running_tokens: IntArray
    # Uncomputed tokens of each waiting sequence, FCFS (the prompt, or prompt + output after a preemption).
    waiting_tokens: IntArray
    free_kv_blocks: int
    # The tightest SLOs among the queued requests (None: the controller's defaults).
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None

    @classmethod
    def of(cls, running_tokens: list[int] | IntArray, waiting_tokens: list[int] | IntArray,
           free_kv_blocks: int, slo_ttft_s: float | None = None,
           slo_tpot_s: float | None = None) -> QueueView:
        return cls(np.asarray(running_tokens, dtype=np.int64), np.asarray(waiting_tokens, dtype=np.int64),
                   free_kv_blocks, slo_ttft_s, slo_tpot_s)


@dataclass(frozen=True, slots=True)
class PlanLimits:
    max_num_seqs: int  # Q_max
    max_batched_tokens: int  # M_max
    block_size: int


@dataclass(frozen=True, slots=True)
class BatchPlan:
    token_budget: int  # S_A: apply as this iteration's token budget
    num_seqs: int  # B_A: sequences the budget schedules
    predicted_latency_s: float  # Predict(B_A, S_A)
    candidates_tried: int
    target_latency_s: float


class _Queue:
    """The per-call precomputation Algorithm 1's candidates share (cumulative sums, KV admission limit)."""

    __slots__ = ("n_run", "run_total", "rcum", "w", "wcum", "kb", "nk", "free", "bs")

    def __init__(self, view: QueueView, limits: PlanLimits) -> None:
        run = view.running_tokens
        self.n_run = n_run = int(run.shape[0])
        self.rcum = np.cumsum(run) if n_run else _EMPTY
        self.run_total = run_total = int(self.rcum[-1]) if n_run else 0
        room = limits.max_batched_tokens - run_total
        slots = limits.max_num_seqs - n_run
        w = view.waiting_tokens[:slots] if room > 0 and slots > 0 else _EMPTY
        wcum = np.cumsum(w)
        if w.shape[0] and wcum[-1] > room:  # sequences after the one that exhausts M_max never get a token
            cut = int(np.searchsorted(wcum, room, side="left")) + 1
            w, wcum = w[:cut], wcum[:cut]
        self.w = w
        self.wcum = wcum
        self.bs = bs = limits.block_size
        self.kb = np.cumsum((w + (bs - 1)) // bs)
        self.free = free = view.free_kv_blocks
        self.nk = int(np.searchsorted(self.kb, free, side="right"))


def plan_batch(view: QueueView, limits: PlanLimits, params: LatencyParams, target_s: float, *,
               search_iters: int = 16, eps_ratio: float = 0.05,
               scalar_candidates: int = 16) -> BatchPlan | None:
    """Algorithm 1: the token budget whose batch's predicted latency is closest to `target_s`."""
    n_run = int(view.running_tokens.shape[0])
    n_wait = int(view.waiting_tokens.shape[0])
    if n_run == 0 and n_wait == 0:
        return None
    q = _Queue(view, limits)
    b_hi = max(min(n_run + n_wait, limits.max_num_seqs), n_run, 1)
    b_lo = max(n_run + 1 if n_wait and n_run < b_hi else n_run, 1)  # a request waits, a slot is free: admit
    n_cand = b_hi - b_lo + 1
    tol = target_s * eps_ratio
    best_err, best_b, best_s, best_t, tried = math.inf, 0, 0, 0.0, 0
    n_scalar = min(n_cand, max(scalar_candidates, 0))
    if n_scalar:
        rcum, wcum, w, kb = q.rcum.tolist(), q.wcum.tolist(), q.w.tolist(), q.kb.tolist()
        for cand in range(b_lo, b_lo + n_scalar):
            tried += 1
            s = _search_scalar(params, cand, limits.max_batched_tokens, target_s, search_iters)
            b_a, s_a = _allocate_scalar(q, rcum, wcum, w, kb, cand, s)
            t = _predict(params, b_a, s_a)
            err = abs(t - target_s)
            if err < best_err:
                best_err, best_b, best_s, best_t = err, b_a, s_a, t
                if best_err < tol:
                    return _finish(best_b, best_s, best_t, tried, target_s)
    if n_scalar < n_cand:
        cands = np.arange(b_lo + n_scalar, b_hi + 1, dtype=np.int64)
        s_arr = _search_vector(params, cands, limits.max_batched_tokens, target_s, search_iters)
        b_arr, sa_arr = _allocate_vector(q, cands, s_arr)
        t_arr = _predict_vector(params, b_arr, sa_arr)
        err_arr = np.abs(t_arr - target_s)
        under = np.flatnonzero(err_arr < tol)
        if under.shape[0]:
            i = int(under[0])
            return _finish(int(b_arr[i]), int(sa_arr[i]), float(t_arr[i]), tried + i + 1, target_s)
        i = int(np.argmin(err_arr))
        tried += int(cands.shape[0])
        if err_arr[i] < best_err:
            best_b, best_s, best_t = int(b_arr[i]), int(sa_arr[i]), float(t_arr[i])
    return _finish(best_b, best_s, best_t, tried, target_s)


def allocate(view: QueueView, limits: PlanLimits, batch_size: int, token_budget: int) -> tuple[int, int]:
    """AllocateTokens alone: (sequences, tokens) of the greedy batch under these caps (a static budget)."""
    if view.running_tokens.shape[0] == 0 and view.waiting_tokens.shape[0] == 0:
        return 0, 0
    q = _Queue(view, limits)
    s = min(token_budget, limits.max_batched_tokens)
    b = max(min(batch_size, limits.max_num_seqs), q.n_run)
    if s <= 0:
        return 0, 0
    return _allocate_scalar(q, q.rcum.tolist(), q.wcum.tolist(), q.w.tolist(), q.kb.tolist(), b, s)


# Batch sizes `peak_tokens_per_s` tries: 1, 2, 4, ... up to Q_max.
_PEAK_GRID = np.array([1 << i for i in range(16)], dtype=np.int64)


def peak_tokens_per_s(params: LatencyParams, limits: PlanLimits) -> float:
    """The most tokens per second an iteration at the engine's token limit can compute: max over batch sizes
    B in {1, 2, 4, ..., Q_max} of M_max / Predict(B, M_max).

    Eq. 2's Pmax is an asymptote, not a rate the engine reaches: only the products of Pmax, ws and the
    saturation terms are identified by the samples, so a fit can trade them off without changing a prediction
    (a simulated A6000 pair's refits reported Pmax / ws from 9.4e3 to 9.7e8 tokens/s while predicting its
    iterations within 2 %, issue 17). A router that divides work by P_max needs the rate a full iteration
    achieves, which every good fit agrees on."""
    tokens = max(limits.max_batched_tokens, 1)
    sizes = _PEAK_GRID[_PEAK_GRID <= max(min(limits.max_num_seqs, tokens), 1)]
    latency = _predict_vector(params, sizes, np.full(sizes.shape, tokens, dtype=np.int64))
    latency = latency[latency > 0.0]
    return float(tokens / latency.min()) if latency.shape[0] else 0.0


def _finish(b_a: int, s_a: int, t: float, tried: int, target_s: float) -> BatchPlan | None:
    if b_a <= 0 or s_a <= 0:
        return None
    return BatchPlan(token_budget=s_a, num_seqs=b_a, predicted_latency_s=t, candidates_tried=tried,
                     target_latency_s=target_s)


def _predict(p: LatencyParams, b: int, s: int) -> float:
    if b <= 0 or s <= 0:
        return 0.0
    thr = p.pmax_tokens_per_s * -math.expm1(-p.kb_per_seq * b) * -math.expm1(-p.ks_per_token * s)
    return p.tau0_s + (p.w0_tokens + p.ws * s) / thr + p.tau_b_s * b + p.tau_s_s * s


def _search_scalar(p: LatencyParams, b: int, m_max: int, target_s: float, iters: int) -> int:
    """Lines 14-25: the largest S in [B, M_max] predicted within the target (B if none), clamped to M_max."""
    fixed = p.tau0_s + p.tau_b_s * b
    inv_b = 1.0 / (p.pmax_tokens_per_s * -math.expm1(-p.kb_per_seq * b))
    w0, ws, ks, tau_s = p.w0_tokens, p.ws, p.ks_per_token, p.tau_s_s
    lo, hi, s = b, m_max, b
    for _ in range(iters):
        if lo > hi:
            break
        mid = (lo + hi) // 2
        if fixed + (w0 + ws * mid) * inv_b / -math.expm1(-ks * mid) + tau_s * mid <= target_s:
            s, lo = mid, mid + 1
        else:
            hi = mid - 1
    return s if s < m_max else m_max


def _allocate_scalar(q: _Queue, rcum: list[int], wcum: list[int], w: list[int], kb: list[int], b: int,
                     s: int) -> tuple[int, int]:
    """Line 28: (sequences, tokens) of the greedy batch for candidate (B, S)."""
    if s <= q.run_total:
        return bisect_left(rcum, s) + 1, s
    left = s - q.run_total
    slots = b - q.n_run
    full = min(bisect_right(wcum, left), slots, q.nk)
    used = wcum[full - 1] if full else 0
    admitted, tokens = full, q.run_total + used
    left -= used
    if full < slots and full < len(w) and left > 0:
        chunk = min(left, w[full])
        if -(-chunk // q.bs) <= q.free - (kb[full - 1] if full else 0):
            admitted += 1
            tokens += chunk
    return q.n_run + admitted, tokens


def _search_vector(p: LatencyParams, b: IntArray, m_max: int, target_s: float, iters: int) -> IntArray:
    """`_search_scalar` for many candidates at once (in-place float arithmetic: this loop is the hot spot)."""
    fixed = p.tau0_s + p.tau_b_s * b
    inv_b = 1.0 / (p.pmax_tokens_per_s * -np.expm1(-p.kb_per_seq * b))
    w0_b = p.w0_tokens * inv_b
    ws_b = p.ws * inv_b
    lo = b.astype(np.float64)
    hi = np.full(lo.shape, float(m_max))
    s = lo.copy()
    mid = np.empty_like(lo)
    t = np.empty_like(lo)
    sat = np.empty_like(lo)
    for _ in range(iters):
        active = lo <= hi
        if not active.any():
            break
        np.add(lo, hi, out=mid)
        mid *= 0.5
        np.floor(mid, out=mid)
        np.maximum(mid, 1.0, out=mid)  # finished candidates (lo > hi) may sit at 0; active ones have mid >= 1
        np.multiply(mid, -p.ks_per_token, out=sat)
        np.expm1(sat, out=sat)  # -(1 - exp(-kS * S))
        np.multiply(ws_b, mid, out=t)
        t += w0_b
        t /= sat  # -Work / Thr
        np.subtract(fixed, t, out=t)
        t += p.tau_s_s * mid
        ok = t <= target_s
        ok &= active
        np.copyto(s, mid, where=ok)
        np.copyto(lo, mid + 1.0, where=ok)
        active ^= ok
        np.copyto(hi, mid - 1.0, where=active)
    return np.minimum(s, m_max).astype(np.int64)


def _allocate_vector(q: _Queue, b: IntArray, s: IntArray) -> tuple[IntArray, IntArray]:
    n_w = int(q.w.shape[0])
    zero = np.zeros(1, dtype=np.int64)
    wcum0 = np.concatenate([zero, q.wcum])
    kb0 = np.concatenate([zero, q.kb])
    wpad = np.concatenate([q.w, zero])
    left = s - q.run_total
    slots = b - q.n_run
    full = np.minimum(np.minimum(np.searchsorted(q.wcum, left, side="right"), slots), q.nk)
    used = wcum0[full]
    rest = left - used
    chunk = np.minimum(rest, wpad[full])
    fits = (chunk + (q.bs - 1)) // q.bs <= q.free - kb0[full]
    admit = (full < slots) & (full < n_w) & (rest > 0) & fits
    b_wait = q.n_run + full + admit
    s_wait = q.run_total + used + np.where(admit, chunk, 0)
    if q.n_run == 0:
        return b_wait, s_wait
    in_run = s <= q.run_total
    b_run = np.searchsorted(q.rcum, s, side="left") + 1
    return np.where(in_run, b_run, b_wait), np.where(in_run, s, s_wait)


def _predict_vector(p: LatencyParams, b: IntArray, s: IntArray) -> npt.NDArray[np.float64]:
    b1 = np.maximum(b, 1)
    s1 = np.maximum(s, 1)
    thr = p.pmax_tokens_per_s * -np.expm1(-p.kb_per_seq * b1) * -np.expm1(-p.ks_per_token * s1)
    t = p.tau0_s + (p.w0_tokens + p.ws * s1) / thr + p.tau_b_s * b1 + p.tau_s_s * s1
    return np.where((b <= 0) | (s <= 0), 0.0, t)
