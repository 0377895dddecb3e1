"""The stream splice (STAR §5.4): a choice whose engine stream ends with `Migrated` is resumed elsewhere and
the client sees one stream, every token once. Fakes play the engines behind the real app; every fault the
splice handles has a case here: the named target refuses (the policy's next engine resumes), every other
engine refuses (the source resumes), nobody can (one error event, no repeated text), a gap in the positions
(error), duplicates (dropped), the resumed stream failing, a second migration; and resuming without KV: every
engine refuses the KV ticket (recompute anywhere), the target dies after streaming (re-ticket from the relayed
tokens, another engine continues), the re-ticket refused everywhere (one error event)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Any

import orjson
import pytest
from fake_engines import MODEL, FakeEngine, Script, script, serving

from gateway.app import METRICS_KEY
from gateway.domain import (
    Admitted,
    Delta,
    EngineRequest,
    EngineStreamError,
    EngineUnavailable,
    Finished,
    Migrated,
    MigrationTicket,
    StreamEvent,
)
from gateway.engines.base import MigratingClient, RecomputingClient
from gateway.engines.grpc_client import ticket_without_kv
from switchyard.proto_gen import engine_agent_pb2 as pb

CHAT = "/v1/chat/completions"


class MovingEngine(FakeEngine):
    """A fake that also resumes migrated requests (`resume` plays `resume_script`)."""

    def __init__(self, engine_id: str, generate_script: Script, resume_script: Script | None = None) -> None:
        super().__init__(engine_id, generate_script)
        self.resume_script = resume_script
        self.resumed: list[MigrationTicket] = []
        self.released: list[str] = []

    async def migrate_out(self, request_id: str, target: str) -> MigrationTicket:
        raise AssertionError("the splice never cuts")

    async def release(self, request_id: str) -> None:
        self.released.append(request_id)

    def resume(self, ticket: MigrationTicket, request: EngineRequest) -> AsyncIterator[StreamEvent]:
        self.resumed.append(ticket)
        steps = self.bare_script if ticket.kv_tokens == 0 else self.resume_script
        return self._play(steps or script(EngineUnavailable(f"{self.engine_id} refuses")), request)

    bare_script: Script | None = None

    async def _play(self, steps: Script, request: EngineRequest) -> AsyncIterator[StreamEvent]:
        try:
            for step in steps(request):
                if isinstance(step, Exception):
                    raise step
                if isinstance(step, float):
                    continue
                yield step
        finally:
            self.closed_streams += 1


class RecomputingEngine(MovingEngine):
    """A fake that also resumes without KV: `without_kv` records the ids it re-tickets with, and `resume` of a
    ticket without KV plays `bare_script` (none: refuses)."""

    def __init__(self, engine_id: str, generate_script: Script, resume_script: Script | None = None,
                 bare_script: Script | None = None) -> None:
        super().__init__(engine_id, generate_script, resume_script)
        self.bare_script = bare_script
        self.after_cut: list[tuple[int, ...]] = []

    def without_kv(self, ticket: MigrationTicket, after_cut: Sequence[int]) -> MigrationTicket:
        self.after_cut.append(tuple(after_cut))
        return dataclasses.replace(ticket, output_tokens=ticket.output_tokens + len(after_cut), kv_tokens=0,
                                   kv_bytes=0, encoded=b"bare")


def ticket(out: int, target: str = "t", source: str = "s") -> MigrationTicket:
    return MigrationTicket(
        request_id="r1",
        source_engine_id=source,
        target=target,
        output_tokens=out,
        kv_tokens=10,
        kv_bytes=1000,
        encoded=b"opaque",
    )


def tok(text: str, token: int) -> Delta:
    return Delta(text, token_ids=(token,), num_tokens=1)


SOURCE = script(Admitted(5), tok("a", 1), tok("b", 2), Migrated(ticket(2)))
CONTINUATION = script(Admitted(5), tok("c", 3), tok("d", 4), Finished("stop", 5, 4))


async def stream(client: Any) -> tuple[str, list[dict[str, Any]]]:
    """(the content the client saw, every data object)."""
    resp = await client.post(
        CHAT,
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        headers={"x-request-id": "r1"},
    )
    assert resp.status == 200
    objs = [
        orjson.loads(line[6:]) for line in (await resp.read()).split(b"\n\n") if line.startswith(b"data: {")
    ]
    text = "".join(c["delta"].get("content") or "" for o in objs for c in o.get("choices", ()))
    return text, objs


async def migrations(client: Any) -> str:
    return "\n".join(
        line
        for line in (await (await client.get("/metrics")).text()).splitlines()
        if line.startswith("switchyard_migrations_total")
    )


async def test_a_migrated_stream_resumes_on_the_named_target_and_reads_as_one() -> None:
    source = MovingEngine("s", SOURCE)
    target = MovingEngine("t", script(), CONTINUATION)
    assert isinstance(target, MigratingClient)
    async with serving(source, target) as client:
        # The fakes answer in engine-id order under round robin: "s" first.
        text, objs = await stream(client)
        assert text == "abcd"
        assert objs[-1]["usage"]["completion_tokens"] == 4  # the resumed engine's finish counts the request
        assert [t.output_tokens for t in target.resumed] == [2]
        assert 'outcome="resumed"} 1.0' in await migrations(client)
        snapshot_text = await (await client.get("/metrics")).text()
    assert "switchyard_requests_in_flight 0.0" in snapshot_text
    assert source.closed_streams == 1 and target.closed_streams == 1
    assert source.released == []  # the target pulled the KV: the source freed it on its own


async def test_a_refusing_target_falls_back_to_another_engine_then_to_the_source() -> None:
    source = MovingEngine("s", SOURCE, CONTINUATION)
    refusing = MovingEngine("t", script())
    other = MovingEngine("u", script())
    async with serving(source, refusing, other) as client:
        text, _ = await stream(client)
        assert text == "abcd"  # t refused, u refused, the source resumed its own cut
        assert len(refusing.resumed) == 1 and len(other.resumed) == 1 and len(source.resumed) == 1
        assert 'outcome="fallback"} 1.0' in await migrations(client)
        assert source.released == []  # the source resumed its own cut with the KV it held

    fallback = MovingEngine("u", script(), CONTINUATION)
    async with serving(MovingEngine("s", SOURCE), MovingEngine("t", script()), fallback) as client:
        text, _ = await stream(client)
        assert text == "abcd" and len(fallback.resumed) == 1


async def test_when_no_engine_resumes_the_stream_ends_with_one_error_and_no_repeated_text() -> None:
    source = MovingEngine("s", SOURCE)
    async with serving(source, MovingEngine("t", script())) as client:
        text, objs = await stream(client)
        assert text == "ab"
        errors = [o for o in objs if "error" in o]
        assert len(errors) == 1 and "resume" in errors[0]["error"]["message"]
        assert 'outcome="failed"} 1.0' in await migrations(client)
        assert source.released == ["r1"]  # nobody pulled the KV the source holds: freed now, not at the lease


async def test_a_gap_in_the_positions_is_an_error_and_duplicates_are_dropped() -> None:
    gap = script(Admitted(5), tok("a", 1), Migrated(ticket(2)))  # the client has 1 token, the cut says 2
    target = MovingEngine("t", script(), CONTINUATION)
    async with serving(MovingEngine("s", gap), target) as client:
        text, objs = await stream(client)
        assert text == "a" and not target.resumed
        assert "lost" in next(o for o in objs if "error" in o)["error"]["message"]

    early_cut = script(Admitted(5), tok("a", 1), tok("b", 2), Migrated(ticket(1)))  # the client has one more
    replay = script(Admitted(5), tok("b", 2), tok("c", 3), Finished("stop", 5, 3))
    async with serving(MovingEngine("s", early_cut), MovingEngine("t", script(), replay)) as client:
        text, _ = await stream(client)
        assert text == "abc"  # the resumed stream's first token was the client's second: dropped


async def test_a_resumed_stream_that_fails_ends_with_an_error_and_a_second_migration_is_followed() -> None:
    broken = script(Admitted(5), tok("c", 3), EngineStreamError("target died"))
    async with serving(MovingEngine("s", SOURCE), MovingEngine("t", script(), broken)) as client:
        text, objs = await stream(client)
        assert text == "abc" and sum("error" in o for o in objs) == 1

    hop = script(Admitted(5), tok("c", 3), Migrated(ticket(3, target="u", source="t")))
    last = script(Admitted(5), tok("d", 4), Finished("length", 5, 4))
    u = MovingEngine("u", script(), last)
    async with serving(MovingEngine("s", SOURCE), MovingEngine("t", script(), hop), u) as client:
        text, objs = await stream(client)
        assert text == "abcd" and objs[-2]["choices"][0]["finish_reason"] == "length"
        assert [t.output_tokens for t in u.resumed] == [3]
        app = client.server.app
        assert app[METRICS_KEY].migrations.labels("resumed")._value.get() == 2


def test_a_ticket_without_kv_carries_the_relayed_tokens_and_no_kv() -> None:
    message = pb.MigrationTicket(request_id="r1", source_engine_id="s", target="t", backend="sim",
                                 remaining_tokens=10, kv_tokens=12, kv_bytes=1200, transfer_params=b"{}")
    message.output_token_ids.ids.extend([1, 2])
    message.prompt_token_ids.ids.extend([7] * 11)
    original = dataclasses.replace(ticket(2), encoded=message.SerializeToString())
    bare = ticket_without_kv(original, [3, 4, 5])
    assert (bare.output_tokens, bare.kv_tokens, bare.kv_bytes, bare.target) == (5, 0, 0, "t")
    again = pb.MigrationTicket.FromString(bare.encoded)
    assert list(again.output_token_ids.ids) == [1, 2, 3, 4, 5] and again.remaining_tokens == 7
    assert list(again.prompt_token_ids.ids) == [7] * 11 and again.transfer_params == b"{}"
    assert ticket_without_kv(original, []).output_tokens == 2  # recompute at the cut
    with pytest.raises(ValueError, match="exceed"):
        ticket_without_kv(original, list(range(11)))
    with pytest.raises(ValueError, match="not an agent's ticket"):
        ticket_without_kv(dataclasses.replace(original, encoded=b"\xff\xff"), [])


async def test_when_every_engine_refuses_the_kv_the_request_is_recomputed_without_it() -> None:
    source = RecomputingEngine("s", SOURCE)
    target = RecomputingEngine("t", script(), None, CONTINUATION)  # refuses the KV, resumes without it
    assert isinstance(target, RecomputingClient)
    async with serving(source, target) as client:
        text, objs = await stream(client)
        assert text == "abcd" and not any("error" in o for o in objs)
        assert objs[-1]["usage"]["completion_tokens"] == 4
        kinds = [(t.kv_tokens, t.output_tokens) for t in source.resumed + target.resumed]
        assert sorted(kinds) == [(0, 2), (10, 2), (10, 2)]  # both refused the KV; one recomputed
        assert source.after_cut + target.after_cut == [()]  # at the cut: nothing relayed since
        assert source.released == ["r1"]  # resuming without KV: the source's held KV is freed at once


async def test_a_target_that_dies_after_streaming_is_re_ticketed_and_another_engine_continues() -> None:
    dies = script(Admitted(5), tok("c", 3), tok("d", 4), EngineStreamError("target killed"))
    rest = script(Admitted(5), tok("e", 5), Finished("length", 5, 5))
    source = RecomputingEngine("s", SOURCE)  # refuses a ticket without KV
    target = RecomputingEngine("t", script(), dies, rest)  # would resume a re-ticket, but it died
    other = RecomputingEngine("u", script(), None, rest)
    async with serving(source, target, other) as client:
        text, objs = await stream(client)
        assert text == "abcde" and not any("error" in o for o in objs)  # no repeated text, no error
        assert objs[-2]["choices"][0]["finish_reason"] == "length"
        assert objs[-1]["usage"]["completion_tokens"] == 5
        assert [t.kv_tokens for t in target.resumed] == [10]  # the dead engine is not tried again
        assert [(t.kv_tokens, t.output_tokens) for t in other.resumed] == [(0, 4)]
        # The re-ticket: the ticket's 2 tokens plus the 2 the dead target streamed, built by u's client.
        assert other.after_cut == [(3, 4)] and target.after_cut == []
        assert 'outcome="failed"' not in await migrations(client)
        assert source.released == []  # the dead target had pulled the KV before it streamed


async def test_a_re_ticket_refused_everywhere_ends_with_one_error_and_no_repeated_text() -> None:
    dies = script(Admitted(5), tok("c", 3), EngineStreamError("target killed"))
    source, target = RecomputingEngine("s", SOURCE), RecomputingEngine("t", script(), dies)
    async with serving(source, target) as client:
        text, objs = await stream(client)
        assert text == "abc"
        errors = [o for o in objs if "error" in o]
        assert len(errors) == 1 and "resume" in errors[0]["error"]["message"]
        assert [(t.kv_tokens, t.output_tokens) for t in source.resumed] == [(0, 3)]  # the source refused it
        assert 'outcome="failed"} 1.0' in await migrations(client)
