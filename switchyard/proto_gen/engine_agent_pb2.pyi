from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatPrompt(_message.Message):
    __slots__ = ("messages", "add_generation_prompt")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "min_tokens", "temperature", "top_p", "seed", "stop", "stop_token_ids", "ignore_eos")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    min_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    def __init__(self, max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class SloTargets(_message.Message):
    __slots__ = ("ttft_ms", "tpot_ms")
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    ttft_ms: float
    tpot_ms: float
    def __init__(self, ttft_ms: _Optional[float] = ..., tpot_ms: _Optional[float] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "prompt_text", "chat", "sampling", "slo", "priority", "target_output_tokens", "session_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SLO_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TARGET_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: TokenIds
    prompt_text: str
    chat: ChatPrompt
    sampling: SamplingParams
    slo: SloTargets
    priority: int
    target_output_tokens: int
    session_id: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., prompt_text: _Optional[str] = ..., chat: _Optional[_Union[ChatPrompt, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., slo: _Optional[_Union[SloTargets, _Mapping]] = ..., priority: _Optional[int] = ..., target_output_tokens: _Optional[int] = ..., session_id: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class EngineTimings(_message.Message):
    __slots__ = ("queue_s", "prefill_s", "decode_s")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    prefill_s: float
    decode_s: float
    def __init__(self, queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., decode_s: _Optional[float] = ...) -> None: ...

class Admitted(_message.Message):
    __slots__ = ("prompt_tokens",)
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("token_ids", "text")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("finish_reason", "usage", "timings", "stop_reason", "error_message")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    usage: Usage
    timings: EngineTimings
    stop_reason: str
    error_message: str
    def __init__(self, finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[EngineTimings, _Mapping]] = ..., stop_reason: _Optional[str] = ..., error_message: _Optional[str] = ...) -> None: ...

class Migrated(_message.Message):
    __slots__ = ("ticket",)
    TICKET_FIELD_NUMBER: _ClassVar[int]
    ticket: MigrationTicket
    def __init__(self, ticket: _Optional[_Union[MigrationTicket, _Mapping]] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("admitted", "delta", "finished", "migrated")
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_FIELD_NUMBER: _ClassVar[int]
    admitted: Admitted
    delta: TokenDelta
    finished: Finished
    migrated: Migrated
    def __init__(self, admitted: _Optional[_Union[Admitted, _Mapping]] = ..., delta: _Optional[_Union[TokenDelta, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ..., migrated: _Optional[_Union[Migrated, _Mapping]] = ...) -> None: ...

class SessionOpen(_message.Message):
    __slots__ = ("tag", "request")
    TAG_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    tag: int
    request: GenerateRequest
    def __init__(self, tag: _Optional[int] = ..., request: _Optional[_Union[GenerateRequest, _Mapping]] = ...) -> None: ...

class SessionUp(_message.Message):
    __slots__ = ("open", "cancel")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    open: _containers.RepeatedCompositeFieldContainer[SessionOpen]
    cancel: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, open: _Optional[_Iterable[_Union[SessionOpen, _Mapping]]] = ..., cancel: _Optional[_Iterable[int]] = ...) -> None: ...

class TaggedEvent(_message.Message):
    __slots__ = ("tag", "event")
    TAG_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    tag: int
    event: GenerateEvent
    def __init__(self, tag: _Optional[int] = ..., event: _Optional[_Union[GenerateEvent, _Mapping]] = ...) -> None: ...

class StreamEnd(_message.Message):
    __slots__ = ("tag", "code", "message")
    TAG_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    tag: int
    code: int
    message: str
    def __init__(self, tag: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class SessionDown(_message.Message):
    __slots__ = ("events", "ends")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    ENDS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[TaggedEvent]
    ends: _containers.RepeatedCompositeFieldContainer[StreamEnd]
    def __init__(self, events: _Optional[_Iterable[_Union[TaggedEvent, _Mapping]]] = ..., ends: _Optional[_Iterable[_Union[StreamEnd, _Mapping]]] = ...) -> None: ...

class MigrateOutRequest(_message.Message):
    __slots__ = ("request_id", "target")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    target: str
    def __init__(self, request_id: _Optional[str] = ..., target: _Optional[str] = ...) -> None: ...

class MigrationTicket(_message.Message):
    __slots__ = ("request_id", "source_engine_id", "target", "backend", "model", "prompt_token_ids", "output_token_ids", "request", "remaining_tokens", "kv_tokens", "kv_bytes", "transfer_params", "cut_timestamp_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    REMAINING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    CUT_TIMESTAMP_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    source_engine_id: str
    target: str
    backend: str
    model: str
    prompt_token_ids: TokenIds
    output_token_ids: TokenIds
    request: GenerateRequest
    remaining_tokens: int
    kv_tokens: int
    kv_bytes: int
    transfer_params: bytes
    cut_timestamp_s: float
    def __init__(self, request_id: _Optional[str] = ..., source_engine_id: _Optional[str] = ..., target: _Optional[str] = ..., backend: _Optional[str] = ..., model: _Optional[str] = ..., prompt_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., output_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., remaining_tokens: _Optional[int] = ..., kv_tokens: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., transfer_params: _Optional[bytes] = ..., cut_timestamp_s: _Optional[float] = ...) -> None: ...

class MigrateInRequest(_message.Message):
    __slots__ = ("ticket", "request_id")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ticket: MigrationTicket
    request_id: str
    def __init__(self, ticket: _Optional[_Union[MigrationTicket, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class WatchStateRequest(_message.Message):
    __slots__ = ("interval_ms",)
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    interval_ms: int
    def __init__(self, interval_ms: _Optional[int] = ...) -> None: ...

class EngineIdentity(_message.Message):
    __slots__ = ("engine_id", "model", "backend", "profile", "role", "combo")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    COMBO_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    model: str
    backend: str
    profile: str
    role: str
    combo: str
    def __init__(self, engine_id: _Optional[str] = ..., model: _Optional[str] = ..., backend: _Optional[str] = ..., profile: _Optional[str] = ..., role: _Optional[str] = ..., combo: _Optional[str] = ...) -> None: ...

class LensState(_message.Message):
    __slots__ = ("predicted_batch_latency_s", "pending_work_tokens", "effective_free_kv_blocks", "peak_throughput_tokens_per_s", "prediction_error_ratio", "slo_risk", "prefill_tokens_per_s")
    PREDICTED_BATCH_LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    PENDING_WORK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EFFECTIVE_FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PEAK_THROUGHPUT_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_ERROR_RATIO_FIELD_NUMBER: _ClassVar[int]
    SLO_RISK_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    predicted_batch_latency_s: float
    pending_work_tokens: float
    effective_free_kv_blocks: int
    peak_throughput_tokens_per_s: float
    prediction_error_ratio: float
    slo_risk: bool
    prefill_tokens_per_s: float
    def __init__(self, predicted_batch_latency_s: _Optional[float] = ..., pending_work_tokens: _Optional[float] = ..., effective_free_kv_blocks: _Optional[int] = ..., peak_throughput_tokens_per_s: _Optional[float] = ..., prediction_error_ratio: _Optional[float] = ..., slo_risk: _Optional[bool] = ..., prefill_tokens_per_s: _Optional[float] = ...) -> None: ...

class RequestPrediction(_message.Message):
    __slots__ = ("request_id", "generated_tokens", "predicted_remaining_tokens", "current_tokens", "migratable")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_REMAINING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CURRENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIGRATABLE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    generated_tokens: int
    predicted_remaining_tokens: float
    current_tokens: int
    migratable: bool
    def __init__(self, request_id: _Optional[str] = ..., generated_tokens: _Optional[int] = ..., predicted_remaining_tokens: _Optional[float] = ..., current_tokens: _Optional[int] = ..., migratable: _Optional[bool] = ...) -> None: ...

class FutureLoad(_message.Message):
    __slots__ = ("round", "tokens_per_round", "load")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    round: int
    tokens_per_round: int
    load: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, round: _Optional[int] = ..., tokens_per_round: _Optional[int] = ..., load: _Optional[_Iterable[float]] = ...) -> None: ...

class QoEFit(_message.Message):
    __slots__ = ("d", "samples", "mean_relative_error")
    D_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MEAN_RELATIVE_ERROR_FIELD_NUMBER: _ClassVar[int]
    d: _containers.RepeatedScalarFieldContainer[float]
    samples: int
    mean_relative_error: float
    def __init__(self, d: _Optional[_Iterable[float]] = ..., samples: _Optional[int] = ..., mean_relative_error: _Optional[float] = ...) -> None: ...

class KvEvents(_message.Message):
    __slots__ = ("stored", "removed", "cleared", "span_tokens")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    SPAN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    stored: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    cleared: bool
    span_tokens: int
    def __init__(self, stored: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ..., cleared: _Optional[bool] = ..., span_tokens: _Optional[int] = ...) -> None: ...

class EngineState(_message.Message):
    __slots__ = ("identity", "seq", "timestamp_s", "ready", "draining", "num_running", "num_waiting", "num_preempted_total", "kv_blocks_total", "kv_blocks_free", "kv_blocks_reserved", "pending_prefill_tokens", "running_batch_tokens", "last_iteration_s", "iterations_total", "lens", "predictions", "future_load", "qoe", "transfer_bytes_per_s", "kv_events")
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_S_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_RESERVED_FIELD_NUMBER: _ClassVar[int]
    PENDING_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAST_ITERATION_S_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LENS_FIELD_NUMBER: _ClassVar[int]
    PREDICTIONS_FIELD_NUMBER: _ClassVar[int]
    FUTURE_LOAD_FIELD_NUMBER: _ClassVar[int]
    QOE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    identity: EngineIdentity
    seq: int
    timestamp_s: float
    ready: bool
    draining: bool
    num_running: int
    num_waiting: int
    num_preempted_total: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_reserved: int
    pending_prefill_tokens: int
    running_batch_tokens: int
    last_iteration_s: float
    iterations_total: int
    lens: LensState
    predictions: _containers.RepeatedCompositeFieldContainer[RequestPrediction]
    future_load: FutureLoad
    qoe: QoEFit
    transfer_bytes_per_s: float
    kv_events: KvEvents
    def __init__(self, identity: _Optional[_Union[EngineIdentity, _Mapping]] = ..., seq: _Optional[int] = ..., timestamp_s: _Optional[float] = ..., ready: _Optional[bool] = ..., draining: _Optional[bool] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_preempted_total: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., kv_blocks_reserved: _Optional[int] = ..., pending_prefill_tokens: _Optional[int] = ..., running_batch_tokens: _Optional[int] = ..., last_iteration_s: _Optional[float] = ..., iterations_total: _Optional[int] = ..., lens: _Optional[_Union[LensState, _Mapping]] = ..., predictions: _Optional[_Iterable[_Union[RequestPrediction, _Mapping]]] = ..., future_load: _Optional[_Union[FutureLoad, _Mapping]] = ..., qoe: _Optional[_Union[QoEFit, _Mapping]] = ..., transfer_bytes_per_s: _Optional[float] = ..., kv_events: _Optional[_Union[KvEvents, _Mapping]] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("identity", "max_context_tokens", "block_size", "tokenizer", "max_num_seqs", "max_batched_tokens", "gpu_memory_gb", "hourly_price_usd", "tensor_parallel", "gpu", "eos_token_id", "hidden_size", "hidden_state_interval", "kv_bytes_per_token")
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_GB_FIELD_NUMBER: _ClassVar[int]
    HOURLY_PRICE_USD_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATE_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    identity: EngineIdentity
    max_context_tokens: int
    block_size: int
    tokenizer: str
    max_num_seqs: int
    max_batched_tokens: int
    gpu_memory_gb: float
    hourly_price_usd: float
    tensor_parallel: int
    gpu: str
    eos_token_id: int
    hidden_size: int
    hidden_state_interval: int
    kv_bytes_per_token: int
    def __init__(self, identity: _Optional[_Union[EngineIdentity, _Mapping]] = ..., max_context_tokens: _Optional[int] = ..., block_size: _Optional[int] = ..., tokenizer: _Optional[str] = ..., max_num_seqs: _Optional[int] = ..., max_batched_tokens: _Optional[int] = ..., gpu_memory_gb: _Optional[float] = ..., hourly_price_usd: _Optional[float] = ..., tensor_parallel: _Optional[int] = ..., gpu: _Optional[str] = ..., eos_token_id: _Optional[int] = ..., hidden_size: _Optional[int] = ..., hidden_state_interval: _Optional[int] = ..., kv_bytes_per_token: _Optional[int] = ...) -> None: ...
