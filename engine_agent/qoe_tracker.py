"""CascadeInfer's QoE model fitted online by an engine agent (paper 000, §4.1 "Fitting the parameters D_k";
issue 16, item 1): each request's batch load over its lifetime here, one sample per finished request, and the
fit of D over a bounded window of recent samples, which the agent pushes on WatchState (`EngineStats.qoe`).

Owns: `BatchLoads` (per request in flight, the F = (1, n, ΣI, ΣI², ΣL) of every iteration it was in, summed:
`switchyard.qoe.LifetimeLoad` for a whole batch at once), `QoETracker` (`BatchLoads` plus
`switchyard.qoe.OnlineFit`: iterations, finishes and drops in, the current `QoEFigures` out, refitted at most
every `refit_every` new samples) and `LoadJoin` (for loads accumulated in another process, vLLM's EngineCore:
pairs each finished request's load with the latency the agent measured, whichever arrives first).
Must not: read clocks (latencies come in as seconds), do I/O, log, or know a backend or the wire; the
backends decide what an iteration's batch is and when a request finished (`engine_agent.backends.sim`, and
vLLM's engine side with `engine_agent.backends.vllm.backend`).

What is a sample: a request that finished here with output tokens, and was in at least one iteration here,
gives (its lifetime-average F, e2e_s / output_tokens), e2e_s and output_tokens as the backend measured them
on this engine (a migrated-in request: from its arrival here, its tokens here). A dropped request (aborted,
cancelled, migrated out) gives none.

Why vectorised: an iteration's F is the same for every request in its batch, so it is computed once and added
to every member's row in one numpy operation per feature. `add_batch` of 256 / 1,024 sequences takes 27 / 84
us, against 61 / 243 us for one `LifetimeLoad.add` per request (`benchmarks/qoe_tracker_cost.py`, on this
repository's 2-core machine); most of it is the id -> row lookup and reading the prompt lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import numpy as np

from engine_agent.domain import QoEFigures
from switchyard.qoe import NUM_FEATURES, Features, OnlineFit, QoEFit

DEFAULT_WINDOW = 2000  # samples the fit is over (`OnlineFit`'s ring; a refit on 2000: ~0.16 ms)
DEFAULT_REFIT_EVERY = 50  # new samples between two refits
# Requests tracked at once. Only a backend that forgets to finish or drop its requests ever reaches it: the
# oldest is then forgotten (it gives no sample), so memory stays bounded.
DEFAULT_MAX_REQUESTS = 65536
_INITIAL_ROWS = 256
_V = TypeVar("_V")
_INF = float("inf")


class _Slots(dict[str, int]):
    """Request id -> its row; a missing id gets a row (`BatchLoads._allocate`), so one C-level `map` over a
    batch's ids both looks the rows up and registers new requests."""

    __slots__ = ("_owner",)

    def __init__(self, owner: BatchLoads) -> None:
        super().__init__()
        self._owner = owner

    def __missing__(self, request_id: str) -> int:
        row = self._owner._allocate()
        self[request_id] = row
        return row


class BatchLoads:
    """Per request in flight, its iterations' F summed: column k of its row is Σ F_k over its iterations
    (column 0, Σ 1, counts them). Memory: 5 floats per request tracked, at most `max_requests` (past it the
    oldest is forgotten)."""

    __slots__ = ("_slots", "_columns", "_free", "_max_requests", "forgotten")

    def __init__(self, max_requests: int = DEFAULT_MAX_REQUESTS) -> None:
        if max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        self._slots = _Slots(self)  # insertion order: first seen first
        rows = min(_INITIAL_ROWS, max_requests)
        # One array per feature: a scalar add per column is about half the time of one (rows, 5) fancy add.
        self._columns = tuple(np.zeros(rows) for _ in range(NUM_FEATURES))
        self._free = list(range(rows - 1, -1, -1))
        self._max_requests = max_requests
        self.forgotten = 0  # requests dropped to stay under max_requests

    def __len__(self) -> int:
        """Requests tracked."""
        return len(self._slots)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._slots

    @property
    def capacity(self) -> int:
        """Rows allocated (grows by doubling up to `max_requests`, never shrinks)."""
        return len(self._columns[0])

    def request_ids(self) -> list[str]:
        """The requests tracked, first seen first (a copy: callers may pop while iterating)."""
        return list(self._slots)

    def add_batch(self, request_ids: Sequence[str], prompt_tokens: Sequence[int],
                  current_tokens: Sequence[int]) -> None:
        """One iteration: its batch, a sequence each (no id twice), as parallel columns of ids, prompt lengths
        (I) and current lengths (L). Adds the batch's F to each member; a new id starts its load here."""
        n = len(request_ids)
        if len(prompt_tokens) != n or len(current_tokens) != n:
            raise ValueError(f"{n} request ids, {len(prompt_tokens)} prompt lengths and "
                             f"{len(current_tokens)} current lengths: the columns must be parallel")
        if n == 0:
            return
        inputs = np.fromiter(prompt_tokens, dtype=np.float64, count=n)
        f = (1.0, float(n), float(inputs.sum()), float(inputs @ inputs), float(sum(current_tokens)))
        rows = np.fromiter(map(self._slots.__getitem__, request_ids), dtype=np.intp, count=n)
        for column, fk in zip(self._columns, f, strict=True):  # after the lookup: it may have grown them
            column[rows] += fk  # rows are distinct within a batch, so each member gets fk once

    def pop(self, request_id: str) -> Features | None:
        """The request's lifetime-average F, and forget it; None when it was never in an iteration here."""
        row = self._slots.pop(request_id, None)
        if row is None:
            return None
        c = self._columns
        k = float(c[0][row])  # F_0 = 1 per iteration: the iteration count
        mean = (1.0, float(c[1][row]) / k, float(c[2][row]) / k, float(c[3][row]) / k, float(c[4][row]) / k)
        self._release(row)
        return mean

    def drop(self, request_id: str) -> None:
        """Forget a request without a sample (no-op when unknown)."""
        row = self._slots.pop(request_id, None)
        if row is not None:
            self._release(row)

    def _release(self, row: int) -> None:
        for column in self._columns:
            column[row] = 0.0
        self._free.append(row)

    def _allocate(self) -> int:
        """A zeroed row for a new request: a free one, else the columns doubled, else the oldest request's."""
        if not self._free:
            rows = self.capacity
            if rows < self._max_requests:
                grown = min(2 * rows, self._max_requests)
                self._columns = tuple(np.concatenate((c, np.zeros(grown - rows))) for c in self._columns)
                self._free.extend(range(grown - 1, rows - 1, -1))
            else:
                self.drop(next(iter(self._slots)))
                self.forgotten += 1
        return self._free.pop()


class QoETracker:
    """One engine's online QoE fit: feed it every iteration's batch, every finish and every drop; `report`
    is the fit over the last `window` samples (None below `min_samples`), refitted only when `refit_every`
    new samples arrived since the last fit, so reading it often costs nothing."""

    __slots__ = ("_loads", "_fit", "_min_samples", "_refit_every", "_new", "_current", "samples_total",
                 "fit_failures")

    def __init__(self, *, window: int = DEFAULT_WINDOW, min_samples: int = 4 * NUM_FEATURES,
                 refit_every: int = DEFAULT_REFIT_EVERY, max_requests: int = DEFAULT_MAX_REQUESTS) -> None:
        if refit_every < 1:
            raise ValueError(f"refit_every must be >= 1, got {refit_every}")
        self._loads = BatchLoads(max_requests)
        self._fit = OnlineFit(window, min_samples=min_samples)  # ValueError on a bad window / min_samples
        self._min_samples = min_samples
        self._refit_every = refit_every
        self._new = 0  # samples since the last fit
        self._current: QoEFigures | None = None
        self.samples_total = 0  # samples observed since start (the window holds the last `window`)
        self.fit_failures = 0

    @property
    def loads(self) -> BatchLoads:
        """The requests in flight and their loads so far."""
        return self._loads

    def on_iteration(self, request_ids: Sequence[str], prompt_tokens: Sequence[int],
                     current_tokens: Sequence[int]) -> None:
        """One engine iteration's batch (`BatchLoads.add_batch`)."""
        self._loads.add_batch(request_ids, prompt_tokens, current_tokens)

    def on_finish(self, request_id: str, e2e_s: float, output_tokens: int) -> bool:
        """A request finished here after `e2e_s` with `output_tokens` produced here; whether it gave a sample
        (not when it was never in an iteration, produced nothing or has no positive finite latency)."""
        mean_f = self._loads.pop(request_id)
        return mean_f is not None and self.observe(mean_f, e2e_s, output_tokens)

    def on_drop(self, request_id: str) -> None:
        """A request that ends here without a sample: aborted, cancelled, migrated out."""
        self._loads.drop(request_id)

    def observe(self, mean_f: Features, e2e_s: float, output_tokens: int) -> bool:
        """A finished request's lifetime-average F accumulated elsewhere (vLLM's engine process), with its
        latency and output tokens here; whether it became a sample (the same checks as `on_finish`)."""
        if output_tokens <= 0 or not (0.0 < e2e_s < _INF) or not all(0.0 <= fk < _INF for fk in mean_f):
            return False
        self._fit.observe(mean_f, e2e_s / output_tokens)
        self._new += 1
        self.samples_total += 1
        return True

    def report(self) -> QoEFigures | None:
        """The current fit: refitted when none exists yet and `min_samples` are held, or when `refit_every`
        samples arrived since the last one; otherwise the last fit unchanged."""
        if self._current is not None and self._new < self._refit_every:
            return self._current
        if len(self._fit) < self._min_samples:
            return None
        self._new = 0
        try:
            fit = self._fit.refit()
        except RuntimeError:  # NNLS out of iterations (not seen on 5 columns): keep the last fit
            self.fit_failures += 1
            return self._current
        if fit is not None:
            self._current = _figures(fit)
        return self._current


class LoadJoin:
    """Finishes the agent saw and loads another process accumulated, paired by request id in either order
    into `tracker.observe`. An unpaired entry (a load of an aborted or migrated-out request, which the agent
    never reports finished) waits until `max_pending` newer ones of its kind push it out."""

    __slots__ = ("_tracker", "_finishes", "_loads", "_max_pending")

    def __init__(self, tracker: QoETracker, max_pending: int = 4096) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self._tracker = tracker
        self._finishes: dict[str, tuple[float, int]] = {}  # insertion order: oldest first
        self._loads: dict[str, Features] = {}
        self._max_pending = max_pending

    @property
    def pending(self) -> tuple[int, int]:
        """(finishes waiting for their load, loads waiting for their finish)."""
        return len(self._finishes), len(self._loads)

    def on_finish(self, request_id: str, e2e_s: float, output_tokens: int) -> None:
        """A request completed here (not aborted, not cut) after `e2e_s` with `output_tokens` produced."""
        mean_f = self._loads.pop(request_id, None)
        if mean_f is not None:
            self._tracker.observe(mean_f, e2e_s, output_tokens)
        elif output_tokens > 0:
            _bounded_put(self._finishes, request_id, (e2e_s, output_tokens), self._max_pending)

    def on_load(self, request_id: str, mean_f: Sequence[float]) -> None:
        """A request's lifetime-average F, from the process that ran its iterations."""
        if len(mean_f) != NUM_FEATURES:
            return
        f = (float(mean_f[0]), float(mean_f[1]), float(mean_f[2]), float(mean_f[3]), float(mean_f[4]))
        finish = self._finishes.pop(request_id, None)
        if finish is not None:
            self._tracker.observe(f, *finish)
        else:
            _bounded_put(self._loads, request_id, f, self._max_pending)


def _bounded_put(pending: dict[str, _V], key: str, value: _V, limit: int) -> None:
    pending[key] = value
    if len(pending) > limit:
        del pending[next(iter(pending))]


def _figures(fit: QoEFit) -> QoEFigures:
    d = fit.model.d
    return QoEFigures((d[0], d[1], d[2], d[3], d[4]), fit.num_samples, fit.mean_relative_error)
