"""LENS's online performance model T(B, S) (NexusSched §4.1, Eq. 1-2), fitted on two timescales.

Owns: `LatencyParams` (one fitted model), `LatencyModel` (the sample windows, cheap `predict`, the recent
a-priori prediction error, and installing fits), and the pure fitting functions a refit job runs.
Must not: read clocks (time enters as `now_s`), schedule, know a backend, start threads or executors (the
caller runs `LatencyModel.refit_job`'s callable inline or in an executor, see `engine_agent.lens.controller`).

The model (Eq. 1-2), all times in seconds:

    T(B, S)   = tau0 + Work(S) / Thr(B, S) + tauB * B + tauS * S
    Work(S)   = w0 + ws * S
    Thr(B, S) = Pmax * (1 - exp(-kB * B)) * (1 - exp(-kS * S))

B is the number of sequences in the iteration (prefill chunks and decodes alike) and S the tokens it computes
(every scheduled token: a decode's one token plus each prefill chunk's tokens), i.e. vLLM's
`num_scheduled_tokens`. The paper's model has no context-length feature, so neither has this one: decode
attention over long contexts is absorbed by tauB (per-sequence cost) and the short-window refit (see below).
An empty batch (B = 0 or S = 0) takes 0 s.

Choices where the paper is silent (all configurable in `LatencyModelConfig`):
- Identifiability. Work/Thr only sees ws / Pmax, so the structural fit fixes ws = 1: Work is counted in tokens
  and Pmax in tokens per second. The short-window refit may then move ws off 1; `peak_throughput` reports
  Pmax / ws, the peak in tokens per second either way.
- Timescales (§4.1's two bullets). Structural fit: {tau0, w0, Pmax, kB, kS, tauB, tauS} (ws = 1) by bounded
  non-linear least squares (scipy `least_squares`, trust-region reflective, soft-L1 loss against outliers,
  residuals relative to the window's median latency, several starts) over the long window: the most recent
  `long_window_samples` samples no older than `long_window_s` (but at least `min_samples_structural`), plus
  the coverage reservoir. It runs when first possible, again whenever the sample count has doubled (cold
  start), and then every `structural_interval_s`. Linear fit, every refit: the parameters that enter Eq. 1
  linearly, {tau0, w0, ws, tauB, tauS} (the paper names {ws, tauB, tauS}; tau0 and w0 are linear too and
  drift with host load and the software stack just as much), by non-negative least squares over the last
  `short_window_samples` batches with {Pmax, kB, kS} fixed, ridge-regularised toward the last structural fit
  (a short window of a steady load barely varies B and S; the ridge keeps what the window cannot identify
  where the long window put it).
- Ridge. The short-window fit minimises sum(((T_pred - T) / T_med)^2) + ridge_weight * sum(((theta -
  theta_anchor) / scale)^2), where a coefficient's scale is the change that moves the window's median batch
  by the median latency. The weight trades tracking against over-fitting one regime (a window of small
  decode-only batches, e.g. while a queue drains, fits those well and everything else badly). Measured on
  h100-llama3-8b iterations (benchmarks/lens_cost.py workload), one-step-ahead R^2 / median held-out R^2 over
  the run: weight 1: 0.9993 / 0.92; 30: 0.9987 / 0.94; 100: 0.9979 / 0.95; 300: 0.9965 / 0.96; 1000:
  0.9943 / 0.97; structural fit alone: 0.989 / 0.975. Default 300; the structural refit (every
  `structural_interval_s`) follows any drift the ridge holds back.
- Coverage reservoir. A time window forgets the shapes the load no longer produces (after a minute at high
  load the small decode batches are gone, and the next quiet period is predicted by extrapolation). Each
  observation is also kept in a (log2 B, log2 S) cell, the last `coverage_per_cell` per cell, for up to
  `coverage_max_age_s`; the structural fit sees those older than the time window as well.
- Cold start without offline profiling. Before `min_samples_linear` samples the model is the prior
  (`prior_*`: a deliberately slow, linear-in-S engine). Until the structural fit is possible the model is
  Eq. 1 with saturated throughput (kB, kS -> infinity, w0 = 0): T = tau0 + S / Pmax + tauB * B, fitted by
  non-negative least squares over every sample. The structural fit replaces it only when it explains the long
  window better. `ready` turns true with the first fit on at least `min_samples_ready` samples; the controller
  leaves the backend's default batching in place until then.
- Off the serving path. `observe` and `predict` are O(1) and never fit; `refit_job(now_s)` snapshots the
  windows and returns a pure callable that computes a `FitOutcome`; `install` swaps it in (one reference
  assignment). `refit(now_s)` does both inline (the simulator, tests).
- `recent_error_ratio` is a-priori: each observation is compared with what the model predicted for it before
  seeing it, averaged over the last `error_window_samples` observations.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import overload

import numpy as np
import numpy.typing as npt

# scipy (about 0.4 s to import) is imported inside the fitting functions, which run off the serving path, so
# that importing this module stays cheap. A caller that runs fits on a serving loop imports it up front, off
# that loop (`import_fit_dependencies`).

FloatArray = npt.NDArray[np.float64]


def import_fit_dependencies() -> None:
    """Import what the fits import lazily (scipy), so their first run does not pay for it."""
    import scipy.linalg  # noqa: F401
    import scipy.optimize  # noqa: F401

# Coverage reservoir cells: log2 buckets of B (up to 4096) and S (up to 131072).
_CELLS_B, _CELLS_S = 13, 18
# kB and kS of a saturated (cold-start) model: 1 - exp(-k * x) == 1.0 for every x >= 1.
SATURATED_K = 1e3
# Bounds of the structural fit (log-parameterised Pmax, kB, kS).
_PMAX_BOUNDS = (1e2, 1e9)
_KB_BOUNDS = (1e-4, 10.0)
_KS_BOUNDS = (1e-6, 1.0)
_STARTS_K = ((0.05, 1e-3), (0.5, 1e-2), (0.02, 3e-4))
_SCALARS = (int, float, np.integer, np.floating)


@dataclass(frozen=True, slots=True)
class LatencyParams:
    """One instance of Eq. 1-2."""

    tau0_s: float
    w0_tokens: float
    ws: float
    pmax_tokens_per_s: float
    kb_per_seq: float
    ks_per_token: float
    tau_b_s: float  # per sequence
    tau_s_s: float  # per token

    @property
    def peak_throughput_tokens_per_s(self) -> float:
        return self.pmax_tokens_per_s / self.ws if self.ws > 0 else math.inf


@dataclass(frozen=True, slots=True)
class LatencyModelConfig:
    long_window_samples: int = 2000
    long_window_s: float = 60.0
    short_window_samples: int = 48
    error_window_samples: int = 64
    min_samples_linear: int = 8
    min_samples_ready: int = 32
    min_samples_structural: int = 64
    structural_interval_s: float = 10.0
    coverage_per_cell: int = 8
    coverage_max_age_s: float = 600.0
    ridge_weight: float = 300.0  # the short-window refit's pull toward the structural fit (module docstring)
    prior_weight: float = 0.1  # the cold (saturated) fit's pull toward the prior
    soft_l1_scale: float = 0.1  # residuals beyond 10% of the median latency are down-weighted
    prior_tau0_s: float = 0.010
    prior_pmax_tokens_per_s: float = 1e4
    prior_tau_b_s: float = 1e-4


@dataclass(frozen=True, slots=True)
class Samples:
    """Iterations as arrays: sequences, tokens, seconds (and when each ended, for windows)."""

    batch_size: FloatArray
    tokens: FloatArray
    latency_s: FloatArray
    time_s: FloatArray

    def __len__(self) -> int:
        return int(self.latency_s.shape[0])

    @classmethod
    def concat(cls, a: Samples, b: Samples) -> Samples:
        return cls(np.concatenate([a.batch_size, b.batch_size]), np.concatenate([a.tokens, b.tokens]),
                   np.concatenate([a.latency_s, b.latency_s]), np.concatenate([a.time_s, b.time_s]))

    def tail(self, n: int) -> Samples:
        return Samples(self.batch_size[-n:], self.tokens[-n:], self.latency_s[-n:], self.time_s[-n:])

    def where(self, mask: npt.NDArray[np.bool_]) -> Samples:
        return Samples(self.batch_size[mask], self.tokens[mask], self.latency_s[mask], self.time_s[mask])


@dataclass(frozen=True, slots=True)
class FitOutcome:
    """What a refit job computed; `LatencyModel.install` applies it."""

    params: LatencyParams
    anchor: LatencyParams  # the long-window fit the short-window refit is regularised toward
    kind: str  # "prior", "saturated", "structural" (this job ran the non-linear fit) or "linear"
    structural: bool  # the anchor is a non-linear (structural) fit
    num_samples: int  # samples observed in total when the job was taken
    fitted_at_s: float


def prior_params(config: LatencyModelConfig) -> LatencyParams:
    return LatencyParams(config.prior_tau0_s, 0.0, 1.0, config.prior_pmax_tokens_per_s, SATURATED_K,
                         SATURATED_K, config.prior_tau_b_s, 0.0)


def predict_scalar(p: LatencyParams, batch_size: float, tokens: float) -> float:
    """Eq. 1 for one batch (about half a microsecond)."""
    if batch_size <= 0 or tokens <= 0:
        return 0.0
    thr = (p.pmax_tokens_per_s * -math.expm1(-p.kb_per_seq * batch_size)
           * -math.expm1(-p.ks_per_token * tokens))
    return (p.tau0_s + (p.w0_tokens + p.ws * tokens) / thr + p.tau_b_s * batch_size
            + p.tau_s_s * tokens)


def predict_array(p: LatencyParams, batch_size: npt.ArrayLike, tokens: npt.ArrayLike) -> FloatArray:
    """Eq. 1 element-wise; 0 where the batch is empty."""
    b = np.asarray(batch_size, dtype=np.float64)
    s = np.asarray(tokens, dtype=np.float64)
    empty = (b <= 0) | (s <= 0)
    b1 = np.maximum(b, 1.0)
    s1 = np.maximum(s, 1.0)
    thr = p.pmax_tokens_per_s * -np.expm1(-p.kb_per_seq * b1) * -np.expm1(-p.ks_per_token * s1)
    t = p.tau0_s + (p.w0_tokens + p.ws * s1) / thr + p.tau_b_s * b1 + p.tau_s_s * s1
    return np.where(empty, 0.0, t)


def r2_score(observed: npt.ArrayLike, predicted: npt.ArrayLike) -> float:
    """Coefficient of determination 1 - SS_res / SS_tot (nan for fewer than two samples or constant data)."""
    y = np.asarray(observed, dtype=np.float64)
    f = np.asarray(predicted, dtype=np.float64)
    if y.size < 2:
        return math.nan
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    if ss_tot <= 0.0:
        return math.nan
    return 1.0 - float(np.sum((y - f) ** 2)) / ss_tot


# -- fitting (pure functions, run off the serving path) --------------------------------------------------


def _ridge_nonneg(x: FloatArray, y: FloatArray, prior: FloatArray, scale: FloatArray,
                  weight: float) -> FloatArray:
    """argmin_{theta >= 0} |X theta - y|^2 + weight * |(theta - prior) / scale|^2.

    Solved on the k x k normal equations in scaled coordinates (k <= 5), never on the tall matrix: a tall SVD
    costs milliseconds and a BLAS thread pool's start-up, the normal equations microseconds.
    """
    xs = x * scale
    gram = xs.T @ xs + weight * np.eye(x.shape[1])
    rhs = xs.T @ y + weight * (prior / scale)
    theta = np.linalg.solve(gram, rhs)
    if np.any(theta < 0.0):
        from scipy.linalg import solve_triangular
        from scipy.optimize import nnls

        chol = np.linalg.cholesky(gram)
        theta = nnls(chol.T, solve_triangular(chol, rhs, lower=True))[0]
    return np.asarray(theta * scale, dtype=np.float64)


def fit_saturated(data: Samples, base: LatencyParams, config: LatencyModelConfig) -> LatencyParams:
    """Cold-start fit: T = tau0 + S / Pmax + tauB * B (Eq. 1 with Thr saturated, w0 = 0, tauS = 0)."""
    y_med = float(np.median(data.latency_s))
    x = np.column_stack([np.ones(len(data)), data.tokens, data.batch_size]) / y_med
    y = data.latency_s / y_med
    s_med = max(float(np.median(data.tokens)), 1.0)
    b_med = max(float(np.median(data.batch_size)), 1.0)
    base_slope = base.ws / base.pmax_tokens_per_s + base.tau_s_s
    prior = np.array([base.tau0_s, base_slope, base.tau_b_s])
    scale = np.array([y_med, y_med / s_med, y_med / b_med])
    # A weak pull toward the prior: only what the samples cannot tell apart stays near it.
    c0, c_s, c_b = _ridge_nonneg(x, y, prior, scale, config.prior_weight)
    pmax = 1.0 / c_s if c_s > 1.0 / _PMAX_BOUNDS[1] else _PMAX_BOUNDS[1]
    return LatencyParams(float(c0), 0.0, 1.0, float(pmax), SATURATED_K, SATURATED_K, float(c_b), 0.0)


def _structural_residuals(x: FloatArray, b: FloatArray, s: FloatArray, t: FloatArray,
                          scale: float) -> FloatArray:
    tau0, w0, lnp, lnkb, lnks, tau_b, tau_s = x
    thr = math.exp(lnp) * -np.expm1(-math.exp(lnkb) * b) * -np.expm1(-math.exp(lnks) * s)
    residuals: FloatArray = (tau0 + (w0 + s) / thr + tau_b * b + tau_s * s - t) / scale
    return residuals


def _structural_jacobian(x: FloatArray, b: FloatArray, s: FloatArray, t: FloatArray,
                         scale: float) -> FloatArray:
    _, w0, lnp, lnkb, lnks, _, _ = x
    kb, ks = math.exp(lnkb), math.exp(lnks)
    eb, es = np.exp(-kb * b), np.exp(-ks * s)
    fb, fs = 1.0 - eb, 1.0 - es
    inv_thr = 1.0 / (math.exp(lnp) * fb * fs)
    q = (w0 + s) * inv_thr
    jac = np.empty((b.shape[0], 7))
    jac[:, 0] = 1.0
    jac[:, 1] = inv_thr
    jac[:, 2] = -q
    jac[:, 3] = -q * kb * b * eb / fb
    jac[:, 4] = -q * ks * s * es / fs
    jac[:, 5] = b
    jac[:, 6] = s
    return jac / scale


def _to_vector(p: LatencyParams) -> FloatArray:
    kb = min(max(p.kb_per_seq, _KB_BOUNDS[0]), _KB_BOUNDS[1])
    ks = min(max(p.ks_per_token, _KS_BOUNDS[0]), _KS_BOUNDS[1])
    pmax = min(max(p.pmax_tokens_per_s / max(p.ws, 1e-9), _PMAX_BOUNDS[0]), _PMAX_BOUNDS[1])
    return np.array([p.tau0_s, p.w0_tokens, math.log(pmax), math.log(kb), math.log(ks), p.tau_b_s, p.tau_s_s])


def _from_vector(x: FloatArray) -> LatencyParams:
    return LatencyParams(float(x[0]), float(x[1]), 1.0, math.exp(x[2]), math.exp(x[3]), math.exp(x[4]),
                         float(x[5]), float(x[6]))


def _robust_cost(p: LatencyParams, data: Samples, scale: float, f_scale: float) -> float:
    z = ((predict_array(p, data.batch_size, data.tokens) - data.latency_s) / scale / f_scale) ** 2
    return float(np.sum(2.0 * (np.sqrt(1.0 + z) - 1.0)))


def fit_structural(data: Samples, base: LatencyParams, config: LatencyModelConfig) -> LatencyParams:
    """Long-window non-linear fit of Eq. 1-2 (ws = 1); the best of several starts and of the saturated fit."""
    from scipy.optimize import least_squares

    b, s, t = data.batch_size, data.tokens, data.latency_s
    scale = float(np.median(t))
    f_scale = config.soft_l1_scale
    lin = fit_saturated(data, base, config)
    # Warm start from the last structural fit; the first one (or after a rejected one) tries a few shapes.
    starts = [_to_vector(base)] if base.kb_per_seq < SATURATED_K else []
    for kb0, ks0 in () if starts else _STARTS_K:
        starts.append(_to_vector(replace(lin, tau0_s=0.5 * lin.tau0_s, tau_b_s=0.5 * lin.tau_b_s,
                                         kb_per_seq=kb0, ks_per_token=ks0)))
    lower = np.array([0.0, 0.0, math.log(_PMAX_BOUNDS[0]), math.log(_KB_BOUNDS[0]), math.log(_KS_BOUNDS[0]),
                      0.0, 0.0])
    upper = np.array([10.0, 1e6, math.log(_PMAX_BOUNDS[1]), math.log(_KB_BOUNDS[1]), math.log(_KS_BOUNDS[1]),
                      10.0, 1.0])
    x_scale = np.array([scale, 10.0, 1.0, 1.0, 1.0, scale / max(float(np.median(b)), 1.0),
                        scale / max(float(np.median(s)), 1.0)])
    best, best_cost = lin, _robust_cost(lin, data, scale, f_scale)
    for x0 in starts:
        x0 = np.clip(x0, lower, upper)
        res = least_squares(_structural_residuals, x0, jac=_structural_jacobian, bounds=(lower, upper),
                            method="trf", tr_solver="lsmr", loss="soft_l1", f_scale=f_scale, x_scale=x_scale,
                            args=(b, s, t, scale), max_nfev=200)
        cand = _from_vector(res.x)
        cost = _robust_cost(cand, data, scale, f_scale)
        if np.isfinite(cost) and cost < best_cost:
            best, best_cost = cand, cost
    return best


def fit_linear(data: Samples, anchor: LatencyParams, config: LatencyModelConfig) -> LatencyParams:
    """Short-window refit of {tau0, w0, ws, tauB, tauS} with {Pmax, kB, kS} fixed, ridge toward `anchor`."""
    b, s, t = data.batch_size, data.tokens, data.latency_s
    inv_thr = 1.0 / (anchor.pmax_tokens_per_s * -np.expm1(-anchor.kb_per_seq * b)
                     * -np.expm1(-anchor.ks_per_token * s))
    y_med = float(np.median(t))
    x = np.column_stack([np.ones(len(data)), inv_thr, s * inv_thr, b, s]) / y_med
    y = t / y_med
    b_med = max(float(np.median(b)), 1.0)
    s_med = max(float(np.median(s)), 1.0)
    g_med = float(np.median(inv_thr))
    prior = np.array([anchor.tau0_s, anchor.w0_tokens, anchor.ws, anchor.tau_b_s, anchor.tau_s_s])
    # Each coefficient's scale: the change that moves the median batch's latency by the median latency.
    scale = np.array([y_med, y_med / g_med, y_med / (s_med * g_med), y_med / b_med, y_med / s_med])
    tau0, w0, ws, tau_b, tau_s = _ridge_nonneg(x, y, prior, scale, config.ridge_weight)
    if ws <= 0.0:
        return anchor
    return replace(anchor, tau0_s=float(tau0), w0_tokens=float(w0), ws=float(ws), tau_b_s=float(tau_b),
                   tau_s_s=float(tau_s))


def run_fit(long: Samples, short: Samples, current: LatencyParams, anchor: LatencyParams,
            anchor_structural: bool, do_structural: bool, num_samples: int, now_s: float,
            config: LatencyModelConfig) -> FitOutcome:
    """One refit job: the structural fit when due, then the short-window linear refit (pure)."""
    n = len(long)
    if n < config.min_samples_linear:
        return FitOutcome(current, anchor, "prior", anchor_structural, num_samples, now_s)
    if do_structural:
        anchor = fit_structural(long, anchor, config)
        anchor_structural = anchor.kb_per_seq < SATURATED_K
        kind = "structural"
    elif not anchor_structural:
        anchor = fit_saturated(long, anchor, config)
        kind = "saturated"
    else:
        kind = "linear"
    params = fit_linear(short, anchor, config) if anchor_structural else anchor
    return FitOutcome(params, anchor, kind, anchor_structural, num_samples, now_s)


# -- the online model ------------------------------------------------------------------------------------


class LatencyModel:
    """Eq. 1-2 learnt online: O(1) `observe` and `predict`, fits through `refit_job` / `install`."""

    def __init__(self, config: LatencyModelConfig | None = None, params: LatencyParams | None = None) -> None:
        self._config = cfg = config or LatencyModelConfig()
        cap = max(cfg.long_window_samples, cfg.short_window_samples, cfg.min_samples_structural)
        self._cap = cap
        self._b = np.zeros(cap)
        self._s = np.zeros(cap)
        self._t = np.zeros(cap)
        self._at = np.zeros(cap)
        self._count = 0  # observations ever
        cells, per_cell = _CELLS_B * _CELLS_S, max(cfg.coverage_per_cell, 1)
        self._cov_b = np.zeros((cells, per_cell))
        self._cov_s = np.zeros((cells, per_cell))
        self._cov_t = np.zeros((cells, per_cell))
        self._cov_at = np.zeros((cells, per_cell))
        self._cov_seq = np.full((cells, per_cell), -1, dtype=np.int64)  # observation number; -1 = empty
        self._cov_next = np.zeros(cells, dtype=np.int64)
        self._err = np.zeros(max(cfg.error_window_samples, 1))
        self._params = params if params is not None else prior_params(cfg)
        self._anchor = self._params
        self._structural = params is not None and params.kb_per_seq < SATURATED_K
        self._ready = params is not None
        self._last_structural_s = -math.inf
        self._count_at_structural = 0
        self._last_fit_s = -math.inf

    @property
    def config(self) -> LatencyModelConfig:
        return self._config

    @property
    def params(self) -> LatencyParams:
        return self._params

    @property
    def ready(self) -> bool:
        """A fit on at least `min_samples_ready` samples is installed (or parameters were given)."""
        return self._ready

    @property
    def anchor(self) -> LatencyParams:
        """The last long-window fit (the short-window refit is regularised toward it)."""
        return self._anchor

    @property
    def structural(self) -> bool:
        return self._structural

    @property
    def num_observations(self) -> int:
        return self._count

    @property
    def peak_throughput(self) -> float:
        """Eq. 2's Pmax in tokens per second (Pmax / ws, see the module docstring)."""
        return self._params.peak_throughput_tokens_per_s

    @property
    def recent_error_ratio(self) -> float:
        """Mean |predicted - observed| / observed over the last observations, each predicted before seen."""
        n = min(self._count, self._err.shape[0])
        return float(self._err[:n].mean()) if n else 0.0

    def observe(self, batch_size: int, tokens: int, latency_s: float, now_s: float) -> None:
        """Record one iteration (B sequences, S computed tokens, its duration) that ended at `now_s`."""
        if batch_size <= 0 or tokens <= 0 or not latency_s > 0.0:
            return
        predicted = predict_scalar(self._params, batch_size, tokens)
        self._err[self._count % self._err.shape[0]] = abs(predicted - latency_s) / latency_s
        i = self._count % self._cap
        self._b[i] = batch_size
        self._s[i] = tokens
        self._t[i] = latency_s
        self._at[i] = now_s
        cell = min(int(batch_size).bit_length(), _CELLS_B - 1) * _CELLS_S + min(int(tokens).bit_length(),
                                                                                _CELLS_S - 1)
        slot = int(self._cov_next[cell])
        self._cov_next[cell] = (slot + 1) % self._cov_seq.shape[1]
        self._cov_b[cell, slot] = batch_size
        self._cov_s[cell, slot] = tokens
        self._cov_t[cell, slot] = latency_s
        self._cov_at[cell, slot] = now_s
        self._cov_seq[cell, slot] = self._count
        self._count += 1

    @overload
    def predict(self, batch_size: float, tokens: float) -> float: ...

    @overload
    def predict(self, batch_size: npt.NDArray[np.generic], tokens: npt.ArrayLike) -> FloatArray: ...

    @overload
    def predict(self, batch_size: npt.ArrayLike, tokens: npt.NDArray[np.generic]) -> FloatArray: ...

    def predict(self, batch_size: npt.ArrayLike, tokens: npt.ArrayLike) -> float | FloatArray:
        """Predicted seconds of a batch of `batch_size` sequences computing `tokens` tokens (Eq. 1)."""
        if isinstance(batch_size, _SCALARS) and isinstance(tokens, _SCALARS):
            return predict_scalar(self._params, float(batch_size), float(tokens))
        return predict_array(self._params, batch_size, tokens)

    def samples(self) -> Samples:
        """Every retained observation, oldest first (a copy)."""
        n = min(self._count, self._cap)
        start = (self._count - n) % self._cap
        order = (start + np.arange(n)) % self._cap
        return Samples(self._b[order], self._s[order], self._t[order], self._at[order])

    def coverage(self, before_observation: int, since_s: float) -> Samples:
        """Reservoir samples from before observation `before_observation`, taken at `since_s` or later."""
        keep = (self._cov_seq >= 0) & (self._cov_seq < before_observation) & (self._cov_at >= since_s)
        return Samples(self._cov_b[keep], self._cov_s[keep], self._cov_t[keep], self._cov_at[keep])

    def r2(self, samples: Samples) -> float:
        """R^2 of the current model's predictions on `samples`."""
        return r2_score(samples.latency_s, predict_array(self._params, samples.batch_size, samples.tokens))

    def structural_due(self, now_s: float) -> bool:
        cfg = self._config
        if min(self._count, self._cap) < cfg.min_samples_structural:
            return False
        if self._count_at_structural == 0:
            return True
        doubled = self._count >= 2 * self._count_at_structural and self._count_at_structural < self._cap
        return doubled or now_s - self._last_structural_s >= cfg.structural_interval_s

    def refit_job(self, now_s: float) -> Callable[[], FitOutcome]:
        """Snapshot the windows now; the returned callable fits them without touching this model."""
        cfg = self._config
        data = self.samples()
        fresh = data.where(data.time_s >= now_s - cfg.long_window_s)
        long = fresh if len(fresh) >= cfg.min_samples_structural else data.tail(cfg.min_samples_structural)
        long = long.tail(cfg.long_window_samples)
        first_in_long = self._count - len(long)
        older = self.coverage(first_in_long, now_s - cfg.coverage_max_age_s)
        if len(older):
            long = Samples.concat(older, long)
        short = data.tail(cfg.short_window_samples)
        current, anchor, anchor_structural = self._params, self._anchor, self._structural
        do_structural = self.structural_due(now_s)
        count = self._count

        def job() -> FitOutcome:
            return run_fit(long, short, current, anchor, anchor_structural, do_structural, count, now_s, cfg)

        return job

    def install(self, outcome: FitOutcome) -> None:
        """Apply a finished refit (from this model's `refit_job`)."""
        self._params = outcome.params
        self._anchor = outcome.anchor
        self._structural = outcome.structural
        self._last_fit_s = outcome.fitted_at_s
        if outcome.kind == "structural":
            self._last_structural_s = outcome.fitted_at_s
            self._count_at_structural = outcome.num_samples
        if outcome.kind != "prior" and min(outcome.num_samples, self._cap) >= self._config.min_samples_ready:
            self._ready = True

    def refit(self, now_s: float) -> FitOutcome:
        """`refit_job` run inline and installed (deterministic; the simulator and tests use it)."""
        outcome = self.refit_job(now_s)()
        self.install(outcome)
        return outcome
