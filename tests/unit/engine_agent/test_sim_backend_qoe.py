"""The sim backend feeds CascadeInfer's online QoE fit and measures its KV pulls (`stats().qoe`,
`stats().transfer_bytes_per_s`), in real time on the simulated H100."""

from __future__ import annotations

import asyncio

from engine_agent.backends.sim import SimBackend
from engine_agent.domain import (
    BackendRequest,
    FinishEvent,
    MigratedEvent,
    MigrationTicket,
    RequestId,
    SamplingSpec,
    TokenEvent,
)
from engine_agent.transfer_rate import TransferRate
from switchyard.clock import MonotonicClock
from switchyard.profiles import get_profile

PROFILE = get_profile("h100-llama3-8b")


def backend(engine_id: str, role: str = "") -> SimBackend:
    return SimBackend(PROFILE, clock=MonotonicClock(), engine_id=engine_id, vocab_size=1000, eos_token_id=2,
                      role=role)


def request(rid: str, prompt_tokens: int, output_tokens: int) -> BackendRequest:
    return BackendRequest(RequestId(rid), (7,) * prompt_tokens,
                          SamplingSpec(max_tokens=output_tokens, ignore_eos=True))


async def drain(events: object) -> FinishEvent | MigratedEvent:
    end: FinishEvent | MigratedEvent | None = None
    async for event in events:  # type: ignore[attr-defined]
        if not isinstance(event, TokenEvent):
            end = event
    assert end is not None
    return end


async def test_finished_requests_are_fitted_and_cancelled_ones_are_not() -> None:
    engine = backend("qoe-0")
    await engine.start()
    try:
        assert engine.stats().qoe is None and engine.stats().transfer_bytes_per_s == 0.0
        cancelled = engine.generate(request("cancelled", 300, 500))
        async for event in cancelled:  # one token, then the client goes away
            assert isinstance(event, TokenEvent)
            break
        await cancelled.aclose()  # type: ignore[attr-defined]
        ends = await asyncio.gather(*(drain(engine.generate(request(f"r{i}", 40 + 97 * i, 4 + i % 9)))
                                      for i in range(24)))
        assert {e.finish_reason for e in ends if isinstance(e, FinishEvent)} == {"length"}
        fit = engine.stats().qoe
        assert fit is not None and fit.samples == 24  # the cancelled request gave none
        assert len(fit.d) == 5 and min(fit.d) >= 0.0 and fit.mean_relative_error >= 0.0
    finally:
        await engine.stop()


async def test_pulled_kv_sets_the_transfer_rate_and_prefill_hand_offs_give_no_samples() -> None:
    prefill, decode = backend("qoe-p", role="prefill"), backend("qoe-d", role="decode")
    for b in (prefill, decode):
        await b.start()
    try:
        cuts = await asyncio.gather(*(drain(prefill.generate(request(f"h{i}", 64 + 50 * i, 12)))
                                      for i in range(20)))
        tickets: list[MigrationTicket] = []
        for cut in cuts:
            assert isinstance(cut, MigratedEvent)
            tickets.append(cut.ticket)
        assert prefill.stats().qoe is None  # every request was handed off: no sample
        expected = TransferRate()
        for ticket in tickets:  # one at a time, so the pulls count in this order
            end = await drain(decode.migrate_in(ticket, ticket.request_id))
            assert isinstance(end, FinishEvent) and end.usage.completion_tokens == 12
            expected.observe(ticket.kv_bytes, decode.transfer_time_s(ticket.kv_bytes))
        stats = decode.stats()
        assert stats.transfer_bytes_per_s == expected.bytes_per_s > 0.0
        assert stats.qoe is not None and stats.qoe.samples == 20  # 11 tokens each here, after the pull
        assert prefill.stats().transfer_bytes_per_s == 0.0
    finally:
        for b in (prefill, decode):
            await b.stop()
