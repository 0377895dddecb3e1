"""`switchyard.child_process`: children started by vfork + exec from a uvloop process whose gRPC threads are
busy do not crash (with uvloop's fork-based spawn, 25 of 400 died with SIGSEGV in grpcio's atfork handlers),
and the process object reports exits and signals as asyncio's does."""

from __future__ import annotations

import asyncio
import signal
import sys

import grpc.aio
import pytest
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from switchyard.child_process import spawn

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


async def _spawn_while_grpc_is_busy(children: int) -> list[int]:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = health_pb2_grpc.HealthStub(channel)
    stop = asyncio.Event()

    async def pound() -> None:
        while not stop.is_set():
            await stub.Check(health_pb2.HealthCheckRequest(service=""))

    callers = [asyncio.create_task(pound()) for _ in range(8)]
    codes = []
    try:
        for _ in range(children):
            codes.append(await spawn(["/bin/true"]).wait())
    finally:
        stop.set()
        await asyncio.gather(*callers)
        await channel.close()
        await server.stop(None)
    return codes


def test_children_spawned_under_busy_grpc_do_not_crash() -> None:
    codes = uvloop.run(_spawn_while_grpc_is_busy(200))
    assert codes == [0] * 200


async def _statuses() -> tuple[int, int | None, int, int]:
    quick = spawn([sys.executable, "-c", "import sys; sys.exit(3)"])
    code = await quick.wait()
    sleeper = spawn([sys.executable, "-c", "import time; time.sleep(60)"])
    running = sleeper.returncode
    sleeper.terminate()
    waits = await asyncio.gather(sleeper.wait(), sleeper.wait())  # two waiters see the same exit
    assert waits[0] == waits[1]
    with pytest.raises(ProcessLookupError):
        sleeper.kill()
    return code, running, waits[0], await sleeper.wait()


def test_exit_status_signal_and_reaping() -> None:
    code, running, terminated, again = asyncio.run(_statuses())
    assert code == 3
    assert running is None
    assert terminated == again == -signal.SIGTERM
