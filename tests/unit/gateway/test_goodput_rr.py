"""goodput_rr (CAUCHY §3.4): smooth weighted round robin across combos, counted by the cluster state."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from gateway.cluster.state import ClusterState
from gateway.dispatch.features import RoutingHints
from gateway.dispatch.life import ChoiceLife, Dispatch, Moment, record_dispatch
from gateway.domain import EngineId, EngineReport, EngineRequest, EngineView
from gateway.policies.goodput_rr import GoodputRRParams, GoodputRRPolicy, combo_type, swrr_pick
from gateway.policies.registry import PolicyParamsError, make_policy
from tests.unit.gateway.builders import MODEL, engine, features, snapshot


def nginx_swrr(weights: dict[str, int], picks: int) -> list[str]:
    """nginx's ngx_http_upstream_get_peer, written from its description: every pick adds each peer's weight
    to its current weight, takes the peer with the largest current (the first one on ties) and subtracts the
    total from it."""
    current = dict.fromkeys(weights, 0)
    total = sum(weights.values())
    out = []
    for _ in range(picks):
        best = None
        for name, w in weights.items():
            current[name] += w
            if best is None or current[name] > current[best]:
                best = name
        assert best is not None
        current[best] -= total
        out.append(best)
    return out


@pytest.mark.parametrize("weights", [
    {"a": 5, "b": 1, "c": 1},
    {"a": 1, "b": 1},
    {"a": 3, "b": 2, "c": 7, "d": 1},
    {"a": 10, "b": 0, "c": 4},
])
def test_swrr_pick_is_nginx_sequence(weights: dict[str, int]) -> None:
    names = sorted(weights)
    counts = [0] * len(names)
    ours = []
    for _ in range(60):
        i = swrr_pick([float(weights[n]) for n in names], counts)
        counts[i] += 1
        ours.append(names[i])
    assert ours == nginx_swrr({n: weights[n] for n in names}, 60)


def _report(engine_id: str, combo: str, free: int = 500) -> EngineReport:
    return EngineReport(engine_id=EngineId(engine_id), model=MODEL, profile="h100-llama3-8b", backend="sim",
                        role="", seq=1, engine_timestamp_s=0.0, ready=True, draining=False, num_running=0,
                        num_waiting=0, kv_blocks_total=1000, kv_blocks_free=free, kv_blocks_reserved=0,
                        pending_prefill_tokens=0, running_batch_tokens=0, combo=combo)


def _join(state: ClusterState, engine_id: str, combo: str, now_s: float, free: int = 500) -> None:
    eid = EngineId(engine_id)
    state.add_engine(eid, now_s)
    state.on_connect(eid)
    state.on_report(eid, _report(engine_id, combo, free), now_s)


def _state(engines: dict[str, tuple[str, int]]) -> ClusterState:
    """A cluster state of ready engines: id -> (combo label, KV blocks free)."""
    state = ClusterState(stale_after_s=1e9)
    for engine_id, (combo, free) in engines.items():
        _join(state, engine_id, combo, 0.0, free)
    return state


def _route(state: ClusterState, policy: GoodputRRPolicy, i: int, now_s: float = 1.0) -> Dispatch:
    life = ChoiceLife(EngineRequest(request_id=f"r{i}", model=MODEL, prompt_token_ids=(1,) * 10,
                                    max_tokens=10), RoutingHints(arrival_s=now_s))
    decision = life.route(policy, Moment(now_s, i, 0.5, state.snapshot(now_s)))
    assert isinstance(decision, Dispatch)
    record_dispatch(state, decision)
    return decision


def test_the_life_and_the_cluster_state_give_nginx_sequence_across_combos() -> None:
    goodput = {"1xh800": 5.0, "1xa800": 2.0, "1xh20": 1.0}
    state = _state({"p0": ("1xa800#0", 500), "p1": ("1xh20#0", 500), "p2": ("1xh800#0", 500)})
    policy = GoodputRRPolicy(GoodputRRParams.model_validate({"goodput": goodput}))
    combos = [combo_type(_route(state, policy, i).route.group) for i in range(40)]  # type: ignore[union-attr]
    ref = nginx_swrr({"1xa800": 2, "1xh20": 1, "1xh800": 5}, 40)
    assert combos == ref
    assert Counter(combos) == {"1xh800": 25, "1xa800": 10, "1xh20": 5}


def test_a_weight_change_starts_counting_anew_without_a_burst() -> None:
    # a: 1, b: 1 for 10 picks (5 each); then a new combo c joins: the weights change. Had the counts been
    # kept, c would be owed ~10/3 picks in a row; counted anew, the picks interleave from the first one.
    state = _state({"e0": ("a#0", 500), "e1": ("b#0", 500)})
    policy = GoodputRRPolicy()
    for i in range(10):
        _route(state, policy, i)
    _join(state, "e2", "c#0", 1.0)
    after = [_route(state, policy, 10 + i, now_s=2.0).route.group for i in range(6)]  # type: ignore[union-attr]
    assert after == ["a#0", "b#0", "c#0", "a#0", "b#0", "c#0"]
    tally = state.snapshot(2.0).routes[MODEL]
    assert tally.counts == (2, 2, 2) and tally.count("c#0") == 2 and tally.count("d") == 0


def test_opportunistic_and_rr_inside_a_combo() -> None:
    snap = snapshot(engine("d0", combo="1xh800+2xh20#0", inflight_tokens=900),
                    engine("d1", combo="1xh800+2xh20#0", inflight_tokens=100),
                    engine("d2", combo="1xh800+2xh20#0", inflight_tokens=500))
    assert GoodputRRPolicy().pick(features(), snap) == "d1"
    rr = make_policy("goodput_rr", {"intra": "rr"})
    assert rr.pick(features(), snap) == "d0"  # no picks counted yet


def test_plan_weights_by_label_type_and_profile_missing_ones_get_the_smallest() -> None:
    policy = GoodputRRPolicy(GoodputRRParams(goodput={"x#1": 7.0, "y": 3.0, "h20-llama3-8b": 2.0}))
    snap = snapshot(engine("e0", combo="x#1"), engine("e1", combo="y#0"),
                    engine("e2", profile="h20-llama3-8b"), engine("e3", combo="z#0"))
    weights = policy.weights(features(), snap)
    assert dict(weights) == {"e2": 2.0, "x#1": 7.0, "y#0": 3.0, "z#0": 2.0}


def test_modelled_weights_without_a_plan_follow_the_catalogue() -> None:
    snap = snapshot(engine("e0", profile="h100-llama3-8b"), engine("e1", profile="h100x2-llama3-8b"))
    policy = GoodputRRPolicy()
    weights = dict(policy.weights(features(), snap))
    assert weights["e1"] == pytest.approx(2 * weights["e0"])


def test_measured_weights_use_p_max_correct_by_ttft_and_keep_counted_weights_within_tolerance() -> None:
    policy = GoodputRRPolicy(GoodputRRParams.model_validate({"weights": "measured", "slo_ttft_s": 0.5,
                                                         "tolerance": 0.1}))
    slow = engine("e1", combo="b#0", peak_throughput_tokens_per_s=1000.0, recent_ttft_s=1.0,
                  recent_latency_samples=4)
    snap = snapshot(engine("e0", combo="a#0", peak_throughput_tokens_per_s=3000.0), slow)
    assert dict(policy.weights(features(), snap)) == {"a#0": 3000.0, "b#0": 500.0}
    # counted under (3100, 500): 3000 is within 10 % of 3100, so the counted weights stay
    from gateway.domain import ClusterSnapshot, RouteTally
    counted = ClusterSnapshot(snap.taken_at_s, snap.engines,
                              {MODEL: RouteTally((("a#0", 3100.0), ("b#0", 500.0)), (3, 0))})
    assert policy.weights(features(), counted) == (("a#0", 3100.0), ("b#0", 500.0))
    far = ClusterSnapshot(snap.taken_at_s, snap.engines,
                          {MODEL: RouteTally((("a#0", 4000.0), ("b#0", 500.0)), (3, 0))})
    assert policy.weights(features(), far) == (("a#0", 3000.0), ("b#0", 500.0))


def test_tokens_baseline_picks_the_combo_with_most_free_kv_tokens() -> None:
    snap = snapshot(engine("e0", combo="a#0", kv_blocks_free=100, block_size=16),
                    engine("e1", combo="b#0", kv_blocks_free=90, block_size=16),
                    engine("e2", combo="b#0", kv_blocks_free=90, block_size=16, unreported_tokens=2000))
    assert make_policy("goodput_rr", {"weights": "tokens"}).pick(features(), snap) == "e0"


def test_excluded_engines_skip_their_combo_without_changing_the_weights() -> None:
    policy = GoodputRRPolicy(GoodputRRParams.model_validate({"goodput": {"a": 5.0, "b": 1.0}}))
    snap = snapshot(engine("e0", combo="a#0"), engine("e1", combo="b#0"))
    first, tag = policy.choose(features(), snap)
    retry, retry_tag = policy.choose(features(exclude=("e0",)), snap)
    assert (first, retry) == ("e0", "e1")
    assert tag is not None and retry_tag is not None and tag.weights == retry_tag.weights
    assert policy.pick(features(exclude=("e0", "e1")), snap) is None
    assert policy.pick(features(model="other"), snap) is None


def test_zero_weights() -> None:
    assert swrr_pick([0.0, 0.0], [3, 1]) == 1  # all zero: treated as equal weights
    assert swrr_pick([0.0, 2.0], [0, 0], [True, False]) == 0  # only a zero-weight item is allowed


def test_unknown_parameters_are_rejected() -> None:
    with pytest.raises(PolicyParamsError, match="weights"):
        make_policy("goodput_rr", {"weights": "delivered"})
    with pytest.raises(PolicyParamsError, match="goodput"):
        make_policy("goodput_rr", {"goodput": {"a": -1.0}})


def test_view_has_combo_from_report() -> None:
    state = _state({"e0": ("1xh800#0", 10)})
    view: EngineView = state.snapshot(0.0).engines[0]
    assert view.combo == "1xh800#0"


def test_membership_changes_with_the_serving_set_and_identity_but_not_with_load() -> None:
    state = _state({"e0": ("a#0", 500), "e1": ("b#0", 500)})
    first = state.snapshot(1.0).membership
    state.note_dispatch(EngineId("e0"), "r", 10, 10, "", 1.0)
    assert state.snapshot(1.1).membership == first  # load changed, membership did not
    report = replace(_report("e1", "b#0"), seq=2, draining=True)
    state.on_report(EngineId("e1"), report, 1.2)
    draining = state.snapshot(1.2).membership
    assert draining != first
    state.on_report(EngineId("e1"), replace(_report("e1", "c#0"), seq=3), 1.3)
    relabelled = state.snapshot(1.3)
    assert relabelled.membership not in (first, draining)
    assert GoodputRRPolicy().weights(features(now_s=1.3), relabelled) == (("a#0", 1.0), ("c#0", 1.0))


def test_one_policy_shared_by_two_cluster_states_keeps_their_layouts_apart() -> None:
    policy = GoodputRRPolicy(GoodputRRParams(intra="rr"))
    left = _state({"e0": ("a#0", 500)})
    right = _state({"f0": ("a#0", 500), "f1": ("a#0", 500)})
    assert policy.pick(features(), left.snapshot(1.0)) == "e0"
    assert policy.pick(features(), right.snapshot(1.0)) == "f0"
    assert policy.pick(features(), left.snapshot(1.0)) == "e0"


def test_session_affinity_counts_its_goodput_rr_fallbacks_picks() -> None:
    policy = make_policy("session_affinity", {"fallback": "goodput_rr",
                                              "fallback_params": {"goodput": {"a": 2.0, "b": 1.0}}})
    state = _state({"e0": ("a#0", 500), "e1": ("b#0", 500)})
    groups = [_route(state, policy, i).route.group for i in range(6)]  # type: ignore[arg-type,union-attr]
    assert groups == ["a#0", "b#0", "a#0", "a#0", "b#0", "a#0"]
