"""SIGTERM drains, end to end: a gateway subprocess (`python -m gateway`) over sim engine agent subprocesses.

Gateway: SIGTERM closes the listening socket first (aiohttp's runner stops its sites, then closes idle
keep-alive connections, then runs `on_shutdown`, where the drain deadline starts), so a new connection is
refused; `/health` would answer 503 `draining` to any request that still reached it. Streams that finish
within `--drain-timeout-s` say what they would have said without the signal (the chunking of their tokens
is timing's); those still running at the deadline end with one OpenAI-shaped SSE error event (code
`shutting_down`) and `[DONE]`; the engines abort them (their state reports show nothing running) and the
process exits 0.

Agent: SIGTERM makes the agent report `draining` (and not ready) on WatchState and refuse new streams; the
gateway stops routing to it, so new requests go to the other agent with no 503 and no retry, while the
streams already on the draining agent finish normally; then the agent exits 0.

Stream lengths are set with `max_tokens` on the sim profile h100-llama3-8b (~7 ms per decode step).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import signal
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import aiohttp
import openai
import orjson
import pytest
from agent_process import REPO, Agent, free_port
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from gateway.domain import EngineReport, EngineUnavailable
from gateway.engines.grpc_client import GrpcEngineClient

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

MODEL = "llama3-8b"
DRAIN_S = 2.5  # the gateway's --drain-timeout-s in these tests
SHORT_TOKENS = 120  # ~1 s of decoding: ends well inside the drain deadline
LONG_TOKENS = 6000  # ~45 s of decoding: still running at the deadline
SHUTTING_DOWN = {
    "error": {
        "message": "The gateway is shutting down; retry the request.",
        "type": "service_unavailable",
        "param": None,
        "code": "shutting_down",
    }
}
DRAINING_LOG = "draining: no new connections"


def chat_body(max_tokens: int) -> dict[str, Any]:
    """A streamed chat request of exactly `max_tokens` tokens, sampled reproducibly."""
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me about draining"}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "seed": 7,
        "temperature": 0.0,
    }


def events(raw: bytes) -> list[bytes]:
    return [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]


def check_complete(raw: bytes, tokens: int) -> None:
    """A whole stream: no error, finish `length`, the usage chunk, then [DONE]."""
    evs = events(raw)
    assert evs[-1] == b"[DONE]", raw[-300:]
    chunks = [orjson.loads(e) for e in evs[:-1]]
    assert not [c for c in chunks if "error" in c], raw[-300:]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == tokens


def semantics(raw: bytes) -> tuple[Any, ...]:
    """What a whole stream says, less how its tokens were split into chunks (a timing matter: deltas that
    arrive together are sent as one) and the wall-clock second in `created`: id, model, role, the text,
    finish reason, usage less its cached tokens (how much of the prompt an engine had cached depends on what
    it served before, not on the signal: the reference's own prompt, for one)."""
    chunks = [orjson.loads(e) for e in events(raw)[:-1]]
    usage = {k: v for k, v in chunks[-1]["usage"].items() if k != "prompt_tokens_details"}
    content = [c for c in chunks if c["choices"]]
    return (
        {c["id"] for c in chunks},
        {c["model"] for c in chunks},
        content[0]["choices"][0]["delta"].get("role"),
        "".join(c["choices"][0]["delta"].get("content") or "" for c in content),
        [c["choices"][0]["finish_reason"] for c in content if c["choices"][0]["finish_reason"]],
        usage,
    )


def check_cut_by_shutdown(raw: bytes) -> None:
    """A stream ended by the drain deadline: content chunks, exactly one error event, then [DONE]."""
    evs = events(raw)
    assert evs[-1] == b"[DONE]", raw[-300:]
    payloads = [orjson.loads(e) for e in evs[:-1]]
    errors = [p for p in payloads if "error" in p]
    assert errors == [SHUTTING_DOWN], raw[-300:]
    assert payloads[-1] == SHUTTING_DOWN  # the error is the last event before [DONE]
    chunks = payloads[:-1]
    assert len(chunks) > 1 and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert all(choice["finish_reason"] is None for c in chunks for choice in c["choices"])


def metric_total(text: str, name: str, **labels: str) -> float:
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    )


@dataclass
class Gateway:
    """`python -m gateway` on a free port; its stderr (the log) goes to `log_path`."""

    proc: asyncio.subprocess.Process
    url: str
    log_path: Path
    session: aiohttp.ClientSession = field(repr=False)

    async def log(self) -> str:
        return await asyncio.to_thread(self.log_path.read_text, errors="replace")

    async def health(self) -> tuple[int, dict[str, Any]]:
        async with self.session.get(f"{self.url}/health") as resp:
            return resp.status, orjson.loads(await resp.read())

    async def metrics(self) -> str:
        async with self.session.get(f"{self.url}/metrics") as resp:
            assert resp.status == 200
            return await resp.text()

    async def open_stream(self, max_tokens: int, request_id: str) -> tuple[aiohttp.ClientResponse, bytes]:
        """POST a streamed chat request; returns the response once its first event has arrived."""
        resp = await self.session.post(
            f"{self.url}/v1/chat/completions",
            json=chat_body(max_tokens),
            headers={"x-request-id": request_id},
        )
        assert resp.status == 200, await resp.text()
        return resp, await resp.content.readuntil(b"\n\n")

    async def complete_stream(self, max_tokens: int, request_id: str) -> bytes:
        resp, first = await self.open_stream(max_tokens, request_id)
        async with resp:
            return first + await resp.read()

    async def engines_ready(self, count: int) -> bool:
        return bool((await self.health())[1]["engines_ready"] == count)

    async def requests_counted(self, count: int) -> bool:
        return metric_total(await self.metrics(), "switchyard_requests_total") >= count

    async def wait_log(self, text: str, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in await self.log():
            assert time.monotonic() < deadline, f"{text!r} not logged:\n{await self.log()}"
            await asyncio.sleep(0.02)


async def until(probe: Callable[[], bool | Awaitable[bool]], what: str, timeout_s: float = 5.0) -> None:
    """Poll `probe` (a predicate or a coroutine function) until it holds; fail naming `what` on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = probe()
        if await result if inspect.isawaitable(result) else result:
            return
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def gateway(engines: list[str], tmp: Path, *extra: str) -> AsyncIterator[Gateway]:
    """A gateway over `engines` (round robin), yielded once /health reports every engine ready."""
    port = free_port()
    log_path = tmp / "gateway.log"
    log_file = await asyncio.to_thread(log_path.open, "wb")
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway", "--port", str(port), "--policy", "round_robin",
            "--stale-after-s", "2", "--drain-timeout-s", str(DRAIN_S),
            *(arg for engine in engines for arg in ("--engine", engine)), *extra,
            cwd=REPO, stdin=asyncio.subprocess.DEVNULL, stdout=log_file, stderr=log_file,
        )  # fmt: skip
    finally:
        log_file.close()
    try:
        async with aiohttp.ClientSession() as session:
            gw = Gateway(proc, f"http://127.0.0.1:{port}", log_path, session)
            deadline = time.monotonic() + 30
            while True:
                assert proc.returncode is None, await gw.log()
                with contextlib.suppress(aiohttp.ClientError):
                    status, body = await gw.health()
                    if status == 200 and body["engines_ready"] == len(engines):
                        break
                assert time.monotonic() < deadline, await gw.log()
                await asyncio.sleep(0.05)
            yield gw
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@contextlib.asynccontextmanager
async def agents(tmp: Path, *extra: str, count: int = 2) -> AsyncIterator[list[Agent]]:
    """`count` sim agents (started off the loop: `Agent.start` polls health with blocking calls); each must
    exit 0 at the end, whether the test stopped it or this does."""
    started = await asyncio.gather(*(asyncio.to_thread(Agent.start, tmp, *extra) for _ in range(count)))
    try:
        yield list(started)
    finally:
        codes = await asyncio.gather(*(asyncio.to_thread(a.terminate) for a in started))
        for agent, code in zip(started, codes, strict=True):
            assert code == 0, agent.log()


async def next_report(
    client: GrpcEngineClient, predicate: Callable[[EngineReport], bool], timeout_s: float = 5.0
) -> EngineReport:
    """The first state report of a WatchState call (opened now) that satisfies `predicate`."""
    watch = cast(AsyncGenerator[EngineReport, None], client.watch_state())  # closed here: cancels the call
    async with asyncio.timeout(timeout_s), contextlib.aclosing(watch) as reports:
        async for report in reports:
            if predicate(report):
                return report
    raise AssertionError("WatchState ended")


async def refused_or_draining(url: str) -> str:
    """What a new connection gets from a draining gateway: refused, or /health 503 `draining`."""
    try:
        async with (
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session,
            session.get(f"{url}/health") as resp,
        ):
            body = orjson.loads(await resp.read())
    except aiohttp.ClientConnectorError:
        return "refused"
    assert (resp.status, body["status"]) == (503, "draining")
    return "503 draining"


async def test_gateway_sigterm_drains_streams_then_ends_the_rest_and_exits_0(tmp_path: Path) -> None:
    async with agents(tmp_path) as (a, b), gateway([a.target, b.target], tmp_path) as gw:
        # The reference: the short stream, served before any signal.
        reference = await gw.complete_stream(SHORT_TOKENS, "short-0")
        check_complete(reference, SHORT_TOKENS)

        engine_clients = [GrpcEngineClient(agent.target) for agent in (a, b)]
        async with AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0) as client:
            try:
                # Three long streams (round robin: on both engines), one through the official client ...
                longs = [await gw.open_stream(LONG_TOKENS, f"long-{i}") for i in range(2)]
                body = chat_body(LONG_TOKENS)
                sim_only = {"ignore_eos": body.pop("ignore_eos")}
                official = await client.chat.completions.create(
                    **body, extra_body=sim_only, extra_headers={"x-request-id": "long-openai"}
                )
                first = await anext(aiter(official))
                assert first.choices[0].delta.role == "assistant"
                for c in engine_clients:
                    await next_report(c, lambda r: r.num_running + r.num_waiting >= 1)
                # ... and two short ones, opened last: ~1 s of decoding left when the signal comes.
                shorts = [await gw.open_stream(SHORT_TOKENS, f"short-{i}") for i in range(2)]
                assert metric_total(await gw.metrics(), "switchyard_requests_in_flight") == 5

                signalled_s = time.monotonic()
                gw.proc.send_signal(signal.SIGTERM)
                await gw.wait_log(DRAINING_LOG)
                # (a) the listening socket is closed: a new connection is refused (or told "draining").
                assert await refused_or_draining(gw.url) in ("refused", "503 draining")

                # (b) streams that end within the deadline say what they would have without the signal.
                for i, (resp, head) in enumerate(shorts):
                    async with resp:
                        raw = head + await resp.read()
                    check_complete(raw, SHORT_TOKENS)
                    if i == 0:  # the same request id and seed as the reference
                        assert semantics(raw) == semantics(reference)
                    assert time.monotonic() - signalled_s < DRAIN_S
                assert await refused_or_draining(gw.url) in ("refused", "503 draining")

                # (c) streams still running at the deadline: one `shutting_down` error event, then [DONE].
                for resp, head in longs:
                    async with resp:
                        raw = head + await resp.read()
                    assert time.monotonic() - signalled_s >= DRAIN_S
                    check_cut_by_shutdown(raw)
                with pytest.raises(openai.APIError) as cut:
                    async for _ in official:
                        pass
                assert cut.value.code == "shutting_down" and cut.value.type == "service_unavailable"

                # (d) the process exits 0 soon after the deadline, having cut exactly the three long streams.
                code = await asyncio.wait_for(gw.proc.wait(), DRAIN_S + 10)
                log = await gw.log()
                assert code == 0, log
                assert "drain deadline passed: ending 3 request(s)" in log, log

                # (e) the engines aborted the cut streams (thousands of tokens each were left to decode).
                for c in engine_clients:
                    idle = await next_report(c, lambda r: r.num_running + r.num_waiting == 0, timeout_s=2.0)
                    assert idle.ready and not idle.draining
            finally:
                for c in engine_clients:
                    await c.close()


async def collect_reports(client: GrpcEngineClient, into: list[EngineReport]) -> None:
    """Every state report until the agent's WatchState call ends (it stops)."""
    with contextlib.suppress(EngineUnavailable):
        async for report in client.watch_state():
            into.append(report)


async def test_agent_sigterm_reports_draining_gets_no_new_work_and_finishes_in_flight(tmp_path: Path) -> None:
    in_flight_tokens = 500  # ~3.5 s: still running on the draining agent while new requests arrive
    async with (
        agents(tmp_path, "--drain-grace-s", "30", "--state-interval-ms", "20") as (a, b),
        gateway([a.target, b.target], tmp_path) as gw,
    ):
        streams = [await gw.open_stream(in_flight_tokens, f"inflight-{i}") for i in range(4)]
        client_a = GrpcEngineClient(a.target)
        reports_a: list[EngineReport] = []
        watching: asyncio.Task[None] | None = None
        try:
            # Round robin put two of the four streams on agent A.
            await next_report(client_a, lambda r: r.num_running + r.num_waiting == 2)
            watching = asyncio.create_task(collect_reports(client_a, reports_a))
            await asyncio.sleep(0.1)  # its first report (not draining yet) has arrived
            retries_before = metric_total(await gw.metrics(), "switchyard_dispatch_retries_total")

            a.proc.send_signal(signal.SIGTERM)
            # A request racing the signal is served too (by B, or refused by A and retried on B).
            check_complete(await gw.complete_stream(10, "racing"), 10)
            # The agent reports draining, not ready ...
            await until(lambda: any(r.draining for r in reports_a), "agent A reports draining")
            draining = [r for r in reports_a if r.draining]
            assert all(not r.ready for r in draining)
            assert reports_a.index(draining[0]) > 0 and not reports_a[0].draining
            # ... and the gateway takes it out of rotation.
            await until(lambda: gw.engines_ready(1), "the gateway sees one engine ready")
            retries_racing = metric_total(await gw.metrics(), "switchyard_dispatch_retries_total")
            assert retries_racing - retries_before <= 1  # only the racing request may have met A

            # New requests while A drains: all served by B, none sent to A (A would refuse: a retry).
            news = await asyncio.gather(*(gw.complete_stream(20, f"new-{i}") for i in range(6)))
            for raw in news:
                check_complete(raw, 20)
            assert a.proc.poll() is None, "A exited before its in-flight streams finished"
            metrics = await gw.metrics()
            assert metric_total(metrics, "switchyard_dispatch_retries_total") == retries_racing

            # A's in-flight streams (and B's) finish normally.
            for resp, head in streams:
                async with resp:
                    check_complete(head + await resp.read(), in_flight_tokens)
            # Then A exits 0, having refused nothing it had admitted.
            code = await asyncio.to_thread(a.proc.wait, 20)
            log_a = await asyncio.to_thread(a.log)
            assert code == 0, log_a
            assert "draining: 2 generate stream(s) in flight" in log_a, log_a
            assert "drain grace expired" not in log_a
            await asyncio.wait_for(watching, 5)
            assert max(r.num_running + r.num_waiting for r in draining) <= 2

            # With A gone, B keeps serving; no request of this test was answered 503.
            check_complete(await gw.complete_stream(10, "after"), 10)
            status, body = await gw.health()
            assert (status, body["engines_ready"]) == (200, 1)
            await until(lambda: gw.requests_counted(12), "12 requests counted")  # when their handlers return
            metrics = await gw.metrics()
            assert metric_total(metrics, "switchyard_requests_total", status="200") == 12
            assert metric_total(metrics, "switchyard_requests_total") == 12  # no 503, nor anything else
        finally:
            if watching is not None:
                watching.cancel()
            await client_a.close()
        gw.proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(gw.proc.wait(), 10) == 0, await gw.log()
