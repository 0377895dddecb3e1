"""Disaggregated serving end to end (CAUCHY): a prefill agent and a decode agent of one combo behind the
gateway, the official `openai` client. Every request starts on the prefill agent, which hands it off after its
first token; the gateway resumes it on the decode agent. The client's text and usage equal, byte for byte,
the same seeded request served whole by a plain agent."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from agent_process import Agent, story_request
from openai import AsyncOpenAI

from gateway.app import running
from gateway.config import GatewayConfig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

BODY: dict[str, Any] = story_request(max_tokens=120, seed=5)


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Agent, Agent, Agent]]:
    tmp = tmp_path_factory.mktemp("gateway-handoff")
    interval = ("--state-interval-ms", "20")
    plain = Agent.start(tmp, *interval)
    prefill = Agent.start(tmp, *interval, "--role", "prefill", "--combo", "1xh100+1xh100#0")
    decode = Agent.start(tmp, *interval, "--role", "decode", "--combo", "1xh100+1xh100#0")
    try:
        yield plain, prefill, decode
    finally:
        for agent in (plain, prefill, decode):
            agent.proc.send_signal(signal.SIGCONT)
            assert agent.terminate() == 0, agent.log()


def config(*agents: Agent) -> GatewayConfig:
    return GatewayConfig(port=0, engines=tuple(a.target for a in agents), policy={"name": "least_loaded"})


async def ask(base_url: str, *, stream: bool) -> tuple[str, int]:
    """(the text, the completion tokens in usage)."""
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    try:
        extra = {"extra_body": {"ignore_eos": True}}
        if not stream:
            done = await client.chat.completions.create(**BODY, **extra)
            assert done.usage is not None
            return done.choices[0].message.content or "", done.usage.completion_tokens
        parts: list[str] = []
        usage = 0
        chunks = await client.chat.completions.create(
            **BODY, **extra, stream=True, stream_options={"include_usage": True}
        )
        async for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return "".join(parts), usage
    finally:
        await client.close()


async def handoffs(base_url: str) -> list[str]:
    async with aiohttp.ClientSession() as http, http.get(f"{base_url}/metrics") as resp:
        return [line for line in (await resp.text()).splitlines()
                if line.startswith("switchyard_migrations_total")]


async def test_a_request_handed_from_prefill_to_decode_reads_as_if_served_whole(
    agents: tuple[Agent, Agent, Agent],
) -> None:
    plain, prefill, decode = agents
    async with running(config(plain), ready_engines=1) as url:
        reference, reference_tokens = await ask(url, stream=True)
    assert reference_tokens == 120 and len(reference) > 100
    async with running(config(prefill, decode), ready_engines=2) as url:
        streamed = await ask(url, stream=True)
        whole = await ask(url, stream=False)
        lines = await handoffs(url)
    assert streamed == (reference, 120)
    assert whole == (reference, 120)
    # Both were handed off and resumed; nothing else moved or failed.
    assert [line for line in lines if not line.endswith(" 0.0")] == [
        'switchyard_migrations_total{outcome="handoff"} 2.0']
