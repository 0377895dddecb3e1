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

With `--reschedule star-oracle|star-nopred` (docs/star.md), STAR moves running requests on both sides: the
agents send rounds (`--length-predictor oracle`, resp. `--star-report`) every k = the simulator's prediction
interval decode steps, their modelled KV link is the simulator's (`--sim-kv-link-gbps` = the
simulator's `kv_link_gbps`, both Gbit/s), and the gateway runs `--reschedule star` (resp. `star-nopred`) with
Algorithm 1's parameters set to the simulator's; the simulation runs the arm of the same name. The
rescheduling interval (0.5 s) and the mover's limits are the defaults of both. Both sides then report
migrations by outcome (live: `switchyard_migrations_total`, scraped before the single migration
above). The SLO `--slo ttft=MS,tpot=MS` adds goodput (requests meeting it per second, `loadgen.metrics`) and
its live/sim ratio. `--sessions N` gives request i the session id `session-{i mod N}` (with `--policy
session_affinity`, few sessions pile requests on few engines, which is what the rescheduler undoes).

    .venv/bin/python benchmarks/live_vs_sim.py [--num-requests 200] [--rate 12] [--engines 2]
        [--policy round_robin] [--max-output-tokens 256] [--dataset azure-conv] [--data-dir DIR]
        [--reschedule star-oracle|star-nopred] [--slo ttft=MS,tpot=MS] [--sessions N] [--output PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import re
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import grpc

from engine_agent.config import AgentConfig
from engine_agent.tokenization import Tokenizer
from gateway.rescheduling.star import StarParams
from launcher.local_fleet import AgentSpec, LocalFleet, terminate
from loadgen.arrivals import ArrivalSpec, schedule
from loadgen.compare import AGREEMENT_KEYS, agreement
from loadgen.datasets import Request, load_dataset
from loadgen.live import EngineTokenizer, LiveOptions, prepare_requests, run_live, wait_gateway_ready
from loadgen.metrics import parse_slo, summarize
from loadgen.paths import resolve_data_dir
from loadgen.simulate import EngineSpec, SimOptions, simulate
from switchyard.profiles import get_profile
from switchyard.proto_gen import engine_agent_pb2 as pb
from switchyard.proto_gen import engine_agent_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[1]
PROFILE = "h100-llama3-8b"
MIGRATION_PROMPT_TOKENS, MIGRATION_CUT_AFTER, MIGRATION_MAX_TOKENS = 3000, 20, 200
# --reschedule: the simulator's arm -> the live gateway's --reschedule and the agents' STAR flags.
RESCHEDULE_ARMS: dict[str, tuple[str, tuple[str, ...]]] = {
    "star-oracle": ("star", ("--length-predictor", "oracle")),
    "star-nopred": ("star-nopred", ("--star-report",)),
}
_MIGRATIONS = re.compile(r'^switchyard_migrations_total\{outcome="(\w+)"\} (\S+)$', re.M)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def reschedule_flags(arm: str, options: SimOptions) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The agents' and the gateway's flags under which a live fleet reschedules as the simulator does under
    `options` (whose `reschedule` is `arm`): the same rounds, KV link and Algorithm 1 parameters."""
    gateway_arm, star_flags = RESCHEDULE_ARMS[arm]
    star = StarParams()
    params = {"theta": star.theta, "horizon": star.horizon, "beta": star.beta,
              "round_tokens": options.prediction_interval, "kv_link_gbps": options.kv_link_gbps,
              **options.reschedule_params}
    agents = (*star_flags, "--hidden-state-interval", str(options.prediction_interval),
              "--state-interval-ms", str(round(options.state_interval_s * 1000)),
              "--sim-kv-link-gbps", str(options.kv_link_gbps),
              "--sim-kv-transfer-latency-s", str(options.kv_transfer_latency_s))
    gateway = ("--reschedule", gateway_arm,
               *(arg for key, value in params.items() for arg in ("--reschedule-param", f"{key}={value}")))
    return agents, gateway


def agent_link(agent_args: Sequence[str]) -> tuple[float, float]:
    """The agents' modelled KV link, (Gbit/s, latency s): their flags', else AgentConfig's defaults."""
    defaults = AgentConfig.model_fields
    flags = dict(zip(agent_args[:-1], agent_args[1:], strict=True))
    return (float(flags.get("--sim-kv-link-gbps", defaults["sim_kv_link_gbps"].default)),
            float(flags.get("--sim-kv-transfer-latency-s", defaults["sim_kv_transfer_latency_s"].default)))


async def migration_counters(url: str) -> dict[str, int]:
    """The gateway's `switchyard_migrations_total` by outcome."""
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
        exposition = await resp.text()
    return {m.group(1): int(float(m.group(2))) for m in _MIGRATIONS.finditer(exposition)}


async def migration_pause(source: str, target: str, kv_gb_per_s: float,
                          kv_latency_s: float) -> dict[str, float]:
    """One request migrated from agent `source` to agent `target` (as tests/integration/
    test_agent_migration_sim.py does): the client's pause against the sim's model of it (the agents' link:
    `kv_gb_per_s` GB/s after `kv_latency_s`)."""
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
    transfer_s = kv_latency_s + ticket.kv_bytes / (kv_gb_per_s * 1e9)
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


async def live_run(plan: Sequence[tuple[float, Request]], engines: int, policy: str, log_path: Path,
                   agent_args: Sequence[str] = (), gateway_args: Sequence[str] = ()
                   ) -> tuple[list[Any], float, dict[str, int], dict[str, float] | None]:
    """Outcomes and duration of the schedule replayed through a fresh gateway and fleet, the gateway's
    migrations by outcome, then one migration between the first two engines (None with one engine)."""
    specs = [AgentSpec(f"bench-{i}", PROFILE, free_port(), extra_args=tuple(agent_args))
             for i in range(engines)]
    async with LocalFleet(specs, start_timeout_s=90.0, stop_grace_s=5.0):
        port = free_port()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("wb") as log:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gateway", "--port", str(port), "--policy", policy,
                *(arg for s in specs for arg in ("--engine", s.address)), *gateway_args,
                "--log-level", "WARNING",
                cwd=REPO, stdout=log, stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}"
            await wait_gateway_ready(url, engines, proc)
            model = get_profile(PROFILE).model.name
            result = await run_live(plan, LiveOptions(url, model), progress=True)
            moves = await migration_counters(url)
            link = agent_link(agent_args)
            migration = (await migration_pause(specs[0].address, specs[1].address, *link)
                         if engines > 1 else None)
            return result.outcomes, result.duration_s, moves, migration
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
    ap.add_argument("--reschedule", choices=sorted(RESCHEDULE_ARMS),
                    help="STAR rescheduling live and in the simulation; default: none")
    ap.add_argument("--slo", metavar="ttft=MS,tpot=MS", help="SLO for goodput (requests meeting it per s)")
    ap.add_argument("--sessions", type=int, default=0,
                    help="give request i the session id session-{i mod N}; 0: the dataset's")
    ap.add_argument("--output", type=Path, default=REPO / "results" / "live_vs_sim.json")
    args = ap.parse_args(argv)

    loaded = load_dataset(args.dataset, resolve_data_dir(args.data_dir), num_requests=args.num_requests,
                          seed=args.seed)
    if args.max_output_tokens > 0:
        cap = args.max_output_tokens
        loaded = [dataclasses.replace(r, output_tokens=min(r.output_tokens or cap, cap)) for r in loaded]
    if args.sessions > 0:
        loaded = [dataclasses.replace(r, session_id=f"session-{i % args.sessions}")
                  for i, r in enumerate(loaded)]
    requests = prepare_requests(loaded, EngineTokenizer(Tokenizer.load_sim()), seed=args.seed)
    plan = schedule(requests, ArrivalSpec(rate_per_s=args.rate, seed=args.seed))
    slo = parse_slo(args.slo) if args.slo else None
    options = SimOptions(policy=args.policy, seed=args.seed, reschedule=args.reschedule or "none")
    agent_args, gateway_args = reschedule_flags(args.reschedule, options) if args.reschedule else ((), ())

    outcomes, duration_s, live_moves, migration = asyncio.run(live_run(
        plan, args.engines, args.policy, args.output.with_suffix(".gateway.log"), agent_args, gateway_args))
    sim = simulate(plan, [EngineSpec(PROFILE, args.engines)], options)
    live_summary = summarize(outcomes, duration_s, slo).to_dict()
    sim_summary = summarize(sim.outcomes, sim.duration_s, slo).to_dict()
    agree = agreement(live_summary, sim_summary)
    live_good, sim_good = live_summary["request_goodput"], sim_summary["request_goodput"]
    goodput = None if slo is None else {
        "slo": live_summary["slo"], "live_req_per_s": live_good, "sim_req_per_s": sim_good,
        "live_attainment": live_summary["slo_attainment"], "sim_attainment": sim_summary["slo_attainment"],
        "ratio": live_good / sim_good if sim_good else None}
    sim_moves = (sim.balance or {}).get("migrations", {})
    outcomes_seen = sorted(set(live_moves) | set(sim_moves))
    moves = {"live": {k: live_moves.get(k, 0) for k in outcomes_seen},
             "sim": {k: int(sim_moves.get(k, 0)) for k in outcomes_seen}}
    result = {
        "benchmark": "live_vs_sim",
        "config": {"dataset": args.dataset, "num_requests": args.num_requests, "rate_per_s": args.rate,
                   "engines": f"{PROFILE}:{args.engines}", "policy": args.policy,
                   "max_output_tokens": args.max_output_tokens, "seed": args.seed,
                   "reschedule": args.reschedule, "sessions": args.sessions,
                   "agent_args": list(agent_args), "gateway_args": list(gateway_args)},
        "live": {"completed": live_summary["completed"], "failed": live_summary["failed"],
                 "duration_s": duration_s, **{k: live_summary[k] for k in AGREEMENT_KEYS}},
        "sim": {"completed": sim_summary["completed"], "failed": sim_summary["failed"],
                "duration_s": sim.duration_s, "wall_s": sim.wall_s,
                **{k: sim_summary[k] for k in AGREEMENT_KEYS}},
        "agreement": agree,
        "ratios": {k: v["ratio"] for k, v in agree.items()}
        | ({"request_goodput": goodput["ratio"]} if goodput is not None else {}),
        "goodput": goodput,
        "migrations": moves,
        "migration": migration,
    }
    print(f"{'metric':<20}{'live':>12}{'sim':>12}{'live/sim':>10}")
    for key, row in agree.items():
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.3f}"
        print(f"{key:<20}{row['live'] or 0:>12.2f}{row['sim'] or 0:>12.2f}{ratio:>10}")
    if goodput is not None:
        ratio = "-" if goodput["ratio"] is None else f"{goodput['ratio']:.3f}"
        print(f"{'goodput req/s':<20}{live_good:>12.3f}{sim_good:>12.3f}{ratio:>10}")
    if args.reschedule:
        print(f"migrations ({args.reschedule}): live {moves['live']}, sim {moves['sim']}")
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
