"""STAR's rescheduler moving live requests (paper 003, §5): sim agents that send rounds of per-request lengths
(`--length-predictor oracle`, or `--star-report` without a predictor) behind the gateway with `--reschedule
star` / `star-nopred`, the official `openai` client.

Every request carries one `x-session-id`, so session affinity piles them all on one engine; the rescheduler
must then move at least one to the idle engine (`switchyard_migrations_total{outcome="cut"}` > 0), and every
seeded stream's text must equal the same request served unmigrated (a gateway that does not reschedule, the
same agents), with no error and the full usage.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator

import aiohttp
import pytest
from agent_process import Agent
from openai import AsyncOpenAI

from gateway.app import running
from gateway.config import GatewayConfig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

MODEL = "llama3-8b"
SEEDS = tuple(range(1, 9))
MAX_TOKENS = 300


def config(agents: tuple[Agent, Agent], policy: str) -> GatewayConfig:
    return GatewayConfig(
        port=0,
        engines=tuple(a.target for a in agents),
        policy={"name": "session_affinity"},
        reschedule={"policy": policy, "interval_s": 0.2},
    )


async def one(client: AsyncOpenAI, seed: int) -> tuple[str, str | None, int]:
    """The text, finish reason and completion tokens of one seeded stream."""
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"tell me a long story, number {seed} " * 8}],
        max_tokens=MAX_TOKENS,
        seed=seed,
        temperature=1.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
        extra_headers={"x-session-id": "one-session"},
    )
    parts: list[str] = []
    finish: str | None = None
    completion = 0
    async for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            completion = chunk.usage.completion_tokens
    return "".join(parts), finish, completion


async def serve_all(agents: tuple[Agent, Agent], policy: str) -> tuple[dict[int, str], dict[str, float]]:
    """Every seed's stream at once through a gateway with this reschedule policy; the texts and the
    migration counters."""
    async with running(config(agents, policy), ready_engines=2) as url:
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        results = await asyncio.gather(*(one(client, seed) for seed in SEEDS))
        await client.close()
        async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
            exposition = await resp.text()
    for text, finish, completion in results:
        assert finish == "length" and completion == MAX_TOKENS and text
    counters = {
        m.group(1): float(m.group(2))
        for m in re.finditer(r'^switchyard_migrations_total\{outcome="(\w+)"\} (\S+)$', exposition, re.M)
    }
    return dict(zip(SEEDS, (text for text, _, _ in results), strict=True)), counters


@pytest.fixture(scope="module")
def oracle_agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Agent, Agent]]:
    tmp = tmp_path_factory.mktemp("reschedule-oracle")
    flags = ("--length-predictor", "oracle", "--state-interval-ms", "20")
    pair = (Agent.start(tmp, *flags), Agent.start(tmp, *flags))
    try:
        yield pair
    finally:
        for agent in pair:
            assert agent.terminate() == 0, agent.log()


@pytest.fixture(scope="module")
def reporting_agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Agent, Agent]]:
    tmp = tmp_path_factory.mktemp("reschedule-nopred")
    flags = ("--star-report", "--hidden-state-interval", "0", "--state-interval-ms", "20")
    pair = (Agent.start(tmp, *flags), Agent.start(tmp, *flags))
    try:
        yield pair
    finally:
        for agent in pair:
            assert agent.terminate() == 0, agent.log()


@pytest.mark.parametrize("policy", ["star", "star-nopred"])
async def test_the_rescheduler_moves_piled_up_requests_and_the_text_is_unchanged(
    oracle_agents: tuple[Agent, Agent], policy: str
) -> None:
    reference, unmoved = await serve_all(oracle_agents, "none")
    moved, counters = await serve_all(oracle_agents, policy)
    assert unmoved.get("cut", 0.0) == 0.0
    assert counters.get("cut", 0.0) >= 1, (counters, _logs(oracle_agents))
    assert counters.get("failed", 0.0) == 0.0 and counters.get("refused", 0.0) <= counters["cut"], counters
    assert moved == reference


async def test_star_nopred_moves_with_current_lengths_only(reporting_agents: tuple[Agent, Agent]) -> None:
    reference, _ = await serve_all(reporting_agents, "none")
    moved, counters = await serve_all(reporting_agents, "star-nopred")
    assert counters.get("cut", 0.0) >= 1, (counters, _logs(reporting_agents))
    assert counters.get("failed", 0.0) == 0.0, counters
    assert moved == reference


def _logs(agents: tuple[Agent, Agent]) -> str:
    return "\n".join(agent.log()[-3000:] for agent in agents)
