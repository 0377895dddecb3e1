"""The Mooncake prefix traces on the committed fixtures: fields, arrivals, windows, and prompts whose
512-token blocks follow `hash_ids` exactly (equal ids, equal blocks; different ids, different blocks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from loadgen_testkit import FIXTURE_DATA

from loadgen.datasets import DatasetFormatError, load_dataset
from loadgen.datasets.mooncake import BLOCK_TOKENS, block_token_ids, load_mooncake, prompt_ids_of
from loadgen.simulate.fleet import PromptIds
from switchyard.prefix import block_keys


def rows(name: str) -> list[dict[str, object]]:
    path = FIXTURE_DATA / "mooncake" / f"{name}_trace.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


CASES = [("mooncake-conv", "conversation"), ("mooncake-synth", "synthetic")]


@pytest.mark.parametrize("dataset, file", CASES)
def test_every_row_becomes_a_timed_request_with_its_block_ids(dataset: str, file: str) -> None:
    reqs = load_dataset(dataset, FIXTURE_DATA)
    source = rows(file)
    assert len(reqs) == len(source) == 200
    for req, row in zip(reqs, source, strict=True):
        assert req.prompt_tokens == row["input_length"]
        assert req.output_tokens == max(int(row["output_length"]), 1)  # type: ignore[call-overload]
        assert req.arrival_s == (int(row["timestamp"]) - int(source[0]["timestamp"])) / 1000.0  # type: ignore[call-overload]
        assert req.metadata["hash_ids"] == tuple(row["hash_ids"])  # type: ignore[arg-type]
        assert req.prompt is None and req.prompt_token_ids is None  # built at dispatch
    window = load_dataset(dataset, FIXTURE_DATA, start_s=10.0, duration_s=5.0)
    assert window and all(10.0 <= r.arrival_s < 15.0 for r in window)  # type: ignore[operator]


def test_prompts_share_exactly_the_blocks_their_hash_ids_share() -> None:
    reqs = load_dataset("mooncake-conv", FIXTURE_DATA, num_requests=40)
    by_block: dict[int, tuple[int, ...]] = {}
    for req in reqs:
        hash_ids = req.metadata["hash_ids"]
        assert isinstance(hash_ids, tuple)
        ids = prompt_ids_of(hash_ids, req.prompt_tokens, 32000)
        assert len(ids) == req.prompt_tokens
        for i, h in enumerate(hash_ids):
            block = ids[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS]
            assert block == block_token_ids(h, 32000)[:len(block)]
            by_block.setdefault(h, block)
    blocks = [b for b in by_block.values() if len(b) == BLOCK_TOKENS]
    assert len(set(blocks)) == len(blocks)  # different ids, different tokens
    # The shared first block (id 0, the system prompt of every conversation) gives equal cache keys.
    first, second = (prompt_ids_of(r.metadata["hash_ids"], r.prompt_tokens, 32000)  # type: ignore[arg-type]
                     for r in reqs[:2])
    k1, k2 = block_keys(first, 16), block_keys(second, 16)
    assert k1[:32] == k2[:32] and k1[32] != k2[32]


def test_simulated_prompts_follow_the_trace_and_others_share_nothing() -> None:
    reqs = load_dataset("mooncake-synth", FIXTURE_DATA, num_requests=3)
    ids = PromptIds()
    assert ids.of(reqs[0]) == prompt_ids_of(reqs[0].metadata["hash_ids"], reqs[0].prompt_tokens,  # type: ignore[arg-type]
                                            32000)
    a, b = ids(100), ids(100)
    assert len(a) == len(b) == 100 and not set(block_keys(a, 16)) & set(block_keys(b, 16))


def test_live_replay_needs_a_vocabulary_and_builds_token_id_prompts() -> None:
    with pytest.raises(ValueError, match="vocabulary size"):
        load_dataset("mooncake-conv", FIXTURE_DATA, num_requests=2, tokenizer=_NoTokenizer())
    reqs = load_dataset("mooncake-conv", FIXTURE_DATA, num_requests=2, vocab_size=32000)
    assert [len(r.prompt_token_ids or ()) for r in reqs] == [r.prompt_tokens for r in reqs]


class _NoTokenizer:
    def encode(self, text: str, /) -> object:
        raise AssertionError("a prefix trace is never tokenized")


def test_malformed_rows_are_reported_with_their_line(tmp_path: Path) -> None:
    bad = tmp_path / "trace.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1]}\n')
    with pytest.raises(DatasetFormatError, match="line 1: 1 hash ids of 512 tokens do not cover"):
        load_mooncake(bad, name="x")
    bad.write_text('{"timestamp": 0, "input_length": 600}\n')
    with pytest.raises(DatasetFormatError, match="line 1: not a Mooncake record"):
        load_mooncake(bad, name="x")
