"""Requests multiplexed on one `Session` call to a real agent process (sim backend), via the gateway's client.

Every token exactly once and in order, against the same requests sent one `Generate` call each; cancellation,
a slow consumer, admission errors, draining and an agent that dies mid-stream.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from agent_process import Agent

from gateway.domain import (
    Admitted,
    Delta,
    EngineEvent,
    EngineRequest,
    EngineRequestError,
    EngineStreamError,
    EngineUnavailable,
    Finished,
)
from gateway.engines.grpc_client import GrpcEngineClient
from switchyard.proto_gen import engine_agent_pb2 as pb
from switchyard.proto_gen import engine_agent_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    running = Agent.start(tmp_path_factory.mktemp("agent"), "--state-interval-ms", "50")
    yield running
    assert running.terminate() == 0, running.log()


@pytest.fixture
async def session_client(agent: Agent) -> AsyncIterator[GrpcEngineClient]:
    client = GrpcEngineClient(agent.target)
    yield client
    await client.close()


def _request(rid: str, max_tokens: int, *, seed: int, **extra: object) -> EngineRequest:
    return EngineRequest(
        request_id=rid,
        model="m",
        prompt_token_ids=(100, 200, 300),
        max_tokens=max_tokens,
        seed=seed,
        ignore_eos=True,
        **extra,  # type: ignore[arg-type]
    )


async def _collect(events: AsyncIterator[EngineEvent]) -> tuple[list[int], str, Finished]:
    ids: list[int] = []
    text = ""
    admitted = False
    async for event in events:
        if isinstance(event, Admitted):
            assert not admitted and not ids
            admitted = True
        elif isinstance(event, Delta):
            assert admitted
            ids.extend(event.token_ids)
            text += event.text
        else:
            assert isinstance(event, Finished) and admitted
            return ids, text, event
    raise AssertionError("stream ended without a finish event")


async def _running(agent: Agent) -> int:
    async with grpc.aio.insecure_channel(agent.target) as channel:
        stub = pb_grpc.EngineAgentStub(channel)
        call = stub.WatchState(pb.WatchStateRequest(interval_ms=20))
        try:
            state = await call.read()
            return int(state.num_running + state.num_waiting)
        finally:
            call.cancel()


async def _until_idle(agent: Agent, timeout_s: float = 5.0) -> None:
    async def wait() -> None:
        while await _running(agent):  # noqa: ASYNC110 - polling another process's state
            await asyncio.sleep(0.02)

    await asyncio.wait_for(wait(), timeout_s)


async def test_every_token_once_and_in_order_as_with_one_call_per_request(
    agent: Agent, session_client: GrpcEngineClient
) -> None:
    per_call = GrpcEngineClient(agent.target, multiplex=False)
    try:
        requests = [
            _request(f"order-{i}", 40 + i, seed=i, stop=("zz",) if i % 3 == 0 else ()) for i in range(48)
        ]
        on_session = await asyncio.gather(*(_collect(session_client.generate(r)) for r in requests))
        on_calls = await asyncio.gather(
            *(
                _collect(per_call.generate(_request(f"call-{i}", r.max_tokens or 0, seed=i, stop=r.stop)))
                for i, r in enumerate(requests)
            )
        )
    finally:
        await per_call.close()
    for request, (ids, text, finished), (ref_ids, ref_text, ref_finished) in zip(
        requests, on_session, on_calls, strict=True
    ):
        assert ids == ref_ids and text == ref_text
        assert finished.finish_reason == ref_finished.finish_reason
        assert finished.completion_tokens == ref_finished.completion_tokens == len(ids)
        if ref_finished.finish_reason == "length":
            assert len(ids) == request.max_tokens


async def test_cancel_aborts_only_that_request(agent: Agent, session_client: GrpcEngineClient) -> None:
    await _until_idle(agent)
    long = session_client.generate(_request("cancel-long", 5000, seed=1))
    seen = 0
    async for event in long:
        seen += isinstance(event, Delta)
        if seen >= 3:
            break
    other = asyncio.ensure_future(_collect(session_client.generate(_request("cancel-other", 60, seed=2))))
    await long.aclose()  # the consumer goes away: a cancel on the session
    ids, _, finished = await other
    assert finished.finish_reason == "length" and len(ids) == 60
    await _until_idle(agent)  # the cancelled request no longer runs on the engine


async def test_slow_consumer_does_not_stall_the_others(
    agent: Agent, session_client: GrpcEngineClient
) -> None:
    slow = session_client.generate(_request("slow-1", 80, seed=3))
    first = await anext(slow)
    assert isinstance(first, Admitted)
    # While `slow` is not read, other requests on the same session run to completion.
    others = await asyncio.wait_for(
        asyncio.gather(
            *(_collect(session_client.generate(_request(f"fast-{i}", 50, seed=10 + i))) for i in range(8))
        ),
        10.0,
    )
    assert all(len(ids) == 50 for ids, _, _ in others)
    ids: list[int] = []
    async for event in slow:
        if isinstance(event, Delta):
            ids.extend(event.token_ids)
        elif isinstance(event, Finished):
            break
    reference = await _collect(session_client.generate(_request("slow-ref", 80, seed=3)))
    assert ids == reference[0]


async def test_admission_errors_keep_their_meaning(session_client: GrpcEngineClient) -> None:
    bad = EngineRequest(request_id="bad-1", model="m", prompt_token_ids=(1, 2), max_tokens=10**7)
    with pytest.raises(EngineRequestError):
        await _collect(session_client.generate(bad))
    # The session survives a refused request.
    ids, _, _ = await _collect(session_client.generate(_request("after-bad", 5, seed=4)))
    assert len(ids) == 5


async def test_agent_death_fails_started_streams_and_refuses_new_ones(tmp_path: Path) -> None:
    agent = await asyncio.to_thread(Agent.start, tmp_path)
    client = GrpcEngineClient(agent.target, connect_timeout_s=1.0)
    try:
        stream = client.generate(_request("dies-1", 8000, seed=5))
        assert isinstance(await anext(stream), Admitted)
        agent.proc.send_signal(signal.SIGKILL)
        with pytest.raises(EngineStreamError):
            async for _ in stream:
                pass
        with pytest.raises(EngineUnavailable):
            await _collect(client.generate(_request("dies-2", 5, seed=6)))
    finally:
        await client.close()
        agent.proc.kill()
        agent.proc.wait()


async def test_draining_agent_refuses_with_unavailable(tmp_path: Path) -> None:
    agent = await asyncio.to_thread(Agent.start, tmp_path, "--drain-grace-s", "10")
    client = GrpcEngineClient(agent.target, connect_timeout_s=1.0)
    try:
        stream = client.generate(_request("drain-1", 400, seed=7))
        assert isinstance(await anext(stream), Admitted)
        agent.proc.send_signal(signal.SIGTERM)  # drains: the open stream finishes, new ones are refused
        await asyncio.sleep(0.3)
        with pytest.raises(EngineUnavailable, match="draining"):
            await _collect(client.generate(_request("drain-2", 5, seed=8)))
        ids: list[int] = []
        async for event in stream:
            if isinstance(event, Delta):
                ids.extend(event.token_ids)
        assert len(ids) == 400
    finally:
        await client.close()
        await asyncio.to_thread(agent.proc.wait, 15)
