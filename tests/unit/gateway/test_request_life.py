"""`gateway.dispatch.life`: the pure request-life core, and the proof that the live dispatcher and the
simulator run it with the same inputs to the same decisions."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import replace

import pytest
from builders import engine, snapshot
from fake_engines import FakeEngine, ok_script

from gateway.cluster.store import ClusterStore
from gateway.dispatch.dispatcher import Dispatcher
from gateway.dispatch.features import RoutingHints
from gateway.dispatch.life import (
    ChoiceLife,
    Decision,
    Dispatch,
    GiveUp,
    LifeError,
    Moment,
    Outcome,
    RecordLatency,
    Retry,
    Shed,
    StreamFailed,
    record_dispatch,
)
from gateway.dispatch.policy_set import PolicySet
from gateway.dispatch.retry import RetryBudget, RetryParams
from gateway.domain import (
    ChatTurn,
    ClusterSnapshot,
    EngineEvent,
    EngineId,
    EngineRequest,
    Finished,
    RequestFeatures,
    RouteTag,
)
from gateway.observability.metrics import GatewayMetrics
from gateway.policies.base import SHED
from gateway.policies.registry import POLICY_NAMES, make_policy
from gateway.policies.round_robin import RoundRobinPolicy
from loadgen.datasets.request import Request
from loadgen.simulate import EngineSpec, SimOptions, simulate
from loadgen.simulate.fleet import PromptIds
from loadgen.simulate.runner import engine_request_of
from switchyard.clock import ManualClock

A, B, C = EngineId("a"), EngineId("b"), EngineId("c")
FLEET = snapshot(engine("a"), engine("b"), engine("c"))
REQUEST = EngineRequest(
    request_id="r1", model="m", messages=(ChatTurn("user", "hello there"),), max_tokens=20
)
HINTS = RoutingHints(arrival_s=10.0, session_id="s", slo_ttft_s=0.5)


def moment(seq: int, now_s: float = 10.0, rand: float = 0.25) -> Moment:
    return Moment(now_s=now_s, dispatch_seq=seq, rand=rand, snapshot=FLEET)


class Ledger:
    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []

    def note_dispatch(self, engine_id: EngineId, request_id: str, prompt_tokens: int, max_tokens: int,
                      session_id: str, now_s: float, route: RouteTag | None = None,
                      prefix_keys: Sequence[int] = ()) -> None:
        self.calls.append((engine_id, request_id, prompt_tokens, max_tokens, session_id, now_s, route))


def test_route_builds_the_features_and_notes_the_dispatch() -> None:
    life = ChoiceLife(REQUEST, HINTS, session_engine=B, session_last_used_s=4.0)
    decision = life.route(RoundRobinPolicy(), moment(seq=1))
    assert isinstance(decision, Dispatch) and decision.engine_id == B and decision.attempt == 1
    f = decision.features
    # 3 reply tokens + 4 per message + ceil(11 bytes / 4)
    assert (f.request_id, f.prompt_tokens, f.max_tokens, f.now_s, f.dispatch_seq, f.rand) == (
        "r1", 3 + 4 + 3, 20, 10.0, 1, 0.25)
    assert (f.session_id, f.session_engine, f.session_last_used_s, f.slo_ttft_s, f.exclude) == (
        "s", B, 4.0, 0.5, frozenset())
    ledger = Ledger()
    record_dispatch(ledger, decision)
    assert ledger.calls == [(B, "r1", 10, 20, "s", 10.0, None)]


def test_an_unavailable_engine_is_retried_elsewhere_then_the_life_gives_up() -> None:
    life = ChoiceLife(REQUEST, HINTS, max_attempts=2)
    first = life.route(RoundRobinPolicy(), moment(seq=0))
    assert isinstance(first, Dispatch) and first.engine_id == A
    assert life.failure("connect_failures", 10.05) == Outcome(A, "connect_failures", 10.05)
    assert life.on_unavailable("connection refused", 10.05, 0.5) == Retry(0.0, 1)  # no budget: no backoff
    assert life.on_closed() == A
    second = life.route(RoundRobinPolicy(), moment(seq=0, now_s=10.1))
    assert isinstance(second, Dispatch) and second.engine_id == B and second.attempt == 2
    assert second.features.exclude == frozenset({A}) and second.features.now_s == 10.1
    third = life.on_unavailable("reset", 10.2, 0.5)
    assert third == GiveUp("no engine for model 'm' after 2 unavailable engine(s): reset", 2)
    assert life.on_closed() == B
    assert life.decisions == [first, second, third] and life.done


def test_retries_wait_a_jittered_backoff_and_stop_when_the_budget_is_spent() -> None:
    budget = RetryBudget(RetryParams(ratio=0.5, min_retries_per_s=0.0, window_s=10.0, base_backoff_s=0.1,
                                     max_backoff_s=0.3))
    lives = [ChoiceLife(replace(REQUEST, request_id=f"r{i}"), HINTS, max_attempts=5, budget=budget)
             for i in range(2)]
    for life in lives:  # two choices started: one retry allowed in the window
        life.route(RoundRobinPolicy(), moment(seq=0))
    first = lives[0]
    assert first.on_unavailable("down", 10.0, 0.5) == Retry(0.05, 1)  # rand * 0.1 * 2**0
    first.on_closed()
    first.route(RoundRobinPolicy(), moment(seq=0, now_s=10.1))
    refused = lives[1].on_unavailable("down", 10.2, 0.5)
    assert isinstance(refused, GiveUp) and "retry budget exhausted" in refused.message
    assert refused.attempts == 1 and lives[1].done
    assert budget.try_retry(20.0) is False  # the window emptied of starts too: nothing earned
    budget.on_start(20.0)
    budget.on_start(20.0)
    assert budget.try_retry(20.0) is True
    assert [RetryParams(base_backoff_s=0.1, max_backoff_s=0.3).backoff_s(k, 0.999) for k in (1, 2, 3, 9)] == \
        pytest.approx([0.0999, 0.1998, 0.2997, 0.2997])


def test_no_eligible_engine_gives_up_at_once() -> None:
    life = ChoiceLife(replace(REQUEST, model="other"), HINTS)
    assert life.route(RoundRobinPolicy(), moment(seq=0)) == GiveUp("no engine for model 'other'", 0)


class Shedding:
    """A policy that sheds every request (an `ExplainedPolicy` answering `SHED`)."""

    NAME = "shedding"

    def pick(self, features: RequestFeatures, snapshot: ClusterSnapshot) -> EngineId | None:
        return A

    def decide(self, features: RequestFeatures, snapshot: ClusterSnapshot) -> tuple[EngineId | None, str]:
        return None, SHED


def test_a_policy_that_sheds_ends_the_life_with_shed_not_give_up() -> None:
    life = ChoiceLife(REQUEST, HINTS)
    decision = life.route(Shedding(), moment(seq=0))
    assert isinstance(decision, Shed) and decision.why == SHED and decision.reason == "slo_unattainable"
    assert life.done and life.tried == [] and life.decisions == [decision]
    with pytest.raises(LifeError):
        life.route(Shedding(), moment(seq=1))


def test_no_retry_once_the_stream_began() -> None:
    life = ChoiceLife(REQUEST, HINTS)
    life.route(RoundRobinPolicy(), moment(seq=0))
    assert life.on_first_event(10.5) == Outcome(A, None, 10.5)
    with pytest.raises(LifeError):
        life.on_unavailable("too late", 10.6, 0.0)
    with pytest.raises(LifeError):
        life.route(RoundRobinPolicy(), moment(seq=1))


def test_a_finish_records_latency_from_the_dispatch_to_the_engine_that_served() -> None:
    life = ChoiceLife(REQUEST, HINTS)
    life.route(RoundRobinPolicy(), moment(seq=0, now_s=10.0))
    life.on_unavailable("down", 10.1, 0.0)
    life.on_closed()
    life.route(RoundRobinPolicy(), moment(seq=0, now_s=10.5))  # the retry's dispatch time counts
    life.on_first_event(10.6)
    life.on_token(10.75)
    life.on_token(10.8)
    outcome = life.on_finished(Finished("stop", 10, 2), 11.5)
    assert outcome == RecordLatency(B, 0.25, 1.0, 11.5)
    assert life.on_closed() == B and life.on_closed() is None


@pytest.mark.parametrize(("reason", "message", "expected"), [
    ("error", "boom", "boom"), ("abort", "", "engine finished with abort")])
def test_an_error_finish_is_a_stream_failure(reason: str, message: str, expected: str) -> None:
    life = ChoiceLife(REQUEST, HINTS)
    life.route(RoundRobinPolicy(), moment(seq=0))
    life.on_first_event(10.5)
    finish = Finished(reason, 10, 0, error_message=message)  # type: ignore[arg-type]
    assert life.on_finished(finish, 11.0) == StreamFailed(expected)


def test_events_without_an_open_attempt_are_executor_bugs() -> None:
    life = ChoiceLife(REQUEST, HINTS)
    with pytest.raises(LifeError):
        life.on_first_event(10.0)
    with pytest.raises(ValueError):
        ChoiceLife(REQUEST, HINTS, max_attempts=0)


# ---- one life, two executors ------------------------------------------------------------------------------

PROFILE = "h100-llama3-8b"
MODEL = "llama3-8b"
SEED = 7
SCHEDULE = [
    (0.0, Request("t0", 40, prompt="Tell me about switchyards, at length.", output_tokens=8)),
    (0.25, Request("t1", 12, messages=(("system", "be brief"), ("user", "hi")), output_tokens=5,
                   session_id="sess")),
    (0.5, Request("t2", 300, output_tokens=3)),  # no text: token ids of its length
    (0.75, Request("t3", 9, prompt="and again", output_tokens=4, session_id="sess")),
    (1.0, Request("t4", 20, prompt="last one", output_tokens=6)),
]
OPTIONS = SimOptions(policy="round_robin", seed=SEED, slo_ttft_s=1.0, slo_tpot_s=0.05)


def simulated_decisions() -> list[Decision]:
    decisions: list[Decision] = []
    simulate(SCHEDULE, [EngineSpec(PROFILE, 3)], OPTIONS, on_decision=decisions.append)
    return decisions


class Sink:
    async def on_event(self, index: int, event: EngineEvent) -> None:
        return None


async def live_decisions() -> list[Decision]:
    """The live dispatcher over the real cluster store, with fake engines named as the simulator names its."""
    clock = ManualClock(0.0)
    fakes = {EngineId(f"{PROFILE}-{i}"): FakeEngine(f"{PROFILE}-{i}", ok_script("x"), model=MODEL)
             for i in range(3)}
    decisions: list[Decision] = []
    store = ClusterStore(fakes, clock, stale_after_s=60.0)
    await store.start()
    try:
        for _ in range(1000):
            if len(store.latest_reports()) == len(fakes):
                break
            await asyncio.sleep(0.001)
        dispatcher = Dispatcher(
            state=store, policies=PolicySet(make_policy, POLICY_NAMES, "round_robin", {}), clock=clock,
            rng=random.Random(SEED), metrics=GatewayMetrics(), on_decision=decisions.append)
        prompt_ids = PromptIds()
        for arrival_s, request in SCHEDULE:
            clock.set(arrival_s)
            max_tokens = request.output_tokens or OPTIONS.max_output_tokens_default
            engine_request = engine_request_of(request, MODEL, max_tokens, True, prompt_ids.of(request))
            hints = RoutingHints(arrival_s=arrival_s, session_id=request.session_id or "",
                                 slo_ttft_s=OPTIONS.slo_ttft_s, slo_tpot_s=OPTIONS.slo_tpot_s)
            await dispatcher.run([engine_request], hints, Sink())
    finally:
        await store.stop()
    return decisions


async def test_live_dispatcher_and_simulator_make_the_same_decisions() -> None:
    simulated = simulated_decisions()
    live = await live_decisions()
    assert len(simulated) == len(SCHEDULE)
    assert all(isinstance(d, Dispatch) for d in simulated)
    assert live == simulated
    # The session came back to the engine that served it, with the time of that dispatch, in both.
    t3 = simulated[3]
    assert isinstance(t3, Dispatch) and t3.features.session_engine == EngineId(f"{PROFILE}-1")
    assert t3.features.session_last_used_s == 0.25
