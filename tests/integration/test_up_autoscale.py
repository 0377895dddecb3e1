"""`switchyard up --plan --autoscale` end to end: the gateway's autoscaler sees a load step on measured QPS,
this command starts the scale-out's copy as new sim agents that join the gateway and serve, and when the load
stops it drains the copy away; no request fails on the way."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from agent_process import REPO, free_port

from launcher.planning_cli import plan

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def write_plan(tmp: Path) -> Path:
    """One 1xa100 copy of a measured 3 req/s (the table is the candidate set), 2 A100s in the inventory."""
    table = tmp / "goodput.json"
    table.write_text(json.dumps({"1xa100": 3.0}))
    path = tmp / "plan.json"
    assert plan(["--model", "llama3-8b", "--workload", "in=200,out=8", "--slo", "ttft=2000,tpot=100",
                 "--goodput-rps", "2", "--gpus", "a100:2", "--goodput-table", str(table),
                 "--json", str(path)]) == 0
    return path


async def get_plan(session: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    async with session.get(f"{base}/v1/plan") as response:
        assert response.status == 200
        body: dict[str, Any] = await response.json()
        return body


async def wait_for(session: aiohttp.ClientSession, base: str, what: str, check: Any,
                   timeout_s: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        body = await get_plan(session, base)
        if check(body):
            return body
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {body['autoscale']}"
        await asyncio.sleep(0.2)


async def ask(session: aiohttp.ClientSession, base: str, model: str) -> int:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with session.post(f"{base}/v1/chat/completions", json=body) as response:
        await response.read()
        return response.status


def copy_states(body: dict[str, Any]) -> dict[str, str]:
    return {c["label"]: c["state"] for c in body["autoscale"]["copies"]}


async def scenario(base: str) -> None:
    async with aiohttp.ClientSession() as session:
        # The banner comes when the gateway listens; the agent's first report (its combo label) may be later.
        body = await wait_for(session, base, "the plan's agent to report",
                              lambda b: any(e["serving"] for e in b["fleet"].get("1xa100#0", [])))
        assert copy_states(body) == {"1xa100#0": "serving"} and body["autoscale"]["actuator"] == "local"
        model = body["fleet"]["1xa100#0"][0]["model"]
        statuses: list[int] = []
        for _ in range(30):  # ~8 req/s for ~4 s against 3 deployed: a scale-out of one copy
            statuses.append(await ask(session, base, model))
            await asyncio.sleep(0.12)
        body = await wait_for(session, base, "the new copy to serve",
                              lambda b: copy_states(b).get("1xa100#1") == "serving")
        assert body["autoscale"]["actions"][0]["kind"] == "ScaleOut"
        assert body["autoscale"]["target_combos"] == {"1xa100": 2}
        body = await wait_for(session, base, "the gateway to see the new agent",
                              lambda b: any(e["serving"] for e in b["fleet"].get("1xa100#1", [])))
        assert body["serving_combos"] == {"1xa100": 2}
        # No load: the newest copy drains and leaves; the plan's copy stays (min_copies) and still serves.
        body = await wait_for(session, base, "the copy to leave",
                              lambda b: copy_states(b).get("1xa100#1") == "gone")
        assert "1xa100#1" not in body["fleet"] and body["autoscale"]["actions"][-1]["kind"] == "ScaleIn"
        statuses.append(await ask(session, base, model))
        assert statuses == [200] * len(statuses)


def test_up_autoscale_adds_a_copy_under_load_and_drains_it_after(tmp_path: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "up.log"
    params = ["step_s=0.5", "local_window_s=2", "global_window_s=600", "provisioning_s=0", "grace_s=0"]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from launcher.cli import main; sys.exit(main(sys.argv[1:]))",
             "up", "--plan", str(write_plan(tmp_path)), "--autoscale", "--port", str(port),
             "--base-agent-port", str(free_port()), "--log-level", "INFO",
             *[arg for p in params for arg in ("--autoscale-param", p)]],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while b"Switchyard is up" not in log_path.read_bytes():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        asyncio.run(scenario(base))
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    text = log_path.read_text()
    assert code == 0, text
    assert "1xa100#1 serves on" in text and "1xa100#1 is gone" in text, text
