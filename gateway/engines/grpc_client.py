"""`EngineClient` over gRPC to a Switchyard engine agent.

Owns: the grpc.aio channel to one agent (keepalive on, created lazily inside the running loop; TLS and the
bearer token as its `EngineLink` says, `gateway.engines.grpc_link`: the token is metadata on every call), how
requests travel (by default every request on one multiplexed `Session` call per agent,
`gateway.engines.grpc_session`, opened lazily and reopened after it breaks; `multiplex=False`, or an agent
without `Session`, uses one `Generate` call per request), and the translation between the gateway's engine
types (`gateway.domain`) and the generated proto messages. With `grpc_session` it is the only gateway code
that imports `switchyard.proto_gen` (checked by tests/unit/test_import_rules.py).
Error mapping of `generate`: a failure before the first event is `EngineUnavailable` (safe to retry
elsewhere), except INVALID_ARGUMENT, which is `EngineRequestError` (the API answers 400); a failure after the
first event is `EngineStreamError`. Closing the generator early cancels the request (a `cancel` on the
session, or the Generate call's cancel), and the agent aborts it. Migration (STAR §5.4): a stream may end with
`Migrated(ticket)` instead of `Finished`; `migrate_out` cuts a request (MigrateOut) and `resume` continues one
on another agent (MigrateIn), with the same error mapping as `generate`; `without_kv` re-builds a ticket to
resume without KV after the tokens the gateway relayed since the cut (`ticket_without_kv`).
An agent that refuses the gateway's credentials (UNAUTHENTICATED, PERMISSION_DENIED on GetInfo or WatchState)
is an error in the log naming the engine (once, until it accepts them again; the cluster store's backoff paces
the retries), and the `EngineUnavailable` says which setting to check; a channel that does not connect over
TLS names the failure gRPC saw (a handshake failure otherwise reads like an unreachable agent).
Must not: know about routing, SSE or the HTTP API; retry (dispatch decides).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal, cast

import grpc
import grpc.aio
from google.protobuf.message import DecodeError

from gateway.domain import (
    Admitted,
    Delta,
    EngineDescription,
    EngineId,
    EngineReport,
    EngineRequest,
    EngineRequestError,
    EngineStreamError,
    EngineUnavailable,
    Finished,
    FutureLoad,
    KvEvents,
    LensState,
    Migrated,
    MigrationRefusedError,
    MigrationTicket,
    QoEReport,
    RequestPrediction,
    StreamEvent,
)
from gateway.engines.grpc_link import PLAINTEXT, EngineLink
from gateway.engines.grpc_session import AgentSessionCall, SessionStreamEnded
from switchyard.proto_gen import engine_agent_pb2 as pb
from switchyard.proto_gen import engine_agent_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

FinishReason = Literal["stop", "length", "abort", "error"]
_FINISH_REASONS: frozenset[str] = frozenset({"stop", "length", "abort", "error"})

KEEPALIVE_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
)


def _ms(seconds: float | None) -> float:
    """Seconds inside, milliseconds on the wire (0 = no target)."""
    return 0.0 if seconds is None else seconds * 1e3


def to_generate_request(request: EngineRequest) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(
        max_tokens=request.max_tokens or 0,  # proto: 0 = up to the context limit
        min_tokens=request.min_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        stop=list(request.stop),
        stop_token_ids=list(request.stop_token_ids),
        ignore_eos=request.ignore_eos,
    )
    if request.seed is not None:
        sampling.seed = request.seed
    message = pb.GenerateRequest(
        request_id=request.request_id,
        sampling=sampling,
        slo=pb.SloTargets(ttft_ms=_ms(request.slo_ttft_s), tpot_ms=_ms(request.slo_tpot_s)),
        priority=request.priority,
        target_output_tokens=request.target_output_tokens or 0,  # proto: 0 = not given
        session_id=request.session_id,
    )
    if request.messages is not None:
        message.chat.CopyFrom(
            pb.ChatPrompt(
                messages=[pb.ChatMessage(role=t.role, content=t.content) for t in request.messages],
                add_generation_prompt=True,
            )
        )
    elif request.prompt_text is not None:
        message.prompt_text = request.prompt_text
    elif request.prompt_token_ids is not None:
        message.prompt_token_ids.CopyFrom(pb.TokenIds(ids=list(request.prompt_token_ids)))
    else:
        raise EngineRequestError(f"request {request.request_id!r} has no prompt")
    return message


def from_generate_event(event: pb.GenerateEvent) -> StreamEvent:
    kind = event.WhichOneof("event")
    if kind == "admitted":
        return Admitted(prompt_tokens=event.admitted.prompt_tokens)
    if kind == "delta":
        ids = tuple(event.delta.token_ids)
        return Delta(text=event.delta.text, token_ids=ids, num_tokens=len(ids))
    if kind == "finished":
        f = event.finished
        reason = cast(FinishReason, f.finish_reason) if f.finish_reason in _FINISH_REASONS else "error"
        return Finished(
            finish_reason=reason,
            prompt_tokens=f.usage.prompt_tokens,
            completion_tokens=f.usage.completion_tokens,
            cached_tokens=f.usage.cached_tokens,
            error_message=f.error_message,
            queue_s=f.timings.queue_s,
            prefill_s=f.timings.prefill_s,
            decode_s=f.timings.decode_s,
        )
    if kind == "migrated":
        return Migrated(from_ticket(event.migrated.ticket))
    raise EngineStreamError(f"unknown generate event {kind!r}")


def from_ticket(ticket: pb.MigrationTicket) -> MigrationTicket:
    """The gateway's view of a ticket; `encoded` keeps the whole of it for the engine that resumes it."""
    return MigrationTicket(
        request_id=ticket.request_id,
        source_engine_id=ticket.source_engine_id,
        target=ticket.target,
        output_tokens=len(ticket.output_token_ids.ids),
        kv_tokens=ticket.kv_tokens,
        kv_bytes=ticket.kv_bytes,
        encoded=ticket.SerializeToString(),
    )


def ticket_without_kv(ticket: MigrationTicket, after_cut: Sequence[int]) -> MigrationTicket:
    """The re-ticket to resume without KV (the splice's "recompute anywhere" and its re-ticket after a target
    died mid-stream): `ticket.encoded` with `after_cut` appended to its output tokens, `remaining_tokens`
    reduced by as many, and no KV (`kv_tokens`, `kv_bytes` 0; the backend-specific `transfer_params` are kept:
    the sim's carry its token generator's state at the cut, which the agent replays over `after_cut`).
    ValueError when `encoded` is no ticket or `after_cut` exceeds the output budget."""
    try:
        message = pb.MigrationTicket.FromString(ticket.encoded)
    except DecodeError as exc:
        raise ValueError(f"ticket {ticket.request_id!r} is not an agent's ticket: {exc}") from None
    if len(after_cut) > message.remaining_tokens:
        raise ValueError(
            f"ticket {ticket.request_id!r}: {len(after_cut)} tokens after the cut exceed the "
            f"{message.remaining_tokens} left"
        )
    message.output_token_ids.ids.extend(after_cut)
    message.remaining_tokens -= len(after_cut)
    message.kv_tokens = 0
    message.kv_bytes = 0
    return from_ticket(message)


def from_engine_state(state: pb.EngineState) -> EngineReport:
    ident = state.identity
    return EngineReport(
        engine_id=EngineId(ident.engine_id),
        model=ident.model,
        profile=ident.profile,
        backend=ident.backend,
        role=ident.role,
        combo=ident.combo,
        seq=state.seq,
        engine_timestamp_s=state.timestamp_s,
        ready=state.ready,
        draining=state.draining,
        num_running=state.num_running,
        num_waiting=state.num_waiting,
        kv_blocks_total=state.kv_blocks_total,
        kv_blocks_free=state.kv_blocks_free,
        kv_blocks_reserved=state.kv_blocks_reserved,
        pending_prefill_tokens=state.pending_prefill_tokens,
        running_batch_tokens=state.running_batch_tokens,
        lens=_lens_state(state),
        last_iteration_s=state.last_iteration_s,
        predictions=tuple(
            RequestPrediction(
                request_id=p.request_id,
                current_tokens=p.current_tokens,
                predicted_remaining_tokens=p.predicted_remaining_tokens,
                generated_tokens=p.generated_tokens,
                migratable=p.migratable,
            )
            for p in state.predictions
        ),
        future_load=(
            FutureLoad(
                round=state.future_load.round,
                round_tokens=state.future_load.tokens_per_round,
                load=tuple(state.future_load.load),
            )
            if state.HasField("future_load")
            else None
        ),
        qoe=_qoe_report(state),
        transfer_bytes_per_s=state.transfer_bytes_per_s,
        kv_events=_kv_events(state),
    )


def _kv_events(state: pb.EngineState) -> KvEvents | None:
    if not state.HasField("kv_events"):
        return None
    kv = state.kv_events
    return KvEvents(stored=tuple(kv.stored), removed=tuple(kv.removed), cleared=kv.cleared,
                    span_tokens=kv.span_tokens)


def _qoe_report(state: pb.EngineState) -> QoEReport | None:
    """The agent's online QoE fit; None when it has none yet (unset) or sent other than Eq. 1's five D."""
    if not state.HasField("qoe") or len(state.qoe.d) != 5:
        return None
    qoe = state.qoe
    d0, d1, d2, d3, d4 = qoe.d
    return QoEReport(d=(d0, d1, d2, d3, d4), samples=qoe.samples, mean_relative_error=qoe.mean_relative_error)


def _lens_state(state: pb.EngineState) -> LensState | None:
    """The wire carries LENS's figures as zeros when the engine runs no LENS model; P_max > 0 tells."""
    if not state.HasField("lens") or state.lens.peak_throughput_tokens_per_s <= 0.0:
        return None
    lens = state.lens
    return LensState(
        predicted_batch_latency_s=lens.predicted_batch_latency_s,
        pending_work_tokens=lens.pending_work_tokens,
        effective_free_kv_blocks=lens.effective_free_kv_blocks,
        peak_throughput_tokens_per_s=lens.peak_throughput_tokens_per_s,
        prediction_error_ratio=lens.prediction_error_ratio,
        slo_risk=lens.slo_risk,
        prefill_tokens_per_s=lens.prefill_tokens_per_s,
    )


def from_engine_info(info: pb.EngineInfo) -> EngineDescription:
    ident = info.identity
    return EngineDescription(
        engine_id=EngineId(ident.engine_id),
        model=ident.model,
        profile=ident.profile,
        backend=ident.backend,
        role=ident.role,
        max_context_tokens=info.max_context_tokens,
        block_size=info.block_size,
        max_num_seqs=info.max_num_seqs,
        kv_bytes_per_token=info.kv_bytes_per_token,
        gpu=info.gpu,
        tensor_parallel=max(info.tensor_parallel, 1),
        hourly_price_usd=info.hourly_price_usd,
    )


def _describe_rpc_error(exc: grpc.aio.AioRpcError) -> str:
    return f"{exc.code().name}: {exc.details()}"


_REFUSED = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})
# MigrateOut's answers when the request cannot move (unknown, ended, not movable faithfully, no capability).
_MIGRATION_REFUSED = frozenset(
    {
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INVALID_ARGUMENT,
    }
)


class GrpcEngineClient:
    def __init__(
        self,
        address: str,
        *,
        connect_timeout_s: float = 5.0,
        watch_interval_ms: int = 0,
        options: tuple[tuple[str, int | str], ...] = KEEPALIVE_OPTIONS,
        multiplex: bool = True,
        link: EngineLink = PLAINTEXT,
    ) -> None:
        """`address` is host:port; `watch_interval_ms` asks the agent for a report interval (0: its own);
        `multiplex`: all requests on one Session call (False: a Generate call per request); `link`: TLS and
        token (default plaintext, no token)."""
        self._address = address
        self._link = link
        self._metadata = link.metadata or None
        self._refused = False  # the agent refused our credentials and has not accepted them since
        self._multiplex = multiplex
        self._session_call: AgentSessionCall | None = None
        self._connect_timeout_s = connect_timeout_s
        self._watch_interval_ms = watch_interval_ms
        self._options = options
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.EngineAgentStub | None = None

    @property
    def address(self) -> str:
        return self._address

    def _get_stub(self) -> pb_grpc.EngineAgentStub:
        if self._stub is None:
            options = [*self._options, *self._link.channel_options]
            self._channel = (
                grpc.aio.insecure_channel(self._address, options=options)
                if self._link.credentials is None
                else grpc.aio.secure_channel(self._address, self._link.credentials, options=options)
            )
            self._stub = pb_grpc.EngineAgentStub(self._channel)
        return self._stub

    async def _connected_stub(self) -> pb_grpc.EngineAgentStub:
        """The stub once the channel is READY; EngineUnavailable after `connect_timeout_s`."""
        stub = self._get_stub()
        assert self._channel is not None
        if self._channel.get_state(try_to_connect=True) != grpc.ChannelConnectivity.READY:
            try:
                await asyncio.wait_for(self._channel.channel_ready(), self._connect_timeout_s)
            except TimeoutError as exc:
                why = await self._connect_failure(stub)
                raise EngineUnavailable(
                    f"engine {self._address} not reachable within {self._connect_timeout_s}s{why}"
                ) from exc
        return stub

    async def _connect_failure(self, stub: pb_grpc.EngineAgentStub) -> str:
        """Over TLS, why the channel does not connect (a handshake failure reads like an unreachable agent):
        a fail-fast call returns the last connection error gRPC saw."""
        if not self._link.tls:
            return ""
        try:
            await stub.GetInfo(
                pb.GetInfoRequest(), timeout=1.0, wait_for_ready=False, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as exc:
            return f" over TLS ({exc.details()})"
        return ""

    def _refusal(self, rpc: str, exc: grpc.aio.AioRpcError) -> EngineUnavailable:
        """The agent refused the gateway's credentials: an error in the log (once per refusal streak)."""
        what = (
            "set engine_link.auth_token_file to the file holding the agent's token"
            if not self._metadata
            else "engine_link.auth_token_file does not hold the agent's token"
        )
        message = f"engine {self._address} refused the gateway on {rpc}: {_describe_rpc_error(exc)} ({what})"
        if not self._refused:
            log.error("%s; retrying with backoff", message)
            self._refused = True
        return EngineUnavailable(message)

    async def describe(self) -> EngineDescription:
        stub = await self._connected_stub()
        try:
            info = await stub.GetInfo(
                pb.GetInfoRequest(), timeout=self._connect_timeout_s, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _REFUSED:
                raise self._refusal("GetInfo", exc) from exc
            raise EngineUnavailable(f"GetInfo on {self._address}: {_describe_rpc_error(exc)}") from exc
        if self._refused:
            log.info("engine %s accepts the gateway's credentials again", self._address)
            self._refused = False
        return from_engine_info(info)

    def generate(self, request: EngineRequest) -> AsyncIterator[StreamEvent]:
        return self._generate_on_session(request) if self._multiplex else self._generate_call(request)

    async def _session(self) -> AgentSessionCall:
        """The live Session call to this agent, opened (again) when there is none or it broke."""
        current = self._session_call
        if current is None or current.broken:
            stub = await self._connected_stub()
            if self._session_call is current:  # nobody opened one while this waited for the channel
                self._session_call = AgentSessionCall(stub, self._address, metadata=self._metadata)
                if current is not None:  # the broken call's request-writing task would stay pending
                    await current.close()
        assert self._session_call is not None
        return self._session_call

    async def _generate_on_session(self, request: EngineRequest) -> AsyncIterator[StreamEvent]:
        message = to_generate_request(request)
        session = await self._session()
        stream = session.open(message)
        started = False
        try:
            while True:
                try:
                    event = await stream.next()
                except SessionStreamEnded as exc:
                    if exc.code == grpc.StatusCode.UNIMPLEMENTED and exc.call_failed and not started:
                        self._multiplex = False  # an agent from before Session: one call per request
                        async for fallback in self._generate_call(request):
                            yield fallback
                        return
                    raise self._generate_error(request, exc.code, exc.details, started) from exc
                started = True
                yield from_generate_event(event)
                if event.HasField("finished") or event.HasField("migrated"):
                    return
        finally:
            session.close_stream(stream)

    def _generate_error(
        self,
        request: EngineRequest,
        code: grpc.StatusCode,
        details: str,
        started: bool,
        rpc: str = "Generate",
    ) -> Exception:
        """How a request that ended with `code` fails (the mapping in the module docstring)."""
        detail = f"{rpc} {request.request_id} on {self._address}: {code.name}: {details}"
        if started:
            return EngineStreamError(detail)
        if code == grpc.StatusCode.INVALID_ARGUMENT and rpc == "Generate":
            return EngineRequestError(details or detail)
        return EngineUnavailable(detail)

    async def _generate_call(self, request: EngineRequest) -> AsyncIterator[StreamEvent]:
        message = to_generate_request(request)
        stub = await self._connected_stub()
        async for event in self._events(request, stub.Generate(message, metadata=self._metadata), "Generate"):
            yield event

    async def _events(
        self,
        request: EngineRequest,
        call: grpc.aio.UnaryStreamCall[Any, pb.GenerateEvent],
        rpc: str,
    ) -> AsyncIterator[StreamEvent]:
        """One call's events (Generate, MigrateIn) until `finished` or `migrated`; the call is cancelled when
        the consumer leaves early (the agent aborts the request)."""
        started = False
        try:
            async for event in call:
                started = True
                yield from_generate_event(event)
                if event.WhichOneof("event") in ("finished", "migrated"):
                    return
        except grpc.aio.AioRpcError as exc:
            raise self._generate_error(request, exc.code(), exc.details() or "", started, rpc) from exc
        finally:
            call.cancel()  # a no-op once the call is done; otherwise the agent sees the cancel and aborts
        detail = f"{rpc} {request.request_id} on {self._address} ended without a finish event"
        raise EngineStreamError(detail) if started else EngineUnavailable(detail)

    async def migrate_out(self, request_id: str, target: str) -> MigrationTicket:
        """Cut a running request here (`MigrateOut`); its stream then ends with `Migrated` (the same ticket).
        `MigrationRefusedError` when the agent refuses (not running, not movable, no migration capability);
        `EngineUnavailable` when it cannot be reached."""
        stub = await self._connected_stub()
        try:
            ticket = await stub.MigrateOut(
                pb.MigrateOutRequest(request_id=request_id, target=target),
                timeout=self._connect_timeout_s,
                metadata=self._metadata,
            )
        except grpc.aio.AioRpcError as exc:
            detail = f"MigrateOut {request_id} on {self._address}: {_describe_rpc_error(exc)}"
            if exc.code() in _MIGRATION_REFUSED:
                raise MigrationRefusedError(detail) from exc
            raise EngineUnavailable(detail) from exc
        return from_ticket(ticket)

    async def release(self, request_id: str) -> None:
        """`Abort` of the cut id: the agent frees the KV it holds for it (vLLM: at once instead of at
        `--migration-kv-lease-s`; the sim holds none). Errors are logged, not raised: the lease still ends."""
        try:
            stub = await self._connected_stub()
            message = pb.AbortRequest(request_id=request_id)
            await stub.Abort(message, timeout=self._connect_timeout_s, metadata=self._metadata)
        except (grpc.aio.AioRpcError, EngineUnavailable) as exc:
            log.info("release of cut %s on %s failed (%s); lease frees it", request_id, self._address, exc)

    def without_kv(self, ticket: MigrationTicket, after_cut: Sequence[int]) -> MigrationTicket:
        """`ticket_without_kv`: the ticket to resume without KV here."""
        return ticket_without_kv(ticket, after_cut)

    def resume(self, ticket: MigrationTicket, request: EngineRequest) -> AsyncIterator[StreamEvent]:
        """Resume a migrated request here (`MigrateIn`) as `request.request_id`: its continuation's events,
        like `generate` (admitted, the tokens after the cut, finished with the whole request's usage).
        `EngineUnavailable` before the first event (refused, unreachable), `EngineStreamError` after."""
        return self._resume(ticket, request)

    async def _resume(self, ticket: MigrationTicket, request: EngineRequest) -> AsyncIterator[StreamEvent]:
        message = pb.MigrateInRequest(
            ticket=pb.MigrationTicket.FromString(ticket.encoded), request_id=request.request_id
        )
        stub = await self._connected_stub()
        async for event in self._events(
            request, stub.MigrateIn(message, metadata=self._metadata), "MigrateIn"
        ):
            yield event

    async def watch_state(self) -> AsyncIterator[EngineReport]:
        stub = await self._connected_stub()
        call = stub.WatchState(
            pb.WatchStateRequest(interval_ms=self._watch_interval_ms), metadata=self._metadata
        )
        try:
            async for state in call:
                yield from_engine_state(state)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _REFUSED:
                raise self._refusal("WatchState", exc) from exc
            raise EngineUnavailable(f"WatchState on {self._address}: {_describe_rpc_error(exc)}") from exc
        finally:
            call.cancel()
        raise EngineUnavailable(f"WatchState on {self._address} ended")

    async def close(self) -> None:
        if self._session_call is not None:
            await self._session_call.close()
            self._session_call = None
        if self._channel is not None:
            await self._channel.close()
        self._channel = None
        self._stub = None
