"""NexusSched §7.4's baselines: latency based (recent 2 s average latency), static weighted (offline weights)
and least loaded by queue length, over hand-made snapshots and over `ClusterState`'s latency window."""

from __future__ import annotations

import random
from typing import Any

import pytest
from builders import engine, features, snapshot
from fake_engines import FakeEngine, ok_script, script, serving

from gateway.app import STORE_KEY
from gateway.cluster.state import ClusterState
from gateway.domain import (
    ClusterSnapshot,
    EngineDescription,
    EngineId,
    EngineReport,
    EngineUnavailable,
    RequestFeatures,
)
from gateway.policies.latency_based import LatencyBasedParams, LatencyBasedPolicy
from gateway.policies.least_loaded import LeastLoadedParams, LeastLoadedPolicy
from gateway.policies.registry import make_policy
from gateway.policies.static_weighted import (
    GPU_CLASS_WEIGHTS,
    StaticWeightedParams,
    StaticWeightedPolicy,
    gpu_class_weight,
)

# ---- latency based -----------------------------------------------------------------------------------------


def lat(e2e_s: float, ttft_s: float = 0.0, samples: int = 1) -> dict[str, Any]:
    return {"recent_e2e_s": e2e_s, "recent_ttft_s": ttft_s, "recent_latency_samples": samples}


@pytest.mark.parametrize(
    ("case", "snap", "feats", "expected"),
    [
        (
            "lowest recent E2E",
            snapshot(engine("a", **lat(2.0)), engine("b", **lat(0.5)), engine("c", **lat(1.0))),
            features(),
            "b",
        ),
        (
            "an engine without samples counts as the mean of the others (1.5 > 1.0)",
            snapshot(engine("a", **lat(2.0)), engine("b", **lat(1.0)), engine("c")),
            features(),
            "b",
        ),
        (
            "... and wins when that mean is the lowest value (a tie with b broken by rand)",
            snapshot(engine("a", **lat(1.0)), engine("b", **lat(1.0)), engine("c")),
            features(rand=0.9),
            "c",
        ),
        ("no samples anywhere: rand over all", snapshot(engine("a"), engine("b")), features(rand=0.6), "b"),
        (
            "excluded and not-ready engines are skipped",
            snapshot(engine("a", **lat(0.1), ready=False), engine("b", **lat(0.2)), engine("c", **lat(0.3))),
            features(exclude=("b",)),
            "c",
        ),
        ("no engine", snapshot(), features(), None),
    ],
)
def test_latency_based(
    case: str, snap: ClusterSnapshot, feats: RequestFeatures, expected: str | None
) -> None:
    assert LatencyBasedPolicy().pick(feats, snap) == expected, case


def test_latency_based_ttft_metric() -> None:
    snap = snapshot(engine("a", **lat(1.0, ttft_s=0.5)), engine("b", **lat(3.0, ttft_s=0.1)))
    assert LatencyBasedPolicy().pick(features(), snap) == "a"
    assert LatencyBasedPolicy(LatencyBasedParams(metric="ttft")).pick(features(), snap) == "b"
    assert make_policy("latency_based", {"metric": "ttft"}).pick(features(), snap) == "b"


@pytest.mark.parametrize(("rand", "expected"), [(0.0, "a"), (0.49, "a"), (0.5, "c"), (0.99, "c")])
def test_latency_based_ties_by_rand(rand: float, expected: str) -> None:
    snap = snapshot(engine("a", **lat(0.5)), engine("b", **lat(0.9)), engine("c", **lat(0.5)))
    assert LatencyBasedPolicy().pick(features(rand=rand), snap) == expected


def describe(engine_id: str) -> EngineDescription:
    return EngineDescription(EngineId(engine_id), "m", "p", "sim", "", 4096, 16, 8)


def report(engine_id: str) -> EngineReport:
    return EngineReport(
        engine_id=EngineId(engine_id), model="m", profile="p", backend="sim", role="", seq=1,
        engine_timestamp_s=0.0, ready=True, draining=False, num_running=0, num_waiting=0,
        kv_blocks_total=100, kv_blocks_free=100, kv_blocks_reserved=0, pending_prefill_tokens=0,
        running_batch_tokens=0,
    )  # fmt: skip


def test_latency_based_over_the_cluster_state_window_forgets_old_samples() -> None:
    state = ClusterState(stale_after_s=100.0, snapshot_resolution_s=0.0)  # 2 s latency window by default
    for e in ("a", "b"):
        state.add_engine(EngineId(e), 0.0)
        state.on_describe(EngineId(e), describe(e))
        state.on_connect(EngineId(e))
        state.on_report(EngineId(e), report(e), 0.0)
    a, b = EngineId("a"), EngineId("b")
    state.note_latency(a, 0.1, 5.0, now_s=10.0)  # a was slow ...
    state.note_latency(b, 0.1, 1.0, now_s=10.5)
    state.note_latency(b, 0.3, 2.0, now_s=11.0)
    policy = LatencyBasedPolicy()
    view = state.snapshot(11.5).get(b)
    assert view is not None
    assert (view.recent_e2e_s, view.recent_ttft_s, view.recent_latency_samples) == (1.5, 0.2, 2)
    assert policy.pick(features(now_s=11.5), state.snapshot(11.5)) == "b"
    state.note_latency(
        a, 0.1, 1.0, now_s=11.9
    )  # ... and is fast now: 3.0 mean until the slow sample ages out
    assert policy.pick(features(now_s=11.95), state.snapshot(11.95)) == "b"
    snap = state.snapshot(12.0)  # 10.0 + 2 s: a's slow sample is out of the window
    assert [(e.recent_e2e_s, e.recent_latency_samples) for e in snap.engines] == [(1.0, 1), (1.5, 2)]
    assert policy.pick(features(now_s=12.0), snap) == "a"
    snap = state.snapshot(20.0)  # everything forgotten
    assert [(e.recent_e2e_s, e.recent_latency_samples) for e in snap.engines] == [(None, 0), (None, 0)]


# ---- static weighted ---------------------------------------------------------------------------------------

FOUR = snapshot(engine("a"), engine("b"), engine("c"), engine("d"))


def shares(policy: Any, snap: ClusterSnapshot, n: int = 1000, *, seed: int | None = None) -> dict[str, float]:
    """Picks per engine over n requests: evenly spaced rand values, or seeded random ones."""
    rng = random.Random(seed)
    picks: dict[str, float] = {}
    for i in range(n):
        rand = (i + 0.5) / n if seed is None else rng.random()
        chosen = policy.pick(features(rand=rand, dispatch_seq=i), snap)
        picks[chosen] = picks.get(chosen, 0) + 1
    return {e: count / n for e, count in sorted(picks.items())}


def test_static_weighted_distributes_exactly_by_weight_over_evenly_spread_draws() -> None:
    policy = StaticWeightedPolicy(StaticWeightedParams(weights={"a": 4, "b": 3, "c": 2, "d": 1}))
    assert shares(policy, FOUR) == {"a": 0.4, "b": 0.3, "c": 0.2, "d": 0.1}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_static_weighted_distributes_by_weight_within_5_percent_over_seeded_draws(seed: int) -> None:
    policy = make_policy("static_weighted", {"weights": {"a": 4, "b": 3, "c": 2, "d": 1}})
    got = shares(policy, FOUR, 20_000, seed=seed)
    for e, expected in {"a": 0.4, "b": 0.3, "c": 0.2, "d": 0.1}.items():
        assert got[e] == pytest.approx(expected, rel=0.05)


@pytest.mark.parametrize(
    ("case", "policy", "snap", "expected"),
    [
        (
            "by profile, an id entry overriding it, default weight for the rest",
            StaticWeightedPolicy(StaticWeightedParams(weights={"h100": 3, "c": 1}, default_weight=0.0)),
            snapshot(
                engine("a", profile="h100"),
                engine("b", profile="h100"),
                engine("c", profile="h100"),
                engine("d", profile="a6000"),
            ),
            {"a": 3 / 7, "b": 3 / 7, "c": 1 / 7},
        ),
        (
            "no weights: a reported P_max is ignored (static), GPU classes decide",
            StaticWeightedPolicy(),
            snapshot(
                engine("a", profile="h100-llama3-8b", peak_throughput_tokens_per_s=10_000.0),
                engine("b", profile="h100-llama3-8b", peak_throughput_tokens_per_s=30_000.0),
            ),
            {"a": 0.5, "b": 0.5},
        ),
        (
            "no weights, GPU classes (a6000x2 is two A6000s)",
            StaticWeightedPolicy(),
            snapshot(engine("a", profile="h100-llama3-8b"), engine("b", profile="a6000x2-llama3-8b")),
            {
                "a": 1 / (1 + 2 * GPU_CLASS_WEIGHTS["a6000"]),
                "b": 2 * GPU_CLASS_WEIGHTS["a6000"] / (1 + 2 * GPU_CLASS_WEIGHTS["a6000"]),
            },
        ),
        (
            "no weights, an unknown GPU class: uniform",
            StaticWeightedPolicy(),
            snapshot(engine("a", profile="h100-llama3-8b"), engine("b", profile="tpu-x")),
            {"a": 0.5, "b": 0.5},
        ),
        (
            "all weights zero: uniform",
            StaticWeightedPolicy(StaticWeightedParams(weights={"a": 0, "b": 0})),
            snapshot(engine("a"), engine("b")),
            {"a": 0.5, "b": 0.5},
        ),
        (
            "excluded, not-ready and ejected engines get nothing",
            StaticWeightedPolicy(StaticWeightedParams(weights={"a": 1, "b": 1, "c": 1, "d": 1})),
            snapshot(engine("a"), engine("b", ready=False), engine("c", ejected=True), engine("d")),
            {"a": 0.5, "d": 0.5},
        ),
    ],
)
def test_static_weighted_weights(
    case: str, policy: StaticWeightedPolicy, snap: ClusterSnapshot, expected: dict[str, float]
) -> None:
    got = shares(policy, snap, 1400)
    assert got.keys() == expected.keys(), case
    for e, share in expected.items():
        assert got[e] == pytest.approx(share, abs=1 / 1400), case


@pytest.mark.parametrize(
    ("profile", "expected"),
    [
        ("h100-llama3-8b", 1.0),
        ("a6000x2-llama3-8b", 2 * GPU_CLASS_WEIGHTS["a6000"]),
        ("A100-llama3-8b", GPU_CLASS_WEIGHTS["a100"]),
        ("", None),
        ("tpu-v5", None),
        ("h100x0-m", None),
    ],
)
def test_gpu_class_weight(profile: str, expected: float | None) -> None:
    assert gpu_class_weight(profile) == expected


def test_gpu_class_weights_order_the_paper_s_heterogeneous_fleet() -> None:
    assert GPU_CLASS_WEIGHTS["h100"] > GPU_CLASS_WEIGHTS["a100"] > GPU_CLASS_WEIGHTS["a6000"] > 0


def test_static_weighted_no_engine() -> None:
    assert StaticWeightedPolicy().pick(features(), snapshot()) is None


# ---- least loaded by queue length -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("measure", "expected"),
    [("tokens", "a"), ("requests", "b")],
)
def test_least_loaded_by_tokens_or_queue_length(measure: str, expected: str) -> None:
    snap = snapshot(
        engine("a", num_running=5, pending_prefill_tokens=10),
        engine("b", num_running=1, unreported_requests=1, inflight_tokens=4000),
        engine("c", num_running=2, num_waiting=1, pending_prefill_tokens=300),
    )
    assert make_policy("least_loaded", {"measure": measure}).pick(features(), snap) == expected
    params = LeastLoadedParams(measure="requests" if measure == "requests" else "tokens")
    assert LeastLoadedPolicy(params).pick(features(), snap) == expected


# ---- registry ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        (
            "latency_based",
            {"metric": "p99"},
            "policy 'latency_based': metric: Input should be 'e2e' or 'ttft'",
        ),
        (
            "latency_based",
            {"window_s": 2},
            "policy 'latency_based': window_s: Extra inputs are not permitted",
        ),
        (
            "static_weighted",
            {"weights": {"a": -1}},
            "policy 'static_weighted': weights.a: Input should be greater than or equal to 0",
        ),
        (
            "static_weighted",
            {"weights": {"a": "x"}},
            "policy 'static_weighted': weights.a: Input should be a valid number",
        ),
        (
            "static_weighted",
            {"weights": [1, 2]},
            "policy 'static_weighted': weights: Input should be a valid dictionary",
        ),
        (
            "static_weighted",
            {"default_weight": -2},
            "policy 'static_weighted': default_weight: Input should be greater than or equal to 0",
        ),
        ("static_weighted", {"qps": 1}, "policy 'static_weighted': qps: Extra inputs are not permitted"),
        (
            "least_loaded",
            {"measure": "kv"},
            "policy 'least_loaded': measure: Input should be 'tokens' or 'requests'",
        ),
    ],
)
def test_registry_rejects_bad_baseline_parameters(name: str, params: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as info:
        make_policy(name, params)
    assert message in str(info.value)


# ---- the dispatcher feeds the latency window ---------------------------------------------------------------


async def test_the_dispatcher_records_latency_of_successful_requests_only() -> None:
    down = FakeEngine("a", script(EngineUnavailable("connection refused")))
    up = FakeEngine("b", ok_script("ok"))
    async with serving(down, up) as client:  # round robin: a first, then the retry on b
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        resp = await client.post("/v1/chat/completions", json=body)
        assert resp.status == 200
        assert client.app is not None
        snap = client.app[STORE_KEY].snapshot()
    assert (len(down.requests), len(up.requests)) == (1, 1)
    assert [(e.engine_id, e.recent_latency_samples) for e in snap.engines] == [("a", 0), ("b", 1)]
