"""The live re-planner of a cascade (`gateway.cascade.replanner`): shadows (which stages run, which verdicts
are asked, what a failure or the concurrency bound does), windows closed on the injected clock, re-plans in a
worker thread (adopted, failed, the idle window), and its pure helpers."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading
from collections.abc import Sequence
from typing import Any

import pytest
from fake_engines import FakeEngine, ok_script, serving

from gateway.cascade.core import CascadeLife, CascadeSpec, JudgeBreaker, Stage, shadow_needs
from gateway.cascade.judge import Verdict
from gateway.cascade.plan import CascadePlan, PlanRequest, plan_cascade
from gateway.cascade.plan.replan import SHADOW_CONCURRENCY, Shift, adopted_baseline, servable_thresholds
from gateway.cascade.quality import QualityProfile, mt_bench_profile
from gateway.cascade.replanner import (
    CascadeReplanner,
    StageAnswer,
    plan_summary,
    rollout_steps,
    user_turns,
)
from gateway.config import CascadeConfig
from gateway.domain import ChatTurn, EngineRequest
from gateway.observability.metrics import GatewayMetrics
from switchyard.clock import ManualClock

MODELS = ("llama3-8b", "llama3-70b")
PROFILE = mt_bench_profile().subset("mt-bench")
REQUEST = EngineRequest("r1", "c", messages=(ChatTurn("user", "What is 2+2?"),), max_tokens=8)


@pytest.fixture(scope="module")
def plan() -> tuple[CascadePlan, PlanRequest]:
    request = PlanRequest(MODELS, "h100", 8, 2.0, q_min=90)
    return plan_cascade(request, PROFILE), request


def config(**replan: Any) -> CascadeConfig:
    return CascadeConfig.model_validate({
        "name": "c", "judge": {"kind": "profile"},
        "stages": [{"model": MODELS[0], "threshold": 90}, {"model": MODELS[1]}],
        "replan": {"gpus": "h100:8", "rate_rps": 1.0, "q_min": 90, "window_s": 10, "shadow_share": 1.0,
                   **replan},
    })


class Harness:
    def __init__(self, planned: CascadePlan, **replan: Any) -> None:
        self.clock = ManualClock(100.0)
        self.metrics = GatewayMetrics()
        self.thresholds: tuple[float, ...] = (90.0,)
        self.dispatched: list[EngineRequest] = []
        self.judged: list[tuple[str, str]] = []
        self.threads: list[int] = []
        self.plan = planned
        self.fail_dispatch = False
        self.verdict = "ok"
        self.hold: asyncio.Event | None = None
        self.replanner = CascadeReplanner(
            config(**replan), PROFILE, current=lambda: self.thresholds, swap=self.swap,
            dispatch=self.dispatch, judge=self.judge, metrics=self.metrics, clock=self.clock,
            planner=self.planner,
        )

    def swap(self, thresholds: Sequence[float]) -> None:
        self.thresholds = tuple(thresholds)

    async def dispatch(self, request: EngineRequest) -> StageAnswer:
        self.dispatched.append(request)
        if self.hold is not None:
            await self.hold.wait()
        if self.fail_dispatch:
            raise RuntimeError("no engine")
        return StageAnswer("shadow answer", 7, 5)

    async def judge(self, request: EngineRequest, answer: str, model: str) -> Verdict:
        self.judged.append((answer, model))
        if self.verdict == "raise":
            raise RuntimeError("judge bug")
        if self.verdict != "ok":
            return Verdict(self.verdict, None, 0, 0, 0.1)
        return Verdict("ok", 80.0, 30, 4, 0.1)

    def planner(self, request: PlanRequest, profile: QualityProfile) -> CascadePlan:
        self.threads.append(threading.get_ident())
        return dataclasses.replace(self.plan, models=request.models)

    async def settle(self) -> None:
        while self.replanner._shadows:  # noqa: SLF001, ASYNC110 (waits for the background shadows)
            await asyncio.sleep(0)

    def tokens(self, kind: str) -> float:
        return float(self.metrics.cascade_shadow_tokens.labels("c", kind)._value.get())  # noqa: SLF001


def accepted_life() -> CascadeLife:
    life = CascadeLife(CascadeSpec("c", (Stage(MODELS[0], 90.0), Stage(MODELS[1], None))), JudgeBreaker())
    life.start()
    life.on_stage_done(7, 4, 0.0)
    life.on_verdict("ok", 95.0, now_s=0.0)
    assert life.answered is not None and life.answered.index == 0
    return life


def escalated_life() -> CascadeLife:
    life = CascadeLife(CascadeSpec("c", (Stage(MODELS[0], 90.0), Stage(MODELS[1], None))), JudgeBreaker())
    life.start()
    life.on_stage_done(7, 4, 0.0)
    life.on_verdict("ok", 50.0, now_s=0.0)
    life.on_stage_done(7, 6, 0.0)
    assert life.answered is not None and life.answered.index == 1
    return life


async def test_an_accepted_request_shadows_the_stage_it_did_not_run(plan: Any) -> None:
    h = Harness(plan[0])
    assert h.replanner.on_arrival()  # shadow_share 1.0
    h.replanner.on_answer(REQUEST, accepted_life(), {0: "stage 0 answer"})
    await h.settle()
    assert [(r.model, r.request_id, r.max_tokens) for r in h.dispatched] == [
        ("llama3-70b", "r1~shadow0.1", 8)]
    assert h.judged == [("shadow answer", "llama3-70b")]  # stage 0's verdict (95) was in hand
    window = h.replanner.view()["window"]
    assert (window["arrivals"], window["shadowed"], window["answered"], window["shadow_rows"]) == (1, 1, 1, 1)
    assert h.replanner.shadow_outcomes == {"recorded": 1}
    assert (h.tokens("prompt"), h.tokens("completion"), h.tokens("judge")) == (7, 5, 34)


async def test_an_escalated_request_only_judges_its_unjudged_last_stage(plan: Any) -> None:
    h = Harness(plan[0])
    h.replanner.on_arrival()
    h.replanner.on_answer(REQUEST, escalated_life(), {0: "a", 1: "b"})
    await h.settle()
    assert h.dispatched == [] and h.judged == [("b", "llama3-70b")]
    assert h.replanner.shadow_outcomes == {"recorded": 1}
    assert (h.tokens("prompt"), h.tokens("completion")) == (0, 0)


async def test_a_request_not_shadowed_feeds_only_the_sample(plan: Any) -> None:
    h = Harness(plan[0], shadow_share=0.0)
    assert not h.replanner.on_arrival()
    h.replanner.on_answer(REQUEST, accepted_life(), None)
    await h.settle()
    assert h.dispatched == [] and h.judged == [] and not h.replanner.shadow_outcomes
    assert h.replanner.view()["window"]["answered"] == 1


@pytest.mark.parametrize(("fail", "verdict"), [(True, "ok"), (False, "timeout"), (False, "raise")])
async def test_a_failed_stage_or_verdict_leaves_its_model_out_of_the_row(
    plan: Any, fail: bool, verdict: str
) -> None:
    """The model the cascade scored stays in the row; the one whose stage or verdict failed is left out (a
    plan that gives the large model no replica still has its small model's scores tested)."""
    h = Harness(plan[0])
    h.fail_dispatch, h.verdict = fail, verdict
    h.replanner.on_arrival()
    h.replanner.on_answer(REQUEST, accepted_life(), {0: "a"})
    await h.settle()
    assert h.replanner.shadow_outcomes == {"partial": 1}
    assert h.replanner.view()["window"]["shadow_rows"] == 1
    metric = h.metrics.cascade_shadow_requests.labels("c", "partial")._value.get()  # noqa: SLF001
    assert metric == 1


@pytest.mark.parametrize("verdict", ["timeout", "raise"])
async def test_a_row_that_scores_no_model_is_dropped(plan: Any, verdict: str) -> None:
    """Both answers held, neither judged (the cascade's verdict failed, the last stage is never judged): a
    failing judge leaves nothing to record."""
    life = CascadeLife(CascadeSpec("c", (Stage(MODELS[0], 90.0), Stage(MODELS[1], None))), JudgeBreaker())
    life.start()
    life.on_stage_done(7, 4, 0.0)
    life.on_verdict("timeout", None, now_s=0.0)
    life.on_stage_done(7, 6, 0.0)
    h = Harness(plan[0])
    h.verdict = verdict
    h.replanner.on_arrival()
    h.replanner.on_answer(REQUEST, life, {0: "a", 1: "b"})
    await h.settle()
    assert h.replanner.shadow_outcomes == {"judge_failed": 1}
    assert h.replanner.view()["window"]["shadow_rows"] == 0


async def test_shadows_over_the_bound_are_skipped_and_close_cancels_the_rest(plan: Any) -> None:
    h = Harness(plan[0])
    h.hold = asyncio.Event()
    for _ in range(SHADOW_CONCURRENCY + 2):
        h.replanner.on_arrival()
        h.replanner.on_answer(REQUEST, accepted_life(), {0: "a"})
    await asyncio.sleep(0)
    assert h.replanner.view()["shadow"]["in_flight"] == SHADOW_CONCURRENCY
    await h.replanner.close()
    assert h.replanner.shadow_outcomes == {"skipped": 2, "cancelled": SHADOW_CONCURRENCY}


async def test_a_rate_shift_replans_in_a_worker_thread_and_adopts(plan: Any) -> None:
    h = Harness(plan[0], rate_rps=10.0)
    assert await h.replanner.tick() is None  # the window has not ended
    for _ in range(5):  # 0.5 req/s against the 10 planned
        h.replanner.on_arrival()
    h.clock.advance(10.0)
    record = await h.replanner.tick()
    assert record is not None and record["adopted"] and record["at_s"] == 10.0
    assert h.threads and threading.get_ident() not in h.threads
    assert record["old_thresholds"] == [90.0] and record["new_thresholds"] == list(plan[0].thresholds)
    assert h.thresholds == plan[0].thresholds
    assert record["reasons"][0].startswith("rate 10 -> 0.5 req/s")
    assert record["profile"] == "previous" and record["rollout"] is None
    assert h.replanner.monitor.baseline.rate_rps == 0.5
    view = h.replanner.view()
    assert view["windows_closed"] == 1 and view["window"]["arrivals"] == 0
    assert view["target"] == record["plan"]
    assert view["last_tests"]["rate"] < 1e-6
    assert h.metrics.cascade_replans.labels("c")._value.get() == 1  # noqa: SLF001
    # The next re-plan publishes the rollout from the previous target.
    for _ in range(50):
        h.replanner.on_arrival()
    h.clock.advance(10.0)
    second = await h.replanner.tick()
    assert second is not None and second["rollout"] == []  # the same shapes: nothing to move


async def test_a_window_without_arrivals_waits_for_traffic_then_replans(plan: Any) -> None:
    h = Harness(plan[0], rate_rps=10.0)
    h.clock.advance(10.0)
    assert await h.replanner.tick() is None
    assert h.threads == [] and h.replanner.view()["idle"] and h.replanner.monitor.baseline.rate_rps == 0.0
    h.clock.advance(10.0)
    assert await h.replanner.tick() is None and h.replanner.view()["idle"]  # still nothing: no shift
    for _ in range(3):
        h.replanner.on_arrival()
    h.clock.advance(10.0)
    record = await h.replanner.tick()
    assert record is not None and record["reasons"] == ["rate 0 -> 0.3 req/s"]
    assert not h.replanner.view()["idle"]


async def test_a_planner_failure_keeps_the_running_plan(plan: Any) -> None:
    h = Harness(plan[0], rate_rps=10.0)

    def broken(request: PlanRequest, profile: QualityProfile) -> CascadePlan:
        raise AssertionError("nothing keeps up")

    h.replanner.planner = broken
    h.replanner.on_arrival()
    h.clock.advance(10.0)
    record = await h.replanner.tick()
    assert record is not None and not record["adopted"]
    assert record["error"] == "AssertionError: nothing keeps up"
    assert h.thresholds == (90.0,) and h.replanner.monitor.baseline.rate_rps == 10.0
    assert h.metrics.cascade_replans.labels("c")._value.get() == 0  # noqa: SLF001


async def test_an_escalate_all_threshold_is_served_as_100(plan: Any) -> None:
    h = Harness(dataclasses.replace(plan[0], thresholds=(101.0,)), rate_rps=10.0)
    h.replanner.on_arrival()
    h.clock.advance(10.0)
    record = await h.replanner.tick()
    assert record is not None and record["new_thresholds"] == [100.0] and h.thresholds == (100.0,)
    assert record["notes"] == ["stage 0: the plan's threshold 101 is served as 100"]
    assert record["plan"]["thresholds"] == [101.0]


# ---- pure helpers ----------------------------------------------------------------------------------------


def test_servable_thresholds() -> None:
    assert servable_thresholds([101.0, 50.0, 0.0]) == ((100.0, 50.0, 0.0), ("stage 0: the plan's threshold "
                                                                           "101 is served as 100",))
    assert servable_thresholds([90]) == ((90.0,), ())


def test_adopted_baseline_takes_the_engines_lengths_where_known() -> None:
    thresholds = (90.0,)
    planned_prompts = adopted_baseline(PROFILE, MODELS, thresholds, shift(2), shadowed=False, sample_size=3)
    observed = shift(3)
    full = adopted_baseline(PROFILE, MODELS, thresholds, observed, shadowed=False, sample_size=3)
    shadowed = adopted_baseline(PROFILE, MODELS, thresholds, observed, shadowed=True, sample_size=3)
    profile_lengths = adopted_baseline(PROFILE, MODELS, thresholds, shift(0), shadowed=False, sample_size=3)
    assert planned_prompts.prompt_tokens == profile_lengths.prompt_tokens  # a sample not full: the profile's
    assert planned_prompts.answer_tokens == profile_lengths.answer_tokens
    assert full.prompt_tokens == (10, 11, 12) and full.answer_tokens == (20, 21, 22)
    assert shadowed.prompt_tokens == (10, 11, 12) and shadowed.answer_tokens == profile_lengths.answer_tokens
    assert full.rate_rps == 3.0 and set(full.scores) == set(MODELS) and len(full.scores[MODELS[0]]) == 160


def shift(n: int) -> Shift:
    return Shift(0.0, ("x",), 3.0, None, tuple(10 + i for i in range(n)), tuple(20 + i for i in range(n)))


def test_shadow_needs() -> None:
    assert shadow_needs(accepted_life().stages, MODELS) == ["scored", "dispatch"]
    assert shadow_needs(escalated_life().stages, MODELS) == ["scored", "judge"]
    life = CascadeLife(CascadeSpec("c", (Stage(MODELS[0], 90.0), Stage(MODELS[1], None))), JudgeBreaker())
    life.start()
    life.on_stage_done(7, 4, 0.0)
    life.on_verdict("timeout", None, now_s=0.0)  # escalated on a failed verdict ...
    life.on_stage_unavailable("no engine")  # ... to a stage that could not run: degraded
    assert shadow_needs(life.stages, MODELS) == ["judge", "dispatch"]


def test_user_turns() -> None:
    chat = EngineRequest("r", "c", messages=(ChatTurn("system", "s"), ChatTurn("user", "q1"),
                                             ChatTurn("assistant", "a1"), ChatTurn("user", "q2")))
    assert user_turns(chat) == ("q1", "q2")
    assert user_turns(EngineRequest("r", "c", prompt_text="p")) == ("p",)


def test_plan_summary_and_rollout(plan: Any) -> None:
    planned, request = plan
    doc = plan_summary(dataclasses.replace(planned, latency_s=math.inf), request, "mt-bench")
    assert doc["L"] is None and doc["thresholds"] == list(planned.thresholds)
    assert doc["request"] == {"gpus": 8, "rate_rps": 2.0, "q_min": 90, "l_max_s": None,
                              "judge_latency_s": 0.27, "dataset": "mt-bench"}
    steps = rollout_steps(MODELS, [[[4, 1, 1]], [[4, 1, 1]]], [[[2, 1, 2]], [[4, 1, 1]]], 8)
    assert steps == [{"remove": {"model": "llama3-8b", "tp": 4, "pp": 1},
                      "add": [{"model": "llama3-8b", "tp": 2, "pp": 1}] * 2, "gap": True}]


# ---- GET /v1/cascades ------------------------------------------------------------------------------------


async def test_the_cascades_endpoint() -> None:
    async with serving(FakeEngine("e0", ok_script("x"))) as client:
        response = await client.get("/v1/cascades")
        assert response.status == 404
        assert (await response.json())["error"]["code"] == "not_found"
    plain = {"name": "plain", "judge": {"kind": "profile"},
             "stages": [{"model": MODELS[0], "threshold": 90}, {"model": MODELS[1]}]}
    replanned = config(window_s=600).model_dump()
    engines = [FakeEngine("e0", ok_script("a"), model=MODELS[0]),
               FakeEngine("e1", ok_script("b"), model=MODELS[1])]
    async with serving(*engines, cascades=[plain, replanned]) as client:
        response = await client.post("/v1/chat/completions", json={
            "model": "c", "messages": [{"role": "user", "content": "an unknown question"}], "max_tokens": 4})
        assert response.status == 200 and response.headers["x-switchyard-cascade-thresholds"] == "90"
        body = await (await client.get("/v1/cascades")).json()
        metrics = await (await client.get("/metrics")).text()
    by_name = {c["name"]: c for c in body["data"]}
    assert by_name["plain"]["replan"] is None and by_name["plain"]["thresholds"] == [90.0]
    replan = by_name["c"]["replan"]
    assert by_name["c"]["models"] == list(MODELS) and replan["gpus"] == "h100:8"
    assert replan["params"]["window_s"] == 600 and replan["params"]["sample_size"] == 50
    assert replan["window"]["arrivals"] == 1 and replan["window"]["answered"] == 1
    assert replan["baseline"] == {"rate_rps": 1.0, "prompt_samples": 160, "answer_samples": 160,
                                  "scored_items": {MODELS[0]: 160, MODELS[1]: 160}}
    assert 'switchyard_cascade_threshold{cascade="plain",stage="0"} 90.0' in metrics
    assert 'switchyard_cascade_replans_total{cascade="c"} 0.0' in metrics
