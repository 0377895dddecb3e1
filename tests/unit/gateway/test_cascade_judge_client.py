"""The judge clients (gateway.cascade.judge): OpenAIJudge against a scripted in-process OpenAI server, the
cluster judge through a fake completion function, the profile judge, and `build_judge`."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.cascade.judge import (
    JUDGED_MODEL_HEADER,
    ClusterJudge,
    CompletionResult,
    JudgeRequest,
    JudgeTransportError,
    OpenAIJudge,
    ProfileJudge,
    Verdict,
    build_judge,
)
from gateway.cascade.judge_prompt import build_prompt
from gateway.cascade.quality import estimate_tokens, mt_bench_profile, to_json
from gateway.config import JudgeConfig
from switchyard.clock import ManualClock

Reply = Callable[[web.Request], Awaitable[web.StreamResponse]]


def completion(
    content: str | None,
    *,
    finish: str = "stop",
    refusal: str | None = None,
    usage: dict[str, int] | None = None,
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if refusal is not None:
        message["refusal"] = refusal
    return {
        "id": "c1",
        "object": "chat.completion",
        "model": "judge",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": usage
        if usage is not None
        else {"prompt_tokens": 321, "completion_tokens": 5, "total_tokens": 326},
    }


class JudgeServer:
    """An OpenAI-compatible server whose answer each test scripts (`reply`); it records what it received."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.reply: Reply = self.ok
        self.started = asyncio.Event()
        self.aborted = asyncio.Event()
        self.url = ""  # the base URL, ".../v1", once serving
        self.app = web.Application()
        self.app.router.add_post("/v1/chat/completions", self.chat)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        self.headers.append(dict(request.headers))
        return await self.reply(request)

    async def ok(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(completion("The answer is right and clear. Rating: [[9]]"))

    async def hang(self, request: web.Request) -> web.StreamResponse:
        """Never answers; records that the client went away (TestServer cancels the handler on disconnect)."""
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.aborted.set()
            raise
        raise AssertionError("unreachable")


REQUEST = JudgeRequest(
    questions=("What is superposition?",), answers=(), answer="A state that ...", judged_model="llama3-8b"
)


@pytest.fixture
async def judge_server() -> AsyncIterator[tuple[JudgeServer, OpenAIJudge, ManualClock]]:
    fake = JudgeServer()
    server = TestServer(fake.app)
    await server.start_server()
    clock = ManualClock(100.0)
    fake.url = str(server.make_url("/v1"))
    judge = OpenAIJudge(fake.url, "judge-model", clock=clock, api_key="sk-judge")
    yield fake, judge, clock
    await judge.close()
    await server.close()


async def test_ok_sends_fastchats_prompt_and_reads_the_rating_and_usage(
    judge_server: tuple[JudgeServer, OpenAIJudge, ManualClock],
) -> None:
    fake, judge, clock = judge_server

    async def slow_ok(request: web.Request) -> web.StreamResponse:
        clock.advance(0.25)  # the judge's latency is read from the injected clock
        return await fake.ok(request)

    fake.reply = slow_ok
    verdict = await judge.judge(REQUEST)
    assert verdict == Verdict("ok", 90.0, 321, 5, 0.25)
    prompt = build_prompt(REQUEST.questions, (), REQUEST.answer, "rating")
    assert fake.bodies == [
        {"model": "judge-model", "messages": prompt.messages(), "max_tokens": 8, "temperature": 0}
    ]
    assert fake.headers[0][JUDGED_MODEL_HEADER] == "llama3-8b"
    assert fake.headers[0]["Authorization"] == "Bearer sk-judge"
    second = JudgeRequest(("Q1", "Q2"), ("A1",), "A2", judged_model="llama3-70b")
    assert (await judge.judge(second)).outcome == "ok"
    assert fake.headers[1][JUDGED_MODEL_HEADER] == "llama3-70b"
    assert fake.bodies[1]["messages"] == build_prompt(("Q1", "Q2"), ("A1",), "A2", "rating").messages()


async def test_explain_sends_the_template_verbatim_with_1024_tokens(
    judge_server: tuple[JudgeServer, OpenAIJudge, ManualClock],
) -> None:
    fake, judge, clock = judge_server
    explain = OpenAIJudge(fake.url + "/", "judge-model", clock=clock, output="explain")
    try:
        assert (await explain.judge(REQUEST)).score == 90.0
    finally:
        await explain.close()
    body = fake.bodies[0]
    assert body["max_tokens"] == 1024
    assert body["messages"] == build_prompt(REQUEST.questions, (), REQUEST.answer, "explain").messages()
    assert "Authorization" not in fake.headers[0]


@pytest.mark.parametrize(
    ("status", "outcome"),
    [
        (429, "http_429"),
        (503, "http_5xx"),
        (500, "http_5xx"),
        (400, "http_error"),
        (401, "http_error"),
        (404, "http_error"),
    ],
)
async def test_http_failures(
    judge_server: tuple[JudgeServer, OpenAIJudge, ManualClock], status: int, outcome: str
) -> None:
    fake, judge, _ = judge_server

    async def fail(request: web.Request) -> web.StreamResponse:
        return web.json_response(
            {"error": {"message": "busy", "type": "x", "param": None, "code": None}}, status=status
        )

    fake.reply = fail
    verdict = await judge.judge(REQUEST)
    assert (verdict.outcome, verdict.score, verdict.prompt_tokens, verdict.completion_tokens) == (
        outcome,
        None,
        0,
        0,
    )
    assert verdict.detail.startswith(f"HTTP {status}: ") and "busy" in verdict.detail


@pytest.mark.parametrize(
    ("body", "outcome", "detail"),
    [
        (completion("A good answer, 9 out of 10."), "malformed", "no [[rating]]"),
        (completion("Rating: [[11]]"), "out_of_range", "outside [1, 10]"),
        (completion("Rating: [[0]]"), "out_of_range", "outside [1, 10]"),
        (completion(None, refusal="I can't help with that."), "refused", "refusal: I can't help"),
        (completion("Rating: [[9]]", refusal="no"), "refused", "refusal"),
        (completion("", finish="content_filter"), "refused", "content_filter"),
        (completion("Rating: [[9]]", finish="content_filter"), "refused", "content_filter"),
        (completion("  \n"), "refused", "empty"),
        (completion(None), "refused", "empty"),
        ({"choices": []}, "malformed", "not shaped"),
        ({"choices": [{"message": {"content": 7}}]}, "malformed", "not text"),
        (
            completion("Rating: [[9]]", usage={"prompt_tokens": -1, "completion_tokens": 1}),
            "malformed",
            "usage",
        ),
    ],
)
async def test_answers_that_are_no_verdict(
    judge_server: tuple[JudgeServer, OpenAIJudge, ManualClock],
    body: dict[str, Any],
    outcome: str,
    detail: str,
) -> None:
    fake, judge, _ = judge_server

    async def answer(request: web.Request) -> web.StreamResponse:
        return web.json_response(body)

    fake.reply = answer
    verdict = await judge.judge(REQUEST)
    assert (verdict.outcome, verdict.score) == (outcome, None)
    assert detail in verdict.detail
    if outcome in ("out_of_range", "refused") and "usage" in body:
        assert (verdict.prompt_tokens, verdict.completion_tokens) == (
            321,
            5,
        )  # the judge's tokens still count


async def test_a_200_that_is_not_json_is_malformed(
    judge_server: tuple[JudgeServer, OpenAIJudge, ManualClock],
) -> None:
    fake, judge, _ = judge_server

    async def html(request: web.Request) -> web.StreamResponse:
        return web.Response(text="<html>proxy</html>", content_type="text/html")

    fake.reply = html
    verdict = await judge.judge(REQUEST)
    assert verdict.outcome == "malformed"


async def test_usage_missing_counts_zero(judge_server: tuple[JudgeServer, OpenAIJudge, ManualClock]) -> None:
    fake, judge, _ = judge_server

    async def bare(request: web.Request) -> web.StreamResponse:
        return web.json_response({"choices": [{"message": {"content": "Rating: [[7]]"}}]})

    fake.reply = bare
    assert await judge.judge(REQUEST) == Verdict("ok", 70.0, 0, 0, 0.0)


async def test_a_slow_judge_times_out_and_the_server_sees_the_abort(
    judge_server: tuple[JudgeServer, OpenAIJudge, ManualClock],
) -> None:
    fake, judge, clock = judge_server
    fake.reply = fake.hang
    quick = OpenAIJudge(fake.url, "judge-model", clock=clock, timeout_s=0.05)
    try:
        verdict = await quick.judge(REQUEST)
    finally:
        await quick.close()
    assert (verdict.outcome, verdict.score, verdict.detail) == ("timeout", None, "no verdict within 0.05 s")
    await asyncio.wait_for(fake.aborted.wait(), 5.0)


async def test_cancelling_the_caller_aborts_the_http_request(
    judge_server: tuple[JudgeServer, OpenAIJudge, ManualClock],
) -> None:
    fake, judge, _ = judge_server
    fake.reply = fake.hang
    task = asyncio.create_task(judge.judge(REQUEST))
    await asyncio.wait_for(fake.started.wait(), 5.0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(
        fake.aborted.wait(), 5.0
    )  # the connection closed: the server's handler was cancelled


async def test_an_unreachable_judge() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    judge = OpenAIJudge(f"http://127.0.0.1:{port}/v1", "judge-model", clock=ManualClock())
    try:
        verdict = await judge.judge(REQUEST)
    finally:
        await judge.close()
    assert (verdict.outcome, verdict.score) == ("unreachable", None)
    assert "Connect" in verdict.detail


# ----------------------------------------------------------------------------------------------- cluster


async def test_the_cluster_judge_sends_the_same_prompt_through_the_gateway() -> None:
    calls: list[tuple[str, list[dict[str, str]], int, float]] = []

    async def complete(
        model: str, messages: list[dict[str, str]], max_tokens: int, timeout_s: float
    ) -> CompletionResult:
        calls.append((model, messages, max_tokens, timeout_s))
        return CompletionResult("Rating: [[8.5]]", 300, 6, "stop")

    judge = ClusterJudge("llama3-70b", complete, clock=ManualClock(), timeout_s=1.5)
    assert await judge.judge(REQUEST) == Verdict("ok", 85.0, 300, 6, 0.0)
    prompt = build_prompt(REQUEST.questions, (), REQUEST.answer, "rating")
    assert calls == [("llama3-70b", prompt.messages(), 8, 1.5)]
    await judge.close()


@pytest.mark.parametrize(
    ("raise_or_return", "outcome"),
    [
        (JudgeTransportError("http_429", "pool at its limit"), "http_429"),
        (JudgeTransportError("http_5xx", "engine failed"), "http_5xx"),
        (JudgeTransportError("unreachable", "no engine serves llama3-70b"), "unreachable"),
        (CompletionResult("", 10, 0, "stop", refusal="no"), "refused"),
        (CompletionResult("meh", 10, 1, "stop"), "malformed"),
        (CompletionResult("Rating: [[42]]", 10, 1, "stop"), "out_of_range"),
    ],
)
async def test_cluster_failures(
    raise_or_return: CompletionResult | JudgeTransportError, outcome: str
) -> None:
    async def complete(
        model: str, messages: list[dict[str, str]], max_tokens: int, timeout_s: float
    ) -> CompletionResult:
        if isinstance(raise_or_return, Exception):
            raise raise_or_return
        return raise_or_return

    verdict = await ClusterJudge("judge", complete, clock=ManualClock()).judge(REQUEST)
    assert (verdict.outcome, verdict.score) == (outcome, None)
    if isinstance(raise_or_return, JudgeTransportError):
        assert verdict.detail == raise_or_return.detail


async def test_a_slow_cluster_judge_times_out() -> None:
    async def never(
        model: str, messages: list[dict[str, str]], max_tokens: int, timeout_s: float
    ) -> CompletionResult:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    verdict = await ClusterJudge("judge", never, clock=ManualClock(), timeout_s=0.02).judge(REQUEST)
    assert verdict.outcome == "timeout"


def test_transport_errors_name_a_transport_outcome() -> None:
    with pytest.raises(ValueError, match="not a transport outcome"):
        JudgeTransportError("malformed", "x")


# ----------------------------------------------------------------------------------------------- profile


async def test_the_profile_judge_scores_by_question_text() -> None:
    profile = mt_bench_profile()
    judge = ProfileJudge(profile, clock=ManualClock())
    for index in (0, 1, 57):
        item = profile.items[index]
        answers = ("an earlier answer",) * (len(item.questions) - 1)
        request = JudgeRequest(item.questions, answers, "whatever it wrote", "llama3-70b")
        verdict = await judge.judge(request)
        prompt = build_prompt(item.questions, answers, "whatever it wrote", "rating")
        score = profile.scores("llama3-70b")[index].score
        assert verdict == Verdict(
            "ok", score, prompt.estimated_tokens, estimate_tokens(f"Rating: [[{score / 10:g}]]"), 0.0
        )


async def test_the_profile_judge_keeps_a_half_point_rating() -> None:
    profile = mt_bench_profile()
    index = next(i for i, s in enumerate(profile.scores("llama3-8b")) if s.score == 85.0)
    item = profile.items[index]
    request = JudgeRequest(item.questions, ("a",) * (len(item.questions) - 1), "b", "llama3-8b")
    verdict = await ProfileJudge(profile, clock=ManualClock()).judge(request)
    assert (verdict.score, verdict.completion_tokens) == (85.0, estimate_tokens("Rating: [[8.5]]"))


async def test_the_profile_judge_falls_back_to_the_models_marginal() -> None:
    profile = mt_bench_profile()
    judge = ProfileJudge(profile, clock=ManualClock())
    request = JudgeRequest(("A question the profile never saw",), (), "x", "llama3-8b")
    assert profile.mean_score("llama3-8b") == pytest.approx(83.4, abs=0.01)
    assert (await judge.judge(request)).score == 80.0  # 83.4 rounded to a rating a judge gives
    strong = JudgeRequest(("A question the profile never saw",), (), "x", "llama3-70b")
    assert (await judge.judge(strong)).score == 90.0  # 92.3


async def test_the_profile_judge_does_not_know_every_model() -> None:
    verdict = await ProfileJudge(mt_bench_profile(), clock=ManualClock()).judge(
        JudgeRequest(("q",), (), "a", "gpt-5")
    )
    assert (verdict.outcome, verdict.score) == ("malformed", None)
    assert "gpt-5" in verdict.detail and verdict.prompt_tokens > 0


# ------------------------------------------------------------------------------------------ types, builder


def test_verdicts_and_requests_are_checked() -> None:
    with pytest.raises(ValueError, match="needs score"):
        Verdict("ok", None, 0, 0, 0.0)
    with pytest.raises(ValueError, match="has no score"):
        Verdict("timeout", 50.0, 0, 0, 0.0)
    with pytest.raises(ValueError, match="unknown judge outcome"):
        Verdict("late", None, 0, 0, 0.0)
    with pytest.raises(ValueError, match="takes 1 earlier answers, got 0"):
        JudgeRequest(("q1", "q2"), (), "a", "m")


async def test_build_judge_makes_each_kind(tmp_path: Path) -> None:
    clock = ManualClock()
    openai = build_judge(
        JudgeConfig(
            kind="openai",
            url="http://judge:8080/v1",
            model="j",
            timeout_s=0.5,
            output="explain",
            max_tokens=64,
        ),
        clock=clock,
    )
    assert isinstance(openai, OpenAIJudge)
    assert openai.body(build_prompt(("q",), (), "a", "explain"))["max_tokens"] == 64
    await openai.close()
    with pytest.raises(ValueError, match="completion function"):
        build_judge(JudgeConfig(kind="cluster", model="llama3-70b"), clock=clock)

    async def complete(
        model: str, messages: list[dict[str, str]], max_tokens: int, timeout_s: float
    ) -> CompletionResult:
        return CompletionResult("Rating: [[6]]", 1, 1, "stop")

    cluster = build_judge(JudgeConfig(kind="cluster", model="llama3-70b"), clock=clock, complete=complete)
    assert isinstance(cluster, ClusterJudge) and (await cluster.judge(REQUEST)).score == 60.0
    shipped = build_judge(JudgeConfig(kind="profile"), clock=clock)
    assert isinstance(shipped, ProfileJudge)
    small = mt_bench_profile().take([0, 1])
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(to_json(small)))
    custom = build_judge(JudgeConfig(kind="profile", profile=str(path)), clock=clock)
    item = small.items[0]
    verdict = await custom.judge(JudgeRequest(item.questions, (), "a", "llama3-8b"))
    assert verdict.score == small.scores("llama3-8b")[0].score
