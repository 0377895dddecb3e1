"""Test helper: an engine agent subprocess on a free loopback port (shared by integration tests)."""

from __future__ import annotations

import contextlib
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
PROFILE = "h100-llama3-8b"  # the fastest simulated iterations (~7 ms per decode step)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Agent:
    """One agent subprocess; its stdout and stderr go to `log_path`."""

    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    target: str = field(init=False)

    def __post_init__(self) -> None:
        self.target = f"127.0.0.1:{self.port}"

    @classmethod
    def start(
        cls,
        tmp: Path,
        *extra: str,
        profile: str = PROFILE,
        credentials: grpc.ChannelCredentials | None = None,
        env: dict[str, str] | None = None,
    ) -> Agent:
        """Start `python -m engine_agent --backend sim` on a free loopback port; returns once SERVING.
        `credentials`: how the health probe connects (an agent with --tls-cert); `env`: the agent's whole
        environment (default: this process's)."""
        port = free_port()
        log_path = tmp / f"agent-{port}.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "engine_agent",
                    "--backend",
                    "sim",
                    "--profile",
                    profile,
                    "--port",
                    str(port),
                    "--engine-id",
                    f"it-{port}",
                    *extra,
                ],
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        agent = cls(port, proc, log_path)
        agent.wait_serving(credentials=credentials)
        return agent

    def wait_serving(
        self, timeout_s: float = 30.0, *, credentials: grpc.ChannelCredentials | None = None
    ) -> None:
        deadline = time.monotonic() + timeout_s
        with (
            grpc.insecure_channel(self.target)
            if credentials is None
            else grpc.secure_channel(self.target, credentials)
        ) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"agent exited with {self.proc.returncode}: {self.log()}")
                try:
                    if (
                        stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
                        == health_pb2.HealthCheckResponse.SERVING
                    ):
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.05)
        raise TimeoutError(f"agent on {self.target} not SERVING after {timeout_s}s: {self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def loop_lag_line(self) -> str:
        match = re.search(r"engine loop stopped: .*", self.log())
        return match.group(0) if match else "(no loop summary)"


def story_request(max_tokens: int, seed: int, model: str = "llama3-8b") -> dict[str, object]:
    """A seeded sampled chat request long enough to stream for a while (the sim carries the seed's
    generator across migrations and hand-offs, so its text is reproducible byte for byte)."""
    return {"model": model, "messages": [{"role": "user", "content": "tell me a long story " * 20}],
            "max_tokens": max_tokens, "seed": seed, "temperature": 1.0}


@contextlib.contextmanager
def cascade_pools(tmp: Path) -> Iterator[tuple[Agent, Agent]]:
    """A cascade's two pools: an h100-llama3-8b and an h100x4-llama3-70b agent (state every 20 ms); both
    are stopped, and must exit cleanly, when the block ends."""
    small = Agent.start(tmp, "--state-interval-ms", "20", profile="h100-llama3-8b")
    large = Agent.start(tmp, "--state-interval-ms", "20", profile="h100x4-llama3-70b")
    try:
        yield small, large
    finally:
        for agent in (small, large):
            agent.proc.send_signal(signal.SIGCONT)
            assert agent.terminate() == 0, agent.log()
