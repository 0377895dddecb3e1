"""The sim backend's change version: the number behind `wait_for_change`, advanced on significant changes.

Owns: `ChangeVersion`, one per `SimBackend`: the visible version, deciding whether an engine change is
significant enough to advance it (the running, waiting or preempted counts moved, or free KV moved by at least
1% of the cache since the last published version), and waking the `wait_for_change` waiters when it does.
Must not: step the engine or change its state (it reads `change_counter` and `stats`), decide when to look
(the backend calls `publish` after anything that may have changed the engine), or read time other than through
the injected `Clock` (stats' timestamp; waits are asyncio timeouts).
"""

from __future__ import annotations

from engine_agent.backends.changes import VersionSignal
from engine_agent.sim.engine import SimEngine
from switchyard.clock import Clock


class ChangeVersion:
    """The version watchers see; everything between significant changes reaches them on their interval."""

    __slots__ = ("_engine", "_clock", "_signal", "_seen_counter", "_published_key",
                 "_published_free", "_kv_step_blocks")

    def __init__(self, engine: SimEngine, clock: Clock) -> None:
        kv_blocks_total = engine.profile.kv_blocks_total
        self._engine = engine
        self._clock = clock
        self._signal = VersionSignal()
        self._seen_counter = engine.change_counter
        self._published_key = (0, 0, 0)
        self._published_free = kv_blocks_total
        self._kv_step_blocks = max(1, kv_blocks_total // 100)

    async def wait(self, after_version: int, timeout_s: float) -> int:
        """`EngineBackend.wait_for_change`: the version once above `after_version` or at the timeout."""
        return await self._signal.wait(after_version, timeout_s)

    def publish(self) -> None:
        """Advance the visible version on a significant change and wake `wait`.

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
        self._signal.advance()
