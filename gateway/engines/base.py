"""The `EngineClient` protocol: how dispatch talks to one engine, whatever its transport.

Owns: the client protocol. Implementations: `grpc_client` (Switchyard engine agents; the only gateway module
that imports generated proto code) and `openai_upstream` (any OpenAI-compatible server: vLLM, SGLang, another
gateway). The request, event and report types it speaks live in `gateway.domain`.
Must not: know about HTTP clients of the gateway, SSE formatting or policies.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from gateway.domain import EngineDescription, EngineEvent, EngineReport, EngineRequest


class EngineClient(Protocol):
    """One engine. `generate` raises `EngineUnavailable` before the first event, `EngineStreamError` after."""

    @property
    def address(self) -> str: ...

    async def describe(self) -> EngineDescription: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineEvent]:
        """Stream one generation. Closing the iterator early cancels the engine request."""
        ...

    def watch_state(self) -> AsyncIterator[EngineReport]:
        """Reports as the engine pushes them; raises when the connection breaks (the store reconnects)."""
        ...

    async def close(self) -> None: ...
