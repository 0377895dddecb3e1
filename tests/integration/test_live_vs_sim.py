"""Live replay through a real gateway and two real sim agents agrees with the simulator on the same schedule.

The fleet: two `python -m engine_agent --backend sim --profile h100-llama3-8b` subprocesses and one
`python -m gateway --policy round_robin` subprocess in front of them. The workload: the first 40 requests of
the Azure conversation fixture trace, output lengths capped at 64 tokens, prompts synthesised to their exact
length with the sim tokenizer, Poisson arrivals at 4 req/s (seed 0). The same schedule runs live (the `run`
machinery, `loadgen.live.run_live`) and in `loadgen.simulate` with the same engines and policy.

Tolerance, from measurement on a 2-core machine (three runs, live vs sim: TTFT median 16.8-17.1 ms vs
12.5 ms, E2E median 490-491 ms vs 486 ms, TPOT median 7.57 vs 7.53 ms): live adds what the simulator leaves
out on purpose - HTTP and SSE through the gateway, gRPC to the agent, tokenisation of the prompt, and
event-loop scheduling of four processes sharing two cores - about 4-5 ms on every request, which is large
next to a ~12 ms TTFT and small next to a ~490 ms E2E. So: E2E median within 15%, TTFT median within
max(15%, 10 ms), TPOT median within 15%; the token totals must match exactly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from engine_agent.tokenization import Tokenizer
from launcher.local_fleet import AgentSpec, LocalFleet, terminate
from loadgen.arrivals import ArrivalSpec, schedule
from loadgen.compare import agreement
from loadgen.datasets import load_dataset
from loadgen.live import EngineTokenizer, LiveOptions, prepare_requests, run_live, wait_gateway_ready
from loadgen.metrics import summarize
from loadgen.simulate import EngineSpec, SimOptions, simulate

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "data"
PROFILE = "h100-llama3-8b"
MODEL = "llama3-8b"
NUM_REQUESTS = 40
MAX_OUTPUT_TOKENS = 64
RATE_PER_S = 4.0
E2E_TOLERANCE = 0.15
TTFT_TOLERANCE = 0.15
TTFT_FLOOR_MS = 10.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])



@pytest.fixture
async def gateway_url(tmp_path: Path) -> AsyncIterator[str]:
    specs = [AgentSpec(f"lvs-{i}", PROFILE, free_port()) for i in range(2)]
    async with LocalFleet(specs, start_timeout_s=90.0, stop_grace_s=5.0):
        port = free_port()
        with (tmp_path / "gateway.log").open("wb") as log:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gateway", "--port", str(port), "--policy", "round_robin",
                *(arg for s in specs for arg in ("--engine", s.address)), "--log-level", "WARNING",
                cwd=REPO, stdout=log, stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}"
            await wait_gateway_ready(url, len(specs), proc, 60.0)
            yield url
        finally:
            await terminate(proc, 10.0)


async def test_live_replay_agrees_with_the_simulator(gateway_url: str) -> None:
    loaded = load_dataset("azure-conv", FIXTURES, num_requests=NUM_REQUESTS, seed=0)
    capped = [dataclasses.replace(r, output_tokens=min(r.output_tokens or MAX_OUTPUT_TOKENS,
                                                       MAX_OUTPUT_TOKENS)) for r in loaded]
    requests = prepare_requests(capped, EngineTokenizer(Tokenizer.load_sim()), seed=0)
    plan = schedule(requests, ArrivalSpec(rate_per_s=RATE_PER_S, seed=0))

    live = await run_live(plan, LiveOptions(gateway_url, MODEL))
    failed = [o.error for o in live.outcomes if not o.success]
    assert not failed, failed[:3]
    sim = await asyncio.get_running_loop().run_in_executor(
        None, lambda: simulate(plan, [EngineSpec(PROFILE, 2)], SimOptions(policy="round_robin", seed=0)))
    assert all(o.success for o in sim.outcomes)

    live_summary = summarize(live.outcomes, live.duration_s).to_dict()
    sim_summary = summarize(sim.outcomes, sim.duration_s).to_dict()
    assert live_summary["total_output_tokens"] == sim_summary["total_output_tokens"]
    assert live_summary["total_input_tokens"] == sim_summary["total_input_tokens"]  # exact prompt lengths
    agree = agreement(live_summary, sim_summary)
    report = {k: (round(v["live"] or 0, 2), round(v["sim"] or 0, 2)) for k, v in agree.items()}
    print(f"live vs sim (ms): {report}")
    e2e, ttft, tpot = agree["median_e2el_ms"], agree["median_ttft_ms"], agree["median_tpot_ms"]
    assert e2e["sim"] and abs(e2e["diff"] or 0) <= E2E_TOLERANCE * e2e["sim"], report
    assert abs(ttft["diff"] or 0) <= max(TTFT_TOLERANCE * (ttft["sim"] or 0), TTFT_FLOOR_MS), report
    assert tpot["sim"] and abs(tpot["diff"] or 0) <= E2E_TOLERANCE * tpot["sim"], report
