"""STAR Table 2's output lengths: the fitted distributions hit the table, draws are seeded, and
`--output-lengths` drives `loadgen simulate` on a fleet of STAR's model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine_agent.tokenization import Tokenizer
from loadgen.cli import build_parser, load_requests, main
from loadgen.datasets import OUTPUT_LENGTH_DISTRIBUTIONS, Request, with_output_lengths
from loadgen.datasets.star_lengths import (
    STAR_MAX_MODEL_LEN,
    STAR_SHAREGPT_OUTPUT,
    TABLE_2_OUTPUT,
    LengthDistribution,
    output_distribution,
)
from loadgen.results import read_results

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "data"
NAMES = sorted(OUTPUT_LENGTH_DISTRIBUTIONS)


@pytest.mark.parametrize("name", NAMES)
def test_quantile_function_passes_through_table_2(name: str) -> None:
    dist, table = OUTPUT_LENGTH_DISTRIBUTIONS[name], TABLE_2_OUTPUT[name]
    q50, q90, q95, q100 = dist.quantile([0.5, 0.9, 0.95, 1.0])
    assert (q50, q90, q95) == pytest.approx((table.p50, table.p90, table.p95), rel=1e-9)
    assert q100 <= STAR_MAX_MODEL_LEN
    mean, std = dist.moments()
    assert mean == pytest.approx(table.mean, rel=1e-3) and std == pytest.approx(table.std, rel=1e-3)
    assert dist.quantile(0.85) > 25_000  # "over 15% of requests generate over 25K tokens"


@pytest.mark.parametrize("name", NAMES)
def test_100k_draws_match_table_2_within_5_percent(name: str) -> None:
    table = TABLE_2_OUTPUT[name]
    drawn = OUTPUT_LENGTH_DISTRIBUTIONS[name].sample(np.random.default_rng(0), 100_000)
    assert drawn.dtype == np.int64 and drawn.min() >= 1
    got = {"p50": np.percentile(drawn, 50), "p90": np.percentile(drawn, 90), "p95": np.percentile(drawn, 95),
           "mean": drawn.mean(), "std": drawn.std()}
    for key, value in got.items():
        assert abs(value / getattr(table, key) - 1) < 0.05, (key, value, getattr(table, key))


def test_draws_are_seeded_and_fit_the_32k_context() -> None:
    requests = [Request(f"r{i}", prompt_tokens=prompt) for i, prompt in enumerate([10, 400, 32_000] * 200)]
    first = with_output_lengths(requests, "star-sharegpt", seed=3)
    assert first == with_output_lengths(requests, "star-sharegpt", seed=3)
    assert first != with_output_lengths(requests, "star-sharegpt", seed=4)
    assert first != with_output_lengths(requests, "star-alpaca", seed=3)
    assert [r.prompt_tokens for r in first] == [r.prompt_tokens for r in requests]
    outputs = [r.output_tokens for r in first]
    assert all(o is not None and 1 <= o <= STAR_MAX_MODEL_LEN - r.prompt_tokens
               for r, o in zip(requests, outputs, strict=True))
    assert max(o or 0 for o in outputs) > STAR_SHAREGPT_OUTPUT.p90 - 400  # some reach the cap


def test_bad_distributions_are_rejected() -> None:
    with pytest.raises(ValueError, match="star-sharegpt"):
        output_distribution("nope")
    with pytest.raises(ValueError, match="u=0 to u=1"):
        LengthDistribution("x", ((0.1, 5.0), (1.0, 10.0)))
    with pytest.raises(ValueError, match="non-decreasing"):
        LengthDistribution("x", ((0.0, 5.0), (1.0, 4.0)))


def test_flag_is_listed_and_checked(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("simulate", "compare"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "--output-lengths" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main(["simulate", "--output-lengths", "nope"])
    assert info.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_simulate_with_star_lengths_on_the_distill_fleet(tmp_path: Path) -> None:
    out = tmp_path / "star.json"
    argv = ["simulate", "--data-dir", str(FIXTURES), "--dataset", "sharegpt", "--num-requests", "12",
            "--rate", "2", "--seed", "1", "--output-lengths", "star-sharegpt", "--engines",
            "h800-deepseek-r1-distill-qwen-7b:2", "--policy", "least_loaded", "--no-plots",
            "--output", str(out)]
    assert main(argv) == 0
    results = read_results(out)
    assert results.summary["completed"] == 12 and results.config["output_lengths"] == "star-sharegpt"
    assert set(results.summary["per_engine"]) == {f"h800-deepseek-r1-distill-qwen-7b-{i}" for i in range(2)}
    # Every request generated exactly its drawn length.
    tokenizer = Tokenizer.load_sim()
    forced = {r.request_id: r.output_tokens
              for r in load_requests(build_parser().parse_args(argv), tokenizer, synthesize=False)}
    own = {r.request_id: r.output_tokens
           for r in load_requests(build_parser().parse_args(argv[:11]), tokenizer, synthesize=False)}
    assert {o.request_id: o.output_tokens for o in results.outcomes} == forced != own
