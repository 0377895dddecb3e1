"""`simulate`: replay a schedule of requests on a simulated fleet in virtual time, routed by a gateway policy.

Owns: the event loop (arrivals, STAR's follows and reschedule ticks, and timeline samples in time order as
sync points, each engine advanced through its iteration completions up to every sync point), executing each
arrival's `ChoiceLife` in virtual time (the gateway's request-life core: a `Moment` per decision, the
`Dispatch` recorded on `ClusterState`, admission on the engine, release and the latency sample at the
finish), on the decider (gateway worker) the arrival is assigned to (`loadgen.simulate.deciders`: that
worker's state records the dispatch, the release and the latency sample; every worker's state receives every
report), the per-request token times that become `loadgen.metrics.Outcome`s, when prediction rounds are
taken and pushed, and the load-balance figures of timeline samples. Migrations themselves are executed by
`loadgen.simulate.migrations` at the sync points this loop gives them.
Must not: model engines (that is `SimEngine`, invariant I2), decide anything of a
request's life (routing, retries, what a finish records: `gateway.dispatch.life` does, as it does live;
invariant I1), or read a clock other than the injected wall clock used only for `SimResult.wall_s` (virtual
time is data, invariant I3). The gateway's admission gate runs here as live (`gateway.admission.core`'s
`ModelQueue.enter` / `pump_fleet`, one per decider; `SimOptions.admission`): an arrival enters it before
routing (a cascade's on its first stage's model, until the client's answer); a queued one starts at the finish
(or failure) that frees its slot, with its own arrival time, for which the fleet advances completion by
completion while anything waits, or fails at its TTFT deadline (`ModelQueue.expire`, a step of its own as the
live gate's timer); a shed one is a failed outcome (live, 503 fleet_saturated).
Not run here: the retry budget (simulated engines never fail before their first event, so no retry is ever
asked for).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from operator import sub
from typing import Any

from engine_agent.domain import BackendRequest, FinishEvent, RequestId, SamplingSpec
from gateway.admission.core import ModelQueue, Ticket
from gateway.admission.core import Shed as GateShed
from gateway.dispatch.features import RoutingHints, estimate_prompt_tokens
from gateway.dispatch.life import (
    ChoiceLife,
    Decision,
    Dispatch,
    GiveUp,
    RecordLatency,
    Shed,
    prefix_lookup,
    record_dispatch,
    record_outcome,
)
from gateway.domain import ChatTurn, EngineRequest, Finished
from gateway.policies.registry import make_policy
from loadgen.datasets.request import Request
from loadgen.metrics import Outcome
from loadgen.simulate.balance import balance_figures, exec_time_variance_ms2
from loadgen.simulate.cascade import CascadeRun
from loadgen.simulate.cascade_replan import CascadeReplanner
from loadgen.simulate.deciders import Decider, DeciderAssigner, build_deciders
from loadgen.simulate.fleet import PromptIds, SimNode, build_fleet, reports_kv_events
from loadgen.simulate.migrations import Migrations, MoveStats
from loadgen.simulate.scaling import FleetChanges, bill, plan_engines, usd_per_hour
from loadgen.simulate.spec import EngineSpec, Scaling, SimOptions, SimResult
from switchyard.clock import Clock, MonotonicClock
from switchyard.roles import PREFILL_ROLE

IDLE_RETRY_S = 1e-3  # an iteration that scheduled nothing is retried this much later, as the sim backend does
MAX_EMPTY_STEPS = 100_000  # empty iterations on one engine before the run is declared stuck
CONNECT_LEAD_S = 1e-3  # engines connect this long (plus the report delay) before the first arrival
# What a draining agent answers a new request with (UNAVAILABLE, `engine_agent.service`).
DRAINING_ERROR = "engine agent is draining; send the request elsewhere"


def engine_request_of(request: Request, model: str, max_tokens: int, ignore_eos: bool,
                      prompt_ids: tuple[int, ...]) -> EngineRequest:
    """The request as the gateway would see it: its text or messages when the trace has them (so the prompt
    estimate is the live one), else `prompt_ids`, the ids its engine admits (`PromptIds.of`)."""
    turns = None
    text = None
    token_ids: tuple[int, ...] | None = prompt_ids
    if request.prompt_token_ids is None:
        if request.messages is not None:
            turns = tuple(ChatTurn(role, content) for role, content in request.messages)
            token_ids = None
        elif request.prompt is not None:
            text = request.prompt
            token_ids = None
    return EngineRequest(request_id=request.request_id, model=model, messages=turns, prompt_text=text,
                         prompt_token_ids=token_ids, max_tokens=max_tokens, ignore_eos=ignore_eos,
                         session_id=request.session_id or "")


def prompt_estimate(request: Request) -> int:
    """The prompt size the live gateway admits `request` with (`estimate_prompt_tokens` of its engine
    request), without drawing its simulated ids: a prompt given as ids is as long as the trace says."""
    if request.prompt_token_ids is None and (request.messages is not None or request.prompt is not None):
        return estimate_prompt_tokens(engine_request_of(request, "", 1, False, ()))
    return len(request.prompt_token_ids) if request.prompt_token_ids is not None else request.prompt_tokens


def _deadline_s(gate: ModelQueue) -> float:
    """The earliest TTFT deadline of a request queued at `gate` (inf: none)."""
    deadline_s = gate.next_deadline_s if gate.queued else None
    return math.inf if deadline_s is None else deadline_s


class _Run:
    """One simulation's mutable state; `simulate` builds it, runs it and throws it away."""

    def __init__(self, schedule: Sequence[tuple[float, Request]], nodes: list[SimNode], options: SimOptions,
                 progress: Callable[[float], None] | None,
                 on_decision: Callable[[Decision], None] | None = None, *,
                 wall_clock: Clock | None = None, scaling: Scaling | None = None,
                 profile_counts: dict[str, int] | None = None) -> None:
        self.schedule = sorted(schedule, key=lambda item: item[0])  # stable: ties keep their order
        ids = [r.request_id for _, r in self.schedule]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids in a simulated schedule must be unique")
        self.nodes = nodes
        self.by_id = {n.engine_id: n for n in nodes}
        self.options = options
        self.progress = progress
        self.on_decision = on_decision
        self.deciders: list[Decider] = build_deciders(
            options.deciders, make_policy, options.policy, options.policy_params, seed=options.seed,
            stale_after_s=options.stale_after_s)
        self.states = tuple(d.state for d in self.deciders)
        self.assign = DeciderAssigner(options.deciders, options.decider_assignment, options.seed)
        self.decisions = [0] * options.deciders  # per decider: routing decisions made
        self.whys: list[dict[str, int]] = [{} for _ in range(options.deciders)]  # per decider: picks by why
        self.dispatched = [0] * options.deciders  # per decider: dispatches the engine accepted
        self.model = nodes[0].model
        self.prompt_ids = PromptIds()
        self.t0 = self.schedule[0][0] if self.schedule else 0.0
        self.outcomes: list[Outcome | None] = [None] * len(self.schedule)
        self.times_of: dict[str, list[float]] = {}  # request id -> its token times, while in flight
        # request id -> (schedule index, its life, the decider that dispatched it)
        self.info: dict[str, tuple[int, ChoiceLife, Decider]] = {}
        self.requests: dict[str, BackendRequest] = {}  # request id -> what its engine admitted (rescheduling)
        self.produced = 0  # output tokens delivered since the last timeline sample
        self.last_event_s = self.t0
        self.timeline: list[dict[str, float]] = []
        self.balance = options.records_balance
        # Prefill engines (CAUCHY's disaggregation) hand requests off; a plan may add some later.
        self.prefill_nodes = [node for node in nodes if node.role == PREFILL_ROLE]
        handoffs = bool(self.prefill_nodes) or scaling is not None
        self.migrations = (
            Migrations(options, self.deciders, self.by_id, self.info, self.times_of, self.requests,
                       start_step=self._start_step, left=self.left, abandon=self._abandon,
                       wall_clock=wall_clock or MonotonicClock())
            if options.reschedule != "none" or handoffs else None)
        last_arrival_s = self.schedule[-1][0] if self.schedule else self.t0
        for node in nodes:
            node.billed_from_s = self.t0
        # The admission gate, one per decider (each gateway worker runs its own), as live; a cascade's
        # requests are admitted once, on its first stage's model, until the client's answer (as the live
        # handler admits them).
        self.gates: list[ModelQueue] | None = (
            [ModelQueue(options.admission) for _ in self.deciders] if options.admission is not None else None)
        self.gate_model = (options.cascade.spec.stages[0].model if options.cascade is not None
                           else self.model)
        self.tickets: dict[str, tuple[int, Ticket]] = {}  # client request id -> (decider, admitted ticket)
        # queued ticket -> (schedule index, request, its decider, arrival s)
        self.waiting: dict[Ticket, tuple[int, Request, Decider, float]] = {}
        self.to_pump: set[int] = set()  # deciders whose gate a ticket left since its last pump (live: leave)
        # per decider: "admitted", "queued" (let go later) or "shed_<reason>"
        self.admission: list[Counter[str]] = [Counter() for _ in range(options.deciders)]
        self.cascade = (CascadeRun(options.cascade, seed=options.seed, dispatch=self._dispatch,
                                   finalize=self._finalize, t0=self.t0)
                        if options.cascade is not None else None)
        counts = profile_counts if profile_counts is not None else {}
        self.fleet: FleetChanges | CascadeReplanner | None = None
        if scaling is not None:
            self.fleet = FleetChanges(scaling, options, nodes, self.t0, last_arrival_s, join=self._join,
                                      leave=self._leave, counts=counts)
        elif self.cascade is not None and self.cascade.sim.replan is not None:
            self.fleet = CascadeReplanner(self.cascade.sim.replan, self.cascade, options, nodes, self.t0,
                                          last_arrival_s, join=self._join, leave=self._leave, counts=counts,
                                          timer=(wall_clock or MonotonicClock()).now)

    # ---- setup and the loop ----------------------------------------------------------------------------

    def connect(self) -> None:
        connect_s = self.t0 - self.options.report_delay_s - CONNECT_LEAD_S
        for node in self.nodes:
            self._connect(node, connect_s)

    def _connect(self, node: SimNode, now_s: float) -> None:
        for state in self.states:  # every worker opens its own watch stream
            state.add_engine(node.engine_id, now_s)
            state.on_describe(node.engine_id, node.feed.identity)
            state.on_connect(node.engine_id)
        node.feed.connect(now_s)
        node.joined = True

    def _join(self, node: SimNode, now_s: float) -> None:
        """A provisioned engine joins the fleet at `now_s` (CAUCHY's scale-out)."""
        self._sync(now_s)
        self.nodes.append(node)
        self.by_id[node.engine_id] = node
        if node.role == PREFILL_ROLE:
            self.prefill_nodes.append(node)
        self._connect(node, now_s)

    def _leave(self, node: SimNode, now_s: float) -> None:
        """A drained engine with nothing in flight leaves at `now_s`: its bill stops."""
        node.left_s = now_s
        for state in self.states:
            state.remove_engine(node.engine_id)
        if self.fleet is not None:
            self.fleet.on_left(node, now_s)

    def run(self) -> None:
        """Sync points in time order: arrivals, follows of migrated requests, reschedule ticks and timeline
        samples (at equal times in that order). Before each, every engine is advanced through the iterations
        completing by then: engines do not interact between sync points, so this is the order a global event
        heap would give. Ticks run every `reschedule_interval_s` from the first arrival while anything is
        left to do."""
        schedule, nodes = self.schedule, self.nodes
        n = len(schedule)
        period_s = self.options.record_timeline_s
        samples = 1
        next_sample_s = self.t0 + period_s
        i = 0
        advance_all = self._advance_all
        migrations = self.migrations
        inf = math.inf
        tick_s = self.options.reschedule_interval_s
        ticks = 1
        next_tick_s = self.t0 + tick_s if self.options.reschedule != "none" else inf
        fleet = self.fleet
        cascade = self.cascade
        while i < n or any(node.busy for node in nodes) or (
                migrations is not None and migrations.next_follow_s < inf) or (
                fleet is not None and fleet.next_s <= fleet.horizon_s) or (
                cascade is not None and cascade.next_s < inf):
            arrival_s = schedule[i][0] if i < n else inf
            follow_s = migrations.next_follow_s if migrations is not None else inf
            fleet_s = fleet.next_s if fleet is not None else inf
            verdict_s = cascade.next_s if cascade is not None else inf
            now_s = min(arrival_s, follow_s, next_tick_s, fleet_s, verdict_s)
            if now_s <= next_sample_s:
                if verdict_s == now_s and arrival_s > now_s:
                    assert cascade is not None
                    self._sync(now_s)  # the verdict escalates (a new dispatch) or releases a held answer
                    cascade.run_due(now_s)
                    continue
                if arrival_s == now_s:
                    if fleet is not None:
                        fleet.run_due(now_s)
                        fleet.on_arrival(now_s)
                    self._on_arrival(i, arrival_s, schedule[i][1])
                    i += 1
                    continue
                if fleet_s == now_s:
                    assert fleet is not None
                    self._sync(now_s)
                    fleet.run_due(now_s)
                    continue
                assert migrations is not None
                self._sync(now_s)
                if follow_s == now_s:
                    # With prefill engines the sync has already followed what was due (`_advance_all`).
                    while migrations.next_follow_s <= now_s:
                        migrations.follow(now_s)
                else:
                    migrations.tick(now_s)
                    ticks += 1
                    next_tick_s = self.t0 + ticks * tick_s
            else:
                advance_all(next_sample_s)
                self._sample(next_sample_s, period_s, i / n)
                samples += 1
                next_sample_s = self.t0 + samples * period_s
        if self.progress is not None:
            self.progress(1.0)

    # ---- events ------------------------------------------------------------------------------------------

    def _sync(self, now_s: float) -> None:
        """Bring every engine to `now_s`, then hand over what the gateway has received by then (and admit what
        the admission gates' queues may let go)."""
        self._advance_all(now_s)
        self._receive(now_s)
        self._pump(now_s)

    def _receive(self, now_s: float) -> None:
        states = self.states
        for node in self.nodes:
            if node.left_s is not None:
                continue
            got = node.feed.receive(now_s)
            if got is not None:
                for receiver in states:  # every worker receives every report
                    receiver.on_report(node.engine_id, got[0], got[1])

    def _advance_all(self, until_s: float) -> None:
        """Every engine through its iterations completing by `until_s`. A prefill engine's iteration that
        hands requests off is a sync point of its own (the follow picks a decode engine and that engine
        admits the request at the hand-off's time), so with prefill engines the fleet advances from one
        prefill completion (or pending follow) to the next, following the hand-offs due at each, before the
        rest of the way. With a cascade the fleet advances from one iteration completion (or cascade event:
        a pool judge request to send, a verdict) to the next, running the cascade's events due at each, so
        the dispatch one makes finds every engine at that moment."""
        nodes, advance = self.nodes, self._advance
        prefill = self.prefill_nodes
        if prefill:
            migrations = self.migrations
            assert migrations is not None
            while True:
                at_s = min(min(node.done_s for node in prefill), migrations.next_follow_s)
                if at_s > until_s:
                    break
                for node in nodes:
                    if node.done_s <= at_s:
                        advance(node, at_s)
                if migrations.next_follow_s <= at_s:
                    self._receive(at_s)
                    while migrations.next_follow_s <= at_s:
                        migrations.follow(at_s)
                self._pump_left(at_s)
        cascade = self.cascade
        if cascade is not None:
            while (at_s := min(cascade.next_s, min(node.done_s for node in nodes))) <= until_s:
                for node in nodes:
                    if node.done_s <= at_s:
                        advance(node, at_s)
                if cascade.next_s <= at_s:
                    self._receive(at_s)
                    cascade.run_due(at_s)
                self._pump_left(at_s)
        if self.gates is not None and self.waiting:
            # Requests wait in a gateway queue: the fleet advances from one iteration completion (or queued
            # request's TTFT deadline, the live gate's timer) to the next, and the queue lets requests go at
            # the finish that frees their slots, as the live gate does.
            while self.waiting and (at_s := min(min(node.done_s for node in nodes),
                                                self._next_deadline_s())) <= until_s:
                for node in nodes:
                    if node.done_s <= at_s:
                        advance(node, at_s)
                self._pump_left(at_s)
        for node in nodes:
            if node.done_s <= until_s:
                advance(node, until_s)

    def _pump_left(self, at_s: float) -> None:
        """With every engine at `at_s`, while requests wait: the gates that tickets left since their last
        pump, and those with a queued request's TTFT deadline due (live: its timer), pump on what the gateway
        has received by then."""
        if not self.waiting:
            return
        assert self.gates is not None
        self.to_pump.update(i for i, gate in enumerate(self.gates) if _deadline_s(gate) <= at_s)
        if self.to_pump:
            self._receive(at_s)
            self._pump(at_s)

    def _next_deadline_s(self) -> float:
        """The earliest TTFT deadline of a request queued at any gate (inf: none)."""
        assert self.gates is not None
        return min(map(_deadline_s, self.gates))

    def _on_arrival(self, index: int, now_s: float, request: Request) -> None:
        self._sync(now_s)
        if self.gates is None:
            self._start(index, now_s, request, None)
            return
        decider = self.deciders[self.assign(request.session_id or "")]
        if self._enter(index, now_s, request, decider):
            self._start(index, now_s, request, decider)
        self._pump(now_s)  # when it failed at once (live: its `leave` pumps)

    def _start(self, index: int, now_s: float, request: Request, decider: Decider | None,
               arrival_s: float | None = None) -> None:
        """The admitted client request's life begins: its cascade, or its one dispatch."""
        if self.cascade is not None:
            self.cascade.arrive(index, now_s, request, arrival_s=arrival_s)
        else:
            self._dispatch(index, now_s, request, self.model, decider, arrival_s=arrival_s)

    # ---- the admission gate (gateway.admission.core, as `AdmissionGate` runs it live) ---------------------

    def _enter(self, index: int, now_s: float, request: Request, decider: Decider) -> bool:
        """The live gate's `enter` for an arrival on `decider`: True when admitted now; else the request
        waits in the queue (`_pump` dispatches it) or was shed (a failed outcome: live, a 503
        fleet_saturated). Its priority is 0 (traces carry none) and its prompt the gateway's estimate."""
        assert self.gates is not None
        gate = self.gates[decider.index]
        self._pump_gate(decider, gate, now_s)  # live: the fleet may have grown since the last leave
        ticket = Ticket(priority=0, arrival_s=now_s)
        arrival = gate.enter(ticket, now_s, decider.state.snapshot(now_s), self.gate_model,
                             prompt_estimate(request), self.options.slo_ttft_s)
        self.admission[decider.index][
            arrival.outcome if arrival.shed is None else f"shed_{arrival.shed.reason}"] += 1
        if arrival.preempted is not None:
            self._shed_queued(decider, arrival.preempted, now_s)
        if arrival.outcome == "admitted":
            self.tickets[request.request_id] = (decider.index, ticket)
            return True
        if arrival.shed is not None:
            self._fail(index, now_s, request, self._saturated(arrival.shed.reason), None)
            return False
        self.waiting[ticket] = (index, request, decider, now_s)
        return False

    def _saturated(self, reason: str) -> str:
        return f"fleet saturated for model {self.gate_model!r} ({reason})"  # live: 503 fleet_saturated

    def _shed_queued(self, decider: Decider, shed: GateShed, now_s: float) -> None:
        """A queued request refused (preempted, or its deadline passed): a failed outcome (live, its waiter's
        503 fleet_saturated)."""
        self.admission[decider.index][f"shed_{shed.reason}"] += 1
        index, request, _, arrival_s = self.waiting.pop(shed.ticket)
        self._fail(index, now_s, request, self._saturated(shed.reason), None, arrival_s=arrival_s)

    def _pump(self, now_s: float) -> None:
        """The gates tickets left (lowest decider first, until none is left to pump) let go what their slots
        now allow: live, each worker's `leave` pumps its own gate."""
        gates = self.gates
        while self.to_pump:
            assert gates is not None
            i = min(self.to_pump)
            self.to_pump.discard(i)
            self._pump_gate(self.deciders[i], gates[i], now_s)

    def _pump_gate(self, decider: Decider, gate: ModelQueue, now_s: float) -> None:
        """As the live gate's pump: the queued requests whose TTFT deadline has passed fail (live, a 503
        fleet_saturated), then what the slots let go is dispatched."""
        if not gate.queued:
            return
        for shed in gate.expire(now_s):
            self._shed_queued(decider, shed, now_s)
        for ticket in gate.pump_fleet(decider.state.snapshot(now_s), self.gate_model, now_s):
            index, request, _, arrival_s = self.waiting.pop(ticket)
            self.tickets[request.request_id] = (decider.index, ticket)
            self._start(index, now_s, request, decider, arrival_s)

    def _leave_gate(self, rid: str, now_s: float) -> None:
        """The request's life ended (however): its ticket leaves the gate (live: the handler's `finally`)."""
        held = self.tickets.pop(rid, None)
        if held is not None:
            assert self.gates is not None
            self.gates[held[0]].leave(held[1], now_s)
            self.to_pump.add(held[0])

    # ---- dispatch ----------------------------------------------------------------------------------------

    def _dispatch(self, index: int, now_s: float, request: Request, model: str,
                  decider: Decider | None = None, *, arrival_s: float | None = None) -> None:
        """Route `request` (for `model`) through its `ChoiceLife` and admit it on the chosen engine (by
        `decider`, else the one the arrival reaches; `arrival_s`: when it arrived, if it waited in the
        gateway's queue until `now_s`)."""
        session_id = request.session_id or ""
        if decider is None:
            decider = self.deciders[self.assign(session_id)]
        arrived_s = now_s if arrival_s is None else arrival_s
        state = decider.state
        session_engine, session_last_used_s = (
            state.session_lookup(session_id, now_s) if session_id else (None, 0.0))
        forced_tokens = request.output_tokens or 0
        forced = forced_tokens > 0
        max_tokens = forced_tokens if forced else self.options.max_output_tokens_default
        prompt_ids = self.prompt_ids.of(request)
        engine_request = engine_request_of(request, model, max_tokens, forced, prompt_ids)
        options = self.options
        hints = RoutingHints(arrival_s=arrived_s, session_id=session_id, slo_ttft_s=options.slo_ttft_s,
                             slo_tpot_s=options.slo_tpot_s)
        prefix_keys, prefix_hits = prefix_lookup(
            engine_request, decider.policy, lambda keys, source: state.prefix_match(keys, source, now_s))
        life = ChoiceLife(engine_request, hints, session_engine=session_engine,
                          session_last_used_s=session_last_used_s, prefix_keys=prefix_keys,
                          prefix_hits=prefix_hits)
        while True:
            decision = life.route(decider.policy, decider.moment(now_s))
            self.decisions[decider.index] += 1
            if isinstance(decision, Dispatch | Shed) and decision.why:
                whys = self.whys[decider.index]
                whys[decision.why] = whys.get(decision.why, 0) + 1
            if self.on_decision is not None:
                self.on_decision(decision)
            if isinstance(decision, GiveUp | Shed):  # live: 503 no engine / 503 fleet_saturated
                self._fail(index, now_s, request, decision.message, None, arrival_s=arrived_s)
                return
            record_dispatch(state, decision)
            node = self.by_id[decision.engine_id]
            if node.feed.drain_s > now_s:
                break
            # Live: a draining agent refuses new requests (UNAVAILABLE) and the dispatcher retries elsewhere
            # (the gateway routed it before the draining report arrived).
            record_outcome(state, life.failure("connect_failures", now_s))
            after = life.on_unavailable(DRAINING_ERROR, now_s, decider.rng.random())
            self._release(life, decider)
            if isinstance(after, GiveUp):
                self._fail(index, now_s, request, after.message, node.engine_id, arrival_s=arrived_s)
                return
            # Simulated lives carry no retry budget, so a retry has no backoff: route again at once.
        rid = request.request_id
        features = decision.features
        backend_request = BackendRequest(
            request_id=RequestId(rid), prompt_token_ids=prompt_ids,
            sampling=SamplingSpec(max_tokens=max_tokens, ignore_eos=forced), session_id=session_id,
            slo_ttft_s=features.slo_ttft_s, slo_tpot_s=features.slo_tpot_s)
        node.feed.flush(now_s)
        try:
            node.engine.add_request(backend_request, now_s)
        except ValueError as exc:  # live: the agent refuses it (INVALID_ARGUMENT), the gateway answers 400
            self._release(life, decider)
            self._fail(index, now_s, request, str(exc), node.engine_id, arrival_s=arrived_s)
            return
        # Live: the agent's `admitted` event; no retry after it, and a success for outlier detection.
        record_outcome(state, life.on_first_event(now_s))
        node.requests += 1
        self.dispatched[decider.index] += 1
        times: list[float] = []
        self.times_of[rid] = times
        self.info[rid] = (index, life, decider)
        node.in_flight[rid] = (request.prompt_tokens, times)
        if self.migrations is not None:
            self.requests[rid] = backend_request
        node.feed.on_change(now_s)
        if not node.busy:
            node.busy = True
            self._start_step(node, now_s)

    def _release(self, life: ChoiceLife, decider: Decider) -> None:
        """Close the life's open attempt and release its dispatch on the ledger of the worker that made it, as
        the live dispatcher's `finally` does."""
        released = life.on_closed()
        if released is not None:
            decider.state.note_finish(released, life.request.request_id)

    def _start_step(self, node: SimNode, now_s: float) -> None:
        """Run the engine's next iteration at `now_s` (an idle engine woken by an admission)."""
        node.feed.flush(now_s)  # reports due before this iteration carry the state before it
        result = node.engine.step(now_s)
        node.result = result
        duration_s = result.duration_s
        node.busy_s += duration_s
        if duration_s <= 0:
            duration_s = self._empty_step(node, now_s)
        node.done_s = now_s + duration_s

    def _empty_step(self, node: SimNode, now_s: float) -> float:
        """How long until an engine whose iteration scheduled nothing tries again: until its earliest loading
        migrated request is ready (the sim backend's idle wait), else `IDLE_RETRY_S`."""
        node.empty_steps += 1
        if node.empty_steps > MAX_EMPTY_STEPS:
            raise RuntimeError(f"engine {node.engine_id} scheduled nothing {MAX_EMPTY_STEPS} times")
        ready_s = node.engine.next_ready_s() if self.migrations is not None else None
        return ready_s - now_s if ready_s is not None and ready_s > now_s else IDLE_RETRY_S

    def _advance(self, node: SimNode, until_s: float) -> None:
        """Deliver every iteration of `node` completing at or before `until_s`, starting the next one at each
        completion while the engine has work (the hot loop: one pass per iteration, no allocation of ours)."""
        engine, feed, rounds = node.engine, node.feed, node.rounds
        may_matter = feed.gate.iteration_may_matter
        times_of = self.times_of
        result = node.result
        done_s = node.done_s
        produced = 0
        busy_s = 0.0
        min_free = node.min_free_blocks
        while done_s <= until_s:
            assert result is not None
            tokens = result.tokens
            if tokens:
                for rid, _ in tokens:
                    times_of[rid].append(done_s)
                produced += len(tokens)
            finished = result.finished
            if finished:
                for rid, event in finished:
                    self._finish(node, rid, event, done_s)
            if result.handoffs:
                assert self.migrations is not None
                self.migrations.hand_off(node, result.handoffs, done_s)
            record = result.record
            if record.kv_blocks_free_after < min_free:
                min_free = record.kv_blocks_free_after
            if may_matter(record, bool(finished)):
                feed.on_change(done_s)
            if rounds is not None and rounds.step(record.num_decode_seqs > 0):
                feed.push_round(done_s, rounds.take())  # the tap's moment: before the next iteration
            if not engine.has_work():
                node.busy = False
                result = None
                if node.leave_after_s <= done_s and not node.in_flight and node.left_s is None:
                    self._leave(node, done_s)  # drained, and its grace is over
                done_s = math.inf
                break
            if done_s >= feed.next_due_s:
                feed.flush(done_s)
            result = engine.step(done_s)
            duration_s = result.duration_s
            busy_s += duration_s
            if duration_s <= 0:
                duration_s = self._empty_step(node, done_s)
            done_s += duration_s
        node.min_free_blocks = min_free
        node.result = result
        node.done_s = done_s
        node.output_tokens += produced
        node.busy_s += busy_s
        self.produced += produced

    # ---- outcomes and samples ----------------------------------------------------------------------------

    def _finish(self, node: SimNode, rid: str, event: FinishEvent, now_s: float) -> None:
        times = self.times_of.pop(rid)
        index, life, decider = self.info.pop(rid)
        self.left(node, rid, now_s)
        if self.gates is not None:
            self._leave_gate(rid, now_s)
        arrival_s = life.hints.arrival_s
        fresh = len(times) - life.relayed
        if fresh > 0:
            life.on_token(times[life.relayed], fresh)
        migrations = None
        if self.migrations is not None:
            self.requests.pop(rid, None)
            migrations = self.migrations.on_finished(rid, times, decider)
        outcome = life.on_finished(
            Finished(event.finish_reason, event.usage.prompt_tokens, event.usage.completion_tokens,
                     error_message=event.error_message), now_s)
        self._release(life, decider)
        if isinstance(outcome, RecordLatency):
            decider.state.note_latency(outcome.engine_id, outcome.ttft_s, outcome.e2e_s, outcome.now_s)
        self.last_event_s = max(self.last_event_s, now_s)
        usage = event.usage
        if self.cascade is not None and self.cascade.owns(rid):
            self.cascade.on_stage_finished(rid, times, usage.prompt_tokens, usage.completion_tokens,
                                           node.engine_id, now_s)
            return
        self.outcomes[index] = Outcome(
            request_id=rid, success=True, prompt_tokens=usage.prompt_tokens,
            output_tokens=usage.completion_tokens, arrival_s=arrival_s - self.t0, start_s=arrival_s - self.t0,
            ttft_s=times[0] - arrival_s, itl_s=tuple(map(sub, times[1:], times)), e2e_s=now_s - arrival_s,
            engine_id=node.engine_id, migrations=migrations if migrations is not None else 0,
            cached_tokens=usage.cached_tokens)

    @staticmethod
    def left(node: SimNode, rid: str, now_s: float) -> None:
        """`rid` is no longer in flight on `node` (finished, or its stream ended with a migration); the last
        one to leave after a STAR round that listed some is followed by an empty round at once."""
        del node.in_flight[rid]
        rounds = node.rounds
        if rounds is not None and not node.in_flight and rounds.listed:
            node.feed.push_round(now_s, rounds.empty())

    def _abandon(self, rid: str, now_s: float, error: str) -> None:
        """A request in flight that cannot go on (a migration no engine could resume): a failed outcome."""
        self.times_of.pop(rid)
        self.requests.pop(rid, None)
        index, life, _ = self.info.pop(rid)
        if self.gates is not None:
            self._leave_gate(rid, now_s)
        arrival_s = life.hints.arrival_s
        self.last_event_s = max(self.last_event_s, now_s)
        self.outcomes[index] = Outcome(
            request_id=rid, success=False, prompt_tokens=self.schedule[index][1].prompt_tokens,
            arrival_s=arrival_s - self.t0, start_s=arrival_s - self.t0, error=error)

    def _fail(self, index: int, now_s: float, request: Request, error: str, engine_id: str | None, *,
              arrival_s: float | None = None) -> None:
        """A failed outcome at `now_s` of the request that arrived at `arrival_s` (default: now)."""
        self.last_event_s = max(self.last_event_s, now_s)
        if self.cascade is not None and self.cascade.owns(request.request_id):
            self.cascade.on_stage_failed(request.request_id, error, now_s)
            return
        if self.gates is not None:
            self._leave_gate(request.request_id, now_s)
        arrived_s = (now_s if arrival_s is None else arrival_s) - self.t0
        self.outcomes[index] = Outcome(
            request_id=request.request_id, success=False, prompt_tokens=request.prompt_tokens,
            arrival_s=arrived_s, start_s=arrived_s, error=error, engine_id=engine_id)

    def _finalize(self, index: int, outcome: Outcome, now_s: float) -> None:
        """A cascade request's client-facing outcome at `now_s` (its answering stage is known)."""
        if self.gates is not None:
            self._leave_gate(outcome.request_id, now_s)
        self.last_event_s = max(self.last_event_s, now_s)
        self.outcomes[index] = outcome

    def _sample(self, at_s: float, period_s: float, fraction_done: float) -> None:
        running = waiting = 0
        iteration_s: list[float] = []
        kv_used = 0.0
        for node in self.nodes:
            if node.busy:
                stats = node.engine.stats(at_s)
                running += stats.num_running
                waiting += stats.num_waiting
                if self.balance:
                    iteration_s.append(stats.last_iteration_s)
                    kv_used = max(kv_used, 1.0 - stats.kv_blocks_free / stats.kv_blocks_total)
            elif self.balance:
                iteration_s.append(0.0)
        row = {"t_s": at_s - self.t0, "in_flight": len(self.info), "running": running, "waiting": waiting,
               "throughput_tokens_per_s": self.produced / period_s}
        billed = self.fleet.billed if self.fleet is not None else self.nodes
        row.update(engines=sum(1 for n in billed if n.billed_from_s <= at_s and n.left_s is None),
                   usd_per_h=usd_per_hour(billed, at_s))
        if self.balance:
            row.update(exec_time_var_ms2=exec_time_variance_ms2(iteration_s), max_kv_used_ratio=kv_used)
        self.timeline.append(row)
        self.produced = 0
        if self.progress is not None:
            self.progress(fraction_done)


def simulate(
    schedule: Sequence[tuple[float, Request]],
    engines: Sequence[EngineSpec],
    options: SimOptions,
    *,
    progress: Callable[[float], None] | None = None,
    wall_clock: Clock | None = None,
    on_decision: Callable[[Decision], None] | None = None,
    scaling: Scaling | None = None,
) -> SimResult:
    """Replay `schedule` ((arrival s, request) pairs, as `loadgen.arrivals.schedule` gives) on `engines`.

    `progress` is called with the fraction of arrivals dispatched so far at every timeline sample, and with
    1.0 at the end. `wall_clock` (default: monotonic) only measures `SimResult.wall_s`. `on_decision` sees
    every routing decision (the live dispatcher's hook of the same name). `scaling`: the fleet is the plan's
    (`engines` must be empty) and changes as `Scaling` says. Semantics: see the `loadgen.simulate` package
    docstring.
    """
    clock = wall_clock or MonotonicClock()
    started_s = clock.now()
    counts: dict[str, int] = {}
    if scaling is not None:
        if engines:
            raise ValueError("give engines or a plan (scaling), not both")
        if options.reschedule != "none":
            raise ValueError("a changing fleet (scaling) and STAR rescheduling cannot be simulated together")
        if options.cascade is not None and options.cascade.replan is not None:
            raise ValueError("a CAUCHY plan (scaling) and a re-planning cascade cannot be simulated together")
        engines = plan_engines(scaling)
    if options.kv_events is None:  # decided once per run, not once per engine (it builds the policy)
        options = replace(options, kv_events=reports_kv_events(options))
    nodes = build_fleet(engines, options, counts)
    run = _Run(schedule, nodes, options, progress, on_decision, wall_clock=clock, scaling=scaling,
               profile_counts=counts)
    run.connect()
    run.run()
    outcomes = [o for o in run.outcomes if o is not None]
    if len(outcomes) != len(run.outcomes):
        raise RuntimeError("the simulation ended with requests still in flight")
    last_arrival_s = run.schedule[-1][0] if run.schedule else run.t0
    duration_s = max(run.last_event_s, last_arrival_s) - run.t0
    billed = run.fleet.billed if run.fleet is not None else nodes
    per_engine: dict[str, dict[str, Any]] = {n.engine_id: n.totals(run.balance) for n in billed}
    cost_usd = bill(billed, run.t0, run.t0 + duration_s)
    tokens = sum(o.prompt_tokens + o.output_tokens for o in outcomes if o.success)
    per_decider: list[dict[str, Any]] = [
        {"decisions": made, "dispatched": accepted, **({"why": whys} if whys else {}),
         **({"admission": dict(gate)} if gate.keys() - {"admitted"} else {})}  # when the gate queued or shed
        for made, accepted, whys, gate in zip(run.decisions, run.dispatched, run.whys, run.admission,
                                              strict=True)]
    if run.balance:
        rows = (run.migrations.rows() if run.migrations is not None
                else [MoveStats().row() for _ in per_decider])
        for decider_row, reschedule in zip(per_decider, rows, strict=True):
            decider_row["reschedule"] = reschedule
    return SimResult(
        outcomes=outcomes,
        duration_s=duration_s,
        wall_s=clock.now() - started_s,
        per_engine=per_engine,
        timeline=run.timeline,
        events_processed=len(run.schedule) + sum(n.iterations() + n.empty_steps for n in billed),
        per_decider=per_decider,
        balance=(balance_figures(per_engine, per_decider, run.timeline, duration_s) if run.balance else None),
        cost_usd=cost_usd,
        tokens_per_usd=tokens / cost_usd if cost_usd > 0 else None,
        fleet_actions=run.fleet.actions if run.fleet is not None else [],
        handoffs=(run.migrations.handoff_figures() if run.migrations is not None and run.prefill_nodes
                  else None),
        cascade=(None if run.cascade is None else
                 {**run.cascade.figures(), "replan": run.fleet.figures()}
                 if isinstance(run.fleet, CascadeReplanner) else run.cascade.figures()),
    )
