"""`loadgen simulate --cascade ... --judge pool:MODEL[:rating|explain]`: the judge as a model of the simulated
fleet, each verdict a judge request dispatched through the runner."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from gateway.cascade.core import Answer, parse_cascade
from gateway.cascade.judge_prompt import build_prompt, rating_reply
from gateway.cascade.quality import estimate_tokens, mt_bench_profile
from loadgen.arrivals import ArrivalSpec, schedule
from loadgen.cascade_cli import check_cascade_fleet
from loadgen.cli import main
from loadgen.datasets.request import Request
from loadgen.metrics import Outcome
from loadgen.simulate import SimOptions, SimResult, parse_engines, simulate
from loadgen.simulate.cascade import (
    EXPLAIN_JUDGMENT_TOKENS,
    CascadeRun,
    CascadeSim,
    SimJudge,
    cascade_requests,
    judge_prompt_tokens,
)

STAGES = "h100-llama3-8b:2,h100x4-llama3-70b:1"
FLEET = f"{STAGES},h100-qwen2.5-14b:1"  # one judge engine


def run(
    judge: str,
    *,
    n: int = 120,
    rate: float = 2.0,
    fleet: str = FLEET,
    noise: float = 0.0,
    on_judge_failure: str = "escalate",
) -> tuple[list[Request], SimResult]:
    profile = mt_bench_profile()
    spec = parse_cascade("c=llama3-8b:90,llama3-70b", on_judge_failure=on_judge_failure)  # type: ignore[arg-type]
    requests = cascade_requests(profile, "mt-bench", n, seed=5, first_model="llama3-8b")
    sim = CascadeSim(spec, profile, SimJudge.parse(judge, noise=noise))
    result = simulate(
        schedule(requests, ArrivalSpec(rate_per_s=rate, seed=5)),
        parse_engines(fleet),
        SimOptions(cascade=sim, seed=5),
    )
    return requests, result


def judge_of(result: SimResult) -> dict[str, Any]:
    assert result.cascade is not None
    judge: dict[str, Any] = result.cascade["judge"]
    return judge


def on_engines(result: SimResult, model: str, key: str = "requests") -> int:
    return sum(int(row[key]) for engine, row in result.per_engine.items() if model in engine)


def answering_models(result: SimResult) -> list[str | None]:
    return [o.engine_id.rsplit("-", 1)[0] if o.engine_id else None for o in result.outcomes]


def test_every_judged_stage_is_a_request_on_the_judge_pool_and_routes_as_the_fixed_judge() -> None:
    requests, pool = run("pool:qwen2.5-14b")
    _, fixed = run("fixed:0.27")
    judge = judge_of(pool)
    assert judge["kind"] == "pool" and judge["model"] == "qwen2.5-14b" and judge["output"] == "rating"
    # Only stage 0 is judged in a 2-stage cascade: one judge request per client request, all on the judge
    # engine, and none of them a client outcome.
    assert judge["verdicts"] == len(requests) and judge["failures"] == {}
    assert on_engines(pool, "qwen2.5-14b") == judge["verdicts"]
    assert len(pool.outcomes) == len(requests) and all(o.success for o in pool.outcomes)
    assert {o.request_id for o in pool.outcomes} == {r.request_id for r in requests}
    # Same verdicts: the same requests escalate and the same models answer; only the timing differs.
    assert pool.cascade is not None and fixed.cascade is not None
    for key in ("stage_share", "answer_share", "escalated_share", "quality"):
        assert pool.cascade[key] == fixed.cascade[key], key
    assert answering_models(pool) == answering_models(fixed)
    # Both kinds report the judge's tokens, estimated alike (the pool's are its engine's counts).
    assert judge["prompt_tokens"] == judge_of(fixed)["prompt_tokens"] > 0
    assert judge["completion_tokens"] == judge_of(fixed)["completion_tokens"]
    assert judge["completion_tokens"] == on_engines(pool, "qwen2.5-14b", "output_tokens")
    # A measured latency: a prefill and a few decode steps on an H100, not the fixed judge's 0.27 s.
    assert 0 < judge["mean_latency_s"] <= judge["p95_latency_s"] < 0.27
    assert judge["latency_s"] is None and judge_of(fixed)["latency_s"] == 0.27
    assert judge_of(fixed)["mean_latency_s"] == pytest.approx(0.27)


def test_a_noisy_judge_gives_the_same_verdicts_whatever_the_timing() -> None:
    """The judge shares the stage-0 engines here, so stage answers finish in another order than with the
    fixed judge; the noise of a verdict is drawn per (request, stage), not in finish order."""
    _, pool = run("pool:llama3-8b", noise=8.0, fleet=STAGES, rate=8.0)
    _, fixed = run("fixed:0.27", noise=8.0, fleet=STAGES, rate=8.0)
    assert on_engines(pool, "llama3-8b") == 2 * len(pool.outcomes)  # a stage 0 and its judge per request
    assert answering_models(pool) == answering_models(fixed)
    assert pool.cascade is not None and fixed.cascade is not None
    assert pool.cascade["escalated_share"] == fixed.cascade["escalated_share"]
    assert pool.cascade["quality"] == fixed.cascade["quality"]


def test_judge_latency_grows_with_the_load_on_its_pool() -> None:
    _, light = run("pool:qwen2.5-14b", n=150, rate=1.0)
    _, heavy = run("pool:qwen2.5-14b", n=150, rate=30.0)
    assert judge_of(heavy)["p95_latency_s"] > 1.5 * judge_of(light)["p95_latency_s"]
    assert judge_of(heavy)["mean_latency_s"] > judge_of(light)["mean_latency_s"]


def test_a_judge_request_joins_its_engine_when_it_is_sent() -> None:
    """At light load a verdict takes about what the judge request alone takes on its engine: one sent while
    another judgment decodes joins the engine's next iteration, not the runner's next arrival or sample."""
    _, alone = run("pool:qwen2.5-14b:explain", n=1)
    _, light = run("pool:qwen2.5-14b:explain", n=60, rate=0.5)
    service_s = judge_of(alone)["mean_latency_s"]
    assert judge_of(light)["p95_latency_s"] < 1.15 * service_s


def test_an_explaining_judge_writes_more_and_answers_later() -> None:
    _, rating = run("pool:qwen2.5-14b", n=60)
    _, explain = run("pool:qwen2.5-14b:explain", n=60)
    r, e = judge_of(rating), judge_of(explain)
    assert e["output"] == "explain" and e["verdicts"] == r["verdicts"] == 60
    assert e["completion_tokens"] == EXPLAIN_JUDGMENT_TOKENS * e["verdicts"]
    # `Rating: [[k]]`, estimated as the live profile judge counts it (ceil(bytes/4): 4 tokens for every k).
    assert r["completion_tokens"] == estimate_tokens(rating_reply(8.5)) * r["verdicts"] == 4 * r["verdicts"]
    assert e["mean_latency_s"] > 5 * r["mean_latency_s"]
    assert e["prompt_tokens"] > r["prompt_tokens"]  # FastChat's explain instruction is the longer one


def test_judge_prompt_tokens_are_fastchats_prompt_around_the_profiled_answers() -> None:
    profile = mt_bench_profile()
    for index in (0, 1, 57, 158):
        item = profile.items[index]
        scores = profile.scores("llama3-70b")
        answer = "abcd" * scores[index].answer_tokens  # text of exactly that many estimated tokens
        history: tuple[str, ...] = ()
        if item.turn == 2:
            first = profile.first_turn(item.question_id)
            assert first is not None
            history = ("abcd" * scores[first].answer_tokens,)
        for output in ("rating", "explain"):
            expected = build_prompt(item.questions, history, answer, output).estimated_tokens
            got = judge_prompt_tokens(profile, index, "llama3-70b", output)
            assert abs(got - expected) <= 2, (index, output)


def test_a_judge_pool_that_cannot_answer_is_a_judge_failure() -> None:
    """No engine serves the judge model (the CLI refuses that fleet; `simulate` runs it): every judge
    request is `unreachable` until the breaker opens, then verdicts are `skipped`."""
    requests, escalate = run("pool:qwen2.5-14b", n=40, fleet=STAGES)
    judge = judge_of(escalate)
    assert judge["verdicts"] == 0 and judge["failures"]["unreachable"] >= 5 and judge["skips"] >= 1
    assert sum(judge["failures"].values()) == len(requests)
    assert escalate.cascade is not None and escalate.cascade["escalated_share"] == 1.0
    assert len(escalate.outcomes) == len(requests) and all(o.success for o in escalate.outcomes)
    _, accept = run("pool:qwen2.5-14b", n=40, fleet=STAGES, on_judge_failure="accept")
    assert accept.cascade is not None and accept.cascade["escalated_share"] == 0.0


def test_a_failed_judge_request_applies_on_judge_failure_with_its_outcome() -> None:
    profile = mt_bench_profile()
    request = cascade_requests(profile, "mt-bench", 1, seed=1, first_model="llama3-8b")[0]
    sent: list[tuple[float, Request, str]] = []
    done: list[Outcome] = []
    for rule, decision in (("escalate", "escalated"), ("accept", "accepted")):
        sent.clear()
        spec = parse_cascade("c=llama3-8b:90,llama3-70b", on_judge_failure=rule)  # type: ignore[arg-type]
        cascade = CascadeRun(
            CascadeSim(spec, profile, SimJudge.parse("pool:qwen2.5-14b")),
            seed=1,
            dispatch=lambda _i, now_s, r, model: sent.append((now_s, r, model)),
            finalize=lambda _i, outcome, _now: done.append(outcome),
            t0=0.0,
        )
        cascade.arrive(0, 1.0, request)
        stage0 = sent[-1][1].request_id
        cascade.on_stage_finished(stage0, [1.5, 1.6], 100, 2, "h100-llama3-8b-0", 1.6)
        assert cascade.next_s == 1.6  # the judge request is sent at the runner's next sync point
        cascade.run_due(1.6)
        at_s, judge_request, model = sent[-1]
        assert (at_s, model) == (1.6, "qwen2.5-14b") and cascade.owns(judge_request.request_id)
        cascade.on_stage_failed(judge_request.request_id, "no engine for model 'qwen2.5-14b'", 1.7)
        cascade.run_due(1.7)
        record = cascade.lives[-1].stages[0]
        assert (record.judge_outcome, record.decision, record.reason) == (
            "unreachable",
            decision,
            "judge_unreachable",
        )
        assert record.judge_latency_s == pytest.approx(0.1)
        if rule == "escalate":
            assert sent[-1][2] == "llama3-70b" and len(cascade.lives[-1].stages) == 2  # stage 1 dispatched
        else:
            assert cascade.lives[-1].answered == Answer(0) and done[-1].success
        assert cascade.breaker.failures == 1  # the failure counts towards the breaker


def test_judge_spec_parsing_of_both_kinds() -> None:
    assert SimJudge.parse("pool:qwen2.5-14b") == SimJudge(kind="pool", model="qwen2.5-14b", output="rating")
    assert SimJudge.parse("pool:qwen2.5-14b:explain").output == "explain"
    assert SimJudge.parse("fixed:0.5", noise=2.0) == SimJudge(0.5, noise=2.0)
    for text, message in (
        ("pool:", "needs a model"),
        ("pool::explain", "needs a model"),
        ("pool:qwen2.5-14b:verbose", "output 'verbose' is not one of rating, explain"),
        ("pool:qwen2.5-14b:", "output '' is not one of rating, explain"),
        ("remote:qwen2.5-14b", "unknown kind 'remote'"),
        ("fixed:soon", "'soon' is not a number of seconds"),
    ):
        with pytest.raises(ValueError, match=message) as caught:
            SimJudge.parse(text)
        assert "\n" not in str(caught.value)


def test_the_judge_model_must_be_served_by_the_fleet(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["simulate", "--cascade", "c=llama3-8b:90,llama3-70b", "--dataset", "mt-bench", "--rate", "4"]
    args = argparse.Namespace(
        cascade="c=llama3-8b:90,llama3-70b",
        quality_profile=None,
        judge="pool:qwen2.5-14b",
        judge_bias=0.0,
        judge_noise=0.0,
        cascade_streaming="final_live",
        model=None,
    )
    with pytest.raises(ValueError, match="no engine serves the judge model qwen2.5-14b"):
        check_cascade_fleet(args, parse_engines(STAGES))
    judge = ["--judge", "pool:qwen2.5-14b", "--num-requests", "20"]
    assert main([*base, *judge, "--engines", STAGES]) == 2
    assert "no engine serves the judge model qwen2.5-14b" in capsys.readouterr().err
    out = tmp_path / "r.json"
    assert main([*base, *judge, "--engines", FLEET, "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Cascade judge:" in printed and "pool qwen2.5-14b (rating): 20 verdicts" in printed
    doc = json.loads(out.read_text())
    assert doc["summary"]["cascade"]["judge"]["kind"] == "pool"
    assert doc["config"]["judge"] == "pool:qwen2.5-14b"
