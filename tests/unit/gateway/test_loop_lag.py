"""The event-loop lag monitor: a wake-up's lateness is what it records (manual clock, exact), a callback that
holds the loop shows in the histogram (real loop, lower bound only), the task ends with its context, and the
app exports `switchyard_event_loop_lag_seconds` from a monitor it starts itself."""

from __future__ import annotations

import asyncio
import time

import pytest
from fake_engines import FakeEngine, serving
from prometheus_client import CollectorRegistry

from gateway.observability.loop_lag import LoopLagMonitor
from gateway.observability.metrics import GatewayMetrics, LoopHistogram
from switchyard.clock import ManualClock

BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1)


def histogram() -> LoopHistogram:
    return LoopHistogram("lag_seconds", "Lag.", buckets=BUCKETS, registry=CollectorRegistry())


def test_record_observes_how_late_the_clock_reads() -> None:
    clock = ManualClock(10.0)
    lags: list[float] = []
    monitor = LoopLagMonitor(lags.append, interval_s=0.05, clock=clock)
    expected = monitor.expected_wake_s()
    assert expected == pytest.approx(10.05)
    clock.set(10.05 + 0.03)  # a 30 ms callback ran when the timer was due
    assert monitor.record(expected) == pytest.approx(0.03)
    clock.set(10.2)
    assert monitor.record(10.25) == 0.0  # a timer that fires early is no lag
    assert lags == [pytest.approx(0.03), 0.0]


def test_recorded_lag_lands_in_its_bucket() -> None:
    clock = ManualClock(0.0)
    lag = histogram()
    monitor = LoopLagMonitor(lag.observe, interval_s=0.05, clock=clock)
    for late_s in (0.0, 0.0004, 0.004, 0.03):
        expected = monitor.expected_wake_s()
        clock.advance(0.05 + late_s)
        monitor.record(expected)
    series = lag.labels()
    assert series.counts == [2, 1, 0, 1, 0, 0]  # le 1 ms: two; le 5 ms: one; le 50 ms: one
    assert series.sum == pytest.approx(0.0344)


def test_interval_must_be_positive() -> None:
    with pytest.raises(ValueError):
        LoopLagMonitor(lambda _: None, interval_s=0.0)


@pytest.mark.allow_loop_blocking(reason="the monitor must see a callback that holds the loop for 150 ms")
async def test_a_blocking_callback_shows_as_lag() -> None:
    lags: list[float] = []
    monitor = LoopLagMonitor(lags.append, interval_s=0.01)
    blocked = asyncio.Event()

    def hold_the_loop() -> None:
        time.sleep(0.15)
        blocked.set()

    async with monitor.running():
        await asyncio.sleep(0.03)  # a few idle wake-ups first
        asyncio.get_running_loop().call_soon(hold_the_loop)
        await blocked.wait()
        await asyncio.sleep(0.03)  # the wake-up delayed by the block is recorded
    # The timer was due at most one interval after the block began and ran after it ended: lag >= 150 - 10 ms.
    assert max(lags) >= 0.14
    count = len(lags)
    await asyncio.sleep(0.03)
    assert len(lags) == count  # the task ended with the context


async def test_app_exports_the_loop_lag_histogram() -> None:
    async with serving(FakeEngine("e1", lambda _: [])) as client:
        await asyncio.sleep(0.12)  # the monitor's first wake-ups (50 ms) come before this sleep ends
        resp = await client.get("/metrics")
        text = await resp.text()
    name = "switchyard_event_loop_lag_seconds_count"
    counts = [line for line in text.splitlines() if line.startswith(name)]
    assert len(counts) == 1 and float(counts[0].split()[-1]) >= 1
    assert 'switchyard_event_loop_lag_seconds_bucket{le="0.005"}' in text


def test_gateway_metrics_registers_the_histogram() -> None:
    metrics = GatewayMetrics()
    metrics.loop_lag.observe(0.002)
    text = metrics.render().decode()
    assert 'switchyard_event_loop_lag_seconds_bucket{le="0.002"} 1.0' in text
    assert 'switchyard_event_loop_lag_seconds_bucket{le="0.0015"} 0.0' in text
