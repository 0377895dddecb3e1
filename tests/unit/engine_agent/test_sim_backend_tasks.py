"""The sim backend owns its background work: after `stop` no task it started is pending (invariant I6)."""

from __future__ import annotations

import asyncio

from engine_agent.backends.sim import SimBackend
from engine_agent.domain import (
    BackendRequest,
    FinishEvent,
    HiddenStateBatch,
    RequestId,
    SamplingSpec,
    TokenEvent,
)
from switchyard.clock import MonotonicClock
from switchyard.profiles import get_profile


def _pending_except_me() -> set[asyncio.Task[object]]:
    return {t for t in asyncio.all_tasks() if not t.done() and t is not asyncio.current_task()}


async def test_stop_leaves_no_task_pending_and_ends_streams_and_subscriptions() -> None:
    before = _pending_except_me()
    # A tap every decode step, so a batch is likely being built in the executor when `stop` comes.
    backend = SimBackend(get_profile("h100-llama3-8b"), clock=MonotonicClock(), engine_id="tasks-0",
                         vocab_size=1000, eos_token_id=2, hidden_state_interval=1)
    await backend.start()
    batches: list[HiddenStateBatch] = []
    tapped = asyncio.Event()

    async def subscribe() -> None:
        async for batch in backend.hidden_states():
            batches.append(batch)
            tapped.set()

    ends: dict[str, FinishEvent] = {}

    async def run(rid: str, max_tokens: int) -> int:
        tokens = 0
        sampling = SamplingSpec(max_tokens=max_tokens, ignore_eos=True)
        request = BackendRequest(RequestId(rid), (5,) * 40, sampling)
        async for event in backend.generate(request):
            if isinstance(event, TokenEvent):
                tokens += len(event.token_ids)
            else:
                assert isinstance(event, FinishEvent)
                ends[rid] = event
        return tokens

    subscriber = asyncio.create_task(subscribe())
    await asyncio.sleep(0)
    short = [asyncio.create_task(run(f"short-{i}", 8)) for i in range(4)]
    long = [asyncio.create_task(run(f"long-{i}", 5000)) for i in range(4)]  # still running at `stop`
    assert await asyncio.gather(*short) == [8] * 4
    await asyncio.wait_for(tapped.wait(), 5.0)  # the long requests keep decoding, so taps keep firing

    await backend.stop()
    # Every stream and subscription ends once stopped: the long requests as aborted.
    await asyncio.wait_for(asyncio.gather(subscriber, *long), 5.0)
    assert {ends[f"long-{i}"].finish_reason for i in range(4)} == {"abort"}
    assert _pending_except_me() <= before
    await backend.stop()  # idempotent
