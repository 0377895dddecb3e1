"""The gateway's autoscale loop (`gateway.fleet.autoscale`): measured QPS into Algorithm 1, its actions
applied through an actuator to the cluster store's membership, with a manual clock and the real CBC solver."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

from gateway.domain import EngineId
from gateway.engines.base import EngineClient
from gateway.fleet.autoscale import AutoscaleLoop, CopySpec
from gateway.planning.autoscaler import AutoscalerParams, ScaleIn, ScaleOut
from gateway.planning.combos import Slo
from gateway.planning.cost_model import Workload
from gateway.planning.ilp import AllocationProblem, PulpCbcSolver
from gateway.planning.plan_file import Plan
from switchyard.clock import ManualClock
from switchyard.hardware import MODELS

# One candidate, 1xa100 at 2 req/s (a measured table is the whole candidate set), 4 GPUs, one copy deployed.
PLAN = Plan(model=MODELS["llama3-8b"], workload=Workload(1000, 500), slo=Slo(1.0, 0.03), objective="co",
            inventory={"a100": 4}, prices={}, combos={"1xa100": 1}, goodput_rps={"1xa100": 2.0},
            goodput_table={"1xa100": 2.0})
PARAMS = AutoscalerParams(local_window_s=3, global_window_s=1000, provisioning_s=0, grace_s=0)


class Store:
    """The membership the loop changes; the plan's first copy serves at "seed:1"."""

    def __init__(self) -> None:
        self.engines: dict[EngineId, str] = {EngineId("seed:1"): "1xa100#0"}

    def add_engine(self, engine_id: EngineId, client: EngineClient) -> None:
        assert engine_id not in self.engines
        self.engines[engine_id] = str(client)

    async def remove_engine(self, engine_id: EngineId) -> None:
        del self.engines[engine_id]

    def engine_ids(self) -> tuple[EngineId, ...]:
        return tuple(self.engines)

    def combos(self) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        for engine_id, label in self.engines.items():
            out.setdefault(label, []).append({"engine_id": engine_id})
        return out


class Actuator:
    name = "test"

    def __init__(self, *, fail: bool = False) -> None:
        self.provisioned: list[str] = []
        self.released: list[tuple[str, tuple[str, ...]]] = []
        self.cancelled: list[str] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail = fail

    async def provision(self, copy: CopySpec) -> Sequence[str]:
        assert copy.model == "llama3-8b" and copy.label.startswith(copy.combo + "#")
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelled.append(copy.label)
            raise
        if self.fail:
            raise RuntimeError("no capacity in the zone")
        self.provisioned.append(copy.label)
        return [f"{copy.label}:1"]

    async def release(self, label: str, addresses: Sequence[str]) -> None:
        self.released.append((label, tuple(addresses)))


class Harness:
    def __init__(self, actuator: Actuator | None, solver: Any = None) -> None:
        self.clock = ManualClock(50.0)
        self.arrived = 0
        self.store = Store()
        self.loop = AutoscaleLoop(PLAN, params=PARAMS, step_s=1.0, arrivals=lambda: self.arrived,
                                  store=self.store, make_client=lambda address: f"client:{address}",  # type: ignore[arg-type,return-value]
                                  clock=self.clock, actuator=actuator, solver=solver)

    async def run(self, qps: int, seconds: int) -> list[Any]:
        actions: list[Any] = []
        for _ in range(seconds):
            self.arrived += qps
            self.clock.advance(1.0)
            actions += await self.loop.tick()
        for _ in range(5):
            await asyncio.sleep(0)  # the copies' tasks run
        return actions


async def test_a_step_up_provisions_copies_that_join_and_a_fall_releases_the_newest() -> None:
    actuator = Actuator()
    h = Harness(actuator)
    actions = await h.run(5, 3)  # 5 req/s against 2 deployed: a deficit of 3 -> two more copies
    assert [type(a) for a in actions] == [ScaleOut] and actions[0].combos == {"1xa100": 2}
    assert actuator.provisioned == ["1xa100#1", "1xa100#2"]  # numbering continues the plan's
    assert set(h.store.engines) == {"seed:1", "1xa100#1:1", "1xa100#2:1"}
    assert h.store.engines[EngineId("1xa100#1:1")] == "client:1xa100#1:1"
    view = h.loop.view()
    assert view["qps"] == 5.0 and view["target_combos"] == {"1xa100": 3} and view["actuator"] == "test"
    assert [(c["label"], c["state"]) for c in view["copies"]] == [
        ("1xa100#0", "serving"), ("1xa100#1", "serving"), ("1xa100#2", "serving")]
    assert view["actions"][0]["kind"] == "ScaleOut"

    actions = await h.run(0, 3)  # no load: the two newest leave, one copy stays (min_copies)
    assert [type(a) for a in actions] == [ScaleIn] and actions[0].combos == {"1xa100": 2}
    assert sorted(actuator.released) == [("1xa100#1", ("1xa100#1:1",)), ("1xa100#2", ("1xa100#2:1",))]
    assert set(h.store.engines) == {"seed:1"}
    states = {c["label"]: c["state"] for c in h.loop.view()["copies"]}
    assert states == {"1xa100#0": "serving", "1xa100#1": "gone", "1xa100#2": "gone"}


async def test_a_plan_copy_is_released_by_the_engines_the_store_knows_for_its_label() -> None:
    actuator = Actuator()
    h = Harness(actuator)
    await h.run(8, 3)  # 8 req/s: three more copies (all 4 GPUs)
    await h.run(2, 3)  # back to 2 req/s: one copy carries it; #3, #2, #1 leave, the plan's #0 stays
    assert sorted(label for label, _ in actuator.released) == ["1xa100#1", "1xa100#2", "1xa100#3"]
    h.store.engines[EngineId("x:1")] = "1xa100#0"  # a second engine in the plan's copy
    loop = h.loop
    await loop._remove(loop.copies["1xa100#0"], (), 0.0)  # noqa: SLF001 (released like any copy)
    assert actuator.released[-1] == ("1xa100#0", ("seed:1", "x:1")) and h.store.engines == {}


async def test_a_copy_still_provisioning_when_it_is_removed_is_cancelled() -> None:
    actuator = Actuator()
    actuator.gate.clear()  # provisioning takes longer than the load lasts
    h = Harness(actuator)
    await h.run(5, 3)
    await h.run(0, 3)
    assert sorted(actuator.cancelled) == ["1xa100#1", "1xa100#2"] and actuator.provisioned == []
    assert set(h.store.engines) == {"seed:1"} and actuator.released == []
    assert {c["state"] for c in h.loop.view()["copies"][1:]} == {"cancelled"}


async def test_a_failed_provisioning_is_reported_and_adds_nothing() -> None:
    h = Harness(Actuator(fail=True))
    await h.run(5, 3)
    copies = h.loop.view()["copies"]
    assert [c["state"] for c in copies] == ["serving", "failed", "failed"]
    assert "no capacity in the zone" in copies[1]["error"] and set(h.store.engines) == {"seed:1"}


async def test_without_an_actuator_the_loop_decides_and_publishes_only() -> None:
    h = Harness(None)
    actions = await h.run(5, 3)
    assert [type(a) for a in actions] == [ScaleOut]
    view = h.loop.view()
    assert view["actuator"] is None and view["target_combos"] == {"1xa100": 3}
    assert [c["label"] for c in view["copies"]] == ["1xa100#0"] and set(h.store.engines) == {"seed:1"}


async def test_the_solver_runs_off_the_event_loop_thread() -> None:
    threads: list[int] = []

    class Recording(PulpCbcSolver):
        def solve(self, problem: AllocationProblem) -> Any:
            threads.append(threading.get_ident())
            return super().solve(problem)

    h = Harness(Actuator(), solver=Recording())
    await h.run(5, 3)
    assert threads and threading.get_ident() not in threads


def re_plan_harness(actuator: Actuator) -> Harness:
    """Two 1xa100 copies (2 req/s each) that one 1xh100 (4 req/s) replaces more cheaply at a re-plan."""
    plan = Plan(model=PLAN.model, workload=PLAN.workload, slo=PLAN.slo, objective="co",
                inventory={"a100": 4, "h100": 2}, prices={}, combos={"1xa100": 2},
                goodput_rps={"1xa100": 2.0, "1xh100": 4.0}, goodput_table={"1xa100": 2.0, "1xh100": 4.0})
    h = Harness(actuator)
    h.loop = AutoscaleLoop(plan, params=AutoscalerParams(local_window_s=3, global_window_s=6,
                                                         provisioning_s=0, grace_s=0),
                           step_s=1.0, arrivals=lambda: h.arrived, store=h.store,
                           make_client=lambda a: a,  # type: ignore[arg-type,return-value]
                           clock=h.clock, actuator=actuator)
    h.store.engines[EngineId("seed:2")] = "1xa100#1"
    return h


async def test_a_re_plan_releases_the_old_copies_only_after_the_new_ones_serve() -> None:
    """Make before break, live: the ScaleIn of a re-plan waits for its ScaleOut's copies."""
    actuator = Actuator()
    actuator.gate.clear()
    h = re_plan_harness(actuator)
    actions = await h.run(4, 6)  # 4 req/s on 2 x 1xa100: re-planned at 6 s
    assert [type(a) for a in actions] == [ScaleOut, ScaleIn]
    assert actions[0].combos == {"1xh100": 1} and actions[1].combos == {"1xa100": 2}
    assert actuator.released == []  # the h100 copy is still provisioning
    actuator.gate.set()
    for _ in range(10):
        await asyncio.sleep(0)
    assert actuator.provisioned == ["1xh100#0"]
    assert sorted(label for label, _ in actuator.released) == ["1xa100#0", "1xa100#1"]
    assert set(h.store.engines) == {"1xh100#0:1"}


async def test_a_re_plan_whose_new_copy_fails_keeps_the_old_ones() -> None:
    actuator = Actuator(fail=True)
    h = re_plan_harness(actuator)
    await h.run(4, 6)
    assert actuator.released == [] and set(h.store.engines) == {"seed:1", "seed:2"}
    copies = {c["label"]: c for c in h.loop.view()["copies"]}
    assert copies["1xh100#0"]["state"] == "failed" and copies["1xa100#0"]["state"] == "serving"
    assert "replacement 1xh100#0 did not come up" in copies["1xa100#0"]["error"]
