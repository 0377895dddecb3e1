"""An agent listens before its backend runs (health checks answer NOT_SERVING meanwhile): until the server
marks the service started it reports not ready on WatchState and refuses Generate as UNAVAILABLE (retryable
elsewhere), never as an engine failure."""

from __future__ import annotations

import grpc

from engine_agent.backends.sim import SimBackend
from engine_agent.service import AgentService
from engine_agent.tokenization import Tokenizer
from switchyard.clock import MonotonicClock
from switchyard.profiles import get_profile
from switchyard.proto_gen import engine_agent_pb2 as pb
from switchyard.proto_gen import engine_agent_pb2_grpc as pb_grpc


async def test_not_ready_and_refusing_until_started() -> None:
    tokenizer = Tokenizer.load_sim()
    backend = SimBackend(get_profile("h100-llama3-8b"), clock=MonotonicClock(), engine_id="st-0",
                         vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eos_token_id)
    service = AgentService(backend, tokenizer, clock=MonotonicClock(), state_interval_s=0.02)
    server = grpc.aio.server()
    pb_grpc.add_EngineAgentServicer_to_server(service, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.EngineAgentStub(channel)
    request = pb.GenerateRequest(request_id="r", prompt_token_ids=pb.TokenIds(ids=[100, 200]),
                                 sampling=pb.SamplingParams(max_tokens=2, ignore_eos=True))
    try:
        watch = stub.WatchState(pb.WatchStateRequest())
        assert not (await watch.read()).ready
        try:
            async for _ in stub.Generate(request):
                raise AssertionError("a stream opened before the backend started")
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE
            assert "starting" in (exc.details() or "")
        await backend.start()
        service.mark_started()
        while not (await watch.read()).ready:
            pass
        kinds = [event.WhichOneof("event") async for event in stub.Generate(request)]
        assert kinds[0] == "admitted" and kinds[-1] == "finished"
        watch.cancel()
    finally:
        await channel.close()
        await server.stop(None)
        await backend.stop()
