"""The OpenAI wire format, byte for byte, through the real app (aiohttp test client) with fake engines.

The engines are in-process `EngineClient`s behind the real `ClusterStore`, dispatcher and policies; time is a
`ManualClock`, so responses are exact. The suite-wide loop guard (tests/conftest.py) fails any test that
blocks the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from fake_engines import CREATED, MODEL, FakeEngine, ok_script, script, serving

from gateway.app import HANDLERS_KEY, METRICS_KEY, STORE_KEY
from gateway.domain import Admitted, Delta, EngineRequestError, EngineStreamError, EngineUnavailable, Finished

DONE = b"data: [DONE]\n\n"
CHAT = "/v1/chat/completions"
RID = {"x-request-id": "r1"}


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}


def sse(*objs: Any) -> bytes:
    return b"".join(b"data: " + orjson.dumps(o) + b"\n\n" for o in objs) + DONE


def head(kind: str = "chat") -> dict[str, Any]:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    return {"id": f"{prefix}-r1", "object": obj, "created": CREATED, "model": MODEL}


def chunk(
    index: int, delta: dict[str, Any], finish: str | None = None, *, usage: bool = True
) -> dict[str, Any]:
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    return head() | {"choices": [choice]} | ({"usage": None} if usage else {})


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


ROLE = {"role": "assistant", "content": ""}


async def test_chat_stream_exact_bytes_with_usage() -> None:
    async with serving(FakeEngine("a", ok_script("Hel", "lo", cached_tokens=3))) as client:
        body = chat_body(stream=True, stream_options={"include_usage": True})
        resp = await client.post(CHAT, headers=RID, json=body)
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "text/event-stream"
        assert resp.headers["x-request-id"] == "r1"
        assert await resp.read() == sse(
            chunk(0, ROLE),
            chunk(0, {"content": "Hel"}),
            chunk(0, {"content": "lo"}),
            chunk(0, {}, "stop"),
            head() | {"choices": [], "usage": usage(5, 2, 3)},
        )


async def test_chat_stream_without_usage_has_no_usage_keys() -> None:
    async with serving(FakeEngine("a", ok_script("x", reason="length"))) as client:
        resp = await client.post(CHAT, headers=RID, json=chat_body(stream=True))
        assert await resp.read() == sse(
            chunk(0, ROLE, usage=False),
            chunk(0, {"content": "x"}, usage=False),
            chunk(0, {}, "length", usage=False),
        )


async def test_completions_stream_exact_bytes() -> None:
    def text(t: str, finish: str | None = None) -> dict[str, Any]:
        choice = {"text": t, "index": 0, "logprobs": None, "finish_reason": finish}
        return head("text") | {"choices": [choice], "usage": None}

    async with serving(FakeEngine("a", ok_script("Hel", "lo", cached_tokens=3))) as client:
        body = {"model": MODEL, "prompt": "Say", "stream": True, "stream_options": {"include_usage": True}}
        resp = await client.post("/v1/completions", headers=RID, json=body)
        assert await resp.read() == sse(
            text("Hel"), text("lo"), text("", "stop"), head("text") | {"choices": [], "usage": usage(5, 2, 3)}
        )


async def test_non_streaming_chat_and_completion_bodies() -> None:
    async with serving(FakeEngine("a", ok_script("Hel", "lo", cached_tokens=3))) as client:
        resp = await client.post(CHAT, headers=RID, json=chat_body())
        assert resp.status == 200
        message = {"role": "assistant", "content": "Hello"}
        assert await resp.json() == head() | {
            "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}],
            "usage": usage(5, 2, 3),
        }
        resp = await client.post("/v1/completions", headers=RID, json={"model": MODEL, "prompt": [1, 2, 3]})
        assert await resp.json() == head("text") | {
            "choices": [{"text": "Hello", "index": 0, "logprobs": None, "finish_reason": "stop"}],
            "usage": usage(5, 2, 3),
        }


async def test_n2_stream_merges_choices_by_index_and_fans_out_seeds() -> None:
    a, b = FakeEngine("a", ok_script("A1", "A2")), FakeEngine("b", ok_script("B1", "B2"))
    async with serving(a, b) as client:
        body = chat_body(stream=True, n=2, seed=7, stream_options={"include_usage": True})
        events = (await (await client.post(CHAT, headers=RID, json=body)).read()).split(b"\n\n")
        assert events[-2:] == [b"data: [DONE]", b""]
        chunks = [orjson.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
        per_choice: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
        for c in chunks[:-1]:
            (choice,) = c["choices"]
            per_choice[choice["index"]].append(choice["delta"] | {"finish": choice["finish_reason"]})
        texts = {i: "".join(d.get("content", "") for d in per_choice[i]) for i in (0, 1)}
        assert sorted(texts.values()) == ["A1A2", "B1B2"]
        for i in (0, 1):
            assert per_choice[i][0] == ROLE | {"finish": None}
            assert per_choice[i][-1] == {"finish": "stop"}
        assert chunks[-1]["usage"] == usage(5, 4, 0)
        sent = sorted(a.requests + b.requests, key=lambda r: r.request_id)
        assert [(r.request_id, r.seed) for r in sent] == [("r1-0", 7), ("r1-1", 8)]


async def test_n2_non_streaming_has_both_choices() -> None:
    async with serving(FakeEngine("a", ok_script("x", "y"))) as client:
        body = await (await client.post(CHAT, json=chat_body(n=2))).json()
        assert [c["index"] for c in body["choices"]] == [0, 1]
        assert [c["message"]["content"] for c in body["choices"]] == ["xy", "xy"]
        assert body["usage"]["completion_tokens"] == 4


async def test_engine_failure_after_first_byte_is_an_error_event_then_done() -> None:
    engine = FakeEngine(
        "a", script(Admitted(5), Delta("Hel", num_tokens=1), EngineStreamError("GPU fell off"))
    )
    async with serving(engine) as client:
        resp = await client.post(CHAT, headers=RID, json=chat_body(stream=True))
        assert resp.status == 200
        error = {
            "message": "The engine failed while generating: GPU fell off",
            "type": "server_error",
            "param": None,
            "code": "engine_failure",
        }
        assert await resp.read() == sse(
            chunk(0, ROLE, usage=False), chunk(0, {"content": "Hel"}, usage=False), {"error": error}
        )
        assert engine.closed_streams == 1


async def test_body_over_the_limit_is_413() -> None:
    async with serving(FakeEngine("a", ok_script("x")), max_body_bytes=1024) as client:
        resp = await client.post(CHAT, json=chat_body(user="u" * 2000))
        assert resp.status == 413
        assert (await resp.json())["error"]["code"] == "request_too_large"


async def test_malformed_json_is_400_in_openai_shape() -> None:
    async with serving(FakeEngine("a", ok_script("x"))) as client:
        resp = await client.post(CHAT, data=b"{not json", headers={"x-request-id": "bad-1"})
        assert resp.status == 400
        assert resp.headers["x-request-id"] == "bad-1"
        err = (await resp.json())["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "invalid_request_error" and err["param"] is None
        resp = await client.post(CHAT, json=chat_body(temperature=2.5))
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == "temperature"


async def test_unknown_model_is_404() -> None:
    async with serving(FakeEngine("a", ok_script("x"))) as client:
        resp = await client.post(CHAT, json=chat_body(model="nope"))
        assert resp.status == 404
        err = (await resp.json())["error"]
        assert (err["code"], err["param"], err["type"]) == (
            "model_not_found",
            "model",
            "invalid_request_error",
        )


async def test_no_ready_engine_is_503_and_health_says_so() -> None:
    engine = FakeEngine("a", ok_script("x"), ready=False)
    async with serving(engine) as client:
        resp = await client.post(CHAT, json=chat_body(stream=True))
        assert resp.status == 503
        assert (await resp.json())["error"]["code"] == "no_engine_available"
        assert (await client.get("/health")).status == 503
        assert engine.requests == []


async def test_unavailable_before_first_byte_retries_on_the_other_engine() -> None:
    down = FakeEngine("a", script(EngineUnavailable("connection refused")))
    up = FakeEngine("b", ok_script("ok"))
    async with serving(down, up) as client:
        resp = await client.post(CHAT, json=chat_body())
        assert resp.status == 200
        assert (await resp.json())["choices"][0]["message"]["content"] == "ok"
        assert len(down.requests) == 1 and len(up.requests) == 1
        assert client.app is not None
        assert all(e.inflight_requests == 0 for e in client.app[STORE_KEY].snapshot().engines)


async def test_request_id_is_echoed_or_assigned() -> None:
    async with serving(FakeEngine("a", ok_script("x"))) as client:
        resp = await client.post(CHAT, json=chat_body(), headers={"x-request-id": "abc.123"})
        assert resp.headers["x-request-id"] == "abc.123"
        assert (await resp.json())["id"] == "chatcmpl-abc.123"
        resp = await client.post(CHAT, json=chat_body(), headers={"x-request-id": "bad id!"})
        assigned = resp.headers["x-request-id"]
        assert len(assigned) == 32 and (await resp.json())["id"] == f"chatcmpl-{assigned}"


async def test_client_disconnect_closes_the_engine_stream() -> None:
    steps = [x for _ in range(10_000) for x in (Delta("t", num_tokens=1), 0.005)]
    engine = FakeEngine("a", script(Admitted(5), *steps))
    async with serving(engine) as client:
        assert client.app is not None
        resp = await client.post(CHAT, json=chat_body(stream=True))
        await resp.content.readline()
        resp.close()
        # The engine stream is closed (inner finally) just before the disconnect is counted (outer handler):
        # wait for both effects, not only the first.
        disconnects = client.app[METRICS_KEY].client_disconnects._value
        for _ in range(400):
            if engine.closed_streams and disconnects.get() == 1:
                break
            await asyncio.sleep(0.005)
        assert engine.closed_streams == 1 and engine.completed_streams == 0
        assert all(e.inflight_requests == 0 for e in client.app[STORE_KEY].snapshot().engines)
        assert client.app[METRICS_KEY].client_disconnects._value.get() == 1


async def test_timeout_before_first_byte_is_504() -> None:
    async with serving(FakeEngine("a", script(5.0)), request_timeout_s=0.05) as client:
        resp = await client.post(CHAT, json=chat_body(stream=True))
        assert resp.status == 504
        assert (await resp.json())["error"]["code"] == "request_timeout"


async def test_engine_side_rejection_is_400() -> None:
    async with serving(
        FakeEngine("a", script(EngineRequestError("prompt is longer than the context")))
    ) as client:
        resp = await client.post(CHAT, json=chat_body())
        assert resp.status == 400
        assert "longer than the context" in (await resp.json())["error"]["message"]


async def test_policy_override_header_only_when_allowed() -> None:
    unknown, known = {"x-switchyard-policy": "zzz"}, {"x-switchyard-policy": "least_loaded"}
    async with serving(FakeEngine("a", ok_script("x")), allow_policy_override=True) as client:
        resp = await client.post(CHAT, json=chat_body(), headers=unknown)
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == "x-switchyard-policy"
        assert (await client.post(CHAT, json=chat_body(), headers=known)).status == 200
    async with serving(FakeEngine("a", ok_script("x"))) as client:
        assert (await client.post(CHAT, json=chat_body(), headers=unknown)).status == 200


async def test_models_health_and_metrics() -> None:
    async with serving(FakeEngine("a", ok_script("x")), FakeEngine("b", ok_script("y"))) as client:
        model = {"id": MODEL, "object": "model", "created": 0, "owned_by": "switchyard"}
        assert await (await client.get("/v1/models")).json() == {"object": "list", "data": [model]}
        health = await client.get("/health")
        assert health.status == 200 and (await health.json())["engines_ready"] == 2
        await client.post(CHAT, json=chat_body())
        text = await (await client.get("/metrics")).text()
        assert 'switchyard_engine_ready{engine="a"} 1.0' in text
        assert 'switchyard_engine_kv_free_ratio{engine="b"} 0.8' in text
        assert 'switchyard_requests_total{model="m",status="200"} 1.0' in text
        assert 'switchyard_routing_decision_seconds_count{policy="round_robin"} 1.0' in text
        missing = await client.get("/v1/nothing")
        assert missing.status == 404 and (await missing.json())["error"]["code"] == "unknown_url"


async def test_concurrent_requests_may_reuse_an_x_request_id() -> None:
    engine = FakeEngine("a", script(Admitted(1), 0.02, Delta("x", num_tokens=1), Finished("stop", 1, 1)))
    async with serving(engine) as client:
        replies = await asyncio.gather(*(client.post(CHAT, headers=RID, json=chat_body()) for _ in range(2)))
        assert [r.status for r in replies] == [200, 200]
        assert [(await r.json())["id"] for r in replies] == ["chatcmpl-r1", "chatcmpl-r1"]
        engine_ids = sorted(r.request_id for r in engine.requests)
        assert engine_ids[0] == "r1" and engine_ids[1].startswith("r1+")


async def test_drain_deadline_ends_streams_with_a_clean_error() -> None:
    steps = [x for _ in range(10_000) for x in (Delta("t", num_tokens=1), 0.005)]
    engine = FakeEngine("a", script(Admitted(5), *steps))
    async with serving(engine) as client:
        assert client.app is not None
        resp = await client.post(CHAT, headers=RID, json=chat_body(stream=True))
        await resp.content.readline()
        client.app[HANDLERS_KEY].begin_drain(0.05)
        assert (await client.get("/health")).status == 503
        events = (await resp.read()).split(b"\n\n")
        assert events[-3:] == [
            b'data: {"error":{"message":"The gateway is shutting down; retry the request.",'
            b'"type":"service_unavailable","param":null,"code":"shutting_down"}}',
            b"data: [DONE]",
            b"",
        ]
        assert engine.closed_streams == 1 and engine.completed_streams == 0
        assert client.app[METRICS_KEY].client_disconnects._value.get() == 0
