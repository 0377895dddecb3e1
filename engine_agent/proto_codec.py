"""Proto <-> domain translation for the engine agent's servicer: requests, events, state and tickets.

Owns: a `GenerateRequest` into a `BackendRequest` (tokenizing the prompt: ids, text or chat template, and
validating it and the output budget against the context limit: `ValueError` with the client-facing message),
the stream's `delta` / `finished` events, the `EngineState` pushed by WatchState (with a STAR round's
predictions and future load when the service passes one, and the prefix-cache events it passes; the QoE fit,
when there is one, and the measured KV pull throughput in every push), GetInfo's `EngineInfo`,
the wire's "0 = not given" fields into None and back (target output tokens, SLOs, the WatchState interval,
the hidden-state interval, the ticket's cut time) and milliseconds into seconds, and the wire ticket
(`ticket_to_proto`: the domain ticket plus the original request, no prompt; `ticket_from_proto`:
`ValueError` when it cannot describe a resumable request).
Must not: hold state, call the backend, stream, detokenize or match stop strings (that is
`engine_agent.service` and `engine_agent.output_text`), or read time.
"""

from __future__ import annotations

import uuid

from engine_agent.domain import (
    BackendRequest,
    EngineStatic,
    EngineStats,
    KvDelta,
    MigrationTicket,
    RequestId,
    SamplingSpec,
)
from engine_agent.star.live import StarRound
from engine_agent.tokenization import Tokenizer
from switchyard.proto_gen import engine_agent_pb2 as pb

# -- requests -----------------------------------------------------------------------------------------


def prompt_ids(request: pb.GenerateRequest, tokenizer: Tokenizer) -> list[int]:
    """The prompt's token ids (given, or tokenized); `ValueError` when there is none or an id is invalid."""
    kind = request.WhichOneof("prompt")
    if kind == "prompt_token_ids":
        ids = list(request.prompt_token_ids.ids)
        vocab = tokenizer.vocab_size
        bad = next((i for i in ids if i >= vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary (size {vocab})")
    elif kind == "prompt_text":
        ids = tokenizer.encode(request.prompt_text, add_special_tokens=True)
    elif kind == "chat":
        messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
        if not messages:
            raise ValueError("chat prompt has no messages")
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=request.chat.add_generation_prompt
        )
    else:
        raise ValueError("request has no prompt (prompt_token_ids, prompt_text or chat)")
    if not ids:
        raise ValueError("prompt is empty")
    return ids


def to_backend_request(
    request: pb.GenerateRequest, tokenizer: Tokenizer, *, max_context_tokens: int
) -> BackendRequest:
    """The backend's request (a fresh id when the client sent none); `ValueError` when it cannot run."""
    prompt = prompt_ids(request, tokenizer)
    limit = max_context_tokens
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
    target = _target_output_tokens(request)
    if target is not None and target > max_tokens:
        raise ValueError(f"target_output_tokens ({target}) is greater than max_tokens ({max_tokens})")
    slo = request.slo
    return BackendRequest(
        request_id=RequestId(request.request_id or f"agent-{uuid.uuid4().hex}"),
        prompt_token_ids=tuple(prompt),
        sampling=_sampling_spec(sampling, max_tokens),
        slo_ttft_s=_slo_s(slo.ttft_ms),
        slo_tpot_s=_slo_s(slo.tpot_ms),
        priority=request.priority,
        target_output_tokens=target,
        session_id=request.session_id,
    )


def _target_output_tokens(request: pb.GenerateRequest) -> int | None:
    """The wire's 0 means "not given"."""
    return request.target_output_tokens or None


def _sampling_spec(sampling: pb.SamplingParams, max_tokens: int) -> SamplingSpec:
    return SamplingSpec(
        max_tokens=max_tokens,
        min_tokens=sampling.min_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p or 1.0,
        seed=sampling.seed if sampling.HasField("seed") else None,
        stop_token_ids=tuple(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
    )


def _slo_s(milliseconds: float) -> float | None:
    return milliseconds / 1000.0 if milliseconds > 0 else None


def watch_interval_s(request: pb.WatchStateRequest) -> float | None:
    """The push interval a WatchState caller asked for; None (the wire's 0): the agent's configured one."""
    return request.interval_ms / 1000.0 if request.interval_ms else None


# -- events and state ---------------------------------------------------------------------------------


def delta_event(ids: tuple[int, ...], text: str) -> pb.GenerateEvent:
    return pb.GenerateEvent(delta=pb.TokenDelta(token_ids=ids, text=text))


def finished_event(
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


def engine_state(
    stats: EngineStats,
    *,
    identity: pb.EngineIdentity,
    seq: int,
    draining: bool,
    started: bool,
    star: StarRound | None = None,
    kv_events: KvDelta | None = None,
    kv_span_tokens: int = 0,
) -> pb.EngineState:
    """The WatchState push: the backend's stats, `seq`, and the service's own flags on top (ready only once
    the backend has started, and not while draining); with `star` (a push that follows a new STAR round), the
    round's `predictions` and `future_load` (otherwise both stay empty / unset). `qoe` is set once the backend
    has a fit (CascadeInfer's online D), unset before. `kv_events`: the prefix-cache events this push carries
    (None: none, `kv_events` stays unset), keyed over `kv_span_tokens`-token index blocks, which a resync
    (`cleared`) states and a delta leaves out (3 bytes a push: the stream's resync fixed it)."""
    lens = stats.lens
    state = pb.EngineState(
        identity=identity,
        seq=seq,
        timestamp_s=stats.timestamp_s,
        ready=stats.ready and started and not draining,
        draining=draining or stats.draining,
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
            prefill_tokens_per_s=lens.prefill_tokens_per_s,
            slo_risk=lens.slo_risk,
        ),
        transfer_bytes_per_s=stats.transfer_bytes_per_s,
    )
    qoe = stats.qoe
    if qoe is not None:
        fit = state.qoe
        fit.d.extend(qoe.d)
        fit.samples = qoe.samples
        fit.mean_relative_error = qoe.mean_relative_error
    if star is not None:
        add = state.predictions.add  # in place: half the time of building messages and extending (~130 us
        for p in star.predictions:  # for 256 requests)
            add(
                request_id=p.request_id,
                generated_tokens=p.generated_tokens,
                predicted_remaining_tokens=p.predicted_remaining_tokens,
                current_tokens=p.current_tokens,
                migratable=p.migratable,
            )
        future = state.future_load
        future.round = star.round
        future.tokens_per_round = star.round_tokens
        future.load.extend(star.future_load)
    if kv_events is not None:
        kv = state.kv_events
        kv.stored.extend(kv_events.stored)
        kv.removed.extend(kv_events.removed)
        kv.cleared = kv_events.cleared
        if kv_events.cleared:
            kv.span_tokens = kv_span_tokens
    return state


def engine_info(
    static: EngineStatic, *, identity: pb.EngineIdentity, tokenizer: str, eos_token_id: int
) -> pb.EngineInfo:
    """GetInfo's answer: the backend's static facts (a tap that is off is the wire's interval 0)."""
    return pb.EngineInfo(
        identity=identity,
        max_context_tokens=static.max_context_tokens,
        block_size=static.block_size,
        tokenizer=tokenizer,
        max_num_seqs=static.max_num_seqs,
        max_batched_tokens=static.max_batched_tokens,
        gpu_memory_gb=static.gpu_memory_gb,
        hourly_price_usd=static.hourly_price_usd,
        tensor_parallel=static.tensor_parallel,
        gpu=static.gpu,
        eos_token_id=eos_token_id,
        hidden_size=static.hidden_size,
        hidden_state_interval=static.hidden_state_interval or 0,
        kv_bytes_per_token=static.kv_bytes_per_token,
    )


# -- migration tickets --------------------------------------------------------------------------------


def ticket_to_proto(ticket: MigrationTicket, request: pb.GenerateRequest) -> pb.MigrationTicket:
    """The wire ticket: the domain ticket plus the original request (stop strings, SLOs, ...), no prompt."""
    original = pb.GenerateRequest()
    original.CopyFrom(request)
    original.ClearField("prompt")
    original.request_id = ticket.request_id
    return pb.MigrationTicket(
        request_id=ticket.request_id,
        source_engine_id=ticket.source_engine_id,
        target=ticket.target,
        backend=ticket.backend,
        model=ticket.model,
        prompt_token_ids=pb.TokenIds(ids=ticket.prompt_token_ids),
        output_token_ids=pb.TokenIds(ids=ticket.output_token_ids),
        request=original,
        remaining_tokens=ticket.remaining_tokens,
        kv_tokens=ticket.kv_tokens,
        kv_bytes=ticket.kv_bytes,
        transfer_params=ticket.transfer_params,
        cut_timestamp_s=ticket.cut_timestamp_s or 0.0,
    )


def ticket_from_proto(ticket: pb.MigrationTicket) -> MigrationTicket:
    """The domain ticket; ValueError when the wire ticket cannot describe a resumable request."""
    if not ticket.request_id:
        raise ValueError("the ticket has no request_id")
    prompt = tuple(ticket.prompt_token_ids.ids)
    output = tuple(ticket.output_token_ids.ids)
    if not prompt or not output:
        raise ValueError("the ticket needs prompt and output token ids")
    if ticket.remaining_tokens <= 0:
        raise ValueError("the ticket leaves no output budget (remaining_tokens 0)")
    request = ticket.request
    return MigrationTicket(
        request_id=RequestId(ticket.request_id),
        source_engine_id=ticket.source_engine_id,
        target=ticket.target,
        backend=ticket.backend,
        model=ticket.model,
        prompt_token_ids=prompt,
        output_token_ids=output,
        # max_tokens counts the whole output: what the source produced plus the budget left.
        sampling=_sampling_spec(request.sampling, len(output) + ticket.remaining_tokens),
        remaining_tokens=ticket.remaining_tokens,
        kv_tokens=ticket.kv_tokens,
        kv_bytes=ticket.kv_bytes,
        transfer_params=ticket.transfer_params,
        slo_ttft_s=_slo_s(request.slo.ttft_ms),
        slo_tpot_s=_slo_s(request.slo.tpot_ms),
        priority=request.priority,
        target_output_tokens=_target_output_tokens(request),
        session_id=request.session_id,
        cut_timestamp_s=ticket.cut_timestamp_s or None,  # the wire's 0: not given
    )
