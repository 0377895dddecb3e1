"""One chaos or soak invocation, end to end: fleet up, capacity, undisturbed pass, faulted pass, checks,
report.

Owns: the order of a run (agents and gateway started; capacity measured closed-loop unless a rate is given;
the load at `load_fraction` of it; the undisturbed pass, which is both the reference text of every request
content and the ITL baseline; the chaos pass with the same seeded requests, client misbehaviour and the fault
plan; waiting until the fleet is quiet and reading every agent's own state; the soak's RSS/fd sampler), the
sampler and quiescence loops, and assembling the report dict.
Must not: judge streams (`classify`), compute figures (`report`) or parse arguments (`__main__`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.chaos import report as rep
from benchmarks.chaos.classify import Reference, Verdict, classify
from benchmarks.chaos.client import StreamRecord, run_stream
from benchmarks.chaos.faults import FaultLog, plan_faults, run_faults
from benchmarks.chaos.fleet import AgentProc, AgentState, GatewayProc, agent_state, rss_and_fds
from benchmarks.chaos.workload import RequestSpec, WorkloadConfig, build_workload

MODEL = "llama3-8b"  # the h100-llama3-8b profile's model name
SLOW_READ_BUFSIZE = 1024  # slow readers' aiohttp buffer: the transport pauses instead of buffering 64 KiB


@dataclass(frozen=True)
class Options:
    agents: int = 3
    profile: str = "h100-llama3-8b"
    seed: int = 1
    rate_rps: float | None = None  # None: load_fraction x the measured capacity
    load_fraction: float = 0.7
    capacity_concurrency: int = 64
    capacity_s: float = 15.0
    duration_s: float = 120.0
    min_requests: int = 5000  # the chaos pass lasts long enough for this many at the rate
    max_tokens: tuple[int, int] = (16, 64)
    slow_fraction: float = 0.02
    disconnect_fraction: float = 0.05
    slow_read_s: float = 0.05
    kills: bool = True
    kill_every_s: tuple[float, float] = (20.0, 40.0)
    down_s: float = 1.0
    stall_at_s: float | None = None  # None: 40 % into the chaos pass
    stall_s: float = 20.0  # 0: no stall
    client_timeout_s: float = 10.0  # inactivity: no byte for this long is a hang
    gateway_args: tuple[str, ...] = ()
    gateway_env: tuple[str, ...] = ()  # NAME=VALUE, e.g. SWITCHYARD_GATEWAY_ENGINE_STALL_TIMEOUT_S=2
    soak_minutes: float = 0.0
    soak_warmup_s: float = 120.0
    soak_kills: bool = False
    reference_s: float = 60.0  # soak: the undisturbed pass over the pool of request contents
    sample_s: float = 10.0
    tracemalloc_frames: int = 0  # soak: > 0 traces the gateway's allocations (snapshots after the warm-up
    # and at the end; the growth between them goes to <output>.tracemalloc.txt); its RSS is then not real
    trace_report: Path | None = None
    log_dir: Path = field(default_factory=lambda: Path("/tmp"))


async def run_pass(
    url: str, specs: Sequence[RequestSpec], prefix: str, opts: Options, t0: float
) -> list[StreamRecord]:
    """Open-loop: each request sent at t0 + its arrival offset; returns once every stream has ended."""
    async with contextlib.AsyncExitStack() as stack:
        normal = await stack.enter_async_context(
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        )
        # A connection per slow client, closed after its response: aiohttp 3.14 re-arms sock_read when a
        # paused transport resumes even after the body ended, so a pooled connection a slow reader used can
        # fail the next request on it at once with a "timeout" (seen: an instant SocketTimeoutError).
        slow = await stack.enter_async_context(
            aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=True), read_bufsize=SLOW_READ_BUFSIZE
            )
        )
        endpoint = f"{url}/v1/chat/completions"
        tasks: list[asyncio.Task[StreamRecord]] = []
        for spec in specs:
            delay = t0 + spec.arrival_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            session = slow if spec.behaviour == "slow" else normal
            tasks.append(
                asyncio.create_task(
                    run_stream(
                        session,
                        endpoint,
                        MODEL,
                        spec,
                        f"{prefix}{spec.index}",
                        idle_timeout_s=opts.client_timeout_s,
                        slow_read_s=opts.slow_read_s,
                    )
                )
            )
        return list(await asyncio.gather(*tasks))


async def measure_capacity(url: str, opts: Options) -> float:
    """Completed requests per second with `capacity_concurrency` closed-loop clients for `capacity_s`."""
    cfg = WorkloadConfig(opts.seed + 1_000, 1000.0, opts.capacity_s * 2, *opts.max_tokens, 0.0, 0.0)
    specs = iter(build_workload(cfg))
    done = 0
    start = time.monotonic()
    deadline = start + opts.capacity_s
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def worker() -> None:
            nonlocal done
            for spec in specs:
                if time.monotonic() >= deadline:
                    return
                rec = await run_stream(
                    session,
                    f"{url}/v1/chat/completions",
                    MODEL,
                    spec,
                    f"cap{spec.index}",
                    idle_timeout_s=opts.client_timeout_s,
                    slow_read_s=0.0,
                )
                if rec.finish_reason is not None and rec.end_s <= deadline:
                    done += 1

        await asyncio.gather(*(worker() for _ in range(opts.capacity_concurrency)))
    return done / opts.capacity_s


async def wait_quiet(agents: Sequence[AgentProc], timeout_s: float) -> tuple[list[AgentState], float]:
    """Poll every agent's own state until all are idle (or time runs out); (states, seconds waited)."""
    start = time.monotonic()
    while True:
        states = list(await asyncio.gather(*(agent_state(a.address) for a in agents)))
        waited = time.monotonic() - start
        if all(s.idle for s in states) or waited >= timeout_s:
            return states, waited
        await asyncio.sleep(0.5)


async def sample_gateway(pid: int, every_s: float, t0: float, out: list[tuple[float, int, int]]) -> None:
    while True:
        with contextlib.suppress(OSError):
            rss, fds = rss_and_fds(pid)
            out.append((round(time.monotonic() - t0, 3), rss, fds))
        await asyncio.sleep(every_s)


def log_errors(path: Path, limit: int = 20) -> list[str]:
    """ERROR / CRITICAL / Traceback lines of a process log (the first `limit`), for the report."""
    if not path.exists():
        return []
    lines = path.read_text(errors="replace").splitlines()
    return [
        line[:300]
        for line in lines
        if " ERROR " in line or " CRITICAL " in line or line.startswith("Traceback")
    ][:limit]


def references(records: Sequence[StreamRecord], specs: Sequence[RequestSpec]) -> dict[int, Reference]:
    """Request content -> its undisturbed text, from the streams of an undisturbed pass that completed."""
    refs: dict[int, Reference] = {}
    for rec, spec in zip(records, specs, strict=True):
        if rec.finish_reason is not None and rec.done and not rec.errors and not rec.timed_out:
            refs.setdefault(spec.content, Reference(rec.text, rec.finish_reason))
    return refs


def _judge(
    records: Sequence[StreamRecord], specs: Sequence[RequestSpec], refs: dict[int, Reference]
) -> list[Verdict]:
    return [classify(rec, refs.get(spec.content)) for rec, spec in zip(records, specs, strict=True)]


def _pass_summary(
    records: Sequence[StreamRecord], verdicts: Sequence[Verdict], wall_s: float
) -> dict[str, Any]:
    http = [v.detail for v in verdicts if v.category == "http_error"]
    errors = [v.detail for v in verdicts if v.category == "error_event"]
    # Latency of completed streams read normally (a slow reader's chunk times are its own pauses).
    timed = [
        r
        for r, v in zip(records, verdicts, strict=True)
        if v.category == "completed_identical" and r.behaviour == "normal"
    ]
    return {
        "requests": len(records),
        "wall_s": round(wall_s, 2),
        "categories": rep.verdict_counts(verdicts),
        "http_errors": dict(sorted(Counter(http).items())),
        "error_events": dict(sorted(Counter(errors).items())),
        "ttft_s": rep.dist(rep.ttft_samples(timed)),
        "itl_s": rep.dist(rep.itl_samples(timed)),
    }


async def run(opts: Options) -> dict[str, Any]:
    soak = opts.soak_minutes > 0
    agents = [AgentProc(i, opts.profile, opts.log_dir) for i in range(opts.agents)]
    env = dict(item.split("=", 1) for item in opts.gateway_env)
    trace = None
    if opts.tracemalloc_frames > 0 and opts.trace_report is not None:
        trace = (opts.tracemalloc_frames, opts.trace_report)
    gateway = GatewayProc(opts.log_dir, [a.address for a in agents], opts.gateway_args, env, trace)
    result: dict[str, Any] = {
        "mode": "soak" if soak else "chaos",
        "log_dir": str(opts.log_dir),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(opts).items()},
    }
    try:
        await asyncio.gather(*(a.start() for a in agents))
        await gateway.start()
        capacity = None
        if opts.rate_rps is None:
            capacity = await measure_capacity(gateway.url, opts)
        rate = opts.rate_rps if opts.rate_rps is not None else opts.load_fraction * (capacity or 0.0)
        if rate <= 0:
            raise RuntimeError(f"no usable rate (measured capacity {capacity})")
        result.update(capacity_rps=None if capacity is None else round(capacity, 2), rate_rps=rate)
        await wait_quiet(agents, 30.0)
        return await (
            _soak(opts, agents, gateway, rate, result)
            if soak
            else _chaos(opts, agents, gateway, rate, result)
        )
    finally:
        if gateway.proc is not None:
            result["gateway_exit"] = await gateway.stop()
        await asyncio.gather(*(a.stop() for a in agents), return_exceptions=True)
        result["log_errors"] = {
            p.name: lines
            for p in [gateway.log_path, *(a.log_path for a in agents)]
            if (lines := log_errors(p))
        }


def _workload(opts: Options, rate: float, duration_s: float, pool: int | None = None) -> WorkloadConfig:
    return WorkloadConfig(
        opts.seed, rate, duration_s, *opts.max_tokens, opts.slow_fraction, opts.disconnect_fraction, pool
    )


async def _faulted_pass(
    opts: Options,
    agents: list[AgentProc],
    gateway: GatewayProc,
    specs: list[RequestSpec],
    duration_s: float,
    prefix: str,
    *,
    kills: bool,
    stall: bool,
    samples: list[tuple[float, int, int]],
) -> tuple[list[StreamRecord], FaultLog, float, float]:
    plan = plan_faults(
        opts.seed,
        duration_s,
        len(agents),
        kill_min_s=opts.kill_every_s[0],
        kill_max_s=opts.kill_every_s[1],
        down_s=opts.down_s,
        stall_at_s=(opts.stall_at_s if opts.stall_at_s is not None else 0.4 * duration_s) if stall else None,
        stall_s=opts.stall_s,
        kills=kills,
    )
    log = FaultLog()
    t0 = time.monotonic() + 0.5
    sampler = asyncio.create_task(sample_gateway(gateway.pid, opts.sample_s, t0, samples))
    faults = asyncio.create_task(run_faults(plan, agents, t0, log))
    try:
        records = await run_pass(gateway.url, specs, prefix, opts, t0)
        await faults
    finally:
        faults.cancel()
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
        for agent in agents:
            agent.resume()
            if not agent.up:
                await agent.start()
    return records, log, t0, time.monotonic() - t0


async def _after(agents: list[AgentProc], gateway: GatewayProc) -> dict[str, Any]:
    states, waited = await wait_quiet(agents, 15.0)
    metrics = await gateway.metrics()
    return {
        "all_idle": all(s.idle for s in states),
        "waited_s": round(waited, 2),
        "agents": [asdict(s) for s in states],
        "gateway_in_flight": metrics.get("switchyard_requests_in_flight"),
        "gateway_engine_running": {
            k: v for k, v in metrics.items() if k.startswith("switchyard_engine_running_requests")
        },
    }


async def _chaos(
    opts: Options, agents: list[AgentProc], gateway: GatewayProc, rate: float, result: dict[str, Any]
) -> dict[str, Any]:
    duration_s = max(opts.duration_s, opts.min_requests / rate)
    specs = build_workload(_workload(opts, rate, duration_s))
    t0 = time.monotonic() + 0.5
    base_records = await run_pass(gateway.url, [s.undisturbed() for s in specs], "b", opts, t0)
    base_wall = time.monotonic() - t0
    await wait_quiet(agents, 30.0)
    samples: list[tuple[float, int, int]] = []
    records, log, t0, wall = await _faulted_pass(
        opts,
        agents,
        gateway,
        specs,
        duration_s,
        "c",
        kills=opts.kills,
        stall=opts.stall_s > 0,
        samples=samples,
    )
    refs = references(base_records, specs)
    base_verdicts = [classify(r, Reference(r.text, r.finish_reason or "")) for r in base_records]
    verdicts = _judge(records, specs, refs)
    result["passes"] = {
        "baseline": _pass_summary(base_records, base_verdicts, base_wall),
        "chaos": _pass_summary(records, verdicts, wall),
    }
    result["after"] = await _after(agents, gateway)
    return _finish(
        result,
        records,
        verdicts,
        log,
        t0,
        samples,
        [a.address for a in agents],
        itl=rep.itl_figures(base_records, records, verdicts, base_verdicts, log.events),
    )


async def _soak(
    opts: Options, agents: list[AgentProc], gateway: GatewayProc, rate: float, result: dict[str, Any]
) -> dict[str, Any]:
    ref_specs = [s.undisturbed() for s in build_workload(_workload(opts, rate, opts.reference_s))]
    t0 = time.monotonic() + 0.5
    ref_records = await run_pass(gateway.url, ref_specs, "r", opts, t0)
    ref_wall = time.monotonic() - t0
    refs = references(ref_records, ref_specs)
    duration_s = opts.soak_minutes * 60.0
    specs = build_workload(_workload(opts, rate, duration_s, len(ref_specs)))
    samples: list[tuple[float, int, int]] = []
    loop = asyncio.get_running_loop()
    baseline_snapshot = loop.call_later(opts.soak_warmup_s + 0.5, gateway.snapshot_memory)
    records, log, t0, wall = await _faulted_pass(
        opts, agents, gateway, specs, duration_s, "s", kills=opts.soak_kills, stall=False, samples=samples
    )
    baseline_snapshot.cancel()
    gateway.snapshot_memory()  # the traced growth since the warm-up (a no-op untraced)
    await asyncio.sleep(15.0 if gateway.trace is not None else 0.0)  # a snapshot takes seconds
    verdicts = _judge(records, specs, refs)
    ref_verdicts = [classify(r, Reference(r.text, r.finish_reason or "")) for r in ref_records]
    result["passes"] = {
        "reference": _pass_summary(ref_records, ref_verdicts, ref_wall),
        "soak": _pass_summary(records, verdicts, wall),
    }
    result["after"] = await _after(agents, gateway)
    result["soak"] = rep.soak_figures(samples, opts.soak_warmup_s)
    return _finish(result, records, verdicts, log, t0, samples, [a.address for a in agents], itl=None)


def _finish(
    result: dict[str, Any],
    records: list[StreamRecord],
    verdicts: list[Verdict],
    log: FaultLog,
    t0: float,
    samples: list[tuple[float, int, int]],
    addresses: list[str],
    itl: dict[str, Any] | None,
) -> dict[str, Any]:
    bugs = [v for v in verdicts if v.is_bug]
    result["bug_count"] = len(bugs)
    result["bug_categories"] = rep.verdict_counts(bugs)
    result["bugs"] = rep.bug_list(records, verdicts, t0)
    result["kills"] = rep.kill_figures(records, log.events, t0)
    result["stall"] = rep.stall_figures(records, verdicts, log.events, t0, addresses)
    result["errors"] = rep.error_list(records, verdicts, t0)
    result["records"] = rep.record_rows(records, verdicts, t0)  # __main__ moves these to --dump-records
    result["itl"] = itl
    result["faults"] = [{"kind": e.kind, "agent": e.agent, "at_s": round(e.t_s - t0, 3)} for e in log.events]
    result["gateway_samples"] = [
        {"t_s": t, "rss_mib": round(rss / 2**20, 2), "fds": fds} for t, rss, fds in samples
    ]
    result["targets"] = rep.targets(
        len(records), len(bugs), result["kills"], itl, result["after"]["all_idle"], result.get("soak")
    )
    return result
