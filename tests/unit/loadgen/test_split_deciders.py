"""The simulated gateway split over N deciders (the gateway's `--workers N`): one worker is the unsplit run,
each worker's ledger holds only its own dispatches and releases, every request is served exactly once, and
the assignment of requests to workers is a function of the seed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from loadgen_testkit import Recording, record_policies

from gateway.dispatch.life import Decision, Dispatch
from loadgen.cli import main
from loadgen.compare import Variant, mean_over_seeds, with_deciders
from loadgen.datasets import Request
from loadgen.simulate import EngineSpec, SimOptions, simulate
from loadgen.simulate.deciders import DeciderAssigner

H100 = "h100-llama3-8b"
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "data"


def req(rid: str, prompt_tokens: int = 100, output_tokens: int = 8, session_id: str | None = None) -> Request:
    return Request(
        request_id=rid, prompt_tokens=prompt_tokens, output_tokens=output_tokens, session_id=session_id
    )


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[Recording]:
    return record_policies(monkeypatch)


def session_reaching(decider: int, count: int, seed: int) -> str:
    """A session id that `DeciderAssigner(count, "session", seed)` sends to `decider`."""
    assigner = DeciderAssigner(count, "session", seed)
    return next(s for s in (f"s{i}" for i in range(1000)) if assigner(s) == decider)


# ---- one decider is the unsplit gateway ------------------------------------------------------------------

MIXED = [(0.02 * i, req(f"r{i}", 100 + 37 * (i % 7), 4 + i % 11)) for i in range(40)]


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "prism", "static_weighted"])
def test_a_split_gateway_whose_traffic_reaches_one_worker_is_the_unsplit_gateway(policy: str) -> None:
    """Decider 0 is the single-process gateway (its random stream and counter), and idle siblings that only
    receive reports change nothing: every request on one keep-alive session to worker 0 of 4 gives the
    one-worker run, decisions (features, draws and counters included) and outcomes alike."""
    session = session_reaching(0, 4, seed=5)
    schedule = [
        (t, Request(r.request_id, r.prompt_tokens, output_tokens=r.output_tokens, session_id=session))
        for t, r in MIXED
    ]
    engines = [EngineSpec(H100, 2), EngineSpec("a6000-llama3-8b", 1)]
    alone: list[Decision] = []
    split: list[Decision] = []
    one = simulate(schedule, engines, SimOptions(policy=policy, seed=5), on_decision=alone.append)
    four = simulate(
        schedule,
        engines,
        SimOptions(policy=policy, seed=5, deciders=4, decider_assignment="session"),
        on_decision=split.append,
    )
    assert alone == split
    assert one.outcomes == four.outcomes and one.timeline == four.timeline
    assert one.per_engine == four.per_engine
    why = {"why": {"scored": 40}} if policy == "prism" else {}  # PRISM says why it picked
    assert one.per_decider == [{"decisions": 40, "dispatched": 40, **why}]
    assert four.per_decider == ([{"decisions": 40, "dispatched": 40, **why}]
                                + [{"decisions": 0, "dispatched": 0}] * 3)


def test_one_decider_is_the_default_and_draws_no_assignment() -> None:
    assert SimOptions().deciders == 1 and SimOptions().decider_assignment == "random"
    first = simulate(MIXED, [EngineSpec(H100, 2)], SimOptions(policy="static_weighted", seed=3))
    again = simulate(
        MIXED,
        [EngineSpec(H100, 2)],
        SimOptions(policy="static_weighted", seed=3, decider_assignment="session"),
    )
    assert first.outcomes == again.outcomes
    assert [DeciderAssigner(1, "random", 3)(f"s{i}") for i in range(5)] == [0] * 5
    for bad in ({"deciders": 0}, {"decider_assignment": "hash"}):
        with pytest.raises(ValueError):
            SimOptions(**bad)  # type: ignore[arg-type]


# ---- each worker's ledger is its own -----------------------------------------------------------------------


def test_each_deciders_ledger_counts_only_its_own_dispatches_while_reports_show_everyone(
    recorded: list[Recording],
) -> None:
    """A wave of requests 10 ms apart (each admission is reported 1 ms later), then probes 100 ms apart once
    the wave has finished (all within the 2 s latency window of the wave's finishes). At every decision of
    the wave, the deciding worker's ledger holds exactly its own earlier dispatches (none has finished yet),
    while the engines' reports show every worker's; at the probes, every release and latency sample reached
    the ledger of the worker that dispatched the request."""
    wave = [(0.01 * i, req(f"w{i}", 200, 100)) for i in range(30)]
    probes = [(1.5 + 0.1 * i, req(f"p{i}", 50, 1)) for i in range(12)]
    result = simulate(
        [*wave, *probes], [EngineSpec(H100, 4)], SimOptions(policy="least_loaded", seed=1, deciders=3)
    )
    assert len(recorded) == 3  # one policy instance per decider
    assert all(o.success for o in result.outcomes)
    wave_out = result.outcomes[:30]
    finishes = [(o.arrival_s or 0.0) + (o.e2e_s or 0.0) for o in wave_out]
    assert min(finishes) > 0.29  # all running until the last arrival
    assert max(finishes) < 1.5  # and done before the first probe
    dispatched_by = {f.request_id: d for d, policy in enumerate(recorded) for f, _ in policy.seen}
    assert sorted(dispatched_by) == sorted(r.request_id for _, r in [*wave, *probes])
    own_wave = [
        sum(1 for rid, d in dispatched_by.items() if rid.startswith("w") and d == k) for k in range(3)
    ]
    assert all(own_wave) and sum(own_wave) == 30
    for decider, policy in enumerate(recorded):
        mine = probes_mine = 0
        assert [f.dispatch_seq for f, _ in policy.seen] == list(range(len(policy.seen)))  # its own counter
        for features, snapshot in policy.seen:
            views = snapshot.engines
            if features.request_id.startswith("w"):
                everyone = int(features.request_id[1:])  # wave requests before this one, all still running
                assert sum(v.inflight_requests for v in views) == mine
                assert sum(v.unreported_requests for v in views) == 0  # reported 1 ms after each admission
                assert sum(v.num_running + v.num_waiting for v in views) == everyone
                mine += 1
            else:  # a probe: what this worker dispatched has finished, and it noted each finish itself
                assert sum(v.inflight_requests for v in views) == 0
                assert sum(v.recent_latency_samples for v in views) == own_wave[decider] + probes_mine
                probes_mine += 1
    assert result.per_decider == [{"decisions": len(p.seen), "dispatched": len(p.seen)} for p in recorded]


def test_sessions_are_remembered_only_by_the_worker_that_served_them(recorded: list[Recording]) -> None:
    """Random assignment spreads a conversation over workers, and a worker that never served it has no
    record of it; session assignment keeps the conversation, and its record, on one worker."""
    turns = [(0.5 * i, req(f"t{i}", 100, 4, session_id="chat")) for i in range(12)]
    simulate(turns, [EngineSpec(H100, 3)], SimOptions(policy="session_affinity", seed=2, deciders=3))
    served_before: set[int] = set()
    forgotten = 0
    by_time = sorted(((f.now_s, d, f) for d, p in enumerate(recorded) for f, _ in p.seen), key=lambda x: x[0])
    assert len(by_time) == 12
    for _, decider, features in by_time:
        assert (features.session_engine is None) == (decider not in served_before)
        if served_before and decider not in served_before:
            forgotten += 1
        served_before.add(decider)
    assert forgotten > 0  # turns that reached a worker which never served the conversation
    recorded.clear()
    simulate(
        turns,
        [EngineSpec(H100, 3)],
        SimOptions(policy="session_affinity", seed=2, deciders=3, decider_assignment="session"),
    )
    served = [(d, f) for d, p in enumerate(recorded) for f, _ in p.seen]
    assert len({d for d, _ in served}) == 1
    assert [f.session_engine is None for _, f in served] == [True] + [False] * 11


# ---- every request exactly once; assignment a function of the seed ---------------------------------------


@pytest.mark.parametrize("deciders", [2, 3, 8])
def test_every_request_is_served_exactly_once(deciders: int) -> None:
    schedule = [(0.005 * i, req(f"r{i}", 50 + 13 * (i % 9), 3 + i % 5)) for i in range(80)]
    decisions: list[Decision] = []
    result = simulate(
        schedule,
        [EngineSpec(H100, 2), EngineSpec("a6000-llama3-8b", 2)],
        SimOptions(policy="least_loaded", seed=4, deciders=deciders),
        on_decision=decisions.append,
    )
    assert [o.request_id for o in result.outcomes] == [r.request_id for _, r in schedule]
    assert all(o.success for o in result.outcomes)
    assert sorted(d.features.request_id for d in decisions if isinstance(d, Dispatch)) == sorted(
        r.request_id for _, r in schedule
    )
    assert sum(t["requests"] for t in result.per_engine.values()) == 80
    assert len(result.per_decider) == deciders
    assert (
        sum(d["decisions"] for d in result.per_decider)
        == sum(d["dispatched"] for d in result.per_decider)
        == 80
    )


def test_assignment_is_a_function_of_the_seed() -> None:
    def draws(seed: int, mode: str = "random") -> list[int]:
        assign = DeciderAssigner(4, mode, seed)  # type: ignore[arg-type]
        return [assign("") for _ in range(200)]

    assert draws(0) == draws(0)
    assert draws(0) != draws(1)
    assert set(draws(0)) == {0, 1, 2, 3}
    by_session = DeciderAssigner(4, "session", 9)
    sessions = [f"s{i}" for i in range(100)]
    first = [by_session(s) for s in sessions]
    assert [by_session(s) for s in reversed(sessions)] == first[::-1]  # a session's worker, in any order
    assert [DeciderAssigner(4, "session", 9)(s) for s in sessions] == first
    assert set(first) == {0, 1, 2, 3}
    assert draws(9, "session") == draws(9)  # requests without a session are drawn as under "random"

    schedule = [(0.01 * i, req(f"r{i}")) for i in range(60)]
    runs = [
        simulate(schedule, [EngineSpec(H100, 3)], SimOptions(policy="least_loaded", seed=s, deciders=4))
        for s in (5, 5, 6)
    ]
    assert runs[0].outcomes == runs[1].outcomes and runs[0].per_decider == runs[1].per_decider
    assert runs[0].per_decider != runs[2].per_decider


# ---- comparison and command line --------------------------------------------------------------------------


def test_with_deciders_repeats_each_variant_per_count_and_means_fold_replicates() -> None:
    base = [
        Variant("rr", "round_robin", (EngineSpec(H100, 1),)),
        Variant("ll", "least_loaded", (EngineSpec(H100, 1),)),
    ]
    assert [(v.label, v.deciders) for v in with_deciders(base, [1, 4])] == [
        ("rr d=1", 1),
        ("rr d=4", 4),
        ("ll d=1", 1),
        ("ll d=4", 4),
    ]
    assert [(v.label, v.deciders) for v in with_deciders(base, [2])] == [("rr", 2), ("ll", 2)]
    for bad in ([], [1, 1], [0]):
        with pytest.raises(ValueError):
            with_deciders(base, bad)
    runs = [
        {
            "label": "rr",
            "rate": 2.0,
            "seed": s,
            "summary": {"p99_ttft_ms": v, "slo_attainment": None, "completed": 10},
        }
        for s, v in ((0, 10.0), (1, 30.0))
    ]
    (row,) = mean_over_seeds(runs)
    assert row["seeds"] == [0, 1]
    assert row["summary"] == {"p99_ttft_ms": 20.0, "slo_attainment": None, "completed": 10.0}
    assert (row["summary_min"]["p99_ttft_ms"], row["summary_max"]["p99_ttft_ms"]) == (10.0, 30.0)


SMALL = [
    "--data-dir",
    str(FIXTURES),
    "--dataset",
    "azure-conv",
    "--num-requests",
    "30",
    "--rate",
    "4",
    "--engines",
    "h100-llama3-8b:2",
    "--no-plots",
]


def test_cli_simulate_and_compare_take_deciders(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert (
        main(
            [
                "simulate",
                *SMALL,
                "--policy",
                "least_loaded",
                "--deciders",
                "3",
                "--output",
                str(tmp_path / "sim.json"),
            ]
        )
        == 0
    )
    assert "Decisions per decider:" in capsys.readouterr().out
    doc = json.loads((tmp_path / "sim.json").read_text())
    assert doc["config"]["deciders"] == 3 and doc["config"]["decider_assignment"] == "random"
    assert sum(d["decisions"] for d in doc["summary"]["per_decider"]) == 30

    out = tmp_path / "cmp.json"
    assert (
        main(
            [
                "compare",
                *SMALL,
                "--policies",
                "round_robin,least_loaded",
                "--deciders",
                "1,2",
                "--seeds",
                "0,1",
                "--no-timelines",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    assert "mean over seeds 0,1" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert [(r["label"], r["deciders"], r["seed"]) for r in doc["runs"][:4]] == [
        ("round_robin d=1", 1, 0),
        ("round_robin d=2", 2, 0),
        ("least_loaded d=1", 1, 0),
        ("least_loaded d=2", 2, 0),
    ]
    assert len(doc["runs"]) == 8 and not any("timeline" in r for r in doc["runs"])
    assert [m["label"] for m in doc["means"]] == [
        "round_robin d=1",
        "round_robin d=2",
        "least_loaded d=1",
        "least_loaded d=2",
    ]
    assert all(m["seeds"] == [0, 1] and m["summary"]["completed"] == 30 for m in doc["means"])


@pytest.mark.parametrize(
    "argv",
    [
        ["simulate", "--deciders", "0"],
        ["compare", "--deciders", "2,2"],
        ["compare", "--deciders", "x"],
        ["compare", "--seeds", "1,1"],
        ["simulate", "--decider-assignment", "hash"],
    ],
)
def test_bad_decider_flags_are_one_line_errors(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "error:" in err
