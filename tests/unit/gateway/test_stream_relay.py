"""The streaming relay's writes through the real app: what one loop tick queues goes out in one socket write,
a choice's first token and a lone chunk are never held back, and client sockets have TCP_NODELAY.

Engines are gated fakes (a step may be an `asyncio.Event` the engine waits on), so the tests say exactly which
events exist when each write happens; a frame held back would hang the read (bounded by `wait_for`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import orjson
import pytest
from aiohttp import ClientResponse, web
from fake_engines import MODEL, FakeEngine, serving
from sockets import tcp_nodelay_of_socket

from gateway.domain import Admitted, Delta, EngineEvent, EngineRequest, Finished

CHAT = "/v1/chat/completions"
Step = EngineEvent | asyncio.Event


class GatedEngine(FakeEngine):
    """Plays `steps`; an `asyncio.Event` step waits until the test sets it."""

    def __init__(self, engine_id: str, steps: list[Step]) -> None:
        super().__init__(engine_id, lambda _: [])
        self.steps = steps

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineEvent]:
        self.requests.append(request)
        try:
            for step in self.steps:
                if isinstance(step, asyncio.Event):
                    await step.wait()
                else:
                    yield step
            self.completed_streams += 1
        finally:
            self.closed_streams += 1


def body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True, **extra}


def deltas(*texts: str) -> list[Step]:
    return [Delta(t, num_tokens=1) for t in texts]


async def next_event(resp: ClientResponse) -> dict[str, Any] | str:
    """The next SSE event's data (parsed JSON, or the raw `[DONE]`), within 5 s."""
    while True:
        line = (await asyncio.wait_for(resp.content.readline(), 5.0)).strip()
        if line.startswith(b"data: "):
            data = line[6:]
            return data.decode() if data == b"[DONE]" else orjson.loads(data)


def content_of(event: dict[str, Any] | str) -> str | None:
    assert isinstance(event, dict)
    return event["choices"][0]["delta"].get("content")


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Body writes of every streamed response in order: `write` or `write_eof`, and their event count."""
    calls: list[str] = []
    write, write_eof = web.StreamResponse.write, web.StreamResponse.write_eof

    async def counted_write(self: web.StreamResponse, data: bytes | bytearray | memoryview) -> None:
        calls.append(f"write:{bytes(data).count(b'data: ')}")
        await write(self, data)

    async def counted_write_eof(self: web.StreamResponse, data: bytes = b"") -> None:
        if not self._eof_sent:  # aiohttp calls write_eof again once the handler returns
            calls.append(f"write_eof:{data.count(b'data: ')}")
        await write_eof(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", counted_write)
    monkeypatch.setattr(web.StreamResponse, "write_eof", counted_write_eof)
    yield calls


async def test_a_burst_is_one_write_after_the_first_token(writes: list[str]) -> None:
    texts = [f"t{i}" for i in range(50)]
    engine = GatedEngine("a", [Admitted(5), *deltas(*texts), Finished("stop", 5, 50)])
    async with serving(engine) as client:
        resp = await client.post(CHAT, json=body(stream_options={"include_usage": True}))
        events = []
        while (event := await next_event(resp)) != "[DONE]":
            events.append(event)
    assert [content_of(e) for e in events[1:51]] == texts
    # Role chunk + first token at once; the 49 other tokens, finish and usage chunks and [DONE] at the end.
    assert writes == ["write:2", "write_eof:52"]


async def test_lone_chunks_are_written_before_the_next_event_exists(writes: list[str]) -> None:
    gates = [asyncio.Event() for _ in range(4)]
    steps: list[Step] = [Admitted(5), gates[0], *deltas("one"), gates[1], *deltas("two"), gates[2],
                         *deltas(*(f"b{i}" for i in range(20))), gates[3], Finished("length", 5, 22)]
    async with serving(GatedEngine("a", steps)) as client:
        resp = await client.post(CHAT, json=body())
        assert content_of(await next_event(resp)) == ""  # the role chunk, while the engine is in prefill
        gates[0].set()
        assert content_of(await next_event(resp)) == "one"
        gates[1].set()
        assert content_of(await next_event(resp)) == "two"
        gates[2].set()
        burst = [content_of(await next_event(resp)) for _ in range(20)]
        assert burst == [f"b{i}" for i in range(20)]
        gates[3].set()
        assert (await next_event(resp))["choices"][0]["finish_reason"] == "length"  # type: ignore[index]
        assert await next_event(resp) == "[DONE]"
    # Role chunk (end of the admission's tick), "one" (first token: at once), "two" (a lone chunk: at once),
    # the burst (its first chunk at once, the 19 others together at the end of the tick), then the finish
    # chunk and [DONE] with the end of the body.
    assert writes == ["write:1", "write:1", "write:1", "write:1", "write:19", "write_eof:2"]


async def test_n2_first_tokens_of_each_choice_go_out_at_once() -> None:
    gate = asyncio.Event()
    engine = GatedEngine("a", [Admitted(5), *deltas("x"), gate, Finished("stop", 5, 1)])
    async with serving(engine) as client:
        resp = await client.post(CHAT, json=body(n=2))
        seen: dict[int, list[str | None]] = {0: [], 1: []}
        for _ in range(4):  # role and first token of both choices, while both engines wait at the gate
            event = await next_event(resp)
            assert isinstance(event, dict)
            seen[event["choices"][0]["index"]].append(content_of(event))
        assert seen == {0: ["", "x"], 1: ["", "x"]}
        gate.set()
        rest = [await next_event(resp) for _ in range(3)]
        assert rest[-1] == "[DONE]"


async def test_a_client_gone_mid_burst_closes_the_engine_stream() -> None:
    gate = asyncio.Event()
    steps: list[Step] = [Admitted(5), *deltas("a"), gate, *deltas(*("z" * 2000 for _ in range(2000)))]
    engine = GatedEngine("a", [*steps, Finished("stop", 5, 2001)])
    async with serving(engine) as client:
        resp = await client.post(CHAT, json=body())
        await next_event(resp)
        resp.close()
        gate.set()
        for _ in range(400):
            if engine.closed_streams:
                break
            await asyncio.sleep(0.005)
        assert engine.closed_streams == 1 and engine.completed_streams == 0


async def test_accepted_client_sockets_have_tcp_nodelay() -> None:
    gate = asyncio.Event()
    async with serving(GatedEngine("a", [Admitted(5), *deltas("a"), gate, Finished("stop", 5, 1)])) as client:
        resp = await client.post(CHAT, json=body())
        await next_event(resp)
        assert resp.connection is not None and resp.connection.transport is not None
        client_address = resp.connection.transport.get_extra_info("sockname")
        assert tcp_nodelay_of_socket(peer=client_address) != 0  # the gateway's end of the connection
        gate.set()
        await resp.read()
