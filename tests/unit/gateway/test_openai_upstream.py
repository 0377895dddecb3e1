"""The OpenAI upstream client against a tiny in-process aiohttp server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.domain import (
    Admitted,
    ChatTurn,
    Delta,
    EngineRequest,
    EngineRequestError,
    EngineStreamError,
    EngineUnavailable,
    Finished,
)
from gateway.engines.openai_upstream import NOMINAL_KV_BLOCKS, OpenAIUpstreamClient, build_body, parse_metrics

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1234.0
"""
OLD_VLLM_METRICS = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 0.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.9
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="2000"} 1.0
"""


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else orjson.dumps(payload).decode()
    return f"data: {data}\n\n".encode()


def chat_chunk(content: str | None = None, finish: str | None = None) -> dict[str, Any]:
    delta = {"content": content} if content is not None else {"role": "assistant", "content": ""}
    return {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


USAGE = {
    "choices": [],
    "usage": {"prompt_tokens": 7, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 4}},
}


class Upstream:
    """A scripted OpenAI-compatible server; `gate` holds the stream after its first content chunk."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.peers: list[object] = []
        self.status = 200
        self.metrics: str | None = VLLM_METRICS
        self.disconnected = asyncio.Event()
        self.app = web.Application()
        self.app.router.add_post("/v1/chat/completions", self.chat)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/metrics", self.metrics_handler)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        self.headers.append(dict(request.headers))
        self.peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        if self.status != 200:
            return web.json_response({"error": {"message": "nope"}}, status=self.status)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            await resp.write(sse(chat_chunk()))
            await resp.write(sse(chat_chunk("Hel")))
            await self.gate.wait()
            await resp.write(sse(chat_chunk("lo", finish="length")))
            await resp.write(sse(USAGE))
            await resp.write(sse("[DONE]"))
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnected.set()
            raise
        return resp

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(sse({"choices": [{"index": 0, "text": "a", "finish_reason": None}]}))
        if self.bodies[-1].get("prompt") == "break":
            await resp.write(sse({"error": {"message": "engine died"}}))
            return resp
        await resp.write(sse({"choices": [{"index": 0, "text": "b", "finish_reason": "stop"}]}))
        return resp  # no usage chunk and no [DONE]

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": "m", "max_model_len": 8192}, {"id": "lora"}]}
        )

    async def metrics_handler(self, request: web.Request) -> web.Response:
        if self.metrics is None:
            raise web.HTTPNotFound()
        return web.Response(text=self.metrics)


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[Upstream, OpenAIUpstreamClient]]:
    fake = Upstream()
    server = TestServer(fake.app)
    await server.start_server()
    client = OpenAIUpstreamClient(
        str(server.make_url("")), metrics_interval_s=0.01, api_key="k", engine_id="up"
    )
    yield fake, client
    fake.gate.set()
    await client.close()
    await server.close()


CHAT = EngineRequest(request_id="r1", model="m", messages=(ChatTurn("user", "hi"),), max_tokens=2, seed=3)


async def test_chat_stream_is_relayed_chunk_by_chunk(upstream: tuple[Upstream, OpenAIUpstreamClient]) -> None:
    fake, client = upstream
    stream = client.generate(CHAT)
    assert await anext(stream) == Admitted(prompt_tokens=0)
    assert await anext(stream) == Delta(
        text="Hel", num_tokens=1
    )  # arrives while the server still holds the rest
    fake.gate.set()
    rest = [event async for event in stream]
    assert rest == [
        Delta(text="lo", num_tokens=1),
        Finished(finish_reason="length", prompt_tokens=7, completion_tokens=2, cached_tokens=4),
    ]
    body = fake.bodies[0]
    assert body == {
        "model": "m",
        "stream": True,
        "stream_options": {"include_usage": True},
        "n": 1,
        "temperature": 1.0,
        "top_p": 1.0,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "seed": 3,
    }
    assert fake.headers[0]["Authorization"] == "Bearer k"


async def test_closing_early_disconnects_the_upstream(
    upstream: tuple[Upstream, OpenAIUpstreamClient],
) -> None:
    fake, client = upstream
    stream = client.generate(CHAT)
    assert [await anext(stream), await anext(stream)] == [
        Admitted(prompt_tokens=0),
        Delta(text="Hel", num_tokens=1),
    ]
    await stream.aclose()
    fake.gate.set()
    await asyncio.wait_for(fake.disconnected.wait(), 5.0)


async def test_completions_without_usage_counts_deltas(
    upstream: tuple[Upstream, OpenAIUpstreamClient],
) -> None:
    fake, client = upstream
    request = EngineRequest(
        request_id="r2", model="m", prompt_token_ids=(1, 2, 3), ignore_eos=True, min_tokens=4
    )
    events = [e async for e in client.generate(request)]
    assert events == [
        Admitted(prompt_tokens=0),
        Delta(text="a", num_tokens=1),
        Delta(text="b", num_tokens=1),
        Finished(finish_reason="stop", prompt_tokens=0, completion_tokens=2),
    ]
    assert fake.bodies[0]["prompt"] == [1, 2, 3]
    assert (fake.bodies[0]["ignore_eos"], fake.bodies[0]["min_tokens"]) == (True, 4)


async def test_error_chunk_mid_stream_is_a_stream_error(
    upstream: tuple[Upstream, OpenAIUpstreamClient],
) -> None:
    _, client = upstream
    events = []
    with pytest.raises(EngineStreamError, match="engine died"):
        async for event in client.generate(EngineRequest(request_id="r3", model="m", prompt_text="break")):
            events.append(event)
    assert events == [Admitted(prompt_tokens=0), Delta(text="a", num_tokens=1)]


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (400, EngineRequestError),
        (404, EngineRequestError),
        (429, EngineUnavailable),
        (500, EngineUnavailable),
        (503, EngineUnavailable),
    ],
)
async def test_http_errors_before_the_stream(
    upstream: tuple[Upstream, OpenAIUpstreamClient], status: int, error: type[Exception]
) -> None:
    fake, client = upstream
    fake.status = status
    with pytest.raises(error, match=f"answered {status}"):
        async for _ in client.generate(CHAT):
            pass


async def test_connection_refused_is_unavailable() -> None:
    server = TestServer(web.Application())
    await server.start_server()
    url = str(server.make_url(""))
    await server.close()
    client = OpenAIUpstreamClient(url)
    try:
        with pytest.raises(EngineUnavailable):
            async for _ in client.generate(CHAT):
                pass
        with pytest.raises(EngineUnavailable):
            await client.describe()
        # A failed scrape is skipped (the state goes stale), it does not end the watch: requests decide
        # availability. So the watch yields nothing while the upstream is down.
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await anext(client.watch_state())
    finally:
        await client.close()


async def test_describe_takes_the_first_model(upstream: tuple[Upstream, OpenAIUpstreamClient]) -> None:
    _, client = upstream
    desc = await client.describe()
    assert (desc.engine_id, desc.model, desc.backend, desc.max_context_tokens) == ("up", "m", "openai", 8192)


async def test_watch_state_parses_vllm_metrics(upstream: tuple[Upstream, OpenAIUpstreamClient]) -> None:
    fake, client = upstream
    await client.describe()
    stream = client.watch_state()
    first, second = await anext(stream), await anext(stream)
    await stream.aclose()
    assert (first.seq, second.seq) == (1, 2)
    assert second.engine_timestamp_s >= first.engine_timestamp_s
    got = (
        first.model,
        first.ready,
        first.num_running,
        first.num_waiting,
        first.kv_blocks_total,
        first.kv_blocks_free,
    )
    assert got == ("m", True, 5, 4, NOMINAL_KV_BLOCKS, 750)


async def test_watch_state_without_metrics_reports_ready_zeros(
    upstream: tuple[Upstream, OpenAIUpstreamClient],
) -> None:
    fake, client = upstream
    fake.metrics = None
    stream = client.watch_state()
    report = await anext(stream)
    await stream.aclose()
    got = (
        report.ready,
        report.num_running,
        report.num_waiting,
        report.kv_blocks_total,
        report.kv_blocks_free,
    )
    assert got == (True, 0, 0, 0, 0)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (VLLM_METRICS, (5, 4, 1000, 750)),
        (OLD_VLLM_METRICS, (1, 0, 2000, 200)),
        ("# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 2\n", (2, 0, 0, 0)),
        ("", (0, 0, 0, 0)),
    ],
)
def test_parse_metrics(text: str, expected: tuple[int, int, int, int]) -> None:
    assert parse_metrics(text) == expected


def test_body_omits_unset_vllm_extras_and_rejects_empty_prompt() -> None:
    path, body = build_body(EngineRequest(request_id="r", model="m", prompt_text="x"))
    assert path == "/v1/completions"
    assert not {"ignore_eos", "min_tokens", "stop_token_ids", "max_tokens", "seed", "stop"} & set(body)
    with pytest.raises(EngineRequestError):
        build_body(EngineRequest(request_id="r", model="m"))


async def test_finished_streams_reuse_the_connection(upstream: tuple[Upstream, OpenAIUpstreamClient]) -> None:
    fake, client = upstream
    fake.gate.set()
    for _ in range(2):
        events = [e async for e in client.generate(CHAT)]
        assert isinstance(events[-1], Finished)
    assert len(fake.peers) == 2 and fake.peers[0] == fake.peers[1]
