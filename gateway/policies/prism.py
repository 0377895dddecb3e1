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
             R_e = max(P_e - n_e / L_e, 5 % of P_e): the decodes take n_e tokens per iteration.
             f(m) = 1 / (1 + m^k), k = `latency_steepness`: about 1 well inside the SLO, 1/2 at the SLO,
             plummeting beyond it.
  S_load     = 1 / (1 + rho_e / tau), rho_e = (W_e + p) / P_e, the seconds e needs to drain its pending work
             and r's prefill at peak rate (normalising by P_e compares heterogeneous GPUs), tau =
             `load_scale_s`.
  S_capacity = 1 when the engine's KV size is unknown (kv_blocks_total = 0) or D_r = 0; else with
             x = M_e / D_r: 1 - (1 - eps) * exp(-(x - 1) / kappa) when r fits (x >= 1; near 1 once free KV
             is several times the demand, kappa = `capacity_headroom`), and eps * (1 + max(x, 0)) / 2 when it
             does not (x < 1; a hard near-zero, eps = 1e-6, that still ranks the engines with more room
             first).
  S_affinity = 1 when r has no session record or e holds it (features.session_engine), else 1 / beta,
             beta = `affinity_bonus` > 1. (The paper boosts the session's engine to beta and leaves the others
             at 1; dividing every score of the request by beta keeps S in (0, 1] and the same ranking.)

No feasible engine (`decide`): when no candidate's predicted t_first is within T_ttft and L_e within T_tpot,
the score ranks engines that all miss the SLO by how badly, which says little about who serves r best; PRISM
then takes the engine that finishes r soonest (t_first + o * L_e; ties by rand) and says so: the reason
"no_feasible_soonest" (else "scored") travels in the dispatch to `switchyard_policy_picks_total{policy,why}`
and the debug log.
Shedding (`overload = "shed"`, goodput at overload): a new request (resumed_tokens = 0) whose best margin
min_e max(t_first / T_ttft, L_e / T_tpot) exceeds `shed_margin` is shed (`decide` returns no engine and
`base.SHED`, "no_feasible_shed"): the request's life answers `Shed`; live, a 503 `fleet_saturated` with the
admission gate's reason `slo_unattainable` and Retry-After (counted as the routing decision "shed"); in the
simulator a failed request that counts against attainment (over all arrivals: shedding is never free).
Between 1 and `shed_margin` PRISM still serves the soonest (the prediction is a mean; a margin > 1 keeps
requests the engine would likely still serve in time). `pick` never sheds (a follow must land somewhere).

Why the queue terms (issue 17, `benchmarks/prism_diagnose.py`, simulated mixed fleet h100 + a100 + 2 x
a6000x2, LENS on, results/prism_diagnose_*.json/.png): t_first used to count only the prefill tokens ahead at
peak rate. Engines at overload are bound by sequence slots and KV, not prefill: waiting requests enter only as
running ones finish, so the old t_first under-predicted the chosen engine's TTFT by 1.5-2x on the Azure
conversation trace at 60 req/s and by up to 20x on the a6000 pair with ShareGPT at 120 req/s, and the fast
engine's queue ran away (max 333-499 requests on the h100 against 136-260 elsewhere) while it still looked
best. At 60 req/s of Azure conv every engine is past the SLO (92 % of decisions find no feasible engine):
PRISM spreads the overload so every engine misses, while round robin overloads the a6000s and leaves the
h100 and a100 within SLO for their shares (attainment 10 % against 27 %). Pricing the queue does not change
that; goodput there needs deferring or shedding what no engine can serve in time (not built yet).

Constants: `decode_work_tokens` 128, `latency_steepness` 4, `load_scale_s` 4 s, the weights 1 and
`shed_margin` 1.0 were chosen by a one-pass coordinate sweep on the training traces only (ShareGPT and Azure
conv, both fleets of benchmarks/nexussched_repro.py at its two highest loads; Azure code and arXiv held out):
`benchmarks/prism_overload.py sweep`, output benchmarks/prism_sweep.json (mean attainment 0.620 at the earlier
defaults, 0.626 with tau 4 s, 0.723 with shedding at margin 1.0; d 64-512, k 2-8, w_load 0.5-2 and margins
1.25-3 did no better).

Stale state: with age a = state_age_s, confidence c_e = 0.5 ** (max(0, a - fresh_age_s) / stale_half_life_s).
The state part of the log score, s_e = sum of w_i log S_i over latency, load and capacity, is blended toward
the candidates' mean: c_e * s_e + (1 - c_e) * mean(s): an old report says less about the engine, so it is
scored more like a typical engine. (Blending toward 1, "neutral", would instead make an old report of an
overloaded engine attractive.) Engines flagged stale (no report within the store's bound) stay candidates with
c = 0 (their views carry the gateway's local accounting): staleness makes routing less informed, never
refuses a request.
Ties: the highest log score within a relative 1e-12 wins; among tied engines the highest confidence (a fresh
engine beats an older report with the same score); among those, the one at index floor(rand * n) in engine-id
order, so exact ties spread uniformly without favouring the first engine.
Must not: import asyncio, aiohttp, grpc, prometheus or time; keep mutable state.
"""

from __future__ import annotations

import math
from typing import Annotated, ClassVar, Literal, NamedTuple

from pydantic import Field, StrictFloat

from gateway.domain import ClusterSnapshot, EngineId, EngineView, RequestFeatures
from gateway.policies.base import SHED, eligible
from gateway.policies.params import NonNegative, NonNegativeFinite, PolicyParams, PositiveFinite
from gateway.policies.static_weighted import gpu_class_weight

CAPACITY_EPSILON = 1e-6
# exp(-36) ~ 2e-16: past x = 1 + 36 kappa, log S_capacity is below double precision next to the other terms.
CAPACITY_NEGLIGIBLE_EXPONENT = 36.0
TIE_TOLERANCE = 1e-12
SCORED = "scored"  # `PrismPolicy.decide`'s reasons
NO_FEASIBLE = "no_feasible_soonest"
NO_CANDIDATE = "no_candidate"
# Prefill never gets less than this share of P_e (decoding a full batch leaves chunked prefill at least this).
MIN_PREFILL_SHARE = 0.05
_LOG_EPS = math.log(CAPACITY_EPSILON)


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


_RequestTerms = tuple[
    int, int, float, float, float, float, float, float, float, float, EngineId | None, float, int
]


def _request_terms(features: RequestFeatures, params: PrismParams, fallback_peak: float) -> _RequestTerms:
    """What every engine's factors share for one request, computed once per pick."""
    return (
        features.prompt_tokens,
        features.prompt_tokens + features.max_tokens,
        features.slo_ttft_s or params.ttft_slo_ms * 1e-3,
        features.slo_tpot_s or params.tpot_slo_ms * 1e-3,
        params.latency_steepness,
        params.decode_work_tokens,
        params.load_scale_s,
        params.capacity_headroom,
        math.log(params.slo_risk_penalty),
        -math.log(params.affinity_bonus),
        features.session_engine,
        fallback_peak,
        features.max_tokens,
    )


class _Evaluation(NamedTuple):
    state: list[float]  # w_lat log S_latency + w_load log S_load + w_cap log S_capacity
    affinity: list[float]  # w_aff log S_affinity
    confidence: list[float]
    all_fresh: bool


def _evaluate(
    engines: tuple[EngineView, ...],
    terms: _RequestTerms,
    params: PrismParams,
    collect: list[tuple[float, float, float, float]] | None = None,
    timing: list[tuple[float, float, float]] | None = None,
) -> _Evaluation:
    """The weighted log factors and confidence of each engine, by the module docstring (the hot path: one
    loop, everything shared hoisted out of it). `collect` receives the unweighted log factors, `timing` each
    engine's (predicted first-token s, predicted finish s, margin: the larger of t_first / T_ttft and
    L_e / T_tpot, feasible when <= 1)."""
    p, demand_tokens, ttft_s, tpot_s, k, d, load_scale_s, kappa, log_risk, log_other, session, fallback, o = (
        terms
    )
    weights = params.weights
    w_lat, w_load, w_cap, w_aff = weights.latency, weights.load, weights.capacity, weights.affinity
    fresh_age_s, half_life_s = params.fresh_age_s, params.stale_half_life_s
    max_margin = 10.0 ** min(300.0 / k, 300.0)  # m^k <= 1e300: f(m) <= 1e-300, far past any real margin
    roomy = 1.0 + CAPACITY_NEGLIGIBLE_EXPONENT * kappa  # beyond this headroom log S_capacity rounds to 0
    log1p, log, exp = math.log1p, math.log, math.exp
    class_peaks: dict[str, float] = {}  # P_e by profile, for this call only
    state: list[float] = []
    affinity: list[float] = []
    confidence: list[float] = []
    all_fresh = True
    for e in engines:
        lens = e.lens
        if lens is not None:
            peak = lens.peak_throughput_tokens_per_s
            latency_s = lens.predicted_batch_latency_s * (1.0 + lens.prediction_error_ratio)
            work = lens.pending_work_tokens
            free_blocks = lens.effective_free_kv_blocks
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
        # Latency margin: the current batch, the wait for a slot (and KV) behind the requests ahead, then the
        # prefill ahead and r's own at the rate decoding leaves over.
        running = e.num_running
        first_s = latency_s
        if running > 0 and latency_s > 0.0:
            drain_s = d * latency_s / running  # one running request finishes per drain_s
            ahead = e.num_waiting + e.unreported_requests
            slots = e.max_num_seqs - running if e.max_num_seqs > 0 else ahead + 1
            blocked = ahead + 1 - max(slots, 0)
            if e.kv_blocks_total > 0 and demand_tokens > 0:
                short = -(demand_tokens // -block_size) - free_after
                if short > 0:  # completions until r's blocks are free, one running request's blocks each
                    per_request = max((e.kv_blocks_total - e.kv_blocks_free) / running, 1.0)
                    blocked = max(blocked, ahead + math.ceil(short / per_request))
            if blocked > 0:
                first_s += blocked * drain_s
            rate = max(peak - running / latency_s, peak * MIN_PREFILL_SHARE)
        else:
            rate = peak
        first_s += (e.pending_prefill_tokens + unreported_prompt + p) / rate
        m_ttft, m_tpot = first_s / ttft_s, latency_s / tpot_s
        if m_ttft > max_margin or m_tpot > max_margin:  # absurd reports must not overflow m^k
            m_ttft, m_tpot = min(m_ttft, max_margin), min(m_tpot, max_margin)
        log_latency = -log1p(m_ttft**k) - log1p(m_tpot**k)
        if lens is not None and lens.slo_risk:
            log_latency += log_risk
        # Relative load.
        work += unreported_prompt + d * e.unreported_requests + p
        log_load = -log1p(work / peak / load_scale_s)
        # Capacity admission.
        log_capacity = 0.0
        if e.kv_blocks_total > 0 and demand_tokens > 0:
            x = free_after / -(demand_tokens // -block_size)
            if x < 1.0:
                log_capacity = _LOG_EPS + log((1.0 + max(x, 0.0)) * 0.5)
            elif x < roomy:
                log_capacity = log1p((CAPACITY_EPSILON - 1.0) * exp((1.0 - x) / kappa))
        # Session affinity.
        log_affinity = 0.0 if session is None or session == e.engine_id else log_other
        if collect is not None:
            collect.append((log_latency, log_load, log_capacity, log_affinity))
        if timing is not None:
            timing.append((first_s, first_s + o * latency_s, max(m_ttft, m_tpot)))
        state.append(w_lat * log_latency + w_load * log_load + w_cap * log_capacity)
        affinity.append(w_aff * log_affinity)
        # Confidence in the state.
        if e.stale:
            confidence.append(0.0)
            all_fresh = False
        elif e.state_age_s > fresh_age_s:
            confidence.append(0.5 ** ((e.state_age_s - fresh_age_s) / half_life_s))
            all_fresh = False
        else:
            confidence.append(1.0)
    return _Evaluation(state, affinity, confidence, all_fresh)


def factors(
    engine: EngineView,
    features: RequestFeatures,
    snapshot: ClusterSnapshot,
    params: PrismParams | None = None,
) -> Factors:
    """The four scores of `engine` for the request (fallback P_max taken over the snapshot's engines)."""
    params = params if params is not None else PrismParams()
    fallback = fallback_peak_tokens_per_s(snapshot.serving(features.model) or (engine,))
    collected: list[tuple[float, float, float, float]] = []
    _evaluate((engine,), _request_terms(features, params, fallback), params, collected)
    return Factors(*(math.exp(v) for v in collected[0]))


def confidence(engine: EngineView, params: PrismParams | None = None) -> float:
    """c_e of the module docstring (0 for an engine flagged stale)."""
    params = params if params is not None else PrismParams()
    return _evaluate((engine,), _request_terms(_NO_REQUEST, params, 1.0), params).confidence[0]


_NO_REQUEST = RequestFeatures(
    request_id="", model="", prompt_tokens=0, max_tokens=0, now_s=0.0, dispatch_seq=0
)


class PrismPolicy:
    NAME: ClassVar[str] = "prism"

    def __init__(self, params: PrismParams | None = None) -> None:
        self._params = params if params is not None else PrismParams()

    @property
    def params(self) -> PrismParams:
        return self._params

    def candidates(self, features: RequestFeatures, snapshot: ClusterSnapshot) -> tuple[EngineView, ...]:
        """The eligible engines, stale ones included (their confidence is 0: they score the mean)."""
        return eligible(features, snapshot)

    def _totals(
        self, features: RequestFeatures, snapshot: ClusterSnapshot,
        timing: list[tuple[float, float, float]] | None = None,
    ) -> tuple[tuple[EngineView, ...], list[float], list[float]]:
        """(candidates, their log scores, their confidences), in engine-id order; `timing`: `_evaluate`'s."""
        params = self._params
        engines = self.candidates(features, snapshot)
        if not engines:
            return engines, [], []
        terms = _request_terms(features, params, fallback_peak_tokens_per_s(engines))
        state, affinity, conf, all_fresh = _evaluate(engines, terms, params, timing=timing)
        if all_fresh:
            return engines, [s + a for s, a in zip(state, affinity, strict=True)], conf
        mean = math.fsum(state) / len(state)
        totals = [c * s + (1.0 - c) * mean + a for s, a, c in zip(state, affinity, conf, strict=True)]
        return engines, totals, conf

    def scores(
        self, features: RequestFeatures, snapshot: ClusterSnapshot
    ) -> list[tuple[EngineId, float, float]]:
        """(engine, log score, confidence) per candidate, in engine-id order (for tests and diagnostics)."""
        engines, totals, conf = self._totals(features, snapshot)
        return [(e.engine_id, t, c) for e, t, c in zip(engines, totals, conf, strict=True)]

    def timings(
        self, features: RequestFeatures, snapshot: ClusterSnapshot
    ) -> list[tuple[EngineId, float, float, float]]:
        """(engine, predicted first-token s, predicted finish s, margin) per candidate, in engine-id order
        (for tests and diagnostics: what `decide` prices; the engine is feasible when the margin is <= 1)."""
        timing: list[tuple[float, float, float]] = []
        engines, _, _ = self._totals(features, snapshot, timing)
        return [(e.engine_id, *t) for e, t in zip(engines, timing, strict=True)]

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
        timing: list[tuple[float, float, float]] = []
        engines, totals, conf = self._totals(features, snapshot, timing)
        if not engines:
            return None, NO_CANDIDATE
        best_margin = min(margin for _, _, margin in timing)
        if best_margin <= 1.0:
            return self._best(engines, totals, conf, features), SCORED
        if shed and best_margin > self._params.shed_margin and features.resumed_tokens == 0:
            return None, SHED
        soonest = min(finish for _, finish, _ in timing)
        floor = soonest + TIE_TOLERANCE * max(1.0, abs(soonest))
        tied = [i for i, (_, finish, _) in enumerate(timing) if finish <= floor]
        return engines[tied[min(int(features.rand * len(tied)), len(tied) - 1)]].engine_id, NO_FEASIBLE

    @staticmethod
    def _best(engines: tuple[EngineView, ...], totals: list[float], conf: list[float],
              features: RequestFeatures) -> EngineId:
        best = max(totals)
        floor = best - TIE_TOLERANCE * max(1.0, abs(best))
        tied = [i for i, t in enumerate(totals) if t >= floor]
        if len(tied) > 1:
            top = max(conf[i] for i in tied)
            tied = [i for i in tied if conf[i] == top]
        return engines[tied[min(int(features.rand * len(tied)), len(tied) - 1)]].engine_id
