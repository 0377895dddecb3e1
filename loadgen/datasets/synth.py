"""Synthetic prompts of an exact token length, for traces that publish only token counts.

Owns: deterministic random token ids (``synthesize_prompt_token_ids``), text whose encoding is exactly n
tokens for a given tokenizer (``synthesize_prompt_text``), and filling those into token-count-only requests.
Must not: read files, choose which requests to load, or hold a tokenizer or generator in module state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from loadgen.datasets.mooncake import HASH_IDS, prompt_ids_of
from loadgen.datasets.request import Request, TokenizerLike

SeedLike = int | Sequence[int]

# Plain English words: each is usually one or two tokens for BPE vocabularies and exactly one for a whitespace
# word-level tokenizer. A tuple, so it is immutable module data, not state.
WORD_POOL: tuple[str, ...] = (
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on",
    "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "had", "they",
    "you", "were", "their", "one", "all", "we", "can", "her", "has", "there", "been", "if", "more", "when",
    "will", "would", "who", "so", "no", "time", "about", "system", "model", "data", "people", "water",
    "light", "river", "city", "music", "paper", "garden", "window", "number", "story", "question", "answer",
    "market", "energy", "road",
)
# Fillers tried, in order, to add exactly one token at the end of a text.
ONE_TOKEN_FILLERS: tuple[str, ...] = (" a", " the", " I", " of", ".", ",", " and", " to", "!", "?", " x", "a")
_MAX_GROW_ROUNDS = 64


def synthesize_prompt_token_ids(
    n: int, vocab_size: int, seed: SeedLike, exclude_ids: Sequence[int] = ()
) -> list[int]:
    """``n`` ids drawn uniformly from ``[0, vocab_size)`` minus ``exclude_ids`` (e.g. special tokens)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be > 0, got {vocab_size}")
    allowed = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), np.asarray(exclude_ids, dtype=np.int64))
    if allowed.size == 0:
        raise ValueError(f"exclude_ids remove every id of a vocabulary of {vocab_size}")
    rng = np.random.default_rng(seed)
    return [int(i) for i in rng.choice(allowed, size=n, replace=True)]


def synthesize_prompt_text(n: int, tokenizer: TokenizerLike, *, seed: SeedLike = 0) -> str:
    """Text of random words whose ``len(tokenizer.encode(text).ids)`` is exactly ``n``.

    Grows a word list until it reaches ``n`` tokens, searches for the longest word prefix that does not
    exceed ``n``, then tops up with one-token fillers, each verified by re-encoding. Raises ValueError when
    ``n`` is below the token count of the empty text (e.g. a BOS the tokenizer always adds) or cannot be hit
    exactly.
    """

    def count(text: str) -> int:
        return len(tokenizer.encode(text).ids)

    base = count("")
    if n < base:
        raise ValueError(f"cannot build a {n}-token text: the empty text already encodes to {base} tokens")
    if n == base:
        return ""
    rng = np.random.default_rng(seed)
    words: list[str] = []
    current = base
    for _ in range(_MAX_GROW_ROUNDS):
        words.extend(str(w) for w in rng.choice(WORD_POOL, size=max(n - current, 1)))
        current = count(" ".join(words))
        if current >= n:
            break
    else:
        raise ValueError(f"cannot build a {n}-token text: word tokens do not accumulate")
    if current == n:
        return " ".join(words)
    # Interpolation search for the longest prefix with at most n tokens: counts grow about linearly in words.
    # After two steps in a row that fail to halve the bracket the next one bisects, so it stays O(log words).
    lo, lo_count, hi, hi_count = 0, base, len(words), current  # lo_count <= n < hi_count
    stalls = 0
    while hi - lo > 1:
        width = hi - lo
        guess = (lo + hi) // 2 if stalls >= 2 else lo + (n - lo_count) * width // (hi_count - lo_count)
        mid = min(max(guess, lo + 1), hi - 1)
        mid_count = count(" ".join(words[:mid]))
        if mid_count <= n:
            lo, lo_count = mid, mid_count
        else:
            hi, hi_count = mid, mid_count
        stalls = stalls + 1 if (hi - lo) * 2 > width else 0
    return _top_up(words[:lo], n, count)


def _top_up(words: list[str], n: int, count: Callable[[str], int]) -> str:
    text = " ".join(words)
    current = count(text)
    while current < n:
        for filler in ONE_TOKEN_FILLERS:
            candidate = text + filler if text else filler.strip()
            if count(candidate) == current + 1:
                text, current = candidate, current + 1
                break
        else:
            if not words:
                raise ValueError(f"cannot build a {n}-token text with this tokenizer")
            words.pop()  # make more room and retry with fillers
            text = " ".join(words)
            current = count(text)
    if current != n:
        raise ValueError(f"cannot build a {n}-token text with this tokenizer (got {current})")
    return text


def fill_prompts(
    requests: Sequence[Request],
    *,
    seed: int,
    tokenizer: TokenizerLike | None = None,
    vocab_size: int | None = None,
    exclude_ids: Sequence[int] = (),
) -> list[Request]:
    """Give token-count-only requests (no prompt, no ids) a prompt of exactly ``prompt_tokens`` tokens.

    With a tokenizer the prompt is text (and a single user message); otherwise, with ``vocab_size``, it is
    token ids. Each request's randomness is seeded by ``(seed, position)``, so results do not depend on
    batching.
    """
    if tokenizer is None and vocab_size is None:
        return list(requests)
    out: list[Request] = []
    for index, req in enumerate(requests):
        if req.prompt is not None or req.prompt_token_ids is not None:
            out.append(req)
        elif HASH_IDS in req.metadata:  # a prefix trace: its blocks decide its tokens
            if vocab_size is None:
                raise ValueError(f"request {req.request_id}: a prefix-trace prompt (hash_ids) is replayed as "
                                 f"token ids, which needs the model's vocabulary size (e.g. --vocab-size)")
            hash_ids = req.metadata[HASH_IDS]
            assert isinstance(hash_ids, tuple)
            out.append(dataclasses.replace(req, prompt_token_ids=prompt_ids_of(hash_ids, req.prompt_tokens,
                                                                                vocab_size)))
        elif tokenizer is not None:
            text = synthesize_prompt_text(req.prompt_tokens, tokenizer, seed=(seed, index))
            out.append(dataclasses.replace(req, prompt=text, messages=(("user", text),)))
        else:
            assert vocab_size is not None
            ids = synthesize_prompt_token_ids(req.prompt_tokens, vocab_size, (seed, index), exclude_ids)
            out.append(dataclasses.replace(req, prompt_token_ids=tuple(ids)))
    return out


SYNTH_DEFAULT_SIGMA = 0.5
SYNTH_DEFAULT_COUNT = 10_000


def lognormal_requests(spec: str, *, seed: int) -> list[Request]:
    """``in=702,out=42[,sigma=0.5][,n=10000]``: token-count-only requests whose prompt and output lengths are
    seeded lognormals with those means (mu = ln(mean) - sigma^2 / 2) and log-std ``sigma``, rounded, at least
    1 token. For workload shapes known only by their means (CAUCHY's DailyMail 702/42, LongWriter)."""
    fields: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"synth:{spec}: expected KEY=VALUE pairs (in, out, sigma, n)")
        fields[key.strip()] = value.strip()
    unknown = set(fields) - {"in", "out", "sigma", "n"}
    if unknown or not {"in", "out"} <= set(fields):
        raise ValueError(f"synth:{spec}: give in=MEAN,out=MEAN (optional sigma=S, n=COUNT)")
    try:
        mean_in, mean_out = float(fields["in"]), float(fields["out"])
        sigma = float(fields.get("sigma", SYNTH_DEFAULT_SIGMA))
        count = int(fields.get("n", SYNTH_DEFAULT_COUNT))
    except ValueError:
        raise ValueError(f"synth:{spec}: in, out and sigma must be numbers, n a whole number") from None
    if not (mean_in >= 1 and mean_out >= 1 and sigma >= 0 and count >= 1):
        raise ValueError(f"synth:{spec}: need in >= 1, out >= 1, sigma >= 0, n >= 1")
    rng = np.random.default_rng([seed, 7])
    ins = rng.lognormal(np.log(mean_in) - sigma**2 / 2, sigma, count)
    outs = rng.lognormal(np.log(mean_out) - sigma**2 / 2, sigma, count)
    return [Request(request_id=f"synth-{i}", prompt_tokens=max(1, round(float(a))),
                    output_tokens=max(1, round(float(b))))
            for i, (a, b) in enumerate(zip(ins, outs, strict=True))]
