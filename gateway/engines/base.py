"""The `EngineClient` protocol: how dispatch talks to one engine, whatever its transport.

Owns: the client protocol. Implementations: `grpc_client` (Switchyard engine agents; the only gateway module
that imports generated proto code) and `openai_upstream` (any OpenAI-compatible server: vLLM, SGLang, another
gateway). The request, event and report types it speaks live in `gateway.domain`.
Must not: know about HTTP clients of the gateway, SSE formatting or policies.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol, runtime_checkable

from gateway.domain import EngineDescription, EngineReport, EngineRequest, MigrationTicket, StreamEvent


class EngineClient(Protocol):
    """One engine. `generate` raises `EngineUnavailable` before the first event, `EngineStreamError` after."""

    @property
    def address(self) -> str: ...

    async def describe(self) -> EngineDescription: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[StreamEvent]:
        """Stream one generation. Closing the iterator early cancels the engine request. The last event is
        `Finished`, or `Migrated` when the engine moved the request (follow it with a `MigratingClient`)."""
        ...

    def watch_state(self) -> AsyncIterator[EngineReport]:
        """Reports as the engine pushes them; raises when the connection breaks (the store reconnects)."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class MigratingClient(Protocol):
    """An engine that can cut a running request and resume one cut elsewhere (STAR §5.4; the gRPC agents)."""

    async def migrate_out(self, request_id: str, target: str) -> MigrationTicket:
        """Cut `request_id` here for `target` (an engine id, informational); `MigrationRefusedError` if it
        cannot move, `EngineUnavailable` if the engine cannot be reached."""
        ...

    def resume(self, ticket: MigrationTicket, request: EngineRequest) -> AsyncIterator[StreamEvent]:
        """Continue a cut request here: the events after the cut, like `generate`'s."""
        ...

    async def release(self, request_id: str) -> None:
        """The KV this engine holds for its cut `request_id` will not be pulled (every resumption with it
        failed, or the splice resumes without KV, or the client left): free it now instead of at the lease's
        end. Best effort: never raises; a no-op when nothing is held."""
        ...


@runtime_checkable
class RecomputingClient(Protocol):
    """An engine that resumes a cut request without its KV, recomputing it (the gRPC agents)."""

    def without_kv(self, ticket: MigrationTicket, after_cut: Sequence[int]) -> MigrationTicket:
        """`ticket` re-built to resume without KV after its output tokens plus `after_cut` (token ids
        produced since the cut, which the client has): no KV to pull, the output budget reduced to match.
        ValueError when `ticket` is not this transport's or `after_cut` exceeds the budget."""
        ...
