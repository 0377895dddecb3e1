"""Engine state as the gateway receives it, in virtual time: the stats -> report translation and the
WatchState stream of one simulated engine.

Owns: `report_from_stats`, which is the live translation itself, composed: the agent's WatchState encoding
(`engine_agent.proto_codec.engine_state`) then the gateway's decoding (`grpc_client.from_engine_state`);
`describe_engine` (what GetInfo plus `from_engine_info` give for a sim agent, the KV bytes per token
included); and `ReportFeed`, one engine's stream of reports with its send times, sequence numbers and delivery
delay, pushed by the sim backend's own change rule (`engine_agent.sim.reporting.ChangeGate`) and at every STAR
round.
Must not: read clocks, know the event heap or policies, or change an engine (it only reads `stats`).

Send times follow the agent: a report when the stream opens, one at once after each significant change, and
one `interval_s` after the last send when nothing significant happened. Interval reports are materialised
lazily: `flush(t)` is called before anything that changes the engine (so a report sent at s carries the
engine's state at s) and `receive(t)` returns the newest report sent at or before t - delay. Only that newest
report is handed to the cluster state: an older one would be overwritten by it before any policy reads the
state, and clearing of unreported dispatches only grows with the report's engine timestamp, so the snapshots
are the same as with every report delivered. Same-instant sends coalesce into one (the live stream yields
once per wake-up, with the state of that moment).

STAR's rounds (`loadgen.simulate.predictions`): `push_round` sends a report at once carrying the round (the
agent's `StarRound`, encoded by the agent's `engine_state` and decoded by the gateway's `from_engine_state`
like the rest of the report); the other sends carry none, and the gateway's cluster state keeps the last
round's until the next (`ClusterState.on_report`). When `receive` hands over only the newest of several
reports, it carries the newest round among them, which is what the cluster state would hold had every report
been delivered.

Prefix-cache events (`kv_events=True`, when the policy reads them): each send drains the engine's KV events
(the agent's journal drains its backend at each push), the stream's first send carries the engine's snapshot
(`cleared`, as the agent's journal resyncs a new watcher), and when `receive` hands over only the newest of
several reports, it carries the skipped ones' events merged (`engine_agent.kv_journal.merge`), so the
gateway's index is the one every report delivered would have built.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import replace

from engine_agent.domain import EngineStats, KvDelta
from engine_agent.kv_journal import merge
from engine_agent.proto_codec import engine_state
from engine_agent.sim.engine import SimEngine
from engine_agent.sim.reporting import ChangeGate
from engine_agent.star.live import StarRound
from gateway.domain import EngineDescription, EngineId, EngineReport
from gateway.engines.grpc_client import from_engine_state
from switchyard.prefix import INDEX_SPAN_TOKENS
from switchyard.profiles import Profile
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
        kv_bytes_per_token=profile.model.kv_bytes_per_token,
        gpu=profile.gpu.display_name,  # as the sim agent reports it (SimBackend.static)
        tensor_parallel=profile.tensor_parallel,
        hourly_price_usd=profile.hourly_price_usd,
    )


def report_from_stats(
    stats: EngineStats,
    identity: EngineDescription,
    seq: int,
    *,
    draining: bool = False,
    timestamp_s: float | None = None,
    star: StarRound | None = None,
    combo: str = "",
    kv_events: KvDelta | None = None,
) -> EngineReport:
    """The `EngineReport` the gateway receives for `stats` sent with sequence number `seq`: the agent's proto
    encoding decoded by the gateway's gRPC client, as on the wire.

    `timestamp_s` overrides `stats.timestamp_s` when the same figures are re-sent later (an unchanged engine);
    `star`: the STAR round the push carries; `kv_events`: the prefix-cache events it carries.
    """
    if timestamp_s is not None:
        stats = replace(stats, timestamp_s=timestamp_s)
    pb_identity = pb.EngineIdentity(
        engine_id=identity.engine_id,
        model=identity.model,
        profile=identity.profile,
        backend=identity.backend,
        role=identity.role,
        combo=combo,
    )
    return from_engine_state(
        engine_state(stats, identity=pb_identity, seq=seq, draining=draining, started=True, star=star,
                     kv_events=kv_events, kv_span_tokens=INDEX_SPAN_TOKENS)
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
        "combo",
        "drain_s",
        "_kv_events",
    )

    def __init__(
        self, engine: SimEngine, identity: EngineDescription, *, interval_s: float, delay_s: float,
        combo: str = "", kv_events: bool = False,
    ) -> None:
        self._engine = engine
        self.identity = identity
        self.combo = combo  # the GPU combo label the engine reports (CAUCHY)
        self.drain_s = math.inf  # the agent drains from then: its reports say so
        self._kv_events = kv_events  # sends carry the engine's KV events (it must keep them: kv_events=True)
        self._interval_s = interval_s
        self._delay_s = delay_s
        self._seq = 0
        # Interval sends since the last change-triggered (or first) send at _anchor_s are due at
        # _anchor_s + j * interval_s, j = 1, 2, ...; _ticks of them are sent.
        self._anchor_s = 0.0
        self._ticks = 0
        self.next_due_s = interval_s  # the next interval send (flush before this is a no-op)
        # (sent at, seq, the engine's figures at that time, the prediction round it carries, the KV events it
        # carries), in send order
        self._pending: deque[tuple[float, int, EngineStats, StarRound | None, KvDelta | None]] = deque()
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
        """The stream opens: the agent sends its state at once (and its KV snapshot)."""
        self._send(now_s, self._read(), kv=self._engine.kv_snapshot() if self._kv_events else None)

    def _drain_kv(self) -> KvDelta | None:
        if not self._kv_events:
            return None
        delta = self._engine.drain_kv_events()
        return delta if delta else None

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
        kv = self._drain_kv()  # what changed since the last send: carried by the first of these sends
        for j in range(first, last + 1):
            pending.append((anchor_s + j * interval_s, seq0 + j, stats, None, kv))
            kv = None
        self._seq = seq0 + last
        self._ticks = last
        self.next_due_s = anchor_s + (last + 1) * interval_s

    def on_change(self, now_s: float) -> None:
        """The engine changed at `now_s` (an admission or a delivered iteration): push if significant."""
        self.flush(now_s)
        stats = self._read()
        if self.gate.significant(stats):
            self._send(now_s, stats)

    def drain(self, now_s: float) -> None:
        """The agent starts draining at `now_s`: it says so at once."""
        self.flush(now_s)
        self.drain_s = now_s
        self._send(now_s, self._read())

    def push_round(self, now_s: float, star: StarRound) -> None:
        """A STAR round was taken at `now_s`: send it at once with the engine's state."""
        self.flush(now_s)
        self._send(now_s, self._read(), star)

    def _send(self, now_s: float, stats: EngineStats, round_: StarRound | None = None,
              kv: KvDelta | None = None) -> None:
        if kv is None:
            kv = self._drain_kv()
        pending = self._pending
        if pending and pending[-1][0] == now_s:  # one wake-up, one report: the state of that moment
            last = pending[-1]
            last_kv = last[4]
            if last_kv is not None and kv is not None:
                kv = merge((last_kv, kv))
            pending[-1] = (now_s, last[1], stats, round_ if round_ is not None else last[3],
                           kv if kv is not None else last_kv)
        else:
            self._seq += 1
            pending.append((now_s, self._seq, stats, round_, kv))
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
        round_ = item[3]
        kvs = [item[4]] if item[4] is not None else []
        while pending and pending[0][0] + delay_s <= now_s:
            item = pending.popleft()
            if item[3] is not None:
                round_ = item[3]
            if item[4] is not None:
                kvs.append(item[4])
        sent_s, seq, stats = item[0], item[1], item[2]
        kv = None if not kvs else kvs[0] if len(kvs) == 1 else merge(kvs)
        return self._report(stats, seq, sent_s, round_, kv), sent_s + delay_s

    def _report(self, stats: EngineStats, seq: int, sent_s: float, round_: StarRound | None,
                kv: KvDelta | None = None) -> EngineReport:
        """`report_from_stats` for one send. Consecutive sends of the same figures without a round or KV
        events differ only in sequence number and timestamp, so their wire translation runs once per distinct
        reading and is re-stamped; a send with a round or events is translated whole."""
        draining = sent_s >= self.drain_s
        if round_ is not None or kv is not None:
            return report_from_stats(stats, self.identity, seq, timestamp_s=sent_s, star=round_,
                                     combo=self.combo, draining=draining, kv_events=kv)
        cached = self._translated
        if cached is None or cached[0] is not stats or cached[1].draining != draining:
            translated = report_from_stats(stats, self.identity, seq, combo=self.combo, draining=draining)
            cached = (stats, translated)
            self._translated = cached
        return replace(cached[1], seq=seq, engine_timestamp_s=sent_s)
