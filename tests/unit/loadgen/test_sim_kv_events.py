"""The simulator's state stream carries the prefix cache's KV events as the agent does: a resync when the
stream opens, each send's events, and the skipped reports' events merged into the one report handed over,
so the gateway's index is exactly what the engine holds."""

from __future__ import annotations

import dataclasses
import random

from engine_agent.domain import BackendRequest, RequestId, SamplingSpec
from engine_agent.sim.engine import SimEngine
from gateway.cluster.state import ClusterState
from gateway.domain import PREFIX_EVENTS, EngineId
from loadgen.simulate.reports import ReportFeed, describe_engine
from switchyard.prefix import INDEX_SPAN_TOKENS, block_keys
from switchyard.profiles import get_profile

# A small KV (4,096 tokens = 16 index blocks) so that eviction happens.
PROFILE = dataclasses.replace(get_profile("h100-llama3-8b"), num_gpu_blocks_override=256)
ENGINE = EngineId("e0")


def prompt(rng: random.Random) -> tuple[int, ...]:
    """One of 6 shared heads (2 index blocks) + a private tail of 0-9 index blocks (past the fourth, one in
    four is indexed)."""
    head = rng.randrange(6)
    tail = rng.randrange(10) * INDEX_SPAN_TOKENS + rng.randrange(INDEX_SPAN_TOKENS)
    salt = rng.randrange(1 << 30)
    return (tuple(100 + head * 7 + i % 50 for i in range(2 * INDEX_SPAN_TOKENS))
            + tuple(5000 + (salt + i) % 20_000 for i in range(tail)))


def test_the_gateway_index_follows_the_engine_through_skipped_reports_and_eviction() -> None:
    rng = random.Random(3)
    engine = SimEngine(PROFILE, prefix_caching=True, kv_events=True)
    # A delivery delay of 3 intervals: `receive` often hands over the newest of several reports.
    feed = ReportFeed(engine, describe_engine(ENGINE, PROFILE), interval_s=0.01, delay_s=0.03, kv_events=True)
    state = ClusterState(stale_after_s=10.0, snapshot_resolution_s=0.0)
    state.add_engine(ENGINE, 0.0)
    state.on_connect(ENGINE)
    feed.connect(0.0)
    now_s = 0.0
    received = 0
    for n in range(120):
        if rng.random() < 0.5:
            feed.flush(now_s)
            engine.add_request(BackendRequest(RequestId(f"r{n}"), prompt(rng),
                                              SamplingSpec(max_tokens=4, ignore_eos=True)), now_s)
            feed.on_change(now_s)
        if engine.has_work():
            feed.flush(now_s)
            now_s += engine.step(now_s).duration_s
            feed.on_change(now_s)
        else:
            now_s += 0.005
        got = feed.receive(now_s)
        if got is not None:
            state.on_report(ENGINE, got[0], got[1])
            received += 1
    while engine.has_work():
        feed.flush(now_s)
        now_s += engine.step(now_s).duration_s
        feed.on_change(now_s)
    got = feed.receive(now_s + 1.0)  # everything sent by now has arrived: the newest report, merged
    assert got is not None
    state.on_report(ENGINE, got[0], got[1])
    assert engine.prefix_cache is not None and engine.prefix_cache.evicted_total > 0
    held = set(engine.kv_snapshot().stored)
    assert held
    index = state._reported  # noqa: SLF001 - the index itself, compared key by key
    assert index.held(ENGINE) == len(held)
    for key in held:
        assert index.match((key,), (ENGINE,)) == {ENGINE: 1}
    assert received > 10


def test_a_policy_reading_events_turns_them_on_in_the_fleet() -> None:
    from loadgen.simulate.fleet import reports_kv_events
    from loadgen.simulate.spec import SimOptions

    assert reports_kv_events(SimOptions(policy="kv_aware"))
    assert reports_kv_events(SimOptions(policy="prism", policy_params={"prefix": True}))
    assert not reports_kv_events(SimOptions(policy="approx_prefix"))
    assert not reports_kv_events(SimOptions(policy="round_robin"))
    assert reports_kv_events(SimOptions(policy="round_robin", kv_events=True))
    assert block_keys(prompt(random.Random(0)), INDEX_SPAN_TOKENS)  # the prompts here do span index blocks
    assert PREFIX_EVENTS == "events"
