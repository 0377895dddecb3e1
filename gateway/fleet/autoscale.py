"""CAUCHY's autoscaler in the live gateway (paper 004, §3.5): measured QPS into Algorithm 1
(`gateway.planning.autoscaler`, the code the simulator and `switchyard plan --autoscale` run), its actions
applied to the fleet through an `Actuator`.

Owns: `AutoscaleLoop`. Every `step_s` it takes one QPS sample (the requests this gateway received for a
served model since the last sample, admitted or not: demand, not what was served), runs `Autoscaler.observe`
in a worker thread (a scale-out or a re-plan solves the ILP: tens of ms, never on the event loop) and
applies what it decides:
- `ScaleOut`: each new copy "C#k" (k continues the plan's numbering, as in the simulator) is provisioned by
  the actuator, which answers with its agents' addresses once they serve. They join the cluster store; the
  agents report their combo label and role themselves, so routing (goodput_rr, hand-offs) sees the copy.
- `ScaleIn`: the newest copies of each combo named, not already leaving. A copy still provisioning is
  cancelled; a serving one is released: the actuator drains its agents (they report draining, take nothing
  new and finish what they hold) and answers once they are gone; then they leave the store. A re-plan's
  ScaleIn (make before break) waits until the copies its ScaleOut added serve and until its `at_s`; when
  one of them failed, the old copies stay (and say so).
- `Blocked`: logged and counted.
Without an actuator (`gateway --autoscale` on its own) the loop decides and publishes only: `view()` (GET
/v1/plan) gives the target combos and the action timeline, for an operator or an outside controller.
The decided copies' timing is the actuator's: the autoscaler's `provisioning_s` is only its own estimate.
Must not: route, run the solver on the event loop, or drop an engine it added without releasing it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from gateway.domain import EngineId
from gateway.engines.base import EngineClient
from gateway.observability.metrics import GatewayMetrics
from gateway.planning.autoscaler import (
    Action,
    Autoscaler,
    AutoscalerParams,
    Blocked,
    ScaleIn,
    ScaleOut,
    action_row,
    copy_label,
    newest_copies,
)
from gateway.planning.ilp import PulpCbcSolver, Solver
from gateway.planning.plan_file import Plan
from switchyard.clock import Clock

log = logging.getLogger(__name__)

CopyState = Literal["provisioning", "serving", "draining", "gone", "cancelled", "failed"]


@dataclass(frozen=True, slots=True)
class CopySpec:
    """One copy of a combo to provision: `label` "C#k", `combo` C (e.g. "1xh800+2xh20"), `model` the plan's
    model (the catalogue name, e.g. "llama3-8b")."""

    label: str
    combo: str
    model: str


class Actuator(Protocol):
    """Starts and stops a copy's engines (`switchyard up`'s local agents; elsewhere a cloud's API)."""

    name: str

    async def provision(self, copy: CopySpec) -> Sequence[str]:
        """Start the copy's engines; return their addresses once every one serves. Cancelled: stop what it
        started. Raises when it cannot (the copy is marked failed)."""
        ...

    async def release(self, label: str, addresses: Sequence[str]) -> None:
        """Drain and stop these engines (their in-flight requests finish first); return once they are gone."""
        ...


class Membership(Protocol):
    """What the loop changes of the cluster store (`gateway.cluster.store.ClusterStore` implements it)."""

    def add_engine(self, engine_id: EngineId, client: EngineClient) -> None: ...

    async def remove_engine(self, engine_id: EngineId) -> None: ...

    def engine_ids(self) -> tuple[EngineId, ...]: ...

    def combos(self) -> dict[str, list[dict[str, Any]]]: ...


@dataclass(slots=True)
class FleetCopy:
    combo: str
    k: int
    state: CopyState
    decided_at_s: float | None  # None: in the plan from the start
    engines: tuple[str, ...] = ()
    serving_at_s: float | None = None
    gone_at_s: float | None = None
    error: str = ""
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def label(self) -> str:
        return copy_label(self.combo, self.k)

    def row(self) -> dict[str, Any]:
        return {"label": self.label, "combo": self.combo, "state": self.state, "engines": list(self.engines),
                "decided_at_s": self.decided_at_s, "serving_at_s": self.serving_at_s,
                "gone_at_s": self.gone_at_s, **({"error": self.error} if self.error else {})}


class AutoscaleLoop:
    """Algorithm 1 on this gateway's arrivals. `arrivals()`: requests received so far (a running count);
    `make_client(address)`: the engine client of a new engine. Times in `view()` are seconds since start."""

    def __init__(
        self,
        plan: Plan,
        *,
        params: AutoscalerParams,
        step_s: float,
        arrivals: Callable[[], int],
        store: Membership,
        make_client: Callable[[str], EngineClient],
        clock: Clock,
        metrics: GatewayMetrics | None = None,
        actuator: Actuator | None = None,
        solver: Solver | None = None,
    ) -> None:
        if not step_s > 0:
            raise ValueError(f"step_s must be > 0, got {step_s}")
        self._plan = plan
        self._scaler = Autoscaler(plan.candidates(), plan.inventory, solver or PulpCbcSolver(), plan.combos,
                                  plan.objective, params)
        self._step_s = step_s
        self._arrivals = arrivals
        self._store = store
        self._make_client = make_client
        self._clock = clock
        self._metrics = metrics
        self._actuator = actuator
        self._t0 = clock.now()
        self._last_s = self._t0
        self._last_n = arrivals()
        self.qps = 0.0
        self.actions: list[dict[str, Any]] = []
        self.copies: dict[str, FleetCopy] = {}
        self._next_k: dict[str, int] = {}
        for combo, count in sorted(plan.combos.items()):
            for k in range(count):
                self.copies[copy_label(combo, k)] = FleetCopy(combo, k, "serving", None)
            self._next_k[combo] = count
        self._target = dict(self._scaler.deployed)
        self._usd_per_h = self._scaler.usd_per_hour(0.0)
        self._tasks: set[asyncio.Task[None]] = set()
        self._leaving: set[str] = set()  # copies a ScaleIn chose (released, or waiting to be)

    # ---- running -------------------------------------------------------------------------------------

    def _now(self) -> float:
        return self._clock.now() - self._t0

    async def run(self) -> None:
        """Sample every `step_s` until cancelled; then cancel and await the copies' work in progress."""
        try:
            while True:
                await asyncio.sleep(self._step_s)
                await self.tick()
        finally:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def tick(self) -> list[Action]:
        """One sample: the QPS since the last one, Algorithm 1 off the loop, its actions applied."""
        now_abs, count = self._clock.now(), self._arrivals()
        elapsed = now_abs - self._last_s
        if elapsed <= 0:
            return []
        self.qps = (count - self._last_n) / elapsed
        self._last_s, self._last_n = now_abs, count
        now_s = now_abs - self._t0
        scaler = self._scaler

        def observe() -> tuple[list[Action], dict[str, int], float]:  # runs in a worker thread
            actions = scaler.observe(now_s, self.qps)
            return actions, dict(scaler.deployed), scaler.usd_per_hour(now_s)

        actions, self._target, self._usd_per_h = await asyncio.to_thread(observe)
        if self._metrics is not None:
            self._metrics.autoscale_qps.set(self.qps)
            self._metrics.autoscale_usd_per_hour.set(self._usd_per_h)
        added: list[FleetCopy] = []
        for action in actions:
            added += self._apply(action, added)
        return actions

    # ---- applying actions ----------------------------------------------------------------------------

    def _apply(self, action: Action, added: list[FleetCopy]) -> list[FleetCopy]:
        self.actions.append(action_row(action))
        if self._metrics is not None:
            self._metrics.autoscale_actions.labels(type(action).__name__).inc()
        log.info("autoscaler: %s", self.actions[-1])
        if isinstance(action, Blocked):
            log.warning("autoscaler blocked: %s", action.reason)
            return []
        if self._actuator is None:  # decide and publish only
            return []
        if isinstance(action, ScaleOut):
            new: list[FleetCopy] = []
            for combo, copies in sorted(action.combos.items()):
                for _ in range(copies):
                    k = self._next_k.get(combo, 0)
                    self._next_k[combo] = k + 1
                    copy = FleetCopy(combo, k, "provisioning", action.at_s)
                    self.copies[copy.label] = copy
                    copy.task = self._spawn(self._provision(copy), f"provision:{copy.label}")
                    new.append(copy)
            return new
        assert isinstance(action, ScaleIn)
        live = [(c.combo, c.k) for c in self.copies.values()
                if c.state in ("provisioning", "serving") and c.label not in self._leaving]
        for combo, k in newest_copies(live, action.combos):
            copy = self.copies[copy_label(combo, k)]
            self._leaving.add(copy.label)
            self._spawn(self._remove(copy, tuple(added), action.at_s), f"release:{copy.label}")
        return []

    def _spawn(self, work: Any, name: str) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _provision(self, copy: FleetCopy) -> None:
        assert self._actuator is not None
        spec = CopySpec(copy.label, copy.combo, self._plan.model.name)
        try:
            addresses = tuple(await self._actuator.provision(spec))
        except asyncio.CancelledError:
            copy.state = "cancelled"
            raise
        except Exception as e:  # noqa: BLE001 (the actuator's failure is the copy's, reported, not the loop's)
            copy.state, copy.error = "failed", f"{type(e).__name__}: {e}"
            log.error("autoscaler: provisioning %s failed: %s", copy.label, copy.error)
            return
        for address in addresses:
            self._store.add_engine(EngineId(address), self._make_client(address))
        copy.engines, copy.state, copy.serving_at_s = addresses, "serving", self._now()
        log.info("autoscaler: %s serves on %s", copy.label, ", ".join(addresses))

    async def _remove(self, copy: FleetCopy, after: Sequence[FleetCopy], at_s: float) -> None:
        """Release a copy, once the copies added with it serve (make before break) and `at_s` has come."""
        assert self._actuator is not None
        waits = [c.task for c in after if c.task is not None]
        if waits:
            await asyncio.gather(*waits, return_exceptions=True)
        failed = [c.label for c in after if c.state != "serving"]
        if failed and copy.state == "serving":  # never break what its replacement did not make
            copy.error = f"kept: its replacement {', '.join(failed)} did not come up"
            self._leaving.discard(copy.label)
            log.warning("autoscaler: %s %s", copy.label, copy.error)
            return
        delay = at_s - self._now()
        if delay > 0:
            await asyncio.sleep(delay)
        if copy.state == "provisioning" and copy.task is not None:
            copy.task.cancel()
            await asyncio.gather(copy.task, return_exceptions=True)
            copy.state, copy.gone_at_s = "cancelled", self._now()
            return
        if copy.state != "serving":
            return
        engines = copy.engines or tuple(e["engine_id"] for e in self._store.combos().get(copy.label, []))
        copy.state = "draining"
        try:
            await self._actuator.release(copy.label, engines)
        except Exception as e:  # noqa: BLE001
            copy.error = f"release: {type(e).__name__}: {e}"
            log.error("autoscaler: releasing %s failed: %s", copy.label, copy.error)
        known = set(self._store.engine_ids())
        for engine in engines:
            if EngineId(engine) in known:
                await self._store.remove_engine(EngineId(engine))
        copy.engines, copy.state, copy.gone_at_s = engines, "gone", self._now()
        log.info("autoscaler: %s is gone", copy.label)

    # ---- what GET /v1/plan shows ---------------------------------------------------------------------

    def view(self) -> dict[str, Any]:
        p = self._scaler.params
        return {
            "actuator": self._actuator.name if self._actuator is not None else None,
            "step_s": self._step_s,
            "params": {"ratio": p.ratio, "local_window_s": p.local_window_s,
                       "global_window_s": p.global_window_s, "provisioning_s": p.provisioning_s,
                       "grace_s": p.grace_s, "min_copies": p.min_copies},
            "uptime_s": self._now(),
            "qps": self.qps,
            "target_combos": dict(self._target),
            "usd_per_hour": self._usd_per_h,
            "actions": list(self.actions),
            "copies": [c.row() for c in self.copies.values()],
        }

