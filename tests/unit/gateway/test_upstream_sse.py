"""The OpenAI upstream client's fast path: the incremental SSE parser (bytes in, events out, however the body
is cut into reads) and the pooled connection (kept alive, TCP_NODELAY)."""

from __future__ import annotations

import orjson
import pytest
from aiohttp.test_utils import TestServer
from sockets import tcp_nodelay_of_socket
from test_openai_upstream import CHAT, USAGE, Upstream, chat_chunk, sse

from gateway.domain import Delta, EngineEvent, EngineStreamError, Finished
from gateway.engines.openai_upstream import OpenAIUpstreamClient, SseChunkParser

SSE_BODY = (
    b": a comment\r\n"
    b"event: message\r\n"
    + sse(chat_chunk()).replace(b"\n", b"\r\n")
    + sse(chat_chunk("Hel"))
    + b"data:" + orjson.dumps(chat_chunk('lo "w\\orld" \u00e9\U0001f600')) + b"\n\n"
    + sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
    + sse(USAGE)
    + sse("[DONE]")
    + b"data: {not json, after [DONE]: ignored}\n\n"
)
SSE_EVENTS = [
    Delta(text="Hel", num_tokens=1),
    Delta(text='lo "w\\orld" \u00e9\U0001f600', num_tokens=1),
    Finished(finish_reason="length", prompt_tokens=7, completion_tokens=2, cached_tokens=4),
]


def parse_in_pieces(body: bytes, size: int) -> tuple[list[EngineEvent], SseChunkParser]:
    parser = SseChunkParser("up")
    events: list[EngineEvent] = []
    for i in range(0, len(body), size):
        events += parser.feed(body[i : i + size])
    events += parser.end()
    return events, parser


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, len(SSE_BODY)])
def test_the_parse_is_independent_of_how_the_body_is_cut(size: int) -> None:
    events, parser = parse_in_pieces(SSE_BODY, size)
    assert parser.done and parser.error is None
    assert [*events, parser.finished()] == SSE_EVENTS


def test_a_last_line_without_newline_counts() -> None:
    body = sse(chat_chunk("a")) + b"data: " + orjson.dumps(chat_chunk("b", finish="stop"))
    events, parser = parse_in_pieces(body, 5)
    assert [*events, parser.finished()] == [
        Delta(text="a", num_tokens=1),
        Delta(text="b", num_tokens=1),
        Finished(finish_reason="stop", prompt_tokens=0, completion_tokens=2),
    ]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (b"data: {not json\n\n", "bad SSE chunk"),
        (b"data: [1, 2]\n\n", "bad SSE chunk"),
        (sse({"error": {"message": "engine died"}}), "engine died"),
    ],
)
def test_an_error_stops_the_parse_after_the_deltas_before_it(bad: bytes, message: str) -> None:
    events, parser = parse_in_pieces(sse(chat_chunk("a")) + bad + sse(chat_chunk("b", finish="stop")), 1000)
    assert events == [Delta(text="a", num_tokens=1)]
    assert parser.error is not None and message in str(parser.error)


def test_no_finish_and_no_done_is_a_stream_error() -> None:
    _, parser = parse_in_pieces(sse(chat_chunk("a")), 1000)
    with pytest.raises(EngineStreamError, match="ended without a finish"):
        parser.finished()




async def test_upstream_connections_stay_pooled_with_tcp_nodelay() -> None:
    fake = Upstream()
    fake.gate.set()
    server = TestServer(fake.app)
    await server.start_server()
    client = OpenAIUpstreamClient(str(server.make_url("")))
    try:
        for _ in range(3):
            events = [e async for e in client.generate(CHAT)]
            assert isinstance(events[-1], Finished)
        assert len(set(fake.peers)) == 1  # one kept-alive connection served all three
        # Still open on our side between requests, with TCP_NODELAY.
        assert tcp_nodelay_of_socket(local=fake.peers[0]) != 0
    finally:
        await client.close()
        await server.close()
