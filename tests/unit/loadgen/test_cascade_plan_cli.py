"""`loadgen cascade-plan` in process: the plan file's keys and values, and exit 2 for bad flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadgen.cli import main

PAIR = "llama3-8b,llama3-70b"
KEYS = {"thresholds", "gpus", "shapes", "L_s", "Q", "J", "iterations", "solver_s"}


def test_writes_a_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    rc = main(["cascade-plan", "--gpus", "h100:8", "--cascade", "llama3-8b,llama3-70b", "--dataset",
               "mt-bench-hard", "--rate", "2", "--q-min", "85", "--output", str(out)])
    assert rc == 0
    plan = json.loads(out.read_text())
    assert KEYS <= set(plan)
    assert len(plan["thresholds"]) == 1 and len(plan["gpus"]) == 2 and sum(plan["gpus"]) == 8
    assert plan["L"] == max(plan["L_s"])
    assert plan["J"] >= plan["L"] and plan["iterations"] >= 4 and plan["solver_s"] > 0
    for stage, gpus in zip(plan["shapes"], plan["gpus"], strict=True):
        assert 1 <= len(stage) <= 2
        assert sum(tp * pp * count for tp, pp, count in stage) <= gpus
    assert plan["stage_share"][0] == 1.0
    assert plan["e2e_p95_s"] >= plan["L_s"][0]
    assert plan["stand_ins"]["llama3-8b"] == "mistralai/Mixtral-8x7B-Instruct-v0.1"
    assert plan["request"] == {"gpus": 8, "rate_rps": 2.0, "q_min": 85.0, "l_max_s": None,
                               "judge_latency_s": 0.27, "dataset": "mt-bench-hard"}
    assert "thresholds" in capsys.readouterr().out


def test_latency_budget_variant(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    rc = main(["cascade-plan", "--gpus", "h100:8", "--cascade", "llama3-8b,llama3-70b", "--rate", "1",
               "--l-max", "30", "--output", str(out)])
    assert rc == 0
    plan = json.loads(out.read_text())
    assert plan["request"]["l_max_s"] == 30.0 and plan["J"] == pytest.approx(-plan["Q"])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--gpus", "h100", "--cascade", PAIR, "--rate", "1", "--q-min", "80"], "GPU:COUNT"),
        (["--gpus", "h100:0", "--cascade", PAIR, "--rate", "1", "--q-min", "80"], "GPU:COUNT"),
        (["--gpus", "h100:8", "--cascade", "llama3-8b", "--rate", "1", "--q-min", "80"], "at least two"),
        (["--gpus", "h100:8", "--cascade", PAIR, "--rate", "0", "--q-min", "80"], "> 0"),
        (["--gpus", "h100:8", "--cascade", PAIR, "--rate", "1"], "--q-min"),
        (["--gpus", "tpu:8", "--cascade", PAIR, "--rate", "1", "--q-min", "80"], "unknown GPU"),
        (["--gpus", "h100:8", "--cascade", "llama3-8b,gpt-5", "--rate", "1", "--q-min", "80"], "gpt-5"),
        (["--gpus", "h100:8", "--cascade", PAIR, "--rate", "1", "--q-min", "80", "--dataset", "nope"],
         "invalid choice"),
    ],
)
def test_bad_flags_exit_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str],
                                        message: str) -> None:
    argv = ["cascade-plan", *flags, "--output", str(tmp_path / "plan.json")]
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = int(exc.code or 0)
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
    assert not (tmp_path / "plan.json").exists()
