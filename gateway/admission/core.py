"""Admission control as pure decisions: a bounded, priority-ordered gateway queue per model, SLO-aware
shedding.

Owns: `AdmissionParams`; `ModelQueue`, one model's state (requests dispatched through it, the queue, recent
completions) and its decisions (`arrive`, `expire`, `pump`, `leave`; `enter` and `pump_fleet` take the slots
and the engines' TTFT from a `ClusterSnapshot`, as both executors call them); `fleet_slots` and
`predicted_engine_ttft_s`, what it reads from a snapshot. The live `AdmissionGate` (`gateway.admission.gate`)
runs it with futures and the clock; `loadgen simulate` runs it in virtual time (`loadgen.simulate.runner`,
`SimOptions.admission`: while requests wait, the simulated fleet advances from one iteration completion to
the next so a queued request goes at the finish that frees its slot).
Must not: import asyncio, aiohttp, grpc, prometheus or time, read a clock (times are arguments), or route.

The model (one per served model):
- Slots: the fleet's concurrent capacity, the sum over the engines in the pool of their `max_num_seqs`
  (`default_engine_slots` for an engine that does not say). While fewer requests than that are dispatched and
  nobody waits, a request goes through at once; otherwise it waits in the queue, ordered by priority (lower
  values first, as vLLM's) then arrival. With no engine in the pool the gate lets everything through (the
  dispatcher answers no_engine_available).
- Predicted TTFT of a new request = its queue wait + the best engine's TTFT. Queue wait = (requests queued
  ahead of it, + 1) / the model's completion rate over the last `rate_window_s` (0 while it would go through
  at once; unknown, so no shedding on it, before any completion), times a calibration factor: the
  `slo_quantile` quantile of actual / predicted wait over the last `calibration_samples` requests that left
  the queue (1.0 until `min_calibration_samples` have). The rate estimate is a mean, and completions come in
  bursts (a batch of equal-length requests finishes together): uncalibrated, the requests admitted near the
  SLO's edge missed it about half the time (91.5 % of admitted met a 1 s SLO at 2x load, 100 % calibrated;
  benchmarks/overload.py). Scaling by the observed ratio's quantile is split-conformal prediction: if recent
  waits are exchangeable with the next one, a fraction `slo_quantile` of admitted requests wait no longer
  than predicted, whatever the burst pattern, with no constant fitted to a trace. Engine TTFT = the engine's
  recent mean TTFT as the gateway observed it (a measurement of the engine now), else, with LENS, its batch
  latency + queued prefill (pending + dispatched-unreported + this prompt) / the prefill rate its LENS plans
  grant (`LensState.prefill_tokens_per_s`) or, when LENS does not plan, P_max; else unknown (0). A
  nominal-peak estimate by GPU class was tried and dropped: on sim agents it predicted > 1.5 s where 4 ms was
  measured and shed 68 % of an under-loaded run (benchmarks/overload.py).
- Shedding, answered at once, only while the slots are full (a request that would go through at once is
  never shed): predicted TTFT > the request's TTFT SLO (reason `slo_unattainable`; requests without an SLO are
  never shed on prediction); the queue full (`queue_full`), unless a queued request has a
  lower priority (larger value) than the newcomer, in which case the last such request is shed instead
  (`preempted`) and the newcomer queues. `retry_after_s` = the predicted wait, clamped to [1, 60] s.
- Expiry (`shed_expired`, on by default): a queued request with a TTFT SLO is shed when its deadline
  (arrival + SLO) passes while it still waits (`expire`, reason `slo_expired`; live, a timer at the
  deadline; in the simulator, a step of its own). It can no longer meet its SLO, and the slot it would take
  belongs to one that still can. The check is the certain miss (it waited past its SLO), not a prediction:
  also shedding when the wait plus the best engine's TTFT passes the deadline gained 0-6 % more requests
  within SLO, not worth a second predicted shed. Without expiry, what queued before the first completions (no
  rate yet, so no prediction) waited far past its SLO and then took slots: Poisson overload on one simulated
  A100 (500 prompt / 400 output tokens, 1 s TTFT SLO, 60 s; benchmarks/admission_expiry.py) at 1.5x / 2x /
  4x capacity, 606 / 619 / 306 requests met the SLO against 586 / 427 / 40 without it (1.03x / 1.45x /
  7.65x). Other shapes: an H100 with 200 / 200 tokens, 1.01x / 0.99x / 1.41x; a prefill-heavy A100 (2,000 /
  100), 1.00x at every load (its own TTFT misses the SLO: what the gate lets through is not the problem).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from gateway.domain import ClusterSnapshot, EngineView

ShedReason = Literal["queue_full", "slo_unattainable", "preempted", "slo_expired"]


@dataclass(frozen=True, slots=True)
class AdmissionParams:
    max_queue: int = 1024  # per model
    default_engine_slots: int = 256  # an engine that does not describe max_num_seqs
    rate_window_s: float = 10.0
    slo_quantile: float = 0.99  # the share of admitted requests whose queue wait should fit the prediction
    calibration_samples: int = 512  # recent actual/predicted wait ratios kept
    min_calibration_samples: int = 20  # before this many, the factor is 1.0
    shed_expired: bool = True  # shed a queued request once its TTFT SLO has passed (`expire`)

    def __post_init__(self) -> None:
        if self.max_queue < 0 or self.default_engine_slots < 1 or self.rate_window_s <= 0:
            raise ValueError("need max_queue >= 0, default_engine_slots >= 1, rate_window_s > 0")
        if (
            not 0.0 < self.slo_quantile <= 1.0
            or self.calibration_samples < 1
            or self.min_calibration_samples < 1
        ):
            raise ValueError(
                "need 0 < slo_quantile <= 1, calibration_samples >= 1, min_calibration_samples >= 1"
            )


@dataclass(eq=False, slots=True)
class Ticket:
    """One request at the gate (compared by identity)."""

    priority: int
    arrival_s: float
    slots: int = 1  # choices (n)
    seq: int = 0
    state: Literal["new", "queued", "admitted", "shed", "gone"] = "new"
    shed_reason: ShedReason | None = None
    retry_after_s: float = 1.0
    predicted_wait_s: float | None = None  # uncalibrated, while queued: what the calibration compares with
    deadline_s: float | None = None  # while queued with a TTFT SLO (and `shed_expired`): arrival + SLO


@dataclass(frozen=True, slots=True)
class Shed:
    ticket: Ticket
    reason: ShedReason
    retry_after_s: float


@dataclass(slots=True)
class Arrival:
    """What `arrive` decided: `admitted` (go now), `queued` (wait for `pump`), or `shed` (answer now); plus
    any queued ticket it preempted (answer that one now too)."""

    outcome: Literal["admitted", "queued", "shed"]
    shed: Shed | None = None
    preempted: Shed | None = None
    predicted_ttft_s: float | None = None


def predicted_engine_ttft_s(e: EngineView, prompt_tokens: int) -> float | None:
    """The engine's TTFT for a new request of `prompt_tokens` (see the module docstring); None if unknown."""
    if e.recent_ttft_s is not None:
        return e.recent_ttft_s
    lens = e.lens
    if lens is None or lens.peak_throughput_tokens_per_s <= 0:
        return None
    latency_s = lens.predicted_batch_latency_s * (1.0 + lens.prediction_error_ratio)
    queued = e.pending_prefill_tokens + e.unreported_prompt_tokens + max(0, prompt_tokens)
    return latency_s + queued / (lens.prefill_tokens_per_s or lens.peak_throughput_tokens_per_s)


def fleet_slots(snapshot: ClusterSnapshot, model: str, params: AdmissionParams) -> int:
    return sum(
        e.max_num_seqs if e.max_num_seqs > 0 else params.default_engine_slots for e in snapshot.serving(model)
    )


def best_engine_ttft_s(snapshot: ClusterSnapshot, model: str, prompt_tokens: int) -> float | None:
    estimates = [predicted_engine_ttft_s(e, prompt_tokens) for e in snapshot.serving(model)]
    known = [t for t in estimates if t is not None]
    return min(known) if known else None


@dataclass(slots=True)
class ModelQueue:
    """One model's gate (see the module docstring); every method takes the time as an argument."""

    params: AdmissionParams
    dispatched: int = 0  # slots held by admitted tickets
    _heap: list[tuple[int, int, Ticket]] = field(default_factory=list)  # (priority, seq, ticket)
    _deadlines: list[tuple[float, int, Ticket]] = field(default_factory=list)  # (deadline, seq, ticket)
    _queued: int = 0  # live tickets in the heap (gone ones are skipped lazily)
    _seq: int = 0
    _completions: deque[float] = field(default_factory=deque)
    _ratios: deque[float] = field(default_factory=deque)  # actual / predicted queue wait, recent
    _factor: float | None = None  # cached quantile of `_ratios`; None = recompute

    @property
    def queued(self) -> int:
        return self._queued

    def wait_factor(self) -> float:
        """The calibration factor: the `slo_quantile` quantile of recent actual/predicted waits (1.0 while
        fewer than `min_calibration_samples`)."""
        if self._factor is None:
            ratios = self._ratios
            if len(ratios) < self.params.min_calibration_samples:
                self._factor = 1.0
            else:
                ordered = sorted(ratios)
                self._factor = ordered[
                    min(len(ordered) - 1, math.ceil(self.params.slo_quantile * len(ordered)) - 1)
                ]
        return self._factor

    def completion_rate(self, now_s: float) -> float:
        """Releases per second over the rate window (0.0 before any)."""
        window_s = self.params.rate_window_s
        done = self._completions
        while done and done[0] <= now_s - window_s:
            done.popleft()
        return len(done) / window_s

    def enter(
        self, ticket: Ticket, now_s: float, snapshot: ClusterSnapshot, model: str, prompt_tokens: int,
        slo_ttft_s: float | None,
    ) -> Arrival:
        """`arrive` on `model`'s fleet in `snapshot`: its slots, and the best engine's TTFT for a ticket that
        cannot go at once (one that can needs no prediction: the walk over the engines is skipped)."""
        slots = fleet_slots(snapshot, model, self.params)
        engine_ttft_s = (best_engine_ttft_s(snapshot, model, prompt_tokens)
                         if slots > 0 and not self._goes_at_once(ticket, slots) else None)
        return self.arrive(ticket, now_s, slots, engine_ttft_s, slo_ttft_s)

    def pump_fleet(self, snapshot: ClusterSnapshot, model: str, now_s: float) -> list[Ticket]:
        """`pump` with `model`'s slots in `snapshot`."""
        return self.pump(fleet_slots(snapshot, model, self.params), now_s)

    def _goes_at_once(self, ticket: Ticket, slots: int) -> bool:
        return slots <= 0 or (self._queued == 0 and self.dispatched + ticket.slots <= slots)

    def arrive(
        self, ticket: Ticket, now_s: float, slots: int, engine_ttft_s: float | None, slo_ttft_s: float | None
    ) -> Arrival:
        self._seq += 1
        ticket.seq = self._seq
        if self._goes_at_once(ticket, slots):
            self._admit(ticket)
            return Arrival("admitted", predicted_ttft_s=engine_ttft_s)
        ahead = sum(1 for p, _, t in self._heap if t.state == "queued" and p <= ticket.priority)
        rate = self.completion_rate(now_s)
        raw_wait_s = (ahead + 1) / rate if rate > 0 else None
        wait_s = None if raw_wait_s is None else raw_wait_s * self.wait_factor()
        predicted = None if wait_s is None else wait_s + (engine_ttft_s or 0.0)
        retry_after_s = _retry_after_s(wait_s)
        if slo_ttft_s is not None and predicted is not None and predicted > slo_ttft_s:
            return Arrival(
                "shed", shed=self._shed(ticket, "slo_unattainable", retry_after_s), predicted_ttft_s=predicted
            )
        preempted: Shed | None = None
        if self._queued >= self.params.max_queue:
            victim = self._lowest_priority()
            if victim is None or victim.priority <= ticket.priority:
                return Arrival(
                    "shed", shed=self._shed(ticket, "queue_full", retry_after_s), predicted_ttft_s=predicted
                )
            self._queued -= 1
            preempted = self._shed(victim, "preempted", retry_after_s)
        ticket.state = "queued"
        ticket.predicted_wait_s = raw_wait_s
        heapq.heappush(self._heap, (ticket.priority, ticket.seq, ticket))
        self._queued += 1
        if slo_ttft_s is not None and self.params.shed_expired:
            ticket.deadline_s = ticket.arrival_s + slo_ttft_s
            heapq.heappush(self._deadlines, (ticket.deadline_s, ticket.seq, ticket))
        return Arrival("queued", preempted=preempted, predicted_ttft_s=predicted)

    @property
    def next_deadline_s(self) -> float | None:
        """The earliest TTFT deadline of the queued tickets (None: none has one): `expire` sheds it then."""
        deadlines = self._deadlines
        while deadlines and deadlines[0][2].state != "queued":
            heapq.heappop(deadlines)
        return deadlines[0][0] if deadlines else None

    def expire(self, now_s: float) -> list[Shed]:
        """Shed the queued tickets whose TTFT deadline (arrival + SLO) has passed by `now_s`, earliest first
        (reason `slo_expired`): they can no longer meet their SLO, and a slot given to one is taken from a
        request that still can. Call before `pump`. Each one's wait so far against its prediction joins the
        calibration (a lower bound on its actual/predicted ratio: dropping it would bias the factor low)."""
        expired: list[Ticket] = []
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now_s:
            _, _, ticket = heapq.heappop(deadlines)
            if ticket.state == "queued":  # else admitted, preempted or gone since it queued
                self._queued -= 1  # its `_heap` entry is skipped by `pump`
                self._calibrate(ticket, now_s)
                expired.append(ticket)
        if not expired:
            return []
        rate = self.completion_rate(now_s)  # retry after the wait a newcomer would now be predicted
        retry_after_s = _retry_after_s(self._queued / rate * self.wait_factor() if rate > 0 else None)
        return [self._shed(ticket, "slo_expired", retry_after_s) for ticket in expired]

    def pump(self, slots: int, now_s: float) -> list[Ticket]:
        """Queued tickets that may go now (in order), admitted; call after a leave or a capacity change. Each
        one's actual wait against its prediction joins the calibration."""
        admitted: list[Ticket] = []
        heap = self._heap
        while heap:
            _, _, head = heap[0]
            if head.state != "queued":
                heapq.heappop(heap)
                continue
            if slots > 0 and self.dispatched + head.slots > slots and self.dispatched > 0:
                break
            heapq.heappop(heap)
            self._queued -= 1
            self._admit(head)
            admitted.append(head)
            self._calibrate(head, now_s)
        return admitted

    def _calibrate(self, ticket: Ticket, now_s: float) -> None:
        """The ticket left the queue at `now_s`: its actual wait over its predicted one joins the samples."""
        if ticket.predicted_wait_s is not None and ticket.predicted_wait_s > 0:
            self._ratios.append((now_s - ticket.arrival_s) / ticket.predicted_wait_s)
            if len(self._ratios) > self.params.calibration_samples:
                self._ratios.popleft()
            self._factor = None

    def leave(self, ticket: Ticket, now_s: float) -> None:
        """The ticket's request ended (or its client left while it was queued)."""
        if ticket.state == "admitted":
            self.dispatched -= ticket.slots
            self._completions.append(now_s)
            self.completion_rate(now_s)  # drops what left the window: bounded by the window's completions
        elif ticket.state == "queued":
            self._queued -= 1  # its heap entry is skipped by `pump`
        ticket.state = "gone"

    def _admit(self, ticket: Ticket) -> None:
        ticket.state = "admitted"
        self.dispatched += ticket.slots

    def _shed(self, ticket: Ticket, reason: ShedReason, retry_after_s: float) -> Shed:
        ticket.state = "shed"
        ticket.shed_reason = reason
        ticket.retry_after_s = retry_after_s
        return Shed(ticket, reason, retry_after_s)

    def _lowest_priority(self) -> Ticket | None:
        """The queued ticket to preempt first: the largest priority value, latest arrival among those."""
        live = [(p, s, t) for p, s, t in self._heap if t.state == "queued"]
        return max(live, key=lambda x: (x[0], x[1]))[2] if live else None


def _retry_after_s(wait_s: float | None) -> float:
    """`Retry-After` for a refusal: the predicted queue wait, clamped to [1, 60] s (1 s when unknown)."""
    return min(60.0, max(1.0, math.ceil(wait_s))) if wait_s is not None else 1.0
