"""`switchyard gpus` and `switchyard plan` (CAUCHY's planning commands): output, JSON, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.cli import main
from switchyard.hardware import GPUS

PLAN = ["plan", "--model", "llama3-8b", "--workload", "in=337,out=1330", "--slo", "ttft=5000,tpot=30"]


def test_switchyard_gpus_prints_the_catalogue(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gpus", "--json", "--price", "H20=1.0"]) == 0
    rows = {r["gpu"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == set(GPUS)
    assert rows["h20"]["usd_per_hour"] == 1.0 and rows["h20"]["gb_per_usd"] == 4000 * 3600
    assert rows["h800"]["tflop_per_usd"] == round(989 * 3600 / 2.69)
    assert main(["gpus"]) == 0
    assert "H20-NVL-96GB" in capsys.readouterr().out
    for bad, reason in ((["--price", "h20"], "expected GPU=USD"), (["--price", "h20=x"], "not a number"),
                        (["--price", "b200=1"], "unknown GPU b200")):
        assert main(["gpus", *bad]) == 2
        err = capsys.readouterr().err
        assert reason in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_plan_meets_the_demand_within_the_inventory(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert main([*PLAN, "--goodput-rps", "40", "--gpus", "h800:2,a800:4,h20:3", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["schema"] == "switchyard.plan/1" and doc["fallback"] is None
    assert doc["expected_goodput_rps"] >= 40
    assert all(doc["gpus_used"].get(g, 0) <= n for g, n in {"h800": 2, "a800": 4, "h20": 3}.items())
    total = sum(c["usd_per_hour"] * c["count"] for c in doc["combos"])
    assert doc["total_usd_per_h"] == pytest.approx(total)
    assert doc["solver_ms"] > 0 and doc["tokens_per_usd"] > 0
    assert "solver" in printed and doc["combos"][0]["combo"] in printed


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        (["--goodput-rps", "600", "--budget-usd-h", "30"], "600 req/s needs >= $"),
        (["--goodput-rps", "2000", "--gpus", "h20:8"], "2000 req/s needs 205 h20 (205 x 1xh20), 8 available"),
        (["--goodput-rps", "5", "--slo", "ttft=5000,tpot=0.5"],
         "TPOT 0.5 ms < fastest decode step (h20x6, 0.7 ms)"),
        (["--goodput-rps", "5", "--gpus", "b200:8"], "unknown GPU 'b200'; known: a10,"),
        (["--goodput-rps", "5", "--model", "gpt5"], "unknown model 'gpt5'; known:"),
        ([], "give --goodput-rps, --budget-usd-h, or both"),
        (["--goodput-rps", "-1"], "--goodput-rps must be > 0"),
        (["--goodput-rps", "5", "--workload", "in=1"], "give in=TOKENS,out=TOKENS"),
    ],
)
def test_plan_refuses_what_cannot_be_planned_in_one_line(extra: list[str], reason: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    args = list(PLAN)
    for flag in ("--slo", "--model", "--workload"):  # a later flag of the same name wins in argparse
        if flag in extra:
            i = args.index(flag)
            del args[i:i + 2]
    assert main([*args, *extra]) == 2
    err = capsys.readouterr().err
    assert reason in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_fallback_plans_the_most_goodput_and_says_so(capsys: pytest.CaptureFixture[str],
                                                    tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    assert main([*PLAN, "--goodput-rps", "2000", "--gpus", "h20:8", "--fallback", "--json", str(out)]) == 0
    assert "FALLBACK (--fallback)" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["fallback"].startswith("2000 req/s needs") and doc["gpus_used"] == {"h20": 8}
    assert 0 < doc["expected_goodput_rps"] < 2000


def test_autoscale_replays_a_timed_trace_through_algorithm_1(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A timed JSONL trace at 1 req/s for 10 minutes, then 3 req/s for 10: the fleet sized for the first
    window grows after the step, and the bill integrates $/h over the trace."""
    trace = tmp_path / "timed.jsonl"
    times = [i * 1.0 for i in range(600)] + [600 + i / 3 for i in range(1800)]
    rows = (json.dumps({"prompt": "hello there", "output_tokens": 200, "timestamp": t}) for t in times)
    trace.write_text("".join(row + "\n" for row in rows))
    table = tmp_path / "goodput.json"
    table.write_text(json.dumps({"1xa800": 1.2, "1xh20": 2.0}))
    out = tmp_path / "plan.json"
    args = ["plan", "--model", "llama3-8b", "--workload", f"jsonl:{trace}", "--slo", "ttft=5000,tpot=50",
            "--goodput-table", str(table), "--autoscale", "--json", str(out)]
    assert main(args) == 0
    assert "ScaleOut" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    auto = doc["autoscale"]
    assert doc["demand_rps"] == pytest.approx(1.0, abs=0.01)  # the first 120 s window's mean
    outs = [a for a in auto["actions"] if a["kind"] == "ScaleOut"]
    assert outs and all(a["at_s"] > 600 for a in outs)
    assert auto["samples"][-1][2] >= 3.0  # capacity at the end covers 3 req/s
    bill = sum(s[3] * 10.0 / 3600.0 for s in auto["samples"])
    assert auto["usd_total"] == pytest.approx(bill)
    assert main(["plan", "--model", "llama3-8b", "--workload", "in=1,out=1", "--slo", "ttft=5000,tpot=50",
                 "--autoscale"]) == 2
    assert "--autoscale needs a timed dataset" in capsys.readouterr().err


def test_plan_takes_a_dataset_or_a_synth_workload_by_its_means(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    small = tmp_path / "small.jsonl"  # fewer rows than any sample size: all of them are used
    rows = (json.dumps({"prompt": "word " * 40, "output_tokens": n}) for n in (100, 300))
    small.write_text("".join(row + "\n" for row in rows))
    out = tmp_path / "plan.json"
    cases = ((f"jsonl:{small}", (None, 200.0)), ("synth:in=702,out=42", (702.0, 42.0)))
    for workload, (r_in, r_out) in cases:
        assert main(["plan", "--model", "llama3-8b", "--workload", workload, "--slo", "ttft=5000,tpot=50",
                     "--goodput-rps", "5", "--json", str(out)]) == 0, capsys.readouterr().err
        doc = json.loads(out.read_text())
        assert doc["output_tokens"] == pytest.approx(r_out, rel=0.02)
        if r_in is not None:
            assert doc["input_tokens"] == pytest.approx(r_in, rel=0.02)
    capsys.readouterr()


def test_profile_combos_measures_a_table_plan_can_read(tmp_path: Path) -> None:
    from launcher.planning_cli import plan, profile_combos

    table_path = tmp_path / "goodput.json"
    assert profile_combos(["--model", "llama3-8b", "--workload", "synth:in=500,out=300", "--slo",
                           "ttft=500,tpot=20", "--combos", "1xh100,2xh100", "--requests", "100",
                           "--trial-s", "10", "--precision", "0.25", "--json", str(table_path)]) == 0
    table = json.loads(table_path.read_text())
    assert set(table) == {"1xh100", "2xh100"}
    assert 0 < table["1xh100"] < table["2xh100"]  # two replicas carry more than one
    plan_path = tmp_path / "plan.json"
    assert plan(["--model", "llama3-8b", "--workload", "in=500,out=300", "--slo", "ttft=500,tpot=20",
                 "--goodput-rps", str(table["1xh100"] * 1.5), "--gpus", "h100:4", "--goodput-table",
                 str(table_path), "--json", str(plan_path)]) == 0
    doc = json.loads(plan_path.read_text())
    assert doc["goodput_table"] == table
    assert {c["goodput_source"] for c in doc["combos"]} == {"table"}


def test_profile_combos_refuses_bad_input_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from launcher.planning_cli import profile_combos

    base = ["--model", "llama3-8b", "--workload", "synth:in=200,out=50", "--slo", "ttft=2000,tpot=100"]
    assert profile_combos([*base, "--gpus", "tpu9"]) == 2
    assert profile_combos([*base, "--combos", "h100"]) == 2
    assert profile_combos([*base, "--attainment", "1.5"]) == 2
    err = capsys.readouterr().err
    assert "unknown GPU 'tpu9'" in err and "bad combo id" in err and "--attainment" in err
    assert "Traceback" not in err


def test_plan_over_a_length_mix_is_recorded_and_read_back(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.planning.plan_file import parse_plan

    lengths = tmp_path / "mixed.jsonl"  # two very different request shapes
    rows = [{"prompt": "word " * 30, "output_tokens": 20}] * 3
    rows.append({"prompt": "word " * 1500, "output_tokens": 900})
    lengths.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "plan.json"
    args = ["plan", "--model", "llama3-8b", "--workload", f"jsonl:{lengths}", "--slo", "ttft=5000,tpot=50",
            "--goodput-rps", "20", "--gpus", "a800:8", "--json", str(out)]
    assert main([*args, "--length-mix"]) == 0, capsys.readouterr().err
    assert "length buckets" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert [b["share"] for b in doc["length_mix"]] == [0.75, 0.25]
    plan = parse_plan(doc)
    assert plan.length_mix is not None and plan.length_mix[1][0] == 0.25
    assert {c.goodput_source for c in plan.candidates()} == {"modelled-mix"}
    mixed = {c["combo"]: c["goodput_rps"] for c in doc["combos"]}
    assert main(args) == 0  # the same dataset by its means
    means = {c["combo"]: c["goodput_rps"] for c in json.loads(out.read_text())["combos"]}
    assert json.loads(out.read_text())["length_mix"] is None
    assert mixed != means  # the long bucket costs more than the means say
    assert main([*args[:4], "in=10,out=10", *args[5:], "--length-mix"]) == 2
    assert "--length-mix needs a dataset" in capsys.readouterr().err
