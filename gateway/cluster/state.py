"""The pure, synchronous cluster state: what every engine last reported plus this gateway's own accounting.

Owns: `ClusterState`: the engines (added by id), their descriptions, connection flags and last reports, the
optimistic in-flight accounting (`note_dispatch` / `note_finish`), the session table, the windowed latency
figures (`note_latency`), the two prefix indexes (`gateway.cluster.prefix_index`: the one the agents' KV
events keep, resynced per stream and dropped on disconnect, and the one this gateway's dispatches keep;
`prefix_match` reads them, see its docstring), and `snapshot(now_s)`,
the immutable `ClusterSnapshot` policies read (cached while nothing changed). The live gateway's
`ClusterStore` drives it from its watch tasks and its clock; the discrete-event simulator drives it in virtual
time (invariant I1: both give policies the same snapshots for the same events).
Must not: import asyncio, grpc, aiohttp or time, read a clock (every time is an argument), do I/O, route, or
drop an engine silently: a disconnected engine stays in the snapshot with `ready=False`, an engine without a
recent report stays with `stale=True`.

Unreported accounting: a dispatch counts in `unreported_*` until a report arrives that was taken on the engine
after the dispatch. The engine's clock at dispatch time is estimated from the latest report of the current
connection: engine_ts(dispatch) = report.engine_timestamp_s + (dispatch_now_s - report_received_s). A later
report with engine_timestamp_s >= that estimate clears it; with no report yet on the connection, the first
report clears it. `inflight_*` lasts until `note_finish`.

Staleness (the architecture's "stale engines are marked, never silently dropped"): an engine whose last report
is older than `stale_after_s` stays in the pool, flagged `stale=True`, and its view falls back to local
accounting, the dispatches and finishes this gateway itself saw: num_running = inflight_requests, num_waiting,
pending_prefill_tokens, running_batch_tokens and unreported_* = 0, kv_blocks_free = the last reported total
minus the blocks of the in-flight tokens (floored at 0), lens = None (its predictions described the engine
as it was); the engine's QoE fit and KV pull throughput (CascadeInfer) stay as last reported. Availability
is decided by the transport: engines leave the pool by their own status (not ready, draining, state stream
gone) or by outlier detection (`note_success` / `note_failure`, the per-engine machine of
`gateway.cluster.health`), never by report age.

Views are reused: a snapshot rebuilds the `EngineView` of an engine only when something about it changed (an
event touched it, or it crossed a time boundary: staleness, a latency sample leaving the window, the end of an
ejection period); the other views are the very objects of the previous snapshot. So a view holds nothing that
depends on the snapshot's time alone: `EngineView.reported_at_s` is when its report arrived, and its age is
`ClusterSnapshot.state_age_s(view)`. Policies may memoise per view object (identity), and a dispatch costs the
snapshot one view, not one per engine.

Latency window: `note_latency(engine, ttft_s, e2e_s, now_s)` records one finished request (the dispatcher
calls it for successful requests only, with latencies measured from its dispatch to that engine). A sample
taken at t counts in the snapshot at now_s while now_s - t < latency_window_s; `recent_ttft_s` /
`recent_e2e_s` are the plain means of the counted samples (None, with `recent_latency_samples` 0, when none).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import cast

from gateway.cluster.health import EngineHealth, FailureReason, OutlierParams
from gateway.cluster.prefix_index import DEFAULT_MAX_KEYS, PrefixIndex
from gateway.domain import (
    PREFIX_EVENTS,
    PREFIX_SENT,
    ClusterSnapshot,
    EngineDescription,
    EngineId,
    EngineReport,
    EngineView,
    FutureLoad,
    RequestPrediction,
    RouteTag,
    RouteTally,
    StageLayout,
)
from switchyard.prefix import INDEX_SPAN_TOKENS

# `ClusterSnapshot.membership` values, unique in the process (a policy shared by several cluster states, as
# the simulator's deciders share theirs, must never see one value for two memberships).
_MEMBERSHIP_EPOCHS = itertools.count()
DEFAULT_BLOCK_SIZE = 16  # assumed until an engine describes itself
DEFAULT_LATENCY_WINDOW_S = 2.0  # NexusSched §7.4's latency-based baseline averages the last 2 s
# Index blocks the sent index keeps per engine whose KV capacity is not known yet (no report).
DEFAULT_SENT_CAPACITY_BLOCKS = 4096


@dataclass(slots=True, eq=False)  # compared by identity: one record per dispatch, even for a repeated id
class _Dispatch:
    tokens: int  # prompt + max output tokens
    prompt_tokens: int
    engine_ts_estimate_s: float | None  # the engine's clock at dispatch time; None = no report to anchor to
    reported: bool = False


@dataclass(slots=True)
class _Engine:
    engine_id: EngineId
    added_at_s: float
    description: EngineDescription | None = None
    connected: bool = False
    report: EngineReport | None = None
    report_received_s: float = 0.0
    # Anchor for the engine clock, per connection (an engine that restarts may restart its clock and seq).
    anchor_engine_ts_s: float | None = None
    anchor_received_s: float = 0.0
    # Request id -> its dispatches, oldest first (ids are normally unique; a client may still reuse one).
    inflight: dict[str, list[_Dispatch]] = field(default_factory=dict)
    unreported: list[_Dispatch] = field(default_factory=list)
    inflight_requests: int = 0
    inflight_tokens: int = 0
    unreported_tokens: int = 0
    unreported_prompt_tokens: int = 0
    # (finished at, ttft_s, e2e_s) of requests finished within the latency window, oldest first, and sums.
    latencies: deque[tuple[float, float, float]] = field(default_factory=deque)
    ttft_sum_s: float = 0.0
    e2e_sum_s: float = 0.0
    health: EngineHealth = field(default_factory=EngineHealth)
    # STAR: the last prediction round's predictions and future-load summary (reports carry them per round).
    predictions: tuple[RequestPrediction, ...] = ()
    future_load: FutureLoad | None = None
    kv_events: bool = False  # its current stream sends prefix-cache events (the reported index holds them)
    index: int = -1  # position in the engines' id order; -1 once removed
    dirty: bool = True  # its view must be rebuilt at the next snapshot
    wake_s: float = math.inf  # when its view changes by time alone (see `_boundary_s`)

    def expire_latencies(self, now_s: float, window_s: float) -> None:
        samples = self.latencies
        while samples and now_s - samples[0][0] >= window_s:
            _, ttft_s, e2e_s = samples.popleft()
            self.ttft_sum_s -= ttft_s
            self.e2e_sum_s -= e2e_s
        if not samples:  # no drift carried over from long sums
            self.ttft_sum_s = self.e2e_sum_s = 0.0


class ClusterState:
    """The fleet as this gateway knows it; every method is synchronous and takes time as an argument."""

    def __init__(
        self,
        *,
        stale_after_s: float = 1.0,
        session_ttl_s: float = 600.0,
        max_sessions: int = 100_000,
        snapshot_resolution_s: float = 0.005,
        latency_window_s: float = DEFAULT_LATENCY_WINDOW_S,
        outlier: OutlierParams | None = None,
        prefix_max_keys: int = DEFAULT_MAX_KEYS,
    ) -> None:
        """A cached snapshot is reused while nothing changed, no engine crossed its staleness boundary, no
        latency sample left its window and it is younger than `snapshot_resolution_s` (so `taken_at_s` /
        `ClusterSnapshot.state_age_s` lag `now_s` by at most that). `prefix_max_keys` bounds each of the two
        prefix indexes (the reported and the sent one).
        """
        if latency_window_s <= 0:
            raise ValueError(f"latency_window_s must be > 0, got {latency_window_s}")
        self._stale_after_s = stale_after_s
        self._latency_window_s = latency_window_s
        self._outlier = outlier if outlier is not None else OutlierParams()
        self._session_ttl_s = session_ttl_s
        self._max_sessions = max_sessions
        self._resolution_s = snapshot_resolution_s
        self._engines: dict[EngineId, _Engine] = {}
        self._order: tuple[_Engine, ...] = ()  # the engines sorted by id
        self._sessions: OrderedDict[str, tuple[EngineId, float]] = OrderedDict()  # oldest use first
        self._changed = True  # the snapshot object must be rebuilt (some view, the routes or the stages)
        self._cached: ClusterSnapshot | None = None
        # The last snapshot's views, in `_order` (None: not built since the engines changed).
        self._views: list[EngineView | None] = []
        self._dirty: list[_Engine] = []  # engines whose views must be rebuilt
        # (time, tie, engine): when an engine's view changes by time alone; lazy (an entry whose time is no
        # longer the engine's `wake_s` is skipped).
        self._wakes: list[tuple[float, int, _Engine]] = []
        self._wake_ties = itertools.count()
        # Weighted picks (goodput_rr): model -> picks per group since its weights last changed.
        self._routes: Mapping[str, RouteTally] = MappingProxyType({})
        # CascadeInfer: model -> the length stages its rescheduler last published (`publish_stages`).
        self._stages: Mapping[str, StageLayout] = MappingProxyType({})
        # A new value when the set of engines or one's model/readiness/ejection/combo/profile changes.
        self._membership = next(_MEMBERSHIP_EPOCHS)
        # KV-cache-aware routing: index-block key -> engines, from the agents' KV events (reported) and from
        # this gateway's dispatches (sent: an LRU per engine sized to its KV capacity).
        self._reported = PrefixIndex(prefix_max_keys)
        self._sent = PrefixIndex(prefix_max_keys)
        self.kv_events_ignored = 0  # event batches not applied: a resync over another span, or its deltas

    # ---- membership and lifecycle events -----------------------------------------------------------------

    def add_engine(self, engine_id: EngineId, now_s: float) -> None:
        """Start tracking an engine (not ready until it connects and reports); ValueError if known."""
        if engine_id in self._engines:
            raise ValueError(f"engine {engine_id!r} is already in the store")
        self._engines[engine_id] = _Engine(engine_id=engine_id, added_at_s=now_s)
        self._reorder()

    def _reorder(self) -> None:
        self._order = tuple(self._engines[e] for e in sorted(self._engines))
        self._views = [None] * len(self._order)
        self._dirty = []
        for index, state in enumerate(self._order):
            state.index, state.dirty = index, True
            self._dirty.append(state)
        self._changed = True
        self._membership = next(_MEMBERSHIP_EPOCHS)

    def _touch(self, state: _Engine) -> None:
        """Something about `state` changed: rebuild its view at the next snapshot."""
        if not state.dirty:
            state.dirty = True
            self._dirty.append(state)
        self._changed = True

    def remove_engine(self, engine_id: EngineId) -> None:
        """Forget an engine and its accounting (an explicit act); KeyError when unknown."""
        self._engines.pop(engine_id).index = -1
        self._reported.remove_engine(engine_id)
        self._sent.remove_engine(engine_id)
        self._reorder()

    def on_describe(self, engine_id: EngineId, description: EngineDescription) -> None:
        state = self._engines[engine_id]
        state.description = description
        self._touch(state)

    def on_connect(self, engine_id: EngineId) -> None:
        """The engine's state stream delivered its first report of a connection (call before `on_report`)."""
        state = self._engines[engine_id]
        state.connected = True
        self._touch(state)

    def on_disconnect(self, engine_id: EngineId) -> None:
        """The state stream ended: not ready until it reconnects; the next report sets a new clock anchor."""
        state = self._engines[engine_id]
        state.connected = False
        state.anchor_engine_ts_s = None
        state.predictions, state.future_load = (), None  # a reconnected agent starts its rounds anew
        if state.kv_events:  # the reconnected stream resyncs (its first events are `cleared`)
            state.kv_events = False
            self._reported.clear(engine_id)
        self._touch(state)

    def on_report(self, engine_id: EngineId, report: EngineReport, received_at_s: float) -> None:
        """Record a state report received at `received_at_s`; duplicates and out-of-order reports of one
        connection (seq not above the last) are ignored."""
        state = self._engines[engine_id]
        previous = state.report
        if state.anchor_engine_ts_s is not None and previous is not None and report.seq <= previous.seq:
            return
        state.report = report
        state.report_received_s = received_at_s
        if report.future_load is not None:  # a new prediction round (STAR): kept until the next one
            state.predictions = report.predictions
            state.future_load = report.future_load
        kv = report.kv_events
        if kv is not None:
            if kv.cleared:  # a resync: the stream's span is stated here, once
                state.kv_events = kv.span_tokens == INDEX_SPAN_TOKENS
                if state.kv_events:
                    self._reported.apply(engine_id, kv.stored, kv.removed, True)
                else:  # keys this gateway cannot compute: never matched, the engine's old keys dropped
                    self._reported.clear(engine_id)
                    self.kv_events_ignored += 1
            elif state.kv_events:  # a stream's deltas count from an accepted resync on
                self._reported.apply(engine_id, kv.stored, kv.removed)
            else:
                self.kv_events_ignored += 1
        if state.anchor_engine_ts_s is None or report.engine_timestamp_s > state.anchor_engine_ts_s:
            engine_ts_s = report.engine_timestamp_s
            if state.unreported:
                still_unreported = []
                for d in state.unreported:
                    if d.engine_ts_estimate_s is None or engine_ts_s >= d.engine_ts_estimate_s:
                        d.reported = True
                        state.unreported_tokens -= d.tokens
                        state.unreported_prompt_tokens -= d.prompt_tokens
                    else:
                        still_unreported.append(d)
                state.unreported = still_unreported
            state.anchor_engine_ts_s = engine_ts_s
            state.anchor_received_s = received_at_s
        self._touch(state)

    # ---- optimistic accounting and sessions ----------------------------------------------------------------

    def note_dispatch(
        self,
        engine_id: EngineId,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        session_id: str,
        now_s: float,
        route: RouteTag | None = None,
        prefix_keys: Sequence[int] = (),
    ) -> None:
        """Count a request sent to `engine_id` until `note_finish`; record its session (if any) there.
        `route`: a weighted policy's tag for the pick; it counts for its group, and weights other than the
        model's current ones start the model's counts anew ("the dispatch counts since the last weight
        change", `RouteTally`). `prefix_keys`: the prompt's index-block keys, recorded in the sent index."""
        state = self._engines.get(engine_id)
        if state is None:
            raise KeyError(f"unknown engine {engine_id!r}")
        if route is not None:
            self._tally(route)
        estimate_s = None
        if state.anchor_engine_ts_s is not None:
            estimate_s = state.anchor_engine_ts_s + (now_s - state.anchor_received_s)
        prompt = max(0, prompt_tokens)
        dispatch = _Dispatch(prompt + max(0, max_tokens), prompt, estimate_s)
        state.inflight.setdefault(request_id, []).append(dispatch)
        state.inflight_requests += 1
        state.inflight_tokens += dispatch.tokens
        state.unreported.append(dispatch)
        state.unreported_tokens += dispatch.tokens
        state.unreported_prompt_tokens += dispatch.prompt_tokens
        state.health.on_dispatch(request_id, now_s)
        if session_id:
            self._sessions[session_id] = (engine_id, now_s)
            self._sessions.move_to_end(session_id)
            self.prune_sessions(now_s)
        if prefix_keys:
            self._sent.record(engine_id, prefix_keys, self._capacity_blocks(state))
        self._touch(state)

    @staticmethod
    def _capacity_blocks(state: _Engine) -> int:
        """The engine's KV capacity in indexed keys (what the sent index keeps for it): a cache of T tokens
        holds T / 1,024 keys of long prompts and T / 256 of prompts under 1,024 tokens
        (`switchyard.prefix.is_indexed`); T / 512 sits between."""
        desc, report = state.description, state.report
        if report is None or report.kv_blocks_total <= 0:
            return DEFAULT_SENT_CAPACITY_BLOCKS
        block_size = desc.block_size if desc is not None and desc.block_size > 0 else DEFAULT_BLOCK_SIZE
        return max(1, report.kv_blocks_total * block_size // (2 * INDEX_SPAN_TOKENS))

    def _tally(self, route: RouteTag) -> None:
        current = self._routes.get(route.model)
        weights = route.weights
        if current is None or (current.weights is not weights and current.weights != weights):
            counts = [0] * len(weights)
        else:
            counts, weights = list(current.counts), current.weights
        counts[route.index] += 1
        routes = dict(self._routes)  # models are few: only the touched one's tally is rebuilt
        routes[route.model] = RouteTally(weights, tuple(counts))
        self._routes = MappingProxyType(routes)

    def publish_stages(self, layouts: Mapping[str, StageLayout]) -> None:
        """The `length_stages` rescheduler's layouts (model -> `StageLayout`), read by its policy through
        `ClusterSnapshot.stages`; a model left out has none."""
        if layouts != self._stages:
            self._stages = MappingProxyType(dict(layouts))
            self._changed = True

    def note_finish(self, engine_id: EngineId, request_id: str) -> None:
        """Forget a dispatched request (its oldest dispatch if the id was reused); unknown ids are ignored."""
        state = self._engines.get(engine_id)
        if state is None:
            return
        dispatches = state.inflight.get(request_id)
        if not dispatches:
            return
        dispatch = dispatches.pop(0)
        if not dispatches:
            del state.inflight[request_id]
        state.health.on_release(request_id)
        state.inflight_requests -= 1
        state.inflight_tokens -= dispatch.tokens
        if not dispatch.reported:
            state.unreported.remove(dispatch)
            state.unreported_tokens -= dispatch.tokens
            state.unreported_prompt_tokens -= dispatch.prompt_tokens
        self._touch(state)

    def engine_of(self, request_id: str) -> EngineId | None:
        """The engine holding `request_id`'s newest in-flight dispatch (None: not in flight). O(engines)."""
        for state in self._engines.values():
            if request_id in state.inflight:
                return state.engine_id
        return None

    # ---- transport outcomes (outlier detection) -----------------------------------------------------------

    def note_success(self, engine_id: EngineId) -> bool:
        """A request to the engine produced its first event; True when that ended an ejection. Unknown
        engines are ignored."""
        state = self._engines.get(engine_id)
        if state is None or not state.health.on_success():
            return False
        self._touch(state)
        return True

    def note_failure(self, engine_id: EngineId, reason: FailureReason, now_s: float) -> bool:
        """A request to the engine failed (see `gateway.cluster.health`); True when this ejected it."""
        state = self._engines.get(engine_id)
        if state is None:
            return False
        model = self._model_of(state)
        peers = [s for s in self._order if self._model_of(s) == model]
        out = sum(1 for s in peers if s.health.out_of_pool(now_s))
        ejected = state.health.on_failure(
            reason, now_s, self._outlier, may_eject=self._outlier.may_eject(out, len(peers))
        )
        self._touch(state)  # the failure may also have ended a half-open probe
        return ejected

    @staticmethod
    def _model_of(state: _Engine) -> str:
        if state.report is not None:
            return state.report.model
        return state.description.model if state.description is not None else ""

    def note_latency(self, engine_id: EngineId, ttft_s: float, e2e_s: float, now_s: float) -> None:
        """A request served by `engine_id` finished at `now_s` with these latencies (from its dispatch
        there); it counts in the engine's recent latency figures for the latency window. Unknown engines are
        ignored."""
        state = self._engines.get(engine_id)
        if state is None:
            return
        ttft_s, e2e_s = max(0.0, ttft_s), max(0.0, e2e_s)
        state.expire_latencies(now_s, self._latency_window_s)
        state.latencies.append((now_s, ttft_s, e2e_s))
        state.ttft_sum_s += ttft_s
        state.e2e_sum_s += e2e_s
        self._touch(state)

    def session_lookup(self, session_id: str, now_s: float) -> tuple[EngineId | None, float]:
        """(engine that last served the session, when) or (None, 0.0) when unknown or older than the TTL."""
        entry = self._sessions.get(session_id)
        if entry is None or now_s - entry[1] > self._session_ttl_s:
            return None, 0.0
        return entry

    def prefix_match(self, keys: Sequence[int], source: str, now_s: float) -> dict[EngineId, int]:
        """How many of `keys` (a prompt's index-block keys, from the first) each engine holds: engine ->
        count, engines with none left out. `source` `PREFIX_SENT`: what this gateway sent where;
        `PREFIX_EVENTS`: the engines' KV events, for engines whose stream sends them and whose report is
        fresh, and the sent index for the others (stale, or sending no events: like the rest of a stale
        engine's state, local accounting stands in for the report)."""
        if not keys:
            return {}
        if source == PREFIX_SENT:
            return self._sent.match(keys, self._engines)
        if source != PREFIX_EVENTS:
            raise ValueError(f"unknown prefix source {source!r}")
        fresh: set[EngineId] = set()  # sets: `PrefixIndex.match` then needs no copy of its engines
        other: set[EngineId] = set()
        stale_after_s = self._stale_after_s
        for state in self._order:
            if state.kv_events and now_s - state.report_received_s <= stale_after_s:
                fresh.add(state.engine_id)
            else:
                other.add(state.engine_id)
        out = self._reported.match(keys, fresh) if fresh else {}
        if other:
            out.update(self._sent.match(keys, other))
        return out

    def prefix_index_sizes(self) -> tuple[int, int, int]:
        """(keys in the reported index, keys in the sent index, keys dropped at the bound by both)."""
        return len(self._reported), len(self._sent), self._reported.dropped + self._sent.dropped

    def prune_sessions(self, now_s: float) -> int:
        """Drop sessions unused for over the TTL and the oldest beyond `max_sessions`; returns how many."""
        dropped = 0
        sessions = self._sessions
        while sessions:
            _, (_, last_used_s) = next(iter(sessions.items()))
            if now_s - last_used_s <= self._session_ttl_s and len(sessions) <= self._max_sessions:
                break
            sessions.popitem(last=False)
            dropped += 1
        return dropped

    # ---- reads ---------------------------------------------------------------------------------------------

    def snapshot(self, now_s: float) -> ClusterSnapshot:
        """The fleet at `now_s`, engines ordered by id (the cached one when still valid, see `__init__`);
        views of engines nothing happened to since the last snapshot are reused (module docstring)."""
        cached = self._cached
        wakes = self._wakes
        next_wake_s = wakes[0][0] if wakes else math.inf
        if (
            cached is not None
            and not self._changed
            and now_s < next_wake_s
            and now_s - cached.taken_at_s < self._resolution_s
        ):
            return cached
        while wakes and wakes[0][0] <= now_s:  # views that changed by time alone
            wake_s, _, state = heapq.heappop(wakes)
            if state.index >= 0 and state.wake_s == wake_s:
                state.wake_s = math.inf
                self._touch(state)
        views = self._views
        for state in self._dirty:
            if state.index < 0:
                continue  # removed since it was touched
            state.dirty = False
            view = self._view(state, now_s)
            last = views[state.index]
            if last is None or (last.ready is not view.ready or last.ejected is not view.ejected
                                or last.combo != view.combo or last.model != view.model
                                or last.profile != view.profile or last.role != view.role):
                self._membership = next(_MEMBERSHIP_EPOCHS)
            views[state.index] = view
            wake_s = self._boundary_s(state, view, now_s)
            if wake_s != state.wake_s:
                state.wake_s = wake_s
                if wake_s < math.inf:
                    heapq.heappush(wakes, (wake_s, next(self._wake_ties), state))
        self._dirty.clear()
        # Every entry is built now: `_reorder` marks every engine dirty when it resets the list to None.
        engines = cast(tuple[EngineView, ...], tuple(views))
        snapshot = ClusterSnapshot(taken_at_s=now_s, engines=engines, routes=self._routes,
                                   membership=self._membership, stages=self._stages)
        self._cached = snapshot
        self._changed = False
        return snapshot

    def _boundary_s(self, state: _Engine, view: EngineView, now_s: float) -> float:
        """The earliest time after `now_s` at which `view` no longer describes the engine though nothing
        happened to it: its report turns stale, its oldest latency sample leaves the window or its ejection
        period ends (+inf: none)."""
        boundary_s = math.inf
        if state.latencies:
            boundary_s = state.latencies[0][0] + self._latency_window_s
        if state.report is not None and not view.stale:  # stale once the age exceeds the bound
            stale_at_s = math.nextafter(state.report_received_s + self._stale_after_s, math.inf)
            boundary_s = min(boundary_s, stale_at_s)
        if state.health.ejected_until_s is not None:
            boundary_s = min(boundary_s, state.health.next_change_s(now_s))
        return boundary_s

    def _view(self, state: _Engine, now_s: float) -> EngineView:
        if state.latencies:
            state.expire_latencies(now_s, self._latency_window_s)
        desc, report = state.description, state.report
        block_size = desc.block_size if desc is not None and desc.block_size > 0 else DEFAULT_BLOCK_SIZE
        max_num_seqs = desc.max_num_seqs if desc is not None else 0
        samples = len(state.latencies)
        gpu, tp, price = ("", 1, 0.0) if desc is None else (
            desc.gpu, desc.tensor_parallel, desc.hourly_price_usd)
        recent_ttft_s = state.ttft_sum_s / samples if samples else None
        recent_e2e_s = state.e2e_sum_s / samples if samples else None
        if report is None:
            return EngineView(
                engine_id=state.engine_id,
                model=desc.model if desc is not None else "",
                profile=desc.profile if desc is not None else "",
                backend=desc.backend if desc is not None else "",
                role=desc.role if desc is not None else "",
                gpu=gpu,
                tensor_parallel=tp,
                hourly_price_usd=price,
                block_size=block_size,
                max_num_seqs=max_num_seqs,
                inflight_requests=state.inflight_requests,
                inflight_tokens=state.inflight_tokens,
                unreported_requests=len(state.unreported),
                unreported_tokens=state.unreported_tokens,
                unreported_prompt_tokens=state.unreported_prompt_tokens,
                recent_ttft_s=recent_ttft_s,
                recent_e2e_s=recent_e2e_s,
                recent_latency_samples=samples,
                ready=False,
                stale=True,
                ejected=state.health.out_of_pool(now_s),
                reported_at_s=state.added_at_s,
            )
        view = EngineView(  # the latest report wins for identity: roles and profiles can change while running
            engine_id=state.engine_id,
            model=report.model,
            profile=report.profile,
            backend=report.backend,
            role=report.role,
            combo=report.combo,
            gpu=gpu,
            tensor_parallel=tp,
            hourly_price_usd=price,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            inflight_requests=state.inflight_requests,
            inflight_tokens=state.inflight_tokens,
            unreported_requests=len(state.unreported),
            unreported_tokens=state.unreported_tokens,
            unreported_prompt_tokens=state.unreported_prompt_tokens,
            recent_ttft_s=recent_ttft_s,
            recent_e2e_s=recent_e2e_s,
            recent_latency_samples=samples,
            ready=state.connected and report.ready and not report.draining,
            stale=False,
            ejected=state.health.out_of_pool(now_s),
            reported_at_s=state.report_received_s,
            seq=report.seq,
            num_running=report.num_running,
            num_waiting=report.num_waiting,
            kv_blocks_total=report.kv_blocks_total,
            kv_blocks_free=report.kv_blocks_free,
            kv_blocks_reserved=report.kv_blocks_reserved,
            pending_prefill_tokens=report.pending_prefill_tokens,
            running_batch_tokens=report.running_batch_tokens,
            last_iteration_s=report.last_iteration_s,
            lens=report.lens,
            predictions=state.predictions,
            future_load=state.future_load,
            qoe=report.qoe,  # properties of the engine, not of its load: a stale view keeps both
            transfer_bytes_per_s=report.transfer_bytes_per_s,
            kv_bytes_per_token=desc.kv_bytes_per_token if desc is not None else 0,
        )
        if now_s <= state.report_received_s + self._stale_after_s:  # the form `_boundary_s` wakes on
            return view
        # Stale: identity and readiness from the last report, load from local accounting (module docstring).
        used_blocks = -(state.inflight_tokens // -block_size)
        return replace(
            view,
            stale=True,
            num_running=state.inflight_requests,
            num_waiting=0,
            kv_blocks_reserved=0,
            kv_blocks_free=max(0, report.kv_blocks_total - used_blocks),
            pending_prefill_tokens=0,
            running_batch_tokens=0,
            unreported_requests=0,
            unreported_tokens=0,
            unreported_prompt_tokens=0,
            lens=None,
            predictions=(),
            future_load=None,
        )

    def engine_ids(self) -> tuple[EngineId, ...]:
        return tuple(state.engine_id for state in self._order)

    def __contains__(self, engine_id: object) -> bool:
        return engine_id in self._engines

    def is_connected(self, engine_id: EngineId) -> bool:
        return self._engines[engine_id].connected

    def models(self) -> tuple[str, ...]:
        """Served model names (from the engines' descriptions), sorted."""
        engines = self._engines.values()
        return tuple(sorted({s.description.model for s in engines if s.description is not None}))

    def descriptions(self) -> Mapping[EngineId, EngineDescription]:
        return {eid: s.description for eid, s in self._engines.items() if s.description is not None}

    def latest_reports(self) -> Mapping[EngineId, EngineReport]:
        """The last report of each engine that has reported."""
        return {eid: s.report for eid, s in self._engines.items() if s.report is not None}
