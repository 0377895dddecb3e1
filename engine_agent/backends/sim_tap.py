"""The sim backend's hidden-state tap: subscribers, which steps are tapped, batches built off the loop.

Owns: `HiddenStateTap`, one per `SimBackend`: its subscribers and their bounded queues
(`HIDDEN_STATE_QUEUE_BATCHES`, oldest dropped), counting decode steps, starting a batch's build in the default
executor on every `interval`-th one while someone subscribes (never two at once: a tap due while the previous
one is still being built is skipped and counted), owning that build until it is done (`aclose` awaits it),
and handing a built batch to every subscriber.
Must not: step the engine or decide when a step is delivered (the backend's loop calls `start` right after a
step with decoding sequences and `publish` once that step is delivered and the batch built), build the vectors
themselves (that is `engine_agent.sim.hidden_states`), or read time (the batch's timestamp is the step's due
time, given by the caller).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator

import numpy as np
import numpy.typing as npt

from engine_agent.domain import HiddenStateBatch, HiddenStateSample, RequestId
from engine_agent.sim.engine import SimEngine
from engine_agent.sim.hidden_states import SyntheticHiddenStates

log = logging.getLogger(__name__)

# Each hidden-state subscriber's queue; the oldest batch is dropped when a consumer falls behind.
HIDDEN_STATE_QUEUE_BATCHES = 8


class _Subscriber:
    __slots__ = ("queue", "waiter", "closed")

    def __init__(self) -> None:
        self.queue: deque[HiddenStateBatch] = deque(maxlen=HIDDEN_STATE_QUEUE_BATCHES)
        self.waiter: asyncio.Future[None] | None = None
        self.closed = False

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class HiddenStateTap:
    """Every `interval` decode steps (None: off), the decoding requests' vectors to each subscriber."""

    __slots__ = ("_engine", "_interval", "_model_args", "_hidden", "_subscribers", "_decode_steps",
                 "_building", "_skipped")

    def __init__(self, engine: SimEngine, *, interval: int | None, hidden_size: int, model_name: str,
                 seed: int) -> None:
        self._engine = engine
        self._interval = interval
        self._model_args = (hidden_size, model_name, seed)
        # Built off the loop (`prepare`, or the first batch in the executor): its set-up takes ~100 ms.
        self._hidden: SyntheticHiddenStates | None = None
        self._subscribers: set[_Subscriber] = set()
        self._decode_steps = 0
        self._building: asyncio.Future[HiddenStateBatch] | None = None  # the batch being built, if any
        self._skipped = 0

    @property
    def taps_skipped(self) -> int:
        """Taps skipped because the previous batch was still being built."""
        return self._skipped

    async def subscribe(self) -> AsyncIterator[HiddenStateBatch]:
        """One subscriber's batches until `close` (nothing when the tap is off)."""
        if not self._interval:
            return
        subscriber = _Subscriber()
        self._subscribers.add(subscriber)
        loop = asyncio.get_running_loop()
        try:
            while True:
                if subscriber.queue:
                    yield subscriber.queue.popleft()
                elif subscriber.closed:
                    return
                else:
                    subscriber.waiter = loop.create_future()
                    await subscriber.waiter
                    subscriber.waiter = None
        finally:
            self._subscribers.discard(subscriber)

    def prepare(self) -> None:
        """Build the synthetic hidden-state model now (~100 ms of numpy: call it off the loop, before the
        engine runs); otherwise the first batch builds it, in the executor."""
        if self._interval and self._hidden is None:
            hidden_size, model_name, seed = self._model_args
            self._hidden = SyntheticHiddenStates(hidden_size, model_name, seed=seed)

    async def aclose(self) -> None:
        """The backend stopped: wait for a batch still being built, then end every subscription once its
        queue is read."""
        building = self._building
        if building is not None:
            await asyncio.wait((building,))  # executor work cannot be interrupted; it takes milliseconds
            self._building = None
        for subscriber in self._subscribers:
            subscriber.closed = True
            subscriber.wake()

    def start(self, due_s: float) -> asyncio.Future[HiddenStateBatch] | None:
        """After a step with decoding sequences: start building a batch if this step is a tap."""
        self._decode_steps += 1
        interval = self._interval
        if not interval or self._decode_steps % interval or not self._subscribers:
            return None
        if self._building is not None:
            self._skipped += 1
            return None
        ids, prompt, generated, remaining = self._engine.decoding_requests()
        if not ids:
            return None
        loop = asyncio.get_running_loop()
        building = loop.run_in_executor(
            None, self._build_batch, self._decode_steps, due_s, ids, prompt, generated, remaining
        )
        self._building = building
        return building

    def _build_batch(self, step: int, timestamp_s: float, ids: list[RequestId], prompt: list[int],
                     generated: list[int], remaining: list[int]) -> HiddenStateBatch:
        """Runs in the executor (one at a time): numpy only, no engine or loop state."""
        self.prepare()
        assert self._hidden is not None
        vectors: npt.NDArray[np.float32] = self._hidden.vectors(ids, prompt, generated, remaining)
        samples = tuple(
            HiddenStateSample(request_id=rid, generated_tokens=g, vector=vectors[i])
            for i, (rid, g) in enumerate(zip(ids, generated, strict=True))
        )
        return HiddenStateBatch(step=step, timestamp_s=timestamp_s, samples=samples)

    def publish(self, future: asyncio.Future[HiddenStateBatch]) -> None:
        """The done callback of `start`'s future (added once its step is delivered): queue the batch."""
        if self._building is future:
            self._building = None
        if future.cancelled():
            return
        error = future.exception()
        if error is not None:
            log.error("hidden-state tap failed: %r", error)
            return
        batch = future.result()
        for subscriber in self._subscribers:
            subscriber.queue.append(batch)  # a full deque drops its oldest batch
            subscriber.wake()
