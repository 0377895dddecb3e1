"""`EngineClient` for any OpenAI-compatible server (vllm serve, SGLang, another Switchyard gateway).

Owns: the HTTP calls to one upstream (streaming completions, GET /v1/models, polling GET /metrics) and their
translation into the gateway's engine events and reports.
- `generate` POSTs /v1/chat/completions (messages) or /v1/completions (text or token ids) with `stream=true`
  and relays every SSE chunk as it arrives (the body is never buffered): `Admitted(prompt_tokens=0)` once the
  upstream answers 200 (the prompt size is unknown until the usage chunk), one `Delta(num_tokens=1)` per
  content chunk, then `Finished` from the finish_reason and the usage chunk. Before the stream: 5xx, 408, 429
  and connection errors are `EngineUnavailable`, other 4xx `EngineRequestError`; after it, any failure is
  `EngineStreamError`. Closing the generator early closes the connection, which makes vLLM abort the request.
- `watch_state` polls /metrics every `metrics_interval_s` (a background task of the cluster store, never the
  request path) and parses vLLM's (and SGLang's) gauge names into `EngineReport`s. When only a KV usage
  fraction is known, KV figures are expressed over a nominal total of `NOMINAL_KV_BLOCKS` (1000) blocks, so
  kv_blocks_free = round((1 - usage) * 1000) and `kv_free_ratio` is exact; vLLM's `cache_config_info`
  `num_gpu_blocks` label, when present, replaces the nominal total. An upstream without /metrics (404) yields
  ready reports with zero counts, so the gateway's own in-flight accounting drives the policies.
Must not: know about routing, the gateway's HTTP API or SSE writer; retry (dispatch decides).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, Literal, cast

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

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

NOMINAL_KV_BLOCKS = 1000
_RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
_WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
_CACHE_INFO = "vllm:cache_config_info"
_RETRYABLE_4XX = frozenset({408, 429})
_DRAIN_TIMEOUT_S = 1.0
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


def _sum_samples(families: dict[str, list[float]], names: tuple[str, ...]) -> float | None:
    for name in names:
        if name in families:
            return sum(families[name])
    return None


def parse_metrics(text: str) -> tuple[int, int, int, int]:
    """(num_running, num_waiting, kv_blocks_total, kv_blocks_free) from Prometheus text (see module doc)."""
    samples: dict[str, list[float]] = {}
    total_blocks = 0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample.value)
            if sample.name == _CACHE_INFO and sample.labels.get("num_gpu_blocks", "").isdigit():
                total_blocks = max(total_blocks, int(sample.labels["num_gpu_blocks"]))
    running = int(_sum_samples(samples, _RUNNING) or 0)
    waiting = int(_sum_samples(samples, _WAITING) or 0)
    usage_values = next((samples[n] for n in _KV_USAGE if n in samples), None)
    if usage_values is None:
        return running, waiting, 0, 0
    usage = min(1.0, max(0.0, sum(usage_values) / len(usage_values)))
    total_blocks = total_blocks or NOMINAL_KV_BLOCKS
    return running, waiting, total_blocks, round((1.0 - usage) * total_blocks)


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
    ) -> None:
        """`session` is borrowed when given (the caller closes it), else created on first use and owned."""
        self._base_url = base_url.rstrip("/")
        self._session = session
        self._owns_session = session is None
        self._metrics_interval_s = metrics_interval_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
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
            self._session = aiohttp.ClientSession()
        return self._session

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
        started = reusable = False
        try:
            resp = await self._http().post(
                f"{self._base_url}{path}",
                data=orjson.dumps(body),
                headers={**self._headers, "Content-Type": "application/json", "Accept": "text/event-stream"},
                timeout=self._timeout,
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
                raise EngineUnavailable(message)
            started = True
            yield Admitted(prompt_tokens=0)
            async with aclosing(self._relay(resp)) as events:
                async for event in events:
                    reusable = isinstance(event, Finished)
                    yield event
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            if started:
                raise EngineStreamError(f"stream from {self._base_url} broke: {exc!r}") from exc
            raise EngineUnavailable(f"POST {self._base_url}{path} failed: {exc!r}") from exc
        finally:
            if reusable:
                resp.release()  # body read to the end: the connection goes back to the pool
            else:
                resp.close()  # closes the connection mid-stream: the upstream aborts the request

    async def _relay(self, resp: aiohttp.ClientResponse) -> AsyncIterator[EngineEvent]:
        finish_reason: str | None = None
        usage: dict[str, Any] | None = None
        deltas = 0
        done = False
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, event/id fields
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            try:
                chunk = orjson.loads(data)
            except orjson.JSONDecodeError as exc:
                raise EngineStreamError(f"bad SSE chunk from {self._base_url}: {data[:200]!r}") from exc
            if "error" in chunk:
                raise EngineStreamError(f"upstream {self._base_url} error: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or ():
                text = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
                if text:
                    deltas += 1
                    yield Delta(text=text, num_tokens=1)
                if choice.get("finish_reason"):
                    finish_reason = choice["finish_reason"]
        if finish_reason is None and not done:
            raise EngineStreamError(f"stream from {self._base_url} ended without a finish")
        if done:
            await self._drain(resp)
        details = (usage or {}).get("prompt_tokens_details") or {}
        yield Finished(
            finish_reason=_finish_reason(finish_reason),
            prompt_tokens=int((usage or {}).get("prompt_tokens") or 0),
            completion_tokens=int((usage or {}).get("completion_tokens") or deltas),
            cached_tokens=int(details.get("cached_tokens") or 0),
        )

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
        while True:
            engine_timestamp_s = self._clock.now()
            running, waiting, kv_total, kv_free = await self._scrape()
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
