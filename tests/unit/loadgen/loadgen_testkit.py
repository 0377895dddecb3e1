"""Shared helpers for the loadgen unit tests: the fixture data root and tiny tokenizers built in-process."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import pytest
from aiohttp import web
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from gateway.domain import ClusterSnapshot, EngineId, RequestFeatures
from gateway.policies.base import Policy
from loadgen.simulate import runner as runner_module

FIXTURE_DATA = Path(__file__).resolve().parents[2] / "fixtures" / "data"

CORPUS = [
    "the quick brown fox jumps over the lazy dog.",
    "a gateway routes each request to an engine and streams the tokens back!",
    "time to first token, time per output token and end to end latency are measured in milliseconds?",
    "people answer the question about the river, the city, the garden and the market, and of the music.",
]


def word_level_tokenizer() -> Tokenizer:
    """Whitespace/punctuation pre-tokenizer + word vocabulary: every word or punctuation run is one token."""
    words = sorted({w for line in CORPUS for w in line.replace(".", " . ").replace(",", " , ").split()})
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def byte_level_bpe(vocab_size: int = 300) -> Tokenizer:
    """A byte-level BPE trained on CORPUS (merges make token counts differ from word counts)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    return tok


def with_bos(tok: Tokenizer) -> Tokenizer:
    """``tok`` with a BOS token added to every encoding, as Llama-style tokenizers do."""
    tok.add_special_tokens(["<s>"])
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos_id)])
    return tok


class Recording:
    """The real policy, keeping what it was shown (one per policy instance the simulator makes, in order)."""

    def __init__(self, inner: Policy) -> None:
        self.inner = inner
        self.NAME = inner.NAME
        self.seen: list[tuple[RequestFeatures, ClusterSnapshot]] = []

    def pick(self, features: RequestFeatures, snapshot: ClusterSnapshot) -> EngineId | None:
        self.seen.append((features, snapshot))
        return self.inner.pick(features, snapshot)


def record_policies(monkeypatch: pytest.MonkeyPatch) -> list[Recording]:
    """Make the simulator's policies `Recording`s; the list fills as it makes them."""
    made: list[Recording] = []
    real = runner_module.make_policy

    def make(name: str, params: Mapping[str, object] | None = None) -> Policy:
        made.append(Recording(real(name, params)))
        return made[-1]  # type: ignore[return-value]

    monkeypatch.setattr(runner_module, "make_policy", make)
    return made


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """`app` on a free local port for the block: its base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()
