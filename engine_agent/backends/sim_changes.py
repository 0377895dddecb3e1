"""The sim backend's change version: the number behind `wait_for_change`, advanced on significant changes.

Owns: `ChangeVersion`, one per `SimBackend`: the visible version, advanced when the `ChangeGate` of
`engine_agent.sim.reporting` (the rule the simulator's report feed uses too) calls an engine change
significant, and waking the `wait_for_change` waiters when it does.
Must not: step the engine or change its state (it reads `change_counter` and `stats`), decide what is
significant (the gate does), decide when to look (the backend calls `publish` after anything that may have
changed the engine), or read time other than through the injected `Clock` (stats' timestamp; waits are asyncio
timeouts).
"""

from __future__ import annotations

from engine_agent.backends.changes import VersionSignal
from engine_agent.sim.engine import SimEngine
from engine_agent.sim.reporting import ChangeGate
from switchyard.clock import Clock


class ChangeVersion:
    """The version watchers see; everything between significant changes reaches them on their interval."""

    __slots__ = ("_engine", "_clock", "_signal", "_seen_counter", "_gate")

    def __init__(self, engine: SimEngine, clock: Clock) -> None:
        self._engine = engine
        self._clock = clock
        self._signal = VersionSignal()
        self._seen_counter = engine.change_counter
        self._gate = ChangeGate(engine.profile.kv_blocks_total)

    async def wait(self, after_version: int, timeout_s: float) -> int:
        """`EngineBackend.wait_for_change`: the version once above `after_version` or at the timeout."""
        return await self._signal.wait(after_version, timeout_s)

    def publish(self) -> None:
        """Advance the visible version when the engine changed significantly (`ChangeGate`), waking `wait`.

        The engine counts every iteration as a change; watchers are woken only on a significant one.
        Everything else reaches them on the WatchState interval.
        """
        counter = self._engine.change_counter
        if counter == self._seen_counter:
            return
        self._seen_counter = counter
        if self._gate.significant(self._engine.stats(self._clock.now())):
            self._signal.advance()
