"""Migrations the client never sees (STAR §5.4): sim agents behind the gateway, the official `openai` client.

A seeded streaming request is cut mid-stream (`POST /admin/migrate`) and resumed on another agent by the
gateway's splice; the client's text equals, byte for byte, the same request served unmigrated (the sim
carries each request's token-generator state in its ticket). With the target frozen (SIGSTOP: it neither
answers nor closes), the splice gives up on it after the stall timeout and the source resumes its own cut.
With the target killed (SIGKILL) after it has streamed part of the resumed request, the gateway re-tickets
without KV from the tokens it relayed and the source recomputes and continues: the text is again identical.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from agent_process import Agent, story_request
from openai import AsyncOpenAI

from gateway.app import running
from gateway.config import GatewayConfig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

BODY: dict[str, Any] = {**story_request(max_tokens=240, seed=11), "stream": True}
CUT_AFTER_CHUNKS = 40


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Agent, Agent]]:
    tmp = tmp_path_factory.mktemp("gateway-migration")
    a = Agent.start(tmp, "--state-interval-ms", "20")
    b = Agent.start(tmp, "--state-interval-ms", "20")
    try:
        yield a, b
    finally:
        for agent in (a, b):
            agent.proc.send_signal(signal.SIGCONT)
            assert agent.terminate() == 0, agent.log()


def config(*agents: Agent, **extra: Any) -> GatewayConfig:
    return GatewayConfig(
        port=0,
        engines=tuple(a.target for a in agents),
        enable_admin=True,
        policy={"name": "round_robin"},
        **extra,
    )


async def stream_text(base_url: str, request_id: str, *, migrate: dict[str, Any] | None = None) -> str:
    """The streamed text; with `migrate`, POST it to /admin/migrate after `CUT_AFTER_CHUNKS` chunks."""
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    parts: list[str] = []
    chunks = 0
    async with aiohttp.ClientSession() as http:
        stream = await client.chat.completions.create(
            **BODY, extra_body={"ignore_eos": True}, extra_headers={"x-request-id": request_id}
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
                chunks += 1
                if migrate is not None and chunks == CUT_AFTER_CHUNKS:
                    async with http.post(
                        f"{base_url}/admin/migrate", json={"request_id": request_id, **migrate}
                    ) as resp:
                        answer = await resp.json()
                        assert resp.status == 200, answer
                        assert answer["output_tokens"] >= CUT_AFTER_CHUNKS
    await client.close()
    return "".join(parts)


async def metric(base_url: str, prefix: str) -> list[str]:
    async with aiohttp.ClientSession() as http, http.get(f"{base_url}/metrics") as resp:
        return [line for line in (await resp.text()).splitlines() if line.startswith(prefix)]


async def test_a_migrated_seeded_stream_is_byte_identical_to_an_unmigrated_one(
    agents: tuple[Agent, Agent],
) -> None:
    a, b = agents
    # Round robin over the engine ids (the addresses, sorted) in a fresh gateway: the first request goes to
    # the first engine, the second to the other one, which the test cuts for the first.
    first, _ = sorted((a, b), key=lambda agent: agent.target)
    async with running(config(a, b), ready_engines=2) as url:
        reference = await stream_text(url, "ref-1")
        named = await stream_text(url, "moved-1", migrate={"target": first.target})
        lines = await metric(url, "switchyard_migrations_total")
    assert len(reference) > 200 and named == reference
    assert 'switchyard_migrations_total{outcome="resumed"} 1.0' in lines  # it went where it was sent
    async with running(config(a, b), ready_engines=2) as url:
        moved = await stream_text(url, "moved-2", migrate={})  # no target: wherever the policy picks
        lines = await metric(url, "switchyard_migrations_total")
    assert moved == reference
    assert 'switchyard_migrations_total{outcome="cut"} 1.0' in lines
    assert 'switchyard_migrations_total{outcome="fallback"} 1.0' in lines


async def test_a_frozen_target_falls_back_to_the_source(agents: tuple[Agent, Agent]) -> None:
    a, b = agents
    # Round robin over the engine ids (the addresses, sorted): the first request goes to the first, the second
    # to the other, which the test cuts for the first while that one is frozen.
    first, second = sorted((a, b), key=lambda agent: agent.target)
    async with running(config(a, b, engine_stall_timeout_s=1.0, stale_after_s=60.0), ready_engines=2) as url:
        reference = await stream_text(url, "ref-2")
        first.proc.send_signal(signal.SIGSTOP)
        try:
            client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            text: list[str] = []
            async with aiohttp.ClientSession() as http:
                stream = await client.chat.completions.create(
                    **BODY, extra_body={"ignore_eos": True}, extra_headers={"x-request-id": "frozen-1"}
                )
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        text.append(chunk.choices[0].delta.content)
                        if len(text) == CUT_AFTER_CHUNKS:
                            async with http.post(
                                f"{url}/admin/migrate",
                                json={"request_id": "frozen-1", "target": first.target},
                            ) as r:
                                answer = await r.json()
                            assert r.status == 200, answer
                            assert answer["source"] == f"it-{second.port}"
            await client.close()
        finally:
            first.proc.send_signal(signal.SIGCONT)
        lines = await metric(url, "switchyard_migrations_total")
    assert "".join(text) == reference
    assert 'switchyard_migrations_total{outcome="fallback"} 1.0' in lines, lines


@pytest.fixture
def fresh_agents(tmp_path: Path) -> Iterator[tuple[Agent, Agent]]:
    """Two agents of the test's own (it kills one)."""
    a = Agent.start(tmp_path, "--state-interval-ms", "20")
    b = Agent.start(tmp_path, "--state-interval-ms", "20")
    try:
        yield a, b
    finally:
        for agent in (a, b):
            if agent.proc.poll() is None:
                assert agent.terminate() == 0, agent.log()


async def test_a_target_killed_mid_stream_is_re_ticketed_and_the_stream_continues(
    fresh_agents: tuple[Agent, Agent],
) -> None:
    a, b = fresh_agents
    first, second = sorted((a, b), key=lambda agent: agent.target)
    body = {**BODY, "max_tokens": 600}
    kill_after_chunks = CUT_AFTER_CHUNKS + 60  # the target has streamed at least 60 chunks by then
    cfg = config(a, b, engine_stall_timeout_s=2.0)
    async with running(cfg, ready_engines=2) as url:
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

        async def text_of(request_id: str, *, kill: bool) -> str:
            parts: list[str] = []
            async with aiohttp.ClientSession() as http:
                stream = await client.chat.completions.create(
                    **body, extra_body={"ignore_eos": True}, extra_headers={"x-request-id": request_id}
                )
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        parts.append(chunk.choices[0].delta.content)
                        if kill and len(parts) == CUT_AFTER_CHUNKS:
                            async with http.post(
                                f"{url}/admin/migrate",
                                json={"request_id": request_id, "target": first.target},
                            ) as r:
                                answer = await r.json()
                            assert r.status == 200, answer
                            assert answer["source"] == f"it-{second.port}"  # round robin's second pick
                        if kill and len(parts) == kill_after_chunks:
                            first.proc.kill()
                            await asyncio.to_thread(first.proc.wait)
            return "".join(parts)

        reference = await text_of("ref-kill", kill=False)  # served by the first engine
        moved = await text_of("killed-1", kill=True)  # source: the second; resumed on the first, killed
        await client.close()
        lines = await metric(url, "switchyard_migrations_total")
    assert first.proc.returncode == -signal.SIGKILL
    assert len(reference) > 500 and moved == reference
    assert 'switchyard_migrations_total{outcome="resumed"} 1.0' in lines, lines
    assert 'switchyard_migrations_total{outcome="fallback"} 1.0' in lines, lines  # the source recomputed
    assert not any('outcome="failed"' in line for line in lines), lines
