"""`AgentSession` batching: one message per write, at most one delta per request per batch, order kept."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import grpc

from engine_agent.session import AgentSession, StreamRefused
from switchyard.proto_gen import engine_agent_pb2 as pb


class ScriptedHost:
    """Streams `tokens[rid]` one token per event, yielding to the loop between events."""

    def __init__(self, tokens: dict[str, list[int]], *, refuse: frozenset[str] = frozenset()) -> None:
        self.tokens = tokens
        self.refuse = refuse
        self.closed: list[str] = []
        self.changed = asyncio.Condition()

    def open_generate(self, request: pb.GenerateRequest) -> str:
        if request.request_id in self.refuse:
            raise StreamRefused(grpc.StatusCode.UNAVAILABLE, "draining")
        return request.request_id

    @contextlib.asynccontextmanager
    async def serving(self, rid: str) -> AsyncGenerator[AsyncIterator[pb.GenerateEvent], None]:
        async def events() -> AsyncIterator[pb.GenerateEvent]:
            yield pb.GenerateEvent(admitted=pb.Admitted(prompt_tokens=1))
            for token in self.tokens[rid]:
                await asyncio.sleep(0)
                yield pb.GenerateEvent(delta=pb.TokenDelta(token_ids=[token], text=f"<{token}>"))
            yield pb.GenerateEvent(finished=pb.Finished(finish_reason="length"))

        try:
            yield events()
        finally:
            self.closed.append(rid)
            async with self.changed:
                self.changed.notify_all()

    async def wait_closed(self, *rids: str) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: all(r in self.closed for r in rids))


class SlowContext:
    """A call whose writes take a few loop turns each (a busy connection): events pile up between them."""

    def __init__(self, turns_per_write: int) -> None:
        self.turns = turns_per_write
        self.written: list[pb.SessionDown] = []
        self.wrote = asyncio.Event()

    async def write(self, message: pb.SessionDown) -> None:
        self.written.append(message)
        self.wrote.set()
        for _ in range(self.turns):
            await asyncio.sleep(0)


async def _requests(ups: list[pb.SessionUp], hold: asyncio.Event) -> AsyncIterator[pb.SessionUp]:
    for up in ups:
        yield up
    await hold.wait()  # the client keeps the call open until told


def _open(*rids: str) -> pb.SessionUp:
    up = pb.SessionUp()
    for k, rid in enumerate(rids, start=1):
        up.open.add(tag=k, request=pb.GenerateRequest(request_id=rid))
    return up


def _replay(written: list[pb.SessionDown]) -> dict[int, list[Any]]:
    per_tag: dict[int, list[Any]] = {}
    for down in written:
        tags_in_batch: list[int] = []
        for tagged in down.events:
            kind = tagged.event.WhichOneof("event")
            if kind == "delta":
                assert tagged.tag not in tags_in_batch, "two deltas of one request in one batch"
                tags_in_batch.append(tagged.tag)
                per_tag.setdefault(tagged.tag, []).extend(tagged.event.delta.token_ids)
                per_tag.setdefault(-tagged.tag, []).append(tagged.event.delta.text)
            else:
                per_tag.setdefault(tagged.tag, []).append(kind)
        for end in down.ends:
            per_tag.setdefault(end.tag, []).append(("end", end.code, end.message))
    return per_tag


async def test_events_are_batched_merged_and_in_order() -> None:
    rng = random.Random(7)
    tokens = {f"r{k}": [rng.randrange(1000) for _ in range(rng.randrange(1, 60))] for k in range(1, 9)}
    host = ScriptedHost(tokens)
    context = SlowContext(turns_per_write=5)
    hold = asyncio.Event()
    session = AgentSession(host, context)  # type: ignore[arg-type]
    run = asyncio.create_task(session.run(_requests([_open(*tokens)], hold)))
    await asyncio.wait_for(host.wait_closed(*tokens), 10)
    for _ in range(20):
        await asyncio.sleep(0)
    hold.set()
    await run
    per_tag = _replay(context.written)
    for k, rid in enumerate(tokens, start=1):
        events = per_tag[k]
        assert events[0] == "admitted" and events[-1] == "finished"
        assert events[1:-1] == tokens[rid]  # every token once, in order
        assert "".join(per_tag[-k]) == "".join(f"<{t}>" for t in tokens[rid])
    total_events = sum(len(v) + 2 for v in tokens.values())
    assert len(context.written) < total_events / 4  # batching happened


async def test_refused_and_cancelled_requests() -> None:
    host = ScriptedHost({"ok": [1, 2, 3], "long": list(range(10_000))}, refuse=frozenset({"no"}))
    context = SlowContext(turns_per_write=0)
    hold = asyncio.Event()

    async def requests() -> AsyncIterator[pb.SessionUp]:
        yield _open("ok", "no", "long")
        while not any(t.tag == 3 and t.event.HasField("delta") for d in context.written for t in d.events):
            await context.wrote.wait()
            context.wrote.clear()
        yield pb.SessionUp(cancel=[3])  # "long" is streaming: the client no longer wants it
        await hold.wait()

    session = AgentSession(host, context)  # type: ignore[arg-type]
    run = asyncio.create_task(session.run(requests()))
    await asyncio.wait_for(host.wait_closed("ok", "long"), 10)
    for _ in range(5):
        await asyncio.sleep(0)
    hold.set()
    await run
    per_tag = _replay(context.written)
    assert per_tag[1] == ["admitted", 1, 2, 3, "finished"]
    assert per_tag[2] == [("end", grpc.StatusCode.UNAVAILABLE.value[0], "draining")]
    long = per_tag[3]
    assert long[0] == "admitted" and long[1:] == list(range(len(long) - 1))  # in order, then nothing
    assert len(long) - 1 < 10_000


async def test_call_ending_closes_open_requests() -> None:
    host = ScriptedHost({"long": list(range(100_000))})
    context = SlowContext(turns_per_write=1)
    hold = asyncio.Event()
    session = AgentSession(host, context)  # type: ignore[arg-type]
    run = asyncio.create_task(session.run(_requests([_open("long")], hold)))
    await asyncio.wait_for(context.wrote.wait(), 10)
    run.cancel()  # what grpc does when the client cancels the call
    with contextlib.suppress(asyncio.CancelledError):
        await run
    assert host.closed == ["long"]
