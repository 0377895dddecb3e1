"""A multi-worker gateway's `/metrics`: expositions merged sample by sample (observability/merge.py), the
gauges classified (metrics.SHARED_GAUGES), and a scrape that merges its siblings' endpoints, skipping and
counting one that does not answer (observability/siblings.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from builders import engine, snapshot
from prometheus_client.parser import text_string_to_metric_families

from gateway.observability.merge import merge_expositions
from gateway.observability.metrics import SHARED_GAUGES, GatewayMetrics
from gateway.observability.siblings import SiblingScrape, private_metrics_app

SHARED = frozenset({"engine_ready"})

WORKER_0 = """\
# HELP requests_total Requests.
# TYPE requests_total counter
requests_total{model="m",status="200"} 3.0
requests_total{model="m",status="500"} 1.0
# HELP requests_created Requests.
# TYPE requests_created gauge
requests_created{model="m",status="200"} 200.0
requests_created{model="m",status="500"} 250.0
# HELP in_flight In flight.
# TYPE in_flight gauge
in_flight 2.0
# HELP engine_ready Engine ready.
# TYPE engine_ready gauge
engine_ready{engine="a"} 1.0
engine_ready{engine="b"} 0.0
# HELP latency_seconds Latency.
# TYPE latency_seconds histogram
latency_seconds_bucket{le="0.1"} 1.0
latency_seconds_bucket{le="1.0"} 2.0
latency_seconds_bucket{le="+Inf"} 3.0
latency_seconds_count 3.0
latency_seconds_sum 2.5
# HELP build Build.
# TYPE build untyped
build 7.0
"""

WORKER_1 = """\
# HELP requests_total Requests.
# TYPE requests_total counter
requests_total{model="m",status="200"} 5.0
requests_total{model="other",status="200"} 2.0
# HELP requests_created Requests.
# TYPE requests_created gauge
requests_created{model="m",status="200"} 100.0
requests_created{model="other",status="200"} 300.0
# HELP in_flight In flight.
# TYPE in_flight gauge
in_flight 1.0
# HELP engine_ready Engine ready.
# TYPE engine_ready gauge
engine_ready{engine="a"} 1.0
engine_ready{engine="b"} 1.0
engine_ready{engine="c"} 1.0
# HELP latency_seconds Latency.
# TYPE latency_seconds histogram
latency_seconds_bucket{le="0.1"} 0.0
latency_seconds_bucket{le="1.0"} 4.0
latency_seconds_bucket{le="+Inf"} 4.0
latency_seconds_count 4.0
latency_seconds_sum 3.0
# HELP build Build.
# TYPE build untyped
build 8.0
# HELP retries_total Retries only this worker has made.
# TYPE retries_total counter
retries_total 4.0
# HELP engine_only_there A shared gauge only a sibling has.
# TYPE engine_only_there gauge
engine_only_there 1.0
"""

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parsed(text: str | bytes) -> Samples:
    raw = text.decode() if isinstance(text, bytes) else text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(raw)
        for s in family.samples
    }


def test_counters_histograms_and_process_gauges_are_summed_engine_gauges_are_not() -> None:
    merged = parsed(merge_expositions(WORKER_0, [WORKER_1], shared=SHARED | {"engine_only_there"}))
    assert merged == {
        # counters summed per label set; a label set one worker alone has is kept
        ("requests_total", (("model", "m"), ("status", "200"))): 8.0,
        ("requests_total", (("model", "m"), ("status", "500"))): 1.0,
        ("requests_total", (("model", "other"), ("status", "200"))): 2.0,
        # a counter's creation time: the earliest
        ("requests_created", (("model", "m"), ("status", "200"))): 100.0,
        ("requests_created", (("model", "m"), ("status", "500"))): 250.0,
        ("requests_created", (("model", "other"), ("status", "200"))): 300.0,
        # a gauge of the worker's own process: summed
        ("in_flight", ()): 3.0,
        # engine state: the answering worker's, not doubled, and no engine only a sibling has seen yet
        ("engine_ready", (("engine", "a"),)): 1.0,
        ("engine_ready", (("engine", "b"),)): 0.0,
        # histograms summed per bucket, count and sum
        ("latency_seconds_bucket", (("le", "0.1"),)): 1.0,
        ("latency_seconds_bucket", (("le", "1.0"),)): 6.0,
        ("latency_seconds_bucket", (("le", "+Inf"),)): 7.0,
        ("latency_seconds_count", ()): 7.0,
        ("latency_seconds_sum", ()): 5.5,
        # untyped: the answering worker's
        ("build", ()): 7.0,
        # a counter family only a sibling has is added; a shared gauge only a sibling has is not
        ("retries_total", ()): 4.0,
    }


def test_the_answering_worker_decides_what_is_shared() -> None:
    merged = parsed(merge_expositions(WORKER_1, [WORKER_0], shared=SHARED))
    assert merged[("engine_ready", (("engine", "b"),))] == 1.0
    assert merged[("engine_ready", (("engine", "c"),))] == 1.0
    assert merged[("requests_total", (("model", "m"), ("status", "200")))] == 8.0


def test_merging_no_sibling_gives_the_worker_exposition_back() -> None:
    metrics = GatewayMetrics()
    metrics.observe_request("m", 200)
    metrics.ttft.observe(0.3)
    metrics.routing_decision.labels("round_robin").observe(2e-5)
    metrics.attach_engine_state(lambda: snapshot(engine("a"), engine("b", num_running=3)))
    text = metrics.render()
    assert merge_expositions(text.decode(), [], shared=SHARED_GAUGES) == text


def test_every_gauge_is_classified_shared_or_per_process() -> None:
    """A new gauge must be put in SHARED_GAUGES when every worker reports it alike (or here when it is the
    process's own): a merged scrape sums the others, which would multiply a shared one by N."""
    # Each worker ejects, and queues at its admission gate, on its own; the autoscaler runs in a one-process
    # gateway only.
    per_process = {
        "switchyard_requests_in_flight", "switchyard_engine_ejected", "switchyard_gateway_queue_depth",
        "switchyard_autoscale_qps", "switchyard_autoscale_usd_per_hour",
    }
    metrics = GatewayMetrics()
    metrics.observe_request("m", 200)
    metrics.scrape_worker_errors.labels("1").inc()
    metrics.attach_engine_state(lambda: snapshot(engine("a")))
    families = list(text_string_to_metric_families(metrics.render().decode()))
    counted = {f.name for f in families if f.type in ("counter", "histogram", "summary")}
    gauges = {
        f.name
        for f in families
        if f.type == "gauge" and not (f.name.endswith("_created") and f.name[: -len("_created")] in counted)
    }
    assert gauges == SHARED_GAUGES | per_process


def two_workers_summed(merged: Samples) -> float:
    return merged[("switchyard_requests_total", (("model", "m"), ("status", "200")))]


@pytest.fixture
async def sibling(tmp_path: Path) -> AsyncIterator[tuple[GatewayMetrics, str]]:
    """A sibling worker's metrics served on its private unix socket, as `worker.py` serves them."""
    metrics = GatewayMetrics()
    metrics.attach_engine_state(lambda: snapshot(engine("a")))
    runner = web.AppRunner(private_metrics_app(metrics))
    await runner.setup()
    path = str(tmp_path / "worker-1.sock")
    await web.UnixSite(runner, path).start()
    try:
        yield metrics, path
    finally:
        await runner.cleanup()


async def test_a_scrape_merges_siblings_and_skips_one_that_does_not_answer(
    sibling: tuple[GatewayMetrics, str], tmp_path: Path
) -> None:
    sibling_metrics, path = sibling
    own = GatewayMetrics()
    own.workers.set(3)
    own.attach_engine_state(lambda: snapshot(engine("a")))
    sibling_metrics.workers.set(3)
    for metrics, n in ((own, 2), (sibling_metrics, 5)):
        for _ in range(n):
            metrics.observe_request("m", 200)
    scrape = SiblingScrape(own, {1: path, 2: str(tmp_path / "worker-2.sock")}, timeout_s=2.0)
    app = web.Application()
    ctx = scrape.ctx(app)
    await anext(ctx)
    try:
        merged = parsed(await scrape.exposition())
        again = parsed(await scrape.exposition())
    finally:
        await ctx.aclose()
    assert two_workers_summed(merged) == 7
    assert merged[("switchyard_gateway_workers", ())] == 3
    assert merged[("switchyard_engine_ready", (("engine", "a"),))] == 1
    # worker 2 never listened: left out of each scrape and counted, by worker
    assert merged[("switchyard_metrics_scrape_worker_errors_total", (("worker", "2"),))] == 1
    assert again[("switchyard_metrics_scrape_worker_errors_total", (("worker", "2"),))] == 2
    assert ("switchyard_metrics_scrape_worker_errors_total", (("worker", "1"),)) not in again
