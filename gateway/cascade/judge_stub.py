"""A judge stub: an OpenAI-compatible server that rates answers from a quality profile, not by reading them.

Owns: `build_stub_app` (POST /v1/chat/completions, GET /v1/models, GET /health), `serve_stub` and the command
`python -m gateway.cascade.judge_stub --port P [--host H --delay-ms X --fail-rate X --malformed-rate X
--seed N --profile PATH]` (`switchyard up --judge-stub` runs it beside the pools); uvloop is installed in
`main` only.
Must not: judge anything for real; it exists so a live cascade can be exercised and measured without a judge
model.

A chat completion is rated as the `profile` judge rates (`judge.rating_from_profile`): the judged model comes
from the `x-switchyard-judged-model` header the gateway's judge client sends, the question from the judge
prompt (`judge_prompt.extract_question`, preferring a split the profile knows); an unknown question gets the
model's marginal, an unknown model or a missing header a 400. The reply is `Rating: [[k]]`, or, when the
prompt is FastChat's verbatim `explain` form, one sentence saying where the score came from and then
`Rating: [[k]]`. `max_tokens` cuts the reply (finish_reason "length"). Usage is estimated as
ceil(UTF-8 bytes / 4) of each message and of the reply (no tokenizer). Faults, drawn per request from one
seeded RNG (two draws always, so the sequence depends only on the seed and the request count): with
`fail_rate` a 503 in OpenAI's error shape, with `malformed_rate` a 200 whose text holds no rating. `delay_ms`
is waited before every answer (a client that goes away cancels the wait).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from gateway.cascade.judge import JUDGED_MODEL_HEADER, rating_from_profile
from gateway.cascade.judge_prompt import EXPLAIN_INSTRUCTION, extract_question, rating_reply
from gateway.cascade.quality import QualityProfile, QualityProfileError, estimate_tokens, load_profile
from gateway.listen import bound_port, stop_on_signals

log = logging.getLogger(__name__)

STUB_MODEL = "switchyard-judge-stub"
MALFORMED_REPLY = "I cannot rate this."  # no [[k]]; short enough for the 8 tokens of `rating`
BYTES_PER_TOKEN = 4


@dataclass(slots=True)
class StubCounts:
    """What the stub answered, for tests and the operator (`STUB_COUNTS` on the app)."""

    requests: int = 0
    rated: int = 0
    failed: int = 0  # injected 503s
    malformed: int = 0  # injected replies without a rating
    by_marginal: int = 0  # rated without finding the question in the profile
    rejected: int = 0  # 400s: not a chat request, no judged-model header, a model the profile lacks


STUB_COUNTS = web.AppKey("judge_stub_counts", StubCounts)


def _error(status: int, message: str, type_: str, code: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


def _json(payload: dict[str, Any]) -> web.Response:
    return web.Response(body=orjson.dumps(payload), content_type="application/json")


class _Stub:
    def __init__(
        self, profile: QualityProfile, delay_s: float, fail_rate: float, malformed_rate: float, seed: int
    ) -> None:
        self._profile = profile
        self._delay_s = delay_s
        self._fail_rate = fail_rate
        self._malformed_rate = malformed_rate
        self._rng = random.Random(seed)
        self.counts = StubCounts()

    def _known(self, question: str) -> bool:
        return self._profile.index_of(question) is not None

    async def chat(self, request: web.Request) -> web.Response:
        self.counts.requests += 1
        fail = self._rng.random() < self._fail_rate
        malformed = self._rng.random() < self._malformed_rate
        try:
            body = orjson.loads(await request.read())
            messages = [(str(m["role"]), m["content"]) for m in body["messages"]]
            if not all(isinstance(content, str) for _, content in messages):
                raise TypeError("message content is not text")
            max_tokens = body.get("max_tokens")
            if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
                raise ValueError(f"max_tokens {max_tokens!r}")
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            self.counts.rejected += 1
            return _error(400, f"not a chat completion request: {exc!r}", "invalid_request_error")
        judged = request.headers.get(JUDGED_MODEL_HEADER)
        if not judged:
            self.counts.rejected += 1
            return _error(
                400, f"the judge stub needs the {JUDGED_MODEL_HEADER} header", "invalid_request_error"
            )
        if self._delay_s > 0:
            await asyncio.sleep(self._delay_s)
        if fail:
            self.counts.failed += 1
            return _error(503, "judge stub: injected failure", "service_unavailable", "injected_failure")
        users = [content for role, content in messages if role == "user"]
        question = extract_question(users[-1], self._known) if users else None
        try:
            rating = rating_from_profile(self._profile, question or "", judged)
        except QualityProfileError as exc:
            self.counts.rejected += 1
            return _error(400, str(exc), "invalid_request_error", "model_not_found")
        if question is None or not self._known(question):
            self.counts.by_marginal += 1
        prompt_text = "".join(content for _, content in messages)
        if malformed:
            self.counts.malformed += 1
            text = MALFORMED_REPLY
        elif EXPLAIN_INSTRUCTION in prompt_text:
            text = (
                f"The judge stub scored this answer of {judged} from its quality profile, without reading "
                f"it. {rating_reply(rating)}"
            )
        else:
            text = rating_reply(rating)
        finish = "stop"
        if max_tokens is not None and estimate_tokens(text) > max_tokens:
            text = text.encode("utf-8")[: max_tokens * BYTES_PER_TOKEN].decode("utf-8", "ignore")
            finish = "length"
        if not malformed:
            self.counts.rated += 1
        prompt_tokens = sum(estimate_tokens(content) for _, content in messages)
        completion_tokens = estimate_tokens(text)
        return _json(
            {
                "id": f"chatcmpl-judge-stub-{self.counts.requests}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": str(body.get("model") or STUB_MODEL),
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
                ],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                },
            }
        )

    async def models(self, request: web.Request) -> web.Response:
        return _json(
            {
                "object": "list",
                "data": [{"id": STUB_MODEL, "object": "model", "created": 0, "owned_by": "switchyard"}],
            }
        )

    async def health(self, request: web.Request) -> web.Response:
        return _json({"status": "ok"})


def build_stub_app(
    profile: QualityProfile | None = None,
    *,
    delay_ms: float = 0.0,
    fail_rate: float = 0.0,
    malformed_rate: float = 0.0,
    seed: int = 0,
) -> web.Application:
    """The stub's application over `profile` (None: the shipped MT-Bench profile)."""
    if delay_ms < 0:
        raise ValueError(f"delay_ms must be >= 0, got {delay_ms}")
    for name, rate in (("fail_rate", fail_rate), ("malformed_rate", malformed_rate)):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {rate}")
    stub = _Stub(
        profile if profile is not None else load_profile(None),
        delay_ms / 1000.0,
        fail_rate,
        malformed_rate,
        seed,
    )
    app = web.Application()
    app[STUB_COUNTS] = stub.counts
    app.router.add_post("/v1/chat/completions", stub.chat)
    app.router.add_get("/v1/models", stub.models)
    app.router.add_get("/health", stub.health)
    return app


async def serve_stub(
    host: str,
    port: int,
    *,
    profile: QualityProfile | None = None,
    delay_ms: float = 0.0,
    fail_rate: float = 0.0,
    malformed_rate: float = 0.0,
    seed: int = 0,
    stop: asyncio.Event | None = None,
    on_listening: Callable[[str], None] | None = None,
    handle_signals: bool = True,
) -> None:
    """Serve the stub until `stop` is set (or SIGTERM/SIGINT when `handle_signals`); `on_listening` gets the
    base URL once bound (port 0 resolves to the real port)."""
    app = build_stub_app(
        profile, delay_ms=delay_ms, fail_rate=fail_rate, malformed_rate=malformed_rate, seed=seed
    )
    stop = stop or asyncio.Event()
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        base_url = f"http://{host}:{bound_port(runner, port)}"
        log.info("judge stub listening on %s", base_url)
        if on_listening is not None:
            on_listening(base_url)
        with stop_on_signals(stop, handle_signals):
            await stop.wait()
    finally:
        await runner.cleanup()


def build_argparser(prog: str = "python -m gateway.cascade.judge_stub") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="An OpenAI-compatible judge stub that rates answers "
        "from a quality profile (gateway.cascade.judge_stub).",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True, help="0 = any free port (the URL is printed)")
    p.add_argument("--delay-ms", type=float, default=0.0, help="wait this long before each answer")
    p.add_argument("--fail-rate", type=float, default=0.0, help="share of requests answered 503")
    p.add_argument("--malformed-rate", type=float, default=0.0, help="share answered without a rating")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault draws")
    p.add_argument(
        "--profile", metavar="PATH", help="quality-profile JSON (default: the shipped MT-Bench one)"
    )
    return p


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop  # noqa: PLC0415 (installed by a process entry only, by the style guide)
    except ImportError:
        return None
    return uvloop.new_event_loop


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_argparser()
    args = parser.parse_args(argv)
    try:
        profile = load_profile(Path(args.profile) if args.profile else None)
        build_stub_app(
            profile,
            delay_ms=args.delay_ms,
            fail_rate=args.fail_rate,
            malformed_rate=args.malformed_rate,
            seed=args.seed,
        )  # the options' check, before binding
    except (QualityProfileError, ValueError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    def announce(url: str) -> None:
        print(f"judge stub listening on {url}", flush=True)

    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(
                serve_stub(
                    args.host,
                    args.port,
                    profile=profile,
                    delay_ms=args.delay_ms,
                    fail_rate=args.fail_rate,
                    malformed_rate=args.malformed_rate,
                    seed=args.seed,
                    on_listening=announce,
                )
            )
    except OSError as exc:
        print(
            f"{parser.prog}: error: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
