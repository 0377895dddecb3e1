"""Mooncake prefix traces (`mooncake-conv`, `mooncake-synth`): requests whose prompts share 512-token blocks.

Owns: parsing the traces' JSONL (`timestamp` ms, `input_length`, `output_length`, `hash_ids`) into `Request`
records with the block ids kept as `metadata["hash_ids"]`, and turning block ids into prompt token ids
(`prompt_ids_of`): equal ids give equal token blocks, different ids different ones, so an engine's prefix
cache sees exactly the trace's sharing.
Must not: shuffle or window (the registry does), truncate unless asked (`fit_context`, for a fleet whose
context is shorter than the trace's prompts), or hold state beyond a small cache of the filler.

A block's tokens: two head tokens that encode its id (unique for ids below (V - first)^2, V the vocabulary)
and a filler shared by every block, `first` + a fixed pseudo-random sequence. The filler being shared is
harmless: cache keys chain every block to all blocks before it. Prompts are built at dispatch, not at load:
12,031 conversation prompts average 12,035 tokens (1.2 GB as Python tuples).
"""

from __future__ import annotations

import functools
import itertools
import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from loadgen.datasets.request import Request
from loadgen.datasets.text import DatasetFormatError

BLOCK_TOKENS = 512  # the traces' block size
FIRST_ID = 4  # ids below this are left to special tokens (BOS, EOS, pad, unk in Llama-style vocabularies)
HASH_IDS = "hash_ids"


def load_mooncake(path: Path, *, name: str) -> list[Request]:
    """Every row of a Mooncake trace, in file order; arrival times relative to the first row."""
    requests: list[Request] = []
    first_ms: float | None = None
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise DatasetFormatError(f"{path}: not UTF-8: {exc}") from exc
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            ts, n_in, n_out = float(row["timestamp"]), int(row["input_length"]), int(row["output_length"])
            hash_ids = tuple(int(h) for h in row[HASH_IDS])
        except (ValueError, KeyError, TypeError) as exc:
            raise DatasetFormatError(f"{path}: line {number}: not a Mooncake record ({exc})") from exc
        if n_in <= 0 or n_out < 0 or any(h < 0 for h in hash_ids):
            raise DatasetFormatError(f"{path}: line {number}: lengths and hash ids must be non-negative "
                                     f"(input_length {n_in} > 0)")
        if not (BLOCK_TOKENS * (len(hash_ids) - 1) < n_in <= BLOCK_TOKENS * len(hash_ids)):
            raise DatasetFormatError(f"{path}: line {number}: {len(hash_ids)} hash ids of {BLOCK_TOKENS} "
                                     f"tokens do not cover input_length {n_in}")
        if first_ms is None:
            first_ms = ts
        requests.append(Request(
            request_id=f"{name}-{number - 1}", prompt_tokens=n_in, output_tokens=max(n_out, 1),
            arrival_s=(ts - first_ms) / 1000.0, metadata={HASH_IDS: hash_ids}))
    return requests


def fit_context(requests: list[Request], max_context_tokens: int) -> tuple[list[Request], int]:
    """Requests cut to fit a `max_context_tokens` context: a prompt whose prompt + output tokens exceed it
    keeps its first whole blocks that fit with its output (at least one block; the output is then cut to
    what is left). The prefix structure is kept: shared blocks lead a prompt, and a cut keeps the lead.
    Returns the requests and how many were cut; requests without `hash_ids` are left as they are."""
    out: list[Request] = []
    cut = 0
    for r in requests:
        hash_ids = r.metadata.get(HASH_IDS) if r.metadata else None
        output = r.output_tokens or 0
        if not hash_ids or r.prompt_tokens + output <= max_context_tokens:
            out.append(r)
            continue
        blocks = max(1, (max_context_tokens - output) // BLOCK_TOKENS)
        prompt = min(r.prompt_tokens, blocks * BLOCK_TOKENS)
        output = max(1, min(output, max_context_tokens - prompt))
        out.append(replace(r, prompt_tokens=prompt, output_tokens=output,
                           metadata={**r.metadata, HASH_IDS: tuple(hash_ids)[:blocks]}))
        cut += 1
    return out, cut


@functools.lru_cache(maxsize=8)
def _filler(vocab_size: int) -> tuple[int, ...]:
    span = vocab_size - FIRST_ID
    rng = np.random.default_rng([0x6D6F6F6E, vocab_size])
    return tuple(int(t) for t in FIRST_ID + rng.integers(0, span, BLOCK_TOKENS - 2))


def check_vocab(max_hash_id: int, vocab_size: int) -> None:
    """ValueError unless a vocabulary of `vocab_size` ids encodes every block id up to `max_hash_id`."""
    span = vocab_size - FIRST_ID
    if span <= 1:
        raise ValueError(f"vocab_size {vocab_size} leaves no ids above the {FIRST_ID} reserved ones")
    if max_hash_id >= span * span:
        raise ValueError(f"hash id {max_hash_id} needs a vocabulary above "
                         f"{FIRST_ID + int(max_hash_id ** 0.5) + 1}, got vocab_size {vocab_size}")


def block_token_ids(hash_id: int, vocab_size: int) -> tuple[int, ...]:
    """The 512 token ids of block `hash_id` (see the module docstring)."""
    check_vocab(hash_id, vocab_size)
    span = vocab_size - FIRST_ID
    return (FIRST_ID + hash_id // span, FIRST_ID + hash_id % span) + _filler(vocab_size)


def prompt_ids_of(hash_ids: tuple[int, ...], length: int, vocab_size: int) -> tuple[int, ...]:
    """A prompt of `length` tokens whose 512-token blocks follow `hash_ids` (the last one cut short)."""
    if not (BLOCK_TOKENS * (len(hash_ids) - 1) < length <= BLOCK_TOKENS * len(hash_ids)):
        raise ValueError(f"{len(hash_ids)} blocks of {BLOCK_TOKENS} tokens do not make {length} tokens")
    ids = tuple(itertools.chain.from_iterable(block_token_ids(h, vocab_size) for h in hash_ids))
    return ids if len(ids) == length else ids[:length]
