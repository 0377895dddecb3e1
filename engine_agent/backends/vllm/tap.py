"""The agent-side half of the vLLM hidden-state tap: decode the workers' drained rows, fan them out.

The worker extension (`engine_side.HiddenStateTap`) records, every k-th sampling step, the post-final-norm
last-token rows of the batch keyed by vLLM's internal request ids; the backend drains them with
`collective_rpc("agent_tap_drain")` and hands the raw batches here.

Owns: `TapFanout`: decoding raw batches into `HiddenStateBatch`es under the agent's request ids, and one
bounded queue per subscriber (the oldest batch is dropped when a consumer falls behind; the engine never
waits), ending every subscription when the backend stops (`close`).
Must not: call into vLLM or block.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import numpy as np

from engine_agent.domain import HiddenStateBatch, HiddenStateSample, RequestId

_QUEUE = 64


class TapFanout:
    def __init__(self, interval: int | None) -> None:
        self._interval = interval  # None: the tap is off and subscriptions end at once
        # Each subscriber's queue; None (after every batch already queued) ends the subscription.
        self._subscribers: list[asyncio.Queue[HiddenStateBatch | None]] = []

    async def subscribe(self) -> AsyncIterator[HiddenStateBatch]:
        if self._interval is None:
            return
        queue: asyncio.Queue[HiddenStateBatch | None] = asyncio.Queue(maxsize=_QUEUE)
        self._subscribers.append(queue)
        try:
            while (batch := await queue.get()) is not None:
                yield batch
        finally:
            self._subscribers.remove(queue)

    def close(self) -> None:
        """The backend stopped: end every subscription once its queued batches are read."""
        for queue in self._subscribers:
            _put_dropping_oldest(queue, None)

    def publish(self, drained: Sequence[Any], by_internal: Mapping[str, RequestId], now_s: float) -> None:
        """`drained`: rank 0's `agent_tap_drain` answer: (step, internal ids, generated, rows, width)."""
        for step, internal_ids, generated, raw, width in drained:
            rows = np.frombuffer(raw, dtype=np.float32).reshape(-1, width)
            samples = tuple(
                HiddenStateSample(request_id=rid, generated_tokens=int(g), vector=rows[i])
                for i, (iid, g) in enumerate(zip(internal_ids, generated, strict=True))
                if (rid := by_internal.get(iid)) is not None
            )
            batch = HiddenStateBatch(step=int(step), timestamp_s=now_s, samples=samples)
            for queue in self._subscribers:
                _put_dropping_oldest(queue, batch)


def _put_dropping_oldest(
    queue: asyncio.Queue[HiddenStateBatch | None], item: HiddenStateBatch | None
) -> None:
    if queue.full():
        queue.get_nowait()
    queue.put_nowait(item)
