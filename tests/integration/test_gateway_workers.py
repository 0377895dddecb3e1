"""`python -m gateway --workers 2` (a supervisor and two worker processes on one port) in front of two real
sim engine agents (subprocesses), checked against the single-process gateway.

One fleet of agents serves every test; the read-only tests share one supervised gateway, and the tests that
stop or break a gateway get their own. Which worker answered is read from the `x-switchyard-worker` header;
each request that must reach "some worker" opens a new connection (SO_REUSEPORT spreads connections by their
addresses), retried a bounded number of times until both workers are seen.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import serve
from gateway.config import GatewayConfig
from gateway.workers.spec import WORKER_HEADER
from gateway.workers.supervisor import supervise
from launcher.local_fleet import AgentSpec, LocalFleet

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

REPO = Path(__file__).resolve().parents[2]
PROFILE = "h100-llama3-8b"
MODEL = "llama3-8b"
WORKERS = {"0", "1"}
MAX_TRIES = 200  # new connections until both workers are seen: each misses one with probability ~1/2
LISTENING = re.compile(rb"^gateway listening on (http://\S+) \(2 workers\)$")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def chat_body(max_tokens: int, **extra: Any) -> bytes:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hello from a test"}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        **extra,
    }
    return orjson.dumps(body)


def events(raw: bytes) -> list[bytes]:
    return [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]


def check_complete(raw: bytes, tokens: int) -> None:
    """A whole stream: finish `length`, then the usage chunk, then [DONE]."""
    evs = events(raw)
    assert evs[-1] == b"[DONE]", raw[-200:]
    chunks = [orjson.loads(e) for e in evs[:-1]]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == tokens


async def fresh_request(url: str, method: str = "GET", body: bytes | None = None) -> tuple[str, int, bytes]:
    """One request on a connection of its own: (the worker that answered, status, body)."""
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session,
        session.request(method, url, data=body, headers={"Content-Type": "application/json"}) as resp,
    ):
        return resp.headers.get(WORKER_HEADER, ""), resp.status, await resp.read()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(parsed: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> float:
    return sum(v for (n, _), v in parsed.items() if n == name)


@dataclass
class Supervised:
    proc: asyncio.subprocess.Process
    url: str
    log_path: Path

    async def log(self) -> str:
        return await asyncio.to_thread(self.log_path.read_text, errors="replace")

    async def worker_pids(self) -> dict[int, int]:
        found = re.findall(r"gateway worker (\d+) \(pid (\d+)\) started", await self.log())
        return {int(i): int(pid) for i, pid in found}

    async def wait_exit(self, timeout_s: float = 60.0) -> int:
        return await asyncio.wait_for(self.proc.wait(), timeout_s)


async def start_supervised(engines: list[str], log_path: Path, *extra: str) -> Supervised:
    """`python -m gateway --workers 2 --port 0 ...`; returns once both workers answer /health 200."""
    log_file = await asyncio.to_thread(log_path.open, "wb")
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "gateway",
            "--workers",
            "2",
            "--port",
            "0",
            "--stale-after-s",
            "2",
            *(a for e in engines for a in ("--engine", e)),
            *extra,
            cwd=REPO,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=log_file,
        )
    finally:
        log_file.close()
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 60)
    match = LISTENING.match(line.strip())
    gw = Supervised(proc, match.group(1).decode() if match else "", log_path)
    assert match is not None, (line, await gw.log())
    healthy: set[str] = set()
    for _ in range(MAX_TRIES * 2):
        worker, status, _ = await fresh_request(f"{gw.url}/health")
        if status == 200:
            healthy.add(worker)
        if healthy == WORKERS:
            return gw
        await asyncio.sleep(0.02)
    raise AssertionError(f"workers healthy: {healthy}\n{await gw.log()}")


@contextlib.asynccontextmanager
async def supervised(engines: list[str], log_path: Path, *extra: str) -> AsyncIterator[Supervised]:
    gw = await start_supervised(engines, log_path, *extra)
    try:
        yield gw
    finally:
        if gw.proc.returncode is None:
            gw.proc.send_signal(signal.SIGTERM)
            await gw.wait_exit()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engines() -> AsyncIterator[list[str]]:
    specs = [AgentSpec(f"wk-{i}", PROFILE, free_port()) for i in range(2)]
    async with LocalFleet(specs, start_timeout_s=90.0, stop_grace_s=5.0):
        yield [s.address for s in specs]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def gw(engines: list[str], tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Supervised]:
    async with supervised(engines, tmp_path_factory.mktemp("gw") / "gateway.log") as running:
        yield running
    assert running.proc.returncode == 0, await running.log()


async def test_both_workers_serve_and_metrics_add_up(gw: Supervised, engines: list[str]) -> None:
    _, status, before_text = await fresh_request(f"{gw.url}/metrics")
    assert status == 200
    before = samples(before_text.decode())
    served: dict[str, int] = {}
    sent = 0
    while set(served) != WORKERS and sent < MAX_TRIES:
        worker, status, raw = await fresh_request(f"{gw.url}/v1/chat/completions", "POST", chat_body(6))
        sent += 1
        assert status == 200, raw
        check_complete(raw, 6)
        served[worker] = served.get(worker, 0) + 1
    assert set(served) == WORKERS, served

    def grew(after: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> float:
        return total(after, name) - total(before, name)

    # Any worker answers a scrape for the whole gateway: scrape until each has answered one, every answer
    # counting every request (each is counted when its handler ends, a moment after the client saw [DONE]).
    answered: set[str] = set()
    for _ in range(MAX_TRIES * 2):
        worker, status, text = await fresh_request(f"{gw.url}/metrics")
        after = samples(text.decode())
        if grew(after, "switchyard_requests_total") < sent:
            await asyncio.sleep(0.02)
            continue
        assert status == 200
        assert grew(after, "switchyard_requests_total") == sent
        assert grew(after, "switchyard_e2e_request_latency_seconds_count") == sent  # histograms summed
        assert after[("switchyard_e2e_request_latency_seconds_bucket", (("le", "+Inf"),))] == total(
            after, "switchyard_e2e_request_latency_seconds_count"
        )
        assert total(after, "switchyard_requests_in_flight") == 0
        assert after[("switchyard_gateway_workers", ())] == 2
        for engine in engines:  # engine state comes from the answering worker alone: never doubled
            assert after[("switchyard_engine_ready", (("engine", engine),))] == 1
        answered.add(worker)
        if answered == WORKERS:
            break
    assert answered == WORKERS


async def test_stream_bytes_match_the_single_worker_gateway(gw: Supervised, engines: list[str]) -> None:
    config = GatewayConfig(port=0, engines=tuple(engines), stale_after_s=2.0)
    stop = asyncio.Event()
    listening: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    server = asyncio.create_task(
        serve(config, stop=stop, on_listening=listening.set_result, handle_signals=False)
    )
    try:
        single = await asyncio.wait_for(listening, 10)
        for _ in range(400):
            if (await fresh_request(f"{single}/health"))[1] == 200:
                break
            await asyncio.sleep(0.025)
        body = chat_body(12, seed=7, temperature=0.0)

        async def stream(base: str) -> tuple[bytes, str]:
            async with (
                aiohttp.ClientSession() as session,
                session.post(
                    f"{base}/v1/chat/completions",
                    data=body,
                    headers={"Content-Type": "application/json", "x-request-id": "same-id"},
                ) as resp,
            ):
                assert resp.status == 200
                return await resp.read(), resp.headers["Content-Type"]

        one, one_type = await stream(single)
        two, two_type = await stream(gw.url)
    finally:
        stop.set()
        await server
    check_complete(two, 12)
    assert two_type == one_type
    created = re.compile(rb'"created":\d+')  # the wall-clock second the request arrived
    # How much of the prompt was cached depends on which engine served it and what it served before (the
    # first stream's prompt is cached on its engine), not on the gateway's workers.
    cached = re.compile(rb'"cached_tokens":\d+')

    def same(raw: bytes) -> bytes:
        return cached.sub(b'"cached_tokens":0', created.sub(b'"created":0', raw))

    assert same(two) == same(one)


async def test_sigterm_drains_an_in_flight_stream_and_exits_0(engines: list[str], tmp_path: Path) -> None:
    tokens = 400  # a few seconds of decoding on the sim profile: still streaming when the drain begins
    gw = await start_supervised(engines, tmp_path / "gateway.log", "--drain-timeout-s", "60")
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                f"{gw.url}/v1/chat/completions",
                data=chat_body(tokens),
                headers={"Content-Type": "application/json"},
            ) as resp,
        ):
            assert resp.status == 200
            first = await resp.content.readuntil(b"\n\n")
            assert first.startswith(b"data: ")
            gw.proc.send_signal(signal.SIGTERM)
            for _ in range(500):  # the worker serving this stream has begun draining
                if "draining: no new connections" in await gw.log():
                    break
                await asyncio.sleep(0.02)
            assert "draining: no new connections" in await gw.log()
            rest = await resp.read()
        check_complete(first + rest, tokens)
        assert await gw.wait_exit() == 0, await gw.log()
    finally:
        if gw.proc.returncode is None:
            gw.proc.kill()
            await gw.proc.wait()


async def test_a_second_signal_kills_the_draining_workers(engines: list[str], tmp_path: Path) -> None:
    gw = await start_supervised(engines, tmp_path / "gateway.log", "--drain-timeout-s", "60")
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                f"{gw.url}/v1/chat/completions",
                data=chat_body(2000),
                headers={"Content-Type": "application/json"},
            ) as resp,
        ):
            assert resp.status == 200
            await resp.content.readuntil(b"\n\n")
            gw.proc.send_signal(signal.SIGTERM)
            for _ in range(500):
                if "draining: no new connections" in await gw.log():
                    break
                await asyncio.sleep(0.02)
            gw.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(aiohttp.ClientError):
                await resp.read()  # cut off: its worker was killed
        code = await gw.wait_exit()
        log = await gw.log()
        assert code == 1, log
        assert re.search(r"error: killed worker \d \(pid \d+\).*: a second signal", log), log
    finally:
        if gw.proc.returncode is None:
            gw.proc.kill()
            await gw.proc.wait()


async def test_a_killed_worker_stops_the_supervisor_naming_it(engines: list[str], tmp_path: Path) -> None:
    gw = await start_supervised(engines, tmp_path / "gateway.log")
    try:
        pids = await gw.worker_pids()
        assert set(pids) == {0, 1}
        os.kill(pids[1], signal.SIGKILL)
        code = await gw.wait_exit()
        log = await gw.log()
        assert code == 1, log
        assert f"error: worker 1 (pid {pids[1]}) ended unexpectedly (killed by SIGKILL)" in log
        with pytest.raises(ProcessLookupError):  # the other worker was stopped and reaped
            os.kill(pids[0], 0)
    finally:
        if gw.proc.returncode is None:
            gw.proc.kill()
            await gw.proc.wait()


def ended(pid: int) -> bool:
    """Gone, or a zombie left for whoever adopted it once its supervisor died."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


async def test_workers_drain_and_exit_when_their_supervisor_is_killed(
    engines: list[str], tmp_path: Path
) -> None:
    gw = await start_supervised(engines, tmp_path / "gateway.log")
    pids = await gw.worker_pids()
    gw.proc.kill()  # SIGKILL: nothing forwarded; each worker sees its stdin pipe close
    await gw.wait_exit()
    for _ in range(1000):
        if all([await asyncio.to_thread(ended, pid) for pid in pids.values()]):
            break
        await asyncio.sleep(0.02)
    assert all(ended(pid) for pid in pids.values()), await gw.log()
    assert (await gw.log()).count("supervisor gone (stdin closed): draining") == 2


@pytest.mark.parametrize("workers", ["0", "-2"])
async def test_workers_below_one_is_a_one_line_error(workers: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway",
        "--workers",
        workers,
        "--engine",
        "127.0.0.1:1",
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2
    assert out == b""
    assert err.decode().splitlines() == [
        "python -m gateway: error: workers: Input should be greater than or equal to 1"
    ]


async def test_inherited_socket_fallback_serves_and_aggregates(engines: list[str]) -> None:
    """Where SO_REUSEPORT is missing the supervisor binds and the workers inherit its socket (forced here)."""
    config = GatewayConfig(port=0, engines=tuple(engines), stale_after_s=2.0, workers=2, drain_timeout_s=5.0)
    stop = asyncio.Event()
    listening: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    running = asyncio.create_task(
        supervise(
            config, stop=stop, on_listening=listening.set_result, handle_signals=False, reuse_port=False
        )
    )
    try:
        url = await asyncio.wait_for(listening, 60)
        # No balancing here: whichever worker accepts first serves, and one may not see its engines yet (a
        # 503, counted like any request), so requests are sent until 4 streams have been served.
        sent = served = 0
        while served < 4 and sent < MAX_TRIES:
            worker, status, raw = await fresh_request(f"{url}/v1/chat/completions", "POST", chat_body(5))
            sent += 1
            assert worker in WORKERS
            if status == 200:
                check_complete(raw, 5)
                served += 1
            else:
                await asyncio.sleep(0.02)
        assert served == 4
        for _ in range(400):
            _, _, text = await fresh_request(f"{url}/metrics")
            parsed = samples(text.decode())
            if total(parsed, "switchyard_requests_total") >= sent:
                break
            await asyncio.sleep(0.02)
        assert total(parsed, "switchyard_requests_total") == sent
        assert parsed[("switchyard_gateway_workers", ())] == 2
    finally:
        stop.set()
        await asyncio.wait_for(running, 60)
