"""Results JSON: summary + config + outcomes, numpy and non-finite values converted, read back intact."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from loadgen.arrivals import ArrivalSpec
from loadgen.metrics import Outcome, parse_slo, summarize
from loadgen.results import RESULTS_SCHEMA, read_results, to_jsonable, write_results


def run_outcomes() -> list[Outcome]:
    return [
        Outcome("a", True, prompt_tokens=3, output_tokens=3, arrival_s=0.0, start_s=0.001, ttft_s=0.05,
                itl_s=(0.01, 0.02), e2e_s=0.08, engine_id="gpu-0"),
        Outcome("b", False, prompt_tokens=7, arrival_s=0.5, start_s=0.5, error="HTTP 503"),
    ]


def test_round_trip(tmp_path: Path) -> None:
    outs = run_outcomes()
    summary = summarize(outs, duration_s=1.0, slo=parse_slo("ttft=100"))
    config = {"dataset": "sharegpt", "arrivals": ArrivalSpec(max_concurrency=4), "num_prompts": np.int64(2),
              "weights": np.array([0.5, 1.5]), "scale": np.float32(0.25), "out": tmp_path / "r.json",
              "flags": (True, np.bool_(False))}
    path = write_results(tmp_path / "nested" / "r.json", summary, config, outs)
    assert path.is_file() and not list(path.parent.glob("*.tmp"))
    back = read_results(path)
    assert back.outcomes == tuple(outs)
    assert back.summary == summary.to_dict()
    assert back.config["arrivals"]["rate_per_s"] == "inf"
    assert back.config["arrivals"]["max_concurrency"] == 4
    assert ArrivalSpec(**back.config["arrivals"]) == ArrivalSpec(max_concurrency=4)
    assert (back.config["num_prompts"], back.config["weights"], back.config["scale"]) == (2, [0.5, 1.5], 0.25)
    assert back.config["out"] == str(tmp_path / "r.json") and back.config["flags"] == [True, False]
    raw = json.loads(path.read_text())
    assert raw["schema"] == RESULTS_SCHEMA and set(raw) == {"schema", "summary", "config", "outcomes"}


def test_to_jsonable_handles_non_finite_and_rejects_unknown() -> None:
    assert to_jsonable([float("inf"), -np.inf, float("nan")]) == ["inf", "-inf", "nan"]
    assert to_jsonable({1: {2}}) == {"1": [2]}
    with pytest.raises(TypeError, match="object"):
        to_jsonable(object())


def test_read_rejects_other_documents(tmp_path: Path) -> None:
    other = tmp_path / "vllm.json"
    other.write_text('{"completed": 3}')
    with pytest.raises(ValueError, match="not a loadgen results file"):
        read_results(other)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": RESULTS_SCHEMA, "outcomes": [{"request_id": "a", "success": False,
                                                                       "colour": "red"}]}))
    with pytest.raises(ValueError, match="unknown field"):
        read_results(bad)
