"""The official `openai` client against a real gateway in front of two real sim engine agents (subprocesses).

One fleet (two agents, one gateway in this event loop) serves the read-only tests; the test that kills an
agent gets a fleet of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

import openai
import pytest
import pytest_asyncio
from aiohttp import web
from openai import AsyncOpenAI

from gateway.app import METRICS_KEY, STORE_KEY, build_app, running
from gateway.config import GatewayConfig
from launcher.local_fleet import AgentSpec, LocalFleet

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

PROFILE = "h100-llama3-8b"
MODEL = "llama3-8b"
LONG = {"ignore_eos": True}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Running:
    fleet: LocalFleet
    app: web.Application
    client: AsyncOpenAI

    def running_requests(self) -> dict[str, int]:
        return {e.engine_id: e.num_running + e.num_waiting for e in self.app[STORE_KEY].snapshot().engines}

    def inflight(self) -> int:
        return sum(e.inflight_requests for e in self.app[STORE_KEY].snapshot().engines)


@contextlib.asynccontextmanager
async def running_fleet(prefix: str) -> AsyncIterator[Running]:
    specs = [AgentSpec(f"{prefix}-{i}", PROFILE, free_port()) for i in range(2)]
    async with LocalFleet(specs, start_timeout_s=90.0, stop_grace_s=5.0) as fleet:
        config = GatewayConfig(
            port=0, engines=tuple(s.address for s in specs), drain_timeout_s=2.0, stale_after_s=2.0
        )
        app = build_app(config)
        async with (
            running(config, app=app, ready_engines=2) as base_url,
            AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0) as client,
        ):
            yield Running(fleet, app, client)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def gw() -> AsyncIterator[Running]:
    async with running_fleet("it") as running:
        yield running


async def wait_until(predicate: object, timeout_s: float = 10.0) -> bool:
    assert callable(predicate)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return bool(predicate())


async def test_models(gw: Running) -> None:
    models = await gw.client.models.list()
    assert [m.id for m in models.data] == [MODEL]


async def test_chat_non_streaming(gw: Running) -> None:
    reply = await gw.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=12, extra_body=LONG
    )
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 12 and reply.usage.prompt_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 12


async def test_chat_streaming_with_usage_chunk(gw: Running) -> None:
    stream = await gw.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Stream please"}],
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=LONG,
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 10
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text
    assert len({c.id for c in chunks}) == 1


async def test_completions_streaming_and_not(gw: Running) -> None:
    reply = await gw.client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=8, extra_body=LONG
    )
    assert reply.object == "text_completion" and reply.choices[0].text
    assert reply.usage is not None and reply.usage.completion_tokens == 8
    stream = await gw.client.completions.create(
        model=MODEL, prompt=[1, 2, 3, 4], max_tokens=5, stream=True, extra_body=LONG
    )
    chunks = [c async for c in stream]
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_n2_streams_two_choices(gw: Running) -> None:
    stream = await gw.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Two please"}],
        max_tokens=6,
        n=2,
        seed=1,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=LONG,
    )
    finishes: dict[int, str] = {}
    usage = None
    async for c in stream:
        for choice in c.choices:
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
        usage = c.usage or usage
    assert finishes == {0: "length", 1: "length"}
    assert usage is not None and usage.completion_tokens == 12
    reply = await gw.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Two please"}], max_tokens=4, n=2, extra_body=LONG
    )
    assert [c.index for c in reply.choices] == [0, 1]


async def test_stop_sequence_is_honoured(gw: Running) -> None:
    base = await gw.client.completions.create(
        model=MODEL, prompt="Tell me", max_tokens=40, seed=5, temperature=0.0, extra_body=LONG
    )
    text = base.choices[0].text
    stop = text[len(text) // 2 :][:3]
    assert stop.strip()
    stopped = await gw.client.completions.create(
        model=MODEL, prompt="Tell me", max_tokens=40, seed=5, temperature=0.0, stop=[stop], extra_body=LONG
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stop not in stopped.choices[0].text
    assert len(stopped.choices[0].text) < len(text)


async def test_invalid_input_and_unknown_model(gw: Running) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        await gw.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=7.0
        )
    assert bad.value.param == "temperature"
    with pytest.raises(openai.NotFoundError) as missing:
        await gw.client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "x"}]
        )
    assert missing.value.code == "model_not_found"


async def test_client_disconnect_aborts_on_the_engine(gw: Running) -> None:
    before = gw.app[METRICS_KEY].client_disconnects._value.get()
    stream = await gw.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Go on forever"}],
        max_tokens=5000,
        stream=True,
        extra_body=LONG,
    )
    seen = 0
    async for _ in stream:
        seen += 1
        if seen == 5:
            break
    assert await wait_until(lambda: sum(gw.running_requests().values()) == 1)
    await stream.close()
    assert await wait_until(lambda: sum(gw.running_requests().values()) == 0 and gw.inflight() == 0)
    assert gw.app[METRICS_KEY].client_disconnects._value.get() == before + 1


async def test_killed_agent_ends_its_streams_cleanly_and_traffic_moves_on() -> None:
    async with running_fleet("kill") as run:

        async def consume(started: asyncio.Event) -> str:
            stream = await run.client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Long story"}],
                max_tokens=300,
                stream=True,
                extra_body=LONG,
            )
            finish = ""
            async for c in stream:
                started.set()
                for choice in c.choices:
                    finish = choice.finish_reason or finish
            return finish

        events = [asyncio.Event(), asyncio.Event()]
        tasks = [asyncio.create_task(consume(e)) for e in events]
        for e in events:
            await asyncio.wait_for(e.wait(), 30)
        assert await wait_until(lambda: all(n == 1 for n in run.running_requests().values()))
        victim = run.fleet.processes["kill-0"]
        victim.kill()
        await victim.wait()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        assert len(errors) == 1 and isinstance(errors[0], openai.APIError), results
        assert not isinstance(errors[0], openai.APIConnectionError)
        assert "engine" in str(errors[0]).lower()
        assert [r for r in results if not isinstance(r, BaseException)] == ["length"]
        for i in range(4):  # engine kill-0 is down: every request lands on kill-1 (directly or after a retry)
            reply = await run.client.completions.create(
                model=MODEL, prompt=f"after {i}", max_tokens=3, extra_body=LONG
            )
            assert reply.choices[0].finish_reason == "length"
        assert run.inflight() == 0
