"""The engine agent's configuration: one typed, frozen tree (pydantic v2), unknown keys rejected.

Owns: the fields an agent process starts from and their defaults and bounds. Times are seconds and "off" is
None here; the command line's milliseconds and 0s are translated by `engine_agent.__main__`.
Must not: read the environment or files, look profiles up (the CLI does, to list the known ones), or rewrite
values.

"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

ORACLE = "oracle"  # `length_predictor`: the sim engine's exact remaining lengths instead of a predictor file


class LinkSecurityConfig(BaseModel):
    """Who may call this agent (the gateway <-> agent link; docs/security.md): paths of PEM files and of a
    file holding the bearer token, read at start by `engine_agent.link_security`. All None = open."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tls_cert_file: str | None = Field(default=None, min_length=1)  # the agent's certificate (chain), PEM
    tls_key_file: str | None = Field(default=None, min_length=1)  # its private key, PEM
    # Given: callers must present a certificate signed by this CA (mutual TLS).
    tls_client_ca_file: str | None = Field(default=None, min_length=1)
    # Given: every RPC but grpc.health.v1 Check needs `authorization: Bearer <the file's token>`.
    auth_token_file: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _tls_files_together(self) -> LinkSecurityConfig:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            given, missing = (
                ("--tls-key", "--tls-cert") if self.tls_cert_file is None else ("--tls-cert", "--tls-key")
            )
            raise ValueError(f"{given} needs {missing} too")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
        return self

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None

    @property
    def mutual_tls(self) -> bool:
        return self.tls_client_ca_file is not None


class VllmConfig(BaseModel):
    """Settings of the embedded vLLM engine (`--backend vllm`); unused by the sim backend."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_model_len: int | None = Field(default=None, ge=16)  # None = the model's own limit
    max_num_seqs: int = Field(default=64, ge=1)
    max_num_batched_tokens: int | None = Field(default=None, ge=16)
    block_size: int | None = Field(
        default=None, ge=1
    )  # None = the platform default (CPU needs 32's multiples)
    dtype: str = "auto"
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0)
    cpu_kv_cache_gb: float = Field(default=1.0, gt=0.0)  # VLLM_CPU_KVCACHE_SPACE on the CPU platform
    enforce_eager: bool = False
    # CPU platform: cores for torch's OpenMP threads (VLLM_CPU_OMP_THREADS_BIND); None = all but the last when
    # migration is on (vLLM's NIXL worker moves OpenMP's master thread there; see `default_omp_bind`), else
    # vLLM's default.
    cpu_omp_threads_bind: str | None = None
    tensor_parallel_size: int = Field(default=1, ge=1)
    # KV migration over NIXL (NixlConnector, pull): the side channel this engine serves its metadata on.
    enable_migration: bool = True
    # vLLM's prefix caching, and its KV events as the gateway's index keys (the `kv-events` capability).
    enable_prefix_caching: bool = True
    nixl_side_channel_host: str = "127.0.0.1"
    nixl_side_channel_port: int | None = Field(default=None, ge=1, le=65535)  # None = agent port + 1000
    # UCX worker threads for NIXL; None = 0 (UCX default) on the CPU platform, vLLM's 4 on GPUs. Measured on 2
    # cores: a decode step of the tiny model took 3.2 ms with 0, 5.1 ms with 1.
    nixl_num_threads: int | None = Field(default=None, ge=0)
    # NIXL's UCX progress thread. NIXL 1.5.1 runs it with a 0 ms poll timeout: it keeps a core at 100 % even
    # when the agent is idle. Off, UCX progresses in the calls vLLM makes each engine step during a transfer.
    nixl_progress_thread: bool = False
    # The lease on a cut request's KV (`--migration-kv-lease-s`): how long the source holds it for its
    # target to pull (NixlConnector's `decoder_kv_blocks_ttl`; NIXL's default: 480 s). The sim frees it at
    # the cut.
    migration_kv_lease_s: float = Field(default=30.0, gt=0.0)


class AgentConfig(BaseModel):
    """Everything `engine_agent.server.serve` needs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = Field(default="127.0.0.1", min_length=1)
    port: int = Field(default=50051, ge=0, le=65535)  # 0 = any free port (logged at start)
    engine_id: str = Field(default="sim-0", min_length=1)
    backend: Literal["sim", "vllm"] = "sim"
    profile: str = Field(default="h100-llama3-8b", min_length=1)
    state_interval_s: float = Field(default=0.05, ge=0.001, le=60.0)  # WatchState's push interval
    drain_grace_s: float = Field(default=30.0, ge=0.0)
    seed: int = 0
    role: str = ""  # "" (generic), "prefill", "decode", "stage-0", "cascade-small", ...
    combo: str = ""  # the GPU combo this engine belongs to (CAUCHY's plans: `switchyard plan`); "" = none
    model: str | None = Field(default=None, min_length=1)  # reported model name; None = the profile's model
    # vLLM: the HF model directory to serve (a real model or `switchyard tiny-model --out DIR`).
    model_dir: str | None = Field(default=None, min_length=1)
    vllm: VllmConfig = Field(default_factory=VllmConfig)
    # LENS (NexusSched §4): the latency model and the state vector always run; this turns on Algorithm 1's
    # per-iteration token budget (off = the backend's static budget, the ablation baseline).
    lens_planning: bool = False
    # BLAS threads for the agent's own numpy work (LENS refits, the STAR length predictor). The engine's
    # processes are not affected. More than 1 lets OpenBLAS's spinning workers take cores from the engine.
    blas_threads: int = Field(default=1, ge=1)
    # Hidden-state tap (STAR §5.3): every this many decode steps; None = off.
    hidden_state_interval: int | None = Field(default=20, ge=1)
    # STAR §4.4: record the tap's samples, labelled with each request's remaining length, as shards in this
    # directory (`engine_agent.star.recorder`); None = off. Needs the tap (`hidden_state_interval`).
    record_hidden_states: str | None = Field(default=None, min_length=1)
    # STAR §4-5 in the agent (`engine_agent.star.live`): predict each running request's remaining length from
    # the tap with this predictor file (`switchyard predictor train`), or "oracle" (sim only: the simulated
    # engine's decided lengths), and send each round's predictions and H-round future load; None = off.
    length_predictor: str | None = Field(default=None, min_length=1)
    # Without a predictor: still send, every k engine iterations, each running request's current length N(r)
    # (and the current load held over the horizon), for the gateway's `--reschedule star-nopred`.
    star_report: bool = False
    # Sim backend: modelled KV transfer for migration (bytes / bandwidth + a fixed latency).
    # Gbit/s, like the rescheduler's and the simulator's kv_link_gbps; 200 = one 200 Gb/s NIC
    sim_kv_link_gbps: float = Field(default=200.0, gt=0.0)
    sim_kv_transfer_latency_s: float = Field(default=0.002, ge=0.0)
    # Sim backend: the batch's sequence cap; None = the profile's (256).
    sim_max_num_seqs: int | None = Field(default=None, ge=1)
    link: LinkSecurityConfig = Field(default_factory=LinkSecurityConfig)  # open by default

    @model_validator(mode="after")
    def _recording_needs_the_tap(self) -> AgentConfig:
        if self.record_hidden_states is not None and self.hidden_state_interval is None:
            raise ValueError(
                "--record-hidden-states needs the hidden-state tap (--hidden-state-interval > 0)"
            )
        return self

    @model_validator(mode="after")
    def _predictor_needs_the_tap(self) -> AgentConfig:
        if self.length_predictor is None:
            return self
        if self.hidden_state_interval is None:
            raise ValueError("--length-predictor needs the hidden-state tap (--hidden-state-interval > 0)")
        if self.length_predictor == ORACLE and self.backend != "sim":
            raise ValueError(
                "--length-predictor oracle needs the sim backend (it reads the simulated engine's decided "
                "output lengths); give a predictor file (switchyard predictor train) for vllm"
            )
        return self

    @property
    def star_rounds(self) -> bool:
        """Whether the agent sends STAR rounds (predicted with `length_predictor`, else current lengths)."""
        return self.length_predictor is not None or self.star_report

    @property
    def bind_address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.port}"
