"""CAUCHY in the simulator: a plan's fleet, engines joining and draining mid-run, the bill, and the closed
loop autoscaler against the offline `switchyard plan --autoscale` timeline."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from gateway.planning.autoscaler import ScaleIn, ScaleOut
from gateway.planning.combos import Slo
from gateway.planning.cost_model import Workload
from gateway.planning.plan_file import Plan, parse_plan
from launcher.planning_cli import autoscale_timeline
from launcher.planning_cli import plan as plan_cli
from loadgen.datasets import Request
from loadgen.simulate import Scaling, SimOptions, simulate
from loadgen.simulate.fleet import combo_engines
from switchyard.hardware import GPUS, MODELS
from switchyard.profiles import get_profile

H100 = "h100-llama3-8b"


def one_h100_plan() -> Plan:
    return Plan(model=MODELS["llama3-8b"], workload=Workload(100.0, 20.0), slo=Slo(1.0, 0.1), objective="co",
                inventory={"h100": 4}, prices={}, combos={"1xh100": 1}, goodput_rps={"1xh100": 5.0})


def steady(rate: float, seconds: float, start: float = 0.0, prefix: str = "r") -> list[tuple[float, Request]]:
    n = int(rate * seconds)
    return [(start + i / rate, Request(f"{prefix}{i}", 100, output_tokens=20)) for i in range(n)]


def combo_profiles(combo_id: str, model: str) -> list[str]:
    return [profile for profile, _ in combo_engines(combo_id, model)]


def test_combo_profiles() -> None:
    assert combo_profiles("1xh800+2xh20", "llama3-8b") == ["h800-llama3-8b", "h20-llama3-8b", "h20-llama3-8b"]
    assert combo_profiles("2xa10", "llama3-8b") == ["a10x2-llama3-8b"]
    with pytest.raises(ValueError, match="no sim profile of a10"):
        combo_profiles("1xa10", "llama3-8b")
    with pytest.raises(ValueError, match="bad combo id"):
        combo_profiles("h800", "llama3-8b")


def test_engines_join_and_drain_mid_run_losing_nothing_and_billing_exactly() -> None:
    actions = (ScaleOut(2.0, {"1xh100": 1}, 5.0, "scripted"), ScaleIn(20.0, {"1xh100": 1}, 25.0, "scripted"))
    scaling = Scaling(one_h100_plan(), actions=actions)
    result = simulate(steady(4.0, 40.0), [], SimOptions(policy="goodput_rr"), scaling=scaling)
    assert len(result.outcomes) == 160 and all(o.success for o in result.outcomes)
    first, joined = f"{H100}-0", f"{H100}-1"
    assert set(result.per_engine) == {first, joined}
    assert result.per_engine[joined]["combo"] == "1xh100#1"  # the newest copy drained
    served = [o for o in result.outcomes if o.engine_id == joined]
    assert served and min(o.arrival_s for o in served) >= 5.0  # nothing before it joined
    assert max(o.arrival_s for o in served) < 20.01  # nothing after it drained (+ the report delay)
    assert max(o.arrival_s + o.e2e_s for o in served) < 25.0  # idle at its grace's end: it left at 25 s
    price = get_profile(H100).hourly_price_usd
    expected = price * result.duration_s / 3600 + price * (25.0 - 2.0) / 3600
    assert result.cost_usd == pytest.approx(expected, rel=1e-12)
    tokens = sum(o.prompt_tokens + o.output_tokens for o in result.outcomes)
    assert result.tokens_per_usd == pytest.approx(tokens / expected)
    usd_h = {round(row["t_s"]): row["usd_per_h"] for row in result.timeline}
    assert (usd_h[1], usd_h[3], usd_h[24], usd_h[26]) == (price, 2 * price, 2 * price, price)
    assert [a["kind"] for a in result.fleet_actions] == ["ScaleOut", "ScaleIn"]


def test_a_copy_removed_while_provisioning_is_cancelled_and_billed_until_then() -> None:
    actions = (ScaleOut(2.0, {"1xh100": 1}, 10.0, "s"), ScaleIn(5.0, {"1xh100": 1}, 6.0, "s"))
    result = simulate(steady(2.0, 20.0), [], SimOptions(), scaling=Scaling(one_h100_plan(), actions=actions))
    assert all(o.success for o in result.outcomes)
    assert result.per_engine[f"{H100}-1"]["requests"] == 0
    price = get_profile(H100).hourly_price_usd
    assert result.cost_usd == pytest.approx(price * (result.duration_s + 3.0) / 3600, rel=1e-12)


def test_a_draining_engine_with_work_leaves_only_once_idle() -> None:
    # A long request sits on the drained copy past its grace: it finishes there, and the bill runs until then.
    schedule = [(0.0, Request("warm", 100, output_tokens=5)),
                (6.0, Request("long", 2000, output_tokens=3000)),
                (6.0, Request("other", 100, output_tokens=5))]
    actions = (ScaleOut(0.0, {"1xh100": 1}, 1.0, "s"), ScaleIn(7.0, {"1xh100": 1}, 8.0, "s"))
    result = simulate(schedule, [], SimOptions(policy="round_robin"),
                      scaling=Scaling(one_h100_plan(), actions=actions))
    assert all(o.success for o in result.outcomes)
    long = next(o for o in result.outcomes if o.request_id == "long")
    assert long.engine_id == f"{H100}-1" and long.arrival_s + long.e2e_s > 8.0
    price = get_profile(H100).hourly_price_usd
    left_s = long.arrival_s + long.e2e_s
    assert result.cost_usd == pytest.approx(price * (result.duration_s + left_s - 0.0) / 3600, rel=1e-9)


def test_the_closed_loop_autoscaler_acts_as_the_offline_timeline(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    assert plan_cli(["--model", "llama3-8b", "--workload", "in=1000,out=500", "--slo", "ttft=1000,tpot=30",
                     "--goodput-rps", "2", "--gpus", "h100:6,a100:6", "--json", str(path)]) == 0
    plan = parse_plan(json.loads(path.read_text()))  # one 1xa100 copy, 9.2 req/s modelled
    # 2 req/s, a step to 15 req/s, then 1 req/s: a scale-out, then scale-ins. The requests are lighter than
    # the plan's workload: only their arrival times matter to the autoscaler.
    schedule = (steady(2.0, 240.0) + steady(15.0, 300.0, 240.0, "b") + steady(1.0, 400.0, 540.0, "c"))
    arrivals = [t for t, _ in schedule]
    offline = autoscale_timeline(plan.candidates(), dict(plan.inventory), plan.objective, plan.combos,
                                 arrivals, 10.0)
    result = simulate(schedule, [], SimOptions(policy="goodput_rr"), scaling=Scaling(plan, autoscale=True))
    assert [a["kind"] for a in offline["actions"]][:2] == ["ScaleOut", "ScaleIn"]
    assert result.fleet_actions == offline["actions"]
    assert all(o.success for o in result.outcomes)
    assert len(result.per_engine) > sum(plan.combos.values())  # engines joined


def test_parse_plan_rejects_bad_documents() -> None:
    with pytest.raises(ValueError, match="schema"):
        parse_plan({"schema": "x"})
    with pytest.raises(ValueError, match="unknown model"):
        parse_plan({"schema": "switchyard.plan/1", "model": "gpt-9"})
    assert math.isfinite(GPUS["h100"].hourly_price_usd)


def test_cli_plan_errors_are_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from loadgen.cli import main

    base = ["simulate", "--dataset", "synth:in=100,out=20", "--num-requests", "5", "--no-plots"]
    assert main([*base, "--autoscale"]) == 2
    assert main([*base, "--plan", str(tmp_path / "missing.json")]) == 2
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main([*base, "--plan", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "--autoscale needs --plan" in err and "missing.json" in err and "bad.json" in err
    assert "Traceback" not in err


def test_cli_simulates_a_plan_and_prints_the_bill(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from loadgen.cli import main

    path = tmp_path / "plan.json"
    assert plan_cli(["--model", "llama3-8b", "--workload", "in=100,out=20", "--slo", "ttft=2000,tpot=100",
                     "--goodput-rps", "2", "--gpus", "h100:2", "--json", str(path)]) == 0
    out_json = tmp_path / "run.json"
    assert main(["simulate", "--plan", str(path), "--policy", "goodput_rr", "--dataset",
                 "synth:in=100,out=20", "--num-requests", "20", "--rate", "5", "--no-plots",
                 "--output", str(out_json)]) == 0
    assert "Fleet cost (USD); tokens per USD:" in capsys.readouterr().out
    summary = json.loads(out_json.read_text())["summary"]
    assert summary["cost_usd"] > 0 and summary["tokens_per_usd"] > 0


def test_a_request_routed_to_a_draining_engine_before_its_report_is_retried_elsewhere() -> None:
    # Reports take 0.5 s: requests arriving just after the drain are still routed to the draining copy, which
    # refuses them (as a live agent does); the life retries them on the other copy.
    actions = (ScaleOut(0.0, {"1xh100": 1}, 1.0, "s"), ScaleIn(10.0, {"1xh100": 1}, 11.0, "s"))
    decisions: list[object] = []
    result = simulate(steady(20.0, 12.0), [], SimOptions(policy="round_robin", report_delay_s=0.5),
                      scaling=Scaling(one_h100_plan(), actions=actions), on_decision=decisions.append)
    assert len(result.outcomes) == 240 and all(o.success for o in result.outcomes)
    drained = f"{H100}-1"
    assert all(o.arrival_s < 10.0 for o in result.outcomes if o.engine_id == drained)
    assert len(decisions) > 240  # some requests were routed twice


def test_cli_autoscale_params_reach_algorithm_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The gateway's --autoscale-param values replay in the simulator: a live run's settings can be tried."""
    from launcher.planning_cli import plan as plan_cli
    from loadgen.cli import main

    path = tmp_path / "plan.json"
    assert plan_cli(["--model", "llama3-8b", "--workload", "in=100,out=20", "--slo", "ttft=2000,tpot=100",
                     "--goodput-rps", "1", "--gpus", "a100:2", "--json", str(path)]) == 0
    out = tmp_path / "run.json"
    base = ["simulate", "--dataset", "synth:in=100,out=20", "--num-requests", "5", "--no-plots",
            "--plan", str(path)]
    assert main([*base, "--autoscale", "--autoscale-param", "local_window_s=60", "--autoscale-param",
                 "min_copies=0", "--output", str(out)]) == 0
    params = json.loads(out.read_text())["config"]["autoscale_params"]
    assert params["local_window_s"] == 60 and params["min_copies"] == 0
    capsys.readouterr()
    assert main([*base, "--autoscale-param", "ratio=0.5"]) == 2
    assert main([*base, "--autoscale", "--autoscale-param", "ratio=2"]) == 2
    assert main([*base, "--autoscale", "--autoscale-param", "windo=2"]) == 2
    err = capsys.readouterr().err
    assert "--autoscale-param is for --autoscale" in err and "ratio must be in (0, 1)" in err
    assert "windo" in err and "Traceback" not in err
