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

The life's states: routing (`route` returns a `Dispatch`, a `GiveUp`, or a `Shed` when the policy sheds the
request: `gateway.policies.base.SHED`), an open attempt (until the executor
calls `on_closed`, which names the engine to release), streaming (after `on_first_event`: no more retries),
done (after `on_finished` or a `GiveUp`). `on_unavailable` answers `Retry(delay_s)` (close the attempt, wait,
route again) or `GiveUp` (attempts or the gateway's retry budget, `gateway.dispatch.retry`, exhausted).
Transport outcomes for outlier detection: the first event is a success, `on_unavailable` and a failed stream
a failure (`Outcome` effects the executor applies with `record_outcome`).

Following a migration (STAR §5.4, the stream splice): the engine's stream ends with `Migrated(ticket)`; the
executor closes the source attempt (`on_closed` releases it) and asks `follow` where to resume. The order:
the engine the mover named (`ticket.target`), then the policy's pick among the others, then the source itself
(it still holds the cut's KV until its lease ends; "the engine the mover named" is in the gateway's engine
ids, the mover passes them as the cut's target), each at most once, at most `max_follows` resumptions per
choice (resumptions that began; each engine is tried at most once per ticket, so refusals are bounded by the
fleet). `follow` returns a `Follow` (a `Dispatch` to note and `MigrateIn` to open, and how many tokens of the
new stream to drop: the splice is by token position, and the client has `relayed` tokens) or a
`StreamFailed` when no engine is left or the client holds tokens the ticket does not (a gap). A resumed
attempt that fails before its first event (`on_follow_failed`) moves to the next candidate.

Resuming without KV (only with `recompute=True`, which the live dispatcher sets; the simulator does not model
it yet): when every candidate refused the ticket that carries KV, `follow` goes on with a ticket without KV,
on any serving engine ("recompute anywhere"); and a resumed attempt that fails after its first
event (`on_resume_failed`: the target died mid-stream) is re-ticketed the same way, on any serving engine but
the ones that died. Such a `Follow` has `recompute` set and `skip_tokens` 0: the executor builds the ticket
from the original one and the token ids it relayed (it keeps them; this class counts them, `relayed`), so the
resuming engine recomputes prompt + every relayed token and streams only what follows. Each engine is tried
at most once per ticket kind; every resumption that began counts towards `max_follows`.
A migrated choice records no latency sample: its TTFT and end-to-end time are not one engine's.

Disaggregated serving (CAUCHY, `switchyard.roles`): `route` never sends a new request to a decode-role engine
while its model has a serving engine of another role (a prefill engine, or one that serves whole requests);
the memo of which engines those are is keyed by `ClusterSnapshot.membership`. A prefill engine cuts each
request after its first token; the ticket from an engine whose role is prefill is a hand-off, and `follow`
resumes it on a decode engine of the source's combo (none serving: of any combo; none: the usual order,
which ends on the source itself), picked by the policy among those. Its `Follow` says `handoff`.
In-place execution (CAUCHY §3.4.2's opportunistic scheduling, for a policy whose `in_place` attribute is true,
goodput_rr with `intra=opportunistic`): a new request may also go to an idle decode engine (it serves the
request whole; idle: nothing of ours in flight there and nothing reported running or waiting,
`EngineView.queue_length`), and the prefill engine itself is one of a hand-off's candidates (the policy's
least-loaded pick may keep it there, to be decoded in place, with no KV moved).
Later features (escalating a cascade stage, handing over to the next stage) are further events of this class,
so the simulator runs them too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

from gateway.cluster.health import FailureReason
from gateway.dispatch.features import RoutingHints, build_features, estimate_prompt_tokens, prefix_keys_of
from gateway.dispatch.retry import RetryBudget
from gateway.domain import (
    ClusterSnapshot,
    EngineId,
    EngineRequest,
    EngineView,
    Finished,
    MigrationTicket,
    RequestFeatures,
    RouteTag,
)
from gateway.policies.base import SHED, Policy, prefix_source
from switchyard.roles import DECODE_ROLE, PREFILL_ROLE

DEFAULT_MAX_ATTEMPTS = 3
# Resumptions of one choice after migrations (moves and fallbacks together): CascadeInfer's hand-overs
# cross up to one stage wall each (the rescheduler stops at 15, `gateway.rescheduling.length_stages`).
DEFAULT_MAX_FOLLOWS = 16


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
    route: RouteTag | None = None  # a weighted policy's tag for the pick (`WeightedPolicy`), for the ledger
    why: str = ""  # an explaining policy's reason (`ExplainedPolicy.decide`), for metrics and logs


@dataclass(frozen=True, slots=True)
class GiveUp:
    """Effect: no engine can serve the request (none eligible, or every one tried was unavailable)."""

    message: str
    attempts: int


@dataclass(frozen=True, slots=True)
class Shed:
    """Effect: the policy shed the request (`policies.base.SHED`: no engine can serve it within its SLO).
    Live: a 503 `fleet_saturated` (`reason`, the admission gate's) with Retry-After; simulated: a failed
    request. `why`: the policy's reason, for metrics and logs."""

    message: str
    reason: str = "slo_unattainable"
    why: str = SHED
    retry_after_s: float = 1.0


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


@dataclass(frozen=True, slots=True)
class Follow:
    """Effect: resume the migrated choice on `dispatch.engine_id` with `ticket` (note the dispatch with
    `record_dispatch`, open the engine's `MigrateIn`), dropping the first `skip_tokens` tokens it streams (the
    client has them already)."""

    dispatch: Dispatch
    ticket: MigrationTicket
    skip_tokens: int
    # Resume without KV: the executor re-tickets `ticket` with the token ids it relayed (`relayed` of them)
    # and no KV, and drops nothing.
    recompute: bool = False
    handoff: bool = False  # a prefill engine's hand-off to a decode engine (not a rescheduler's move)


Decision = Dispatch | GiveUp | Shed


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
        route: RouteTag | None = None,
        prefix_keys: Sequence[int] = (),
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


def prefix_lookup(
    request: EngineRequest, policy: Policy, match: Callable[[tuple[int, ...], str], Mapping[EngineId, int]]
) -> tuple[tuple[int, ...], Mapping[EngineId, int] | None]:
    """A new choice's `prefix_keys` and `prefix_hits` for `policy` (both executors call this before building
    the `ChoiceLife`): nothing unless the policy reads them (`prefix_source`); else the prompt's index keys
    and, when there are any, `match(keys, source)` (the cluster state's `prefix_match` at the executor's
    now)."""
    source = prefix_source(policy)
    if source is None:
        return (), None
    keys = prefix_keys_of(request)
    return keys, (match(keys, source) if keys else None)


def record_dispatch(ledger: DispatchLedger, dispatch: Dispatch) -> None:
    """Apply a `Dispatch` effect's accounting (the one place its fields map onto `note_dispatch`)."""
    f = dispatch.features
    ledger.note_dispatch(
        dispatch.engine_id, f.request_id, f.prompt_tokens, f.max_tokens, f.session_id, f.now_s,
        route=dispatch.route, prefix_keys=f.prefix_keys,
    )


_NO_ENGINES: frozenset[EngineId] = frozenset()
_NO_HITS: Mapping[EngineId, int] = MappingProxyType({})
_ENTRY_MEMO: dict[tuple[int, str], frozenset[EngineId]] = {}
_ENTRY_MEMO_SIZE = 64


def decode_only(snapshot: ClusterSnapshot, model: str) -> frozenset[EngineId]:
    """The decode-role engines of `model` a new request must not be routed to: every one of them while the
    model has a serving engine of another role, else none (decode engines then serve whole requests rather
    than none at all). Memoised by `snapshot.membership` (roles are part of it)."""
    key = (snapshot.membership, model)
    if key[0] >= 0:
        memo = _ENTRY_MEMO.get(key)
        if memo is not None:
            return memo
    decode: list[EngineId] = []
    other = False
    for e in snapshot.serving(model):
        if e.role == DECODE_ROLE:
            decode.append(e.engine_id)
        else:
            other = True
    out = frozenset(decode) if decode and other else _NO_ENGINES
    if key[0] >= 0:
        if len(_ENTRY_MEMO) >= _ENTRY_MEMO_SIZE:
            _ENTRY_MEMO.clear()
        _ENTRY_MEMO[key] = out
    return out


def _idle(view: EngineView | None) -> bool:
    """Nothing of ours in flight on the engine and nothing reported running or waiting there."""
    return view is not None and view.inflight_requests == 0 and view.queue_length == 0


def handoff_targets(snapshot: ClusterSnapshot, model: str, source: EngineView,
                    exclude: frozenset[EngineId]) -> frozenset[EngineId]:
    """Where a hand-off from the prefill engine `source` may resume: the serving decode engines of its combo
    not in `exclude`; none: of any combo (empty when no decode engine is left)."""
    decode = [e for e in snapshot.serving(model) if e.role == DECODE_ROLE and e.engine_id not in exclude]
    same = [e.engine_id for e in decode if source.combo and e.combo == source.combo]
    return frozenset(same or [e.engine_id for e in decode])


class LifeError(RuntimeError):
    """An executor fed an event the life's state does not allow (an executor bug, never the client's)."""


class ChoiceLife:
    """The decisions of one choice: build it on arrival, feed it events, apply what it returns."""

    __slots__ = (
        "request",
        "hints",
        "prompt_tokens",
        "max_attempts",
        "session_engine",
        "session_last_used_s",
        "prefix_keys",
        "prefix_hits",
        "budget",
        "tried",
        "decisions",
        "last_error",
        "current",
        "first_token_s",
        "streaming",
        "done",
        "relayed",
        "ticket",
        "migrated_from",
        "follow_tried",
        "follows",
        "resumptions",
        "max_follows",
        "recompute",
        "bare",
        "died",
    )

    def __init__(
        self,
        request: EngineRequest,
        hints: RoutingHints,
        *,
        session_engine: EngineId | None = None,
        session_last_used_s: float = 0.0,
        prefix_keys: tuple[int, ...] = (),
        prefix_hits: Mapping[EngineId, int] | None = None,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        budget: RetryBudget | None = None,
        max_follows: int = DEFAULT_MAX_FOLLOWS,
        recompute: bool = False,
    ) -> None:
        """`budget`: the executor's gateway-wide retry budget (None: retries bounded by `max_attempts` only,
        without backoff). `recompute`: the executor can resume without KV (see the module docstring).
        `prefix_keys` / `prefix_hits`: the prompt's index-block keys and how many of them each engine holds,
        looked up by the executor when the policy reads them (`gateway.dispatch.features.prefix_lookup`)."""
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")
        self.request = request
        self.hints = hints
        self.prompt_tokens = estimate_prompt_tokens(request)
        self.max_attempts = max_attempts
        self.session_engine = session_engine
        self.session_last_used_s = session_last_used_s
        self.prefix_keys = prefix_keys
        self.prefix_hits: Mapping[EngineId, int] = prefix_hits if prefix_hits is not None else _NO_HITS
        self.budget = budget
        self.tried: list[EngineId] = []
        self.decisions: list[Decision] = []
        self.last_error: str | None = None
        self.current: Dispatch | None = None
        self.first_token_s: float | None = None
        self.streaming = False
        self.done = False
        self.relayed = 0  # output tokens relayed to the client so far (the splice's position)
        self.ticket: MigrationTicket | None = None  # the migration being followed
        self.migrated_from: EngineId | None = None  # the engine that cut it
        self.follow_tried: list[EngineId] = []  # engines tried for the current ticket
        self.follows = 0  # resumed attempts opened (refused ones too)
        self.resumptions = 0  # resumed attempts that began (their first event came)
        self.max_follows = max_follows
        self.recompute = recompute
        self.bare = False  # following without KV (recompute) rather than the ticket's KV
        self.died: list[EngineId] = []  # engines that failed a resumed stream after its first event

    # ---- routing -------------------------------------------------------------------------------------------

    def route(self, policy: Policy, moment: Moment) -> Decision:
        """The next engine for this choice, or why there is none. Excludes every engine tried so far."""
        if self.streaming or self.done or self.current is not None:
            raise LifeError("route() while an attempt is open or after the stream began")
        if len(self.tried) >= self.max_attempts:
            return self._give_up()
        if not self.tried and self.budget is not None:
            self.budget.on_start(moment.now_s)
        excluded = frozenset(self.tried)
        if self.hints.avoid:
            excluded |= self.hints.avoid
        snapshot = moment.snapshot
        decode = decode_only(snapshot, self.request.model)
        if decode and getattr(policy, "in_place", False):  # idle decode engines may serve whole requests
            decode = frozenset(e.engine_id for e in snapshot.serving(self.request.model)
                               if e.engine_id in decode and not _idle(e))
        features = self._features(moment, excluded | decode if decode else excluded, follow=False)
        route: RouteTag | None = None
        why = ""
        choose = getattr(policy, "choose", None)  # a `WeightedPolicy` (isinstance on a Protocol costs ~9 µs)
        if choose is not None:
            engine_id, route = choose(features, moment.snapshot)
        else:
            decide = getattr(policy, "decide", None)  # an `ExplainedPolicy`
            if decide is not None:
                engine_id, why = decide(features, moment.snapshot)
            else:
                engine_id = policy.pick(features, moment.snapshot)
        if engine_id is None:
            if why == SHED:
                model = self.request.model
                shed = Shed(f"no engine can serve this request to model {model!r} within its SLO")
                self.done = True
                self.decisions.append(shed)
                return shed
            return self._give_up()
        self.tried.append(engine_id)
        dispatch = Dispatch(engine_id=engine_id, features=features, attempt=len(self.tried), route=route,
                            why=why)
        self.current = dispatch
        self.decisions.append(dispatch)
        return dispatch

    def _features(self, moment: Moment, exclude: frozenset[EngineId], *, follow: bool) -> RequestFeatures:
        """The policy's view of this choice at `moment`, without `exclude`. A follow (resuming a migrated
        choice) ignores session affinity: the session's engine is the one that just gave the request up."""
        return build_features(
            self.request,
            self.hints,
            prompt_tokens=self.prompt_tokens,
            now_s=moment.now_s,
            dispatch_seq=moment.dispatch_seq,
            rand=moment.rand,
            session_engine=None if follow else self.session_engine,
            session_last_used_s=0.0 if follow else self.session_last_used_s,
            exclude=exclude,
            resumed_tokens=self.ticket.output_tokens if follow and self.ticket is not None else 0,
            prefix_keys=self.prefix_keys,
            prefix_hits=self.prefix_hits,
        )

    def _give_up(self, why: str = "") -> GiveUp:
        detail = (
            f" after {len(self.tried)} unavailable engine(s){why}: {self.last_error}"
            if self.last_error is not None
            else ""
        )
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
        if self.ticket is not None:
            self.resumptions += 1
        return Outcome(dispatch.engine_id, None, now_s)

    def on_token(self, now_s: float, num_tokens: int = 1) -> None:
        """`num_tokens` tokens reached the client at `now_s`."""
        if self.first_token_s is None:
            self.first_token_s = now_s
        self.relayed += num_tokens

    # ---- following a migration -----------------------------------------------------------------------------

    def on_migrated(self, ticket: MigrationTicket) -> None:
        """The open attempt's stream ended with `Migrated(ticket)`; the executor closes it (`on_closed`) and
        then asks `follow`."""
        dispatch = self._open()
        if not self.streaming:
            raise LifeError("on_migrated() before the stream began")
        self.ticket = ticket
        self.migrated_from = dispatch.engine_id
        self.follow_tried = []
        self.bare = False

    def follow(self, policy: Policy, moment: Moment) -> Follow | StreamFailed:
        """Where to resume the migrated choice (see the module docstring), or why it cannot be."""
        ticket = self.ticket
        if ticket is None or self.current is not None or self.done:
            raise LifeError("follow() without a migration to follow, or with an attempt open")
        if self.bare:
            return self._follow_bare(policy, moment, ticket)
        if self.relayed < ticket.output_tokens:
            return self._fail(
                f"the client has {self.relayed} tokens but the engine cut the request after "
                f"{ticket.output_tokens}: tokens would be lost"
            )
        if self.resumptions >= self.max_follows:
            return self._fail(
                f"the request resumed {self.resumptions} times; no further resumption is allowed"
            )
        serving = {e.engine_id for e in moment.snapshot.serving(self.request.model)}
        source = self.migrated_from  # the gateway's id (the ticket names the agent's)
        assert source is not None
        tried = self.follow_tried
        engine_id: EngineId | None = None
        named = EngineId(ticket.target)
        if ticket.target and named in serving and named not in tried:
            engine_id = named
        excluded = frozenset((*tried, source))
        source_view = moment.snapshot.get(source)
        handoff = source_view is not None and source_view.role == PREFILL_ROLE
        if engine_id is None and source_view is not None and handoff:  # the policy's pick among the targets
            targets = handoff_targets(moment.snapshot, self.request.model, source_view, excluded)
            if targets and source in serving and source not in tried and getattr(policy, "in_place", False):
                targets |= {source}  # in place: the prefill engine may decode it itself, no KV moves
            if targets:
                others = frozenset(serving) - targets
                engine_id = policy.pick(self._features(moment, (excluded - targets) | others, follow=True),
                                        moment.snapshot)
        features = self._features(moment, excluded, follow=True)
        if engine_id is None:
            engine_id = policy.pick(features, moment.snapshot)
        if engine_id is None and source not in tried and source in serving:
            engine_id = source
        if engine_id is None:
            if self.recompute:  # every candidate refused the KV: recompute anywhere
                self.bare = True
                self.follow_tried = []
                return self._follow_bare(policy, moment, ticket)
            return self._no_engine()
        return self._open_follow(engine_id, features, ticket, self.relayed - ticket.output_tokens, False,
                                 handoff)

    def _follow_bare(self, policy: Policy, moment: Moment, ticket: MigrationTicket) -> Follow | StreamFailed:
        """Resume without KV on any serving engine not tried for this kind of ticket and not dead."""
        if self.resumptions >= self.max_follows:
            return self._fail(
                f"the request resumed {self.resumptions} times; no further resumption is allowed"
            )
        excluded = frozenset((*self.follow_tried, *self.died))
        features = self._features(moment, excluded, follow=True)
        engine_id = policy.pick(features, moment.snapshot)
        if engine_id is None:
            return self._no_engine()
        return self._open_follow(engine_id, features, ticket, 0, True)

    def _open_follow(
        self,
        engine_id: EngineId,
        features: RequestFeatures,
        ticket: MigrationTicket,
        skip_tokens: int,
        recompute: bool,
        handoff: bool = False,
    ) -> Follow:
        self.follow_tried.append(engine_id)
        self.follows += 1
        dispatch = Dispatch(engine_id=engine_id, features=features, attempt=len(self.tried) + self.follows)
        self.current = dispatch
        return Follow(dispatch, ticket, skip_tokens, recompute, handoff)

    def _no_engine(self) -> StreamFailed:
        detail = f": {self.last_error}" if self.last_error else ""
        return self._fail(f"no engine could resume the migrated request{detail}")

    def on_follow_failed(self, error: str) -> None:
        """The resumed attempt failed before its first event: `follow` tries the next candidate."""
        self._open()
        self.last_error = error

    def on_resume_failed(self, error: str) -> bool:
        """The resumed attempt failed after its first event (its engine died mid-stream). True: close it and
        `follow` again, re-ticketed without KV from the relayed tokens, on an engine other than the dead
        ones; False (not a migrated choice, or the life cannot recompute): a stream error, and the life is
        done."""
        dispatch = self._open()
        if self.ticket is None or not self.recompute or self.done:
            self.done = True
            return False
        self.last_error = error
        self.died.append(dispatch.engine_id)
        self.bare = True
        self.follow_tried = []
        return True

    def _fail(self, message: str) -> StreamFailed:
        self.done = True
        return StreamFailed(message)

    def on_finished(self, event: Finished, now_s: float) -> RecordLatency | StreamFailed | None:
        """The engine's finish: a latency sample for its engine on success (None after a migration: the
        latencies are not one engine's), else the stream's error."""
        dispatch = self._open()
        self.done = True
        if event.finish_reason in ("error", "abort"):
            return StreamFailed(event.error_message or f"engine finished with {event.finish_reason}")
        if self.ticket is not None:
            return None
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
