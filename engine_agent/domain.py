"""The engine agent's domain types: what its backends are asked and what they answer.

Owns: token-id requests (`BackendRequest`, `SamplingSpec`), the events of a request's stream (`TokenEvent`,
`FinishEvent`, `MigratedEvent`) with usage and timings, migration tickets and figures, hidden-state samples,
and the engine's static facts and dynamic state (`EngineStatic`, `EngineStats`, `LensFigures`, `QoEFigures`).
Must not: import anything of the agent's (backends, the simulated GPU, LENS and the service all import
this, so it stays at the bottom), know gRPC or protobuf, or read clocks. Times are seconds (floats).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NewType

import numpy as np
import numpy.typing as npt

RequestId = NewType("RequestId", str)

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    max_tokens: int  # > 0; the service fills the context limit when the client gave none
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True, slots=True)
class BackendRequest:
    request_id: RequestId
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingSpec
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    priority: int = 0
    # Trace replay: the exact output length to produce (>= 1; the sim backend honours it; None = not given).
    target_output_tokens: int | None = None
    session_id: str = ""


@dataclass(frozen=True, slots=True)
class TokenEvent:
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Timings:
    queue_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0


@dataclass(frozen=True, slots=True)
class FinishEvent:
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    error_message: str = ""


@dataclass(frozen=True, slots=True)
class MigrationTicket:
    """Everything a target engine needs to resume a request cut on a source engine.

    `output_token_ids` are exactly the tokens the source delivered on the request's stream before it ended
    with a `MigratedEvent`; the target continues after them with `remaining_tokens` of budget.
    `transfer_params` is backend-specific JSON (vLLM: the NixlConnector's `kv_transfer_params`; sim: the
    modelled transfer), opaque to everything but the target backend of the same kind.
    """

    request_id: RequestId
    source_engine_id: str
    target: str
    backend: str
    model: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    sampling: SamplingSpec  # as the client asked it (max_tokens counts the whole output)
    remaining_tokens: int
    kv_tokens: int  # tokens whose KV the target can pull instead of recomputing
    kv_bytes: int
    transfer_params: bytes = b""
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    priority: int = 0
    target_output_tokens: int | None = None
    session_id: str = ""
    cut_timestamp_s: float | None = None  # source engine clock when the source emitted its last token


def request_from_ticket(ticket: MigrationTicket, request_id: RequestId) -> BackendRequest:
    """The original request (prompt, sampling, SLOs) a ticket resumes, under the id it runs as here."""
    return BackendRequest(
        request_id=request_id,
        prompt_token_ids=ticket.prompt_token_ids,
        sampling=ticket.sampling,
        slo_ttft_s=ticket.slo_ttft_s,
        slo_tpot_s=ticket.slo_tpot_s,
        priority=ticket.priority,
        target_output_tokens=ticket.target_output_tokens,
        session_id=ticket.session_id,
    )


@dataclass(frozen=True, slots=True)
class MigratedEvent:
    """Ends a request's stream on the source instead of a `FinishEvent`: the request continues elsewhere."""

    ticket: MigrationTicket


@dataclass(frozen=True, slots=True)
class MigrationStats:
    """What a target reports once a migrated request has produced its first token there."""

    kv_tokens_loaded: int  # tokens whose KV came over the transfer (not recomputed)
    kv_tokens_recomputed: int
    kv_bytes_transferred: int
    transfer_s: float | None  # source's cut to the first token here; None: the ticket had no cut time


class MigrationRefused(ValueError):
    """The request cannot move faithfully (unknown, finished, seeded sampling on vLLM, ...): the reason."""


BackendEvent = TokenEvent | FinishEvent | MigratedEvent


@dataclass(frozen=True, slots=True)
class HiddenStateSample:
    """Final-layer (post final norm) hidden state of a request's last token."""

    request_id: RequestId
    generated_tokens: int  # output tokens the request had when the state was taken
    vector: npt.NDArray[np.float32]  # shape (hidden_size,)


@dataclass(frozen=True, slots=True)
class HiddenStateBatch:
    """One tap: every running (decoding) request's hidden state at one engine step."""

    step: int  # the engine's decode-step counter when the tap fired
    timestamp_s: float
    samples: tuple[HiddenStateSample, ...]


@dataclass(frozen=True, slots=True)
class EngineStatic:
    """Facts that do not change while the engine runs (GetInfo)."""

    engine_id: str
    model: str
    backend: str
    profile: str
    role: str
    max_context_tokens: int
    block_size: int
    max_num_seqs: int
    max_batched_tokens: int
    gpu: str = ""
    gpu_memory_gb: float = 0.0
    hourly_price_usd: float = 0.0
    tensor_parallel: int = 1
    hidden_size: int = 0  # width of the hidden-state tap's vectors
    hidden_state_interval: int | None = None  # the tap fires every this many decode steps; None = off
    kv_bytes_per_token: int = 0  # KV bytes one token holds (all layers, whole TP group); 0 = unknown


@dataclass(frozen=True, slots=True)
class LensFigures:
    """NexusSched's state vector (Eq. 8); zero until LENS is enabled."""

    predicted_batch_latency_s: float = 0.0
    pending_work_tokens: float = 0.0
    effective_free_kv_blocks: int = 0
    peak_throughput_tokens_per_s: float = 0.0
    prediction_error_ratio: float = 0.0
    slo_risk: bool = False
    prefill_tokens_per_s: float = 0.0  # what LENS's plans leave a new request's prefill; 0 = not planning


@dataclass(frozen=True, slots=True)
class QoEFigures:
    """CascadeInfer's QoE model (Eq. 1) as this engine fitted it online (`engine_agent.qoe_tracker`)."""

    d: tuple[float, float, float, float, float]  # D_0..D_4 for F = (1, n, ΣI, ΣI², ΣL); Σ D_k F_k: s / token
    samples: int  # finished requests in the fitted window
    mean_relative_error: float  # mean |predicted - measured| / measured over those requests


@dataclass(frozen=True, slots=True)
class KvDelta:
    """Prefix-cache events: index-block keys (`switchyard.prefix`) stored and removed since the previous
    drain; `cleared`: everything before this batch is gone (a reset, or the first batch of a resync, which
    then lists every key the engine holds)."""

    stored: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    cleared: bool = False

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed or self.cleared)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """One reading of an engine's dynamic state, taken at `timestamp_s` on the engine's clock."""

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
    lens: LensFigures = field(default_factory=LensFigures)
    qoe: QoEFigures | None = None  # None: no fit yet (too few finished requests)
    # Measured KV pull throughput of migrated-in requests (an exponentially weighted mean, bytes per second);
    # 0: no pull measured yet.
    transfer_bytes_per_s: float = 0.0
