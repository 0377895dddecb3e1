"""`EngineClient` for any OpenAI-compatible server (vllm serve, SGLang, another Switchyard gateway).

Owns: the HTTP calls to one upstream (streaming completions, GET /v1/models, polling GET /metrics) and their
translation into the gateway's engine events and reports.
- `generate` POSTs /v1/chat/completions (messages) or /v1/completions (text or token ids) with `stream=true`
  and relays every SSE chunk as it arrives (the body is never buffered): `Admitted(prompt_tokens=0)` once the
  upstream answers 200 (the prompt size is unknown until the usage chunk), one `Delta(num_tokens=1)` per
  content chunk, then `Finished` from the finish_reason and the usage chunk. Before the stream: 5xx, 408, 429
  and connection errors are `EngineUnavailable`, other 4xx `EngineRequestError`; after it, any failure is
  `EngineStreamError`. Closing the generator early closes the connection, which makes vLLM abort the request.
  The body is read as whatever bytes have arrived (one read can hold many events) and cut into events by
  `SseChunkParser`, a pure parser (bytes in, events out) that decodes only `data:` lines.
- Connections: one `aiohttp.ClientSession` per upstream (`upstream_session`), keep-alive connections pooled
  across requests; the pool closes idle connections after `KEEPALIVE_S`, before the upstream's own idle
  timeout (uvicorn's 5 s, which vllm serve and SGLang use) can close one the gateway is about to reuse.
  aiohttp sets TCP_NODELAY on every connection it opens.
- `watch_state` polls /metrics every `metrics_interval_s` (a background task of the cluster store, never the
  request path; a failed scrape is skipped, so the state goes stale while requests keep deciding
  availability) and parses vLLM's (and SGLang's) gauge names into `EngineReport`s. When only a KV usage
  fraction is known, KV figures are expressed over a nominal total of `NOMINAL_KV_BLOCKS` (1000) blocks, so
  kv_blocks_free = round((1 - usage) * 1000) and `kv_free_ratio` is exact; vLLM's `cache_config_info`
  `num_gpu_blocks` label, when present, replaces the nominal total. An upstream without /metrics (404) yields
  ready reports with zero counts, so the gateway's own in-flight accounting drives the policies.
Must not: know about routing, the gateway's HTTP API or SSE writer; retry (dispatch decides).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator
from typing import Any, Literal, cast

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families
from yarl import URL

from gateway.domain import (
    Admitted,
    Delta,
    EngineDescription,
    EngineEvent,
    EngineId,
    EngineReport,
    EngineRequest,
    EngineRequestError,
    EngineStreamError,
    EngineUnavailable,
    Finished,
)
from switchyard.clock import Clock, MonotonicClock

log = logging.getLogger(__name__)

NOMINAL_KV_BLOCKS = 1000
_RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
_WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
_CACHE_INFO = "vllm:cache_config_info"
_RETRYABLE_4XX = frozenset({408, 429})
_DRAIN_TIMEOUT_S = 1.0
# One streaming request holds one connection (HTTP/1.1): the cap is far above any engine's batch plus queue
# and only guards file descriptors; a request waiting for a pooled connection counts against the connect
# timeout. The default of the gateway's `upstream_max_connections`.
MAX_CONNECTIONS = 4096
KEEPALIVE_S = 4.0
FinishReason = Literal["stop", "length", "abort", "error"]
_FINISH_REASONS: frozenset[str] = frozenset({"stop", "length", "abort", "error"})


def _finish_reason(upstream_reason: str | None) -> FinishReason:
    """OpenAI's reasons mapped onto ours: tool_calls, content_filter and the like end the turn, so "stop"."""
    if upstream_reason in _FINISH_REASONS:
        return cast(FinishReason, upstream_reason)
    return "stop"


def build_body(request: EngineRequest) -> tuple[str, dict[str, Any]]:
    """The path and JSON body of one streaming request."""
    body: dict[str, Any] = {
        "model": request.model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "n": 1,
        "temperature": request.temperature,
        "top_p": request.top_p,
    }
    if request.messages is not None:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": t.role, "content": t.content} for t in request.messages]
    elif request.prompt_text is not None:
        path = "/v1/completions"
        body["prompt"] = request.prompt_text
    elif request.prompt_token_ids is not None:
        path = "/v1/completions"
        body["prompt"] = list(request.prompt_token_ids)
    else:
        raise EngineRequestError(f"request {request.request_id!r} has no prompt")
    if request.max_tokens is not None:
        body["max_tokens"] = request.max_tokens
    if request.seed is not None:
        body["seed"] = request.seed
    if request.stop:
        body["stop"] = list(request.stop)
    # vLLM extensions, sent only when set so that strict OpenAI servers accept the default request.
    if request.ignore_eos:
        body["ignore_eos"] = True
    if request.min_tokens > 0:
        body["min_tokens"] = request.min_tokens
    if request.stop_token_ids:
        body["stop_token_ids"] = list(request.stop_token_ids)
    return path, body


def _count(families: dict[str, list[float]], names: tuple[str, ...]) -> int:
    """The first family of `names` present, summed, as a count (0 when none is present)."""
    for name in names:
        if name in families:
            total = sum(families[name])
            if not (math.isfinite(total) and total >= 0):
                raise ValueError(f"{name} is {total}, not a count")
            return int(total)
    return 0


def parse_metrics(text: str) -> tuple[int, int, int, int]:
    """(num_running, num_waiting, kv_blocks_total, kv_blocks_free) from Prometheus text (see module doc).

    Raises `ValueError` (only) for text the Prometheus parser rejects, counts that are negative or not finite,
    and a KV usage that is not a number; the caller then treats the scrape as failed."""
    samples: dict[str, list[float]] = {}
    total_blocks = 0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample.value)
            blocks = sample.labels.get("num_gpu_blocks", "") if sample.name == _CACHE_INFO else ""
            if blocks.isascii() and blocks.isdigit():  # "²" is a digit to isdigit, not to int
                total_blocks = max(total_blocks, int(blocks))
    running = _count(samples, _RUNNING)
    waiting = _count(samples, _WAITING)
    usage_values = next((samples[n] for n in _KV_USAGE if n in samples), None)
    if usage_values is None:
        return running, waiting, 0, 0
    usage = sum(usage_values) / len(usage_values)
    if math.isnan(usage):
        raise ValueError("the KV cache usage is not a number")
    usage = min(1.0, max(0.0, usage))
    total_blocks = total_blocks or NOMINAL_KV_BLOCKS
    # min: a float product rounds past a total beyond 2**53 blocks
    return running, waiting, total_blocks, min(total_blocks, round((1.0 - usage) * total_blocks))


def upstream_session(max_connections: int = MAX_CONNECTIONS) -> aiohttp.ClientSession:
    """The HTTP session of one upstream: pooled keep-alive connections, no cookie handling."""
    connector = aiohttp.TCPConnector(limit=max_connections, keepalive_timeout=KEEPALIVE_S)
    return aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar())


class SseChunkParser:
    """An upstream's streamed body, fed as it arrives, turned into `Delta`s and the final `Finished`.

    `feed` returns the deltas of every complete line; `done` turns true at `data: [DONE]` (later bytes are
    ignored); an `error` chunk, undecodable JSON or a chunk not shaped like OpenAI's (choices not a list of
    objects, a delta not an object, text, a finish reason or usage of the wrong type) stops parsing and sets
    `error` (raise it after relaying the deltas before it). `finished()` is the stream's `Finished` once the
    body ended, or raises when it ended without a finish reason and without `[DONE]`, or when its usage counts
    are not non-negative integers. Whatever the bytes, `EngineStreamError` is the only exception raised.
    """

    __slots__ = ("_source", "_tail", "finish_reason", "usage", "deltas", "done", "error")

    def __init__(self, source: str) -> None:
        self._source = source  # names the upstream in errors
        self._tail = b""
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.deltas = 0
        self.done = False
        self.error: EngineStreamError | None = None

    def feed(self, data: bytes) -> list[Delta]:
        lines = (self._tail + data if self._tail else data).split(b"\n")
        self._tail = lines.pop()
        return self._lines(lines)

    def end(self) -> list[Delta]:
        """The body ended: a last line without its newline still counts."""
        tail, self._tail = self._tail, b""
        return self._lines([tail]) if tail else []

    def _lines(self, lines: list[bytes]) -> list[Delta]:
        # The per-chunk path of every upstream stream: one loop, names bound locally.
        out: list[Delta] = []
        if self.done or self.error is not None:
            return out
        loads = orjson.loads
        for raw in lines:
            if not raw:
                continue  # the blank line after each event
            if not raw.startswith(b"data:"):
                raw = raw.strip()
                if not raw.startswith(b"data:"):
                    continue  # comments, event/id fields
            data = raw[5:].strip()
            if data == b"[DONE]":
                self.done = True
                break
            try:
                chunk = loads(data)
            except orjson.JSONDecodeError:
                chunk = None
            if not isinstance(chunk, dict):
                self.error = EngineStreamError(f"bad SSE chunk from {self._source}: {data[:200]!r}")
                break
            if "error" in chunk:
                self.error = EngineStreamError(f"upstream {self._source} error: {chunk['error']!r:.500}")
                break
            usage = chunk.get("usage")
            if usage:
                if not isinstance(usage, dict):
                    self.error = self._malformed(data)
                    break
                self.usage = usage
            choices = chunk.get("choices") or ()
            if not isinstance(choices, list | tuple):
                self.error = self._malformed(data)
                break
            for choice in choices:
                if not isinstance(choice, dict):
                    self.error = self._malformed(data)
                    return out
                if "delta" in choice:
                    delta = choice["delta"]
                    if delta and not isinstance(delta, dict):
                        self.error = self._malformed(data)
                        return out
                    text = delta.get("content") if delta else None
                else:
                    text = choice.get("text")
                if text:
                    if not isinstance(text, str):
                        self.error = self._malformed(data)
                        return out
                    self.deltas += 1
                    out.append(Delta(text, (), 1))  # (text, token_ids, num_tokens): positional is faster
                reason = choice.get("finish_reason")
                if reason:
                    if not isinstance(reason, str):
                        self.error = self._malformed(data)
                        return out
                    self.finish_reason = reason
        return out

    def _malformed(self, data: bytes) -> EngineStreamError:
        return EngineStreamError(f"malformed SSE chunk from {self._source}: {data[:200]!r}")

    def finished(self) -> Finished:
        if self.finish_reason is None and not self.done:
            raise EngineStreamError(f"stream from {self._source} ended without a finish")
        usage = self.usage or {}
        details = usage.get("prompt_tokens_details") or {}
        if not isinstance(details, dict):
            raise EngineStreamError(f"stream from {self._source}: malformed usage {usage!r:.200}")
        return Finished(
            finish_reason=_finish_reason(self.finish_reason),
            prompt_tokens=self._usage_count(usage, "prompt_tokens", 0),
            completion_tokens=self._usage_count(usage, "completion_tokens", self.deltas),
            cached_tokens=self._usage_count(details, "cached_tokens", 0),
        )

    def _usage_count(self, usage: dict[str, Any], name: str, default: int) -> int:
        value = usage.get(name) or default
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**32:
            return value
        raise EngineStreamError(f"stream from {self._source}: usage {name} is {value!r:.50}, not a count")


class OpenAIUpstreamClient:
    def __init__(
        self,
        base_url: str,
        *,
        session: aiohttp.ClientSession | None = None,
        metrics_interval_s: float = 0.5,
        api_key: str | None = None,
        engine_id: str | None = None,
        connect_timeout_s: float = 5.0,
        clock: Clock | None = None,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        """`session` is borrowed when given (the caller closes it), else created on first use (an
        `upstream_session` of `max_connections`) and owned."""
        self._base_url = base_url.rstrip("/")
        self._session = session
        self._max_connections = max_connections
        self._owns_session = session is None
        self._metrics_interval_s = metrics_interval_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # Built once: the per-request part of a POST is the body alone.
        self._post_headers = {
            **self._headers, "Content-Type": "application/json", "Accept": "text/event-stream"
        }
        self._urls: dict[str, URL] = {}
        self._engine_id = EngineId(engine_id or self._base_url)
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=connect_timeout_s, sock_connect=connect_timeout_s
        )
        self._clock: Clock = clock or MonotonicClock()
        self._description: EngineDescription | None = None

    @property
    def address(self) -> str:
        return self._base_url

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = upstream_session(self._max_connections)
        return self._session

    def _url(self, path: str) -> URL:
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = URL(f"{self._base_url}{path}")
        return url

    async def describe(self) -> EngineDescription:
        try:
            async with self._http().get(
                f"{self._base_url}/v1/models", headers=self._headers, timeout=self._timeout
            ) as resp:
                if resp.status != 200:
                    raise EngineUnavailable(f"GET {self._base_url}/v1/models answered {resp.status}")
                payload = orjson.loads(await resp.read())
        except (aiohttp.ClientError, OSError, TimeoutError, orjson.JSONDecodeError) as exc:
            raise EngineUnavailable(f"GET {self._base_url}/v1/models failed: {exc!r}") from exc
        models = payload.get("data") or []
        if not models:
            raise EngineUnavailable(f"{self._base_url} serves no model")
        first = models[0]
        self._description = EngineDescription(
            engine_id=self._engine_id,
            model=str(first["id"]),
            profile="",
            backend="openai",
            role="",
            max_context_tokens=int(first.get("max_model_len") or 0),
            block_size=16,  # vLLM's default; the upstream does not say
            max_num_seqs=0,  # unknown
        )
        return self._description

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineEvent]:
        path, body = build_body(request)
        data = orjson.dumps(body)
        del body  # the body's dicts must not live in this frame as long as the stream does
        started = reusable = False
        try:
            resp = await self._http().post(
                self._url(path), data=data, headers=self._post_headers, timeout=self._timeout
            )
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise EngineUnavailable(f"POST {self._base_url}{path} failed: {exc!r}") from exc
        try:
            if resp.status != 200:
                detail = (await resp.text(errors="replace"))[:2000]
                reusable = True
                message = f"POST {self._base_url}{path} answered {resp.status}: {detail}"
                if 400 <= resp.status < 500 and resp.status not in _RETRYABLE_4XX:
                    raise EngineRequestError(message)
                raise EngineUnavailable(message, server_error=resp.status >= 500)
            started = True
            yield Admitted(prompt_tokens=0)
            parser = SseChunkParser(self._base_url)
            content = resp.content
            while not parser.done:
                data = await content.readany()
                deltas = parser.feed(data) if data else parser.end()
                for delta in deltas:
                    yield delta
                if parser.error is not None:
                    raise parser.error
                if not data:
                    break  # end of the body
            finished = parser.finished()
            if parser.done:
                await self._drain(resp)
            reusable = True
            yield finished
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            if started:
                raise EngineStreamError(f"stream from {self._base_url} broke: {exc!r}") from exc
            raise EngineUnavailable(f"POST {self._base_url}{path} failed: {exc!r}") from exc
        finally:
            if reusable:
                resp.release()  # body read to the end: the connection goes back to the pool
            else:
                resp.close()  # closes the connection mid-stream: the upstream aborts the request

    @staticmethod
    async def _drain(resp: aiohttp.ClientResponse) -> None:
        """Read what follows [DONE] (normally nothing) so the connection can be reused; bounded in time."""
        try:
            async with asyncio.timeout(_DRAIN_TIMEOUT_S):
                while await resp.content.readany():
                    pass
        except TimeoutError:
            resp.close()

    async def watch_state(self) -> AsyncIterator[EngineReport]:
        seq = 0
        failing = False
        while True:
            engine_timestamp_s = self._clock.now()
            try:
                running, waiting, kv_total, kv_free = await self._scrape()
            except EngineUnavailable as exc:
                # A late or failed scrape makes the state stale, never the upstream unavailable: requests
                # decide that (outlier detection). Logged once per run of failures.
                if not failing:
                    log.warning("%s: metrics scrape failed, routing on local accounting: %s",
                                self._base_url, exc)
                failing = True
                await asyncio.sleep(self._metrics_interval_s)
                continue
            if failing:
                log.info("%s: metrics scrape works again", self._base_url)
                failing = False
            seq += 1
            desc = self._description
            yield EngineReport(
                engine_id=self._engine_id,
                model=desc.model if desc is not None else "",
                profile="",
                backend="openai",
                role="",
                seq=seq,
                engine_timestamp_s=engine_timestamp_s,
                ready=True,
                draining=False,
                num_running=running,
                num_waiting=waiting,
                kv_blocks_total=kv_total,
                kv_blocks_free=kv_free,
                kv_blocks_reserved=0,
                pending_prefill_tokens=0,
                running_batch_tokens=0,
            )
            await asyncio.sleep(self._metrics_interval_s)

    async def _scrape(self) -> tuple[int, int, int, int]:
        url = f"{self._base_url}/metrics"
        try:
            async with self._http().get(url, headers=self._headers, timeout=self._timeout) as resp:
                if resp.status == 404:
                    return 0, 0, 0, 0
                if resp.status != 200:
                    raise EngineUnavailable(f"GET {url} answered {resp.status}")
                text = await resp.text(errors="replace")
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise EngineUnavailable(f"GET {url} failed: {exc!r}") from exc
        try:
            return parse_metrics(text)
        except ValueError as exc:
            raise EngineUnavailable(f"GET {url}: unparsable metrics: {exc}") from exc

    async def close(self) -> None:
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None
