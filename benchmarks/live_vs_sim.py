"""How well the simulator predicts a live fleet: the same schedule replayed live and in `loadgen.simulate`.

Starts N `python -m engine_agent --backend sim` agents and one `python -m gateway` in front of them (local
subprocesses), replays a trace live through the OpenAI protocol with `loadgen.live.run_live` (the machinery
of `python -m loadgen run`), then simulates the identical schedule with the same engines and policy. The
baseline is the simulation of the same requests in the same run; the figure of merit is the agreement: live /
sim ratios of TTFT, TPOT and E2E medians and p90s and of output throughput. The default load is heavier than
the integration test's (200 Azure conversation requests at 12 req/s on 2 H100 engines, outputs capped at
256 tokens, so queues form). Then, with two engines or more, one KV migration on the same live fleet (a
3000-token greedy request cut on engine 0 after 20 tokens, resumed on engine 1): the pause the client sees
(engine 0's last token to engine 1's first) against the simulator's model of it (the KV transfer at the
agents' modelled link plus one decode iteration), as a ratio. Printed and written as JSON (default
results/live_vs_sim.json).

    .venv/bin/python benchmarks/live_vs_sim.py [--num-requests 200] [--rate 12] [--engines 2]
        [--policy round_robin] [--max-output-tokens 256] [--dataset azure-conv] [--data-dir DIR]
        [--output PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from engine_agent.config import AgentConfig
from engine_agent.sim.profiles import get_profile
from engine_agent.tokenization import Tokenizer
from launcher.local_fleet import AgentSpec, LocalFleet, terminate
from loadgen.arrivals import ArrivalSpec, schedule
from loadgen.compare import AGREEMENT_KEYS, agreement
from loadgen.datasets import Request, load_dataset
from loadgen.live import EngineTokenizer, LiveOptions, prepare_requests, run_live, wait_gateway_ready
from loadgen.metrics import summarize
from loadgen.paths import resolve_data_dir
from loadgen.simulate import EngineSpec, SimOptions, simulate
from switchyard.proto_gen import engine_agent_pb2 as pb
from switchyard.proto_gen import engine_agent_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[1]
PROFILE = "h100-llama3-8b"
MIGRATION_PROMPT_TOKENS, MIGRATION_CUT_AFTER, MIGRATION_MAX_TOKENS = 3000, 20, 200


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])



async def migration_pause(source: str, target: str) -> dict[str, float]:
    """One request migrated from agent `source` to agent `target` (as tests/integration/
    test_agent_migration_sim.py does): the client's pause against the sim's model of it."""
    ids = [100 + i % 5000 for i in range(MIGRATION_PROMPT_TOKENS)]
    req = pb.GenerateRequest(request_id="bench-migrate", prompt_token_ids=pb.TokenIds(ids=ids),
                             sampling=pb.SamplingParams(max_tokens=MIGRATION_MAX_TOKENS, temperature=0.0,
                                                        ignore_eos=True))
    async with grpc.aio.insecure_channel(source) as a_channel, grpc.aio.insecure_channel(target) as b_channel:
        a, b = pb_grpc.EngineAgentStub(a_channel), pb_grpc.EngineAgentStub(b_channel)
        tokens, last_token_s, ticket = 0, 0.0, None
        async for event in a.Generate(req):  # ends with `migrated`
            if event.HasField("delta") and event.delta.token_ids:
                tokens += len(event.delta.token_ids)
                last_token_s = time.perf_counter()
                if tokens >= MIGRATION_CUT_AFTER and ticket is None:
                    cut = pb.MigrateOutRequest(request_id=req.request_id, target=target)
                    ticket = await a.MigrateOut(cut)
        if ticket is None:
            raise RuntimeError(f"the request finished on {source} before it could be cut")
        sent_s, first_token_s = time.perf_counter(), 0.0
        async for event in b.MigrateIn(pb.MigrateInRequest(ticket=ticket)):
            if not first_token_s and event.HasField("delta") and event.delta.token_ids:
                first_token_s = time.perf_counter()
        watch = b.WatchState(pb.WatchStateRequest())
        iteration_s = (await watch.read()).last_iteration_s
        watch.cancel()
    defaults = AgentConfig.model_fields
    transfer_s = (defaults["sim_kv_transfer_latency_s"].default
                  + ticket.kv_bytes / (defaults["sim_kv_transfer_gbps"].default * 1e9))
    pause_s = first_token_s - last_token_s
    return {
        "kv_mb": ticket.kv_bytes / 1e6,
        "modelled_transfer_ms": transfer_s * 1e3,
        "modelled_iteration_ms": iteration_s * 1e3,
        "modelled_pause_ms": (transfer_s + iteration_s) * 1e3,
        "live_pause_ms": pause_s * 1e3,
        "live_migrate_in_to_first_token_ms": (first_token_s - sent_s) * 1e3,
        "live_over_modelled": pause_s / (transfer_s + iteration_s),
    }


async def live_run(plan: Sequence[tuple[float, Request]], engines: int, policy: str,
                   log_path: Path) -> tuple[list[Any], float, dict[str, float] | None]:
    """Outcomes and duration of the schedule replayed through a fresh gateway and fleet, then one migration
    between the first two engines (None with one engine)."""
    specs = [AgentSpec(f"bench-{i}", PROFILE, free_port()) for i in range(engines)]
    async with LocalFleet(specs, start_timeout_s=90.0, stop_grace_s=5.0):
        port = free_port()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("wb") as log:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gateway", "--port", str(port), "--policy", policy,
                *(arg for s in specs for arg in ("--engine", s.address)), "--log-level", "WARNING",
                cwd=REPO, stdout=log, stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}"
            await wait_gateway_ready(url, engines, proc)
            model = get_profile(PROFILE).model.name
            result = await run_live(plan, LiveOptions(url, model), progress=True)
            migration = await migration_pause(specs[0].address, specs[1].address) if engines > 1 else None
            return result.outcomes, result.duration_s, migration
        finally:
            await terminate(proc, 10.0)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default="azure-conv")
    ap.add_argument("--data-dir")
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--rate", type=float, default=12.0)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--policy", default="round_robin")
    ap.add_argument("--max-output-tokens", type=int, default=256,
                    help="cap on forced output lengths; 0: none")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", type=Path, default=REPO / "results" / "live_vs_sim.json")
    args = ap.parse_args(argv)

    loaded = load_dataset(args.dataset, resolve_data_dir(args.data_dir), num_requests=args.num_requests,
                          seed=args.seed)
    if args.max_output_tokens > 0:
        cap = args.max_output_tokens
        loaded = [dataclasses.replace(r, output_tokens=min(r.output_tokens or cap, cap)) for r in loaded]
    requests = prepare_requests(loaded, EngineTokenizer(Tokenizer.load_sim()), seed=args.seed)
    plan = schedule(requests, ArrivalSpec(rate_per_s=args.rate, seed=args.seed))

    outcomes, duration_s, migration = asyncio.run(live_run(plan, args.engines, args.policy,
                                                args.output.with_suffix(".gateway.log")))
    sim = simulate(plan, [EngineSpec(PROFILE, args.engines)], SimOptions(policy=args.policy, seed=args.seed))
    live_summary = summarize(outcomes, duration_s).to_dict()
    sim_summary = summarize(sim.outcomes, sim.duration_s).to_dict()
    agree = agreement(live_summary, sim_summary)
    result = {
        "benchmark": "live_vs_sim",
        "config": {"dataset": args.dataset, "num_requests": args.num_requests, "rate_per_s": args.rate,
                   "engines": f"{PROFILE}:{args.engines}", "policy": args.policy,
                   "max_output_tokens": args.max_output_tokens, "seed": args.seed},
        "live": {"completed": live_summary["completed"], "failed": live_summary["failed"],
                 "duration_s": duration_s, **{k: live_summary[k] for k in AGREEMENT_KEYS}},
        "sim": {"completed": sim_summary["completed"], "failed": sim_summary["failed"],
                "duration_s": sim.duration_s, "wall_s": sim.wall_s,
                **{k: sim_summary[k] for k in AGREEMENT_KEYS}},
        "agreement": agree,
        "ratios": {k: v["ratio"] for k, v in agree.items()},
        "migration": migration,
    }
    print(f"{'metric':<20}{'live':>12}{'sim':>12}{'live/sim':>10}")
    for key, row in agree.items():
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.3f}"
        print(f"{key:<20}{row['live'] or 0:>12.2f}{row['sim'] or 0:>12.2f}{ratio:>10}")
    print(f"live: {live_summary['completed']} ok / {live_summary['failed']} failed in {duration_s:.1f} s; "
          f"sim: {sim_summary['completed']} ok in {sim.duration_s:.1f} simulated s ({sim.wall_s:.2f} s wall)")
    if migration is not None:
        print(f"migration of {migration['kv_mb']:.0f} MB of KV: "
              f"live pause {migration['live_pause_ms']:.1f} ms, "
              f"modelled {migration['modelled_pause_ms']:.1f} ms (x{migration['live_over_modelled']:.2f})")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written: {args.output}")
    return 0 if live_summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
