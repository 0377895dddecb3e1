"""Collecting STAR training data: replay a dataset through agents that record their hidden states.

Owns: starting K engine agents as child processes (`python -m engine_agent ... --record-hidden-states DIR`,
sim or vLLM, on free loopback ports, inheriting stderr), waiting until each serves (grpc.health.v1), sending
every request straight to an agent's `Generate` (no gateway; round robin, at most `concurrency` in flight per
agent), with the dataset's output length forced (`max_tokens` = `target_output_tokens` = the length,
`ignore_eos`) unless asked to let the model stop, then stopping the agents with SIGTERM (each writes its last
shard on the way out) and counting what was written.
Must not: load datasets (the caller passes requests: `ReplayRequest` is the shape of loadgen's `Request`,
which this package may not import), read or label hidden states (the agents' recorders do), or leave a child
running (stopped in a `finally`, SIGKILL after a grace).

Request ids are `<run tag>-<index>` with a random run tag, so shards of several runs can be read together.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

import grpc
import grpc.aio
import numpy as np

from engine_agent.processes import AgentProcessError, terminate, wait_serving
from engine_agent.star.shards import SHARD_SUFFIX
from switchyard.child_process import ChildProcess, spawn
from switchyard.proto_gen import engine_agent_pb2 as pb
from switchyard.proto_gen import engine_agent_pb2_grpc as pb_grpc

Backend = Literal["sim", "vllm"]
DEFAULT_START_TIMEOUT_S: dict[Backend, float] = {"sim": 60.0, "vllm": 600.0}
STOP_GRACE_S = 60.0  # an agent writes its last shard after the drain
_COMPLETED = ("stop", "length")


class ReplayRequest(Protocol):
    """One request to replay (`loadgen.datasets.request.Request` has this shape)."""

    @property
    def prompt_tokens(self) -> int: ...
    @property
    def prompt(self) -> str | None: ...
    @property
    def messages(self) -> tuple[tuple[str, str], ...] | None: ...
    @property
    def prompt_token_ids(self) -> tuple[int, ...] | None: ...
    @property
    def output_tokens(self) -> int | None: ...


# (dataset name, data directory or None for the default, number of requests, seed) -> requests.
RequestLoader = Callable[[str, str | None, int, int], Sequence[ReplayRequest]]


class CollectError(RuntimeError):
    """An agent did not start or serve; the message is one line."""


@dataclass(frozen=True, slots=True)
class CollectOptions:
    out: Path
    backend: Backend = "sim"
    profile: str = "h100-llama3-8b"
    model_dir: str | None = None
    agents: int = 1
    concurrency: int = 256  # requests in flight per agent
    hidden_state_interval: int = 20
    seed: int = 0
    force_lengths: bool = True  # the dataset's output lengths (else the model stops, within max_tokens)
    max_tokens: int = 2048  # for requests whose length is not forced
    start_timeout_s: float | None = None  # None: the backend's default
    agent_args: tuple[str, ...] = ()  # more agent flags

    def __post_init__(self) -> None:
        if self.agents < 1 or self.concurrency < 1 or self.hidden_state_interval < 1 or self.max_tokens < 1:
            raise ValueError("agents, concurrency, hidden_state_interval and max_tokens must be >= 1")
        if self.backend == "vllm" and not self.model_dir:
            raise ValueError("the vllm backend needs a model directory")


@dataclass(frozen=True, slots=True)
class CollectReport:
    requests: int
    completed: int
    failed: dict[str, int]
    elapsed_s: float
    new_shards: tuple[Path, ...] = field(default_factory=tuple)

    def as_dict(self) -> dict[str, object]:
        return {"requests": self.requests, "completed": self.completed, "failed": self.failed,
                "elapsed_s": round(self.elapsed_s, 2), "new_shards": len(self.new_shards)}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def generate_request(request: ReplayRequest, request_id: str, options: CollectOptions,
                     rng: np.random.Generator) -> pb.GenerateRequest:
    """The agent's request for one replayed request (prompt ids synthesised when the dataset has only a
    count)."""
    out = pb.GenerateRequest(request_id=request_id)
    if request.prompt_token_ids is not None:
        out.prompt_token_ids.ids.extend(request.prompt_token_ids)
    elif request.messages is not None:
        out.chat.add_generation_prompt = True
        for role, content in request.messages:
            out.chat.messages.add(role=role, content=content)
    elif request.prompt is not None:
        out.prompt_text = request.prompt
    else:
        synthetic = rng.integers(100, 1000, max(request.prompt_tokens, 1))
        out.prompt_token_ids.ids.extend(int(t) for t in synthetic)
    out.sampling.temperature = 1.0
    length = request.output_tokens
    if options.force_lengths and length is not None:
        length = max(length, 1)
        out.sampling.max_tokens = length
        out.sampling.ignore_eos = True
        out.target_output_tokens = length
    else:
        out.sampling.max_tokens = options.max_tokens
    return out


def _agent_command(options: CollectOptions, index: int, port: int) -> list[str]:
    backend = (["--backend", "vllm", "--model", str(options.model_dir)] if options.backend == "vllm"
               else ["--backend", "sim", "--profile", options.profile])
    return [
        sys.executable, "-m", "engine_agent", *backend, "--host", "127.0.0.1", "--port", str(port),
        "--engine-id", f"collect-{index}", "--seed", str(options.seed + index),
        "--hidden-state-interval", str(options.hidden_state_interval),
        "--record-hidden-states", str(options.out), "--log-level", "WARNING", *options.agent_args,
    ]


async def _replay_one(stub: pb_grpc.EngineAgentStub, request: pb.GenerateRequest,
                      slots: asyncio.Semaphore) -> str:
    """'completed', or why not (the finish reason, or the RPC's status code)."""
    async with slots:
        try:
            async for event in stub.Generate(request):
                if event.HasField("finished"):
                    reason = event.finished.finish_reason
                    return "completed" if reason in _COMPLETED else f"finish:{reason}"
                if event.HasField("migrated"):
                    return "migrated"
        except grpc.aio.AioRpcError as exc:
            return f"rpc:{exc.code().name}"
    return "no-finish"


def _shards_in(directory: Path) -> set[Path]:
    if not directory.is_dir():
        return set()
    return {p for p in directory.iterdir() if p.suffix == SHARD_SUFFIX}


async def collect(requests: Sequence[ReplayRequest], options: CollectOptions,
                  progress: Callable[[str], None] | None = None) -> CollectReport:
    """Start the agents, replay `requests` through them, stop them; the shards land in `options.out`."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    before = await asyncio.to_thread(_shards_in, options.out)
    rng = np.random.default_rng([options.seed, 3])
    tag = uuid.uuid4().hex[:8]
    wire = [generate_request(r, f"{tag}-{i:05d}", options, rng) for i, r in enumerate(requests)]
    ports = [free_port() for _ in range(options.agents)]
    procs: list[ChildProcess] = []
    outcomes: Counter[str] = Counter()
    timeout_s = options.start_timeout_s or DEFAULT_START_TIMEOUT_S[options.backend]
    try:
        for i, port in enumerate(ports):
            procs.append(spawn(_agent_command(options, i, port)))  # vfork: see child_process
        addresses = [f"127.0.0.1:{port}" for port in ports]
        try:
            waits = (wait_serving(a, p, timeout_s) for a, p in zip(addresses, procs, strict=True))
            await asyncio.gather(*waits)
        except AgentProcessError as exc:
            raise CollectError(f"{exc} (its errors are above)") from None
        if progress is not None:
            progress(f"{len(procs)} agent(s) serving; replaying {len(wire)} request(s)")
        channels = [grpc.aio.insecure_channel(a) for a in addresses]
        stubs = [pb_grpc.EngineAgentStub(c) for c in channels]  # type: ignore[no-untyped-call]
        slots = [asyncio.Semaphore(options.concurrency) for _ in stubs]
        tasks = [
            asyncio.create_task(_replay_one(stubs[i % len(stubs)], request, slots[i % len(stubs)]))
            for i, request in enumerate(wire)
        ]
        try:
            step = max(len(tasks) // 10, 1)
            for done, finished in enumerate(asyncio.as_completed(tasks), start=1):
                outcomes[await finished] += 1
                if progress is not None and (done % step == 0 or done == len(tasks)):
                    progress(f"{done}/{len(tasks)} request(s) done")
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for channel in channels:
                await channel.close()
    finally:
        await asyncio.gather(*(terminate(p, STOP_GRACE_S) for p in procs), return_exceptions=True)
    after = await asyncio.to_thread(_shards_in, options.out)
    completed = outcomes.pop("completed", 0)
    return CollectReport(requests=len(wire), completed=completed, failed=dict(outcomes),
                         elapsed_s=loop.time() - started, new_shards=tuple(sorted(after - before)))
