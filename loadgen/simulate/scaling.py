"""The simulated fleet over time (CAUCHY §3.5): a plan's engines, the autoscaler's actions, joins, drains,
leaves and the bill.

Owns: `FleetChanges`, which the runner (`loadgen.simulate.runner`) asks for its next event time and calls
at it: QPS samples (`gateway.planning.autoscaler.QpsMeter`) go to the `Autoscaler` (or scripted actions come
due), a `ScaleOut` creates the combos' engines at once (billed from the decision) and has them join the
gateway's cluster states `provisioning_s` later; a `ScaleIn` drains the newest copies of its combos (their
reports say draining, the gateway routes them nothing new, and a request routed there before the report
arrived is refused and retried elsewhere by the runner, as a live agent refuses it; a copy still provisioning
is cancelled) and each
drained engine leaves once `gone_at_s` has passed and nothing is in flight (so no request is lost; its
bill runs until it leaves). `plan_engines` gives a plan's first fleet, `bill` what every engine cost.
Must not: route, or advance engines (the runner does both); read clocks.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from gateway.planning.autoscaler import (
    Action,
    Autoscaler,
    QpsMeter,
    ScaleIn,
    ScaleOut,
    action_row,
    copy_label,
    newest_copies,
)
from gateway.planning.ilp import PulpCbcSolver
from loadgen.simulate.fleet import SimNode, combo_engines
from loadgen.simulate.spec import EngineSpec, Scaling, SimOptions


def plan_engines(scaling: Scaling) -> list[EngineSpec]:
    """The plan's combos as engines: copy k of combo C is labelled "C#k"."""
    model = scaling.plan.model.name
    specs: list[EngineSpec] = []
    for combo, count in sorted(scaling.plan.combos.items()):
        for k in range(count):
            label = copy_label(combo, k)
            specs += [EngineSpec(profile, 1, combo=label, role=role)
                      for profile, role in combo_engines(combo, model)]
    return specs


def bill(nodes: Sequence[SimNode], start_s: float, end_s: float) -> float:
    """USD the engines cost between `start_s` and `end_s`: each from when it was billed until it left."""
    total = 0.0
    for node in nodes:
        until = end_s if node.left_s is None else min(node.left_s, end_s)
        held_s = until - max(node.billed_from_s, start_s)
        if held_s > 0:
            total += node.price_usd_h * held_s / 3600.0
    return total


def usd_per_hour(nodes: Sequence[SimNode], at_s: float) -> float:
    return sum(n.price_usd_h for n in nodes
               if n.billed_from_s <= at_s and (n.left_s is None or n.left_s > at_s))


class FleetChanges:
    """The fleet's changes during one run; times are absolute (the run's clock), actions' relative."""

    def __init__(self, scaling: Scaling, options: SimOptions, nodes: Sequence[SimNode], t0_s: float,
                 last_arrival_s: float, *, join: Callable[[SimNode, float], None],
                 leave: Callable[[SimNode, float], None], counts: dict[str, int]) -> None:
        self.scaling = scaling
        self.options = options
        self.t0_s = t0_s
        self._join = join
        self._leave = leave
        self._counts = counts  # engines numbered so far per profile (ids continue the initial fleet's)
        self.billed: list[SimNode] = list(nodes)  # every engine that ever held GPUs
        self.copies: dict[tuple[str, int], list[SimNode]] = {}  # (combo, k) of label "combo#k" -> its engines
        for node in nodes:
            combo, _, k = node.combo.partition("#")
            if combo and k.isdigit():  # plan_engines' labels
                self.copies.setdefault((combo, int(k)), []).append(node)
        self._next_copy: Counter[str] = Counter()
        for combo, k in self.copies:
            self._next_copy[combo] = max(self._next_copy[combo], k + 1)
        self._events: list[tuple[float, int, str, Any]] = []
        self._seq = 0
        self.actions: list[dict[str, Any]] = []
        self.scaler: Autoscaler | None = None
        self.meter: QpsMeter | None = None
        self._last_close_s = -math.inf
        # Changes due after this still run while engines work; with nothing left to do the run ends here.
        self.horizon_s = last_arrival_s
        if scaling.autoscale:
            plan = scaling.plan
            solver = scaling.solver if scaling.solver is not None else PulpCbcSolver()
            self.scaler = Autoscaler(plan.candidates(), plan.inventory, solver, plan.combos, plan.objective,
                                     scaling.params)
            self.meter = QpsMeter(scaling.step_s, t0_s)
            # Samples run through the bin of the last arrival, as the offline timeline's do.
            last_rel = last_arrival_s - t0_s
            self._last_close_s = t0_s + (int(last_rel // scaling.step_s) + 1) * scaling.step_s
            self.horizon_s = self._last_close_s
        for action in scaling.actions:
            self._push(t0_s + action.at_s, "action", action)

    # ---- the runner's interface ------------------------------------------------------------------------

    @property
    def next_s(self) -> float:
        """When the next change is due (inf: none)."""
        event_s = self._events[0][0] if self._events else math.inf
        meter = self.meter
        if meter is not None and meter.next_sample_s <= self._last_close_s:
            return min(event_s, meter.next_sample_s)
        return event_s

    def on_arrival(self, now_s: float) -> None:
        """A request arrives at `now_s` (before it is routed): count it for the QPS samples."""
        if self.meter is not None:
            self._observe(self.meter.arrive(now_s))

    def run_due(self, now_s: float) -> None:
        """Apply everything due by `now_s`, in time order."""
        if self.meter is not None:
            self._observe(self.meter.until(min(now_s, self._last_close_s)))
        events = self._events
        while events and events[0][0] <= now_s:
            at_s, _, kind, payload = heapq.heappop(events)
            if kind == "action":
                self._apply(payload, at_s)
            elif kind == "join":
                for node in payload:
                    if node.left_s is None:  # not cancelled while provisioning
                        self._join(node, at_s)
            elif kind == "drain":
                self._drain(payload[0], payload[1], at_s)
            elif kind == "leave":
                for node in payload:
                    if node.left_s is None and not node.busy and not node.in_flight:
                        self._leave(node, at_s)

    def on_left(self, node: SimNode, now_s: float) -> None:
        """An engine left (the runner's `_leave`): nothing more to do here."""

    # ---- internals -----------------------------------------------------------------------------------------

    def _push(self, at_s: float, kind: str, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._events, (at_s, self._seq, kind, payload))

    def _observe(self, samples: list[tuple[float, float]]) -> None:
        assert self.scaler is not None
        for rel_s, qps in samples:
            for action in self.scaler.observe(rel_s, qps):
                self._apply(action, self.t0_s + action.at_s)

    def _apply(self, action: Action, now_s: float) -> None:
        self.actions.append(action_row(action))
        if isinstance(action, ScaleOut):
            joining: list[SimNode] = []
            for combo, copies in sorted(action.combos.items()):
                for _ in range(copies):
                    joining += self._new_copy(combo, now_s)
            self._push(self.t0_s + action.serving_at_s, "join", joining)
        elif isinstance(action, ScaleIn):
            self._push(self.t0_s + action.at_s, "drain", (dict(action.combos), self.t0_s + action.gone_at_s))

    def _new_copy(self, combo: str, now_s: float) -> list[SimNode]:
        k = self._next_copy[combo]
        self._next_copy[combo] = k + 1
        label = copy_label(combo, k)
        nodes: list[SimNode] = []
        for profile, role in combo_engines(combo, self.scaling.plan.model.name):
            index = self._counts.get(profile, 0)
            self._counts[profile] = index + 1
            nodes.append(SimNode(f"{profile}-{index}", profile, self.options, combo=label,
                                 billed_from_s=now_s, role=role))
        self.copies[(combo, k)] = nodes
        self.billed += nodes
        return nodes

    def _drain(self, combos: dict[str, int], gone_s: float, now_s: float) -> None:
        leaving: list[SimNode] = []
        live = [key for key, nodes in self.copies.items()
                if all(n.left_s is None and n.leave_after_s == math.inf for n in nodes)]
        for key in newest_copies(live, combos):
            for node in self.copies[key]:
                node.leave_after_s = gone_s
                if node.joined:
                    node.feed.drain(now_s)
                    leaving.append(node)
                else:  # still provisioning: cancelled
                    node.left_s = now_s
        self._push(gone_s, "leave", leaving)
