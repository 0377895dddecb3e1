"""CascadeInfer's arrival routing (`gateway.policies.length_stages`): the stage a request belongs to, the
fall-backs when that stage has no eligible engine, the bid (or round robin) within it; its parameters through
the registry; the layout's way into snapshots (`ClusterState.publish_stages`); and the configuration checks
that tie the policy to its rescheduler (`GatewayConfig`, `gateway.app._rescheduler`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from builders import MODEL, engine, features, snapshot
from pydantic import ValidationError

from gateway.app import _rescheduler
from gateway.cluster.state import ClusterState
from gateway.config import ConfigError, GatewayConfig
from gateway.domain import ClusterSnapshot, EngineId, EngineView, LengthStage, StageLayout
from gateway.policies.length_stages import (
    LengthStagesPolicy,
    LengthStagesPolicyParams,
    bid_winner,
    engine_load,
    stage_candidates,
)
from gateway.policies.registry import PolicyParamsError, make_policy
from gateway.rescheduling.length_stages import LengthStages

# stage 0: a, lengths [0, 100); stage 1: b and c, [100, 1000); stage 2: d, [1000, ...)
LAYOUT = StageLayout(MODEL, (
    LengthStage(0, 100, (EngineId("a"),), (100,)),
    LengthStage(100, 1000, (EngineId("b"), EngineId("c")), (1000, 1000)),
    LengthStage(1000, 4096, (EngineId("d"),), (4096,)),
))


def staged(*engines: EngineView, layout: StageLayout | None = LAYOUT) -> ClusterSnapshot:
    snap = snapshot(*engines)
    if layout is None:
        return snap
    return ClusterSnapshot(snap.taken_at_s, snap.engines, stages={layout.model: layout})


FLEET = tuple(engine(e) for e in "abcd")


def ids(views: tuple[EngineView, ...]) -> set[str]:
    return {v.engine_id for v in views}


# ---------------------------------------------------------------------------------------------------------
# The stage


@pytest.mark.parametrize(
    ("prompt", "resumed", "expected"),
    [
        (0, 0, {"a"}),
        (99, 0, {"a"}),
        (100, 0, {"b", "c"}),
        (999, 0, {"b", "c"}),
        (1000, 0, {"d"}),
        (50_000, 0, {"d"}),  # past every stage: the last
        (50, 49, {"a"}),  # a follow's length is its prompt plus the tokens it already generated
        (50, 50, {"b", "c"}),
        (500, 600, {"d"}),
    ],
)
def test_the_earliest_stage_whose_hi_exceeds_the_length(
    prompt: int, resumed: int, expected: set[str]
) -> None:
    feats = features(prompt_tokens=prompt, resumed_tokens=resumed)
    assert ids(stage_candidates(feats, staged(*FLEET))) == expected


@pytest.mark.parametrize(
    ("prompt", "exclude", "not_ready", "expected"),
    [
        (50, ("a",), (), {"b", "c"}),  # the next later stage
        (50, (), ("a",), {"b", "c"}),
        (50, ("a", "b"), (), {"c"}),  # what is left of a stage
        (50, ("a", "b", "c"), (), {"d"}),  # later stages first...
        (50, ("a",), ("b", "c"), {"d"}),
        (2000, ("d",), (), {"b", "c"}),  # ...then earlier ones, nearest first
        (2000, ("d", "b"), ("c",), {"a"}),
        (500, ("b", "c"), (), {"d"}),
        (500, ("b", "c", "d"), (), {"a"}),
        (500, ("a", "b", "c", "d"), (), set()),
    ],
)
def test_falls_to_later_then_earlier_stages(
    prompt: int, exclude: tuple[str, ...], not_ready: tuple[str, ...], expected: set[str]
) -> None:
    fleet = [engine(e, ready=e not in not_ready) for e in "abcd"]
    feats = features(prompt_tokens=prompt, exclude=exclude)
    assert ids(stage_candidates(feats, staged(*fleet))) == expected
    pick = LengthStagesPolicy().pick(feats, staged(*fleet))
    assert (pick in expected) if expected else pick is None


def test_ejected_engines_are_not_candidates() -> None:
    fleet = [engine("a", ejected=True), *(engine(e) for e in "bcd")]
    assert ids(stage_candidates(features(prompt_tokens=50), staged(*fleet))) == {"b", "c"}


def test_engines_that_joined_since_the_layout_take_requests_when_no_staged_one_can() -> None:
    fleet = [*(engine(e, ready=False) for e in "abcd"), engine("e")]
    assert ids(stage_candidates(features(prompt_tokens=50), staged(*fleet))) == {"e"}
    # while a staged engine is eligible, a newcomer is not in its stage
    assert ids(stage_candidates(features(prompt_tokens=50), staged(*FLEET, engine("e")))) == {"a"}


@pytest.mark.parametrize(
    "snap",
    [
        staged(*FLEET, layout=None),
        staged(*FLEET, layout=StageLayout("other", LAYOUT.stages)),  # another model's layout
        staged(*FLEET, layout=StageLayout(MODEL, ())),
    ],
    ids=["no-layout", "other-model", "empty"],
)
def test_without_a_layout_every_eligible_engine_competes(snap: ClusterSnapshot) -> None:
    feats = features(prompt_tokens=50, exclude=("b",))
    assert ids(stage_candidates(feats, snap)) == {"a", "c", "d"}


def test_other_models_engines_never_compete() -> None:
    snap = staged(*FLEET, engine("z", model="other"))
    assert ids(stage_candidates(features(prompt_tokens=50_000), snap)) == {"d"}
    assert LengthStagesPolicy().pick(features(model="nope"), snap) is None


# ---------------------------------------------------------------------------------------------------------
# Within the stage


@pytest.mark.parametrize(("seq", "expected"), [(0, "b"), (1, "c"), (2, "b"), (7, "c")])
def test_round_robin_rotates_over_the_stage_by_dispatch_seq(seq: int, expected: str) -> None:
    policy = LengthStagesPolicy(LengthStagesPolicyParams(within="round_robin"))
    fleet = (engine("a"), engine("c", running_batch_tokens=10**6), engine("b"), engine("d"))
    assert policy.pick(features(prompt_tokens=500, dispatch_seq=seq), staged(*fleet)) == expected


def test_round_robin_skips_the_excluded() -> None:
    policy = LengthStagesPolicy(LengthStagesPolicyParams(within="round_robin"))
    for seq in range(4):
        feats = features(prompt_tokens=500, dispatch_seq=seq, exclude=("b",))
        assert policy.pick(feats, staged(*FLEET)) == "c"


WIDE = StageLayout(MODEL, (LengthStage(0, 4096, tuple(EngineId(e) for e in "abcdefgh")),))


@pytest.mark.parametrize(
    ("loads", "ages", "pending", "rand", "expected"),
    [
        # the lower-load half kept (ceil(n/2)), then the freshest report
        ({"a": 10, "b": 20, "c": 30, "d": 40}, {"a": 0.5, "b": 0.1, "c": 0.0, "d": 0.0}, {}, 0.0, "b"),
        ({"a": 10, "b": 20, "c": 30}, {"a": 0.2, "b": 0.3, "c": 0.0}, {}, 0.0, "a"),
        # the published pending tokens count in the load
        ({"a": 10, "b": 20, "c": 30, "d": 40}, {"a": 0.5, "b": 0.1, "c": 0.0, "d": 0.0}, {"b": 100}, 0.0,
         "c"),
        # of eight, four kept by load, then the three earliest starts: a's pending tokens start it last
        ({e: 0 for e in "abcd"} | {e: 99 for e in "efgh"}, {"a": 0.0, "b": 0.3, "c": 0.2, "d": 0.1},
         {"a": 50}, 0.0, "d"),
        # equal starts: the lower loads kept (b, the freshest but the heaviest of the four, dropped)
        ({"a": 0, "b": 30, "c": 20, "d": 10} | {e: 99 for e in "efgh"},
         {"a": 0.3, "b": 0.0, "c": 0.1, "d": 0.2}, {}, 0.0, "c"),
        # exact ties of age: the request's rand picks among the (up to) three earliest
        ({e: 0 for e in "abcdef"}, {}, {}, 0.0, "a"),
        ({e: 0 for e in "abcdef"}, {}, {}, 0.5, "b"),
        ({e: 0 for e in "abcdef"}, {}, {}, 0.9, "c"),
    ],
)
def test_bid_within_the_stage(loads: dict[str, int], ages: dict[str, float], pending: dict[str, int],
                              rand: float, expected: str) -> None:
    fleet = [engine(e, running_batch_tokens=load, state_age_s=ages.get(e, 0.0), kv_bytes_per_token=1000)
             for e, load in loads.items()]
    layout = StageLayout(MODEL, WIDE.stages, {EngineId(e): n for e, n in pending.items()})
    feats = features(prompt_tokens=10, rand=rand)
    assert LengthStagesPolicy().pick(feats, staged(*fleet, layout=layout)) == expected


def test_bid_without_a_layout_over_every_engine() -> None:
    fleet = [engine("a", running_batch_tokens=5), engine("b", running_batch_tokens=1, state_age_s=0.2),
             engine("c", running_batch_tokens=2, state_age_s=0.1), engine("d", running_batch_tokens=9)]
    assert LengthStagesPolicy().pick(features(), staged(*fleet, layout=None)) == "c"


@pytest.mark.parametrize(("link_bytes_per_s", "expected"), [(1e12, "p"), (1e6, "q")])
def test_the_link_speed_times_the_starts_of_engines_that_measured_none(
    link_bytes_per_s: float, expected: str
) -> None:
    # eight receivers, four light ones kept by load; of those r and s start at once, p and q each wait for
    # 10 pending bytes: q over its measured 1 GB/s (1e-8 s), p over the link; the later of p, q is dropped
    light = [engine("p", kv_bytes_per_token=1, state_age_s=0.0),
             engine("q", kv_bytes_per_token=1, transfer_bytes_per_s=1e9, state_age_s=0.1),
             engine("r", kv_bytes_per_token=1, state_age_s=0.2),
             engine("s", kv_bytes_per_token=1, state_age_s=0.3)]
    heavy = [engine(e, running_batch_tokens=10**6) for e in "wxyz"]
    pending = {EngineId("p"): 10, EngineId("q"): 10}
    winner = bid_winner([*light, *heavy], pending, link_bytes_per_s, lambda: 0.0)
    assert winner is not None and winner.engine_id == expected
    # the policy's kv_link_gbps is that link (1e6 bytes/s = 0.008 Gbps)
    policy = LengthStagesPolicy(LengthStagesPolicyParams(kv_link_gbps=link_bytes_per_s * 8 / 1e9))
    layout = StageLayout(MODEL, (LengthStage(0, 4096, tuple(EngineId(e) for e in "pqrswxyz")),), pending)
    assert policy.pick(features(), staged(*light, *heavy, layout=layout)) == expected


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({}, 0),
        ({"running_batch_tokens": 100}, 100),
        ({"running_batch_tokens": 100, "pending_prefill_tokens": 20, "unreported_prompt_tokens": 3}, 123),
    ],
)
def test_engine_load(values: dict[str, Any], expected: int) -> None:
    view = engine("a", **values)
    assert engine_load(view) == expected
    assert engine_load(view, 1000) == expected + 1000


# ---------------------------------------------------------------------------------------------------------
# Parameters through the registry


def test_make_policy_builds_it() -> None:
    policy = make_policy("length_stages", {"within": "round_robin", "kv_link_gbps": 100.0})
    assert isinstance(policy, LengthStagesPolicy)
    assert policy.params == LengthStagesPolicyParams(within="round_robin", kv_link_gbps=100.0)
    assert isinstance(make_policy("length_stages"), LengthStagesPolicy)


@pytest.mark.parametrize(
    ("params", "path"),
    [
        ({"bogus": 1}, "bogus"),
        ({"within": "zigzag"}, "within"),
        ({"kv_link_gbps": 0.0}, "kv_link_gbps"),
        ({"kv_link_gbps": "10"}, "kv_link_gbps"),
        ({"kv_link_gbps": True}, "kv_link_gbps"),
        ({"kv_link_gbps": float("inf")}, "kv_link_gbps"),
    ],
)
def test_make_policy_validates_params(params: dict[str, object], path: str) -> None:
    with pytest.raises(PolicyParamsError, match=rf"^policy 'length_stages': {path}") as info:
        make_policy("length_stages", params)
    assert info.value.problems[0][0] == path


# ---------------------------------------------------------------------------------------------------------
# The layout into snapshots


def test_publish_stages_shows_in_the_next_snapshot() -> None:
    state = ClusterState(stale_after_s=10.0, snapshot_resolution_s=60.0)  # snapshots cached for a minute
    first = state.snapshot(1.0)
    assert dict(first.stages) == {}
    assert state.snapshot(2.0) is first  # cached
    state.publish_stages({MODEL: LAYOUT})
    second = state.snapshot(2.0)
    assert second is not first
    assert dict(second.stages) == {MODEL: LAYOUT}
    # an equal layout changes nothing: the cache stays
    state.publish_stages({MODEL: StageLayout(MODEL, LAYOUT.stages)})
    assert state.snapshot(3.0) is second
    # a model left out has none
    state.publish_stages({})
    assert dict(state.snapshot(3.0).stages) == {}


def test_published_layouts_cannot_be_changed_through_the_snapshot() -> None:
    state = ClusterState(stale_after_s=10.0, snapshot_resolution_s=0.0)
    layouts = {MODEL: LAYOUT}
    state.publish_stages(layouts)
    layouts.clear()  # the caller's dict is copied
    snap = state.snapshot(1.0)
    assert dict(snap.stages) == {MODEL: LAYOUT}
    with pytest.raises(TypeError):
        snap.stages["x"] = LAYOUT  # type: ignore[index]


# ---------------------------------------------------------------------------------------------------------
# Configuration


def test_the_policy_needs_its_rescheduler() -> None:
    with pytest.raises(ValidationError, match="length_stages"):
        GatewayConfig(policy={"name": "length_stages"})  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="length_stages"):
        GatewayConfig(policy={"name": "length_stages"}, reschedule={"policy": "star"})  # type: ignore[arg-type]
    config = GatewayConfig(policy={"name": "length_stages"},  # type: ignore[arg-type]
                           reschedule={"policy": "length_stages"})  # type: ignore[arg-type]
    assert config.reschedule.policy == "length_stages"
    # the rescheduler without the policy is fine (another policy routes)
    GatewayConfig(reschedule={"policy": "length_stages"})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("params", "key"),
    [
        ({"layout": "zigzag"}, "layout"),
        ({"ema": 0}, "ema"),
        ({"min_requests": "x"}, "min_requests"),
        ({"nope": 1}, "nope"),
    ],
)
def test_rescheduler_config_errors_name_the_key(params: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=rf"^reschedule\.params: .*{key}"):
        _rescheduler("length_stages", params, 0.5)  # type: ignore[arg-type]


def _write(tmp_path: Path, doc: object) -> str:
    path = tmp_path / "stages.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    return str(path)


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"stages": [{"lo": 0, "hi": 100}, {"lo": 200, "hi": 300}]}, r"plan\.stages\[1\]: .*adjacent"),
        ({"stages": [{"lo": 0, "hi": 100, "instances": 0}]}, r"plan\.stages\[0\]: needs"),
        ({"stages": [{"lo": 5, "hi": 100}]}, r"plan\.stages\[0\]: the first stage must start at 0"),
        ({"stages": []}, r"plan: expected"),
    ],
)
def test_rescheduler_with_a_bad_plan_names_the_key(tmp_path: Path, doc: object, message: str) -> None:
    with pytest.raises(ConfigError, match=rf"^reschedule\.params: {message}"):
        _rescheduler("length_stages", {"plan": _write(tmp_path, doc)}, 0.5)


def test_rescheduler_with_an_unreadable_plan(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^reschedule\.params: plan: cannot read .*missing\.json"):
        _rescheduler("length_stages", {"plan": str(tmp_path / "missing.json")}, 0.5)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"^reschedule\.params: plan: cannot read"):
        _rescheduler("length_stages", {"plan": str(bad)}, 0.5)


def test_rescheduler_reads_its_plan_and_the_loop_interval(tmp_path: Path) -> None:
    path = _write(tmp_path, {"stages": [{"lo": 0, "hi": 1000}, {"lo": 1000, "hi": 4096}]})
    rescheduler = _rescheduler("length_stages", {"plan": path, "refine": "off", "max_len": "4096"}, 0.25)
    assert isinstance(rescheduler, LengthStages)
    assert rescheduler.params.interval_s == 0.25
    assert rescheduler.params.max_len == 4096
    rescheduler.propose(snapshot(engine("a"), engine("b")), MODEL, frozenset(), frozenset(), 100.0)
    layout = rescheduler.layouts()[MODEL]
    assert [(s.lo, s.hi, s.engines) for s in layout.stages] == [(0, 1000, ("a",)), (1000, 4096, ("b",))]
    # a layout the policy then routes by
    assert LengthStagesPolicy().pick(features(prompt_tokens=2000), staged(*FLEET, layout=layout)) == "b"
