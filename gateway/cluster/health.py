"""Passive outlier detection for one engine: consecutive failures eject it, a half-open probe brings it
back.

Owns: `OutlierParams` and `EngineHealth`, the per-engine state machine `ClusterState` keeps (so the live
gateway and the simulator eject the same way, invariant I1). Outcomes come from the executor: a request's
first event is a success (the transport works); an engine unreachable or failing before its first event
(`connect_failures`, `server_errors`), failing mid-stream (`server_errors`) or producing no event for the
stall timeout (`stall`) is a failure. A client going away or a request the engine rejects as invalid is
neither.
Must not: import asyncio, aiohttp, grpc, prometheus or time, read a clock (every time is an argument), or
decide routing (it says whether the engine is in the pool; policies choose among the engines that are).

States and transitions (Envoy's outlier detection, simplified to one consecutive-failure counter):
- healthy: in the pool. `consecutive_failures` failures in a row eject it, unless that would take more than
  `max_ejected_ratio` of its model's engines out of the pool (at least one engine may always be ejected);
  the counter then keeps counting and the next failure tries again.
- ejected until t = now + min(max_ejection_s, base_ejection_s * 2**(ejections - 1)): out of the pool.
  `ejections` counts ejections since the engine last proved healthy, so a flapping engine stays out longer.
- half-open (t reached): in the pool for exactly one request, the probe. While the probe is in flight the
  engine is out of the pool again; its first event ends the ejection (healthy, `ejections` reset), its
  failure ejects again for the next, longer period, and a probe that ends without a verdict (the client left)
  frees the slot for another probe.
- Any success ends an ejection at once: a request dispatched before it that now succeeds is evidence too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FailureReason = Literal["connect_failures", "server_errors", "stall"]
FAILURE_REASONS: tuple[FailureReason, ...] = ("connect_failures", "server_errors", "stall")


@dataclass(frozen=True, slots=True)
class OutlierParams:
    consecutive_failures: int = 5
    base_ejection_s: float = 5.0
    max_ejection_s: float = 60.0
    max_ejected_ratio: float = 0.5  # of a model's engines; at least one may always be ejected

    def __post_init__(self) -> None:
        if self.consecutive_failures < 1:
            raise ValueError(f"consecutive_failures must be >= 1, got {self.consecutive_failures}")
        if not 0 < self.base_ejection_s <= self.max_ejection_s:
            raise ValueError("need 0 < base_ejection_s <= max_ejection_s")
        if not 0.0 <= self.max_ejected_ratio <= 1.0:
            raise ValueError(f"max_ejected_ratio must be in [0, 1], got {self.max_ejected_ratio}")

    def ejection_s(self, ejections: int) -> float:
        return min(self.max_ejection_s, self.base_ejection_s * 2.0 ** min(max(ejections - 1, 0), 32))

    def may_eject(self, ejected_now: int, engines: int) -> bool:
        """Whether one more engine of a model with `engines` engines, `ejected_now` of them out, may go."""
        return ejected_now + 1 <= max(1, int(self.max_ejected_ratio * engines))


class EngineHealth:
    """One engine's outlier state (see the module docstring); every method takes the time as an argument."""

    __slots__ = ("failures", "ejections", "ejected_until_s", "probe_request", "last_reason")

    def __init__(self) -> None:
        self.failures = 0  # consecutive
        self.ejections = 0  # since the engine last proved healthy
        self.ejected_until_s: float | None = None  # None: not ejected; reached: half-open
        self.probe_request: str | None = None  # the half-open probe in flight
        self.last_reason: FailureReason | None = None

    def out_of_pool(self, now_s: float) -> bool:
        """Ejected and not yet half-open, or half-open with its probe in flight."""
        until_s = self.ejected_until_s
        if until_s is None:
            return False
        return now_s < until_s or self.probe_request is not None

    def is_ejected(self, now_s: float) -> bool:
        """Ejected and the ejection period still running (for gauges; half-open counts as not ejected)."""
        return self.ejected_until_s is not None and now_s < self.ejected_until_s

    def next_change_s(self, now_s: float) -> float:
        """When the pool membership changes by itself (the ejection period ends), else +inf."""
        until_s = self.ejected_until_s
        return until_s if until_s is not None and now_s < until_s else float("inf")

    def on_dispatch(self, request_id: str, now_s: float) -> None:
        """A request was sent to the engine: in half-open state it is the probe."""
        until_s = self.ejected_until_s
        if until_s is not None and now_s >= until_s and self.probe_request is None:
            self.probe_request = request_id

    def on_release(self, request_id: str) -> None:
        """A request to the engine ended; a probe that ended without a verdict frees the probe slot."""
        if self.probe_request == request_id:
            self.probe_request = None

    def on_success(self) -> bool:
        """The engine answered a request; True when that ended an ejection."""
        self.failures = 0
        self.last_reason = None
        if self.ejected_until_s is None:
            return False
        self.ejected_until_s = None
        self.ejections = 0
        self.probe_request = None
        return True

    def on_failure(
        self, reason: FailureReason, now_s: float, params: OutlierParams, *, may_eject: bool
    ) -> bool:
        """A request to the engine failed; True when this failure ejected it (counted once per ejection)."""
        self.failures += 1
        self.last_reason = reason
        until_s = self.ejected_until_s
        if until_s is not None:
            if now_s < until_s:
                return False  # already out: the failure of a request sent before the ejection
            # Half-open: the probe (or a request raced in with it) failed, so back out for longer.
            self.probe_request = None
            return self._eject(now_s, params)
        if self.failures >= params.consecutive_failures and may_eject:
            return self._eject(now_s, params)
        return False

    def _eject(self, now_s: float, params: OutlierParams) -> bool:
        self.ejections += 1
        self.ejected_until_s = now_s + params.ejection_s(self.ejections)
        self.failures = 0
        return True
