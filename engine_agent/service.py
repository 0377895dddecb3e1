"""The engine agent's gRPC servicer (grpc.aio): the RPCs around one `EngineBackend`.

Owns: the RPC flow: Generate (validate, admit, stream) and Session (the same streams multiplexed on one call:
`engine_agent.session`), streaming deltas with the stream's text
(`engine_agent.output_text`: incremental detokenization, stop-string / stop-token-id semantics, the text's
hand-over at a migration) and ending the stream at a stop string, usage counted from what was streamed, the
WatchState push (interval and prompt on change, `seq` increasing across the process; STAR's round, from
`engine_agent.star.live`, in each watcher's first push after the round, pushed at once; the prefix cache's
KV events, when the backend has the capability: drained into the one `engine_agent.kv_journal` at each push
and sent to each watcher from its own cursor, a resync first), GetInfo, Abort,
MigrateOut / MigrateIn (the original request of each in-flight stream for the ticket, waiting for the source
stream to end at the cut; UNIMPLEMENTED, naming the capability, when the backend's `Capabilities` lack
migration), refusing new Generate / MigrateIn calls while draining, and telling the `on_stream_end` hook how
each stream ended (`StreamEnd`: the STAR recorder labels its hidden states with it), and what STAR's rounds
read of each stream (`running_requests`: prompt and output counts, whether it may be cut now).
Must not: schedule, batch or time tokens (the backend does), translate between proto and domain types itself
(`engine_agent.proto_codec` does: requests, events, state, tickets), own the server, health or signals
(`engine_agent.server` does), or read time other than through the injected `Clock`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import dataclass

import grpc

from engine_agent.backends.base import MIGRATION, Capabilities, EngineBackend, KvEventSource, Migrator
from engine_agent.domain import (
    BackendEvent,
    BackendRequest,
    FinishEvent,
    KvDelta,
    MigratedEvent,
    MigrationRefused,
    MigrationTicket,
    RequestId,
    request_from_ticket,
)
from engine_agent.kv_journal import KvJournal
from engine_agent.output_text import OutputText
from engine_agent.proto_codec import (
    delta_event,
    engine_info,
    engine_state,
    finished_event,
    ticket_from_proto,
    ticket_to_proto,
    to_backend_request,
    watch_interval_s,
)
from engine_agent.session import AgentSession, StreamRefused
from engine_agent.star.live import RunningRequest, StarLive
from engine_agent.tokenization import Tokenizer
from switchyard.clock import Clock
from switchyard.prefix import INDEX_SPAN_TOKENS
from switchyard.proto_gen import engine_agent_pb2 as pb
from switchyard.proto_gen import engine_agent_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# MigrateOut answers once the source stream has ended (`migrated`, or `finished` when a stop string matched in
# the tokens up to the cut): at most a step after the cut unless the stream's client reads slowly.
_CUT_SETTLE_TIMEOUT_S = 5.0


# Finish reasons of a request that completed (its output length is final); "abort" and "error" did not.
_COMPLETED = ("stop", "length")


@dataclass(frozen=True, slots=True)
class StreamEnd:
    """How one request's stream on this engine ended: what the `on_stream_end` hook is told."""

    request_id: RequestId
    prompt_tokens: int
    # The request's final output length (a migrated-in request's earlier tokens included) when it completed
    # here ("stop" or "length"); None when it did not: aborted, cancelled, failed or migrated away.
    output_tokens: int | None


class _InFlight:
    """What the service keeps per running stream: the request as the client sent it, how the stream ended,
    and what STAR's rounds read of it (`engine_agent.star.live.RunningRequest`)."""

    __slots__ = ("request", "outcome", "ticket", "completed_tokens", "prompt_tokens", "prior_tokens",
                 "output_tokens", "cutting")

    def __init__(self, request: pb.GenerateRequest) -> None:
        self.request = request  # the original request (for MigrateIn streams: the ticket's, under the new id)
        # "migrated", "finished" or "closed" (cancelled, or an error) once the stream has ended.
        self.outcome: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.ticket: pb.MigrationTicket | None = None
        self.completed_tokens: int | None = None  # the output length, once finished with "stop" or "length"
        self.prompt_tokens = 0  # set when it starts serving
        self.prior_tokens = 0  # output tokens produced on earlier engines (MigrateIn)
        self.output_tokens = 0  # output tokens so far, the prior ones included
        self.cutting = False  # MigrateOut is cutting it

    @property
    def migratable(self) -> bool:
        """Decoding here (a migrated-in request once it produced a token here), not being cut, not ended."""
        return self.output_tokens > self.prior_tokens and not self.cutting and not self.outcome.done()

    def end(self, outcome: str, *, completed_tokens: int | None = None) -> None:
        if not self.outcome.done():
            self.outcome.set_result(outcome)
            self.completed_tokens = completed_tokens

    def ticket_proto(self, ticket: MigrationTicket) -> pb.MigrationTicket:
        """The ticket as MigrateOut answers it and the `migrated` event carries it (built once)."""
        if self.ticket is None:
            self.ticket = ticket_to_proto(ticket, self.request)
        return self.ticket


@dataclass(frozen=True, slots=True)
class OpenedStream:
    """An admitted request before it streams: `serving` runs it."""

    record: _InFlight
    request: pb.GenerateRequest
    backend_request: BackendRequest
    events: AsyncIterator[BackendEvent]
    prior: tuple[int, ...]  # output tokens before a migration (empty for Generate)


class AgentService(pb_grpc.EngineAgentServicer):
    """Serves one backend; `start_draining` refuses new Generate calls, `wait_idle` awaits in-flight ones.

    `capabilities`: the backend's optional capabilities as the server decided them at start-up (default:
    whatever the backend implements). `on_stream_end`, when given, is called once per admitted stream as it
    ends (on the loop; it must not block or raise). `star`, when given, publishes STAR's rounds: each
    WatchState watcher's first push after a new round carries it (`running_requests` is what they read).
    """

    def __init__(
        self,
        backend: EngineBackend,
        tokenizer: Tokenizer,
        *,
        clock: Clock,
        state_interval_s: float,
        capabilities: Capabilities | None = None,
        on_stream_end: Callable[[StreamEnd], None] | None = None,
        star: StarLive | None = None,
        combo: str = "",
    ) -> None:
        """`combo`: the GPU combo the engine belongs to (`--combo`), sent in its identity."""
        if state_interval_s <= 0:
            raise ValueError(f"state_interval_s must be > 0, got {state_interval_s}")
        self._backend = backend
        self._capabilities = capabilities if capabilities is not None else Capabilities.of(backend)
        self._tokenizer = tokenizer
        self._clock = clock
        self._state_interval_s = state_interval_s
        self._seq = itertools.count(1)
        self._draining = False
        # False until the server has started the backend: the gRPC server listens first (so health checks
        # answer NOT_SERVING), and a call that arrives in between is refused as retryable, not failed.
        self._started = False
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._requests: dict[RequestId, _InFlight] = {}
        self._on_stream_end = on_stream_end
        self._star = star
        self._kv_journal: KvJournal | None = None  # made at the first watch (the backend has started)
        static = backend.static
        self._identity = pb.EngineIdentity(
            engine_id=static.engine_id,
            model=static.model,
            backend=static.backend,
            profile=static.profile,
            role=static.role,
            combo=combo,
        )

    # -- lifecycle (called by the server) ----------------------------------------------------------

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def mark_started(self) -> None:
        """The backend runs: report ready and accept Generate / MigrateIn."""
        self._started = True

    def start_draining(self) -> None:
        self._draining = True

    def running_requests(self) -> Mapping[RequestId, RunningRequest]:
        """The streams in flight by request id, read-only (STAR's rounds read them on the loop)."""
        return self._requests

    async def wait_idle(self, timeout_s: float) -> bool:
        """True when no Generate call is in flight (within the timeout)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        return self._idle.is_set()

    # -- RPCs --------------------------------------------------------------------------------------------

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        # A coroutine writing events (not an async generator handler), so a client cancel raises inside it
        # wherever it waits and the `aclosing` blocks abort the backend request at once.
        try:
            opened = self.open_generate(request)
        except StreamRefused as exc:
            await context.abort(exc.code, exc.message)
        await self._write_call(context, opened)

    async def Session(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[pb.SessionUp], context: grpc.aio.ServicerContext
    ) -> None:
        await AgentSession(self, context).run(request_iterator)

    def open_generate(self, request: pb.GenerateRequest) -> OpenedStream:
        """Admit one Generate request (Generate or a Session's open); `StreamRefused` says why not."""
        if self._draining:
            raise StreamRefused(
                grpc.StatusCode.UNAVAILABLE, "engine agent is draining; send the request elsewhere"
            )
        if not self._started:
            raise StreamRefused(
                grpc.StatusCode.UNAVAILABLE, "engine agent is starting; send the request elsewhere"
            )
        try:
            backend_request = to_backend_request(
                request, self._tokenizer, max_context_tokens=self._backend.static.max_context_tokens
            )
        except ValueError as exc:
            raise StreamRefused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
        rid = backend_request.request_id
        if rid in self._requests:
            raise StreamRefused(grpc.StatusCode.INVALID_ARGUMENT, f"request id {rid!r} is already running")
        record = _InFlight(request)
        events = self._backend.generate(backend_request)
        return OpenedStream(record, request, backend_request, events, ())

    async def MigrateOut(  # noqa: N802 - gRPC method name
        self, request: pb.MigrateOutRequest, context: grpc.aio.ServicerContext
    ) -> pb.MigrationTicket:
        migrator = await self._migrator(context)
        rid = RequestId(request.request_id)
        record = self._requests.get(rid)
        if record is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"request {rid!r} is not running on this engine")
        record.cutting = True  # not offered to the rescheduler again while the cut runs
        try:
            ticket = await migrator.migrate_out(rid, request.target)
        except MigrationRefused as exc:
            record.cutting = False
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        outcome = "migrated"
        with contextlib.suppress(TimeoutError):
            outcome = await asyncio.wait_for(asyncio.shield(record.outcome), _CUT_SETTLE_TIMEOUT_S)
        if outcome != "migrated":
            reason = "a stop string matched" if outcome == "finished" else "its client closed the stream"
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"request {rid!r} ended at or before the cut ({reason}); there is nothing to resume",
            )
        return record.ticket_proto(ticket)

    async def MigrateIn(  # noqa: N802 - gRPC method name
        self, request: pb.MigrateInRequest, context: grpc.aio.ServicerContext
    ) -> None:
        migrator = await self._migrator(context)
        if self._draining or not self._started:
            what = "draining" if self._draining else "starting"
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"engine agent is {what}; resume the request elsewhere"
            )
        try:
            ticket = ticket_from_proto(request.ticket)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed migration ticket: {exc}")
        rid = RequestId(request.request_id or ticket.request_id)
        if rid in self._requests:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request id {rid!r} is already running")
        try:
            events = migrator.migrate_in(ticket, rid)
        except MigrationRefused as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        original = pb.GenerateRequest()
        original.CopyFrom(request.ticket.request)
        original.request_id = rid
        opened = OpenedStream(
            _InFlight(original), original, request_from_ticket(ticket, rid), events, ticket.output_token_ids
        )
        await self._write_call(context, opened)

    async def _write_call(self, context: grpc.aio.ServicerContext, opened: OpenedStream) -> None:
        """One stream as its call's messages (Generate, MigrateIn); a refusal ends the call, with its code."""
        try:
            async with self.serving(opened) as events:
                async for event in events:
                    await context.write(event)
        except StreamRefused as exc:
            await context.abort(exc.code, exc.message)

    async def _migrator(self, context: grpc.aio.ServicerContext) -> Migrator:
        """The backend's migration capability, or the call ends UNIMPLEMENTED saying why it is absent."""
        migrator = self._capabilities.migrator
        if migrator is not None:
            return migrator
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, self._capabilities.missing(MIGRATION))
        raise AssertionError("unreachable: context.abort raises")

    @contextlib.asynccontextmanager
    async def serving(self, opened: OpenedStream) -> AsyncGenerator[AsyncIterator[pb.GenerateEvent], None]:
        """One admitted stream's events, counted in flight and in `_requests` while the block runs; leaving
        the block early closes the stream, which aborts the request in the backend. Iterating raises
        `StreamRefused` when the backend refuses the request at admission."""
        record, breq = opened.record, opened.backend_request
        rid = breq.request_id
        record.prompt_tokens = len(breq.prompt_token_ids)
        record.prior_tokens = record.output_tokens = len(opened.prior)
        self._requests[rid] = record
        self._in_flight += 1
        self._idle.clear()
        try:
            stream = self._stream(opened.request, breq, opened.events, opened.prior, record)
            async with contextlib.aclosing(stream) as out:
                yield out
        finally:
            record.end("closed")
            if self._requests.get(rid) is record:
                del self._requests[rid]
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()
            if self._on_stream_end is not None:
                self._on_stream_end(StreamEnd(rid, len(breq.prompt_token_ids), record.completed_tokens))

    async def Abort(  # noqa: N802 - gRPC method name
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        found = await self._backend.abort(RequestId(request.request_id))
        return pb.AbortResponse(found=found)

    async def WatchState(  # noqa: N802 - gRPC method name
        self, request: pb.WatchStateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.EngineState]:
        interval_s = watch_interval_s(request) or self._state_interval_s
        backend = self._backend
        star = self._star
        sent_round = 0  # the last STAR round this watcher was sent
        kv_source = self._capabilities.kv_event_source
        kv_cursor: int | None = None  # the last journal batch this watcher was sent (None: a resync is due)
        span_tokens = INDEX_SPAN_TOKENS
        version = await backend.wait_for_change(-1, 0.0)
        while True:
            latest = None if star is None else star.latest
            if latest is not None and latest.round > sent_round:
                sent_round = latest.round
            else:
                latest = None
            kv = None
            if kv_source is not None:
                kv_cursor, kv = self._kv_since(kv_source, kv_cursor)
            yield engine_state(
                backend.stats(),
                identity=self._identity,
                seq=next(self._seq),
                draining=self._draining,
                started=self._started,
                star=latest,
                kv_events=kv,
                kv_span_tokens=span_tokens,
            )
            deadline = self._clock.now() + interval_s
            while (remaining := deadline - self._clock.now()) > 0:
                if star is None:
                    current = await backend.wait_for_change(version, remaining)
                else:
                    current = await self._wait_change_or_round(star, version, remaining, sent_round)
                    latest = star.latest
                    if latest is not None and latest.round > sent_round:
                        version = max(version, current)
                        break
                if current > version:
                    version = current
                    break

    def _kv_since(self, source: KvEventSource, cursor: int | None) -> tuple[int, KvDelta | None]:
        """Drain the backend's KV events into the journal; what a watcher at `cursor` has not been sent."""
        journal = self._kv_journal
        if journal is None:
            journal = self._kv_journal = KvJournal(source.kv_snapshot().stored)
        else:
            journal.append(source.drain_kv_events())
        return journal.since(cursor)

    async def _wait_change_or_round(
        self, star: StarLive, version: int, timeout_s: float, sent_round: int
    ) -> int:
        """`wait_for_change`, also returning when STAR publishes a round after `sent_round` (one more task per
        wait than without STAR; the round's future is shared by every watcher)."""
        latest = star.latest
        if latest is not None and latest.round > sent_round:
            return version
        round_published = star.next_round()
        change = asyncio.ensure_future(self._backend.wait_for_change(version, timeout_s))
        try:
            await asyncio.wait((change, round_published), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not change.done():
                change.cancel()
        return change.result() if change.done() and not change.cancelled() else version

    async def GetInfo(  # noqa: N802 - gRPC method name
        self, request: pb.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.EngineInfo:
        return engine_info(
            self._backend.static,
            identity=self._identity,
            tokenizer=self._tokenizer.identity,
            eos_token_id=self._backend.eos_token_id,
        )

    # -- streaming -------------------------------------------------------------------------------

    async def _stream(
        self,
        request: pb.GenerateRequest,
        breq: BackendRequest,
        backend_events: AsyncIterator[BackendEvent],
        prior: tuple[int, ...],
        record: _InFlight,
    ) -> AsyncGenerator[pb.GenerateEvent, None]:
        prompt_tokens = len(breq.prompt_token_ids)
        stops = list(request.sampling.stop)
        text = OutputText(self._tokenizer, stops, breq.sampling)
        if prior:  # a migrated request: the text state the source stopped in (see `engine_agent.output_text`)
            text.prime(prior)
        emitted = len(prior)
        admitted_s = self._clock.now()
        first_token_s = admitted_s
        yield pb.GenerateEvent(admitted=pb.Admitted(prompt_tokens=prompt_tokens))
        if text.matched is not None:  # not for a ticket cut from a live stream: that would have stopped
            record.end("finished", completed_tokens=emitted)
            yield finished_event(
                "stop", prompt_tokens, emitted, 0, pb.EngineTimings(), stop_reason=text.matched
            )
            return
        # Leaving this block early (stop string, client cancel, error) closes the backend stream, which aborts
        # the request there and frees its KV.
        async with _closing(backend_events) as events:
            try:
                async for event in events:
                    if isinstance(event, MigratedEvent):
                        record.end("migrated")
                        catch_up = text.cut(event.ticket.output_token_ids)
                        if catch_up:
                            yield delta_event((), catch_up)
                        yield pb.GenerateEvent(migrated=pb.Migrated(ticket=record.ticket_proto(event.ticket)))
                        return
                    if isinstance(event, FinishEvent):
                        tail = text.finish()
                        reason = "stop" if text.matched is not None else event.finish_reason
                        record.end("finished", completed_tokens=emitted if reason in _COMPLETED else None)
                        if tail:
                            yield delta_event((), tail)
                        yield finished_event(
                            reason,
                            prompt_tokens,
                            emitted,
                            event.usage.cached_tokens,
                            pb.EngineTimings(
                                queue_s=event.timings.queue_s,
                                prefill_s=event.timings.prefill_s,
                                decode_s=event.timings.decode_s,
                            ),
                            stop_reason=text.matched or "",
                            error_message=event.error_message,
                        )
                        return
                    ids = event.token_ids
                    if emitted == len(prior):
                        first_token_s = self._clock.now()
                    if not text.stops_active:
                        piece = text.add(ids, emitted)
                        emitted += len(ids)
                        record.output_tokens = emitted
                        yield delta_event(ids, piece)
                        continue
                    # Token by token, so a stop string ends the stream at the token that completed it.
                    pieces: list[str] = []
                    for k in range(len(ids)):
                        pieces.append(text.add(ids[k : k + 1], emitted + k))
                        if text.matched is not None:
                            emitted += k + 1
                            record.end("finished", completed_tokens=emitted)
                            yield delta_event(ids[: k + 1], "".join(pieces))
                            now = self._clock.now()
                            yield finished_event(
                                "stop",
                                prompt_tokens,
                                emitted,
                                0,
                                pb.EngineTimings(
                                    prefill_s=first_token_s - admitted_s, decode_s=now - first_token_s
                                ),
                                stop_reason=text.matched,
                            )
                            return
                    emitted += len(ids)
                    record.output_tokens = emitted
                    yield delta_event(ids, "".join(pieces))
            except MigrationRefused as exc:  # a resume refused at admission (e.g. the id was taken meanwhile)
                raise StreamRefused(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from exc
            except ValueError as exc:  # admission refused by the backend (e.g. a duplicate request id)
                raise StreamRefused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc


@contextlib.asynccontextmanager
async def _closing(events: AsyncIterator[BackendEvent]) -> AsyncGenerator[AsyncIterator[BackendEvent], None]:
    """Close the backend stream on leaving the block (an early close aborts the request in the backend)."""
    try:
        yield events
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()
