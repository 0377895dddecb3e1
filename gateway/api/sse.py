"""Server-sent events on an aiohttp `StreamResponse`, in the framing OpenAI clients parse.

Owns: `SseWriter`: headers, `data: {json}\\n\\n` per chunk (orjson), the error event
`data: {"error": {...}}\\n\\n`, the terminal `data: [DONE]\\n\\n`, and write coalescing: the first event of an
event-loop tick is written at once (a lone chunk waits for nothing), the events after it in the same tick are
queued and go out together in one socket write at the end of the tick (a flush task), so a burst costs two
writes however long it is; `send_now` writes at once what is queued (a choice's first token, whose latency is
the client's TTFT, must not wait for the rest of a burst); more than `FLUSH_BYTES` pending makes the producer
wait for the write (backpressure from a slow client).
`SplicedEvent`: the encoded event of an object with one per-event string field, encoded once with a marker
and split there, so that per event only the string is JSON-encoded and spliced in (the same bytes as
`encode_event` of the whole object, by construction).
Must not: build OpenAI chunk objects (openai_format does), or swallow a client disconnect: a failed write
surfaces as `ConnectionResetError` from the next queue, flush or end call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

import orjson
from aiohttp import web

DONE = b"data: [DONE]\n\n"

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # reverse proxies must not buffer the stream
}
# Pending bytes beyond which `queue` waits for the write in flight (aiohttp's own drain limit is 64 KiB).
FLUSH_BYTES = 64 * 1024
# A string no chunk holds in practice (request ids are printable; a model name holding it is handled).
_MARKER = "\x00splice\x00"
_MARKER_JSON = orjson.dumps(_MARKER)


class _SseResponse(web.StreamResponse):
    """A stream response whose status line and headers go out with its first body bytes, in the same socket
    write (aiohttp's own `web.Response` does this through the same class attribute). Were a later aiohttp to
    drop the attribute, headers would simply go out at `prepare()` again, in a write of their own."""

    _send_headers_immediately = False


def encode_event(obj: Mapping[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class SplicedEvent:
    """`encode_event(build(text))` for any `text`, with `build(marker)` encoded once.

    orjson encodes a string the same wherever it stands, so the encoded object split at the marker's encoding,
    with the text's encoding in between, is the encoding of the object holding the text. If the marker's
    encoding were to occur more than once (a model name holding it), every event takes the plain path."""

    __slots__ = ("_build", "_head", "_tail")

    def __init__(self, build: Callable[[str], Mapping[str, Any]]) -> None:
        self._build = build
        parts = encode_event(build(_MARKER)).split(_MARKER_JSON)
        self._head, self._tail = (parts[0], parts[1]) if len(parts) == 2 else (b"", b"")

    def encode(self, text: str) -> bytes:
        if self._tail:
            return self._head + orjson.dumps(text) + self._tail
        return encode_event(self._build(text))


class SseWriter:
    """One response's events. Three ways to send, all in order: `queue` (written at the end of the tick),
    `send_frame` (at once when it is the tick's first write, else at the end of the tick) and `send_now` (at
    once, after whatever is queued)."""

    __slots__ = (
        "response",
        "_request",
        "started",
        "_loop",
        "_pending",
        "_pending_bytes",
        "_flusher",
        "_writing",
        "_wrote_this_tick",
        "_broken",
    )

    def __init__(self, request: web.BaseRequest, headers: Mapping[str, str]) -> None:
        self.response: web.StreamResponse = _SseResponse(status=200, headers={**SSE_HEADERS, **headers})
        self._request = request
        self.started = False
        self._loop = asyncio.get_running_loop()
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._flusher: asyncio.Task[None] | None = None  # writes `_pending` at the end of the tick
        self._writing = False  # the flusher is inside a write (maybe waiting for the client to drain)
        self._wrote_this_tick = False
        self._broken: ConnectionResetError | None = None

    async def start(self) -> None:
        """Commit the status line and headers (sent with the first event, the first byte the client sees)."""
        if not self.started:
            self.started = True
            await self.response.prepare(self._request)

    async def send(self, obj: Mapping[str, Any]) -> None:
        await self.queue(encode_event(obj))

    async def queue(self, frame: bytes) -> None:
        """Queue an encoded event for the write at the end of this tick; waits only while more than
        `FLUSH_BYTES` are pending."""
        if self._broken is not None:
            raise self._broken
        self._pending.append(frame)
        self._pending_bytes += len(frame)
        if self._flusher is None:
            self._flusher = self._loop.create_task(self._flush())
        elif self._pending_bytes > FLUSH_BYTES:
            await self.flush()

    async def send_frame(self, frame: bytes) -> None:
        """A lone event goes out at once; the events after it in the same tick are queued behind it."""
        if self._wrote_this_tick or self._flusher is not None:
            await self.queue(frame)
        else:
            await self._write_now(frame)

    async def send_now(self, frame: bytes) -> None:
        """Write everything queued, then `frame`, now (not at the end of the tick)."""
        if self._broken is not None:
            raise self._broken
        if self._writing:  # the flush task is inside a write: it writes this next, in order
            self._pending.append(frame)
            await self.flush()
            return
        # A flush task not yet started then finds nothing left.
        if self._pending:
            self._pending.append(frame)
            frame = b"".join(self._pending)
            self._pending.clear()
            self._pending_bytes = 0
        await self._write_now(frame)

    async def _write_now(self, data: bytes) -> None:
        if self._broken is not None:
            raise self._broken
        if not self._wrote_this_tick:
            self._wrote_this_tick = True
            self._loop.call_soon(self._next_tick)
        try:
            await self.response.write(data)
        except ConnectionResetError as e:  # aiohttp's ClientConnectionResetError included
            self._broken = e
            raise

    def _next_tick(self) -> None:
        self._wrote_this_tick = False

    async def flush(self) -> None:
        """Wait until every queued event is written (or the write failed: then raise)."""
        flusher = self._flusher
        if flusher is not None:
            # Shielded: a timeout or cancellation of the caller must not cancel the write half-way.
            await asyncio.shield(flusher)
        if self._broken is not None:
            raise self._broken

    async def _flush(self) -> None:
        try:
            while self._pending:
                data = b"".join(self._pending) if len(self._pending) > 1 else self._pending[0]
                self._pending.clear()
                self._pending_bytes = 0
                self._writing = True
                await self.response.write(data)
                self._writing = False
        except ConnectionResetError as e:
            self._broken = e
            self._pending.clear()
        finally:
            self._writing = False
            self._flusher = None

    async def send_error(self, body: Mapping[str, Any]) -> None:
        """An OpenAI error object as an event, then `[DONE]`, then the end: the stream ends cleanly."""
        await self._end(encode_event(body) + DONE)

    async def done(self) -> None:
        await self._end(DONE)

    async def _end(self, tail: bytes) -> None:
        """Everything queued, then `tail` and the end of the body, in one write when nothing is in flight (a
        flush task not yet started then finds nothing left to write)."""
        if self._writing:
            await self.flush()
        if self._broken is not None:
            raise self._broken
        self._pending.append(tail)
        data = b"".join(self._pending)
        self._pending.clear()
        self._pending_bytes = 0
        await self.response.write_eof(data)

    def close(self) -> None:
        """Drop what is still queued and stop a write not yet started (the handler is ending early)."""
        self._pending.clear()
        if self._flusher is not None:
            self._flusher.cancel()
            self._flusher = None
