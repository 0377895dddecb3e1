"""One `Session` call: many requests multiplexed on one bidirectional gRPC stream, events sent in batches.

Owns: `AgentSession` (reading the client's opens and cancels, one task per open request running the same
stream Generate runs, and one writer that sends everything the requests produced since its last write as one
`SessionDown`, a request's deltas within a batch merged into one), `StreamRefused` (the status a stream ends
with when the agent will not serve it: Generate ends its call with it, a Session sends it as the request's
`StreamEnd`), and the `StreamHost` protocol the servicer implements for it.
Must not: admit, detokenize or translate requests itself (the servicer, `engine_agent.service`, does), read
time, or wait on the client inside a request's task: a request's events are appended to the batch without
waiting, so one slow reader of one request cannot stall the others (the gateway buffers per request).

Why one stream: the gRPC per-message cost (a write, an HTTP/2 frame, a read and a wake-up on each side) was
the largest item of the agent's and the gateway's CPU per token (docs/performance.md). Events of one engine
step arrive in the same loop turn (vLLM's output handler fills every request's queue at once), and the
writer runs after the request tasks that turn woke, so one step of N running requests costs one message.

Semantics kept from per-request Generate calls: a request's events arrive in order and end with `finished`,
`migrated` or a `StreamEnd`; a cancel (or the call ending) aborts the request in the backend; a refusal at
admission (draining, invalid argument) is a `StreamEnd` with Generate's status code.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

import grpc

from switchyard.proto_gen import engine_agent_pb2 as pb

log = logging.getLogger(__name__)


class StreamRefused(Exception):
    """A stream the agent will not (or can no longer) serve: the status its call ends with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class StreamHost(Protocol):
    """What a session needs from the servicer: admission and the stream of one admitted request."""

    def open_generate(self, request: pb.GenerateRequest) -> Any:
        """Admit a request; raises `StreamRefused`."""
        ...

    def serving(self, opened: Any) -> contextlib.AbstractAsyncContextManager[AsyncIterator[pb.GenerateEvent]]:
        """The admitted request's events while the block runs; leaving early aborts it."""
        ...


class AgentSession:
    """Serves one Session call until the client ends it; every request still open then is cancelled."""

    def __init__(self, host: StreamHost, context: grpc.aio.ServicerContext) -> None:
        self._host = host
        self._context = context
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._batch = pb.SessionDown()  # filled by the request tasks, taken whole by the writer
        self._open_delta: dict[int, pb.TokenDelta] = {}  # tag -> its delta in the batch being filled
        self._ready = asyncio.Event()

    async def run(self, requests: AsyncIterator[pb.SessionUp]) -> None:
        writer = asyncio.create_task(self._write_loop(), name="agent-session-writer")
        try:
            async for up in requests:
                for opened in up.open:
                    self._open(opened.tag, opened.request)
                for tag in up.cancel:
                    task = self._tasks.pop(tag, None)
                    if task is not None:
                        task.cancel()
            # The client half-closed: serve what is open, send the last batch, then end the call.
            while self._tasks:
                await asyncio.wait(list(self._tasks.values()))
            while self._batch.events or self._batch.ends:
                self._ready.set()
                await asyncio.sleep(0)
                if writer.done():
                    break
        finally:
            tasks = list(self._tasks.values())
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await writer

    def _open(self, tag: int, request: pb.GenerateRequest) -> None:
        if tag in self._tasks:
            self._end(tag, grpc.StatusCode.INVALID_ARGUMENT, f"session tag {tag} is already open")
            return
        try:
            opened = self._host.open_generate(request)
        except StreamRefused as exc:
            self._end(tag, exc.code, exc.message)
            return
        self._tasks[tag] = asyncio.create_task(self._serve(tag, opened), name=f"agent-session-{tag}")

    async def _serve(self, tag: int, opened: Any) -> None:
        try:
            async with self._host.serving(opened) as events:
                async for event in events:
                    self._push(tag, event)
        except StreamRefused as exc:
            self._end(tag, exc.code, exc.message)
        except asyncio.CancelledError:
            raise  # the client cancelled the request (or the call): it wants nothing more of it
        except Exception as exc:
            log.exception("session stream %d failed", tag)
            self._end(tag, grpc.StatusCode.INTERNAL, f"engine agent error: {exc}")
        finally:
            if self._tasks.get(tag) is asyncio.current_task():
                del self._tasks[tag]

    def _push(self, tag: int, event: pb.GenerateEvent) -> None:
        if event.HasField("delta"):
            held = self._open_delta.get(tag)
            if held is not None:  # this request already has a delta in the batch: merge into it
                held.token_ids.extend(event.delta.token_ids)
                held.text += event.delta.text
                return
            tagged = self._batch.events.add(tag=tag)
            tagged.event.CopyFrom(event)
            self._open_delta[tag] = tagged.event.delta
        else:
            self._batch.events.add(tag=tag).event.CopyFrom(event)
            self._open_delta.pop(tag, None)
        self._ready.set()

    def _end(self, tag: int, code: grpc.StatusCode, message: str) -> None:
        self._open_delta.pop(tag, None)
        self._batch.ends.add(tag=tag, code=code.value[0], message=message)
        self._ready.set()

    async def _write_loop(self) -> None:
        context = self._context
        while True:
            await self._ready.wait()
            self._ready.clear()
            if not self._batch.events and not self._batch.ends:
                continue
            down, self._batch = self._batch, pb.SessionDown()
            self._open_delta.clear()
            await context.write(down)
