"""The gateway's domain types: what crosses its seams (api, dispatch, policies, cluster, engines, loadgen).

Owns: `EngineId`; the engine-facing request (`EngineRequest`, `ChatTurn`), its events (`Admitted`, `Delta`,
`Finished`) and failures (`EngineUnavailable`, `EngineStreamError`, `EngineRequestError`); what engines report
(`EngineReport`, `EngineDescription`); and the routing inputs every policy gets (`EngineView`,
`ClusterSnapshot`, `RequestFeatures`). The live gateway's cluster store and the discrete-event simulator build
the same types (invariant I1), so a policy measured in simulation is the shipped policy.
Must not: import anything of the gateway's (every gateway package imports this, so it stays at the bottom),
import asyncio, grpc, aiohttp, prometheus or time, or hold mutable state. Times are seconds (floats).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, NewType

EngineId = NewType("EngineId", str)


@dataclass(frozen=True, slots=True)
class LensState:
    """NexusSched's engine state vector (Eq. 8) as an engine running LENS reports it."""

    predicted_batch_latency_s: float  # L-hat: predicted duration of the current batch
    pending_work_tokens: float  # W
    effective_free_kv_blocks: int  # M_free: free KV after reservations for queued requests
    peak_throughput_tokens_per_s: float  # P_max (> 0)
    prediction_error_ratio: float  # recent |predicted - observed| / observed iteration time
    slo_risk: bool  # the engine's feasible latency interval is empty (it cannot meet its SLOs)
    # The prefill tokens per second LENS's plans leave a request arriving now (0: LENS does not plan).
    prefill_tokens_per_s: float = 0.0


@dataclass(frozen=True, slots=True)
class RequestPrediction:
    """STAR (§4): one running request's predicted remaining output, as its engine last reported it."""

    request_id: str
    current_tokens: int  # N(r): prompt + generated, the tokens whose KV it holds
    predicted_remaining_tokens: float  # N-hat(r), counted down between the agent's taps
    generated_tokens: int = 0
    migratable: bool = True  # decoding, not being cut or loading

    @property
    def prompt_tokens(self) -> int:
        """The prompt as this engine holds it: N(r) less the tokens generated (CascadeInfer's I)."""
        return max(self.current_tokens - self.generated_tokens, 0)


@dataclass(frozen=True, slots=True)
class QoEReport:
    """CascadeInfer §4.1: an engine's online fit of Eq. 1 (D for F = (1, n, ΣI, ΣI², ΣL)), the samples it
    was fitted on and its mean relative error on them."""

    d: tuple[float, float, float, float, float]
    samples: int
    mean_relative_error: float


@dataclass(frozen=True, slots=True)
class FutureLoad:
    """STAR's worker-side summary (§5.2, `switchyard.star_load`): the engine's predicted token load at rounds
    1..H of `round_tokens` decode steps, from the prediction round `round`."""

    round: int
    round_tokens: int
    load: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class EngineView:
    """What the gateway knows about one engine at snapshot time."""

    engine_id: EngineId
    model: str
    profile: str = ""
    backend: str = "sim"
    role: str = ""
    # Lifecycle as seen by the gateway.
    ready: bool = True  # connected, reported ready, not draining
    stale: bool = False  # no state report within the staleness bound: the pushed figures are local accounting
    ejected: bool = False  # out of the pool by outlier detection (or its one half-open probe is in flight)
    # When the last report arrived (the gateway's clock; when the engine was added, before any report). The
    # report's age is `ClusterSnapshot.state_age_s(view)`: a view holds nothing that depends on the snapshot's
    # time alone, so the cluster state reuses it across snapshots while the engine is unchanged.
    reported_at_s: float = 0.0
    # Pushed state (last report).
    seq: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    kv_blocks_reserved: int = 0
    block_size: int = 16
    pending_prefill_tokens: int = 0
    running_batch_tokens: int = 0
    max_num_seqs: int = 0
    last_iteration_s: float = 0.0  # duration of the engine's latest iteration (kept while it idles)
    lens: LensState | None = None  # LENS's state vector; None when the engine does not run LENS
    # STAR: the last prediction round's per-request predictions and future-load summary (empty / None when
    # the engine runs no length predictor). Kept between rounds; a stale view drops them, like `lens`.
    predictions: tuple[RequestPrediction, ...] = ()
    future_load: FutureLoad | None = None
    kv_bytes_per_token: int = 0  # from the engine's description (0 = unknown): migration cost, C_mig
    # CascadeInfer: the engine's QoE fit (None: none yet) and its measured KV pull throughput (0 = none yet).
    qoe: QoEReport | None = None
    transfer_bytes_per_s: float = 0.0
    # The hardware, its price and its GPU combo (CAUCHY): from the description / identity; "" / 0 = unknown.
    gpu: str = ""
    tensor_parallel: int = 1
    hourly_price_usd: float = 0.0
    combo: str = ""
    # Gateway-side optimistic accounting: requests this gateway dispatched and not yet finished.
    inflight_requests: int = 0
    inflight_tokens: int = 0  # prompt + max output tokens of those requests (an upper bound)
    # Dispatched since the engine's last report (so not yet reflected in num_running / num_waiting).
    unreported_requests: int = 0
    unreported_tokens: int = 0  # prompt + max output tokens
    unreported_prompt_tokens: int = 0  # prompt tokens alone (estimates)
    # Observed by this gateway: mean latencies of requests that finished on the engine within the cluster
    # state's latency window (None with no sample there), measured from dispatch to first token / to finish.
    recent_ttft_s: float | None = None
    recent_e2e_s: float | None = None
    recent_latency_samples: int = 0

    @property
    def kv_free_ratio(self) -> float:
        return self.kv_blocks_free / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def has_lens(self) -> bool:
        """Whether the engine reports LENS's state vector."""
        return self.lens is not None

    @property
    def queue_length(self) -> int:
        """Requests on the engine as best known: reported running + waiting + dispatched since."""
        return self.num_running + self.num_waiting + self.unreported_requests


# A weighted policy's weights for one model: (group, weight) pairs sorted by group (goodput_rr's combos).
RouteWeights = tuple[tuple[str, float], ...]


@dataclass(frozen=True, slots=True)
class RouteTag:
    """What a weighted policy (`gateway.policies.goodput_rr`) says about one pick, for the ledger: the pick
    counts for group `weights[index]` under `weights` of `model`'s groups."""

    model: str
    weights: RouteWeights
    index: int

    @property
    def group(self) -> str:
        return self.weights[self.index][0]


@dataclass(frozen=True, slots=True)
class RouteTally:
    """A model's weighted-pick counts since its weights last changed (`ClusterState` keeps them)."""

    weights: RouteWeights
    counts: tuple[int, ...]  # picks tagged with `weights`, per group in `weights`' order

    def count(self, group: str) -> int:
        for (name, _), n in zip(self.weights, self.counts, strict=True):
            if name == group:
                return n
        return 0


_NO_ROUTES: Mapping[str, RouteTally] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class LengthStage:
    """One stage of CascadeInfer's pipeline (`gateway.rescheduling.length_stages`): its engines serve
    sequences of length [lo, hi) (the last stage: lo and up). `bounds` is each engine's own refined upper
    bound (§4.3), in `engines`' order; `hi` is their mean."""

    lo: int
    hi: int
    engines: tuple[EngineId, ...]
    bounds: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class StageLayout:
    """A model's length stages as its rescheduler last published them, for the `length_stages` policy:
    `stages` in increasing length; `pending_tokens`: per engine, the tokens of requests it has won in
    bid-ask and not received yet (its bid's earliest start is these over its transfer throughput)."""

    model: str
    stages: tuple[LengthStage, ...]
    pending_tokens: Mapping[EngineId, int] = field(default_factory=lambda: _NO_PENDING)

    def stage_of(self, engine_id: EngineId) -> int | None:
        for index, stage in enumerate(self.stages):
            if engine_id in stage.engines:
                return index
        return None


_NO_PENDING: Mapping[EngineId, int] = MappingProxyType({})
_NO_STAGES: Mapping[str, StageLayout] = MappingProxyType({})


# (membership, model) -> positions of the engines serving the model (`ClusterSnapshot.serving`).
_SERVING_POSITIONS: dict[tuple[int, str], tuple[int, ...]] = {}
_SERVING_MEMO_SIZE = 256


@dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    """The fleet at one instant. `engines` is in a stable order (by engine id). `routes`: model -> the
    weighted picks since that model's weights last changed (empty unless a weighted policy routes).
    `stages`: model -> its CascadeInfer stage layout (`StageLayout`, empty unless that rescheduler runs).
    `membership`: two snapshots with the same value >= 0 (unique per process) have the same engines in the
    same order, each with the same model, readiness, ejection, combo, profile and role (policies may memoise
    what depends on those alone); -1: unknown (hand-built snapshots)."""

    taken_at_s: float
    engines: tuple[EngineView, ...]
    routes: Mapping[str, RouteTally] = field(default_factory=lambda: _NO_ROUTES)
    membership: int = field(default=-1, compare=False)  # a memo key, not part of the value
    # model -> its length stages as the `length_stages` rescheduler last published them (empty otherwise)
    stages: Mapping[str, StageLayout] = field(default_factory=lambda: _NO_STAGES)

    def get(self, engine_id: EngineId) -> EngineView | None:
        for e in self.engines:
            if e.engine_id == engine_id:
                return e
        return None

    def state_age_s(self, view: EngineView) -> float:
        """Seconds from `view`'s last report arriving to this snapshot (from the engine's addition before
        any report)."""
        return self.taken_at_s - view.reported_at_s

    def serving(self, model: str) -> tuple[EngineView, ...]:
        """Engines of `model` that can take a request: ready and not ejected. Stale ones stay (availability
        is decided by the transport, not by report age; a stale view carries local accounting instead).
        Their positions are memoised per membership (which fixes model, readiness and ejection by position),
        so a routing decision does not walk the whole fleet."""
        engines = self.engines
        if self.membership < 0:
            return tuple(e for e in engines if e.model == model and e.ready and not e.ejected)
        key = (self.membership, model)
        positions = _SERVING_POSITIONS.get(key)
        if positions is None:
            positions = tuple(
                i for i, e in enumerate(engines) if e.model == model and e.ready and not e.ejected)
            if len(_SERVING_POSITIONS) >= _SERVING_MEMO_SIZE:
                _SERVING_POSITIONS.clear()
            _SERVING_POSITIONS[key] = positions
        if len(positions) == len(engines):
            return engines
        return tuple(map(engines.__getitem__, positions))


# Where a policy's `prefix_hits` come from (its `prefix_source`; `ClusterState.prefix_match`): the engines'
# own KV events, or what this gateway sent where.
PREFIX_EVENTS = "events"
PREFIX_SENT = "sent"


@dataclass(frozen=True, slots=True)
class RequestFeatures:
    """One request as a policy sees it. Time and randomness are data here, never read by the policy."""

    request_id: str
    model: str
    prompt_tokens: int  # exact when known, else an estimate
    max_tokens: int
    now_s: float  # the clock reading the dispatcher took for this decision
    dispatch_seq: int  # increases by one per decision in this process (round robin uses it)
    rand: float = 0.0  # uniform [0, 1) drawn by the dispatcher (seeded in tests and the simulator)
    session_id: str = ""
    # The engine that last served this session and when (looked up by the dispatcher; None = no record).
    session_engine: EngineId | None = None
    session_last_used_s: float = 0.0
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    priority: int = 0
    exclude: frozenset[EngineId] = frozenset()  # engines already tried for this request
    # A follow (resuming a migrated request): the output tokens it already holds KV for, so its sequence is
    # prompt_tokens + resumed_tokens long; 0 for a new request.
    resumed_tokens: int = 0
    # KV-cache-aware routing, filled only for a policy that reads them (its `prefix_source`): the prompt's
    # index-block keys (`switchyard.prefix`, 256-token blocks; empty when the gateway has no token ids) and
    # how many of them, from the first, each engine holds (engines holding none are absent).
    prefix_keys: tuple[int, ...] = ()
    prefix_hits: Mapping[EngineId, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ChatTurn:
    role: str
    content: str


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One generation (one choice: the gateway fans `n > 1` out into n of these)."""

    request_id: str
    model: str
    # Exactly one of these three is set.
    messages: tuple[ChatTurn, ...] | None = None
    prompt_text: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    max_tokens: int | None = None  # None = up to the context limit
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    priority: int = 0
    target_output_tokens: int | None = None  # trace replay: the exact output length to produce
    session_id: str = ""


@dataclass(frozen=True, slots=True)
class Admitted:
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class Delta:
    text: str
    token_ids: tuple[int, ...] = ()
    # Tokens this delta represents (upstreams that send no ids count one per chunk).
    num_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Finished:
    finish_reason: Literal["stop", "length", "abort", "error"]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    error_message: str = ""
    queue_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0


@dataclass(frozen=True, slots=True)
class MigrationTicket:
    """A request cut on its engine to resume elsewhere (STAR §5.4), as the gateway carries it: the figures
    the splice decides on, plus the transport's own encoding of the ticket (`encoded`, opaque here) that the
    resuming engine needs."""

    request_id: str  # the id on the source
    source_engine_id: str
    target: str  # the engine id the mover named (the rescheduler's target); "" = anywhere
    output_tokens: int  # tokens the source delivered before the cut (its stream carried every one)
    kv_tokens: int = 0  # tokens whose KV the target pulls instead of recomputing
    kv_bytes: int = 0
    encoded: bytes = b""


@dataclass(frozen=True, slots=True)
class Migrated:
    """Last event of a stream whose request moved (instead of `Finished`): follow it with `ticket`."""

    ticket: MigrationTicket


EngineEvent = Admitted | Delta | Finished  # what a choice's client-facing relay carries
StreamEvent = EngineEvent | Migrated  # what an engine's stream carries (the dispatcher follows `Migrated`)


class EngineUnavailable(Exception):
    """The engine could not be reached or failed before producing anything (safe to retry elsewhere).

    `server_error`: the engine answered with a server-side failure (HTTP 5xx, gRPC INTERNAL) rather than
    being unreachable; outlier detection labels the two apart."""

    def __init__(self, message: str = "", *, server_error: bool = False) -> None:
        super().__init__(message)
        self.server_error = server_error


class EngineStreamError(Exception):
    """The engine failed after the stream began (not retryable without duplicating output). The dispatcher
    sets `engine_id` to the engine that failed."""

    engine_id: EngineId | None = None


class MigrationRefusedError(Exception):
    """The engine would not cut the request (unknown or ended there, not movable faithfully, no migration
    capability); the request keeps running where it is."""


class EngineRequestError(ValueError):
    """The engine rejected the request itself (bad arguments); the API answers 400 and never retries it."""


@dataclass(frozen=True, slots=True)
class KvEvents:
    """An engine's prefix-cache events in one report: index-block keys (`switchyard.prefix`, chained over
    `span_tokens`-token blocks) stored and evicted since the previous report of the stream; `cleared`: forget
    what the engine held before (a resync: `stored` lists all it holds, and `span_tokens` is stated there
    only, for the rest of the stream)."""

    stored: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    cleared: bool = False
    span_tokens: int = 0


@dataclass(frozen=True, slots=True)
class EngineReport:
    """One state report, transport-neutral (the cluster store turns it into an `EngineView`)."""

    engine_id: EngineId
    model: str
    profile: str
    backend: str
    role: str
    seq: int
    engine_timestamp_s: float
    ready: bool
    draining: bool
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_reserved: int
    pending_prefill_tokens: int
    running_batch_tokens: int
    lens: LensState | None = None  # None when the engine does not run LENS
    last_iteration_s: float = 0.0
    # STAR: present only in a push that follows a new prediction round (the store keeps the last ones).
    predictions: tuple[RequestPrediction, ...] = ()
    future_load: FutureLoad | None = None
    combo: str = ""  # the GPU combo the engine belongs to (CAUCHY), from its identity; "" = none
    qoe: QoEReport | None = None  # CascadeInfer: the agent's online QoE fit (None: none yet)
    transfer_bytes_per_s: float = 0.0  # the agent's measured KV pull throughput (0 = none yet)
    # Prefix-cache events since the stream's previous report (None: none new, or the engine sends none).
    kv_events: KvEvents | None = None


@dataclass(frozen=True, slots=True)
class EngineDescription:
    engine_id: EngineId
    model: str
    profile: str
    backend: str
    role: str
    max_context_tokens: int
    block_size: int
    max_num_seqs: int
    kv_bytes_per_token: int = 0  # 0 = the engine did not say
    # The hardware and its price (GetInfo; "" / 0 = unknown), for cost accounting and CAUCHY's planner.
    gpu: str = ""
    tensor_parallel: int = 1
    hourly_price_usd: float = 0.0
