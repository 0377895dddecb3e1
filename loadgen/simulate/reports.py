"""Engine state as the gateway receives it, in virtual time: the stats -> report translation and the
WatchState stream of one simulated engine.

Owns: `report_from_stats`, which is the live translation itself, composed: the agent's WatchState encoding
(`engine_agent.proto_codec.engine_state`) then the gateway's decoding (`grpc_client.from_engine_state`);
`describe_engine` (what GetInfo plus `from_engine_info` give for a sim agent); and `ReportFeed`, one engine's
stream of reports with its send times, sequence numbers and delivery delay, pushed by the sim backend's own
change rule (`engine_agent.sim.reporting.ChangeGate`).
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
from dataclasses import replace

from engine_agent.domain import EngineStats
from engine_agent.proto_codec import engine_state
from engine_agent.sim.engine import SimEngine
from engine_agent.sim.profiles import Profile
from engine_agent.sim.reporting import ChangeGate
from gateway.domain import EngineDescription, EngineId, EngineReport
from gateway.engines.grpc_client import from_engine_state
from switchyard.proto_gen import engine_agent_pb2 as pb

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
    """The `EngineReport` the gateway receives for `stats` sent with sequence number `seq`: the agent's proto
    encoding decoded by the gateway's gRPC client, as on the wire.

    `timestamp_s` overrides `stats.timestamp_s` when the same figures are re-sent later (an unchanged engine).
    """
    if timestamp_s is not None:
        stats = replace(stats, timestamp_s=timestamp_s)
    pb_identity = pb.EngineIdentity(
        engine_id=identity.engine_id,
        model=identity.model,
        profile=identity.profile,
        backend=identity.backend,
        role=identity.role,
    )
    return from_engine_state(
        engine_state(stats, identity=pb_identity, seq=seq, draining=draining, started=True)
    )


class ReportFeed:
    """One engine's WatchState stream, as received by the gateway `delay_s` after each send."""

    __slots__ = (
        "_engine",
        "identity",
        "_interval_s",
        "_delay_s",
        "_seq",
        "_anchor_s",
        "_ticks",
        "next_due_s",
        "_pending",
        "gate",
        "_stats",
        "_stats_version",
        "_translated",
    )

    def __init__(
        self, engine: SimEngine, identity: EngineDescription, *, interval_s: float, delay_s: float
    ) -> None:
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
        self._translated: tuple[EngineStats, EngineReport] | None = None  # the last translation, reused

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
        return self._report(stats, seq, sent_s), sent_s + delay_s

    def _report(self, stats: EngineStats, seq: int, sent_s: float) -> EngineReport:
        """`report_from_stats` for one send. Consecutive sends of the same figures differ only in sequence
        number and timestamp, so the wire translation runs once per distinct reading and is re-stamped."""
        cached = self._translated
        if cached is None or cached[0] is not stats:
            cached = (stats, report_from_stats(stats, self.identity, seq))
            self._translated = cached
        return replace(cached[1], seq=seq, engine_timestamp_s=sent_s)
