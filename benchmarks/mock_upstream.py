"""A minimal OpenAI-compatible streaming server: the baseline upstream for the gateway-overhead benchmark.

It does no inference: each request streams `max_tokens` one-word chat chunks as fast as the event loop allows
(optionally `--itl-ms` apart), then a finish chunk, a usage chunk when asked, and `[DONE]`. Anything slower in
front of it is overhead of whatever sits in front (the gateway).

    python benchmarks/mock_upstream.py --port 9100 [--itl-ms 0]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import orjson
from aiohttp import web

MODEL = "mock-model"


def _chunk(rid: str, created: int, delta: dict[str, str], finish: str | None) -> bytes:
    body = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    return b"data: " + orjson.dumps(body) + b"\n\n"


async def chat(request: web.Request) -> web.StreamResponse:
    body = orjson.loads(await request.read())
    n_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
    itl_s = request.app["itl_s"]
    rid = f"chatcmpl-mock-{time.monotonic_ns()}"
    created = int(time.time())
    if not body.get("stream"):
        return web.json_response(
            {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": MODEL,
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": "tok " * n_tokens},
                     "finish_reason": "length"}
                ],
                "usage": {"prompt_tokens": 8, "completion_tokens": n_tokens, "total_tokens": 8 + n_tokens},
            }
        )
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    await resp.write(_chunk(rid, created, {"role": "assistant", "content": ""}, None))
    for _ in range(n_tokens):
        if itl_s:
            await asyncio.sleep(itl_s)
        await resp.write(_chunk(rid, created, {"content": "tok "}, None))
    await resp.write(_chunk(rid, created, {}, "length"))
    if (body.get("stream_options") or {}).get("include_usage"):
        usage = {"prompt_tokens": 8, "completion_tokens": n_tokens, "total_tokens": 8 + n_tokens}
        tail = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": MODEL,
                "choices": [], "usage": usage}
        await resp.write(b"data: " + orjson.dumps(tail) + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def models(_: web.Request) -> web.Response:
    models_list = [{"id": MODEL, "object": "model", "owned_by": "mock"}]
    return web.json_response({"object": "list", "data": models_list})


def build_app(itl_s: float = 0.0) -> web.Application:
    app = web.Application()
    app["itl_s"] = itl_s
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9100)
    ap.add_argument("--itl-ms", type=float, default=0.0)
    args = ap.parse_args()
    import uvloop

    uvloop.install()
    web.run_app(build_app(args.itl_ms / 1000), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
