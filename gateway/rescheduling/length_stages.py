"""CascadeInfer's length stages as a rescheduler (paper 000, §4.2-4.4): plan, refine, hand over, bid-ask.

Owns: `LengthStagesParams` (the `--reschedule-param` keys), `StagesPlanFile` (a `plan=PATH` document),
`LengthStages` (one gateway worker's rescheduler: per model its stage layout, each engine's refined bound,
the bid-ask book and the transfers it started) and `Move` (what it proposes). §4.4's receiver choice
(`bid_winner`, `engine_load`) is the `length_stages` policy's, shared.
Must not: import asyncio, grpc, aiohttp, prometheus or `time`, read clocks or talk to engines. Time and
randomness come in (`now_s`, an injected `rand`); an executor above carries each `Move` out through the mover
(cut on the source) and the dispatcher's splice (resume on the target, or the life's fallbacks), live
(`gateway.dispatch.mover.RescheduleLoop`) and in the simulator (`loadgen.simulate.migrations`).

What it reads, per model, from each snapshot: the engines that can decode (ready, not ejected, not stale), and
their STAR rows (`EngineView.predictions`, pushed every k decode steps by an agent run with `--star-report`):
each running request's current length L = N(r) and prompt I = N(r) - generated. A request's length is the
engine's word, at most one round old.

One tick (`propose`, every `interval_s`), per model:
1. Observe. Requests seen are tracked (I, longest L seen); a request gone from every engine for two ticks and
   not in transfer has finished: (I, L - I) joins the window of recent requests re-planning uses.
2. Layout. The first layout is `plan` (a `StagesPlanFile`: stages' [lo, hi) with instance counts, engines in
   id order, or named engines), else planned on `history` (earlier requests' lengths: the simulator passes a
   slice of the dataset disjoint from the run's) when it holds `min_requests`, else one stage of every
   engine. Every `plan_interval_s`, once the window
   holds `min_requests`, the layout is re-planned on the window (`layout`: "dp" is §4.2's partition
   (`gateway.planning.stages`, the heuristic), "chain" one instance per stage, "single" one stage); engines
   keep their order (a re-plan moves stage walls, not engines past each other). An engine that joins goes to
   the stage with the most tokens per engine; a stage left without an engine merges into its neighbour
   (its range goes to the stage below, or to the one above for the first). Until the first re-plan, an
   engine the `plan` names that joins or comes back, or any engine joining while a planned stage is merged
   away, gets the plan laid again over the engines present (planned stages back, not the merged
   neighbour's: an agent late at start-up, or restarted).
3. Refinement (§4.3, `refine`). Each engine of a stage below the last has its own upper bound b_e, seeded
   from the plan. R = its own requests plus the successors' union divided by their count (`qoe.divide`),
   sorted by L; "qoe": the split i minimising Q^{R[:i]} + Q^{R[i:]} (Eq. 1 with the engines' pushed fit
   (`EngineView.qoe`, the samples-weighted mean of those that have one), else `d`); "count": the median;
   "memory": where the cumulated L reaches half. b_e <- (1 - ema) b_e + ema L(R[split]), clamped inside
   (the stage's lo, the next stage's hi); frozen while |R| < `min_requests`. A stage's hi is the mean of its
   engines' bounds.
4. Asks. Hand-over: a request on a stage-s engine whose L >= b_e is asked to the first later stage whose hi
   exceeds L (the last stage else). Intra-stage (`balance=bidask` only): an engine whose KV demand (used KV
   tokens + tokens won and not yet received) exceeds `overload` x its stage's mean offers its longest
   requests until the excess is covered, to its own stage; a bid whose winner would end fuller than the
   sender (its load plus the request's length against the sender's load) is dropped, so no request
   ping-pongs. One ask per request: a request already won, in
   transfer, excluded by the mover, at `max_migrations_per_request` or foreign (another worker's) is not
   asked.
5. Bids (`bid_winner`): every receiver of the stage but the sender bids its load (`engine_load`: the tokens it
   holds, prefills pending and dispatched since its report, plus tokens won not yet received) and its earliest
   start (tokens won not yet received x KV bytes per token / its transfer throughput, `EngineView.
   transfer_bytes_per_s`, else the link); the higher-load half is dropped (ceil(n/2) kept), the 3 earliest
   kept, and the freshest report wins ("the one that replies first"; ties by the injected rand).
   `balance=round_robin`: receivers in turn instead (§6.5's baseline). The winner queues the request with
   the sender's load (its tokens offered and not yet sent) as priority.
6. Transfers. Each receiver, below `max_transfers` in flight, takes its queue by priority: a request whose
   sender is sending another (one at a time per sender, §4.4) or busy in the mover is skipped and counts a
   skip; past `starvation_skips` its sender owes it next (the sender sends nothing else) and the receiver
   waits for it. A receiver without free KV for it (free blocks less tokens in flight to it) lets the request
   stay (it may be asked again). A started transfer is a `Move`; it ends when the request shows on another
   engine and is decoding there, or is gone, or after `transfer_timeout_s`.
`not_started` takes back a move the mover refused (409, or 503): the request may be asked again next round;
404 (another worker's request) marks it foreign.

Why the gateway is the broker, not agent to agent: the paper decentralises against a central scheduler's
delay and stale state (§2.5, §3.1); here every move already passes the gateway (its stream, its ticket), the
state is one report interval old, an ask over a few dozen engines costs microseconds, and the simulator runs
the same code. Kept: per-sender, per-request matching, the priority queues, the starvation rule.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from gateway.domain import ClusterSnapshot, EngineId, EngineView, LengthStage, StageLayout
from gateway.planning.stages import StagePlanError, TransferCost, plan_stages
from gateway.policies.length_stages import bid_winner, engine_load
from switchyard.qoe import NUM_FEATURES, PROFILED_QOE_D, Features, QoEModel, divide

Layout = Literal["dp", "chain", "single"]
Refine = Literal["qoe", "count", "memory", "off"]
Balance = Literal["bidask", "handover", "round_robin"]
LAYOUTS: tuple[Layout, ...] = ("dp", "chain", "single")
REFINES: tuple[Refine, ...] = ("qoe", "count", "memory", "off")
BALANCES: tuple[Balance, ...] = ("bidask", "handover", "round_robin")
DECODE_ROLES = frozenset({"", "decode"})
# The dispatcher's life allows `gateway.dispatch.life.DEFAULT_MAX_FOLLOWS` (16) resumptions per request; the
# rescheduler leaves one for a fallback (a test checks the two agree).
MAX_MOVES_PER_REQUEST = 15
GONE_TICKS = 2  # a request missing from every engine this many ticks in a row has finished
WINDOW = 4096  # finished requests kept for re-planning
FOREIGN_REMEMBERED = 65_536


class StagesConfigError(ValueError):
    """A bad parameter or plan; the message names the key."""


@dataclass(frozen=True, slots=True)
class LengthStagesParams:
    """The rescheduler's knobs (`--reschedule-param K=V`; the module docstring says what each does)."""

    layout: Layout = "dp"
    refine: Refine = "qoe"
    balance: Balance = "bidask"
    ema: float = 0.3  # weight of a new boundary in its moving average
    min_requests: int = 5  # refinement freezes below this many; re-planning waits for this many finished
    overload: float = 1.25  # intra-stage trigger: KV demand above this x the stage mean
    max_transfers: int = 3  # per receiver in flight
    starvation_skips: int = 3
    plan_interval_s: float = 60.0
    max_migrations_per_request: int = 0  # 0: the stage count
    max_len: int = 0  # planning range; 0: the longest request seen, rounded up to a power of two
    kv_link_gbps: float = 25.0  # hand-over cost in planning; a receiver's throughput when it reports none
    transfer_timeout_s: float = 30.0
    interval_s: float = 0.5  # the loop's interval (the caller sets it): a sender's transfers fill one tick
    transfer_latency_s: float = 0.002  # a pull's fixed cost in a sender's transfer-time estimate
    plan: str = ""  # a stage plan document (`StagesPlanFile`), read by the caller
    d0: float = PROFILED_QOE_D[0]  # Eq. 1's D when no engine pushes a fit
    d1: float = PROFILED_QOE_D[1]
    d2: float = PROFILED_QOE_D[2]
    d3: float = PROFILED_QOE_D[3]
    d4: float = PROFILED_QOE_D[4]

    def __post_init__(self) -> None:
        checks = (
            ("layout", self.layout in LAYOUTS, f"one of {', '.join(LAYOUTS)}"),
            ("refine", self.refine in REFINES, f"one of {', '.join(REFINES)}"),
            ("balance", self.balance in BALANCES, f"one of {', '.join(BALANCES)}"),
            ("ema", 0 < self.ema <= 1, "in (0, 1]"),
            ("min_requests", self.min_requests >= 1, ">= 1"),
            ("overload", self.overload >= 1, ">= 1"),
            ("max_transfers", self.max_transfers >= 1, ">= 1"),
            ("starvation_skips", self.starvation_skips >= 0, ">= 0"),
            ("plan_interval_s", self.plan_interval_s > 0, "> 0"),
            ("max_migrations_per_request", self.max_migrations_per_request >= 0, ">= 0"),
            ("max_len", self.max_len >= 0, ">= 0"),
            ("kv_link_gbps", self.kv_link_gbps > 0, "> 0"),
            ("transfer_timeout_s", self.transfer_timeout_s > 0, "> 0"),
            ("interval_s", self.interval_s > 0, "> 0"),
            ("transfer_latency_s", self.transfer_latency_s >= 0, ">= 0"),
            *((f"d{k}", v >= 0 and math.isfinite(v), ">= 0") for k, v in enumerate(self.d)),
        )
        bad = [f"{key} must be {what}, got {getattr(self, key)!r}" for key, ok, what in checks if not ok]
        if bad:
            raise StagesConfigError("; ".join(bad))

    @property
    def d(self) -> Features:
        return (self.d0, self.d1, self.d2, self.d3, self.d4)

    @property
    def link_bytes_per_s(self) -> float:
        return self.kv_link_gbps * 1e9 / 8

    @classmethod
    def from_mapping(cls, values: Mapping[str, object]) -> LengthStagesParams:
        """From `--reschedule-param` values; `StagesConfigError` naming an unknown or ill-typed key."""
        kinds = {name: f.type for name, f in cls.__dataclass_fields__.items()}  # "int", "float", a Literal
        unknown = sorted(set(values) - set(kinds))
        if unknown:
            raise StagesConfigError(
                f"unknown parameter(s) {', '.join(unknown)}; known: {', '.join(sorted(kinds))}")
        out: dict[str, Any] = {}
        for key, value in values.items():
            kind = kinds[key]
            try:
                if isinstance(value, bool):
                    raise ValueError
                if kind == "int":
                    number = float(str(value))
                    if number != int(number):
                        raise ValueError
                    out[key] = int(number)
                elif kind == "float":
                    out[key] = float(str(value))
                else:
                    out[key] = str(value)
            except ValueError:
                raise StagesConfigError(f"{key}: expected {kind}, got {value!r}") from None
        return cls(**out)


@dataclass(frozen=True, slots=True)
class PlannedStage:
    lo: int
    hi: int
    instances: int
    engines: tuple[str, ...] = ()  # named engines (optional); else the stage takes `instances` in id order


@dataclass(frozen=True, slots=True)
class StagesPlanFile:
    """A first plan: `switchyard plan-stages --json`'s `stages` ({lo, hi, instances}, optionally `engines`),
    for `model` ("" = every model)."""

    stages: tuple[PlannedStage, ...]
    model: str = ""

    @classmethod
    def parse(cls, doc: object, where: str = "plan") -> StagesPlanFile:
        """`StagesConfigError` naming the key on a bad document (non-increasing ranges, bad counts)."""
        if not isinstance(doc, dict) or not isinstance(doc.get("stages"), list) or not doc["stages"]:
            raise StagesConfigError(
                f"{where}: expected {{\"stages\": [{{\"lo\", \"hi\", \"instances\"}}, ...]}}")
        stages: list[PlannedStage] = []
        for index, raw in enumerate(doc["stages"]):
            key = f"{where}.stages[{index}]"
            if not isinstance(raw, dict):
                raise StagesConfigError(f"{key}: expected an object")
            try:
                lo, hi, n = int(raw["lo"]), int(raw["hi"]), int(raw.get("instances", 1))
            except (KeyError, TypeError, ValueError):
                raise StagesConfigError(f"{key}: lo, hi and instances must be whole numbers") from None
            engines = raw.get("engines", [])
            if not isinstance(engines, list) or not all(isinstance(e, str) for e in engines):
                raise StagesConfigError(f"{key}.engines: expected a list of engine ids")
            if hi <= lo or n < 1 or (engines and len(engines) != n):
                raise StagesConfigError(f"{key}: needs lo < hi and instances >= 1 (= its engines when named)")
            if stages and lo != stages[-1].hi:
                raise StagesConfigError(f"{key}: ranges must be increasing and adjacent "
                                        f"(lo {lo} after hi {stages[-1].hi})")
            stages.append(PlannedStage(lo, hi, n, tuple(engines)))
        if stages[0].lo != 0:
            raise StagesConfigError(f"{where}.stages[0]: the first stage must start at 0")
        model = doc.get("model", "")
        return cls(tuple(stages), model if isinstance(model, str) else "")

    def check_engines(self, known: Sequence[str], where: str = "plan") -> None:
        """`StagesConfigError` when the plan names an engine that is not in `known`."""
        for index, stage in enumerate(self.stages):
            unknown = sorted(set(stage.engines) - set(known))
            if unknown:
                raise StagesConfigError(
                    f"{where}.stages[{index}].engines: unknown engine(s) {', '.join(unknown)}")


@dataclass(frozen=True, slots=True)
class Move:
    """Move `request_id` from `source` to `target`: a hand-over or a rebalancing (`reason`)."""

    request_id: str
    source: EngineId
    target: EngineId
    model: str
    reason: Literal["handover", "rebalance"]
    tokens: int  # its length when asked


@dataclass(slots=True)
class _Tracked:
    prompt: int
    length: int
    engine: EngineId
    missing: int = 0


@dataclass(slots=True)
class _Won:
    request_id: str
    source: EngineId
    tokens: int
    priority: int  # the sender's load when asked
    order: int
    reason: Literal["handover", "rebalance"]
    skips: int = 0


@dataclass(slots=True)
class _Transfer:
    source: EngineId
    target: EngineId
    tokens: int
    started_s: float
    done_s: float  # when its KV should have been pulled (the sender's estimate)


@dataclass(slots=True)
class _Stage:
    engines: list[EngineId]
    bounds: dict[EngineId, float]  # each engine's refined upper bound
    hi: float  # the stage's upper bound (the last: the planning range)


@dataclass(slots=True)
class _Model:
    stages: list[_Stage] = field(default_factory=list)
    planned_at_s: float = -math.inf
    tracked: dict[str, _Tracked] = field(default_factory=dict)
    window: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=WINDOW))
    moves: dict[str, int] = field(default_factory=dict)
    queues: dict[EngineId, list[_Won]] = field(default_factory=dict)
    won: dict[str, EngineId] = field(default_factory=dict)  # request -> the receiver that won it
    transfers: dict[str, _Transfer] = field(default_factory=dict)
    owed: dict[EngineId, str] = field(default_factory=dict)  # sender -> the starving request it sends next
    free_at: dict[EngineId, float] = field(default_factory=dict)  # sender -> when its last transfer ends
    turn: int = 0  # round robin's counter
    first_plan: bool = False  # the layout is still the `plan`'s (not re-planned since)


class LengthStages:
    """One gateway worker's CascadeInfer rescheduler (see the module docstring)."""

    def __init__(self, params: LengthStagesParams, *, plan: StagesPlanFile | None = None,
                 history: Sequence[tuple[int, int]] = (), rand: Callable[[], float]) -> None:
        """`plan`: the first layout; `history`: (I, O) of earlier requests, the first window (the first layout
        is planned on it when there is no `plan` and it holds `min_requests`)."""
        self.params = params
        self._plan = plan
        self._history = tuple(history)
        self._rand = rand
        self._models: dict[str, _Model] = {}
        self._foreign: dict[str, None] = {}
        self._order = 0
        self.counts: dict[str, int] = {"handover": 0, "rebalance": 0, "replans": 0, "stays": 0, "skips": 0,
                                       "starved": 0}

    # ---- what it publishes ---------------------------------------------------------------------------------

    def layouts(self) -> dict[str, StageLayout]:
        """Per model its stages, each engine's bound and the tokens each engine has won, not yet received."""
        out = {}
        for name, m in self._models.items():
            if not m.stages:
                continue
            pending = self._pending(m)
            stages, lo = [], 0
            for s in m.stages:
                hi = int(round(s.hi))
                stages.append(LengthStage(lo, hi, tuple(s.engines),
                                          tuple(int(round(s.bounds[e])) for e in s.engines)))
                lo = hi
            out[name] = StageLayout(name, tuple(stages), pending)
        return out

    # ---- the tick ------------------------------------------------------------------------------------------

    def propose(self, snapshot: ClusterSnapshot, model: str, exclude: frozenset[str],
                busy: frozenset[str], now_s: float) -> list[Move]:
        """One interval for `model` (steps 1-6 of the module docstring): the transfers to start now."""
        engines = [e for e in snapshot.engines if e.model == model and e.role in DECODE_ROLES and e.ready
                   and not e.ejected and not e.stale]
        m = self._models.get(model)
        if m is None:
            m = self._models[model] = _Model()
            m.window.extend(self._history)
        if not engines:
            return []
        views = {e.engine_id: e for e in engines}
        rows = self._observe(m, engines, now_s)
        self._keep_layout(m, model, views, rows, now_s)
        if self.params.refine != "off":
            self._refine(m, views, rows)
        self._ask(m, model, views, rows, exclude)
        return self._start(m, model, views, rows, busy, now_s)

    def not_started(self, move: Move, status: int) -> None:
        """The mover did not start `move` (`status` as `MoveError`'s): it may be asked again; 404 marks the
        request another worker's."""
        m = self._models.get(move.model)
        if m is None:
            return
        transfer = m.transfers.pop(move.request_id, None)
        if transfer is not None:
            m.moves[move.request_id] = max(m.moves.get(move.request_id, 1) - 1, 0)
        if status == 404:
            self._foreign[move.request_id] = None
            while len(self._foreign) > FOREIGN_REMEMBERED:
                del self._foreign[next(iter(self._foreign))]

    # ---- 1. observe ----------------------------------------------------------------------------------------

    def _observe(self, m: _Model, engines: Sequence[EngineView],
                 now_s: float) -> dict[str, tuple[EngineId, int, int, bool]]:
        rows: dict[str, tuple[EngineId, int, int, bool]] = {}  # request -> (engine, I, L, migratable)
        for e in engines:
            for p in e.predictions:
                rows[p.request_id] = (e.engine_id, p.prompt_tokens, p.current_tokens, p.migratable)
        for rid, (engine, prompt, length, _) in rows.items():
            t = m.tracked.get(rid)
            if t is None:
                m.tracked[rid] = _Tracked(prompt, length, engine)
            else:
                t.length, t.engine, t.missing = max(t.length, length), engine, 0
        for rid, t in list(m.tracked.items()):
            if rid in rows or rid in m.transfers:
                continue
            t.missing += 1
            if t.missing >= GONE_TICKS:
                del m.tracked[rid]
                m.window.append((t.prompt, max(t.length - t.prompt, 1)))
                m.moves.pop(rid, None)
        for rid, tr in list(m.transfers.items()):
            row = rows.get(rid)
            arrived = row is not None and row[0] != tr.source and row[3]
            # missing everywhere well after its pull should have ended: it finished (or failed) in transit
            gone = row is None and now_s > tr.done_s + GONE_TICKS * self.params.interval_s
            if arrived or gone or now_s - tr.started_s > self.params.transfer_timeout_s:
                del m.transfers[rid]
        for rid in [r for r in m.won if r not in rows]:  # finished before it was sent
            self._drop_won(m, rid)
        return rows

    # ---- 2. layout -----------------------------------------------------------------------------------------

    def _keep_layout(self, m: _Model, model: str, views: Mapping[EngineId, EngineView],
                     rows: Mapping[str, tuple[EngineId, int, int, bool]], now_s: float) -> None:
        ids = sorted(views)
        joined = set(ids) - {e for s in m.stages for e in s.engines}
        if m.first_plan and joined and self._plan is not None and (
                joined & {e for s in self._plan.stages for e in s.engines}
                or len(m.stages) < len(self._plan.stages)):
            # An engine the plan names joined (or came back), or one joined while a planned stage is merged
            # away: lay the plan again over the engines present, so an engine late at start-up, or restarted,
            # gets its planned stage back instead of the merged neighbour's.
            m.stages = self._first_layout(model, ids)
        elif not m.stages:
            m.stages = self._first_layout(model, ids)
            m.first_plan = self._plan is not None
            if self._plan is None and len(m.window) >= self.params.min_requests:
                m.stages = self._replan(m, views) or m.stages
            m.planned_at_s = now_s
        elif (now_s - m.planned_at_s >= self.params.plan_interval_s
              and len(m.window) >= self.params.min_requests):
            replanned = self._replan(m, views)
            m.planned_at_s = now_s
            if replanned is not None:
                m.stages = replanned
                m.first_plan = False
                self.counts["replans"] += 1
        present = set(ids)
        for s in m.stages:  # engines that left
            s.engines = [e for e in s.engines if e in present]
            s.bounds = {e: b for e, b in s.bounds.items() if e in present}
        merged: list[_Stage] = []
        for s in m.stages:  # a stage without a live engine merges into its neighbour
            if s.engines:
                merged.append(s)
            elif merged:
                merged[-1].hi = s.hi
                for e in merged[-1].engines:
                    merged[-1].bounds[e] = s.hi
        if m.stages and not merged:
            merged = [_Stage([], {}, m.stages[-1].hi)]
        m.stages = merged
        placed = {e for s in m.stages for e in s.engines}
        for e in ids:  # engines that joined: to the stage with the most tokens per engine
            if e in placed:
                continue
            target = max(m.stages, key=lambda s: sum(
                engine_load(views[x]) for x in s.engines) / max(len(s.engines), 1))
            target.engines.append(e)
            target.engines.sort()
            target.bounds[e] = target.hi
        if m.stages[-1].hi < self._max_len(m):
            m.stages[-1].hi = self._max_len(m)

    def _max_len(self, m: _Model) -> int:
        if self.params.max_len:
            return self.params.max_len
        longest = max((i + o for i, o in m.window), default=1)
        longest = max(longest, max((t.length for t in m.tracked.values()), default=1))
        return 1 << max(longest - 1, 1).bit_length()

    def _first_layout(self, model: str, ids: Sequence[EngineId]) -> list[_Stage]:
        plan = self._plan
        if plan is None or (plan.model and plan.model != model):
            return [_Stage(list(ids), {e: float(self.params.max_len or 1 << 17) for e in ids},
                           float(self.params.max_len or 1 << 17))]
        named = {e for s in plan.stages for e in s.engines}
        if named:  # engines not (yet) present are left out; the caller checks names where the fleet is known
            present = set(ids)
            stages = [_Stage(sorted(EngineId(e) for e in s.engines if e in present), {}, float(s.hi))
                      for s in plan.stages]
            rest = [e for e in ids if e not in named]
            if rest:
                stages[-1].engines.extend(rest)
        else:
            counts = _scale([s.instances for s in plan.stages], len(ids))
            stages, at = [], 0
            for planned, k in zip(plan.stages, counts, strict=True):
                if k:
                    stages.append(_Stage(list(ids[at:at + k]), {}, float(planned.hi)))
                    at += k
                elif stages:
                    stages[-1].hi = float(planned.hi)
        for stage in stages:
            stage.bounds = {e: stage.hi for e in stage.engines}
        return stages

    def _replan(self, m: _Model, views: Mapping[EngineId, EngineView]) -> list[_Stage] | None:
        ordered = [e for s in m.stages for e in s.engines]
        ordered += sorted(set(views) - set(ordered))
        p = self.params
        max_len = self._max_len(m)
        requests = [(min(i, max_len - 1), min(o, max_len - min(i, max_len - 1))) for i, o in m.window]
        if p.layout == "single" or len(ordered) == 1:
            return [_Stage(ordered, {e: float(max_len) for e in ordered}, float(max_len))]
        kvb = max((views[e].kv_bytes_per_token for e in ordered if e in views), default=0)
        try:
            plan = plan_stages(len(ordered), max_len, requests, QoEModel(self._d(views)),
                               TransferCost(float(kvb), p.kv_link_gbps / 8),
                               "chain" if p.layout == "chain" else "heuristic")
        except StagePlanError:
            return None
        stages, at = [], 0
        for st in plan.stages:
            engines = ordered[at:at + st.instances]
            at += st.instances
            stages.append(_Stage(engines, {e: float(st.hi) for e in engines}, float(st.hi)))
        return stages

    def _d(self, views: Mapping[EngineId, EngineView]) -> Features:
        """The engines' pushed fits, weighted by their samples; the parameters' D when none has one."""
        fits = [(v.qoe.d, v.qoe.samples) for v in views.values() if v.qoe is not None and v.qoe.samples > 0]
        if not fits:
            return self.params.d
        total = sum(n for _, n in fits)
        mean = [sum(d[k] * n for d, n in fits) / total for k in range(NUM_FEATURES)]
        return (mean[0], mean[1], mean[2], mean[3], mean[4])

    # ---- 3. refinement -------------------------------------------------------------------------------------

    def _refine(self, m: _Model, views: Mapping[EngineId, EngineView],
                rows: Mapping[str, tuple[EngineId, int, int, bool]]) -> None:
        p = self.params
        by_engine: dict[EngineId, list[tuple[int, int]]] = {}
        for engine, prompt, length, _ in rows.values():
            by_engine.setdefault(engine, []).append((prompt, length))
        d = self._d(views) if p.refine == "qoe" else p.d
        lo = 0.0
        for index in range(len(m.stages) - 1):
            s, nxt = m.stages[index], m.stages[index + 1]
            successors = [r for e in nxt.engines for r in by_engine.get(e, ())]
            share = divide(successors, len(nxt.engines), key=lambda r: r[1]) if successors else []
            ceiling = nxt.hi - 1 if index + 1 < len(m.stages) - 1 else self._max_len(m) - 1
            for e in s.engines:
                pool = sorted([*by_engine.get(e, ()), *share], key=lambda r: r[1])
                if len(pool) >= p.min_requests:
                    target = _split_length(pool, p.refine, d)
                    s.bounds[e] = (1 - p.ema) * s.bounds[e] + p.ema * target
                s.bounds[e] = min(max(s.bounds[e], lo + 1), max(ceiling, lo + 1))
            s.hi = sum(s.bounds.values()) / len(s.bounds)
            lo = s.hi

    # ---- 4-5. asks and bids --------------------------------------------------------------------------------

    def _ask(self, m: _Model, model: str, views: Mapping[EngineId, EngineView],
             rows: Mapping[str, tuple[EngineId, int, int, bool]], exclude: frozenset[str]) -> None:
        p = self.params
        limit = min(p.max_migrations_per_request or len(m.stages), MAX_MOVES_PER_REQUEST)
        by_engine: dict[EngineId, list[tuple[str, int]]] = {}
        for rid, (engine, _, length, migratable) in rows.items():
            if (migratable and rid not in m.won and rid not in m.transfers and rid not in exclude
                    and rid not in self._foreign and m.moves.get(rid, 0) < limit):
                by_engine.setdefault(engine, []).append((rid, length))
        pending = self._pending(m)
        offered = self._offered(m)
        last = len(m.stages) - 1
        for index, s in enumerate(m.stages):
            for e in s.engines:
                if index == last:
                    break
                for rid, length in sorted(by_engine.get(e, ()), key=lambda r: -r[1]):
                    if length < s.bounds[e]:
                        continue
                    t = next((j for j in range(index + 1, last) if length < m.stages[j].hi), last)
                    offered[e] = offered.get(e, 0) + length
                    self._bid(m, model, rid, e, length, offered[e], m.stages[t].engines, views, pending,
                              "handover")
        if p.balance != "bidask":
            return
        for s in m.stages:
            live = [e for e in s.engines if e in views]
            if len(live) < 2:
                continue
            demand = {e: _kv_used(views[e]) + pending.get(e, 0) for e in live}
            mean = sum(demand.values()) / len(demand)
            for e in live:
                excess = demand[e] - mean
                if mean <= 0 or demand[e] <= p.overload * mean:
                    continue
                for rid, length in sorted(by_engine.get(e, ()), key=lambda r: -r[1]):
                    if excess <= 0:
                        break
                    if rid in m.won:
                        continue
                    offered[e] = offered.get(e, 0) + length
                    excess -= length
                    self._bid(m, model, rid, e, length, offered[e], s.engines, views, pending, "rebalance")

    def _bid(self, m: _Model, model: str, rid: str, source: EngineId, length: int, sender_load: int,
             receivers: Sequence[EngineId], views: Mapping[EngineId, EngineView],
             pending: dict[EngineId, int], reason: Literal["handover", "rebalance"]) -> None:
        bidders = [views[r] for r in receivers if r != source and r in views]
        if not bidders:
            return
        if self.params.balance == "round_robin":
            winner: EngineView | None = bidders[m.turn % len(bidders)]
            m.turn += 1
        else:
            winner = bid_winner(bidders, pending, self.params.link_bytes_per_s, self._rand)
        assert winner is not None
        if reason == "rebalance" and (engine_load(winner, pending.get(winner.engine_id, 0)) + length
                                      >= engine_load(views[source])):
            return  # the move would leave the receiver fuller than the sender was: no gain, a ping-pong
        self._order += 1
        m.queues.setdefault(winner.engine_id, []).append(
            _Won(rid, source, length, sender_load, self._order, reason))
        m.won[rid] = winner.engine_id
        pending[winner.engine_id] = pending.get(winner.engine_id, 0) + length

    # ---- 6. transfers --------------------------------------------------------------------------------------

    def _start(self, m: _Model, model: str, views: Mapping[EngineId, EngineView],
               rows: Mapping[str, tuple[EngineId, int, int, bool]], busy: frozenset[str],
               now_s: float) -> list[Move]:
        moves: list[Move] = []
        for receiver in [r for r in m.queues if r not in views]:  # a receiver that left: its wins are void
            for w in m.queues.pop(receiver):
                m.won.pop(w.request_id, None)
        m.owed = {s: r for s, r in m.owed.items() if r in m.won}  # an owed request that left owes nothing
        horizon_s = now_s + self.params.interval_s  # a sender may start what its link finishes by then
        sending = {e for e, at in m.free_at.items() if at >= horizon_s}
        inflight: dict[EngineId, int] = {}
        for t in m.transfers.values():
            if t.done_s > now_s:
                inflight[t.target] = inflight.get(t.target, 0) + 1
        incoming: dict[EngineId, int] = {}
        for t in m.transfers.values():
            incoming[t.target] = incoming.get(t.target, 0) + t.tokens
        for receiver in sorted(m.queues):
            queue = m.queues[receiver]
            queue.sort(key=lambda w: (-w.priority, w.order))
            view = views.get(receiver)
            kept: list[_Won] = []
            waiting = False
            for w in queue:
                if waiting or view is None or inflight.get(receiver, 0) >= self.params.max_transfers:
                    kept.append(w)
                    continue
                row = rows.get(w.request_id)
                if row is None or row[0] != w.source or not row[3]:
                    self._forget(m, w)  # finished, moved or no longer decoding: not ours to send
                    continue
                owed = m.owed.get(w.source)
                if w.source in sending or w.source in busy or (owed is not None and owed != w.request_id):
                    w.skips += 1
                    self.counts["skips"] += 1
                    if w.skips > self.params.starvation_skips and owed is None:
                        m.owed[w.source] = w.request_id
                        self.counts["starved"] += 1
                    kept.append(w)
                    waiting = m.owed.get(w.source) == w.request_id
                    continue
                free = view.kv_blocks_free * view.block_size - incoming.get(receiver, 0)
                if free < row[2]:
                    self._forget(m, w)  # no room on the receiver: the request stays
                    self.counts["stays"] += 1
                    continue
                m.won.pop(w.request_id, None)
                if m.owed.get(w.source) == w.request_id:
                    del m.owed[w.source]
                start_s = max(now_s, m.free_at.get(w.source, now_s))
                done_s = start_s + self._transfer_s(view, row[2])
                m.free_at[w.source] = done_s
                m.transfers[w.request_id] = _Transfer(w.source, receiver, row[2], now_s, done_s)
                m.moves[w.request_id] = m.moves.get(w.request_id, 0) + 1
                if done_s >= horizon_s:
                    sending.add(w.source)
                inflight[receiver] = inflight.get(receiver, 0) + 1
                incoming[receiver] = incoming.get(receiver, 0) + row[2]
                self.counts[w.reason] += 1
                moves.append(Move(w.request_id, w.source, receiver, model, w.reason, row[2]))
            m.queues[receiver] = kept
        return moves

    # ---- bookkeeping ---------------------------------------------------------------------------------------

    def _transfer_s(self, receiver: EngineView, tokens: int) -> float:
        """The sender's estimate of one pull: its KV bytes over the receiver's throughput (else the link)."""
        rate = receiver.transfer_bytes_per_s or self.params.link_bytes_per_s
        return self.params.transfer_latency_s + tokens * max(receiver.kv_bytes_per_token, 1) / rate

    @staticmethod
    def _pending(m: _Model) -> dict[EngineId, int]:
        """Tokens each engine has won and not received: queued wins and transfers in flight."""
        out: dict[EngineId, int] = {}
        for receiver, queue in m.queues.items():
            out[receiver] = sum(w.tokens for w in queue)
        for t in m.transfers.values():
            out[t.target] = out.get(t.target, 0) + t.tokens
        return out

    @staticmethod
    def _offered(m: _Model) -> dict[EngineId, int]:
        """Each sender's buffered tokens: its requests won by a receiver and not sent yet (its ask's load)."""
        out: dict[EngineId, int] = {}
        for queue in m.queues.values():
            for w in queue:
                out[w.source] = out.get(w.source, 0) + w.tokens
        return out

    @staticmethod
    def _forget(m: _Model, w: _Won) -> None:
        """`w` leaves its receiver's book unsent: no longer won, and its sender owes it no more."""
        m.won.pop(w.request_id, None)
        if m.owed.get(w.source) == w.request_id:
            del m.owed[w.source]

    @staticmethod
    def _drop_won(m: _Model, rid: str) -> None:
        receiver = m.won.pop(rid, None)
        if receiver is not None:
            m.queues[receiver] = [w for w in m.queues.get(receiver, []) if w.request_id != rid]


def _kv_used(view: EngineView) -> int:
    return max(view.kv_blocks_total - view.kv_blocks_free, 0) * view.block_size


def _scale(counts: Sequence[int], total: int) -> list[int]:
    """`counts` scaled to sum to `total` (largest remainder; a stage may get 0 when total < len(counts))."""
    whole = sum(counts)
    exact = [c * total / whole for c in counts]
    out = [int(x) for x in exact]
    for i in sorted(range(len(counts)), key=lambda i: -(exact[i] - out[i]))[: total - sum(out)]:
        out[i] += 1
    return out


def _split_length(pool: Sequence[tuple[int, int]], refine: Refine, d: Features) -> float:
    """The length at the split of `pool` ((I, L) sorted by L) by `refine` (§4.3's argmin for "qoe")."""
    n = len(pool)
    if refine == "count":
        return float(pool[n // 2][1])
    lengths = np.fromiter((r[1] for r in pool), dtype=np.float64, count=n)
    if refine == "memory":
        cum = np.cumsum(lengths)
        return float(lengths[int(np.searchsorted(cum, cum[-1] / 2))])
    inputs = np.fromiter((r[0] for r in pool), dtype=np.float64, count=n)
    zero = np.zeros(1)
    count = np.arange(n + 1, dtype=np.float64)
    s_i = np.concatenate([zero, np.cumsum(inputs)])
    s_i2 = np.concatenate([zero, np.cumsum(inputs * inputs)])
    s_l = np.concatenate([zero, np.cumsum(lengths)])

    def q(k: Any, a: Any, b: Any, c: Any) -> Any:  # Q^B = n (D0 + D1 n + D2 ΣI + D3 ΣI² + D4 ΣL), 0 if empty
        return k * (d[0] + d[1] * k + d[2] * a + d[3] * b + d[4] * c)

    head = q(count, s_i, s_i2, s_l)
    tail = q(n - count, s_i[-1] - s_i, s_i2[-1] - s_i2, s_l[-1] - s_l)
    split = int(np.argmin((head + tail)[:n]))  # 0 <= i < N
    return float(lengths[split])
