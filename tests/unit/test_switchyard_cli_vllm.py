"""`switchyard up --backend vllm`: argument rules, defaults, the agents' command lines and the banner (no vLLM
needed: nothing is spawned)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from launcher.cli import DEFAULT_ENGINES, banner, build_up_parser, check_up_args, main, star_agent_args, up
from launcher.local_fleet import DEFAULT_START_TIMEOUT_S, AgentSpec, LocalFleet, plan_agents


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    out = tmp_path / "tiny"
    out.mkdir()
    (out / "config.json").write_text("{}")
    return out


def checked(argv: list[str]) -> argparse.Namespace:
    parser = build_up_parser()
    args = parser.parse_args(argv)
    check_up_args(parser, args)
    return args


def usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        up(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_sim_defaults_are_unchanged() -> None:
    args = checked([])
    assert (args.backend, args.model, args.engines) == ("sim", None, DEFAULT_ENGINES["sim"])
    assert args.engines == 4
    assert args.startup_timeout_s == DEFAULT_START_TIMEOUT_S["sim"] == 60.0


def test_vllm_defaults_to_one_engine_a_long_startup_and_an_absolute_model_path(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(model_dir.parent)
    args = checked(["--backend", "vllm", "--model", "tiny"])
    assert args.engines == 1
    assert args.startup_timeout_s == DEFAULT_START_TIMEOUT_S["vllm"] == 300.0
    assert args.model == str(model_dir.resolve())


def test_explicit_engines_and_startup_timeout_win(model_dir: Path) -> None:
    args = checked(
        ["--backend", "vllm", "--model", str(model_dir), "--engines", "2", "--startup-timeout-s", "600"]
    )
    assert (args.engines, args.startup_timeout_s) == (2, 600.0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--backend", "vllm"], "--backend vllm needs --model DIR"),
        (["--backend", "vllm", "--model", "{missing}"], "no such directory"),
        (["--backend", "vllm", "--model", "{empty}"], "no config.json"),
        (["--backend", "vllm", "--model", "{model}", "--profile", "h100-llama3-8b"], "--profile is for"),
        (["--model", "{model}"], "--model is for --backend vllm"),
        (["--backend", "vllm", "--model", "{model}", "--startup-timeout-s", "0"], "must be positive"),
        (["--backend", "vllm", "--model", "{model}", "--engines", "0"], "need at least one engine"),
        (["--backend", "tgi"], "invalid choice: 'tgi'"),
        (["--length-predictor", "oracle"], "--length-predictor is for --reschedule star"),
        (["--backend", "vllm", "--model", "{model}", "--reschedule", "star"], "needs --length-predictor"),
        (["--backend", "vllm", "--model", "{model}", "--reschedule", "star", "--length-predictor", "oracle"],
         "oracle is for the sim backend"),
    ],
)
def test_up_rejects_bad_backend_arguments_in_one_line(
    argv: list[str], message: str, model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    paths = {"model": model_dir, "missing": tmp_path / "missing", "empty": tmp_path / "empty"}
    argv = [a.format(**paths) for a in argv]
    line = usage_error(argv, capsys)
    assert line.startswith("switchyard up: error: ")
    assert message in line


def test_vllm_agents_are_spawned_with_the_model_directory(model_dir: Path) -> None:
    specs = plan_agents(2, [], 50051, backend="vllm", model=str(model_dir))
    assert [s.address for s in specs] == ["127.0.0.1:50051", "127.0.0.1:50052"]
    assert specs[0].backend_args() == ["--backend", "vllm", "--model", str(model_dir)]
    assert specs[0].label == "vllm:tiny"
    sim = plan_agents(1, ["h100-llama3-8b"], 50051)[0]
    assert sim.backend_args() == ["--backend", "sim", "--profile", "h100-llama3-8b"]
    with pytest.raises(ValueError, match="needs a model directory"):
        AgentSpec("engine-0", "", 50051, backend="vllm")


def test_the_fleet_waits_by_backend_unless_told() -> None:
    vllm = AgentSpec("engine-0", "", 50051, backend="vllm", model="/m")
    sim = AgentSpec("engine-1", "h100-llama3-8b", 50052)
    assert LocalFleet([vllm, sim]).start_timeout_s(vllm) == 300.0
    assert LocalFleet([vllm, sim]).start_timeout_s(sim) == 60.0
    assert LocalFleet([vllm], start_timeout_s=90.0).start_timeout_s(vllm) == 90.0


def test_the_banner_says_what_the_engines_are(model_dir: Path) -> None:
    specs = plan_agents(1, [], 50051, backend="vllm", model=str(model_dir))
    text = banner("http://127.0.0.1:8000", specs, ["tiny"], "round_robin")
    assert text.splitlines()[0] == (
        "Switchyard is up: 1 vLLM engine(s) [engine-0=vllm:tiny@127.0.0.1:50051], policy round_robin"
    )
    assert "simulated" not in text
    sim = banner("http://127.0.0.1:8000", plan_agents(1, ["h100-llama3-8b"], 50051), ["m"], "round_robin")
    assert sim.startswith("Switchyard is up: 1 simulated engine(s) [engine-0=h100-llama3-8b@")


def test_tiny_model_rejects_a_bad_shape_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["tiny-model", "--out", str(tmp_path / "m"), "--hidden-size", "100", "--heads", "8"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("switchyard tiny-model: error: hidden size 100 is not divisible by 8 heads")
    assert not (tmp_path / "m").exists()


def test_reschedule_gives_the_agents_what_the_rescheduler_reads(model_dir: Path) -> None:
    assert star_agent_args(checked([])) == ()
    assert star_agent_args(checked(["--reschedule", "star"])) == ("--length-predictor", "oracle")
    assert star_agent_args(checked(["--reschedule", "star-nopred"])) == ("--star-report",)
    predictor = model_dir / "star.npz"
    args = checked(["--backend", "vllm", "--model", str(model_dir), "--reschedule", "star",
                    "--length-predictor", str(predictor)])
    assert star_agent_args(args) == ("--length-predictor", str(predictor))
    specs = plan_agents(2, ["h100-llama3-8b"], 50051, extra_args=("--star-report",))
    assert all(s.extra_args == ("--star-report",) for s in specs)


def test_up_plan_starts_the_plans_engines_labelled_and_routes_by_its_goodput(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from launcher.cli import plan_policy_params, up_agent_specs
    from launcher.planning_cli import plan

    path = tmp_path / "plan.json"
    assert plan(["--model", "llama3-8b", "--workload", "in=1000,out=500", "--slo", "ttft=1000,tpot=30",
                 "--goodput-rps", "15", "--gpus", "a100:6", "--json", str(path)]) == 0
    args = checked(["--plan", str(path)])
    assert args.engines == 2 and args.policy == "goodput_rr"
    specs = up_agent_specs(args, [e.profile for e in args.plan_specs])
    assert [s.profile for s in specs] == ["a100-llama3-8b", "a100-llama3-8b"]
    assert [s.extra_args for s in specs] == [("--combo", "1xa100#0"), ("--combo", "1xa100#1")]
    goodput = json.loads(path.read_text())["combos"][0]["goodput_rps"]
    assert plan_policy_params(args) == {"goodput": {"1xa100": goodput}}
    # A disaggregated combo: its prefill and decode engines get their roles.
    doc = json.loads(path.read_text())
    doc["combos"][0]["combo"] = "1xa100+1xa100"
    disaggregated = tmp_path / "pd.json"
    disaggregated.write_text(json.dumps(doc))
    args = checked(["--plan", str(disaggregated)])
    specs = up_agent_specs(args, [e.profile for e in args.plan_specs])
    assert [s.extra_args for s in specs] == [
        ("--combo", f"1xa100+1xa100#{k}", "--role", role) for k in (0, 1) for role in ("prefill", "decode")]
    assert usage_error(["--plan", str(path), "--engines", "3"], capsys).endswith(
        "--plan sets the engines: drop --engines and --profile")
    assert "no such file" in usage_error(["--plan", str(tmp_path / "none.json")], capsys).lower()


def test_up_autoscale_needs_a_plan_and_one_gateway_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from launcher.cli import up_agent_specs
    from launcher.planning_cli import plan

    path = tmp_path / "plan.json"
    assert plan(["--model", "llama3-8b", "--workload", "in=1000,out=500", "--slo", "ttft=1000,tpot=30",
                 "--goodput-rps", "15", "--gpus", "a100:6", "--json", str(path)]) == 0
    args = checked(["--plan", str(path), "--autoscale", "--autoscale-param", "local_window_s=60",
                    "--autoscale-param", "min_copies=2"])
    assert args.autoscale_config.enabled and args.autoscale_config.local_window_s == 60
    assert args.autoscale_config.min_copies == 2
    specs = up_agent_specs(args, [e.profile for e in args.plan_specs])
    assert specs[0].extra_args == ("--drain-grace-s", "600", "--combo", "1xa100#0")  # released agents drain
    assert checked(["--plan", str(path)]).autoscale_config is None
    assert usage_error(["--autoscale"], capsys).endswith("--autoscale needs --plan PATH "
                                                         "(what is deployed, and what to re-plan over)")
    assert usage_error(["--plan", str(path), "--autoscale", "--gateway-workers", "2"], capsys).endswith(
        "--autoscale runs a one-process gateway: drop --gateway-workers")
    assert usage_error(["--plan", str(path), "--autoscale-param", "ratio=0.5"], capsys).endswith(
        "--autoscale-param is for --autoscale")
    assert "autoscale-param: ratio: Input should be less than 1" in usage_error(
        ["--plan", str(path), "--autoscale", "--autoscale-param", "ratio=2"], capsys)
    assert "windo: Extra inputs are not permitted" in usage_error(
        ["--plan", str(path), "--autoscale", "--autoscale-param", "windo=2"], capsys)
