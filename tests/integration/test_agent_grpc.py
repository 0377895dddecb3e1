"""A real engine agent process (`python -m engine_agent --backend sim`) over loopback gRPC.

Figures (WatchState reaction, 64-stream wall time, engine-loop lag) are printed; run with `-s` or `-rP` to see
them.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from agent_process import PROFILE, REPO, Agent
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_agent.tokenization import Tokenizer
from switchyard.proto_gen import engine_agent_pb2 as pb
from switchyard.proto_gen import engine_agent_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration

MAX_CONTEXT = 8192


def _run_cli(*args: str, timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "engine_agent", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    running = Agent.start(tmp_path_factory.mktemp("agent"), "--state-interval-ms", "50", "--combo", "1xh100")
    yield running
    code = running.terminate()
    print(f"\nshared agent: exit {code}; {running.loop_lag_line()}")
    assert code == 0, running.log()


@pytest.fixture
async def stub(agent: Agent) -> AsyncIterator[pb_grpc.EngineAgentStub]:
    async with grpc.aio.insecure_channel(agent.target) as channel:
        yield pb_grpc.EngineAgentStub(channel)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.load_sim()


def _gen(
    request_id: str, max_tokens: int, *, ids: tuple[int, ...] = (100, 200, 300), **sampling: object
) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=pb.TokenIds(ids=ids),
        sampling=pb.SamplingParams(max_tokens=max_tokens, **sampling),  # type: ignore[arg-type]
    )


@dataclass
class Collected:
    admitted: pb.Admitted | None = None
    ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: pb.Finished | None = None


async def _collect(
    call: AsyncIterator[pb.GenerateEvent], out: Collected | None = None, *, until_delta: bool = False
) -> Collected:
    out = out or Collected()
    async for event in call:
        kind = event.WhichOneof("event")
        if kind == "admitted":
            assert out.admitted is None and not out.ids
            out.admitted = event.admitted
        elif kind == "delta":
            assert out.admitted is not None and out.finished is None
            out.ids.extend(event.delta.token_ids)
            out.text += event.delta.text
            if until_delta:
                break
        else:
            out.finished = event.finished
    return out


async def _state_until(
    stream: AsyncIterator[pb.EngineState], predicate: object, timeout_s: float
) -> pb.EngineState:
    async def scan() -> pb.EngineState:
        async for state in stream:
            if predicate(state):  # type: ignore[operator]
                return state
        raise AssertionError("WatchState ended")

    return await asyncio.wait_for(scan(), timeout_s)


async def _idle_state(stub: pb_grpc.EngineAgentStub) -> pb.EngineState:
    call = stub.WatchState(pb.WatchStateRequest(interval_ms=20))
    try:
        return await _state_until(
            call, lambda s: s.num_running == 0 and s.kv_blocks_free == s.kv_blocks_total, 2.0
        )
    finally:
        call.cancel()


async def test_health_and_info(agent: Agent, stub: pb_grpc.EngineAgentStub, tokenizer: Tokenizer) -> None:
    async with grpc.aio.insecure_channel(agent.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "switchyard.engine.v1.EngineAgent"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    info = await stub.GetInfo(pb.GetInfoRequest())
    assert info.identity.engine_id == f"it-{agent.port}"
    assert (info.identity.backend, info.identity.profile, info.identity.model) == (
        "sim",
        PROFILE,
        "llama3-8b",
    )
    assert info.max_context_tokens == MAX_CONTEXT and info.block_size == 16
    assert info.tokenizer == tokenizer.identity and info.eos_token_id == tokenizer.eos_token_id
    assert info.gpu and info.gpu_memory_gb == 80.0 and info.tensor_parallel == 1
    assert info.hourly_price_usd == 2.99 and info.identity.combo == "1xh100"  # CAUCHY: price and combo
    assert (info.hidden_size, info.hidden_state_interval) == (4096, 20)  # llama3-8b; the default interval


async def test_streaming_chat_generate(stub: pb_grpc.EngineAgentStub, tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    request = pb.GenerateRequest(
        request_id="chat-1",
        chat=pb.ChatPrompt(messages=[pb.ChatMessage(**m) for m in messages], add_generation_prompt=True),
        sampling=pb.SamplingParams(max_tokens=40, ignore_eos=True),
    )
    got = await _collect(stub.Generate(request))
    assert got.admitted is not None
    assert got.admitted.prompt_tokens == len(tokenizer.apply_chat_template(messages))
    assert len(got.ids) == 40
    assert got.text == tokenizer.decode(got.ids)
    assert got.finished is not None and got.finished.finish_reason == "length"
    assert got.finished.usage.prompt_tokens == got.admitted.prompt_tokens
    assert got.finished.usage.completion_tokens == 40
    assert got.finished.timings.prefill_s > 0 and got.finished.timings.decode_s > 0


async def test_prompt_text_and_target_output_tokens(
    stub: pb_grpc.EngineAgentStub, tokenizer: Tokenizer
) -> None:
    request = pb.GenerateRequest(
        request_id="text-1",
        prompt_text="Once upon a time",
        target_output_tokens=7,
        sampling=pb.SamplingParams(max_tokens=30),
    )
    got = await _collect(stub.Generate(request))
    assert got.admitted is not None
    assert got.admitted.prompt_tokens == len(tokenizer.encode("Once upon a time", add_special_tokens=True))
    assert got.finished is not None and got.finished.finish_reason == "stop"  # ended by EOS
    assert got.ids[-1] == tokenizer.eos_token_id and got.finished.usage.completion_tokens == 7


async def test_stop_string_truncates_and_aborts(stub: pb_grpc.EngineAgentStub) -> None:
    full = await _collect(stub.Generate(_gen("stop-ref", 60, seed=7, ignore_eos=True)))
    text = full.text
    # A stop string that first occurs in the middle of the output.
    start = next(
        i for i in range(20, len(text) - 5) if text[i : i + 4].strip() and text.find(text[i : i + 4]) == i
    )
    stop = text[start : start + 4]
    got = await _collect(stub.Generate(_gen("stop-1", 60, seed=7, ignore_eos=True, stop=[stop])))
    assert got.finished is not None
    assert (got.finished.finish_reason, got.finished.stop_reason) == ("stop", stop)
    assert got.text == text[:start]
    assert got.ids == full.ids[: len(got.ids)] and len(got.ids) < 60
    assert got.finished.usage.completion_tokens == len(got.ids)
    idle = await _idle_state(stub)  # the backend request was aborted and its KV freed
    assert idle.num_running == 0


async def test_context_limit_validation(stub: pb_grpc.EngineAgentStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _collect(stub.Generate(_gen("long-1", 100, ids=tuple(range(20, 20 + MAX_CONTEXT - 50)))))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "maximum context length is 8192" in (err.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _collect(
            stub.Generate(pb.GenerateRequest(request_id="none", sampling=pb.SamplingParams(max_tokens=1)))
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # max_tokens 0 = up to the context limit.
    prompt = tuple(100 + i % 5000 for i in range(MAX_CONTEXT - 12))
    got = await _collect(stub.Generate(_gen("fill-1", 0, ids=prompt, ignore_eos=True)))
    assert got.finished is not None and got.finished.finish_reason == "length"
    assert got.finished.usage.completion_tokens == 12


async def test_64_concurrent_streams(stub: pb_grpc.EngineAgentStub) -> None:
    started = time.perf_counter()
    results = await asyncio.gather(
        *(_collect(stub.Generate(_gen(f"c64-{i}", 256, ignore_eos=True))) for i in range(64))
    )
    wall_s = time.perf_counter() - started
    for got in results:
        assert got.finished is not None and got.finished.finish_reason == "length"
        assert len(got.ids) == 256
        assert (got.finished.usage.prompt_tokens, got.finished.usage.completion_tokens) == (3, 256)
    engine_s = max(
        g.finished.timings.queue_s + g.finished.timings.prefill_s + g.finished.timings.decode_s
        for g in results
        if g.finished is not None
    )
    print(
        f"\n64 x 256-token streams: wall {wall_s:.3f}s, simulated engine time {engine_s:.3f}s, "
        f"overhead {100 * (wall_s / engine_s - 1):.1f}%"
    )


async def test_watch_state_reacts_to_changes(stub: pb_grpc.EngineAgentStub, agent: Agent) -> None:
    # A 1 s interval: anything seen within ~100 ms is a push on change, not on the interval.
    watch = stub.WatchState(pb.WatchStateRequest(interval_ms=1000))
    try:
        first = await _state_until(watch, lambda s: True, 2.0)
        assert first.identity.engine_id == f"it-{agent.port}" and first.ready and not first.draining
        assert first.num_running == 0 and first.kv_blocks_free == first.kv_blocks_total
        last_seq = first.seq
        call = stub.Generate(_gen("watch-1", 2000, ignore_eos=True, ids=tuple(range(100, 1100))))
        sent = time.perf_counter()
        running = await _state_until(
            watch, lambda s: s.num_running == 1 and s.kv_blocks_free < s.kv_blocks_total, 1.0
        )
        admit_reaction_s = time.perf_counter() - sent
        assert running.seq > last_seq and running.timestamp_s > first.timestamp_s
        assert running.kv_blocks_total - running.kv_blocks_free >= 1000 // 16
        abort_sent = time.perf_counter()
        assert (await stub.Abort(pb.AbortRequest(request_id="watch-1"))).found
        idle = await _state_until(
            watch, lambda s: s.num_running == 0 and s.kv_blocks_free == s.kv_blocks_total, 1.0
        )
        abort_reaction_s = time.perf_counter() - abort_sent
        assert idle.seq > running.seq
        got = await _collect(call)
        assert got.finished is not None and got.finished.finish_reason == "abort"
        print(
            "\nWatchState reaction (interval 1000 ms): "
            f"admit -> running=1 in {admit_reaction_s * 1e3:.1f} ms; "
            f"abort -> running=0 and KV all free in {abort_reaction_s * 1e3:.1f} ms"
        )
    finally:
        watch.cancel()


async def test_watch_state_interval_and_seq(stub: pb_grpc.EngineAgentStub) -> None:
    watch = stub.WatchState(pb.WatchStateRequest())  # the agent's 50 ms
    other = stub.WatchState(pb.WatchStateRequest(interval_ms=20))
    try:
        seqs: list[int] = []
        started = time.perf_counter()
        async for state in watch:
            seqs.append(state.seq)
            other_state = await other.read()
            seqs.append(other_state.seq)
            if len(seqs) >= 8:
                break
        elapsed = time.perf_counter() - started
        mine = seqs[0::2]
        assert mine == sorted(mine) and len(set(seqs)) == len(seqs)  # one process-wide sequence
        assert elapsed >= 0.15  # idle engine: pushes come on the 50 ms interval
    finally:
        watch.cancel()
        other.cancel()


async def test_abort_mid_stream_returns_blocks(stub: pb_grpc.EngineAgentStub) -> None:
    call = stub.Generate(_gen("abort-1", 1000, ignore_eos=True, ids=tuple(range(100, 900))))
    received = 0
    finished: pb.Finished | None = None
    async for event in call:
        if event.HasField("delta"):
            received += len(event.delta.token_ids)
            if received >= 5 and finished is None:
                assert (await stub.Abort(pb.AbortRequest(request_id="abort-1"))).found
        elif event.HasField("finished"):
            finished = event.finished
    assert finished is not None and finished.finish_reason == "abort"
    assert finished.usage.completion_tokens == received and received < 1000
    assert (await _idle_state(stub)).kv_blocks_free == (await _idle_state(stub)).kv_blocks_total
    assert not (await stub.Abort(pb.AbortRequest(request_id="abort-1"))).found


async def test_client_cancel_aborts(stub: pb_grpc.EngineAgentStub) -> None:
    watch = stub.WatchState(pb.WatchStateRequest(interval_ms=1000))
    try:
        call = stub.Generate(_gen("cancel-1", 1000, ignore_eos=True, ids=tuple(range(100, 900))))
        deltas = 0
        async for event in call:
            deltas += event.HasField("delta")
            if deltas >= 3:
                break
        await _state_until(watch, lambda s: s.num_running == 1, 1.0)
        call.cancel()
        idle = await _state_until(
            watch, lambda s: s.num_running == 0 and s.kv_blocks_free == s.kv_blocks_total, 1.0
        )
        assert idle.num_waiting == 0
    finally:
        watch.cancel()


def test_cli_unknown_profile() -> None:
    result = _run_cli("--backend", "sim", "--profile", "h100-nonexistent", "--port", "0")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown profile 'h100-nonexistent'" in lines[0] and PROFILE in lines[0]


def test_cli_port_in_use(agent: Agent) -> None:
    result = _run_cli(
        "--backend", "sim", "--profile", PROFILE, "--port", str(agent.port), "--log-level", "ERROR"
    )
    assert result.returncode == 2
    errors = [line for line in result.stderr.strip().splitlines() if "error" in line.lower()]
    assert errors and "in use" in errors[-1] and str(agent.port) in errors[-1]


async def test_sigterm_drains_in_flight_stream(tmp_path: Path) -> None:
    # Off the loop: Agent.start polls health with a blocking gRPC channel and time.sleep until SERVING.
    agent = await asyncio.to_thread(Agent.start, tmp_path, "--drain-grace-s", "20")
    try:
        async with grpc.aio.insecure_channel(agent.target) as channel:
            stub = pb_grpc.EngineAgentStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            call = stub.Generate(_gen("drain-1", 150, ignore_eos=True))
            got = await _collect(call, until_delta=True)
            os.kill(agent.proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + 5
            while (
                await health.Check(health_pb2.HealthCheckRequest())
            ).status == health_pb2.HealthCheckResponse.SERVING:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _collect(stub.Generate(_gen("drain-new", 5)))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            await _collect(call, got)
        assert got.finished is not None and got.finished.finish_reason == "length"
        assert len(got.ids) == 150 and got.finished.usage.completion_tokens == 150
        assert await asyncio.to_thread(agent.proc.wait, 20) == 0
        assert "engine agent" in agent.log() and "stopped" in agent.log()
    finally:
        if agent.proc.poll() is None:
            agent.proc.kill()
            agent.proc.wait()


async def test_watch_state_carries_prefix_cache_events(stub: pb_grpc.EngineAgentStub) -> None:
    """A watcher's first push resyncs (`cleared`); a later push carries the index blocks a computed prompt
    stored, keyed as the gateway keys them; a watcher that connects afterwards gets them in its resync."""
    from switchyard.prefix import INDEX_SPAN_TOKENS, index_keys

    # 9 index blocks, of which 5 are indexed (the first four, then the eighth): a sparse key is reported too.
    ids = tuple(100 + (i * 7919) % 8000 for i in range(9 * INDEX_SPAN_TOKENS + 10))
    keys = index_keys(ids)
    assert len(keys) == 5
    watch = stub.WatchState(pb.WatchStateRequest(interval_ms=20))
    try:
        first = await _state_until(watch, lambda s: True, 2.0)
        assert first.HasField("kv_events") and first.kv_events.cleared
        assert first.kv_events.span_tokens == INDEX_SPAN_TOKENS
        done = await _collect(stub.Generate(_gen("kv-events", 4, ids=ids)))
        assert done.finished is not None
        stored: set[int] = set()

        def saw_all(state: pb.EngineState) -> bool:
            if state.HasField("kv_events"):
                assert not state.kv_events.cleared  # one resync per stream
                stored.update(state.kv_events.stored)
            return set(keys) <= stored

        await _state_until(watch, saw_all, 5.0)
    finally:
        watch.cancel()
    late = stub.WatchState(pb.WatchStateRequest(interval_ms=20))
    try:
        resync = await _state_until(late, lambda s: True, 2.0)
        assert resync.kv_events.cleared and set(keys) <= set(resync.kv_events.stored)
    finally:
        late.cancel()
    # The repeat hits the cached blocks: all but the last, partial block of 10 tokens.
    again = await _collect(stub.Generate(_gen("kv-events-again", 4, ids=ids)))
    assert again.finished is not None
    assert again.finished.usage.cached_tokens >= 9 * INDEX_SPAN_TOKENS
