"""`loadgen cascade-plan` in process: the plan file's keys and values, and exit 2 for bad flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadgen.cli import main
from switchyard.profiles import UnknownProfileError, get_profile, profile_name

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


def test_simulate_serves_a_plan_its_fleet_and_thresholds(tmp_path: Path) -> None:
    plan_path, out = tmp_path / "plan.json", tmp_path / "sim.json"
    assert main(["cascade-plan", "--gpus", "h100:16", "--cascade", PAIR, "--dataset", "mt-bench-hard",
                 "--rate", "3", "--q-min", "88", "--output", str(plan_path)]) == 0
    plan = json.loads(plan_path.read_text())
    rc = main(["simulate", "--cascade", f"c={PAIR.replace(',', ':50,')}", "--plan", str(plan_path),
               "--dataset", "mt-bench-hard", "--rate", "3", "--num-requests", "200", "--output", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["summary"]["cascade"]["thresholds"] == plan["thresholds"]  # the plan's, not the flag's 50
    engines = result["summary"]["per_engine"]
    held = sum(get_profile(e.rsplit("-", 1)[0]).num_gpus for e in engines)
    assert held == sum(tp * pp * count for stage in plan["shapes"] for tp, pp, count in stage)
    assert held <= 16
    assert result["config"]["engines"] == ",".join(
        f"{profile_name('h100', model, tp, pp)}:{count}"
        for model, stage in zip(plan["models"], plan["shapes"], strict=True) for tp, pp, count in stage)


@pytest.mark.parametrize(("cascade", "edit", "message"), [
    ("c=llama3-8b:50,qwen2.5-14b", {}, "it plans llama3-8b,llama3-70b, --cascade serves llama3-8b,qwen2"),
    ("c=llama3-8b:50,llama3-70b", {"thresholds": [101.0]}, "escalates every request"),
    ("c=llama3-8b:50,llama3-70b", {"shapes": [[], []]}, "no replica"),
    ("c=llama3-8b:50,llama3-70b", {"models": None}, "not a cascade plan"),
])
def test_simulate_refuses_a_plan_it_cannot_serve(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 cascade: str, edit: dict[str, object], message: str) -> None:
    plan_path = tmp_path / "plan.json"
    assert main(["cascade-plan", "--gpus", "h100:8", "--cascade", PAIR, "--rate", "1", "--q-min", "85",
                 "--output", str(plan_path)]) == 0
    capsys.readouterr()
    plan_path.write_text(json.dumps({**json.loads(plan_path.read_text()), **edit}))
    rc = main(["simulate", "--cascade", cascade, "--plan", str(plan_path), "--dataset", "mt-bench",
               "--num-requests", "10"])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1


def test_shape_profiles_resolve_by_name() -> None:
    profile = get_profile("h100x4p2-llama3-70b")
    assert (profile.tensor_parallel, profile.pipeline_parallel, profile.num_gpus) == (4, 2, 8)
    assert get_profile("h100x8-llama3-8b").tensor_parallel == 8  # beyond the registry's two per pair
    assert get_profile("h100-llama3-8b") is get_profile("h100-llama3-8b")
    for name in ("h100x2-llama3-70b", "h100x3-llama3-8b", "h100x4p5-llama3-8b", "h100-llama9", "nope"):
        with pytest.raises(UnknownProfileError, match="GPU\\[xTP\\[pPP\\]\\]-MODEL"):
            get_profile(name)


def test_a_rate_nothing_keeps_up_with_gives_an_infeasible_plan(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    rc = main(["cascade-plan", "--gpus", "h100:8", "--cascade", PAIR, "--rate", "200", "--q-min", "90",
               "--output", str(out)])
    assert rc == 1 and "keeps up with 200 req/s" in capsys.readouterr().err
    plan = json.loads(out.read_text())
    assert plan["feasible"] is False and plan["L"] is None and plan["J"] is None
