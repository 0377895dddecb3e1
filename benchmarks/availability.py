"""Availability under load: 256 concurrent streams through a round-robin gateway in front of two healthy
OpenAI upstreams (issue 12's report: 79 of ~4,200 requests answered 503 no_engine_available because late
/metrics scrapes marked the upstreams stale). Every request must succeed.

One invocation starts two mock upstreams (benchmarks/mock_upstream.py, `--itl-ms` between chunks) and, per
scenario, a gateway (`python -m gateway --policy round_robin --upstream A --upstream B`), then keeps
`--concurrency` streams open until `--requests` have finished, counting answers by status and error code.
Scenarios: `default` (the gateway's defaults) and `stale` (`stale_after_s` = 0.05 s, shorter than the 0.5 s
scrape interval, so the upstreams are stale most of the time: the old code refused everything then).

    python benchmarks/availability.py [--requests 4200] [--concurrency 256] \
        [--output results/availability.json]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway_overhead import free_port, wait_http  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


async def run_load(url: str, requests: int, concurrency: int, tokens: int) -> dict[str, object]:
    counts: collections.Counter[str] = collections.Counter()
    body = {"model": "mock-model", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "max_tokens": tokens}
    remaining = requests
    started = time.perf_counter()

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            try:
                async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
                    text = await resp.text()
                    if resp.status != 200:
                        code = json.loads(text).get("error", {}).get("code")
                        counts[f"{resp.status} {code}"] += 1
                    elif '"error"' in text:
                        counts["200 error event"] += 1
                    elif "[DONE]" in text:
                        counts["200"] += 1
                    else:
                        counts["200 truncated"] += 1
            except (aiohttp.ClientError, OSError) as e:
                counts[f"client error {type(e).__name__}"] += 1

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return {"requests": requests, "seconds": time.perf_counter() - started, "answers": dict(counts)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=4200)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=32, help="chunks per stream")
    ap.add_argument("--itl-ms", type=float, default=5.0, help="mock upstreams' gap between chunks")
    ap.add_argument("--output", type=Path, default=REPO / "results" / "availability.json")
    args = ap.parse_args()
    procs: list[subprocess.Popen[bytes]] = []
    results: dict[str, object] = {
        "concurrency": args.concurrency, "tokens": args.tokens, "itl_ms": args.itl_ms
    }
    try:
        upstreams = []
        for _ in range(2):
            port = free_port()
            procs.append(subprocess.Popen(
                [sys.executable, str(REPO / "benchmarks" / "mock_upstream.py"), "--port", str(port),
                 "--itl-ms", str(args.itl_ms), "--random-phase"], cwd=REPO))
            upstreams.append(f"http://127.0.0.1:{port}")
        for url in upstreams:
            wait_http(f"{url}/v1/models")
        for scenario, env in (("default", {}), ("stale", {"SWITCHYARD_GATEWAY_STALE_AFTER_S": "0.05"})):
            port = free_port()
            cmd = [sys.executable, "-m", "gateway", "--port", str(port), "--policy", "round_robin"]
            for url in upstreams:
                cmd += ["--upstream", url]
            gateway = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **env}, stderr=subprocess.DEVNULL)
            try:
                base = f"http://127.0.0.1:{port}"
                wait_http(f"{base}/health")
                results[scenario] = asyncio.run(run_load(base, args.requests, args.concurrency, args.tokens))
                print(scenario, results[scenario], flush=True)
            finally:
                gateway.terminate()
                gateway.wait(30)
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
