"""Engine agents as child processes: waiting until one serves, and stopping one.

Owns: `wait_serving` (grpc.health.v1 SERVING, while watching that the child has not exited) and `terminate`
(SIGTERM, wait, SIGKILL, always reaped), for whoever starts agents as children: the launcher's local fleet
(`switchyard up`, tests) and `switchyard predictor collect`. `AgentProcessError` says why a child did not
serve.
Must not: spawn agents or choose their flags (the callers do), or route requests.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from switchyard.child_process import ChildProcess

# What these functions watch and stop: ours (vfork-spawned) or asyncio's own process object.
Child = ChildProcess | asyncio.subprocess.Process


class AgentProcessError(RuntimeError):
    """An agent child could not be started: it exited, or did not serve in time."""


async def wait_serving(address: str, proc: Child | None, timeout_s: float) -> None:
    """Until the agent at `address` answers health SERVING; `AgentProcessError` if `proc` exits or time runs
    out."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc is not None and proc.returncode is not None:
                raise AgentProcessError(
                    f"agent at {address} exited with status {proc.returncode} before serving"
                )
            with contextlib.suppress(grpc.aio.AioRpcError):
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=0.5)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            if loop.time() >= deadline:
                raise AgentProcessError(f"agent at {address} did not serve within {timeout_s:g} s")
            await asyncio.sleep(0.1)


async def terminate(proc: Child, grace_s: float) -> int:
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
