"""PRISM (NexusSched Eq. 9): each factor's formula, their product, stale state, ties, and the SLO headers that
feed it. Table-driven over hand-made snapshots with exact expectations."""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Iterator
from typing import Any

import pytest
from builders import MODEL, NOW_S, engine, features, lens_state, snapshot
from fake_engines import FakeEngine, ok_script, serving

from gateway.cluster.state import ClusterState
from gateway.domain import ClusterSnapshot, EngineId, EngineReport, EngineView, RequestFeatures
from gateway.policies.prism import (
    CAPACITY_EPSILON,
    PrismParams,
    PrismPolicy,
    PrismWeights,
    class_peak_tokens_per_s,
    confidence,
    factors,
)
from gateway.policies.registry import make_policy
from gateway.policies.static_weighted import GPU_CLASS_WEIGHTS

P = PrismParams()  # defaults: T_ttft 2 s, T_tpot 50 ms, k 4, tau 4 s, kappa 1, beta 1.5, d 128, P 20k tok/s
TAU = P.load_scale_s


def f(m: float, k: float = 4.0) -> float:
    return 1.0 / (1.0 + m**k)


def only(view: EngineView, feats: RequestFeatures | None = None, params: PrismParams = P) -> Any:
    return factors(view, feats or features(), snapshot(view), params)


# ---- each factor's formula ---------------------------------------------------------------------------------

LENS = {"peak_throughput_tokens_per_s": 10_000.0}


@pytest.mark.parametrize(
    ("case", "view_fields", "feat_fields", "expected"),
    [
        ("idle engine, no LENS: L = 0", {}, {}, f(100 / 20_000 / 2.0)),
        (
            "busy, no LENS: L = last iteration, prefill ahead at the default P",
            {"num_running": 2, "last_iteration_s": 0.05, "pending_prefill_tokens": 1900},
            {},
            # prefill runs at P less the decodes' 2 tokens per 50 ms iteration
            f((0.05 + 2000 / (20_000 - 2 / 0.05)) / 2.0) * f(0.05 / 0.05),
        ),
        (
            "a full engine: r waits for a slot behind the queue, one finishing every d L / running",
            LENS | {"predicted_batch_latency_s": 0.02, "num_running": 4, "max_num_seqs": 4, "num_waiting": 2},
            {},
            f((0.02 + 3 * 128 * 0.02 / 4 + 100 / (10_000 - 4 / 0.02)) / 2.0) * f(0.02 / 0.05),
        ),
        (
            "dispatches since the report queue for slots too",
            LENS | {"predicted_batch_latency_s": 0.02, "num_running": 4, "max_num_seqs": 5,
                    "unreported_requests": 3, "unreported_prompt_tokens": 300},
            {},
            f((0.02 + 3 * 128 * 0.02 / 4 + 400 / (10_000 - 4 / 0.02)) / 2.0) * f(0.02 / 0.05),
        ),
        (
            "KV short of r's 10 blocks: it waits for a completion to free some",
            LENS | {"predicted_batch_latency_s": 0.02, "num_running": 4, "effective_free_kv_blocks": 2,
                    "kv_blocks_total": 100, "kv_blocks_free": 2},
            {},
            f((0.02 + 1 * 128 * 0.02 / 4 + 100 / (10_000 - 4 / 0.02)) / 2.0) * f(0.02 / 0.05),
        ),
        (
            "decoding never leaves prefill less than 5 % of P",
            LENS | {"predicted_batch_latency_s": 0.001, "num_running": 100},
            {},
            f((0.001 + 100 / (10_000 * 0.05)) / 2.0) * f(0.001 / 0.05),
        ),
        (
            "idle, no LENS: a stale last iteration time does not count",
            {"last_iteration_s": 0.5},
            {},
            f(100 / 20_000 / 2.0),
        ),
        (
            "LENS: L-hat inflated by the prediction error, P_max",
            LENS | {"predicted_batch_latency_s": 0.02, "prediction_error_ratio": 0.5},
            {},
            f((0.03 + 100 / 10_000) / 2.0) * f(0.03 / 0.05),
        ),
        (
            "unreported prompts are ahead of the request",
            {"unreported_requests": 1, "unreported_prompt_tokens": 900},
            {},
            f(1000 / 20_000 / 2.0),
        ),
        (
            "the request's own SLOs replace the defaults",
            LENS | {"predicted_batch_latency_s": 0.02},
            {"slo_ttft_s": 0.05, "slo_tpot_s": 0.01},
            f(0.03 / 0.05) * f(0.02 / 0.01),
        ),
        (
            "slo_risk halves it",
            LENS | {"predicted_batch_latency_s": 0.02, "slo_risk": True},
            {},
            0.5 * f(0.03 / 2.0) * f(0.02 / 0.05),
        ),
    ],
)
def test_latency_factor(
    case: str, view_fields: dict[str, Any], feat_fields: dict[str, Any], expected: float
) -> None:
    got = only(engine("a", **view_fields), features(prompt_tokens=100, **feat_fields)).latency
    assert got == pytest.approx(expected, rel=1e-12), case


def test_latency_factor_is_half_at_the_slo_and_plummets_beyond() -> None:
    at_slo = engine("a", **LENS, predicted_batch_latency_s=0.05)
    assert only(at_slo, features(prompt_tokens=0, slo_ttft_s=100.0)).latency == pytest.approx(0.5)
    over = engine("a", **LENS, predicted_batch_latency_s=0.15)
    assert only(over, features(prompt_tokens=0, slo_ttft_s=100.0)).latency == pytest.approx(1 / 82)


@pytest.mark.parametrize(
    ("case", "view_fields", "expected_rho_s"),
    [
        ("idle, no LENS: only the request's prefill", {}, 100 / 20_000),
        (
            "no LENS: W = pending prefill + d per queued request",
            {"pending_prefill_tokens": 1000, "num_running": 3, "num_waiting": 1},
            (1000 + 128 * 4 + 100) / 20_000,
        ),
        ("LENS: W / P_max", LENS | {"pending_work_tokens": 9900.0}, 10_000 / 10_000),
        (
            "LENS: in-flight requests since the report add their prompts and d each",
            LENS | {"pending_work_tokens": 1000.0, "unreported_requests": 2, "unreported_prompt_tokens": 700},
            (1000 + 700 + 2 * 128 + 100) / 10_000,
        ),
    ],
)
def test_load_factor(case: str, view_fields: dict[str, Any], expected_rho_s: float) -> None:
    got = only(engine("a", **view_fields), features(prompt_tokens=100)).load
    assert got == pytest.approx(1 / (1 + expected_rho_s / TAU), rel=1e-12), case


def cap(x: float, kappa: float = 1.0) -> float:
    if x >= 1:
        return 1 - (1 - CAPACITY_EPSILON) * math.exp(-(x - 1) / kappa)
    return CAPACITY_EPSILON * (1 + max(x, 0.0)) / 2


# Request: 100 prompt + 60 output tokens = 160 tokens = 10 blocks of 16.
KV = {"kv_blocks_total": 1000}


@pytest.mark.parametrize(
    ("case", "view_fields", "expected"),
    [
        ("KV size unknown -> neutral", {"kv_blocks_free": 0}, 1.0),
        (
            "no LENS: free - reserved = 30 blocks, x = 3",
            KV | {"kv_blocks_free": 40, "kv_blocks_reserved": 10},
            cap(3),
        ),
        ("exactly fits: x = 1 -> eps", KV | {"kv_blocks_free": 10}, cap(1)),
        ("does not fit: x = 0.5", KV | {"kv_blocks_free": 5}, cap(0.5)),
        (
            "nothing free (reservations exceed free)",
            KV | {"kv_blocks_free": 5, "kv_blocks_reserved": 9},
            cap(0),
        ),
        ("ample room -> 1", KV | {"kv_blocks_free": 1000}, 1.0),
        (
            "LENS: effective free KV",
            KV | LENS | {"kv_blocks_free": 1000, "effective_free_kv_blocks": 20},
            cap(2),
        ),
        (
            "unreported demand is taken off: ceil(330 / 16) = 21 blocks",
            KV | {"kv_blocks_free": 61, "unreported_tokens": 330},
            cap(4),
        ),
    ],
)
def test_capacity_factor(case: str, view_fields: dict[str, Any], expected: float) -> None:
    got = only(engine("a", **view_fields), features(prompt_tokens=100, max_tokens=60)).capacity
    assert got == pytest.approx(expected, rel=1e-9, abs=1e-300), case


def test_capacity_is_a_hard_near_zero_when_the_request_does_not_fit() -> None:
    feats = features(prompt_tokens=100, max_tokens=60)
    assert only(engine("a", **KV, kv_blocks_free=9), feats).capacity < CAPACITY_EPSILON
    assert only(engine("a", **KV, kv_blocks_free=40), feats).capacity > 0.8


@pytest.mark.parametrize(
    ("case", "session_engine", "engine_id", "expected"),
    [
        ("no session record: neutral", None, "a", 1.0),
        ("the session's engine", "a", "a", 1.0),
        ("another engine: 1 / beta", "b", "a", 1 / 1.5),
    ],
)
def test_affinity_factor(case: str, session_engine: str | None, engine_id: str, expected: float) -> None:
    got = only(engine(engine_id), features(session_engine=session_engine)).affinity
    assert got == pytest.approx(expected), case


def test_every_factor_is_in_zero_one() -> None:
    views = [
        engine("a"),
        engine("b", num_running=900, last_iteration_s=9.0, pending_prefill_tokens=10**7, **KV),
        engine("c", **LENS, **KV, predicted_batch_latency_s=5.0, pending_work_tokens=1e9, slo_risk=True),
    ]
    for view in views:
        for value in only(view, features(session_engine="z", prompt_tokens=10**5)):
            assert 0.0 < value <= 1.0


def test_fallback_peak_is_the_median_reported_one() -> None:
    plain = engine("a", pending_prefill_tokens=900)
    snap = snapshot(plain, engine("b", peak_throughput_tokens_per_s=4000.0), engine("c", **LENS))
    got = factors(plain, features(prompt_tokens=100), snap).load
    assert got == pytest.approx(1 / (1 + 1000 / 7000 / TAU))


def test_without_any_p_max_the_gpu_class_scales_the_default_peak() -> None:
    h100 = engine("a", profile="h100-llama3-8b", pending_prefill_tokens=1900)
    a6000x2 = engine("b", profile="a6000x2-llama3-8b", pending_prefill_tokens=1900)
    other = engine("c", profile="tpu-x", pending_prefill_tokens=1900)
    snap = snapshot(h100, a6000x2, other)
    feats = features(prompt_tokens=100)
    peak_b = 20_000 * 2 * GPU_CLASS_WEIGHTS["a6000"]
    assert factors(h100, feats, snap).load == pytest.approx(1 / (1 + 2000 / 20_000 / TAU))
    assert factors(a6000x2, feats, snap).load == pytest.approx(1 / (1 + 2000 / peak_b / TAU))
    assert factors(other, feats, snap).load == pytest.approx(1 / (1 + 2000 / 20_000 / TAU))
    assert class_peak_tokens_per_s("a100-llama3-8b", P) == pytest.approx(20_000 * GPU_CLASS_WEIGHTS["a100"])
    assert pick(snapshot(a6000x2, engine("a", profile="h100-llama3-8b", pending_prefill_tokens=2500))) == "a"


# ---- the product and the pick ------------------------------------------------------------------------------


def pick(snap: ClusterSnapshot, feats: RequestFeatures | None = None, **params: Any) -> EngineId | None:
    return PrismPolicy(PrismParams(**params)).pick(feats or features(), snap)


@pytest.mark.parametrize(
    ("case", "snap", "feats", "expected"),
    [
        (
            "heterogeneous: same queue, the faster engine drains sooner",
            snapshot(
                engine("a", peak_throughput_tokens_per_s=5_000.0, pending_work_tokens=2000.0),
                engine("b", peak_throughput_tokens_per_s=20_000.0, pending_work_tokens=2000.0),
            ),
            features(),
            "b",
        ),
        (
            "lower predicted latency wins when the loads are equal",
            snapshot(
                engine("a", **LENS, predicted_batch_latency_s=0.04),
                engine("b", **LENS, predicted_batch_latency_s=0.01),
            ),
            features(),
            "b",
        ),
        (
            "no LENS: fewer queued requests and prefill wins",
            snapshot(
                engine("a", num_running=8, last_iteration_s=0.03),
                engine("b", num_running=2, last_iteration_s=0.02),
            ),
            features(),
            "b",
        ),
        (
            "optimistic accounting: dispatches since the report count",
            snapshot(engine("a", unreported_requests=3, unreported_prompt_tokens=1500), engine("b")),
            features(),
            "b",
        ),
        (
            "capacity gate: an idle engine without room loses to a busy one with room",
            snapshot(
                engine("a", **KV, kv_blocks_free=5),
                engine(
                    "b",
                    **KV,
                    kv_blocks_free=900,
                    num_running=20,
                    last_iteration_s=0.03,
                    pending_prefill_tokens=3000,
                ),
            ),
            features(prompt_tokens=100, max_tokens=60),
            "b",
        ),
        (
            "no engine has room: the one with most room",
            snapshot(engine("a", **KV, kv_blocks_free=2), engine("b", **KV, kv_blocks_free=6)),
            features(prompt_tokens=100, max_tokens=60),
            "b",
        ),
        (
            "session bonus on a tie",
            snapshot(engine("a"), engine("b"), engine("c")),
            features(session_engine="c"),
            "c",
        ),
        (
            "the bonus does not outweigh a much heavier load",
            snapshot(
                engine("a", pending_prefill_tokens=40_000, num_running=30, last_iteration_s=0.06), engine("b")
            ),
            features(session_engine="a"),
            "b",
        ),
        (
            "excluded, not ready and other-model engines are skipped",
            snapshot(
                engine("a", ready=False), engine("b", model="x"), engine("c", num_running=50), engine("d")
            ),
            features(exclude=("d",)),
            "c",
        ),
        ("no engine of the model", snapshot(engine("a")), features(model="other"), None),
        ("empty fleet", snapshot(), features(), None),
    ],
)
def test_pick(case: str, snap: ClusterSnapshot, feats: RequestFeatures, expected: str | None) -> None:
    assert pick(snap, feats) == expected, case


def fast_and_slow(waiting: int) -> ClusterSnapshot:
    """A fast engine, full (256 of 256 sequences) with `waiting` queued, and a slow one with free slots; the
    same pending work."""
    fast = engine("fast", peak_throughput_tokens_per_s=20_000.0, predicted_batch_latency_s=0.03,
                  pending_work_tokens=2000.0, num_running=256, max_num_seqs=256, num_waiting=waiting)
    slow = engine("slow", peak_throughput_tokens_per_s=5_000.0, predicted_batch_latency_s=0.04,
                  pending_work_tokens=2000.0, num_running=20, max_num_seqs=256)
    return snapshot(fast, slow)


def test_the_fast_engines_queue_makes_it_lose() -> None:
    feats = features(slo_ttft_s=1.0)
    assert pick(fast_and_slow(waiting=0), feats) == "fast"  # no queue: r waits for one completion, speed wins
    queued = fast_and_slow(waiting=100)  # 101 completions ahead of r at one per 128 x 30 ms / 256 = 15 ms
    first_fast = 0.03 + 101 * 128 * 0.03 / 256 + 100 / (20_000 - 256 / 0.03)
    assert first_fast > 1.0  # past the TTFT SLO
    assert factors(queued.engines[0], feats, queued).latency == pytest.approx(
        f(first_fast / 1.0) * f(0.03 / 0.05))
    assert pick(queued, feats) == "slow"


def decide(snap: ClusterSnapshot, feats: RequestFeatures | None = None) -> tuple[EngineId | None, str]:
    return PrismPolicy().decide(feats or features(), snap)


def test_no_feasible_engine_takes_the_one_that_finishes_soonest_and_says_so() -> None:
    # Both past the 50 ms TPOT. By score b wins (a's heavy load); a finishes 50 tokens sooner.
    a = engine("a", **LENS, predicted_batch_latency_s=0.06, pending_work_tokens=200_000.0, num_running=10)
    b = engine("b", **LENS, predicted_batch_latency_s=0.09, num_running=10)
    snap = snapshot(a, b)
    scores = dict((e, s) for e, s, _ in PrismPolicy().scores(features(), snap))
    assert scores["b"] > scores["a"]
    assert decide(snap) == ("a", "no_feasible_soonest")
    # one feasible engine: the score decides again
    assert decide(snapshot(a, b, engine("c", **LENS, predicted_batch_latency_s=0.2, num_running=1,
                                        max_num_seqs=1)))[1] == "no_feasible_soonest"
    assert decide(snapshot(a, b, engine("c"))) == ("c", "scored")
    assert decide(snapshot(), features()) == (None, "no_candidate")


@pytest.mark.parametrize(("rand", "expected"), [(0.0, "a"), (0.99, "b")])
def test_no_feasible_ties_are_broken_by_rand(rand: float, expected: str) -> None:
    slow = {**LENS, "predicted_batch_latency_s": 0.1, "num_running": 3}
    assert decide(snapshot(engine("a", **slow), engine("b", **slow)), features(rand=rand)) == \
        (expected, "no_feasible_soonest")


def test_score_is_the_weighted_product_of_the_factors() -> None:
    views = (
        engine(
            "a",
            **LENS,
            **KV,
            predicted_batch_latency_s=0.03,
            pending_work_tokens=5000.0,
            effective_free_kv_blocks=30,
        ),
        engine(
            "b", **KV, num_running=4, last_iteration_s=0.02, kv_blocks_free=500, pending_prefill_tokens=700
        ),
    )
    snap = snapshot(*views)
    feats = features(prompt_tokens=100, max_tokens=60, session_engine="b")
    weights = PrismWeights(latency=2.0, load=0.5, capacity=1.0, affinity=3.0)
    params = PrismParams(weights=weights)
    scores = {e: s for e, s, _ in PrismPolicy(params).scores(feats, snap)}
    for view in views:
        lat, load, capacity, aff = factors(view, feats, snap, params)
        expected = lat**2.0 * load**0.5 * capacity * aff**3.0
        assert math.exp(scores[view.engine_id]) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    ("weights", "expected"),
    [
        ({}, "b"),  # a is loaded and slow: b
        ({"latency": 0.0, "load": 0.0}, "a"),  # only capacity left: a has more room
        ({"latency": 0.0, "load": 0.0, "capacity": 0.0}, "c"),  # only affinity left: the session's engine
        ({"latency": 0.0, "load": 0.0, "capacity": 0.0, "affinity": 0.0}, "a"),  # all off: a tie, rand 0
    ],
)
def test_a_zero_weight_switches_its_factor_off(weights: dict[str, float], expected: str) -> None:
    snap = snapshot(
        engine(
            "a",
            **KV,
            kv_blocks_free=1000,
            num_running=30,
            last_iteration_s=0.08,
            pending_prefill_tokens=20_000,
        ),
        engine("b", **KV, kv_blocks_free=100),
        engine("c", **KV, kv_blocks_free=20, num_running=10, last_iteration_s=0.03),
    )
    feats = features(prompt_tokens=100, max_tokens=60, session_engine="c", rand=0.0)
    assert pick(snap, feats, weights=PrismWeights(**weights)) == expected


# ---- ties, stale state -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rand", "expected"), [(0.0, "a"), (0.24, "a"), (0.25, "b"), (0.6, "c"), (0.99, "d")]
)
def test_exact_ties_are_broken_by_rand_in_engine_id_order(rand: float, expected: str) -> None:
    snap = snapshot(*(engine(e, num_running=3, last_iteration_s=0.02) for e in "dcba"))
    assert pick(snap, features(rand=rand)) == expected


def test_ties_spread_evenly_over_the_tied_engines() -> None:
    snap = snapshot(engine("a"), engine("b"), engine("c"), engine("x", num_running=9, last_iteration_s=0.1))
    picks = [pick(snap, features(rand=i / 300)) for i in range(300)]
    assert {e: picks.count(EngineId(e)) for e in "abcx"} == {"a": 100, "b": 100, "c": 100, "x": 0}


@pytest.mark.parametrize(
    ("age_s", "expected"),
    [(0.0, 1.0), (0.25, 1.0), (1.25, 0.5), (2.25, 0.25)],
)
def test_confidence_halves_per_half_life_after_the_fresh_age(age_s: float, expected: float) -> None:
    assert confidence(engine("a", state_age_s=age_s), NOW_S) == pytest.approx(expected)
    assert confidence(engine("a", state_age_s=age_s, stale=True), NOW_S) == 0.0


def test_an_old_report_is_blended_toward_the_fleet_mean() -> None:
    good = {"num_running": 1, "last_iteration_s": 0.01}
    bad = {"num_running": 40, "last_iteration_s": 0.09, "pending_prefill_tokens": 30_000}
    fresh = snapshot(engine("a", **good), engine("b", **bad))
    scores = {e: s for e, s, _ in PrismPolicy().scores(features(), fresh)}
    mean = (scores[EngineId("a")] + scores[EngineId("b")]) / 2
    aged = snapshot(engine("a", **good, state_age_s=1.25), engine("b", **bad, state_age_s=2.25))
    blended = {e: s for e, s, _ in PrismPolicy().scores(features(), aged)}
    assert blended[EngineId("a")] == pytest.approx(0.5 * scores[EngineId("a")] + 0.5 * mean)
    assert blended[EngineId("b")] == pytest.approx(0.25 * scores[EngineId("b")] + 0.75 * mean)
    # The old good report looks less good, the older bad one less bad: neither turns into the best engine.
    assert scores[EngineId("b")] < blended[EngineId("b")] < blended[EngineId("a")] < scores[EngineId("a")]


@pytest.mark.parametrize("rand", [0.0, 0.3, 0.5, 0.7, 0.99])
def test_an_aged_engine_never_wins_a_tie_against_a_fresh_one(rand: float) -> None:
    snap = snapshot(engine("a", state_age_s=3.0), engine("b"), engine("c", state_age_s=0.9))
    assert pick(snap, features(rand=rand)) == "b"


def test_stale_engines_stay_candidates_scored_at_the_mean() -> None:
    busy = engine("b", num_running=50, last_iteration_s=0.1)
    idle = engine("c")
    stale = engine("a", stale=True, state_age_s=9.0)
    policy = PrismPolicy()
    scores = {e: s for e, s, _ in policy.scores(features(), snapshot(stale, busy, idle))}
    assert scores["b"] < scores["a"] < scores["c"]
    assert pick(snapshot(stale, busy)) == "a"  # better than a known-busy engine, worse than a known-idle one
    assert pick(snapshot(stale, busy, idle)) == "c"
    assert pick(snapshot(engine("a", stale=True, ready=False))) is None
    assert pick(snapshot(engine("a", stale=True, ejected=True), busy)) == "b"


@pytest.mark.parametrize("k", [0.5, 4.0, 40.0, 1000.0])
def test_absurd_reports_do_not_overflow(k: float) -> None:
    snap = snapshot(
        engine("a", num_running=1, last_iteration_s=1e200),
        engine("b", **LENS, predicted_batch_latency_s=float("inf"), pending_work_tokens=1e300),
        engine("c", num_running=1, last_iteration_s=0.02),
    )
    assert pick(snap, latency_steepness=k) == "c"


def test_pick_is_pure() -> None:
    snap = snapshot(engine("a", num_running=2, last_iteration_s=0.02), engine("b"))
    feats = features(session_engine="a", rand=0.4)
    policy = PrismPolicy()
    assert [policy.pick(feats, snap) for _ in range(3)] == [policy.pick(feats, snap)] * 3
    assert snap == snapshot(engine("a", num_running=2, last_iteration_s=0.02), engine("b"))


# ---- parameters --------------------------------------------------------------------------------------------


def test_registry_builds_prism_with_parameters() -> None:
    policy = make_policy(
        "prism", {"weights": {"affinity": 2, "load": 0}, "tpot_slo_ms": 12, "affinity_bonus": 3}
    )
    assert isinstance(policy, PrismPolicy)
    assert policy.params.weights == PrismWeights(affinity=2.0, load=0.0)
    assert (policy.params.tpot_slo_ms, policy.params.affinity_bonus, policy.params.ttft_slo_ms) == (
        12.0,
        3.0,
        2000.0,
    )


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"nope": 1}, "nope: Extra inputs are not permitted"),
        ({"weights": {"speed": 1}}, "weights.speed: Extra inputs are not permitted"),
        ({"weights": [1]}, "weights: Input should be a valid dictionary or instance of PrismWeights"),
        ({"weights": {"load": -1}}, "weights.load: Input should be greater than or equal to 0"),
        ({"weights": {"load": "1"}}, "weights.load: Input should be a valid number"),
        ({"weights": {"latency": float("inf")}}, "weights.latency: Input should be a finite number"),
        ({"ttft_slo_ms": 0}, "ttft_slo_ms: Input should be greater than 0"),
        ({"affinity_bonus": 0.5}, "affinity_bonus: Input should be greater than or equal to 1"),
        ({"slo_risk_penalty": 0}, "slo_risk_penalty: Input should be greater than 0"),
        ({"slo_risk_penalty": 1.5}, "slo_risk_penalty: Input should be less than or equal to 1"),
        ({"decode_work_tokens": -1}, "decode_work_tokens: Input should be greater than or equal to 0"),
        ({"fresh_age_s": float("nan")}, "fresh_age_s: Input should be greater than or equal to 0"),
        ({"load_scale_s": True}, "load_scale_s: Input should be a valid number"),
        ({"load_scale_s": "1"}, "load_scale_s: Input should be a valid number"),
    ],
)
def test_registry_rejects_bad_prism_parameters(params: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as info:
        make_policy("prism", params)
    assert str(info.value) == f"policy 'prism': {message}"


# ---- SLO headers, through the real app ---------------------------------------------------------------------

CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("headers", "config", "expected_s"),
    [
        ({"x-slo-ttft-ms": "250", "x-slo-tpot-ms": "12.5"}, {}, (0.25, 0.0125)),
        ({}, {}, (None, None)),  # no SLO: the engine request carries none
        ({}, {"slo": {"ttft_ms": 2000, "tpot_ms": 40}}, (2.0, 0.04)),  # configured defaults
        ({"x-slo-tpot-ms": "20"}, {"slo": {"ttft_ms": 2000, "tpot_ms": 40}}, (2.0, 0.02)),  # header wins
    ],
)
async def test_slo_headers_reach_the_engine_request(
    headers: dict[str, str], config: dict[str, Any], expected_s: tuple[float | None, float | None]
) -> None:
    fake = FakeEngine("a", ok_script("x"))
    async with serving(fake, policy={"name": "prism"}, **config) as client:
        resp = await client.post(CHAT, json=BODY, headers=headers)
        assert resp.status == 200
    got = (fake.requests[0].slo_ttft_s, fake.requests[0].slo_tpot_s)
    assert got == expected_s


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("x-slo-ttft-ms", "fast"),
        ("x-slo-ttft-ms", "0"),
        ("x-slo-ttft-ms", "-5"),
        ("x-slo-tpot-ms", "inf"),
        ("x-slo-tpot-ms", "nan"),
        ("x-slo-tpot-ms", ""),
    ],
)
async def test_invalid_slo_headers_are_400_in_openai_shape(name: str, value: str) -> None:
    fake = FakeEngine("a", ok_script("x"))
    async with serving(fake, policy={"name": "prism"}) as client:
        resp = await client.post(CHAT, json=BODY, headers={name: value})
        assert resp.status == 400
        err = (await resp.json())["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert (err["type"], err["param"]) == ("invalid_request_error", name)
    assert fake.requests == []


@pytest.mark.parametrize(
    ("headers", "why"),
    [
        ({}, "scored"),
        # even an idle engine needs p / P_e to prefill: no engine meets a 0.1 µs TTFT
        ({"x-slo-ttft-ms": "0.0001"}, "no_feasible_soonest"),
    ],
)
async def test_the_pick_reason_is_counted_live(headers: dict[str, str], why: str) -> None:
    fake = FakeEngine("a", ok_script("x"))
    async with serving(fake, policy={"name": "prism"}) as client:
        resp = await client.post(CHAT, json=BODY, headers=headers)
        assert resp.status == 200
        exposition = await (await client.get("/metrics")).text()
    assert f'switchyard_policy_picks_total{{policy="prism",why="{why}"}} 1.0' in exposition, exposition


def test_a_request_no_engine_can_serve_in_time_is_shed_when_asked() -> None:
    # Both engines past the 50 ms TPOT, with requests queued: a's margin is 0.06 / 0.05 = 1.2, b's 0.09 /
    # 0.05 = 1.8.
    a = engine("a", **LENS, predicted_batch_latency_s=0.06, num_running=10, num_waiting=1)
    b = engine("b", **LENS, predicted_batch_latency_s=0.09, num_running=10, unreported_requests=2)
    snap = snapshot(a, b)
    margins = {e: m for e, _, _, m in PrismPolicy().timings(features(), snap)}
    assert margins["a"] == pytest.approx(1.2) and margins["b"] == pytest.approx(1.8)
    shed = PrismPolicy(PrismParams(overload="shed"))
    assert shed.decide(features(), snap) == (None, "no_feasible_shed")
    assert shed.pick(features(), snap) == "a"  # pick never sheds: a follow must land somewhere
    assert shed.decide(features(resumed_tokens=30), snap) == ("a", "no_feasible_soonest")  # nor a follow
    # within the margin: still served, by the soonest finish
    assert PrismPolicy(PrismParams(overload="shed", shed_margin=1.25)).decide(features(), snap) == \
        ("a", "no_feasible_soonest")
    # a feasible engine: scored as ever
    assert shed.decide(features(), snapshot(a, b, engine("c")))[1] == "scored"
    # the default serves the soonest
    assert PrismPolicy().decide(features(), snap) == ("a", "no_feasible_soonest")
    # a batch past the TPOT margin on its own counts as busy even with nothing queued ...
    slow_b = engine("b", **LENS, predicted_batch_latency_s=0.09, num_running=10)
    assert shed.decide(features(), snapshot(a, slow_b)) == (None, "no_feasible_shed")
    # ... but an engine with nothing queued whose batch is within the margin (here a TTFT the request's
    # prompt alone misses) is not overloaded: the request is served, not shed
    long_prompt = features(prompt_tokens=300_000)
    quiet_b = engine("b", **LENS, predicted_batch_latency_s=0.01, num_running=10)
    assert shed.decide(long_prompt, snapshot(a, quiet_b))[1] == "no_feasible_soonest"


async def test_a_shed_request_is_a_503_fleet_saturated_with_retry_after() -> None:
    started = asyncio.Event()

    def slow(request: Any) -> list[Any]:
        started.set()
        return [0.3, *ok_script("x")(request)]

    fake = FakeEngine("a", slow)
    policy = {"name": "prism", "params": {"overload": "shed"}}
    impossible = {"x-slo-ttft-ms": "0.0001"}
    async with serving(fake, policy=policy) as client:
        # Idle: nothing is queued on the engine, so even an impossible SLO is served (by the soonest).
        resp = await client.post(CHAT, json=BODY, headers=impossible)
        assert resp.status == 200
        # One request in flight (dispatched since the engine's report): queued ahead, so it is shed.
        started.clear()
        first = asyncio.create_task(client.post(CHAT, json=BODY))
        await started.wait()
        resp = await client.post(CHAT, json=BODY, headers=impossible)
        assert resp.status == 503
        assert resp.headers["Retry-After"] == "1"
        err = (await resp.json())["error"]
        assert (err["type"], err["code"]) == ("service_unavailable", "fleet_saturated")
        assert "time-to-first-token" in err["message"]
        assert (await first).status == 200
        exposition = await (await client.get("/metrics")).text()
    assert 'switchyard_policy_picks_total{policy="prism",why="no_feasible_shed"} 1.0' in exposition
    assert 'switchyard_policy_picks_total{policy="prism",why="no_feasible_soonest"} 1.0' in exposition
    assert 'switchyard_routing_decisions_total{policy="prism",reason="shed"} 1.0' in exposition
    assert len(fake.requests) == 2


def _random_decisions(seed: int, lens_share: float, params: PrismParams,
                      ) -> Iterator[tuple[RequestFeatures, ClusterSnapshot, PrismPolicy]]:
    """Random reports and dispatches over 12 engines (with and without LENS, KV short and not, some stale):
    each step's request and snapshot, and a long-lived policy that dispatches the request where it decides."""
    rng = random.Random(seed)
    state = ClusterState(stale_after_s=0.5, snapshot_resolution_s=0.0)
    ids = [EngineId(f"e{i}") for i in range(12)]
    for eid in ids:
        state.add_engine(eid, 0.0)
        state.on_connect(eid)
    kept = PrismPolicy(params)
    now_s, seqs = 0.0, dict.fromkeys(ids, 0)
    for step in range(300):
        now_s += rng.choice((0.001, 0.01, 0.1))
        for eid in ids if step == 0 else rng.sample(ids, rng.randrange(3)):
            seqs[eid] += 1
            running = rng.randrange(0, 40)
            lens = lens_state(predicted_batch_latency_s=0.01 + 0.001 * running,
                              pending_work_tokens=float(rng.randrange(20_000)),
                              effective_free_kv_blocks=rng.randrange(-50, 400),
                              peak_throughput_tokens_per_s=rng.uniform(5e3, 2e4),
                              slo_risk=rng.random() < 0.1) if rng.random() < lens_share else None
            state.on_report(eid, EngineReport(
                engine_id=eid, model=MODEL, profile="h100-llama3-8b", backend="sim", role="", seq=seqs[eid],
                engine_timestamp_s=now_s, ready=True, draining=False, num_running=running,
                num_waiting=rng.randrange(5), kv_blocks_total=500, kv_blocks_free=rng.randrange(500),
                kv_blocks_reserved=0, pending_prefill_tokens=rng.randrange(3000), running_batch_tokens=0,
                last_iteration_s=0.02, lens=lens), now_s)
        feats = features(f"r{step}", prompt_tokens=rng.choice((10, 500, 3000)),
                         max_tokens=rng.choice((16, 400)), now_s=now_s,
                         session_engine=rng.choice((None, "e3")), rand=rng.random(),
                         slo_ttft_s=rng.choice((None, 0.2, 2.0)))
        snap = state.snapshot(now_s)
        yield feats, snap, kept
        engine, _ = kept.decide(feats, snap)
        if engine is not None:
            state.note_dispatch(engine, feats.request_id, feats.prompt_tokens, feats.max_tokens, "", now_s)


@pytest.mark.parametrize(("seed", "lens_share"), [(0, 1.0), (1, 1.0), (2, 0.5), (3, 0.0)])
def test_the_memoised_table_decides_as_a_table_built_afresh(seed: int, lens_share: float) -> None:
    """A long-lived policy patches its table where the cluster state's views changed; a new policy per
    decision builds every row: both must give the same decisions and scores."""
    params = PrismParams(overload="shed", shed_margin=1.5)
    for step, (feats, snap, kept) in enumerate(_random_decisions(seed, lens_share, params)):
        fresh = PrismPolicy(params)
        assert kept.decide(feats, snap) == fresh.decide(feats, snap), f"step {step}"
        kept_scores, fresh_scores = kept.scores(feats, snap), fresh.scores(feats, snap)
        assert [(e, c) for e, _, c in kept_scores] == [(e, c) for e, _, c in fresh_scores]
        assert [s for _, s, _ in kept_scores] == pytest.approx([s for _, s, _ in fresh_scores], rel=1e-12)


def test_a_decision_agrees_with_the_scores_and_timings_it_reports() -> None:
    """`decide` runs the compiled kernel in one call; `scores` and `timings` run its parts. Its pick must be
    the best score when some engine is feasible, the soonest finish when none is, and a shed only where no
    engine is within the shed margin."""
    params = PrismParams(overload="shed", shed_margin=1.5)
    reasons = set()
    runs = (_random_decisions(seed, share, params) for seed, share in ((4, 1.0), (5, 0.5), (6, 1.0)))
    for step, (feats, snap, kept) in enumerate(decision for run in runs for decision in run):
        engine, why = kept.decide(feats, snap)
        reasons.add(why)
        timings = kept.timings(feats, snap)
        best_margin = min(m for *_, m in timings)
        if why == "scored":
            assert best_margin <= 1.0
            scores = {e: s for e, s, _ in kept.scores(feats, snap)}
            assert scores[engine] >= max(scores.values()) - 1e-9, f"step {step}"
        elif why == "no_feasible_soonest":
            assert best_margin > 1.0
            finish = {e: f for e, _, f, _ in timings}
            assert finish[engine] == min(finish.values()), f"step {step}"
        else:
            assert (engine, why) == (None, "no_feasible_shed")
            assert best_margin > params.shed_margin
    assert reasons == {"scored", "no_feasible_soonest", "no_feasible_shed"}  # every branch was exercised


def test_the_prefill_rate_lens_grants_prices_the_ttft_and_the_load() -> None:
    """An engine whose LENS plans leave prefill 1,000 tokens/s (a TTFT-bound target) loses a long prompt to a
    slower GPU that prefills at 8,000, though its P_max is four times higher."""
    starved = engine("a", peak_throughput_tokens_per_s=40_000.0, prefill_tokens_per_s=1_000.0,
                     predicted_batch_latency_s=0.008, pending_prefill_tokens=1_000,
                     pending_work_tokens=1_000.0)
    steady = engine("b", peak_throughput_tokens_per_s=10_000.0, prefill_tokens_per_s=8_000.0,
                    predicted_batch_latency_s=0.03, pending_prefill_tokens=1_000, pending_work_tokens=1_000.0)
    feats = features(prompt_tokens=2_000, max_tokens=10, slo_ttft_s=1.0, slo_tpot_s=0.05)
    snap = snapshot(starved, steady)
    first = {e: t for e, t, _, _ in PrismPolicy().timings(feats, snap)}
    assert first["a"] == pytest.approx(0.008 + 3_000 / 1_000.0)
    assert first["b"] == pytest.approx(0.03 + 3_000 / 8_000.0)
    assert pick(snap, feats) == "b"
    # The load factor drains the prefill at the granted rate: (W - Q) / P_max + (Q + p) / R.
    load = factors(starved, feats, snap).load
    assert load == pytest.approx(1 / (1 + (0 / 40_000.0 + 3_000 / 1_000.0) / 4.0))
    # Without a granted rate (LENS not planning) the same engine is priced at its peak and wins.
    unplanned = engine("a", peak_throughput_tokens_per_s=40_000.0, predicted_batch_latency_s=0.008,
                       pending_prefill_tokens=1_000, pending_work_tokens=1_000.0)
    assert pick(snapshot(unplanned, steady), feats) == "a"
