"""`loadgen simulate --cascade`: escalation as a new dispatch on a multi-model fleet, the figures it
reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cascade.core import parse_cascade
from gateway.cascade.quality import mt_bench_profile
from loadgen.arrivals import ArrivalSpec, schedule
from loadgen.cli import main
from loadgen.simulate import SimOptions, parse_engines, simulate
from loadgen.simulate.cascade import CascadeSim, SimJudge, cascade_requests

FLEET = "h100-llama3-8b:2,h100x4-llama3-70b:1"


def run(
    n: int = 120,
    *,
    judge: SimJudge | None = None,
    streaming: str = "final_live",
    subset: str = "mt-bench",
    threshold: int = 90,
    fleet: str = FLEET,
):  # type: ignore[no-untyped-def]
    profile = mt_bench_profile()
    spec = parse_cascade(f"c=llama3-8b:{threshold},llama3-70b")
    requests = cascade_requests(profile, subset, n, seed=3, first_model="llama3-8b")
    sim = CascadeSim(spec, profile, judge or SimJudge(), streaming=streaming)  # type: ignore[arg-type]
    result = simulate(
        schedule(requests, ArrivalSpec(rate_per_s=2.0, seed=3)),
        parse_engines(fleet),
        SimOptions(cascade=sim, seed=3),
    )
    return requests, result


def test_stage_shares_and_quality_are_the_profiles_over_the_drawn_items() -> None:
    requests, result = run()
    profile = mt_bench_profile()
    items = [int(r.metadata["item"]) for r in requests]  # type: ignore[call-overload]
    weak = [profile.scores("llama3-8b")[i].score for i in items]
    strong = [profile.scores("llama3-70b")[i].score for i in items]
    escalated = [w < 90 for w in weak]
    assert result.cascade is not None
    assert result.cascade["escalated_share"] == pytest.approx(sum(escalated) / len(items))
    expected_q = sum(s if e else w for w, s, e in zip(weak, strong, escalated, strict=True)) / len(items)
    assert result.cascade["quality"] == pytest.approx(expected_q)
    assert all(o.success for o in result.outcomes)
    # Each stage is an ordinary dispatch: the large model served exactly the escalated requests.
    large = sum(v["requests"] for k, v in result.per_engine.items() if "70b" in k)
    assert large == sum(escalated)


def test_a_first_stage_without_engines_starts_requests_on_the_next() -> None:
    """The live rule (`CascadeLife.on_stage_unavailable`): nothing is held, so the next stage runs; every
    request is answered by the large model, none fails."""
    requests, result = run(30, fleet="h100x4-llama3-70b:1")
    assert all(o.success for o in result.outcomes)
    assert result.cascade is not None
    assert result.cascade["answer_share"] == [0.0, 1.0]
    assert result.cascade["degraded_share"] == 0.0
    assert sum(v["requests"] for v in result.per_engine.values()) == len(requests)


def test_an_accepted_buffered_answer_arrives_whole_after_the_judge() -> None:
    _, result = run(40, judge=SimJudge(latency_s=0.5), streaming="buffered")
    for outcome in result.outcomes:
        assert outcome.ttft_s == pytest.approx(outcome.e2e_s)  # released at once
        assert outcome.e2e_s is not None and outcome.e2e_s >= 0.5  # at least one verdict waited on


def test_a_judge_biased_down_escalates_more_without_changing_the_credited_scores() -> None:
    _, fair = run(200)
    _, harsh = run(200, judge=SimJudge(bias=-10.0))
    assert fair.cascade is not None and harsh.cascade is not None
    assert harsh.cascade["escalated_share"] > fair.cascade["escalated_share"]
    assert harsh.cascade["quality"] >= fair.cascade["quality"]


def test_judge_spec_parsing() -> None:
    assert SimJudge.parse("fixed:0.27").latency_s == 0.27
    with pytest.raises(ValueError, match="fixed:SECONDS"):
        SimJudge.parse("remote:judge")  # `pool:MODEL` is a judge kind too (test_sim_cascade_judge_pool.py)


def test_cli_writes_cascade_figures_and_refuses_bad_combinations(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    base = ["simulate", "--cascade", "c=llama3-8b:90,llama3-70b", "--num-requests", "30", "--rate", "4"]
    assert main([*base, "--dataset", "mt-bench-easy", "--engines", FLEET, "--output", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["summary"]["cascade"]["stage_share"][0] == 1.0
    assert doc["config"]["cascade"] == "c=llama3-8b:90,llama3-70b"
    assert main([*base, "--dataset", "sharegpt", "--engines", FLEET]) == 2
    assert "mt-bench | mt-bench-hard | mt-bench-easy" in capsys.readouterr().err
    assert main([*base, "--dataset", "mt-bench", "--engines", "h100-llama3-8b:2"]) == 2
    assert "no engine serves llama3-70b" in capsys.readouterr().err
