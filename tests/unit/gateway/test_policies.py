"""Table-driven tests of the built-in routing policies over hand-made snapshots (exact expectations)."""

from __future__ import annotations

import pytest
from builders import engine, features, snapshot

from gateway.domain import ClusterSnapshot, EngineId, RequestFeatures
from gateway.policies.base import Policy
from gateway.policies.latency_based import LatencyBasedPolicy
from gateway.policies.least_loaded import LeastLoadedPolicy
from gateway.policies.prism import PrismPolicy
from gateway.policies.registry import POLICY_NAMES, make_policy
from gateway.policies.round_robin import RoundRobinPolicy
from gateway.policies.session_affinity import SessionAffinityParams, SessionAffinityPolicy, is_saturated
from gateway.policies.static_weighted import StaticWeightedPolicy

THREE = snapshot(engine("c"), engine("a"), engine("b"))


@pytest.mark.parametrize(
    ("case", "snap", "feats", "expected"),
    [
        ("seq 0 -> first by id", THREE, features(dispatch_seq=0), "a"),
        ("seq 1", THREE, features(dispatch_seq=1), "b"),
        ("seq 2", THREE, features(dispatch_seq=2), "c"),
        ("seq wraps", THREE, features(dispatch_seq=3), "a"),
        ("excluded skipped", THREE, features(dispatch_seq=0, exclude=("a",)), "b"),
        ("excluded shifts the ring", THREE, features(dispatch_seq=1, exclude=("a",)), "c"),
        (
            "not ready and stale skipped",
            snapshot(engine("a", ready=False), engine("b", stale=True), engine("c")),
            features(dispatch_seq=7),
            "c",
        ),
        ("other model skipped", snapshot(engine("a", model="x"), engine("b")), features(dispatch_seq=0), "b"),
        ("no engine of the model", THREE, features(model="other"), None),
        ("empty fleet", snapshot(), features(), None),
        ("all excluded", THREE, features(exclude=("a", "b", "c")), None),
    ],
)
def test_round_robin(case: str, snap: ClusterSnapshot, feats: RequestFeatures, expected: str | None) -> None:
    assert RoundRobinPolicy().pick(feats, snap) == expected, case


def test_round_robin_cycles_through_every_engine_in_id_order() -> None:
    picks = [RoundRobinPolicy().pick(features(dispatch_seq=i), THREE) for i in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]


@pytest.mark.parametrize(
    ("case", "snap", "feats", "expected"),
    [
        (
            "fewest in-flight tokens",
            snapshot(
                engine("a", inflight_tokens=300),
                engine("b", inflight_tokens=100),
                engine("c", inflight_tokens=200),
            ),
            features(),
            "b",
        ),
        (
            "pending prefill counts",
            snapshot(
                engine("a", inflight_tokens=100, pending_prefill_tokens=0),
                engine("b", inflight_tokens=0, pending_prefill_tokens=150),
            ),
            features(),
            "a",
        ),
        (
            "running batch tokens do not count",
            snapshot(engine("a", running_batch_tokens=10_000), engine("b", inflight_tokens=1)),
            features(),
            "a",
        ),
        ("tie -> lowest id", snapshot(engine("b"), engine("a"), engine("c")), features(), "a"),
        (
            "tie on the sum -> lowest id",
            snapshot(
                engine("b", inflight_tokens=50, pending_prefill_tokens=50),
                engine("c", inflight_tokens=100),
                engine("a", pending_prefill_tokens=101),
            ),
            features(),
            "b",
        ),
        (
            "idle but ejected engine skipped",
            snapshot(engine("a", ejected=True), engine("b", inflight_tokens=900)),
            features(),
            "b",
        ),
        (
            "stale engine stays eligible on local accounting",
            snapshot(engine("a", stale=True, inflight_tokens=100), engine("b", inflight_tokens=900)),
            features(),
            "a",
        ),
        (
            "idle but not ready engine skipped",
            snapshot(engine("a", ready=False), engine("b", inflight_tokens=900)),
            features(),
            "b",
        ),
        (
            "excluded idle engine skipped",
            snapshot(engine("a"), engine("b", inflight_tokens=900)),
            features(exclude=("a",)),
            "b",
        ),
        (
            "model filter",
            snapshot(engine("a", model="small"), engine("b", model="big", inflight_tokens=900)),
            features(model="big"),
            "b",
        ),
        ("nothing eligible", snapshot(engine("a", ready=False)), features(), None),
    ],
)
def test_least_loaded(case: str, snap: ClusterSnapshot, feats: RequestFeatures, expected: str | None) -> None:
    assert LeastLoadedPolicy().pick(feats, snap) == expected, case


# Session affinity: "s" is the session's engine; "idle" is the least loaded alternative.
S_FREE = engine(
    "s", inflight_tokens=500, max_num_seqs=8, num_running=2, kv_blocks_total=100, kv_blocks_free=50
)
IDLE = engine("idle")
PAIR = snapshot(S_FREE, IDLE)


@pytest.mark.parametrize(
    ("case", "snap", "feats", "expected"),
    [
        ("live session sticks", PAIR, features(session_engine="s", session_last_used_s=90.0), "s"),
        ("ttl boundary is inclusive", PAIR, features(session_engine="s", session_last_used_s=40.0), "s"),
        ("expired session falls back", PAIR, features(session_engine="s", session_last_used_s=39.9), "idle"),
        ("no session falls back", PAIR, features(), "idle"),
        (
            "gone engine falls back",
            snapshot(IDLE),
            features(session_engine="s", session_last_used_s=99.0),
            "idle",
        ),
        (
            "ejected session engine falls back",
            snapshot(engine("s", ejected=True), engine("t", inflight_tokens=5)),
            features(session_engine="s", session_last_used_s=99.0),
            "t",
        ),
        (
            "not ready session engine falls back",
            snapshot(engine("s", ready=False), engine("t", inflight_tokens=5)),
            features(session_engine="s", session_last_used_s=99.0),
            "t",
        ),
        (
            "excluded session engine falls back",
            PAIR,
            features(session_engine="s", session_last_used_s=99.0, exclude=("s",)),
            "idle",
        ),
        (
            "session engine serving another model falls back",
            snapshot(engine("s", model="x"), IDLE),
            features(session_engine="s", session_last_used_s=99.0),
            "idle",
        ),
        (
            "queue full (running + waiting + unreported >= max_num_seqs) falls back",
            snapshot(engine("s", max_num_seqs=8, num_running=5, num_waiting=2, unreported_requests=1), IDLE),
            features(session_engine="s", session_last_used_s=99.0),
            "idle",
        ),
        (
            "one seat left sticks",
            snapshot(engine("s", max_num_seqs=8, num_running=5, num_waiting=2), IDLE),
            features(session_engine="s", session_last_used_s=99.0),
            "s",
        ),
        (
            "kv nearly full falls back",
            snapshot(engine("s", kv_blocks_total=100, kv_blocks_free=4), IDLE),
            features(session_engine="s", session_last_used_s=99.0),
            "idle",
        ),
        (
            "kv at the threshold sticks",
            snapshot(engine("s", kv_blocks_total=100, kv_blocks_free=5), IDLE),
            features(session_engine="s", session_last_used_s=99.0),
            "s",
        ),
        (
            "unknown kv and seat limits never saturate",
            snapshot(engine("s", num_running=1000), IDLE),
            features(session_engine="s", session_last_used_s=99.0),
            "s",
        ),
        (
            "fallback may pick the session engine again",
            snapshot(engine("s"), engine("t", inflight_tokens=1)),
            features(session_engine="s", session_last_used_s=0.0),
            "s",
        ),
    ],
)
def test_session_affinity(
    case: str, snap: ClusterSnapshot, feats: RequestFeatures, expected: str | None
) -> None:
    policy = SessionAffinityPolicy(SessionAffinityParams(ttl_s=60.0, min_kv_free_ratio=0.05))
    assert policy.pick(feats, snap) == expected, case


def test_session_affinity_uses_the_configured_fallback() -> None:
    policy = make_policy("session_affinity", {"fallback": "round_robin", "ttl_s": 60.0})
    snap = snapshot(engine("a", inflight_tokens=900), engine("b"), engine("c"))
    picks = [
        policy.pick(features(dispatch_seq=i, session_engine="gone", session_last_used_s=99.0), snap)
        for i in range(3)
    ]
    assert picks == ["a", "b", "c"]


@pytest.mark.parametrize(
    ("view_fields", "expected"),
    [
        ({}, False),
        ({"max_num_seqs": 4, "num_running": 3}, False),
        ({"max_num_seqs": 4, "num_running": 3, "unreported_requests": 1}, True),
        ({"kv_blocks_total": 1000, "kv_blocks_free": 49}, True),
        ({"kv_blocks_total": 1000, "kv_blocks_free": 50}, False),
    ],
)
def test_is_saturated(view_fields: dict[str, int], expected: bool) -> None:
    assert is_saturated(engine("e", **view_fields), min_kv_free_ratio=0.05) is expected


@pytest.mark.parametrize(
    ("name", "params", "cls"),
    [
        ("round_robin", None, RoundRobinPolicy),
        ("least_loaded", {}, LeastLoadedPolicy),
        ("least_loaded", {"measure": "requests"}, LeastLoadedPolicy),
        ("prism", None, PrismPolicy),
        ("latency_based", {"metric": "ttft"}, LatencyBasedPolicy),
        ("static_weighted", {"weights": {"a": 2}}, StaticWeightedPolicy),
        ("session_affinity", None, SessionAffinityPolicy),
        (
            "session_affinity",
            {"ttl_s": 5, "min_kv_free_ratio": 0.1, "fallback": "round_robin"},
            SessionAffinityPolicy,
        ),
    ],
)
def test_registry_builds(name: str, params: dict[str, object] | None, cls: type) -> None:
    policy: Policy = make_policy(name, params)
    assert isinstance(policy, cls)
    assert policy.NAME == name


def test_registry_names_match_policy_names() -> None:
    assert POLICY_NAMES == (
        "approx_prefix",
        "goodput_rr",
        "kv_aware",
        "latency_based",
        "least_loaded",
        "length_stages",
        "prism",
        "round_robin",
        "session_affinity",
        "static_weighted",
    )
    assert {make_policy(n).NAME for n in POLICY_NAMES} == set(POLICY_NAMES)


def test_session_affinity_default_fallback_is_least_loaded() -> None:
    policy = make_policy("session_affinity")
    assert isinstance(policy, SessionAffinityPolicy)
    assert isinstance(policy.fallback, LeastLoadedPolicy)


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        (
            "nope",
            None,
            "unknown policy 'nope'; known policies: approx_prefix, goodput_rr, kv_aware, latency_based, "
            "least_loaded, length_stages, prism, round_robin, session_affinity, static_weighted",
        ),
        ("round_robin", {"x": 1}, "policy 'round_robin': x: Extra inputs are not permitted"),
        ("least_loaded", {"x": 1}, "policy 'least_loaded': x: Extra inputs are not permitted"),
        ("session_affinity", {"ttl": 1}, "policy 'session_affinity': ttl: Extra inputs are not permitted"),
        (
            "session_affinity",
            {"ttl_s": "10"},
            "policy 'session_affinity': ttl_s: Input should be a valid number",
        ),
        (
            "session_affinity",
            {"ttl_s": True},
            "policy 'session_affinity': ttl_s: Input should be a valid number",
        ),
        (
            "session_affinity",
            {"ttl_s": -1.0},
            "policy 'session_affinity': ttl_s: Input should be greater than or equal to 0",
        ),
        (
            "session_affinity",
            {"min_kv_free_ratio": 1.5},
            "policy 'session_affinity': min_kv_free_ratio: Input should be less than or equal to 1",
        ),
        (
            "session_affinity",
            {"fallback": "session_affinity"},
            "policy 'session_affinity': fallback: session_affinity cannot fall back to itself",
        ),
        (
            "session_affinity",
            {"fallback": "nope"},
            "policy 'session_affinity': fallback: unknown policy 'nope'",
        ),
        (
            "session_affinity",
            {"fallback": 3},
            "policy 'session_affinity': fallback: Input should be a valid string",
        ),
        (
            "session_affinity",
            {"fallback_params": [1]},
            "policy 'session_affinity': fallback_params: Input should be a valid dictionary",
        ),
        (
            "session_affinity",
            {"fallback": "round_robin", "fallback_params": {"x": 1}},
            "policy 'session_affinity': fallback_params.x: Extra inputs are not permitted",
        ),
    ],
)
def test_registry_errors(name: str, params: dict[str, object] | None, message: str) -> None:
    with pytest.raises(ValueError) as info:
        make_policy(name, params)
    assert message in str(info.value)


def test_policies_do_not_mutate_their_inputs() -> None:
    snap = snapshot(engine("a"), engine("b"))
    feats = features(session_engine="a", session_last_used_s=99.0)
    for name in POLICY_NAMES:
        assert make_policy(name).pick(feats, snap) == EngineId("a")
    assert snap == snapshot(engine("a"), engine("b"))
