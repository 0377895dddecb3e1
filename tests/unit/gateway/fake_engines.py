"""In-process fake engines and an app harness for API tests: scripted `EngineClient`s behind the real app.

Owns: `FakeEngine` (plays a script of events, exceptions to raise and sleeps), `script` / `ok_script`, and
`serving`: the real gateway app (real `ClusterStore`, dispatcher, policies) around fakes, with manual clocks,
started behind an aiohttp test client once every fake has reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.app import STORE_KEY, build_app
from gateway.config import GatewayConfig
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
from switchyard.clock import ManualClock

MODEL = "m"
CREATED = 1_700_000_000  # the wall clock's reading: every response's `created`

Script = Callable[[EngineRequest], list[EngineEvent | Exception | float]]


def script(*steps: EngineEvent | Exception | float) -> Script:
    """The same steps for every request."""
    return lambda _: list(steps)


def ok_script(*texts: str, prompt_tokens: int = 5, cached_tokens: int = 0, reason: str = "stop") -> Script:
    def script(_: EngineRequest) -> list[EngineEvent | Exception | float]:
        events: list[EngineEvent | Exception | float] = [Admitted(prompt_tokens)]
        events += [Delta(t, num_tokens=1) for t in texts]
        events.append(Finished(reason, prompt_tokens, len(texts), cached_tokens))  # type: ignore[arg-type]
        return events

    return script


class FakeEngine:
    """An `EngineClient` that plays a script: events, exceptions to raise, or floats (seconds to sleep)."""

    def __init__(self, engine_id: str, script: Script, *, ready: bool = True, model: str = MODEL,
                 combo: str = "") -> None:
        self.engine_id = engine_id
        self.combo = combo
        self.model = model
        self.script = script
        self.ready = ready
        self.requests: list[EngineRequest] = []
        self.closed_streams = 0
        self.completed_streams = 0
        self.max_num_seqs = 64

    @property
    def address(self) -> str:
        return f"fake://{self.engine_id}"

    async def describe(self) -> EngineDescription:
        return EngineDescription(
            EngineId(self.engine_id), self.model, "fake", "sim", "", 4096, 16, self.max_num_seqs
        )

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineEvent]:
        self.requests.append(request)
        try:
            for step in self.script(request):
                if isinstance(step, Exception):
                    raise step
                if isinstance(step, float):
                    await asyncio.sleep(step)
                    continue
                yield step
            self.completed_streams += 1
        finally:
            self.closed_streams += 1

    async def watch_state(self) -> AsyncIterator[EngineReport]:
        yield EngineReport(
            engine_id=EngineId(self.engine_id),
            model=self.model,
            profile="fake",
            backend="sim",
            role="",
            seq=1,
            engine_timestamp_s=0.0,
            ready=self.ready,
            draining=False,
            num_running=0,
            num_waiting=0,
            kv_blocks_total=100,
            kv_blocks_free=80,
            kv_blocks_reserved=0,
            pending_prefill_tokens=0,
            running_batch_tokens=0,
            combo=self.combo,
        )
        await asyncio.Event().wait()

    async def close(self) -> None:
        return None


Client = TestClient[web.Request, web.Application]


@contextlib.asynccontextmanager
async def serving(*engines: FakeEngine, **config: Any) -> AsyncIterator[Client]:
    """The real app around `engines` (config fields as keywords), started once every fake has reported."""
    app = build_app(
        GatewayConfig(**config),
        clock=ManualClock(100.0),
        engine_clients={EngineId(e.engine_id): e for e in engines},
        wall_clock=ManualClock(CREATED),
        rng=random.Random(0),
    )
    client: Client = TestClient(TestServer(app))
    await client.start_server()
    try:
        store = app[STORE_KEY]
        for _ in range(1000):
            if all(store.latest_reports().get(EngineId(e.engine_id)) for e in engines):
                break
            await asyncio.sleep(0.001)
        yield client
    finally:
        await client.close()
