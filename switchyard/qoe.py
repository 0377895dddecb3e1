"""CascadeInfer's QoE model (paper 000, §4.1, Eq. 1), pure: what a batch of sequences costs an instance.

Owns: the batch features F = (1, n, ΣI, ΣI², ΣL) of a batch of n sequences (I: a sequence's input (prompt)
length, L: its current length, prompt plus the tokens generated so far), `QoEModel` (coefficients D_0..D_4:
a request's normalised latency in that batch, latency / output tokens, is Σ D_k F_k, and the batch's QoE is
Q^B = n Σ D_k F_k), and `divide` (one subset of a set divided evenly in `parts`, the paper's footnote 1:
sorted, from the (parts/2)-th element, every parts-th).
Also owns the fit of D (§4.1 "Fitting the parameters D_k", validated in §6.5): `LifetimeLoad` (a request's
F averaged over the iterations it is in), `fit` (non-negative least squares of normalised latency on those
averages, `QoEFit`), `OnlineFit` (the same over a bounded window of recent requests, for an agent) and
`relative_errors` (|predicted - measured| / measured, §6.5's Figure 13).
Must not: read clocks, do I/O, or decide stages (`gateway.planning.stages` does); import scipy at module level
(about 0.4 s; `fit` imports it when first called, off any serving path).

Why here and not in `gateway/planning`: the agents (sim and vLLM) accumulate F per iteration and fit D online
(the issue's item 1), and the gateway's stage planner evaluates Q^B; the engine agent may not import the
gateway, so the model sits on the shared ground floor beside `switchyard.perf_model`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

NUM_FEATURES = 5
FEATURE_NAMES = ("one", "n", "sum_input", "sum_input_sq", "sum_len")

Features = tuple[float, float, float, float, float]
# One profiled request: (its lifetime-average F, its normalised latency: e2e seconds / output tokens).
Sample = tuple[Features, float]
FloatArray = npt.NDArray[np.float64]
T = TypeVar("T")

# Eq. 1's D for llama3-8b on one H100 as the simulator runs it: `benchmarks/cascadeinfer_profile.py`'s
# default run (§4.1: ShareGPT lengths in buckets [100, 200) ... [3200, 6400), batch sizes 1 ... 256, 60 s
# each, NNLS on relative error; held-out error 5.7 % vs 45.9 % for the static mean). D4 (ΣL) fits to 0 there.
PROFILED_QOE_D: Features = (7.110955333435831e-3, 3.419446183120474e-05, 1.167853817877221e-07,
                  1.4423585217140033e-12, 0.0)
PROFILED_QOE_SOURCE = "benchmarks/cascadeinfer_profile.py on h100-llama3-8b"


def features(inputs: Sequence[float], lengths: Sequence[float]) -> Features:
    """F of one batch: its sequences' input lengths and current lengths, pairwise."""
    if len(inputs) != len(lengths):
        raise ValueError(f"{len(inputs)} input lengths for {len(lengths)} sequences")
    squares = sum(i * i for i in inputs)
    return (1.0, float(len(inputs)), float(sum(inputs)), float(squares), float(sum(lengths)))


@dataclass(frozen=True, slots=True)
class QoEModel:
    """Eq. 1's coefficients; non-negative (a negative D_k would make a fuller batch look faster)."""

    d: Features

    def __post_init__(self) -> None:
        if len(self.d) != NUM_FEATURES or any(not v >= 0 for v in self.d):
            raise ValueError(f"QoE coefficients must be {NUM_FEATURES} non-negative numbers, got {self.d}")

    def per_request(self, f: Features) -> float:
        """Normalised latency (seconds per output token) of each request of a batch with features `f`."""
        return sum(dk * fk for dk, fk in zip(self.d, f, strict=True))

    def batch(self, inputs: Sequence[float], lengths: Sequence[float]) -> float:
        """Q^B = n Σ D_k F_k of a batch (0 for an empty one: an idle instance costs no one anything)."""
        if not inputs:
            return 0.0
        return len(inputs) * self.per_request(features(inputs, lengths))


def divide(items: Sequence[T], parts: int, key: Callable[[T], Any] | None = None) -> list[T]:
    """One of `parts` even subsets of `items` (footnote 1): sorted (by `key`), from index parts // 2, every
    parts-th; all of them for parts 1. Empty when there are fewer than parts // 2 + 1 items."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    return sorted(items, key=key)[parts // 2 :: parts]  # type: ignore[type-var, arg-type]


# -- fitting D (§4.1 "Fitting the parameters D_k"; §6.5 validates it) ---------------------------------------


class LifetimeLoad:
    """A request's batch load over its lifetime: the F of every engine iteration it is in, summed; `mean()` is
    §4.1's "average batch loads F_k over its lifetime", the regressor its normalised latency is fitted on.

    One per request in flight; the caller adds each iteration's batch F (an iteration counts once, whatever
    its duration: the paper's average is over iterations)."""

    __slots__ = ("_sums", "_iterations")

    def __init__(self) -> None:
        self._sums = [0.0] * NUM_FEATURES
        self._iterations = 0

    @property
    def iterations(self) -> int:
        """Iterations added so far."""
        return self._iterations

    def add(self, f: Features) -> None:
        """One more iteration with batch features `f` (as `features` gives them)."""
        sums = self._sums
        sums[0] += f[0]
        sums[1] += f[1]
        sums[2] += f[2]
        sums[3] += f[3]
        sums[4] += f[4]
        self._iterations += 1

    def mean(self) -> Features:
        """The lifetime-average F; ValueError before any iteration (a request that never ran has no load)."""
        k = self._iterations
        if k == 0:
            raise ValueError("no iterations added: a request's lifetime load needs at least one")
        s = self._sums
        return (s[0] / k, s[1] / k, s[2] / k, s[3] / k, s[4] / k)


@dataclass(frozen=True, slots=True)
class QoEFit:
    """A fitted model, how many requests it was fitted on and its mean relative error over them."""

    model: QoEModel
    num_samples: int
    mean_relative_error: float  # mean of |predicted - measured| / measured over the fitted samples


def fit(samples: Sequence[Sample], *, relative: bool = True) -> QoEFit:
    """D by non-negative least squares of normalised latency q on the lifetime-average F (§4.1's regression,
    constrained to D >= 0: a negative D_k would make a fuller batch look faster, and the stage planner would
    reward overload).

    Objective: with `relative` (the default) each row is divided by its q, so NNLS minimises
    Σ ((predicted - q) / q)², the squared relative error (§6.5 reports the relative error); relative=False is
    §4.1's equation as written, Σ (predicted - q)². Why the default departs from the paper: normalised
    latencies span two orders of magnitude (~7.5 ms per token for a lone decode, ~0.7 s for a two-token answer
    queued behind long prompts), and unweighted, the few slowest requests set D while the common case is
    missed: on `benchmarks/cascadeinfer_profile.py`'s default run (h100-llama3-8b, 60 virtual s per
    configuration) the validation mean relative error is 5.7 % weighted vs 10.4 % unweighted (static mean:
    45.9 %).

    Conditioning: the columns span 1 (F_0) to ~1e10 (ΣI² of a batch of long prompts), so each is divided by
    its largest value before NNLS and the solution divided by the same scales. A positive column scale
    changes neither the fits reachable nor the sign constraint: the same problem, with the matrix's condition
    number down from ~4e9 to ~6e2 on batches of 1-256 prompts of 100-6400 tokens. (scipy 1.17's NNLS solved
    the unscaled problem as well on such data; the scaling keeps the active set's tolerances meaningful on
    any solver the `scipy>=1.11` pin allows.)
    ValueError on fewer samples than features, a non-positive or non-finite latency, or a negative or
    non-finite feature."""
    x, q = _arrays(samples)
    return _fit_arrays(x, q, relative)


def relative_errors(model: QoEModel, samples: Sequence[Sample]) -> FloatArray:
    """|model's prediction - q| / q of each sample, in order (§6.5's Figure 13 is their density)."""
    x, q = _arrays(samples)
    return _relative_errors(np.asarray(model.d, dtype=np.float64), x, q)


class OnlineFit:
    """The fit an agent keeps: the last `capacity` requests' (lifetime-average F, q), refitted on demand.

    Memory is bounded by a ring of `capacity` samples (the oldest is overwritten); `refit` is one NNLS on at
    most `capacity` x 5 values (0.13 ms measured at the default 2000), and returns the previous fit
    unchanged when nothing was observed since, so calling it every few seconds is cheap. Below `min_samples`
    it returns None: too few requests to trust five coefficients."""

    __slots__ = ("_x", "_q", "_next", "_count", "_min_samples", "_relative", "_fit", "_stale")

    def __init__(self, capacity: int = 2000, *, min_samples: int = 4 * NUM_FEATURES,
                 relative: bool = True) -> None:
        """`relative`: `fit`'s objective."""
        if min_samples < NUM_FEATURES:
            raise ValueError(f"min_samples must be >= {NUM_FEATURES} (one per coefficient), "
                             f"got {min_samples}")
        if capacity < min_samples:
            raise ValueError(f"capacity ({capacity}) must be >= min_samples ({min_samples})")
        self._x = np.zeros((capacity, NUM_FEATURES), dtype=np.float64)
        self._q = np.zeros(capacity, dtype=np.float64)
        self._next = 0
        self._count = 0
        self._min_samples = min_samples
        self._relative = relative
        self._fit: QoEFit | None = None
        self._stale = False

    @property
    def capacity(self) -> int:
        return len(self._q)

    def __len__(self) -> int:
        """Samples held (at most `capacity`)."""
        return self._count

    def observe(self, mean_f: Features, q: float) -> None:
        """One finished request: its lifetime-average F and normalised latency (ValueError on bad values)."""
        row = np.asarray(mean_f, dtype=np.float64)
        if row.shape != (NUM_FEATURES,) or not np.all(np.isfinite(row)) or np.any(row < 0):
            raise ValueError(f"features must be {NUM_FEATURES} finite non-negative numbers, got {mean_f}")
        if not (q > 0 and np.isfinite(q)):
            raise ValueError(f"normalised latency must be positive and finite, got {q}")
        i = self._next
        self._x[i] = row
        self._q[i] = q
        self._next = (i + 1) % len(self._q)
        self._count = min(self._count + 1, len(self._q))
        self._stale = True

    def refit(self) -> QoEFit | None:
        """The fit over the samples held; None below `min_samples`."""
        if self._count < self._min_samples:
            return None
        if self._stale or self._fit is None:
            n = self._count
            self._fit = _fit_arrays(self._x[:n], self._q[:n], self._relative)
            self._stale = False
        return self._fit


def _arrays(samples: Sequence[Sample]) -> tuple[FloatArray, FloatArray]:
    """(N x 5 features, N latencies), checked: features finite and non-negative, latencies positive."""
    x = np.empty((len(samples), NUM_FEATURES), dtype=np.float64)
    q = np.empty(len(samples), dtype=np.float64)
    for j, (f, qj) in enumerate(samples):
        if len(f) != NUM_FEATURES:
            raise ValueError(f"sample {j}: {len(f)} features, expected {NUM_FEATURES}")
        x[j] = f
        q[j] = qj
    bad_q = np.flatnonzero(~(np.isfinite(q) & (q > 0)))
    if bad_q.size:
        j = int(bad_q[0])
        raise ValueError(f"sample {j}: normalised latency must be positive and finite, got {q[j]}")
    bad_x = np.flatnonzero(~np.all(np.isfinite(x) & (x >= 0), axis=1))
    if bad_x.size:
        j = int(bad_x[0])
        raise ValueError(f"sample {j}: features must be finite and non-negative, got {tuple(x[j])}")
    return x, q


def _fit_arrays(x: FloatArray, q: FloatArray, relative: bool) -> QoEFit:
    """NNLS on checked arrays, rows divided by q when `relative`, columns scaled to a largest value of 1 (see
    `fit`)."""
    if len(q) < NUM_FEATURES:
        raise ValueError(f"{len(q)} samples cannot fit {NUM_FEATURES} coefficients (need >= {NUM_FEATURES})")
    from scipy.optimize import nnls  # lazily: see the module docstring

    a, b = (x / q[:, None], np.ones_like(q)) if relative else (x, q)
    scale = a.max(axis=0)
    scale[scale <= 0] = 1.0  # an all-zero column: any scale, its coefficient stays 0
    solution, _ = nnls(a / scale, b)
    d = np.asarray(solution, dtype=np.float64) / scale  # >= 0: NNLS's answer over positive scales
    model = QoEModel((float(d[0]), float(d[1]), float(d[2]), float(d[3]), float(d[4])))
    return QoEFit(model, len(q), float(np.mean(_relative_errors(d, x, q))))


def _relative_errors(d: FloatArray, x: FloatArray, q: FloatArray) -> FloatArray:
    errors: FloatArray = np.abs(x @ d - q) / q
    return errors
