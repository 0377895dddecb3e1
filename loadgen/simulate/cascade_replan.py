"""Re-planning a cascade in the simulator (Cascadia §4.4, App. G): the monitor's windows, Algorithm 1 re-run
on a shift, the thresholds swapped and the replicas reconfigured one at a time.

Owns: `CascadeReplanner`, for a run whose `CascadeSim.replan` (`loadgen.simulate.cascade.SimReplan`) is
set: the runner's fleet-changes object (the interface of `loadgen.simulate.scaling.FleetChanges`: `next_s`,
`horizon_s`, `on_arrival`, `run_due`, `on_left`, `billed`, `actions`).
- Windows close at `WorkloadMonitor.next_close_s` (the cascade run feeds the monitor its arrivals, answers
  and shadowed rows). A `Shift` re-runs `plan_cascade` (or `SimReplan.planner`, a `Planner`) on the
  shift's rate and shadowed rows (or the profile the running plan was made on, when too few rows scored
  every model). The solve is timed on the
  wall clock the runner is given and lands that long after the window closed: requests go on under the
  running plan meanwhile (App. G). One re-plan at a time; a shift seen while one is rolling out is
  recorded and waits for the next window.
- On landing, the thresholds swap at once for requests arriving from then on (requests in flight keep
  theirs) and the replicas roll out (`gateway.cascade.plan.replan.rollout`): each step drains one old
  replica (it takes nothing new, its requests finish: none is lost), and once it has left its GPUs load the
  step's new replicas, which join `reload_s` later, 2 to 20 s (App. G): 2 s plus the replica's weights per
  GPU at `LOAD_BYTES_PER_S_PER_GPU`; the next step starts when they serve.
Must not: decide thresholds or deployments (the planner does), route, advance engines, or read any clock but
the injected timer (the solver's own duration).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from gateway.cascade.plan import PlanRequest, plan_cascade
from gateway.cascade.plan.replan import (
    Replica,
    Shift,
    Step,
    adopted_baseline,
    replicas,
    rollout,
    servable_thresholds,
)
from gateway.cascade.quality import QualityProfile
from loadgen.simulate.cascade import CascadeRun, SimReplan
from loadgen.simulate.fleet import SimNode
from loadgen.simulate.spec import SimOptions
from switchyard.profiles import Profile, get_profile, profile_name

RELOAD_FIXED_S = 2.0  # App. G: reconfiguration takes about 2-20 s
RELOAD_MAX_S = 20.0
LOAD_BYTES_PER_S_PER_GPU = 4e9  # weights from local storage into HBM, per GPU (an assumption, documented)


class PlannedCascade(Protocol):
    """What a re-plan must give (`gateway.cascade.plan.CascadePlan` is one): per stage its threshold, GPUs
    and replica groups (tp, pp, count), and whether it keeps up at all."""

    @property
    def thresholds(self) -> tuple[float, ...]: ...
    @property
    def gpus(self) -> tuple[int, ...]: ...
    @property
    def shapes(self) -> tuple[tuple[tuple[int, int, int], ...], ...]: ...
    @property
    def feasible(self) -> bool: ...


Planner = Callable[[PlanRequest, QualityProfile], PlannedCascade]


def reload_s(profile: Profile) -> float:
    """Seconds from a replica's GPUs being free to it serving: its weights per GPU loaded, within 2-20 s."""
    per_gpu = profile.model.weight_bytes / profile.num_gpus
    return min(RELOAD_MAX_S, RELOAD_FIXED_S + per_gpu / LOAD_BYTES_PER_S_PER_GPU)


def replica_of(node: SimNode) -> Replica:
    profile = get_profile(node.profile_name)
    return Replica(profile.model.name, profile.tensor_parallel, profile.pipeline_parallel)


class CascadeReplanner:
    """One run's re-planning: windows, solves, threshold swaps and rolling reconfiguration."""

    def __init__(
        self,
        replan: SimReplan,
        cascade: CascadeRun,
        options: SimOptions,
        nodes: Sequence[SimNode],
        t0_s: float,
        last_arrival_s: float,
        *,
        join: Callable[[SimNode, float], None],
        leave: Callable[[SimNode, float], None],
        counts: dict[str, int],
        timer: Callable[[], float],
    ) -> None:
        monitor = cascade.monitor
        if monitor is None:
            raise ValueError("a re-planning run needs the cascade run's monitor")
        self.replan = replan
        self.cascade = cascade
        self.monitor = monitor
        self.options = options
        self.t0_s = t0_s
        self.horizon_s = last_arrival_s
        self._join = join
        self._leave = leave
        self._counts = counts
        self._timer = timer
        self.models = cascade.sim.spec.models
        self.planned_on = replan.planned_on  # the profile the running plan was made on
        self.billed: list[SimNode] = list(nodes)
        self.serving: list[SimNode] = list(nodes)  # joined and not draining
        held = sum(get_profile(n.profile_name).num_gpus for n in nodes)
        if held > replan.gpus:
            raise ValueError(f"the fleet holds {held} GPUs, more than the re-planning budget {replan.gpus}")
        self.actions: list[dict[str, Any]] = []
        self._events: list[tuple[float, int, str, Any]] = []
        self._seq = 0
        self._busy = False  # a solve landing or a rollout running
        self._steps: list[Step] = []
        self._awaiting: SimNode | None = None  # the drained replica whose leaving starts the step's loads
        self._step_adds: tuple[Replica, ...] = ()
        self._loading = 0
        self.gap_s = 0.0  # summed time some stage model had no serving replica during rollouts
        self._gaps: dict[str, float] = {}  # model -> since when it has had none

    # ---- the runner's interface ------------------------------------------------------------------------

    @property
    def next_s(self) -> float:
        event_s = self._events[0][0] if self._events else math.inf
        close_s = self.monitor.next_close_s
        return min(event_s, close_s) if close_s <= self.horizon_s else event_s

    def on_arrival(self, now_s: float) -> None:
        """Arrivals reach the monitor through the cascade run (it decides shadows)."""

    def run_due(self, now_s: float) -> None:
        while True:
            close_s = self.monitor.next_close_s
            close_s = close_s if close_s <= self.horizon_s else math.inf
            event_s = self._events[0][0] if self._events else math.inf
            if min(close_s, event_s) > now_s:
                return
            if close_s <= event_s:
                shift = self.monitor.close(close_s)
                if shift is not None:
                    self._on_shift(shift, close_s)
                continue
            at_s, _, kind, payload = heapq.heappop(self._events)
            if kind == "land":
                self._land(payload, at_s)
            else:
                assert kind == "load"
                self._loaded(payload, at_s)

    def on_left(self, node: SimNode, now_s: float) -> None:
        """A drained engine has left (the runner saw its last request finish)."""
        if node is self._awaiting:
            self._awaiting = None
            self._load(self._step_adds, now_s)

    # ---- internals ----------------------------------------------------------------------------------------

    def _push(self, at_s: float, kind: str, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._events, (at_s, self._seq, kind, payload))

    def _row(self, kind: str, now_s: float, **extra: Any) -> None:
        self.actions.append({"at_s": now_s - self.t0_s, "kind": kind, **extra})

    def _on_shift(self, shift: Shift, now_s: float) -> None:
        reason = "; ".join(shift.reasons)
        if self._busy:
            self._row("shift_deferred", now_s, reason=reason)
            return
        replan = self.replan
        profile = shift.profile if shift.profile is not None else self.planned_on
        request = PlanRequest(
            self.models,
            replan.gpu,
            replan.gpus,
            shift.rate_rps,
            q_min=replan.q_min,
            l_max_s=replan.l_max_s,
            judge_latency_s=replan.judge_latency_s,
        )
        planner: Planner = replan.planner or plan_cascade
        started = self._timer()
        plan = planner(request, profile)
        solver_s = self._timer() - started
        self._busy = True
        self._row(
            "replan",
            now_s,
            reason=reason,
            rate_rps=shift.rate_rps,
            shadowed=len(profile.items) if shift.profile is not None else 0,
            solver_s=solver_s,
            thresholds=list(plan.thresholds),
            gpus=list(plan.gpus),
            shapes=[[list(g) for g in stage] for stage in plan.shapes],
            feasible=plan.feasible,
        )
        self._push(now_s + solver_s, "land", (plan, profile, shift))

    def _land(self, payload: Any, now_s: float) -> None:
        plan, profile, shift = payload
        shadowed = shift.profile is not None
        if not plan.feasible:  # nothing keeps up at this rate: keep serving as is
            self._row("replan_infeasible", now_s)
            self._busy = False
            return
        thresholds, _ = servable_thresholds(plan.thresholds)  # 101 (escalate all) is served as 100, as live
        self.cascade.set_thresholds(thresholds)
        self.planned_on = profile
        self.monitor.adopt(
            adopted_baseline(
                profile,
                self.models,
                thresholds,
                shift,
                shadowed=shadowed,
                sample_size=self.monitor.params.sample_size,
            )
        )
        current = [replica_of(n) for n in self.serving]
        self._steps = list(rollout(current, replicas(self.models, plan.shapes), self.replan.gpus))
        self._row("thresholds", now_s, thresholds=list(thresholds), steps=len(self._steps))
        self._next_step(now_s)

    def _next_step(self, now_s: float) -> None:
        if not self._steps:
            self._busy = False
            self._row("rolled_out", now_s, replicas=len(self.serving))
            return
        step = self._steps.pop(0)
        self._step_adds = step.add
        if step.remove is None:
            self._load(step.add, now_s)
            return
        node = next(n for n in self.serving if replica_of(n) == step.remove)
        self.serving.remove(node)
        if not any(n.model == node.model for n in self.serving):
            self._gaps.setdefault(node.model, now_s)
        self._row("drain", now_s, engine=node.engine_id)
        node.leave_after_s = now_s
        node.feed.drain(now_s)
        self._awaiting = node
        if not node.busy and not node.in_flight:
            self._leave(node, now_s)  # calls on_left

    def _load(self, adds: Sequence[Replica], now_s: float) -> None:
        self._loading = len(adds)
        if not adds:
            self._next_step(now_s)
            return
        for replica in adds:
            name = profile_name(
                self.replan.gpu, replica.model, replica.tensor_parallel, replica.pipeline_parallel
            )
            index = self._counts.get(name, 0)
            self._counts[name] = index + 1
            node = SimNode(f"{name}-{index}", name, self.options, billed_from_s=now_s)
            self.billed.append(node)
            self._push(now_s + reload_s(get_profile(name)), "load", node)

    def _loaded(self, node: SimNode, now_s: float) -> None:
        self._join(node, now_s)
        self.serving.append(node)
        since = self._gaps.pop(node.model, None)
        if since is not None:
            self.gap_s += now_s - since
        self._row("join", now_s, engine=node.engine_id)
        self._loading -= 1
        if self._loading == 0:
            self._next_step(now_s)

    def figures(self) -> dict[str, Any]:
        replans = [a for a in self.actions if a["kind"] == "replan"]
        return {
            "windows": self.monitor.windows,
            "replans": len(replans),
            "solver_s": [a["solver_s"] for a in replans],
            "gap_s": self.gap_s,
            "final_replicas": sorted(n.profile_name for n in self.serving),
            "last_tests": dict(self.monitor.last_tests),
        }
