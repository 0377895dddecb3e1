"""The `EngineBackend` protocol and the optional capabilities a backend may add: what the agent asks of it.

Owns: the core protocol every backend implements (`EngineBackend`), the optional capability protocols
(`Migrator`: moving running requests between engines; `HiddenStateSource`: the hidden-state tap;
`KvEventSource`: the prefix cache's stored / evicted blocks, for KV-cache-aware routing), and
`Capabilities`: which of them one backend offers, decided once at start-up (the service refuses the RPCs of an
absent capability instead of calling into the backend). The request, event and state types they speak live in
`engine_agent.domain`.
Must not: know gRPC or protobuf (that is `engine_agent.service`), tokenize or detokenize text (that is
`engine_agent.tokenization`, applied by the service around the backend), or read the wall clock directly.

LENS is not a capability here: a backend gets `lens_planning` when it is built and reports LENS's state
vector in `EngineStats.lens`; the agent calls nothing LENS-specific on it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from engine_agent.domain import (
    BackendEvent,
    BackendRequest,
    EngineStatic,
    EngineStats,
    HiddenStateBatch,
    KvDelta,
    MigrationStats,
    MigrationTicket,
    RequestId,
)

MIGRATION = "migration"
HIDDEN_STATES = "hidden-states"
KV_EVENTS = "kv-events"


class EngineBackend(Protocol):
    """A GPU engine as the agent sees it. One instance per agent process."""

    @property
    def static(self) -> EngineStatic: ...

    @property
    def eos_token_id(self) -> int: ...

    async def start(self) -> None:
        """Bring the engine up; returns when it can accept requests."""

    async def stop(self) -> None:
        """Stop the engine and free resources (after the service drained).

        Every background task the backend started is cancelled and awaited before this returns.
        """

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


@runtime_checkable
class Migrator(Protocol):
    """Optional capability: cut a running request for another engine, and resume one cut elsewhere."""

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


@runtime_checkable
class HiddenStateSource(Protocol):
    """Optional capability: the hidden-state tap (STAR's remaining-length predictor reads it)."""

    def hidden_states(self) -> AsyncIterator[HiddenStateBatch]:
        """Subscribe to the tap: one batch every `static.hidden_state_interval` decode steps.

        Each call is an independent subscriber with a small bounded queue (oldest batches are dropped when the
        consumer falls behind, never blocking the engine); it ends when the backend stops.
        """
        ...


@runtime_checkable
class KvEventSource(Protocol):
    """Optional capability: the engine's prefix-cache events at the gateway's index granularity
    (`switchyard.prefix.INDEX_SPAN_TOKENS`-token blocks keyed by `block_keys`), from the engine's own cache,
    never guessed from what was sent to it."""

    def drain_kv_events(self) -> KvDelta:
        """Index blocks stored and evicted since the previous call, netted (one reader: the agent's
        journal)."""
        ...

    def kv_snapshot(self) -> KvDelta:
        """Every index block the engine holds now (`cleared`): the journal's starting point."""
        ...


@dataclass(frozen=True, slots=True)
class Capabilities:
    """The optional capabilities one backend offers, decided once at start-up (`of`).

    `switched_off` maps a capability the backend implements but the agent's configuration turned off to the
    reason (e.g. "--no-migration"): such a capability is absent, like one the backend does not implement.
    """

    migrator: Migrator | None = None
    hidden_state_source: HiddenStateSource | None = None
    kv_event_source: KvEventSource | None = None
    backend: str = ""
    switched_off: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, backend: EngineBackend, *, switched_off: Mapping[str, str] | None = None) -> Capabilities:
        """What `backend` implements, less what `switched_off` names (and a tap whose interval is None)."""
        off = dict(switched_off or {})
        if backend.static.hidden_state_interval is None:
            off.setdefault(HIDDEN_STATES, "no hidden-state interval configured")
        return cls(
            migrator=backend if isinstance(backend, Migrator) and MIGRATION not in off else None,
            hidden_state_source=(
                backend if isinstance(backend, HiddenStateSource) and HIDDEN_STATES not in off else None
            ),
            kv_event_source=backend if isinstance(backend, KvEventSource) and KV_EVENTS not in off else None,
            backend=backend.static.backend,
            switched_off=off,
        )

    @property
    def names(self) -> tuple[str, ...]:
        """The capabilities present, for the start-up log."""
        present = (
            (MIGRATION, self.migrator),
            (HIDDEN_STATES, self.hidden_state_source),
            (KV_EVENTS, self.kv_event_source),
        )
        return tuple(name for name, capability in present if capability is not None)

    def missing(self, name: str) -> str:
        """Why capability `name` is absent: the message an RPC that needs it is refused with."""
        reason = self.switched_off.get(name)
        if reason is not None:
            return f"this engine does not offer the {name} capability: it is switched off ({reason})"
        return f"this engine does not offer the {name} capability: the {self.backend} backend lacks it"
