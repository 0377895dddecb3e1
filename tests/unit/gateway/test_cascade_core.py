"""CascadeLife: Fig. 4's decisions, judge failures, the breaker, failed stages and the usage it reports."""

from __future__ import annotations

import pytest

from gateway.cascade.core import (
    Answer,
    AskJudge,
    CascadeLife,
    CascadeSpec,
    CascadeSpecError,
    Fail,
    JudgeBreaker,
    RunStage,
    Stage,
    parse_cascade,
)

SPEC = parse_cascade("c=small:90,mid:80,large")


def life(spec: CascadeSpec = SPEC, breaker: JudgeBreaker | None = None) -> CascadeLife:
    return CascadeLife(spec, breaker or JudgeBreaker())


def test_parse_and_shape_rules() -> None:
    assert SPEC.models == ("small", "mid", "large") and SPEC.thresholds == (90.0, 80.0)
    for bad, why in (
        ("c=a", "at least 2"),
        ("c=a:90,b:50", "takes no threshold"),
        ("c=a,b", "needs a threshold"),
        ("c=a:101,b", "in \\[0, 100\\]"),
        ("c=a:x,b", "not a number"),
        ("=a:1,b", "expected"),
    ):
        with pytest.raises(CascadeSpecError, match=why):
            parse_cascade(bad)
    assert SPEC.with_thresholds([50, 60]).thresholds == (50.0, 60.0)


def test_accept_at_the_first_stage() -> None:
    c = life()
    assert c.start() == RunStage(0, "small")
    assert c.on_stage_done(10, 20, now_s=0.0) == AskJudge(0)
    assert c.on_verdict(
        "ok", 90.0, prompt_tokens=300, completion_tokens=5, latency_s=0.2, now_s=0.1
    ) == Answer(0)
    usage = c.usage_of()
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (10, 20, 30)
    assert usage["cascade"]["answering_model"] == "small"
    assert usage["cascade"]["judge_prompt_tokens"] == 300
    assert usage["cascade"]["stages"][0]["judge"]["outcome"] == "ok"


def test_escalate_below_threshold_to_the_last_stage_which_answers_unjudged() -> None:
    c = life()
    c.start()
    c.on_stage_done(10, 20, now_s=0.0)
    assert c.on_verdict("ok", 80.0, now_s=0.1) == RunStage(1, "mid")
    c.on_stage_done(11, 30, now_s=0.2)
    assert c.on_verdict("ok", 70.0, now_s=0.3) == RunStage(2, "large")
    assert c.on_stage_done(12, 40, now_s=0.4) == Answer(2)
    assert c.escalation_reasons() == ["below_threshold", "below_threshold"]
    assert c.scores() == [80.0, 70.0]
    usage = c.usage_of()
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (33, 90)  # every stage's tokens, summed
    assert "judge" not in usage["cascade"]["stages"][2]


@pytest.mark.parametrize(("rule", "expected"), [("escalate", RunStage(1, "mid")), ("accept", Answer(0))])
def test_judge_failure_applies_the_rule(rule: str, expected: object) -> None:
    spec = parse_cascade("c=small:90,mid:80,large", on_judge_failure=rule)  # type: ignore[arg-type]
    c = life(spec)
    c.start()
    c.on_stage_done(1, 1, now_s=0.0)
    assert c.on_verdict("timeout", None, latency_s=2.0, now_s=2.0) == expected
    assert c.stages[0].reason == "judge_timeout"


def test_the_breaker_skips_the_judge_after_five_failures_for_ten_seconds() -> None:
    breaker = JudgeBreaker(5, 10.0)
    for i in range(5):
        c = life(breaker=breaker)
        c.start()
        assert c.on_stage_done(1, 1, now_s=float(i)) == AskJudge(0)
        c.on_verdict("http_5xx", None, now_s=float(i))
    skipped = life(breaker=breaker)
    skipped.start()
    assert skipped.on_stage_done(1, 1, now_s=13.9) == RunStage(1, "mid")  # no judge asked
    assert skipped.stages[0].reason == "judge_skipped" and breaker.skips == 1
    later = life(breaker=breaker)
    later.start()
    assert later.on_stage_done(1, 1, now_s=14.0) == AskJudge(0)  # 10 s after the fifth failure
    later.on_verdict("ok", 95.0, now_s=14.1)
    assert breaker.failures == 0


def test_a_broken_stage_runs_again_elsewhere_once_then_the_held_answer_goes_out_degraded() -> None:
    c = life()
    c.start()
    c.on_stage_done(1, 1, now_s=0.0)
    c.on_verdict("ok", 10.0, now_s=0.1)
    assert c.on_stage_broken("mid-0", "reset") == RunStage(1, "mid", avoid="mid-0")
    assert c.on_stage_broken("mid-1", "reset") == Answer(0, degraded=True)
    assert c.usage_of()["cascade"]["degraded"] is True


def test_an_empty_first_pool_starts_on_the_next_and_an_empty_next_pool_degrades() -> None:
    first = life()
    first.start()
    assert first.on_stage_unavailable("no engine for model 'small'") == RunStage(1, "mid")
    assert first.on_stage_unavailable("no engine for model 'mid'") == RunStage(2, "large")
    assert first.on_stage_unavailable("no engine for model 'large'") == Fail("no engine for model 'large'")
    assert first.failed
    assert [r.decision for r in first.stages] == ["failed", "failed", "failed"]
    skipped = life()
    skipped.start()
    skipped.on_stage_unavailable("no engine for model 'small'")
    assert skipped.on_stage_done(5, 3, now_s=0.0) == AskJudge(1)  # the middle stage is judged as ever
    skipped.on_verdict("ok", 10.0, now_s=0.1)
    assert skipped.on_stage_unavailable("no engine for model 'large'") == Answer(1, degraded=True)
    assert skipped.usage_of()["cascade"]["stages"][0] == {
        "model": "small", "prompt_tokens": 0, "completion_tokens": 0, "decision": "failed",
        "reason": "no engine for model 'small'"}
    nxt = life()
    nxt.start()
    nxt.on_stage_done(1, 1, now_s=0.0)
    nxt.on_verdict("ok", 10.0, now_s=0.1)
    assert nxt.on_stage_unavailable("no engine for model 'mid'") == Answer(0, degraded=True)


def test_spec_built_from_stages() -> None:
    with pytest.raises(CascadeSpecError):
        CascadeSpec("c", (Stage("a", None), Stage("b", None)))


def test_spec_text_is_parse_cascades_inverse() -> None:
    for text in ("c=llama3-8b:90,llama3-70b", "c3=a:85.5,b:0,c"):
        assert parse_cascade(text).text == text
    assert parse_cascade("c=a:90,b").with_thresholds([72.5]).text == "c=a:72.5,b"
