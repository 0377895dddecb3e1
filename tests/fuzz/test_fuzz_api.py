"""The gateway's HTTP surface under generated and mutated requests: a listening gateway (`serve`) in front of
two sim engine agents (child processes), 10,000 cases from `api_fuzz` (hypothesis, drawing from the served
`/openapi.json`), every answer a 2xx or a 4xx in OpenAI's error shape: no 5xx, no broken connection, no
hang; afterwards the gateway is healthy and holds no request.

The cases are generated before the fleet starts (about 15 s of CPU that would otherwise keep the event loop
from the engines' state streams) from `openapi_document()`, which the first test checks is what the gateway
serves.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from api_fuzz import Case, generate_cases, send_all

from gateway.api.openapi import openapi_document
from gateway.app import METRICS_KEY, STORE_KEY, build_app, running
from gateway.config import GatewayConfig
from launcher.local_fleet import AgentSpec, LocalFleet
from switchyard.profiles import get_profile

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

CASES = 10_000
PROFILE = "h100-llama3-8b"
MODEL = get_profile(PROFILE).model.name
CONTEXT_TOKENS = get_profile(PROFILE).max_context_tokens
CONFIG = dict(allow_policy_override=True, request_timeout_s=30.0, drain_timeout_s=2.0, stale_after_s=5.0)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Live:
    app: web.Application
    base_url: str


@pytest.fixture(scope="module")
def cases() -> list[Case]:
    return generate_cases(
        openapi_document(), [MODEL], count=CASES, context_tokens=CONTEXT_TOKENS,
        max_body_bytes=GatewayConfig().max_body_bytes,
    )


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def live(cases: list[Case]) -> AsyncIterator[Live]:
    specs = [AgentSpec(f"fuzz-{i}", PROFILE, free_port()) for i in range(2)]
    async with LocalFleet(specs, start_timeout_s=90.0, stop_grace_s=5.0):
        config = GatewayConfig(port=0, engines=tuple(s.address for s in specs), **CONFIG)  # type: ignore[arg-type]
        app = build_app(config)
        async with running(config, app=app, ready_engines=2) as base_url:
            yield Live(app, base_url)


async def test_openapi_json_is_the_generated_document_and_covers_every_route(live: Live) -> None:
    async with aiohttp.ClientSession() as session, session.get(f"{live.base_url}/openapi.json") as resp:
        assert resp.status == 200 and resp.content_type == "application/json"
        served = await resp.json()
    assert served == json.loads(json.dumps(openapi_document()))
    routes = {r.resource.canonical for r in live.app.router.routes() if r.resource is not None}
    assert routes == set(served["paths"])
    assert live.app[STORE_KEY].models() == (MODEL,)
    assert live.app[STORE_KEY].max_context_tokens(MODEL) == CONTEXT_TOKENS


async def test_generated_and_mutated_requests_get_a_2xx_or_an_openai_4xx(
    live: Live, cases: list[Case]
) -> None:
    report = await send_all(live.base_url, cases, window=64, timeout_s=45.0)
    summary = report.summary()
    print(json.dumps(summary, indent=1))  # shown with -s, and in the failure report
    assert report.sent == len(cases) >= CASES
    assert not report.failures, "\n".join(report.failures[:20])
    # Engines reached: the cases are not all refused at the door.
    assert report.kinds["generated:2xx"] > 300 and report.kinds["mutated:2xx"] > 50
    # Nothing left behind: every engine stream closed, no in-flight accounting, no 5xx ever counted.
    store = live.app[STORE_KEY]
    for _ in range(200):
        if all(e.inflight_requests == 0 for e in store.snapshot().engines):
            break
        await asyncio.sleep(0.05)
    assert [e.inflight_requests for e in store.snapshot().engines] == [0, 0]
    assert store.ready_count() == 2
    fives = {
        line.split('status="')[1][:3]: float(line.rsplit(" ", 1)[1])
        for line in live.app[METRICS_KEY].render().decode().splitlines()
        if line.startswith("switchyard_requests_total{") and 'status="5' in line
    }
    assert fives in ({}, {"503": report.shed_by_own_slo})  # the gateway's own count agrees: no other 5xx
