"""One choice's life as pure decisions, events in and effects out (run live and simulated).

Owns: `ChoiceLife`, the decisions of one generation (one choice of an API request) between "arrived" and
"finished": build the policy's `RequestFeatures`, pick an engine through the policy, say how to note the
dispatch, retry before the first event on an engine not yet tried (bounded by `max_attempts`), refuse to retry
once output may have reached the client, decide what an engine's finish means (success, or a stream error),
and what latency sample to record for the engine that served it. Also the effect types (`Dispatch`, `GiveUp`,
`RecordLatency`) and `record_dispatch`, the one way an executor applies a `Dispatch` to its ledger. Must not:
read a clock or draw randomness (both arrive in a `Moment`), do I/O, await anything, touch metrics, or mutate
the cluster state (it returns what to record; the executor records it). Invariant I1: the live `Dispatcher`
(`gateway.dispatch.dispatcher`) executes these effects with real engine streams, the simulator
(`loadgen.simulate.runner`) in virtual time, so a routing or retry decision has one implementation. The
features it builds are `gateway.dispatch.features.build_features`'s.

The life's states: routing (`route` returns a `Dispatch` or `GiveUp`), an open attempt (until the executor
calls `on_closed`, which names the engine to release), streaming (after `on_first_event`: no more retries),
done (after `on_finished` or a `GiveUp`). `on_unavailable` answers `Retry(delay_s)` (close the attempt, wait,
route again) or `GiveUp` (attempts or the gateway's retry budget, `gateway.dispatch.retry`, exhausted).
Transport outcomes for outlier detection: the first event is a success, `on_unavailable` and a failed stream
a failure (`Outcome` effects the executor applies with `record_outcome`). Later
features (following a migration, escalating a cascade stage, handing over to the next stage) are further
events of this class, so the simulator runs them too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from gateway.cluster.health import FailureReason
from gateway.dispatch.features import RoutingHints, build_features, estimate_prompt_tokens
from gateway.dispatch.retry import RetryBudget
from gateway.domain import ClusterSnapshot, EngineId, EngineRequest, Finished, RequestFeatures
from gateway.policies.base import Policy

DEFAULT_MAX_ATTEMPTS = 3


@dataclass(frozen=True, slots=True)
class Moment:
    """What an executor samples for one decision: its clock, its dispatch counter, one uniform draw in [0, 1)
    and the fleet as its cluster state shows it."""

    now_s: float
    dispatch_seq: int
    rand: float
    snapshot: ClusterSnapshot


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Effect: note the dispatch on `engine_id` (`record_dispatch`) and open the request's stream there."""

    engine_id: EngineId
    features: RequestFeatures  # what the policy saw, for the ledger and for decision logs
    attempt: int  # 1 for the first engine, 2 for the first retry, ...


@dataclass(frozen=True, slots=True)
class GiveUp:
    """Effect: no engine can serve the request (none eligible, or every one tried was unavailable)."""

    message: str
    attempts: int


@dataclass(frozen=True, slots=True)
class RecordLatency:
    """Effect: a latency sample for the engine that served the choice, measured from its dispatch."""

    engine_id: EngineId
    ttft_s: float
    e2e_s: float
    now_s: float


@dataclass(frozen=True, slots=True)
class StreamFailed:
    """Effect: the engine ended the stream with an error after it began (not retryable)."""

    message: str


@dataclass(frozen=True, slots=True)
class Retry:
    """Effect: close the failed attempt, wait `delay_s` (jittered backoff), then `route` again."""

    delay_s: float
    attempt: int  # the attempt that failed


@dataclass(frozen=True, slots=True)
class Outcome:
    """Effect: the transport outcome of an attempt on `engine_id` (None reason: success), for outlier
    detection (`record_outcome`)."""

    engine_id: EngineId
    reason: FailureReason | None
    now_s: float


Decision = Dispatch | GiveUp


class DispatchLedger(Protocol):
    """The part of a cluster state that records dispatches (the live store and `ClusterState` have it)."""

    def note_dispatch(
        self,
        engine_id: EngineId,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        session_id: str,
        now_s: float,
    ) -> None: ...


class OutcomeLedger(Protocol):
    """The part of a cluster state that keeps outlier detection (`ClusterState` has it)."""

    def note_success(self, engine_id: EngineId) -> bool: ...

    def note_failure(self, engine_id: EngineId, reason: FailureReason, now_s: float) -> bool: ...


def record_outcome(ledger: OutcomeLedger, outcome: Outcome) -> bool:
    """Apply an `Outcome`; True when it changed the engine's membership (ejected it, or ended an ejection)."""
    if outcome.reason is None:
        return ledger.note_success(outcome.engine_id)
    return ledger.note_failure(outcome.engine_id, outcome.reason, outcome.now_s)


def record_dispatch(ledger: DispatchLedger, dispatch: Dispatch) -> None:
    """Apply a `Dispatch` effect's accounting (the one place its fields map onto `note_dispatch`)."""
    f = dispatch.features
    ledger.note_dispatch(
        dispatch.engine_id, f.request_id, f.prompt_tokens, f.max_tokens, f.session_id, f.now_s
    )


class LifeError(RuntimeError):
    """An executor fed an event the life's state does not allow (an executor bug, never the client's)."""


class ChoiceLife:
    """The decisions of one choice: build it on arrival, feed it events, apply what it returns."""

    __slots__ = ("request", "hints", "prompt_tokens", "max_attempts", "session_engine", "session_last_used_s",
                 "budget", "tried", "decisions", "last_error", "current", "first_token_s", "streaming",
                 "done")

    def __init__(
        self,
        request: EngineRequest,
        hints: RoutingHints,
        *,
        session_engine: EngineId | None = None,
        session_last_used_s: float = 0.0,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        budget: RetryBudget | None = None,
    ) -> None:
        """`budget`: the executor's gateway-wide retry budget (None: retries bounded by `max_attempts` only,
        without backoff)."""
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")
        self.request = request
        self.hints = hints
        self.prompt_tokens = estimate_prompt_tokens(request)
        self.max_attempts = max_attempts
        self.session_engine = session_engine
        self.session_last_used_s = session_last_used_s
        self.budget = budget
        self.tried: list[EngineId] = []
        self.decisions: list[Decision] = []
        self.last_error: str | None = None
        self.current: Dispatch | None = None
        self.first_token_s: float | None = None
        self.streaming = False
        self.done = False

    # ---- routing -------------------------------------------------------------------------------------------

    def route(self, policy: Policy, moment: Moment) -> Decision:
        """The next engine for this choice, or why there is none. Excludes every engine tried so far."""
        if self.streaming or self.done or self.current is not None:
            raise LifeError("route() while an attempt is open or after the stream began")
        if len(self.tried) >= self.max_attempts:
            return self._give_up()
        if not self.tried and self.budget is not None:
            self.budget.on_start(moment.now_s)
        features = build_features(
            self.request,
            self.hints,
            prompt_tokens=self.prompt_tokens,
            now_s=moment.now_s,
            dispatch_seq=moment.dispatch_seq,
            rand=moment.rand,
            session_engine=self.session_engine,
            session_last_used_s=self.session_last_used_s,
            exclude=frozenset(self.tried),
        )
        engine_id = policy.pick(features, moment.snapshot)
        if engine_id is None:
            return self._give_up()
        self.tried.append(engine_id)
        dispatch = Dispatch(engine_id=engine_id, features=features, attempt=len(self.tried))
        self.current = dispatch
        self.decisions.append(dispatch)
        return dispatch

    def _give_up(self, why: str = "") -> GiveUp:
        detail = (f" after {len(self.tried)} unavailable engine(s){why}: {self.last_error}"
                  if self.last_error is not None else "")
        give_up = GiveUp(f"no engine for model {self.request.model!r}{detail}", len(self.tried))
        self.done = True
        self.decisions.append(give_up)
        return give_up

    # ---- the open attempt ----------------------------------------------------------------------------------

    def on_unavailable(self, error: str, now_s: float, rand: float) -> Retry | GiveUp:
        """The open attempt's engine failed before any event (safe to retry elsewhere). `Retry`: once the
        executor has closed the attempt (`on_closed`) and waited, `route` may pick another engine; `GiveUp`
        when no attempt is left or the retry budget is spent. `rand`: a uniform draw for the backoff
        jitter."""
        dispatch = self._open()
        if self.streaming:
            raise LifeError("on_unavailable() after the stream began: that is a stream error, not a retry")
        self.last_error = error
        if len(self.tried) >= self.max_attempts:
            return self._give_up()
        budget = self.budget
        if budget is None:
            return Retry(0.0, dispatch.attempt)
        if not budget.try_retry(now_s):
            return self._give_up(" (retry budget exhausted)")
        return Retry(budget.params.backoff_s(dispatch.attempt, rand), dispatch.attempt)

    def failure(self, reason: FailureReason, now_s: float) -> Outcome:
        """The outlier-detection outcome of the open attempt's failure (`reason`)."""
        return Outcome(self._open().engine_id, reason, now_s)

    def on_first_event(self, now_s: float) -> Outcome:
        """The engine answered: from now on output may reach the client, so this choice never retries. The
        transport worked: a success for outlier detection."""
        dispatch = self._open()
        self.streaming = True
        return Outcome(dispatch.engine_id, None, now_s)

    def on_token(self, now_s: float) -> None:
        """A token arrived at `now_s` (only the first one matters to the life)."""
        if self.first_token_s is None:
            self.first_token_s = now_s

    def on_finished(self, event: Finished, now_s: float) -> RecordLatency | StreamFailed:
        """The engine's finish: a latency sample for its engine on success, else the stream's error."""
        dispatch = self._open()
        self.done = True
        if event.finish_reason in ("error", "abort"):
            return StreamFailed(event.error_message or f"engine finished with {event.finish_reason}")
        start_s = dispatch.features.now_s
        first_s = self.first_token_s if self.first_token_s is not None else now_s
        return RecordLatency(dispatch.engine_id, first_s - start_s, now_s - start_s, now_s)

    def on_closed(self) -> EngineId | None:
        """The executor closed the open attempt, however it ended (finished, unavailable, rejected, client
        gone, timeout): returns the engine whose dispatch it must release (`note_finish`), or None."""
        dispatch, self.current = self.current, None
        return None if dispatch is None else dispatch.engine_id

    def _open(self) -> Dispatch:
        if self.current is None:
            raise LifeError("no attempt is open")
        return self.current
