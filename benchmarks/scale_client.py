"""The load client of benchmarks/gateway_scale.py: one process holding many slow streaming chat completions.

Owns: `client_worker`, the body of one load-client process (started by gateway_scale.py through
multiprocessing's spawn context): it raises its RLIMIT_NOFILE, opens its streams on one aiohttp session
without a connection limit, at most `ClientPlan.ramp_per_s` a second and at most `ClientPlan.window` still
waiting for their first chunk (so the gateway's accept queue is never flooded), tells the parent (`streaming`)
once every stream has its first chunk or has failed, and at the end reports (`done`) each stream's outcome
(every content chunk, the finish chunk and `[DONE]`, or the error) and the gaps between content chunks that
end inside the hold window the parent sends (`window`). A `LoopLagMonitor` runs in the client too (its
figures inside the window are reported), so gaps that the client's own loop added are told apart from the
gateway's. `lag_probe`: a process that only times its loop during the hold, the host's scheduling floor.
Must not: start or measure other processes (gateway_scale.py does), or parse more of a chunk than the checks
need.
"""

from __future__ import annotations

import asyncio
import multiprocessing.connection
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from gateway.observability.loop_lag import LoopLagMonitor

MODEL = "mock-model"
NOFILE_SLACK = 64


@dataclass(frozen=True)
class ClientPlan:
    url: str  # the gateway's /v1/chat/completions
    streams: int
    tokens: int  # content chunks each stream must bring
    ramp_per_s: float  # new streams per second, at most
    window: int  # streams waiting for their first chunk, at most
    start_at_s: float  # time.monotonic() of the first request (the same clock in every process)


class StreamRecord:
    """What one stream saw: content chunk arrival times, its finish and `[DONE]`, or its error."""

    __slots__ = ("times", "first_s", "finish", "done", "error")

    def __init__(self) -> None:
        self.times: list[float] = []
        self.first_s: float | None = None
        self.finish: str | None = None
        self.done = False
        self.error: str | None = None

    def event(self, raw: bytes, now_s: float) -> None:
        if not raw.startswith(b"data: "):
            return
        payload = raw[6:]
        if payload == b"[DONE]":
            self.done = True
            return
        obj = orjson.loads(payload)
        if "error" in obj:
            self.error = f"error event: {obj['error']}"
            return
        for choice in obj.get("choices") or ():
            if (choice.get("delta") or {}).get("content"):
                self.times.append(now_s)
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]

    def check(self, tokens: int) -> str | None:
        """The stream's error, or what it lacks, or None when it is complete."""
        if self.error is None and (len(self.times) != tokens or self.finish is None or not self.done):
            return f"incomplete: {len(self.times)}/{tokens} chunks, finish={self.finish}, [DONE]={self.done}"
        return self.error


async def _one_stream(
    session: aiohttp.ClientSession, url: str, body: bytes, rec: StreamRecord, settled: Callable[[], None]
) -> None:
    """One stream into `rec`; calls `settled` once: at its first chunk, or when it ends without one."""
    try:
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return
            content = resp.content
            tail = b""
            while True:
                data = await content.readany()
                if not data:
                    break
                now_s = time.monotonic()
                events = (tail + data if tail else data).split(b"\n\n")
                tail = events.pop()
                if rec.first_s is None and events:
                    rec.first_s = now_s
                    settled()
                for raw in events:
                    rec.event(raw, now_s)
            if tail.strip():
                rec.error = f"unterminated event at the end: {tail[:100]!r}"
    except Exception as e:  # every failure is a figure of the run, with its message
        rec.error = rec.error or repr(e)
    finally:
        if rec.first_s is None:
            settled()


async def _hold_streams(
    conn: multiprocessing.connection.Connection, plan: ClientPlan
) -> tuple[list[StreamRecord], list[tuple[float, float]], float]:
    """Open the plan's streams, tell the parent once each streams or has failed, return when all ended."""
    loop = asyncio.get_running_loop()
    lags: list[tuple[float, float]] = []  # (when, lag)
    records = [StreamRecord() for _ in range(plan.streams)]
    request = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": plan.tokens,
        "stream": True,
    }
    body = orjson.dumps(request)
    window = asyncio.Semaphore(plan.window)
    pending = plan.streams
    all_settled = asyncio.Event()

    def settled() -> None:
        nonlocal pending
        window.release()
        pending -= 1
        if pending == 0:
            all_settled.set()

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=60.0)
    async with (
        LoopLagMonitor(lambda lag_s: lags.append((time.monotonic(), lag_s))).running(),
        aiohttp.ClientSession(connector=connector, timeout=timeout) as session,
    ):
        await asyncio.sleep(max(0.0, plan.start_at_s - time.monotonic()))
        started_s = time.monotonic()
        tasks = []
        for i, rec in enumerate(records):
            delay_s = started_s + i / plan.ramp_per_s - time.monotonic()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            await window.acquire()
            tasks.append(loop.create_task(_one_stream(session, plan.url, body, rec, settled)))
        await all_settled.wait()
        streaming = sum(1 for r in records if r.first_s is not None and r.error is None)
        conn.send(("streaming", streaming, time.monotonic() - started_s))
        await asyncio.gather(*tasks)
    return records, lags, started_s


def _raise_nofile(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < need:
        raise SystemExit(
            f"scale_client: {need} file descriptors needed, hard limit {hard}: use more --clients"
        )
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop  # noqa: PLC0415 (optional: the benchmark processes' loops only)
    except ImportError:
        return None
    return uvloop.new_event_loop


def client_worker(conn: multiprocessing.connection.Connection, plan: ClientPlan) -> None:
    """One load-client process (see the module docstring for its messages)."""
    _raise_nofile(plan.streams + NOFILE_SLACK)
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        records, lags, started_s = runner.run(_hold_streams(conn, plan))
    _, t0, t1 = conn.recv()  # ("window", t0, t1) once the parent's hold is over
    gaps: list[float] = []
    errors: list[str] = []
    for rec in records:
        times = rec.times
        gaps.extend(b - a for a, b in zip(times, times[1:], strict=False) if t0 <= b <= t1)
        error = rec.check(plan.tokens)
        if error is not None:
            errors.append(error)
    result: dict[str, Any] = {
        "streams": plan.streams,
        "errors": errors,
        "gaps_s": gaps,
        "loop_lags_s": [lag_s for when_s, lag_s in lags if t0 <= when_s <= t1],
        "started_s": started_s,
        "first_chunk_at_s": [r.first_s for r in records if r.first_s is not None],
        "ended_before_hold_end": sum(1 for r in records if r.times and r.times[-1] < t1),
    }
    conn.send(("done", result))
    conn.close()


def lag_probe(conn: multiprocessing.connection.Connection) -> None:
    """A process that only times its own event loop, from the parent's ("start", seconds) on, then sends
    ("probe", lags): the host's own scheduling delay, the floor under any process's loop lag."""
    _, seconds = conn.recv()
    lags: list[float] = []

    async def probe() -> None:
        async with LoopLagMonitor(lags.append).running():
            await asyncio.sleep(seconds)

    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(probe())
    conn.send(("probe", lags))
    conn.close()
