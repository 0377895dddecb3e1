"""`python -m loadgen`: flag parsing, one-line operator errors, simulate and compare on the fixtures."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from loadgen.cli import build_parser, main
from loadgen.results import read_results

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "data"
REPO = Path(__file__).resolve().parents[3]
SMALL = ["--data-dir", str(FIXTURES), "--dataset", "azure-conv", "--num-requests", "30", "--rate", "4",
         "--engines", "h100-llama3-8b:2"]


def closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse errors
        code = int(exc.code or 0)
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "error:" in err, err
    return err


def test_shared_flags_parse_on_every_command() -> None:
    parser = build_parser()
    shared = ["--dataset", "mt-bench", "--rate", "2.5", "--burstiness", "0.5", "--max-concurrency", "8",
              "--num-requests", "12", "--seed", "7", "--slo", "ttft=500,tpot=50", "--output", "o.json",
              "--no-plots", "--model", "m"]
    for command in (["run", "--target", "http://x"], ["simulate"], ["compare"]):
        args = parser.parse_args([*command, *shared])
        assert (args.dataset, args.rate, args.burstiness, args.max_concurrency) == ("mt-bench", 2.5, 0.5, 8)
        assert (args.num_requests, args.seed, args.output, args.no_plots, args.model) == (12, 7, "o.json",
                                                                                          True, "m")
    args = parser.parse_args(["simulate", "--policy", "least_loaded", "--policy-param", "a=1",
                              "--state-interval-ms", "20"])
    assert (args.policy, args.policy_param, args.state_interval_ms) == ("least_loaded", ["a=1"], 20.0)
    args = parser.parse_args(["compare", "--policies", "round_robin,least_loaded", "--rates", "2,4",
                              "--engines-list", "h100-llama3-8b:2;a6000-llama3-8b:2"])
    assert args.rates == "2,4" and args.engines_list.count(";") == 1


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["simulate", "--rate", "-1"], "--rate"),
        (["simulate", "--bogus"], "unrecognized"),
        (["run"], "--target"),
        (["simulate", "--dataset", "nope", "--data-dir", str(FIXTURES)], "unknown dataset"),
        (["simulate", "--data-dir", "/no/such/dir"], "not a directory"),
        (["simulate", "--data-dir", str(FIXTURES), "--timestamps", "--rate", "3"], "--timestamps"),
        (["simulate", "--data-dir", str(FIXTURES), "--start", "5"], "--timestamps"),
        (["simulate", "--data-dir", str(FIXTURES), "--slo", "ttft=abc"], "SLO"),
        (["simulate", "--data-dir", str(FIXTURES), "--policy", "nope"], "unknown policy"),
        (["simulate", "--data-dir", str(FIXTURES), "--policy-param", "novalue"], "KEY=VALUE"),
        (["simulate", "--data-dir", str(FIXTURES), "--engines", "nope:2"], "nope"),
        (["simulate", "--data-dir", str(FIXTURES), "--max-concurrency", "0"], "--max-concurrency"),
        (["simulate", "--data-dir", str(FIXTURES), "--model", "other"], "--model"),
        (["compare", "--data-dir", str(FIXTURES), "--rates", "2,x"], "--rates"),
        (["compare", *SMALL, "--timestamps", "--rate", "inf", "--rates", "2"], "--rates"),
    ],
)
def test_bad_flags_give_one_line_errors(capsys: pytest.CaptureFixture[str], argv: list[str],
                                        needle: str) -> None:
    assert needle in one_line_error(capsys, argv)


def test_missing_data_dir_from_environment(capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SWITCHYARD_DATA_DIR", str(tmp_path / "absent"))
    assert "SWITCHYARD_DATA_DIR" in one_line_error(capsys, ["simulate"])


def test_unreachable_target(capsys: pytest.CaptureFixture[str]) -> None:
    err = one_line_error(capsys, ["run", "--target", f"http://127.0.0.1:{closed_port()}", *SMALL[:6]])
    assert "cannot reach" in err


def test_simulate_writes_results_and_plots(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "sim" / "run.json"
    code = main(["simulate", *SMALL, "--policy", "least_loaded", "--slo", "ttft=500,tpot=50",
                 "--output", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "Successful requests:" in printed and "simulated s per wall s" in printed
    results = read_results(out)
    assert results.summary["completed"] == 30 and len(results.outcomes) == 30
    assert results.summary["slo_attainment"] is not None
    assert set(results.summary["per_engine"]) == {"h100-llama3-8b-0", "h100-llama3-8b-1"}
    assert results.summary["sim_wall_s"] > 0 and results.summary["simulated_s_per_wall_s"] > 0
    assert results.summary["timeline"] and results.config["policy"] == "least_loaded"
    assert results.config["arrivals"]["rate_per_s"] == 4.0
    for name in ("run_latency_cdf.png", "run_timeline.png"):
        assert (out.parent / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_is_deterministic_and_no_plots_skips_matplotlib(tmp_path: Path) -> None:
    script = ("import sys; from loadgen.cli import main; "
              f"code = main({['simulate', *SMALL, '--no-plots', '--output', str(tmp_path / 'a.json')]!r}); "
              "print('MPL', 'matplotlib' in sys.modules); sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "MPL False" in done.stdout
    assert list(tmp_path.glob("*.png")) == []
    assert main(["simulate", *SMALL, "--no-plots", "--output", str(tmp_path / "b.json")]) == 0
    first, second = read_results(tmp_path / "a.json"), read_results(tmp_path / "b.json")
    assert first.outcomes == second.outcomes


def test_compare_policies_over_rates(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "cmp.json"
    code = main(["compare", *SMALL, "--policies", "round_robin,least_loaded", "--rates", "2,8",
                 "--slo", "ttft=200", "--output", str(out)])
    assert code == 0
    table = capsys.readouterr().out
    assert "TTFT p50" in table and "goodput" in table and "least_loaded" in table
    doc = json.loads(out.read_text())
    assert doc["schema"] == "switchyard.loadgen.compare/1"
    runs = doc["runs"]
    assert [(r["label"], r["rate"]) for r in runs] == [("round_robin", 2.0), ("least_loaded", 2.0),
                                                       ("round_robin", 8.0), ("least_loaded", 8.0)]
    assert all(r["summary"]["completed"] == 30 for r in runs)
    assert (tmp_path / "cmp_compare.png").read_bytes()[:4] == b"\x89PNG"


def test_compare_engine_mixes(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "mix.json"
    code = main(["compare", *SMALL, "--engines-list", "h100-llama3-8b:1;h100-llama3-8b:2", "--no-plots",
                 "--output", str(out)])
    assert code == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["label"] for r in runs] == ["h100-llama3-8b:1", "h100-llama3-8b:2"]
    assert len(runs[1]["per_engine"]) == 2
    assert not list(tmp_path.glob("*.png"))
