"""Event-loop lag: how late the gateway's one event loop runs a timer, exported as a histogram.

Owns: `LoopLagMonitor`, a background task that sleeps `interval_s`, then records how much later than asked it
woke (`record`: the expected wake-up in, one observation out, read from an injected `Clock`), and
`lag_monitor_ctx`, the app's `cleanup_ctx` entry that runs it for the app's life (cancelled and awaited at
shutdown). Any callback that holds the loop (a long parse, a collection, a burst of thousands of chunks in one
tick) delays the wake-up by about what it holds, so the histogram's tail is the responsiveness every request
sees. Idle cost: one timer wake-up per interval (20 a second at 50 ms) and one bisect.
Must not: block, sleep other than the monitor's own timer, or decide anything; the histogram it feeds is
registered by `GatewayMetrics` (`switchyard_event_loop_lag_seconds`).

Resolution: a timer can fire up to about a millisecond late on an idle loop (uvloop's timers count whole
milliseconds), so read lags below 1 ms as "none".
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from switchyard.clock import Clock, MonotonicClock

DEFAULT_INTERVAL_S = 0.05


class LoopLagMonitor:
    """Sleeps `interval_s` in a loop and observes each wake-up's lateness, in seconds (never negative)."""

    __slots__ = ("_observe", "_interval_s", "_clock")

    def __init__(
        self,
        observe: Callable[[float], None],
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Clock | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self._observe = observe
        self._interval_s = interval_s
        self._clock: Clock = clock or MonotonicClock()

    @property
    def interval_s(self) -> float:
        return self._interval_s

    def expected_wake_s(self) -> float:
        """When a sleep of `interval_s` started now should end."""
        return self._clock.now() + self._interval_s

    def record(self, expected_s: float) -> float:
        """Observe how late the clock reads against `expected_s` (an early timer counts as 0); returns it."""
        lag_s = self._clock.now() - expected_s
        if lag_s < 0.0:
            lag_s = 0.0
        self._observe(lag_s)
        return lag_s

    async def run(self) -> None:
        """Forever: sleep one interval, record the lateness. Cancel to stop."""
        interval_s = self._interval_s
        while True:
            expected_s = self.expected_wake_s()
            await asyncio.sleep(interval_s)
            self.record(expected_s)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """`run` as a task for the body's duration, cancelled and awaited on the way out."""
        task = asyncio.get_running_loop().create_task(self.run(), name="loop-lag-monitor")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def lag_monitor_ctx(
    observe: Callable[[float], None], *, interval_s: float = DEFAULT_INTERVAL_S
) -> Callable[[web.Application], AsyncIterator[None]]:
    """A `cleanup_ctx` entry running a `LoopLagMonitor` into `observe` while the app runs."""

    async def ctx(_app: web.Application) -> AsyncIterator[None]:
        async with LoopLagMonitor(observe, interval_s=interval_s).running():
            yield

    return ctx
