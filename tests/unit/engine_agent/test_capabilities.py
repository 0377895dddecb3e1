"""Optional backend capabilities: decided once at start-up; the RPCs of an absent one answer UNIMPLEMENTED."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from engine_agent.backends.base import (
    HIDDEN_STATES,
    KV_EVENTS,
    MIGRATION,
    Capabilities,
    EngineBackend,
    HiddenStateSource,
    KvEventSource,
    Migrator,
)
from engine_agent.backends.sim import SimBackend
from engine_agent.config import AgentConfig, VllmConfig
from engine_agent.domain import BackendEvent, BackendRequest, EngineStatic, EngineStats, RequestId
from engine_agent.server import backend_capabilities
from engine_agent.service import AgentService
from engine_agent.tokenization import Tokenizer
from switchyard.clock import MonotonicClock
from switchyard.profiles import get_profile
from switchyard.proto_gen import engine_agent_pb2 as pb
from switchyard.proto_gen import engine_agent_pb2_grpc as pb_grpc

PROFILE = get_profile("h100-llama3-8b")


def sim_backend(*, hidden_state_interval: int | None = 20) -> SimBackend:
    tokenizer = Tokenizer.load_sim()
    return SimBackend(PROFILE, clock=MonotonicClock(), engine_id="cap-0", vocab_size=tokenizer.vocab_size,
                      eos_token_id=tokenizer.eos_token_id, hidden_state_interval=hidden_state_interval)


class CoreOnly:
    """An `EngineBackend` with no optional capability: the sim backend's core, nothing else."""

    def __init__(self, inner: SimBackend) -> None:
        self._inner = inner

    @property
    def static(self) -> EngineStatic:
        return self._inner.static

    @property
    def eos_token_id(self) -> int:
        return self._inner.eos_token_id

    async def start(self) -> None:
        await self._inner.start()

    async def stop(self) -> None:
        await self._inner.stop()

    def generate(self, request: BackendRequest) -> AsyncIterator[BackendEvent]:
        return self._inner.generate(request)

    async def abort(self, request_id: RequestId) -> bool:
        return await self._inner.abort(request_id)

    def stats(self) -> EngineStats:
        return self._inner.stats()

    async def wait_for_change(self, after_version: int, timeout_s: float) -> int:
        return await self._inner.wait_for_change(after_version, timeout_s)


def test_the_sim_backend_has_every_capability_and_a_core_only_backend_none() -> None:
    backend = sim_backend()
    assert isinstance(backend, Migrator) and isinstance(backend, HiddenStateSource)
    assert isinstance(backend, KvEventSource)
    caps = Capabilities.of(backend)
    assert caps.migrator is backend and caps.hidden_state_source is backend
    assert caps.kv_event_source is backend
    assert caps.names == (MIGRATION, HIDDEN_STATES, KV_EVENTS)

    core: EngineBackend = CoreOnly(backend)
    assert not isinstance(core, Migrator) and not isinstance(core, HiddenStateSource)
    none = Capabilities.of(core)
    assert none.migrator is None and none.hidden_state_source is None and none.names == ()
    assert none.missing(MIGRATION) == (
        "this engine does not offer the migration capability: the sim backend lacks it"
    )


def test_switched_off_capabilities_are_absent_with_the_reason() -> None:
    backend = sim_backend(hidden_state_interval=None)
    caps = Capabilities.of(backend, switched_off={MIGRATION: "--no-migration", KV_EVENTS: "test"})
    assert caps.migrator is None and caps.hidden_state_source is None and caps.kv_event_source is None
    assert caps.names == ()
    assert caps.missing(MIGRATION) == (
        "this engine does not offer the migration capability: it is switched off (--no-migration)"
    )
    assert "hidden-states capability" in caps.missing(HIDDEN_STATES)


@pytest.mark.parametrize(
    ("config", "migration"),
    [
        (AgentConfig(), True),
        (AgentConfig(backend="vllm", model_dir="m"), True),
        (AgentConfig(backend="vllm", model_dir="m", vllm=VllmConfig(enable_migration=False)), False),
    ],
)
def test_no_migration_switches_the_capability_off(config: AgentConfig, migration: bool) -> None:
    backend = sim_backend()  # the rule only reads the config and what the backend implements
    assert (backend_capabilities(config, backend).migrator is not None) == migration


@pytest.fixture
async def serve_backend() -> AsyncIterator[object]:
    """Serve a backend over loopback gRPC: `await start(backend, capabilities)` gives a stub."""
    servers: list[grpc.aio.Server] = []
    channels: list[grpc.aio.Channel] = []
    backends: list[EngineBackend] = []

    async def start(backend: EngineBackend, capabilities: Capabilities | None) -> pb_grpc.EngineAgentStub:
        service = AgentService(backend, Tokenizer.load_sim(), clock=MonotonicClock(), state_interval_s=0.05,
                               capabilities=capabilities)
        server = grpc.aio.server()
        pb_grpc.add_EngineAgentServicer_to_server(service, server)  # type: ignore[no-untyped-call]
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        await backend.start()
        service.mark_started()
        servers.append(server)
        backends.append(backend)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        channels.append(channel)
        return pb_grpc.EngineAgentStub(channel)

    yield start
    for channel in channels:
        await channel.close()
    for server in servers:
        await server.stop(None)
    for backend in backends:
        await backend.stop()


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda: (CoreOnly(sim_backend()), None), "the sim backend lacks it"),
        (lambda: (sim_backend(), {MIGRATION: "--no-migration"}), "it is switched off (--no-migration)"),
    ],
    ids=["not-implemented", "switched-off"],
)
async def test_migration_rpcs_without_the_capability_answer_unimplemented(
    serve_backend, make, reason: str  # type: ignore[no-untyped-def]
) -> None:
    backend, switched_off = make()
    stub = await serve_backend(backend, Capabilities.of(backend, switched_off=switched_off))
    # A running request: the refusal is about the engine, not the request.
    stream = stub.Generate(pb.GenerateRequest(
        request_id="r", prompt_token_ids=pb.TokenIds(ids=[100, 200, 300]),
        sampling=pb.SamplingParams(max_tokens=2000, ignore_eos=True),
    ))
    assert (await stream.read()).WhichOneof("event") == "admitted"
    with pytest.raises(grpc.aio.AioRpcError) as out:
        await stub.MigrateOut(pb.MigrateOutRequest(request_id="r", target="elsewhere"))
    assert out.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert out.value.details() == f"this engine does not offer the migration capability: {reason}"
    with pytest.raises(grpc.aio.AioRpcError) as into:
        async for _ in stub.MigrateIn(pb.MigrateInRequest(ticket=pb.MigrationTicket(request_id="x"))):
            pass
    assert into.value.code() == grpc.StatusCode.UNIMPLEMENTED and "migration capability" in (
        into.value.details() or ""
    )
    stream.cancel()
