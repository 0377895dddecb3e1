"""Migration between two real sim agents (`python -m engine_agent --backend sim`) over loopback gRPC.

A long greedy request starts on agent A; after ~20 tokens MigrateOut cuts it for agent B; MigrateIn on B
continues it. A third agent C runs the same requests unmigrated as the reference: the sim carries each
request's token-generator state in the ticket, so A's tokens followed by B's equal C's, and so does the text.
The pause the client sees (A's last token to B's first) is printed (run with `-rP` to see it), not bounded:
a wall-clock figure; benchmarks/live_vs_sim.py measures it against the modelled transfer + one iteration.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import grpc
import pytest
from agent_process import Agent

from engine_agent.tokenization import Tokenizer
from switchyard.hardware import MODELS
from switchyard.proto_gen import engine_agent_pb2 as pb
from switchyard.proto_gen import engine_agent_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

KV_BYTES_PER_TOKEN = MODELS["llama3-8b"].kv_bytes_per_token
# The agent's defaults (AgentConfig.sim_kv_link_gbps in Gbit/s / sim_kv_transfer_latency_s).
LINK_GBPS, TRANSFER_LATENCY_S = 200.0, 0.002
PROMPT_TOKENS = 3000
CUT_AFTER = 20


@dataclass
class Agents:
    a: Agent
    b: Agent
    c: Agent


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agents]:
    tmp = tmp_path_factory.mktemp("migration")
    started: list[Agent] = []
    try:
        for _ in range(3):
            started.append(Agent.start(tmp, "--state-interval-ms", "20"))
        yield Agents(*started)
    finally:
        for agent in started:
            code = agent.terminate()
            assert code == 0, agent.log()


@dataclass
class Stream:
    admitted: pb.Admitted | None = None
    ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: pb.Finished | None = None
    migrated: pb.Migrated | None = None
    first_token_s: float = 0.0
    last_token_s: float = 0.0


async def read(call: AsyncIterator[pb.GenerateEvent], out: Stream, *, until_tokens: int = 0) -> Stream:
    """Read events into `out` (until it holds `until_tokens` tokens, when given); timestamps on arrival."""
    async for event in call:
        kind = event.WhichOneof("event")
        if kind == "admitted":
            assert out.admitted is None
            out.admitted = event.admitted
        elif kind == "delta":
            assert out.finished is None and out.migrated is None
            if event.delta.token_ids:
                out.last_token_s = time.perf_counter()
                if not out.ids:
                    out.first_token_s = out.last_token_s
            out.ids.extend(event.delta.token_ids)
            out.text += event.delta.text
            if until_tokens and len(out.ids) >= until_tokens:
                return out
        elif kind == "finished":
            out.finished = event.finished
        else:
            out.migrated = event.migrated
    return out


def request(request_id: str, max_tokens: int, **sampling: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=pb.TokenIds(ids=[100 + i % 5000 for i in range(PROMPT_TOKENS)]),
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling),  # type: ignore[arg-type]
        priority=3,
        session_id="sess-7",
    )


@pytest.fixture
async def stubs(agents: Agents) -> AsyncIterator[tuple[pb_grpc.EngineAgentStub, ...]]:
    async with (
        grpc.aio.insecure_channel(agents.a.target) as a,
        grpc.aio.insecure_channel(agents.b.target) as b,
        grpc.aio.insecure_channel(agents.c.target) as c,
    ):
        stubs = pb_grpc.EngineAgentStub(a), pb_grpc.EngineAgentStub(b), pb_grpc.EngineAgentStub(c)
        for stub in stubs:  # connect first, so that no timing below includes a connection set-up
            await stub.GetInfo(pb.GetInfoRequest())
        yield stubs


async def migrate(
    a: pb_grpc.EngineAgentStub, b: pb_grpc.EngineAgentStub, b_target: str, req: pb.GenerateRequest
) -> tuple[Stream, pb.MigrationTicket, Stream, float]:
    """Run `req` on A, cut it after CUT_AFTER tokens, resume it on B: (A, ticket, B, MigrateIn sent at)."""
    source = Stream()
    call = a.Generate(req)
    await read(call, source, until_tokens=CUT_AFTER)
    ticket = await a.MigrateOut(pb.MigrateOutRequest(request_id=req.request_id, target=b_target))
    await read(call, source)  # the rest of A's stream: the ticket's last tokens, then `migrated`
    sent_s = time.perf_counter()
    target = await read(b.MigrateIn(pb.MigrateInRequest(ticket=ticket)), Stream())
    return source, ticket, target, sent_s


async def idle(stub: pb_grpc.EngineAgentStub) -> pb.EngineState:
    watch = stub.WatchState(pb.WatchStateRequest(interval_ms=20))
    try:
        async def scan() -> pb.EngineState:
            async for state in watch:
                empty = state.num_running == 0 and state.num_waiting == 0
                if empty and state.kv_blocks_free == state.kv_blocks_total:
                    return state
            raise AssertionError("WatchState ended")

        return await asyncio.wait_for(scan(), 2.0)
    finally:
        watch.cancel()


async def test_migrate_long_greedy_request(
    agents: Agents, stubs: tuple[pb_grpc.EngineAgentStub, ...]
) -> None:
    a, b, c = stubs
    req = request("mig-long", 200, ignore_eos=True)
    source, ticket, target, resume_sent_s = await migrate(a, b, agents.b.target, req)

    # A: ends with `migrated` after exactly the ticket's tokens, with the same ticket MigrateOut returned.
    assert source.finished is None and source.migrated is not None
    assert source.migrated.ticket == ticket
    assert source.ids == list(ticket.output_token_ids.ids) and len(source.ids) >= CUT_AFTER
    kv_tokens = PROMPT_TOKENS + len(source.ids) - 1
    assert (ticket.kv_tokens, ticket.kv_bytes) == (kv_tokens, kv_tokens * KV_BYTES_PER_TOKEN)
    assert ticket.remaining_tokens == 200 - len(source.ids)
    assert (ticket.backend, ticket.model, ticket.request.priority, ticket.request.session_id) == (
        "sim", "llama3-8b", 3, "sess-7")
    assert not ticket.request.HasField("prompt_token_ids") and ticket.request.sampling.ignore_eos

    # B: the continuation, with usage for the whole request.
    assert target.admitted is not None and target.admitted.prompt_tokens == PROMPT_TOKENS
    assert target.finished is not None and target.finished.finish_reason == "length"
    usage = target.finished.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (PROMPT_TOKENS, 200)

    # C: the same request unmigrated.
    reference = await read(c.Generate(req), Stream())
    assert reference.finished is not None
    assert source.ids + target.ids == reference.ids
    assert source.text + target.text == reference.text
    assert reference.finished.usage == target.finished.usage

    for stub in (a, b):
        await idle(stub)  # every KV block free again on both engines
    info = await b.GetInfo(pb.GetInfoRequest())
    assert (info.hidden_size, info.hidden_state_interval) == (4096, 20)

    transfer_s = TRANSFER_LATENCY_S + ticket.kv_bytes * 8 / (LINK_GBPS * 1e9)
    pause_s = target.first_token_s - source.last_token_s
    resume_s = target.first_token_s - resume_sent_s
    state = await b.WatchState(pb.WatchStateRequest()).read()
    iteration_s = state.last_iteration_s
    print(
        f"\nmigration of a {PROMPT_TOKENS}-token prompt after {len(source.ids)} tokens: "
        f"{ticket.kv_bytes / 1e6:.0f} MB of KV, modelled transfer {transfer_s * 1e3:.1f} ms + one decode "
        f"iteration {iteration_s * 1e3:.1f} ms = {(transfer_s + iteration_s) * 1e3:.1f} ms; measured pause "
        f"(A's last token -> B's first token) {pause_s * 1e3:.1f} ms, of which MigrateIn call -> first token "
        f"{resume_s * 1e3:.1f} ms"
    )
    assert transfer_s <= resume_s <= pause_s  # B holds the first token for the modelled transfer at least


async def test_stop_string_straddling_the_cut(
    agents: Agents, stubs: tuple[pb_grpc.EngineAgentStub, ...], tokenizer: Tokenizer
) -> None:
    a, b, c = stubs
    # Same request id everywhere: the sim's tokens for an unseeded request come from its id.
    plain = await read(c.Generate(request("straddle", 60, ignore_eos=True)), Stream())
    # A stop string from the middle of token 16 to the middle of token 30: the cut (token ~21) falls inside.
    start = len(tokenizer.decode(plain.ids[:16])) + 1
    end = len(tokenizer.decode(plain.ids[:30])) - 1
    stop = plain.text[start:end]
    assert plain.text.find(stop) == start and len(stop) > 20
    req = request("straddle", 60, ignore_eos=True, stop=[stop])
    reference = await read(c.Generate(req), Stream())
    assert reference.finished is not None and reference.finished.stop_reason == stop
    source, ticket, target, _ = await migrate(a, b, agents.b.target, req)
    assert source.migrated is not None and 16 < len(ticket.output_token_ids.ids) < 30
    # A holds back the text that could begin the stop string.
    assert source.text == reference.text[: len(source.text)] and len(source.text) <= start
    assert target.finished is not None
    assert (target.finished.finish_reason, target.finished.stop_reason) == ("stop", stop)
    assert source.text + target.text == reference.text == plain.text[:start]
    assert source.ids + target.ids == reference.ids
    assert target.finished.usage.completion_tokens == reference.finished.usage.completion_tokens
    for stub in (a, b):
        await idle(stub)


async def test_refusals(agents: Agents, stubs: tuple[pb_grpc.EngineAgentStub, ...]) -> None:
    a, b, _ = stubs
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await a.MigrateOut(pb.MigrateOutRequest(request_id="nobody", target=agents.b.target))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    # A ticket for another model, and a malformed one.
    source, ticket, target, _ = await migrate(a, b, agents.b.target, request("refuse-1", 40, ignore_eos=True))
    assert target.finished is not None
    other = pb.MigrationTicket()
    other.CopyFrom(ticket)
    other.model = "qwen2.5-14b"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await read(b.MigrateIn(pb.MigrateInRequest(ticket=other, request_id="refuse-2")), Stream())
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "model" in (err.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await read(b.MigrateIn(pb.MigrateInRequest(ticket=pb.MigrationTicket(request_id="x"))), Stream())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    await idle(b)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.load_sim()


async def test_cut_while_the_prefill_step_is_in_flight(
    agents: Agents, stubs: tuple[pb_grpc.EngineAgentStub, ...]
) -> None:
    """An 8000-token prompt prefills in one ~0.25 s step; a cut during it moves the request after its
    first token (the step's output), like a prefill/decode hand-over: KV for the prompt, no recompute."""
    a, b, c = stubs
    req = pb.GenerateRequest(
        request_id="after-prefill",
        prompt_token_ids=pb.TokenIds(ids=[100 + i % 5000 for i in range(8000)]),
        sampling=pb.SamplingParams(max_tokens=50, ignore_eos=True),
    )
    call = a.Generate(req)
    source = Stream()
    async for event in call:
        assert event.HasField("admitted")
        break
    await asyncio.sleep(0.05)  # the prefill step is computed and in flight
    ticket = await a.MigrateOut(pb.MigrateOutRequest(request_id="after-prefill", target=agents.b.target))
    await read(call, source)
    assert source.migrated is not None and source.ids == list(ticket.output_token_ids.ids)
    print(f"\ncut during the prefill step: {len(source.ids)} token(s) before it, KV of {ticket.kv_tokens}")
    assert ticket.kv_tokens == 8000 + len(source.ids) - 1
    target = await read(b.MigrateIn(pb.MigrateInRequest(ticket=ticket)), Stream())
    reference = await read(c.Generate(req), Stream())
    assert source.ids + target.ids == reference.ids and len(reference.ids) == 50
    assert target.finished is not None and target.finished.usage.completion_tokens == 50
    for stub in (a, b):
        await idle(stub)
