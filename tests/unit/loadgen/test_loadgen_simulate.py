"""The discrete-event simulator: exact, seeded expectations from the engine model and the gateway code."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
from loadgen_testkit import Recording, record_policies

from engine_agent.backends.sim import SimBackend
from engine_agent.domain import BackendRequest, FinishEvent, RequestId, SamplingSpec, TokenEvent
from engine_agent.sim.engine import SimEngine
from engine_agent.sim.reporting import ChangeGate
from gateway.cluster.state import ClusterState
from gateway.domain import ClusterSnapshot, EngineDescription, EngineId, EngineReport
from loadgen.datasets import Request
from loadgen.simulate import EngineSpec, SimOptions, parse_engines, simulate
from loadgen.simulate.reports import ReportFeed, describe_engine, report_from_stats
from switchyard.clock import MonotonicClock
from switchyard.profiles import get_profile

H100 = "h100-llama3-8b"
A6000 = "a6000-llama3-8b"


def req(rid: str, prompt_tokens: int = 100, output_tokens: int | None = 8) -> Request:
    return Request(request_id=rid, prompt_tokens=prompt_tokens, output_tokens=output_tokens)


def engine_of(result_outcomes: list[Any]) -> list[str | None]:
    return [o.engine_id for o in result_outcomes]


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[Recording]:
    return record_policies(monkeypatch)


def test_parse_engines_and_options_validation() -> None:
    assert parse_engines(f"{H100}:6, {A6000}:2") == [EngineSpec(H100, 6), EngineSpec(A6000, 2)]
    assert parse_engines(H100) == [EngineSpec(H100, 1)]
    for bad in ("", f"{H100}:x", f"{H100}:0", "no-such-profile:1"):
        with pytest.raises(ValueError):
            parse_engines(bad)
    with pytest.raises(ValueError):
        SimOptions(state_interval_s=0.0)
    with pytest.raises(ValueError):
        SimOptions(report_delay_s=-1.0)
    assert dict(SimOptions(policy_params={"ttl_s": 5}).policy_params) == {"ttl_s": 5}


def test_single_request_matches_the_engine_model_exactly() -> None:
    profile = get_profile(A6000)  # a 2048-token budget: a 3000-token prompt takes two prefill iterations
    engine = SimEngine(profile, seed=0)
    sampling = SamplingSpec(max_tokens=6, ignore_eos=True)
    engine.add_request(BackendRequest(RequestId("r1"), (0,) * 3000, sampling), 0.0)
    now_s, durations, token_times = 0.0, [], []
    while engine.has_work():
        step = engine.step(now_s)
        now_s += step.duration_s
        durations.append(step.duration_s)
        token_times.extend(now_s for _ in step.tokens)
    assert len(durations) == 7 and len(token_times) == 6

    result = simulate([(0.0, req("r1", 3000, 6))], [EngineSpec(A6000, 1)], SimOptions())
    (out,) = result.outcomes
    assert out.success and out.engine_id == f"{A6000}-0"
    assert out.ttft_s == durations[0] + durations[1]
    assert out.e2e_s == now_s
    assert out.itl_s == tuple(b - a for a, b in zip(token_times, token_times[1:], strict=False))
    assert (out.prompt_tokens, out.output_tokens, out.arrival_s) == (3000, 6, 0.0)
    assert result.duration_s == now_s
    assert result.per_engine == {f"{A6000}-0": {"profile": A6000, "requests": 1, "output_tokens": 6,
                                                "busy_s": pytest.approx(sum(durations)), "iterations": 7}}
    assert result.events_processed == 1 + 7


def test_times_are_relative_to_the_first_arrival() -> None:
    result = simulate([(100.0, req("a")), (100.5, req("b"))], [EngineSpec(H100, 1)], SimOptions())
    assert [o.arrival_s for o in result.outcomes] == [0.0, 0.5]


def test_round_robin_alternates_over_two_engines() -> None:
    schedule = [(0.1 * i, req(f"r{i}")) for i in range(5)]
    result = simulate(schedule, [EngineSpec(H100, 2)], SimOptions(policy="round_robin"))
    assert engine_of(result.outcomes) == [f"{H100}-{i % 2}" for i in range(5)]


def test_least_loaded_avoids_the_loaded_engine() -> None:
    schedule = [(0.0, req("big", 4000, 500)), (0.01, req("s1", 100, 10)), (0.02, req("s2", 100, 10))]
    result = simulate(schedule, [EngineSpec(H100, 2)], SimOptions(policy="least_loaded"))
    assert engine_of(result.outcomes) == [f"{H100}-0", f"{H100}-1", f"{H100}-1"]


def test_reports_arrive_after_the_delay_and_optimistic_accounting_covers_the_gap(
    recorded: list[Recording],
) -> None:
    options = SimOptions(policy="least_loaded", report_delay_s=0.02, state_interval_s=0.05)
    schedule = [(0.0, req("r0", 500, 200)), (0.01, req("r1", 500, 200)), (0.05, req("r2", 500, 200))]
    simulate(schedule, [EngineSpec(H100, 2)], options)
    (policy,) = recorded
    e0 = EngineId(f"{H100}-0")
    views = [snapshot.get(e0) for _, snapshot in policy.seen]
    ages = [snap.state_age_s(v) for (_, snap), v in zip(policy.seen, views, strict=True) if v is not None]
    assert all(v is not None for v in views)
    # Engines connect at -0.021 s. At 0.01 s only that report has arrived (the next one, sent at 0.0 s after
    # r0's admission, arrives at 0.02 s), so the engine looks idle; only the gateway's accounting shows r0.
    at_r1 = views[1]
    assert at_r1 is not None
    assert (at_r1.num_running, at_r1.num_waiting, at_r1.seq) == (0, 0, 1)
    assert ages[1] == pytest.approx(0.011)
    assert (at_r1.inflight_requests, at_r1.unreported_requests, at_r1.queue_length) == (1, 1, 1)
    # By 0.05 s reports sent after the admission have arrived: r0 is on the engine and no longer unreported.
    at_r2 = views[2]
    assert at_r2 is not None
    assert at_r2.num_running + at_r2.num_waiting == 1 and at_r2.seq > 1
    assert (at_r2.inflight_requests, at_r2.unreported_requests, at_r2.queue_length) == (1, 0, 1)


def test_same_seed_gives_identical_outcomes_and_drawn_lengths_follow_it() -> None:
    schedule = [(0.05 * i, req(f"r{i}", 200 + 10 * i, None)) for i in range(20)]
    engines = [EngineSpec(H100, 2), EngineSpec(A6000, 1)]
    options = SimOptions(policy="least_loaded", seed=3, max_output_tokens_default=64)
    first = simulate(schedule, engines, options)
    again = simulate(schedule, engines, options)
    assert first.outcomes == again.outcomes and first.timeline == again.timeline
    other_options = SimOptions(policy="least_loaded", seed=4, max_output_tokens_default=64)
    other = simulate(schedule, engines, other_options)
    assert [o.output_tokens for o in other.outcomes] != [o.output_tokens for o in first.outcomes]


def test_stale_engines_still_serve_on_local_accounting() -> None:
    options = SimOptions(state_interval_s=10.0, stale_after_s=0.0005)  # every engine is stale at the arrival
    result = simulate([(0.01, req("r0"))], [EngineSpec(H100, 1)], options)
    (out,) = result.outcomes
    assert out.success and out.engine_id == f"{H100}-0"


def test_a_request_the_engine_refuses_fails_with_its_message() -> None:
    result = simulate([(0.0, req("huge", 9000, 10)), (0.1, req("ok"))], [EngineSpec(H100, 1)], SimOptions())
    bad, ok = result.outcomes
    assert not bad.success and bad.error is not None and "exceeds the max context" in bad.error
    assert ok.success


def test_timeline_samples_every_period() -> None:
    schedule = [(0.0, req("r0", 100, 300))]
    result = simulate(schedule, [EngineSpec(H100, 1)], SimOptions(record_timeline_s=0.5))
    times = [row["t_s"] for row in result.timeline]
    assert times == [0.5 * (k + 1) for k in range(len(times))] and times[-1] >= result.duration_s
    assert result.timeline[0]["in_flight"] == 1.0 and result.timeline[0]["running"] == 1.0
    produced = sum(row["throughput_tokens_per_s"] * 0.5 for row in result.timeline)
    assert produced == pytest.approx(300)


def test_report_feed_sends_on_interval_and_delivers_the_newest_after_the_delay() -> None:
    profile = get_profile(H100)
    engine = SimEngine(profile)
    feed = ReportFeed(engine, describe_engine(f"{H100}-0", profile), interval_s=0.05, delay_s=0.001)
    feed.connect(0.0)
    assert feed.receive(0.0005) is None
    got = feed.receive(0.12)  # interval sends at 0.05 and 0.10 after the connect report
    assert got is not None
    report, received_s = got
    assert (report.seq, report.engine_timestamp_s, received_s) == (3, 0.1, 0.1 + 0.001)
    assert feed.receive(0.12) is None


def test_skipping_the_change_check_never_misses_a_significant_change() -> None:
    profile = get_profile(A6000)
    engine = SimEngine(profile, seed=5)
    gate = ChangeGate(profile.kv_blocks_total)
    # A burst over the sequence and KV limits: admissions from a queue, finishes, preemptions.
    for i in range(300):
        sampling = SamplingSpec(max_tokens=50 + (i * 37) % 400, ignore_eos=True)
        engine.add_request(BackendRequest(RequestId(f"r{i}"), (0,) * (200 + (i * 53) % 1500), sampling), 0.0)
    gate.significant(engine.stats(0.0))
    now_s, checked, skipped = 0.0, 0, 0
    while engine.has_work():
        step = engine.step(now_s)
        now_s += step.duration_s
        may = gate.iteration_may_matter(step.record, bool(step.finished))
        significant = gate.significant(engine.stats(now_s))
        assert may or not significant
        checked += 1
        skipped += not may
    assert engine.stats(now_s).num_preempted_total > 0 and skipped > 0 and checked > skipped


class EagerFeed:
    """Reference for `ReportFeed`: every send of the agent's schedule, each delivered at its receive time."""

    def __init__(self, engine: SimEngine, identity: EngineDescription, interval_s: float, delay_s: float,
                 state: ClusterState) -> None:
        self.engine, self.identity, self.state = engine, identity, state
        self.interval_s, self.delay_s = interval_s, delay_s
        self.gate = ChangeGate(engine.profile.kv_blocks_total)
        self.seq, self.anchor_s, self.ticks = 0, 0.0, 0
        self.sent: list[tuple[float, int, EngineReport]] = []  # (sent at, seq, report), in send order

    def flush(self, now_s: float) -> None:
        while self.anchor_s + (self.ticks + 1) * self.interval_s <= now_s:
            self.ticks += 1
            self.seq += 1
            sent_s = self.anchor_s + self.ticks * self.interval_s
            self.sent.append((sent_s, self.seq, report_from_stats(self.engine.stats(sent_s), self.identity,
                                                                  self.seq)))

    def send(self, now_s: float) -> None:
        if self.sent and self.sent[-1][0] == now_s:  # same-instant sends coalesce
            seq = self.sent.pop()[1]
        else:
            self.seq += 1
            seq = self.seq
        self.sent.append((now_s, seq, report_from_stats(self.engine.stats(now_s), self.identity, seq)))
        self.anchor_s, self.ticks = now_s, 0

    def on_change(self, now_s: float) -> None:
        self.flush(now_s)
        if self.gate.significant(self.engine.stats(now_s)):
            self.send(now_s)

    def deliver(self, now_s: float) -> None:
        self.flush(now_s)
        while self.sent and self.sent[0][0] + self.delay_s <= now_s:
            sent_s, _, report = self.sent.pop(0)
            self.state.on_report(self.identity.engine_id, report, sent_s + self.delay_s)


class LazyFeed:
    """`ReportFeed` behind the same interface as `EagerFeed`."""

    def __init__(self, engine: SimEngine, identity: EngineDescription, interval_s: float, delay_s: float,
                 state: ClusterState) -> None:
        self.feed = ReportFeed(engine, identity, interval_s=interval_s, delay_s=delay_s)
        self.identity, self.state = identity, state
        self.flush, self.on_change = self.feed.flush, self.feed.on_change

    def send(self, now_s: float) -> None:
        self.feed.connect(now_s)

    def deliver(self, now_s: float) -> None:
        got = self.feed.receive(now_s)
        if got is not None:
            self.state.on_report(self.identity.engine_id, got[0], got[1])


def drive(feed_type: type[EagerFeed] | type[LazyFeed], delay_s: float) -> list[ClusterSnapshot]:
    """One engine, requests admitted at some reads, the gateway's snapshot at every 3 ms."""
    profile = get_profile(A6000)
    identity = describe_engine(f"{A6000}-0", profile)
    engine = SimEngine(profile, seed=1)
    state = ClusterState(snapshot_resolution_s=0.0)
    feed = feed_type(engine, identity, 0.05, delay_s, state)
    state.add_engine(identity.engine_id, -0.1)
    state.on_describe(identity.engine_id, identity)
    state.on_connect(identity.engine_id)
    feed.send(-0.1)
    arrivals = {12: 3000, 40: 1000, 41: 50, 150: 300, 151: 2500, 152: 700}  # read index -> prompt tokens
    done_s, snapshots = math.inf, []
    for k in range(1, 400):
        read_s = 0.003 * k
        while done_s <= read_s:  # iterations back to back, each delivered (and checked) at its end
            feed.on_change(done_s)
            if engine.has_work():
                feed.flush(done_s)
                done_s += engine.step(done_s).duration_s
            else:
                done_s = math.inf
        feed.deliver(read_s)
        snapshots.append(state.snapshot(read_s))
        if k in arrivals:
            rid = f"q{k}"
            state.note_dispatch(identity.engine_id, rid, arrivals[k], 40, "", read_s)
            feed.flush(read_s)
            engine.add_request(BackendRequest(RequestId(rid), (0,) * arrivals[k],
                                              SamplingSpec(max_tokens=40, ignore_eos=True)), read_s)
            feed.on_change(read_s)
            if done_s == math.inf:
                feed.flush(read_s)
                done_s = read_s + engine.step(read_s).duration_s
    return snapshots


@pytest.mark.parametrize("delay_s", [0.0, 0.001, 0.02, 0.12])
def test_lazy_delivery_gives_the_snapshots_of_delivering_every_report(delay_s: float) -> None:
    lazy, eager = drive(LazyFeed, delay_s), drive(EagerFeed, delay_s)
    assert lazy == eager
    assert len({s.engines[0].seq for s in lazy}) > 20  # many reports were received along the way


async def test_token_counts_agree_with_a_live_sim_backend() -> None:
    requests = [req("forced-a", 300, 5), req("drawn-b", 200, None), req("forced-c", 50, 9)]
    options = SimOptions(max_output_tokens_default=16, seed=11)
    simulated = simulate([(0.0, r) for r in requests], [EngineSpec(H100, 1)], options)

    backend = SimBackend(get_profile(H100), clock=MonotonicClock(), engine_id=f"{H100}-0", vocab_size=32000,
                         eos_token_id=2, seed=11)
    await backend.start()
    try:
        async def count(r: Request) -> int:
            forced = r.output_tokens is not None
            sampling = SamplingSpec(max_tokens=r.output_tokens or 16, ignore_eos=forced)
            tokens, finish = 0, None
            request = BackendRequest(RequestId(r.request_id), (0,) * r.prompt_tokens, sampling)
            async for event in backend.generate(request):
                if isinstance(event, TokenEvent):
                    tokens += len(event.token_ids)
                else:
                    finish = event
            assert isinstance(finish, FinishEvent) and finish.usage.completion_tokens == tokens
            return tokens

        live = await asyncio.gather(*(count(r) for r in requests))
    finally:
        await backend.stop()
    assert [o.output_tokens for o in simulated.outcomes] == live
    assert live[0] == 5 and live[2] == 9


def test_slos_reach_the_policy_and_finished_latencies_reach_the_cluster_state(
        recorded: list[Recording]) -> None:
    schedule = [(0.0, req("a")), (1.0, req("b")), (2.0, req("c"))]
    options = SimOptions(policy="latency_based", slo_ttft_s=0.5, slo_tpot_s=0.02)
    simulate(schedule, [EngineSpec(H100, 1)], options)
    seen = recorded[0].seen
    assert all(f.slo_ttft_s == 0.5 and f.slo_tpot_s == 0.02 for f, _ in seen)
    views = [snap.engines[0] for _, snap in seen]
    assert [v.recent_latency_samples for v in views] == [0, 1, 2]  # note_latency after each finish
    assert views[1].recent_ttft_s > 0 and views[1].recent_e2e_s >= views[1].recent_ttft_s


def test_lens_state_reaches_prism_and_planning_follows_options_and_specs(recorded: list[Recording]) -> None:
    schedule = [(0.05 * i, req(f"r{i}", 400, 32)) for i in range(120)]
    simulate(schedule, [EngineSpec(H100, 1)], SimOptions(policy="prism"))
    last = recorded[0].seen[-1][1].engines[0]
    assert last.lens is not None and last.lens.peak_throughput_tokens_per_s > 0  # on by default
    simulate(schedule, [EngineSpec(H100, 1)], SimOptions(policy="prism", lens_state=False))
    assert recorded[1].seen[-1][1].engines[0].lens is None
    with pytest.raises(ValueError, match="slo_tpot_s"):
        SimOptions(slo_tpot_s=0.0)
