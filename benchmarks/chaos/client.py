"""One streaming chat request as a client sees it: every SSE event, timed, into a `StreamRecord`.

Owns: sending a `RequestSpec` to the gateway with aiohttp (`stream: true`, its seed and max_tokens, an
`x-request-id`), reading the response the way its behaviour says (normally, slowly: a pause before each line
through a small read buffer, or closing the connection after k content chunks), and recording what came back:
HTTP status and error body before the stream; content pieces with their arrival times, the finish reason,
OpenAI error events, `[DONE]`, anything after the end; a client-side inactivity timeout (a hang) or a broken
transport.
Must not: judge the stream (`benchmarks.chaos.classify` does) or retry.
"""

from __future__ import annotations

import asyncio
import time
from array import array
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from benchmarks.chaos.workload import RequestSpec


@dataclass(slots=True)
class StreamRecord:
    index: int
    request_id: str
    behaviour: str
    start_s: float
    end_s: float = 0.0
    status: int | None = None
    http_error: Any = None  # the parsed body of a non-200 answer (None: not JSON)
    pieces: list[str] = field(default_factory=list)
    piece_times_s: array[float] = field(default_factory=lambda: array("d"))  # compact: soaks keep many
    finish_reason: str | None = None
    done: bool = False  # saw data: [DONE]
    errors: list[tuple[float, Any]] = field(default_factory=list)  # (time, the event's "error" value)
    after_end: int = 0  # events after [DONE] or after an error event other than [DONE]
    malformed: list[str] = field(default_factory=list)  # lines that are not SSE data we understand
    disconnected: bool = False  # the client closed on purpose
    timed_out: bool = False  # no byte for the client's inactivity timeout
    transport_error: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def _note_line(rec: StreamRecord, line: bytes, now_s: float) -> int:
    """Record one SSE line; returns how many content pieces it added (0 or 1)."""
    line = line.strip()
    if not line or line.startswith(b":"):
        return 0
    if not line.startswith(b"data:"):
        rec.malformed.append(line[:200].decode(errors="replace"))
        return 0
    payload = line[5:].strip()
    ended = rec.done or bool(rec.errors)
    if payload == b"[DONE]":
        if rec.done:
            rec.after_end += 1
        rec.done = True
        return 0
    if ended:
        rec.after_end += 1
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError:
        rec.malformed.append(payload[:200].decode(errors="replace"))
        return 0
    if not isinstance(obj, dict):
        rec.malformed.append(payload[:200].decode(errors="replace"))
        return 0
    if "error" in obj:
        rec.errors.append((now_s, obj["error"]))
        return 0
    added = 0
    for choice in obj.get("choices") or ():
        content = (choice.get("delta") or {}).get("content")
        if content:
            rec.pieces.append(content)
            rec.piece_times_s.append(now_s)
            added += 1
        if choice.get("finish_reason"):
            rec.finish_reason = choice["finish_reason"]
    return added


async def run_stream(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    spec: RequestSpec,
    request_id: str,
    *,
    idle_timeout_s: float,
    slow_read_s: float,
) -> StreamRecord:
    """Send `spec` and read its answer to the end (or until the behaviour stops reading)."""
    rec = StreamRecord(spec.index, request_id, spec.behaviour, time.monotonic())
    body = {
        "model": model,
        "messages": [{"role": "user", "content": spec.prompt}],
        "max_tokens": spec.max_tokens,
        "seed": spec.seed,
        "stream": True,
    }
    timeout = aiohttp.ClientTimeout(total=None, connect=idle_timeout_s, sock_read=idle_timeout_s)
    try:
        async with session.post(
            url,
            data=orjson.dumps(body),
            timeout=timeout,
            headers={"content-type": "application/json", "x-request-id": request_id},
        ) as resp:
            rec.status = resp.status
            if resp.status != 200:
                raw = await resp.read()
                try:
                    rec.http_error = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    rec.http_error = None
                return rec
            chunks = 0
            async for line in resp.content:
                if spec.behaviour == "slow":
                    await asyncio.sleep(slow_read_s)
                chunks += _note_line(rec, line, time.monotonic())
                if spec.behaviour == "disconnect" and chunks >= spec.disconnect_after_chunks:
                    rec.disconnected = True
                    resp.close()  # drop the connection, do not return it to the pool
                    break
    except TimeoutError as e:
        # A real one needs the socket silent for the whole timeout, so at least that long since the start; an
        # instant "timeout" is the client library's fault (see `run.run_pass`), not a hang.
        rec.timed_out = time.monotonic() - rec.start_s >= 0.9 * idle_timeout_s
        rec.transport_error = f"{type(e).__name__}: {e}"
    except (aiohttp.ClientError, ConnectionError) as e:
        rec.transport_error = f"{type(e).__name__}: {e}"
    finally:
        rec.end_s = time.monotonic()
        if len(rec.pieces) > 1:
            rec.pieces = [rec.text]  # one string instead of one per chunk: a soak keeps every record
    return rec
