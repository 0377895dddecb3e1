"""Overload at 2x fleet capacity: with admission control, do admitted requests meet their TTFT SLO, and how
fast are rejections answered? Baselines in the same invocation: the same load with admission control off, and
with it on but without expiry (`admission.shed_expired`: queued requests are kept past their TTFT deadline).

One invocation starts `--agents` sim agents (`--profile`) and, per scenario, a fresh gateway in front of them.
It first measures the fleet's capacity on a gateway of its own (requests per second finished by a closed loop
with `--seats` clients per agent for `--capacity-s`), then offers Poisson arrivals at `--load` x that rate for
`--duration-s`, each request carrying `x-slo-ttft-ms`. Per scenario it reports: admitted (200) and rejected
(503 fleet_saturated) counts, the share of admitted requests whose TTFT (arrival to first content chunk, at
the client) met the SLO, TTFT p50/p99 of admitted requests, the rejections' answer time p50/p99 at the client,
and the bucket bound of the gateway's own p99 (`switchyard_admission_rejection_seconds`: handler arrival to
refusal), which tells the gateway's share from the machine's. Attainment over all arrivals is reported too (a
rejection counts as a miss), so shedding is never a free win.

    python benchmarks/overload.py [--agents 2] [--max-num-seqs 16] [--load 2.0] [--slo-ttft-ms 1000] \
        [--output results/overload.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway_overhead import free_port, wait_http  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def body(model: str, tokens: int, rng: random.Random) -> dict[str, object]:
    words = " ".join(rng.choice(("alpha", "beta", "gamma", "delta")) for _ in range(rng.randint(50, 150)))
    return {"model": model, "messages": [{"role": "user", "content": words}], "stream": True,
            "max_tokens": tokens, "ignore_eos": True}


async def one(session: aiohttp.ClientSession, url: str, payload: dict[str, object],
              headers: dict[str, str]) -> tuple[int, float, float]:
    """(status, TTFT or answer time, e2e) of one request, timed at the client."""
    start = time.perf_counter()
    async with session.post(f"{url}/v1/chat/completions", json=payload, headers=headers) as resp:
        if resp.status != 200:
            await resp.read()
            t = time.perf_counter() - start
            return resp.status, t, t
        ttft = None
        failed = False
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            if line.startswith(b'data: {"error"'):
                failed = True
            elif ttft is None and b'"content":""' not in line and b'"content"' in line:
                ttft = time.perf_counter() - start
        end = time.perf_counter() - start
        # A stream that ended with an error event is not an admitted request served: status 599 here.
        return (599 if failed else 200), ttft if ttft is not None else end, end


async def capacity(url: str, model: str, seats: int, tokens: int, seconds: float) -> float:
    rng = random.Random(1)
    done = 0
    stop_at = time.perf_counter() + seconds

    async def loop(session: aiohttp.ClientSession) -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            status, _, _ = await one(session, url, body(model, tokens, rng), {})
            done += status == 200

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        started = time.perf_counter()
        await asyncio.gather(*(loop(session) for _ in range(seats)))
        return done / (time.perf_counter() - started)


async def offered(url: str, model: str, rate: float, seconds: float, tokens: int,
                  slo_ms: float) -> list[tuple[int, float, float]]:
    rng = random.Random(7)
    headers = {"x-slo-ttft-ms": str(slo_ms)}
    tasks = []
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as session:
        t = 0.0
        start = time.perf_counter()
        while t < seconds:
            t += rng.expovariate(rate)
            delay = start + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(session, url, body(model, tokens, rng), headers)))
        return list(await asyncio.gather(*tasks))


def summary(rows: list[tuple[int, float, float]], slo_s: float) -> dict[str, object]:
    admitted = [r for r in rows if r[0] == 200]
    rejected = [r for r in rows if r[0] == 503]
    ttft = np.array([r[1] for r in admitted]) if admitted else np.array([0.0])
    met = sum(1 for r in admitted if r[1] <= slo_s)
    rej = np.array([r[1] for r in rejected]) if rejected else np.array([0.0])
    return {
        "arrivals": len(rows),
        "admitted": len(admitted),
        "rejected_503": len(rejected),
        "stream_errors": sum(1 for r in rows if r[0] == 599),
        "other_status": sum(1 for r in rows if r[0] not in (200, 503, 599)),
        "admitted_meeting_slo": met / len(admitted) if admitted else None,
        "attainment_over_arrivals": met / len(rows) if rows else None,
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "rejection_answer_p50_ms": float(np.percentile(rej, 50) * 1e3),
        "rejection_answer_p99_ms": float(np.percentile(rej, 99) * 1e3),
    }


def _bucket_p99_ms(url: str, name: str) -> float | None:
    """The upper bound of the histogram bucket holding the 99th percentile (None: no sample), in ms: the
    gateway's own share of a rejection's answer time, beside the client-observed figure."""
    import urllib.request  # noqa: PLC0415
    with urllib.request.urlopen(f"{url}/metrics") as r:
        text = r.read().decode()
    buckets = []
    for line in text.splitlines():
        if line.startswith(f"{name}_bucket"):
            le = line.split('le="')[1].split('"')[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    for le, count in buckets:
        if count >= 0.99 * total:
            return le * 1e3
    return None


def start_gateway(targets: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
    """A least-loaded gateway over `targets` (with `env` over this process's environment), once healthy."""
    port = free_port()
    cmd = [sys.executable, "-m", "gateway", "--port", str(port), "--policy", "least_loaded"]
    for t in targets:
        cmd += ["--engine", t]
    gw = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **env}, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/health", timeout_s=120)
    except BaseException:
        gw.terminate()
        gw.wait(60)
        raise
    return gw, url


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--agents", type=int, default=2)
    ap.add_argument("--profile", default="h100-llama3-8b")
    ap.add_argument("--seats", type=int, default=64, help="closed-loop clients per agent, capacity probe")
    ap.add_argument("--max-num-seqs", type=int, default=16,
                    help="each agent's batch slots; small enough that this machine's client can offer 2x")
    ap.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    ap.add_argument("--capacity-s", type=float, default=15.0)
    ap.add_argument("--load", type=float, default=2.0, help="offered load, x the measured capacity")
    ap.add_argument("--duration-s", type=float, default=40.0)
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    ap.add_argument("--output", type=Path, default=REPO / "results" / "overload.json")
    args = ap.parse_args()
    procs: list[subprocess.Popen[bytes]] = []
    res: dict[str, object] = {k: v for k, v in vars(args).items() if k != "output"}
    try:
        targets = []
        for i in range(args.agents):
            port = free_port()
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "engine_agent", "--backend", "sim", "--profile", args.profile,
                 "--port", str(port), "--engine-id", f"ov-{i}", "--seed", str(i),
                 "--sim-max-num-seqs", str(args.max_num_seqs)],
                cwd=REPO, stderr=subprocess.DEVNULL))
            targets.append(f"127.0.0.1:{port}")
        # Capacity on a gateway of its own, so that every measured arm starts cold (no completions seen).
        probe, url = start_gateway(targets, {})
        try:
            import urllib.request  # noqa: PLC0415
            with urllib.request.urlopen(f"{url}/v1/models") as r:
                model = json.loads(r.read())["data"][0]["id"]
            cap = asyncio.run(capacity(url, model, args.agents * args.seats, args.tokens, args.capacity_s))
        finally:
            probe.terminate()
            probe.wait(60)
        res["capacity_rps"] = cap
        print(f"capacity {cap:.2f} requests/s", flush=True)
        for scenario, enabled, expire in (("admission_on", "true", "true"),
                                          ("admission_no_expiry", "true", "false"),
                                          ("admission_off", "false", "true")):
            gw, url = start_gateway(targets, {"SWITCHYARD_GATEWAY_ADMISSION__ENABLED": enabled,
                                              "SWITCHYARD_GATEWAY_ADMISSION__SHED_EXPIRED": expire})
            try:
                rate = args.load * cap
                rows = asyncio.run(offered(url, model, rate, args.duration_s, args.tokens, args.slo_ttft_ms))
                res[scenario] = summary(rows, args.slo_ttft_ms / 1e3)
                with urllib.request.urlopen(f"{url}/metrics") as r:
                    res[scenario]["gateway_metrics"] = [  # type: ignore[index]
                        line for line in r.read().decode().splitlines()
                        if line.startswith(("switchyard_admission_total", "switchyard_admission_rejections",
                                            "switchyard_gateway_queue_depth",
                                            "switchyard_gateway_queue_wait_seconds_sum",
                                            "switchyard_gateway_queue_wait_seconds_count"))]
                res[scenario]["gateway_rejection_p99_ms_at_most"] = _bucket_p99_ms(  # type: ignore[index]
                    url, "switchyard_admission_rejection_seconds")
                print(scenario, res[scenario], flush=True)
            finally:
                gw.terminate()
                gw.wait(60)
    finally:
        for p in procs:
            p.terminate()
            p.wait(30)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
