"""A minimal OpenAI-compatible streaming server: the baseline upstream for the gateway-overhead benchmark.

It does no inference: each request streams `max_tokens` one-word chat chunks as fast as the event loop allows
(optionally `--itl-ms` apart), then a finish chunk, a usage chunk when asked, and `[DONE]`. Anything slower in
front of it is overhead of whatever sits in front (the gateway). `--random-phase` draws each stream's first
content chunk uniformly within one `--itl-ms` (the role chunk still goes out at once) and paces the rest on a
fixed timeline from there, so that many slow streams tick at spread-out times, as independent requests do,
instead of in step (benchmarks/gateway_scale.py: thousands of streams, one chunk a second).

    python benchmarks/mock_upstream.py --port 9100 [--itl-ms 0] [--random-phase]
"""

from __future__ import annotations

import argparse
import asyncio
import random
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
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "tok " * n_tokens},
                        "finish_reason": "length",
                    }
                ],
                "usage": {"prompt_tokens": 8, "completion_tokens": n_tokens, "total_tokens": 8 + n_tokens},
            }
        )
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    await resp.write(_chunk(rid, created, {"role": "assistant", "content": ""}, None))
    if request.app["random_phase"]:
        # On a fixed timeline from a random phase: a chunk written late does not delay the ones after it, so
        # streams keep their phases. (Sleeping one ITL after each write instead lets the streams one loop
        # iteration serves, all timed from that iteration's cached clock, fall into step: they merge into
        # bursts that grow until a few bursts a second hold them all.)
        loop = asyncio.get_running_loop()
        due_s = loop.time() + random.uniform(0.0, itl_s)
        for _ in range(n_tokens):
            await asyncio.sleep(max(0.0, due_s - loop.time()))
            due_s += itl_s
            await resp.write(_chunk(rid, created, {"content": "tok "}, None))
    else:
        for _ in range(n_tokens):
            if itl_s:
                await asyncio.sleep(itl_s)
            await resp.write(_chunk(rid, created, {"content": "tok "}, None))
    await resp.write(_chunk(rid, created, {}, "length"))
    if (body.get("stream_options") or {}).get("include_usage"):
        usage = {"prompt_tokens": 8, "completion_tokens": n_tokens, "total_tokens": 8 + n_tokens}
        tail = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": MODEL,
            "choices": [],
            "usage": usage,
        }
        await resp.write(b"data: " + orjson.dumps(tail) + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def models(_: web.Request) -> web.Response:
    models_list = [{"id": MODEL, "object": "model", "owned_by": "mock"}]
    return web.json_response({"object": "list", "data": models_list})


def build_app(itl_s: float = 0.0, random_phase: bool = False) -> web.Application:
    app = web.Application()
    app["itl_s"] = itl_s
    app["random_phase"] = random_phase
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9100)
    ap.add_argument("--itl-ms", type=float, default=0.0)
    ap.add_argument(
        "--random-phase", action="store_true", help="first content chunk at a random point of one ITL"
    )
    args = ap.parse_args()
    import uvloop

    uvloop.install()
    web.run_app(build_app(args.itl_ms / 1000, args.random_phase), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
