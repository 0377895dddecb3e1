"""The gateway's half of an agent `Session`: all of one gateway's requests to one agent on one gRPC stream.

Owns: `AgentSessionCall` (the Session call to one agent; a writer that sends the opens and cancels of one loop
turn as one `SessionUp`; a reader that hands each batch's events to their requests without waiting on any of
them; failing every open request when the call breaks) and `SessionStream` (one request's events in arrival
order, buffered until its consumer reads them).
Must not: translate events to the gateway's domain (`grpc_client` does), retry, or block the reader on a
consumer: a slow HTTP client makes only its own request's buffer grow (bounded by the request's own output),
never delays another request's events. This matches the per-request Generate call, whose HTTP/2 flow control
pushed back on the agent's stream of that request only.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import deque
from collections.abc import AsyncIterator

import grpc
import grpc.aio

from switchyard.proto_gen import engine_agent_pb2 as pb
from switchyard.proto_gen import engine_agent_pb2_grpc as pb_grpc

_STATUS_BY_VALUE: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}
_TAG_SPACE = 1 << 32
_LAST_EVENTS = frozenset({"finished", "migrated"})


class SessionStreamEnded(Exception):
    """A request ended without `finished` / `migrated`: the agent's status for it, or the call's failure."""

    def __init__(self, code: grpc.StatusCode, details: str, *, call_failed: bool) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.call_failed = call_failed  # the whole Session call broke (not only this request)


class SessionStream:
    """One request on a session: `next()` returns its events in order, then raises `SessionStreamEnded` if
    it ended with an error (after its last event)."""

    __slots__ = ("tag", "_events", "_end", "_waiter")

    def __init__(self, tag: int) -> None:
        self.tag = tag
        self._events: deque[pb.GenerateEvent] = deque()
        self._end: SessionStreamEnded | None = None
        self._waiter: asyncio.Future[None] | None = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def deliver(self, event: pb.GenerateEvent) -> None:
        self._events.append(event)
        self._wake()

    def fail(self, end: SessionStreamEnded) -> None:
        if self._end is None:
            self._end = end
        self._wake()

    async def next(self) -> pb.GenerateEvent:
        while True:
            if self._events:
                return self._events.popleft()
            if self._end is not None:
                raise self._end
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None


class AgentSessionCall:
    """One live Session call. `broken` once the call failed or ended: open a new one for new requests."""

    def __init__(
        self,
        stub: pb_grpc.EngineAgentStub,
        address: str,
        *,
        metadata: tuple[tuple[str, str], ...] | None = None,
    ) -> None:
        """`metadata` goes with the call (the gateway's bearer token, `grpc_link`)."""
        self._address = address
        self._streams: dict[int, SessionStream] = {}
        self._tags = itertools.count(1)
        self._outbox = pb.SessionUp()
        self._ready = asyncio.Event()
        self._failure: SessionStreamEnded | None = None
        self._call = stub.Session(self._requests(), metadata=metadata)
        self._reader = asyncio.create_task(self._read_loop(), name=f"session-reader:{address}")

    @property
    def broken(self) -> bool:
        return self._failure is not None

    def open(self, request: pb.GenerateRequest) -> SessionStream:
        if self._failure is not None:
            raise self._failure
        tag = self._next_tag()
        stream = SessionStream(tag)
        self._streams[tag] = stream
        self._outbox.open.add(tag=tag).request.CopyFrom(request)
        self._ready.set()
        return stream

    def close_stream(self, stream: SessionStream) -> None:
        """The consumer is done with `stream`: if the agent has not ended it, cancel it there."""
        if self._streams.pop(stream.tag, None) is not None and self._failure is None:
            self._outbox.cancel.append(stream.tag)
            self._ready.set()

    def _next_tag(self) -> int:
        while True:
            tag = next(self._tags) % _TAG_SPACE
            if tag and tag not in self._streams:
                return tag

    async def _requests(self) -> AsyncIterator[pb.SessionUp]:
        """The call's request stream: everything queued since the last message, as one message."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            up, self._outbox = self._outbox, pb.SessionUp()
            if up.open or up.cancel:
                yield up

    async def _read_loop(self) -> None:
        streams = self._streams
        try:
            async for down in self._call:
                for tagged in down.events:
                    stream = streams.get(tagged.tag)
                    if stream is not None:
                        event = tagged.event
                        stream.deliver(event)
                        if not event.HasField("delta") and event.WhichOneof("event") in _LAST_EVENTS:
                            del streams[tagged.tag]  # ended at the agent: nothing to cancel there
                for end in down.ends:
                    stream = streams.pop(end.tag, None)
                    if stream is not None:
                        code = _STATUS_BY_VALUE.get(end.code, grpc.StatusCode.UNKNOWN)
                        stream.fail(SessionStreamEnded(code, end.message, call_failed=False))
            failure = SessionStreamEnded(
                grpc.StatusCode.UNAVAILABLE, f"Session on {self._address} ended", call_failed=True
            )
        except grpc.aio.AioRpcError as exc:
            failure = SessionStreamEnded(exc.code(), exc.details() or "", call_failed=True)
        except asyncio.CancelledError:
            failure = SessionStreamEnded(
                grpc.StatusCode.CANCELLED, f"Session on {self._address} closed", call_failed=True
            )
            self._fail_all(failure)
            raise
        self._fail_all(failure)

    def _fail_all(self, failure: SessionStreamEnded) -> None:
        self._failure = failure
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.fail(failure)

    async def close(self) -> None:
        self._call.cancel()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
