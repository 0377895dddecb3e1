"""Quality profiles of cascade models (Cascadia footnote 3): per item, each model's judge score and answer
length.

Owns: `QualityProfile` (items in a fixed order, each model's `ItemScore` per item), the cascade arithmetic
over it (`route`: which stage answers each item under thresholds H, the stage shares, Q(H)), subsets
(`mt-bench`, `mt-bench-hard`, `mt-bench-easy`, contaminated prompts dropped or kept), the look-up of an item
by its question text (the `profile` judge and the judge stub score from it), the shipped MT-Bench profile
(`mt_bench_profile`, read from `gateway/cascade/assets/mt_bench_quality.json`) and `derive_mt_bench_profile`,
which rebuilds that asset from the data files.
Must not: judge, route live requests, time anything, or import I/O beyond reading the asset (a pure core).

The data (`mt_bench/routellm/judgements.jsonl`, RouteLLM, Apache-2.0): GPT-4 single-answer grades 1-10 for two
models on the 80 MT-Bench questions x 2 turns, the answers inside the judge prompts. Scores are scaled x10 to
0-100 (Cascadia's judge range). Stand-ins, labelled wherever a figure is reported: Mixtral-8x7B-Instruct
stands for `llama3-8b`, gpt-4-1106-preview for `llama3-70b` (the simulated fleet's Llama 3 pair); the data
holds no other model. A three-stage cascade needs a middle model the data does not have: `SYNTHETIC_MIDDLE`
(`qwen2.5-14b`) takes, per item, one of the two real judgements, chosen by a fixed hash of (question id, turn)
with probability 1/2 each (its answer length comes with the judgement it took). It has real scores item by
item, a mean between the two models', and agrees with each on about half the items: a stand-in for "a model
between the two", not a measurement of one.

Answer lengths are ceil(UTF-8 bytes / 4), the gateway's own token estimate (`gateway.dispatch.features`): the
data has texts, not token ids, and no Llama tokenizer can be downloaded here. A turn-2 prompt is the turn-1
question, the model's own turn-1 answer and the turn-2 question (MT-Bench's multi-turn generation).

The routing rule (Fig. 4): a request starts on stage 1; at stage i < C its answer is accepted when its score
is at least h_i, else it escalates; the last stage always answers. With the shipped profile and all 160 items:
weak only 83.4, strong only 92.3, h_1 = 90 escalates 27.5 % and gives Q = 92.4 (tests pin these).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

WEAK_SOURCE = "mistralai/Mixtral-8x7B-Instruct-v0.1"
STRONG_SOURCE = "gpt-4-1106-preview"
STAND_INS: Mapping[str, str] = {"llama3-8b": WEAK_SOURCE, "llama3-70b": STRONG_SOURCE}
SYNTHETIC_MIDDLE = "qwen2.5-14b"
HARD_CATEGORIES = frozenset({"math", "coding", "reasoning", "extraction"})
EASY_CATEGORIES = frozenset({"writing", "roleplay", "stem", "humanities"})
SUBSETS = ("mt-bench", "mt-bench-hard", "mt-bench-easy")
SCORE_SCALE = 10.0  # the judge's 1-10 to Cascadia's 0-100
ASSET = "mt_bench_quality.json"
BYTES_PER_TOKEN = 4


class QualityProfileError(ValueError):
    """A profile that cannot be built or asked: an unknown model or subset, or data that does not parse."""


@dataclass(frozen=True, slots=True)
class ItemScore:
    """One model's answer to one item: its judge score on 0-100 and its length in (estimated) tokens."""

    score: float
    answer_tokens: int


@dataclass(frozen=True, slots=True)
class Item:
    """One MT-Bench item: a question at one turn. `questions` are the user turns up to and including this
    one."""

    question_id: int
    turn: int
    category: str
    questions: tuple[str, ...]
    contaminated: bool = False

    @property
    def key(self) -> tuple[int, int]:
        return (self.question_id, self.turn)

    @property
    def hard(self) -> bool:
        return self.category in HARD_CATEGORIES


@dataclass(frozen=True, slots=True)
class Routing:
    """Where each item ends under thresholds H: the answering stage (0-based) per item, and the aggregates."""

    answering_stage: tuple[int, ...]
    stage_share: tuple[float, ...]  # share of items that reach stage i (stage 0 is 1.0)
    answer_share: tuple[float, ...]  # share of items answered by stage i
    quality: float  # Q(H): mean score of the accepted answers, 0-100

    @property
    def escalated_share(self) -> float:
        return 1.0 - self.answer_share[0] if self.answer_share else 0.0


class QualityProfile:
    """Items and each model's score on each; immutable once built."""

    def __init__(
        self,
        items: Sequence[Item],
        scores: Mapping[str, Sequence[ItemScore]],
        *,
        sources: Mapping[str, str] | None = None,
    ) -> None:
        if not items:
            raise QualityProfileError("a quality profile needs at least one item")
        for model, row in scores.items():
            if len(row) != len(items):
                raise QualityProfileError(f"model {model!r} has {len(row)} scores for {len(items)} items")
        self.items: tuple[Item, ...] = tuple(items)
        self._scores: dict[str, tuple[ItemScore, ...]] = {m: tuple(r) for m, r in scores.items()}
        self.sources: dict[str, str] = dict(sources or {})
        self._by_text: dict[str, int] = {}
        self._first_turn: dict[int, int] = {}  # question id -> the index of its turn-1 item
        for index, item in enumerate(self.items):
            self._by_text.setdefault(_normalise(item.questions[-1]), index)
            if item.turn == 1:
                self._first_turn.setdefault(item.question_id, index)

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(self._scores)

    def scores(self, model: str) -> tuple[ItemScore, ...]:
        try:
            return self._scores[model]
        except KeyError:
            raise QualityProfileError(
                f"no quality profile for model {model!r}; profiled: {', '.join(self.models)}"
            ) from None

    def first_turn(self, question_id: int) -> int | None:
        """The index of the question's turn-1 item, or None when the profile lacks it."""
        return self._first_turn.get(question_id)

    def mean_score(self, model: str) -> float:
        """The model's marginal: its mean score over the profile's items (the quality of 'this model
        only')."""
        row = self.scores(model)
        return sum(s.score for s in row) / len(row)

    def index_of(self, question_text: str) -> int | None:
        """The item whose latest user turn is this text (whitespace-normalised), or None."""
        return self._by_text.get(_normalise(question_text))

    def subset(self, name: str = "mt-bench", *, drop_contaminated: bool = False) -> QualityProfile:
        """`mt-bench` (every item), `mt-bench-hard` (math, coding, reasoning, extraction) or
        `mt-bench-easy`."""
        if name not in SUBSETS:
            raise QualityProfileError(f"unknown subset {name!r}; known: {', '.join(SUBSETS)}")
        keep = [
            i
            for i, item in enumerate(self.items)
            if not (drop_contaminated and item.contaminated)
            and (name == "mt-bench" or (item.hard if name == "mt-bench-hard" else not item.hard))
        ]
        return self.take(keep)

    def take(self, indices: Iterable[int]) -> QualityProfile:
        """A profile of these items (in this order, repeats allowed: a sample with replacement)."""
        chosen = list(indices)
        return QualityProfile(
            [self.items[i] for i in chosen],
            {m: [row[i] for i in chosen] for m, row in self._scores.items()},
            sources=self.sources,
        )

    def route(self, models: Sequence[str], thresholds: Sequence[float]) -> Routing:
        """Fig. 4 over every item: stage i accepts when score >= h_i; the last stage always answers."""
        if len(thresholds) != len(models) - 1:
            raise QualityProfileError(
                f"{len(models)} stages take {len(models) - 1} thresholds, got {len(thresholds)}"
            )
        rows = [self.scores(m) for m in models]
        last = len(models) - 1
        answering: list[int] = []
        total = 0.0
        for index in range(len(self.items)):
            stage = next((s for s in range(last) if rows[s][index].score >= thresholds[s]), last)
            answering.append(stage)
            total += rows[stage][index].score
        n = len(answering)
        answered = [answering.count(s) / n for s in range(len(models))]
        reached = [sum(answered[s:]) for s in range(len(models))]
        return Routing(tuple(answering), tuple(reached), tuple(answered), total / n)

    def score_levels(self, model: str) -> tuple[float, ...]:
        """The distinct scores a model received, ascending: the thresholds worth trying for it (§3.3)."""
        return tuple(sorted({s.score for s in self.scores(model)}))


def stage_models(profile: QualityProfile, models: Sequence[str]) -> None:
    """Raise `QualityProfileError` naming the first model the profile cannot score."""
    for model in models:
        profile.scores(model)


def _normalise(text: str) -> str:
    return " ".join(text.split())


def estimate_tokens(text: str) -> int:
    """ceil(UTF-8 bytes / 4): the gateway's token estimate where no tokenizer is at hand."""
    return math.ceil(len(text.encode("utf-8")) / BYTES_PER_TOKEN)


def _coin(question_id: int, turn: int) -> bool:
    digest = hashlib.sha256(f"{question_id}:{turn}".encode()).digest()
    return digest[0] < 128


def _middle(weak: ItemScore, strong: ItemScore, item: Item) -> ItemScore:
    return strong if _coin(item.question_id, item.turn) else weak


# ---------------------------------------------------------------------------------------------------- the
# asset


def to_json(profile: QualityProfile) -> dict[str, Any]:
    return {
        "sources": profile.sources,
        "models": list(profile.models),
        "items": [
            {
                "question_id": item.question_id,
                "turn": item.turn,
                "category": item.category,
                "questions": list(item.questions),
                "contaminated": item.contaminated,
                "scores": {
                    m: [profile.scores(m)[i].score, profile.scores(m)[i].answer_tokens]
                    for m in profile.models
                },
            }
            for i, item in enumerate(profile.items)
        ],
    }


def from_json(data: Mapping[str, Any]) -> QualityProfile:
    try:
        models = [str(m) for m in data["models"]]
        items: list[Item] = []
        scores: dict[str, list[ItemScore]] = {m: [] for m in models}
        for row in data["items"]:
            items.append(
                Item(
                    int(row["question_id"]),
                    int(row["turn"]),
                    str(row["category"]),
                    tuple(str(q) for q in row["questions"]),
                    bool(row.get("contaminated", False)),
                )
            )
            for model in models:
                score, tokens = row["scores"][model]
                scores[model].append(ItemScore(float(score), int(tokens)))
        return QualityProfile(
            items, scores, sources={str(k): str(v) for k, v in data.get("sources", {}).items()}
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise QualityProfileError(f"quality profile does not parse: {exc!r}") from None


_SHIPPED: list[QualityProfile] = []


def mt_bench_profile() -> QualityProfile:
    """The shipped MT-Bench profile with its stand-in names: `llama3-8b`, `qwen2.5-14b` (synthetic),
    `llama3-70b`."""
    if not _SHIPPED:
        text = resources.files("gateway.cascade").joinpath("assets", ASSET).read_text(encoding="utf-8")
        _SHIPPED.append(from_json(json.loads(text)))
    return _SHIPPED[0]


def load_profile(path: Path | None) -> QualityProfile:
    """A profile from a JSON file in the asset's format, or the shipped one when `path` is None."""
    if path is None:
        return mt_bench_profile()
    try:
        return from_json(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, json.JSONDecodeError) as exc:
        raise QualityProfileError(f"cannot read quality profile {path}: {exc}") from None


# ------------------------------------------------------------------------------------------ deriving from
# data


def _answer(judge: str, user_prompt: str) -> str:
    if judge.endswith("multi-turn"):
        end = user_prompt.rindex("<|The End of Assistant A's Conversation with User|>")
        start = user_prompt.rindex("### Assistant A:\n", 0, end) + len("### Assistant A:\n")
        return user_prompt[start:end].strip()
    start = user_prompt.index("[The Start of Assistant's Answer]\n") + len(
        "[The Start of Assistant's Answer]\n"
    )
    end = user_prompt.rindex("\n[The End of Assistant's Answer]")
    return user_prompt[start:end].strip()


def derive_mt_bench_profile(data_dir: Path) -> QualityProfile:
    """Rebuild the shipped profile from `mt_bench/` under a data root (the asset is this, written by
    `to_json`)."""
    base = data_dir / "mt_bench"
    questions = {int(q["question_id"]): q for q in _jsonl(base / "fastchat" / "question.jsonl")}
    contaminated = {
        _normalise(str(r["eval_prompt"])) for r in _jsonl(base / "routellm" / "contaminated_prompts.jsonl")
    }
    found: dict[tuple[int, int, str], tuple[float, str]] = {}
    for row in _jsonl(base / "routellm" / "judgements.jsonl"):
        judge = str(row["judge"][1])
        found[(int(row["question_id"]), int(row["turn"]), str(row["model"]))] = (
            float(row["score"]),
            _answer(judge, str(row["user_prompt"])),
        )
    items: list[Item] = []
    scores: dict[str, list[ItemScore]] = {"llama3-8b": [], SYNTHETIC_MIDDLE: [], "llama3-70b": []}
    for qid in sorted(questions):
        q = questions[qid]
        turns = tuple(str(t) for t in q["turns"])
        dirty = _normalise(turns[0]) in contaminated
        for turn in (1, 2):
            item = Item(qid, turn, str(q["category"]), turns[:turn], dirty)
            pair = []
            for source in (WEAK_SOURCE, STRONG_SOURCE):
                if (qid, turn, source) not in found:
                    raise QualityProfileError(f"judgements lack question {qid} turn {turn} for {source}")
                score, answer = found[(qid, turn, source)]
                pair.append(ItemScore(score * SCORE_SCALE, estimate_tokens(answer)))
            items.append(item)
            scores["llama3-8b"].append(pair[0])
            scores["llama3-70b"].append(pair[1])
            scores[SYNTHETIC_MIDDLE].append(_middle(pair[0], pair[1], item))
    sources = {
        "llama3-8b": WEAK_SOURCE,
        "llama3-70b": STRONG_SOURCE,
        SYNTHETIC_MIDDLE: f"synthetic: per item one of {WEAK_SOURCE} / {STRONG_SOURCE} (hash coin)",
    }
    return QualityProfile(items, scores, sources=sources)


def _jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as exc:
        raise QualityProfileError(f"cannot read {path}: {exc}") from None


def prompt_tokens(item: Item, profile: QualityProfile, model: str) -> int:
    """The prompt a stage sees for this item: the user turns, and on turn 2 the model's own turn-1 answer."""
    tokens = sum(estimate_tokens(q) for q in item.questions)
    first = profile.first_turn(item.question_id) if item.turn > 1 else None
    if first is not None:
        tokens += profile.scores(model)[first].answer_tokens
    return tokens
