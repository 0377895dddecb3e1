"""The gRPC engine client against an in-process fake agent servicer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
import grpc.aio
import pytest

from gateway.domain import (
    Admitted,
    ChatTurn,
    Delta,
    EngineRequest,
    EngineRequestError,
    EngineStreamError,
    EngineUnavailable,
    Finished,
    QoEReport,
)
from gateway.engines.grpc_client import GrpcEngineClient, from_engine_state, to_generate_request
from switchyard.proto_gen import engine_agent_pb2 as pb
from switchyard.proto_gen import engine_agent_pb2_grpc as pb_grpc

IDENTITY = pb.EngineIdentity(engine_id="e0", model="m", backend="sim", profile="p", role="",
                             combo="1xh800+2xh20")


class FakeAgent(pb_grpc.EngineAgentServicer):
    def __init__(self) -> None:
        self.requests: list[pb.GenerateRequest] = []
        self.cancelled = asyncio.Event()
        self.aborted: list[str] = []

    async def Generate(  # noqa: N802 - the generated servicer's method name
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateEvent]:
        self.requests.append(request)
        if request.request_id == "bad":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens too large")
        if request.request_id == "down":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "draining")
        yield pb.GenerateEvent(admitted=pb.Admitted(prompt_tokens=3))
        yield pb.GenerateEvent(delta=pb.TokenDelta(token_ids=[5, 6], text="hi"))
        if request.request_id == "hang":
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        if request.request_id == "crash":
            await context.abort(grpc.StatusCode.INTERNAL, "boom")
        if request.request_id == "truncated":
            return
        yield pb.GenerateEvent(
            finished=pb.Finished(
                finish_reason="length",
                usage=pb.Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=1),
                timings=pb.EngineTimings(queue_s=0.5, prefill_s=0.25, decode_s=1.0),
            )
        )

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:  # noqa: N802
        self.aborted.append(request.request_id)
        return pb.AbortResponse(found=False)

    async def WatchState(  # noqa: N802
        self, request: pb.WatchStateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.EngineState]:
        for seq in (1, 2):  # the first without LENS (P_max 0 on the wire), the second with
            yield pb.EngineState(
                identity=IDENTITY,
                seq=seq,
                timestamp_s=10.0 + seq,
                ready=True,
                num_running=seq,
                kv_blocks_total=100,
                kv_blocks_free=60,
                lens=pb.LensState(
                    predicted_batch_latency_s=0.02, peak_throughput_tokens_per_s=(seq - 1) * 9e3
                ),
            )
        await context.abort(grpc.StatusCode.UNAVAILABLE, "agent stopping")

    async def GetInfo(self, request: pb.GetInfoRequest, context: grpc.aio.ServicerContext) -> pb.EngineInfo:  # noqa: N802
        return pb.EngineInfo(identity=IDENTITY, max_context_tokens=4096, block_size=16, max_num_seqs=64,
                             gpu="H20-NVL-96GB", tensor_parallel=2, hourly_price_usd=3.0)


@pytest.fixture
async def agent() -> AsyncIterator[tuple[FakeAgent, GrpcEngineClient]]:
    fake = FakeAgent()
    server = grpc.aio.server()
    pb_grpc.add_EngineAgentServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = GrpcEngineClient(f"127.0.0.1:{port}", connect_timeout_s=5.0)
    yield fake, client
    await client.close()
    await server.stop(grace=None)


def request(request_id: str) -> EngineRequest:
    return EngineRequest(request_id=request_id, model="m", prompt_text="hello", max_tokens=2)


async def test_generate_translates_events(agent: tuple[FakeAgent, GrpcEngineClient]) -> None:
    _, client = agent
    events = [e async for e in client.generate(request("ok"))]
    assert events == [
        Admitted(prompt_tokens=3),
        Delta(text="hi", token_ids=(5, 6), num_tokens=2),
        Finished("length", 3, 2, cached_tokens=1, queue_s=0.5, prefill_s=0.25, decode_s=1.0),
    ]


@pytest.mark.parametrize(
    ("request_id", "error", "events_before"),
    [
        ("bad", EngineRequestError, 0),
        ("down", EngineUnavailable, 0),
        ("crash", EngineStreamError, 2),
        ("truncated", EngineStreamError, 2),
    ],
)
async def test_generate_error_mapping(
    agent: tuple[FakeAgent, GrpcEngineClient], request_id: str, error: type[Exception], events_before: int
) -> None:
    _, client = agent
    seen = 0
    with pytest.raises(error):
        async for _ in client.generate(request(request_id)):
            seen += 1
    assert seen == events_before


async def test_closing_early_cancels_the_rpc(agent: tuple[FakeAgent, GrpcEngineClient]) -> None:
    fake, client = agent
    stream = client.generate(request("hang"))
    assert await anext(stream) == Admitted(prompt_tokens=3)
    await anext(stream)
    await stream.aclose()
    await asyncio.wait_for(fake.cancelled.wait(), 5.0)


async def test_unreachable_agent_is_unavailable() -> None:
    client = GrpcEngineClient("127.0.0.1:1", connect_timeout_s=0.2)
    try:
        with pytest.raises(EngineUnavailable):
            async for _ in client.generate(request("ok")):
                pass
        with pytest.raises(EngineUnavailable):
            await client.describe()
    finally:
        await client.close()


async def test_release_aborts_the_cut_id_and_never_raises(agent: tuple[FakeAgent, GrpcEngineClient]) -> None:
    fake, client = agent
    await client.release("cut-1")
    assert fake.aborted == ["cut-1"]
    gone = GrpcEngineClient("127.0.0.1:1", connect_timeout_s=0.2)
    try:
        await gone.release("cut-2")  # unreachable: logged, not raised (the agent's lease frees the KV)
    finally:
        await gone.close()


async def test_describe_and_watch(agent: tuple[FakeAgent, GrpcEngineClient]) -> None:
    fake, client = agent
    desc = await client.describe()
    assert (desc.engine_id, desc.model, desc.block_size, desc.max_num_seqs, desc.max_context_tokens) == (
        "e0",
        "m",
        16,
        64,
        4096,
    )
    assert (desc.gpu, desc.tensor_parallel, desc.hourly_price_usd) == ("H20-NVL-96GB", 2, 3.0)
    reports = []
    with pytest.raises(EngineUnavailable, match="agent stopping"):
        async for report in client.watch_state():
            reports.append(report)
    assert [(r.seq, r.engine_timestamp_s, r.num_running, r.kv_blocks_free) for r in reports] == [
        (1, 11.0, 1, 60),
        (2, 12.0, 2, 60),
    ]
    assert reports[0].lens is None and {r.combo for r in reports} == {"1xh800+2xh20"}
    assert reports[1].lens is not None and reports[1].lens.predicted_batch_latency_s == pytest.approx(0.02)
    assert reports[1].lens.peak_throughput_tokens_per_s == pytest.approx(9e3)


def test_request_translation() -> None:
    chat = EngineRequest(
        request_id="r",
        model="m",
        messages=(ChatTurn("user", "hi"),),
        seed=7,
        stop=("x",),
        slo_ttft_s=0.2,
        session_id="s",
    )
    message = to_generate_request(chat)
    assert message.WhichOneof("prompt") == "chat" and message.chat.add_generation_prompt
    assert (message.sampling.seed, list(message.sampling.stop), message.slo.ttft_ms, message.session_id) == (
        7,
        ["x"],
        200.0,
        "s",
    )
    ids = to_generate_request(EngineRequest(request_id="r", model="m", prompt_token_ids=(1, 2)))
    assert ids.WhichOneof("prompt") == "prompt_token_ids" and list(ids.prompt_token_ids.ids) == [1, 2]
    assert not ids.sampling.HasField("seed")
    with pytest.raises(EngineRequestError):
        to_generate_request(EngineRequest(request_id="r", model="m"))


def test_engine_state_carries_the_qoe_fit_and_pull_throughput_across_the_wire() -> None:
    """CascadeInfer: the agent's `proto_codec.engine_state` and this client's `from_engine_state`, the one
    translation (the simulator calls the same two)."""
    from engine_agent.domain import EngineStats, QoEFigures  # noqa: PLC0415 - the agent's half, for this test
    from engine_agent.proto_codec import engine_state  # noqa: PLC0415

    stats = EngineStats(timestamp_s=1.0, ready=True, draining=False, num_running=0, num_waiting=0,
                        num_preempted_total=0, kv_blocks_total=10, kv_blocks_free=10, kv_blocks_reserved=0,
                        pending_prefill_tokens=0, running_batch_tokens=0, last_iteration_s=0.0,
                        iterations_total=0)

    def over_the_wire(s: EngineStats) -> pb.EngineState:
        wire = engine_state(s, identity=IDENTITY, seq=1, draining=False, started=True)
        return pb.EngineState.FromString(wire.SerializeToString())

    d = (7e-3, 3.4e-5, 1.2e-7, 1.4e-12, 0.0)
    fitted = replace(stats, qoe=QoEFigures(d, 2000, 0.057), transfer_bytes_per_s=2.5e10)
    report = from_engine_state(over_the_wire(fitted))
    assert report.qoe == QoEReport(d=d, samples=2000, mean_relative_error=0.057)
    assert report.transfer_bytes_per_s == 2.5e10
    unfitted = over_the_wire(stats)
    assert not unfitted.HasField("qoe")
    report = from_engine_state(unfitted)
    assert (report.qoe, report.transfer_bytes_per_s) == (None, 0.0)
    unfitted.qoe.d.extend((1.0, 2.0))  # not Eq. 1's five coefficients: no fit
    assert from_engine_state(unfitted).qoe is None
