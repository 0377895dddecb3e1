"""The `EngineBackend` protocol: what the agent's service asks of a GPU engine.

Owns: the protocol. The request, event and state types it speaks live in `engine_agent.domain`.
Must not: know gRPC or protobuf (that is `engine_agent.service`), tokenize or detokenize text (that is
`engine_agent.tokenization`, applied by the service around the backend), or read the wall clock directly.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from engine_agent.domain import (
    BackendEvent,
    BackendRequest,
    EngineStatic,
    EngineStats,
    HiddenStateBatch,
    MigrationStats,
    MigrationTicket,
    RequestId,
)


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

    def hidden_states(self) -> AsyncIterator[HiddenStateBatch]:
        """Subscribe to the hidden-state tap: one batch every `hidden_state_interval` decode steps.

        Each call is an independent subscriber with a small bounded queue (oldest batches are dropped when the
        consumer falls behind, never blocking the engine). Yields nothing when the tap is off (interval 0).
        """
        ...

    async def migrate_out(self, request_id: RequestId, target: str) -> MigrationTicket:
        """Cut a running request at a token boundary, keep its KV exported, and return its ticket.

        Tokens up to the cut are still delivered on the request's `generate` stream, which then ends with a
        `MigratedEvent` carrying the same ticket. Raises `MigrationRefused` with the reason when it cannot
        move.
        """
        ...

    def migrate_in(self, ticket: MigrationTicket, request_id: RequestId) -> AsyncIterator[BackendEvent]:
        """Resume a migrated request, pulling its KV, and stream the continuation (tokens, then a finish).

        The finish's usage counts the whole request: the original prompt and every output token, the
        source's included.
        Raises `MigrationRefused` when the ticket does not fit this engine (other model or backend).
        """
        ...

    def migration_stats(self, request_id: RequestId) -> MigrationStats | None:
        """For a request resumed by `migrate_in`: how its KV arrived (None until known, or unknown id)."""
        ...

    async def wait_for_change(self, after_version: int, timeout_s: float) -> int:
        """Wait until the state's change counter exceeds `after_version` or the timeout passes.

        Returns the current change counter. The service pushes `WatchState` on change or on its interval.
        """
        ...
