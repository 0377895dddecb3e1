"""Moving running requests: the mover's limits and errors, the reschedule loop, and who may call
`/admin/migrate`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
from builders import engine, snapshot
from fake_engines import FakeEngine, ok_script, serving

from gateway.dispatch.mover import MoveError, MoveParams, Mover, RescheduleLoop
from gateway.domain import (
    ClusterSnapshot,
    EngineId,
    EngineRequest,
    EngineUnavailable,
    LengthStage,
    MigrationRefusedError,
    MigrationTicket,
    StageLayout,
    StreamEvent,
)
from gateway.engines.base import EngineClient
from gateway.observability.metrics import GatewayMetrics
from switchyard.clock import ManualClock

A, B, C = EngineId("a"), EngineId("b"), EngineId("c")


class Cutter(FakeEngine):
    """A fake whose MigrateOut answers from a list (a ticket, or an exception to raise)."""

    def __init__(self, engine_id: str, *answers: MigrationTicket | Exception) -> None:
        super().__init__(engine_id, ok_script("x"))
        self.answers = list(answers)
        self.cuts: list[tuple[str, str]] = []

    async def migrate_out(self, request_id: str, target: str) -> MigrationTicket:
        self.cuts.append((request_id, target))
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def resume(self, ticket: MigrationTicket, request: EngineRequest) -> AsyncIterator[StreamEvent]:
        raise AssertionError("the mover never resumes")

    async def release(self, request_id: str) -> None:
        raise AssertionError("the mover never releases")


@dataclass
class Fleet:
    """The mover's view of the cluster: where each request runs, and the engines' clients."""

    where: dict[str, EngineId]
    clients: dict[EngineId, EngineClient]
    view: ClusterSnapshot

    def snapshot(self) -> ClusterSnapshot:
        return self.view

    def engine_of(self, request_id: str) -> EngineId | None:
        return self.where.get(request_id)

    def client(self, engine_id: EngineId) -> EngineClient:
        return self.clients[engine_id]


def ticket(request_id: str = "r1") -> MigrationTicket:
    return MigrationTicket(request_id, "a", "b", output_tokens=7, kv_tokens=100, kv_bytes=1000)


def mover(source: EngineClient, clock: ManualClock, **params: float) -> tuple[Mover, Fleet]:
    fleet = Fleet(
        {"r1": A, "r2": A},
        {A: source, B: FakeEngine("b", ok_script("y"))},
        snapshot(engine("a"), engine("b"), engine("c", model="other")),
    )
    return Mover(fleet, clock, GatewayMetrics(), MoveParams(**params)), fleet  # type: ignore[arg-type]


async def test_the_mover_cuts_on_the_requests_engine_and_enforces_its_limits() -> None:
    clock = ManualClock(0.0)
    source = Cutter("a", ticket(), ticket("r2"), ticket(), ticket())
    m, _ = mover(source, clock, max_migrations_per_request=2, request_cooldown_s=5.0, engine_cooldown_s=1.0)
    assert (await m.migrate("r1", B)).output_tokens == 7
    assert source.cuts == [("r1", "b")]
    assert m.busy_engines() == {A, B} and "r1" in m.unmovable_requests()
    with pytest.raises(MoveError) as busy:  # the engines cool down for 1 s
        await m.migrate("r2", B)
    assert busy.value.status == 409 and "cooling down" in str(busy.value)
    clock.advance(1.5)
    with pytest.raises(MoveError) as cooling:
        await m.migrate("r1", B)
    assert "cooldown" in str(cooling.value)
    assert (await m.migrate("r2", None)).request_id == "r2"  # no target: only the source is held
    assert m.busy_engines() == {A}
    clock.advance(6.0)
    await m.migrate("r1", B)
    clock.advance(6.0)
    with pytest.raises(MoveError) as limit:
        await m.migrate("r1", B)
    assert "2 times" in str(limit.value) and "r1" in m.unmovable_requests()


async def test_unknown_requests_and_engines_refusals_and_unreachable_engines() -> None:
    clock = ManualClock(0.0)
    source = Cutter("a", MigrationRefusedError("stop strings"), EngineUnavailable("gone"))
    m, fleet = mover(source, clock, engine_cooldown_s=0.0, request_cooldown_s=0.0)
    for request_id, target, status in (
        ("nope", B, 404),
        ("r1", EngineId("zz"), 404),
        ("r1", A, 409),
        ("r1", C, 409),
    ):  # C serves another model
        with pytest.raises(MoveError) as e:
            await m.migrate(request_id, target)
        assert e.value.status == status
    with pytest.raises(MoveError) as refused:
        await m.migrate("r1", B)
    assert refused.value.status == 409 and "stop strings" in str(refused.value)
    with pytest.raises(MoveError) as gone:
        await m.migrate("r1", B)
    assert gone.value.status == 503
    fleet.clients[A] = FakeEngine("a", ok_script("x"))  # an engine without migration
    with pytest.raises(MoveError) as plain:
        await m.migrate("r1", B)
    assert plain.value.status == 409 and "cannot migrate" in str(plain.value)


async def test_the_reschedule_loop_hands_each_models_proposal_to_the_mover() -> None:
    clock = ManualClock(0.0)
    source = Cutter("a", ticket(), MigrationRefusedError("ended"))
    m, fleet = mover(source, clock)
    seen: list[tuple[str, frozenset[str], frozenset[str]]] = []

    @dataclass
    class Proposal:
        request_id: str
        source: EngineId
        target: EngineId

    class Proposer:
        def __init__(self) -> None:
            self.refused: list[tuple[str, int]] = []

        def propose(
            self, snap: ClusterSnapshot, model: str, exclude: frozenset[str], busy: frozenset[str],
            now_s: float,
        ) -> list[Proposal]:
            seen.append((model, exclude, busy))
            return [Proposal("r1", A, B)] if model == "m" else []

        def not_started(self, proposal: Proposal, status: int) -> None:
            self.refused.append((proposal.request_id, status))

        def layouts(self) -> dict[str, StageLayout]:
            return {"m": StageLayout("m", (LengthStage(0, 100, (A, B)),))}

    published: list[Mapping[str, StageLayout]] = []
    proposer = Proposer()
    loop = RescheduleLoop(m, fleet.snapshot, proposer, 0.5, GatewayMetrics(), clock, published.append)
    assert await loop.once() == 1
    assert [s[0] for s in seen] == ["m", "other"]
    clock.advance(10.0)
    assert await loop.once() == 0  # the engine refused: logged, not raised
    assert seen[-2][1] == frozenset() and source.cuts == [("r1", "b"), ("r1", "b")]
    assert proposer.refused == [("r1", 409)]  # handed back to the rescheduler
    assert len(published) == 2 and published[0]["m"].stages[0].engines == (A, B)


async def test_admin_migrate_needs_the_flag_and_with_keys_an_admin_key(tmp_path: Path) -> None:
    async with serving(FakeEngine("a", ok_script("x"))) as client:
        assert (await client.post("/admin/migrate", json={"request_id": "r"})).status == 404  # no route
    keys = tmp_path / "keys.json"
    keys.write_text(
        json.dumps(
            {
                "keys": [
                    {"name": "user", "key": "sk-user-123456789"},
                    {"name": "ops", "key": "sk-ops-123456789", "admin": True},
                ]
            }
        )
    )
    async with serving(FakeEngine("a", ok_script("x")), enable_admin=True, api_keys_file=str(keys)) as client:
        assert (await client.post("/admin/migrate", json={"request_id": "r"})).status == 401
        user = await client.post(
            "/admin/migrate", json={"request_id": "r"}, headers={"Authorization": "Bearer sk-user-123456789"}
        )
        assert user.status == 403 and (await user.json())["error"]["code"] == "admin_required"
        ops = {"Authorization": "Bearer sk-ops-123456789"}
        unknown = await client.post("/admin/migrate", json={"request_id": "r"}, headers=ops)
        assert unknown.status == 404 and "not running" in (await unknown.json())["error"]["message"]
        bad = await client.post("/admin/migrate", json={"target": "a"}, headers=ops)
        assert bad.status == 400 and (await bad.json())["error"]["param"] == "request_id"
