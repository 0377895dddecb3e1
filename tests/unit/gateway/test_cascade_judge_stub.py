"""The judge stub (gateway.cascade.judge_stub): it rates from the quality profile by the judged-model header
and the question in the prompt, injects its seeded faults, and round-trips with the OpenAI judge client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.cascade.judge import JUDGED_MODEL_HEADER, JudgeRequest, OpenAIJudge
from gateway.cascade.judge_prompt import build_prompt, profile_rating, rating_reply
from gateway.cascade.judge_stub import MALFORMED_REPLY, STUB_COUNTS, build_stub_app, main, serve_stub
from gateway.cascade.quality import QualityProfile, estimate_tokens, mt_bench_profile
from switchyard.clock import ManualClock

WEAK, STRONG = "llama3-8b", "llama3-70b"


def _answers(n_questions: int) -> tuple[str, ...]:
    return tuple(f"earlier answer {i}" for i in range(n_questions - 1))


def _body(
    questions: tuple[str, ...], answer: str = "the answer", output: str = "rating", max_tokens: int | None = 8
) -> dict[str, Any]:
    prompt = build_prompt(questions, _answers(len(questions)), answer, output)  # type: ignore[arg-type]
    body: dict[str, Any] = {"model": "judge", "messages": prompt.messages(), "temperature": 0}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body


async def _client(app: web.Application) -> TestClient[web.Request, web.Application]:
    client = TestClient(TestServer(app))
    await client.start_server()
    return client


@pytest.fixture
async def stub() -> AsyncIterator[TestClient[web.Request, web.Application]]:
    client = await _client(build_stub_app(mt_bench_profile()))
    yield client
    await client.close()


async def _post(
    client: TestClient[web.Request, web.Application], body: dict[str, Any], model: str | None = WEAK
) -> tuple[int, dict[str, Any]]:
    headers = {JUDGED_MODEL_HEADER: model} if model is not None else {}
    async with client.post("/v1/chat/completions", json=body, headers=headers) as response:
        return response.status, await response.json()


async def test_the_stub_rates_from_the_profile(stub: TestClient[web.Request, web.Application]) -> None:
    profile = mt_bench_profile()
    for index in (0, 1, 40, 41, 159):
        item = profile.items[index]
        for model in (WEAK, STRONG):
            body = _body(item.questions)
            status, answer = await _post(stub, body, model)
            rating = profile_rating(profile.scores(model)[index].score)
            assert status == 200
            assert answer["choices"][0]["message"] == {"role": "assistant", "content": rating_reply(rating)}
            assert answer["choices"][0]["finish_reason"] == "stop"
            prompt_tokens = sum(estimate_tokens(m["content"]) for m in body["messages"])
            assert answer["usage"] == {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": estimate_tokens(rating_reply(rating)),
                "total_tokens": prompt_tokens + estimate_tokens(rating_reply(rating)),
            }
    counts = stub.app[STUB_COUNTS]
    assert (counts.requests, counts.rated, counts.by_marginal, counts.failed) == (10, 10, 0, 0)


async def test_unknown_questions_get_the_marginal_and_bad_requests_a_400(
    stub: TestClient[web.Request, web.Application],
) -> None:
    status, answer = await _post(stub, _body(("Never asked in MT-Bench",)), STRONG)
    assert (status, answer["choices"][0]["message"]["content"]) == (200, "Rating: [[9]]")  # 92.3
    status, answer = await _post(stub, _body(("q",)), model=None)
    assert status == 400 and JUDGED_MODEL_HEADER in answer["error"]["message"]
    status, answer = await _post(stub, _body(("q",)), model="gpt-5")
    assert (status, answer["error"]["code"]) == (400, "model_not_found")
    status, answer = await _post(stub, {"messages": "no"})
    assert (status, answer["error"]["type"]) == (400, "invalid_request_error")
    counts = stub.app[STUB_COUNTS]
    assert (counts.requests, counts.rated, counts.by_marginal, counts.rejected) == (4, 1, 1, 3)


async def test_explain_prompts_get_a_sentence_and_max_tokens_cuts(
    stub: TestClient[web.Request, web.Application],
) -> None:
    item = mt_bench_profile().items[0]
    status, answer = await _post(stub, _body(item.questions, output="explain", max_tokens=None))
    text = answer["choices"][0]["message"]["content"]
    assert status == 200 and text.endswith(
        rating_reply(profile_rating(mt_bench_profile().scores(WEAK)[0].score))
    )
    assert "quality profile" in text
    status, answer = await _post(stub, _body(item.questions, output="explain", max_tokens=3))
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 3


async def test_models_and_health(stub: TestClient[web.Request, web.Application]) -> None:
    async with stub.get("/v1/models") as response:
        assert [m["id"] for m in (await response.json())["data"]] == ["switchyard-judge-stub"]
    async with stub.get("/health") as response:
        assert response.status == 200


async def test_fail_and_malformed_rates() -> None:
    item = mt_bench_profile().items[0]
    failing = await _client(build_stub_app(mt_bench_profile(), fail_rate=1.0))
    try:
        for _ in range(3):
            status, answer = await _post(failing, _body(item.questions))
            assert (status, answer["error"]["type"], answer["error"]["code"]) == (
                503,
                "service_unavailable",
                "injected_failure",
            )
    finally:
        await failing.close()
    garbled = await _client(build_stub_app(mt_bench_profile(), malformed_rate=1.0))
    try:
        status, answer = await _post(garbled, _body(item.questions))
        assert (status, answer["choices"][0]["message"]["content"]) == (200, MALFORMED_REPLY)
    finally:
        await garbled.close()


async def test_faults_follow_the_seed() -> None:
    item = mt_bench_profile().items[0]

    async def statuses(seed: int) -> list[tuple[int, str]]:
        client = await _client(
            build_stub_app(mt_bench_profile(), fail_rate=0.3, malformed_rate=0.3, seed=seed)
        )
        seen: list[tuple[int, str]] = []
        try:
            for _ in range(40):
                status, answer = await _post(client, _body(item.questions))
                seen.append((status, answer["choices"][0]["message"]["content"] if status == 200 else ""))
            counts = client.app[STUB_COUNTS]
            assert counts.failed + counts.malformed + counts.rated == 40
        finally:
            await client.close()
        return seen

    first = await statuses(7)
    assert first == await statuses(7)
    kinds = {(s, text == MALFORMED_REPLY) for s, text in first}
    assert kinds == {(503, False), (200, True), (200, False)}  # 40 draws at 0.3 / 0.3 hit each kind


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="fail_rate"):
        build_stub_app(mt_bench_profile(), fail_rate=1.5)
    with pytest.raises(ValueError, match="delay_ms"):
        build_stub_app(mt_bench_profile(), delay_ms=-1)
    assert main(["--port", "0", "--malformed-rate", "-0.1"]) == 2
    assert main(["--port", "0", "--profile", "/nonexistent/profile.json"]) == 2


# --------------------------------------------------------------------------------- the client round trip


async def _judge_all(profile: QualityProfile, model: str, url: str) -> list[float | None]:
    judge = OpenAIJudge(url, "judge", clock=ManualClock(), timeout_s=30.0)
    try:
        scores = []
        for item in profile.items:
            request = JudgeRequest(item.questions, _answers(len(item.questions)), "an answer", model)
            scores.append((await judge.judge(request)).score)
        return scores
    finally:
        await judge.close()


async def test_the_openai_judge_through_the_stub_routes_as_the_profile_does() -> None:
    profile = mt_bench_profile()
    server = TestServer(build_stub_app(profile))
    await server.start_server()
    try:
        weak = await _judge_all(profile, WEAK, str(server.make_url("/v1")))
    finally:
        await server.close()
    assert weak == [s.score for s in profile.scores(WEAK)]  # all 160 items, 85 included
    escalated = sum(1 for score in weak if score is not None and score < 90.0) / len(weak)
    assert escalated == profile.route([WEAK, STRONG], [90.0]).escalated_share == 0.275


async def test_stub_faults_reach_the_client_as_verdicts() -> None:
    item = mt_bench_profile().items[0]
    request = JudgeRequest(item.questions, (), "a", WEAK)
    outcomes = []
    for fail_rate, malformed_rate in ((1.0, 0.0), (0.0, 1.0)):
        server = TestServer(
            build_stub_app(mt_bench_profile(), fail_rate=fail_rate, malformed_rate=malformed_rate)
        )
        await server.start_server()
        judge = OpenAIJudge(str(server.make_url("/v1")), "judge", clock=ManualClock())
        try:
            outcomes.append((await judge.judge(request)).outcome)
        finally:
            await judge.close()
            await server.close()
    assert outcomes == ["http_5xx", "malformed"]
    slow = TestServer(build_stub_app(mt_bench_profile(), delay_ms=10_000))
    await slow.start_server()
    judge = OpenAIJudge(str(slow.make_url("/v1")), "judge", clock=ManualClock(), timeout_s=0.05)
    try:
        assert (await judge.judge(request)).outcome == "timeout"
    finally:
        await judge.close()
        await slow.close()


async def test_serve_stub_listens_until_stopped() -> None:
    stop = asyncio.Event()
    listening: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        serve_stub(
            "127.0.0.1",
            0,
            profile=mt_bench_profile(),
            stop=stop,
            on_listening=listening.set_result,
            handle_signals=False,
        )
    )
    url = await asyncio.wait_for(listening, 10.0)
    async with aiohttp.ClientSession() as session, session.get(url + "/health") as response:
        assert response.status == 200
    stop.set()
    await asyncio.wait_for(task, 10.0)
