"""`LoopHistogram` is exposed exactly like prometheus_client's `Histogram` (less the optional `_created`
series), and the app's collector tuning is undone when serving ends."""

from __future__ import annotations

import gc

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from gateway.app import collector_tuned
from gateway.observability.metrics import LoopHistogram

BUCKETS = (1e-6, 0.001, 0.0025, 0.5, 1.0, 10.0)
VALUES = [0.0, 1e-6, 2e-6, 0.001, 0.0011, 0.0025, 0.3, 0.5, 1.0, 9.99, 10.0, 10.5, 1e9, 0.0001]


def exposition(registry: CollectorRegistry) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


def test_exposition_matches_prometheus_client() -> None:
    reference, ours = CollectorRegistry(), CollectorRegistry()
    ref_plain = Histogram("a_seconds", "A.", buckets=BUCKETS, registry=reference)
    ref_labelled = Histogram("b_seconds", "B.", ["policy"], buckets=BUCKETS, registry=reference)
    plain = LoopHistogram("a_seconds", "A.", buckets=BUCKETS, registry=ours)
    labelled = LoopHistogram("b_seconds", "B.", buckets=BUCKETS, registry=ours, labelnames=["policy"])
    assert exposition(ours) == exposition(reference)  # before any observation too
    for i, value in enumerate(VALUES):
        ref_plain.observe(value)
        plain.observe(value)
        policy = ("round_robin", "prism")[i % 2]
        ref_labelled.labels(policy).observe(value)
        labelled.labels(policy).observe(value)
    assert exposition(ours) == exposition(reference)


def test_label_misuse_is_refused() -> None:
    labelled = LoopHistogram("c_seconds", "C.", buckets=BUCKETS, registry=CollectorRegistry(),
                             labelnames=["policy"])
    with pytest.raises(ValueError):
        labelled.observe(1.0)
    with pytest.raises(ValueError):
        labelled.labels("a", "b")


def test_collector_tuning_is_undone() -> None:
    thresholds, frozen = gc.get_threshold(), gc.get_freeze_count()
    with collector_tuned():
        assert gc.get_threshold()[0] >= 20_000
        assert gc.get_freeze_count() > frozen
    assert gc.get_threshold() == thresholds and gc.get_freeze_count() == frozen
