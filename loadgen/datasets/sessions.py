"""Multi-turn chat sessions (`sessions`): one shared system prompt, then a history that grows turn by turn.

Owns: `SessionSpec` (the generator's validated parameters), `TurnLengths` (where user-turn and answer lengths
come from: ShareGPT files under the data root when present, else fitted lognormals) and `session_requests`,
which turns both into timed `Request`s whose prompts are Mooncake-style 512-token blocks
(`metadata["hash_ids"]`), so the simulator (`loadgen.simulate.fleet.PromptIds`) and live replay
(`loadgen.live.request_body`) build the same token ids from them (`loadgen.datasets.mooncake.prompt_ids_of`).
Must not: resolve the data root, send requests or sleep (a turn that waits for the previous response is
`loadgen.live`'s business: `AFTER_REQUEST_ID`, `THINK_TIME_S`), or build token ids at load.

The prompt of turn k of a session is: the system prompt (`system_prompt_tokens`, the same blocks in every
session), then the session's history (user turn i and answer i for every i < k), then user turn k. A session
is one stream of blocks of its own after the system blocks, and every turn's prompt is a prefix of that
stream, so turn k + 1's prompt starts with turn k's prompt, token for token. The answers in the history are
the planned ones (turn i's forced output length of the session's own tokens), not what a live model answered:
a live engine's cache reuses the previous prompt, never the previous answer, as in the simulator. Because
blocks are 512 tokens, the system prompt must be a whole number of blocks (2,048 tokens by default): a block
shared by every session must hold nothing but the system prompt.

Lengths: user turns are the sizes of ShareGPT V3's first human turns (`ShareGPT_V3_filtered_{999,500}.json`,
ceil(utf-8 bytes / 4) tokens) and answers Sarathi-Serve's ShareGPT decode lengths
(`sharegpt_8k_filtered_stats_llama2_tokenizer.csv`), each drawn with replacement; a file that is absent is
replaced by a lognormal fitted to its log-moments (user turns: median 62 tokens, log-std 1.46; answers: median
320, log-std 1.0). Every length is cut to [1, 1,024] tokens.

Arrivals: sessions start by a gamma process at `rate_per_s` sessions per second (`burstiness` 1: Poisson; the
first session at t = 0; an infinite rate starts all at t = 0); turn k + 1 is planned `think_time_s` after turn
k's planned arrival. The simulator replays these planned times; live replay by default sends turn k + 1
`think_time_s` after turn k's response has ended. A session ends early before a turn whose prompt plus answer
would exceed `max_session_tokens` (its first turn is cut to fit instead).

Content: block ids count up from seed x 65,536 (`BLOCKS_PER_SEED`), system blocks first, so runs with
different seeds share no block, not even the system prompt: arms measured one after another on the same live
engines each need their own seed, or the later one is served from the earlier one's cache. A vocabulary of V
ids encodes seeds below (V - 4)^2 / 65,536 (1,023 for the sim tokenizer's 8,192).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loadgen.datasets.mooncake import BLOCK_TOKENS, HASH_IDS
from loadgen.datasets.request import Request, estimate_tokens
from loadgen.datasets.text import DatasetFormatError, read_json
from loadgen.datasets.traces import read_decode_lengths

# Metadata keys a session request carries besides `hash_ids`.
TURN = "turn"  # 0-based turn of the session
AFTER_REQUEST_ID = "after_request_id"  # the session's previous turn (absent on a first turn)
THINK_TIME_S = "think_time_s"  # the pause between the previous turn and this one

SHAREGPT_PROMPT_FILES = ("sharegpt/ShareGPT_V3_filtered_999.json", "sharegpt/ShareGPT_V3_filtered_500.json")
SHAREGPT_LENGTHS_FILE = "sharegpt/sharegpt_8k_filtered_stats_llama2_tokenizer.csv"
BLOCKS_PER_SEED = 1 << 16  # block ids of one seed's run: [seed x this, (seed + 1) x this)
MAX_TURN_TOKENS = 1024  # Sarathi's ShareGPT decode lengths are capped there; the V3 prompts end below it
USER_LOG_MEDIAN, USER_LOG_STD = math.log(62.0), 1.46  # ShareGPT V3 first human turns (1,493), bytes / 4
ANSWER_LOG_MEDIAN, ANSWER_LOG_STD = math.log(320.0), 1.0  # Sarathi ShareGPT decode lengths (30,731)
_SALT = 0x5E55


@dataclass(frozen=True, slots=True)
class SessionSpec:
    """What `session_requests` generates: `sessions` sessions of up to `turns_per_session` turns each."""

    sessions: int = 64
    turns_per_session: int = 6
    system_prompt_tokens: int = 2048
    think_time_s: float = 3.0
    rate_per_s: float = math.inf  # session starts per second
    burstiness: float = 1.0  # gamma shape of the gaps between session starts; 1 = Poisson
    max_session_tokens: int = 8192  # prompt + answer of any turn

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.turns_per_session < 1:
            raise ValueError(f"sessions need sessions >= 1 and turns_per_session >= 1, got {self.sessions} "
                             f"and {self.turns_per_session}")
        if self.system_prompt_tokens < 0 or self.system_prompt_tokens % BLOCK_TOKENS:
            raise ValueError(f"system_prompt_tokens must be a non-negative multiple of the {BLOCK_TOKENS}-"
                             f"token block (e.g. 2048), got {self.system_prompt_tokens}")
        if not (math.isfinite(self.think_time_s) and self.think_time_s >= 0):
            raise ValueError(f"think_time_s must be a finite number >= 0, got {self.think_time_s}")
        if not (self.rate_per_s > 0 and self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"sessions need rate_per_s > 0 and a finite burstiness > 0, got "
                             f"{self.rate_per_s} and {self.burstiness}")
        if self.max_session_tokens < self.system_prompt_tokens + 2:
            raise ValueError(f"max_session_tokens {self.max_session_tokens} leaves no room for a user turn "
                             f"and an answer after the {self.system_prompt_tokens}-token system prompt")
        if self.sessions * math.ceil(self.max_session_tokens / BLOCK_TOKENS) > BLOCKS_PER_SEED:
            raise ValueError(f"{self.sessions} sessions of up to {self.max_session_tokens} tokens may need "
                             f"more than {BLOCKS_PER_SEED} blocks: fewer sessions or a smaller "
                             f"max_session_tokens")


@dataclass(frozen=True, slots=True)
class TurnLengths:
    """Pools of user-turn and answer lengths in tokens (None: the fitted lognormal) and their provenance."""

    user_tokens: tuple[int, ...] | None = None
    answer_tokens: tuple[int, ...] | None = None

    @classmethod
    def from_data_dir(cls, data_dir: Path | None) -> TurnLengths:
        """The ShareGPT pools found under `data_dir` (the module docstring's files); None parts otherwise."""
        if data_dir is None:
            return cls()
        by_id: dict[str, int] = {}
        for relpath in SHAREGPT_PROMPT_FILES:
            path = data_dir / relpath
            if path.is_file():
                by_id.update(_first_human_turn_tokens(path))
        path = data_dir / SHAREGPT_LENGTHS_FILE
        answers = tuple(int(n) for n in read_decode_lengths(path)) if path.is_file() else ()
        return cls(user_tokens=tuple(by_id.values()) or None, answer_tokens=answers or None)

    def describe(self) -> dict[str, str]:
        """Where each length comes from, for a results file."""
        return {"user": "lognormal" if self.user_tokens is None else f"sharegpt-v3 ({len(self.user_tokens)})",
                "answer": "lognormal" if self.answer_tokens is None
                else f"sarathi-sharegpt ({len(self.answer_tokens)})"}

    def draw(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        """`n` user-turn lengths and `n` answer lengths, each in [1, MAX_TURN_TOKENS]."""
        return (_draw(rng, n, self.user_tokens, USER_LOG_MEDIAN, USER_LOG_STD),
                _draw(rng, n, self.answer_tokens, ANSWER_LOG_MEDIAN, ANSWER_LOG_STD))


def _draw(rng: np.random.Generator, n: int, pool: Sequence[int] | None, log_median: float,
          log_std: float) -> np.ndarray:
    values = (rng.choice(np.asarray(pool, dtype=np.int64), size=n) if pool is not None
              else np.rint(rng.lognormal(log_median, log_std, n)))
    return np.clip(values, 1, MAX_TURN_TOKENS).astype(np.int64)


def _first_human_turn_tokens(path: Path) -> dict[str, int]:
    records = read_json(path)
    if not isinstance(records, list):
        raise DatasetFormatError(f"{path}: expected a JSON array of conversations")
    out: dict[str, int] = {}
    for row, record in enumerate(records):
        turns = record.get("conversations") if isinstance(record, dict) else None
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], dict):
            raise DatasetFormatError(f"{path}: record {row} has no 'conversations' list of objects")
        if turns[0].get("from") in ("human", "user"):
            out[str(record.get("id", f"{path.name}-{row}"))] = estimate_tokens(str(turns[0].get("value", "")))
    return out


def session_start_times_s(spec: SessionSpec, seed: int) -> np.ndarray:
    """When each session's first turn is planned: 0, then cumulative Gamma(K, 1 / (R K)) gaps."""
    if math.isinf(spec.rate_per_s):
        return np.zeros(spec.sessions)
    rng = np.random.default_rng([seed, _SALT])
    gaps_s = rng.gamma(spec.burstiness, 1.0 / (spec.rate_per_s * spec.burstiness), spec.sessions - 1)
    return np.concatenate(([0.0], np.cumsum(gaps_s)))


def session_requests(spec: SessionSpec, *, seed: int, lengths: TurnLengths | None = None) -> list[Request]:
    """Every turn of every session, sorted by planned arrival (ties: turn, then session). Session s draws its
    lengths from its own stream (`seed`, s), so adding sessions leaves the earlier ones as they were."""
    if seed < 0:
        raise ValueError(f"the sessions dataset needs a seed >= 0, got {seed}")
    pools = lengths if lengths is not None else TurnLengths()
    starts_s = session_start_times_s(spec, seed)
    system_blocks = spec.system_prompt_tokens // BLOCK_TOKENS
    system_ids = tuple(range(seed * BLOCKS_PER_SEED, seed * BLOCKS_PER_SEED + system_blocks))
    next_id = seed * BLOCKS_PER_SEED + system_blocks
    out: list[tuple[float, int, int, Request]] = []
    for s in range(spec.sessions):
        users, answers = pools.draw(np.random.default_rng([seed, _SALT, s]), spec.turns_per_session)
        turns = _fit_turns(spec, [int(u) for u in users], [int(a) for a in answers])
        longest = turns[-1][0]  # the last prompt is the longest: every prompt is a prefix of the next
        own = tuple(range(next_id, next_id + math.ceil(longest / BLOCK_TOKENS) - system_blocks))
        next_id += len(own)
        previous: str | None = None
        for k, (prompt_tokens, answer_tokens) in enumerate(turns):
            request_id = f"sessions-{s}-{k}"
            blocks = math.ceil(prompt_tokens / BLOCK_TOKENS)
            metadata: dict[str, object] = {HASH_IDS: system_ids + own[:blocks - system_blocks], TURN: k,
                                           THINK_TIME_S: spec.think_time_s}
            if previous is not None:
                metadata[AFTER_REQUEST_ID] = previous
            arrival_s = float(starts_s[s]) + k * spec.think_time_s
            out.append((arrival_s, k, s, Request(
                request_id=request_id, prompt_tokens=prompt_tokens, output_tokens=answer_tokens,
                arrival_s=arrival_s, session_id=f"session-{seed}-{s}", metadata=metadata)))
            previous = request_id
    out.sort(key=lambda item: item[:3])
    return [request for *_, request in out]


def _fit_turns(spec: SessionSpec, users: list[int], answers: list[int]) -> list[tuple[int, int]]:
    """(prompt tokens, answer tokens) per turn: each prompt is the last one plus its answer plus the new user
    turn; stops before a turn over `max_session_tokens`, whose first turn is cut to fit instead."""
    room = spec.max_session_tokens - spec.system_prompt_tokens
    first_user = min(users[0], room - 1)
    turns = [(spec.system_prompt_tokens + first_user, min(answers[0], room - first_user))]
    for user, answer in zip(users[1:], answers[1:], strict=True):
        prompt = sum(turns[-1]) + user
        if prompt + answer > spec.max_session_tokens:
            break
        turns.append((prompt, answer))
    return turns
