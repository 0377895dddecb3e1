"""Gateway overhead: the same client against a minimal OpenAI upstream, directly and through the gateway.

One invocation starts the mock upstream (benchmarks/mock_upstream.py) and a gateway in front of it
(`python -m gateway --upstream ...`), each in its own process, and measures, side by side in the same run:
- TTFT p50/p99 at concurrency 1 (direct vs gateway, and the difference: the gateway's added TTFT);
- CPU seconds the gateway process spends per request (from /proc, user + system);
- streamed chunks per second at concurrency 64 and 256 (`--concurrency`, e.g. 64 256 1024; direct vs gateway,
  and their ratio; `--repeat N` measures each pair N times, direct and gateway alternating, and reports the
  median ratio and every ratio);
- the gateway's CPU split into a fixed cost per request and a cost per streamed content chunk: a second
  gateway run at the first concurrency with `--split-tokens` (default 1) chunks per stream, the two runs' CPU
  per request fitted by a line in the chunk count;
- `--upstreams N` starts N mock upstreams: the gateway routes over all of them, the direct client spreads its
  requests over them round robin; `--itl-ms X` paces their chunks X ms apart (default 0: each stream is one
  burst, which the gateway reads and writes in a few socket operations; paced, every chunk is a read and a
  write of its own, as with a real engine);
- `--workers N` (N > 1) also starts a gateway with `--workers N` in front of the same upstreams and measures,
  at each concurrency, its streamed chunks per second against the one-worker gateway's (`--repeat` pairs,
  alternating, medians kept); the JSON's `workers` section has both ceilings (the best median over the
  concurrencies), their ratio `n_over_one` (target: >= 1.6 for 2 workers on 2 cores, `target_ratio`), and the
  CPU both gateways used (a supervised gateway: the supervisor and its workers, from /proc). On a machine
  with as many cores as workers, the client and the mock upstreams compete with the workers for them: give
  the upstreams cores of their own (`--upstreams`, another machine) to see the gateway's own ceiling;
- loadgen's own measurement lag (`loadgen.live.run_live`, the machinery of `python -m loadgen run`) against a
  second mock upstream with scripted timing (every content chunk, the first included, `--itl-ms 10` after the
  previous one): measured minus scripted TTFT and ITL, and how late each request is sent after its planned
  arrival; this benchmark's bare client on the same upstream (its TTFT) is the baseline.
Results are printed and written as JSON (default results/gateway_overhead.json).

    .venv/bin/python benchmarks/gateway_overhead.py [--requests 200] [--tokens 64] [--concurrency 64 256 1024]
        [--upstreams 2] [--repeat 3] [--skip-lag] [--workers 2]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import orjson

from loadgen.datasets import text_request
from loadgen.live import LiveOptions, run_live

REPO = Path(__file__).resolve().parents[1]
SCRIPTED_ITL_MS = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


async def one_stream(session: aiohttp.ClientSession, url: str, tokens: int) -> tuple[float, int]:
    """Returns (ttft_s, content chunks received)."""
    body = {
        "model": "mock-model",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft = -1.0
    chunks = 0
    async with session.post(url + "/v1/chat/completions", data=orjson.dumps(body),
                            headers={"Content-Type": "application/json"}) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            obj = orjson.loads(line[6:])
            choices = obj.get("choices") or []
            if choices and choices[0].get("delta", {}).get("content"):
                if ttft < 0:
                    ttft = time.perf_counter() - t0
                chunks += 1
    if chunks != tokens:
        raise RuntimeError(f"expected {tokens} content chunks, got {chunks}")
    return ttft, chunks


async def ttft_sequential(url: str, n: int, tokens: int) -> list[float]:
    async with aiohttp.ClientSession() as s:
        for _ in range(5):  # warm-up: connections, caches
            await one_stream(s, url, tokens)
        return [(await one_stream(s, url, tokens))[0] for _ in range(n)]


async def throughput(urls: str | list[str], concurrency: int, per_worker: int, tokens: int) -> float:
    """Content chunks per second of `concurrency` workers, each streaming `per_worker` requests in a row (to
    the urls in turn when there are several)."""
    targets = itertools.cycle([urls] if isinstance(urls, str) else urls)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        await asyncio.gather(*(one_stream(s, next(targets), tokens) for _ in range(min(concurrency, 16))))

        async def worker() -> int:
            return sum([(await one_stream(s, next(targets), tokens))[1] for _ in range(per_worker)])

        t0 = time.perf_counter()
        total = sum(await asyncio.gather(*(worker() for _ in range(concurrency))))
        return total / (time.perf_counter() - t0)


def gateway_cpu_run(
    pid: int, url: str, concurrency: int, per_worker: int, tokens: int
) -> tuple[float, float]:
    """(content chunks/s, gateway CPU seconds per request) of one throughput run through the gateway."""
    c0 = cpu_seconds(pid)
    rate = asyncio.run(throughput(url, concurrency, per_worker, tokens))
    n_req = concurrency * per_worker + min(concurrency, 16)
    return rate, (cpu_seconds(pid) - c0) / n_req


async def loadgen_lag(url: str, requests: int, tokens: int, spacing_s: float) -> dict[str, float]:
    """loadgen's figures against the scripted upstream at `url`, less the script; the bare client's TTFT on
    the same upstream (sequential, like loadgen's spaced arrivals) is the baseline."""
    plan = [(i * spacing_s, text_request(f"lag-{i}", "hello", tokenizer=None, output_tokens=tokens))
            for i in range(requests)]
    outcomes = (await run_live(plan, LiveOptions(url, "mock-model"))).outcomes
    failed = [o.error for o in outcomes if not o.success]
    if failed:
        raise RuntimeError(f"loadgen: {len(failed)} requests failed, e.g. {failed[0]}")
    scripted_s = SCRIPTED_ITL_MS / 1e3
    ttft = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    itl = [gap for o in outcomes for gap in o.itl_s]
    late = [o.start_s - o.arrival_s for o in outcomes if o.start_s is not None and o.arrival_s is not None]
    bare = await ttft_sequential(url, requests, tokens)
    return {
        "scripted_ttft_and_itl_ms": SCRIPTED_ITL_MS,
        "ttft_lag_p50_ms": (percentile(ttft, 0.5) - scripted_s) * 1e3,
        "ttft_lag_p99_ms": (percentile(ttft, 0.99) - scripted_s) * 1e3,
        "itl_lag_p50_ms": (percentile(itl, 0.5) - scripted_s) * 1e3,
        "itl_lag_p99_ms": (percentile(itl, 0.99) - scripted_s) * 1e3,
        "start_late_p50_ms": percentile(late, 0.5) * 1e3,
        "start_late_p99_ms": percentile(late, 0.99) * 1e3,
        "start_late_max_ms": max(late) * 1e3,
        "bare_client_ttft_p50_ms": percentile(bare, 0.5) * 1e3,
        "loadgen_over_bare_ttft_p50": percentile(ttft, 0.5) / percentile(bare, 0.5),
        "requests": requests,
    }


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of a process and its children (a supervised gateway: the supervisor and its workers)."""
    pids = [pid]
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:  # field 4: the parent's pid
                pids.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue  # a process that ended meanwhile
    total = 0.0
    for p in pids:
        try:
            total += cpu_seconds(p)
        except OSError:
            continue
    return total


def wait_workers(url: str, workers: int, timeout_s: float = 60.0) -> None:
    """Until each of `workers` workers (`x-switchyard-worker`) answered /health 200, on new connections."""

    async def probe() -> None:
        deadline = time.monotonic() + timeout_s
        healthy: set[str] = set()
        while len(healthy) < workers:
            try:
                async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
                    async with s.get(url + "/health") as r:
                        if r.status == 200:
                            healthy.add(r.headers.get("x-switchyard-worker", ""))
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url}: {len(healthy)} of {workers} workers healthy after {timeout_s}s")
            await asyncio.sleep(0.02)

    asyncio.run(probe())


def workers_scaling(
    one: tuple[int, str], many: tuple[int, str], workers: int, args: argparse.Namespace
) -> dict[str, object]:
    """Chunks/s of the one-worker gateway and of the `workers`-worker one at each concurrency, alternating."""
    per_conc: dict[str, object] = {}
    best_one = best_many = 0.0
    cpu = {"one": 0.0, "many": 0.0}
    for conc in args.concurrency:
        ones, manys = [], []
        for _ in range(args.repeat):
            for (pid, url), runs, key in ((one, ones, "one"), (many, manys, "many")):
                c0 = tree_cpu_seconds(pid)
                runs.append(asyncio.run(throughput(url, conc, args.per_worker, args.tokens)))
                cpu[key] += tree_cpu_seconds(pid) - c0
        m1, mn = statistics.median(ones), statistics.median(manys)
        best_one, best_many = max(best_one, m1), max(best_many, mn)
        per_conc[f"concurrency_{conc}"] = {
            "one_worker_chunks_per_s": m1,
            f"{workers}_workers_chunks_per_s": mn,
            "n_over_one": mn / m1,
            "one_worker_runs": ones,
            f"{workers}_workers_runs": manys,
        }
    return {
        "workers": workers,
        "one_worker_max_chunks_per_s": best_one,
        f"{workers}_workers_max_chunks_per_s": best_many,
        "n_over_one": best_many / best_one,
        "target_ratio": 0.8 * workers,  # 1.6 for 2 workers
        "one_worker_cpu_s": cpu["one"],
        f"{workers}_workers_cpu_s": cpu["many"],
        **per_conc,
    }


def wait_http(url: str, timeout_s: float = 30.0) -> None:
    async def probe() -> None:
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as s:
            while True:
                try:
                    async with s.get(url) as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{url} not up after {timeout_s}s")
                await asyncio.sleep(0.1)

    asyncio.run(probe())


def finish(res: dict[str, object], output: Path) -> int:
    print(json.dumps(res, indent=2))
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(res, indent=2))
    print(f"wrote {output}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description="gateway overhead vs a direct connection")
    ap.add_argument("--requests", type=int, default=200, help="sequential requests for the TTFT figures")
    ap.add_argument("--tokens", type=int, default=64, help="chunks per stream")
    ap.add_argument("--per-worker", type=int, default=4, help="streams per worker in the throughput runs")
    ap.add_argument("--lag-requests", type=int, default=40, help="requests for loadgen's measurement lag")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[64, 256], help="throughput concurrencies")
    ap.add_argument("--repeat", type=int, default=1, help="direct/gateway throughput pairs per concurrency")
    ap.add_argument("--upstreams", type=int, default=1, help="mock upstreams behind the gateway")
    ap.add_argument("--split-tokens", type=int, default=1,
                    help="chunks per stream of the extra run that splits CPU per request and per chunk")
    ap.add_argument("--itl-ms", type=float, default=0.0, help="mock upstreams' gap between chunks")
    ap.add_argument("--skip-lag", action="store_true", help="skip loadgen's measurement lag")
    ap.add_argument("--workers", type=int, default=1,
                    help="also measure a gateway with this many workers against the one-worker gateway")
    ap.add_argument("--output", type=Path, default=REPO / "results" / "gateway_overhead.json")
    args = ap.parse_args()

    up_ports, gw_port = [free_port() for _ in range(args.upstreams)], free_port()
    directs = [f"http://127.0.0.1:{port}" for port in up_ports]
    direct, via = directs[0], f"http://127.0.0.1:{gw_port}"
    py = sys.executable
    procs = [subprocess.Popen([py, str(REPO / "benchmarks" / "mock_upstream.py"), "--port", str(port),
                               "--itl-ms", str(args.itl_ms)])
             for port in up_ports]
    try:
        for url in directs:
            wait_http(url + "/v1/models")
        gw = subprocess.Popen([py, "-m", "gateway", "--port", str(gw_port), "--policy", "round_robin",
                               *(a for url in directs for a in ("--upstream", url))],
                              cwd=REPO, stdout=subprocess.DEVNULL)
        procs.append(gw)
        wait_http(via + "/health")
        many: tuple[int, str] | None = None
        if args.workers > 1:
            many_url = f"http://127.0.0.1:{free_port()}"
            gw_many = subprocess.Popen(
                [py, "-m", "gateway", "--workers", str(args.workers), "--port", many_url.rsplit(":", 1)[1],
                 "--policy", "round_robin", *(a for url in directs for a in ("--upstream", url))],
                cwd=REPO, stdout=subprocess.DEVNULL)
            procs.append(gw_many)
            wait_workers(many_url, args.workers)
            many = (gw_many.pid, many_url)

        res: dict[str, object] = {"tokens_per_stream": args.tokens, "cpu_cores": os.cpu_count(),
                                  "upstreams": args.upstreams, "itl_ms": args.itl_ms,
                                  "load_average": os.getloadavg()[0]}
        d = asyncio.run(ttft_sequential(direct, args.requests, args.tokens))
        cpu0 = cpu_seconds(gw.pid)
        g = asyncio.run(ttft_sequential(via, args.requests, args.tokens))
        cpu1 = cpu_seconds(gw.pid)
        res["concurrency_1"] = {
            "direct_ttft_p50_ms": percentile(d, 0.5) * 1e3,
            "direct_ttft_p99_ms": percentile(d, 0.99) * 1e3,
            "gateway_ttft_p50_ms": percentile(g, 0.5) * 1e3,
            "gateway_ttft_p99_ms": percentile(g, 0.99) * 1e3,
            "added_ttft_p50_ms": (percentile(g, 0.5) - percentile(d, 0.5)) * 1e3,
            "added_ttft_p99_ms": (percentile(g, 0.99) - percentile(d, 0.99)) * 1e3,
            "gateway_cpu_ms_per_request": (cpu1 - cpu0) / (args.requests + 5) * 1e3,
            "requests": args.requests,
            "direct_ttft_mean_ms": statistics.fmean(d) * 1e3,
        }
        for conc in args.concurrency:
            pairs = []
            for _ in range(args.repeat):
                td = asyncio.run(throughput(directs, conc, args.per_worker, args.tokens))
                tg, cpu_s = gateway_cpu_run(gw.pid, via, conc, args.per_worker, args.tokens)
                pairs.append((tg / td, td, tg, cpu_s))
            ratio, td, tg, _ = sorted(pairs)[len(pairs) // 2]  # the median pair
            cpu_s = statistics.fmean(p[3] for p in pairs)
            res[f"concurrency_{conc}"] = {
                "direct_chunks_per_s": td,
                "gateway_chunks_per_s": tg,
                "gateway_over_direct": ratio,
                "gateway_cpu_ms_per_request": cpu_s * 1e3,  # mean over the repeats
                "gateway_cpu_us_per_chunk_all_in": cpu_s / args.tokens * 1e6,
                "all_ratios": [p[0] for p in pairs],
            }
        # CPU per request = fixed + per_chunk * chunks: full and small runs in turn at the first concurrency.
        # The small runs have more requests: /proc's CPU time has a 10 ms resolution.
        conc = args.concurrency[0]
        full_s, small_s = [], []
        for _ in range(args.repeat):
            full_s.append(gateway_cpu_run(gw.pid, via, conc, args.per_worker, args.tokens)[1])
            small_s.append(gateway_cpu_run(gw.pid, via, conc, args.per_worker * 8, args.split_tokens)[1])
        full_mean, small_mean = statistics.fmean(full_s), statistics.fmean(small_s)
        per_chunk_s = (full_mean - small_mean) / (args.tokens - args.split_tokens)
        res["cpu_split"] = {
            "concurrency": conc,
            "gateway_cpu_us_per_request_fixed": (small_mean - per_chunk_s * args.split_tokens) * 1e6,
            "gateway_cpu_us_per_content_chunk": per_chunk_s * 1e6,
            "gateway_cpu_us_per_request_at_split_tokens": small_mean * 1e6,
            "gateway_cpu_us_per_request_at_tokens": full_mean * 1e6,
            "split_tokens": args.split_tokens,
            "runs": args.repeat,
        }
        if many is not None:
            res["workers"] = workers_scaling((gw.pid, via), many, args.workers, args)
        if args.skip_lag:
            return finish(res, args.output)
        lag_port = free_port()
        scripted = f"http://127.0.0.1:{lag_port}"
        procs.append(subprocess.Popen([py, str(REPO / "benchmarks" / "mock_upstream.py"),
                                       "--port", str(lag_port), "--itl-ms", str(SCRIPTED_ITL_MS)]))
        wait_http(scripted + "/v1/models")
        # 8 chunks, 10 ms apart: ~90 ms per request; 100 ms between arrivals, so requests rarely overlap.
        res["loadgen_lag"] = asyncio.run(loadgen_lag(scripted, args.lag_requests, 8, 0.1))
        return finish(res, args.output)
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            p.wait(timeout=15)


if __name__ == "__main__":
    sys.exit(main())
