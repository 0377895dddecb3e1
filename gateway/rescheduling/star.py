"""STAR's decode rescheduler (paper 003, §5.2, Eq. 3-4, Algorithm 1) as a pure function of a snapshot.

Owns: `StarParams`, `Migration`, `propose` and `StarRescheduler` (it as the reschedule loop drives one): one
interval of Algorithm 1 (classify, enumerate, pick the best feasible migration) over the decode engines of a
model, evaluated in O(1) per candidate from the engines' H-round future-load summaries (`switchyard.star_load`
holds the arithmetic shared with the agent).
Must not: import asyncio, grpc, aiohttp, prometheus or `time`, read clocks, talk to engines or remember
anything between calls; carrying a migration out (cut, KV pull, splice) belongs to an executor above.

Algorithm 1, as implemented (per model; the engines are its decode engines, role "" or "decode", ready, not
ejected, not stale: the others are neither source nor target nor counted in the variance):
- Loads. N_i(B_{i,0}), the current token load, is the sum of the engine's predictions' `current_tokens`, or
  its `running_batch_tokens` when it reports no predictions. The future loads N-hat_i(B_{i,t}), t = 1..H, are
  its `FutureLoad` (the agent's worker-side summary) when that covers H rounds, else rebuilt from its
  predictions with `switchyard.star_load.engine_summary`; an engine with neither (no predictor) is held at its
  current load over the horizon. Its round length k is its FutureLoad's `round_tokens`, else
  `StarParams.round_tokens`.
- Phase 1 (lines 11-16): w_i = sum_t beta_t N-hat_i(B_{i,t}), w-bar their mean, O = {w_i > (1+theta) w-bar},
  U = {N_i(B_{i,0}) < (1+theta) w-bar}, both as printed. Line 15 compares a *current* load with the mean
  *weighted horizon* load, sum_t beta_t ~ 8.7 times its scale with the defaults, so U is nearly every engine
  (an overloaded one included: s = t is skipped); we keep it as printed, the variance test of Phase 3 is
  what rejects moves to loaded engines. Busy engines (`busy_engines`) count in w-bar and the variance but are
  neither source nor target. No O, or nothing in U: no migration (line 6).
- Phase 2 (lines 17-23): r in B_s, migratable and not in `exclude_requests`, with
  N-hat(r) > C_mig / T_exec (line 20; C_mig = N(r) x the source's `kv_bytes_per_token` / the link bandwidth,
  T_exec = the source's `last_iteration_s`: the transfer must take fewer decode steps than r has left), and
  N_t(B_{t,0}) + N(r) + N-hat(r) <= C_mem (line 21 counting N(r) too, the KV r brings; C_mem =
  `kv_blocks_total` x `block_size` of the target, in tokens).
- Phase 3 (lines 24-34): sigma-hat^2 = sigma_0^2 + sum_{t=1..H} beta_t Var_i(N-hat_i(B_{i,t})) (Eq. 4 cut at
  H; Var is the population variance over the model's engines). Moving r takes its trace (N(r) + t k_s while
  t k_s < N-hat(r), `star_load.request_trace`) off the source's summary and adds its trace on the target (the
  same with the target's k) to the target's, and moves N(r) in sigma_0^2. The candidate with the largest
  reduction (before minus after) wins; none when that is not positive.
- "STAR w/o prediction" (`use_prediction=False`): w_i = N_i(B_{i,0}), the objective is sigma_0^2 alone
  (Eq. 3), and N-hat is never read: line 20 is skipped (the remaining length is unknown) and line 21 is
  N_t(B_{t,0}) + N(r) <= C_mem.

Defaults and choices the paper does not state:
- theta = 0.1, H = 32 rounds, beta_t = 0.9^t, k = 20 decode steps per round (§5.3's prediction interval).
- The link: 25 Gbps, gigabits per second (§6.3, after DistServe), i.e. 3.125e9 bytes/s.
- Unknown KV size per token (0 in the view): such a source's requests are not candidates, as line 20 cannot be
  checked (unless `assume_kv_bytes_per_token` > 0). T_exec <= 0 (never iterated): C_mig / T_exec is infinite,
  no candidates either. Unknown KV capacity (`kv_blocks_total` 0): C_mem = 0, never a target.
- Ties: reductions within `TIE_RELATIVE` (1e-9) of sigma-hat^2 count as equal, and the first candidate in the
  loops' order wins (source, then target, in snapshot order, then the request's order in the source's
  report); a move must reduce sigma-hat^2 by more than that to be proposed (floating-point noise).
- One migration per call; with `model` None every model is run and the largest reduction is returned.

Cost: w_i, w-bar and Var are sums over n engines; then every candidate (r, s, t) is evaluated in O(1) from
prefix sums over the horizon (of beta_t, t beta_t, t^2 beta_t, of each engine's beta_t L_t and t beta_t L_t,
and of the fleet's total at each round): a trace is N + t k on rounds 1..T(r), so every sum over rounds that
involves it is a difference of prefix sums. Per source, the |B_s| x |U| reductions are one numpy block, and
only the sources that can matter are evaluated: each gets an upper bound in O(|B_s|) (the target term at its
smallest over U, ignoring KV room), the most promising goes first, and a source whose bound is below the best
found less the tie tolerance is skipped. Total O(n H + sum_i |B_i| + |O| R_max + |evaluated| |U| R_max)
against the paper's O(|O| |U| R_max H). On 256 engines x 256 requests, H = 32 (benchmarks/star_cost.py):
~9 ms, of which ~3 ms is reading the 65k predictions' current tokens; ~17 ms when every overloaded engine
must be evaluated (identical hot engines); the paper's native evaluation is ~5,000 times slower at 128.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from gateway.domain import ClusterSnapshot, EngineId, EngineView, StageLayout
from switchyard.star_load import (
    DEFAULT_BETA,
    DEFAULT_HORIZON,
    DEFAULT_ROUND_TOKENS,
    engine_summary,
    horizon_weights,
)

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

DECODE_ROLES = frozenset({"", "decode"})
TIE_RELATIVE = 1e-9  # reductions closer than this fraction of sigma-hat^2 are ties


@dataclass(frozen=True, slots=True)
class StarParams:
    """Algorithm 1's knobs (defaults: see the module docstring)."""

    theta: float = 0.1  # overload threshold (lines 14-15)
    horizon: int = DEFAULT_HORIZON  # H, rounds
    beta: float = DEFAULT_BETA  # beta_t = beta**t
    round_tokens: int = DEFAULT_ROUND_TOKENS  # k, for engines whose FutureLoad does not say
    kv_link_gbps: float = 25.0  # gigabits per second between decode engines (C_mig)
    use_prediction: bool = True  # False: "STAR w/o prediction" (Eq. 3 only)
    assume_kv_bytes_per_token: int = 0  # for engines reporting 0 (unknown); 0: they offer no candidates

    def __post_init__(self) -> None:
        problems = [
            what for what, bad in (
                (f"theta must be >= 0, got {self.theta}", not self.theta >= 0),
                (f"horizon must be >= 0, got {self.horizon}", self.horizon < 0),
                (f"beta must be in (0, 1], got {self.beta}", not 0 < self.beta <= 1),
                (f"round_tokens must be >= 1, got {self.round_tokens}", self.round_tokens < 1),
                (f"kv_link_gbps must be > 0, got {self.kv_link_gbps}", not self.kv_link_gbps > 0),
                (f"assume_kv_bytes_per_token must be >= 0, got {self.assume_kv_bytes_per_token}",
                 self.assume_kv_bytes_per_token < 0),
            ) if bad
        ]
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def link_bytes_per_s(self) -> float:
        return self.kv_link_gbps * 1e9 / 8


@dataclass(frozen=True, slots=True)
class Migration:
    """m*: move `request_id` from `source` to `target`, and the figures behind the choice."""

    request_id: str
    source: EngineId
    target: EngineId
    model: str
    variance_reduction: float  # sigma-hat^2 before minus after (Eq. 4; Eq. 3 without prediction), tokens^2
    objective: float  # sigma-hat^2 before the move
    current_tokens: int  # N(r)
    predicted_remaining_tokens: float  # N-hat(r) as reported (not used without prediction)
    kv_bytes: int  # N(r) x the source's KV bytes per token (0 when unknown)
    migration_cost_s: float  # C_mig: kv_bytes over the link


def propose(
    snapshot: ClusterSnapshot,
    params: StarParams,
    *,
    model: str | None = None,
    exclude_requests: frozenset[str] = frozenset(),
    busy_engines: frozenset[str] = frozenset(),
) -> Migration | None:
    """One scheduling interval of Algorithm 1: the best feasible migration m*, or None."""
    models = [model] if model is not None else sorted({e.model for e in snapshot.engines})
    best: Migration | None = None
    for name in models:
        found = _propose_model(
            decode_engines(snapshot, name), name, params, exclude_requests, busy_engines
        )
        if found is not None and (best is None or found.variance_reduction > best.variance_reduction):
            best = found
    return best


def decode_engines(snapshot: ClusterSnapshot, model: str) -> tuple[EngineView, ...]:
    """The engines Algorithm 1 sees of `model`: decode role, ready, not ejected, not stale, in order."""
    return tuple(
        e for e in snapshot.engines
        if e.model == model and e.role in DECODE_ROLES and e.ready and not e.ejected and not e.stale
    )


def current_load(engine: EngineView) -> float:
    """N_i(B_{i,0}): the predictions' current tokens, or the running batch's when there are none."""
    if engine.predictions:
        return float(sum(p.current_tokens for p in engine.predictions))
    return float(engine.running_batch_tokens)


def last_rounds(remaining: FloatArray, round_tokens: int, horizon: int) -> IntArray:
    """T(r) = min(H, the last round t with t*k < N-hat(r)), 0 for N-hat <= 0: `star_load`'s rule, vectorised
    (the request's trace is N(r) + t k on rounds 1..T(r))."""
    whole = np.floor_divide(remaining, round_tokens)
    last = np.where(whole * round_tokens >= remaining, whole - 1, whole)
    last = np.where(remaining > 0, last, 0)
    out: IntArray = np.minimum(last, horizon).astype(np.int64)
    return out


@dataclass(frozen=True, slots=True)
class _Fleet:
    """One model's engines as arrays, with the prefix sums every candidate's reduction is read from."""

    engines: tuple[EngineView, ...]
    load0: FloatArray  # N_i(B_{i,0})
    round_tokens: IntArray  # k_i
    weighted: FloatArray  # w_i
    objective: float  # sigma-hat^2
    pl: FloatArray  # (n, H+1): sum_{t<=m} beta_t L_{i,t}
    ptl: FloatArray  # (n, H+1): sum_{t<=m} t beta_t L_{i,t}
    ps: FloatArray  # (H+1,): sum_{t<=m} beta_t S_t, S_t = sum_i L_{i,t}
    pts: FloatArray  # (H+1,): sum_{t<=m} t beta_t S_t
    b0: FloatArray  # (H+1,): sum_{t<=m} beta_t
    b1: FloatArray  # t beta_t
    b2: FloatArray  # t^2 beta_t

    @property
    def horizon(self) -> int:
        return int(self.b0.shape[0]) - 1


def _prefix(x: FloatArray) -> FloatArray:
    """Cumulative sums along the last axis with a leading 0 (index m = the sum of the first m)."""
    pad = np.zeros((*x.shape[:-1], 1))
    return np.concatenate([pad, np.cumsum(x, axis=-1)], axis=-1)


def _fleet(engines: Sequence[EngineView], params: StarParams) -> _Fleet:
    horizon = params.horizon if params.use_prediction else 0
    load0 = np.array([current_load(e) for e in engines], dtype=np.float64)
    ks = [
        e.future_load.round_tokens if params.use_prediction and e.future_load is not None
        and e.future_load.round_tokens >= 1 else params.round_tokens
        for e in engines
    ]
    load = np.zeros((len(engines), horizon))
    if horizon:
        for i, e in enumerate(engines):
            if e.future_load is not None and len(e.future_load.load) >= horizon:
                load[i] = e.future_load.load[:horizon]
            elif e.predictions:
                pairs = ((p.current_tokens, p.predicted_remaining_tokens) for p in e.predictions)
                load[i] = engine_summary(pairs, ks[i], horizon)
            else:
                load[i] = load0[i]
    beta = np.array(horizon_weights(horizon, params.beta), dtype=np.float64)
    tau = np.arange(1, horizon + 1, dtype=np.float64)
    total = load.sum(axis=0)
    pl = _prefix(load * beta)
    objective = float(np.var(load0)) + (float(np.dot(beta, np.var(load, axis=0))) if horizon else 0.0)
    return _Fleet(
        engines=tuple(engines), load0=load0, round_tokens=np.array(ks, dtype=np.int64),
        weighted=pl[:, -1] if horizon else load0, objective=objective,
        pl=pl, ptl=_prefix(load * (tau * beta)), ps=_prefix(total * beta), pts=_prefix(total * tau * beta),
        b0=_prefix(beta), b1=_prefix(tau * beta), b2=_prefix(tau * tau * beta),
    )


@dataclass(frozen=True, slots=True)
class _Candidates:
    """Phase 2's requests on one source (before the target-side memory check, done per target)."""

    positions: IntArray  # index in the source's predictions
    tokens: FloatArray  # N(r)
    remaining: FloatArray  # N-hat(r); 0 without prediction (no trace beyond round 0)
    need: FloatArray  # what line 21 adds to the target: N(r) + N-hat(r) (N(r) without prediction)
    kv_bytes_per_token: int


def _candidates(
    source: EngineView, params: StarParams, exclude: frozenset[str]
) -> _Candidates | None:
    kvb = source.kv_bytes_per_token or params.assume_kv_bytes_per_token
    if params.use_prediction and (kvb <= 0 or source.last_iteration_s <= 0):
        return None  # line 20 cannot be checked, or C_mig / T_exec is infinite
    rows = [
        (j, p.current_tokens, p.predicted_remaining_tokens)
        for j, p in enumerate(source.predictions) if p.migratable and p.request_id not in exclude
    ]
    if not rows:
        return None
    table = np.array(rows, dtype=np.float64)
    positions, tokens = table[:, 0].astype(np.int64), table[:, 1]
    if not params.use_prediction:
        return _Candidates(positions, tokens, np.zeros(len(rows)), tokens, kvb)
    remaining = table[:, 2]
    c_mig = tokens * kvb / params.link_bytes_per_s
    keep = remaining > c_mig / source.last_iteration_s
    if not keep.any():
        return None
    return _Candidates(positions[keep], tokens[keep], remaining[keep], tokens[keep] + remaining[keep], kvb)


@dataclass(frozen=True, slots=True)
class _Targets:
    """Targets sharing one round length k, laid out for a row gather by T(r): (H+1, |targets|) tables."""

    columns: IntArray  # their columns in the target list
    engines: IntArray  # their engine indices
    round_tokens: int
    x: FloatArray  # [m, j] = sum_{t<=m} beta_t L_{j,t} + N_j(B_{j,0})
    y: FloatArray  # [m, j] = k sum_{t<=m} t beta_t L_{j,t}
    x_min: FloatArray  # [m] = min_j x[m, j]
    y_min: FloatArray
    slack: FloatArray  # C_mem - N_j(B_{j,0})


def _target_groups(fleet: _Fleet, targets: IntArray) -> list[_Targets]:
    capacity = np.array(
        [e.kv_blocks_total * e.block_size for e in fleet.engines], dtype=np.float64
    )[targets]
    groups = []
    for k in np.unique(fleet.round_tokens[targets]):
        cols = np.flatnonzero(fleet.round_tokens[targets] == k)
        idx = targets[cols]
        x = np.ascontiguousarray((fleet.pl[idx] + fleet.load0[idx, None]).T)
        y = np.ascontiguousarray((fleet.ptl[idx] * float(k)).T)
        groups.append(_Targets(
            columns=cols, engines=idx, round_tokens=int(k), x=x, y=y, x_min=x.min(axis=1),
            y_min=y.min(axis=1), slack=capacity[cols] - fleet.load0[idx],
        ))
    return groups


def _bases(
    fleet: _Fleet, source: int, cand: _Candidates, groups: list[_Targets]
) -> list[tuple[_Targets, FloatArray, IntArray]]:
    """Per target group: each candidate's target-independent part of the reduction, and T(r) there.

    The change of Var at a round, moving a (off the source) and b (onto the target): with Q = sum x^2 and
    S = sum x, dVar = dQ / n - ((S + b - a)^2 - S^2) / n^2, dQ = -2 L_s a + a^2 + 2 L_t b + b^2; summed over
    rounds with beta_t (round 0: a = b = N(r), weight 1). Only the 2 L_t b / n term depends on the target:
    reduction = base - 2/n (N(r) x[T(r), t] + y[T(r), t]) (`_Targets`).
    """
    n = len(fleet.engines)
    h = fleet.horizon
    big_n = cand.tokens
    ks = float(fleet.round_tokens[source])
    ts = last_rounds(cand.remaining, int(ks), h)
    a_load = big_n * fleet.pl[source, ts] + ks * fleet.ptl[source, ts]
    a2 = big_n * big_n * fleet.b0[ts] + 2 * big_n * ks * fleet.b1[ts] + ks * ks * fleet.b2[ts]
    sa = big_n * fleet.ps[ts] + ks * fleet.pts[ts]
    own = (-2 * a_load + a2 - 2 * big_n * fleet.load0[source] + 2 * big_n * big_n) / n
    out = []
    for g in groups:
        kt = float(g.round_tokens)
        tt = ts if g.round_tokens == int(ks) else last_rounds(cand.remaining, g.round_tokens, h)
        b2 = big_n * big_n * fleet.b0[tt] + 2 * big_n * kt * fleet.b1[tt] + kt * kt * fleet.b2[tt]
        m = np.minimum(ts, tt)
        ab = big_n * big_n * fleet.b0[m] + big_n * (ks + kt) * fleet.b1[m] + ks * kt * fleet.b2[m]
        sb = big_n * fleet.ps[tt] + kt * fleet.pts[tt]
        out.append((g, -(own + b2 / n - (2 * (sb - sa) + a2 + b2 - 2 * ab) / (n * n)), tt))
    return out


def _upper_bound(fleet: _Fleet, source: int, cand: _Candidates, groups: list[_Targets]) -> float:
    """No candidate of `source` reduces sigma-hat^2 by more: the target term at its smallest over the group
    (N(r) >= 0; the same floating-point operations as `_reductions`, so the bound holds exactly)."""
    scale = -2.0 / len(fleet.engines)
    return max(
        float(np.max((g.x_min[tt] * cand.tokens + g.y_min[tt]) * scale + base))
        for g, base, tt in _bases(fleet, source, cand, groups)
    )


def _reductions(
    fleet: _Fleet, source: int, cand: _Candidates, groups: list[_Targets], n_targets: int
) -> FloatArray:
    """(|candidates|, |targets|): sigma-hat^2 before minus after moving each candidate to each target, -inf
    where line 21 fails or the target is the source."""
    scale = -2.0 / len(fleet.engines)
    out = np.empty((len(cand.tokens), n_targets))
    for g, base, tt in _bases(fleet, source, cand, groups):
        red = g.x[tt]  # row gather: a fresh (|candidates|, |group|) array
        red *= cand.tokens[:, None]
        red += g.y[tt]
        red *= scale
        red += base[:, None]
        if cand.need.max() > g.slack.min():
            red[cand.need[:, None] > g.slack[None, :]] = -math.inf
        red[:, g.engines == source] = -math.inf
        if len(groups) == 1:
            return red
        out[:, g.columns] = red
    return out


def _propose_model(
    engines: Sequence[EngineView],
    model: str,
    params: StarParams,
    exclude: frozenset[str],
    busy: frozenset[str],
) -> Migration | None:
    if len(engines) < 2:
        return None
    fleet = _fleet(engines, params)
    bound = (1 + params.theta) * float(fleet.weighted.mean())
    free = [e.engine_id not in busy for e in engines]
    overloaded = [i for i in range(len(engines)) if fleet.weighted[i] > bound and free[i]]
    targets = np.array(
        [i for i in range(len(engines)) if fleet.load0[i] < bound and free[i]], dtype=np.int64
    )
    if not overloaded or targets.size == 0:
        return None
    groups = _target_groups(fleet, targets)
    tol = TIE_RELATIVE * fleet.objective
    # Branch and bound over the sources, the most promising first: a source whose bound is below the best
    # found (less the tie tolerance) can hold neither the best nor a tie with it.
    bounded: list[tuple[float, int, _Candidates]] = []
    for s in overloaded:
        cand = _candidates(engines[s], params, exclude)
        if cand is not None:
            bounded.append((_upper_bound(fleet, s, cand, groups), s, cand))
    bounded.sort(key=lambda entry: -entry[0])
    top = -math.inf
    scanned: list[tuple[int, _Candidates, float]] = []
    for bound, s, cand in bounded:
        if bound < top - tol or not (bound > tol or top > tol):
            break  # nothing left can reach the best (or, with nothing positive yet, be positive)
        best = float(_reductions(fleet, s, cand, groups, targets.size).max())
        scanned.append((s, cand, best))
        top = max(top, best)
    if not top > tol:
        return None
    s, cand, _ = min((e for e in scanned if e[2] >= top - tol), key=lambda e: e[0])  # first source on a tie
    red = _reductions(fleet, s, cand, groups, targets.size)
    hit = red >= top - tol
    col = int(np.flatnonzero(hit.any(axis=0))[0])  # then the first target
    row = int(np.flatnonzero(hit[:, col])[0])  # then the first request
    reduction = float(red[row, col])
    source, target = engines[s], engines[int(targets[col])]
    prediction = source.predictions[int(cand.positions[row])]
    kv_bytes = prediction.current_tokens * cand.kv_bytes_per_token
    return Migration(
        request_id=prediction.request_id,
        source=source.engine_id,
        target=target.engine_id,
        model=model,
        variance_reduction=reduction,
        objective=fleet.objective,
        current_tokens=prediction.current_tokens,
        predicted_remaining_tokens=prediction.predicted_remaining_tokens,
        kv_bytes=kv_bytes,
        migration_cost_s=kv_bytes / params.link_bytes_per_s,
    )


class StarRescheduler:
    """Algorithm 1 as a `gateway.dispatch.mover.Rescheduler`: at most one migration per model and interval,
    nothing remembered, nothing published."""

    def __init__(self, params: StarParams) -> None:
        self.params = params

    def propose(self, snapshot: ClusterSnapshot, model: str, exclude: frozenset[str], busy: frozenset[str],
                now_s: float) -> list[Migration]:
        found = propose(snapshot, self.params, model=model, exclude_requests=exclude, busy_engines=busy)
        return [] if found is None else [found]

    def not_started(self, proposal: object, status: int) -> None:
        """Nothing to take back: the next interval proposes afresh."""

    def layouts(self) -> dict[str, StageLayout]:
        return {}
