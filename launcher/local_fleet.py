"""A fleet of engine agents as local child processes (for `switchyard up` and integration tests).

Owns: spawning `python -m engine_agent --backend sim --profile P ...` or `... --backend vllm --model DIR ...`
children, waiting until each serves (grpc.health.v1 SERVING, while watching that the child has not exited;
vLLM on a CPU takes a minute or more to start, so the default wait depends on the backend), and stopping
them (SIGTERM, wait, SIGKILL, always reaped); adding and removing agents while it runs (`add`, `remove`), and
`LocalActuator`, the autoscaler's actuator that does so for `switchyard up --plan --autoscale`.
Must not: route or proxy requests, or leave a child running when its owner stops (callers use `LocalFleet` as
an async context manager or call `stop()` in a finally).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Literal

from engine_agent.processes import AgentProcessError, terminate, wait_serving
from gateway.fleet.autoscale import CopySpec
from switchyard.child_process import ChildProcess, spawn

# An agent could not be started (it exited, or did not serve in time); the launcher's name for it.
FleetError = AgentProcessError

Backend = Literal["sim", "vllm"]
BACKENDS: tuple[Backend, ...] = ("sim", "vllm")
# How long an agent may take to answer SERVING: the sim starts in about a second; vLLM on a CPU loads the
# model, compiles and profiles memory first (30-90 s for a tiny model).
DEFAULT_START_TIMEOUT_S: dict[Backend, float] = {"sim": 60.0, "vllm": 300.0}


@dataclass(frozen=True, slots=True)
class AgentSpec:
    """One agent: `profile` is the sim profile (sim backend); `model` the model directory (vllm backend)."""

    engine_id: str
    profile: str
    port: int
    host: str = "127.0.0.1"
    backend: Backend = "sim"
    model: str | None = None
    extra_args: tuple[str, ...] = ()  # more agent flags, e.g. ("--enforce-eager", "--max-model-len", "1024")

    def __post_init__(self) -> None:
        if self.backend == "vllm" and not self.model:
            raise ValueError(f"{self.engine_id}: the vllm backend needs a model directory")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def label(self) -> str:
        """What the engine runs, for banners: the sim profile, or `vllm:<model directory name>`."""
        if self.backend == "vllm":
            return f"vllm:{Path(self.model or '').name}"
        return self.profile

    def backend_args(self) -> list[str]:
        """The agent's backend flags: `--backend sim --profile P` or `--backend vllm --model DIR`."""
        if self.backend == "vllm":
            return ["--backend", "vllm", "--model", str(self.model)]
        return ["--backend", "sim", "--profile", self.profile]


def plan_agents(
    count: int,
    profiles: Sequence[str],
    base_port: int,
    host: str = "127.0.0.1",
    *,
    backend: Backend = "sim",
    model: str | None = None,
    extra_args: Sequence[str] = (),
) -> list[AgentSpec]:
    """`count` agents on consecutive ports. Sim: profiles cycled (a heterogeneous fleet when several are
    given); vllm: every agent serves `model` (profiles unused). `extra_args`: more flags for every agent."""
    if count < 1:
        raise ValueError("need at least one engine")
    if backend == "sim" and not profiles:
        raise ValueError("need at least one profile")
    if backend == "vllm" and not model:
        raise ValueError("the vllm backend needs a model directory")
    if base_port < 1 or base_port + count - 1 > 65535:
        raise ValueError(f"ports {base_port}..{base_port + count - 1} are out of range")
    return [
        AgentSpec(
            f"engine-{i}",
            profiles[i % len(profiles)] if backend == "sim" else "",
            base_port + i,
            host,
            backend=backend,
            model=model if backend == "vllm" else None,
            extra_args=tuple(extra_args),
        )
        for i in range(count)
    ]


class LocalFleet:
    """Child agent processes; `async with LocalFleet(specs) as fleet:` starts them all and waits until they
    serve. `start_timeout_s` bounds that wait for every agent; None: each agent's backend default
    (`DEFAULT_START_TIMEOUT_S`)."""

    def __init__(
        self,
        specs: Sequence[AgentSpec],
        *,
        python: str = sys.executable,
        agent_log_level: str = "WARNING",
        start_timeout_s: float | None = None,
        stop_grace_s: float = 10.0,
    ) -> None:
        self.specs = list(specs)
        self._python = python
        self._log_level = agent_log_level
        self._start_timeout_s = start_timeout_s
        self._stop_grace_s = stop_grace_s
        self.processes: dict[str, ChildProcess] = {}

    def start_timeout_s(self, spec: AgentSpec) -> float:
        if self._start_timeout_s is not None:
            return self._start_timeout_s
        return DEFAULT_START_TIMEOUT_S[spec.backend]

    async def start(self) -> None:
        for spec in self.specs:
            self.processes[spec.engine_id] = await self.spawn(spec)
        await asyncio.gather(
            *(
                wait_serving(s.address, self.processes[s.engine_id], self.start_timeout_s(s))
                for s in self.specs
            )
        )

    async def spawn(self, spec: AgentSpec) -> ChildProcess:
        # switchyard.child_process: vfork + exec, as a fork() of this gRPC process can crash the child
        return spawn(
            [
                self._python,
                "-X",
                "faulthandler",  # a crashing agent leaves its threads' Python stacks in the log
                "-m",
                "engine_agent",
                *spec.backend_args(),
                "--host",
                spec.host,
                "--port",
                str(spec.port),
                "--engine-id",
                spec.engine_id,
                *spec.extra_args,
                "--log-level",
                self._log_level,
            ]
        )

    async def add(self, specs: Sequence[AgentSpec]) -> None:
        """Start more agents and wait until they serve; on failure or cancellation, stop them again."""
        started: list[AgentSpec] = []
        try:
            for spec in specs:
                self.processes[spec.engine_id] = await self.spawn(spec)
                self.specs.append(spec)
                started.append(spec)
            await asyncio.gather(
                *(
                    wait_serving(s.address, self.processes[s.engine_id], self.start_timeout_s(s))
                    for s in specs
                )
            )
        except BaseException:
            await self.remove([s.address for s in started], grace_s=self._stop_grace_s)
            raise

    async def remove(self, addresses: Sequence[str], *, grace_s: float) -> None:
        """Stop the agents at `addresses` (SIGTERM: they drain; SIGKILL after `grace_s`), reaped."""
        wanted = set(addresses)
        gone = [s for s in self.specs if s.address in wanted]
        procs = [self.processes.pop(s.engine_id) for s in gone if s.engine_id in self.processes]
        self.specs = [s for s in self.specs if s not in gone]
        await asyncio.gather(*(terminate(p, grace_s) for p in procs), return_exceptions=True)

    async def stop(self) -> None:
        procs = list(self.processes.values())
        await asyncio.gather(*(terminate(p, self._stop_grace_s) for p in procs), return_exceptions=True)

    async def __aenter__(self) -> LocalFleet:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


class LocalActuator:
    """`switchyard up --plan --autoscale`'s hands (`gateway.fleet.autoscale.Actuator`): each copy of a combo
    as sim agents of `fleet` on this machine (`loadgen.simulate.fleet.combo_engines`: the simulator's engines
    for it), labelled `--combo C#k` with their roles, on the next free ports from `next_port`. Agents drain
    for up to `drain_s` when released (SIGTERM; they finish what they hold, then exit)."""

    name = "local"

    def __init__(
        self,
        fleet: LocalFleet,
        *,
        next_port: int,
        host: str = "127.0.0.1",
        agent_args: Sequence[str] = (),
        drain_s: float = 600.0,
    ) -> None:
        self._fleet = fleet
        self._next_port = next_port
        self._host = host
        self._agent_args = tuple(agent_args)
        self._drain_s = drain_s
        self._next_id = len(fleet.specs)

    def _free_port(self) -> int:
        taken = {s.port for s in self._fleet.specs}
        while True:
            port = self._next_port
            self._next_port += 1
            if port > 65535:
                raise FleetError("no free port left for a new agent")
            if port in taken:
                continue
            with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as probe:
                try:
                    probe.bind((self._host, port))
                except OSError:
                    continue
            return port

    async def provision(self, copy: CopySpec) -> list[str]:
        from loadgen.simulate.fleet import combo_engines  # noqa: PLC0415 (the catalogue of sim profiles)

        specs: list[AgentSpec] = []
        for profile, role in combo_engines(copy.combo, copy.model):
            specs.append(
                AgentSpec(
                    f"engine-{self._next_id}",
                    profile,
                    self._free_port(),
                    self._host,
                    extra_args=(
                        *self._agent_args,
                        "--combo",
                        copy.label,
                        *(("--role", role) if role else ()),
                        "--drain-grace-s",
                        f"{self._drain_s:g}",
                    ),
                )
            )
            self._next_id += 1
        await self._fleet.add(specs)
        return [s.address for s in specs]

    async def release(self, label: str, addresses: Sequence[str]) -> None:
        await self._fleet.remove(addresses, grace_s=self._drain_s + 5.0)
