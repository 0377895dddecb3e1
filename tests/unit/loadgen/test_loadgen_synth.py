"""Exact-length prompt synthesis: random token ids and text whose encoding is exactly n tokens."""

from __future__ import annotations

import pytest
from loadgen_testkit import byte_level_bpe, with_bos, word_level_tokenizer

from loadgen.datasets import synthesize_prompt_text, synthesize_prompt_token_ids


def test_token_ids_are_seeded_in_range_and_exclude_ids() -> None:
    ids = synthesize_prompt_token_ids(500, 50, seed=3, exclude_ids=[0, 1, 2])
    assert len(ids) == 500
    assert ids == synthesize_prompt_token_ids(500, 50, seed=3, exclude_ids=[0, 1, 2])
    assert ids != synthesize_prompt_token_ids(500, 50, seed=4, exclude_ids=[0, 1, 2])
    assert all(3 <= i < 50 for i in ids)
    assert all(type(i) is int for i in ids)
    assert synthesize_prompt_token_ids(0, 50, seed=3) == []


def test_token_ids_reject_bad_arguments() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        synthesize_prompt_token_ids(3, 0, seed=0)
    with pytest.raises(ValueError, match="every id"):
        synthesize_prompt_token_ids(3, 2, seed=0, exclude_ids=[0, 1])
    with pytest.raises(ValueError, match="n must be"):
        synthesize_prompt_token_ids(-1, 5, seed=0)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 64, 513, 2048])
def test_text_has_exact_length_for_word_level(n: int) -> None:
    tok = word_level_tokenizer()
    text = synthesize_prompt_text(n, tok, seed=n)
    assert len(tok.encode(text).ids) == n


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 17, 100, 999, 3000])
def test_text_has_exact_length_for_trained_bpe(n: int) -> None:
    tok = byte_level_bpe()
    text = synthesize_prompt_text(n, tok, seed=(1, n))
    assert len(tok.encode(text).ids) == n


def test_text_is_deterministic_per_seed() -> None:
    tok = byte_level_bpe()
    assert synthesize_prompt_text(200, tok, seed=5) == synthesize_prompt_text(200, tok, seed=5)
    assert synthesize_prompt_text(200, tok, seed=5) != synthesize_prompt_text(200, tok, seed=6)


def test_text_counts_a_bos_the_tokenizer_adds() -> None:
    tok = with_bos(byte_level_bpe())
    assert synthesize_prompt_text(1, tok) == ""
    for n in (2, 3, 50):
        assert len(tok.encode(synthesize_prompt_text(n, tok, seed=n)).ids) == n
    with pytest.raises(ValueError, match="already encodes to 1"):
        synthesize_prompt_text(0, tok)


def test_synth_lognormal_workloads_have_the_asked_means_and_are_seeded() -> None:
    from loadgen.datasets.registry import load_dataset  # noqa: PLC0415

    requests = load_dataset("synth:in=702,out=42", None, num_requests=10_000, seed=3)
    mean_in = sum(r.prompt_tokens for r in requests) / len(requests)
    mean_out = sum(r.output_tokens or 0 for r in requests) / len(requests)
    assert abs(mean_in / 702 - 1) < 0.02 and abs(mean_out / 42 - 1) < 0.02
    assert min(r.prompt_tokens for r in requests) >= 1 and min(r.output_tokens or 0 for r in requests) >= 1
    again = load_dataset("synth:in=702,out=42", None, num_requests=10_000, seed=3)
    assert [r.prompt_tokens for r in again] == [r.prompt_tokens for r in requests]
    flat = load_dataset("synth:in=100,out=20,sigma=0,n=5", None, seed=0)
    assert {(r.prompt_tokens, r.output_tokens) for r in flat} == {(100, 20)} and len(flat) == 5
    for bad in ("synth:in=702", "synth:in=x,out=2", "synth:in=702,out=42,mu=1", "synth:in=0,out=1"):
        with pytest.raises(ValueError, match="synth:"):
            load_dataset(bad, None)
