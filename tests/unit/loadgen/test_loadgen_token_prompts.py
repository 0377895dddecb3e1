"""Live replay of block prompts (mooncake-*, sessions): token-id bodies built at dispatch, the block fidelity,
session turns that wait for the previous response, and the `loadgen run` flags and errors around them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web
from loadgen_testkit import FIXTURE_DATA, serving

from engine_agent.tokenization import Tokenizer
from loadgen.cli import main
from loadgen.datasets import Request, SessionSpec, load_dataset, session_requests, text_request
from loadgen.datasets.mooncake import prompt_ids_of
from loadgen.live import (
    EngineTokenizer,
    LiveOptions,
    block_fidelity,
    check_block_vocab,
    prepare_requests,
    request_body,
    run_live,
)
from loadgen.metrics import Outcome
from loadgen.results import read_results

TWO_SESSIONS = SessionSpec(sessions=2, turns_per_session=3, system_prompt_tokens=512, think_time_s=0.0)


@dataclass
class EchoServer:
    """A streaming /v1/completions that reports the prompt's length as its `prompt_tokens` (plus `extra`, as
    a server adding a BOS would) and logs ("start" | "end", session, prompt length) in order. With `hold`,
    no stream ends before `hold` requests have started."""

    extra: int = 0
    hold: int = 0
    log: list[tuple[str, str, int]] = field(default_factory=list)
    prompts: list[Any] = field(default_factory=list)
    started: int = 0
    gate: asyncio.Event = field(default_factory=asyncio.Event)

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "echo", "object": "model"}]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = body["prompt"]
        length = len(prompt) if isinstance(prompt, list) else 1
        session = request.headers.get("x-session-id", "")
        self.prompts.append(prompt)
        self.log.append(("start", session, length))
        self.started += 1
        if self.started >= self.hold:
            self.gate.set()
        await self.gate.wait()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for doc in ({"choices": [{"index": 0, "text": "a", "finish_reason": None}]},
                    {"choices": [], "usage": {"prompt_tokens": length + self.extra, "completion_tokens": 1}}):
            await resp.write(b"data: " + orjson.dumps(doc) + b"\n\n")
        self.log.append(("end", session, length))
        await resp.write(b"data: [DONE]\n\n")
        return resp


@pytest.fixture
async def echo() -> AsyncIterator[tuple[EchoServer, str]]:
    server = EchoServer()
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_get("/v1/models", server.models)
    app.router.add_post("/v1/completions", server.complete)
    async with serving(app) as url:
        yield server, url


def test_a_block_prompt_goes_to_completions_as_its_planned_token_ids() -> None:
    request = session_requests(TWO_SESSIONS, seed=0)[-1]
    path, body = request_body(request, "m", 1000)
    assert path == "/v1/completions"
    assert body["prompt"] == list(prompt_ids_of(request.metadata["hash_ids"], request.prompt_tokens, 1000))  # type: ignore[arg-type]
    assert body["max_tokens"] == request.output_tokens and body["ignore_eos"] is True
    with pytest.raises(ValueError, match="vocabulary size"):
        request_body(request, "m")
    mooncake = load_dataset("mooncake-conv", FIXTURE_DATA, num_requests=2)
    assert request_body(mooncake[1], "m", 8192)[1]["prompt"] == list(
        prompt_ids_of(mooncake[1].metadata["hash_ids"], mooncake[1].prompt_tokens, 8192))  # type: ignore[arg-type]


def test_preparing_leaves_block_prompts_to_dispatch_and_the_vocabulary_is_checked_up_front() -> None:
    requests = load_dataset("mooncake-conv", FIXTURE_DATA, num_requests=3)
    tokenizer = EngineTokenizer(Tokenizer.load_sim())
    assert prepare_requests(requests, tokenizer, seed=0) == requests
    text = text_request("t", "Tell me about rivers.", tokenizer=None)
    assert prepare_requests([*requests, text], tokenizer, seed=0)[:3] == requests
    check_block_vocab(requests, 8192)
    largest = max(max(r.metadata["hash_ids"]) for r in requests)  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="needs a vocabulary above"):
        check_block_vocab(requests, 4 + int(largest ** 0.5))
    check_block_vocab([text], 5)  # nothing to build: no vocabulary needed


def outcome(request: Request, prompt_tokens: int, success: bool = True) -> Outcome:
    if not success:
        return Outcome(request.request_id, False, prompt_tokens=prompt_tokens, error="HTTP 500")
    return Outcome(request.request_id, True, prompt_tokens=prompt_tokens, ttft_s=0.1, e2e_s=0.2)


def test_block_fidelity_counts_the_blocks_the_server_took_as_planned() -> None:
    a, b, c = session_requests(TWO_SESSIONS, seed=0)[:3]
    blocks = [len(r.metadata["hash_ids"]) for r in (a, b, c)]  # type: ignore[arg-type]
    fidelity = block_fidelity([a, b, c], [outcome(a, a.prompt_tokens), outcome(b, b.prompt_tokens + 1),
                                          outcome(c, c.prompt_tokens, success=False)])
    assert fidelity == {"prompt_form": "token_ids", "requests": 2, "planned_blocks": blocks[0] + blocks[1],
                        "exact_blocks": blocks[0], "fidelity": blocks[0] / (blocks[0] + blocks[1])}
    assert block_fidelity([a], [outcome(a, 1, success=False)])["fidelity"] is None  # type: ignore[index]
    text = text_request("t", "hello", tokenizer=None)
    assert block_fidelity([text], [outcome(text, 2)]) is None


async def test_a_session_turn_waits_for_the_previous_response(echo: tuple[EchoServer, str]) -> None:
    server, url = echo
    plan = [(0.0, r) for r in session_requests(TWO_SESSIONS, seed=0)]  # all planned at t = 0
    result = await run_live(plan, LiveOptions(url, "echo", vocab_size=1000))
    assert all(o.success for o in result.outcomes)
    for session in {r.session_id for _, r in plan}:
        mine = [(kind, length) for kind, sid, length in server.log if sid == session]
        lengths = sorted({length for _, length in mine})
        assert len(lengths) == 3  # three turns, prompts growing
        assert mine == [(kind, n) for n in lengths for kind in ("start", "end")]  # one at a time, in order
    by_id = {o.request_id: o for o in result.outcomes}
    for _, request in plan:
        after = request.metadata.get("after_request_id")
        if isinstance(after, str):
            previous = by_id[after]
            assert previous.start_s is not None and previous.e2e_s is not None
            assert by_id[request.request_id].arrival_s >= previous.start_s + previous.e2e_s  # type: ignore[operator]
    assert all(isinstance(p, list) and max(p) < 1000 for p in server.prompts)


async def test_planned_turns_go_at_their_planned_times(echo: tuple[EchoServer, str]) -> None:
    server, url = echo
    server.hold = 6  # every stream waits until all six requests have arrived: only planned sending finishes
    plan = [(0.0, r) for r in session_requests(TWO_SESSIONS, seed=0)]
    result = await run_live(plan, LiveOptions(url, "echo", vocab_size=1000, turns_after_response=False))
    assert all(o.success for o in result.outcomes)
    assert [kind for kind, _, _ in server.log[:6]] == ["start"] * 6


async def test_cli_runs_sessions_as_token_ids_and_reports_fidelity(
        echo: tuple[EchoServer, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    server, url = echo
    out = tmp_path / "live.json"
    argv = ["run", "--target", url, "--dataset", "sessions", "--data-dir", str(FIXTURE_DATA),
            "--sessions", "2", "--turns-per-session", "2", "--think-time-s", "0", "--vocab-size", "1000",
            "--no-progress", "--no-plots", "--output", str(out)]
    assert await asyncio.to_thread(main, argv) == 0
    assert "Block fidelity (token ids):" in (printed := capsys.readouterr().out) and "100.0%" in printed
    results = read_results(out)
    fidelity = results.summary["block_fidelity"]
    assert fidelity["fidelity"] == 1.0 and fidelity["requests"] == 4
    assert fidelity["planned_blocks"] == sum(-(-n // 512) for n in (len(p) for p in server.prompts))
    assert results.config["vocab_size"] == 1000 and results.config["sessions"]["sessions"] == 2
    assert {sid for _, sid, _ in server.log} == {"session-0-0", "session-0-1"}
    assert all(max(p) < 1000 for p in server.prompts)
    server.log.clear()
    server.extra = 1  # a server that adds a BOS shifts every block
    argv = ["run", "--target", url, "--dataset", "mooncake-conv", "--data-dir", str(FIXTURE_DATA),
            "--num-requests", "2", "--no-progress", "--no-plots", "--output", str(out)]
    assert await asyncio.to_thread(main, argv) == 0
    results = read_results(out)
    assert results.config["vocab_size"] == 8192  # the sim tokenizer's vocabulary
    assert results.summary["block_fidelity"]["fidelity"] == 0.0


@pytest.mark.parametrize(("argv", "needle"), [
    (["simulate", "--dataset", "azure-conv", "--sessions", "3"], "--sessions: only for --dataset sessions"),
    (["simulate", "--dataset", "sessions", "--system-prompt-tokens", "2000"], "multiple of the 512"),
    (["simulate", "--dataset", "sessions", "--timestamps"], "makes its own arrivals"),
    (["simulate", "--dataset", "sessions", "--duration", "5"], "makes its own arrivals"),
    (["simulate", "--dataset", "sessions", "--output-lengths", "star-sharegpt"], "makes its own arrivals"),
    (["compare", "--dataset", "sessions", "--rates", "1,2"], "makes its own arrivals"),
    (["simulate", "--dataset", "sessions", "--think-time-s", "-1"], "think_time_s"),
    (["run", "--target", "http://127.0.0.1:1", "--dataset", "mooncake-conv", "--vocab-size", "5"],
     "leaves no ids"),
    (["run", "--target", "http://127.0.0.1:1", "--dataset", "sessions", "--seed", "2000"],
     "needs a vocabulary above"),
])
def test_session_and_vocabulary_errors_are_one_line(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                    needle: str) -> None:
    assert main([*argv, "--data-dir", str(FIXTURE_DATA)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("loadgen: error:") and needle in err, err
