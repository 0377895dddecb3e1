"""`cascades:` in the gateway config: the shape rules, each a path-named ConfigError."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config import ConfigError, build_config

JUDGE = {"kind": "profile"}


def cascade(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "name": "cascade-llama3",
        "judge": JUDGE,
        "stages": [{"model": "llama3-8b", "threshold": 90}, {"model": "llama3-70b"}],
    }
    return {**base, **over}


def test_a_cascade_with_defaults() -> None:
    config = build_config(cli={"cascades": [cascade()]})
    c = config.cascades[0]
    assert (c.on_judge_failure, c.streaming, c.judge.timeout_s, c.judge.output) == (
        "escalate",
        "final_live",
        2.0,
        "rating",
    )
    assert (c.judge.failures_to_skip, c.judge.skip_s) == (5, 10.0)


@pytest.mark.parametrize(
    ("cascades", "message"),
    [
        ([cascade(stages=[{"model": "a"}])], "at least 2 stages"),
        ([cascade(stages=[{"model": "a", "threshold": 101}, {"model": "b"}])], "less than or equal to 100"),
        ([cascade(stages=[{"model": "a", "threshold": -1}, {"model": "b"}])], "greater than or equal to 0"),
        (
            [cascade(stages=[{"model": "a", "threshold": 50}, {"model": "b", "threshold": 50}])],
            "no threshold",
        ),
        ([cascade(stages=[{"model": "a"}, {"model": "b"}])], "needs a threshold"),
        ([cascade(), cascade()], "share a name"),
        ([cascade(), cascade(name="llama3-8b")], "both a cascade and a stage model"),
        ([cascade(judge={"kind": "openai", "model": "gpt-4o"})], "needs url and model"),
        ([cascade(judge={"kind": "cluster"})], "needs model"),
        ([cascade(judge={"kind": "profile", "timeout_s": 0})], "greater than 0"),
        ([cascade(streaming="live")], "streaming"),
    ],
)
def test_bad_cascades_are_refused(cascades: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_config(cli={"cascades": cascades})
