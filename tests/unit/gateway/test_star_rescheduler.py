"""STAR's rescheduler (`gateway.rescheduling.star`): hand cases with exact expectations, and the
O(1)-per-candidate evaluation against a naive one that recomputes every engine's H-round trace from the
per-request predictions for each candidate (O(R H) per candidate), on 1,000 random fleets with fixed seeds."""

from __future__ import annotations

import random
import statistics
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from builders import MODEL, engine, snapshot

from gateway.domain import ClusterSnapshot, EngineView, FutureLoad, RequestPrediction
from gateway.rescheduling.star import TIE_RELATIVE, Migration, StarParams, propose
from switchyard.star_load import engine_summary, request_trace

LINK = 25e9 / 8  # bytes/s of the default 25 Gbps link


def star_engine(
    engine_id: str,
    requests: list[tuple[int, float]],
    *,
    round_tokens: int = 20,
    horizon: int = 32,
    summary: bool = True,
    capacity_tokens: int = 1_000_000,
    kv_bytes_per_token: int = 1000,
    last_iteration_s: float = 0.02,
    migratable: tuple[bool, ...] = (),
    **values: Any,
) -> EngineView:
    """An engine reporting `requests` as (N(r), N-hat(r)), ids '<engine>-r<j>', with the agent's summary."""
    predictions = tuple(
        RequestPrediction(f"{engine_id}-r{j}", n, rem, migratable=migratable[j] if migratable else True)
        for j, (n, rem) in enumerate(requests)
    )
    load = tuple(engine_summary(requests, round_tokens, horizon))
    future = FutureLoad(0, round_tokens, load) if summary else None
    return engine(
        engine_id, predictions=predictions, future_load=future, kv_blocks_total=capacity_tokens // 16,
        block_size=16, kv_bytes_per_token=kv_bytes_per_token, last_iteration_s=last_iteration_s,
        running_batch_tokens=sum(n for n, _ in requests), num_running=len(requests), **values,
    )


# ---------------------------------------------------------------------------------------------------------
# The naive reference: classification, filters and Eq. 3-4 from scratch, every candidate's fleet recomputed.


def naive_propose(
    snap: ClusterSnapshot, params: StarParams, exclude: frozenset[str] = frozenset(),
    busy: frozenset[str] = frozenset(),
) -> tuple[str, str, str, float] | None:
    """(request, source, target, reduction) of the best candidate over every model, or None."""
    best: tuple[str, str, str, float] | None = None
    for model in sorted({e.model for e in snap.engines}):
        engines = [e for e in snap.engines if e.model == model and e.role in ("", "decode") and e.ready
                   and not e.ejected and not e.stale]
        found = _naive_model(engines, params, exclude, busy)
        if found is not None and (best is None or found[3] > best[3]):
            best = found
    return best


def _naive_model(
    engines: list[EngineView], params: StarParams, exclude: frozenset[str], busy: frozenset[str]
) -> tuple[str, str, str, float] | None:
    n = len(engines)
    if n < 2:
        return None
    h = params.horizon if params.use_prediction else 0
    beta = np.array([params.beta ** t for t in range(1, h + 1)])
    ks = [e.future_load.round_tokens if params.use_prediction and e.future_load is not None
          and e.future_load.round_tokens >= 1 else params.round_tokens for e in engines]
    held = [0.0 if e.predictions else float(e.running_batch_tokens) for e in engines]

    def trace(p: RequestPrediction, k: int) -> list[float]:
        return request_trace(p.current_tokens, p.predicted_remaining_tokens, k, h)

    def rows(i: int) -> tuple[np.ndarray, np.ndarray]:  # (N of each request, (R, H) traces) on engine i
        preds = engines[i].predictions
        traces = np.array([trace(p, ks[i]) for p in preds]).reshape(len(preds), h)
        return np.array([float(p.current_tokens) for p in preds]), traces

    def objective(load0: np.ndarray, load: np.ndarray) -> np.ndarray:  # (..., n), (..., n, H)
        return np.var(load0, axis=-1) + (np.var(load, axis=-2) @ beta if h else 0.0)

    per_engine = [rows(i) for i in range(n)]
    load0 = np.array([held[i] + per_engine[i][0].sum() for i in range(n)])
    load = np.array([held[i] + per_engine[i][1].sum(axis=0) for i in range(n)]).reshape(n, h)
    before = float(objective(load0, load))
    w = load @ beta if h else load0
    bound = (1 + params.theta) * float(np.mean(w))
    over = [i for i in range(n) if w[i] > bound and engines[i].engine_id not in busy]
    under = [i for i in range(n) if load0[i] < bound and engines[i].engine_id not in busy]
    found: list[tuple[float, str, str, str]] = []  # in the loops' order: source, target, request
    for s in over:
        src = engines[s]
        kvb = src.kv_bytes_per_token or params.assume_kv_bytes_per_token
        picked = []
        for j, p in enumerate(src.predictions):
            if not p.migratable or p.request_id in exclude:
                continue
            if params.use_prediction:  # line 20, as printed
                if kvb <= 0 or src.last_iteration_s <= 0:
                    continue
                c_mig = p.current_tokens * kvb / params.link_bytes_per_s
                if not p.predicted_remaining_tokens > c_mig / src.last_iteration_s:
                    continue
            picked.append(j)
        for t in under:
            if t == s:
                continue
            tgt = engines[t]
            c_mem = tgt.kv_blocks_total * tgt.block_size
            extra = (lambda p: p.predicted_remaining_tokens) if params.use_prediction else (lambda p: 0.0)
            fits = [j for j in picked  # line 21, counting N(r)
                    if load0[t] + src.predictions[j].current_tokens + extra(src.predictions[j]) <= c_mem]
            if not fits:
                continue
            # Every candidate's fleet from scratch: the source's requests but r, the target's plus r.
            others0 = np.array([held[i] + per_engine[i][0].sum() for i in range(n)])
            others = np.array([held[i] + per_engine[i][1].sum(axis=0) for i in range(n)]).reshape(n, h)
            c = len(fits)
            keep = np.ones((c, len(src.predictions)))
            keep[np.arange(c), fits] = 0.0
            new0 = np.repeat(others0[None, :], c, axis=0)
            new = np.repeat(others[None, :, :], c, axis=0)
            new0[:, s] = held[s] + keep @ per_engine[s][0]
            new[:, s, :] = held[s] + keep @ per_engine[s][1]
            moved_n = np.array([float(src.predictions[j].current_tokens) for j in fits])
            moved = np.array([trace(src.predictions[j], ks[t]) for j in fits]).reshape(c, h)
            n_t, tr_t = per_engine[t]
            new0[:, t] = held[t] + np.concatenate([np.repeat(n_t[None, :], c, 0), moved_n[:, None]], 1).sum(1)
            stacked = np.concatenate([np.repeat(tr_t[None], c, 0), moved[:, None, :]], axis=1)
            new[:, t, :] = held[t] + stacked.sum(axis=1)
            after = objective(new0, new)
            for j, value in zip(fits, after, strict=True):
                found.append((before - float(value), src.predictions[j].request_id, src.engine_id,
                              tgt.engine_id))
    tol = TIE_RELATIVE * before
    top = max((f[0] for f in found), default=-np.inf)
    if not top > tol:
        return None
    red, rid, source, target = next(f for f in found if f[0] >= top - tol)
    return rid, source, target, red


def same(m: Migration | None, expected: tuple[str, str, str, float] | None) -> bool:
    if m is None or expected is None:
        return m is None and expected is None
    return (m.request_id, m.source, m.target) == expected[:3] and m.variance_reduction == pytest.approx(
        expected[3], rel=1e-6, abs=1e-9 * max(m.objective, 1.0))


# ---------------------------------------------------------------------------------------------------------
# Hand cases.

# A: r0 N=600 ends within the round, r1 N=100 and r2 N=400 run on; B, C idle.
HOT = [(600, 10.0), (100, 5000.0), (400, 5000.0)]


def hot_fleet(**a: Any) -> list[EngineView]:
    return [star_engine("a", HOT, **a), star_engine("b", []), star_engine("c", [])]


def test_a_balanced_fleet_proposes_nothing() -> None:
    reqs = [(500, 300.0), (800, 2000.0)]
    snap = snapshot(*(star_engine(f"e{i}", reqs) for i in range(4)))
    assert propose(snap, StarParams()) is None
    assert propose(snap, StarParams(use_prediction=False)) is None


def test_one_hot_engine_moves_the_request_that_cuts_the_expected_variance_most() -> None:
    snap = snapshot(*hot_fleet())
    m = propose(snap, StarParams())
    # r0 is the biggest now but finishes before round 1: r2 is what keeps loading `a` over the horizon.
    assert m is not None and (m.request_id, m.source, m.target, m.model) == ("a-r2", "a", "b", MODEL)
    assert same(m, naive_propose(snap, StarParams()))
    assert (m.current_tokens, m.predicted_remaining_tokens, m.kv_bytes) == (400, 5000.0, 400_000)
    assert m.migration_cost_s == pytest.approx(400_000 / LINK)
    assert m.variance_reduction > 0 and m.objective > m.variance_reduction


def test_ties_go_to_the_first_source_then_the_first_target() -> None:
    # Two identical hot engines and two idle ones: four equal best moves of r2.
    snap = snapshot(star_engine("a", HOT), star_engine("b", HOT), star_engine("c", []), star_engine("d", []))
    m = propose(snap, StarParams())
    assert m is not None and (m.request_id, m.source, m.target) == ("a-r2", "a", "c")
    m = propose(snap, StarParams(), busy_engines=frozenset({"a", "c"}))
    assert m is not None and (m.request_id, m.source, m.target) == ("b-r2", "b", "d")


def test_without_prediction_the_current_variance_alone_decides() -> None:
    snap = snapshot(*hot_fleet())
    m = propose(snap, StarParams(use_prediction=False))
    assert m is not None and (m.request_id, m.source, m.target) == ("a-r0", "a", "b")
    # Eq. 3 alone: Var(1100, 0, 0) - Var(500, 600, 0).
    expected = statistics.pvariance([1100, 0, 0]) - statistics.pvariance([500, 600, 0])
    assert m.variance_reduction == pytest.approx(expected)
    assert m.objective == pytest.approx(statistics.pvariance([1100, 0, 0]))


def test_a_request_that_would_finish_before_its_kv_arrives_is_never_moved() -> None:
    # 0.1 ms iterations, 1 MB per token: C_mig / T_exec = N(r) * 1e6 / LINK / 1e-4 = 1280 steps for r2 (400
    # tokens), 320 for r1: with N-hat = 1000 each, r2 is filtered out (line 20), r1 is not.
    hot = [(600, 10.0), (100, 1000.0), (400, 1000.0)]
    fleet = [star_engine("a", hot, kv_bytes_per_token=1_000_000, last_iteration_s=1e-4),
             star_engine("b", []), star_engine("c", [])]
    m = propose(snapshot(*fleet), StarParams())
    assert m is not None and m.request_id == "a-r1"
    assert same(m, naive_propose(snapshot(*fleet), StarParams()))
    # Only the filtered request left: nothing to move.
    alone = [star_engine("a", [(400, 1000.0)], kv_bytes_per_token=1_000_000, last_iteration_s=1e-4),
             star_engine("b", []), star_engine("c", [])]
    assert propose(snapshot(*alone), StarParams()) is None
    # An unknown KV size or iteration time: line 20 cannot be checked, no candidate; unless assumed.
    unknown = [star_engine("a", HOT, kv_bytes_per_token=0), star_engine("b", [])]
    assert propose(snapshot(*unknown), StarParams()) is None
    assert propose(snapshot(*unknown), StarParams(assume_kv_bytes_per_token=1000)) is not None
    assert propose(snapshot(star_engine("a", HOT, last_iteration_s=0.0), star_engine("b", [])),
                   StarParams()) is None


def test_a_target_without_kv_room_is_never_chosen() -> None:
    # b is the first idle engine, but r2 (N 400, N-hat 5,000) needs 0 + 400 + 5,000 > 5,392 tokens there.
    fleet = [star_engine("a", HOT), star_engine("b", [], capacity_tokens=5392), star_engine("c", [])]
    m = propose(snapshot(*fleet), StarParams())
    assert m is not None and (m.request_id, m.target) == ("a-r2", "c")
    assert same(m, naive_propose(snapshot(*fleet), StarParams()))
    # Exactly enough room (0 + 400 + 5,000 <= 5,400): b again.
    room = replace(fleet[1], kv_blocks_total=5400, block_size=1)
    m = propose(snapshot(fleet[0], room, fleet[2]), StarParams())
    assert m is not None and m.target == "b"


def test_excluded_requests_and_busy_engines_are_respected() -> None:
    snap = snapshot(*hot_fleet())
    m = propose(snap, StarParams(), exclude_requests=frozenset({"a-r2"}))
    assert m is not None and m.request_id != "a-r2"
    assert same(m, naive_propose(snap, StarParams(), exclude=frozenset({"a-r2"})))
    m = propose(snap, StarParams(), busy_engines=frozenset({"b"}))
    assert m is not None and (m.request_id, m.target) == ("a-r2", "c")
    assert propose(snap, StarParams(), busy_engines=frozenset({"a"})) is None
    not_migratable = snapshot(star_engine("a", HOT, migratable=(True, True, False)), *hot_fleet()[1:])
    m = propose(not_migratable, StarParams())
    assert m is not None and m.request_id != "a-r2"


def test_other_models_prefill_engines_and_unhealthy_engines_are_left_alone() -> None:
    base = hot_fleet()
    plain = propose(snapshot(*base), StarParams())
    assert plain is not None
    decoys = [
        star_engine("0-prefill", [], role="prefill"),
        star_engine("0-other", [], model="other"),
        star_engine("0-stale", [], stale=True),
        star_engine("0-ejected", [], ejected=True),
        star_engine("0-unready", [], ready=False),
    ]
    # Idle decoys sort first, so they would be the first targets, and would change the variance if counted.
    m = propose(snapshot(*base, *decoys), StarParams())
    assert m == plain
    # A hot engine that is stale, ejected, of prefill role or of another model is no source.
    for hot in (replace(base[0], stale=True), replace(base[0], ejected=True),
                replace(base[0], role="prefill"), replace(base[0], model="other")):
        assert propose(snapshot(hot, *base[1:]), StarParams()) is None
    # With `model` given, only that model is looked at.
    assert propose(snapshot(*base), StarParams(), model="other") is None


def test_the_agents_future_load_drives_the_classification() -> None:
    # The agent's summary says `a` empties within a round (say its predictor has since revised): no overload.
    fleet = hot_fleet()
    drained = replace(fleet[0], future_load=FutureLoad(3, 20, (0.0,) * 32))
    assert propose(snapshot(drained, *fleet[1:]), StarParams()) is None
    # A summary shorter than H is not used: the rounds are rebuilt from the predictions.
    short = replace(fleet[0], future_load=FutureLoad(3, 20, (0.0,) * 8))
    assert propose(snapshot(short, *fleet[1:]), StarParams()) == propose(snapshot(*fleet), StarParams())


def test_params_are_validated() -> None:
    for bad in ({"theta": -0.1}, {"horizon": -1}, {"beta": 0.0}, {"beta": 1.5}, {"round_tokens": 0},
                {"kv_link_gbps": 0.0}, {"assume_kv_bytes_per_token": -1}):
        with pytest.raises(ValueError):
            StarParams(**bad)
    assert StarParams().link_bytes_per_s == LINK


# ---------------------------------------------------------------------------------------------------------
# Random fleets: the same m* as the naive evaluation.


def random_engine(rng: random.Random, name: str, params: StarParams) -> EngineView:
    k = rng.choice([params.round_tokens, params.round_tokens, 7, 16])
    remaining_kinds = (
        lambda: rng.uniform(0, 3000), lambda: float(rng.randint(0, 40) * k), lambda: 0.0,
        lambda: rng.uniform(1e4, 1e5), lambda: -rng.uniform(0, 50),
    )
    reqs = [(rng.randint(1, 6000), rng.choice(remaining_kinds)()) for _ in range(rng.randint(0, 40))]
    migratable = tuple(rng.random() < 0.85 for _ in reqs)
    kvb = rng.choice([0, 200, 20_000, 150_000, 1_000_000]) if rng.random() < 0.9 else 0
    iter_s = rng.choice([0.0, 0.005, 0.02, 0.08]) if rng.random() < 0.95 else 0.0
    capacity = int(rng.uniform(0.3, 3.0) * 40_000 * rng.random()) + 16
    view = star_engine(
        name, reqs, round_tokens=k, horizon=rng.choice([params.horizon, params.horizon + 3, 2]),
        summary=rng.random() < 0.7, capacity_tokens=capacity, kv_bytes_per_token=kvb,
        last_iteration_s=iter_s, migratable=migratable,
    )
    if rng.random() < 0.08:  # no predictor: only the running batch's tokens are known
        view = replace(view, predictions=(), future_load=None, running_batch_tokens=rng.randint(0, 80_000))
    roll = rng.random()
    if roll < 0.03:
        view = replace(view, stale=True)
    elif roll < 0.05:
        view = replace(view, role="prefill")
    elif roll < 0.07:
        view = replace(view, model="other")
    elif roll < 0.08:
        view = replace(view, ejected=True)
    return view


def random_case(seed: int) -> tuple[ClusterSnapshot, StarParams, frozenset[str], frozenset[str]]:
    rng = random.Random(seed)
    params = StarParams(
        theta=rng.choice([0.0, 0.1, 0.1, 0.3]), horizon=rng.choice([0, 1, 5, 12, 32, 32]),
        beta=rng.choice([0.5, 0.9, 0.9, 1.0]), round_tokens=rng.choice([20, 20, 13]),
        kv_link_gbps=rng.choice([0.5, 25.0, 25.0, 100.0]), use_prediction=rng.random() < 0.75,
        assume_kv_bytes_per_token=rng.choice([0, 0, 5000]),
    )
    engines = [random_engine(rng, f"e{i:02d}", params) for i in range(rng.randint(2, 16))]
    ids = [p.request_id for e in engines for p in e.predictions]
    exclude = frozenset(rng.sample(ids, min(len(ids), rng.randint(0, 3))))
    busy = frozenset(e.engine_id for e in engines if rng.random() < 0.05)
    return snapshot(*engines), params, exclude, busy


def test_the_same_migration_as_the_naive_evaluation_on_1000_random_fleets() -> None:
    proposed = 0
    for seed in range(1000):
        snap, params, exclude, busy = random_case(seed)
        fast = propose(snap, params, exclude_requests=exclude, busy_engines=busy)
        slow = naive_propose(snap, params, exclude, busy)
        assert same(fast, slow), (seed, fast, slow)
        proposed += fast is not None
    assert proposed > 300  # the fleets exercise the selection, not just the early exits
