"""The agent's STAR rounds (`--length-predictor FILE|oracle`, `--star-report`): per-request N(r) and N-hat(r),
and the engine's H-round future-load summary, published once per round for the WatchState push.

Owns: `StarLive`, one per agent: the per-request predictions (N-hat at the tap that predicted it and the
generated count there; forgotten as soon as the request's stream ends), the round counter, each round's
`StarRound` (what the next push of every WatchState watcher carries, once) and the future that wakes the
watchers when a round is published; the two ways rounds are clocked (`run_tap`: every tap batch, predicted
first; `run_iterations`: every k engine iterations, no prediction); the predictors a round reads
(`MlpPredictor`: a trained `LengthPredictor`, run in the default executor; `OraclePredictor`: the sim engine's
decided output lengths through `OutputTargets`); and the cost figures (`LiveStats`).
Must not: own its task (the server starts `run_*` after the backend and cancels and awaits it at shutdown),
translate to protobuf (`engine_agent.proto_codec` does), subscribe to the tap itself (the server hands it a
subscription), touch the engine's state off the event loop, or import the service (the service reads the
rounds; the running requests come in as `RunningView`).

What a round holds. Reported: every request in flight on this engine that has output tokens (decoding, or a
migrated-in request whose KV is loading); requests still waiting or in their prefill are not (their load shows
from the round after their first token). For each: N(r) = prompt tokens + output tokens so far (a migrated-in
request's earlier tokens included: the KV it holds), the output count itself, and `migratable`: the service
says it is decoding here (a migrated-in request once it produced a token here), not being cut and not ended;
with a predictor it must also have been in this round's tap batch (decoding at the tap) and have a prediction.
- With a predictor: N-hat(r) = the prediction at the tap, counted down by the tokens generated since
  (floored at 0); a request never predicted yet (it started decoding after the last tap) has N-hat 0 and is
  not migratable. The future load is `switchyard.star_load.engine_summary` of the (N(r), N-hat(r)) pairs with
  k = the tap interval and H = 32.
- Without (`--star-report`, for the gateway's `--reschedule star-nopred`): N-hat is 0 for every request
  (unknown, and never read by STAR w/o prediction) and the future load is the current load, sum N(r), held
  over the H rounds: what the rescheduler assumes of an engine without predictions. Rounds are every k engine
  iterations (k = the tap interval when configured, else 20), looked at on every significant state change and
  at least every `poll_s`.
- When the last request in flight ends after a round that listed some, an empty round follows at once, so the
  gateway does not keep an idle engine's last requests as its load.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from engine_agent.backends.base import EngineBackend
from engine_agent.domain import HiddenStateBatch, HiddenStateSample, RequestId
from engine_agent.star.predictor import LengthPredictor
from switchyard.star_load import DEFAULT_HORIZON, engine_summary

log = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float64]


class RunningRequest(Protocol):
    """What a round reads of one in-flight request (the service's per-stream record)."""

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def output_tokens(self) -> int:
        """Output tokens so far, the ones produced on earlier engines included."""
        ...

    @property
    def migratable(self) -> bool:
        """Decoding here, not being cut, not ended."""
        ...


# The requests in flight on this engine, by id (the service's; read on the loop only).
RunningView = Callable[[], Mapping[RequestId, RunningRequest]]


class PredictionRow(NamedTuple):
    """One request of a round (the wire's `RequestPrediction`; a named tuple: 256 of them are built per round
    on the loop, ~3 times faster than a frozen dataclass)."""

    request_id: RequestId
    generated_tokens: int  # output tokens so far
    predicted_remaining_tokens: float  # N-hat(r), counted down to now; 0 when unknown
    current_tokens: int  # N(r): prompt + generated
    migratable: bool


@dataclass(frozen=True, slots=True)
class StarRound:
    """What one round publishes (the wire's `predictions` and `FutureLoad`)."""

    round: int  # 1, 2, ... per agent process
    round_tokens: int  # k
    predictions: tuple[PredictionRow, ...]
    future_load: tuple[float, ...]  # rounds 1..H


@dataclass(frozen=True, slots=True)
class LiveStats:
    rounds: int
    batches_predicted: int
    samples_predicted: int
    loop_blocked_s_total: float  # time the rounds held the event loop (reading, counting down, summarising)
    loop_blocked_s_max: float
    predict_s_total: float  # predictor time off the loop
    predict_s_max: float


class SamplePredictor(Protocol):
    """Remaining output tokens for each sample at its generated count; NaN where unknown."""

    async def predict(self, samples: Sequence[HiddenStateSample]) -> FloatArray: ...


@runtime_checkable
class OutputTargets(Protocol):
    """The sim backend's read-only view of the output length its engine decided for each decoding request."""

    def output_targets(self) -> Mapping[RequestId, int]: ...


class MlpPredictor:
    """A trained `LengthPredictor` (numpy) run in the default executor; `last_predict_s`: its time there."""

    __slots__ = ("_predictor", "last_predict_s")

    def __init__(self, predictor: LengthPredictor) -> None:
        self._predictor = predictor
        self.last_predict_s = 0.0

    @property
    def hidden_size(self) -> int:
        return self._predictor.hidden_size

    async def predict(self, samples: Sequence[HiddenStateSample]) -> FloatArray:
        loop = asyncio.get_running_loop()
        out, self.last_predict_s = await loop.run_in_executor(None, self.predict_now, samples)
        return out

    def predict_now(self, samples: Sequence[HiddenStateSample]) -> tuple[FloatArray, float]:
        """Blocking: the predictions and the seconds they took (stacking the vectors included)."""
        started = time.perf_counter()
        d = self._predictor.hidden_size
        vectors = np.stack([s.vector for s in samples]) if samples else np.empty((0, d), np.float32)
        out = self._predictor.predict(vectors).astype(np.float64)
        return out, time.perf_counter() - started


class OraclePredictor:
    """The sim engine's exact remaining length: its decided output length minus the sample's generated count
    (read on the loop: O(running requests))."""

    __slots__ = ("_source",)

    def __init__(self, source: OutputTargets) -> None:
        self._source = source

    async def predict(self, samples: Sequence[HiddenStateSample]) -> FloatArray:
        targets = self._source.output_targets()
        out = np.full(len(samples), np.nan)
        for i, sample in enumerate(samples):
            target = targets.get(sample.request_id)
            if target is not None:
                out[i] = max(target - sample.generated_tokens, 0)
        return out


class StarLive:
    """Rounds of per-request predictions and the future-load summary (see the module docstring)."""

    def __init__(
        self, *, round_tokens: int, horizon: int = DEFAULT_HORIZON, predictor: SamplePredictor | None = None
    ) -> None:
        if round_tokens < 1 or horizon < 0:
            raise ValueError(f"need round_tokens >= 1 and horizon >= 0, got {round_tokens}, {horizon}")
        self._k = round_tokens
        self._horizon = horizon
        self._predictor = predictor
        # request -> (N-hat at the tap that predicted it, its generated tokens there)
        self._predicted: dict[RequestId, tuple[float, int]] = {}
        self._running: RunningView | None = None
        self._latest: StarRound | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._rounds = self._batches = self._samples = 0
        self._blocked_total = self._blocked_max = self._predict_total = self._predict_max = 0.0

    @property
    def round_tokens(self) -> int:
        return self._k

    @property
    def predicting(self) -> bool:
        return self._predictor is not None

    @property
    def latest(self) -> StarRound | None:
        """The last round published (None before the first)."""
        return self._latest

    @property
    def tracked(self) -> int:
        """Requests holding a prediction (bounded by the requests in flight)."""
        return len(self._predicted)

    @property
    def stats(self) -> LiveStats:
        return LiveStats(self._rounds, self._batches, self._samples, self._blocked_total, self._blocked_max,
                         self._predict_total, self._predict_max)

    def next_round(self) -> asyncio.Future[None]:
        """A future resolved when the next round is published (shared by every watcher; never cancel it)."""
        if self._waiter is None or self._waiter.done():
            self._waiter = asyncio.get_running_loop().create_future()
        return self._waiter

    def attach(self, running: RunningView) -> None:
        """The requests in flight that rounds read (`run_*` attach theirs; set before `round_now`)."""
        self._running = running

    def forget(self, request_id: RequestId) -> None:
        """The request's stream ended here (the service's `on_stream_end`); publishes an empty round when it
        was the last one in flight and the last round listed requests."""
        self._predicted.pop(request_id, None)
        latest, running = self._latest, self._running
        if latest is not None and latest.predictions and running is not None and not running():
            self._publish((), [0.0] * self._horizon)

    # -- clocks --------------------------------------------------------------------------------------

    async def run_tap(self, batches: AsyncIterator[HiddenStateBatch], running: RunningView) -> None:
        """A round per tap batch, predicted first, until the subscription ends (or the task is cancelled)."""
        if self._predictor is None:
            raise ValueError("run_tap needs a predictor (without one, rounds come from run_iterations)")
        self.attach(running)
        try:
            async for batch in batches:
                await self.on_batch(batch)
        finally:
            self._log_summary()

    async def run_iterations(self, backend: EngineBackend, running: RunningView, poll_s: float) -> None:
        """A round every k engine iterations, looked at on each significant change and every `poll_s`."""
        if poll_s <= 0:
            raise ValueError(f"poll_s must be > 0, got {poll_s}")
        self.attach(running)
        version = -1
        last: int | None = None
        try:
            while True:
                version = await backend.wait_for_change(version, poll_s)
                iterations = backend.stats().iterations_total
                if last is None or iterations < last:
                    last = iterations
                elif iterations - last >= self._k:
                    last = iterations
                    self.round_now()
        finally:
            self._log_summary()

    # -- rounds --------------------------------------------------------------------------------------

    async def on_batch(self, batch: HiddenStateBatch) -> None:
        """Predict one tap batch (off the loop for the MLP), then publish a round."""
        predictor, running = self._predictor, self._running
        if predictor is None or running is None:
            raise RuntimeError("on_batch needs a predictor and the running requests (attach)")
        samples = batch.samples
        started = time.perf_counter()
        estimates = await predictor.predict(samples)
        if isinstance(predictor, MlpPredictor):  # off the loop: its own time, not the loop's
            predict_s = predictor.last_predict_s
            self._predict_total += predict_s
            self._predict_max = max(self._predict_max, predict_s)
            started = time.perf_counter()
        in_flight = running()
        predicted = self._predicted
        for sample, estimate in zip(samples, estimates.tolist(), strict=True):
            rid = sample.request_id
            if not math.isnan(estimate) and rid in in_flight:  # known, and not ended while predicting
                predicted[rid] = (estimate, sample.generated_tokens)
        self._batches += 1
        self._samples += len(samples)
        self._round(in_flight, frozenset(s.request_id for s in samples), started)

    def round_now(self) -> None:
        """Publish a round of the requests in flight now (the iteration clock's round)."""
        if self._running is None:
            raise RuntimeError("round_now needs the running requests (attach)")
        self._round(self._running(), None, time.perf_counter())

    def _round(self, in_flight: Mapping[RequestId, RunningRequest], tapped: frozenset[RequestId] | None,
               started: float) -> None:
        predicting = self._predictor is not None
        predicted = self._predicted
        rows: list[PredictionRow] = []
        for rid, req in in_flight.items():
            out = req.output_tokens
            if out <= 0:
                continue  # waiting or in its prefill
            n_tokens = req.prompt_tokens + out
            migratable = req.migratable
            remaining = 0.0
            if predicting:
                entry = predicted.get(rid)
                if entry is None:
                    migratable = False
                else:
                    remaining = max(entry[0] - (out - entry[1]), 0.0)
                    migratable = migratable and tapped is not None and rid in tapped
            rows.append(PredictionRow(rid, out, remaining, n_tokens, migratable))
        if predicting:
            load = engine_summary(((r.current_tokens, r.predicted_remaining_tokens) for r in rows),
                                  self._k, self._horizon)
        else:
            load = [float(sum(r.current_tokens for r in rows))] * self._horizon
        self._publish(tuple(rows), load)
        blocked = time.perf_counter() - started
        self._blocked_total += blocked
        self._blocked_max = max(self._blocked_max, blocked)

    def _publish(self, rows: tuple[PredictionRow, ...], load: list[float]) -> None:
        self._rounds += 1
        self._latest = StarRound(self._rounds, self._k, rows, tuple(load))
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _log_summary(self) -> None:
        s = self.stats
        log.info(
            "star rounds: %d (%s), %d sample(s) in %d batch(es) predicted; event loop held %.3f ms per round "
            "(max %.3f); predictor off the loop %.3f ms per batch (max %.3f)",
            s.rounds, "predicted" if self.predicting else "current lengths only", s.samples_predicted,
            s.batches_predicted, 1e3 * s.loop_blocked_s_total / max(s.rounds, 1), 1e3 * s.loop_blocked_s_max,
            1e3 * s.predict_s_total / max(s.batches_predicted, 1), 1e3 * s.predict_s_max,
        )
