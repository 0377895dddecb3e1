"""The gateway's composition root: the only place that wires store, policies, dispatcher, metrics and API.

Owns: `build_app` (typed `AppKey`s; background work born in `cleanup_ctx`: the cluster store's watch tasks and
the upstreams' clients, each with its own pooled HTTP session), the engine clients built from config (engine
id = the configured address), and `serve` (listen, then on SIGTERM/SIGINT: stop accepting, `/health` turns
503, in-flight streams drain for up to `drain_timeout_s`, then remaining handlers are cancelled, which closes
their engine streams; last the store stops and the clients close). In a worker process of a multi-worker
gateway (`gateway.workers`, given a `WorkerSpec`): `/metrics` merges its siblings' expositions
(`observability.siblings`), responses name the worker (`x-switchyard-worker`), and `serve` listens with
SO_REUSEPORT or on the socket the supervisor bound.
Must not: hold module-level state, install an event loop policy (`__main__` does), or contain request logic.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import json
import logging
import random
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from aiohttp import web

from gateway.admission.core import AdmissionParams
from gateway.admission.gate import AdmissionGate
from gateway.api.access import AccessGate
from gateway.api.admin import AdminRoutes
from gateway.api.handlers import ApiHandlers, openai_error_middleware
from gateway.api.openai_format import WallClock
from gateway.cascade.judge import Judge, build_judge
from gateway.cascade.serve import CascadeRunner, cluster_complete
from gateway.cluster.health import OutlierParams
from gateway.cluster.store import ClusterStore
from gateway.config import ConfigError, GatewayConfig, load_plan_document, log_effective_config
from gateway.dispatch.dispatcher import Dispatcher
from gateway.dispatch.mover import MoveParams, Mover, RescheduleLoop, Rescheduler, move_params_for
from gateway.dispatch.policy_set import PolicySet
from gateway.dispatch.retry import RetryBudget, RetryParams
from gateway.dispatch.stall import StallWatch
from gateway.domain import EngineId, StageLayout
from gateway.engines.base import EngineClient
from gateway.engines.grpc_client import GrpcEngineClient
from gateway.engines.grpc_link import load_engine_link
from gateway.engines.openai_upstream import OpenAIUpstreamClient
from gateway.fleet.autoscale import Actuator, AutoscaleLoop
from gateway.listen import bound_port, stop_on_signals
from gateway.observability.loop_lag import lag_monitor_ctx
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.siblings import SiblingScrape
from gateway.planning.plan_file import parse_plan
from gateway.policies import prism_kernel  # noqa: F401  (loads PRISM's compiled kernels before the loop runs)
from gateway.policies.registry import POLICY_NAMES, make_policy
from gateway.rescheduling.length_stages import (
    LengthStages,
    LengthStagesParams,
    StagesConfigError,
    StagesPlanFile,
)
from gateway.rescheduling.star import StarParams, StarRescheduler
from gateway.workers.spec import WORKER_HEADER, WorkerSpec
from switchyard.clock import Clock, MonotonicClock

log = logging.getLogger(__name__)
# `prism_kernel` is imported above for its side effect: numba's import and the kernels' load (about 0.5 s)
# happen when the gateway starts, not on the event loop when a PrismPolicy is first built (the configured
# policy is built inside `build_app`, a per-request override while serving).

CONFIG_KEY = web.AppKey("config", GatewayConfig)
METRICS_KEY = web.AppKey("metrics", GatewayMetrics)
STORE_KEY = web.AppKey("store", ClusterStore)
DISPATCHER_KEY = web.AppKey("dispatcher", Dispatcher)
MOVER_KEY = web.AppKey("mover", Mover)
HANDLERS_KEY = web.AppKey("handlers", ApiHandlers)
_DRAIN_GRACE_S = 1.0
# The accept queue: aiohttp's default (128) overflowed when clients opened 2,000 streams a second
# (benchmarks/gateway_scale.py: connection resets); the kernel caps it at net.core.somaxconn.
LISTEN_BACKLOG = 4096
# The cyclic collector's default first threshold (700 net container allocations) is crossed ~100 times a
# second by the objects of in-flight requests, each collection walking all of them: 5 % of the gateway's CPU
# at 64 streams. At 20,000 no collection ran in 6 s of the same load.
_GC_GEN0_THRESHOLD = 20_000


def build_app(
    config: GatewayConfig,
    *,
    clock: Clock | None = None,
    engine_clients: Mapping[EngineId, EngineClient] | None = None,
    wall_clock: Clock | None = None,
    rng: random.Random | None = None,
    worker: WorkerSpec | None = None,
    actuator: Actuator | None = None,
    judges: Mapping[str, Judge] | None = None,
) -> web.Application:
    """The gateway app. `engine_clients` replaces the engines and upstreams of `config` (tests, embedding);
    `worker`: this app is one of a multi-worker gateway's (see the module docstring); `actuator`: what
    applies the autoscaler's actions (`config.autoscale`; `switchyard up` passes its local fleet); `judges`:
    each cascade's judge by cascade name (default: built from `config.cascades`' judge sections)."""
    clock = clock or MonotonicClock()
    log_effective_config(config, log)
    try:
        policies = PolicySet(make_policy, POLICY_NAMES, config.policy.name, config.policy.params)
    except ValueError as e:
        raise ConfigError(f"policy: {e}") from e
    metrics = GatewayMetrics()
    metrics.workers.set(config.workers)
    access = AccessGate.from_file(config.api_keys_file, metrics, clock)  # ConfigError naming file and entry
    scrape = SiblingScrape(metrics, worker.sibling_sockets()) if worker is not None else None
    link = load_engine_link(config.engine_link)

    def grpc_client(address: str) -> EngineClient:
        return GrpcEngineClient(address, multiplex=config.engine_streams == "session", link=link)

    clients: dict[EngineId, EngineClient] = (
        dict(engine_clients)
        if engine_clients is not None
        else {EngineId(address): grpc_client(address) for address in config.engines}
    )
    o, r = config.outlier, config.retry
    store = ClusterStore(
        clients,
        clock,
        stale_after_s=config.stale_after_s,
        session_ttl_s=config.session_ttl_s,
        outlier=OutlierParams(
            o.consecutive_failures, o.base_ejection_s, o.max_ejection_s, o.max_ejected_ratio
        ),
    )
    stall_watch = StallWatch(config.engine_stall_timeout_s, clock)
    dispatcher = Dispatcher(
        state=store,
        policies=policies,
        clock=clock,
        rng=rng or random.Random(),
        metrics=metrics,
        max_attempts=config.max_dispatch_attempts,
        request_timeout_s=config.request_timeout_s,
        retry_budget=RetryBudget(
            RetryParams(r.budget_ratio, r.min_retries_per_s, r.window_s, r.base_backoff_s, r.max_backoff_s)
        ),
        stall_watch=stall_watch,
    )
    a = config.admission
    admission = AdmissionGate(
        AdmissionParams(
            max_queue=a.max_queue,
            default_engine_slots=a.default_engine_slots,
            rate_window_s=a.rate_window_s,
            slo_quantile=a.slo_quantile,
            calibration_samples=a.calibration_samples,
            shed_expired=a.shed_expired,
        ),
        store.snapshot,
        clock,
        metrics,
        enabled=a.enabled,
    )
    plan_document = load_plan_document(config.plan_file) if config.plan_file is not None else None
    handlers = ApiHandlers(
        config=config,
        dispatcher=dispatcher,
        admission=admission,
        fleet=store,
        metrics=metrics,
        clock=clock,
        wall_clock=wall_clock or WallClock(),
        access=access,
        exposition=scrape.exposition if scrape is not None else None,
        plan=plan_document,
    )
    if config.cascades:
        handlers.cascades = _cascade_runner(config, dispatcher, metrics, clock, judges)
    app = web.Application(middlewares=[openai_error_middleware])
    app[CONFIG_KEY] = config
    app[METRICS_KEY] = metrics
    app[STORE_KEY] = store
    app[DISPATCHER_KEY] = dispatcher
    app[HANDLERS_KEY] = handlers
    handlers.add_routes(app)
    rs = config.reschedule
    rescheduler = _rescheduler(rs.policy, rs.params, rs.interval_s) if rs.policy != "none" else None
    configured = MoveParams(rs.max_migrations_per_request, rs.request_cooldown_s, rs.engine_cooldown_s)
    mover = Mover(store, clock, metrics, move_params_for(rescheduler, configured))
    app[MOVER_KEY] = mover
    if rescheduler is not None:
        reschedule = RescheduleLoop(
            mover, store.snapshot, rescheduler, rs.interval_s, metrics, clock,
            publish=functools.partial(_publish_stages, store, metrics),
        )
        app.cleanup_ctx.append(_background_ctx(reschedule.run, "rescheduler"))
    if config.enable_admin:
        AdminRoutes(mover, access).add_routes(app)
        if access.is_open:
            log.warning("admin endpoints on (/admin/*) and no API key file: anyone can call them")
    upstreams = () if engine_clients is not None else config.upstreams
    app.cleanup_ctx.append(_engines_ctx(upstreams))
    if handlers.cascades is not None:
        app.cleanup_ctx.append(_closing_ctx(handlers.cascades.close))  # unwound before the engines' ctx
        if handlers.cascades.replanners:  # cancelled before the shadows are and the judges close
            app.cleanup_ctx.append(_background_ctx(handlers.cascades.run_replans, "cascade-replan"))
    if config.autoscale.enabled and plan_document is not None:
        autoscale = _autoscale_loop(
            config, plan_document, handlers, store, grpc_client, clock, metrics, actuator
        )
        handlers.autoscale_view = autoscale.view
        app.cleanup_ctx.append(_background_ctx(autoscale.run, "autoscaler"))  # unwound before the engines'
        if actuator is None:
            log.warning("autoscale without an actuator: decisions are published at GET /v1/plan, not applied")
    app.cleanup_ctx.append(lag_monitor_ctx(metrics.loop_lag.observe))  # switchyard_event_loop_lag_seconds
    app.cleanup_ctx.append(_background_ctx(stall_watch.run, "stall-watch"))
    if worker is not None and scrape is not None:
        app.cleanup_ctx.append(scrape.ctx)
        app.on_response_prepare.append(_worker_header(str(worker.index)))
    app.on_shutdown.append(_begin_drain)
    app.on_cleanup.append(_end_drain)
    return app


def _autoscale_loop(
    config: GatewayConfig,
    plan_document: Mapping[str, Any],
    handlers: ApiHandlers,
    store: ClusterStore,
    make_client: Callable[[str], EngineClient],
    clock: Clock,
    metrics: GatewayMetrics,
    actuator: Actuator | None,
) -> AutoscaleLoop:
    return AutoscaleLoop(
        parse_plan(plan_document),
        params=config.autoscale.params(),  # checked when the config was built
        step_s=config.autoscale.step_s,
        arrivals=lambda: handlers.arrivals,
        store=store,
        make_client=make_client,
        clock=clock,
        metrics=metrics,
        actuator=actuator,
    )


def _cascade_runner(config: GatewayConfig, dispatcher: Dispatcher, metrics: GatewayMetrics, clock: Clock,
                    judges: Mapping[str, Judge] | None) -> CascadeRunner:
    """The cascades with their judges; a `cluster` judge calls its model through this gateway's fleet."""
    built: dict[str, Judge] = dict(judges or {})
    complete = functools.partial(cluster_complete, dispatcher, clock)
    for cascade in config.cascades:
        if cascade.name not in built:
            built[cascade.name] = build_judge(cascade.judge, clock=clock, complete=complete)
    return CascadeRunner(config.cascades, dispatcher=dispatcher, judges=built, metrics=metrics, clock=clock)


def _closing_ctx(close: Callable[[], Awaitable[None]]) -> Callable[[web.Application], AsyncIterator[None]]:
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await close()

    return ctx


def _rescheduler(
    policy: str, params: Mapping[str, float | int | bool | str], interval_s: float
) -> Rescheduler:
    """STAR's Algorithm 1 (`gateway.rescheduling.star`) or CascadeInfer's stages
    (`gateway.rescheduling.length_stages`; `plan=PATH` read here), as the reschedule loop's rescheduler;
    `ConfigError` naming the bad key."""
    if policy == "length_stages":
        try:
            stages = LengthStagesParams.from_mapping({"interval_s": interval_s, **params})
            plan = None
            if stages.plan:
                try:
                    doc = json.loads(Path(stages.plan).read_text(encoding="utf-8"))
                except (OSError, ValueError) as e:
                    raise StagesConfigError(f"plan: cannot read {stages.plan}: {e}") from None
                plan = StagesPlanFile.parse(doc, "plan")
        except StagesConfigError as e:
            raise ConfigError(f"reschedule.params: {e}") from e
        return LengthStages(stages, plan=plan, rand=random.random)
    try:
        star = StarParams(**{**params, "use_prediction": policy == "star"})  # type: ignore[arg-type]
    except (TypeError, ValueError) as e:
        raise ConfigError(f"reschedule.params: {e}") from e
    return StarRescheduler(star)


def _publish_stages(store: ClusterStore, metrics: GatewayMetrics, layouts: Mapping[str, StageLayout]) -> None:
    """The rescheduler's stage layouts into the snapshots (the policy's view) and the stage gauges."""
    store.publish_stages(layouts)
    for layout in layouts.values():
        for index, stage in enumerate(layout.stages):
            for engine, bound in zip(stage.engines, stage.bounds or (stage.hi,) * len(stage.engines),
                                     strict=True):
                metrics.engine_stage.labels(engine, layout.model).set(index)
                metrics.engine_stage_bound.labels(engine, layout.model).set(bound)


def _worker_header(index: str) -> Callable[[web.Request, web.StreamResponse], Awaitable[None]]:
    async def name_the_worker(request: web.Request, response: web.StreamResponse) -> None:
        response.headers[WORKER_HEADER] = index

    return name_the_worker


def _background_ctx(
    run: Callable[[], Awaitable[None]], name: str
) -> Callable[[web.Application], AsyncIterator[None]]:
    """A background task for the app's life: started with it, cancelled and awaited at cleanup."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(run(), name=name)
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    return ctx


def _engines_ctx(upstreams: tuple[str, ...]) -> Callable[[web.Application], AsyncIterator[None]]:
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        store, metrics = app[STORE_KEY], app[METRICS_KEY]
        for url in upstreams:
            # One session (connection pool) per upstream, owned and closed by its client: a slow upstream
            # cannot hold the connections another one needs.
            client = OpenAIUpstreamClient(url, max_connections=app[CONFIG_KEY].upstream_max_connections)
            store.add_engine(EngineId(url), client)
        metrics.attach_engine_state(store.snapshot)
        await store.start()
        try:
            yield
        finally:
            await store.stop()  # cancels the watch tasks and closes every engine client (and their sessions)
            metrics.detach_engine_state()

    return ctx


async def _begin_drain(app: web.Application) -> None:
    app[HANDLERS_KEY].begin_drain(app[CONFIG_KEY].drain_timeout_s)
    log.info(
        "draining: no new connections; in-flight requests get up to %.1f s", app[CONFIG_KEY].drain_timeout_s
    )


async def _end_drain(app: web.Application) -> None:
    app[HANDLERS_KEY].end_drain()


async def serve(
    config: GatewayConfig,
    *,
    stop: asyncio.Event | None = None,
    on_listening: Callable[[str], None] | None = None,
    app: web.Application | None = None,
    handle_signals: bool = True,
    reuse_port: bool = False,
    sock: socket.socket | None = None,
) -> None:
    """Run the gateway until `stop` is set (or SIGTERM/SIGINT, when `handle_signals`), then shut down
    gracefully.

    `on_listening` gets the base URL once the socket is bound (port 0 resolves to the real port). A worker of
    a multi-worker gateway binds `config.host:port` with SO_REUSEPORT (`reuse_port`) or serves the listening
    socket `sock` its supervisor bound."""
    app = app or build_app(config)
    stop = stop or asyncio.Event()
    # aiohttp's own deadline comes a little after ours (handlers' `begin_drain`), which ends stragglers with a
    # clean error first; aiohttp's then only catches a handler that ignores cancellation.
    # handler_cancellation: a client that goes away cancels its handler at once (even one waiting on a long
    # prefill or a non-streamed answer), which closes the engine stream and aborts the request on the engine.
    # keepalive_timeout: aiohttp closes a connection still waiting for (the rest of) a request head this long
    # after it opened or answered its last request: the slowloris bound (docs/security.md, "Hostile clients").
    # Head sizes stay within aiohttp's defaults (8190-byte lines, 128 headers).
    runner = web.AppRunner(
        app,
        shutdown_timeout=config.drain_timeout_s + _DRAIN_GRACE_S,
        access_log=None,
        handler_cancellation=True,
        keepalive_timeout=config.client_limits.header_read_timeout_s,
    )
    await runner.setup()
    try:
        site: web.BaseSite = (
            web.SockSite(runner, sock)
            if sock is not None
            else web.TCPSite(
                runner, config.host, config.port, reuse_port=reuse_port or None, backlog=LISTEN_BACKLOG
            )
        )
        try:
            await site.start()
        except OSError as e:
            raise ConfigError(f"cannot listen on {config.host}:{config.port}: {e.strerror or e}") from e
        port = bound_port(runner, config.port)
        base_url = f"http://{config.host}:{port}"
        log.info("gateway listening on %s", base_url)
        if on_listening is not None:
            on_listening(base_url)
        with stop_on_signals(stop, handle_signals), collector_tuned():
            await stop.wait()
        log.info("shutting down")
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def running(
    config: GatewayConfig,
    *,
    app: web.Application | None = None,
    ready_engines: int = 0,
    ready_timeout_s: float = 10.0,
) -> AsyncIterator[str]:
    """`serve` in a task of the running loop (embedding, tests): yields the base URL once the socket listens
    and `ready_engines` engines are in the pool, and stops the gateway gracefully on exit. Raises
    `TimeoutError` when either takes longer than `ready_timeout_s`."""
    app = app or build_app(config)
    stop = asyncio.Event()
    listening: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    server = asyncio.create_task(
        serve(config, stop=stop, app=app, on_listening=listening.set_result, handle_signals=False)
    )
    try:
        async with asyncio.timeout(ready_timeout_s):
            base_url = await listening
            store = app[STORE_KEY]
            while store.ready_count() < ready_engines:  # noqa: ASYNC110 (the store has no readiness event)
                await asyncio.sleep(0.025)
        yield base_url
    finally:
        stop.set()
        await server


@contextlib.contextmanager
def collector_tuned() -> Iterator[None]:
    """While serving: rarer young collections (`_GC_GEN0_THRESHOLD`), and what start-up built (modules, the
    app) frozen out of the collector's walks, so that the full collections left do not walk the whole heap.
    The previous settings come back when serving ends (an embedding process, a test run)."""
    thresholds = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(max(_GC_GEN0_THRESHOLD, thresholds[0]), *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


