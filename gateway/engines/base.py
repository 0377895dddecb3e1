"""The `EngineClient` protocol: how dispatch talks to one engine, whatever its transport.

Owns: the engine-facing request and event types, and the client protocol. Implementations: `grpc_client`
(Switchyard engine agents; the only gateway module that imports generated proto code) and `openai_upstream`
(any OpenAI-compatible server: vLLM, SGLang, another gateway).
Must not: know about HTTP clients of the gateway, SSE formatting or policies.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal, Protocol

from gateway.cluster.snapshot import EngineId


@dataclass(frozen=True, slots=True)
class ChatTurn:
    role: str
    content: str


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One generation (one choice: the gateway fans `n > 1` out into n of these)."""

    request_id: str
    model: str
    # Exactly one of these three is set.
    messages: tuple[ChatTurn, ...] | None = None
    prompt_text: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    max_tokens: int = 0  # 0 = up to the context limit
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    slo_ttft_ms: float = 0.0
    slo_tpot_ms: float = 0.0
    priority: int = 0
    target_output_tokens: int = 0
    session_id: str = ""


@dataclass(frozen=True, slots=True)
class Admitted:
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class Delta:
    text: str
    token_ids: tuple[int, ...] = ()
    # Tokens this delta represents (upstreams that send no ids count one per chunk).
    num_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Finished:
    finish_reason: Literal["stop", "length", "abort", "error"]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    error_message: str = ""
    queue_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0


EngineEvent = Admitted | Delta | Finished


class EngineUnavailable(Exception):
    """The engine could not be reached or failed before producing anything (safe to retry elsewhere)."""


class EngineStreamError(Exception):
    """The engine failed after the stream began (not retryable without duplicating output)."""


class EngineRequestError(ValueError):
    """The engine rejected the request itself (bad arguments); the API answers 400 and never retries it."""


@dataclass(frozen=True, slots=True)
class EngineReport:
    """One state report, transport-neutral (the cluster store turns it into an `EngineView`)."""

    engine_id: EngineId
    model: str
    profile: str
    backend: str
    role: str
    seq: int
    engine_timestamp_s: float
    ready: bool
    draining: bool
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_reserved: int
    pending_prefill_tokens: int
    running_batch_tokens: int
    predicted_batch_latency_s: float = 0.0
    pending_work_tokens: float = 0.0
    effective_free_kv_blocks: int = 0
    peak_throughput_tokens_per_s: float = 0.0
    prediction_error_ratio: float = 0.0
    slo_risk: bool = False
    last_iteration_s: float = 0.0


@dataclass(frozen=True, slots=True)
class EngineDescription:
    engine_id: EngineId
    model: str
    profile: str
    backend: str
    role: str
    max_context_tokens: int
    block_size: int
    max_num_seqs: int


class EngineClient(Protocol):
    """One engine. `generate` raises `EngineUnavailable` before the first event, `EngineStreamError` after."""

    @property
    def address(self) -> str: ...

    async def describe(self) -> EngineDescription: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineEvent]:
        """Stream one generation. Closing the iterator early cancels the engine request."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def watch_state(self) -> AsyncIterator[EngineReport]:
        """Reports as the engine pushes them; raises when the connection breaks (the store reconnects)."""
        ...

    async def close(self) -> None: ...
