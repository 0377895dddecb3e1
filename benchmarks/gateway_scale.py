"""Gateway scale: N concurrent slow streams held by one gateway: RSS per stream, event-loop lag, errors.

One invocation runs the same measurement twice, each time against fresh processes: a baseline with
`--baseline` streams (default 1,000) and the scale run with `--streams` (default 10,000). A run starts the
mock upstream (benchmarks/mock_upstream.py `--random-phase`: one content chunk every `--itl-ms`, default 1 s,
each stream on its own random phase, so the chunks of many streams spread over the second) and a gateway in
front of it (`python -m gateway --upstream URL --port P`), warms the gateway with a few short streams, reads
its RSS (VmRSS, /proc/PID/status), then opens the streams from `--clients` load-client processes
(benchmarks/scale_client.py: one aiohttp session each, no connection limit, at most `--ramp-per-s` new
streams a second and `--ramp-window` waiting for their first chunk, all clients together, so that the
gateway's accept queue of 128 never overflows: an overflow resets connections). Once every stream has its
first chunk it holds them for `--hold-s` seconds, sampling the gateway's RSS every second, and reads
`switchyard_event_loop_lag_seconds` from the gateway's /metrics at both ends of the hold (the difference is
the lag histogram of the hold alone: p50/p99 interpolated inside buckets, as Prometheus'
`histogram_quantile`, and the per-bucket counts), with `switchyard_requests_in_flight` (must be N at both
ends). The clients time every content chunk: the inter-chunk gaps that end inside the hold window are the
client-observed figures (the upstream's pacing, `--itl-ms`, is their floor); each client times its own loop
too, and a probe process that does nothing else times its loop during the hold: the host's scheduling floor,
the baseline of the gateway's lag. Then the streams run out and each must have all its content chunks, the
finish chunk and `[DONE]`.

Reported per run: RSS before and held, (held - before) / N, the loop lag, client gap and probe percentiles,
CPU of the gateway, upstream and clients during the hold (100 = one core), gateway CPU per stream set up,
errors with examples; across the runs the RSS slope (RSS_held(N) - RSS_held(baseline)) / (N - baseline), the
marginal cost of one more held stream with the fixed costs (pools, first-request imports, allocator arenas)
cancelled; and `targets`: slope <= 20 KiB per stream, loop-lag p99 during the scale run's hold <= 5 ms, no
errors in either run (met or not; nothing is asserted).

File descriptors: each stream holds two sockets in the gateway (client side and upstream side), one in the
upstream and one in a client. RLIMIT_NOFILE is raised to the hard limit in this process and in every process
it starts, and beyond it (to 2 N + slack) when the gateway needs more and the process may (CAP_SYS_RESOURCE);
otherwise the run stops at once, saying how many streams fit. A hard limit of 20,000 fits 9,968 streams.

The gateway pools upstream connections per upstream (`upstream_max_connections`, default 4096); a stream
waiting for a pooled connection fails after the connect timeout (503), so the run sets
SWITCHYARD_GATEWAY_UPSTREAM_MAX_CONNECTIONS to N plus slack unless `--keep-pool-limit`.

`--tracemalloc FRAMES` runs the gateway under benchmarks/traced_gateway.py and writes where its traced memory
grew between the warm-up and the end of the hold, per stream (its RSS and lag figures are then not the real
ones). Printed and written as JSON (default results/gateway_scale.json).

    .venv/bin/python benchmarks/gateway_scale.py [--streams 10000] [--baseline 1000] [--hold-s 20]
        [--itl-ms 1000] [--clients 1] [--ramp-per-s 500] [--ramp-window 100] [--tokens 0 (auto)]
        [--keep-pool-limit] [--tracemalloc FRAMES] [--output PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import resource
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gateway_overhead import cpu_seconds, free_port, percentile, wait_http  # noqa: E402 (sibling script)
from scale_client import MODEL, ClientPlan, client_worker, lag_probe  # noqa: E402 (sibling script)

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
# Descriptors besides the streams' sockets: an idle gateway holds 17 (stdio, epoll, pipes, the listening
# socket, the upstream metrics poll); the rest is margin (this process's /metrics scrapes, warm-up sockets).
NOFILE_SLACK = 64
POOL_SLACK = 64
LAG_METRIC = "switchyard_event_loop_lag_seconds"
TARGET_RSS_KIB_PER_STREAM = 20.0
TARGET_LOOP_LAG_P99_MS = 5.0
READY_TIMEOUT_S = 180.0  # every stream streaming, after the last one was sent
WARMUP_STREAMS = 8


# ---- file descriptors ----------------------------------------------------------------------------------


def raise_nofile(need: int, who: str, hint: str = "") -> int:
    """Soft RLIMIT_NOFILE up to the hard limit, and both up to `need` when the hard limit is lower and this
    process may raise it (CAP_SYS_RESOURCE); exits with a message naming `who` (and `hint`) when `need` cannot
    be had. Returns the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < need:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (need, need))
        except (ValueError, OSError) as e:
            raise SystemExit(
                f"gateway_scale: {who} needs {need} file descriptors but the hard limit (ulimit -Hn) is "
                f"{hard} and cannot be raised here ({e}); raise it (limits.conf, `ulimit -Hn`, "
                f"docker --ulimit nofile=...){hint}"
            ) from e
        return need
    limit = hard if hard != resource.RLIM_INFINITY else max(soft, need)
    if soft < limit:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    return limit


def _nofile_to_hard() -> None:
    """preexec_fn of every child: soft limit = hard limit (the hard one inherited from this process)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def process_nofile(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft = line.split()[3]
            return 1 << 62 if soft == "unlimited" else int(soft)
    raise RuntimeError(f"no open-files limit in /proc/{pid}/limits")


def check_nofile(pid: int, need: int, who: str) -> int:
    have = process_nofile(pid)
    if have < need:
        raise SystemExit(f"gateway_scale: the {who} (pid {pid}) may open {have} files, it needs {need}")
    return have


# ---- /proc and /metrics --------------------------------------------------------------------------------


def rss_kib(pid: int) -> dict[str, int]:
    """VmRSS and its anonymous part (the heap) of `pid`, in KiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon"):
            out[key] = int(value.split()[0])
    return out


def scrape(base_url: str) -> dict[str, Any]:
    """The gateway's loop-lag buckets (cumulative, by bound) and in-flight requests, from /metrics."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    buckets: dict[float, float] = {}
    in_flight = -1.0
    statuses: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == f"{LAG_METRIC}_bucket":
                buckets[float(s.labels["le"])] = s.value
            elif s.name == "switchyard_requests_in_flight":
                in_flight = s.value
            elif s.name == "switchyard_requests_total":
                statuses[s.labels["status"]] = statuses.get(s.labels["status"], 0.0) + s.value
    return {"lag_buckets": buckets, "in_flight": int(in_flight), "statuses": statuses}


def histogram_quantile(q: float, before: dict[float, float], after: dict[float, float]) -> float:
    """The q-quantile of the observations between two scrapes of one cumulative histogram, interpolated
    linearly inside its bucket (Prometheus' `histogram_quantile`); the +Inf bucket answers its lower bound."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1]
    if total <= 0:
        return math.nan
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, cumulative in zip(bounds, counts, strict=True):
        if cumulative >= rank:
            if math.isinf(bound):
                return lower
            inside = cumulative - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, cumulative
    return lower


def highest_bucket_s(before: dict[float, float], after: dict[float, float]) -> float:
    """The upper bound of the bucket of the largest observation between two scrapes (inf: beyond them all)."""
    bounds = sorted(after)
    total = after[bounds[-1]] - before.get(bounds[-1], 0.0)
    return next((b for b in bounds if after[b] - before.get(b, 0.0) >= total), math.inf)


# ---- one run -------------------------------------------------------------------------------------------


def _recv(conn: multiprocessing.connection.Connection, kind: str, deadline_s: float) -> tuple[Any, ...]:
    if not conn.poll(max(0.0, deadline_s - time.monotonic())):
        raise TimeoutError(f"no {kind!r} message from a load client in time")
    msg = conn.recv()
    if msg[0] != kind:
        raise RuntimeError(f"expected {kind!r} from a load client, got {msg[0]!r}")
    return tuple(msg)


async def _warm_up(url: str, n: int) -> None:
    body = orjson.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "stream": True}
    )
    async with aiohttp.ClientSession() as s:

        async def one() -> None:
            async with s.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                r.raise_for_status()
                await r.read()

        await asyncio.gather(*(one() for _ in range(n)))


def _bucket_counts(before: dict[float, float], after: dict[float, float]) -> dict[str, int]:
    """Observations per bucket between two scrapes (not cumulative), by upper bound; empty ones left out."""
    out: dict[str, int] = {}
    below = 0.0
    for le in sorted(after):
        cumulative = after[le] - before.get(le, 0.0)
        if cumulative > below:
            out["inf" if math.isinf(le) else f"<={le * 1e3:g}ms"] = int(cumulative - below)
        below = cumulative
    return out


def _ms(x: float) -> float | None:
    return None if math.isnan(x) else round(x * 1e3, 3)


class Processes:
    """The processes of one run, ended (clients joined, servers terminated) on `close`."""

    def __init__(self) -> None:
        self.servers: list[subprocess.Popen[bytes]] = []
        self.clients: list[multiprocessing.process.BaseProcess] = []
        self.others: list[multiprocessing.process.BaseProcess] = []

    def start(self, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, preexec_fn=_nofile_to_hard)
        self.servers.append(proc)
        return proc

    def cpu_s(self, gateway: int, upstream: int) -> dict[str, float]:
        return {
            "gateway": cpu_seconds(gateway),
            "upstream": cpu_seconds(upstream),
            "clients": sum(cpu_seconds(w.pid) for w in self.clients if w.pid is not None),
        }

    def close(self) -> None:
        for w in [*self.clients, *self.others]:
            w.join(timeout=10)
            if w.is_alive():
                w.terminate()
        for proc in reversed(self.servers):
            proc.terminate()
        for proc in self.servers:
            proc.wait(timeout=30)


def _signal_and_wait(pid: int, path: Path, timeout_s: float = 300.0) -> None:
    """SIGUSR1 to the traced gateway, then wait until it has written `path`."""
    path.unlink(missing_ok=True)
    os.kill(pid, signal.SIGUSR1)
    deadline_s = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline_s:
            raise TimeoutError(f"the traced gateway wrote no {path}")
        time.sleep(0.2)


def _cpu_pct(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    return {k: round((after[k] - before[k]) / seconds * 100, 1) for k in before}


def run_once(n: int, args: argparse.Namespace, tokens: int) -> dict[str, Any]:
    """One measurement at `n` streams against fresh upstream and gateway processes."""
    up_port, gw_port = free_port(), free_port()
    up_url, gw_url = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{gw_port}"
    procs = Processes()
    spawn = multiprocessing.get_context("spawn")
    trace = args.output.with_name(f"{args.output.stem}_tracemalloc_{n}.txt") if args.tracemalloc else None
    try:
        mock = [PY, str(REPO / "benchmarks" / "mock_upstream.py"), "--port", str(up_port)]
        upstream = procs.start([*mock, "--itl-ms", str(args.itl_ms), "--random-phase"])
        wait_http(up_url + "/v1/models")
        env = dict(os.environ)
        if not args.keep_pool_limit:
            env["SWITCHYARD_GATEWAY_UPSTREAM_MAX_CONNECTIONS"] = str(n + POOL_SLACK)
        flags = ["--upstream", up_url, "--port", str(gw_port), "--log-level", "WARNING"]
        if trace is not None:
            env["SWITCHYARD_TRACE_STREAMS"] = str(n)
            traced = [
                PY,
                "-X",
                f"tracemalloc={args.tracemalloc}",
                str(REPO / "benchmarks" / "traced_gateway.py"),
            ]
            gateway = procs.start([*traced, str(trace), *flags], env)
        else:
            gateway = procs.start([PY, "-m", "gateway", *flags], env)
        wait_http(gw_url + "/health")
        nofile = {
            "gateway": check_nofile(gateway.pid, 2 * n + NOFILE_SLACK, "gateway"),
            "upstream": check_nofile(upstream.pid, n + NOFILE_SLACK, "upstream"),
        }
        chat_url = gw_url + "/v1/chat/completions"
        asyncio.run(_warm_up(chat_url, WARMUP_STREAMS))
        time.sleep(1.0)
        if trace is not None:
            _signal_and_wait(gateway.pid, trace.with_suffix(".base"))
        rss_before = rss_kib(gateway.pid)
        m_before = scrape(gw_url)

        k = args.clients
        start_at_s = time.monotonic() + 2.0 + 0.5 * k  # after every client has imported
        pipes = []
        for i in range(k):
            share = n // k + (1 if i < n % k else 0)
            window = max(1, args.ramp_window // k)
            plan = ClientPlan(chat_url, share, tokens, args.ramp_per_s / k, window, start_at_s)
            parent_end, child_end = spawn.Pipe()
            w = spawn.Process(target=client_worker, args=(child_end, plan), daemon=True)
            w.start()
            child_end.close()
            procs.clients.append(w)
            pipes.append(parent_end)
        probe_end, child_end = spawn.Pipe()
        probe = spawn.Process(target=lag_probe, args=(child_end,), daemon=True)
        probe.start()
        child_end.close()
        procs.others.append(probe)
        cpu_ramp = procs.cpu_s(gateway.pid, upstream.pid)
        ready = [_recv(p, "streaming", start_at_s + n / args.ramp_per_s + READY_TIMEOUT_S) for p in pipes]
        streaming = sum(int(r[1]) for r in ready)
        ramp_s = max(float(r[2]) for r in ready)
        held = streaming == n

        m0 = scrape(gw_url)
        t0 = time.monotonic()
        probe_end.send(("start", args.hold_s))
        cpu0 = procs.cpu_s(gateway.pid, upstream.pid)
        samples: list[dict[str, int]] = []
        while held and time.monotonic() < t0 + args.hold_s:
            time.sleep(min(1.0, max(0.0, t0 + args.hold_s - time.monotonic())))
            samples.append(rss_kib(gateway.pid))
        t1 = time.monotonic()
        cpu1 = procs.cpu_s(gateway.pid, upstream.pid)
        m1 = scrape(gw_url)
        samples = samples or [rss_kib(gateway.pid)]
        if trace is not None and held:  # after the measured window: the snapshot holds the loop for seconds
            _signal_and_wait(gateway.pid, trace)

        for p in pipes:
            p.send(("window", t0, t1))
        probe_lags = _recv(probe_end, "probe", time.monotonic() + 30.0)[1]
        results = [_recv(p, "done", time.monotonic() + tokens * args.itl_ms / 1e3 + 120.0)[1] for p in pipes]
        m_after = scrape(gw_url)
    finally:
        procs.close()

    errors = [e for r in results for e in r["errors"]]
    gaps = [g for r in results for g in r["gaps_s"]]
    client_lags = [x for r in results for x in r["loop_lags_s"]]
    started_s = min(r["started_s"] for r in results)
    first = [t - started_s for r in results for t in r["first_chunk_at_s"]]
    rss_held = max(s["VmRSS"] for s in samples)
    non_200 = {k: v - m_before["statuses"].get(k, 0.0) for k, v in m_after["statuses"].items() if k != "200"}
    lag0, lag1 = m0["lag_buckets"], m1["lag_buckets"]
    hold_s = t1 - t0
    return {
        "n_streams": n,
        "clients": args.clients,
        "tokens_per_stream": tokens,
        "held": held,
        "streaming_at_hold_start": streaming,
        "in_flight_at_hold_start": m0["in_flight"],
        "in_flight_at_hold_end": m1["in_flight"],
        "streams_ended_before_hold_end": sum(r["ended_before_hold_end"] for r in results),
        "ramp_s": round(ramp_s, 2),
        "hold_s": round(hold_s, 2),
        "hold_window_monotonic_s": [round(t0, 3), round(t1, 3)],
        "rss_before_kib": rss_before["VmRSS"],
        "rss_anon_before_kib": rss_before["RssAnon"],
        "rss_held_kib": rss_held,
        "rss_anon_held_kib": max(s["RssAnon"] for s in samples),
        "rss_held_samples_kib": [s["VmRSS"] for s in samples],
        "rss_per_stream_kib": round((rss_held - rss_before["VmRSS"]) / n, 3),
        "loop_lag_p50_ms": _ms(histogram_quantile(0.5, lag0, lag1)),
        "loop_lag_p99_ms": _ms(histogram_quantile(0.99, lag0, lag1)),
        "loop_lag_highest_bucket_ms": _ms(highest_bucket_s(lag0, lag1)),
        "loop_lag_samples": int(lag1[math.inf] - lag0.get(math.inf, 0.0)),
        "loop_lag_ramp_p99_ms": _ms(histogram_quantile(0.99, m_before["lag_buckets"], lag0)),
        "client_gap_p50_ms": _ms(percentile(gaps, 0.5)) if gaps else None,
        "client_gap_p99_ms": _ms(percentile(gaps, 0.99)) if gaps else None,
        "client_gap_max_ms": _ms(max(gaps)) if gaps else None,
        "client_gap_samples": len(gaps),
        "upstream_itl_ms": args.itl_ms,
        "loop_lag_buckets_during_hold": _bucket_counts(lag0, lag1),
        "client_loop_lag_p99_ms": _ms(percentile(client_lags, 0.99)) if client_lags else None,
        "host_probe_loop_lag_p50_ms": _ms(percentile(probe_lags, 0.5)) if probe_lags else None,
        "host_probe_loop_lag_p99_ms": _ms(percentile(probe_lags, 0.99)) if probe_lags else None,
        "first_chunk_p50_s_from_ramp_start": round(percentile(first, 0.5), 3) if first else None,
        "cpu_pct_during_hold": _cpu_pct(cpu0, cpu1, hold_s),
        "gateway_cpu_ms_per_stream_setup": round((cpu0["gateway"] - cpu_ramp["gateway"]) / n * 1e3, 3),
        "nofile_limits": nofile,
        "errors": len(errors),
        "error_examples": sorted(set(errors))[:5],
        "gateway_non_200_responses": non_200,
        "tracemalloc_report": str(trace) if trace is not None and held else None,
    }


# ---- main ----------------------------------------------------------------------------------------------


def auto_tokens(n: int, args: argparse.Namespace) -> int:
    """Chunks per stream such that the first stream sent outlives the hold: the ramp, time for every stream
    to start, the hold, then a margin; at one chunk per `--itl-ms`."""
    lifetime_s = n / args.ramp_per_s + 15.0 + args.hold_s + 10.0
    return math.ceil(lifetime_s / (args.itl_ms / 1e3))


def targets(baseline: dict[str, Any], scale: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    dn = scale["n_streams"] - baseline["n_streams"]
    slope = (scale["rss_held_kib"] - baseline["rss_held_kib"]) / dn
    errors = baseline["errors"] + scale["errors"]
    lag = scale["loop_lag_p99_ms"]
    t: dict[str, Any] = {
        "rss_per_stream_kib": {
            "target_max": TARGET_RSS_KIB_PER_STREAM,
            "measured": round(slope, 3),
            "measured_as": "slope between the baseline and the scale run's held RSS",
            "met": slope <= TARGET_RSS_KIB_PER_STREAM,
        },
        "loop_lag_p99_ms": {
            "target_max": TARGET_LOOP_LAG_P99_MS,
            "measured": lag,
            "measured_as": "gateway loop-lag histogram over the scale run's hold",
            "met": lag is not None and lag <= TARGET_LOOP_LAG_P99_MS,
        },
        "errors": {
            "target_max": 0,
            "measured": errors,
            "measured_as": "failed or incomplete streams, both runs",
            "met": errors == 0 and scale["held"] and baseline["held"],
        },
    }
    t["all_met"] = all(v["met"] for v in t.values())
    return slope, t


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="N concurrent slow streams through one gateway")
    ap.add_argument("--streams", type=int, default=10_000, help="concurrent streams of the scale run")
    ap.add_argument("--baseline", type=int, default=1_000, help="concurrent streams of the baseline run")
    ap.add_argument("--hold-s", type=float, default=20.0, help="seconds all streams are held and measured")
    ap.add_argument("--itl-ms", type=float, default=1000.0, help="upstream gap between content chunks")
    ap.add_argument("--tokens", type=int, default=0, help="content chunks per stream (0: long enough)")
    ap.add_argument("--clients", type=int, default=1, help="load-client processes")
    ap.add_argument("--ramp-per-s", type=float, default=500.0, help="new streams per second, all clients")
    ap.add_argument(
        "--ramp-window",
        type=int,
        default=100,
        help="streams waiting for their first chunk at once, all clients (the gateway's accept "
        "queue holds 128)",
    )
    ap.add_argument(
        "--tracemalloc",
        type=int,
        default=0,
        metavar="FRAMES",
        help="run the gateway under tracemalloc (figures then are not the headline ones) and "
        "write where its memory grew during the hold next to --output (<stem>_tracemalloc_<N>.txt)",
    )
    ap.add_argument(
        "--keep-pool-limit",
        action="store_true",
        help="leave the gateway's upstream connection limit at its default",
    )
    ap.add_argument("--output", type=Path, default=REPO / "results" / "gateway_scale.json")
    args = ap.parse_args(argv)
    if not 0 < args.baseline < args.streams:
        ap.error("need 0 < --baseline < --streams")
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fits = (hard - NOFILE_SLACK) // 2
    nofile = raise_nofile(
        2 * args.streams + NOFILE_SLACK,
        f"the gateway (two sockets per stream, client side and upstream side, plus {NOFILE_SLACK})",
        f", or run at most {fits} --streams",
    )

    runs = {}
    for name, n in (("baseline", args.baseline), ("scale", args.streams)):
        tokens = args.tokens or auto_tokens(n, args)
        t_start = time.monotonic()
        print(f"{name}: {n} streams, {tokens} chunks each, {args.itl_ms:g} ms apart ...", flush=True)
        runs[name] = run_once(n, args, tokens)
        runs[name]["wall_s"] = round(time.monotonic() - t_start, 1)
        print(json.dumps({k: v for k, v in runs[name].items() if k != "rss_held_samples_kib"}), flush=True)
    slope, met = targets(runs["baseline"], runs["scale"])
    res = {
        "benchmark": "gateway_scale",
        "config": {
            "streams": args.streams,
            "baseline": args.baseline,
            "hold_s": args.hold_s,
            "itl_ms": args.itl_ms,
            "clients": args.clients,
            "ramp_per_s": args.ramp_per_s,
            "ramp_window": args.ramp_window,
            "tracemalloc_frames": args.tracemalloc,
            "keep_pool_limit": args.keep_pool_limit,
            "cpus": os.cpu_count(),
            "nofile_limit": nofile,
            "load_average": os.getloadavg()[0],
        },
        "results": runs,
        "n_streams": args.streams,
        "errors": runs["baseline"]["errors"] + runs["scale"]["errors"],
        "rss_slope_kib_per_stream": round(slope, 3),
        "rss_per_stream_kib": runs["scale"]["rss_per_stream_kib"],
        "loop_lag_p99_ms": runs["scale"]["loop_lag_p99_ms"],
        "targets": met,
    }
    print(json.dumps(res["targets"], indent=2))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(res, indent=2))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
