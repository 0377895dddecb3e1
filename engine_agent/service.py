"""The engine agent's gRPC servicer (grpc.aio): proto <-> domain translation around one `EngineBackend`.

Owns: tokenizing prompts (ids, text, chat template), request validation against the context limit, streaming
deltas with incremental detokenization and stop-string / stop-token-id semantics, usage counted from what was
streamed, the WatchState push (interval and prompt on change, `seq` increasing across the process), GetInfo,
Abort, and refusing new Generate calls while draining.
Must not: schedule, batch or time tokens (the backend does), own the server, health or signals
(`engine_agent.server` does), or read time other than through the injected `Clock`.

"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator

import grpc

from engine_agent.backends.base import (
    BackendEvent,
    BackendRequest,
    EngineBackend,
    FinishEvent,
    RequestId,
    SamplingSpec,
)
from engine_agent.proto_gen import engine_agent_pb2 as pb
from engine_agent.proto_gen import engine_agent_pb2_grpc as pb_grpc
from engine_agent.tokenization import IncrementalDetokenizer, StopMatcher, Tokenizer
from switchyard.clock import Clock

log = logging.getLogger(__name__)


class AgentService(pb_grpc.EngineAgentServicer):
    """Serves one backend; `start_draining` refuses new Generate calls, `wait_idle` awaits in-flight ones."""

    def __init__(
        self, backend: EngineBackend, tokenizer: Tokenizer, *, clock: Clock, state_interval_ms: int
    ) -> None:
        self._backend = backend
        self._tokenizer = tokenizer
        self._clock = clock
        self._state_interval_s = state_interval_ms / 1000.0
        self._seq = itertools.count(1)
        self._draining = False
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        static = backend.static
        self._identity = pb.EngineIdentity(
            engine_id=static.engine_id,
            model=static.model,
            backend=static.backend,
            profile=static.profile,
            role=static.role,
        )

    # -- lifecycle (called by the server) ----------------------------------------------------------

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def start_draining(self) -> None:
        self._draining = True

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
        if self._draining:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "engine agent is draining; send the request elsewhere"
            )
        try:
            backend_request = self._to_backend_request(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self._in_flight += 1
        self._idle.clear()
        try:
            async with contextlib.aclosing(self._stream(request, backend_request, context)) as events:
                async for event in events:
                    await context.write(event)
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    async def Abort(  # noqa: N802 - gRPC method name
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        found = await self._backend.abort(RequestId(request.request_id))
        return pb.AbortResponse(found=found)

    async def WatchState(  # noqa: N802 - gRPC method name
        self, request: pb.WatchStateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.EngineState]:
        interval_s = request.interval_ms / 1000.0 if request.interval_ms else self._state_interval_s
        backend = self._backend
        version = await backend.wait_for_change(-1, 0.0)
        while True:
            yield self._state()
            deadline = self._clock.now() + interval_s
            while (remaining := deadline - self._clock.now()) > 0:
                current = await backend.wait_for_change(version, remaining)
                if current > version:
                    version = current
                    break

    async def GetInfo(  # noqa: N802 - gRPC method name
        self, request: pb.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.EngineInfo:
        static = self._backend.static
        return pb.EngineInfo(
            identity=self._identity,
            max_context_tokens=static.max_context_tokens,
            block_size=static.block_size,
            tokenizer=self._tokenizer.identity,
            max_num_seqs=static.max_num_seqs,
            max_batched_tokens=static.max_batched_tokens,
            gpu_memory_gb=static.gpu_memory_gb,
            hourly_price_usd=static.hourly_price_usd,
            tensor_parallel=static.tensor_parallel,
            gpu=static.gpu,
            eos_token_id=self._backend.eos_token_id,
        )

    # -- translation -------------------------------------------------------------------------------

    def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "prompt_token_ids":
            ids = list(request.prompt_token_ids.ids)
            vocab = self._tokenizer.vocab_size
            bad = next((i for i in ids if i >= vocab), None)
            if bad is not None:
                raise ValueError(f"prompt token id {bad} is outside the vocabulary (size {vocab})")
        elif kind == "prompt_text":
            ids = self._tokenizer.encode(request.prompt_text, add_special_tokens=True)
        elif kind == "chat":
            messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
            if not messages:
                raise ValueError("chat prompt has no messages")
            ids = self._tokenizer.apply_chat_template(
                messages, add_generation_prompt=request.chat.add_generation_prompt
            )
        else:
            raise ValueError("request has no prompt (prompt_token_ids, prompt_text or chat)")
        if not ids:
            raise ValueError("prompt is empty")
        return ids

    def _to_backend_request(self, request: pb.GenerateRequest) -> BackendRequest:
        prompt = self._prompt_ids(request)
        limit = self._backend.static.max_context_tokens
        sampling = request.sampling
        if len(prompt) >= limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens, but the prompt has "
                f"{len(prompt)} tokens (no room for output)."
            )
        max_tokens = sampling.max_tokens or limit - len(prompt)
        if len(prompt) + max_tokens > limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt, "
                f"{max_tokens} for the completion)."
            )
        if sampling.min_tokens > max_tokens:
            raise ValueError(f"min_tokens ({sampling.min_tokens}) is greater than max_tokens ({max_tokens})")
        if request.target_output_tokens > max_tokens:
            raise ValueError(
                f"target_output_tokens ({request.target_output_tokens}) is greater than "
                f"max_tokens ({max_tokens})"
            )
        slo = request.slo
        return BackendRequest(
            request_id=RequestId(request.request_id or f"agent-{uuid.uuid4().hex}"),
            prompt_token_ids=tuple(prompt),
            sampling=SamplingSpec(
                max_tokens=max_tokens,
                min_tokens=sampling.min_tokens,
                temperature=sampling.temperature,
                top_p=sampling.top_p or 1.0,
                seed=sampling.seed if sampling.HasField("seed") else None,
                stop_token_ids=tuple(sampling.stop_token_ids),
                ignore_eos=sampling.ignore_eos,
            ),
            slo_ttft_s=slo.ttft_ms / 1000.0 if slo.ttft_ms > 0 else None,
            slo_tpot_s=slo.tpot_ms / 1000.0 if slo.tpot_ms > 0 else None,
            priority=request.priority,
            target_output_tokens=request.target_output_tokens,
            session_id=request.session_id,
        )

    async def _stream(
        self, request: pb.GenerateRequest, breq: BackendRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[pb.GenerateEvent, None]:
        prompt_tokens = len(breq.prompt_token_ids)
        text = _OutputText(self._tokenizer, list(request.sampling.stop), breq.sampling)
        emitted = 0
        admitted_s = self._clock.now()
        first_token_s = admitted_s
        yield pb.GenerateEvent(admitted=pb.Admitted(prompt_tokens=prompt_tokens))
        # Leaving this block early (stop string, client cancel, error) closes the backend stream, which aborts
        # the request there and frees its KV.
        async with _closing(self._backend.generate(breq)) as events:
            try:
                async for event in events:
                    if isinstance(event, FinishEvent):
                        tail = text.finish()
                        if tail:
                            yield _delta((), tail)
                        reason = "stop" if text.matched is not None else event.finish_reason
                        yield _finished(
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
                    if emitted == 0:
                        first_token_s = self._clock.now()
                    if not text.stops_active:
                        piece = text.add(ids, emitted)
                        emitted += len(ids)
                        yield _delta(ids, piece)
                        continue
                    # Token by token, so a stop string ends the stream at the token that completed it.
                    pieces: list[str] = []
                    for k in range(len(ids)):
                        pieces.append(text.add(ids[k : k + 1], emitted + k))
                        if text.matched is not None:
                            emitted += k + 1
                            yield _delta(ids[: k + 1], "".join(pieces))
                            now = self._clock.now()
                            yield _finished(
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
                    yield _delta(ids, "".join(pieces))
            except ValueError as exc:  # admission refused by the backend (e.g. a duplicate request id)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    def _state(self) -> pb.EngineState:
        stats = self._backend.stats()
        lens = stats.lens
        return pb.EngineState(
            identity=self._identity,
            seq=next(self._seq),
            timestamp_s=stats.timestamp_s,
            ready=stats.ready and not self._draining,
            draining=self._draining or stats.draining,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            num_preempted_total=stats.num_preempted_total,
            kv_blocks_total=stats.kv_blocks_total,
            kv_blocks_free=stats.kv_blocks_free,
            kv_blocks_reserved=stats.kv_blocks_reserved,
            pending_prefill_tokens=stats.pending_prefill_tokens,
            running_batch_tokens=stats.running_batch_tokens,
            last_iteration_s=stats.last_iteration_s,
            iterations_total=stats.iterations_total,
            lens=pb.LensState(
                predicted_batch_latency_s=lens.predicted_batch_latency_s,
                pending_work_tokens=lens.pending_work_tokens,
                effective_free_kv_blocks=lens.effective_free_kv_blocks,
                peak_throughput_tokens_per_s=lens.peak_throughput_tokens_per_s,
                prediction_error_ratio=lens.prediction_error_ratio,
                slo_risk=lens.slo_risk,
            ),
        )


class _OutputText:
    """One stream's text: incremental detokenization, then stop strings; stop-token-id tokens add no text."""

    __slots__ = ("_detok", "_stop", "_stop_ids", "_min_tokens")

    def __init__(self, tokenizer: Tokenizer, stops: list[str], sampling: SamplingSpec) -> None:
        self._detok: IncrementalDetokenizer = tokenizer.detokenizer()
        self._stop = StopMatcher(stops)
        self._stop_ids = frozenset(sampling.stop_token_ids)
        self._min_tokens = sampling.min_tokens

    @property
    def stops_active(self) -> bool:
        return self._stop.active

    @property
    def matched(self) -> str | None:
        return self._stop.matched

    def add(self, ids: tuple[int, ...], position: int) -> str:
        """Text released by `ids`, the tokens at output positions `position`, `position + 1`, ..."""
        if self._stop_ids:
            ids = tuple(
                t for k, t in enumerate(ids) if t not in self._stop_ids or position + k < self._min_tokens
            )
        return self._stop.feed(self._detok.add(ids))

    def finish(self) -> str:
        released = self._stop.feed(self._detok.flush())
        return released + self._stop.flush()


@contextlib.asynccontextmanager
async def _closing(events: AsyncIterator[BackendEvent]) -> AsyncGenerator[AsyncIterator[BackendEvent], None]:
    """Close the backend stream on leaving the block (an early close aborts the request in the backend)."""
    try:
        yield events
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


def _delta(ids: tuple[int, ...], text: str) -> pb.GenerateEvent:
    return pb.GenerateEvent(delta=pb.TokenDelta(token_ids=ids, text=text))


def _finished(
    reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    timings: pb.EngineTimings,
    *,
    stop_reason: str = "",
    error_message: str = "",
) -> pb.GenerateEvent:
    return pb.GenerateEvent(
        finished=pb.Finished(
            finish_reason=reason,
            usage=pb.Usage(
                prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, cached_tokens=cached_tokens
            ),
            timings=timings,
            stop_reason=stop_reason,
            error_message=error_message,
        )
    )
