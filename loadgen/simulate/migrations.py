"""STAR's migrations in virtual time: the rescheduler's tick, the mover's cut and the splice's follow.

Owns: `Migrations`, the executor of rescheduling for one simulation: per gateway worker (decider) a mover's
limits (`gateway.dispatch.mover.MoveLimits`, the live mover's bookkeeping, at virtual times) and its
`MoveStats`; `tick` (the live `RescheduleLoop.once` and `Mover.migrate`), the pending follows, `follow` (the
live dispatcher's `_follow`), and the splice stalls, measured when the request finishes.
Must not: decide which request moves where (`gateway.rescheduling.star.propose` does), where a migrated
request resumes or what its life records (`gateway.dispatch.life.ChoiceLife` does), model engines
(`SimEngine` cuts and admits), or order events (the runner calls `tick` and `follow` at their sync points,
every engine advanced to that time and the reports received first).

Semantics (each step is the live code's, or mirrors it where the live step is I/O):
- Tick, every `SimOptions.reschedule_interval_s`, per worker: its snapshot; per model (sorted), `propose` with
  `SimOptions.star_params()`, excluding the requests and engines the worker's limits hold; a proposal goes to
  the mover. The wall-clock time of each `propose` call is kept (the injected wall clock: the one figure that
  differs between runs of one seed).
- Mover (live `Mover.migrate`): the source is the engine the worker's ledger has the request on (none: not
  started, 404); `check_target` and the limits (409: not started); then the cut, `SimEngine.migrate_out` at
  the tick's time t. A refusal (the request finished, is in prefill, preempted, or loading) counts
  "refused"; both engines cool down either way, as live. The sim's cut is instantaneous.
- The stream's end: the source's iteration in flight was computed at its start, so it may hold a token of the
  cut request; the stream delivers it at the iteration's end d and only then ends with `Migrated` (the sim
  backend does the same), else the stream ends at t. The ticket's `output_tokens` are every token the stream
  delivered (checked against the cut's count: a mismatch is a bug and raises); its `target` is the proposal's.
- Follow, when the stream ends (a sync point of its own): the tokens delivered so far reach the life
  (`on_token`), then `on_migrated(ticket)`, `on_closed` (the source's dispatch released on the worker's
  ledger), `follow(policy, moment)` (the worker's policy and `Moment`); its `Dispatch` is recorded
  (`record_dispatch`) and the engine it names admits the cut (`add_migrated_request`), the KV pull taking
  `kv_transfer_latency_s` + kv_bytes x 8 / (kv_link_gbps x 1e9) once the target has the blocks; the admission
  stands for the resumed stream's first event (`record_outcome(on_first_event)`). A target that refuses is a
  failure before the first event ("connect_failures", as the gateway's gRPC client reads an agent's
  FAILED_PRECONDITION) and the life's next candidate is tried; none left: the request fails with the life's
  message. Outcomes are counted as the gateway's `switchyard_migrations_total{outcome}`: cut, refused,
  resumed (on the named target), fallback (another engine), failed.
- Splice stall: from the `Migrated` event to the request's first token on the resuming engine (the gap the
  client sees, the live `switchyard_migration_splice_stall_seconds`).
- Hand-offs (CAUCHY's disaggregation): a prefill engine cuts a request in the iteration that samples its first
  token (`SimEngine`'s `handoff`); `hand_off` queues its follow at that iteration's end, with no mover and no
  limits (the live agent cuts it itself), and the follow runs as above; a resumption the life marks as a
  hand-off counts "handoff" (the live outcome label of the same name).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine_agent.domain import BackendRequest, MigrationRefused, RequestId
from engine_agent.sim.migration import MigrationCut
from gateway.dispatch.life import ChoiceLife, StreamFailed, record_dispatch, record_outcome
from gateway.dispatch.mover import MoveError, MoveLimits, Rescheduler, check_target, move_params_for
from gateway.domain import EngineId, MigrationTicket
from gateway.rescheduling.length_stages import LengthStages
from gateway.rescheduling.star import StarRescheduler
from loadgen.simulate.balance import percentiles_ms
from loadgen.simulate.deciders import Decider
from loadgen.simulate.fleet import SimNode
from loadgen.simulate.spec import SimOptions
from switchyard.clock import Clock

MIGRATION_OUTCOMES = ("cut", "refused", "resumed", "fallback", "handoff", "failed")
BITS_PER_BYTE = 8


@dataclass
class MoveStats:
    """One worker's rescheduling figures (`row` is their JSON form, a `per_decider` row's `reschedule`)."""

    propose_calls: int = 0
    proposals: int = 0  # calls that returned a migration
    outcomes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MIGRATION_OUTCOMES, 0))
    not_started: dict[str, int] = field(default_factory=dict)  # the mover's MoveError status -> count
    kv_bytes_moved: int = 0  # KV of the cuts resumed (on the named target or elsewhere)
    moves: dict[str, int] = field(default_factory=dict)  # request -> cuts
    splice_stall_s: list[float] = field(default_factory=list)
    propose_s: list[float] = field(default_factory=list)  # wall-clock seconds per propose call
    handoff_kv_bytes: int = 0  # KV of the prefill engines' hand-offs resumed (not in `kv_bytes_moved`)
    handoff_stall_s: list[float] = field(default_factory=list)  # hand-offs' splice stalls (not in the above)
    reasons: dict[str, int] = field(default_factory=dict)  # length_stages: moves started by reason
    layout: dict[str, Any] = field(default_factory=dict)  # length_stages: its last layout, per model

    def row(self) -> dict[str, Any]:
        return {
            "propose_calls": self.propose_calls,
            "proposals": self.proposals,
            "migrations": dict(self.outcomes),
            "not_started": dict(sorted(self.not_started.items())),
            "kv_bytes_moved": self.kv_bytes_moved,
            "requests_moved": len(self.moves),
            "max_moves_per_request": max(self.moves.values(), default=0),
            "moves": dict(self.moves),
            "splice_stall_s": list(self.splice_stall_s),
            "propose_s": list(self.propose_s),
            "handoff_kv_bytes": self.handoff_kv_bytes,
            "handoff_stall_s": list(self.handoff_stall_s),
            "reasons": dict(self.reasons),
            "layout": self.layout,
        }


@dataclass(frozen=True, slots=True)
class _Pending:
    """A cut whose stream has not ended yet (queued by when it ends)."""

    request_id: str
    ticket: MigrationTicket
    cut: MigrationCut
    source: EngineId
    decider: int


class Migrations:
    """Rescheduling in one simulation (see the module docstring). The runner owns the shared tables it is
    given: requests in flight (`info`: schedule index, life, decider), their token times (`times_of`) and
    their engine requests (`requests`)."""

    def __init__(  # noqa: PLR0913 (the runner's shared tables)
        self,
        options: SimOptions,
        deciders: Sequence[Decider],
        nodes: Mapping[EngineId, SimNode],
        info: Mapping[str, tuple[int, ChoiceLife, Decider]],
        times_of: Mapping[str, list[float]],
        requests: Mapping[str, BackendRequest],
        *,
        start_step: Callable[[SimNode, float], None],
        left: Callable[[SimNode, str, float], None],
        abandon: Callable[[str, float, str], None],
        wall_clock: Clock,
    ) -> None:
        self._reschedulers = [_rescheduler(options, decider.index) for decider in deciders]
        self._link_bytes_per_s = options.kv_link_gbps * 1e9 / BITS_PER_BYTE
        self._latency_s = options.kv_transfer_latency_s
        self._deciders = deciders
        self._limits = [MoveLimits(move_params_for(r, options.move_params)) for r in self._reschedulers]
        self.stats = [MoveStats() for _ in deciders]
        self._nodes = nodes
        self._info = info
        self._times_of = times_of
        self._requests = requests
        self._start_step = start_step
        self._left = left
        self._abandon = abandon
        self._wall = wall_clock
        self._pending: list[tuple[float, int, _Pending]] = []
        self._order = 0
        # request -> per follow: (the index of its first token on the resuming engine, when the stream ended,
        # whether it was a hand-off)
        self._marks: dict[str, list[tuple[int, float, bool]]] = {}

    @property
    def next_follow_s(self) -> float:
        """When the earliest pending follow is due (inf: none)."""
        return self._pending[0][0] if self._pending else float("inf")

    def transfer_s(self, kv_bytes: int) -> float:
        """The modelled KV pull of `kv_bytes`."""
        return self._latency_s + kv_bytes / self._link_bytes_per_s

    # ---- the tick and the cut ------------------------------------------------------------------------------

    def tick(self, now_s: float) -> None:
        """One rescheduling interval on every worker (the live `RescheduleLoop.once`)."""
        wall = self._wall
        for decider, limits, stats, rescheduler in zip(self._deciders, self._limits, self.stats,
                                                       self._reschedulers, strict=True):
            snapshot = decider.state.snapshot(now_s)
            for model in sorted({e.model for e in snapshot.engines if e.model}):
                started_s = wall.now()
                proposals = rescheduler.propose(snapshot, model, limits.unmovable_requests(now_s),
                                                limits.busy_engines(now_s), now_s)
                stats.propose_s.append(wall.now() - started_s)
                stats.propose_calls += 1
                stats.proposals += bool(proposals)
                for proposal in proposals:
                    try:
                        self._cut(decider, limits, stats, proposal.request_id, proposal.target, now_s)
                    except MoveError as exc:
                        rescheduler.not_started(proposal, exc.status)
                        key = str(exc.status)
                        stats.not_started[key] = stats.not_started.get(key, 0) + 1
                        continue
                    reason = getattr(proposal, "reason", "")
                    if reason:
                        stats.reasons[reason] = stats.reasons.get(reason, 0) + 1
            layouts = rescheduler.layouts()
            if layouts:
                decider.state.publish_stages(layouts)
                stats.layout = {m: [{"lo": s.lo, "hi": s.hi, "engines": list(s.engines),
                                     "bounds": list(s.bounds)} for s in layout.stages]
                                for m, layout in layouts.items()}

    def _cut(self, decider: Decider, limits: MoveLimits, stats: MoveStats, request_id: str, target: EngineId,
             now_s: float) -> None:
        """The live `Mover.migrate` on the worker's ledger and limits; `MoveError` when not started."""
        state = decider.state
        source = state.engine_of(request_id)
        if source is None:
            raise MoveError(404, f"request {request_id!r} is not running on any engine of this gateway")
        check_target(state.snapshot(now_s), request_id, source, target)
        limits.check(request_id, source, target, now_s)
        engines = (source, target)
        limits.begin(request_id, engines)
        node = self._nodes[source]
        node.feed.flush(now_s)  # reports due before the cut carry the state before it
        try:
            cut = node.engine.migrate_out(RequestId(request_id), now_s)
        except MigrationRefused:
            stats.outcomes["refused"] += 1
            return
        finally:
            limits.end(request_id, engines, now_s)
        limits.note_cut(request_id, now_s)
        stats.outcomes["cut"] += 1
        stats.moves[request_id] = stats.moves.get(request_id, 0) + 1
        node.migrations_out += 1
        node.feed.on_change(now_s)
        in_flight = node.result.tokens if node.result is not None else ()
        pending = sum(1 for rid, _ in in_flight if rid == request_id)
        delivered = len(self._times_of[request_id])
        if delivered + pending != cut.num_output:  # the engine and the delivered stream disagree: a bug
            raise RuntimeError(f"request {request_id!r}: {delivered} tokens delivered and {pending} in "
                               f"flight, the engine cut it after {cut.num_output}")
        ticket = MigrationTicket(request_id=request_id, source_engine_id=source, target=target,
                                 output_tokens=cut.num_output, kv_tokens=cut.kv_tokens, kv_bytes=cut.kv_bytes)
        due_s = node.done_s if pending else now_s
        self._order += 1
        item = _Pending(request_id, ticket, cut, source, decider.index)
        heapq.heappush(self._pending, (due_s, self._order, item))

    # ---- the prefill role's hand-off -----------------------------------------------------------------------

    def hand_off(self, node: SimNode, cuts: Sequence[MigrationCut], now_s: float) -> None:
        """A prefill engine cut `cuts` in the iteration delivered at `now_s` (`StepResult.handoffs`), each
        after its first token: their streams end now, with a ticket for any engine (the life's `follow` picks
        a decode engine of the source's combo), as a live prefill agent's stream ends with `Migrated`."""
        for cut in cuts:
            rid = cut.request_id
            delivered = len(self._times_of[rid])
            if delivered != cut.num_output:  # the engine and the delivered stream disagree: a bug
                raise RuntimeError(f"request {rid!r}: {delivered} tokens delivered, the engine handed it off "
                                   f"after {cut.num_output}")
            ticket = MigrationTicket(request_id=rid, source_engine_id=node.engine_id, target="",
                                     output_tokens=cut.num_output, kv_tokens=cut.kv_tokens,
                                     kv_bytes=cut.kv_bytes)
            node.migrations_out += 1
            self._order += 1
            decider = self._info[rid][2]
            heapq.heappush(self._pending, (now_s, self._order,
                                           _Pending(rid, ticket, cut, node.engine_id, decider.index)))

    # ---- the follow ----------------------------------------------------------------------------------------

    def follow(self, now_s: float) -> None:
        """The earliest pending stream end (due at `now_s`): the live dispatcher's `_follow`."""
        _, _, item = heapq.heappop(self._pending)
        rid = item.request_id
        _, life, decider = self._info[rid]
        stats = self.stats[decider.index]
        times = self._times_of[rid]
        source = self._nodes[item.source]
        prompt_tokens = source.in_flight[rid][0]
        self._left(source, rid, now_s)  # the source's stream ended
        fresh = len(times) - life.relayed
        if fresh > 0:
            life.on_token(times[life.relayed], fresh)
        life.on_migrated(item.ticket)
        self._release(life, decider)
        request = self._requests[rid]
        while True:
            step = life.follow(decider.policy, decider.moment(now_s))
            if isinstance(step, StreamFailed):
                stats.outcomes["failed"] += 1
                self._marks.pop(rid, None)
                self._abandon(rid, now_s, step.message)
                return
            if step.skip_tokens:  # the client has exactly the ticket's tokens: nothing to drop
                raise RuntimeError(f"request {rid!r}: a follow would drop {step.skip_tokens} tokens")
            dispatch = step.dispatch
            record_dispatch(decider.state, dispatch)
            node = self._nodes[dispatch.engine_id]
            node.feed.flush(now_s)
            # Resumed where it was cut (in place), its KV never moves.
            transfer_s = 0.0 if dispatch.engine_id == item.source else self.transfer_s(item.cut.kv_bytes)
            try:
                node.engine.add_migrated_request(request, item.cut, now_s, transfer_s)
            except MigrationRefused as exc:  # live: MigrateIn answers FAILED_PRECONDITION before any event
                record_outcome(decider.state, life.failure("connect_failures", now_s))
                life.on_follow_failed(f"engine {dispatch.engine_id} did not resume it: {exc}")
                self._release(life, decider)
                continue
            break
        record_outcome(decider.state, life.on_first_event(now_s))
        stats.outcomes["handoff" if step.handoff else
                       "resumed" if dispatch.engine_id == item.ticket.target else "fallback"] += 1
        if step.handoff:
            stats.handoff_kv_bytes += item.cut.kv_bytes if dispatch.engine_id != item.source else 0
        else:
            stats.kv_bytes_moved += item.cut.kv_bytes
        node.migrations_in += 1
        node.in_flight[rid] = (prompt_tokens, times)
        self._marks.setdefault(rid, []).append((item.ticket.output_tokens, now_s, step.handoff))
        node.feed.on_change(now_s)
        if not node.busy:
            node.busy = True
            self._start_step(node, now_s)

    @staticmethod
    def _release(life: ChoiceLife, decider: Decider) -> None:
        released = life.on_closed()
        if released is not None:
            decider.state.note_finish(released, life.request.request_id)

    def on_finished(self, request_id: str, times: Sequence[float], decider: Decider) -> int:
        """The request finished with token `times`: the splice stall of each of its follows; returns how many
        of them were migrations (a prefill role's hand-off is not one)."""
        marks = self._marks.pop(request_id, None)
        if marks is None:
            return 0
        stats = self.stats[decider.index]
        for index, ended_s, handoff in marks:
            (stats.handoff_stall_s if handoff else stats.splice_stall_s).append(times[index] - ended_s)
        return sum(1 for _, _, handoff in marks if not handoff)

    def handoff_figures(self) -> dict[str, Any]:
        """The prefill engines' hand-offs over every worker: how many resumed, their KV bytes and their splice
        stall's percentiles (ms; a failed follow counts with the migrations' "failed")."""
        return {"handoffs": sum(stats.outcomes["handoff"] for stats in self.stats),
                "kv_bytes": sum(stats.handoff_kv_bytes for stats in self.stats),
                "stall_ms": percentiles_ms([s for stats in self.stats for s in stats.handoff_stall_s])}

    def rows(self) -> list[dict[str, Any]]:
        """Each worker's figures (`MoveStats.row`), in decider order."""
        return [stats.row() for stats in self.stats]


def _rescheduler(options: SimOptions, decider: int) -> Rescheduler:
    """A worker's rescheduler, as the live gateway builds it (`gateway.app._rescheduler`): CascadeInfer's with
    a random stream of its own (seeded by the run's seed and the worker), else STAR's Algorithm 1."""
    if options.reschedule == "length_stages":
        draws = random.Random(f"length_stages:{options.seed}:{decider}")
        return LengthStages(options.stages_params(), plan=options.stages_plan, history=options.stages_history,
                            rand=draws.random)
    return StarRescheduler(options.star_params())
