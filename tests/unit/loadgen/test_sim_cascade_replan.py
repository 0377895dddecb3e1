"""`loadgen simulate --cascade --plan --replan`: a shifting workload re-planned in the simulator (§4.4)."""

from __future__ import annotations

import json

import pytest

from loadgen.cli import main

PAIR = "llama3-8b,llama3-70b"


@pytest.fixture(scope="module")
def shifted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    tmp = tmp_path_factory.mktemp("replan")
    plan, out = tmp / "plan.json", tmp / "sim.json"
    assert main(["cascade-plan", "--gpus", "h100:16", "--cascade", PAIR, "--dataset", "mt-bench-hard",
                 "--rate", "3", "--q-min", "86", "--output", str(plan)]) == 0
    rc = main(["simulate", "--cascade", "c=llama3-8b:90,llama3-70b", "--plan", str(plan), "--replan",
               "--replan-param", "window_s=100", "--replan-param", "shadow_share=0.3",
               "--dataset", "mt-bench-hard@200,mt-bench-easy@300", "--rate", "3", "--output", str(out)])
    assert rc in (0, 1)
    return {"plan": json.loads(plan.read_text()), "result": json.loads(out.read_text())}


def test_the_easy_phase_is_seen_and_re_planned(shifted: dict[str, object]) -> None:
    plan, result = shifted["plan"], shifted["result"]
    assert isinstance(plan, dict) and isinstance(result, dict)
    summary = result["summary"]
    cascade = summary["cascade"]
    replan = cascade["replan"]
    assert replan["windows"] in (4, 5)  # about 500 s of arrivals, windows of 100 s
    assert replan["replans"] == 1  # the plan made on the shadowed easy rows holds for the rest
    actions = summary["fleet_actions"]
    first = next(a for a in actions if a["kind"] == "replan")
    assert 200.0 <= first["at_s"] <= 400.0 and "llama3-8b scores" in first["reason"]
    assert cascade["thresholds"] != plan["thresholds"]  # swapped: the easy items need less escalation
    kinds = [a["kind"] for a in actions]
    assert kinds.index("thresholds") > kinds.index("replan")
    assert replan["solver_s"] and all(0 < s < 30 for s in replan["solver_s"])


def test_every_request_has_one_outcome_and_shadows_are_nobodys(shifted: dict[str, object]) -> None:
    result = shifted["result"]
    assert isinstance(result, dict)
    summary = result["summary"]
    assert summary["completed"] + summary["failed"] == 1500
    shadow = summary["cascade"]["shadow"]
    assert 300 < shadow["requests"] < 600  # 30 % of 1500
    assert shadow["rows"] + shadow["dropped"] == shadow["requests"]
    assert 0 < shadow["dispatches"] < shadow["requests"]  # only the stages the cascade did not run
    engine_requests = sum(e["requests"] for e in summary["per_engine"].values())
    stages = round(1500 * sum(summary["cascade"]["stage_share"]))
    assert engine_requests >= stages + shadow["dispatches"] - shadow["unreached"] - 5  # retries on drains add
    assert shadow["completion_tokens"] > 0 and shadow["judge_prompt_tokens"] > 0


def test_replan_needs_a_plan(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["simulate", "--cascade", "c=llama3-8b:90,llama3-70b", "--replan", "--dataset", "mt-bench",
               "--engines", "h100-llama3-8b:1,h100x4-llama3-70b:1", "--num-requests", "5"])
    assert rc == 2 and "--replan needs --plan" in capsys.readouterr().err
    rc = main(["simulate", "--cascade", "c=llama3-8b:90,llama3-70b", "--dataset", "mt-bench@x",
               "--engines", "h100-llama3-8b:1,h100x4-llama3-70b:1", "--rate", "1"])
    assert rc == 2 and "SUBSET@SECONDS" in capsys.readouterr().err
