"""Admission control: the pure queue (`gateway.admission.core`) and the gate behind the real app."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from builders import engine, snapshot
from fake_engines import FakeEngine, ok_script, script, serving

from gateway.admission.core import (
    AdmissionParams,
    ModelQueue,
    Ticket,
    best_engine_ttft_s,
    fleet_slots,
    predicted_engine_ttft_s,
)
from gateway.domain import Admitted, Delta, Finished, LensState

PARAMS = AdmissionParams(max_queue=2, default_engine_slots=4, rate_window_s=10.0)


def test_requests_go_through_while_slots_are_free_then_queue_in_priority_order() -> None:
    q = ModelQueue(PARAMS)
    first, second = Ticket(0, 0.0), Ticket(0, 0.0)
    assert q.arrive(first, 0.0, 1, None, None).outcome == "admitted"
    assert q.arrive(second, 0.1, 1, None, None).outcome == "queued"
    urgent = Ticket(-5, 0.2)
    assert q.arrive(urgent, 0.2, 1, None, None).outcome == "queued"
    q.leave(first, 1.0)
    assert q.pump(1, 1.0) == [urgent]  # lower value first, as vLLM's priorities
    q.leave(urgent, 2.0)
    assert q.pump(1, 2.0) == [second] and q.queued == 0


def test_a_full_queue_sheds_the_newcomer_unless_it_outranks_a_queued_request() -> None:
    q = ModelQueue(PARAMS)
    q.arrive(Ticket(0, 0.0), 0.0, 1, None, None)
    low = Ticket(5, 0.1)
    assert q.arrive(low, 0.1, 1, None, None).outcome == "queued"
    assert q.arrive(Ticket(0, 0.2), 0.2, 1, None, None).outcome == "queued"
    same = q.arrive(Ticket(5, 0.3), 0.3, 1, None, None)
    assert same.outcome == "shed" and same.shed is not None and same.shed.reason == "queue_full"
    high = q.arrive(Ticket(1, 0.4), 0.4, 1, None, None)
    assert high.outcome == "queued" and high.preempted is not None
    assert high.preempted.ticket is low and high.preempted.reason == "preempted" and low.state == "shed"
    assert q.queued == 2


def test_a_request_is_shed_when_its_predicted_wait_misses_its_ttft_slo() -> None:
    q = ModelQueue(AdmissionParams(max_queue=100, rate_window_s=10.0))
    running = [Ticket(0, 0.0) for _ in range(4)]
    for t in running:
        q.arrive(t, 0.0, 4, None, None)
    for i, t in enumerate(running[:2]):  # two completions in the window: 0.2 per second
        q.leave(t, 1.0 + i)
    # The fleet shrank to 2 slots, both taken by the two still running.
    # One queued ahead at the same priority: wait (1 + 1) / 0.2 = 10 s, plus the engine's 0.5 s.
    shed = q.arrive(Ticket(0, 3.0), 3.0, 2, 0.5, 10.0)
    assert shed.outcome == "queued"  # the first waiter, nobody ahead: 5.5 s <= 10 s
    late = q.arrive(Ticket(0, 3.0), 3.0, 2, 0.5, 10.0)
    assert late.outcome == "shed" and late.shed is not None and late.shed.reason == "slo_unattainable"
    assert late.predicted_ttft_s == pytest.approx(10.5) and late.shed.retry_after_s == 10.0
    assert q.arrive(Ticket(0, 3.0), 3.0, 2, 0.5, None).outcome == "queued"  # no SLO: never shed on it
    idle = ModelQueue(PARAMS)
    assert idle.arrive(Ticket(0, 0.0), 0.0, 4, 2.0, 1.0).outcome == "admitted"  # a free slot: never shed


def test_no_engine_in_the_pool_lets_everything_through() -> None:
    q = ModelQueue(PARAMS)
    assert all(q.arrive(Ticket(0, 0.0), 0.0, 0, None, 0.001).outcome == "admitted" for _ in range(5))


def test_engine_ttft_prediction_and_fleet_slots() -> None:
    lens = LensState(0.05, 0.0, 100, 10_000.0, 0.2, False)
    with_lens = engine("a", lens=lens, pending_prefill_tokens=4000, unreported_prompt_tokens=1000)
    assert predicted_engine_ttft_s(with_lens, 1000) == pytest.approx(0.06 + 6000 / 10_000)
    observed = engine("b", profile="", recent_ttft_s=0.3)
    assert predicted_engine_ttft_s(observed, 100) == 0.3
    assert predicted_engine_ttft_s(engine("c", profile="h100-llama3-8b"), 100) is None  # no nominal guess
    assert predicted_engine_ttft_s(engine("c", lens=lens, recent_ttft_s=0.01), 100) == 0.01  # measured wins
    snap = snapshot(with_lens, observed, engine("d", profile="", max_num_seqs=8), engine("e", ready=False))
    assert fleet_slots(snap, "m", PARAMS) == 4 + 4 + 8  # the not-ready engine has none
    assert best_engine_ttft_s(snap, "m", 1000) == 0.3


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def test_saturation_answers_503_fleet_saturated_at_once() -> None:
    slow = FakeEngine("a", script(Admitted(5), 5.0, Delta("x", num_tokens=1), Finished("stop", 5, 1)))
    slow.max_num_seqs = 1
    async with serving(slow, admission={"max_queue": 1}) as client:
        running = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))
        await asyncio.sleep(0.05)
        queued = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))
        await asyncio.sleep(0.05)
        resp = await client.post("/v1/chat/completions", json=CHAT)  # the queue (1) is full
        body = orjson.loads(await resp.read())
        assert resp.status == 503 and resp.headers["Retry-After"] == "1"
        assert body["error"]["code"] == "fleet_saturated" and body["error"]["type"] == "service_unavailable"
        urgent = asyncio.create_task(
            client.post("/v1/chat/completions", json=CHAT, headers={"x-priority": "-1"}))
        resp = await queued  # preempted by the more urgent request
        assert resp.status == 503 and "higher priority" in orjson.loads(await resp.read())["error"]["message"]
        metrics = await (await client.get("/metrics")).text()
        for task in (running, urgent):
            task.cancel()
        await asyncio.gather(running, urgent, return_exceptions=True)
    assert 'switchyard_admission_rejections_total{model="m",reason="queue_full"} 1.0' in metrics
    assert 'switchyard_admission_rejections_total{model="m",reason="preempted"} 1.0' in metrics
    assert 'switchyard_gateway_queue_depth{model="m"} 1.0' in metrics


async def test_a_queued_request_goes_when_a_slot_frees() -> None:
    quick = FakeEngine("a", ok_script("done"))
    quick.max_num_seqs = 1
    async with serving(quick) as client:
        answers = await asyncio.gather(*(client.post("/v1/chat/completions", json=CHAT) for _ in range(5)))
        metrics = await (await client.get("/metrics")).text()
    assert [r.status for r in answers] == [200] * 5
    assert 'switchyard_admission_total{model="m",outcome="admitted"}' in metrics


async def test_a_queued_request_is_refused_at_its_ttft_deadline_while_the_slot_stays_taken() -> None:
    """The gate's timer fires at the deadline (the test's clock stands still: only the timer can shed it)."""
    slow = FakeEngine("a", script(Admitted(5), 5.0, Delta("x", num_tokens=1), Finished("stop", 5, 1)))
    slow.max_num_seqs = 1
    async with serving(slow) as client:
        running = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))
        await asyncio.sleep(0.05)
        resp = await client.post("/v1/chat/completions", json=CHAT, headers={"x-slo-ttft-ms": "200"})
        body = orjson.loads(await resp.read())
        assert not running.done()  # the slot's holder runs for 5 s: the deadline, not a slot, ended the wait
        assert resp.status == 503 and body["error"]["code"] == "fleet_saturated"
        assert "past its time-to-first-token target" in body["error"]["message"]
        assert resp.headers["Retry-After"] == "1"
        metrics = await (await client.get("/metrics")).text()
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
    assert 'switchyard_admission_rejections_total{model="m",reason="slo_expired"} 1.0' in metrics
    assert 'switchyard_gateway_queue_depth{model="m"} 0.0' in metrics


def test_the_queue_wait_estimate_is_scaled_by_the_observed_quantile_of_actual_over_predicted() -> None:
    params = AdmissionParams(max_queue=100, rate_window_s=10.0, slo_quantile=0.9, min_calibration_samples=10)
    q = ModelQueue(params)
    assert q.wait_factor() == 1.0
    running = [Ticket(0, 0.0) for _ in range(11)]
    for t in running:
        q.arrive(t, 0.0, 11, None, None)
    for i, t in enumerate(running[:10]):  # 10 completions in the window: 1 per second
        q.leave(t, 0.5 + i * 0.1)
    # One slot (held by the 11th), so each newcomer queues; predicted waits 1, 2, ... s (nobody leaves).
    now = 2.0
    waiters = [Ticket(0, now) for _ in range(10)]
    for k, t in enumerate(waiters):
        arrival = q.arrive(t, now, 1, None, None)
        assert arrival.outcome == "queued" and arrival.predicted_ttft_s == pytest.approx(k + 1.0)
    # They all go at once, 3 s later: actual/predicted = 3/1, 3/2, ..., 3/10.
    q.leave(running[10], now + 3.0)
    assert q.pump(20, now + 3.0) == waiters
    ratios = sorted(3.0 / (k + 1) for k in range(10))
    assert q.wait_factor() == pytest.approx(ratios[8])  # the 0.9 quantile of 10: the 9th smallest
    # The next estimate is scaled: the queue is empty but the slots (1) are full again.
    for t in waiters[:1]:
        q.leave(t, now + 3.0)
    q.arrive(Ticket(0, 5.0), 5.0, 1, None, None)
    scaled = q.arrive(Ticket(0, 5.0), 5.0, 1, 0.25, 100.0)
    rate = q.completion_rate(5.0)
    assert scaled.predicted_ttft_s == pytest.approx(2 / rate * ratios[8] + 0.25)


def test_a_queued_request_is_shed_once_its_ttft_deadline_passes_and_only_then() -> None:
    q = ModelQueue(AdmissionParams(max_queue=100))
    holder = Ticket(0, 0.0)
    q.arrive(holder, 0.0, 1, None, None)
    early, late, patient = Ticket(0, 1.0), Ticket(0, 2.0), Ticket(0, 1.5)
    assert q.arrive(early, 1.0, 1, None, 3.0).outcome == "queued"  # no completion yet: no prediction
    assert q.arrive(late, 2.0, 1, None, 1.0).outcome == "queued"
    assert q.arrive(patient, 1.5, 1, None, None).outcome == "queued"  # no SLO: no deadline
    assert (early.deadline_s, late.deadline_s, patient.deadline_s) == (4.0, 3.0, None)
    assert q.next_deadline_s == 3.0
    assert q.expire(2.99) == [] and q.queued == 3
    [shed] = q.expire(3.0)
    assert shed.ticket is late and shed.reason == "slo_expired" and late.state == "shed"
    assert q.queued == 2 and q.next_deadline_s == 4.0
    q.leave(holder, 3.5)
    assert q.pump(1, 3.5) == [early]  # it went before its deadline: nothing left to expire
    assert q.next_deadline_s is None and q.expire(100.0) == []
    q.leave(early, 4.0)
    assert q.pump(1, 4.0) == [patient]


def test_expiry_skips_tickets_that_left_or_were_preempted_and_can_be_turned_off() -> None:
    q = ModelQueue(AdmissionParams(max_queue=1))
    q.arrive(Ticket(0, 0.0), 0.0, 1, None, None)
    gone, low = Ticket(0, 0.0), Ticket(5, 0.0)
    q.arrive(gone, 0.0, 1, None, 1.0)
    q.leave(gone, 0.5)  # its client left while it waited
    q.arrive(low, 0.5, 1, None, 1.0)
    newcomer = Ticket(0, 0.6)
    high = q.arrive(newcomer, 0.6, 1, None, 1.0)
    assert high.preempted is not None and high.preempted.ticket is low
    [shed] = q.expire(10.0)  # only the one still queued
    assert shed.ticket is newcomer and low.shed_reason == "preempted" and gone.state == "gone"
    assert q.queued == 0
    off = ModelQueue(AdmissionParams(shed_expired=False))
    off.arrive(Ticket(0, 0.0), 0.0, 1, None, None)
    waiting = Ticket(0, 0.0)
    off.arrive(waiting, 0.0, 1, None, 0.1)
    assert waiting.deadline_s is None and off.next_deadline_s is None and off.expire(100.0) == []


def test_an_expired_wait_joins_the_calibration_as_a_lower_bound_on_its_ratio() -> None:
    q = ModelQueue(AdmissionParams(max_queue=100, min_calibration_samples=1, slo_quantile=1.0))
    running = [Ticket(0, 0.0) for _ in range(3)]
    for t in running:
        q.arrive(t, 0.0, 3, None, None)
    q.leave(running[0], 1.0)  # 1 completion in 10 s: 0.1 per second
    q.arrive(Ticket(0, 1.0), 1.0, 3, None, None)  # takes the slot it freed
    waiter = Ticket(0, 2.0)
    arrival = q.arrive(waiter, 2.0, 3, None, 30.0)
    assert arrival.outcome == "queued" and waiter.predicted_wait_s == pytest.approx(10.0)
    [shed] = q.expire(32.0)  # it waited 30 s against a predicted 10 s
    assert shed.ticket is waiter and q.wait_factor() == pytest.approx(3.0)
