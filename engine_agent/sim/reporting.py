"""When a simulated engine's state is worth pushing at once: the one change rule of the sim backend's
`WatchState` and of the simulator's report feed.

Owns: `ChangeGate`. A change is significant when the running, waiting or preempted counts differ from the last
published ones, or free KV moved by at least 1% of the cache (one block at least) since the last published
state. The agent pushes a report at once after a significant change and otherwise `interval_s` after its last
push (`engine_agent.service.AgentService.WatchState`); the sim backend (`backends.sim_changes.ChangeVersion`)
asks this gate whether to wake its watchers, and the simulator (`loadgen.simulate.reports.ReportFeed`) whether
to send, so the two cannot drift apart.
Must not: read clocks, step or change an engine (it reads `EngineStats` and `IterationRecord`s), or import
asyncio.
"""

from __future__ import annotations

from engine_agent.domain import EngineStats
from engine_agent.sim.engine import IterationRecord

KV_STEP_DIVISOR = 100  # free KV must move by 1/100 of the cache (one block at least) to count on its own


class ChangeGate:
    """The last published state, and whether a new reading differs from it significantly.

    `waiting_seen` is the waiting count at the last check. While it is 0, an iteration without finishes or
    preemptions cannot change the counts (nothing can be admitted), so `iteration_may_matter` lets the
    simulator skip the check and its stats read after most iterations with the same outcome.
    """

    __slots__ = ("_key", "published_free", "kv_step_blocks", "waiting_seen")

    def __init__(self, kv_blocks_total: int) -> None:
        self._key = (0, 0, 0)
        self.published_free = kv_blocks_total
        self.kv_step_blocks = max(1, kv_blocks_total // KV_STEP_DIVISOR)
        self.waiting_seen = 0

    def significant(self, stats: EngineStats) -> bool:
        """Whether `stats` is a significant change; if so it becomes the published state."""
        self.waiting_seen = stats.num_waiting
        key = (stats.num_running, stats.num_waiting, stats.num_preempted_total)
        if key == self._key and abs(stats.kv_blocks_free - self.published_free) < self.kv_step_blocks:
            return False
        self._key = key
        self.published_free = stats.kv_blocks_free
        return True

    def iteration_may_matter(self, record: IterationRecord, finished: bool) -> bool:
        """False only when the iteration of `record` provably left the significant figures unchanged."""
        return (finished or record.num_preempted > 0 or self.waiting_seen > 0
                or abs(record.kv_blocks_free_after - self.published_free) >= self.kv_step_blocks)
