"""The engine agent's configuration: one typed, frozen tree (pydantic v2), unknown keys rejected.

Owns: the fields an agent process starts from and their defaults and bounds.
Must not: read the environment or files, look profiles up (the CLI does, to list the known ones), or rewrite
values.

"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class AgentConfig(BaseModel):
    """Everything `engine_agent.server.serve` needs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = Field(default="127.0.0.1", min_length=1)
    port: int = Field(default=50051, ge=0, le=65535)  # 0 = any free port (logged at start)
    engine_id: str = Field(default="sim-0", min_length=1)
    backend: Literal["sim"] = "sim"
    profile: str = Field(default="h100-llama3-8b", min_length=1)
    state_interval_ms: int = Field(default=50, ge=1, le=60_000)
    drain_grace_s: float = Field(default=30.0, ge=0.0)
    seed: int = 0
    role: str = ""  # "" (generic), "prefill", "decode", "stage-0", "cascade-small", ...
    model: str | None = Field(default=None, min_length=1)  # reported model name; None = the profile's model

    @property
    def bind_address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.port}"
