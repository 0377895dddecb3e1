"""The processes under test: sim engine agents and one gateway, as children of the harness.

Owns: starting agents (`python -m engine_agent --backend sim`, output to a log file, waiting for health
SERVING with `launcher.local_fleet.wait_serving`), killing one (SIGKILL, reaped) and starting it again on the
same port and engine id, stalling one (SIGSTOP ... SIGCONT: its sockets stay open, nothing is emitted), the
gateway (`python -m gateway --engine ...`, waiting until /health counts every engine ready), stopping
everything, and reading what the harness measures of them: an agent's own state (its first WatchState report:
running, waiting, free KV blocks), the gateway's /metrics, and a process's RSS and open file descriptors from
/proc.
Must not: decide when to fault (`benchmarks.chaos.faults`) or send inference requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from gateway.engines.grpc_client import GrpcEngineClient
from launcher.local_fleet import terminate, wait_serving

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _spawn(
    args: list[str], log_path: Path, env: dict[str, str] | None = None
) -> asyncio.subprocess.Process:
    with log_path.open("ab") as log:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            *args,
            cwd=REPO,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env=None if env is None else {**os.environ, **env},
        )


class AgentProc:
    """One sim agent; `start` again after `kill` reuses its port and engine id (the gateway reconnects)."""

    def __init__(self, index: int, profile: str, log_dir: Path, extra_args: tuple[str, ...] = ()) -> None:
        self.index = index
        self.port = free_port()
        self.engine_id = f"chaos-{index}"
        self.address = f"127.0.0.1:{self.port}"
        self.profile = profile
        self.log_path = log_dir / f"agent-{index}.log"
        self.extra_args = extra_args
        self.proc: asyncio.subprocess.Process | None = None
        self.stopped = False  # SIGSTOPped
        self.starts = 0

    @property
    def up(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def start(self, timeout_s: float = 60.0) -> None:
        self.starts += 1
        self.proc = await _spawn(
            [
                "-m",
                "engine_agent",
                "--backend",
                "sim",
                "--profile",
                self.profile,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--engine-id",
                self.engine_id,
                "--log-level",
                "WARNING",
                *self.extra_args,
            ],
            self.log_path,
        )
        await wait_serving(self.address, self.proc, timeout_s)

    async def kill(self) -> None:
        """SIGKILL and reap (a stopped agent dies too)."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGKILL)
            await self.proc.wait()
        self.stopped = False

    def stall(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGSTOP)
            self.stopped = True

    def resume(self) -> None:
        if self.proc is not None and self.proc.returncode is None and self.stopped:
            self.proc.send_signal(signal.SIGCONT)
        self.stopped = False

    async def stop(self) -> None:
        self.resume()
        if self.proc is not None:
            await terminate(self.proc, 5.0)


class GatewayProc:
    def __init__(
        self,
        log_dir: Path,
        engines: list[str],
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        trace: tuple[int, Path] | None = None,
    ) -> None:
        """`trace`: (frames, report path) runs the gateway under benchmarks/traced_gateway.py (SIGUSR1:
        snapshot; the first is the baseline, later ones write the growth since it to the report)."""
        self.port = free_port()
        self.env = env or {}
        self.trace = trace
        self.url = f"http://127.0.0.1:{self.port}"
        self.engines = engines
        self.extra_args = extra_args
        self.log_path = log_dir / "gateway.log"
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    async def start(self, timeout_s: float = 60.0) -> None:
        args = ["-m", "gateway"]
        if self.trace is not None:
            frames, report = self.trace
            args = [
                "-X",
                f"tracemalloc={frames}",
                str(REPO / "benchmarks" / "traced_gateway.py"),
                str(report),
            ]
        args += ["--host", "127.0.0.1", "--port", str(self.port), "--log-level", "INFO"]
        for engine in self.engines:
            args += ["--engine", engine]
        self.proc = await _spawn([*args, *self.extra_args], self.log_path, self.env)
        await self.wait_ready(len(self.engines), timeout_s)

    async def wait_ready(self, engines: int, timeout_s: float) -> None:
        """Until /health says `engines` engines are ready (RuntimeError if the gateway exits or time runs
        out)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        async with aiohttp.ClientSession() as session:
            while True:
                if self.proc is None or self.proc.returncode is not None:
                    raise RuntimeError(f"gateway exited before ready; see {self.log_path}")
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    async with session.get(f"{self.url}/health", timeout=aiohttp.ClientTimeout(total=1)) as r:
                        if (await r.json()).get("engines_ready", 0) >= engines:
                            return
                if loop.time() >= deadline:
                    raise RuntimeError(f"gateway not ready with {engines} engines within {timeout_s:g} s")
                await asyncio.sleep(0.1)

    async def metrics(self) -> dict[str, float]:
        """The gateway's /metrics as {"name{labels}": value} (samples without labels keyed by name)."""
        async with aiohttp.ClientSession() as session, session.get(f"{self.url}/metrics") as r:
            text = await r.text()
        samples: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                with contextlib.suppress(ValueError):
                    samples[key] = float(value)
        return samples

    def snapshot_memory(self) -> None:
        """Ask a traced gateway for a tracemalloc snapshot (no-op when not traced)."""
        if self.trace is not None and self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGUSR1)

    async def stop(self) -> int | None:
        if self.proc is None:
            return None
        return await terminate(self.proc, 10.0)


@dataclass(frozen=True, slots=True)
class AgentState:
    address: str
    num_running: int
    num_waiting: int
    kv_blocks_free: int
    kv_blocks_total: int
    kv_blocks_reserved: int

    @property
    def idle(self) -> bool:
        return (
            self.num_running == 0
            and self.num_waiting == 0
            and self.kv_blocks_reserved == 0
            and self.kv_blocks_free == self.kv_blocks_total
        )


async def agent_state(address: str, timeout_s: float = 5.0) -> AgentState:
    """The agent's own figures: its first WatchState report."""
    client = GrpcEngineClient(address, connect_timeout_s=timeout_s)
    try:
        reports = client.watch_state()
        try:
            report = await asyncio.wait_for(anext(reports), timeout_s)
        finally:
            await reports.aclose()  # type: ignore[attr-defined]
    finally:
        await client.close()
    return AgentState(
        address,
        report.num_running,
        report.num_waiting,
        report.kv_blocks_free,
        report.kv_blocks_total,
        report.kv_blocks_reserved,
    )


def rss_and_fds(pid: int) -> tuple[int, int]:
    """(VmRSS in bytes, open file descriptors) of a live process, from /proc."""
    rss = 0
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
                break
    return rss, len(os.listdir(f"/proc/{pid}/fd"))
