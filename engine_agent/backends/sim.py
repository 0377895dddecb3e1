"""`SimBackend`: the simulated GPU (`engine_agent.sim.engine.SimEngine`) driven in real time.

Owns: the one engine-loop task (born in `start`, cancelled and awaited in `stop`, which also awaits a
hidden-state batch still being built in the executor), per-request delivery
buffers, the mapping of the engine's step results onto wall time (a step's output is delivered when its
simulated duration has elapsed), aborts on early close, when the change version behind `wait_for_change` is
looked at (the version itself is `engine_agent.backends.sim_changes`), the loop-lag figures, migration
(`migrate_out` / `migrate_in`: the cut against the delivery buffers, the modelled KV transfer time, the
migration stats kept), when the hidden-state tap runs (`hidden_states`), the decided output lengths STAR's
oracle reads (`output_targets`), attaching LENS to the engine (`engine_agent.sim.lens_adapter.SimLens`:
state vector always, batch planning with `lens_planning`; the engine runs its refits inline, a few ms every 16
iterations, which the loop absorbs like any slow step), and feeding CascadeInfer's online QoE fit
(`engine_agent.qoe_tracker.QoETracker`) and the KV pull throughput (`engine_agent.transfer_rate`) that
`stats` carries.
Must not: batch, schedule or time iterations itself (that is the engine model, invariant I2), know gRPC or
text, encode tickets (that is `engine_agent.sim.ticket`), keep tap subscribers or build hidden-state batches
(that is `engine_agent.backends.sim_tap`), or read time other than through the injected `Clock` (it waits
with asyncio sleeps and events).

Migration. `migrate_out` cuts the request in the engine at once. The engine may already have computed the step
now in flight (computed, then slept on until it is due): its token for the request belongs to the ticket, so
the stream delivers it when the step is due and only then ends with the `MigratedEvent`; the ticket's output
tokens are exactly the tokens the stream delivered. The source frees the KV at the cut (see
`engine_agent.sim.migration`). `transfer_params` carry the request's token-generator state and decided
output length (`engine_agent.sim.ticket`), so a migrated request continues with exactly the tokens it would
have produced unmigrated: seeded requests can move too. On the target the KV is "pulled" in
transfer_s = kv_transfer_latency_s + kv_bytes x 8 / (kv_link_gbps x 1e9) once its blocks are allocated; then
only the last sampled token is computed. A ticket without KV (`kv_tokens` 0, possibly with output tokens a
failed target streamed after the cut) transfers nothing: the engine checks those tokens against the request's
generator and recomputes prompt + output in one prefill. Since the source frees its KV at the cut, the sim
holds no cut's KV, so it needs no lease (`--migration-kv-lease-s`) and an `Abort` of a cut id finds nothing.

Prefill role (`role="prefill"`, CAUCHY's disaggregation): the engine cuts every request after its first
token (`SimEngine`'s `handoff`); the step's delivery appends that token and ends the stream with the cut's
`MigratedEvent` (target "": the gateway picks a decode engine), so the ticket carries exactly one output
token.

QoE fit (CascadeInfer §4.1). The engine records each step's batch (`record_batches`); right after the step the
loop hands it to the tracker, then the step's finishes: e2e_s is the request's time on this engine in the
engine's timeline (arrival here to its last token: queueing, and for a migrated-in request the wait for blocks
and the modelled pull, included), output tokens those produced here (a migrated-in request's earlier ones
excluded). Aborts, cancellations, cuts and prefill hand-offs are dropped (no sample). `stats` refits at most
every 50 new samples. Added cost per iteration (recording and tracking, `benchmarks/qoe_tracker_cost.py` on
this repository's 2-core machine): 39 us at 256 decoding sequences and 145 us at 1,024, against 159 and 633 us
for the bare `step` (about 24 %; 0.2 to 0.35 % of the 19 and 42 ms those iterations last in simulated time).
Transfer throughput: each migrated-in request whose KV was pulled (not recomputed, not resumed in place)
counts kv_bytes / transfer_s of its modelled pull when its first token here is delivered.

Hidden-state tap (`engine_agent.backends.sim_tap`). Every `hidden_state_interval` decode steps (iterations
with decoding sequences), when someone subscribes, the loop takes the decoding requests' lengths from the
engine right after the step and builds their vectors in the default executor while it sleeps out the step
(never two taps at once: a tap due while the previous one is still being built is skipped); the batch reaches
each subscriber's queue once built and the step delivered.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine_agent.backends.sim_changes import ChangeVersion
from engine_agent.backends.sim_tap import HiddenStateTap
from engine_agent.domain import (
    BackendEvent,
    BackendRequest,
    EngineStatic,
    EngineStats,
    FinishEvent,
    HiddenStateBatch,
    KvDelta,
    MigratedEvent,
    MigrationRefused,
    MigrationStats,
    MigrationTicket,
    RequestId,
    Timings,
    TokenEvent,
    Usage,
    request_from_ticket,
)
from engine_agent.lens.perf_model import import_fit_dependencies
from engine_agent.qoe_tracker import QoETracker
from engine_agent.sim.engine import SimEngine, StepResult
from engine_agent.sim.lens_adapter import SimLens
from engine_agent.sim.migration import MigrationCut
from engine_agent.sim.ticket import cut_from_ticket, ticket_for_cut
from engine_agent.transfer_rate import TransferRate
from switchyard.clock import Clock
from switchyard.profiles import Profile
from switchyard.roles import PREFILL_ROLE

log = logging.getLogger(__name__)

# Delivery later than this re-anchors the simulated timeline to the wall clock (counted as a late step).
DEFAULT_LAG_TOLERANCE_S = 0.002
# Migration stats kept for finished requests (the most recent ones).
_MIGRATION_STATS_KEPT = 4096


@dataclass(frozen=True, slots=True)
class LoopLag:
    """How far the engine loop fell behind the simulated timeline (delivery time - simulated step end)."""

    steps: int
    late_steps: int  # steps delivered more than the tolerance late (the timeline slipped)
    max_lag_s: float
    mean_lag_s: float
    slipped_s: float  # total time the simulated timeline was pushed back to follow the wall clock


class _Stream:
    """One request's output; the consumer has read `tokens[:read]` and waits on `waiter`.

    `prior` are the tokens the request produced on earlier engines (migrated in); `end` is the event that ends
    the stream (a finish or a migration) once every token is read.
    """

    __slots__ = ("request", "prior", "tokens", "read", "end", "waiter", "last_token_s", "migration")

    def __init__(self, request: BackendRequest, prior: tuple[int, ...], now_s: float,
                 migration: MigrationStats | None) -> None:
        self.request = request
        self.prior = prior
        self.tokens: list[int] = []
        self.read = 0
        self.end: FinishEvent | MigratedEvent | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.last_token_s = now_s
        self.migration = migration  # how its KV arrives, until the first token here (then published)

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class SimBackend:
    """`EngineBackend` over `SimEngine` in real time, with the `Migrator` and `HiddenStateSource`
    capabilities, and `KvEventSource` when prefix caching is on; one instance per agent process."""

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
        hidden_state_interval: int | None = None,
        kv_link_gbps: float = 200.0,
        kv_transfer_latency_s: float = 0.002,
        lens_planning: bool = False,
        prefix_caching: bool = True,
    ) -> None:
        if hidden_state_interval is not None and hidden_state_interval < 1:
            raise ValueError(f"hidden_state_interval must be >= 1 (None: off), got {hidden_state_interval}")
        if kv_link_gbps <= 0 or kv_transfer_latency_s < 0:
            raise ValueError("kv_link_gbps must be > 0 and kv_transfer_latency_s >= 0")
        self._clock = clock
        self._eos_token_id = eos_token_id
        self._vocab_size = vocab_size
        self._engine = SimEngine(
            profile,
            seed=seed,
            vocab_size=vocab_size,
            eos_token_id=eos_token_id,
            special_token_ids=special_token_ids,
            engine_id=engine_id,
            # LENS always runs (its state vector feeds PRISM); it plans batches only with `lens_planning`.
            lens=SimLens.for_profile(profile, planning=lens_planning),
            handoff=role == PREFILL_ROLE,
            record_batches=True,  # CascadeInfer's batch loads (`_track_qoe`)
            prefix_caching=prefix_caching,
            kv_events=prefix_caching,  # the agent's journal drains them at every WatchState push
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
            hidden_size=profile.model.hidden_size,
            hidden_state_interval=hidden_state_interval,
            kv_bytes_per_token=profile.model.kv_bytes_per_token,
        )
        self._kv_bytes_per_token = profile.model.kv_bytes_per_token
        self._kv_transfer_bytes_per_s = kv_link_gbps * 1e9 / 8
        self._kv_transfer_latency_s = kv_transfer_latency_s
        self._lag_tolerance_s = lag_tolerance_s
        self._streams: dict[RequestId, _Stream] = {}
        self._wake = asyncio.Event()
        self._changes = ChangeVersion(self._engine, clock)
        self._last_admit_s = float("-inf")
        self._task: asyncio.Task[None] | None = None
        self._lag_steps = 0
        self._lag_late = 0
        self._lag_max_s = 0.0
        self._lag_sum_s = 0.0
        self._slipped_s = 0.0
        # The step computed and not yet delivered (with its due time), and the migrated events it gates.
        self._inflight: StepResult | None = None
        self._inflight_due_s = 0.0
        self._deferred: dict[RequestId, MigratedEvent] = {}
        self._migration_stats: OrderedDict[RequestId, MigrationStats] = OrderedDict()
        self._qoe = QoETracker()
        self._transfer = TransferRate()
        self._tap = HiddenStateTap(
            self._engine,
            interval=hidden_state_interval,
            hidden_size=profile.model.hidden_size,
            model_name=profile.model.name,
            seed=seed,
        )

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
            # Off the loop, before the engine runs: the first LENS refit (inline in the engine loop) would
            # import scipy (~0.4 s), and the tap's synthetic model takes ~0.1 s to build.
            await asyncio.to_thread(self._prepare)
            self._task = asyncio.create_task(self._run(), name=f"sim-engine-loop:{self._static.engine_id}")

    def _prepare(self) -> None:
        import_fit_dependencies()
        self._tap.prepare()

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._inflight is not None:  # computed already: its tokens (and migrations it gates) count
            self._deliver(self._inflight, self._inflight_due_s)
        now = self._clock.now()
        for request_id in list(self._streams):
            event = self._engine.abort(request_id, now)
            self._qoe.on_drop(request_id)
            self._end_stream(request_id, event or _aborted())
        await self._tap.aclose()
        self._changes.publish()
        lag = self.loop_lag
        log.info(
            "engine loop stopped: steps=%d late_steps=%d max_lag_ms=%.2f mean_lag_ms=%.3f slipped_ms=%.1f "
            "hidden_state_taps_skipped=%d",
            lag.steps,
            lag.late_steps,
            lag.max_lag_s * 1e3,
            lag.mean_lag_s * 1e3,
            lag.slipped_s * 1e3,
            self._tap.taps_skipped,
        )

    def generate(self, request: BackendRequest) -> AsyncIterator[BackendEvent]:
        return self._serve(request, None)

    async def _serve(
        self, request: BackendRequest, migrated: tuple[MigrationCut, float, tuple[int, ...]] | None
    ) -> AsyncIterator[BackendEvent]:
        """Admit (on the first iteration) and stream one request; `migrated` = (cut, transfer_s, prior)."""
        request_id = request.request_id
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
        if self._task is None:
            raise RuntimeError("backend is not started")
        now = self._clock.now()
        if migrated is None:
            self._engine.add_request(request, now)  # ValueError on over-context or duplicate
            stream = _Stream(request, (), now, None)
        else:
            cut, transfer_s, prior = migrated
            self._engine.add_migrated_request(request, cut, now, transfer_s)  # MigrationRefused
            recomputed = len(request.prompt_token_ids) + len(prior) - 1 if cut.recompute else 0
            stats = MigrationStats(cut.kv_tokens, recomputed, cut.kv_bytes, transfer_s)
            stream = _Stream(request, prior, now, stats)
        self._streams[request_id] = stream
        self._last_admit_s = now
        self._wake.set()
        self._changes.publish()
        ended = False
        loop = asyncio.get_running_loop()
        try:
            while True:
                tokens = stream.tokens
                if len(tokens) > stream.read:
                    ids = tuple(tokens[stream.read :])
                    stream.read = len(tokens)
                    yield TokenEvent(ids)
                elif stream.end is not None:
                    ended = True
                    yield stream.end
                    return
                else:
                    stream.waiter = loop.create_future()
                    await stream.waiter
                    stream.waiter = None
        finally:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
                self._deferred.pop(request_id, None)
            if not ended and stream.end is None:
                self._engine.abort(request_id, self._clock.now())  # None when already cut: nothing to free
                self._qoe.on_drop(request_id)
                self._changes.publish()

    async def abort(self, request_id: RequestId) -> bool:
        if request_id not in self._streams:
            return False
        event = self._engine.abort(request_id, self._clock.now())
        if event is None:
            return False  # finished or cut in the step now in flight; its delivery ends the stream
        self._qoe.on_drop(request_id)
        self._end_stream(request_id, event)
        self._changes.publish()
        return True

    def stats(self) -> EngineStats:
        """The engine's figures with the QoE fit (refitted here when due) and the KV pull throughput."""
        return dataclasses.replace(self._engine.stats(self._clock.now()), qoe=self._qoe.report(),
                                   transfer_bytes_per_s=self._transfer.bytes_per_s)

    async def wait_for_change(self, after_version: int, timeout_s: float) -> int:
        return await self._changes.wait(after_version, timeout_s)

    # -- migration ---------------------------------------------------------------------------------

    async def migrate_out(self, request_id: RequestId, target: str) -> MigrationTicket:
        stream = self._streams.get(request_id)
        if stream is None or stream.end is not None or request_id in self._deferred:
            raise MigrationRefused(f"request {request_id!r} is not running here (unknown or finished)")
        cut = self._engine.migrate_out(request_id, self._clock.now())  # MigrationRefused with the reason
        self._qoe.on_drop(request_id)
        inflight = self._inflight
        pending = tuple(t for rid, t in inflight.tokens if rid == request_id) if inflight is not None else ()
        output = stream.prior + tuple(stream.tokens) + pending
        if len(output) != cut.num_output:  # the engine and the delivery buffers disagree: a bug
            raise RuntimeError(f"request {request_id!r}: {len(output)} tokens delivered or in flight, "
                               f"the engine produced {cut.num_output}")
        ticket = self._ticket(cut, stream, output, target,
                              self._inflight_due_s if pending else stream.last_token_s)
        event = MigratedEvent(ticket)
        if pending:
            self._deferred[request_id] = event  # after the step in flight delivers the ticket's last token
        else:
            self._end_stream(request_id, event)
        self._changes.publish()
        return ticket

    def _ticket(self, cut: MigrationCut, stream: _Stream, output: tuple[int, ...], target: str,
                cut_s: float) -> MigrationTicket:
        static = self._static
        return ticket_for_cut(
            cut,
            stream.request,
            output,
            source_engine_id=static.engine_id,
            backend=static.backend,
            model=static.model,
            target=target,
            kv_bytes_per_token=self._kv_bytes_per_token,
            vocab_size=self._vocab_size,
            cut_timestamp_s=cut_s,
        )

    def migrate_in(self, ticket: MigrationTicket, request_id: RequestId) -> AsyncIterator[BackendEvent]:
        """Check the ticket now (`MigrationRefused`); the request is admitted on the first iteration."""
        static = self._static
        cut = cut_from_ticket(ticket, request_id, backend=static.backend, model=static.model,
                              vocab_size=self._vocab_size)
        if request_id in self._streams:
            raise MigrationRefused(f"request id {request_id!r} is already running")
        request = request_from_ticket(ticket, request_id)
        # Without KV, or resumed where it was cut (in place), nothing is pulled.
        in_place = ticket.source_engine_id == static.engine_id
        transfer_s = 0.0 if cut.recompute or in_place else self.transfer_time_s(ticket.kv_bytes)
        self._engine.check_migrated_request(request, cut, transfer_s)
        return self._serve(request, (cut, transfer_s, ticket.output_token_ids))

    def transfer_time_s(self, kv_bytes: int) -> float:
        """The modelled KV pull: a fixed latency plus the bytes over the configured bandwidth."""
        return self._kv_transfer_latency_s + kv_bytes / self._kv_transfer_bytes_per_s

    def migration_stats(self, request_id: RequestId) -> MigrationStats | None:
        return self._migration_stats.get(request_id)

    def _note_migration(self, stream: _Stream, stats: MigrationStats) -> None:
        """A migrated request produced its first token here: publish how its KV arrived."""
        request_id = stream.request.request_id
        engine_stats = self._engine.migration_stats(request_id)  # None once the request finished
        published = engine_stats or stats
        self._migration_stats[request_id] = published
        if published.transfer_s is not None:  # kv bytes 0 (recomputed) or 0 s (resumed in place): no pull
            self._transfer.observe(published.kv_bytes_transferred, published.transfer_s)
        self._migration_stats.move_to_end(request_id)
        while len(self._migration_stats) > _MIGRATION_STATS_KEPT:
            self._migration_stats.popitem(last=False)
        stream.migration = None

    # -- hidden-state tap --------------------------------------------------------------------------

    def drain_kv_events(self) -> KvDelta:
        return self._engine.drain_kv_events()

    def kv_snapshot(self) -> KvDelta:
        return self._engine.kv_snapshot()

    def hidden_states(self) -> AsyncIterator[HiddenStateBatch]:
        return self._tap.subscribe()

    def output_targets(self) -> dict[RequestId, int]:
        """Read-only, for STAR's oracle predictor (`engine_agent.star.live.OraclePredictor`): the output
        length the engine decided for each decoding request (earlier engines' tokens included), so its exact
        remaining length at g generated tokens is the target minus g. Call on the loop (O(running))."""
        ids, _, generated, remaining = self._engine.decoding_requests()
        return {rid: g + r for rid, g, r in zip(ids, generated, remaining, strict=True)}

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
            self._track_qoe(result)
            due = start + result.duration_s
            self._inflight, self._inflight_due_s = result, due
            tap = self._tap.start(due) if result.record.num_decode_seqs else None
            delay = due - clock.now()
            # Never sleep a negative time; still yield so the servicer runs when the loop is behind.
            await asyncio.sleep(delay if delay > 0 else 0)
            self._account_lag(clock.now() - due)
            busy_until = due if clock.now() - due <= self._lag_tolerance_s else None
            self._deliver(result, due)
            if tap is not None:
                tap.add_done_callback(self._tap.publish)
            if result.duration_s <= 0 and not result.tokens and not result.finished:
                busy_until = None
                await self._idle_wait()

    async def _idle_wait(self) -> None:
        """After an empty step: wait for a loading migrated request to be ready, new work, or 1 ms."""
        ready_s = self._engine.next_ready_s()
        timeout_s = 1e-3 if ready_s is None else ready_s - self._clock.now()
        if timeout_s <= 0:
            await asyncio.sleep(0)
            return
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout_s)

    def _track_qoe(self, result: StepResult) -> None:
        """The step's batch, then its finishes and hand-offs, to the QoE tracker (module docstring)."""
        qoe = self._qoe
        batch = result.batch
        if batch is not None:
            qoe.on_iteration(batch.request_ids, batch.prompt_tokens, batch.current_tokens)
        for request_id, event in result.finished:
            stream = self._streams.get(request_id)
            earlier = len(stream.prior) if stream is not None else 0
            t = event.timings
            qoe.on_finish(request_id, t.queue_s + t.prefill_s + t.decode_s,
                          event.usage.completion_tokens - earlier)
        for cut in result.handoffs:
            qoe.on_drop(cut.request_id)

    def _account_lag(self, lag_s: float) -> None:
        lag_s = max(lag_s, 0.0)
        self._lag_steps += 1
        self._lag_sum_s += lag_s
        if lag_s > self._lag_max_s:
            self._lag_max_s = lag_s
        if lag_s > self._lag_tolerance_s:
            self._lag_late += 1
            self._slipped_s += lag_s

    def _deliver(self, result: StepResult, due_s: float) -> None:
        self._inflight = None
        streams = self._streams
        touched: list[_Stream] = []
        for request_id, token_id in result.tokens:
            stream = streams.get(request_id)
            if stream is not None and stream.end is None:
                tokens = stream.tokens
                if len(tokens) == stream.read:
                    touched.append(stream)
                tokens.append(token_id)
                stream.last_token_s = due_s
        for request_id, event in result.finished:
            stream = streams.get(request_id)
            if stream is not None and stream.end is None:
                stream.end = event
                touched.append(stream)
        for cut in result.handoffs:  # the prefill role: the stream ends with the cut after its first token
            stream = streams.get(cut.request_id)
            if stream is not None and stream.end is None:
                stream.end = MigratedEvent(self._ticket(cut, stream, stream.prior + tuple(stream.tokens), "",
                                                        due_s))
                touched.append(stream)
        if self._deferred:
            deferred, self._deferred = self._deferred, {}
            for request_id, migrated in deferred.items():
                stream = streams.get(request_id)
                if stream is not None and stream.end is None:
                    stream.end = migrated
                    touched.append(stream)
        for stream in touched:
            if stream.migration is not None and stream.tokens:
                self._note_migration(stream, stream.migration)
            stream.wake()
        self._changes.publish()

    def _end_stream(self, request_id: RequestId, event: FinishEvent | MigratedEvent) -> None:
        stream = self._streams.get(request_id)
        if stream is not None and stream.end is None:
            stream.end = event
            stream.wake()


def _aborted() -> FinishEvent:
    return FinishEvent(
        finish_reason="abort", usage=Usage(prompt_tokens=0, completion_tokens=0), timings=Timings()
    )
