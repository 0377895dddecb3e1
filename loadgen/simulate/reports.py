"""Engine state as the gateway receives it, in virtual time: the stats -> report translation and the
WatchState stream of one simulated engine.

Owns: `report_from_stats` (what the agent's WatchState servicer plus the gateway's gRPC client make of an
`EngineStats`: the live path is `AgentService._state` then `grpc_client.from_engine_state`), `describe_engine`
(GetInfo then `from_engine_info`), `ChangeGate` (the sim backend's rule for a change-triggered push), and
`ReportFeed`, one engine's stream of reports with its send times, sequence numbers and delivery delay.
Must not: read clocks, know the event heap or policies, or change an engine (it only reads `stats`).

Send times follow the agent: a report when the stream opens, one at once after each significant change, and
one `interval_s` after the last send when nothing significant happened. Interval reports are materialised
lazily: `flush(t)` is called before anything that changes the engine (so a report sent at s carries the
engine's state at s) and `receive(t)` returns the newest report sent at or before t - delay. Only that newest
report is handed to the cluster state: an older one would be overwritten by it before any policy reads the
state, and clearing of unreported dispatches only grows with the report's engine timestamp, so the snapshots
are the same as with every report delivered. Same-instant sends coalesce into one (the live stream yields
once per wake-up, with the state of that moment).
"""

from __future__ import annotations

from collections import deque

from engine_agent.domain import EngineStats
from engine_agent.sim.engine import IterationRecord, SimEngine
from engine_agent.sim.profiles import Profile
from gateway.domain import EngineDescription, EngineId, EngineReport

SIM_BACKEND = "sim"


def describe_engine(
    engine_id: str, profile: Profile, *, model: str | None = None, role: str = ""
) -> EngineDescription:
    """What the gateway learns from a sim agent's GetInfo (`SimBackend.static` through `from_engine_info`)."""
    return EngineDescription(
        engine_id=EngineId(engine_id),
        model=model or profile.model.name,
        profile=profile.name,
        backend=SIM_BACKEND,
        role=role,
        max_context_tokens=profile.max_context_tokens,
        block_size=profile.block_size,
        max_num_seqs=profile.max_num_seqs,
    )


def report_from_stats(
    stats: EngineStats,
    identity: EngineDescription,
    seq: int,
    *,
    draining: bool = False,
    timestamp_s: float | None = None,
) -> EngineReport:
    """The `EngineReport` the gateway receives for `stats` sent with sequence number `seq`.

    `timestamp_s` overrides `stats.timestamp_s` when the same figures are re-sent later (an unchanged engine).
    """
    lens = stats.lens
    return EngineReport(
        engine_id=identity.engine_id,
        model=identity.model,
        profile=identity.profile,
        backend=identity.backend,
        role=identity.role,
        seq=seq,
        engine_timestamp_s=stats.timestamp_s if timestamp_s is None else timestamp_s,
        ready=stats.ready and not draining,
        draining=draining or stats.draining,
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        kv_blocks_total=stats.kv_blocks_total,
        kv_blocks_free=stats.kv_blocks_free,
        kv_blocks_reserved=stats.kv_blocks_reserved,
        pending_prefill_tokens=stats.pending_prefill_tokens,
        running_batch_tokens=stats.running_batch_tokens,
        predicted_batch_latency_s=lens.predicted_batch_latency_s,
        pending_work_tokens=lens.pending_work_tokens,
        effective_free_kv_blocks=lens.effective_free_kv_blocks,
        peak_throughput_tokens_per_s=lens.peak_throughput_tokens_per_s,
        prediction_error_ratio=lens.prediction_error_ratio,
        slo_risk=lens.slo_risk,
        last_iteration_s=stats.last_iteration_s,
    )


class ChangeGate:
    """`SimBackend._publish`'s rule: a change is significant when the running, waiting or preempted counts
    differ from the last published ones, or free KV moved by at least 1% of the cache (one block at least).

    `waiting_seen` is the waiting count at the last check. While it is 0, an iteration without finishes or
    preemptions cannot change the counts (nothing can be admitted), so `iteration_may_matter` lets the runner
    skip the check and its stats read after most iterations with the same outcome.
    """

    __slots__ = ("_key", "published_free", "kv_step_blocks", "waiting_seen")

    def __init__(self, kv_blocks_total: int) -> None:
        self._key = (0, 0, 0)
        self.published_free = kv_blocks_total
        self.kv_step_blocks = max(1, kv_blocks_total // 100)
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


class ReportFeed:
    """One engine's WatchState stream, as received by the gateway `delay_s` after each send."""

    __slots__ = ("_engine", "identity", "_interval_s", "_delay_s", "_seq", "_anchor_s", "_ticks",
                 "next_due_s", "_pending", "gate", "_stats", "_stats_version")

    def __init__(self, engine: SimEngine, identity: EngineDescription, *, interval_s: float,
                 delay_s: float) -> None:
        self._engine = engine
        self.identity = identity
        self._interval_s = interval_s
        self._delay_s = delay_s
        self._seq = 0
        # Interval sends since the last change-triggered (or first) send at _anchor_s are due at
        # _anchor_s + j * interval_s, j = 1, 2, ...; _ticks of them are sent.
        self._anchor_s = 0.0
        self._ticks = 0
        self.next_due_s = interval_s  # the next interval send (flush before this is a no-op)
        # (sent at, seq, the engine's figures at that time), in send order
        self._pending: deque[tuple[float, int, EngineStats]] = deque()
        self.gate = ChangeGate(engine.profile.kv_blocks_total)
        self._stats = engine.stats(0.0)
        self._stats_version = engine.change_counter

    def _read(self) -> EngineStats:
        """The engine's current figures, re-read only when its change counter moved (their `timestamp_s` is
        meaningless: the send time travels beside them and becomes the report's timestamp)."""
        engine = self._engine
        version = engine.change_counter
        if version != self._stats_version:
            self._stats = engine.stats(0.0)
            self._stats_version = version
        return self._stats

    def connect(self, now_s: float) -> None:
        """The stream opens: the agent sends its state at once."""
        self._send(now_s, self._read())

    def flush(self, now_s: float) -> None:
        """Materialise the interval sends due in (last send, now_s] with the engine's current state (call it
        before changing the engine). Only sends that can still be the newest one visible are kept."""
        if now_s < self.next_due_s:
            return
        anchor_s, interval_s, ticks = self._anchor_s, self._interval_s, self._ticks
        last = int((now_s - anchor_s) / interval_s)  # the newest send due by now_s, up to rounding:
        while anchor_s + last * interval_s > now_s:
            last -= 1
        while anchor_s + (last + 1) * interval_s <= now_s:
            last += 1
        if last <= ticks:
            return
        delay_s = self._delay_s
        first = last  # the usual case: only the last send can still be the newest visible
        while first > ticks + 1 and anchor_s + first * interval_s + delay_s > now_s:
            first -= 1  # not yet received at now_s: the one before may be the newest received
        stats = self._read()
        seq0 = self._seq - ticks
        pending = self._pending
        for j in range(first, last + 1):
            pending.append((anchor_s + j * interval_s, seq0 + j, stats))
        self._seq = seq0 + last
        self._ticks = last
        self.next_due_s = anchor_s + (last + 1) * interval_s

    def on_change(self, now_s: float) -> None:
        """The engine changed at `now_s` (an admission or a delivered iteration): push if significant."""
        self.flush(now_s)
        stats = self._read()
        if self.gate.significant(stats):
            self._send(now_s, stats)

    def _send(self, now_s: float, stats: EngineStats) -> None:
        pending = self._pending
        if pending and pending[-1][0] == now_s:
            pending[-1] = (now_s, pending[-1][1], stats)  # one wake-up, one report: the state of that moment
        else:
            self._seq += 1
            pending.append((now_s, self._seq, stats))
        self._anchor_s = now_s
        self._ticks = 0
        self.next_due_s = now_s + self._interval_s

    def receive(self, now_s: float) -> tuple[EngineReport, float] | None:
        """(newest report received by `now_s`, its receive time), or None when nothing new arrived."""
        if now_s >= self.next_due_s:
            self.flush(now_s)
        pending = self._pending
        if not pending:
            return None
        delay_s = self._delay_s
        if pending[0][0] + delay_s > now_s:
            return None
        item = pending.popleft()
        while pending and pending[0][0] + delay_s <= now_s:
            item = pending.popleft()
        sent_s, seq, stats = item
        return report_from_stats(stats, self.identity, seq, timestamp_s=sent_s), sent_s + delay_s
