"""The cascade's LLM judge: a stage's answer in, a `Verdict` (a 0-100 score, or why there is none) out.

Owns: the `Judge` role and its three kinds (`JudgeConfig.kind`), built by `build_judge`:
- `OpenAIJudge`: POST `{url}/chat/completions` on any OpenAI-compatible server (one pooled aiohttp session,
  opened on the first call), bearer `api_key`, temperature 0, `max_tokens` (8 for `rating`, 1024 for
  `explain` unless configured), header `x-switchyard-judged-model` naming the stage model (the judge stub
  scores from it; a real judge ignores it). The whole call, connect to last byte, has `timeout_s`.
- `ClusterJudge`: the same prompt through `ClusterComplete`, a model this gateway serves (the gateway supplies
  the function; it raises `JudgeTransportError` for 5xx, 429 or an unreachable pool).
- `ProfileJudge` (the simulated fleet): no network; the profile's score of the judged model on the item whose
  last question is the request's (`QualityProfile.index_of`), else the model's marginal mean, as a rating
  (`judge_prompt.profile_rating`); tokens estimated from the prompt it would send and `Rating: [[k]]`.
Outcomes: "ok" (score set), "timeout", "refused" (a `refusal`, finish_reason `content_filter`, or no text),
"http_5xx", "http_429", "http_error" (other non-200s, other client errors), "unreachable" (connection refused
or dropped), "malformed" (no rating in the text, a body not shaped like OpenAI's, a judged model the profile
lacks), "out_of_range" (a rating outside [1, 10]). Latency is read from the injected clock.
Must not: decide what a failure means (the cascade core applies `on_judge_failure`, counts failures in a row
and skips the judge), retry, or swallow cancellation: a cancelled caller (client disconnect) cancels the HTTP
request, which closes its connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import orjson

from gateway.cascade.judge_prompt import (
    SCORE_SCALE,
    JudgePrompt,
    Output,
    build_prompt,
    parse_rating,
    profile_rating,
    rating_reply,
)
from gateway.cascade.quality import QualityProfile, QualityProfileError, estimate_tokens, load_profile
from gateway.config import JudgeConfig
from gateway.engines.openai_upstream import upstream_session
from switchyard.clock import Clock

JUDGED_MODEL_HEADER = "x-switchyard-judged-model"
OUTCOMES = frozenset(
    {
        "ok",
        "timeout",
        "refused",
        "http_5xx",
        "http_429",
        "http_error",
        "unreachable",
        "malformed",
        "out_of_range",
    }
)
TRANSPORT_OUTCOMES = frozenset({"timeout", "http_5xx", "http_429", "http_error", "unreachable"})
MAX_TOKENS = {"rating": 8, "explain": 1024}  # JudgeConfig.max_tokens None
_DETAIL_CHARS = 200


@dataclass(frozen=True, slots=True)
class JudgeRequest:
    questions: tuple[str, ...]  # user turns; the last is the one being answered
    answers: tuple[str, ...]  # the assistant's earlier turns (len(questions) - 1 of them)
    answer: str  # the answer being judged
    judged_model: str  # the stage model that wrote it

    def __post_init__(self) -> None:
        if not self.questions or len(self.answers) != len(self.questions) - 1:
            raise ValueError(
                f"a judge request of {len(self.questions)} user turns takes "
                f"{max(0, len(self.questions) - 1)} earlier answers, got {len(self.answers)}"
            )


@dataclass(frozen=True, slots=True)
class Verdict:
    outcome: str  # one of OUTCOMES
    score: float | None  # 0-100 (FastChat's 1-10 rating x 10) when outcome == "ok", else None
    prompt_tokens: int
    completion_tokens: int
    latency_s: float
    detail: str = ""  # a short human reason for a failure (status code, parse problem)

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"unknown judge outcome {self.outcome!r}")
        if (self.score is not None) != (self.outcome == "ok"):
            raise ValueError(
                f"a {self.outcome!r} verdict {'needs' if self.outcome == 'ok' else 'has no'} score"
            )


class Judge(Protocol):
    async def judge(self, request: JudgeRequest) -> Verdict: ...

    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class CompletionResult:
    """A non-streamed chat completion, as `ClusterComplete` returns it."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None
    refusal: str | None = None


class ClusterComplete(Protocol):
    """One chat completion on a model the gateway serves; raises `JudgeTransportError` when none comes."""

    async def __call__(
        self, model: str, messages: list[dict[str, str]], max_tokens: int, timeout_s: float
    ) -> CompletionResult: ...


class JudgeTransportError(Exception):
    """No completion: `outcome` is one of `TRANSPORT_OUTCOMES`, `detail` says why."""

    def __init__(self, outcome: str, detail: str) -> None:
        if outcome not in TRANSPORT_OUTCOMES:
            raise ValueError(
                f"{outcome!r} is not a transport outcome ({', '.join(sorted(TRANSPORT_OUTCOMES))})"
            )
        super().__init__(f"{outcome}: {detail}")
        self.outcome = outcome
        self.detail = detail


def verdict_of(result: CompletionResult, latency_s: float) -> Verdict:
    """A completion's verdict: refused, else FastChat's parser over its text."""
    tokens = (max(0, result.prompt_tokens), max(0, result.completion_tokens))
    if result.refusal:
        return Verdict("refused", None, *tokens, latency_s, f"refusal: {_clip(result.refusal)}")
    if result.finish_reason == "content_filter":
        return Verdict("refused", None, *tokens, latency_s, "finish_reason content_filter")
    if not result.text.strip():
        return Verdict("refused", None, *tokens, latency_s, "an empty answer")
    parsed = parse_rating(result.text)
    return Verdict(parsed.outcome, parsed.score, *tokens, latency_s, parsed.detail)


def _failure(outcome: str, latency_s: float, detail: str) -> Verdict:
    return Verdict(outcome, None, 0, 0, latency_s, detail)


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _DETAIL_CHARS else text[:_DETAIL_CHARS] + "..."


def _max_tokens(config: JudgeConfig) -> int:
    return config.max_tokens if config.max_tokens is not None else MAX_TOKENS[config.output]


def _prompt(request: JudgeRequest, output: Output) -> JudgePrompt:
    return build_prompt(request.questions, request.answers, request.answer, output)


# ------------------------------------------------------------------------------------------------ openai


class OpenAIJudge:
    """A judge behind any OpenAI-compatible chat endpoint (module doc)."""

    def __init__(
        self,
        url: str,
        model: str,
        *,
        clock: Clock,
        api_key: str | None = None,
        timeout_s: float = 2.0,
        output: Output = "rating",
        max_tokens: int | None = None,
        session_factory: Callable[[], aiohttp.ClientSession] = upstream_session,
    ) -> None:
        self._endpoint = url.rstrip("/") + "/chat/completions"
        self._model = model
        self._clock = clock
        self._timeout_s = timeout_s
        self._output: Output = output
        self._max_tokens = max_tokens if max_tokens is not None else MAX_TOKENS[output]
        self._headers = {"Content-Type": "application/json"}
        if api_key is not None:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._session_factory = session_factory
        self._session: aiohttp.ClientSession | None = None

    def body(self, prompt: JudgePrompt) -> dict[str, Any]:
        return {
            "model": self._model,
            "messages": prompt.messages(),
            "max_tokens": self._max_tokens,
            "temperature": 0,
        }

    async def judge(self, request: JudgeRequest) -> Verdict:
        data = orjson.dumps(self.body(_prompt(request, self._output)))
        headers = {**self._headers, JUDGED_MODEL_HEADER: request.judged_model}
        if self._session is None:
            self._session = self._session_factory()
        started = self._clock.now()
        try:
            async with asyncio.timeout(self._timeout_s):
                async with self._session.post(self._endpoint, data=data, headers=headers) as response:
                    status, raw = response.status, await response.read()
        except TimeoutError:
            return _failure(
                "timeout", self._clock.now() - started, f"no verdict within {self._timeout_s:g} s"
            )
        except aiohttp.ClientConnectionError as exc:
            return _failure(
                "unreachable", self._clock.now() - started, f"{type(exc).__name__}: {_clip(str(exc))}"
            )
        except aiohttp.ClientError as exc:
            return _failure(
                "http_error", self._clock.now() - started, f"{type(exc).__name__}: {_clip(str(exc))}"
            )
        latency_s = self._clock.now() - started
        if status != 200:
            outcome = "http_429" if status == 429 else "http_5xx" if 500 <= status < 600 else "http_error"
            return _failure(outcome, latency_s, f"HTTP {status}: {_clip(raw.decode('utf-8', 'replace'))}")
        try:
            return verdict_of(completion_of(orjson.loads(raw)), latency_s)
        except (orjson.JSONDecodeError, ValueError) as exc:
            return _failure("malformed", latency_s, f"a 200 not shaped like a chat completion: {exc}")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def completion_of(body: Any) -> CompletionResult:
    """An OpenAI chat completion body's first choice and usage; ValueError when it is not shaped like one."""
    try:
        choice = body["choices"][0]
        message = choice["message"]
        text, refusal, finish = message.get("content"), message.get("refusal"), choice.get("finish_reason")
        usage = body.get("usage") or {}
        counts = (usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0))
    except (KeyError, IndexError, TypeError, AttributeError) as exc:
        raise ValueError(f"missing {exc}") from None
    if not (text is None or isinstance(text, str)) or not (refusal is None or isinstance(refusal, str)):
        raise ValueError("message content or refusal is not text")
    if not (finish is None or isinstance(finish, str)):
        raise ValueError("finish_reason is not text")
    if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
        raise ValueError(f"usage counts {counts} are not non-negative integers")
    return CompletionResult(text or "", counts[0], counts[1], finish, refusal)


# ----------------------------------------------------------------------------------------------- cluster


class ClusterJudge:
    """A judge that is a model this gateway serves, reached through the gateway's own `ClusterComplete`."""

    def __init__(
        self,
        model: str,
        complete: ClusterComplete,
        *,
        clock: Clock,
        timeout_s: float = 2.0,
        output: Output = "rating",
        max_tokens: int | None = None,
    ) -> None:
        self._model = model
        self._complete = complete
        self._clock = clock
        self._timeout_s = timeout_s
        self._output: Output = output
        self._max_tokens = max_tokens if max_tokens is not None else MAX_TOKENS[output]

    async def judge(self, request: JudgeRequest) -> Verdict:
        messages = _prompt(request, self._output).messages()
        started = self._clock.now()
        try:
            async with asyncio.timeout(self._timeout_s):
                result = await self._complete(self._model, messages, self._max_tokens, self._timeout_s)
        except TimeoutError:
            return _failure(
                "timeout", self._clock.now() - started, f"no verdict within {self._timeout_s:g} s"
            )
        except JudgeTransportError as exc:
            return _failure(exc.outcome, self._clock.now() - started, exc.detail)
        return verdict_of(result, self._clock.now() - started)

    async def close(self) -> None:
        return None


# ----------------------------------------------------------------------------------------------- profile


def rating_from_profile(profile: QualityProfile, question: str, judged_model: str) -> float:
    """The 1-10 rating a profile-driven judge gives this model's answer to this question: the model's score on
    the item whose last question it is, else its marginal mean (`profile_rating`); QualityProfileError for a
    model the profile lacks. The `profile` judge and the judge stub answer with it."""
    index = profile.index_of(question)
    score = profile.mean_score(judged_model) if index is None else profile.scores(judged_model)[index].score
    return profile_rating(score)


class ProfileJudge:
    """The simulated fleet's judge: scores from a quality profile, never reading the answer (module doc)."""

    def __init__(self, profile: QualityProfile, *, clock: Clock, output: Output = "rating") -> None:
        self._profile = profile
        self._clock = clock
        self._output: Output = output

    def rating(self, question: str, judged_model: str) -> float:
        return rating_from_profile(self._profile, question, judged_model)

    async def judge(self, request: JudgeRequest) -> Verdict:
        started = self._clock.now()
        prompt_tokens = _prompt(request, self._output).estimated_tokens
        try:
            rating = self.rating(request.questions[-1], request.judged_model)
        except QualityProfileError as exc:
            return Verdict("malformed", None, prompt_tokens, 0, self._clock.now() - started, str(exc))
        return Verdict(
            "ok",
            rating * SCORE_SCALE,
            prompt_tokens,
            estimate_tokens(rating_reply(rating)),
            self._clock.now() - started,
        )

    async def close(self) -> None:
        return None


def build_judge(config: JudgeConfig, *, clock: Clock, complete: ClusterComplete | None = None) -> Judge:
    """The judge a cascade's config names. Raises ValueError for a cluster judge without `complete`, and
    QualityProfileError for a profile file that cannot be read (read here, once, at start)."""
    if config.kind == "openai":
        if config.url is None or config.model is None:
            raise ValueError("an openai judge needs url and model")
        return OpenAIJudge(
            config.url,
            config.model,
            clock=clock,
            api_key=config.api_key,
            timeout_s=config.timeout_s,
            output=config.output,
            max_tokens=_max_tokens(config),
        )
    if config.kind == "cluster":
        if config.model is None or complete is None:
            raise ValueError("a cluster judge needs model and the gateway's completion function")
        return ClusterJudge(
            config.model,
            complete,
            clock=clock,
            timeout_s=config.timeout_s,
            output=config.output,
            max_tokens=_max_tokens(config),
        )
    profile = load_profile(Path(config.profile) if config.profile is not None else None)
    return ProfileJudge(profile, clock=clock, output=config.output)
