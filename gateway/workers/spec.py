"""What the supervisor hands a worker process, and the names both derive from it.

Owns: `WorkerSpec` (the worker's index and the worker count, the supervisor's run directory, the listening
socket's inherited file descriptor when the supervisor bound it, and the effective `GatewayConfig`, used as
is: no file or environment is read again in the worker), written as JSON to `worker-<i>.json` in the run
directory; the private metrics socket path of each worker (`worker-<i>.sock`), from which siblings fetch its
own exposition; the response header naming the worker that served (`x-switchyard-worker`); the line a worker
writes to its supervisor once it listens (`LISTENING`).
Must not: start, signal or wait for processes (`supervisor.py` does), or serve (`worker.py` does).
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.config import ConfigError, GatewayConfig

WORKER_HEADER = "x-switchyard-worker"
LISTENING = "switchyard-worker-listening"  # a worker's stdout line to its supervisor: `LISTENING <url>`


class WorkerSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    index: int = Field(ge=0)
    count: int = Field(ge=2)
    run_dir: str
    # The listening socket the supervisor bound (no SO_REUSEPORT); None: bind host:port with SO_REUSEPORT.
    listen_fd: int | None = None
    config: GatewayConfig

    def metrics_socket(self, index: int | None = None) -> str:
        """The private metrics endpoint of worker `index` (default: this one)."""
        return metrics_socket(self.run_dir, self.index if index is None else index)

    def sibling_sockets(self) -> dict[int, str]:
        return {i: self.metrics_socket(i) for i in range(self.count) if i != self.index}


def metrics_socket(run_dir: str, index: int) -> str:
    return os.path.join(run_dir, f"worker-{index}.sock")


def spec_path(run_dir: str, index: int) -> Path:
    return Path(run_dir) / f"worker-{index}.json"


def write_spec(spec: WorkerSpec) -> Path:
    path = spec_path(spec.run_dir, spec.index)
    path.write_text(spec.model_dump_json(), encoding="utf-8")
    return path


def read_spec(path: str | Path) -> WorkerSpec:
    try:
        return WorkerSpec.model_validate_json(Path(path).read_bytes())
    except OSError as e:
        raise ConfigError(f"cannot read worker spec {path}: {e.strerror}") from e
    except ValidationError as e:
        raise ConfigError(f"worker spec {path}: {e}") from e
