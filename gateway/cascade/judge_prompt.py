"""The LLM judge's text: FastChat's single-answer templates, the prompt built from a request, and the parser.

Owns: the shipped templates (`gateway/cascade/assets/judge_prompts.jsonl`: FastChat's `single-v1` and
`single-v1-multi-turn`, lm-sys/FastChat, Apache-2.0; see `assets/README.md`), `build_prompt` (the system and
user messages FastChat's `run_judge_single` sends), `parse_rating` (its rating parser), `extract_question`
(the inverse the judge stub uses: the judged question back out of a prompt this module built), the
profile-judge rating rule (token estimates are `quality.estimate_tokens`).
Must not: send anything, time anything, or import I/O (pure: text in, text out; the clients are `judge.py`).

Prompts, as FastChat fills them:
- one user turn: `single-v1`, `{question}` and `{answer}`; system message "You are a helpful assistant.".
- two user turns: `single-v1-multi-turn`, `{question_1}`, `{answer_1}` (the assistant's earlier turn),
  `{question_2}`, `{answer_2}` (the answer judged); the template's system prompt holds the instruction.
- more than two (FastChat has no template for it): the multi-turn template with its `### User:` /
  `### Assistant A:` block repeated once per turn; exactly FastChat's text at two turns. Its system prompt
  still says "the second user question": kept verbatim, it reads as "the last".
- The math variants (`single-math-v1[-multi-turn]`) are not shipped: they grade against a reference answer,
  and a live request has none.
With `output="explain"` the 200 general-template judge inputs of the MT-Bench data (RouteLLM's
`judgements.jsonl`) are rebuilt byte for byte from their questions and answers.

`output="explain"` sends the templates verbatim (the judge explains, then rates: a median of 153 estimated
tokens over the 320 GPT-4 judgments in the MT-Bench data). `output="rating"` changes one passage only, the
output instruction: from "Begin your evaluation by providing a short explanation." to the end of
`"Rating: [[5]]".` (in `single-v1`'s user template and in `single-v1-multi-turn`'s system prompt) becomes
`RATING_INSTRUCTION`, which asks for `Rating: [[k]]` alone; every other character is FastChat's.

The parser is FastChat's `run_judge_single`: the first `[[k]]` (`\\[\\[(\\d+\\.?\\d*)\\]\\]`), else
the first `[k]` (`\\[(\\d+\\.?\\d*)\\]`), read as a number (FastChat: `ast.literal_eval`; here `float`,
which reads every string the pattern matches). No match is `malformed` (FastChat's -1). FastChat keeps any
number; here one outside [1, 10] is `out_of_range`. A rating k is the score 10*k on Cascadia's 0-100.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Literal

from gateway.cascade.quality import SCORE_SCALE, estimate_tokens

ASSET = "judge_prompts.jsonl"
SINGLE = "single-v1"
MULTI_TURN = "single-v1-multi-turn"
Output = Literal["rating", "explain"]

# The passage `output="rating"` replaces, and what replaces it.
EXPLAIN_INSTRUCTION = (
    "Begin your evaluation by providing a short explanation. Be as objective as possible. After providing "
    "your explanation, you must rate the response on a scale of 1 to 10 by strictly following this format: "
    '"[[rating]]", for example: "Rating: [[5]]".'
)
RATING_INSTRUCTION = (
    "Be as objective as possible. Do not explain: reply with your rating of the response on a scale of 1 to "
    '10 and nothing else, strictly in this format: "Rating: [[rating]]", for example: "Rating: [[5]]".'
)
RATING_MIN = 1.0
RATING_MAX = 10.0

_ONE_SCORE = re.compile(r"\[\[(\d+\.?\d*)\]\]")
_ONE_SCORE_BACKUP = re.compile(r"\[(\d+\.?\d*)\]")
# Where the judged question sits in the two templates (checked against the asset when it is read).
_SINGLE_BEFORE_QUESTION = "[Question]\n"
_SINGLE_AFTER_QUESTION = "\n\n[The Start of Assistant's Answer]\n"
_TURN_BEFORE_QUESTION = "### User:\n"
_TURN_AFTER_QUESTION = "\n\n### Assistant A:\n"


class JudgePromptError(ValueError):
    """Templates that do not have the shape this module fills (a changed asset)."""


@dataclass(frozen=True, slots=True)
class Template:
    name: str
    system_prompt: str
    prompt_template: str


@dataclass(frozen=True, slots=True)
class JudgePrompt:
    """What the judge is sent: FastChat's conversation of one system and one user message."""

    template: str  # the FastChat template's name
    system: str
    user: str

    def messages(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system}, {"role": "user", "content": self.user}]

    @property
    def estimated_tokens(self) -> int:
        return estimate_tokens(self.system) + estimate_tokens(self.user)


@dataclass(frozen=True, slots=True)
class ParsedRating:
    outcome: Literal["ok", "malformed", "out_of_range"]
    rating: float | None  # the number found (also when out of range); None when malformed
    detail: str = ""

    @property
    def score(self) -> float | None:
        """0-100 when the rating is usable, else None."""
        return self.rating * SCORE_SCALE if self.outcome == "ok" and self.rating is not None else None


def parse_rating(judgment: str) -> ParsedRating:
    """FastChat's single-answer parser (module doc), with ratings outside [1, 10] rejected."""
    match = _ONE_SCORE.search(judgment) or _ONE_SCORE_BACKUP.search(judgment)
    if match is None:
        return ParsedRating("malformed", None, f"no [[rating]] in the judgment ({_clip(judgment)!r})")
    rating = float(match.group(1))
    if not RATING_MIN <= rating <= RATING_MAX:
        return ParsedRating("out_of_range", rating, f"rating {match.group(1)} outside [1, 10]")
    return ParsedRating("ok", rating)


def format_rating(rating: float) -> str:
    """`9` for 9.0, `8.5` for 8.5: how a judge writes k."""
    return f"{rating:g}"


def rating_reply(rating: float) -> str:
    return f"Rating: [[{format_rating(rating)}]]"


def profile_rating(score: float) -> float:
    """The 1-10 rating a profile-driven judge answers for a profile score (0-100).

    A score on the half-point grid of 10..100 is passed through (the shipped profile's item scores are
    GPT-4's own ratings x10, 8.5 included, so a live profile judge routes exactly as the simulator does);
    anything else (a model's marginal mean, 83.4) is rounded half up to the nearest 10, within [10, 100]."""
    if (
        SCORE_SCALE * RATING_MIN <= score <= SCORE_SCALE * RATING_MAX
        and (2 * score / SCORE_SCALE).is_integer()
    ):
        return score / SCORE_SCALE
    return min(RATING_MAX, max(RATING_MIN, float(math.floor(score / SCORE_SCALE + 0.5))))


# ------------------------------------------------------------------------------------------- the templates


@cache
def templates() -> Mapping[str, Template]:
    """The shipped templates by name, checked for the passages this module fills and replaces."""
    text = resources.files("gateway.cascade").joinpath("assets", ASSET).read_text(encoding="utf-8")
    return parse_templates(text)


def parse_templates(text: str) -> dict[str, Template]:
    try:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        found = {
            str(r["name"]): Template(str(r["name"]), str(r["system_prompt"]), str(r["prompt_template"]))
            for r in rows
        }
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise JudgePromptError(f"judge templates do not parse: {exc!r}") from None
    for name, needed in (
        (
            SINGLE,
            (
                "{question}",
                "{answer}",
                _SINGLE_BEFORE_QUESTION + "{question}" + _SINGLE_AFTER_QUESTION + "{answer}",
            ),
        ),
        (
            MULTI_TURN,
            (
                "{question_1}",
                "{answer_1}",
                _TURN_BEFORE_QUESTION + "{question_2}" + _TURN_AFTER_QUESTION + "{answer_2}",
            ),
        ),
    ):
        if name not in found:
            raise JudgePromptError(f"judge templates lack {name!r}")
        if any(n not in found[name].prompt_template for n in needed):
            raise JudgePromptError(f"judge template {name!r} has not the expected placeholders")
    if EXPLAIN_INSTRUCTION not in found[SINGLE].prompt_template + found[MULTI_TURN].system_prompt:
        raise JudgePromptError("judge templates lack FastChat's output instruction")
    return found


def build_prompt(
    questions: Sequence[str], answers: Sequence[str], answer: str, output: Output
) -> JudgePrompt:
    """The judge's prompt for `answer` to `questions[-1]`, after `answers` to the earlier questions."""
    if not questions or len(answers) != len(questions) - 1:
        raise ValueError(
            f"{len(questions)} user turns take {max(0, len(questions) - 1)} earlier answers, "
            f"got {len(answers)}"
        )
    table = templates()
    if len(questions) == 1:
        single = table[SINGLE]
        user = single.prompt_template.format(question=questions[0], answer=answer)
        return JudgePrompt(SINGLE, single.system_prompt, _instruct(user, output))
    multi = table[MULTI_TURN]
    user = _conversation(multi.prompt_template, [*questions], [*answers, answer])
    return JudgePrompt(MULTI_TURN, _instruct(multi.system_prompt, output), user)


def _instruct(text: str, output: Output) -> str:
    return text if output == "explain" else text.replace(EXPLAIN_INSTRUCTION, RATING_INSTRUCTION)


def _conversation(template: str, questions: list[str], answers: list[str]) -> str:
    """The multi-turn template filled: FastChat's `.format` at two turns, the first block repeated beyond."""
    if len(questions) == 2:
        return template.format(
            question_1=questions[0], answer_1=answers[0], question_2=questions[1], answer_2=answers[1]
        )
    first = template.index(_TURN_BEFORE_QUESTION + "{question_1}")
    last = template.index(_TURN_BEFORE_QUESTION + "{question_2}")
    head, block, tail = template[:first], template[first:last], template[last:]
    middle = "".join(
        block.format(question_1=q, answer_1=a) for q, a in zip(questions[:-1], answers[:-1], strict=True)
    )
    return head + middle + tail.format(question_2=questions[-1], answer_2=answers[-1])


# ---------------------------------------------------------------------------------- the stub's inverse


def extract_question(user: str, known: Callable[[str], bool] | None = None) -> str | None:
    """The judged (last) question in the user message of a prompt `build_prompt` made; None if the text is not
    one of ours.

    The question and the answers are free text and may contain the templates' own markers, so every split the
    markers allow is a candidate: the first one `known` accepts (the stub: a question its profile holds) wins,
    else the most likely (the first split of `single-v1`; the last `### User:` block of the multi-turn one,
    cut at its first `### Assistant A:`)."""
    candidates = (
        _single_candidates(user)
        if _SINGLE_BEFORE_QUESTION in user and _SINGLE_AFTER_QUESTION in user
        else _turn_candidates(user)
    )
    first: str | None = None
    for candidate in candidates:
        if known is None or known(candidate):
            return candidate
        first = candidate if first is None else first
    return first


def _single_candidates(user: str) -> list[str]:
    start = user.index(_SINGLE_BEFORE_QUESTION) + len(_SINGLE_BEFORE_QUESTION)
    return [user[start:end] for end in _positions(user, _SINGLE_AFTER_QUESTION, start)]


def _turn_candidates(user: str) -> list[str]:
    starts = [p + len(_TURN_BEFORE_QUESTION) for p in _positions(user, _TURN_BEFORE_QUESTION, 0)]
    return [
        user[start:end] for start in reversed(starts) for end in _positions(user, _TURN_AFTER_QUESTION, start)
    ]


def _positions(text: str, marker: str, start: int) -> list[int]:
    found: list[int] = []
    at = text.find(marker, start)
    while at >= 0:
        found.append(at)
        at = text.find(marker, at + 1)
    return found


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
