"""CascadeInfer's length-stages rescheduler (`gateway.rescheduling.length_stages`): its parameters and plan
file, the first layout, §4.3's refinement, hand-over, §4.4's bid-ask and transfer pacing, the layout's
upkeep (merges, joins, re-plans) and the mover's refusals, on hand-made snapshots with exact expectations.
Time and randomness are injected: `propose(..., now_s)` and `rand`."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from builders import MODEL, engine, snapshot

from gateway.dispatch.life import DEFAULT_MAX_FOLLOWS
from gateway.domain import EngineId, EngineView, QoEReport, RequestPrediction
from gateway.planning.stages import TransferCost, plan_stages
from gateway.policies.length_stages import bid_winner
from gateway.rescheduling.length_stages import (
    MAX_MOVES_PER_REQUEST,
    LengthStages,
    LengthStagesParams,
    Move,
    StagesConfigError,
    StagesPlanFile,
    _split_length,
)
from switchyard.qoe import PROFILED_QOE_D, QoEModel

KVB = 1000  # KV bytes per token of every engine here
SLOW = 1e6  # bytes/s: a 1,100-token pull takes 1.1 s, past one 0.5 s tick
T0 = 100.0


# ---------------------------------------------------------------------------------------------------------
# Builders


def req(rid: str, length: int, prompt: int | None = None, *, migratable: bool = True) -> RequestPrediction:
    """A running request of current length `length` (prompt `prompt`, default half of it)."""
    prompt = length // 2 if prompt is None else prompt
    return RequestPrediction(rid, current_tokens=length, predicted_remaining_tokens=0,
                             generated_tokens=length - prompt, migratable=migratable)


def view(engine_id: str, *requests: RequestPrediction, free_blocks: int = 10_000, total_blocks: int = 10_000,
         **values: Any) -> EngineView:
    """An engine of MODEL reporting `requests` (16-token blocks, KVB bytes per token); its running batch
    holds their tokens unless `running_batch_tokens` says otherwise."""
    values.setdefault("running_batch_tokens", sum(r.current_tokens for r in requests))
    return engine(engine_id, predictions=tuple(requests), kv_blocks_total=total_blocks,
                  kv_blocks_free=free_blocks, block_size=16, kv_bytes_per_token=KVB, **values)


def plan(*stages: tuple[int, int, int]) -> StagesPlanFile:
    return StagesPlanFile.parse({"stages": [{"lo": lo, "hi": hi, "instances": n} for lo, hi, n in stages]})


TWO = plan((0, 1000, 1), (1000, 4096, 1))  # a | b
THREE = plan((0, 100, 1), (100, 1000, 1), (1000, 4096, 1))  # a | b | c


def rescheduler(plan: StagesPlanFile | None = None, history: Sequence[tuple[int, int]] = (),
                rand: Callable[[], float] = lambda: 0.0, **params: Any) -> LengthStages:
    return LengthStages(LengthStagesParams(**params), plan=plan, history=history, rand=rand)


def tick(rs: LengthStages, *views: EngineView, at: float = T0, exclude: Sequence[str] = (),
         busy: Sequence[str] = ()) -> list[Move]:
    return rs.propose(snapshot(*views, taken_at_s=at), MODEL, frozenset(exclude), frozenset(busy), at)


def shape(rs: LengthStages) -> list[tuple[int, int, tuple[str, ...], tuple[int, ...]]]:
    """MODEL's published stages as (lo, hi, engines, bounds)."""
    return [(s.lo, s.hi, tuple(s.engines), s.bounds) for s in rs.layouts()[MODEL].stages]


def pairs(moves: Sequence[Move]) -> set[tuple[str, str, str]]:
    return {(m.request_id, m.source, m.target) for m in moves}


def pending(rs: LengthStages) -> dict[str, int]:
    """MODEL's published tokens won and not yet received, per engine (zeros left out)."""
    return {e: n for e, n in rs.layouts()[MODEL].pending_tokens.items() if n}


# ---------------------------------------------------------------------------------------------------------
# Parameters


@pytest.mark.parametrize(
    ("values", "key"),
    [
        ({"zigzag": 1}, "zigzag"),
        ({"layout": "zigzag"}, "layout"),
        ({"refine": "median"}, "refine"),
        ({"balance": "random"}, "balance"),
        ({"ema": 0}, "ema"),
        ({"ema": "1.5"}, "ema"),
        ({"min_requests": 0}, "min_requests"),
        ({"overload": 0.5}, "overload"),
        ({"max_transfers": 0}, "max_transfers"),
        ({"starvation_skips": -1}, "starvation_skips"),
        ({"kv_link_gbps": 0}, "kv_link_gbps"),
        ({"d3": -1.0}, "d3"),
        ({"min_requests": "five"}, "min_requests"),
        ({"min_requests": "5.5"}, "min_requests"),
        ({"min_requests": 2.5}, "min_requests"),
        ({"ema": "abc"}, "ema"),
        ({"min_requests": True}, "min_requests"),
        ({"ema": False}, "ema"),
        ({"layout": True}, "layout"),
    ],
)
def test_params_reject_naming_the_key(values: dict[str, object], key: str) -> None:
    with pytest.raises(StagesConfigError, match=key):
        LengthStagesParams.from_mapping(values)


def test_params_unknown_key_lists_the_known_ones() -> None:
    with pytest.raises(StagesConfigError, match=r"unknown parameter\(s\) bogus, zzz; known: .*max_transfers"):
        LengthStagesParams.from_mapping({"zzz": 1, "bogus": 2, "ema": 0.5})


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"ema": "0.3", "min_requests": "5"}, {"ema": 0.3, "min_requests": 5}),
        ({"ema": 0.3, "min_requests": 5}, {"ema": 0.3, "min_requests": 5}),
        ({"min_requests": 5.0, "max_transfers": "7.0"}, {"min_requests": 5, "max_transfers": 7}),
        ({"overload": 2, "kv_link_gbps": "100"}, {"overload": 2.0, "kv_link_gbps": 100.0}),
        ({"layout": "chain", "refine": "count", "balance": "round_robin"},
         {"layout": "chain", "refine": "count", "balance": "round_robin"}),
        ({"plan": "/tmp/p.json"}, {"plan": "/tmp/p.json"}),
        ({}, {"ema": 0.3, "min_requests": 5, "layout": "dp", "refine": "qoe", "balance": "bidask"}),
    ],
)
def test_params_parse_strings_and_json_numbers(
    values: dict[str, object], expected: dict[str, object]
) -> None:
    params = LengthStagesParams.from_mapping(values)
    got = {key: getattr(params, key) for key in expected}
    assert got == expected
    assert all(type(got[k]) is type(v) for k, v in expected.items())


def test_params_direct_construction_validates_too() -> None:
    with pytest.raises(StagesConfigError,
                       match=r"ema must be in \(0, 1\], got 0.*max_transfers must be >= 1"):
        LengthStagesParams(ema=0.0, max_transfers=0)


# ---------------------------------------------------------------------------------------------------------
# The plan file


def _doc(*stages: dict[str, object]) -> dict[str, object]:
    return {"stages": list(stages)}


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({}, r"^plan: expected"),
        ({"stages": []}, r"^plan: expected"),
        ([1, 2], r"^plan: expected"),
        (_doc({"lo": 0, "hi": 100}, {"lo": 200, "hi": 300}),
         r"^plan\.stages\[1\]: .*adjacent.*lo 200 after hi 100"),
        (_doc({"lo": 0, "hi": 100}, {"lo": 50, "hi": 300}), r"^plan\.stages\[1\]: .*increasing"),
        (_doc({"lo": 0, "hi": 100}, {"lo": 100, "hi": 50}), r"^plan\.stages\[1\]: needs lo < hi"),
        (_doc({"lo": 0, "hi": 0}), r"^plan\.stages\[0\]: needs lo < hi"),
        (_doc({"lo": 0, "hi": 100}, {"lo": 100, "hi": 200, "instances": 0}),
         r"^plan\.stages\[1\]: .*instances"),
        (_doc({"lo": 10, "hi": 100}), r"^plan\.stages\[0\]: the first stage must start at 0"),
        (_doc({"lo": 0, "hi": 100}, {"lo": 100, "hi": 200, "instances": 2, "engines": ["a"]}),
         r"^plan\.stages\[1\]: .*its engines"),
        (_doc({"lo": 0, "hi": 100, "engines": "a"}), r"^plan\.stages\[0\]\.engines: expected a list"),
        (_doc({"lo": 0, "hi": 100, "engines": [1]}), r"^plan\.stages\[0\]\.engines"),
        (_doc({"lo": "x", "hi": 100}), r"^plan\.stages\[0\]: lo, hi and instances must be whole"),
        (_doc({"hi": 100}), r"^plan\.stages\[0\]: lo, hi"),
        (_doc({"lo": 0, "hi": 100}, 7), r"^plan\.stages\[1\]: expected an object"),
    ],
)
def test_plan_parse_errors_name_the_key(doc: object, message: str) -> None:
    with pytest.raises(StagesConfigError, match=message):
        StagesPlanFile.parse(doc)


def test_plan_parse_names_the_document() -> None:
    with pytest.raises(StagesConfigError, match=r"^stages\.json\.stages\[1\]"):
        StagesPlanFile.parse(_doc({"lo": 0, "hi": 100}, {"lo": 99, "hi": 200}), "stages.json")


def test_plan_parse_reads_stages_engines_and_model() -> None:
    parsed = StagesPlanFile.parse({"model": "m2", "stages": [
        {"lo": 0, "hi": 100, "instances": 2, "engines": ["x", "y"]}, {"lo": 100, "hi": 900}]})
    assert parsed.model == "m2"
    assert [(s.lo, s.hi, s.instances, s.engines) for s in parsed.stages] == [
        (0, 100, 2, ("x", "y")), (100, 900, 1, ())]


def test_check_engines_names_the_unknown_ones() -> None:
    parsed = StagesPlanFile.parse(_doc({"lo": 0, "hi": 100, "engines": ["a"]},
                                       {"lo": 100, "hi": 200, "instances": 2, "engines": ["zz", "b"]}))
    parsed.check_engines(["a", "b", "zz", "c"])
    with pytest.raises(StagesConfigError, match=r"^plan\.stages\[1\]\.engines: unknown engine\(s\) zz$"):
        parsed.check_engines(["a", "b"])
    with pytest.raises(StagesConfigError, match=r"^f\.stages\[0\]\.engines: unknown engine\(s\) a$"):
        parsed.check_engines(["b", "zz"], "f")


# ---------------------------------------------------------------------------------------------------------
# The first layout


ENGINE_IDS = "abcdefgh"


@pytest.mark.parametrize(
    ("fleet", "expected"),
    [
        (4, [(0, 100, ("a",), (100,)), (100, 1000, ("b",), (1000,)), (1000, 4096, ("c", "d"), (4096, 4096))]),
        (8, [(0, 100, ("a", "b"), (100, 100)), (100, 1000, ("c", "d"), (1000, 1000)),
             (1000, 4096, ("e", "f", "g", "h"), (4096,) * 4)]),
        # fewer engines than planned instances: a stage scaled to none hands its range to the one below
        (2, [(0, 1000, ("a",), (1000,)), (1000, 4096, ("b",), (4096,))]),
        (1, [(0, 4096, ("a",), (4096,))]),
    ],
)
def test_plan_lays_stages_over_engines_in_id_order(
    fleet: int, expected: list[tuple[int, int, tuple[str, ...], tuple[int, ...]]]
) -> None:
    rs = rescheduler(plan((0, 100, 1), (100, 1000, 1), (1000, 4096, 2)), refine="off")
    views = [view(e) for e in reversed(ENGINE_IDS[:fleet])]  # the snapshot orders them
    assert tick(rs, *views) == []
    assert shape(rs) == expected


def test_plan_with_named_engines_puts_the_unnamed_ones_last() -> None:
    named = StagesPlanFile.parse(_doc({"lo": 0, "hi": 1000, "engines": ["c"]},
                                      {"lo": 1000, "hi": 4096, "engines": ["a"]}))
    rs = rescheduler(named, refine="off")
    tick(rs, view("a"), view("b"), view("c"))
    assert shape(rs) == [(0, 1000, ("c",), (1000,)), (1000, 4096, ("a", "b"), (4096, 4096))]


def test_plan_for_another_model_is_ignored() -> None:
    other = StagesPlanFile.parse({"model": "other", "stages": [{"lo": 0, "hi": 10}, {"lo": 10, "hi": 20}]})
    rs = rescheduler(other, refine="off")
    tick(rs, view("a"), view("b"))
    assert shape(rs) == [(0, 1 << 17, ("a", "b"), (1 << 17, 1 << 17))]


@pytest.mark.parametrize(("max_len", "hi"), [(0, 1 << 17), (8192, 8192)])
def test_without_plan_or_history_one_stage_of_every_engine(max_len: int, hi: int) -> None:
    rs = rescheduler(max_len=max_len)
    assert rs.layouts() == {}
    tick(rs, view("b"), view("a"), view("c"))
    assert shape(rs) == [(0, hi, ("a", "b", "c"), (hi, hi, hi))]
    assert rs.layouts()[MODEL].model == MODEL


HISTORY = [(100, 50), (120, 80), (200, 300), (50, 20), (1500, 900), (2000, 1500), (300, 200), (80, 40)]


@pytest.mark.parametrize("layout", ["chain", "dp"])
def test_history_holding_min_requests_is_planned(layout: str) -> None:
    rs = rescheduler(history=HISTORY, layout=layout, refine="off", max_len=4096, min_requests=5)
    tick(rs, view("a"), view("b"), view("c"))
    method = "chain" if layout == "chain" else "heuristic"
    link = TransferCost(float(KVB), 25.0 / 8)
    planned = plan_stages(3, 4096, HISTORY, QoEModel(PROFILED_QOE_D), link, method)
    expected, at = [], 0
    for st in planned.stages:
        engines = tuple("abc"[at:at + st.instances])
        at += st.instances
        expected.append((st.lo, st.hi, engines, (st.hi,) * len(engines)))
    assert shape(rs) == expected
    if layout == "chain":
        assert len(expected) == 3
    assert rs.counts["replans"] == 0  # the first layout is no re-plan


def test_history_short_of_min_requests_is_not_planned() -> None:
    rs = rescheduler(history=HISTORY[:4], layout="chain", refine="off", max_len=4096, min_requests=5)
    tick(rs, view("a"), view("b"), view("c"))
    assert shape(rs) == [(0, 4096, ("a", "b", "c"), (4096,) * 3)]


def test_a_plan_wins_over_history() -> None:
    rs = rescheduler(TWO, history=HISTORY, layout="chain", refine="off", max_len=4096, min_requests=1)
    tick(rs, view("a"), view("b"))
    assert shape(rs) == [(0, 1000, ("a",), (1000,)), (1000, 4096, ("b",), (4096,))]


def test_engines_that_cannot_decode_are_left_out() -> None:
    rs = rescheduler(refine="off", max_len=4096)
    tick(rs, view("a"), view("b", ready=False), view("c", ejected=True), view("d", stale=True),
         view("e", role="prefill"), view("f", role="decode"), engine("g", model="other"))
    assert shape(rs) == [(0, 4096, ("a", "f"), (4096, 4096))]


def test_no_engine_of_the_model_proposes_nothing() -> None:
    rs = rescheduler(TWO)
    assert tick(rs, engine("a", model="other")) == []
    assert rs.layouts() == {}


# ---------------------------------------------------------------------------------------------------------
# Refinement (§4.3)

# stage 0 (engine a, bound 1000) holds four requests; stage 1 (engine b) two: a's pool is all six
A_ROWS = [(100, 300), (200, 500), (50, 700), (300, 900)]
B_ROWS = [(500, 1500), (800, 2500)]


def _refine_views(a_rows: Sequence[tuple[int, int]] = A_ROWS, b_rows: Sequence[tuple[int, int]] = B_ROWS,
                  **values: Any) -> tuple[EngineView, EngineView]:
    return (view("a", *(req(f"a{j}", length, prompt) for j, (prompt, length) in enumerate(a_rows)), **values),
            view("b", *(req(f"b{j}", length, prompt) for j, (prompt, length) in enumerate(b_rows)), **values))


@pytest.mark.parametrize(("refine", "ema"), [("qoe", 0.3), ("qoe", 1.0), ("count", 0.3), ("memory", 0.5)])
def test_refinement_moves_the_bound_by_one_ema_step(refine: str, ema: float) -> None:
    rs = rescheduler(TWO, refine=refine, ema=ema, min_requests=5, max_len=4096)
    tick(rs, *_refine_views())
    pool = sorted([*A_ROWS, *B_ROWS], key=lambda r: r[1])
    target = _split_length(pool, refine, PROFILED_QOE_D)  # type: ignore[arg-type]
    if refine == "count":
        assert target == pool[len(pool) // 2][1] == 900  # the median
    expected = (1 - ema) * 1000 + ema * target
    assert expected != 1000
    assert shape(rs) == [(0, round(expected), ("a",), (round(expected),)),
                         (round(expected), 4096, ("b",), (4096,))]
    # a second tick on the same requests takes one more step
    tick(rs, *_refine_views(), at=T0 + 0.5)
    second = (1 - ema) * expected + ema * target
    assert shape(rs)[0][3] == (round(second),)


def test_refinement_uses_the_engines_pushed_qoe_fits_weighted_by_samples() -> None:
    fit_a, fit_b = (0.0, 1.0, 0.0, 0.0, 0.0), (0.0, 0.0, 0.0, 0.0, 1e-3)
    a, b = _refine_views()
    a = view("a", *a.predictions, qoe=QoEReport(fit_a, samples=3, mean_relative_error=0.1))
    b = view("b", *b.predictions, qoe=QoEReport(fit_b, samples=1, mean_relative_error=0.1))
    rs = rescheduler(TWO, refine="qoe", ema=1.0, min_requests=5, max_len=4096)
    tick(rs, a, b)
    pool = sorted([*A_ROWS, *B_ROWS], key=lambda r: r[1])
    mean = tuple((x * 3 + y * 1) / 4 for x, y in zip(fit_a, fit_b, strict=True))
    target = _split_length(pool, "qoe", mean)  # type: ignore[arg-type]
    assert target != _split_length(pool, "qoe", PROFILED_QOE_D)  # the fits matter here
    swapped = tuple((x * 1 + y * 3) / 4 for x, y in zip(fit_a, fit_b, strict=True))
    assert target != _split_length(pool, "qoe", swapped)  # and so do their samples
    assert shape(rs)[0][3] == (round(target),)


def test_refinement_freezes_below_min_requests() -> None:
    rs = rescheduler(TWO, refine="qoe", ema=0.5, min_requests=7, max_len=4096)  # the pool holds six
    tick(rs, *_refine_views())
    assert shape(rs) == [(0, 1000, ("a",), (1000,)), (1000, 4096, ("b",), (4096,))]


def test_refinement_off_keeps_the_plan() -> None:
    rs = rescheduler(TWO, refine="off", min_requests=1, max_len=4096)
    tick(rs, *_refine_views())
    assert shape(rs)[0][:2] == (0, 1000)


def test_refined_bounds_stay_increasing_across_stages() -> None:
    # a's pool (its six at 3000 and b's five at 50) splits at 3000: clamped to the next stage's hi - 1 = 999;
    # b's pool (its five at 50) splits at 50: clamped above its stage's new lo, to 1000
    rs = rescheduler(THREE, refine="count", ema=1.0, min_requests=5, max_len=4096)
    a = view("a", *(req(f"a{j}", 3000, 10) for j in range(6)))
    b = view("b", *(req(f"b{j}", 50, 10) for j in range(5)))
    tick(rs, a, b, view("c"))
    assert shape(rs) == [(0, 999, ("a",), (999,)), (999, 1000, ("b",), (1000,)),
                         (1000, 4096, ("c",), (4096,))]


def test_a_stage_hi_is_the_mean_of_its_engines_bounds() -> None:
    # stage 0 has a and b; only a has a pool of min_requests (its own three and c's two)
    two_engines = plan((0, 1000, 2), (1000, 4096, 1))
    rs = rescheduler(two_engines, refine="count", ema=1.0, min_requests=5, max_len=4096)
    a = view("a", req("a0", 100, 10), req("a1", 200, 10), req("a2", 300, 10))
    c = view("c", req("c0", 2000, 10), req("c1", 3000, 10))
    tick(rs, a, view("b"), c)
    # a's pool [100, 200, 300, 2000, 3000]: median 300; b's [2000, 3000] is short: stays 1000
    assert shape(rs)[0] == (0, 650, ("a", "b"), (300, 1000))


# ---------------------------------------------------------------------------------------------------------
# Hand-over


@pytest.mark.parametrize(
    ("request_", "exclude", "expected"),
    [
        (req("r1", 1200), (), [Move("r1", EngineId("a"), EngineId("b"), MODEL, "handover", 1200)]),
        (req("r1", 1000), (), [Move("r1", EngineId("a"), EngineId("b"), MODEL, "handover", 1000)]),
        (req("r1", 999), (), []),
        (req("r1", 1200), ("r1",), []),
        (req("r1", 1200, migratable=False), (), []),
    ],
    ids=["crossing", "at-the-bound", "short", "excluded", "not-migratable"],
)
def test_handover_of_a_request_past_its_engines_bound(
    request_: RequestPrediction, exclude: tuple[str, ...], expected: list[Move]
) -> None:
    rs = rescheduler(TWO, refine="off", max_len=4096)
    assert tick(rs, view("a", request_), view("b"), exclude=exclude) == expected
    assert rs.counts["handover"] == len(expected)


def test_handover_goes_to_the_first_later_stage_whose_hi_exceeds_the_length() -> None:
    four = plan((0, 100, 1), (100, 1000, 1), (1000, 2000, 1), (2000, 4096, 1))
    rs = rescheduler(four, refine="off", max_len=4096)
    moves = tick(rs, view("a", req("r500", 500), req("r1500", 1500), req("r3000", 3000)),
                 view("b", req("b1", 1200)), view("c"), view("d"))
    assert pairs(moves) == {("r500", "a", "b"), ("r1500", "a", "c"), ("r3000", "a", "d"), ("b1", "b", "c")}


def test_requests_on_the_last_stage_stay() -> None:
    rs = rescheduler(TWO, refine="off", max_len=4096, balance="handover")
    assert tick(rs, view("a"), view("b", req("r1", 4000))) == []


@pytest.mark.parametrize(("limit", "moved_again"), [(1, False), (2, True), (0, True)])
def test_max_migrations_per_request(limit: int, moved_again: bool) -> None:
    # 0 means the stage count (2)
    rs = rescheduler(TWO, refine="off", max_len=4096, max_migrations_per_request=limit,
                     transfer_timeout_s=5.0)
    assert len(tick(rs, view("a", req("r1", 1200)), view("b"))) == 1
    # the transfer times out with the request still on a: it may be asked again below the limit
    again = tick(rs, view("a", req("r1", 1200)), view("b"), at=T0 + 6)
    assert [m.request_id for m in again] == (["r1"] if moved_again else [])


def test_max_moves_per_request_leaves_one_follow_for_a_fallback() -> None:
    assert MAX_MOVES_PER_REQUEST + 1 == DEFAULT_MAX_FOLLOWS


# ---------------------------------------------------------------------------------------------------------
# Bid-ask (§4.4)

# (engine id, load in tokens, report age in seconds)
Receiver = tuple[str, int, float]
SIX_TIED = [("b", 0, 0.1), ("c", 0, 0.1), ("d", 0, 0.1), ("e", 9, 0.1), ("f", 9, 0.1), ("g", 9, 0.1)]


@pytest.mark.parametrize(
    ("receivers", "rand", "winner"),
    [
        ([("b", 0, 0.0)], 0.0, "b"),
        # n = 2: one kept, the lower load, however stale
        ([("b", 500, 0.0), ("c", 100, 0.9)], 0.0, "c"),
        # n = 3: two kept (ceil(3/2)); the fresher of them
        ([("b", 100, 0.2), ("c", 200, 0.3), ("d", 300, 0.0)], 0.0, "b"),
        # n = 4: the higher-load half is dropped however fresh
        ([("b", 100, 0.5), ("c", 200, 0.1), ("d", 300, 0.0), ("e", 400, 0.0)], 0.0, "c"),
        # n = 8: four kept by load, of them the 3 earliest starts (all 0 here: the lower loads, then by id),
        # e dropped though freshest
        ([("b", 0, 0.3), ("c", 0, 0.2), ("d", 0, 0.1), ("e", 0, 0.0),
          ("f", 900, 0.0), ("g", 900, 0.0), ("h", 900, 0.0), ("i", 900, 0.0)], 0.0, "d"),
        ([("b", 30, 0.0), ("c", 20, 0.1), ("d", 10, 0.2), ("e", 0, 0.3),
          ("f", 900, 0.0), ("g", 900, 0.0), ("h", 900, 0.0), ("i", 900, 0.0)], 0.0, "c"),
        # exact ties of report age: the injected rand picks among the earliest three
        (SIX_TIED, 0.0, "b"),
        (SIX_TIED, 0.4, "c"),
        (SIX_TIED, 0.99, "d"),
    ],
)
def test_bid_ask_picks_the_receiver(receivers: list[Receiver], rand: float, winner: str) -> None:
    rs = rescheduler(plan((0, 1000, 1), (1000, 4096, len(receivers))), refine="off", max_len=4096,
                     rand=lambda: rand)
    views = [view(e, running_batch_tokens=load, state_age_s=age) for e, load, age in receivers]
    moves = tick(rs, view("a", req("r1", 1500)), *views)
    assert pairs(moves) == {("r1", "a", winner)}
    assert pending(rs) == {winner: 1500}


@pytest.mark.parametrize(
    ("pending", "rates", "ages", "winner"),
    [
        # no pending: every start is 0, the three lowest ids kept, d (freshest) dropped
        ({}, {}, {"a": 0.3, "b": 0.2, "c": 0.1, "d": 0.0}, "c"),
        # c's pending tokens start late on the default link: dropped; d kept
        ({"c": 10_000}, {}, {"a": 0.3, "b": 0.2, "c": 0.0, "d": 0.1}, "d"),
        # the same pending over a fast measured throughput starts earlier than b's over the link
        ({"b": 10, "c": 10_000}, {"c": 1e15}, {"a": 0.3, "b": 0.2, "c": 0.0, "d": 0.1}, "c"),
    ],
)
def test_bid_winner_keeps_the_three_earliest_starts(
    pending: dict[str, int], rates: dict[str, float], ages: dict[str, float], winner: str
) -> None:
    # 7 receivers: a-d light (kept by load), e-g heavy; pending tokens count in the load too, so the heavy
    # ones stay heavier
    receivers = [view(e, running_batch_tokens=0 if e in "abcd" else 1_000_000, state_age_s=ages.get(e, 0.0),
                      transfer_bytes_per_s=rates.get(e, 0.0)) for e in "abcdefg"]
    got = bid_winner(receivers, {EngineId(k): v for k, v in pending.items()}, 25e9 / 8, lambda: 0.0)
    assert got is not None and got.engine_id == winner


def test_bid_winner_without_receivers() -> None:
    assert bid_winner([], {}, 1.0, lambda: 0.0) is None


def test_later_asks_see_the_tokens_won_earlier() -> None:
    # b and c equally loaded: r1 (asked first, the longest) goes to b by id; then b holds r1's tokens won
    rs = rescheduler(plan((0, 1000, 1), (1000, 4096, 2)), refine="off", max_len=4096)
    moves = tick(rs, view("a", req("r1", 1500), req("r2", 1400)), view("b"), view("c"))
    assert pairs(moves) == {("r1", "a", "b"), ("r2", "a", "c")}


def test_round_robin_takes_receivers_in_turn() -> None:
    rs = rescheduler(plan((0, 1000, 1), (1000, 4096, 3)), refine="off", max_len=4096, balance="round_robin",
                     max_transfers=10)
    heavy = {"running_batch_tokens": 1_000_000}
    moves = tick(rs, view("a", req("r1", 1500), req("r2", 1400), req("r3", 1300), req("r4", 1200)),
                 view("b", **heavy), view("c"), view("d", state_age_s=5.0))
    assert pairs(moves) == {("r1", "a", "b"), ("r2", "a", "c"), ("r3", "a", "d"), ("r4", "a", "b")}
    # the turn carries over to the next tick
    more = tick(rs, view("a", req("r1", 1500), req("r2", 1400), req("r3", 1300), req("r4", 1200),
                         req("r5", 1100)), view("b", **heavy), view("c"), view("d"), at=T0 + 0.5)
    assert pairs(more) == {("r5", "a", "c")}


def test_seeded_rand_is_reproducible() -> None:
    def run(seed: int) -> list[tuple[str, str, str]]:
        rs = rescheduler(plan((0, 1000, 2), (1000, 4096, 6)), refine="off", max_len=4096,
                         rand=random.Random(seed).random, max_transfers=10)
        senders = [view(s, *(req(f"{s}{j}", 1100 + j) for j in range(4))) for s in "ab"]
        moves = tick(rs, *senders, *(view(e) for e in "cdefgh"))
        return sorted((m.request_id, m.source, m.target) for m in moves)

    assert run(7) == run(7)
    assert len(run(7)) == 8


# ---------------------------------------------------------------------------------------------------------
# Transfers: pacing, caps, starvation, room


@pytest.mark.parametrize(("rate", "expected"), [(SLOW, 2), (0.0, 4)])
def test_one_transfer_at_a_time_per_sender_within_the_estimate(rate: float, expected: int) -> None:
    # senders a and b (stage 0) own two crossing requests each; c receives over `rate` (0: the 25 Gbps link)
    rs = rescheduler(plan((0, 1000, 2), (1000, 4096, 1)), refine="off", max_len=4096, max_transfers=10)
    senders = (view("a", req("a1", 1100), req("a2", 1200)), view("b", req("b1", 1100), req("b2", 1200)))
    moves = tick(rs, *senders, view("c", transfer_bytes_per_s=rate))
    assert len(moves) == expected
    assert {m.source for m in moves} == {"a", "b"}
    if rate == SLOW:
        # a's pull (~1.2 s) still fills the next tick; once its estimate ends the other one goes
        assert tick(rs, *senders, view("c", transfer_bytes_per_s=rate), at=T0 + 0.5) == []
        later = tick(rs, *senders, view("c", transfer_bytes_per_s=rate), at=T0 + 1.5)
        assert len(later) == 2 and {m.source for m in later} == {"a", "b"}
        assert {m.request_id for m in moves} | {m.request_id for m in later} == {"a1", "a2", "b1", "b2"}


def test_transfers_per_receiver_in_flight_are_capped() -> None:
    rs = rescheduler(plan((0, 1000, 4), (1000, 4096, 1)), refine="off", max_len=4096, max_transfers=2)
    senders = [view(s, req(f"{s}1", 1100)) for s in "abcd"]
    slow = view("e", transfer_bytes_per_s=SLOW)
    first = tick(rs, *senders, slow)
    assert len(first) == 2
    assert tick(rs, *senders, slow, at=T0 + 0.5) == []  # both still in flight (~1.1 s each)
    then = tick(rs, *senders, slow, at=T0 + 2.0)
    assert len(then) == 2
    assert {m.request_id for m in first} | {m.request_id for m in then} == {"a1", "b1", "c1", "d1"}


def test_fast_transfers_free_their_slot_by_the_next_tick() -> None:
    rs = rescheduler(TWO, refine="off", max_len=4096, max_transfers=2)
    a = view("a", *(req(f"r{j}", 1100 + j) for j in range(5)))
    assert len(tick(rs, a, view("b"))) == 2
    assert len(tick(rs, a, view("b"), at=T0 + 0.5)) == 2
    assert len(tick(rs, a, view("b"), at=T0 + 1.0)) == 1


@pytest.mark.parametrize(("skips", "first_sent", "starved"), [(1, "r1", 1), (10, "r2", 0)])
def test_starvation_a_skipped_request_is_owed_next(skips: int, first_sent: str, starved: int) -> None:
    rs = rescheduler(TWO, refine="off", max_len=4096, starvation_skips=skips)
    b = view("b", transfer_bytes_per_s=SLOW)  # one pull per tick from a
    # t0: r1 won by b, a busy in the mover: skipped
    assert tick(rs, view("a", req("r1", 1100)), b, busy=("a",)) == []
    assert rs.counts["skips"] == 1
    # t1: r2 asked (the sender's load is higher now: r2 queues ahead of r1); a still busy: both skipped
    both = view("a", req("r1", 1100), req("r2", 1200))
    assert tick(rs, both, b, busy=("a",), at=T0 + 0.5) == []
    assert rs.counts["starved"] == starved
    # t2: a free: past starvation_skips it owes r1, which goes before r2
    moves = tick(rs, both, b, at=T0 + 1.0)
    assert [m.request_id for m in moves] == [first_sent]


def test_a_sender_owing_a_finished_request_sends_others() -> None:
    rs = rescheduler(TWO, refine="off", max_len=4096, starvation_skips=0)
    assert tick(rs, view("a", req("r1", 1100)), view("b"), busy=("a",)) == []
    assert rs.counts["starved"] == 1  # a owes r1
    # r1 finishes on a; r2 crosses a's bound and a is free
    moves: list[Move] = []
    for k in range(1, 6):
        moves += tick(rs, view("a", req("r2", 1200)), view("b"), at=T0 + 0.5 * k)
    assert [m.request_id for m in moves] == ["r2"]


def test_a_request_won_by_a_receiver_that_leaves_is_asked_again() -> None:
    rs = rescheduler(plan((0, 1000, 1), (1000, 4096, 2)), refine="off", max_len=4096)
    c = view("c", running_batch_tokens=10)
    assert tick(rs, view("a", req("r1", 1200)), view("b"), c, busy=("a",)) == []  # b won r1; a busy
    # b is gone for good; a is free and r1 still past a's bound: c, the stage's last receiver, should get it
    moves: list[Move] = []
    for k in range(1, 6):
        moves += tick(rs, view("a", req("r1", 1200)), c, at=T0 + 0.5 * k)
    assert pairs(moves) == {("r1", "a", "c")}


def test_no_room_on_the_receiver_the_request_stays_and_is_asked_again() -> None:
    rs = rescheduler(TWO, refine="off", max_len=4096)
    a = view("a", req("r1", 1200))
    assert tick(rs, a, view("b", free_blocks=74)) == []  # 74 x 16 = 1184 < 1200
    assert rs.counts["stays"] == 1
    assert pending(rs) == {}
    moves = tick(rs, a, view("b", free_blocks=75), at=T0 + 0.5)  # 1200 fits
    assert pairs(moves) == {("r1", "a", "b")}


def test_room_on_the_receiver_counts_the_tokens_in_flight_to_it() -> None:
    # c has 2,400 tokens free: b1 (1,300, its sender's load the higher) goes first, then 1,100 < a1's 1,200
    rs = rescheduler(plan((0, 1000, 2), (1000, 4096, 1)), refine="off", max_len=4096)
    moves = tick(rs, view("a", req("a1", 1200)), view("b", req("b1", 1300)), view("c", free_blocks=150))
    assert [m.request_id for m in moves] == ["b1"]
    assert rs.counts["stays"] == 1


# ---------------------------------------------------------------------------------------------------------
# Intra-stage rebalance

# one stage of a, b, c; a's KV holds 10,240 tokens, b's and c's 1,024: mean 4,096, a above 1.25 x mean by
# 6,144, covered by its two longest requests
OVERLOADED = (view("a", req("r4000", 4000), req("r3000", 3000), req("r2000", 2000), req("r1000", 1000),
                   free_blocks=10_000 - 640),
              view("b", free_blocks=10_000 - 64), view("c", free_blocks=10_000 - 64))


@pytest.mark.parametrize(
    ("balance", "expected"),
    [
        ("bidask", {("r4000", "a", "b", "rebalance"), ("r3000", "a", "c", "rebalance")}),
        ("handover", set()),
        ("round_robin", set()),
    ],
)
def test_intra_stage_rebalance_offers_the_longest_requests(balance: str, expected: set[object]) -> None:
    rs = rescheduler(balance=balance, max_len=1 << 17)
    moves = tick(rs, *OVERLOADED)
    assert {(m.request_id, m.source, m.target, m.reason) for m in moves} == expected
    assert rs.counts["rebalance"] == len(expected)


@pytest.mark.parametrize(
    ("receiver_load", "moved"),
    [(0, ["r900"]), (599, ["r900"]), (600, ["r600"]), (899, ["r600"]), (900, []), (5000, [])],
)
def test_a_rebalance_that_would_leave_the_receiver_fuller_than_the_sender_is_dropped(
    receiver_load: int, moved: list[str]
) -> None:
    # a holds 1,500 tokens (r900 and r600) and is overloaded against b (its excess covers both): a bid goes
    # to b only while b's load (plus what it won this tick) plus the request stays below a's 1,500
    rs = rescheduler(max_len=1 << 17)
    a = view("a", req("r900", 900), req("r600", 600), free_blocks=10_000 - 640)
    b = view("b", running_batch_tokens=receiver_load, free_blocks=10_000 - 64)
    moves = tick(rs, a, b)
    assert [m.request_id for m in moves] == moved
    assert all(m.reason == "rebalance" for m in moves)


def test_no_rebalance_below_the_overload_factor() -> None:
    rs = rescheduler(overload=3.0, max_len=1 << 17)  # 10,240 < 3 x 4,096
    assert tick(rs, *OVERLOADED) == []


def test_rebalance_stays_within_the_stage() -> None:
    # stage 0 is a, b (a overloaded); stage 1 is c: a's short requests go to b only
    rs = rescheduler(plan((0, 5000, 2), (5000, 8192, 1)), refine="off", max_len=8192)
    a = view("a", req("r900", 900), req("r800", 800), free_blocks=10_000 - 640, running_batch_tokens=10_240)
    moves = tick(rs, a, view("b", free_blocks=10_000 - 64), view("c"))
    assert {(m.request_id, m.target, m.reason) for m in moves} == {("r900", "b", "rebalance"),
                                                                    ("r800", "b", "rebalance")}


# ---------------------------------------------------------------------------------------------------------
# The layout's upkeep


@pytest.mark.parametrize(
    ("gone", "expected"),
    [
        ("a", [(0, 1000, ("b",), (1000,)), (1000, 4096, ("c",), (4096,))]),
        ("b", [(0, 1000, ("a",), (1000,)), (1000, 4096, ("c",), (4096,))]),
        ("c", [(0, 100, ("a",), (100,)), (100, 4096, ("b",), (4096,))]),
    ],
)
def test_a_stage_whose_engines_vanish_merges_into_its_neighbour(
    gone: str, expected: list[tuple[int, int, tuple[str, ...], tuple[int, ...]]]
) -> None:
    rs = rescheduler(THREE, refine="off", max_len=4096)
    tick(rs, view("a"), view("b"), view("c"))
    assert len(shape(rs)) == 3
    tick(rs, *(view(e) for e in "abc" if e != gone), at=T0 + 0.5)
    assert shape(rs) == expected
    his = [hi for _, hi, _, _ in expected]
    assert his == sorted(set(his))
    assert all(lo == prev for (lo, *_), (_, prev, *_) in zip(expected[1:], expected, strict=False))


def test_an_engine_that_is_not_ready_leaves_its_stage_too() -> None:
    rs = rescheduler(THREE, refine="off", max_len=4096)
    tick(rs, view("a"), view("b"), view("c"))
    tick(rs, view("a"), view("b", ready=False), view("c"), at=T0 + 0.5)
    assert [s[2] for s in shape(rs)] == [("a",), ("c",)]


@pytest.mark.parametrize("named", [True, False])
def test_an_engine_late_at_start_up_gets_its_planned_stage(named: bool) -> None:
    doc = {"stages": [{"lo": 0, "hi": 1000, "instances": 1, **({"engines": ["a"]} if named else {})},
                      {"lo": 1000, "hi": 4096, "instances": 1, **({"engines": ["b"]} if named else {})}]}
    rs = rescheduler(StagesPlanFile.parse(doc), refine="off", max_len=4096)
    tick(rs, view("a"))  # b has not reported yet: one stage
    assert [s[2] for s in shape(rs)] == [("a",)]
    tick(rs, view("a"), view("b"), at=T0 + 0.5)
    assert shape(rs) == [(0, 1000, ("a",), (1000,)), (1000, 4096, ("b",), (4096,))]
    tick(rs, view("a"), at=T0 + 1.0)  # b gone: merged; b back: its stage again
    tick(rs, view("a"), view("b"), at=T0 + 1.5)
    assert shape(rs) == [(0, 1000, ("a",), (1000,)), (1000, 4096, ("b",), (4096,))]


@pytest.mark.parametrize(("loaded", "stage"), [("a", 0), ("b", 1), ("c", 2)])
def test_a_new_engine_joins_the_stage_with_the_most_tokens_per_engine(loaded: str, stage: int) -> None:
    rs = rescheduler(THREE, refine="off", max_len=4096)
    tick(rs, view("a"), view("b"), view("c"))
    views = [view(e, running_batch_tokens=5000 if e == loaded else 10) for e in "abc"]
    tick(rs, *views, view("d"), at=T0 + 0.5)
    layout = shape(rs)
    assert len(layout) == 3
    lo, hi, engines, bounds = layout[stage]
    assert engines == tuple(sorted((loaded, "d")))
    assert bounds == (hi, hi)


def test_finished_requests_feed_the_replanning_window() -> None:
    def run(ticks: Sequence[tuple[float, bool]], min_requests: int = 3) -> int:
        rs = rescheduler(min_requests=min_requests, plan_interval_s=10.0, max_len=4096)
        for at, present in ticks:
            rows = (req("r1", 300, 100), req("r2", 900, 500), req("r3", 2000, 1000)) if present else ()
            tick(rs, view("a", *rows), view("b"), view("c"), at=at)
        return rs.counts["replans"]

    # gone for two ticks (t=101 and t=111): three finished, re-planned at t=111
    assert run([(100.0, True), (101.0, False), (111.0, False)]) == 1
    # gone for one tick only when the interval is up: not finished yet
    assert run([(100.0, True), (111.0, False)]) == 0
    # gone for two ticks, but the interval is not up
    assert run([(100.0, True), (101.0, False), (105.0, False)]) == 0
    # gone for two ticks, but fewer than min_requests finished
    assert run([(100.0, True), (101.0, False), (111.0, False)], min_requests=4) == 0
    # back in between: never gone for two ticks in a row
    assert run([(100.0, True), (101.0, False), (102.0, True), (111.0, False)]) == 0


def test_a_replan_keeps_engines_in_order_and_redraws_the_walls() -> None:
    rs = rescheduler(history=HISTORY, layout="chain", min_requests=5, plan_interval_s=10.0, max_len=4096,
                     refine="off")
    tick(rs, view("a"), view("b"), view("c"))
    first = shape(rs)
    tick(rs, view("a"), view("b"), view("c"), at=T0 + 10)
    assert rs.counts["replans"] == 1
    assert [e for s in shape(rs) for e in s[2]] == ["a", "b", "c"]
    assert shape(rs) == first  # the same window: the same walls


# ---------------------------------------------------------------------------------------------------------
# Moves the mover did not start


@pytest.mark.parametrize(("status", "again"), [(None, 0), (409, 1), (503, 1), (404, 0)])
def test_not_started(status: int | None, again: int) -> None:
    rs = rescheduler(TWO, refine="off", max_len=4096)
    a = view("a", req("r1", 1200))
    (move,) = tick(rs, a, view("b"))
    if status is not None:
        rs.not_started(move, status)
    assert len(tick(rs, a, view("b"), at=T0 + 0.5)) == again
    assert len(tick(rs, a, view("b"), at=T0 + 100)) == (0 if status == 404 else 1)  # 404: never again


def test_not_started_for_an_unknown_model_is_ignored() -> None:
    rs = rescheduler(TWO)
    rs.not_started(Move("r1", EngineId("a"), EngineId("b"), "nope", "handover", 1), 409)


def test_a_transfer_ends_when_the_request_decodes_on_another_engine() -> None:
    rs = rescheduler(TWO, refine="off", max_len=4096)
    (move,) = tick(rs, view("a", req("r1", 1200)), view("b"))
    assert pending(rs) == {"b": 1200}
    tick(rs, view("a"), view("b", req("r1", 1210)), at=T0 + 0.5)
    assert pending(rs) == {}
