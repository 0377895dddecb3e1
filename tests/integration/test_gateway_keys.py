"""API keys and limits over HTTP: the real app (store, dispatcher, handlers, access gate) on loopback in
front of scripted in-process engines, a manual clock driving the buckets; aiohttp's client and the official
`openai` client as callers.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import random
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.app import STORE_KEY, build_app
from gateway.config import ConfigError, GatewayConfig
from gateway.domain import (
    Admitted,
    Delta,
    EngineDescription,
    EngineEvent,
    EngineId,
    EngineReport,
    EngineRequest,
    Finished,
)
from switchyard.clock import ManualClock

pytestmark = pytest.mark.integration

ALICE = "sk-alice-4f1c9a0e7d2b"
BOB = "sk-bob-93d0c6a1e5f7"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
Client = TestClient[web.Request, web.Application]


class Engine:
    """An in-process engine serving `model`: `Admitted(prompt_tokens)`, `tokens` one-token deltas, `Finished`;
    with `gate`, it waits for the gate before finishing (a stream held open)."""

    def __init__(self, engine_id: str, model: str = "m", *, tokens: int = 3, prompt_tokens: int = 4) -> None:
        self.engine_id = engine_id
        self.model = model
        self.tokens = tokens
        self.prompt_tokens = prompt_tokens
        self.gate: asyncio.Event | None = None
        self.requests: list[EngineRequest] = []

    @property
    def address(self) -> str:
        return f"fake://{self.engine_id}"

    async def describe(self) -> EngineDescription:
        return EngineDescription(EngineId(self.engine_id), self.model, "fake", "sim", "", 4096, 16, 64)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineEvent]:
        self.requests.append(request)
        yield Admitted(self.prompt_tokens)
        for i in range(self.tokens):
            yield Delta(f"t{i} ", num_tokens=1)
        if self.gate is not None:
            await self.gate.wait()
        yield Finished("stop", self.prompt_tokens, self.tokens)

    async def watch_state(self) -> AsyncIterator[EngineReport]:
        yield EngineReport(
            engine_id=EngineId(self.engine_id),
            model=self.model,
            profile="fake",
            backend="sim",
            role="",
            seq=1,
            engine_timestamp_s=0.0,
            ready=True,
            draining=False,
            num_running=0,
            num_waiting=0,
            kv_blocks_total=100,
            kv_blocks_free=80,
            kv_blocks_reserved=0,
            pending_prefill_tokens=0,
            running_batch_tokens=0,
        )
        await asyncio.Event().wait()

    async def close(self) -> None:
        return None


def write_keys(tmp_path: Path, *entries: dict[str, Any]) -> str:
    path = tmp_path / "keys.json"
    path.write_bytes(orjson.dumps({"keys": list(entries)}))
    return str(path)


@contextlib.asynccontextmanager
async def gateway(
    keys_file: str | None, engines: Sequence[Engine], clock: ManualClock | None = None
) -> AsyncIterator[Client]:
    app = build_app(
        GatewayConfig(api_keys_file=keys_file, stale_after_s=1e6),
        clock=clock or ManualClock(100.0),
        engine_clients={EngineId(e.engine_id): e for e in engines},
        wall_clock=ManualClock(1_700_000_000),
        rng=random.Random(0),
    )
    client: Client = TestClient(TestServer(app))
    await client.start_server()
    try:
        store = app[STORE_KEY]
        for _ in range(1000):
            if store.ready_count() == len(engines):
                break
            await asyncio.sleep(0.001)
        yield client
    finally:
        await client.close()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat(model: str = "m", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}


def completion(prompt_ids: list[int], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": prompt_ids, **extra}  # token ids: the prompt estimate is exact


def ratelimit_headers(headers: Any) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items() if k.lower().startswith("x-ratelimit-")}


async def test_requests_without_a_valid_key_get_401_in_openai_shape(tmp_path: Path) -> None:
    engine = Engine("e0")
    async with gateway(write_keys(tmp_path, {"name": "alice", "key": ALICE}), [engine]) as client:
        cases = [
            ({}, None),
            ({"Authorization": f"Basic {ALICE}"}, None),
            ({"Authorization": "Bearer "}, None),
            (auth("sk-not-a-key-at-all"), "invalid_api_key"),
            (auth(ALICE + "x"), "invalid_api_key"),
        ]
        for headers, code in cases:
            resp = await client.post(CHAT, json=chat(), headers=headers)
            assert resp.status == 401, headers
            body = await resp.json()
            assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == code
            assert body["error"]["param"] is None and "API key" in body["error"]["message"]
            assert not ratelimit_headers(resp.headers)
        resp = await client.get("/v1/models")
        assert resp.status == 401
        assert engine.requests == []  # nothing reached an engine
        # /health and /metrics stay open.
        assert (await client.get("/health")).status == 200
        metrics = await client.get("/metrics")
        assert metrics.status == 200
        assert 'switchyard_key_requests_total{key="unauthenticated",model="unknown",status="401"} 6.0' in (
            await metrics.text()
        )
        resp = await client.post(CHAT, json=chat(), headers=auth(ALICE))
        assert resp.status == 200 and (await resp.json())["choices"][0]["message"]["content"] == "t0 t1 t2 "


async def test_a_key_sees_and_uses_only_its_models(tmp_path: Path) -> None:
    keys = write_keys(
        tmp_path,
        {"name": "alice", "key": ALICE, "models": ["m"]},
        {"name": "bob", "key_sha256": hashlib.sha256(BOB.encode()).hexdigest(), "models": "*"},
    )
    async with gateway(keys, [Engine("e0", "m"), Engine("e1", "other")]) as client:
        listed = await (await client.get("/v1/models", headers=auth(ALICE))).json()
        assert [m["id"] for m in listed["data"]] == ["m"]
        listed = await (await client.get("/v1/models", headers=auth(BOB))).json()
        assert [m["id"] for m in listed["data"]] == ["m", "other"]

        resp = await client.post(CHAT, json=chat("other"), headers=auth(ALICE))
        assert resp.status == 403
        assert (await resp.json())["error"] == {
            "message": "The API key `alice` is not allowed to use the model `other`.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_allowed",
        }
        # Refused before the fleet is asked: a model nobody serves is 403 too, not 404.
        assert (await client.post(CHAT, json=chat("nope"), headers=auth(ALICE))).status == 403
        assert (await client.post(CHAT, json=chat("nope"), headers=auth(BOB))).status == 404
        assert (await client.post(CHAT, json=chat("other"), headers=auth(BOB))).status == 200


async def test_429_when_the_request_bucket_is_empty(tmp_path: Path) -> None:
    clock = ManualClock(100.0)
    keys = write_keys(tmp_path, {"name": "alice", "key": ALICE, "requests_per_s": 2})
    async with gateway(keys, [Engine("e0")], clock) as client:
        for remaining in ("1", "0"):
            resp = await client.post(CHAT, json=chat(), headers=auth(ALICE))
            assert resp.status == 200
            assert ratelimit_headers(resp.headers) == {
                "x-ratelimit-limit-requests": "2",
                "x-ratelimit-remaining-requests": remaining,
                "x-ratelimit-reset-requests": "500ms" if remaining == "1" else "1s",
            }
        clock.advance(0.25)
        resp = await client.post(CHAT, json=chat(), headers=auth(ALICE))
        assert resp.status == 429
        assert resp.headers["Retry-After"] == "1"
        assert ratelimit_headers(resp.headers) == {
            "x-ratelimit-limit-requests": "2",
            "x-ratelimit-remaining-requests": "0",
            "x-ratelimit-reset-requests": "750ms",
        }
        error = (await resp.json())["error"]
        assert (error["type"], error["code"], error["param"]) == ("requests", "rate_limit_exceeded", None)
        assert "Please try again in 250ms." in error["message"]
        assert "x-request-id" in resp.headers
        clock.advance(0.25)
        assert (await client.post(CHAT, json=chat(), headers=auth(ALICE))).status == 200
        text = await (await client.get("/metrics")).text()
        assert 'switchyard_rate_limited_total{key="alice",reason="requests"} 1.0' in text
        assert 'switchyard_key_requests_total{key="alice",model="m",status="200"} 3.0' in text
        assert 'switchyard_key_requests_total{key="alice",model="m",status="429"} 1.0' in text


async def test_concurrent_streams_are_capped_per_key(tmp_path: Path) -> None:
    engine = Engine("e0")
    engine.gate = asyncio.Event()
    keys = write_keys(
        tmp_path,
        {"name": "alice", "key": ALICE, "max_concurrent_streams": 1},
        {"name": "bob", "key": BOB, "max_concurrent_streams": 1},
    )
    async with gateway(keys, [engine]) as client:
        first = await client.post(CHAT, json=chat(stream=True), headers=auth(ALICE))
        assert first.status == 200
        assert (await first.content.readline()).startswith(b"data: ")  # streaming, held open by the gate
        second = await client.post(CHAT, json=chat(stream=True), headers=auth(ALICE))
        assert second.status == 429 and second.headers["Retry-After"] == "1"
        error = (await second.json())["error"]
        assert error["type"] == "requests" and "concurrent" in error["message"]
        # Another key's slot is its own.
        bob_task = asyncio.create_task(client.post(CHAT, json=chat(), headers=auth(BOB)))
        engine.gate.set()
        assert (await bob_task).status == 200
        await first.read()
        for _ in range(100):  # the handler's `finally` runs once the response is written
            resp = await client.post(CHAT, json=chat(), headers=auth(ALICE))
            if resp.status == 200:
                break
            await asyncio.sleep(0.01)
        assert resp.status == 200


async def test_a_client_that_leaves_frees_its_stream_slot(tmp_path: Path) -> None:
    engine = Engine("e0", tokens=1)
    engine.gate = asyncio.Event()
    keys = write_keys(tmp_path, {"name": "alice", "key": ALICE, "max_concurrent_streams": 1})
    async with gateway(keys, [engine]) as client:
        first = await client.post(CHAT, json=chat(stream=True), headers=auth(ALICE))
        assert (await first.content.readline()).startswith(b"data: ")
        first.close()  # the client goes away mid-stream
        engine.gate.set()
        for _ in range(200):
            resp = await client.post(CHAT, json=chat(), headers=auth(ALICE))
            if resp.status == 200:
                break
            assert resp.status == 429
            await asyncio.sleep(0.01)
        assert resp.status == 200


async def test_completion_tokens_are_charged_as_they_stream(tmp_path: Path) -> None:
    clock = ManualClock(100.0)
    engine = Engine("e0", tokens=100, prompt_tokens=4)
    keys = write_keys(tmp_path, {"name": "alice", "key": ALICE, "tokens_per_min": 60})  # 1 token/s
    async with gateway(keys, [engine], clock) as client:
        resp = await client.post(COMPLETIONS, json=completion([1, 2, 3, 4], stream=True), headers=auth(ALICE))
        assert resp.status == 200
        # Headers go out before the first byte: the prompt taken at admission, nothing streamed yet.
        assert ratelimit_headers(resp.headers) == {
            "x-ratelimit-limit-tokens": "60",
            "x-ratelimit-remaining-tokens": "56",
            "x-ratelimit-reset-tokens": "4s",
        }
        await resp.read()
        # 4 + 100 tokens from a bucket of 60: 44 in debt. A 4-token prompt waits for 48 tokens at 1/s.
        resp = await client.post(COMPLETIONS, json=completion([1, 2, 3, 4]), headers=auth(ALICE))
        assert resp.status == 429
        assert resp.headers["Retry-After"] == "48"
        assert ratelimit_headers(resp.headers)["x-ratelimit-remaining-tokens"] == "0"
        assert ratelimit_headers(resp.headers)["x-ratelimit-reset-tokens"] == "1m44s"
        error = (await resp.json())["error"]
        assert (error["type"], error["code"]) == ("tokens", "rate_limit_exceeded")
        clock.advance(48)
        assert (
            await client.post(COMPLETIONS, json=completion([1, 2, 3, 4]), headers=auth(ALICE))
        ).status == 200
        # A prompt above the whole bucket can never pass: no Retry-After, and clients are told not to retry.
        resp = await client.post(COMPLETIONS, json=completion(list(range(61))), headers=auth(ALICE))
        assert resp.status == 429 and "Retry-After" not in resp.headers
        assert resp.headers["x-should-retry"] == "false"
        assert "Request too large" in (await resp.json())["error"]["message"]
        text = await (await client.get("/metrics")).text()
        assert 'switchyard_key_tokens_total{key="alice",kind="prompt"} 8.0' in text
        assert 'switchyard_key_tokens_total{key="alice",kind="completion"} 200.0' in text
        assert 'switchyard_rate_limited_total{key="alice",reason="tokens"} 1.0' in text
        assert 'switchyard_rate_limited_total{key="alice",reason="too_large"} 1.0' in text


async def test_the_prompt_estimate_is_corrected_to_the_engines_count(tmp_path: Path) -> None:
    engine = Engine("e0", tokens=0, prompt_tokens=1)  # the engine counts 1 prompt token, the estimate 10
    keys = write_keys(tmp_path, {"name": "alice", "key": ALICE, "tokens_per_min": 60})
    async with gateway(keys, [engine]) as client:
        assert (
            await client.post(COMPLETIONS, json=completion(list(range(10))), headers=auth(ALICE))
        ).status == 200
        resp = await client.post(COMPLETIONS, json=completion([1]), headers=auth(ALICE))
        assert ratelimit_headers(resp.headers)["x-ratelimit-remaining-tokens"] == "58"  # 60 - 1 - 1


@pytest.mark.parametrize(("header", "priority"), [(None, 3), ("0", 3), ("3", 3), ("7", 7)])
async def test_the_key_priority_caps_the_requested_one(
    tmp_path: Path, header: str | None, priority: int
) -> None:
    engine = Engine("e0")
    keys = write_keys(tmp_path, {"name": "alice", "key": ALICE, "priority": 3})
    async with gateway(keys, [engine]) as client:
        headers = auth(ALICE) | ({"x-priority": header} if header is not None else {})
        assert (await client.post(CHAT, json=chat(), headers=headers)).status == 200
        assert engine.requests[0].priority == priority


async def test_keys_never_reach_metrics_or_logs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    clock = ManualClock(100.0)
    keys = write_keys(tmp_path, {"name": "alice", "key": ALICE, "requests_per_s": 1, "models": ["m"]})
    async with gateway(keys, [Engine("e0"), Engine("e1", "other")], clock) as client:
        for body, headers in [
            (chat(), auth(ALICE)),
            (chat(), auth(ALICE)),  # 429
            (chat("other"), auth(ALICE)),  # 403
            (chat(), auth(BOB)),  # 401
            (chat(stream=True), auth(ALICE)),  # 429, streamed
        ]:
            await (await client.post(CHAT, json=body, headers=headers)).read()
        text = await (await client.get("/metrics")).text()
    assert 'key="alice"' in text
    assert ALICE not in text and BOB not in text
    assert hashlib.sha256(ALICE.encode()).hexdigest() not in text
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "alice" in logged  # the name is logged (start-up, rate limits)
    assert ALICE not in logged and BOB not in logged and ALICE not in caplog.text and BOB not in caplog.text


async def test_without_a_key_file_the_gateway_is_open_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async with gateway(None, [Engine("e0")]) as client:
        resp = await client.post(CHAT, json=chat())
        assert resp.status == 200 and not ratelimit_headers(resp.headers)
        assert (await client.post(CHAT, json=chat(), headers=auth("anything-at-all"))).status == 200
        assert (await client.get("/v1/models")).status == 200
        text = await (await client.get("/metrics")).text()
    assert "switchyard_key_requests_total{" not in text  # no per-key series at an open gateway
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "no API key file: the gateway accepts every request" in warnings


def test_a_bad_key_file_stops_the_app_naming_file_and_entry(tmp_path: Path) -> None:
    keys = write_keys(tmp_path, {"name": "alice", "key": ALICE}, {"name": "bob", "key": ALICE})
    with pytest.raises(ConfigError, match=r"API key file .*keys.json: keys.1 \('bob'\): same key as keys.0"):
        build_app(GatewayConfig(api_keys_file=keys), engine_clients={})


async def test_the_official_client_raises_its_typed_errors(tmp_path: Path) -> None:
    keys = write_keys(tmp_path, {"name": "alice", "key": ALICE, "models": ["m"], "requests_per_s": 1})
    async with gateway(keys, [Engine("e0"), Engine("e1", "other")]) as client:
        base_url = str(client.make_url("/v1"))
        messages: list[Any] = [{"role": "user", "content": "hi"}]
        async with openai.AsyncOpenAI(base_url=base_url, api_key="sk-wrong-key-123", max_retries=0) as wrong:
            with pytest.raises(openai.AuthenticationError) as auth_error:
                await wrong.chat.completions.create(model="m", messages=messages)
            assert auth_error.value.code == "invalid_api_key"
        async with openai.AsyncOpenAI(base_url=base_url, api_key=ALICE, max_retries=0) as alice:
            with pytest.raises(openai.PermissionDeniedError):
                await alice.chat.completions.create(model="other", messages=messages)
            reply = await alice.chat.completions.with_raw_response.create(model="m", messages=messages)
            assert reply.headers["x-ratelimit-remaining-requests"] == "0"
            assert reply.parse().choices[0].message.content == "t0 t1 t2 "
            with pytest.raises(openai.RateLimitError) as limited:
                await alice.chat.completions.create(model="m", messages=messages, stream=True)
            assert limited.value.code == "rate_limit_exceeded"
            assert limited.value.response.headers["retry-after"] == "1"
            assert [m.id for m in (await alice.models.list()).data] == ["m"]
