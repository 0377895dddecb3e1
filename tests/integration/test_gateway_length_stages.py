"""CascadeInfer's hand-over through the live gateway (paper 000, §4.3): two sim agents as two length stages.

The gateway runs `--policy length_stages --reschedule length_stages` with a fixed plan (stage 0 = [0, 256) on
the first agent, stage 1 = [256, 8192) on the second, refinement off so the bound stays where the plan put
it). A seeded request whose prompt is under 256 tokens starts on the first agent; once prompt + generated
tokens reach the bound the rescheduler hands it to the second, whose splice the client never sees: the text
equals, byte for byte, the same request served unmigrated, with the full usage. With the second agent killed
after it has streamed part of the request, the gateway re-tickets from the tokens it relayed, the first agent
recomputes and continues, the empty stage merges into its neighbour (no further hand-over is asked), and the
text is again identical.
"""

from __future__ import annotations

import asyncio
import json
import re
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

BOUND = 256
MAX_TOKENS = 600
FLAGS = ("--star-report", "--hidden-state-interval", "0", "--state-interval-ms", "20")


def plan_file(tmp: Path, first: Agent, second: Agent) -> Path:
    path = tmp / "plan.json"
    path.write_text(json.dumps({"stages": [
        {"lo": 0, "hi": BOUND, "instances": 1, "engines": [first.target]},
        {"lo": BOUND, "hi": 8192, "instances": 1, "engines": [second.target]},
    ]}))
    return path


def staged(first: Agent, second: Agent, plan: Path, **extra: Any) -> GatewayConfig:
    return GatewayConfig(
        port=0,
        engines=(first.target, second.target),
        policy={"name": "length_stages"},
        reschedule={"policy": "length_stages", "interval_s": 0.1,
                    "params": {"plan": str(plan), "refine": "off", "plan_interval_s": 3600}},
        **extra,
    )


def unstaged(agent: Agent) -> GatewayConfig:
    return GatewayConfig(port=0, engines=(agent.target,), policy={"name": "round_robin"})


async def stream(url: str, request_id: str, seed: int, *,
                 on_chunk: Any = None) -> tuple[str, str | None, int]:
    """The text, finish reason and completion tokens; `on_chunk(n)` after the n-th content chunk."""
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    parts: list[str] = []
    finish: str | None = None
    completion = 0
    body = {**story_request(max_tokens=MAX_TOKENS, seed=seed), "stream": True,
            "stream_options": {"include_usage": True}}
    async for chunk in await client.chat.completions.create(
        **body, extra_body={"ignore_eos": True}, extra_headers={"x-request-id": request_id}
    ):
        if chunk.choices:
            if chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
                if on_chunk is not None:
                    await on_chunk(len(parts))
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            assert chunk.usage.prompt_tokens < BOUND  # the request starts in stage 0
            completion = chunk.usage.completion_tokens
    await client.close()
    return "".join(parts), finish, completion


async def exposition(url: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
        return await resp.text()


async def layout_published(url: str, second: Agent) -> None:
    """Until the rescheduler's first tick has published the plan (an arrival before it sees no stages and
    is routed as by round robin)."""
    for _ in range(100):
        if f'switchyard_engine_stage{{engine="{second.target}"' in await exposition(url):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the stage layout was never published")


def counter(text: str, name: str, label: str, value: str) -> float:
    match = re.search(rf'^{name}\{{{label}="{value}"\}} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Agent, Agent]]:
    """Two reporting agents of the test's own (one test kills one)."""
    a, b = Agent.start(tmp_path, *FLAGS), Agent.start(tmp_path, *FLAGS)
    try:
        yield a, b
    finally:
        for agent in (a, b):
            agent.proc.send_signal(signal.SIGCONT)
            if agent.proc.poll() is None:
                assert agent.terminate() == 0, agent.log()


async def test_a_request_crossing_two_stages_streams_the_unmigrated_text(
    pair: tuple[Agent, Agent], tmp_path: Path
) -> None:
    first, second = pair
    async with running(unstaged(first), ready_engines=1) as url:
        reference = await asyncio.gather(*(stream(url, f"ref-{s}", s) for s in (3, 4)))
    async with running(staged(first, second, plan_file(tmp_path, first, second)), ready_engines=2) as url:
        await layout_published(url, second)
        moved = await asyncio.gather(*(stream(url, f"staged-{s}", s) for s in (3, 4)))
        metrics = await exposition(url)
    for _, finish, completion in moved:
        assert finish == "length" and completion == MAX_TOKENS
    assert [m[0] for m in moved] == [r[0] for r in reference]
    assert counter(metrics, "switchyard_stage_migrations_total", "reason", "handover") == 2, metrics
    assert counter(metrics, "switchyard_migrations_total", "outcome", "resumed") == 2
    assert counter(metrics, "switchyard_migrations_total", "outcome", "failed") == 0


async def test_the_handover_target_killed_mid_stream_leaves_the_text_unchanged(
    pair: tuple[Agent, Agent], tmp_path: Path
) -> None:
    first, second = pair
    async with running(unstaged(first), ready_engines=1) as url:
        reference, _, _ = await stream(url, "ref-kill", 5)
    handed_over_at = 0

    async def kill_after_the_hand_over(n: int) -> None:
        nonlocal handed_over_at
        if handed_over_at == 0 and counter(await exposition(url), "switchyard_migrations_total",
                                           "outcome", "resumed") >= 1:
            handed_over_at = n
        if handed_over_at and n == handed_over_at + 40 and second.proc.poll() is None:
            second.proc.kill()
            await asyncio.to_thread(second.proc.wait)

    cfg = staged(first, second, plan_file(tmp_path, first, second), engine_stall_timeout_s=2.0)
    async with running(cfg, ready_engines=2) as url:
        await layout_published(url, second)
        text, finish, completion = await stream(url, "staged-kill", 5, on_chunk=kill_after_the_hand_over)
        metrics = await exposition(url)
    assert second.proc.returncode == -signal.SIGKILL, "the hand-over never happened"
    assert handed_over_at > 0 and finish == "length" and completion == MAX_TOKENS
    assert text == reference
    assert counter(metrics, "switchyard_migrations_total", "outcome", "fallback") == 1, metrics
    assert counter(metrics, "switchyard_migrations_total", "outcome", "failed") == 0
    assert counter(metrics, "switchyard_stage_migrations_total", "reason", "handover") == 1
