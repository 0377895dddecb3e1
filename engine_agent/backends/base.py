"""The `EngineBackend` protocol and the domain types every backend speaks.

Owns: what a backend is asked (token-id requests, aborts) and what it answers (token events, a finish, its
state).
Must not: know gRPC or protobuf (that is `engine_agent.service`), tokenize or detokenize text (that is
`engine_agent.tokenization`, applied by the service around the backend), or read the wall clock directly.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal, NewType, Protocol

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
    # Trace replay: the exact output length to produce (the sim backend honours it; 0 = not given).
    target_output_tokens: int = 0
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


BackendEvent = TokenEvent | FinishEvent


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


@dataclass(frozen=True, slots=True)
class LensFigures:
    """NexusSched's state vector (Eq. 8); zero until LENS is enabled."""

    predicted_batch_latency_s: float = 0.0
    pending_work_tokens: float = 0.0
    effective_free_kv_blocks: int = 0
    peak_throughput_tokens_per_s: float = 0.0
    prediction_error_ratio: float = 0.0
    slo_risk: bool = False


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


class EngineBackend(Protocol):
    """A GPU engine as the agent sees it. One instance per agent process."""

    @property
    def static(self) -> EngineStatic: ...

    @property
    def eos_token_id(self) -> int: ...

    async def start(self) -> None:
        """Bring the engine up; returns when it can accept requests."""

    async def stop(self) -> None:
        """Stop the engine loop and free resources (after the service drained)."""

    def generate(self, request: BackendRequest) -> AsyncIterator[BackendEvent]:
        """Admit a request and stream its tokens; the last event is a `FinishEvent`.

        Closing or cancelling the iterator before the finish aborts the request and frees its KV.
        """
        ...

    async def abort(self, request_id: RequestId) -> bool:
        """Abort a running or waiting request; False when the id is unknown (already finished)."""
        ...

    def stats(self) -> EngineStats:
        """The current state (cheap, no I/O)."""
        ...

    async def wait_for_change(self, after_version: int, timeout_s: float) -> int:
        """Wait until the state's change counter exceeds `after_version` or the timeout passes.

        Returns the current change counter. The service pushes `WatchState` on change or on its interval.
        """
        ...
