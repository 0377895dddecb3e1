"""Injected time (invariant I3): everything that reads time takes a `Clock`.

Owns: the `Clock` protocol, the wall/monotonic implementation and a manual clock for tests and the simulator.
Must not: sleep, schedule tasks, or be read by policies (policies get `now_s` inside their inputs).
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Seconds on a monotonic time line."""

    def now(self) -> float: ...


class MonotonicClock:
    """Real time: `time.monotonic()`."""

    def now(self) -> float:
        return time.monotonic()


class ManualClock:
    """Time that moves only when told to (tests, the discrete-event simulator)."""

    def __init__(self, start_s: float = 0.0) -> None:
        self._now = start_s

    def now(self) -> float:
        return self._now

    def advance(self, delta_s: float) -> None:
        if delta_s < 0:
            raise ValueError(f"cannot move time backwards by {delta_s}")
        self._now += delta_s

    def set(self, now_s: float) -> None:
        if now_s < self._now:
            raise ValueError(f"cannot move time backwards from {self._now} to {now_s}")
        self._now = now_s
