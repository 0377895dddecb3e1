"""One request's life, from routing to the last engine event.

Owns: `Dispatcher`: build `RequestFeatures` (clock, dispatch sequence and randomness are injected here, so the
policy stays pure), take a snapshot, time `policy.pick`, `note_dispatch`, open the engine stream, relay its
events to an `EventSink`, retry on `EngineUnavailable` before the first event (on engines not yet tried,
bounded), fan out n choices and merge them by choice index, enforce the request timeout, close the engine
stream whenever the relay ends early (the engine aborts), count client disconnects, `note_finish` always, and
`note_latency` for each choice that finished successfully (its TTFT and E2E measured from the dispatch to the
engine that served it, so a retry's earlier attempts do not count against that engine; this feeds the
latency-based policy's windowed figures).
Must not: format HTTP or SSE (the sink does), parse requests, or mutate the cluster beyond
note_dispatch/finish/latency.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from gateway.dispatch.features import RoutingHints, build_features, estimate_prompt_tokens
from gateway.dispatch.policy_set import PolicySet
from gateway.domain import (
    ClusterSnapshot,
    Delta,
    EngineEvent,
    EngineId,
    EngineRequest,
    EngineStreamError,
    EngineUnavailable,
    Finished,
)
from gateway.engines.base import EngineClient
from gateway.observability.metrics import GatewayMetrics
from switchyard.clock import Clock

log = logging.getLogger(__name__)


class RoutingState(Protocol):
    """The part of the cluster store the dispatcher uses."""

    def snapshot(self) -> ClusterSnapshot: ...

    def note_dispatch(
        self,
        engine_id: EngineId,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        session_id: str,
        now_s: float,
    ) -> None: ...

    def note_finish(self, engine_id: EngineId, request_id: str) -> None: ...

    def note_latency(self, engine_id: EngineId, ttft_s: float, e2e_s: float, now_s: float) -> None: ...

    def session_lookup(self, session_id: str) -> tuple[EngineId | None, float]: ...

    def client(self, engine_id: EngineId) -> EngineClient:
        """The client of an engine in the snapshot (KeyError when unknown)."""
        ...


class EventSink(Protocol):
    """Where events go (the API's SSE writer or body collector). Raises `ClientDisconnected` if the client
    left."""

    async def on_event(self, index: int, event: EngineEvent) -> None: ...


class ClientDisconnected(Exception):
    """The client went away; the dispatcher closes the engine streams and counts it."""


class NoEngineAvailable(Exception):
    """No engine could take the request (none eligible, or all tried ones unavailable)."""


class RequestTimedOut(Exception):
    """The request did not finish within the configured timeout."""


class Dispatcher:
    def __init__(
        self,
        *,
        state: RoutingState,
        policies: PolicySet,
        clock: Clock,
        rng: random.Random,
        metrics: GatewayMetrics,
        max_attempts: int = 3,
        request_timeout_s: float = 600.0,
    ) -> None:
        self._state = state
        self._policies = policies
        self._clock = clock
        self._rng = rng
        self._metrics = metrics
        self._max_attempts = max_attempts
        self.request_timeout_s = request_timeout_s
        self._seq = itertools.count()
        self._shutting_down = False

    def begin_shutdown(self) -> None:
        """From now on a cancelled relay is the server draining, not a client disconnect."""
        self._shutting_down = True

    async def run(self, requests: Sequence[EngineRequest], hints: RoutingHints, sink: EventSink) -> None:
        """Serve all choices of one API request into `sink`, within the request timeout.

        Raises `NoEngineAvailable`, `RequestTimedOut`, `EngineStreamError`, `EngineRequestError` (from the
        engine client) or `ClientDisconnected`; engine streams are closed before it returns or raises.
        """
        try:
            async with asyncio.timeout(self.request_timeout_s):
                if len(requests) == 1:
                    await self._relay_one(requests[0], hints, sink)
                else:
                    await self._relay_many(requests, hints, sink)
        except TimeoutError as e:
            raise RequestTimedOut(f"no finish within {self.request_timeout_s:g} s") from e
        except ClientDisconnected:  # a write to a gone client failed
            self._metrics.client_disconnects.inc()
            raise
        except asyncio.CancelledError:  # aiohttp cancels the handler when its client goes away ...
            if not self._shutting_down:  # ... and when shutdown ends a request, which is no disconnect
                self._metrics.client_disconnects.inc()
            raise

    async def _relay_one(self, request: EngineRequest, hints: RoutingHints, sink: EventSink) -> None:
        async with contextlib.aclosing(self.generate(request, hints)) as events:
            async for event in events:
                await sink.on_event(0, event)

    async def _relay_many(
        self, requests: Sequence[EngineRequest], hints: RoutingHints, sink: EventSink
    ) -> None:
        queue: asyncio.Queue[tuple[int, EngineEvent | BaseException | None]] = asyncio.Queue()

        async def pump(index: int, request: EngineRequest) -> None:
            try:
                async with contextlib.aclosing(self.generate(request, hints)) as events:
                    async for event in events:
                        queue.put_nowait((index, event))
                queue.put_nowait((index, None))
            except Exception as e:  # handed to the relaying task, which raises it
                queue.put_nowait((index, e))

        tasks = [
            asyncio.create_task(pump(i, r), name=f"choice-{r.request_id}") for i, r in enumerate(requests)
        ]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    await sink.on_event(index, item)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def generate(self, request: EngineRequest, hints: RoutingHints) -> AsyncIterator[EngineEvent]:
        """One choice's events, routed and retried before the first event; use under `contextlib.aclosing`."""
        tried: set[EngineId] = set()
        prompt_tokens = estimate_prompt_tokens(request)
        session_engine: EngineId | None = None
        session_last_used_s = 0.0
        if hints.session_id:
            session_engine, session_last_used_s = self._state.session_lookup(hints.session_id)
        last_error: EngineUnavailable | None = None
        for _ in range(self._max_attempts):
            now_s = self._clock.now()
            features = build_features(
                request,
                hints,
                prompt_tokens=prompt_tokens,
                now_s=now_s,
                dispatch_seq=next(self._seq),
                rand=self._rng.random(),
                session_engine=session_engine,
                session_last_used_s=session_last_used_s,
                exclude=frozenset(tried),
            )
            policy_name, policy = self._policies.resolve(hints.policy_name)
            snapshot = self._state.snapshot()
            started_s = self._clock.now()
            engine_id = policy.pick(features, snapshot)
            self._metrics.routing_decision.labels(policy_name).observe(self._clock.now() - started_s)
            if engine_id is None:
                break
            client = self._state.client(engine_id)
            tried.add(engine_id)
            self._state.note_dispatch(
                engine_id, request.request_id, prompt_tokens, features.max_tokens, hints.session_id, now_s
            )
            stream = client.generate(request)
            try:
                try:
                    first = await anext(stream)
                except (EngineUnavailable, StopAsyncIteration) as e:
                    last_error = e if isinstance(e, EngineUnavailable) else EngineUnavailable("empty stream")
                    log.info(
                        "request %s: engine %s unavailable (%s); retrying elsewhere",
                        request.request_id,
                        engine_id,
                        last_error,
                    )
                    self._metrics.retries.inc()
                    continue
                timing = _ChoiceTiming(hints.arrival_s)
                self._observe(first, timing)
                yield first
                finished = isinstance(first, Finished)
                if not finished:
                    async for event in stream:
                        self._observe(event, timing)
                        yield event
                        if isinstance(event, Finished):
                            finished = True
                            break
                if not finished:
                    raise EngineStreamError("engine stream ended without a finish event")
                done_s = self._clock.now()
                first_s = timing.first_token_s if timing.first_token_s is not None else done_s
                self._state.note_latency(engine_id, first_s - now_s, done_s - now_s, done_s)
                return
            finally:
                try:
                    with contextlib.suppress(Exception):
                        await stream.aclose()  # type: ignore[attr-defined]  # cancels the engine request
                finally:
                    self._state.note_finish(engine_id, request.request_id)
        detail = f" after {len(tried)} unavailable engine(s): {last_error}" if last_error else ""
        raise NoEngineAvailable(f"no engine for model {request.model!r}{detail}")

    def _observe(self, event: EngineEvent, timing: _ChoiceTiming) -> None:
        """Record TTFT / inter-token / end-to-end latency; turn an error finish into `EngineStreamError`."""
        if isinstance(event, Delta):
            now_s = self._clock.now()
            if timing.last_token_s is None:
                timing.first_token_s = now_s
                self._metrics.ttft.observe(now_s - timing.arrival_s)
            else:
                self._metrics.itl.observe(now_s - timing.last_token_s)
            timing.last_token_s = now_s
        elif isinstance(event, Finished):
            if event.finish_reason in ("error", "abort"):
                raise EngineStreamError(event.error_message or f"engine finished with {event.finish_reason}")
            self._metrics.e2e.observe(self._clock.now() - timing.arrival_s)


class _ChoiceTiming:
    __slots__ = ("arrival_s", "first_token_s", "last_token_s")

    def __init__(self, arrival_s: float) -> None:
        self.arrival_s = arrival_s
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
