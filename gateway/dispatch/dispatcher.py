"""The live executor of a request's life: real engine streams, the real clock, the cluster store.

Owns: `Dispatcher`: for each choice, run `ChoiceLife` (`gateway.dispatch.life`, the pure decisions the
simulator runs too) with the clock reading, dispatch sequence number, random draw and snapshot it samples;
execute its effects (note the dispatch, open the engine stream, retry elsewhere after `EngineUnavailable`
before the first event, release the dispatch with `note_finish` however the attempt ends, record the latency
sample of a successful finish); relay events to an `EventSink`; fan out n choices and merge them by choice
index; enforce the request timeout; close the engine stream whenever the relay ends early (the engine aborts);
count client disconnects; time each routing decision and hand it to `on_decision` (debug log by default);
apply the life's transport outcomes to outlier detection (`record_outcome`); wait out a retry's jittered
backoff; and watch for stalls (`StallWatch`): an attempt waiting on its engine that produced no event for
`engine_stall_timeout_s` is cancelled and becomes a `stall` failure (retried elsewhere before the first
event, a stream error after it); follow migrations (`_follow`), keeping the token ids a resumed stream
produced since its ticket's cut, so that a resumption without KV (the life's recompute and re-ticket) goes
out as the ticket plus those ids (built by the resuming engine's `RecomputingClient`). Must not: decide where
to route or whether to retry (the life does), format HTTP or SSE (the sink does), parse requests, or mutate
the cluster beyond note_dispatch / finish / latency / success / failure.

Stall detection costs the relay two attribute writes and an increment per event: one `StallWatch` task scans
the open attempts every `tick_s` (a quarter of the timeout, at most 1 s), so a stall is noticed between
`engine_stall_timeout_s` and that plus `tick_s` after the last event. Only time spent waiting on the engine
counts: an attempt whose consumer (the client's socket) is slow is never a stall.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Protocol

from gateway.cluster.health import FailureReason
from gateway.dispatch.cancel import IDLE_STREAM_CANCEL
from gateway.dispatch.features import RoutingHints
from gateway.dispatch.life import (
    DEFAULT_MAX_ATTEMPTS,
    ChoiceLife,
    Decision,
    DispatchLedger,
    GiveUp,
    Moment,
    Outcome,
    OutcomeLedger,
    Shed,
    StreamFailed,
    prefix_lookup,
    record_dispatch,
    record_outcome,
)
from gateway.dispatch.policy_set import PolicySet
from gateway.dispatch.retry import RetryBudget
from gateway.dispatch.stall import Stalled, StallWatch, Watched
from gateway.domain import (
    Admitted,
    ClusterSnapshot,
    Delta,
    EngineEvent,
    EngineId,
    EngineRequest,
    EngineStreamError,
    EngineUnavailable,
    Finished,
    Migrated,
    MigrationTicket,
    StreamEvent,
)
from gateway.engines.base import EngineClient, MigratingClient, RecomputingClient
from gateway.observability.metrics import GatewayMetrics
from gateway.policies.base import Policy
from switchyard.clock import Clock

log = logging.getLogger(__name__)


class RoutingState(DispatchLedger, OutcomeLedger, Protocol):
    """The part of the cluster store the dispatcher uses (`note_dispatch` from the life's ledger)."""

    def snapshot(self) -> ClusterSnapshot: ...

    def note_finish(self, engine_id: EngineId, request_id: str) -> None: ...

    def note_latency(self, engine_id: EngineId, ttft_s: float, e2e_s: float, now_s: float) -> None: ...

    def session_lookup(self, session_id: str) -> tuple[EngineId | None, float]: ...

    def prefix_match(self, keys: Sequence[int], source: str) -> dict[EngineId, int]: ...

    def client(self, engine_id: EngineId) -> EngineClient:
        """The client of an engine in the snapshot (KeyError when unknown)."""
        ...


class EventSink(Protocol):
    """Where events go (the API's SSE writer or body collector). Raises `ClientDisconnected` if the client
    left."""

    async def on_event(self, index: int, event: EngineEvent) -> None: ...


class ClientDisconnected(Exception):
    """The client went away; the dispatcher closes the engine streams and counts it."""


class NoEngineAvailable(Exception):
    """No engine could take the request (none eligible, or all tried ones unavailable)."""


class RequestShed(NoEngineAvailable):
    """The policy shed the request (the life's `Shed`): answered 503 `fleet_saturated` with Retry-After, as
    the admission gate's refusals (a cascade treats it as its stage being unavailable)."""

    def __init__(self, message: str, reason: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


class RequestTimedOut(Exception):
    """The request did not finish within the configured timeout."""


class Dispatcher:
    def __init__(
        self,
        *,
        state: RoutingState,
        policies: PolicySet,
        clock: Clock,
        rng: random.Random,
        metrics: GatewayMetrics,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        request_timeout_s: float = 600.0,
        on_decision: Callable[[Decision], None] | None = None,
        retry_budget: RetryBudget | None = None,
        stall_watch: StallWatch | None = None,
    ) -> None:
        """`retry_budget`: None retries up to `max_attempts` at once, without a budget or backoff.
        `stall_watch`: None detects no stalls (run the watch's `run()` as a background task)."""
        self._state = state
        self._policies = policies
        self._clock = clock
        self._rng = rng
        self._metrics = metrics
        self._max_attempts = max_attempts
        self.request_timeout_s = request_timeout_s
        self._seq = itertools.count()
        self._shutting_down = False
        self._on_decision = on_decision or _log_decision
        self._budget = retry_budget
        self.stall_watch = stall_watch
        self._releases: set[asyncio.Task[None]] = set()  # `MigratingClient.release` calls in flight

    def begin_shutdown(self) -> None:
        """From now on a cancelled relay is the server draining, not a client disconnect."""
        self._shutting_down = True

    async def run(self, requests: Sequence[EngineRequest], hints: RoutingHints, sink: EventSink) -> None:
        """Serve all choices of one API request into `sink`, within the request timeout.

        Raises `NoEngineAvailable`, `RequestTimedOut`, `EngineStreamError`, `EngineRequestError` (from the
        engine client) or `ClientDisconnected`; engine streams are closed before it returns or raises.
        """
        try:
            async with asyncio.timeout(self.request_timeout_s):
                if len(requests) == 1:
                    await self._relay_one(requests[0], hints, sink)
                else:
                    await self._relay_many(requests, hints, sink)
        except TimeoutError as e:
            raise RequestTimedOut(f"no finish within {self.request_timeout_s:g} s") from e
        except ClientDisconnected:  # a write to a gone client failed
            self._metrics.client_disconnects.inc()
            raise
        except asyncio.CancelledError as e:  # aiohttp cancels the handler when its client goes away ...
            # ... and shutdown or the idle-stream bound end a request, which is no disconnect.
            if not self._shutting_down and e.args != (IDLE_STREAM_CANCEL,):
                self._metrics.client_disconnects.inc()
            raise

    async def _relay_one(self, request: EngineRequest, hints: RoutingHints, sink: EventSink) -> None:
        async with contextlib.aclosing(self.generate(request, hints)) as events:
            async for event in events:
                await sink.on_event(0, event)

    async def _relay_many(
        self, requests: Sequence[EngineRequest], hints: RoutingHints, sink: EventSink
    ) -> None:
        queue: asyncio.Queue[tuple[int, EngineEvent | BaseException | None]] = asyncio.Queue()

        async def pump(index: int, request: EngineRequest) -> None:
            try:
                async with contextlib.aclosing(self.generate(request, hints)) as events:
                    async for event in events:
                        queue.put_nowait((index, event))
                queue.put_nowait((index, None))
            except Exception as e:  # handed to the relaying task, which raises it
                queue.put_nowait((index, e))

        tasks = [
            asyncio.create_task(pump(i, r), name=f"choice-{r.request_id}") for i, r in enumerate(requests)
        ]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    await sink.on_event(index, item)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def generate(
        self, request: EngineRequest, hints: RoutingHints
    ) -> AsyncGenerator[EngineEvent, None]:
        """One choice's events, routed and retried before the first event; use under `contextlib.aclosing`.

        The decisions are `ChoiceLife`'s (the simulator runs the same); this method executes them: it samples
        the clock, the dispatch counter, the randomness and the snapshot for each decision, opens and closes
        engine streams, and applies the ledger effects to the cluster store.
        """
        session_engine: EngineId | None = None
        session_last_used_s = 0.0
        if hints.session_id:
            session_engine, session_last_used_s = self._state.session_lookup(hints.session_id)
        policy_name, policy = self._policies.resolve(hints.policy_name)
        prefix_keys, prefix_hits = prefix_lookup(request, policy, self._state.prefix_match)
        life = ChoiceLife(
            request,
            hints,
            session_engine=session_engine,
            session_last_used_s=session_last_used_s,
            prefix_keys=prefix_keys,
            prefix_hits=prefix_hits,
            max_attempts=self._max_attempts,
            budget=self._budget,
            recompute=True,
        )
        state, clock, metrics = self._state, self._clock, self._metrics
        decisions = metrics.routing_decisions
        watch = self.stall_watch
        while True:
            started_s = clock.now()
            moment = Moment(started_s, next(self._seq), self._rng.random(), state.snapshot())
            decision = life.route(policy, moment)
            metrics.routing_decision.labels(policy_name).observe(clock.now() - started_s)
            if log.isEnabledFor(logging.DEBUG):
                _debug_decision(policy_name, policy, decision, moment)
            del moment  # its snapshot (a view per engine) must not live as long as the stream does
            self._on_decision(decision)
            if isinstance(decision, GiveUp):
                decisions.labels(policy_name, "no_engine").inc()
                raise NoEngineAvailable(decision.message)
            if isinstance(decision, Shed):
                decisions.labels(policy_name, "shed").inc()
                metrics.policy_picks.labels(policy_name, decision.why).inc()
                raise RequestShed(decision.message, decision.reason, decision.retry_after_s)
            decisions.labels(policy_name, "dispatch" if decision.attempt == 1 else "retry").inc()
            if decision.why:
                metrics.policy_picks.labels(policy_name, decision.why).inc()
            engine_id = decision.engine_id
            client = state.client(engine_id)
            record_dispatch(state, decision)
            stream = client.generate(request)
            watched = watch.open() if watch is not None else None
            backoff_s = 0.0
            try:
                try:
                    first = await _next_event(stream, watched)
                except (EngineUnavailable, StopAsyncIteration, Stalled) as e:
                    reason, error = _failure_of(e)
                    self._apply(life.failure(reason, clock.now()))
                    after = life.on_unavailable(error, clock.now(), self._rng.random())
                    log.info("request %s: engine %s unavailable (%s)", request.request_id, engine_id, error)
                    if isinstance(after, GiveUp):
                        self._on_decision(after)
                        budget_spent = after.attempts < self._max_attempts
                        if budget_spent:
                            metrics.retry_budget_exhausted.inc()
                        decisions.labels(policy_name, "retry_budget" if budget_spent else "no_engine").inc()
                        raise NoEngineAvailable(after.message) from None
                    metrics.retries.inc()
                    backoff_s = after.delay_s
                    continue
                self._apply(life.on_first_event(clock.now()))
                timing = _ChoiceTiming(hints.arrival_s)
                event = first
                while True:
                    if isinstance(event, Migrated):
                        life.on_migrated(event.ticket)
                        timing.migrated_s = clock.now()
                        break
                    finished = self._observe(event, timing, life)
                    yield event
                    if finished:
                        return
                    event = await _stream_event(stream, watched)
            except EngineStreamError as e:  # the engine failed it: a stall, a broken stream, an error finish
                e.engine_id = engine_id  # which engine (a cascade runs a buffered stage again elsewhere)
                stalled = watched is not None and watched.stalled
                if life.current is not None:
                    self._apply(life.failure("stall" if stalled else "server_errors", clock.now()))
                metrics.stream_errors.labels("stall" if stalled else "engine").inc()
                raise
            finally:
                try:
                    await self._close_attempt(stream, watched, life, request.request_id)
                finally:
                    if backoff_s > 0:
                        await asyncio.sleep(backoff_s)
            # Only a migration leaves the loop this way (a finish returned, a failure raised): follow it.
            async for resumed in self._follow(life, policy, request, timing):
                yield resumed
            return

    async def _follow(
        self, life: ChoiceLife, policy: Policy, request: EngineRequest, timing: _ChoiceTiming
    ) -> AsyncIterator[EngineEvent]:
        """Resume a migrated choice where the life says (`ChoiceLife.follow`) and relay the rest of its
        stream: the resumed stream's `Admitted` is dropped (the client had the role chunk), its first
        `skip_tokens` tokens too (the client has them), and a resumed stream can migrate again.

        The token ids a resumed stream produced since the ticket's cut (relayed or dropped) are kept here, not
        in the pure life: a resumption without KV (`Follow.recompute`: every engine refused the KV, or the
        resumed engine died mid-stream) goes out as the ticket re-built by the resuming engine's client
        (`RecomputingClient.without_kv`) with the ticket's output tokens plus these, and drops the tokens the
        client has beyond them."""
        state, clock, metrics, watch = self._state, self._clock, self._metrics, self.stall_watch
        after_cut: list[int] = []  # token ids the resumed streams produced since `life.ticket`'s cut
        seen: MigrationTicket | None = None
        held: MigrationTicket | None = None  # the cut whose KV its source holds until a resumption pulls it
        try:
            while True:
                ticket = life.ticket
                assert ticket is not None
                if ticket is not seen:
                    seen = ticket
                    held = ticket if ticket.kv_tokens > 0 else None
                step = life.follow(
                    policy, Moment(clock.now(), next(self._seq), self._rng.random(), state.snapshot())
                )
                if held is not None and not isinstance(step, StreamFailed) and step.recompute:
                    self._release(held)  # resumed without KV from here on: nobody will pull it
                    held = None
                if isinstance(step, StreamFailed):
                    metrics.migrations.labels("failed").inc()
                    metrics.stream_errors.labels("migration").inc()
                    raise EngineStreamError(step.message)
                dispatch = step.dispatch
                engine_id = dispatch.engine_id
                client = state.client(engine_id)
                if not isinstance(client, MigratingClient) or (
                    step.recompute and not isinstance(client, RecomputingClient)
                ):
                    life.on_follow_failed(f"engine {engine_id} cannot resume a migrated request this way")
                    life.on_closed()
                    continue
                skip = step.skip_tokens
                resume_ticket = step.ticket
                if step.recompute:
                    assert isinstance(client, RecomputingClient)
                    skip = life.relayed - ticket.output_tokens - len(after_cut)
                    if skip < 0:  # a delta without its token ids: the re-ticket would not match the client's
                        life.on_follow_failed("the relayed token ids are incomplete: cannot re-ticket")
                        life.on_closed()
                        continue
                    try:
                        resume_ticket = client.without_kv(ticket, after_cut)
                    except ValueError as e:
                        life.on_follow_failed(str(e))
                        life.on_closed()
                        continue
                record_dispatch(state, dispatch)
                stream = client.resume(resume_ticket, request)
                watched = watch.open() if watch is not None else None
                resumed = False
                try:
                    try:
                        event = await _next_event(stream, watched)
                    except (EngineUnavailable, StopAsyncIteration, Stalled) as e:
                        reason, error = _failure_of(e)
                        self._apply(life.failure(reason, clock.now()))
                        life.on_follow_failed(error)
                        log.info(
                            "request %s: engine %s did not resume it (%s)",
                            request.request_id,
                            engine_id,
                            error,
                        )
                        continue
                    self._apply(life.on_first_event(clock.now()))
                    metrics.migrations.labels(
                        "handoff" if step.handoff else "resumed" if engine_id == ticket.target else "fallback"
                    ).inc()
                    resumed = True
                    if not step.recompute:
                        held = None  # the resuming engine pulled the KV before its first event
                    while True:
                        if isinstance(event, Migrated):
                            life.on_migrated(event.ticket)
                            after_cut.clear()
                            timing.migrated_s = clock.now()
                            break
                        if isinstance(event, Delta):  # a re-ticket's stream starts after the ids it carries
                            after_cut.extend(event.token_ids)
                        if isinstance(event, Delta) and skip > 0:
                            if event.num_tokens > skip:
                                raise EngineStreamError(
                                    f"the resumed stream's delta of {event.num_tokens} tokens straddles the "
                                    f"{skip} the client already has"
                                )
                            skip -= event.num_tokens
                        elif not isinstance(event, Admitted):
                            if timing.migrated_s is not None and isinstance(event, Delta):
                                metrics.splice_stall.observe(clock.now() - timing.migrated_s)
                                timing.migrated_s = None
                            finished = self._observe(event, timing, life)
                            yield event
                            if finished:
                                return
                        event = await _stream_event(stream, watched)
                except EngineStreamError as e:
                    stalled = watched is not None and watched.stalled
                    if life.current is not None:
                        self._apply(life.failure("stall" if stalled else "server_errors", clock.now()))
                        if resumed and life.on_resume_failed(str(e)):  # re-ticket from what was relayed
                            log.info(
                                "request %s: engine %s failed the resumed stream (%s); re-ticketing, no KV",
                                request.request_id,
                                engine_id,
                                e,
                            )
                            timing.migrated_s = clock.now()
                            continue
                    if not resumed:
                        metrics.migrations.labels("failed").inc()
                    metrics.stream_errors.labels("stall" if stalled else "engine").inc()
                    raise
                finally:
                    await self._close_attempt(stream, watched, life, request.request_id)
        finally:
            if held is not None:  # the client left, or the splice failed, before anything pulled it
                self._release(held)

    async def _close_attempt(
        self, stream: AsyncIterator[StreamEvent], watched: Watched | None, life: ChoiceLife, request_id: str
    ) -> None:
        """End one engine attempt, however it ended: stop watching it for stalls, close its stream (the engine
        cancels the request if it still runs) and release its dispatch in the ledger."""
        if watched is not None and self.stall_watch is not None:
            self.stall_watch.close(watched)
        try:
            with contextlib.suppress(Exception):
                await stream.aclose()  # type: ignore[attr-defined]
        finally:
            released = life.on_closed()
            if released is not None:
                self._state.note_finish(released, request_id)

    def _release(self, ticket: MigrationTicket) -> None:
        """Tell a cut's source that its held KV will not be pulled, in the background (the client's stream
        does not wait on a source that may be dead)."""
        client = self._state.client(ticket.source_engine_id)
        if not isinstance(client, MigratingClient):
            return
        task = asyncio.create_task(client.release(ticket.request_id), name=f"release-{ticket.request_id}")
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    def _apply(self, outcome: Outcome) -> None:
        """Apply a transport outcome to outlier detection; count and log a change of pool membership."""
        if not record_outcome(self._state, outcome):
            return
        if outcome.reason is None:
            log.info("engine %s is back in the pool (a request succeeded)", outcome.engine_id)
        else:
            self._metrics.outlier_ejections.labels(str(outcome.engine_id), outcome.reason).inc()
            log.warning(
                "engine %s ejected from the pool after consecutive failures (%s)",
                outcome.engine_id,
                outcome.reason,
            )

    def _observe(self, event: EngineEvent, timing: _ChoiceTiming, life: ChoiceLife) -> bool:
        """Feed `event` to the life and the latency metrics; True on a successful finish (its latency sample
        is recorded); an error finish raises `EngineStreamError`."""
        if isinstance(event, Delta):
            now_s = self._clock.now()
            life.on_token(now_s, event.num_tokens)
            if timing.last_token_s is None:
                self._metrics.ttft.observe(now_s - timing.arrival_s)
            else:
                self._metrics.itl.observe(now_s - timing.last_token_s)
            timing.last_token_s = now_s
            return False
        if isinstance(event, Finished):
            now_s = self._clock.now()
            outcome = life.on_finished(event, now_s)
            if isinstance(outcome, StreamFailed):
                raise EngineStreamError(outcome.message)
            self._metrics.e2e.observe(now_s - timing.arrival_s)
            if outcome is not None:  # None: a migrated choice (its latencies are not one engine's)
                self._state.note_latency(outcome.engine_id, outcome.ttft_s, outcome.e2e_s, outcome.now_s)
            return True
        return False


async def _stream_event(stream: AsyncIterator[StreamEvent], watched: Watched | None) -> StreamEvent:
    """The next event of a stream that has begun: its end without a last event, or a stall, is the engine
    failing the stream."""
    try:
        return await _next_event(stream, watched)
    except StopAsyncIteration:
        raise EngineStreamError("engine stream ended without a finish event") from None
    except Stalled as e:
        raise EngineStreamError(str(e)) from None


async def _next_event(stream: AsyncIterator[StreamEvent], watched: Watched | None) -> StreamEvent:
    """The stream's next event; under a stall watch, `Stalled` when the watch gave up waiting for it."""
    if watched is None:
        return await anext(stream)
    watched.awaiting = True
    try:
        event = await anext(stream)
    except asyncio.CancelledError:
        watched.awaiting = False
        if watched.stalled and watched.task.uncancel() == 0:
            raise Stalled(f"the engine produced no event for {watched.timeout_s:g} s") from None
        raise
    watched.awaiting = False
    watched.events += 1
    return event


def _failure_of(error: BaseException) -> tuple[FailureReason, str]:
    """The outlier-detection reason and message of a failure before the first event."""
    if isinstance(error, Stalled):
        return "stall", str(error)
    if isinstance(error, EngineUnavailable):
        return ("server_errors" if error.server_error else "connect_failures"), str(error)
    return "server_errors", "the engine ended the stream without an event"


def _log_decision(decision: Decision) -> None:
    """The default `on_decision`: nothing (the debug line is written by `_debug_decision`)."""


def _debug_decision(policy_name: str, policy: object, decision: Decision, moment: Moment) -> None:
    """At DEBUG: the decision, the policy that made it, why (dispatch, retry or give-up) and, for a policy
    that can score (PRISM's `scores`), every candidate's score and confidence on the same snapshot."""
    if isinstance(decision, GiveUp):
        log.debug(
            "routing: policy=%s reason=give_up attempts=%d: %s",
            policy_name,
            decision.attempts,
            decision.message,
        )
        return
    if isinstance(decision, Shed):
        log.debug("routing: policy=%s reason=shed why=%s: %s", policy_name, decision.why, decision.message)
        return
    f = decision.features
    scores = getattr(policy, "scores", None)
    detail = ""
    if callable(scores):
        detail = " scores=" + ", ".join(f"{e}:{s:.4g}@{c:.2f}" for e, s, c in scores(f, moment.snapshot))
    views = {e.engine_id: e for e in moment.snapshot.serving(f.model)}
    load = ", ".join(f"{e}:q{v.queue_length}{'/stale' if v.stale else ''}" for e, v in views.items())
    log.debug(
        "routing: request=%s policy=%s reason=%s%s engine=%s attempt=%d exclude=%s load=[%s]%s",
        f.request_id,
        policy_name,
        "dispatch" if decision.attempt == 1 else "retry",
        f" why={decision.why}" if decision.why else "",
        decision.engine_id,
        decision.attempt,
        sorted(f.exclude),
        load,
        detail,
    )


class _ChoiceTiming:
    """Client-facing latency metrics of one choice (from the request's arrival, retries included)."""

    __slots__ = ("arrival_s", "last_token_s", "migrated_s")

    def __init__(self, arrival_s: float) -> None:
        self.arrival_s = arrival_s
        self.last_token_s: float | None = None
        self.migrated_s: float | None = None  # when the gateway saw the last `Migrated`, until the next token
