"""Cascades live (Cascadia): two sim pools (llama3-8b, llama3-70b) behind the gateway, judge stubs scoring
from the quality profile, the official `openai` client. Accept, escalate, the judge down / slow / malformed,
an empty next pool, a client that leaves during the judge; usage equal to the engines' counts; and stage
shares that equal the simulator's on the same items."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
from agent_process import Agent, cascade_pools, free_port
from aiohttp import web
from openai import AsyncOpenAI

from gateway.app import running
from gateway.cascade.judge_stub import STUB_COUNTS, build_stub_app
from gateway.cascade.quality import mt_bench_profile
from gateway.config import GatewayConfig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

PROFILE = mt_bench_profile()
WEAK = PROFILE.scores("llama3-8b")
TURN_ONE = [i for i, item in enumerate(PROFILE.items) if item.turn == 1]
ACCEPTED = next(i for i in TURN_ONE if WEAK[i].score >= 90)
ESCALATED = next(i for i in TURN_ONE if WEAK[i].score < 90)
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Agent, Agent]]:
    with cascade_pools(tmp_path_factory.mktemp("gateway-cascade")) as pools:
        yield pools


@contextlib.asynccontextmanager
async def stub(**options: Any) -> AsyncIterator[tuple[str, web.Application]]:
    app = build_stub_app(**options)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}/v1", app
    finally:
        await runner.cleanup()


def cascade(name: str, url: str, **over: Any) -> dict[str, Any]:
    return {
        "name": name,
        "judge": {"kind": "openai", "url": url, "model": "judge", **over.pop("judge", {})},
        "stages": over.pop("stages", [{"model": "llama3-8b", "threshold": 90}, {"model": "llama3-70b"}]),
        **over,
    }


@contextlib.asynccontextmanager
async def served(agents: tuple[Agent, Agent], name: str) -> AsyncIterator[str]:
    """The gateway over `agents` serving cascade `name` (llama3-8b at 90, then llama3-70b); stub judge."""
    async with stub() as (judge_url, _):
        config = GatewayConfig(
            port=0, engines=tuple(a.target for a in agents), cascades=[cascade(name, judge_url)]
        )  # type: ignore[list-item]
        async with running(config, ready_engines=2) as url:
            yield url


def messages(index: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": PROFILE.items[index].questions[0]}]


async def ask(url: str, model: str, index: int, **extra: Any) -> tuple[dict[str, str], dict[str, Any]]:
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    try:
        raw = await client.chat.completions.with_raw_response.create(
            model=model,
            messages=messages(index),
            max_tokens=MAX_TOKENS,  # type: ignore[arg-type]
            extra_body={"ignore_eos": True},
            **extra,
        )
        return dict(raw.headers), raw.parse().model_dump()
    finally:
        await client.close()


async def metric_lines(url: str, prefix: str) -> list[str]:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
        return [line for line in (await resp.text()).splitlines() if line.startswith(prefix)]


async def test_accept_escalate_and_usage_equal_to_the_engines(agents: tuple[Agent, Agent]) -> None:
    async with stub() as (judge_url, judge_app):
        config = GatewayConfig(
            port=0, engines=tuple(a.target for a in agents), cascades=[cascade("cascade-llama3", judge_url)]
        )  # type: ignore[list-item]
        async with running(config, ready_engines=2) as url:
            _, direct = await ask(url, "llama3-8b", ESCALATED)
            headers, body = await ask(url, "cascade-llama3", ACCEPTED)
            assert (headers["x-switchyard-cascade-stage"], headers["x-switchyard-cascade-model"]) == (
                "0",
                "llama3-8b",
            )
            assert headers["x-switchyard-cascade-scores"] == f"{WEAK[ACCEPTED].score:g}"
            assert body["model"] == "cascade-llama3"
            usage = body["usage"]
            assert usage["completion_tokens"] == MAX_TOKENS
            assert usage["cascade"]["stages"][0]["judge"]["outcome"] == "ok"
            assert usage["cascade"]["judge_prompt_tokens"] > 0  # the judge's tokens, apart from the usage

            headers, body = await ask(url, "cascade-llama3", ESCALATED)
            assert (headers["x-switchyard-cascade-stage"], headers["x-switchyard-cascade-model"]) == (
                "1",
                "llama3-70b",
            )
            usage = body["usage"]
            stages = usage["cascade"]["stages"]
            assert [s["decision"] for s in stages] == ["escalated", "answered"]
            assert stages[0]["reason"] == "below_threshold"
            # The client pays for both stages: each the engines' exact counts of the same prompt.
            assert usage["completion_tokens"] == 2 * MAX_TOKENS
            assert usage["prompt_tokens"] == 2 * direct["usage"]["prompt_tokens"]
            assert judge_app[STUB_COUNTS].rated == 2

            answers = await metric_lines(url, "switchyard_cascade_answers_total")
            assert any('stage="1"' in line and line.endswith(" 1.0") for line in answers), answers


async def test_streamed_escalation_carries_cascade_usage_in_the_final_chunk(
    agents: tuple[Agent, Agent],
) -> None:
    async with served(agents, "c") as url:
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        try:
            async with client.chat.completions.with_streaming_response.create(
                model="c",
                messages=messages(ESCALATED),
                max_tokens=MAX_TOKENS,  # type: ignore[arg-type]
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            ) as response:
                assert response.headers["x-switchyard-cascade-model"] == "llama3-70b"
                chunks = [chunk async for chunk in await response.parse()]
        finally:
            await client.close()
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text
        usage = chunks[-1].model_dump()["usage"]
        assert usage["completion_tokens"] == 2 * MAX_TOKENS
        assert usage["cascade"]["answering_model"] == "llama3-70b"


@pytest.mark.parametrize(
    ("stub_options", "judge", "reason"),
    [
        (None, {}, "judge_unreachable"),  # nothing listens on the judge's port
        ({"delay_ms": 1500}, {"timeout_s": 0.3}, "judge_timeout"),
        ({"malformed_rate": 1.0}, {}, "judge_malformed"),
        ({"fail_rate": 1.0}, {}, "judge_http_5xx"),
    ],
)
async def test_judge_failures_escalate_with_the_reason(
    agents: tuple[Agent, Agent], stub_options: dict[str, Any] | None, judge: dict[str, Any], reason: str
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        judge_url = (
            f"http://127.0.0.1:{free_port()}/v1"
            if stub_options is None
            else (await stack.enter_async_context(stub(**stub_options)))[0]
        )
        config = GatewayConfig(
            port=0, engines=tuple(a.target for a in agents), cascades=[cascade("c", judge_url, judge=judge)]
        )  # type: ignore[list-item]
        async with running(config, ready_engines=2) as url:
            headers, body = await ask(url, "c", ACCEPTED)  # the judge would have accepted it
            assert headers["x-switchyard-cascade-model"] == "llama3-70b"
            assert headers["x-switchyard-cascade-scores"] == "-"
            assert body["usage"]["cascade"]["stages"][0]["reason"] == reason
            escalations = await metric_lines(url, "switchyard_cascade_escalations_total")
            assert any(f'reason="{reason}"' in line for line in escalations), escalations


async def test_accept_on_judge_failure_an_empty_next_pool_and_an_empty_first_pool(
    agents: tuple[Agent, Agent],
) -> None:
    async with stub(malformed_rate=1.0) as (bad_url, _), stub() as (judge_url, _):
        cascades = [
            cascade("lenient", bad_url, on_judge_failure="accept"),
            cascade(
                "nowhere",
                judge_url,
                stages=[{"model": "llama3-8b", "threshold": 100}, {"model": "qwen2.5-14b"}],
            ),
            cascade(
                "headless",
                judge_url,
                stages=[{"model": "qwen2.5-14b", "threshold": 90}, {"model": "llama3-70b"}],
            ),
        ]
        config = GatewayConfig(port=0, engines=tuple(a.target for a in agents), cascades=cascades)  # type: ignore[arg-type]
        async with running(config, ready_engines=2) as url:
            headers, body = await ask(url, "lenient", ESCALATED)
            assert headers["x-switchyard-cascade-model"] == "llama3-8b"
            assert body["usage"]["cascade"]["stages"][0]["reason"] == "judge_malformed"
            headers, body = await ask(url, "nowhere", ESCALATED)
            assert headers["x-switchyard-cascade-model"] == "llama3-8b"
            assert headers["x-switchyard-cascade-degraded"] == "true"
            assert body["usage"]["cascade"]["degraded"] is True
            assert body["choices"][0]["message"]["content"]
            # No engine serves the first stage and nothing is held: the request starts on the next stage.
            headers, body = await ask(url, "headless", ESCALATED)
            assert headers["x-switchyard-cascade-model"] == "llama3-70b"
            assert "x-switchyard-cascade-degraded" not in headers
            stages = body["usage"]["cascade"]["stages"]
            assert [s["decision"] for s in stages] == ["failed", "answered"]
            assert body["usage"]["completion_tokens"] == stages[1]["completion_tokens"] == MAX_TOKENS


async def test_refusals_and_a_client_that_leaves_during_the_judge(agents: tuple[Agent, Agent]) -> None:
    async with stub(delay_ms=3000) as (slow_url, judge_app):
        config = GatewayConfig(
            port=0,
            engines=tuple(a.target for a in agents),
            cascades=[cascade("c", slow_url, judge={"timeout_s": 10})],
        )  # type: ignore[list-item]
        async with running(config, ready_engines=2) as url:
            async with aiohttp.ClientSession() as http:
                for body, param in (({"n": 2}, "n"), ({}, "prompt")):
                    path = "/v1/chat/completions" if param == "n" else "/v1/completions"
                    payload = (
                        {"model": "c", "messages": messages(ACCEPTED), **body}
                        if param == "n"
                        else {"model": "c", "prompt": [1, 2, 3]}
                    )
                    async with http.post(f"{url}{path}", json=payload) as resp:
                        assert resp.status == 400
                        assert (await resp.json())["error"]["param"] == param
                task = asyncio.create_task(
                    http.post(
                        f"{url}/v1/chat/completions",
                        json={"model": "c", "messages": messages(ACCEPTED), "max_tokens": MAX_TOKENS},
                    )
                )
                while judge_app[STUB_COUNTS].requests == 0:  # noqa: ASYNC110 (the judge has the answer: leave)
                    await asyncio.sleep(0.02)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            for _ in range(100):
                if any(
                    line.endswith(" 1.0")
                    for line in await metric_lines(url, "switchyard_client_disconnects_total")
                ):
                    break
                await asyncio.sleep(0.05)
            assert await metric_lines(url, "switchyard_requests_in_flight") == [
                "switchyard_requests_in_flight 0.0"
            ]
            assert await metric_lines(url, "switchyard_cascade_answers_total") == []


@pytest.fixture(scope="module")
def simulated() -> tuple[list[Any], float]:
    """The simulator's run of 40 drawn items (outside the event loop: it is CPU work)."""
    from gateway.cascade.core import parse_cascade  # noqa: PLC0415
    from loadgen.arrivals import ArrivalSpec, schedule  # noqa: PLC0415
    from loadgen.simulate import SimOptions, parse_engines, simulate  # noqa: PLC0415
    from loadgen.simulate.cascade import CascadeSim, cascade_requests  # noqa: PLC0415

    requests = cascade_requests(PROFILE, "mt-bench", 40, seed=7, first_model="llama3-8b")
    spec = parse_cascade("c=llama3-8b:90,llama3-70b")
    sim = simulate(
        schedule(requests, ArrivalSpec(rate_per_s=4.0, seed=7)),
        parse_engines("h100-llama3-8b:1,h100x4-llama3-70b:1"),
        SimOptions(cascade=CascadeSim(spec, PROFILE), seed=7),
    )
    assert sim.cascade is not None
    return list(requests), float(sim.cascade["escalated_share"])


async def test_live_stage_shares_equal_the_simulators(
    agents: tuple[Agent, Agent], simulated: tuple[list[Any], float]
) -> None:
    requests, sim_escalated = simulated
    async with served(agents, "c") as url:
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        try:

            async def one(messages_: Any) -> str:
                raw = await client.chat.completions.with_raw_response.create(
                    model="c", messages=messages_, max_tokens=4
                )
                return raw.headers["x-switchyard-cascade-stage"]

            stages = await asyncio.gather(
                *(one([{"role": r, "content": c} for r, c in req.messages or ()]) for req in requests)
            )
        finally:
            await client.close()
    live_escalated = stages.count("1") / len(stages)
    assert abs(live_escalated - sim_escalated) <= 0.02
