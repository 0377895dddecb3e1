"""Cascadia's Sim(w, f) (App. B, analytic) and the parallelism search (§3.2, Table 3)."""

from __future__ import annotations

import math

import pytest

from gateway.cascade.plan.parallelism import MAX_SHAPES, ReplicaGroup, evaluate, latency_table
from gateway.cascade.plan.stage_latency import (
    ReplicaShape,
    StageLatencyModel,
    StageWorkload,
    erlang_c,
    mixture_p95,
)
from switchyard.hardware import GPUS

PROMPTS = (120, 300, 80, 500, 250, 60, 900, 200, 150, 400)
ANSWERS = (300, 120, 500, 250, 700, 90, 400, 350, 200, 600)


def workload(rate: float) -> StageWorkload:
    return StageWorkload(rate, PROMPTS, ANSWERS)


@pytest.fixture(scope="module")
def h100() -> StageLatencyModel:
    return StageLatencyModel(GPUS["h100"])


def test_p95_grows_with_rate_and_overload_is_infinite(h100: StageLatencyModel) -> None:
    shape = ReplicaShape(1, 1)
    capacity = h100.capacity_rps("llama3-8b", shape, workload(1.0))
    assert 0 < capacity < math.inf
    rates = [capacity * x for x in (0.01, 0.2, 0.5, 0.8, 0.95, 0.999)]
    p95s = [h100.replica("llama3-8b", shape, workload(r)).p95_s for r in rates]
    assert all(math.isfinite(p) for p in p95s)
    assert p95s == sorted(p95s) and len(set(p95s)) == len(p95s)
    assert h100.replica("llama3-8b", shape, workload(capacity)).overloaded
    assert h100.replica("llama3-8b", shape, workload(2 * capacity)).p95_s == math.inf


def test_round_robin_replicas_share_the_rate(h100: StageLatencyModel) -> None:
    shape = ReplicaShape(1, 1)
    one = h100.replica("llama3-8b", shape, workload(10.0), replicas=1)
    two = h100.replica("llama3-8b", shape, workload(20.0), replicas=2)
    assert one == two  # each of two replicas sees 20 / 2


def test_light_load_latency_is_a_lone_requests(h100: StageLatencyModel) -> None:
    estimate = h100.replica("llama3-8b", ReplicaShape(1, 1), workload(1e-3))
    # p95 by nearest rank over 10 requests is the longest: 1 prefill chunk + 700 - 1 decodes + half a step.
    assert estimate.p95_s == pytest.approx(estimate.step_s * (1 + 699 + 0.5))
    assert estimate.wait_probability < 1e-9


def test_tensor_parallel_lowers_latency_and_pipeline_raises_capacity(h100: StageLatencyModel) -> None:
    w = workload(1.0)
    tp1 = h100.replica("llama3-70b", ReplicaShape(4, 1), w)
    tp2 = h100.replica("llama3-70b", ReplicaShape(8, 1), w)
    assert tp2.p95_s < tp1.p95_s
    assert h100.capacity_rps("llama3-70b", ReplicaShape(4, 2), w) > h100.capacity_rps(
        "llama3-70b", ReplicaShape(4, 1), w)


def test_shapes_are_memory_feasible(h100: StageLatencyModel) -> None:
    shapes = h100.shapes("llama3-70b")
    assert ReplicaShape(1, 1) not in shapes  # 141 GB of weights on one 80 GB GPU
    assert ReplicaShape(2, 1) not in shapes and ReplicaShape(1, 2) not in shapes  # no KV room left on two
    assert {ReplicaShape(4, 1), ReplicaShape(2, 2), ReplicaShape(1, 4), ReplicaShape(8, 1)} <= set(shapes)
    assert len(h100.shapes("llama3-8b")) == 16
    two = (ReplicaShape(1, 1), ReplicaShape(2, 1), ReplicaShape(1, 2))
    assert h100.shapes("llama3-8b", max_gpus=2) == two
    with pytest.raises(ValueError, match="does not fit"):
        h100.replica("llama3-70b", ReplicaShape(1, 1), workload(1.0))


def test_latency_table_is_nonincreasing_and_respects_memory(h100: StageLatencyModel) -> None:
    table = latency_table(h100, "llama3-70b", workload(2.0), 12)
    latencies = table.latencies_s
    assert latencies[:3] == (math.inf, math.inf, math.inf)  # the 70B model needs >= 3 GPUs (tp1, pp3)
    assert all(math.isfinite(v) for v in latencies[3:])
    assert list(latencies) == sorted(latencies, reverse=True)
    for f, strategy in enumerate(table.strategies):
        assert strategy.gpus <= f
        assert len({g.shape for g in strategy.groups}) <= MAX_SHAPES
        for group in strategy.groups:
            assert h100.profile("llama3-70b", group.shape) is not None


def test_more_gpus_never_hurt_and_rate_never_helps(h100: StageLatencyModel) -> None:
    low = latency_table(h100, "llama3-8b", workload(5.0), 8).latencies_s
    high = latency_table(h100, "llama3-8b", workload(40.0), 8).latencies_s
    assert all(h >= lo for h, lo in zip(high[1:], low[1:], strict=True))
    assert list(high) == sorted(high, reverse=True)


def test_an_overloaded_stage_needs_more_gpus(h100: StageLatencyModel) -> None:
    one = h100.capacity_rps("llama3-8b", ReplicaShape(1, 1), workload(1.0))
    table = latency_table(h100, "llama3-8b", workload(3.5 * one), 8)
    assert math.isinf(table.latencies_s[1]) and math.isinf(table.latencies_s[3])
    assert math.isfinite(table.latencies_s[8])
    assert table.strategies[8].capacity_rps > 3.5 * one


def test_idle_stage_needs_no_gpus(h100: StageLatencyModel) -> None:
    table = latency_table(h100, "llama3-70b", StageWorkload(0.0, (), ()), 4)
    assert table.latencies_s == (0.0,) * 5
    assert all(not s.groups for s in table.strategies)


def test_two_shape_strategy_p95_lies_between_its_shapes(h100: StageLatencyModel) -> None:
    w = workload(6.0)
    a, b = ReplicaShape(4, 1), ReplicaShape(8, 1)
    mixed = evaluate(h100, "llama3-70b", w, (ReplicaGroup(a, 1), ReplicaGroup(b, 1)))
    pa = h100.replica("llama3-70b", a, w, 2).p95_s
    pb = h100.replica("llama3-70b", b, w, 2).p95_s
    assert min(pa, pb) <= mixed.p95_s <= max(pa, pb)
    assert mixed.gpus == 12 and mixed.replicas == 2


def test_mixture_p95_of_one_replica_is_its_own() -> None:
    model = StageLatencyModel(GPUS["h100"])
    w = workload(5.0)
    shape = ReplicaShape(1, 1)
    estimate = model.replica("llama3-8b", shape, w)
    assert mixture_p95([(estimate, 1.0)], model.stats("llama3-8b", shape, w)) == estimate.p95_s


def test_erlang_c_exact_values() -> None:
    assert erlang_c(1, 0.5) == pytest.approx(0.5)  # M/M/1: P(wait) = rho
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)  # M/M/2 at a = 1
    assert erlang_c(4, 0.0) == 0.0 and erlang_c(4, 4.0) == 1.0
    assert 0.0 < erlang_c(1000.0, 950.0) < erlang_c(1000.0, 990.0) < 1.0


def test_bad_workloads_are_rejected() -> None:
    with pytest.raises(ValueError, match="pair up"):
        StageWorkload(1.0, (1, 2), (1,))
    with pytest.raises(ValueError, match="rate_rps"):
        StageWorkload(-1.0, (1,), (1,))
    with pytest.raises(ValueError, match="at least one"):
        StageWorkload(1.0, (), ())
