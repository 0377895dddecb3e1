"""Live replay: send a schedule of requests to an OpenAI-compatible server and measure each one.

Owns: turning a ``Request`` into an OpenAI streaming body (chat completions for message datasets, completions
with prompt text or token ids otherwise; ``max_tokens`` = the forced output length plus ``ignore_eos`` when
the trace forces one), preparing token-count-only traces for live replay (a synthesised prompt of exactly
``prompt_tokens`` tokens as the target's tokenizer counts them, sent as completions text so no chat template
adds tokens), the per-request measurement (vLLM ``bench serve``'s: TTFT = first chunk with content, ITL = gaps
between content chunks, E2E = send to end of stream, output tokens from the usage chunk), the arrival loop
(sleep until each send time, a semaphore for ``max_concurrency``; a session's next turn, by default, waits
for the previous turn's response and then its think time), the one-second timeline of in-flight requests and
output throughput, the block fidelity of block prompts, and the optional tqdm bar.

Block prompts (``mooncake-*``, ``sessions``: ``metadata["hash_ids"]``) are built at dispatch, as the simulator
builds them (``prompt_ids_of`` with ``LiveOptions.vocab_size``), and always sent as token ids to
``/v1/completions`` (``prompt: [ids]``): chat takes text only, and no text is known to tokenize to exactly
those blocks. Their block fidelity is the share of the completed requests' planned 512-token blocks that the
server took as planned: all of a request's blocks when its reported ``prompt_tokens`` equals the ids sent
(a server that adds a token, e.g. a BOS, shifts every block), none otherwise.
Must not: compute summaries (``loadgen.metrics``), write files, parse command lines, or read time other than
through the injected ``Clock``.

The prompts are exact only for the tokenizer used to synthesise them: the default is the sim agents'
tokenizer (``Tokenizer.load_sim()``); replaying against engines with another tokenizer needs that tokenizer
(``--tokenizer DIR``, an HF-style directory) or prompt lengths will differ from the trace.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from engine_agent.tokenization import Tokenizer
from loadgen.datasets import Request, fill_prompts
from loadgen.datasets.mooncake import HASH_IDS, check_vocab, prompt_ids_of
from loadgen.datasets.sessions import AFTER_REQUEST_ID, THINK_TIME_S
from loadgen.metrics import Outcome
from switchyard.clock import Clock, MonotonicClock

TIMELINE_PERIOD_S = 1.0
ERROR_TEXT_LIMIT = 300


class TargetUnreachableError(ConnectionError):
    """The target did not answer (connection refused, DNS failure, timeout) or answered /v1/models badly."""


@dataclass(frozen=True, slots=True)
class EncodedIds:
    """``encode(text).ids`` for ``TokenizerLike`` callers."""

    ids: list[int]


@dataclass(frozen=True, slots=True)
class EngineTokenizer:
    """Counts tokens as an engine agent does for a completions prompt: ``encode(text, add_special_tokens)``
    (so a BOS is counted), and renders chat messages with the tokenizer's template."""

    tokenizer: Tokenizer

    def encode(self, text: str, /) -> EncodedIds:
        return EncodedIds(self.tokenizer.encode(text, add_special_tokens=True))

    def count_messages(self, messages: Sequence[tuple[str, str]]) -> int:
        if not self.tokenizer.has_chat_template:
            return len(self.encode("\n".join(content for _, content in messages)).ids)
        rendered = [{"role": role, "content": content} for role, content in messages]
        return len(self.tokenizer.apply_chat_template(rendered))


def prepare_requests(requests: Sequence[Request], tokenizer: EngineTokenizer, *, seed: int,
                     synthesize: bool = True) -> list[Request]:
    """Requests ready for replay on engines using ``tokenizer``: token-count-only ones get (when
    ``synthesize``; the simulator needs only the count) a prompt text of exactly ``prompt_tokens`` tokens and
    no messages, so they go as completions; text requests whose count was a byte estimate get the exact count
    the engine will see (chat template included)."""
    blocks = [_hash_ids(r) is not None for r in requests]  # built at dispatch (request_body)
    count_only = [r.prompt is None and r.messages is None and r.prompt_token_ids is None and not b
                  for r, b in zip(requests, blocks, strict=True)]
    filled = list(requests)
    if synthesize:
        others = iter(fill_prompts([r for r, b in zip(requests, blocks, strict=True) if not b], seed=seed,
                                   tokenizer=tokenizer))
        filled = [r if b else next(others) for r, b in zip(requests, blocks, strict=True)]
    out: list[Request] = []
    for request, synthesized in zip(filled, count_only, strict=True):
        if synthesized and synthesize:
            out.append(dataclasses.replace(request, messages=None))
        elif request.prompt_tokens_estimated:
            if request.messages is not None:
                exact = tokenizer.count_messages(request.messages)
            else:
                exact = len(tokenizer.encode(request.prompt or "").ids)
            out.append(dataclasses.replace(request, prompt_tokens=exact, prompt_tokens_estimated=False))
        else:
            out.append(request)
    return out


def _hash_ids(request: Request) -> tuple[int, ...] | None:
    """The block ids of a block prompt still to build, else None."""
    hash_ids = request.metadata.get(HASH_IDS)
    if not isinstance(hash_ids, tuple) or request.prompt_token_ids is not None or request.prompt is not None:
        return None
    return hash_ids


def check_block_vocab(requests: Sequence[Request], vocab_size: int) -> None:
    """ValueError unless ``vocab_size`` ids encode every block prompt's block ids (checked before a run, so
    no request fails at dispatch)."""
    ids = [max(h) for h in map(_hash_ids, requests) if h]
    if ids:
        check_vocab(max(ids), vocab_size)


def request_body(request: Request, model: str, vocab_size: int | None = None) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of the streaming OpenAI request that replays ``request``; a block prompt's token ids
    are built here from its ``hash_ids``, which needs ``vocab_size``."""
    body: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    hash_ids = _hash_ids(request)
    if hash_ids is not None:
        if vocab_size is None:
            raise ValueError(f"request {request.request_id}: a block prompt (hash_ids) is sent as token ids, "
                             f"which needs the model's vocabulary size (--vocab-size)")
        path = "/v1/completions"
        body["prompt"] = list(prompt_ids_of(hash_ids, request.prompt_tokens, vocab_size))
    elif request.messages is not None:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": role, "content": content} for role, content in request.messages]
    elif request.prompt is not None:
        path = "/v1/completions"
        body["prompt"] = request.prompt
    elif request.prompt_token_ids is not None:
        path = "/v1/completions"
        body["prompt"] = list(request.prompt_token_ids)
    else:
        raise ValueError(f"request {request.request_id} has no prompt: prepare it with prepare_requests()")
    if request.output_tokens:  # a forced length of 0 counts as none, as in the simulator
        body["max_tokens"] = request.output_tokens
        body["ignore_eos"] = True
    return path, body


def chunk_content(chunk: dict[str, Any]) -> str:
    """The generated text a streaming chunk carries (chat ``delta.content`` or completions ``text``)."""
    choices = chunk.get("choices") or ()
    if not choices:
        return ""
    first = choices[0]
    delta = first.get("delta")
    text = delta.get("content") if isinstance(delta, dict) else first.get("text")
    return text if isinstance(text, str) else ""


@dataclass(frozen=True, slots=True)
class LiveOptions:
    """Where and how to send: base URL (``http://host:port``), model, in-flight cap, per-request timeout, the
    vocabulary block prompts are built in, and whether a session's turn waits for the previous response
    (``turns_after_response``; False: every request at its planned time, as the simulator does)."""

    target: str
    model: str
    max_concurrency: int | None = None
    request_timeout_s: float = 600.0
    api_key: str | None = None
    vocab_size: int | None = None
    turns_after_response: bool = True


@dataclass
class LiveResult:
    """Outcomes in schedule order; ``duration_s`` from the first send to the last finish; ``timeline`` rows
    {t_s, in_flight, throughput_tokens_per_s} every second (the simulator's shape, without engine counts)."""

    outcomes: list[Outcome]
    duration_s: float
    timeline: list[dict[str, float]] = field(default_factory=list)


class _Tracker:
    """Counters shared by the request tasks of one run and read by the timeline sampler."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.chunks = 0  # content chunks since the last sample (one per token for a token-streaming server)


async def fetch_models(session: aiohttp.ClientSession, target: str) -> list[str]:
    """Model ids from ``GET {target}/v1/models``; TargetUnreachableError when the target does not answer."""
    url = target.rstrip("/") + "/v1/models"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
            if resp.status != 200:
                raise TargetUnreachableError(f"GET {url} answered HTTP {resp.status}")
            doc = orjson.loads(await resp.read())
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
        raise TargetUnreachableError(f"cannot reach {url}: {exc or type(exc).__name__}") from exc
    return [str(m["id"]) for m in doc.get("data", []) if isinstance(m, dict) and "id" in m]


async def send_one(
    session: aiohttp.ClientSession,
    options: LiveOptions,
    request: Request,
    arrival_s: float,
    clock: Clock,
    run_start: float,
    tracker: _Tracker | None = None,
) -> Outcome:
    """Send ``request`` and measure it; any failure (HTTP status, stream error, exception) is a failed
    outcome with its message, never an exception."""
    path, body = request_body(request, options.model, options.vocab_size)
    headers = {"content-type": "application/json"}
    if request.session_id:
        headers["x-session-id"] = request.session_id
    if options.api_key:
        headers["authorization"] = f"Bearer {options.api_key}"
    start = clock.now()
    ttft_s: float | None = None
    last = start
    itl_s: list[float] = []
    usage: dict[str, Any] = {}
    error: str | None = None
    try:
        async with session.post(options.target.rstrip("/") + path, data=orjson.dumps(body), headers=headers,
                                timeout=aiohttp.ClientTimeout(total=options.request_timeout_s)) as resp:
            if resp.status != 200:
                text = (await resp.text(errors="replace"))[:ERROR_TEXT_LIMIT]
                error = f"HTTP {resp.status}: {text}"
            else:
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    now = clock.now()
                    chunk = orjson.loads(data)
                    if "error" in chunk:
                        error = f"stream error: {orjson.dumps(chunk['error']).decode()[:ERROR_TEXT_LIMIT]}"
                        break
                    if chunk_content(chunk):
                        if ttft_s is None:
                            ttft_s = now - start
                        else:
                            itl_s.append(now - last)
                        last = now
                        if tracker is not None:
                            tracker.chunks += 1
                    if isinstance(chunk.get("usage"), dict):
                        usage = chunk["usage"]
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"[:ERROR_TEXT_LIMIT]
    end = clock.now()
    if error is None and ttft_s is None:
        error = "stream ended without content"
    prompt_tokens = int(usage.get("prompt_tokens") or request.prompt_tokens)
    if error is not None:
        return Outcome(request_id=request.request_id, success=False, prompt_tokens=prompt_tokens,
                       arrival_s=arrival_s, start_s=start - run_start, error=error)
    output_tokens = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Outcome(
        request_id=request.request_id, success=True, prompt_tokens=prompt_tokens,
        output_tokens=int(output_tokens) if output_tokens is not None else len(itl_s) + 1,
        arrival_s=arrival_s, start_s=start - run_start, ttft_s=ttft_s, itl_s=tuple(itl_s), e2e_s=end - start,
        cached_tokens=int(cached) if isinstance(cached, int) else None,
    )


async def _sample_timeline(tracker: _Tracker, clock: Clock, run_start: float,
                           rows: list[dict[str, float]]) -> None:
    last_s = 0.0
    while True:
        await asyncio.sleep(TIMELINE_PERIOD_S)
        t_s = clock.now() - run_start
        rows.append({"t_s": t_s, "in_flight": float(tracker.in_flight),
                     "throughput_tokens_per_s": tracker.chunks / max(t_s - last_s, 1e-9)})
        tracker.chunks = 0
        last_s = t_s


def _progress_bar(total: int, enabled: bool) -> Any:
    if not enabled or not sys.stderr.isatty():
        return None
    from tqdm import tqdm  # noqa: PLC0415 (only a terminal run needs it)

    return tqdm(total=total, unit="req", desc="replay", dynamic_ncols=True)


async def run_live(
    schedule: Sequence[tuple[float, Request]],
    options: LiveOptions,
    *,
    clock: Clock | None = None,
    progress: bool = False,
    session: aiohttp.ClientSession | None = None,
) -> LiveResult:
    """Replay ``schedule`` ((send time s, request) pairs) against ``options.target``; returns outcomes in
    schedule order. Each request is sent at its time (or later, when ``max_concurrency`` requests are in
    flight); TTFT and E2E are measured from the actual send."""
    clk = clock if clock is not None else MonotonicClock()
    own_session = session is None
    http = session if session is not None else aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, force_close=False))
    limit = asyncio.Semaphore(options.max_concurrency) if options.max_concurrency else None
    tracker = _Tracker()
    bar = _progress_bar(len(schedule), progress)
    timeline: list[dict[str, float]] = []
    outcomes: list[Outcome | None] = [None] * len(schedule)
    ended = _turn_ends(schedule) if options.turns_after_response else {}
    run_start = clk.now()

    async def one(index: int, at_s: float, request: Request) -> None:
        previous = request.metadata.get(AFTER_REQUEST_ID)
        after = ended.get(previous) if isinstance(previous, str) else None
        if after is not None:  # the session's previous turn: its response, then the think time
            await after.done.wait()
            think_s = request.metadata.get(THINK_TIME_S)
            at_s = after.end_s + (float(think_s) if isinstance(think_s, int | float) else 0.0)
        delay_s = at_s - (clk.now() - run_start)
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        if limit is not None:
            await limit.acquire()
        tracker.in_flight += 1
        try:
            outcomes[index] = await send_one(http, options, request, at_s, clk, run_start, tracker)
        finally:
            tracker.in_flight -= 1
            if limit is not None:
                limit.release()
            if bar is not None:
                bar.update(1)
            mine = ended.get(request.request_id)
            if mine is not None:
                mine.end_s = clk.now() - run_start
                mine.done.set()

    try:
        sampler = asyncio.create_task(_sample_timeline(tracker, clk, run_start, timeline))
        try:
            async with asyncio.TaskGroup() as group:
                for index, (at_s, request) in enumerate(schedule):
                    group.create_task(one(index, at_s, request))
            end = clk.now()
        finally:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
    finally:
        if bar is not None:
            bar.close()
        if own_session:
            await http.close()
    duration_s = end - run_start  # vLLM's benchmark duration: run start to the last request's end
    done = [o for o in outcomes if o is not None]
    return LiveResult(outcomes=done, duration_s=max(duration_s, 1e-9), timeline=timeline)


@dataclass
class _TurnEnd:
    """A request a later one follows: ``done`` is set when it has ended, at ``end_s`` run seconds."""

    done: asyncio.Event = field(default_factory=asyncio.Event)
    end_s: float = 0.0


def _turn_ends(schedule: Sequence[tuple[float, Request]]) -> dict[str, _TurnEnd]:
    """A ``_TurnEnd`` for each request in ``schedule`` that another one follows (``AFTER_REQUEST_ID``)."""
    ids = {request.request_id for _, request in schedule}
    followed = {r.metadata[AFTER_REQUEST_ID] for _, r in schedule if AFTER_REQUEST_ID in r.metadata}
    return {rid: _TurnEnd() for rid in ids if rid in followed}


def block_fidelity(requests: Sequence[Request], outcomes: Sequence[Outcome]) -> dict[str, Any] | None:
    """The block fidelity of a run's block prompts (module docstring), over its completed requests; None when
    the run has no block prompt. {prompt_form, requests, planned_blocks, exact_blocks, fidelity}."""
    by_id = {r.request_id: r for r in requests}
    counted = planned = exact = 0
    for outcome in outcomes:
        request = by_id.get(outcome.request_id)
        hash_ids = _hash_ids(request) if request is not None else None
        if request is None or hash_ids is None or not outcome.success:
            continue
        counted += 1
        planned += len(hash_ids)
        if outcome.prompt_tokens == request.prompt_tokens:
            exact += len(hash_ids)
    if not any(_hash_ids(r) for r in requests):
        return None
    return {"prompt_form": "token_ids", "requests": counted, "planned_blocks": planned, "exact_blocks": exact,
            "fidelity": exact / planned if planned else None}


async def wait_gateway_ready(
    url: str, engines: int, proc: asyncio.subprocess.Process | None = None, timeout_s: float = 60.0
) -> None:
    """Wait until the gateway at `url` reports at least `engines` ready engines on `/health`.

    Raises RuntimeError if `proc` (the gateway process, when we started it) exits first, TimeoutError after
    `timeout_s`.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with aiohttp.ClientSession() as session:
        while loop.time() < deadline:
            if proc is not None and proc.returncode is not None:
                raise RuntimeError(f"gateway exited with {proc.returncode}")
            try:
                async with session.get(f"{url}/health") as resp:
                    if resp.status == 200 and (await resp.json())["engines_ready"] >= engines:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise TimeoutError(f"gateway at {url} did not see {engines} engines in {timeout_s} s")
