"""STAR's training data from a real vLLM-CPU engine: `predictor collect --backend vllm` on the tiny model.

The agent opens its shard writer only once vLLM has loaded the model (the hidden size is known then); this
ran with a hidden size of 0 and failed at start-up before. The tiny model's weights are random, so the rows
check plumbing and labels, not that the vectors predict anything.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from engine_agent.star.collect import CollectOptions, collect
from engine_agent.star.shards import load_shards

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore")]

INTERVAL = 4
LENGTHS = (9, 24, 17, 40)


@dataclass(frozen=True)
class Prompt:
    prompt_token_ids: tuple[int, ...]
    output_tokens: int
    prompt: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def test_collect_on_vllm_writes_labelled_rows_of_the_models_hidden_size(tiny_model_dir: Path,
                                                                      tmp_path: Path) -> None:
    requests = [Prompt(tuple(range(10 + i, 40 + i)), n) for i, n in enumerate(LENGTHS)]
    options = CollectOptions(out=tmp_path / "shards", backend="vllm", model_dir=str(tiny_model_dir),
                             hidden_state_interval=INTERVAL, start_timeout_s=300.0,
                             agent_args=("--enforce-eager", "--max-model-len", "256", "--block-size", "32"))
    report = asyncio.run(collect(requests, options))
    assert report.completed == len(LENGTHS) and not report.failed
    data = load_shards([options.out])
    rows = data.rows
    assert data.hidden_size == 128 and rows.vectors.shape[1] == 128 and np.isfinite(rows.vectors).all()
    assert len(set(rows.request_ids.tolist())) == len(LENGTHS)
    np.testing.assert_array_equal(rows.remaining_tokens, rows.output_tokens - rows.generated_tokens)
    assert sorted(set(rows.output_tokens.tolist())) == sorted(LENGTHS)
    assert (rows.generated_tokens > 0).all() and (rows.remaining_tokens >= 0).all()
