"""The gateway's cluster state store: the live adapter around `ClusterState`.

Owns: one state-watching task per engine (describe, then consume `watch_state`, reconnect with exponential
backoff and jitter when the stream breaks), the engine clients, and the clock readings it passes to
`gateway.cluster.state.ClusterState`, which holds all the state (per-engine reports, optimistic in-flight
accounting, sessions, snapshots and their caching; see its docstring for the accounting rules).
Must not: keep cluster state of its own (the simulator drives the same `ClusterState` in virtual time,
invariant I1), route (that is `policies`), run requests (that is `dispatch`), poll engines on the request path
(invariant I4), or drop an engine silently.

Lifecycle (invariant I6): `start()` spawns the watch tasks, `stop()` cancels and awaits them and then closes
the clients, which the store owns from the moment they are added; `async with store:` does both (use it inside
the app's `cleanup_ctx`).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from gateway.cluster.health import FailureReason, OutlierParams
from gateway.cluster.state import ClusterState
from gateway.domain import ClusterSnapshot, EngineDescription, EngineId, EngineReport, RouteTag, StageLayout
from gateway.engines.base import EngineClient
from switchyard.clock import Clock

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Backoff:
    """Reconnect delays: initial_s * multiplier**attempt, capped at max_s, times a jitter factor drawn
    uniformly from [1 - jitter_ratio, 1 + jitter_ratio]."""

    initial_s: float = 0.05
    max_s: float = 5.0
    multiplier: float = 2.0
    jitter_ratio: float = 0.2

    def delay_s(self, attempt: int, rand: float) -> float:
        base_s = min(self.max_s, self.initial_s * self.multiplier ** min(attempt, 64))
        return base_s * (1.0 - self.jitter_ratio + 2.0 * self.jitter_ratio * rand)


@dataclass(slots=True)
class _Watched:
    """An engine's client and the task watching its state stream (its state lives in `ClusterState`)."""

    engine_id: EngineId
    client: EngineClient
    task: asyncio.Task[None] | None = None


class ClusterStore:
    def __init__(
        self,
        clients: Mapping[EngineId, EngineClient],
        clock: Clock,
        *,
        stale_after_s: float = 1.0,
        backoff: Backoff | None = None,
        rand: Callable[[], float] | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        session_ttl_s: float = 600.0,
        max_sessions: int = 100_000,
        snapshot_resolution_s: float = 0.005,
        outlier: OutlierParams | None = None,
    ) -> None:
        """`rand` draws the backoff jitter (inject a seeded one in tests); `sleep` waits out a backoff.

        A cached snapshot is reused while nothing changed, no engine crossed its staleness boundary and it is
        younger than `snapshot_resolution_s` (so `taken_at_s` / `ClusterSnapshot.state_age_s` lag the clock by
        at most that).
        """
        self._clock = clock
        self._backoff = backoff or Backoff()
        self._rand = rand or random.Random().random
        self._sleep = sleep
        self._state = ClusterState(
            stale_after_s=stale_after_s,
            session_ttl_s=session_ttl_s,
            max_sessions=max_sessions,
            snapshot_resolution_s=snapshot_resolution_s,
            outlier=outlier,
        )
        self._watched: dict[EngineId, _Watched] = {}
        self._started = False
        for engine_id, client in clients.items():
            self.add_engine(engine_id, client)

    @property
    def state(self) -> ClusterState:
        """The pure state this store feeds (read it; mutate it only through the store)."""
        return self._state

    # ---- lifecycle -------------------------------------------------------------------------------------

    async def start(self) -> None:
        self._started = True
        for watched in self._watched.values():
            self._spawn(watched)

    async def stop(self) -> None:
        """Cancel and await every watch task, then close every client."""
        self._started = False
        tasks = [w.task for w in self._watched.values() if w.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for watched in self._watched.values():
            watched.task = None
            self._state.on_disconnect(watched.engine_id)
            try:
                await watched.client.close()
            except Exception:
                log.exception("closing engine client %s failed", watched.engine_id)

    async def __aenter__(self) -> ClusterStore:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    def add_engine(self, engine_id: EngineId, client: EngineClient) -> None:
        self._state.add_engine(engine_id, self._clock.now())  # ValueError when already there
        watched = _Watched(engine_id=engine_id, client=client)
        self._watched[engine_id] = watched
        if self._started:
            self._spawn(watched)

    async def remove_engine(self, engine_id: EngineId) -> None:
        """Stop watching an engine, close its client and forget it (an explicit act, never a silent drop)."""
        watched = self._watched.pop(engine_id)
        self._state.remove_engine(engine_id)
        if watched.task is not None:
            watched.task.cancel()
            await asyncio.gather(watched.task, return_exceptions=True)
        await watched.client.close()

    def _spawn(self, watched: _Watched) -> None:
        if watched.task is None or watched.task.done():
            watched.task = asyncio.create_task(self._watch(watched), name=f"watch-state:{watched.engine_id}")

    # ---- the watch loop ------------------------------------------------------------------------------

    async def _watch(self, watched: _Watched) -> None:
        engine_id, client, state = watched.engine_id, watched.client, self._state
        attempt = 0
        while True:
            try:
                state.on_describe(engine_id, await client.describe())
                reports = client.watch_state()
                try:
                    async for report in reports:
                        if not state.is_connected(engine_id):
                            state.on_connect(engine_id)
                            attempt = 0
                            log.info("engine %s connected", engine_id)
                        state.on_report(engine_id, report, self._clock.now())
                finally:
                    aclose = getattr(reports, "aclose", None)
                    if aclose is not None:
                        await (
                            aclose()
                        )  # ends the RPC / poll loop now, not whenever the generator is collected
                log.warning("engine %s state stream ended", engine_id)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("engine %s state stream broke: %r", engine_id, exc)
            state.on_disconnect(engine_id)
            delay_s = self._backoff.delay_s(attempt, self._rand())
            attempt += 1
            await self._sleep(delay_s)

    # ---- optimistic accounting and sessions ------------------------------------------------------------

    def note_dispatch(
        self,
        engine_id: EngineId,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        session_id: str,
        now_s: float,
        route: RouteTag | None = None,
        prefix_keys: Sequence[int] = (),
    ) -> None:
        """Count a request sent to `engine_id` until `note_finish`; record its session (if any) there, a
        weighted policy's pick (`route`) and the prompt's prefix keys (see `ClusterState.note_dispatch`)."""
        self._state.note_dispatch(engine_id, request_id, prompt_tokens, max_tokens, session_id, now_s, route,
                                  prefix_keys)

    def note_finish(self, engine_id: EngineId, request_id: str) -> None:
        """Forget a dispatched request (its oldest dispatch if the id was reused); unknown ids are ignored."""
        self._state.note_finish(engine_id, request_id)

    def note_success(self, engine_id: EngineId) -> bool:
        """A request to the engine produced its first event (outlier detection); True when that ended an
        ejection."""
        return self._state.note_success(engine_id)

    def note_failure(self, engine_id: EngineId, reason: FailureReason, now_s: float) -> bool:
        """A request to the engine failed (outlier detection); True when this ejected it."""
        return self._state.note_failure(engine_id, reason, now_s)

    def note_latency(self, engine_id: EngineId, ttft_s: float, e2e_s: float, now_s: float) -> None:
        """A request finished successfully on `engine_id` at `now_s` (feeds the windowed latency figures)."""
        self._state.note_latency(engine_id, ttft_s, e2e_s, now_s)

    def session_lookup(self, session_id: str) -> tuple[EngineId | None, float]:
        """(engine that last served the session, when) or (None, 0.0) when unknown or older than the TTL."""
        return self._state.session_lookup(session_id, self._clock.now())

    def prefix_match(self, keys: Sequence[int], source: str) -> dict[EngineId, int]:
        """Index blocks of `keys` each engine holds (`ClusterState.prefix_match`, at the clock's now)."""
        return self._state.prefix_match(keys, source, self._clock.now())

    def prune_sessions(self, now_s: float) -> int:
        """Drop sessions unused for over the TTL and the oldest beyond `max_sessions`; returns how many."""
        return self._state.prune_sessions(now_s)

    # ---- reads ---------------------------------------------------------------------------------------------

    def snapshot(self) -> ClusterSnapshot:
        return self._state.snapshot(self._clock.now())

    def publish_stages(self, layouts: Mapping[str, StageLayout]) -> None:
        """The `length_stages` rescheduler's layouts, into later snapshots (`ClusterState.publish_stages`)."""
        self._state.publish_stages(layouts)

    def engine_of(self, request_id: str) -> EngineId | None:
        """The engine this gateway last dispatched `request_id` to and has not released (None: none)."""
        return self._state.engine_of(request_id)

    def client(self, engine_id: EngineId) -> EngineClient:
        """The client of a picked engine (KeyError when unknown)."""
        return self._watched[engine_id].client

    def engine_ids(self) -> tuple[EngineId, ...]:
        return self._state.engine_ids()

    def ready_count(self) -> int:
        """Engines that can take a request now (ready and not ejected, stale or not), for /health."""
        return sum(1 for e in self.snapshot().engines if e.ready and not e.ejected)

    def combos(self) -> dict[str, list[dict[str, Any]]]:
        """The engines by GPU combo label ("" for none), for GET /v1/plan: id, model, gpu, tp, $/h, ready."""
        out: dict[str, list[dict[str, Any]]] = {}
        for e in self.snapshot().engines:
            out.setdefault(e.combo, []).append({
                "engine_id": e.engine_id, "model": e.model, "profile": e.profile, "gpu": e.gpu,
                "tensor_parallel": e.tensor_parallel, "hourly_price_usd": e.hourly_price_usd,
                "serving": e.ready and not e.ejected,
            })
        return out

    def models(self) -> tuple[str, ...]:
        """Served model names (from the engines' descriptions), sorted, for /v1/models."""
        return self._state.models()

    def descriptions(self) -> Mapping[EngineId, EngineDescription]:
        return self._state.descriptions()

    def latest_reports(self) -> Mapping[EngineId, EngineReport]:
        """The last report of each engine that has reported (for metrics)."""
        return self._state.latest_reports()

    def is_connected(self, engine_id: EngineId) -> bool:
        return self._state.is_connected(engine_id)

    def max_context_tokens(self, model: str) -> int | None:
        """The smallest context among the engines of `model` that described one (None when none did): the
        API refuses output limits beyond it."""
        limits = [
            d.max_context_tokens
            for d in self._state.descriptions().values()
            if d.model == model and d.max_context_tokens > 0
        ]
        return min(limits) if limits else None
