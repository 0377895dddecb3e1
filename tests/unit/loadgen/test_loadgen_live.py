"""Live replay against an in-process fake OpenAI server with scripted chunk timing.

Timing checks are only the ones a loaded machine cannot break: each scripted delay is a lower bound of what
loadgen measures, and the first token, the gaps and the end add up. How far above the script loadgen's
figures land (its measurement lag) is wall-clock noise, measured by benchmarks/gateway_overhead.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from loadgen_testkit import serving

from engine_agent.tokenization import Tokenizer
from loadgen.cli import main
from loadgen.datasets import Request, text_request
from loadgen.live import (
    EngineTokenizer,
    LiveOptions,
    TargetUnreachableError,
    chunk_content,
    fetch_models,
    prepare_requests,
    request_body,
    run_live,
)
from loadgen.metrics import summarize
from loadgen.results import read_results

FIXTURE_DATA = Path(__file__).resolve().parents[2] / "fixtures" / "data"

FIRST_S = 0.2  # scripted delay before the first content chunk
GAP_S = 0.1  # scripted delay between content chunks
USAGE_TOKENS = 17  # what the usage chunk reports (differs from the 4 content chunks on purpose)


@dataclass
class FakeServer:
    """An OpenAI streaming endpoint: role chunk at once, then 4 content chunks (one empty delta between),
    a finish chunk, a usage chunk and [DONE]. A prompt containing "fail500" gets HTTP 500, "midstream" an
    error event after one chunk. Records bodies and the peak number of concurrent requests."""

    first_s: float = FIRST_S
    gap_s: float = GAP_S
    bodies: list[dict[str, Any]] = field(default_factory=list)
    active: int = 0
    peak: int = 0

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        text = orjson.dumps(body.get("messages") or body.get("prompt")).decode()
        if "fail500" in text:
            return web.json_response({"error": {"message": "boom", "type": "server_error"}}, status=500)
        chat = request.path.endswith("/chat/completions")
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)

            async def send(doc: dict[str, Any]) -> None:
                await resp.write(b"data: " + orjson.dumps(doc) + b"\n\n")

            def piece(content: str | None, finish: str | None = None) -> dict[str, Any]:
                choice = ({"index": 0, "delta": {} if content is None else {"content": content},
                           "finish_reason": finish} if chat else
                          {"index": 0, "text": content or "", "finish_reason": finish})
                return {"choices": [choice], "usage": None}

            if chat:
                await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            await asyncio.sleep(self.first_s)
            for i in range(4):
                if i:
                    await asyncio.sleep(self.gap_s)
                await send(piece(f" tok{i}"))
                if i == 1:
                    await send(piece(None if chat else ""))  # an empty delta: not a token
                if i == 0 and "midstream" in text:
                    await send({"error": {"message": "engine died", "type": "server_error"}})
                    return resp
            await send(piece(None, "length"))
            await send({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": USAGE_TOKENS,
                                                 "total_tokens": 5 + USAGE_TOKENS}})
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            self.active -= 1


@pytest.fixture
async def fake() -> AsyncIterator[tuple[FakeServer, str]]:
    server = FakeServer()
    app = web.Application()
    app.router.add_get("/v1/models", server.models)
    app.router.add_post("/v1/chat/completions", server.stream)
    app.router.add_post("/v1/completions", server.stream)
    async with serving(app) as url:
        yield server, url


def chat(rid: str, text: str = "hello", output_tokens: int | None = 4) -> Request:
    return text_request(rid, text, tokenizer=None, output_tokens=output_tokens)


def completion(rid: str, text: str = "hello", output_tokens: int | None = 4) -> Request:
    return Request(request_id=rid, prompt_tokens=3, prompt=text, output_tokens=output_tokens)


async def test_ttft_itl_and_usage_are_measured_per_content_chunk(fake: tuple[FakeServer, str]) -> None:
    server, url = fake
    result = await run_live([(0.0, chat("c")), (0.0, completion("p"))], LiveOptions(url, "fake-model"))
    assert [o.request_id for o in result.outcomes] == ["c", "p"]
    for outcome in result.outcomes:
        assert outcome.success, outcome.error
        assert outcome.ttft_s is not None and FIRST_S <= outcome.ttft_s
        assert len(outcome.itl_s) == 3  # 4 content chunks; role, empty and finish chunks are not tokens
        assert all(gap >= 0 for gap in outcome.itl_s)
        # first token, then the gaps, then the rest of the stream: TTFT is not taken at the end of the stream
        assert outcome.e2e_s is not None and outcome.ttft_s + sum(outcome.itl_s) <= outcome.e2e_s
        assert outcome.e2e_s >= FIRST_S + 3 * GAP_S
        assert outcome.output_tokens == USAGE_TOKENS and outcome.prompt_tokens == 5
    summary = summarize(result.outcomes, result.duration_s)
    assert summary.completed == 2 and summary.total_output_tokens == 2 * USAGE_TOKENS


async def test_request_bodies_follow_the_trace(fake: tuple[FakeServer, str]) -> None:
    server, url = fake
    await run_live([(0.0, chat("c", output_tokens=4)), (0.0, completion("p", output_tokens=None))],
                   LiveOptions(url, "fake-model"))
    by_kind = {("messages" in b): b for b in server.bodies}
    assert by_kind[True]["messages"] == [{"role": "user", "content": "hello"}]
    assert by_kind[True]["max_tokens"] == 4 and by_kind[True]["ignore_eos"] is True
    assert by_kind[False]["prompt"] == "hello" and "max_tokens" not in by_kind[False]
    for body in server.bodies:
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["model"] == "fake-model"


async def test_failures_are_counted_not_raised(fake: tuple[FakeServer, str]) -> None:
    _, url = fake
    plan = [(0.0, chat("ok")), (0.0, chat("bad", "fail500")), (0.0, chat("cut", "midstream"))]
    result = await run_live(plan, LiveOptions(url, "fake-model"))
    by_id = {o.request_id: o for o in result.outcomes}
    assert by_id["ok"].success
    assert not by_id["bad"].success and by_id["bad"].error is not None and "HTTP 500" in by_id["bad"].error
    assert not by_id["cut"].success and "engine died" in (by_id["cut"].error or "")
    assert summarize(result.outcomes, result.duration_s).failed == 2


async def test_unreachable_target_fails_each_request_and_models_probe_raises() -> None:
    result = await run_live([(0.0, chat("x"))], LiveOptions("http://127.0.0.1:1", "m"))
    assert not result.outcomes[0].success
    async with aiohttp.ClientSession() as session:
        with pytest.raises(TargetUnreachableError):
            await fetch_models(session, "http://127.0.0.1:1")


async def test_concurrency_cap_and_arrival_times_are_respected(fake: tuple[FakeServer, str]) -> None:
    server, url = fake
    server.first_s, server.gap_s = 0.1, 0.02
    plan = [(0.0, chat(f"r{i}")) for i in range(6)]
    result = await run_live(plan, LiveOptions(url, "fake-model", max_concurrency=2))
    assert server.peak == 2
    assert all(o.success for o in result.outcomes)
    assert result.duration_s >= 3 * 0.16  # three waves of two requests, each >= 0.16 s
    server.peak = 0
    spaced = [(0.0, chat("a")), (0.5, chat("b")), (1.2, chat("c"))]
    result = await run_live(spaced, LiveOptions(url, "fake-model"))
    for (at_s, _), outcome in zip(spaced, result.outcomes, strict=True):
        assert outcome.start_s is not None and at_s <= outcome.start_s
        assert outcome.arrival_s == at_s
    assert server.peak == 1
    assert result.timeline and {"t_s", "in_flight", "throughput_tokens_per_s"} <= set(result.timeline[0])


async def test_models_probe(fake: tuple[FakeServer, str]) -> None:
    _, url = fake
    async with aiohttp.ClientSession() as session:
        assert await fetch_models(session, url) == ["fake-model"]


def test_prepare_synthesises_exact_prompts_for_token_count_traces() -> None:
    sim = Tokenizer.load_sim()
    tok = EngineTokenizer(sim)
    trace = [Request(request_id=f"t{i}", prompt_tokens=n, output_tokens=8)
             for i, n in enumerate((1, 37, 500))]
    text = text_request("x", "Tell me about rivers.", tokenizer=None)
    prepared = prepare_requests([*trace, text], tok, seed=3)
    for request in prepared[:3]:
        assert request.messages is None and request.prompt is not None
        assert len(sim.encode(request.prompt, add_special_tokens=True)) == request.prompt_tokens
        assert request_body(request, "m")[0] == "/v1/completions"
    assert prepared[3].messages == (("user", "Tell me about rivers."),)
    assert not prepared[3].prompt_tokens_estimated
    assert prepared[3].prompt_tokens == tok.count_messages(prepared[3].messages)
    assert prepare_requests(trace, tok, seed=3) == prepared[:3]  # deterministic
    assert prepare_requests(trace, tok, seed=3, synthesize=False) == trace
    with pytest.raises(ValueError):
        request_body(trace[0], "m")


def test_chunk_content_reads_chat_and_completions_chunks() -> None:
    assert chunk_content({"choices": [{"delta": {"content": "a"}}]}) == "a"
    assert chunk_content({"choices": [{"delta": {"role": "assistant"}}]}) == ""
    assert chunk_content({"choices": [{"text": "b"}]}) == "b"
    assert chunk_content({"choices": [], "usage": {"completion_tokens": 1}}) == ""


async def test_cli_run_replays_a_trace_and_writes_results(fake: tuple[FakeServer, str], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    server, url = fake
    server.first_s, server.gap_s = 0.01, 0.005
    out = tmp_path / "live.json"
    argv = ["run", "--target", url, "--data-dir", str(FIXTURE_DATA), "--dataset", "azure-conv",
            "--num-requests", "3", "--rate", "50", "--max-concurrency", "2", "--no-progress",
            "--slo", "ttft=1000", "--output", str(out)]
    assert await asyncio.to_thread(main, argv) == 0  # main runs its own event loop
    assert "Successful requests:" in capsys.readouterr().out
    results = read_results(out)
    assert results.summary["completed"] == 3 and results.config["model"] == "fake-model"
    assert all(o.output_tokens == USAGE_TOKENS for o in results.outcomes)
    assert all(isinstance(b.get("prompt"), str) and b["ignore_eos"] for b in server.bodies)
    assert (tmp_path / "live_latency_cdf.png").exists() and (tmp_path / "live_timeline.png").exists()
