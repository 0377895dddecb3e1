"""Client-facing time bounds of one request being answered: the idle stream and the slow reader.

Owns: `ClientGuard`, one timer per request that ends the request when either bound passes, and
`GuardedSink`, the `EventSink` in front of the request's relay that marks each event's write for it.
- Idle stream (`idle_s`, streams only): no engine event for that long -> `on_idle` (the handler cancels its
  task and answers `stream_idle_timeout`: an SSE error event + [DONE], or a 504 before the first byte).
- Slow client (`slow_s`): a write (an event's, or one marked with `writing()`) not done after that long ->
  the connection is aborted (its unsent bytes dropped), `switchyard_slow_client_aborts_total` counts it and
  the sink raises `ClientDisconnected`, so the dispatcher closes the engine streams (the engines abort).
Back-pressure is the writers', not the guard's: aiohttp's `write` waits for the socket to drain once its
buffer passes aiohttp's limit, and `SseWriter` waits once `FLUSH_BYTES` are queued, so a client that stops
reading stops `on_event`, and with it the dispatcher's pull from the engine stream. The guard bounds how long
that may last. Cost per event: two clock reads and a few stores; the timer is re-armed when it fires (every
`slow_s / CHECKS_PER_BOUND` at most while not writing), never per event, so a stuck write is cut between
`slow_s` and `slow_s * (1 + 1 / CHECKS_PER_BOUND)` after it began.
Must not: route, format responses, or touch engines.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal

from aiohttp import web

from gateway.dispatch.cancel import IDLE_STREAM_CANCEL as IDLE_STREAM_CANCEL  # re-exported for the API
from gateway.dispatch.dispatcher import ClientDisconnected, EventSink
from gateway.domain import EngineEvent

log = logging.getLogger(__name__)

CHECKS_PER_BOUND = 4
# The message of the handler's cancellation when a stream went idle (`task.cancel(IDLE_STREAM_CANCEL)`), so
# that code the cancellation passes through can tell it from a client that went away.


class ClientGuard:
    """Start it when the request is dispatched (idle time counts from then); `close()` when it ends."""

    __slots__ = (
        "_request",
        "_loop",
        "_idle_s",
        "_slow_s",
        "_since_s",
        "_busy",
        "_timer",
        "_on_idle",
        "_count_abort",
        "_label",
        "expired",
    )

    def __init__(
        self,
        request: web.BaseRequest,
        *,
        idle_s: float | None,
        slow_s: float,
        on_idle: Callable[[], None],
        count_abort: Callable[[], None],
        label: str,
    ) -> None:
        """`idle_s` None: no idle bound (a non-streamed request's final write); `label` names the request in
        logs."""
        self._request = request
        self._loop = asyncio.get_running_loop()
        self._idle_s = idle_s
        self._slow_s = slow_s
        self._since_s = self._loop.time()  # the last event's write began or ended (whichever was last)
        self._busy = False  # a write is in progress
        self._on_idle = on_idle
        self._count_abort = count_abort
        self._label = label
        self.expired: Literal["idle", "slow"] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._arm(self._since_s)

    def begin(self) -> None:
        self._since_s = self._loop.time()
        self._busy = True

    def end(self) -> None:
        self._busy = False
        self._since_s = self._loop.time()

    @property
    def cut(self) -> bool:
        """The guard aborted the connection (a slow client)."""
        return self.expired == "slow"

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Mark a write outside `GuardedSink` (the stream's end, an error event). A write the guard cut
        returns normally (aiohttp wakes it when the connection is gone): check `cut` after it."""
        self.begin()
        try:
            yield
        finally:
            self.end()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self, now_s: float) -> None:
        if self._busy:
            due_s = self._since_s + self._slow_s
        else:
            due_s = now_s + self._slow_s / CHECKS_PER_BOUND  # a write may begin any time
            if self._idle_s is not None:
                due_s = min(due_s, self._since_s + self._idle_s)
        self._timer = self._loop.call_at(due_s, self._check)

    def _check(self) -> None:
        now_s = self._loop.time()
        if self._busy and now_s >= self._since_s + self._slow_s:
            self._timer = None
            self._abort()
            return
        if not self._busy and self._idle_s is not None and now_s >= self._since_s + self._idle_s:
            self.expired = "idle"
            self._idle_s = None  # once; the error event's write is still watched for a slow client
            self._on_idle()
        self._arm(now_s)

    def _abort(self) -> None:
        self.expired = "slow"
        self._count_abort()
        log.warning(
            "request %s: the client read nothing for %g s (client_limits.slow_client_timeout_s); "
            "closing its connection and aborting the request",
            self._label,
            self._slow_s,
        )
        transport = self._request.transport
        if transport is not None:
            # abort, not close: close would wait for the unread bytes to drain first, which they never do.
            transport.abort()


class GuardedSink:
    """`sink` with each event's write marked for `guard`; raises `ClientDisconnected` once the guard has cut a
    slow client (the dispatcher then closes the engine streams)."""

    __slots__ = ("_guard", "_sink")

    def __init__(self, guard: ClientGuard, sink: EventSink) -> None:
        self._guard = guard
        self._sink = sink

    async def on_event(self, index: int, event: EngineEvent) -> None:
        guard = self._guard
        guard.begin()
        try:
            await self._sink.on_event(index, event)
        finally:
            guard.end()
        if guard.cut:
            raise ClientDisconnected("the client stopped reading (slow_client_timeout_s)")
