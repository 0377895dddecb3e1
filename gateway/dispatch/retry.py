"""How retries before the first byte are paced and bounded: jittered backoff and a retry budget.

Owns: `RetryParams` and `RetryBudget`, a gateway-wide allowance of retries (Finagle's and Linkerd's retry
budget): over a sliding window of `window_s`, retries may number at most
`min_retries_per_s * window_s + ratio * (choices started in the window)`, so a failing engine cannot turn
every request into `max_attempts` requests (a retry storm), while a quiet gateway still retries a few. And
`backoff_s`, the delay before attempt k+1: full jitter over min(max_backoff_s, base_backoff_s * 2**(k-1)).
Must not: import asyncio, aiohttp, grpc, prometheus or time, read a clock or draw randomness (time and the
uniform draw are arguments); the live dispatcher and the simulator drive the same budget (invariant I1).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RetryParams:
    ratio: float = 0.2  # retries per started choice, over the window
    min_retries_per_s: float = 1.0  # always allowed, so a quiet gateway still retries
    window_s: float = 10.0
    base_backoff_s: float = 0.025
    max_backoff_s: float = 1.0

    def __post_init__(self) -> None:
        if self.ratio < 0 or self.min_retries_per_s < 0:
            raise ValueError("ratio and min_retries_per_s must be >= 0")
        if self.window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")
        if not 0 <= self.base_backoff_s <= self.max_backoff_s:
            raise ValueError("need 0 <= base_backoff_s <= max_backoff_s")

    def backoff_s(self, attempt: int, rand: float) -> float:
        """The wait before attempt `attempt + 1` after attempt `attempt` (>= 1) failed; `rand` in [0, 1)."""
        cap_s = min(self.max_backoff_s, self.base_backoff_s * 2.0 ** min(max(attempt - 1, 0), 32))
        return cap_s * rand


class RetryBudget:
    """The sliding-window allowance of the module docstring; every call takes the time as an argument."""

    __slots__ = ("params", "_starts", "_retries")

    def __init__(self, params: RetryParams | None = None) -> None:
        self.params = params if params is not None else RetryParams()
        self._starts: deque[float] = deque()
        self._retries: deque[float] = deque()

    def on_start(self, now_s: float) -> None:
        """A choice began (its first attempt): it earns `ratio` retries for the window."""
        self._starts.append(now_s)
        if self._starts[0] <= now_s - self.params.window_s:  # bounded by the window's arrivals
            self._expire(now_s)

    def try_retry(self, now_s: float) -> bool:
        """Spend one retry if the budget allows it (True), else leave the budget as it is (False)."""
        self._expire(now_s)
        p = self.params
        allowance = p.min_retries_per_s * p.window_s + p.ratio * len(self._starts)
        if len(self._retries) + 1 > allowance:
            return False
        self._retries.append(now_s)
        return True

    def _expire(self, now_s: float) -> None:
        horizon_s = now_s - self.params.window_s
        for times in (self._starts, self._retries):
            while times and times[0] <= horizon_s:
                times.popleft()
