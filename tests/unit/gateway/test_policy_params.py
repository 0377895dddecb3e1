"""Each policy's parameter model, through `make_policy`: a bad field is rejected with the policy's name and
the field's path; the defaults are the ones the hand-written registry used; a valid mapping builds the same
policy as the matching direct construction. Table-driven, exact expectations."""

from __future__ import annotations

from typing import Any

import pytest
from builders import engine, features, snapshot
from pydantic import ValidationError

from gateway.domain import ClusterSnapshot, RequestFeatures
from gateway.policies.base import Policy
from gateway.policies.goodput_rr import GoodputRRParams, GoodputRRPolicy
from gateway.policies.kv_aware import ApproxPrefixParams, ApproxPrefixPolicy, KvAwareParams, KvAwarePolicy
from gateway.policies.latency_based import LatencyBasedParams, LatencyBasedPolicy
from gateway.policies.least_loaded import LeastLoadedParams, LeastLoadedPolicy
from gateway.policies.length_stages import LengthStagesPolicy, LengthStagesPolicyParams
from gateway.policies.params import PolicyParams
from gateway.policies.prism import PrismParams, PrismPolicy, PrismWeights
from gateway.policies.registry import POLICY_NAMES, PolicyParamsError, make_policy
from gateway.policies.round_robin import RoundRobinParams, RoundRobinPolicy
from gateway.policies.session_affinity import SessionAffinityParams, SessionAffinityPolicy
from gateway.policies.static_weighted import StaticWeightedParams, StaticWeightedPolicy

INF, NAN = float("inf"), float("nan")

# ---- bad fields: (policy, params, "<field path>: <reason>") ------------------------------------------------

BAD: list[tuple[str, dict[str, Any], str]] = [
    ("kv_aware", {"overlap_weight": -1}, "overlap_weight: Input should be greater than or equal to 0"),
    ("kv_aware", {"index": "both"}, "index: Input should be 'events' or 'sent'"),
    ("approx_prefix", {"cache_threshold": "half"}, "cache_threshold: Input should be a valid number"),
    ("round_robin", {"measure": "tokens"}, "measure: Extra inputs are not permitted"),
    ("least_loaded", {"metric": "e2e"}, "metric: Extra inputs are not permitted"),
    ("least_loaded", {"measure": 1}, "measure: Input should be 'tokens' or 'requests'"),
    ("least_loaded", {"measure": "kv"}, "measure: Input should be 'tokens' or 'requests'"),
    ("latency_based", {"window_s": 2.0}, "window_s: Extra inputs are not permitted"),
    ("latency_based", {"metric": None}, "metric: Input should be 'e2e' or 'ttft'"),
    ("latency_based", {"metric": "p99"}, "metric: Input should be 'e2e' or 'ttft'"),
    ("static_weighted", {"qps": {"a": 1}}, "qps: Extra inputs are not permitted"),
    ("static_weighted", {"weights": {"a": "2"}}, "weights.a: Input should be a valid number"),
    ("static_weighted", {"weights": {"a": True}}, "weights.a: Input should be a valid number"),
    ("static_weighted", {"weights": [1, 2]}, "weights: Input should be a valid dictionary"),
    ("static_weighted", {"default_weight": "1"}, "default_weight: Input should be a valid number"),
    ("static_weighted", {"weights": {"a": -1}}, "weights.a: Input should be greater than or equal to 0"),
    ("static_weighted", {"default_weight": INF}, "default_weight: Input should be a finite number"),
    ("goodput_rr", {"weights": "delivered"},
     "weights: Input should be 'plan', 'measured', 'equal' or 'tokens'"),
    ("goodput_rr", {"intra": "least"}, "intra: Input should be 'opportunistic' or 'rr'"),
    ("goodput_rr", {"goodput": {"a": -2.0}}, "goodput.a: Input should be greater than or equal to 0"),
    ("goodput_rr", {"slo_ttft_s": 0}, "slo_ttft_s: Input should be greater than 0"),
    ("length_stages", {"within": "random"}, "within: Input should be 'bid' or 'round_robin'"),
    ("length_stages", {"kv_link_gbps": 0.0}, "kv_link_gbps: Input should be greater than 0"),
    ("prism", {"weight": {"load": 1}}, "weight: Extra inputs are not permitted"),
    ("prism", {"weights": {"speed": 1}}, "weights.speed: Extra inputs are not permitted"),
    ("prism", {"weights": {"latency": "1"}}, "weights.latency: Input should be a valid number"),
    ("prism", {"ttft_slo_ms": "2000"}, "ttft_slo_ms: Input should be a valid number"),
    ("prism", {"load_scale_s": False}, "load_scale_s: Input should be a valid number"),
    ("prism", {"weights": {"load": -0.5}}, "weights.load: Input should be greater than or equal to 0"),
    ("prism", {"tpot_slo_ms": 0}, "tpot_slo_ms: Input should be greater than 0"),
    ("prism", {"stale_half_life_s": INF}, "stale_half_life_s: Input should be a finite number"),
    ("prism", {"affinity_bonus": 0.99}, "affinity_bonus: Input should be greater than or equal to 1"),
    ("prism", {"overload": "defer"}, "overload: Input should be 'soonest' or 'shed'"),
    ("prism", {"shed_margin": 0.5}, "shed_margin: Input should be greater than or equal to 1"),
    ("prism", {"slo_risk_penalty": 1.01}, "slo_risk_penalty: Input should be less than or equal to 1"),
    ("session_affinity", {"ttl": 60}, "ttl: Extra inputs are not permitted"),
    ("session_affinity", {"ttl_s": "60"}, "ttl_s: Input should be a valid number"),
    ("session_affinity", {"min_kv_free_ratio": True}, "min_kv_free_ratio: Input should be a valid number"),
    ("session_affinity", {"fallback": ["round_robin"]}, "fallback: Input should be a valid string"),
    ("session_affinity", {"ttl_s": -1}, "ttl_s: Input should be greater than or equal to 0"),
    ("session_affinity", {"ttl_s": NAN}, "ttl_s: Input should be greater than or equal to 0"),
    (
        "session_affinity",
        {"min_kv_free_ratio": -0.1},
        "min_kv_free_ratio: Input should be greater than or equal to 0",
    ),
    (
        "session_affinity",
        {"fallback": "session_affinity"},
        "fallback: session_affinity cannot fall back to itself",
    ),
    (
        "session_affinity",
        {"fallback": "nope"},
        "fallback: unknown policy 'nope'; known: approx_prefix, goodput_rr, kv_aware, latency_based, "
        "least_loaded, length_stages, prism, round_robin, static_weighted",
    ),
    ("session_affinity", {"fallback_params": "x"}, "fallback_params: Input should be a valid dictionary"),
    (
        "session_affinity",
        {"fallback": "prism", "fallback_params": {"weights": {"load": "x"}}},
        "fallback_params.weights.load: Input should be a valid number",
    ),
    (
        "session_affinity",
        {"fallback_params": {"measure": "kv"}},
        "fallback_params.measure: Input should be 'tokens' or 'requests'",
    ),
]


@pytest.mark.parametrize(("name", "params", "problem"), BAD)
def test_a_bad_field_names_the_policy_and_the_field(name: str, params: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError) as info:
        make_policy(name, params)
    assert str(info.value) == f"policy {name!r}: {problem}"


def test_every_policy_has_bad_field_cases() -> None:
    assert {name for name, _, _ in BAD} == set(POLICY_NAMES)


def test_every_bad_field_is_listed() -> None:
    with pytest.raises(PolicyParamsError) as info:
        make_policy("prism", {"nope": 1, "ttft_slo_ms": 0, "weights": {"load": "x"}})
    assert info.value.policy == "prism"
    assert info.value.problems == (
        ("weights.load", "Input should be a valid number"),
        ("ttft_slo_ms", "Input should be greater than 0"),
        ("nope", "Extra inputs are not permitted"),
    )


def test_params_that_are_not_a_mapping_are_rejected() -> None:
    with pytest.raises(ValueError) as info:
        make_policy("least_loaded", ["measure"])  # type: ignore[arg-type]
    assert str(info.value) == (
        "policy 'least_loaded': Input should be a valid dictionary or instance of LeastLoadedParams"
    )


# ---- defaults: the values the hand-written registry used ---------------------------------------------------

DEFAULTS: list[tuple[str, type[PolicyParams], dict[str, Any]]] = [
    ("round_robin", RoundRobinParams, {}),
    ("least_loaded", LeastLoadedParams, {"measure": "tokens"}),
    ("latency_based", LatencyBasedParams, {"metric": "e2e"}),
    ("static_weighted", StaticWeightedParams, {"weights": {}, "default_weight": 1.0}),
    ("length_stages", LengthStagesPolicyParams, {"within": "bid", "kv_link_gbps": 25.0}),
    ("goodput_rr", GoodputRRParams,
     {"weights": "plan", "goodput": {}, "intra": "opportunistic", "tolerance": 0.1, "slo_ttft_s": None}),
    (
        "prism",
        PrismParams,
        {
            "weights": {"latency": 1.0, "load": 1.0, "capacity": 1.0, "affinity": 1.0},
            "ttft_slo_ms": 2000.0,
            "tpot_slo_ms": 50.0,
            "latency_steepness": 4.0,
            "load_scale_s": 4.0,
            "capacity_headroom": 1.0,
            "affinity_bonus": 1.5,
            "decode_work_tokens": 128.0,
            "default_peak_tokens_per_s": 20_000.0,
            "fresh_age_s": 0.25,
            "stale_half_life_s": 1.0,
            "slo_risk_penalty": 0.5,
            "overload": "soonest",
            "shed_margin": 1.0,
            "prefix": False,
        },
    ),
    (
        "session_affinity",
        SessionAffinityParams,
        {"ttl_s": 600.0, "min_kv_free_ratio": 0.05, "fallback": "least_loaded", "fallback_params": {}},
    ),
    ("kv_aware", KvAwareParams, {"balance_abs": 32.0, "balance_rel": 1.5, "overlap_weight": 32.0,
                                 "load": "active", "index": "events"}),
    ("approx_prefix", ApproxPrefixParams, {"balance_abs": 32.0, "balance_rel": 1.5, "cache_threshold": 0.3}),
]


@pytest.mark.parametrize(("name", "model", "expected"), DEFAULTS)
def test_defaults_live_on_the_model(name: str, model: type[PolicyParams], expected: dict[str, Any]) -> None:
    assert model().model_dump() == expected
    assert getattr(make_policy(name), "params", None) == model()
    assert getattr(make_policy(name, {}), "params", None) == model()


def test_every_policy_has_defaults() -> None:
    assert {name for name, _, _ in DEFAULTS} == set(POLICY_NAMES)


def test_the_default_session_affinity_falls_back_to_a_default_least_loaded_policy() -> None:
    policy = make_policy("session_affinity")
    assert isinstance(policy, SessionAffinityPolicy)
    assert isinstance(policy.fallback, LeastLoadedPolicy)
    assert policy.fallback.params == LeastLoadedParams()


# ---- a valid mapping builds the same policy as a direct construction ---------------------------------------

_SA = SessionAffinityParams(ttl_s=5.0, min_kv_free_ratio=0.1, fallback="round_robin")
VALID: list[tuple[str, dict[str, Any], Policy]] = [
    ("round_robin", {}, RoundRobinPolicy(RoundRobinParams())),
    ("least_loaded", {"measure": "requests"}, LeastLoadedPolicy(LeastLoadedParams(measure="requests"))),
    ("latency_based", {"metric": "ttft"}, LatencyBasedPolicy(LatencyBasedParams(metric="ttft"))),
    (
        "static_weighted",
        {"weights": {"a": 3, "b": 1.5}, "default_weight": 0},
        StaticWeightedPolicy(StaticWeightedParams(weights={"a": 3.0, "b": 1.5}, default_weight=0.0)),
    ),
    ("length_stages", {"within": "round_robin"},
     LengthStagesPolicy(LengthStagesPolicyParams(within="round_robin"))),
    (
        "goodput_rr",
        {"weights": "measured", "goodput": {"a": 2}, "intra": "rr", "slo_ttft_s": 1},
        GoodputRRPolicy(GoodputRRParams(weights="measured", goodput={"a": 2.0}, intra="rr", slo_ttft_s=1.0)),
    ),
    (
        "prism",
        {"weights": {"affinity": 2, "load": 0}, "tpot_slo_ms": 12, "affinity_bonus": 3, "fresh_age_s": INF},
        PrismPolicy(
            PrismParams(
                weights=PrismWeights(affinity=2.0, load=0.0),
                tpot_slo_ms=12.0,
                affinity_bonus=3.0,
                fresh_age_s=INF,
            )
        ),
    ),
    (
        "session_affinity",
        {"ttl_s": 5, "min_kv_free_ratio": 0.1, "fallback": "round_robin"},
        SessionAffinityPolicy(_SA, fallback=RoundRobinPolicy()),
    ),
    ("kv_aware", {"overlap_weight": 2, "load": "inflight", "index": "sent"},
     KvAwarePolicy(KvAwareParams(overlap_weight=2.0, load="inflight", index="sent"))),
    ("approx_prefix", {"cache_threshold": 0.4, "balance_abs": 4},
     ApproxPrefixPolicy(ApproxPrefixParams(cache_threshold=0.4, balance_abs=4.0))),
]

SNAPSHOTS: list[tuple[ClusterSnapshot, RequestFeatures]] = [
    (
        snapshot(
            engine("a", inflight_tokens=900, num_running=1, last_iteration_s=0.03, recent_ttft_s=0.2),
            engine("b", num_running=4, num_waiting=2, recent_e2e_s=0.5, recent_latency_samples=3),
            engine("c", pending_prefill_tokens=4000, recent_e2e_s=2.0, recent_latency_samples=1),
        ),
        features(dispatch_seq=seq, rand=rand, session_engine=session, session_last_used_s=97.0),
    )
    for seq, rand, session in [(0, 0.1, None), (1, 0.5, "a"), (2, 0.9, "c"), (4, 0.0, "b")]
]


@pytest.mark.parametrize(("name", "params", "direct"), VALID, ids=[v[0] for v in VALID])
def test_a_valid_mapping_builds_the_same_policy(name: str, params: dict[str, Any], direct: Policy) -> None:
    built = make_policy(name, params)
    assert type(built) is type(direct)
    assert getattr(built, "params", None) == getattr(direct, "params", None)
    assert [built.pick(f, s) for s, f in SNAPSHOTS] == [direct.pick(f, s) for s, f in SNAPSHOTS]


def test_every_policy_has_a_valid_case() -> None:
    assert {name for name, _, _ in VALID} == set(POLICY_NAMES)


def test_ints_are_taken_as_floats() -> None:
    params = StaticWeightedParams.model_validate({"weights": {"a": 3}, "default_weight": 0})
    assert (type(params.weights["a"]), type(params.default_weight)) == (float, float)


def test_session_affinity_fallback_params_reach_the_fallback() -> None:
    policy = make_policy("session_affinity", {"fallback_params": {"measure": "requests"}})
    assert isinstance(policy, SessionAffinityPolicy)
    assert isinstance(policy.fallback, LeastLoadedPolicy)
    assert policy.fallback.measure == "requests"


def test_session_affinity_needs_the_configured_fallback_handed_in() -> None:
    with pytest.raises(ValueError, match="build the configured fallback 'round_robin' with make_policy"):
        SessionAffinityPolicy(SessionAffinityParams(fallback="round_robin"))
    with pytest.raises(
        ValueError, match="fallback is a 'round_robin' policy, but params name 'least_loaded'"
    ):
        SessionAffinityPolicy(SessionAffinityParams(), fallback=RoundRobinPolicy())


# ---- the models themselves ---------------------------------------------------------------------------------


def test_params_are_frozen() -> None:
    params = LeastLoadedParams()
    with pytest.raises(ValidationError, match="frozen"):
        params.measure = "requests"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("model", "fields"),
    [
        (PrismWeights, {"latency": NAN}),
        (PrismParams, {"decode_work_tokens": INF}),
        (RoundRobinParams, {"anything": 1}),
        (SessionAffinityParams, {"min_kv_free_ratio": 1.5}),
    ],
)
def test_direct_construction_validates_too(model: type[PolicyParams], fields: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        model(**fields)
