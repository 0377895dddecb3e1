"""The gateway <-> agent link (docs/security.md): real sim agents with a bearer token, TLS and mutual TLS.

A throwaway CA and certificates are made at test time (`link_certs`). Three agents serve the module: one
asking for a token over plaintext, one with TLS and a token, one with mutual TLS. Each refuses callers
without the right credentials and serves those with them, over raw gRPC and through the gateway's client; a
gateway configured with the link settings serves a chat completion through two of them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio
import pytest
import pytest_asyncio
from agent_process import Agent
from grpc_health.v1 import health_pb2, health_pb2_grpc
from link_certs import LinkCerts, make_link_certs
from openai import AsyncOpenAI

from gateway.app import running
from gateway.config import EngineLinkConfig, GatewayConfig
from gateway.domain import EngineRequest, EngineUnavailable, Finished
from gateway.engines.grpc_client import GrpcEngineClient
from gateway.engines.grpc_link import load_engine_link
from switchyard.proto_gen import engine_agent_pb2 as pb
from switchyard.proto_gen import engine_agent_pb2_grpc as pb_grpc

# One event loop for the module: grpc.aio's poller outlives a test's loop and logs errors into the next one.
pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

TOKEN = "0123456789abcdef0123456789abcdef"
MODEL = "llama3-8b"
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


@dataclass(frozen=True)
class Link:
    certs: LinkCerts
    token_file: Path
    wrong_token_file: Path
    token_agent: Agent  # --auth-token-file, plaintext
    tls_agent: Agent  # --tls-cert/--tls-key and --auth-token-file
    mtls_agent: Agent  # --tls-cert/--tls-key/--tls-client-ca, no token

    def creds(self, *, client_cert: bool = False, ca: Path | None = None) -> grpc.ChannelCredentials:
        pair = self.certs.client
        return grpc.ssl_channel_credentials(
            (ca or self.certs.ca).read_bytes(),
            pair.key.read_bytes() if client_cert else None,
            pair.cert.read_bytes() if client_cert else None,
        )


@pytest.fixture(scope="module")
def link(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Link]:
    tmp = tmp_path_factory.mktemp("link")
    certs = make_link_certs(tmp / "certs")
    token_file = tmp / "token"
    token_file.write_text(f"  {TOKEN}\n")  # surrounding whitespace is stripped
    wrong = tmp / "wrong-token"
    wrong.write_text("not-the-token\n")
    server = ("--tls-cert", str(certs.server.cert), "--tls-key", str(certs.server.key))
    tls_creds = grpc.ssl_channel_credentials(certs.ca.read_bytes())
    mtls_creds = grpc.ssl_channel_credentials(
        certs.ca.read_bytes(), certs.client.key.read_bytes(), certs.client.cert.read_bytes()
    )
    agents: list[Agent] = []
    try:
        agents.append(Agent.start(tmp, "--auth-token-file", str(token_file)))
        agents.append(Agent.start(tmp, *server, "--auth-token-file", str(token_file), credentials=tls_creds))
        agents.append(Agent.start(tmp, *server, "--tls-client-ca", str(certs.ca), credentials=mtls_creds))
        yield Link(certs, token_file, wrong, *agents)
    finally:
        for agent in agents:
            assert agent.terminate() == 0, agent.log()


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


@pytest_asyncio.fixture(loop_scope="module")
async def token_stub(link: Link) -> AsyncIterator[pb_grpc.EngineAgentStub]:
    async with grpc.aio.insecure_channel(link.token_agent.target) as channel:
        yield pb_grpc.EngineAgentStub(channel)


def generate_request(rid: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        prompt_token_ids=pb.TokenIds(ids=[100, 200, 300]),
        sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True),
    )


async def refused(call: object) -> grpc.aio.AioRpcError:
    """The error a unary call or the first read of a streaming call ends with (the test fails without one)."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        if isinstance(call, grpc.aio.UnaryUnaryCall):
            await call
        else:
            assert isinstance(call, (grpc.aio.UnaryStreamCall, grpc.aio.StreamStreamCall))
            await call.read()
    return caught.value


# ---- the token ----


@pytest.mark.parametrize("metadata", [None, bearer("wrong"), (("authorization", TOKEN),)], ids=str)
async def test_token_agent_refuses_every_rpc_without_the_token(
    token_stub: pb_grpc.EngineAgentStub, metadata: tuple[tuple[str, str], ...] | None
) -> None:
    async def no_requests() -> AsyncIterator[pb.SessionUp]:
        await asyncio.sleep(10)
        yield pb.SessionUp()

    calls = [
        token_stub.GetInfo(pb.GetInfoRequest(), metadata=metadata, timeout=5),
        token_stub.WatchState(pb.WatchStateRequest(), metadata=metadata, timeout=5),
        token_stub.Generate(generate_request("no-token"), metadata=metadata, timeout=5),
        token_stub.Session(no_requests(), metadata=metadata, timeout=5),
        token_stub.Abort(pb.AbortRequest(request_id="x"), metadata=metadata, timeout=5),
        token_stub.MigrateOut(pb.MigrateOutRequest(request_id="x"), metadata=metadata, timeout=5),
        token_stub.MigrateIn(pb.MigrateInRequest(request_id="x"), metadata=metadata, timeout=5),
    ]
    for call in calls:
        error = await refused(call)
        assert error.code() == UNAUTHENTICATED, error
        assert "bearer token" in (error.details() or "")


async def test_token_agent_serves_the_right_token(token_stub: pb_grpc.EngineAgentStub) -> None:
    md = bearer(TOKEN)
    info = await token_stub.GetInfo(pb.GetInfoRequest(), metadata=md, timeout=5)
    assert info.identity.model == MODEL
    watch = token_stub.WatchState(pb.WatchStateRequest(interval_ms=20), metadata=md, timeout=5)
    state = await watch.read()
    assert isinstance(state, pb.EngineState) and state.ready
    watch.cancel()
    events = [e async for e in token_stub.Generate(generate_request("with-token"), metadata=md, timeout=5)]
    assert events[-1].finished.usage.completion_tokens == 3
    # "bearer" is case-insensitive (RFC 6750 schemes are).
    lower = (("authorization", f"bearer {TOKEN}"),)
    assert (await token_stub.GetInfo(pb.GetInfoRequest(), metadata=lower, timeout=5)).identity.model == MODEL


async def test_health_check_is_exempt_but_health_watch_is_not(link: Link) -> None:
    async with grpc.aio.insecure_channel(link.token_agent.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        error = await refused(health.Watch(health_pb2.HealthCheckRequest(), timeout=5))
        assert error.code() == UNAUTHENTICATED


def _request(rid: str) -> EngineRequest:
    return EngineRequest(
        request_id=rid, model="m", prompt_token_ids=(1, 2, 3), max_tokens=4, seed=1, ignore_eos=True
    )


async def _finish(client: GrpcEngineClient, rid: str) -> Finished:
    last = None
    async for event in client.generate(_request(rid)):
        last = event
    assert isinstance(last, Finished), last
    return last


@pytest.mark.parametrize("multiplex", [True, False], ids=["session", "per_request"])
async def test_gateway_client_sends_the_token_on_every_call(link: Link, multiplex: bool) -> None:
    engine_link = load_engine_link(EngineLinkConfig(auth_token_file=str(link.token_file)))
    client = GrpcEngineClient(link.token_agent.target, multiplex=multiplex, link=engine_link)
    try:
        assert (await client.describe()).model == MODEL
        reports = client.watch_state()
        assert (await anext(reports)).ready
        await reports.aclose()
        assert (await _finish(client, f"client-{multiplex}")).completion_tokens == 4
    finally:
        await client.close()


async def test_refused_gateway_client_logs_one_error_naming_the_engine(
    link: Link, caplog: pytest.LogCaptureFixture
) -> None:
    target = link.token_agent.target
    wrong_link = load_engine_link(EngineLinkConfig(auth_token_file=str(link.wrong_token_file)))
    wrong = GrpcEngineClient(target, link=wrong_link)
    none = GrpcEngineClient(target)
    per_request = GrpcEngineClient(target, multiplex=False, link=wrong_link)
    try:
        with caplog.at_level(logging.ERROR, logger="gateway.engines.grpc_client"):
            for _ in range(3):  # the cluster store retries with backoff: one error line, not one per retry
                with pytest.raises(EngineUnavailable, match=rf"engine {target} refused the gateway.*UNAUTH"):
                    await wrong.describe()
        errors = [r.getMessage() for r in caplog.records if r.name == "gateway.engines.grpc_client"]
        assert len(errors) == 1 and target in errors[0] and "auth_token_file" in errors[0], errors
        with pytest.raises(EngineUnavailable, match="UNAUTHENTICATED"):
            await anext(wrong.watch_state())
        with pytest.raises(EngineUnavailable, match="set engine_link.auth_token_file"):
            await none.describe()
        # Before the first event, so retryable elsewhere. On a Session call the status can read INTERNAL: the
        # grpc.aio client reports its first write racing the agent's refusal as an internal error.
        with pytest.raises(EngineUnavailable, match="UNAUTHENTICATED|INTERNAL"):
            await _finish(wrong, "refused-1")
        with pytest.raises(EngineUnavailable, match="UNAUTHENTICATED"):
            await _finish(per_request, "refused-2")
    finally:
        await wrong.close()
        await none.close()
        await per_request.close()


# ---- TLS and mutual TLS ----


async def _get_info(target: str, creds: grpc.ChannelCredentials | None, **options: str) -> pb.EngineInfo:
    channel = (
        grpc.aio.insecure_channel(target)
        if creds is None
        else grpc.aio.secure_channel(target, creds, options=list(options.items()))
    )
    async with channel:
        stub = pb_grpc.EngineAgentStub(channel)
        return await stub.GetInfo(pb.GetInfoRequest(), metadata=bearer(TOKEN), timeout=5)


async def test_tls_agent_refuses_plaintext_and_serves_tls(link: Link) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as plain:
        await _get_info(link.tls_agent.target, None)
    assert plain.value.code() == grpc.StatusCode.UNAVAILABLE
    assert (await _get_info(link.tls_agent.target, link.creds())).identity.model == MODEL
    with pytest.raises(grpc.aio.AioRpcError) as stranger:  # a client that does not trust the agent's CA
        await _get_info(link.tls_agent.target, link.creds(ca=link.certs.other_ca))
    assert "CERTIFICATE_VERIFY_FAILED" in (stranger.value.details() or "")


async def test_tls_server_name_override(link: Link) -> None:
    port = link.tls_agent.port
    base = {"tls": True, "tls_ca_file": str(link.certs.ca), "auth_token_file": str(link.token_file)}
    named = GrpcEngineClient(
        f"127.0.0.1:{port}", link=load_engine_link(EngineLinkConfig(**base, tls_server_name="agent.test"))
    )
    misnamed = GrpcEngineClient(
        f"127.0.0.1:{port}",
        connect_timeout_s=1.0,
        link=load_engine_link(EngineLinkConfig(**base, tls_server_name="other.test")),
    )
    try:
        assert (await named.describe()).model == MODEL
        with pytest.raises(EngineUnavailable, match=r"over TLS \(.*Hostname Verification"):
            await misnamed.describe()
    finally:
        await named.close()
        await misnamed.close()


async def test_gateway_client_names_the_tls_failure(link: Link) -> None:
    untrusting = GrpcEngineClient(
        link.tls_agent.target,
        connect_timeout_s=1.0,
        link=load_engine_link(EngineLinkConfig(tls=True, tls_ca_file=str(link.certs.other_ca))),
    )
    plaintext = GrpcEngineClient(link.tls_agent.target, connect_timeout_s=1.0)
    try:
        with pytest.raises(EngineUnavailable, match="over TLS.*CERTIFICATE_VERIFY_FAILED"):
            await untrusting.describe()
        with pytest.raises(EngineUnavailable, match="not reachable"):
            await plaintext.describe()
    finally:
        await untrusting.close()
        await plaintext.close()


async def test_mtls_agent_needs_a_client_certificate_from_its_ca(link: Link) -> None:
    target = link.mtls_agent.target
    with pytest.raises(grpc.aio.AioRpcError) as no_cert:
        await _get_info(target, link.creds())
    assert no_cert.value.code() == grpc.StatusCode.UNAVAILABLE
    stranger = grpc.ssl_channel_credentials(
        link.certs.ca.read_bytes(),
        link.certs.stranger.key.read_bytes(),
        link.certs.stranger.cert.read_bytes(),
    )
    with pytest.raises(grpc.aio.AioRpcError) as foreign:
        await _get_info(target, stranger)
    assert foreign.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.aio.AioRpcError):
        await _get_info(target, None)
    assert (await _get_info(target, link.creds(client_cert=True))).identity.model == MODEL


# ---- a whole gateway ----


async def test_gateway_serves_a_chat_completion_through_secured_agents(link: Link) -> None:
    certs = link.certs
    config = GatewayConfig(
        port=0,
        engines=(link.tls_agent.target, link.mtls_agent.target),
        engine_link=EngineLinkConfig(
            tls=True,
            tls_ca_file=str(certs.ca),
            tls_cert_file=str(certs.client.cert),
            tls_key_file=str(certs.client.key),
            auth_token_file=str(link.token_file),
        ),
        stale_after_s=2.0,
        drain_timeout_s=1.0,
    )
    async with (
        running(config, ready_engines=2) as base_url,
        AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0) as client,
    ):
        for _ in range(2):  # round robin: one through each agent
            reply = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Hello over TLS"}],
                max_tokens=5,
                extra_body={"ignore_eos": True},
            )
            assert reply.choices[0].message.content
            assert reply.usage is not None and reply.usage.completion_tokens == 5
