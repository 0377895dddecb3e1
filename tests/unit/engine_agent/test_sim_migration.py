"""Migration in the sim: the engine-level cut and resume (virtual time), refusals, the modelled transfer, and
the backend's ticket (in real time, including a cut while a step is in flight)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random

import pytest

from engine_agent.backends.sim import SimBackend
from engine_agent.domain import (
    BackendRequest,
    FinishEvent,
    MigratedEvent,
    MigrationRefused,
    MigrationStats,
    MigrationTicket,
    RequestId,
    SamplingSpec,
    TokenEvent,
    Usage,
)
from engine_agent.output_text import OutputText
from engine_agent.sim.engine import SimEngine
from engine_agent.sim.migration import MigrationCut
from engine_agent.tokenization import Tokenizer
from switchyard.clock import MonotonicClock
from switchyard.profiles import Profile, get_profile

BASE = get_profile("h100-llama3-8b")
KV_PER_TOKEN = BASE.model.kv_bytes_per_token  # 131072 bytes: 32 layers x 8 KV heads x 128 x (K, V) x bf16


def profile(**changes: object) -> Profile:
    return dataclasses.replace(BASE, **changes)  # type: ignore[arg-type]


def request(rid: str, prompt_tokens: int, max_tokens: int = 64, *, seed: int | None = None,
            target: int | None = None, ignore_eos: bool = True) -> BackendRequest:
    sampling = SamplingSpec(max_tokens=max_tokens, seed=seed, ignore_eos=ignore_eos)
    return BackendRequest(RequestId(rid), (9,) * prompt_tokens, sampling, target_output_tokens=target)


def step_until(engine: SimEngine, now_s: float, tokens: dict[str, list[int]],
               finished: dict[str, FinishEvent], steps: int | None = None) -> float:
    """Step (each step starting when the previous one's output is visible) `steps` times or until idle."""
    done = 0
    while engine.has_work() and (steps is None or done < steps):
        result = engine.step(now_s)
        now_s += result.duration_s if result.duration_s > 0 else 1e-3
        for rid, token in result.tokens:
            tokens.setdefault(rid, []).append(token)
        finished.update(result.finished)
        done += 1
    return now_s


def unmigrated(req: BackendRequest, seed: int = 0) -> tuple[list[int], FinishEvent]:
    engine = SimEngine(BASE, seed=seed)
    engine.add_request(req, 0.0)
    tokens: dict[str, list[int]] = {}
    finished: dict[str, FinishEvent] = {}
    step_until(engine, 0.0, tokens, finished)
    return tokens[req.request_id], finished[req.request_id]


@pytest.mark.parametrize(
    "req",
    [
        request("plain", 100, 64),
        request("seeded", 100, 64, seed=1234),
        request("eos", 40, 200, target=50, ignore_eos=False),  # ends with EOS: finish "stop"
    ],
    ids=["per-id-lcg", "seeded", "stop-at-target"],
)
def test_cut_and_resume_continue_the_unmigrated_token_stream(req: BackendRequest) -> None:
    source, target = SimEngine(BASE), SimEngine(BASE, seed=99)  # the target's own seed does not matter
    source.add_request(req, 0.0)
    tokens: dict[str, list[int]] = {}
    finished: dict[str, FinishEvent] = {}
    now_s = step_until(source, 0.0, tokens, finished, steps=21)  # prefill + 20 decode steps
    before = tokens.pop(req.request_id)
    assert len(before) == 21
    cut = source.migrate_out(req.request_id, now_s)
    prompt = len(req.prompt_token_ids)
    assert (cut.num_output, cut.prompt_len, cut.kv_tokens) == (21, prompt, prompt + 21 - 1)
    assert cut.kv_bytes == cut.kv_tokens * KV_PER_TOKEN
    # The source freed everything at the cut and forgot the request.
    stats = source.stats(now_s)
    assert (stats.kv_blocks_free, stats.num_running, stats.running_batch_tokens) == (
        BASE.kv_blocks_total, 0, 0)
    assert not source.has_work()
    assert source.abort(req.request_id, now_s) is None

    transfer_s = 0.05
    moved = dataclasses.replace(req, request_id=RequestId("moved"))
    target.add_migrated_request(moved, cut, now_s, transfer_s)
    assert target.next_ready_s() == pytest.approx(now_s + transfer_s)
    after_stats = target.stats(now_s)
    assert after_stats.kv_blocks_total - after_stats.kv_blocks_free == -(-cut.kv_tokens // BASE.block_size)
    assert (after_stats.num_waiting, after_stats.pending_prefill_tokens) == (1, 0)
    step_until(target, now_s + transfer_s, tokens, finished)
    after = tokens["moved"]
    reference, reference_finish = unmigrated(req)
    assert before + after == reference
    event = finished["moved"]
    assert event.finish_reason == reference_finish.finish_reason
    assert event.usage == Usage(prompt_tokens=prompt, completion_tokens=len(reference))
    final = target.stats(0.0)
    assert (final.kv_blocks_free, final.kv_blocks_reserved, final.num_waiting) == (BASE.kv_blocks_total, 0, 0)


def test_resumed_request_waits_for_the_transfer_then_computes_one_token() -> None:
    source, target = SimEngine(BASE), SimEngine(BASE)
    source.add_request(request("m", 500, 100), 0.0)
    now_s = step_until(source, 0.0, {}, {}, steps=5)
    cut = source.migrate_out(RequestId("m"), now_s)
    target.add_request(request("other", 20, 100), 10.0)
    target.add_migrated_request(request("m", 500, 100), cut, 10.0, transfer_s=0.2)
    assert target.migration_stats(RequestId("m")) == MigrationStats(504, 0, 504 * KV_PER_TOKEN, 0.2)
    now_s, other_tokens = 10.0, 0
    while now_s < 10.2:  # only the other request runs while the KV is in transit
        result = target.step(now_s)
        assert [rid for rid, _ in result.tokens] == ["other"]
        other_tokens += 1
        now_s += result.duration_s
    result = target.step(now_s)
    assert [rid for rid, _ in result.tokens] == ["other", "m"]
    record = result.record
    # No recompute: "m" joins as a decode of its last sampled token (context 505), next to the other decode.
    assert (record.num_prefill_seqs, record.num_decode_seqs, record.num_decode_tokens) == (0, 2, 2)
    assert record.batch_context_tokens == (20 + other_tokens) + 505
    assert target.stats(now_s).running_batch_tokens == record.batch_context_tokens


def test_resume_queues_until_blocks_are_free() -> None:
    small = profile(num_gpu_blocks_override=12, max_batched_tokens=512)
    source, target = SimEngine(small), SimEngine(small)
    source.add_request(request("m", 100, 40), 0.0)
    now_s = step_until(source, 0.0, {}, {}, steps=3)
    cut = source.migrate_out(RequestId("m"), now_s)  # 102 KV tokens: 7 blocks
    target.add_request(request("big", 120, 20), 0.0)  # holds 8 blocks, then 9
    step_until(target, 0.0, {}, {}, steps=2)
    target.add_migrated_request(request("m", 100, 40), cut, 1.0, transfer_s=0.0)
    stats = target.stats(1.0)
    assert (stats.num_waiting, stats.kv_blocks_reserved, stats.kv_blocks_free) == (1, 7, 12 - 8)
    assert target.next_ready_s() is None and target.migration_stats(RequestId("m")) is None
    tokens: dict[str, list[int]] = {}
    finished: dict[str, FinishEvent] = {}
    step_until(target, 1.0, tokens, finished)
    assert len(tokens["big"]) == 18 and len(tokens["m"]) == 40 - 3
    assert finished["m"].usage == Usage(100, 40)
    assert target.stats(0.0).kv_blocks_free == 12


def test_refusals() -> None:
    engine = SimEngine(profile(max_batched_tokens=64, num_gpu_blocks_override=40))
    with pytest.raises(MigrationRefused, match="not on this engine"):
        engine.migrate_out(RequestId("nope"), 0.0)
    engine.add_request(request("long-prefill", 200), 0.0)  # 64-token chunks: prefill over 4 steps
    engine.add_request(request("waiting", 10), 0.0)
    engine.step(0.0)
    with pytest.raises(MigrationRefused, match="in prefill"):
        engine.migrate_out(RequestId("long-prefill"), 0.0)
    with pytest.raises(MigrationRefused, match="waiting for its prefill"):
        engine.migrate_out(RequestId("waiting"), 0.0)
    # Finished requests are gone.
    engine.add_request(request("short", 5, 1), 0.0)
    finished: dict[str, FinishEvent] = {}
    step_until(engine, 0.0, {}, finished)
    assert "short" in finished
    with pytest.raises(MigrationRefused, match="unknown or finished"):
        engine.migrate_out(RequestId("short"), 0.0)
    # A preempted request holds no KV.
    tight = SimEngine(profile(num_gpu_blocks_override=8, max_batched_tokens=512))
    tight.add_request(request("a", 48, 40), 0.0)
    tight.add_request(request("b", 48, 40), 0.0)
    step_until(tight, 0.0, {}, {}, steps=18)
    assert tight.stats(0.0).num_preempted_total == 1
    with pytest.raises(MigrationRefused, match="preempted"):
        tight.migrate_out(RequestId("b"), 0.0)
    # A request still loading its migrated KV cannot move again yet.
    source, target = SimEngine(BASE), SimEngine(BASE)
    source.add_request(request("m", 30), 0.0)
    step_until(source, 0.0, {}, {}, steps=3)
    cut = source.migrate_out(RequestId("m"), 1.0)
    target.add_migrated_request(request("m", 30), cut, 1.0, transfer_s=1.0)
    with pytest.raises(MigrationRefused, match="still loading"):
        target.migrate_out(RequestId("m"), 1.5)
    # Bad cuts: duplicate id, mismatched prompt, nothing left to do.
    with pytest.raises(MigrationRefused, match="duplicate"):
        target.add_migrated_request(request("m", 30), cut, 1.0, transfer_s=0.0)
    with pytest.raises(MigrationRefused, match="does not match"):
        target.add_migrated_request(request("m2", 31), cut, 1.0, transfer_s=0.0)
    done = dataclasses.replace(cut, num_output=64, kv_tokens=30 + 64 - 1, target_len=64)
    with pytest.raises(MigrationRefused, match="nothing left"):
        target.add_migrated_request(request("m3", 30), done, 1.0, transfer_s=0.0)
    # Aborting a loading request frees its blocks.
    assert target.abort(RequestId("m"), 1.5) is not None
    stats = target.stats(1.5)
    assert (stats.kv_blocks_free, stats.num_waiting, stats.kv_blocks_reserved) == (BASE.kv_blocks_total, 0, 0)


def test_preempted_migrant_reports_recompute() -> None:
    small = profile(num_gpu_blocks_override=9, max_batched_tokens=512)
    source, target = SimEngine(small), SimEngine(small)
    source.add_request(request("m", 60, 60), 0.0)
    now_s = step_until(source, 0.0, {}, {}, steps=4)
    cut = source.migrate_out(RequestId("m"), now_s)  # 63 KV tokens: 4 blocks
    target.add_request(request("first", 60, 60), 0.0)
    step_until(target, 0.0, {}, {}, steps=1)  # 4 blocks
    target.add_migrated_request(request("m", 60, 60), cut, 0.0, transfer_s=0.0)
    tokens: dict[str, list[int]] = {}
    finished: dict[str, FinishEvent] = {}
    now_s = 0.0
    while not target.stats(0.0).num_preempted_total:  # both grow into the last free blocks
        now_s = step_until(target, now_s, tokens, finished, steps=1)
    stats = target.migration_stats(RequestId("m"))
    assert stats is not None and stats.kv_tokens_loaded == 63 and stats.kv_tokens_recomputed >= 63
    step_until(target, now_s, tokens, finished)
    assert finished["m"].usage == Usage(60, 60) and len(tokens["m"]) == 56
    assert target.stats(0.0).kv_blocks_free == 9


def test_cut_is_exact_about_state() -> None:
    engine = SimEngine(BASE)
    engine.add_request(request("m", 33, 10), 0.0)
    step_until(engine, 0.0, {}, {}, steps=4)
    cut = engine.migrate_out(RequestId("m"), 0.0)
    assert cut == MigrationCut(RequestId("m"), 33, 4, 10, False, cut.lcg_state, 36, 36 * KV_PER_TOKEN)
    assert engine.decoding_requests() == ([], [], [], [])


# -- backend (real time) ---------------------------------------------------------------------------------


def backend(engine_id: str, **kwargs: object) -> SimBackend:
    return SimBackend(BASE, clock=MonotonicClock(), engine_id=engine_id, vocab_size=1000, eos_token_id=2,
                      **kwargs)  # type: ignore[arg-type]


async def collect(events: object) -> tuple[list[int], FinishEvent | MigratedEvent]:
    ids: list[int] = []
    async for event in events:  # type: ignore[attr-defined]
        if isinstance(event, TokenEvent):
            ids.extend(event.token_ids)
        else:
            return ids, event
    raise AssertionError("stream ended without a finish")


async def test_backend_cut_in_flight_then_resume_elsewhere() -> None:
    a, b, c = backend("a"), backend("b", kv_link_gbps=80.0, kv_transfer_latency_s=0.01), backend("c")
    for engine in (a, b, c):
        await engine.start()
    try:
        req = request("mig-1", 300, 80)
        received: list[int] = []
        stream = a.generate(req)
        ticket: MigrationTicket | None = None
        end: FinishEvent | MigratedEvent | None = None
        async for event in stream:
            if isinstance(event, TokenEvent):
                received.extend(event.token_ids)
                if len(received) >= 10 and ticket is None:
                    # The loop has already computed the next step (it sleeps until that step is due).
                    ticket = await a.migrate_out(RequestId("mig-1"), "b:1")
                    assert len(ticket.output_token_ids) == len(received) + 1
                    assert not await a.abort(RequestId("mig-1"))  # cut: nothing to abort
                    with pytest.raises(MigrationRefused):
                        await a.migrate_out(RequestId("mig-1"), "b:1")
            else:
                end = event
        assert isinstance(end, MigratedEvent) and ticket is not None and end.ticket == ticket
        assert list(ticket.output_token_ids) == received
        assert ticket.remaining_tokens == 80 - len(received)
        assert (ticket.kv_tokens, ticket.kv_bytes) == (300 + len(received) - 1,
                                                       (300 + len(received) - 1) * KV_PER_TOKEN)
        assert ticket.cut_timestamp_s > 0 and ticket.backend == "sim" and ticket.model == "llama3-8b"
        params = json.loads(ticket.transfer_params)
        assert params["remaining_output_tokens"] == 80 - len(received)
        assert a.stats().kv_blocks_free == BASE.kv_blocks_total

        assert b.migration_stats(RequestId("mig-1")) is None
        continued, finish = await collect(b.migrate_in(ticket, RequestId("mig-1")))
        assert isinstance(finish, FinishEvent) and finish.finish_reason == "length"
        assert finish.usage == Usage(300, 80)
        transfer_s = 0.01 + ticket.kv_bytes / 10e9
        assert b.migration_stats(RequestId("mig-1")) == MigrationStats(ticket.kv_tokens, 0, ticket.kv_bytes,
                                                                       pytest.approx(transfer_s))
        reference, ref_finish = await collect(c.generate(req))
        assert received + continued == reference
        assert isinstance(ref_finish, FinishEvent) and ref_finish.usage == finish.usage
        for engine in (a, b, c):
            assert engine.stats().kv_blocks_free == BASE.kv_blocks_total
    finally:
        for engine in (a, b, c):
            await engine.stop()


async def test_backend_migrate_in_refusals() -> None:
    a, b = backend("a"), backend("b")
    other_model = SimBackend(get_profile("h100-qwen2.5-14b"), clock=MonotonicClock(), engine_id="q",
                             vocab_size=1000, eos_token_id=2)
    await a.start()
    await b.start()
    try:
        with pytest.raises(MigrationRefused, match="unknown or finished"):
            await a.migrate_out(RequestId("none"), "x")
        stream = a.generate(request("r", 50, 200))
        got = 0
        ticket = None
        async for event in stream:
            if isinstance(event, TokenEvent):
                got += len(event.token_ids)
                if got >= 3 and ticket is None:
                    ticket = await a.migrate_out(RequestId("r"), "b")
        assert ticket is not None
        with pytest.raises(MigrationRefused, match="model"):
            other_model.migrate_in(ticket, RequestId("r"))
        with pytest.raises(MigrationRefused, match="backend"):
            b.migrate_in(dataclasses.replace(ticket, backend="vllm"), RequestId("r"))
        with pytest.raises(MigrationRefused, match="transfer_params"):
            b.migrate_in(dataclasses.replace(ticket, transfer_params=b"{}"), RequestId("r"))
        with pytest.raises(MigrationRefused, match="output tokens"):
            b.migrate_in(dataclasses.replace(ticket, output_token_ids=ticket.output_token_ids[:-1]),
                         RequestId("r"))
        # A ticket resumes once per id; a second resume under the same id while running is refused.
        first = b.migrate_in(ticket, RequestId("r"))
        first_event = await anext(first)
        assert isinstance(first_event, TokenEvent)
        with pytest.raises(MigrationRefused, match="already running"):
            b.migrate_in(ticket, RequestId("r"))
        await first.aclose()  # type: ignore[attr-defined]
        await asyncio.sleep(0.01)
        assert b.stats().kv_blocks_free == BASE.kv_blocks_total and b.stats().num_running == 0
    finally:
        await a.stop()
        await b.stop()


# -- text across a cut (the agent service's text state) ----------------------------------------------------


def _source_text(text: OutputText, chunks: list[tuple[int, ...]], stops_active: bool) -> str:
    """What the service releases for a stream delivered in `chunks` (token by token when stops are set)."""
    out, position = [], 0
    for chunk in chunks:
        if stops_active:
            out.extend(text.add(chunk[k : k + 1], position + k) for k in range(len(chunk)))
        else:
            out.append(text.add(chunk, position))
        position += len(chunk)
    return "".join(out)


@pytest.mark.parametrize("stops", [[], ["zzzz-never"]], ids=["no-stops", "stops"])
def test_text_across_a_cut_equals_the_unmigrated_text(stops: list[str]) -> None:
    tokenizer = Tokenizer.load_sim()
    sampling = SamplingSpec(max_tokens=400, ignore_eos=True)
    engine = SimEngine(BASE, vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eos_token_id,
                       special_token_ids=tokenizer.special_token_ids)
    engine.add_request(BackendRequest(RequestId("text"), (100,) * 10, sampling), 0.0)
    tokens: dict[str, list[int]] = {}
    step_until(engine, 0.0, tokens, {})
    ids = tuple(tokens["text"])
    full = OutputText(tokenizer, stops, sampling)
    expected = _source_text(full, [ids], bool(stops)) + full.finish()
    # Tokens that end mid-character: a group of tokens ending with one releases nothing, not even the complete
    # text before it; a cut right after such a group is where the source must catch up.
    partial = [i for i in range(len(ids) - 1) if tokenizer.decode([ids[i]]).endswith("\ufffd")]
    assert len(partial) >= 3
    rng = random.Random(0)
    cases: list[tuple[int, list[tuple[int, ...]]]] = [
        (i + 1, [ids[k : k + 1] for k in range(i - 1)] + [ids[i - 1 : i + 1]]) for i in partial if i > 0
    ]
    for _ in range(60):
        cut = rng.randrange(1, len(ids))
        chunks: list[tuple[int, ...]] = []
        k = 0
        while k < cut:  # the source's deliveries: groups of 1-4 tokens
            size = min(rng.randint(1, 4), cut - k)
            chunks.append(ids[k : k + size])
            k += size
        cases.append((cut, chunks))
    caught_up = 0
    for cut, chunks in cases:
        source = OutputText(tokenizer, stops, sampling)
        released = _source_text(source, chunks, bool(stops))
        catch_up = source.cut(ids[:cut])
        caught_up += bool(catch_up)
        target = OutputText(tokenizer, stops, sampling)
        target.prime(ids[:cut])
        rest = target.add(ids[cut:], cut) + target.finish()
        assert released + catch_up + rest == expected, cut
    # Token-by-token delivery (stops set) never needs a catch-up; grouped delivery does after a partial token.
    assert caught_up == (0 if stops else len([i for i in partial if i > 0]))


# -- resuming without KV (recompute; the gateway's re-ticket) -----------------------------------------------


@pytest.mark.parametrize("relayed_after_cut", [0, 9], ids=["at-the-cut", "re-ticket"])
def test_a_cut_without_kv_recomputes_and_continues_the_unmigrated_stream(relayed_after_cut: int) -> None:
    req = request("r", 100, 64, seed=7)
    reference, reference_finish = unmigrated(req)
    source, target = SimEngine(BASE), SimEngine(BASE, seed=5)
    source.add_request(req, 0.0)
    tokens: dict[str, list[int]] = {}
    now_s = step_until(source, 0.0, tokens, {}, steps=21)
    cut = source.migrate_out(req.request_id, now_s)
    # A target that died had streamed `relayed_after_cut` more tokens, which the client has.
    extra = tuple(reference[21 : 21 + relayed_after_cut])
    bare = dataclasses.replace(cut, kv_tokens=0, kv_bytes=0, after_cut=extra)
    target.add_migrated_request(req, bare, now_s, transfer_s=0.0)
    assert target.stats(now_s).pending_prefill_tokens == 100 + 21 + relayed_after_cut
    first = target.step(now_s)
    # One prefill of prompt + every output token (timed by the performance model), then its next token.
    record = first.record
    assert (record.num_prefill_seqs, record.num_prefill_tokens) == (1, 100 + 21 + relayed_after_cut)
    assert first.duration_s > 0 and [rid for rid, _ in first.tokens] == ["r"]
    finished: dict[str, FinishEvent] = {}
    after = [first.tokens[0][1]]
    tokens = {}
    step_until(target, now_s + first.duration_s, tokens, finished)
    after += tokens["r"]
    assert reference[:21] + list(extra) + after == reference
    assert finished["r"].usage == reference_finish.usage
    stats = target.migration_stats(RequestId("r"))
    assert stats is None  # finished: the engine forgot it (the backend keeps its own record)
    assert target.stats(0.0).kv_blocks_free == BASE.kv_blocks_total


def test_a_re_ticket_whose_tokens_the_generator_does_not_draw_is_refused() -> None:
    req = request("r", 50, 64)
    reference, _ = unmigrated(req)
    source, target = SimEngine(BASE), SimEngine(BASE)
    source.add_request(req, 0.0)
    now_s = step_until(source, 0.0, {}, {}, steps=11)
    cut = source.migrate_out(req.request_id, now_s)
    wrong = (*reference[11:14], reference[14] + 1)
    with pytest.raises(MigrationRefused, match="output token 15 .* not the one"):
        target.add_migrated_request(req, dataclasses.replace(cut, kv_tokens=0, kv_bytes=0, after_cut=wrong),
                                    now_s, 0.0)
    with pytest.raises(MigrationRefused, match="cannot carry output tokens"):
        target.check_migrated_request(req, dataclasses.replace(cut, after_cut=tuple(reference[11:13])), 0.0)
    with pytest.raises(MigrationRefused, match="nothing left"):
        target.check_migrated_request(
            req, dataclasses.replace(cut, kv_tokens=0, kv_bytes=0, after_cut=tuple(reference[11:])), 0.0)
    assert not target.has_work() and target.stats(now_s).kv_blocks_free == BASE.kv_blocks_total


async def test_backend_resumes_a_ticket_without_kv_carrying_more_tokens_than_its_cut() -> None:
    a, b, c = backend("a"), backend("b", kv_link_gbps=80.0, kv_transfer_latency_s=0.5), backend("c")
    for engine in (a, b, c):
        await engine.start()
    try:
        req = request("re-1", 200, 60, seed=3)
        reference, ref_finish = await collect(c.generate(req))
        received: list[int] = []
        ticket: MigrationTicket | None = None
        async for event in a.generate(req):
            if isinstance(event, TokenEvent):
                received.extend(event.token_ids)
                if len(received) >= 8 and ticket is None:
                    ticket = await a.migrate_out(RequestId("re-1"), "b")
        assert ticket is not None and received == list(ticket.output_token_ids)
        relayed = tuple(reference[: len(received) + 6])  # a target streamed 6 more tokens, then died
        bare = dataclasses.replace(ticket, output_token_ids=relayed, remaining_tokens=60 - len(relayed),
                                   kv_tokens=0, kv_bytes=0)
        with pytest.raises(MigrationRefused, match="only a ticket without KV"):
            b.migrate_in(dataclasses.replace(bare, kv_tokens=ticket.kv_tokens), RequestId("re-1"))
        wrong = dataclasses.replace(bare, output_token_ids=(*relayed[:-1], relayed[-1] + 1))
        with pytest.raises(MigrationRefused, match="not the one"):
            b.migrate_in(wrong, RequestId("re-1"))
        continued, finish = await collect(b.migrate_in(bare, RequestId("re-1")))
        assert list(relayed) + continued == reference
        assert isinstance(finish, FinishEvent) and isinstance(ref_finish, FinishEvent)
        assert finish.usage == ref_finish.usage == Usage(200, 60)
        # No transfer (the 0.5 s latency is not paid): the prompt and output were recomputed.
        assert b.migration_stats(RequestId("re-1")) == MigrationStats(0, 200 + len(relayed) - 1, 0, 0.0)
        for engine in (a, b, c):
            assert engine.stats().kv_blocks_free == BASE.kv_blocks_total
    finally:
        for engine in (a, b, c):
            await engine.stop()
