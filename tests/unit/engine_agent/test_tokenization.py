"""Tokenizer, chat template, incremental detokenizer and stop-string matcher."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from engine_agent import tokenizer_build
from engine_agent.tokenization import IncrementalDetokenizer, StopMatcher, Tokenizer, TokenizerLoadError

TEXTS = [
    "Hello, world!",
    "  leading spaces and trailing  ",
    "Ünïcödé: 日本語のテキスト, emoji 🎉🚀 and accents café",
    "code:\n\tdef f(x):\n\t\treturn x * 2\n\n",
    "",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.load_sim()


def test_identity_and_special_ids(tok: Tokenizer) -> None:
    assert tok.identity.startswith("sim_tokenizer@sha256:")
    assert len(tok.identity.split(":")[-1]) == 12
    assert tok.vocab_size == tokenizer_build.VOCAB_SIZE
    assert tok.bos_token_id == 0
    assert tok.eos_token_id == 2
    assert {0, 1, 2, 3, 4} <= tok.special_token_ids
    assert tok.has_chat_template


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_encode_with_special_tokens_adds_bos(tok: Tokenizer) -> None:
    plain = tok.encode("Hi there")
    assert tok.encode("Hi there", add_special_tokens=True) == [0, *plain]


def test_chat_template_renders_llama3_format(tok: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  Hi there \n"}]
    text = tok.render_chat(messages, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    without = tok.render_chat(messages, add_generation_prompt=False)
    assert without.endswith("Hi there<|eot_id|>")
    ids = tok.apply_chat_template(messages)
    assert ids[0] == tok.bos_token_id
    assert ids.count(3) == 3 and ids.count(4) == 3 and ids.count(tok.eos_token_id) == 2
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_chat_template_rejects_unknown_role_and_is_sandboxed(tok: Tokenizer, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown chat role"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}])
    # An HF dir with a hostile template cannot reach Python internals.
    src = tokenizer_build.SIM_TOKENIZER_DIR
    (tmp_path / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    config = json.loads((src / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    config["eos_token"] = {"content": "<|eot_id|>", "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    hostile = Tokenizer.load(tmp_path, name="hostile")
    assert hostile.identity == f"hostile@sha256:{tok.identity.split(':')[-1]}"
    with pytest.raises(ValueError, match="chat template rejected"):
        hostile.apply_chat_template([{"role": "user", "content": "x"}])


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError, match="tokenizer.json"):
        Tokenizer.load(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes(
        (tokenizer_build.SIM_TOKENIZER_DIR / "tokenizer.json").read_bytes()
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|not_a_token|>"}))
    with pytest.raises(TokenizerLoadError, match="not in the vocabulary"):
        Tokenizer.load(tmp_path)


def _stream(tok: Tokenizer, ids: list[int], chunk: int) -> list[str]:
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(detok.flush())
    return pieces


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_incremental_detok_never_splits_characters(tok: Tokenizer, chunk: int) -> None:
    text = "naïve café — 日本語 🎉 ok, Ωmega"
    ids = tok.encode(text)
    # The byte-level BPE splits some multi-byte characters across tokens; the stream must still be exact.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    pieces = _stream(tok, ids, chunk)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_incremental_detok_skips_special_tokens(tok: Tokenizer) -> None:
    ids = [tok.bos_token_id or 0, *tok.encode("Hello"), tok.eos_token_id]
    assert "".join(_stream(tok, ids, 1)) == "Hello"


def test_incremental_detok_flushes_unfinished_sequence(tok: Tokenizer) -> None:
    ids = tok.encode("🎉")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok)
    assert detok.add(ids[:1]) == ""
    assert detok.flush() == "\ufffd"


def _run_stop(stops: list[str], deltas: list[str]) -> tuple[list[str], str | None]:
    matcher = StopMatcher(stops)
    out = [matcher.feed(d) for d in deltas]
    out.append(matcher.flush())
    return out, matcher.matched


@pytest.mark.parametrize(
    ("stops", "deltas", "emitted", "matched"),
    [
        (["\n\n"], ["Hello", " world"], "Hello world", None),
        (["STOP"], ["abcSTOPdef"], "abc", "STOP"),
        (["STOP"], ["abcST", "OPdef"], "abc", "STOP"),
        (["STOP"], ["S", "T", "O", "P"], "", "STOP"),
        (["STOP"], ["abcST", "x"], "abcSTx", None),
        (["STOP"], ["abcSTO"], "abcSTO", None),  # unmatched tail released at the end
        (["abc", "b"], ["xabc"], "x", "abc"),  # earliest match wins
        (["bcd", "ab"], ["xab", "cd"], "x", "ab"),
        (["aab"], ["a", "a", "a", "b", "z"], "a", "aab"),  # overlapping partial prefixes
        (["", "end"], ["the end", " more"], "the ", "end"),  # empty stop ignored
        ([], ["free text"], "free text", None),
        (["\u00e9t\u00e9"], ["summer \u00e9", "t\u00e9!"], "summer ", "\u00e9t\u00e9"),
    ],
)
def test_stop_matcher(stops: list[str], deltas: list[str], emitted: str, matched: str | None) -> None:
    out, got = _run_stop(stops, deltas)
    assert "".join(out) == emitted
    assert got == matched


def test_stop_matcher_never_emits_then_retracts() -> None:
    matcher = StopMatcher(["<END>"])
    final = "value <EN<E"
    released = ""
    for ch in "value <EN<E<END> tail":
        released += matcher.feed(ch)
        # Whatever was released is final: always a prefix of the truncated output.
        assert final.startswith(released)
    assert released == final
    assert matcher.matched == "<END>"
    assert matcher.feed("more") == "" and matcher.flush() == ""


def test_stop_matcher_holds_only_possible_prefixes() -> None:
    matcher = StopMatcher(["xyz"])
    assert matcher.feed("abx") == "ab"
    assert matcher.feed("a") == "xa"
    assert matcher.flush() == ""


def test_builder_reproduces_committed_files(tmp_path: Path) -> None:
    corpus = tokenizer_build.CORPUS_PATH.read_text(encoding="utf-8")
    assert len(corpus.encode("utf-8")) < 300_000
    written = tokenizer_build.build(tmp_path, corpus)
    for path in written:
        committed = tokenizer_build.SIM_TOKENIZER_DIR / path.name
        assert path.read_bytes() == committed.read_bytes(), (
            f"{path.name} differs: rerun tokenizer_build --out"
        )


def test_incremental_detok_random_texts_and_groupings(tok: Tokenizer) -> None:
    """Any text, streamed in any grouping of its tokens, comes out whole and never mid-character."""
    rng = random.Random(11)
    alphabet = "abcxyz ,.\n—éïΩ日本語🎉🙂\t0123"
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40)))
        ids = tok.encode(text)
        detok = IncrementalDetokenizer(tok)
        pieces: list[str] = []
        k = 0
        while k < len(ids):
            step = rng.randrange(1, 5)
            pieces.append(detok.add(ids[k : k + step]))
            k += step
        pieces.append(detok.flush())
        assert "".join(pieces) == text
        assert all("\ufffd" not in p for p in pieces)
