"""CascadeInfer's length stages in the simulator: the live policy and rescheduler, the mover and the splice.

A two-stage plan over three engines ([0, 600) on one, [600, ...) on two): every request starts short, on the
first engine, and grows past 600 tokens, so each is handed over once; nothing may be lost or repeated.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gateway.rescheduling.length_stages import StagesPlanFile
from loadgen.cli import main
from loadgen.compare import STAGES_ABLATION_ARMS
from loadgen.datasets import Request
from loadgen.metrics import Outcome
from loadgen.simulate import EngineSpec, SimOptions, SimResult, simulate
from switchyard.clock import ManualClock

H100 = "h100-llama3-8b"
PLAN = StagesPlanFile.parse({"stages": [{"lo": 0, "hi": 600, "instances": 1},
                                        {"lo": 600, "hi": 8192, "instances": 2}]})


def growing(n: int = 12, spacing_s: float = 0.05) -> list[tuple[float, Request]]:
    """n requests with 200-token prompts that decode 700 + 10 i tokens (well past the first stage's 600)."""
    return [(i * spacing_s, Request(request_id=f"r{i}", prompt_tokens=200, output_tokens=700 + 10 * i))
            for i in range(n)]


def run(**options: Any) -> SimResult:
    base: dict[str, Any] = {"policy": "length_stages", "reschedule": "length_stages", "stages_plan": PLAN,
                            "prediction_interval": 4, "reschedule_interval_s": 0.1,
                            "reschedule_params": {"refine": "off"}}
    return simulate(growing(), [EngineSpec(H100, 3)], SimOptions(**{**base, **options}),
                    wall_clock=ManualClock(0.0))


def assert_whole(outcomes: list[Outcome]) -> None:
    for o in outcomes:
        assert o.success, o.error
        expected = 700 + 10 * int(o.request_id[1:])
        assert o.output_tokens == expected and len(o.itl_s) + 1 == expected, o.request_id
        assert all(gap > 0 for gap in o.itl_s), o.request_id


def test_requests_start_on_the_first_stage_and_are_handed_over_whole() -> None:
    result = run()
    assert_whole(result.outcomes)
    first = "h100-llama3-8b-0"
    # every prompt (200) is in [0, 600); the two arrivals before the first tick (0.1 s) see no layout yet
    assert result.per_engine[first]["requests"] == 10
    row = result.per_decider[0]["reschedule"]
    assert row["reasons"].get("handover", 0) >= 10  # nearly every request crossed 600 on the first engine
    assert row["migrations"]["resumed"] == row["migrations"]["cut"] and row["migrations"]["failed"] == 0
    later = sum(result.per_engine[f"h100-llama3-8b-{i}"]["output_tokens"] for i in (1, 2))
    assert later > 0.5 * sum(o.output_tokens for o in result.outcomes)  # most decoding ran past the wall
    layout = row["layout"]["llama3-8b"]
    assert [s["engines"] for s in layout] == [[first], ["h100-llama3-8b-1", "h100-llama3-8b-2"]]
    # each outcome records its own moves; together they are the cuts that resumed
    assert sum(o.migrations or 0 for o in result.outcomes) == row["migrations"]["resumed"]
    assert sum(1 for o in result.outcomes if o.migrations) >= 10


def test_the_same_seed_gives_the_same_run() -> None:
    a, b = run(seed=3), run(seed=3)
    assert [(o.request_id, o.engine_id, o.e2e_s) for o in a.outcomes] == \
        [(o.request_id, o.engine_id, o.e2e_s) for o in b.outcomes]


def test_without_the_rescheduler_nothing_moves_and_one_stage_serves() -> None:
    result = run(policy="round_robin", reschedule="none", stages_plan=None, reschedule_params={})
    assert_whole(result.outcomes)
    assert result.balance is None
    assert {o.migrations for o in result.outcomes} == {0}


@pytest.mark.parametrize(("options", "match"), [
    ({"reschedule": "none", "stages_plan": None, "reschedule_params": {}},
     "needs --reschedule length_stages"),
    ({"reschedule_params": {"layout": "zigzag"}}, "layout"),
    ({"reschedule_params": {"bogus": 1}}, "bogus"),
])
def test_bad_options_are_refused_naming_the_key(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        run(**options)


def test_compare_stages_ablation_runs_each_arm_with_its_parameters(tmp_path: Path) -> None:
    out = tmp_path / "ablation.json"
    code = main(["compare", "--dataset", "synth:in=200,out=700,n=30", "--num-requests", "30", "--rate", "20",
                 "--engines", f"{H100}:3", "--reschedule", "length_stages", "--stages-ablation",
                 "--reschedule-param", "ema=0.5", "--output", str(out), "--no-plots", "--no-timelines"])
    assert code == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["label"] for r in runs] == [label for label, _, _ in STAGES_ABLATION_ARMS]
    for run_, (_, policy_params, params) in zip(runs, STAGES_ABLATION_ARMS, strict=True):
        assert run_["policy"] == "length_stages" and run_["policy_params"] == dict(policy_params)
        assert run_["reschedule_params"] == {"ema": 0.5, **params}  # the arm's over the command line's
        assert run_["summary"]["completed"] == 30 and run_["summary"]["mean_migrations"] is not None


@pytest.mark.parametrize(("extra", "match"), [
    ([], "needs --reschedule length_stages"),
    (["--reschedule", "length_stages", "--ablation"], "pick one"),
])
def test_compare_stages_ablation_usage_errors(extra: list[str], match: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["compare", "--dataset", "synth:in=200,out=700,n=5", "--num-requests", "5",
                 "--engines", f"{H100}:2", "--stages-ablation", *extra])
    assert code == 2 and match in capsys.readouterr().err
