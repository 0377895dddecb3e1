"""Server-sent events on an aiohttp `StreamResponse`, in the framing OpenAI clients parse.

Owns: `SseWriter`: headers, `data: {json}\\n\\n` per chunk (orjson, written and flushed to the transport per
chunk), the error event `data: {"error": {...}}\\n\\n`, and the terminal `data: [DONE]\\n\\n`.
Must not: build OpenAI chunk objects (openai_format does), or swallow a client disconnect: the transport's
`ConnectionResetError` propagates to the caller.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web

DONE = b"data: [DONE]\n\n"

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # reverse proxies must not buffer the stream
}


def encode_event(obj: Mapping[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class SseWriter:
    def __init__(self, request: web.BaseRequest, headers: Mapping[str, str]) -> None:
        self.response = web.StreamResponse(status=200, headers={**SSE_HEADERS, **headers})
        self._request = request
        self.started = False

    async def start(self) -> None:
        """Send the status line and headers (the first byte the client sees)."""
        if not self.started:
            self.started = True
            await self.response.prepare(self._request)

    async def send(self, obj: Mapping[str, Any]) -> None:
        await self.response.write(encode_event(obj))

    async def send_error(self, body: Mapping[str, Any]) -> None:
        """An OpenAI error object as an event, then `[DONE]`: the stream ends cleanly."""
        await self.response.write(encode_event(body) + DONE)

    async def done(self) -> None:
        await self.response.write(DONE)
        await self.response.write_eof()
