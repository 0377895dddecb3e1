"""Every dataset loader on the committed fixtures: counts, fields, arrivals, shuffling, windows, synthesis."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
from loadgen_testkit import FIXTURE_DATA, word_level_tokenizer

from loadgen.datasets import DatasetFormatError, Request, estimate_tokens, load_dataset

SARATHI_CSV = FIXTURE_DATA / "sharegpt" / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"


def ids(requests: list[Request]) -> list[str]:
    return [r.request_id for r in requests]


def sarathi_decode_lengths() -> set[int]:
    with SARATHI_CSV.open() as f:
        return {int(row["num_decode_tokens"]) for row in csv.DictReader(f)}


def test_sharegpt_prompt_only_file_samples_output_lengths() -> None:
    reqs = load_dataset("sharegpt", FIXTURE_DATA, shuffle=False)
    records = json.loads((FIXTURE_DATA / "sharegpt" / "ShareGPT_V3_filtered_500.json").read_text())
    assert len(reqs) == 30
    assert ids(reqs) == [f"sharegpt-{i}" for i in range(30)]
    first = reqs[0]
    assert first.prompt == records[0]["conversations"][0]["value"]
    assert first.messages == (("user", first.prompt),)
    assert first.prompt_tokens == math.ceil(len(first.prompt.encode("utf-8")) / 4)
    assert first.prompt_tokens_estimated and first.arrival_s is None and first.prompt_token_ids is None
    assert first.metadata["source_id"] == records[0]["id"]
    assert {r.metadata["output_length_source"] for r in reqs} == {"sampled"}
    assert {r.output_tokens for r in reqs} <= sarathi_decode_lengths()
    assert [r.output_tokens for r in reqs] == [r.output_tokens for r in load_dataset("sharegpt", FIXTURE_DATA,
                                                                                   shuffle=False)]


def test_sharegpt_shuffle_is_deterministic_per_seed() -> None:
    a = load_dataset("sharegpt", FIXTURE_DATA, seed=1)
    assert ids(a) == ids(load_dataset("sharegpt", FIXTURE_DATA, seed=1))
    assert ids(a) != ids(load_dataset("sharegpt", FIXTURE_DATA, seed=2))
    assert sorted(ids(a)) == sorted(ids(load_dataset("sharegpt", FIXTURE_DATA, shuffle=False)))
    assert ids(load_dataset("sharegpt", FIXTURE_DATA, seed=1, num_requests=5)) == ids(a)[:5]


def test_sorted_sg90k_skips_non_human_first_and_is_shuffled() -> None:
    name = "sharegpt:sharegpt/sg_90k_part1_html_cleaned_lang_first_sampled_sorted.json"
    in_order = load_dataset(name, FIXTURE_DATA, shuffle=False)
    # fixture records 4 and 11 start with "gpt", record 7 with "system": no human turn, skipped
    assert ids(in_order) == [f"sharegpt-{i}" for i in (0, 1, 2, 3, 5, 6, 8, 9, 10)]
    lengths = [len(r.prompt or "") for r in in_order]
    assert lengths == sorted(lengths, reverse=True)
    shuffled = load_dataset(name, FIXTURE_DATA, seed=0)
    assert sorted(ids(shuffled)) == sorted(ids(in_order)) and ids(shuffled) != ids(in_order)


def test_sharegpt_with_reply_turns_uses_reply_length(tmp_path: Path) -> None:
    conv = [{"id": "a", "conversations": [{"from": "human", "value": "hello there, gateway"},
                                          {"from": "gpt", "value": "the quick brown fox"}]},
            {"id": "b", "conversations": [{"from": "system", "value": "be brief"},
                                          {"from": "human", "value": "the lazy dog"},
                                          {"from": "gpt", "value": "a"}]}]
    path = tmp_path / "conv.json"
    path.write_text(json.dumps(conv))
    reqs = load_dataset(f"sharegpt:{path}", None, shuffle=False)
    assert [(r.prompt, r.output_tokens) for r in reqs] == [("hello there, gateway", 5), ("the lazy dog", 1)]
    tok = word_level_tokenizer()
    exact = load_dataset(f"sharegpt:{path}", None, shuffle=False, tokenizer=tok)
    assert [(r.prompt_tokens, r.output_tokens, r.prompt_tokens_estimated) for r in exact] == [
        (4, 4, False), (3, 1, False)]


def test_sharegpt_without_replies_or_length_stats_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps([{"id": "a", "conversations": [{"from": "human", "value": "hi"}]}]))
    with pytest.raises(DatasetFormatError, match="no reply turn"):
        load_dataset(f"sharegpt:{path}", None)


def test_azure_conv_arrivals_are_relative_to_first_row_and_exact() -> None:
    reqs = load_dataset("azure-conv", FIXTURE_DATA)
    assert len(reqs) == 300
    first, second = reqs[0], reqs[1]
    assert (first.request_id, first.prompt_tokens, first.output_tokens) == ("azure-conv-0", 374, 44)
    assert first.arrival_s == 0.0
    # 18:15:50.9951690 - 18:15:46.6805900
    assert second.arrival_s == 43_145_790 / 10_000_000
    assert (second.prompt_tokens, second.output_tokens) == (396, 109)
    assert not first.prompt_tokens_estimated and first.prompt is None and first.prompt_token_ids is None
    arrivals = [r.arrival_s for r in reqs]
    assert arrivals == sorted(arrivals)  # timed traces keep trace order, never shuffled
    assert ids(load_dataset("azure-conv", FIXTURE_DATA, seed=9)) == ids(reqs)


def test_azure_window_and_truncation() -> None:
    full = load_dataset("azure-conv", FIXTURE_DATA)
    window = load_dataset("azure-conv", FIXTURE_DATA, start_s=10.0, duration_s=20.0)
    expected = [r for r in full if r.arrival_s is not None and 10.0 <= r.arrival_s < 30.0]
    assert ids(window) == ids(expected) and len(window) > 5
    assert [r.arrival_s for r in window] == [r.arrival_s for r in expected]  # not re-based to the window
    first_five = load_dataset("azure-conv", FIXTURE_DATA, start_s=10.0, duration_s=20.0, num_requests=5)
    assert ids(first_five) == ids(expected[:5])
    tail = load_dataset("azure-conv", FIXTURE_DATA, start_s=10.0)
    assert ids(tail) == [r.request_id for r in full if r.arrival_s is not None and r.arrival_s >= 10.0]


def test_azure_code() -> None:
    reqs = load_dataset("azure-code", FIXTURE_DATA)
    assert len(reqs) == 300
    assert (reqs[0].prompt_tokens, reqs[0].output_tokens, reqs[0].arrival_s) == (4808, 10, 0.0)
    assert reqs[1].arrival_s == 520_000 / 10_000_000  # 18:17:04.0319600 - 18:17:03.9799600


@pytest.mark.parametrize(("name", "first"), [("sarathi-sharegpt", (74, 918)), ("arxiv", (3772, 54))])
def test_length_statistics(name: str, first: tuple[int, int]) -> None:
    reqs = load_dataset(name, FIXTURE_DATA, shuffle=False)
    assert len(reqs) == 200
    assert (reqs[0].prompt_tokens, reqs[0].output_tokens) == first
    assert all(r.arrival_s is None and not r.prompt_tokens_estimated for r in reqs)
    assert ids(load_dataset(name, FIXTURE_DATA, seed=3)) == ids(load_dataset(name, FIXTURE_DATA, seed=3))


def test_window_on_untimed_dataset_is_rejected() -> None:
    with pytest.raises(ValueError, match="no timestamps"):
        load_dataset("arxiv", FIXTURE_DATA, start_s=5.0)
    with pytest.raises(ValueError, match="no timestamps"):
        load_dataset("sharegpt", FIXTURE_DATA, duration_s=5.0)


def test_mt_bench_and_spec_bench_first_turn() -> None:
    mt = load_dataset("mt-bench", FIXTURE_DATA, shuffle=False)
    line = json.loads((FIXTURE_DATA / "mt_bench" / "fastchat" / "question.jsonl").read_text().splitlines()[0])
    assert len(mt) == 10 and ids(mt)[:2] == ["mt-bench-81", "mt-bench-82"]
    assert mt[0].prompt == line["turns"][0] and mt[0].output_tokens is None
    assert (mt[0].metadata["category"], mt[0].metadata["num_turns"]) == ("writing", 2)
    spec = load_dataset("spec-bench", FIXTURE_DATA)
    assert len(spec) == 20
    assert {r.metadata["category"] for r in spec} >= {"translation", "summarization", "qa", "math_reasoning",
                                                       "rag", "writing"}
    assert all(r.prompt_tokens == estimate_tokens(r.prompt or "") for r in spec)


def test_alpaca_prompt_joins_instruction_and_input() -> None:
    reqs = load_dataset("alpaca", FIXTURE_DATA, shuffle=False)
    assert len(reqs) == 6
    assert reqs[0].prompt == "Name three primary colours."
    assert reqs[1].prompt == "Translate the sentence into French.\n\nThe train leaves at noon."
    assert reqs[0].output_tokens == 6  # ceil(len("Red, blue and yellow.") / 4)


def test_custom_jsonl_untimed_and_timed(tmp_path: Path) -> None:
    plain = tmp_path / "plain.jsonl"
    plain.write_text('{"prompt": "the dog", "output_tokens": 12}\n\n{"prompt": "a fox", "extra": 1}\n')
    reqs = load_dataset(f"jsonl:{plain}", None, shuffle=False)
    assert [(r.request_id, r.prompt, r.output_tokens, r.arrival_s) for r in reqs] == [
        ("jsonl-0", "the dog", 12, None), ("jsonl-1", "a fox", None, None)]
    assert reqs[1].metadata["extra"] == 1
    timed = tmp_path / "timed.jsonl"
    timed.write_text("\n".join(json.dumps(o) for o in [
        {"prompt": "b", "output_tokens": 2, "timestamp": 102.5, "session_id": "s1"},
        {"prompt": "a", "output_tokens": 1, "timestamp": 100.0},
        {"prompt": "c", "output_tokens": 3, "timestamp": 110.0}]))
    reqs = load_dataset(f"jsonl:{timed}", None)
    assert [(r.prompt, r.arrival_s) for r in reqs] == [("a", 0.0), ("b", 2.5), ("c", 10.0)]
    assert reqs[1].session_id == "s1"
    assert [r.prompt for r in load_dataset(f"jsonl:{timed}", None, start_s=1.0, duration_s=9.0)] == ["b"]


def test_custom_jsonl_rejects_bad_lines(tmp_path: Path) -> None:
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text('{"prompt": "a", "timestamp": 1}\n{"prompt": "b"}\n')
    with pytest.raises(DatasetFormatError, match="every line or no line"):
        load_dataset(f"jsonl:{mixed}", None)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": 3}\n')
    with pytest.raises(DatasetFormatError, match="bad.jsonl:1"):
        load_dataset(f"jsonl:{bad}", None)


def test_token_count_traces_get_exact_synthetic_prompts() -> None:
    with_ids = load_dataset("azure-code", FIXTURE_DATA, num_requests=4, vocab_size=1000, exclude_ids=[0, 1])
    assert [len(r.prompt_token_ids or ()) for r in with_ids] == [r.prompt_tokens for r in with_ids]
    assert all(min(r.prompt_token_ids or (2,)) >= 2 for r in with_ids)
    again = load_dataset("azure-code", FIXTURE_DATA, num_requests=4, vocab_size=1000, exclude_ids=[0, 1])
    assert [r.prompt_token_ids for r in with_ids] == [r.prompt_token_ids for r in again]
    tok = word_level_tokenizer()
    with_text = load_dataset("azure-conv", FIXTURE_DATA, num_requests=3, tokenizer=tok)
    assert [len(tok.encode(r.prompt or "").ids) for r in with_text] == [374, 396, 879]
    assert [r.prompt_tokens for r in with_text] == [374, 396, 879]


def test_text_dataset_with_tokenizer_counts_exactly() -> None:
    tok = word_level_tokenizer()
    reqs = load_dataset("mt-bench", FIXTURE_DATA, tokenizer=tok)
    assert all(r.prompt_tokens == len(tok.encode(r.prompt or "").ids) and not r.prompt_tokens_estimated
               for r in reqs)


def test_errors_for_unknown_names_missing_files_and_too_many_requests(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown dataset 'nope'.*azure-conv"):
        load_dataset("nope", FIXTURE_DATA)
    with pytest.raises(FileNotFoundError, match="arxiv"):
        load_dataset("arxiv", tmp_path)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_dataset("jsonl:missing.jsonl", tmp_path)
    with pytest.raises(ValueError, match="fewer than num_requests=11"):
        load_dataset("mt-bench", FIXTURE_DATA, num_requests=11)
