"""Fuzz a live gateway: generated and mutated requests against `python -m gateway` in front of sim engine
agents, each its own process.

The cases come from tests/fuzz/api_fuzz.py (hypothesis, drawing request bodies from the `/openapi.json` the
running gateway serves, then mutating them; plus arbitrary bytes, routing headers with arbitrary values, other
routes and methods, and fixed edge cases), sent `--window` at a time. Every answer must be a 2xx or a 4xx in
OpenAI's error shape: a 5xx (save admission control's 503 to a request whose own TTFT target no engine can
meet, counted apart), a dropped connection or a hang is a failure, each listed with its case. Afterwards the
gateway must still be running and healthy, and its own `switchyard_requests_total` must agree (no 5xx but
those 503s). Baseline, in the same run: one plain valid request sent as many times through the same window;
the fuzz's cases per second are reported against it.

    .venv/bin/python benchmarks/fuzz_gateway.py [--cases 10000] [--seed 0] [--agents 2] [--window 64]

Writes results/fuzz_gateway.json (`--output`). Needs the test extra (hypothesis). Exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "fuzz"))  # the case generator is the fuzz test's

from api_fuzz import Case, generate_cases, send_all  # noqa: E402

from gateway.config import GatewayConfig  # noqa: E402
from launcher.local_fleet import AgentSpec, LocalFleet  # noqa: E402
from switchyard.profiles import get_profile  # noqa: E402

PROFILE = "h100-llama3-8b"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def get(session: aiohttp.ClientSession, url: str) -> tuple[int, bytes]:
    async with session.get(url) as resp:
        return resp.status, await resp.read()


async def wait_healthy(base: str, gateway: asyncio.subprocess.Process, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if gateway.returncode is not None:
                raise RuntimeError(f"the gateway exited with {gateway.returncode}")
            try:
                if (await get(session, f"{base}/health"))[0] == 200:
                    return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError("the gateway did not turn healthy")


def five_hundreds(exposition: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in exposition.splitlines():
        if line.startswith("switchyard_requests_total{") and 'status="5' in line:
            status = line.split('status="')[1][:3]
            out[status] = out.get(status, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    profile = get_profile(PROFILE)
    specs = [AgentSpec(f"fuzz-{i}", PROFILE, free_port()) for i in range(args.agents)]
    results: dict[str, Any] = {"profile": PROFILE, "agents": args.agents, "window": args.window,
                               "seed": args.seed}
    async with LocalFleet(specs, start_timeout_s=90.0, stop_grace_s=5.0):
        port = free_port()
        cmd = [sys.executable, "-m", "gateway", "--port", str(port), "--allow-policy-override",
               "--request-timeout-s", "30", "--log-level", "ERROR"]
        for spec in specs:
            cmd += ["--engine", spec.address]
        gateway = await asyncio.create_subprocess_exec(*cmd, cwd=REPO, stderr=asyncio.subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        try:
            await wait_healthy(base, gateway)
            async with aiohttp.ClientSession() as session:
                document = json.loads((await get(session, f"{base}/openapi.json"))[1])
                models = [m["id"] for m in json.loads((await get(session, f"{base}/v1/models"))[1])["data"]]
            started = time.perf_counter()
            cases = generate_cases(
                document, models, count=args.cases, context_tokens=profile.max_context_tokens,
                max_body_bytes=GatewayConfig().max_body_bytes, seed=args.seed,
            )
            results["generation_s"] = round(time.perf_counter() - started, 2)
            hello = json.dumps({"model": models[0], "max_tokens": 2,
                                "messages": [{"role": "user", "content": "hello"}]}).encode()
            plain = [Case("baseline", "POST", "/v1/chat/completions", body=hello)] * min(args.cases, 2000)
            baseline = await send_all(base, plain, window=args.window)
            results["baseline"] = {k: v for k, v in baseline.summary().items() if k != "top_errors"}
            rss_before = rss_mib(gateway.pid)
            report = await send_all(base, cases, window=args.window, timeout_s=60.0)
            results["fuzz"] = report.summary()
            results["fuzz"]["all_failures"] = report.failures
            rss_after = rss_mib(gateway.pid)
            results["gateway_rss_mib"] = {"before": round(rss_before, 1), "after": round(rss_after, 1)}
            if baseline.wall_s and report.wall_s:
                results["cases_per_s_vs_baseline"] = round(
                    (report.sent / report.wall_s) / (baseline.sent / baseline.wall_s), 3
                )
            async with aiohttp.ClientSession() as session:
                health_status, _ = await get(session, f"{base}/health")
                _, exposition = await get(session, f"{base}/metrics")
            counted = five_hundreds(exposition.decode())
            results["after"] = {
                "gateway_running": gateway.returncode is None,
                "health_status": health_status,
                "gateway_5xx_counted": counted,
            }
            results["ok"] = (
                report.sent >= args.cases and not report.failures and not baseline.failures
                and gateway.returncode is None and health_status == 200
                and counted in ({}, {"503": float(report.shed_by_own_slo)})
            )
        finally:
            if gateway.returncode is None:
                gateway.terminate()
            await asyncio.wait_for(gateway.wait(), 30)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0, help="hypothesis seed of the first generation round")
    ap.add_argument("--agents", type=int, default=2)
    ap.add_argument("--window", type=int, default=64, help="requests in flight")
    ap.add_argument("--output", type=Path, default=REPO / "results" / "fuzz_gateway.json")
    args = ap.parse_args()
    results = asyncio.run(run(args))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    shown = {k: v for k, v in results.items() if k != "fuzz"}
    fuzz = {k: v for k, v in results.get("fuzz", {}).items() if k not in ("all_failures", "top_errors")}
    print(json.dumps({**shown, "fuzz": fuzz}, indent=2))
    print(f"wrote {args.output}")
    return 0 if results.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
