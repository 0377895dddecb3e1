"""The prefill role in the sim (CAUCHY's disaggregation): the engine cuts each request in the iteration that
samples its first token, and a decode engine resumes it from the cut; the tokens are the unmigrated ones,
none lost or repeated. In virtual time (`SimEngine`) and in real time (`SimBackend`, role "prefill")."""

from __future__ import annotations

import dataclasses

import pytest

from engine_agent.backends.sim import SimBackend
from engine_agent.domain import (
    BackendRequest,
    FinishEvent,
    MigratedEvent,
    RequestId,
    SamplingSpec,
    TokenEvent,
    Usage,
)
from engine_agent.sim.engine import SimEngine
from engine_agent.sim.ticket import cut_from_ticket
from switchyard.clock import MonotonicClock
from switchyard.profiles import get_profile

BASE = get_profile("h100-llama3-8b")


def request(rid: str, prompt_tokens: int, max_tokens: int, *, seed: int | None = None,
            target: int | None = None) -> BackendRequest:
    sampling = SamplingSpec(max_tokens=max_tokens, seed=seed, ignore_eos=target is None)
    return BackendRequest(RequestId(rid), (9,) * prompt_tokens, sampling, target_output_tokens=target)


def run(engine: SimEngine, now_s: float, tokens: dict[str, list[int]],
        finished: dict[str, FinishEvent]) -> tuple[float, list[object]]:
    """Step until idle; (the end time, every hand-off cut in step order)."""
    cuts: list[object] = []
    while engine.has_work():
        result = engine.step(now_s)
        now_s += result.duration_s if result.duration_s > 0 else 1e-3
        for rid, token in result.tokens:
            tokens.setdefault(rid, []).append(token)
        finished.update(result.finished)
        cuts.extend(result.handoffs)
    return now_s, cuts


def test_a_prefill_engine_hands_every_request_off_after_its_first_token() -> None:
    reqs = [request("long", 700, 50), request("short", 30, 20, seed=7), request("eos", 40, 200, target=25),
            request("one", 12, 1)]  # one token in all: it finishes on the prefill engine
    prefill = SimEngine(BASE, handoff=True)
    assert prefill.handoff and not SimEngine(BASE).handoff
    for req in reqs:
        prefill.add_request(req, 0.0)
    tokens: dict[str, list[int]] = {}
    finished: dict[str, FinishEvent] = {}
    end_s, cuts = run(prefill, 0.0, tokens, finished)
    # One token each, then a cut holding the prompt's KV; the one-token request just finished.
    assert {rid: len(t) for rid, t in tokens.items()} == {"long": 1, "short": 1, "eos": 1, "one": 1}
    assert set(finished) == {"one"} and finished["one"].usage == Usage(12, 1)
    by_id = {c.request_id: c for c in cuts}  # type: ignore[attr-defined]
    assert set(by_id) == {"long", "short", "eos"}
    for req in reqs[:3]:
        cut = by_id[req.request_id]
        prompt = len(req.prompt_token_ids)
        kv_bytes = prompt * BASE.model.kv_bytes_per_token
        assert (cut.num_output, cut.kv_tokens, cut.kv_bytes) == (1, prompt, kv_bytes)
    # Nothing is left on the prefill engine: its KV is free and it never ran a decode step.
    stats = prefill.stats(end_s)
    assert (stats.num_running, stats.num_waiting, stats.kv_blocks_free, stats.running_batch_tokens) == (
        0, 0, BASE.kv_blocks_total, 0)

    decode = SimEngine(BASE, seed=5)  # a decode engine's own seed does not matter
    for req in reqs[:3]:
        decode.add_migrated_request(req, by_id[req.request_id], end_s, 0.01)  # type: ignore[arg-type]
    _, more = run(decode, end_s, tokens, finished)
    assert more == []  # a decode engine hands nothing off
    for req in reqs:
        reference = SimEngine(BASE)
        reference.add_request(req, 0.0)
        ref_tokens: dict[str, list[int]] = {}
        ref_finished: dict[str, FinishEvent] = {}
        run(reference, 0.0, ref_tokens, ref_finished)
        rid = req.request_id
        assert tokens[rid] == ref_tokens[rid]
        assert finished[rid].finish_reason == ref_finished[rid].finish_reason
        assert finished[rid].usage == ref_finished[rid].usage


def test_a_request_migrated_onto_a_prefill_engine_decodes_there() -> None:
    source = SimEngine(BASE, handoff=True)
    req = request("r", 64, 30)
    source.add_request(req, 0.0)
    tokens: dict[str, list[int]] = {}
    finished: dict[str, FinishEvent] = {}
    end_s, cuts = run(source, 0.0, tokens, finished)
    other = SimEngine(BASE, handoff=True)  # the fallback when no decode engine is left
    other.add_migrated_request(req, cuts[0], end_s, 0.0)  # type: ignore[arg-type]
    _, again = run(other, end_s, tokens, finished)
    assert again == [] and len(tokens["r"]) == 30 and finished["r"].usage == Usage(64, 30)


def backend(engine_id: str, **kwargs: object) -> SimBackend:
    return SimBackend(BASE, clock=MonotonicClock(), engine_id=engine_id, vocab_size=1000, eos_token_id=2,
                      **kwargs)  # type: ignore[arg-type]


async def test_a_prefill_agent_backend_ends_each_stream_with_a_one_token_ticket() -> None:
    prefill, decode, plain = backend("p", role="prefill"), backend("d", role="decode"), backend("x")
    assert prefill.static.role == "prefill"
    for b in (prefill, decode, plain):
        await b.start()
    try:
        req = request("h-1", 200, 40, seed=3)
        first: list[int] = []
        end: object = None
        async for event in prefill.generate(req):
            if isinstance(event, TokenEvent):
                first.extend(event.token_ids)
            else:
                end = event
        assert isinstance(end, MigratedEvent) and len(first) == 1
        ticket = end.ticket
        assert (list(ticket.output_token_ids), ticket.target, ticket.kv_tokens) == (first, "", 200)
        assert ticket.remaining_tokens == 39
        assert cut_from_ticket(ticket, RequestId("h-1"), backend="sim", model="llama3-8b",
                               vocab_size=1000).num_output == 1
        assert prefill.stats().kv_blocks_free == BASE.kv_blocks_total
        rest: list[int] = []
        finish: object = None
        async for event in decode.migrate_in(ticket, RequestId("h-1")):
            if isinstance(event, TokenEvent):
                rest.extend(event.token_ids)
            else:
                finish = event
        reference: list[int] = []
        async for event in plain.generate(dataclasses.replace(req)):
            if isinstance(event, TokenEvent):
                reference.extend(event.token_ids)
        assert first + rest == reference and len(reference) == 40
        assert isinstance(finish, FinishEvent) and finish.usage == Usage(200, 40)
    finally:
        for b in (prefill, decode, plain):
            await b.stop()


@pytest.mark.parametrize("role", ["decode", "", "cascade-small"])
async def test_other_roles_serve_whole_requests(role: str) -> None:
    engine = backend("e", role=role)
    await engine.start()
    try:
        count = 0
        end: object = None
        async for event in engine.generate(request("w", 50, 12)):
            if isinstance(event, TokenEvent):
                count += len(event.token_ids)
            else:
                end = event
        assert isinstance(end, FinishEvent) and count == 12
    finally:
        await engine.stop()
