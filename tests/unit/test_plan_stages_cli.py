"""`switchyard plan-stages` (CascadeInfer's stage partition): request files, a fixture dataset, the JSON,
the injected clock, and one-line refusals."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from launcher.cli import main
from launcher.stages_cli import PROFILED_QOE_D, PROFILED_QOE_SOURCE, plan_stages_command

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "data"
REQUESTS = [{"input": 50, "output": 20}, {"input": 400, "output": 300}, {"input": 3000, "output": 900},
            {"input": 120, "output": 8}, {"input": 700, "output": 2000}, {"input": 60, "output": 60}]


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _check(doc: dict[str, Any], instances: int, max_len: int) -> None:
    stages = doc["stages"]
    assert isinstance(stages, list) and stages[0]["lo"] == 0 and stages[-1]["hi"] == max_len
    assert all(a["hi"] == b["lo"] for a, b in zip(stages, stages[1:], strict=False))
    assert sum(s["instances"] for s in stages) == instances
    assert isinstance(doc["quality"], float) and doc["quality"] > 0 and doc["plan_ms"] >= 0


def test_a_request_file_gives_stages_and_the_exact_quality(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, "requests.json", json.dumps(REQUESTS))
    argv = ["plan-stages", "--instances", "4", "--max-len", "8K", "--requests", str(path)]
    assert main([*argv, "--exact", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    _check(doc, 4, 8192)
    assert doc["requests"] == 6 and doc["max_len"] == 8192
    assert doc["qoe"] == {"d": list(PROFILED_QOE_D), "source": PROFILED_QOE_SOURCE}
    assert doc["exact_quality"] <= doc["quality"] * (1 + 1e-9) and doc["exact_ms"] >= 0
    assert sum(s["instances"] for s in doc["exact_stages"]) == 4
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "quality" in text and "cascadeinfer_profile" in text and "[0, " in text


def test_jsonl_a_qoe_file_and_the_injected_clock(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, "requests.jsonl", "".join(json.dumps(r) + "\n\n" for r in REQUESTS))
    qoe = _write(tmp_path, "qoe.json", json.dumps({"d": [0.01, 1e-4, 0, 0, 1e-7]}))

    def ticks() -> Iterator[float]:
        now = 0.0
        while True:
            yield now
            now += 0.004

    clock = ticks()
    argv = ["--instances", "3", "--max-len", "4096", "--requests", str(path), "--qoe", str(qoe), "--json"]
    assert plan_stages_command(argv, clock=lambda: next(clock)) == 0
    doc = json.loads(capsys.readouterr().out)
    _check(doc, 3, 4096)
    assert doc["plan_ms"] == pytest.approx(4.0)  # one tick of the clock passed in
    assert doc["qoe"] == {"d": [0.01, 1e-4, 0.0, 0.0, 1e-7], "source": str(qoe)}


def test_a_fixture_dataset(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan-stages", "--instances", "8", "--max-len", "128K", "--dataset", "sharegpt",
            "--data-dir", str(FIXTURES), "--json"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    _check(doc, 8, 131072)
    assert doc["requests"] == 30 and doc["source"] == "sharegpt"
    assert main([*argv[:-1], "--num-requests", "10", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] == 10


@pytest.mark.parametrize(
    ("content", "extra", "reason"),
    [
        ("[]", [], "no requests in"),
        ("", [], "no requests in"),
        ('{"input": 5}\n', [], "line 1 is not"),
        ('[{"input": 5, "output": 1.5}]', [], "item 1 is not"),
        ("[{", [], "Expecting"),
        (json.dumps(REQUESTS), ["--max-len", "2048"], "grows past max_len 2048"),
        (json.dumps(REQUESTS), ["--instances", "0"], "instances must be >= 1"),
        (json.dumps(REQUESTS), ["--model", "gpt5"], "unknown model 'gpt5'"),
        (json.dumps(REQUESTS), ["--bandwidth-gb-s", "0"], "bandwidth > 0"),
        (json.dumps(REQUESTS), ["--qoe", "QOE"], "QoE coefficients must be 5"),
    ],
)
def test_refusals_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str,
                               extra: list[str], reason: str) -> None:
    path = _write(tmp_path, "requests.json", content)
    qoe = _write(tmp_path, "qoe.json", json.dumps({"d": [1, 2, 3, 4]}))
    extra = [str(qoe) if e == "QOE" else e for e in extra]
    argv = ["plan-stages", "--instances", "2", "--max-len", "8192", "--requests", str(path), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert reason in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert err.startswith("switchyard plan-stages: error: ")


def test_a_missing_file_or_dataset_root(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan-stages", "--instances", "2", "--max-len", "8192",
                 "--requests", str(tmp_path / "none.json")]) == 2
    assert "No such file" in capsys.readouterr().err
    assert main(["plan-stages", "--instances", "2", "--max-len", "8192", "--dataset", "sharegpt",
                 "--data-dir", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "not a directory" in err and len(err.strip().splitlines()) == 1
