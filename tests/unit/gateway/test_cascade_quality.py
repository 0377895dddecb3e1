"""The MT-Bench quality profile (Cascadia footnote 3): the pinned figures, subsets and routing over items."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cascade.quality import (
    SYNTHETIC_MIDDLE,
    QualityProfileError,
    derive_mt_bench_profile,
    from_json,
    mt_bench_profile,
    prompt_tokens,
    to_json,
)

SHARED_DATA = Path(__file__).resolve().parents[4] / "shared" / "data"
PAIR = ("llama3-8b", "llama3-70b")


def test_pinned_figures_of_the_issue() -> None:
    profile = mt_bench_profile()
    assert len(profile.items) == 160
    assert round(profile.mean_score("llama3-8b"), 1) == 83.4
    assert round(profile.mean_score("llama3-70b"), 1) == 92.3
    routing = profile.route(PAIR, [90])
    assert routing.escalated_share == pytest.approx(0.275)
    assert round(routing.quality, 1) == 92.4
    assert routing.stage_share == (1.0, pytest.approx(0.275))


def test_stand_ins_are_labelled() -> None:
    sources = mt_bench_profile().sources
    assert sources["llama3-8b"] == "mistralai/Mixtral-8x7B-Instruct-v0.1"
    assert sources["llama3-70b"] == "gpt-4-1106-preview"
    assert sources[SYNTHETIC_MIDDLE].startswith("synthetic")


def test_thresholds_at_the_ends_send_everything_one_way() -> None:
    profile = mt_bench_profile()
    assert profile.route(PAIR, [0]).quality == pytest.approx(profile.mean_score("llama3-8b"))
    assert profile.route(PAIR, [101]).quality == pytest.approx(profile.mean_score("llama3-70b"))
    assert profile.route(PAIR, [101]).escalated_share == 1.0


def test_synthetic_middle_takes_one_real_judgement_per_item() -> None:
    profile = mt_bench_profile()
    weak, mid, strong = (profile.scores(m) for m in ("llama3-8b", SYNTHETIC_MIDDLE, "llama3-70b"))
    assert all(m in (w, s) for w, m, s in zip(weak, mid, strong, strict=True))
    assert (
        profile.mean_score("llama3-8b")
        < profile.mean_score(SYNTHETIC_MIDDLE)
        < profile.mean_score("llama3-70b")
    )
    three = profile.route(("llama3-8b", SYNTHETIC_MIDDLE, "llama3-70b"), [90, 90])
    assert three.stage_share[0] == 1.0 and three.stage_share[2] < three.stage_share[1] < 1.0
    assert sum(three.answer_share) == pytest.approx(1.0)


def test_subsets_and_contamination() -> None:
    profile = mt_bench_profile()
    assert len(profile.subset("mt-bench", drop_contaminated=True).items) == 144
    hard, easy = profile.subset("mt-bench-hard"), profile.subset("mt-bench-easy")
    assert len(hard.items) == len(easy.items) == 80
    assert {i.category for i in hard.items} == {"math", "coding", "reasoning", "extraction"}
    assert hard.mean_score("llama3-8b") < easy.mean_score("llama3-8b")
    with pytest.raises(QualityProfileError, match="unknown subset"):
        profile.subset("mt-bench-medium")


def test_lookup_by_question_text_and_unknown_model() -> None:
    profile = mt_bench_profile()
    item = profile.items[3]
    assert profile.index_of("  " + item.questions[-1].replace(" ", "  ") + "\n") == 3
    assert profile.index_of("not an MT-Bench question") is None
    with pytest.raises(QualityProfileError, match="no quality profile for model 'gpt-5'"):
        profile.scores("gpt-5")


def test_turn_two_prompt_carries_the_models_own_first_answer() -> None:
    profile = mt_bench_profile()
    first, second = profile.items[0], profile.items[1]
    assert (first.turn, second.turn, first.question_id) == (1, 2, second.question_id)
    weak = prompt_tokens(second, profile, "llama3-8b")
    strong = prompt_tokens(second, profile, "llama3-70b")
    assert weak - strong == (
        profile.scores("llama3-8b")[0].answer_tokens - profile.scores("llama3-70b")[0].answer_tokens
    )


def test_json_round_trip_and_a_broken_file() -> None:
    profile = mt_bench_profile()
    again = from_json(json.loads(json.dumps(to_json(profile))))
    assert again.route(PAIR, [80]) == profile.route(PAIR, [80])
    with pytest.raises(QualityProfileError, match="does not parse"):
        from_json({"models": ["a"], "items": [{"question_id": 1}]})


@pytest.mark.skipif(
    not (SHARED_DATA / "mt_bench").is_dir(), reason="needs ../shared/data (the full judgements)"
)
def test_the_shipped_asset_is_the_derivation_of_the_data() -> None:
    assert to_json(derive_mt_bench_profile(SHARED_DATA)) == to_json(mt_bench_profile())
