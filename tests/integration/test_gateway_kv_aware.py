"""KV-cache-aware routing through the live gateway: two sim agents push their prefix caches' KV events on
WatchState, and `kv_aware` sends every request that shares a cached prefix to the engine holding it, which
reports the hit in the usage's `cached_tokens`. Round robin, the control, sends every other one to the engine
that has never seen the prefix."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from agent_process import Agent
from openai import AsyncOpenAI

from gateway.app import running
from gateway.config import GatewayConfig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SHARED = [10 + (i * 7919) % 8000 for i in range(1024)]  # a 1,024-token "system prompt" (4 index blocks)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Agent, Agent]]:
    tmp = tmp_path_factory.mktemp("kv")
    a, b = Agent.start(tmp, "--state-interval-ms", "20"), Agent.start(tmp, "--state-interval-ms", "20")
    yield a, b
    for agent in (a, b):
        assert agent.terminate() == 0, agent.log()


async def cached_tokens(policy: str, pair: tuple[Agent, Agent], tag: int) -> list[int]:
    """The cached prompt tokens of a first request and four followers sharing its 1,024-token prefix."""
    config = GatewayConfig(port=0, engines=(pair[0].target, pair[1].target), policy={"name": policy})
    async with running(config, ready_engines=2) as url:
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        out = []
        for n in range(5):
            prompt = [tag, *SHARED, *[20 + (tag * 31 + n * 7 + i) % 8000 for i in range(40)]]
            done = await client.completions.create(model="llama3-8b", prompt=prompt, max_tokens=2)
            assert done.usage is not None and done.usage.prompt_tokens == len(prompt)
            details = done.usage.prompt_tokens_details
            out.append(details.cached_tokens if details is not None and details.cached_tokens else 0)
            await asyncio.sleep(0.15)  # the engine's events reach the gateway (20 ms pushes)
        await client.close()
    return out


async def test_kv_aware_sends_a_shared_prefix_to_the_engine_that_caches_it(pair: tuple[Agent, Agent]) -> None:
    # Distinct first tokens (`tag`) keep the two runs' prefixes apart in the agents' caches.
    kv = await cached_tokens("kv_aware", pair, tag=1)
    assert kv[0] == 0 and all(c >= 1024 for c in kv[1:]), kv
    rr = await cached_tokens("round_robin", pair, tag=2)
    assert rr[0] == 0 and rr[1] == 0, rr  # the second request goes to the other engine: a miss
