"""PRISM: NexusSched's predictive router (paper §5.2, Eq. 9), a product of four scores per engine.

Owns: `PrismPolicy`, its parameters `PrismParams` / `PrismWeights`, the P_e fallbacks
(`fallback_peak_tokens_per_s`, `class_peak_tokens_per_s`), and `factors` / `confidence` (one engine's four
scores and staleness confidence, for tests and diagnostics; `pick` runs the same code).

score(e, r) = S_latency^w_lat * S_load^w_load * S_capacity^w_cap * S_affinity^w_aff; the engine with the
highest score wins. Every S is in (0, 1]; a weight of 0 switches its factor off (S^0 = 1). Computed as a sum
of logarithms.

State of engine e (Eq. 8 when the engine runs LENS, `EngineView.has_lens`, i.e. it reports P_max > 0;
otherwise the fallback named after each figure, from what every engine reports):
  P_e = P_max; fallback: the median P_max of the candidate engines that report one; when none does,
        `default_peak_tokens_per_s` (an H100's figure) times the relative GPU class weight of the engine's
        profile (`static_weighted.gpu_class_weight`: e.g. about 0.44 for an A100, 2 x 0.19 for a6000x2), or
        times 1 for an unknown class.
  L_e = L-hat * (1 + prediction_error_ratio) (pessimistic by the model's recent error); fallback: the
        engine's last iteration time while it has requests (running + waiting > 0), else 0.
  Q_e = pending_prefill_tokens + unreported_prompt_tokens: prompt tokens ahead of r (reported by all engines).
  W_e = W + unreported_prompt_tokens + d * unreported_requests; fallback for W:
        pending_prefill_tokens + d * (num_running + num_waiting), d = `decode_work_tokens` (decode work
        assumed per queued request).
  M_e = M_free - ceil(unreported_tokens / block_size); fallback for M_free:
        kv_blocks_free - kv_blocks_reserved (blocks the queued prompts will take).
  The `unreported_*` terms are the optimistic in-flight accounting: requests this gateway sent since the
  engine's last report, so a burst does not herd onto the engine that looked best in that report.
Request r: p = prompt_tokens (estimate), o = max_tokens, T_ttft / T_tpot = the request's SLOs (headers or
gateway defaults), else `ttft_slo_ms` / `tpot_slo_ms`; D_r = ceil((p + o) / block_size) KV blocks.

Factors:
  S_latency  = f(t_first / T_ttft) * f(L_e / T_tpot) * (slo_risk_penalty if the engine reports slo_risk),
             t_first = L_e + A_e + (Q_e + p) / R_e: wait for the current batch, then for a place in it (A_e),
             then prefill what is ahead and r itself at the rate decoding leaves over (the queueing +
             prefill part of TTFT); L_e is also the time per output token of the batch r joins.
             A_e: with n_e running requests one finishes every d L_e / n_e s (d = `decode_work_tokens`, the
             decode steps a running request has left, on average); r needs b_e completions, b_e = the
             requests ahead of it (waiting + dispatched since the report) + 1 - free sequence slots
             (max_num_seqs - n_e), or, when M_e is short of D_r, the requests ahead + the completions whose
             blocks (used KV / n_e each) cover the shortfall, whichever is more; A_e = 0 on an idle engine.
             R_e = the prefill rate the engine's LENS reports while it plans the batches
             (`LensState.prefill_tokens_per_s`: measured over recent iterations with prefill pending), else
             max(P_e - n_e / L_e, 5 % of P_e): the decodes take n_e tokens per iteration. (LENS's TTFT-bound
             targets can plan iterations so short that prefill crawls; priced at P_e, PRISM sent 75 % of the
             Azure conv trace at its own rate to such an H100, TTFT 0.45 s against 0.05 s predicted, issue
             17.)
             f(m) = 1 / (1 + m^k), k = `latency_steepness`: about 1 well inside the SLO, 1/2 at the SLO,
             plummeting beyond it.
  S_load     = 1 / (1 + rho_e / tau), rho_e = (W_e + p) / P_e, the seconds e needs to drain its pending work
             and r's prefill at peak rate (normalising by P_e compares heterogeneous GPUs), tau =
             `load_scale_s`. When LENS grants a prefill rate, the prefill part drains at it instead:
             rho_e = max(W_e - Q_e, 0) / P_e + (Q_e + p) / R_e.
  S_capacity = 1 when the engine's KV size is unknown (kv_blocks_total = 0) or D_r = 0; else with
             x = M_e / D_r: 1 - (1 - eps) * exp(-(x - 1) / kappa) when r fits (x >= 1; near 1 once free KV
             is several times the demand, kappa = `capacity_headroom`), and eps * (1 + max(x, 0)) / 2 when it
             does not (x < 1; a hard near-zero, eps = 1e-6, that still ranks the engines with more room
             first).
  S_affinity = 1 when r has no session record or e holds it (features.session_engine), else 1 / beta,
             beta = `affinity_bonus` > 1. (The paper boosts the session's engine to beta and leaves the others
             at 1; dividing every score of the request by beta keeps S in (0, 1] and the same ranking.)
Prefix (`prefix`, issue 18: the affinity factor generalised from sessions to any shared prefix): with the
  engines' KV events looked up (`prefix_source` "events"; `RequestFeatures.prefix_hits`), c_e =
  min(indexed_tokens(hits_e), p) prompt tokens are cached on e, so e prefills only p_e = max(p - c_e, 1)
  of them: p_e replaces p in t_first and rho_e (the cached prefix is priced as the prefill time it saves),
  and S_affinity = beta^(f_e - 1) with the overlap share f_e = c_e / p (1 on the session's engine): 1 for a
  fully cached prompt, 1 / beta for none, the session rule's two values at its two ends.

No feasible engine (`decide`): when no candidate's predicted t_first is within T_ttft and L_e within T_tpot,
the score ranks engines that all miss the SLO by how badly, which says little about who serves r best; PRISM
then takes the engine that finishes r soonest (t_first + o * L_e; ties by rand) and says so: the reason
"no_feasible_soonest" (else "scored") travels in the dispatch to `switchyard_policy_picks_total{policy,why}`
and the debug log.
Shedding (`overload = "shed"`, goodput at overload): a new request (resumed_tokens = 0) whose best margin
min_e max(t_first / T_ttft, L_e / T_tpot) exceeds `shed_margin` while every candidate is busy (requests queued
ahead of r, waiting or dispatched since the report, or a batch already past the TPOT margin on its own, L_e /
T_tpot > `shed_margin`: the fleet is overloaded, not merely slow for this request) is shed (`decide` returns
no engine and `base.SHED`, "no_feasible_shed"): the request's life answers `Shed`; live, a 503
`fleet_saturated` with the admission gate's reason `slo_unattainable` and Retry-After (counted as the routing
decision "shed"); in the simulator a failed request that counts against attainment (over all arrivals:
shedding is never free). Between 1 and `shed_margin` PRISM still serves the soonest (the prediction is a mean;
a margin > 1 keeps requests the engine would likely still serve in time). `pick` never sheds (a follow must
land somewhere).
Why the busy condition (issue 17): an engine with nothing queued and a batch within the TPOT is not where
capacity is short, and the TTFT margin there is least certain. LENS at low load plans iterations that put TTFT
at its SLO on purpose (Eq. 7's TTFT boundary; since aimed at a quarter of it, `TargetConfig.ttft_aim`, which
took that cell from 0.874 to 0.979 with shedding) and reports the slow prefill rate of those plans, so PRISM
predicted misses the engines would not have had: shedding without the condition cost 29 % of the Azure
conversation trace at its own rate on the mixed fleet (attainment 0.709 against 0.999 for round robin) and
22 % of arXiv-length requests at 10 req/s. The queue alone (without the TPOT part) kept too many requests on
the training cells at overload (mean 0.642 against 0.675 on five ShareGPT / Azure conv points).

Why the queue terms (issue 17, `benchmarks/prism_diagnose.py`, simulated mixed fleet h100 + a100 + 2 x
a6000x2, LENS on, results/prism_diagnose_*.json/.png): t_first used to count only the prefill tokens ahead at
peak rate. Engines at overload are bound by sequence slots and KV, not prefill: waiting requests enter only as
running ones finish, so the old t_first under-predicted the chosen engine's TTFT by 1.5-2x on the Azure
conversation trace at 60 req/s and by up to 20x on the a6000 pair with ShareGPT at 120 req/s, and the fast
engine's queue ran away (max 333-499 requests on the h100 against 136-260 elsewhere) while it still looked
best. At 60 req/s of Azure conv every engine is past the SLO (92 % of decisions find no feasible engine):
PRISM spreads the overload so every engine misses, while round robin overloads the a6000s and leaves the
h100 and a100 within SLO for their shares (attainment 10 % against 27 %). Pricing the queue does not change
that; goodput there needs shedding what no engine can serve in time (`overload = "shed"`).
At low load (the same fleet, Azure conv at its own 5.5 req/s) PRISM + LENS attained 94 % against round
robin's 99.9 %: LENS's TTFT-bound target (learnt from a TTFT-TPOT line that promises short TTFTs at any TPOT)
plans the h100 to 8 ms iterations, and a decode-only batch within 5 % of that target ends Algorithm 1's search
before any waiting request is admitted, so prefill crawled (a median 125 tokens/s with requests waiting,
against a P_max of 42,000). Priced at P_max, that h100 looked 10x faster than it was and took 75 % of the
requests (predicted TTFT 0.05 s, actual 0.45 s). With the prefill rate LENS measures priced instead
(t_first and the load factor), its share fell to 39 % and attainment rose to 97 %; the rest is LENS's
starvation itself, which routing cannot undo (results/prism_diagnose_*.json).

Why P_e is LENS's full-iteration rate (issue 17, same benchmarks, arXiv lengths at 10 req/s on the mixed
fleet): the second A6000 pair's latency model reported Eq. 2's Pmax / ws, 9.4e3 tokens/s at first and then up
to 9.7e8 as refits traded Pmax against kS while still predicting its iterations within 2 %. PRISM divides
work by P_e, so that engine looked idle: it took 26 % of the requests, got them 11x later than predicted and
served 17 % of them within SLO (attainment 0.784 against least loaded's 1.000). LENS now reports the rate a
full iteration reaches (`engine_agent.lens.planner.peak_tokens_per_s`), the same for every fit that predicts
the same iterations; with it PRISM attained 1.000 there.

Constants: `decode_work_tokens` 128, `latency_steepness` 4, `load_scale_s` 4 s, the weights 1 and
`shed_margin` 1.0 come from a one-pass coordinate sweep on the training traces only (ShareGPT and Azure conv,
both fleets of benchmarks/nexussched_repro.py at its two highest loads: 12 points; Azure code and arXiv held
out): `benchmarks/prism_overload.py sweep`, output benchmarks/prism_sweep.json. A value replaces the default
only when it gains more than 0.005 mean attainment (about the binomial standard error of the 12-point mean).
Last run on the code of issue 17's end (P_e as LENS's full-iteration rate, shedding only in a busy fleet, the
compiled kernel, LENS's `ttft_aim` 0.25; 1,130 s on two cores): mean attainment 0.321 at the defaults,
0.293-0.321 over d 64-512, k 2-8, tau 0.25-4 s and w_load 0.5-2 (d 512 0.3213 against d 128's 0.3211: within
the margin), and 0.589 with shedding at margin 1.0 (0.325-0.383 at margins 1.25-3). Three earlier runs, each
on the code of its day, chose the same values.

Stale state: with age a = `ClusterSnapshot.state_age_s(view)`, confidence
c_e = 0.5 ** (max(0, a - fresh_age_s) / stale_half_life_s).
The state part of the log score, s_e = sum of w_i log S_i over latency, load and capacity, is blended toward
the candidates' mean: c_e * s_e + (1 - c_e) * mean(s): an old report says less about the engine, so it is
scored more like a typical engine. (Blending toward 1, "neutral", would instead make an old report of an
overloaded engine attractive.) Engines flagged stale (no report within the store's bound) stay candidates with
c = 0 (their views carry the gateway's local accounting): staleness makes routing less informed, never
refuses a request.
Ties: the highest log score within a relative 1e-12 wins; among tied engines the highest confidence (a fresh
engine beats an older report with the same score); among those, the one at index floor(rand * n) in engine-id
order, so exact ties spread uniformly without favouring the first engine.
Cost (issue 17, benchmarks/prism_pick_cost.py): the request-independent terms of every candidate (P_e, L_e,
W_e, M_e, A_e without a KV shortfall, R_e, ...) are the rows of one array (`_Table`), built from the views
alone; the policy keeps the last table per model and rebuilds only the rows whose views are new objects (the
cluster state reuses the view of an engine nothing happened to, so after a dispatch one row changes). The
arithmetic over the rows is `prism_kernel`, compiled by numba: one call a decision. As about 40 numpy calls it
cost 29-32 us at 64 engines (numpy's fixed cost per call, 0.3-1 us, whatever the row count); compiled, a
decision costs 14.5 us at 64 engines, most of it patching the rows of the 2-3 engines that changed, and about
100 us at 1,024 (p99 17.5 and 147 us with the gateway's collector settings; targets 20 and 200;
docs/performance.md). The kernel loads on the first PrismPolicy (numba's import and the cached machine code:
about 0.5 s), not with this module; the gateway app imports it at start.
Must not: import asyncio, aiohttp, grpc, prometheus or time; keep mutable state other than that memo (a
function of the views: it never changes a decision).
"""

from __future__ import annotations

import math
from itertools import compress, count
from operator import is_not
from typing import Annotated, ClassVar, Literal, NamedTuple

import numpy as np
from pydantic import Field, StrictFloat

from gateway.domain import PREFIX_EVENTS, ClusterSnapshot, EngineId, EngineView, RequestFeatures
from gateway.policies.base import SHED, eligible
from gateway.policies.params import NonNegative, NonNegativeFinite, PolicyParams, PositiveFinite
from gateway.policies.static_weighted import gpu_class_weight
from switchyard.prefix import indexed_tokens

CAPACITY_EPSILON = 1e-6
TIE_TOLERANCE = 1e-12
SCORED = "scored"  # `PrismPolicy.decide`'s reasons
NO_FEASIBLE = "no_feasible_soonest"
NO_CANDIDATE = "no_candidate"
# Prefill never gets less than this share of P_e (decoding a full batch leaves chunked prefill at least this).
MIN_PREFILL_SHARE = 0.05


class PrismWeights(PolicyParams):
    """The exponents w_i of Eq. 9: each >= 0 and finite (0 switches the factor off)."""

    latency: NonNegativeFinite = 1.0
    load: NonNegativeFinite = 1.0
    capacity: NonNegativeFinite = 1.0
    affinity: NonNegativeFinite = 1.0


class PrismParams(PolicyParams):
    """PRISM's parameters (symbols of the module docstring); bounds are field constraints."""

    weights: PrismWeights = Field(default_factory=PrismWeights)
    ttft_slo_ms: PositiveFinite = 2000.0  # used when the request carries no TTFT SLO
    tpot_slo_ms: PositiveFinite = 50.0  # used when the request carries no TPOT SLO
    latency_steepness: PositiveFinite = 4.0  # k
    load_scale_s: PositiveFinite = 4.0  # tau
    capacity_headroom: PositiveFinite = 1.0  # kappa
    affinity_bonus: Annotated[StrictFloat, Field(ge=1, allow_inf_nan=False)] = 1.5  # beta
    decode_work_tokens: NonNegativeFinite = 128.0  # d
    default_peak_tokens_per_s: PositiveFinite = 20_000.0  # P_e of an H100-class engine without LENS
    fresh_age_s: NonNegative = 0.25  # +inf: never blend
    stale_half_life_s: PositiveFinite = 1.0
    slo_risk_penalty: Annotated[StrictFloat, Field(gt=0, le=1)] = 0.5
    overload: Literal["soonest", "shed"] = "soonest"  # what `decide` does when no engine is feasible
    prefix: bool = False  # price the cached prompt prefix (KV events) in latency, load and affinity
    shed_margin: Annotated[StrictFloat, Field(ge=1, allow_inf_nan=False)] = 1.0


class Factors(NamedTuple):
    latency: float
    load: float
    capacity: float
    affinity: float


def fallback_peak_tokens_per_s(engines: tuple[EngineView, ...]) -> float:
    """P_e for engines without LENS: the median P_max reported by `engines`, 0.0 when none reports one (then
    each engine's P_e comes from its GPU class, see `class_peak_tokens_per_s`)."""
    reported = sorted(e.lens.peak_throughput_tokens_per_s for e in engines if e.lens is not None)
    if not reported:
        return 0.0
    mid = len(reported) // 2
    return reported[mid] if len(reported) % 2 else 0.5 * (reported[mid - 1] + reported[mid])


def class_peak_tokens_per_s(profile: str, params: PrismParams) -> float:
    """P_e of an engine without LENS in a fleet where none reports P_max: by the profile's GPU class."""
    return params.default_peak_tokens_per_s * (gpu_class_weight(profile) or 1.0)


TABLE_COLUMNS: tuple[str, ...] = (  # a row of `_Table` (`prism_kernel` reads them by position)
    "latency",  # L_e
    "first_base",  # L_e + A_e (without a KV shortfall) + Q_e / R_e: t_first before r's own prefill
    "inv_rate",  # 1 / R_e (1 / P_e when no batch runs)
    "load_base",  # rho_e without r, over tau
    "inv_peak_scaled",  # r's prompt tokens' share of rho_e over tau: 1 / (tau R_e) if LENS grants R_e,
    # else 1 / (tau P_e)
    "free_kv",  # M_e (free KV once the unreported dispatches land) where the KV size is known, else +inf
    "kv_wait_free",  # M_e where a KV shortfall makes r wait (a batch runs), else +inf
    "block_size",
    "drain",  # seconds per completion (0 when no batch runs)
    "ahead",  # requests ahead of r
    "blocked_slots",  # completions r waits for a sequence slot, floored at 0
    "per_request",  # KV blocks one completion frees
    "risk",  # log(slo_risk_penalty) when the engine reports slo_risk, else 0
    "reported_at",  # when its report arrived
    "stale",  # 1 when flagged stale
)


class _Table:
    """The request-independent terms of a tuple of candidate engines: one row per engine (in the tuple's
    order) of a column-major array `data`, for one `PrismParams` and fallback P_e; `prism_kernel` reads the
    columns by position (`TABLE_COLUMNS` names them, in its order). A row is a function of its view alone
    (`_row`), so a table can be kept while its views are the same objects and patched where some are not
    (`PrismPolicy._table`): the cluster state reuses the view of an engine nothing happened to, so after a
    dispatch one row changes.
    """

    __slots__ = ("views", "fallback", "data", "all_lens", "_index_of")

    def __init__(self, views: tuple[EngineView, ...], params: PrismParams, fallback: float) -> None:
        self.views, self.fallback = views, fallback
        class_peaks: dict[str, float] = {}
        rows = np.array([_row(e, params, fallback, class_peaks) for e in views], dtype=np.float64)
        self.data = np.asfortranarray(rows.reshape(len(views), len(TABLE_COLUMNS)))  # contiguous columns
        self.all_lens = all(e.lens is not None for e in views)  # the fallback P_e is unused
        self._index_of: dict[EngineId, int] | None = None

    def patch(self, positions: list[int], views: tuple[EngineView, ...], params: PrismParams) -> None:
        """Rebuild the rows at `positions` from `views` (the new candidates: the same engines in the same
        order)."""
        class_peaks: dict[str, float] = {}
        data, fallback = self.data, self.fallback
        for i in positions:
            view = views[i]
            data[i] = _row(view, params, fallback, class_peaks)
            if view.lens is None:
                self.all_lens = False
        self.views = views

    def index_of(self, engine_id: EngineId) -> int:
        """The row of `engine_id` (-1: not a candidate); rows keep their engines while the table lives."""
        if self._index_of is None:
            self._index_of = {e.engine_id: i for i, e in enumerate(self.views)}
        return self._index_of.get(engine_id, -1)


_INF = math.inf
_EMPTY = np.empty(0)  # an absent per-row array for the kernel


def _max_margin(params: PrismParams) -> float:
    return float(10.0 ** min(300.0 / params.latency_steepness, 300.0))  # m^k <= 1e300: f(m) <= 1e-300


def _row(e: EngineView, params: PrismParams, fallback: float,
         class_peaks: dict[str, float]) -> tuple[float, ...]:
    """One engine's `TABLE_COLUMNS`, by the module docstring (`class_peaks`: P_e by profile, a memo)."""
    d = params.decode_work_tokens
    lens = e.lens
    granted = 0.0  # the prefill rate LENS's plans leave a new request (0: it does not plan)
    if lens is not None:
        peak = lens.peak_throughput_tokens_per_s
        latency_s = lens.predicted_batch_latency_s * (1.0 + lens.prediction_error_ratio)
        work = lens.pending_work_tokens
        free_blocks = lens.effective_free_kv_blocks
        granted = lens.prefill_tokens_per_s
    else:
        if fallback > 0.0:
            peak = fallback
        else:
            by_class = class_peaks.get(e.profile)
            if by_class is None:
                by_class = class_peaks[e.profile] = class_peak_tokens_per_s(e.profile, params)
            peak = by_class
        queued = e.num_running + e.num_waiting
        latency_s = e.last_iteration_s if queued > 0 else 0.0
        work = e.pending_prefill_tokens + d * queued
        free_blocks = e.kv_blocks_free - e.kv_blocks_reserved
    unreported_prompt = e.unreported_prompt_tokens
    block_size = e.block_size if e.block_size > 0 else 16
    free_after = free_blocks + e.unreported_tokens // -block_size  # KV left once the unreported land
    has_kv = e.kv_blocks_total > 0
    running = e.num_running
    ahead = e.num_waiting + e.unreported_requests
    active = running > 0 and latency_s > 0.0
    if active:
        drain_s = d * latency_s / running  # one running request finishes per drain_s
        slots = e.max_num_seqs - running if e.max_num_seqs > 0 else ahead + 1
        blocked = max(ahead + 1 - max(slots, 0), 0)
        per_request = max((e.kv_blocks_total - e.kv_blocks_free) / running, 1.0)
        rate = max(peak - running / latency_s, peak * MIN_PREFILL_SHARE)
    else:
        drain_s, blocked, per_request, rate = 0.0, 0, 1.0, peak
    if granted > 0.0:
        rate = granted
    ahead_prefill = e.pending_prefill_tokens + unreported_prompt
    pending = work + unreported_prompt + d * e.unreported_requests
    if granted > 0.0:  # prefill drains at the granted rate, the rest of the work at peak
        inv_prefill = 1.0 / granted
        load_s = max(pending - ahead_prefill, 0.0) / peak + ahead_prefill * inv_prefill
    else:
        inv_prefill = 1.0 / peak
        load_s = pending * inv_prefill
    inv_tau = 1.0 / params.load_scale_s
    return (
        latency_s,
        latency_s + blocked * drain_s + ahead_prefill / rate,
        1.0 / rate,
        load_s * inv_tau,
        inv_prefill * inv_tau,
        free_after if has_kv else _INF,
        free_after if has_kv and active else _INF,
        block_size,
        drain_s,
        ahead,
        blocked,
        per_request,
        math.log(params.slo_risk_penalty) if lens is not None and lens.slo_risk else 0.0,
        e.reported_at_s,
        1.0 if e.stale else 0.0,
    )


class _Request(NamedTuple):
    """r as the kernel takes it (`prompt_rows` and `overlap` empty unless `prefix` priced them)."""

    prompt: float  # p
    demand_tokens: float  # p + o
    output: float  # o
    ttft_s: float
    tpot_s: float
    session: EngineId | None
    prompt_rows: np.ndarray = _EMPTY  # with `prefix`, per row: the prompt tokens the engine does not hold
    overlap: np.ndarray = _EMPTY  # with `prefix`, per row: the share of the prompt the engine holds


def _request(features: RequestFeatures, params: PrismParams) -> _Request:
    return _Request(float(features.prompt_tokens), float(features.prompt_tokens + features.max_tokens),
                    float(features.max_tokens),
                    features.slo_ttft_s or params.ttft_slo_ms * 1e-3,
                    features.slo_tpot_s or params.tpot_slo_ms * 1e-3, features.session_engine)


def _with_prefix(r: _Request, views: tuple[EngineView, ...], features: RequestFeatures) -> _Request:
    """r with `prefix`: per row, the uncached prompt tokens (at least 1, the token the engine recomputes, as
    vLLM does for a fully cached prompt) and the overlap share, the session's engine counting as a full
    hit."""
    p = features.prompt_tokens
    hits = features.prefix_hits
    if p <= 0 or (not hits and r.session is None):
        return r
    cached = np.array([min(indexed_tokens(hits.get(e.engine_id, 0)), p) for e in views], dtype=np.float64)
    overlap = cached * (1.0 / p)
    if r.session is not None:
        overlap = np.where(np.array([e.engine_id == r.session for e in views]), 1.0, overlap)
    return r._replace(prompt_rows=np.maximum(p - cached, 1.0), overlap=overlap)



def _constants(params: PrismParams) -> np.ndarray:
    from gateway.policies import prism_kernel as kernel  # noqa: PLC0415  (numba: loaded on first use)
    weights = params.weights
    return kernel.constants(params.latency_steepness, _max_margin(params), params.capacity_headroom,
                            weights.latency, weights.load, weights.capacity,
                            weights.affinity * math.log(params.affinity_bonus), params.stale_half_life_s,
                            params.shed_margin)


def _terms(table: _Table, r: _Request, consts: np.ndarray) -> np.ndarray:
    """`prism_kernel.terms` of the table's rows for r."""
    from gateway.policies import prism_kernel as kernel  # noqa: PLC0415  (numba: loaded on first use)
    result: np.ndarray = kernel.terms(table.data, r.prompt_rows, r.prompt, r.demand_tokens, 1.0 / r.ttft_s,
                                      1.0 / r.tpot_s, consts)
    return result


def _session_index(table: _Table, r: _Request) -> int:
    return table.index_of(r.session) if r.session is not None else -1


def _scores(table: _Table, r: _Request, now_s: float, params: PrismParams,
            consts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(log scores, confidences) of the table's rows for r."""
    from gateway.policies import prism_kernel as kernel  # noqa: PLC0415  (numba: loaded on first use)
    conf = np.empty(len(table.views))
    blend = kernel.confidence(table.data, now_s - params.fresh_age_s, params.stale_half_life_s, conf)
    scores = kernel.totals(_terms(table, r, consts), conf, blend, r.overlap, r.session is not None,
                           _session_index(table, r), consts)
    return scores, conf


def factors(
    engine: EngineView,
    features: RequestFeatures,
    snapshot: ClusterSnapshot,
    params: PrismParams | None = None,
) -> Factors:
    """The four scores of `engine` for the request (fallback P_max taken over the snapshot's engines)."""
    from gateway.policies import prism_kernel as kernel  # noqa: PLC0415  (numba: loaded on first use)
    params = params if params is not None else PrismParams()
    fallback = fallback_peak_tokens_per_s(snapshot.serving(features.model) or (engine,))
    table = _Table((engine,), params, fallback)
    r = _request(features, params)
    if params.prefix:
        r = _with_prefix(r, (engine,), features)
    t = _terms(table, r, _constants(params))
    affinity = 0.0
    if len(r.overlap):
        affinity = math.log(params.affinity_bonus) * (float(r.overlap[0]) - 1.0)
    elif r.session is not None and r.session != engine.engine_id:
        affinity = -math.log(params.affinity_bonus)
    logs = (float(t[kernel.T_LATENCY, 0]), float(t[kernel.T_LOAD, 0]), float(t[kernel.T_CAPACITY, 0]),
            affinity)
    return Factors(*(math.exp(v) for v in logs))


def confidence(engine: EngineView, now_s: float, params: PrismParams | None = None) -> float:
    """c_e of the module docstring at snapshot time `now_s` (0 for an engine flagged stale)."""
    from gateway.policies import prism_kernel as kernel  # noqa: PLC0415  (numba: loaded on first use)
    params = params if params is not None else PrismParams()
    conf = np.empty(1)
    kernel.confidence(_Table((engine,), params, 1.0).data, now_s - params.fresh_age_s,
                      params.stale_half_life_s, conf)
    return float(conf[0])


class PrismPolicy:
    NAME: ClassVar[str] = "prism"

    def __init__(self, params: PrismParams | None = None) -> None:
        from gateway.policies import prism_kernel as kernel  # noqa: PLC0415  (numba: loaded on first use)

        self._params = params if params is not None else PrismParams()
        self._consts = _constants(self._params)
        self._kernel = kernel
        self.prefix_source = PREFIX_EVENTS if self._params.prefix else None  # `base.prefix_source`
        # model -> the last candidates' table: request-independent terms, patched where views changed. A memo
        # only (it never changes a decision: the rows are a function of the views).
        self._tables: dict[str, _Table] = {}

    @property
    def params(self) -> PrismParams:
        return self._params

    def candidates(self, features: RequestFeatures, snapshot: ClusterSnapshot) -> tuple[EngineView, ...]:
        """The eligible engines, stale ones included (their confidence is 0: they score the mean)."""
        return eligible(features, snapshot)

    def _table(self, features: RequestFeatures, engines: tuple[EngineView, ...]) -> _Table:
        """The candidates' table: the memo when it holds the same engines, patched where views changed."""
        params = self._params
        if features.exclude:  # a retry's candidates: rare, not worth a memo slot
            return _Table(engines, params, fallback_peak_tokens_per_s(engines))
        table = self._tables.get(features.model)
        if table is not None and len(table.views) == len(engines):
            old = table.views
            if engines is old:
                return table
            changed = list(compress(count(), map(is_not, engines, old)))
            if not changed:
                table.views = engines
                return table
            if len(changed) * 4 <= len(engines) and all(
                    engines[i].engine_id == old[i].engine_id for i in changed):
                if (table.all_lens and all(engines[i].lens is not None for i in changed)) or (
                        fallback_peak_tokens_per_s(engines) == table.fallback):
                    table.patch(changed, engines, params)
                    return table
        table = _Table(engines, params, fallback_peak_tokens_per_s(engines))
        if len(self._tables) >= 64 and features.model not in self._tables:
            self._tables.clear()
        self._tables[features.model] = table
        return table

    def _evaluate(self, features: RequestFeatures, snapshot: ClusterSnapshot) -> tuple[_Table, _Request]:
        table = self._table(features, self.candidates(features, snapshot))
        r = _request(features, self._params)
        if self._params.prefix and table.views:
            r = _with_prefix(r, table.views, features)
        return table, r

    def scores(
        self, features: RequestFeatures, snapshot: ClusterSnapshot
    ) -> list[tuple[EngineId, float, float]]:
        """(engine, log score, confidence) per candidate, in engine-id order (for tests and diagnostics)."""
        table, r = self._evaluate(features, snapshot)
        if not table.views:
            return []
        totals, conf = _scores(table, r, snapshot.taken_at_s, self._params, self._consts)
        return list(zip((e.engine_id for e in table.views), totals.tolist(), conf.tolist(), strict=True))

    def timings(
        self, features: RequestFeatures, snapshot: ClusterSnapshot
    ) -> list[tuple[EngineId, float, float, float]]:
        """(engine, predicted first-token s, predicted finish s, margin) per candidate, in engine-id order
        (for tests and diagnostics: what `decide` prices; the engine is feasible when the margin is <= 1)."""
        table, r = self._evaluate(features, snapshot)
        if not table.views:
            return []
        kernel = self._kernel
        t = _terms(table, r, self._consts)
        first = t[kernel.T_FIRST]
        finish = first + r.output * table.data[:, kernel.LATENCY]
        return [(e.engine_id, f, d, m) for e, f, d, m in zip(
            table.views, first.tolist(), finish.tolist(), t[kernel.T_MARGIN].tolist(), strict=True)]

    def pick(self, features: RequestFeatures, snapshot: ClusterSnapshot) -> EngineId | None:
        return self._decide(features, snapshot, shed=False)[0]

    def decide(self, features: RequestFeatures, snapshot: ClusterSnapshot) -> tuple[EngineId | None, str]:
        """The pick and why: "scored" (the highest score), "no_feasible_soonest" when no candidate meets the
        request's TTFT and TPOT (predicted) and the one that finishes it soonest is taken instead, or (None,
        "no_feasible_shed") when `overload` is "shed", the request is new and no candidate is within
        `shed_margin` of its SLO."""
        return self._decide(features, snapshot, shed=self._params.overload == "shed")

    def _decide(self, features: RequestFeatures, snapshot: ClusterSnapshot,
                *, shed: bool) -> tuple[EngineId | None, str]:
        table, r = self._evaluate(features, snapshot)
        views = table.views
        if not views:
            return None, NO_CANDIDATE
        kernel = self._kernel
        row, why = kernel.decide(
            table.data, r.prompt_rows, r.prompt, r.demand_tokens, r.output, 1.0 / r.ttft_s, 1.0 / r.tpot_s,
            r.overlap, r.session is not None, _session_index(table, r),
            snapshot.taken_at_s - self._params.fresh_age_s, features.rand,
            shed and features.resumed_tokens == 0, self._consts)
        if why == kernel.SHED:
            return None, SHED
        return views[row].engine_id, SCORED if why == kernel.SCORED else NO_FEASIBLE
