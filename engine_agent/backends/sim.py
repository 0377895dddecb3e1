"""`SimBackend`: the simulated GPU (`engine_agent.sim.engine.SimEngine`) driven in real time.

Owns: the one engine-loop task (born in `start`, cancelled and awaited in `stop`), per-request delivery
buffers, the mapping of the engine's step results onto wall time (a step's output is delivered when its
simulated duration has elapsed), aborts on early close, the change version behind `wait_for_change`, and the
loop-lag figures.
Must not: batch, schedule or time iterations itself (that is the engine model, invariant I2), know gRPC or
text, or read time other than through the injected `Clock` (it waits with asyncio sleeps and events).

"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine_agent.backends.base import (
    BackendEvent,
    BackendRequest,
    EngineStatic,
    EngineStats,
    FinishEvent,
    RequestId,
    Timings,
    TokenEvent,
    Usage,
)
from engine_agent.sim.engine import SimEngine, StepResult
from engine_agent.sim.profiles import Profile
from switchyard.clock import Clock

log = logging.getLogger(__name__)

# Delivery later than this re-anchors the simulated timeline to the wall clock (counted as a late step).
DEFAULT_LAG_TOLERANCE_S = 0.002


@dataclass(frozen=True, slots=True)
class LoopLag:
    """How far the engine loop fell behind the simulated timeline (delivery time - simulated step end)."""

    steps: int
    late_steps: int  # steps delivered more than the tolerance late (the timeline slipped)
    max_lag_s: float
    mean_lag_s: float
    slipped_s: float  # total time the simulated timeline was pushed back to follow the wall clock


class _Stream:
    """One request's undelivered output; the consumer waits on `waiter`."""

    __slots__ = ("tokens", "finish", "waiter")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.finish: FinishEvent | None = None
        self.waiter: asyncio.Future[None] | None = None

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class SimBackend:
    """`EngineBackend` over `SimEngine` in real time; one instance per agent process."""

    def __init__(
        self,
        profile: Profile,
        *,
        clock: Clock,
        engine_id: str,
        vocab_size: int,
        eos_token_id: int,
        special_token_ids: frozenset[int] = frozenset(),
        seed: int = 0,
        role: str = "",
        model: str | None = None,
        lag_tolerance_s: float = DEFAULT_LAG_TOLERANCE_S,
    ) -> None:
        self._clock = clock
        self._eos_token_id = eos_token_id
        self._engine = SimEngine(
            profile,
            seed=seed,
            vocab_size=vocab_size,
            eos_token_id=eos_token_id,
            special_token_ids=special_token_ids,
            engine_id=engine_id,
        )
        self._static = EngineStatic(
            engine_id=engine_id,
            model=model or profile.model.name,
            backend="sim",
            profile=profile.name,
            role=role,
            max_context_tokens=profile.max_context_tokens,
            block_size=profile.block_size,
            max_num_seqs=profile.max_num_seqs,
            max_batched_tokens=profile.max_batched_tokens,
            gpu=profile.gpu.display_name,
            gpu_memory_gb=profile.gpu.memory_gb * profile.tensor_parallel,
            hourly_price_usd=profile.hourly_price_usd,
            tensor_parallel=profile.tensor_parallel,
        )
        self._lag_tolerance_s = lag_tolerance_s
        self._streams: dict[RequestId, _Stream] = {}
        self._wake = asyncio.Event()
        self._changed = asyncio.Event()
        self._version = 0
        self._seen_counter = self._engine.change_counter
        self._published_key = (0, 0, 0)
        self._published_free = profile.kv_blocks_total
        self._kv_step_blocks = max(1, profile.kv_blocks_total // 100)
        self._last_admit_s = float("-inf")
        self._task: asyncio.Task[None] | None = None
        self._lag_steps = 0
        self._lag_late = 0
        self._lag_max_s = 0.0
        self._lag_sum_s = 0.0
        self._slipped_s = 0.0

    @property
    def static(self) -> EngineStatic:
        return self._static

    @property
    def eos_token_id(self) -> int:
        return self._eos_token_id

    @property
    def loop_lag(self) -> LoopLag:
        steps = self._lag_steps
        return LoopLag(
            steps=steps,
            late_steps=self._lag_late,
            max_lag_s=self._lag_max_s,
            mean_lag_s=self._lag_sum_s / steps if steps else 0.0,
            slipped_s=self._slipped_s,
        )

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"sim-engine-loop:{self._static.engine_id}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        now = self._clock.now()
        for request_id in list(self._streams):
            event = self._engine.abort(request_id, now)
            self._finish_stream(request_id, event or _aborted())
        self._publish()
        lag = self.loop_lag
        log.info(
            "engine loop stopped: steps=%d late_steps=%d max_lag_ms=%.2f mean_lag_ms=%.3f slipped_ms=%.1f",
            lag.steps,
            lag.late_steps,
            lag.max_lag_s * 1e3,
            lag.mean_lag_s * 1e3,
            lag.slipped_s * 1e3,
        )

    async def generate(self, request: BackendRequest) -> AsyncIterator[BackendEvent]:
        request_id = request.request_id
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
        if self._task is None:
            raise RuntimeError("backend is not started")
        now = self._clock.now()
        self._engine.add_request(request, now)  # ValueError on over-context or duplicate
        stream = _Stream()
        self._streams[request_id] = stream
        self._last_admit_s = now
        self._wake.set()
        self._publish()
        finished = False
        loop = asyncio.get_running_loop()
        try:
            while True:
                if stream.tokens:
                    ids = tuple(stream.tokens)
                    stream.tokens.clear()
                    yield TokenEvent(ids)
                elif stream.finish is not None:
                    finished = True
                    yield stream.finish
                    return
                else:
                    stream.waiter = loop.create_future()
                    await stream.waiter
                    stream.waiter = None
        finally:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            if not finished and stream.finish is None:
                self._engine.abort(request_id, self._clock.now())
                self._publish()

    async def abort(self, request_id: RequestId) -> bool:
        if request_id not in self._streams:
            return False
        event = self._engine.abort(request_id, self._clock.now())
        if event is None:
            return False  # finished in the step now in flight; its delivery ends the stream
        self._finish_stream(request_id, event)
        self._publish()
        return True

    def stats(self) -> EngineStats:
        return self._engine.stats(self._clock.now())

    async def wait_for_change(self, after_version: int, timeout_s: float) -> int:
        if self._version > after_version or timeout_s <= 0:
            return self._version
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._version <= after_version:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
        return self._version

    # -- engine loop -------------------------------------------------------------------------------

    async def _run(self) -> None:
        engine = self._engine
        clock = self._clock
        busy_until: float | None = None  # simulated end of the previous step while the engine stays busy
        while True:
            if not engine.has_work():
                busy_until = None
                self._wake.clear()
                await self._wake.wait()
                continue
            now = clock.now()
            start = now if busy_until is None else max(busy_until, min(self._last_admit_s, now))
            result = engine.step(start)
            due = start + result.duration_s
            delay = due - clock.now()
            # Never sleep a negative time; still yield so the servicer runs when the loop is behind.
            await asyncio.sleep(delay if delay > 0 else 0)
            self._account_lag(clock.now() - due)
            busy_until = due if clock.now() - due <= self._lag_tolerance_s else None
            self._deliver(result)
            if result.duration_s <= 0 and not result.tokens and not result.finished:
                await asyncio.sleep(1e-3)  # an idle step: do not spin

    def _account_lag(self, lag_s: float) -> None:
        lag_s = max(lag_s, 0.0)
        self._lag_steps += 1
        self._lag_sum_s += lag_s
        if lag_s > self._lag_max_s:
            self._lag_max_s = lag_s
        if lag_s > self._lag_tolerance_s:
            self._lag_late += 1
            self._slipped_s += lag_s

    def _deliver(self, result: StepResult) -> None:
        streams = self._streams
        touched: list[_Stream] = []
        for request_id, token_id in result.tokens:
            stream = streams.get(request_id)
            if stream is not None and stream.finish is None:
                if not stream.tokens:
                    touched.append(stream)
                stream.tokens.append(token_id)
        for request_id, event in result.finished:
            stream = streams.get(request_id)
            if stream is not None and stream.finish is None:
                stream.finish = event
                touched.append(stream)
        for stream in touched:
            stream.wake()
        self._publish()

    def _finish_stream(self, request_id: RequestId, event: FinishEvent) -> None:
        stream = self._streams.get(request_id)
        if stream is not None and stream.finish is None:
            stream.finish = event
            stream.wake()

    def _publish(self) -> None:
        """Advance the visible version on a significant change and wake `wait_for_change`.

        The engine counts every iteration as a change; watchers are woken only when the running, waiting or
        preempted counts move, or free KV moves by at least `_kv_step_blocks` (1% of the cache) since the last
        published version. Everything else reaches them on the WatchState interval.
        """
        counter = self._engine.change_counter
        if counter == self._seen_counter:
            return
        self._seen_counter = counter
        stats = self._engine.stats(self._clock.now())
        key = (stats.num_running, stats.num_waiting, stats.num_preempted_total)
        if (
            key == self._published_key
            and abs(stats.kv_blocks_free - self._published_free) < self._kv_step_blocks
        ):
            return
        self._published_key = key
        self._published_free = stats.kv_blocks_free
        self._version += 1
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()


def _aborted() -> FinishEvent:
    return FinishEvent(
        finish_reason="abort", usage=Usage(prompt_tokens=0, completion_tokens=0), timings=Timings()
    )
