"""A fleet of simulated engine agents as local child processes (for `switchyard up` and integration tests).

Owns: spawning `python -m engine_agent --backend sim ...` children, waiting until each serves (grpc.health.v1
SERVING, while watching that the child has not exited), and stopping them (SIGTERM, wait, SIGKILL, always
reaped).
Must not: route or proxy requests, or leave a child running when its owner stops (callers use `LocalFleet` as
an async context manager or call `stop()` in a finally).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc


class FleetError(RuntimeError):
    """An agent could not be started (it exited, or did not serve in time)."""


@dataclass(frozen=True, slots=True)
class AgentSpec:
    engine_id: str
    profile: str
    port: int
    host: str = "127.0.0.1"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def plan_agents(
    count: int, profiles: Sequence[str], base_port: int, host: str = "127.0.0.1"
) -> list[AgentSpec]:
    """`count` agents on consecutive ports, profiles cycled (a heterogeneous fleet when several are given)."""
    if count < 1:
        raise ValueError("need at least one engine")
    if not profiles:
        raise ValueError("need at least one profile")
    if base_port < 1 or base_port + count - 1 > 65535:
        raise ValueError(f"ports {base_port}..{base_port + count - 1} are out of range")
    return [AgentSpec(f"engine-{i}", profiles[i % len(profiles)], base_port + i, host) for i in range(count)]


async def wait_serving(address: str, proc: asyncio.subprocess.Process | None, timeout_s: float) -> None:
    """Until the agent at `address` answers health SERVING; FleetError if `proc` exits or time runs out."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc is not None and proc.returncode is not None:
                raise FleetError(f"agent at {address} exited with status {proc.returncode} before serving")
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=0.5)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if loop.time() >= deadline:
                raise FleetError(f"agent at {address} did not serve within {timeout_s:g} s")
            await asyncio.sleep(0.1)


async def terminate(proc: asyncio.subprocess.Process, grace_s: float) -> int:
    """SIGTERM, wait up to `grace_s`, then SIGKILL; always reaped. Returns the exit status."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), grace_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
    return await proc.wait()


class LocalFleet:
    """Child agent processes; `async with LocalFleet(specs) as fleet:` starts them all and waits until they
    serve."""

    def __init__(
        self,
        specs: Sequence[AgentSpec],
        *,
        python: str = sys.executable,
        agent_log_level: str = "WARNING",
        start_timeout_s: float = 60.0,
        stop_grace_s: float = 10.0,
    ) -> None:
        self.specs = list(specs)
        self._python = python
        self._log_level = agent_log_level
        self._start_timeout_s = start_timeout_s
        self._stop_grace_s = stop_grace_s
        self.processes: dict[str, asyncio.subprocess.Process] = {}

    async def start(self) -> None:
        for spec in self.specs:
            self.processes[spec.engine_id] = await self.spawn(spec)
        await asyncio.gather(
            *(wait_serving(s.address, self.processes[s.engine_id], self._start_timeout_s) for s in self.specs)
        )

    async def spawn(self, spec: AgentSpec) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            self._python,
            "-m",
            "engine_agent",
            "--backend",
            "sim",
            "--profile",
            spec.profile,
            "--host",
            spec.host,
            "--port",
            str(spec.port),
            "--engine-id",
            spec.engine_id,
            "--log-level",
            self._log_level,
            stdin=asyncio.subprocess.DEVNULL,
        )

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
