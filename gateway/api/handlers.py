"""HTTP endpoints: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`, `GET /v1/plan`,
`GET /v1/cascades`, `GET /health`, `GET /metrics`, `GET /openapi.json` (`gateway.api.openapi`).

Owns: reading the body under the size limit and within `client_limits.body_read_timeout_s` (else 408),
refusing output limits beyond the model's context (the smallest its engines described), the client-facing time
bounds of each answer (`gateway.api.client_guard`: a stream the engines went quiet on ends with a
`stream_idle_timeout` error, a client that stops reading is cut after `slow_client_timeout_s`), request ids
(`x-request-id` echoed when well-formed, else assigned; it is also the response id's suffix), routing hints
from headers (`x-session-id`, `x-slo-ttft-ms`, `x-slo-tpot-ms`, `x-priority`, `x-switchyard-policy` when the
config allows overrides), mapping every failure to the OpenAI error shape (HTTP status before the first byte,
an SSE error event after it), and request metrics. With an API key file, `gateway.api.access` gates the
inference routes and `/v1/models` (401 before the body is read, 403 for a model the key may not use, 429 from
its limits); `/health` and `/metrics` stay open.
Must not: choose engines or talk to them (the dispatcher does), or format chunks (openai_format does).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import uuid
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
from aiohttp import web

from gateway.access.keys import ApiKey
from gateway.admission.gate import AdmissionGate, Permit, Rejected
from gateway.api import errors
from gateway.api.access import AccessGate, Ticket
from gateway.api.client_guard import IDLE_STREAM_CANCEL, ClientGuard, GuardedSink
from gateway.api.errors import ApiError
from gateway.api.openai_format import ChatFormat, CompletionFormat
from gateway.api.openapi import OpenApiRoute
from gateway.api.relay import CollectRelay, StreamRelay
from gateway.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    engine_requests,
    parse_chat,
    parse_completion,
)
from gateway.cascade.serve import CascadeRunner, CascadeUnavailable
from gateway.config import GatewayConfig
from gateway.dispatch.dispatcher import (
    ClientDisconnected,
    Dispatcher,
    EventSink,
    NoEngineAvailable,
    RequestShed,
    RequestTimedOut,
)
from gateway.dispatch.features import RoutingHints, estimate_prompt_tokens
from gateway.dispatch.policy_set import UnknownPolicy
from gateway.domain import EngineRequest, EngineRequestError, EngineStreamError
from gateway.observability.metrics import CONTENT_TYPE, GatewayMetrics
from gateway.policies.goodput_rr import combo_type
from switchyard.clock import Clock

log = logging.getLogger(__name__)

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
STATUS_CLIENT_CLOSED = 499  # nginx's code for "client closed the request", used in the status label only


class FleetView(Protocol):
    """What the API shows of the fleet (the cluster store implements it)."""

    def models(self) -> Collection[str]: ...

    def ready_count(self) -> int: ...

    def max_context_tokens(self, model: str) -> int | None:
        """The smallest context among `model`'s engines that described one; None when unknown."""
        ...

    def combos(self) -> dict[str, list[dict[str, Any]]]:
        """The engines by GPU combo label, for GET /v1/plan."""
        ...


@dataclass
class ApiHandlers:
    config: GatewayConfig
    dispatcher: Dispatcher
    fleet: FleetView
    metrics: GatewayMetrics
    clock: Clock
    wall_clock: Clock
    access: AccessGate  # API keys and limits (an open gate without a key file)
    admission: AdmissionGate  # the fleet's bounded queue per model, SLO-aware shedding
    # What `/metrics` answers when not this process's registry alone (a worker: the whole gateway's).
    exposition: Callable[[], Awaitable[bytes]] | None = None
    plan: Mapping[str, Any] | None = None  # the `plan_file` document (CAUCHY), served at GET /v1/plan
    # The autoscaler's state for GET /v1/plan (gateway.fleet.autoscale), when it runs.
    autoscale_view: Callable[[], dict[str, Any]] | None = None
    arrivals: int = 0  # requests received for a served model (the autoscaler's QPS counts them)
    cascades: CascadeRunner | None = None  # cascades served as models (gateway.cascade), when configured
    draining: bool = False
    _inflight_ids: set[str] = field(default_factory=set)
    _inflight_tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    _drain_timer: asyncio.TimerHandle | None = None

    def begin_drain(self, deadline_s: float) -> None:
        """Answer /health 503 from now on; requests still running after `deadline_s` end with a clean
        `shutting_down` error (an SSE error event + [DONE], or a 503 body) instead of a cut connection."""
        self.draining = True
        self.dispatcher.begin_shutdown()
        loop = asyncio.get_running_loop()
        self._drain_timer = loop.call_later(deadline_s, self._cancel_inflight)

    def end_drain(self) -> None:
        if self._drain_timer is not None:
            self._drain_timer.cancel()
            self._drain_timer = None

    def _cancel_inflight(self) -> None:
        if self._inflight_tasks:
            log.warning("drain deadline passed: ending %d request(s)", len(self._inflight_tasks))
        for task in self._inflight_tasks:
            task.cancel()

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/plan", self.get_plan)
        app.router.add_get("/v1/cascades", self.get_cascades)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/openapi.json", OpenApiRoute().handle)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def get_plan(self, request: web.Request) -> web.Response:
        """The configured plan (`plan_file`) and the fleet as it is, by combo: what was planned next to what
        serves. 404 without a plan. `autoscale`: false, or the autoscaler's target combos, QPS, copies and
        action timeline (`gateway.fleet.autoscale.AutoscaleLoop.view`)."""
        try:
            self.access.authenticate(request.headers)
        except ApiError as e:
            return errors.error_response(e)
        if self.plan is None:
            return errors.error_response(ApiError(
                404, "no plan configured: start the gateway with --plan PATH (from `switchyard plan --json`)",
                "invalid_request_error", code="not_found"))
        planned = {str(row["combo"]): int(row["count"]) for row in self.plan.get("combos", [])}
        fleet = self.fleet.combos()
        serving: dict[str, int] = {}
        for label, engines in fleet.items():
            if label and all(e["serving"] for e in engines):
                kind = combo_type(label)
                serving[kind] = serving.get(kind, 0) + 1
        body = {"object": "plan", "plan": self.plan, "planned_combos": planned, "serving_combos": serving,
                "fleet": fleet,
                "autoscale": self.autoscale_view() if self.autoscale_view is not None else False}
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def get_cascades(self, request: web.Request) -> web.Response:
        """The cascades served as models (those the API key may use): each one's models and thresholds now
        and, with `replan:`, its re-planning state (`gateway.cascade.replanner.CascadeReplanner.view`). 404
        without cascades."""
        try:
            key = self.access.authenticate(request.headers)
        except ApiError as e:
            return errors.error_response(e)
        if self.cascades is None:
            return errors.error_response(ApiError(
                404, "no cascades configured (cascades: in the config, or --cascade)",
                "invalid_request_error", code="not_found"))
        visible = set(self.access.visible_models(key, self.cascades.names()))
        body = {"object": "list", "data": [c for c in self.cascades.view() if c["name"] in visible]}
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def list_models(self, request: web.Request) -> web.Response:
        try:
            key = self.access.authenticate(request.headers)
        except ApiError as e:
            return errors.error_response(e)
        served = list(self.fleet.models())
        if self.cascades is not None:
            served += self.cascades.names()
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "switchyard"}
            for m in self.access.visible_models(key, served)
        ]
        return web.Response(
            body=orjson.dumps({"object": "list", "data": data}), content_type="application/json"
        )

    async def health(self, request: web.Request) -> web.Response:
        ready = self.fleet.ready_count()
        ok = ready >= 1 and not self.draining
        body = {
            "status": "ok" if ok else ("draining" if self.draining else "no_engine"),
            "engines_ready": ready,
        }
        return web.Response(
            status=200 if ok else 503, body=orjson.dumps(body), content_type="application/json"
        )

    async def prometheus(self, request: web.Request) -> web.Response:
        body = self.metrics.render() if self.exposition is None else await self.exposition()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def _serve(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        arrival_s = self.clock.now()
        request_id = _request_id(request)
        headers = {"x-request-id": request_id}
        model_label = "unknown"  # only served model names become label values
        status = 500
        relay: StreamRelay | CollectRelay | None = None
        guard: ClientGuard | None = None  # a stream's idle and slow-client bounds
        key: ApiKey | None = None
        ticket: Ticket | None = None
        permit: Permit | None = None
        # Engine-side ids must be unique among in-flight requests even when clients reuse an x-request-id.
        engine_request_id = request_id
        if engine_request_id in self._inflight_ids:
            engine_request_id = f"{request_id}+{uuid.uuid4().hex[:8]}"
        self._inflight_ids.add(engine_request_id)
        task = asyncio.current_task()
        if task is not None:
            self._inflight_tasks.add(task)
        self.metrics.in_flight.inc()
        try:
            key = self.access.authenticate(request.headers)  # before the body is read
            body = await self._read_body(request)
            parsed: ChatCompletionRequest | CompletionRequest = (
                parse_chat(body) if chat else parse_completion(body)
            )
            hints = self._hints(request, arrival_s)
            hints = self.access.hints(key, hints, "x-priority" in request.headers)
            self.access.check_model(key, parsed.model)
            cascade = self._cascade(parsed)
            if cascade is None:
                self._check_model(parsed.model)
            self.arrivals += 1
            self._check_context(parsed)
            model_label = parsed.model
            reqs = engine_requests(
                parsed,
                request_id=engine_request_id,
                slo_ttft_s=hints.slo_ttft_s,
                slo_tpot_s=hints.slo_tpot_s,
                priority=hints.priority,
                session_id=hints.session_id,
            )
            prompt_estimate = estimate_prompt_tokens(reqs[0])
            ticket = self.access.admit(key, prompt_estimate, headers)  # adds x-ratelimit-*
            # A cascade is admitted once, on its first stage's model (every request starts there).
            permit = await self._admit(cascade or parsed.model, hints, prompt_estimate, len(reqs), headers)
            fmt_cls = ChatFormat if chat else CompletionFormat
            fmt = fmt_cls(request_id, int(self.wall_clock.now()), parsed.model, parsed.include_usage)
            stream, n, include_usage = parsed.stream, parsed.n, parsed.include_usage
            # A stream can last minutes: the raw body and the parsed model (each prompt-sized, the model
            # 1.5 KiB more) do not live in this frame for it; the engine requests hold what engines need.
            del body, parsed
            if stream:
                guard = self._guard(request, request_id, task, idle=True)
                relay = StreamRelay(request, fmt, n, include_usage, headers)
                sink = relay if ticket is None else ticket.sink(relay)
                await self._run(reqs, hints, GuardedSink(guard, sink), relay, guard.end)
                with guard.writing():
                    await relay.finish()
                if guard.cut:
                    raise ClientDisconnected("the client stopped reading")
                status = 200
                return relay.response
            relay = CollectRelay(request, fmt, n)
            await self._run(reqs, hints, relay if ticket is None else ticket.sink(relay), relay, _nothing,
                            headers)
            status = 200
            response = web.Response(
                body=orjson.dumps(relay.body()), content_type="application/json", headers=headers
            )
            self._guard_body_write(request, request_id, task)
            return response
        except ClientDisconnected:
            status = STATUS_CLIENT_CLOSED
            return relay.response if isinstance(relay, StreamRelay) else web.Response(status=status)
        except asyncio.CancelledError:
            status = STATUS_CLIENT_CLOSED
            idle = guard is not None and guard.expired == "idle"
            if task is None or not (idle or self.draining):
                raise
            # Our idle-stream bound or our own drain deadline (see `begin_drain`) cancelled us: answer cleanly
            # instead of cutting off.
            task.uncancel()
            limits = self.config.client_limits
            err = errors.stream_idle(limits.idle_stream_timeout_s) if idle else errors.shutting_down()
            status = err.status
            if isinstance(relay, StreamRelay) and relay.started:
                await _fail_stream(relay, err, guard)
                return relay.response
            return errors.error_response(err, headers)
        except Exception as e:  # every failure becomes an OpenAI error; unknown ones are logged as bugs
            err = self._to_api_error(e, model_label, request_id)
            if isinstance(e, RequestShed):
                headers["Retry-After"] = str(max(1, int(e.retry_after_s)))
            status = err.status
            if isinstance(relay, StreamRelay) and relay.started:
                await _fail_stream(relay, err, guard)
                return relay.response
            return errors.error_response(err, headers)
        finally:
            if guard is not None:
                guard.close()
            if isinstance(relay, StreamRelay):
                relay.close()
            self._inflight_ids.discard(engine_request_id)
            if task is not None:
                self._inflight_tasks.discard(task)
            self.metrics.in_flight.dec()
            self.metrics.observe_request(model_label, status)
            self.access.end(key, ticket, model_label, status)
            self.admission.leave(permit)

    def _cascade(self, parsed: ChatCompletionRequest | CompletionRequest) -> str | None:
        """The first stage's model when `parsed` asks for a cascade (checked: one choice, a text prompt), else
        None."""
        runner = self.cascades
        if runner is None or parsed.model not in runner.specs:
            return None
        if parsed.n > 1:
            raise errors.bad_request(
                f"model {parsed.model!r} is a cascade: it answers one choice (n must be 1)", "n")
        if isinstance(parsed, CompletionRequest) and not isinstance(parsed.prompt, str):
            raise errors.bad_request(f"model {parsed.model!r} is a cascade: its judge reads text, so the "
                                     "prompt must be text, not token ids", "prompt")
        return runner.specs[parsed.model].stages[0].model

    async def _run(self, reqs: list[EngineRequest], hints: RoutingHints, sink: EventSink,
                   relay: StreamRelay | CollectRelay, touch: Callable[[], None],
                   headers: dict[str, str] | None = None) -> None:
        """The dispatcher's run, or a cascade's (its stages, judge and usage) when the model is one."""
        runner = self.cascades
        if runner is None or reqs[0].model not in runner.specs:
            await self.dispatcher.run(reqs, hints, sink)
            return

        def set_headers(values: Mapping[str, str]) -> None:
            if isinstance(relay, StreamRelay):
                relay.response.headers.update(values)
            elif headers is not None:
                headers.update(values)

        life = await runner.run(reqs[0].model, reqs[0], hints, sink, set_headers=set_headers, touch=touch)
        relay.usage_of = life.usage_of

    async def _admit(
        self, model: str, hints: RoutingHints, prompt_tokens: int, slots: int, headers: dict[str, str]
    ) -> Permit | None:
        """Through the admission gate (maybe after queueing), or a 503 `fleet_saturated` with Retry-After."""
        try:
            return await self.admission.enter(
                model, priority=hints.priority, prompt_tokens=prompt_tokens, slo_ttft_s=hints.slo_ttft_s,
                slots=slots,
            )
        except Rejected as e:
            headers["Retry-After"] = str(int(e.retry_after_s))
            self.metrics.admission_rejection_time.observe(self.clock.now() - hints.arrival_s)
            raise errors.fleet_saturated(model, e.reason) from None

    def _to_api_error(self, e: Exception, model: str, request_id: str) -> ApiError:
        if isinstance(e, ApiError):
            return e
        if isinstance(e, RequestShed):  # the policy shed it: the admission gate's answer, not "no engine"
            return errors.fleet_saturated(model, e.reason)
        if isinstance(e, NoEngineAvailable | CascadeUnavailable):
            log.warning("request %s: %s", request_id, e)
            return errors.no_engine(model)
        if isinstance(e, RequestTimedOut):
            return errors.timed_out(self.dispatcher.request_timeout_s)
        if isinstance(e, UnknownPolicy):
            return errors.bad_request(str(e), "x-switchyard-policy")
        if isinstance(e, EngineRequestError):
            return errors.bad_request(str(e))
        if isinstance(e, EngineStreamError):
            log.warning("request %s: engine failed mid-stream: %s", request_id, e)
            return errors.engine_failure(str(e))
        log.exception("request %s: internal error", request_id, exc_info=e)
        return errors.internal_error()

    async def _read_body(self, request: web.Request) -> bytes:
        """The body, at most `max_body_bytes` (else 413), all of it within `body_read_timeout_s` of the
        handler's start (else 408: a client trickling its body holds a handler for that long at most)."""
        limit = self.config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise errors.request_too_large(limit)
        chunks: list[bytes] = []
        size = 0
        timeout_s = self.config.client_limits.body_read_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                async for chunk in request.content.iter_chunked(64 * 1024):
                    size += len(chunk)
                    if size > limit:
                        raise errors.request_too_large(limit)
                    chunks.append(chunk)
        except TimeoutError:
            raise errors.body_read_timeout(timeout_s) from None
        return b"".join(chunks)

    def _guard(
        self, request: web.Request, request_id: str, task: asyncio.Task[Any] | None, *, idle: bool
    ) -> ClientGuard:
        limits = self.config.client_limits
        return ClientGuard(
            request,
            idle_s=limits.idle_stream_timeout_s if idle and task is not None else None,
            slow_s=limits.slow_client_timeout_s,
            on_idle=_nothing if task is None else functools.partial(_cancel, task, IDLE_STREAM_CANCEL),
            count_abort=self.metrics.slow_client_aborts.inc,
            label=request_id,
        )

    def _guard_body_write(
        self, request: web.Request, request_id: str, task: asyncio.Task[Any] | None
    ) -> None:
        """A JSON answer is written by aiohttp after the handler returns, in the handler's task: it is bound
        like a stream's writes (a client that never reads it is cut after `slow_client_timeout_s`)."""
        if task is None:
            return
        guard = self._guard(request, request_id, task, idle=False)
        guard.begin()
        task.add_done_callback(lambda _: guard.close())

    def _check_context(self, parsed: ChatCompletionRequest | CompletionRequest) -> None:
        """Output limits beyond the model's context (the smallest its engines described) are refused: no
        engine could honour them. Unknown context (no engine described one): the engine decides."""
        limit_tokens = self.fleet.max_context_tokens(parsed.model)
        if limit_tokens is None:
            return
        completion_limit = (
            isinstance(parsed, ChatCompletionRequest) and parsed.max_completion_tokens is not None
        )
        param = "max_completion_tokens" if completion_limit else "max_tokens"
        output = parsed.output_limit_tokens()
        if output is not None and output > limit_tokens:
            raise errors.context_exceeded(param, output, limit_tokens)
        if parsed.min_tokens > limit_tokens:
            raise errors.context_exceeded("min_tokens", parsed.min_tokens, limit_tokens)

    def _check_model(self, model: str) -> None:
        served = self.fleet.models()
        if model in served:
            return
        if not served:
            raise errors.no_engine(model)
        raise errors.model_not_found(model)

    def _hints(self, request: web.Request, arrival_s: float) -> RoutingHints:
        h = request.headers
        slo = self.config.slo
        ttft_ms = _positive_float(h, "x-slo-ttft-ms", slo.ttft_ms)
        tpot_ms = _positive_float(h, "x-slo-tpot-ms", slo.tpot_ms)
        priority_raw = h.get("x-priority")
        try:
            priority = int(priority_raw) if priority_raw is not None else 0
        except ValueError:
            raise errors.bad_request("x-priority must be an integer", "x-priority") from None
        if not -(2**31) <= priority < 2**31:  # engines take an int32
            raise errors.bad_request("x-priority must be within [-2**31, 2**31)", "x-priority")
        session_id = h.get("x-session-id", "")[:256]
        if not _utf8(session_id):  # aiohttp keeps a head's invalid UTF-8 as surrogate escapes
            raise errors.bad_request("x-session-id must be valid UTF-8", "x-session-id")
        policy = h.get("x-switchyard-policy") if self.config.allow_policy_override else None
        return RoutingHints(
            arrival_s=arrival_s,
            session_id=session_id,
            slo_ttft_s=None if ttft_ms is None else ttft_ms / 1e3,
            slo_tpot_s=None if tpot_ms is None else tpot_ms / 1e3,
            priority=priority,
            policy_name=policy or None,
        )


async def _fail_stream(relay: StreamRelay, err: ApiError, guard: ClientGuard | None) -> None:
    """The error event + [DONE] on a started stream, its write bounded like the others."""
    if guard is None:
        await relay.fail(err)
        return
    with guard.writing():
        await relay.fail(err)


def _nothing() -> None:
    return None


def _cancel(task: asyncio.Task[Any], message: str) -> None:
    task.cancel(message)


def _utf8(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _positive_float(headers: Mapping[str, str], name: str, default: float | None) -> float | None:
    raw = headers.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise errors.bad_request(f"{name} must be a number of milliseconds", name) from None
    if not value > 0 or value == float("inf"):
        raise errors.bad_request(f"{name} must be positive and finite", name)
    return value


def _request_id(request: web.Request) -> str:
    given = request.headers.get("x-request-id")
    if given is not None and _REQUEST_ID.match(given):
        return given
    return uuid.uuid4().hex


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def openai_error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Unknown routes and methods answer in the OpenAI error shape too."""
    try:
        return await handler(request)
    except web.HTTPMethodNotAllowed:
        return errors.error_response(errors.method_not_allowed(request.method, request.path))
    except web.HTTPNotFound:
        return errors.error_response(errors.not_found_route(request.path))
