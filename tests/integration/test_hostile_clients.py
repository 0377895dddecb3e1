"""Hostile clients against a listening gateway (`gateway.app.serve`, the production server settings) over
in-process scripted engines: slowloris heads and bodies, idle streams, slow readers, and oversized requests.

Raw sockets (the event loop's `sock_*` calls, no client-side buffering) play the clients that send half a
request or never read; aiohttp's client plays the well-behaved ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field

import aiohttp
import orjson
import pytest
from aiohttp import web

from gateway.app import METRICS_KEY, STORE_KEY, build_app, running
from gateway.config import ClientLimitsConfig, GatewayConfig
from gateway.domain import (
    Admitted,
    Delta,
    EngineDescription,
    EngineEvent,
    EngineId,
    EngineReport,
    EngineRequest,
    Finished,
)

pytestmark = pytest.mark.integration

MODEL = "m"
CONTEXT_TOKENS = 4096
Step = EngineEvent | float  # an event to yield, or seconds to sleep
Script = Callable[[EngineRequest], Iterable[Step]]


def answer(*texts: str) -> Script:
    def script(_: EngineRequest) -> Iterator[Step]:
        yield Admitted(3)
        for text in texts:
            yield Delta(text, num_tokens=1)
        yield Finished("stop", 3, len(texts))

    return script


@dataclass
class Engine:
    """An `EngineClient` playing `script`; counts what it produced and how its streams ended."""

    script: Script
    engine_id: str = "e0"
    produced_bytes: int = 0
    produced_events: int = 0
    closed: int = 0
    completed: int = 0
    requests: list[EngineRequest] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"fake://{self.engine_id}"

    async def describe(self) -> EngineDescription:
        return EngineDescription(EngineId(self.engine_id), MODEL, "fake", "sim", "", CONTEXT_TOKENS, 16, 64)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineEvent]:
        self.requests.append(request)
        try:
            for step in self.script(request):
                if isinstance(step, float):
                    await asyncio.sleep(step)
                    continue
                self.produced_events += 1
                if isinstance(step, Delta):
                    self.produced_bytes += len(step.text)
                yield step
            self.completed += 1
        finally:
            self.closed += 1

    async def watch_state(self) -> AsyncIterator[EngineReport]:
        yield EngineReport(
            EngineId(self.engine_id), MODEL, "fake", "sim", "", 1, 0.0, True, False, 0, 0, 100, 80, 0, 0, 0
        )
        await asyncio.Event().wait()

    async def close(self) -> None:
        return None


@dataclass
class Gateway:
    app: web.Application
    host: str
    port: int
    transports: list[asyncio.Transport]  # the server side of each answered request, in order

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def slow_client_aborts(self) -> float:
        return float(self.app[METRICS_KEY].slow_client_aborts._value.get())

    async def connect(self, *, rcvbuf: int | None = None) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:  # before connect, so the advertised window is small from the start
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (self.host, self.port))
        return sock


@contextlib.asynccontextmanager
async def gateway(engine: Engine, *, sndbuf: int | None = None, **limits: float) -> AsyncIterator[Gateway]:
    """The app served by `serve` on a free port; `sndbuf` shrinks the server sockets' send buffers (so that a
    client that stops reading back-pressures the gateway after kilobytes, not the kernel's megabytes)."""
    config = GatewayConfig(port=0, drain_timeout_s=1.0, client_limits=ClientLimitsConfig(**limits))
    app = build_app(config, engine_clients={EngineId(engine.engine_id): engine}, rng=random.Random(0))
    transports: list[asyncio.Transport] = []

    async def keep_transport(request: web.Request, response: web.StreamResponse) -> None:
        transport = request.transport
        assert transport is not None
        transports.append(transport)  # type: ignore[arg-type]
        if sndbuf is not None:
            transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)

    app.on_response_prepare.append(keep_transport)
    async with running(config, app=app, ready_engines=1) as base_url:
        host, port = base_url.removeprefix("http://").rsplit(":", 1)
        yield Gateway(app, host, int(port), transports)


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.01)
    return predicate()


async def closed_after_s(sock: socket.socket, timeout_s: float = 10.0) -> tuple[float, bytes]:
    """Seconds until the peer closed `sock`, and what it sent before."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    received = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := await asyncio.wait_for(loop.sock_recv(sock, 65536), timeout_s):
            received += chunk
    return loop.time() - started, received


def request_bytes(body: dict[str, object], *, content_length: int | None = None) -> tuple[bytes, bytes]:
    """(head, body) of a chat completion POST."""
    payload = orjson.dumps(body)
    length = len(payload) if content_length is None else content_length
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()
    return head, payload


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


# ---- slowloris ------------------------------------------------------------------------------------------


async def test_a_connection_that_never_finishes_its_head_is_closed_at_the_bound() -> None:
    async with gateway(Engine(answer("ok")), header_read_timeout_s=0.5) as gw:
        silent = await gw.connect()
        partial = await gw.connect()
        await asyncio.get_running_loop().sock_sendall(partial, b"POST /v1/chat/completions HTTP/1.1\r\nHo")
        (silent_s, silent_got), (partial_s, partial_got) = await asyncio.gather(
            closed_after_s(silent), closed_after_s(partial)
        )
        assert 0.4 < silent_s < 3.0 and 0.4 < partial_s < 3.0
        assert silent_got == partial_got == b""  # closed without an answer: there is no request to answer
        silent.close()
        partial.close()


async def test_trickling_a_head_does_not_extend_the_bound() -> None:
    async with gateway(Engine(answer("ok")), header_read_timeout_s=0.5) as gw:
        sock = await gw.connect()
        loop = asyncio.get_running_loop()

        async def trickle() -> None:
            with contextlib.suppress(OSError):
                for byte in b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nX-Slow: " + b"a" * 200:
                    await loop.sock_sendall(sock, bytes([byte]))
                    await asyncio.sleep(0.05)

        sender = asyncio.create_task(trickle())
        closed_s, got = await closed_after_s(sock)
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
        assert 0.4 < closed_s < 3.0 and got == b""
        sock.close()


async def test_slowloris_connections_do_not_block_a_normal_request() -> None:
    async with gateway(Engine(answer("hello")), header_read_timeout_s=2.0) as gw:
        loop = asyncio.get_running_loop()
        partial = [await gw.connect() for _ in range(200)]
        for sock in partial:
            await loop.sock_sendall(sock, b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n")
        async with aiohttp.ClientSession() as session:
            started = loop.time()
            async with session.post(f"{gw.url}/v1/chat/completions", json=CHAT) as resp:
                body = await resp.json()
            answered_s = loop.time() - started
        assert resp.status == 200 and body["choices"][0]["message"]["content"] == "hello"
        assert answered_s < 2.0  # answered while every slowloris connection was still open
        closed = await asyncio.gather(*(closed_after_s(sock) for sock in partial))
        assert all(got == b"" for _, got in closed)
        for sock in partial:
            sock.close()


async def test_a_body_that_does_not_arrive_in_time_is_answered_408() -> None:
    async with gateway(Engine(answer("ok")), body_read_timeout_s=0.5) as gw:
        sock = await gw.connect()
        head, body = request_bytes(CHAT)
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(sock, head + body[: len(body) // 2])
        started = loop.time()
        first = await asyncio.wait_for(loop.sock_recv(sock, 65536), 5.0)
        answered_s = loop.time() - started
        sock.close()
        status_line, _, rest = first.partition(b"\r\n")
        assert status_line == b"HTTP/1.1 408 Request Timeout"
        error = orjson.loads(rest.partition(b"\r\n\r\n")[2])["error"]
        assert error["code"] == "body_read_timeout" and error["type"] == "invalid_request_error"
        assert "0.5 s" in error["message"]
        assert 0.4 < answered_s < 3.0
        assert gw.app[STORE_KEY].snapshot().engines[0].inflight_requests == 0


# ---- request bounds -------------------------------------------------------------------------------------

BOUNDS = [
    # (body overrides, status, param, message fragment)
    ({"max_tokens": CONTEXT_TOKENS + 1}, 400, "max_tokens", f"context length of {CONTEXT_TOKENS} tokens"),
    ({"max_completion_tokens": 10**6}, 400, "max_completion_tokens", f"of {CONTEXT_TOKENS} tokens"),
    ({"max_tokens": None, "min_tokens": CONTEXT_TOKENS + 1}, 400, "min_tokens", f"{CONTEXT_TOKENS} tokens"),
    ({"max_tokens": 2**32}, 400, "max_tokens", "less than or equal to 4294967295"),
    ({"n": 17}, 400, "n", "less than or equal to 16"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4 stop sequences"),
    ({"stop": "x" * 1025}, 400, "stop", "at most 1024 characters"),
    ({"messages": [{"role": "user", "content": "a"}] * 2049}, 400, "messages", "at most 2048 items"),
    ({"seed": 2**63 - 1, "n": 2}, 400, "seed", "seed + n - 1"),
]


@pytest.mark.parametrize(("overrides", "status", "param", "fragment"), BOUNDS)
async def test_out_of_bounds_requests_are_refused_naming_the_field(
    overrides: dict[str, object], status: int, param: str, fragment: str
) -> None:
    engine = Engine(answer("ok"))
    async with gateway(engine) as gw, aiohttp.ClientSession() as session:
        async with session.post(f"{gw.url}/v1/chat/completions", json={**CHAT, **overrides}) as resp:
            body = await resp.json()
    assert resp.status == status
    assert body["error"]["param"] == param and fragment in body["error"]["message"], body
    assert engine.requests == []


async def test_output_limits_up_to_the_context_reach_the_engine() -> None:
    engine = Engine(answer("ok"))
    async with gateway(engine) as gw, aiohttp.ClientSession() as session:
        for field_name in ("max_tokens", "max_completion_tokens"):
            payload = {**CHAT, "max_tokens": None, field_name: CONTEXT_TOKENS}
            async with session.post(f"{gw.url}/v1/chat/completions", json=payload) as resp:
                assert resp.status == 200
    assert [r.max_tokens for r in engine.requests] == [CONTEXT_TOKENS, CONTEXT_TOKENS]


# ---- idle streams ---------------------------------------------------------------------------------------


async def test_a_stream_the_engine_goes_quiet_on_ends_with_an_error_event() -> None:
    def stalls(_: EngineRequest) -> Iterator[Step]:
        yield Admitted(3)
        yield Delta("first", num_tokens=1)
        yield 30.0  # silent far beyond the idle bound
        yield Finished("stop", 3, 1)

    engine = Engine(stalls)
    async with gateway(engine, idle_stream_timeout_s=0.4) as gw, aiohttp.ClientSession() as session:
        loop = asyncio.get_running_loop()
        started = loop.time()
        async with session.post(f"{gw.url}/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
            assert resp.status == 200
            events = [line for line in (await resp.read()).split(b"\n\n") if line]
        ended_s = loop.time() - started
        assert events[-1] == b"data: [DONE]"
        error = orjson.loads(events[-2].removeprefix(b"data: "))["error"]
        assert error["code"] == "stream_idle_timeout" and error["type"] == "timeout_error"
        assert any(b'"content":"first"' in e for e in events[:-2])
        assert 0.35 < ended_s < 3.0
        assert await wait_until(lambda: engine.closed == 1)
        assert engine.completed == 0  # the engine stream was closed, not run to its end
        assert gw.app[STORE_KEY].snapshot().engines[0].inflight_requests == 0


async def test_an_engine_silent_before_the_first_event_gets_a_504() -> None:
    engine = Engine(lambda _: iter([30.0]))
    async with gateway(engine, idle_stream_timeout_s=0.3) as gw, aiohttp.ClientSession() as session:
        async with session.post(f"{gw.url}/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
            body = await resp.json()
        assert resp.status == 504 and body["error"]["code"] == "stream_idle_timeout"
        assert await wait_until(lambda: engine.closed == 1)


async def test_a_slow_but_steady_stream_is_not_idle() -> None:
    def steady(_: EngineRequest) -> Iterator[Step]:
        yield Admitted(3)
        for i in range(8):
            yield 0.1
            yield Delta(str(i), num_tokens=1)
        yield Finished("stop", 3, 8)

    async with gateway(Engine(steady), idle_stream_timeout_s=0.3) as gw, aiohttp.ClientSession() as session:
        async with session.post(f"{gw.url}/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
            raw = await resp.read()
        assert resp.status == 200 and b"error" not in raw and raw.endswith(b"data: [DONE]\n\n")


# ---- slow readers ---------------------------------------------------------------------------------------

DELTA_TEXT = "x" * 4096


def endless(_: EngineRequest) -> Iterator[Step]:
    yield Admitted(3)
    while True:
        yield Delta(DELTA_TEXT, num_tokens=1)


async def test_a_client_that_stops_reading_back_pressures_the_engine_then_is_aborted() -> None:
    engine = Engine(endless)
    async with gateway(engine, sndbuf=16 * 1024, slow_client_timeout_s=0.5) as gw:
        loop = asyncio.get_running_loop()
        sock = await gw.connect(rcvbuf=4096)
        head, body = request_bytes({**CHAT, "max_tokens": CONTEXT_TOKENS, "stream": True})
        await loop.sock_sendall(sock, head + body)  # ... and never reads
        assert await wait_until(lambda: len(gw.transports) == 1)
        transport = gw.transports[0]
        buffered_max = 0
        produced: list[tuple[float, int]] = []  # (time, bytes the engine produced by then)
        deadline = loop.time() + 5.0
        while gw.slow_client_aborts() == 0 and loop.time() < deadline:
            buffered_max = max(buffered_max, transport.get_write_buffer_size())
            produced.append((loop.time(), engine.produced_bytes))
            await asyncio.sleep(0.01)
        assert gw.slow_client_aborts() == 1
        # Back-pressure reached the engine: what it produced is what the buffers hold, not a growing pile.
        cut_s, total = produced[-1]
        assert total < 1024 * 1024
        assert buffered_max < 256 * 1024  # aiohttp's and asyncio's write limits, plus one burst
        earlier = [n for t, n in produced if t <= cut_s - 0.2]
        assert earlier and earlier[-1] == total  # nothing pulled from the engine in the 0.2 s before the cut
        assert await wait_until(lambda: engine.closed == 1)
        assert engine.completed == 0
        assert transport.is_closing()
        assert gw.app[STORE_KEY].snapshot().engines[0].inflight_requests == 0
        requests_total = gw.app[METRICS_KEY].requests.labels(MODEL, "499")._value.get()
        assert requests_total == 1
        sock.close()


async def test_a_client_that_never_reads_a_json_answer_is_cut() -> None:
    engine = Engine(answer(*[DELTA_TEXT] * 256))  # a 1 MiB answer
    async with gateway(engine, sndbuf=16 * 1024, slow_client_timeout_s=0.5) as gw:
        loop = asyncio.get_running_loop()
        sock = await gw.connect(rcvbuf=4096)
        head, body = request_bytes(CHAT)
        await loop.sock_sendall(sock, head + body)
        assert await wait_until(lambda: gw.slow_client_aborts() == 1, timeout_s=5.0)
        assert gw.transports[0].is_closing()
        sock.close()


async def test_a_reading_client_is_never_cut() -> None:
    engine = Engine(answer(*[DELTA_TEXT] * 256))
    async with gateway(engine, sndbuf=16 * 1024, slow_client_timeout_s=0.3) as gw:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{gw.url}/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
                raw = b""
                async for chunk in resp.content.iter_any():
                    raw += chunk
                    await asyncio.sleep(0.01)  # slow, but reading
        assert raw.endswith(b"data: [DONE]\n\n") and raw.count(b"x" * 4096) == 256
        assert gw.slow_client_aborts() == 0
