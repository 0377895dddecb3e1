"""The live admission gate: `gateway.admission.core`'s decisions with futures, the clock and metrics.

Owns: `AdmissionGate` (one `ModelQueue` per model; `enter` admits, queues or sheds a request and `leave`
releases it, waking the queued requests that may go; a queued request with a TTFT SLO gets a timer at its
deadline, when the queue refuses it unless it went before), `Permit`, and `Rejected`, the error the API
answers with 503 (`fleet_saturated`) and a `Retry-After` header. Metrics:
`switchyard_admission_total{model,outcome}`, `switchyard_admission_rejections_total{model,reason}`,
`switchyard_gateway_queue_depth{model}`, `switchyard_gateway_queue_wait_seconds`.
Must not: route, parse requests or format HTTP.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from gateway.admission.core import AdmissionParams, ModelQueue, Shed, ShedReason, Ticket
from gateway.domain import ClusterSnapshot
from gateway.observability.metrics import GatewayMetrics
from switchyard.clock import Clock

log = logging.getLogger(__name__)


class Rejected(Exception):
    """The fleet is saturated for this request: answer 503 at once, with `Retry-After`."""

    def __init__(self, reason: ShedReason, retry_after_s: float, model: str) -> None:
        super().__init__(f"admission refused ({reason}) for model {model!r}")
        self.reason = reason
        self.retry_after_s = retry_after_s


@dataclass(eq=False, slots=True)
class Permit:
    model: str
    ticket: Ticket
    waker: asyncio.Future[None] | None = None


class AdmissionGate:
    def __init__(
        self,
        params: AdmissionParams,
        snapshot: Callable[[], ClusterSnapshot],
        clock: Clock,
        metrics: GatewayMetrics,
        *,
        enabled: bool = True,
    ) -> None:
        self.params = params
        self.enabled = enabled
        self._snapshot = snapshot
        self._clock = clock
        self._metrics = metrics
        self._models: dict[str, ModelQueue] = {}
        self._wakers: dict[int, Permit] = {}  # id(ticket) -> permit, while queued

    def _queue(self, model: str) -> ModelQueue:
        queue = self._models.get(model)
        if queue is None:
            queue = self._models[model] = ModelQueue(self.params)
        return queue

    async def enter(
        self, model: str, *, priority: int, prompt_tokens: int, slo_ttft_s: float | None, slots: int = 1
    ) -> Permit | None:
        """Admit the request (now, or after waiting in the queue), or raise `Rejected`. None when the gate
        is disabled. Cancelling the wait (the client left) leaves the queue."""
        if not self.enabled:
            return None
        now_s = self._clock.now()
        queue = self._queue(model)
        self._pump(model, queue)  # the fleet may have grown since the last leave
        ticket = Ticket(priority=priority, arrival_s=now_s, slots=max(1, slots))
        arrival = queue.enter(ticket, now_s, self._snapshot(), model, prompt_tokens, slo_ttft_s)
        m = self._metrics
        m.admission.labels(model, arrival.outcome if arrival.outcome != "shed" else "rejected").inc()
        if arrival.preempted is not None:
            self._reject_queued(model, arrival.preempted)
        permit = Permit(model, ticket)
        if arrival.outcome == "admitted":
            return permit
        if arrival.outcome == "shed":
            assert arrival.shed is not None
            m.admission_rejections.labels(model, arrival.shed.reason).inc()
            raise Rejected(arrival.shed.reason, arrival.shed.retry_after_s, model)
        loop = asyncio.get_running_loop()
        permit.waker = loop.create_future()
        self._wakers[id(ticket)] = permit
        m.queue_depth.labels(model).set(queue.queued)
        # At its TTFT deadline the queue sheds it (`expire`) unless it went before; between leaves and
        # arrivals nothing else would pump.
        deadline = (loop.call_later(max(0.0, ticket.deadline_s - now_s), self._pump, model, queue,
                                    ticket.deadline_s) if ticket.deadline_s is not None else None)
        try:
            await permit.waker
        except asyncio.CancelledError:
            self.leave(permit)
            raise
        finally:
            self._wakers.pop(id(ticket), None)
            if deadline is not None:
                deadline.cancel()
        m.queue_wait.observe(self._clock.now() - now_s)
        return permit

    def leave(self, permit: Permit | None) -> None:
        """The request ended (however); frees its slots and admits what may go now."""
        if permit is None or permit.ticket.state == "gone":
            return
        queue = self._queue(permit.model)
        queue.leave(permit.ticket, self._clock.now())
        self._pump(permit.model, queue)

    def _pump(self, model: str, queue: ModelQueue, due_s: float | None = None) -> None:
        """Refuse the queued requests whose TTFT deadline has passed, then wake those the slots let go.
        `due_s`: the deadline a timer fired for (it counts as passed even if the timer ran a hair early)."""
        if not queue.queued:
            return
        now_s = self._clock.now() if due_s is None else max(self._clock.now(), due_s)
        for shed in queue.expire(now_s):
            self._reject_queued(model, shed)
        for ticket in queue.pump_fleet(self._snapshot(), model, now_s):
            permit = self._wakers.get(id(ticket))
            if permit is not None and permit.waker is not None and not permit.waker.done():
                permit.waker.set_result(None)
        self._metrics.queue_depth.labels(model).set(queue.queued)

    def _reject_queued(self, model: str, shed: Shed) -> None:
        """A queued request was refused (preempted, or its deadline passed): its waiter raises `Rejected`."""
        self._metrics.admission_rejections.labels(model, shed.reason).inc()
        permit = self._wakers.get(id(shed.ticket))
        if permit is not None and permit.waker is not None and not permit.waker.done():
            permit.waker.set_exception(Rejected(shed.reason, shed.retry_after_s, model))

    def queued(self, model: str) -> int:
        queue = self._models.get(model)
        return queue.queued if queue is not None else 0
