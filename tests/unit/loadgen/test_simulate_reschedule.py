"""STAR rescheduling in the simulator: the live rescheduler, mover limits and splice decisions, virtual time.

A skewed fleet: two engines behind round robin, the long requests all dispatched to the first (even positions)
and the short ones to the second, so the second empties and the rescheduler has work to do.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine_agent.domain import BackendRequest, MigrationRefused, RequestId, SamplingSpec
from engine_agent.sim.engine import SimEngine
from engine_agent.star.history import HistoryTable
from engine_agent.star.mlp import MLP
from engine_agent.star.predictor import LengthPredictor, PredictorMeta
from gateway.cluster.state import ClusterState
from gateway.dispatch.mover import MoveError, MoveLimits, MoveParams
from gateway.domain import EngineId, FutureLoad
from loadgen.cli import main
from loadgen.datasets import Request
from loadgen.metrics import Outcome
from loadgen.results import read_results
from loadgen.simulate import EngineSpec, SimOptions, SimResult, simulate
from loadgen.simulate.balance import balance_figures, exec_time_variance_ms2, format_balance_table
from loadgen.simulate.predictions import BinnedLengths, PredictionRounds, exact_lengths, remaining_lengths
from loadgen.simulate.reports import ReportFeed, describe_engine
from switchyard.clock import ManualClock
from switchyard.profiles import get_profile

H100 = "h100-llama3-8b"
E0, E1 = f"{H100}-0", f"{H100}-1"
FLEET = [EngineSpec(H100, 2)]
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "data"


def length_of(i: int) -> int:
    return 1200 + 40 * i if i % 2 == 0 else 20 + i


def skewed(n: int = 12) -> list[tuple[float, Request]]:
    """n requests at t = 0: the even ones long (round robin puts them on engine 0), the odd ones short."""
    return [(0.0, Request(request_id=f"r{i}", prompt_tokens=300 + 10 * i, output_tokens=length_of(i)))
            for i in range(n)]


def run(arm: str, schedule: list[tuple[float, Request]] | None = None, **options: Any) -> SimResult:
    return simulate(schedule or skewed(), FLEET, SimOptions(reschedule=arm, **options),  # type: ignore[arg-type]
                    wall_clock=ManualClock(0.0))


def moved(result: SimResult) -> dict[str, int]:
    return {rid: cuts for row in result.per_decider for rid, cuts in row["reschedule"]["moves"].items()}


def assert_whole(outcomes: list[Outcome]) -> None:
    """Every request finished with exactly its forced output length and strictly increasing token times."""
    for o in outcomes:
        assert o.success, o.error
        expected = length_of(int(o.request_id[1:]))
        assert o.output_tokens == expected and len(o.itl_s) + 1 == expected, o.request_id
        assert o.ttft_s is not None and o.ttft_s > 0 and all(gap > 0 for gap in o.itl_s), o.request_id


def test_star_oracle_moves_long_requests_off_the_loaded_engine() -> None:
    result = run("star-oracle")
    assert_whole(result.outcomes)
    balance = result.balance
    assert balance is not None
    cuts = balance["migrations"]["cut"]
    assert cuts >= 2 and balance["migrations"]["resumed"] == cuts
    assert balance["migrations"]["failed"] == balance["migrations"]["fallback"] == 0
    assert balance["kv_bytes_moved"] > 0 and balance["splice_stall_ms"]["p99"] > 0
    assert result.per_engine[E0]["migrations_out"] >= 2 and result.per_engine[E1]["migrations_in"] >= 2
    moves = moved(result)
    assert sum(moves.values()) == cuts and max(moves.values()) <= MoveParams().max_migrations_per_request
    assert all(int(rid[1:]) % 2 == 0 for rid in moves)  # only the long requests were worth moving
    by_id = {o.request_id: o for o in result.outcomes}
    # A request moved once from engine 0 finishes on engine 1: its outcome is on its final engine.
    assert any(cuts == 1 and by_id[rid].engine_id == E1 for rid, cuts in moves.items())
    for rid, outcome in by_id.items():
        if rid not in moves:
            assert outcome.engine_id == (E0 if int(rid[1:]) % 2 == 0 else E1)
    # Work spread: engine 1 produced tokens of long requests after the short ones were done.
    assert result.per_engine[E1]["output_tokens"] > sum(length_of(i) for i in range(1, 12, 2))


def test_no_rescheduling_moves_nothing_and_changes_nothing() -> None:
    plain = simulate(skewed(), FLEET, SimOptions())
    none = run("none", balance_figures=True)
    assert none.outcomes == plain.outcomes and plain.balance is None
    assert none.balance is not None and sum(none.balance["migrations"].values()) == 0
    assert none.balance["propose_calls"] == 0 and all(o.engine_id == (E0 if int(o.request_id[1:]) % 2 == 0
                                                                      else E1) for o in none.outcomes)
    # The load-balance figures: the first engine held every long request.
    assert none.per_engine[E0]["peak_kv_used_ratio"] > none.per_engine[E1]["peak_kv_used_ratio"] > 0
    assert none.per_engine[E0]["preemptions"] == 0 and none.balance["exec_time_var_ms2"] > 0
    assert all("exec_time_var_ms2" in row and "max_kv_used_ratio" in row for row in none.timeline)


def test_the_same_seed_gives_the_same_run() -> None:
    first, second = run("star-oracle"), run("star-oracle")
    assert first.outcomes == second.outcomes and first.per_engine == second.per_engine
    assert first.per_decider == second.per_decider and first.balance == second.balance
    assert first.timeline == second.timeline


def test_star_without_prediction_runs_on_current_load() -> None:
    result = run("star-nopred")
    assert_whole(result.outcomes)
    assert result.balance is not None and result.balance["migrations"]["cut"] >= 1


def test_star_with_bins_and_with_a_predictor_file_keep_every_token() -> None:
    binned = run("star", predictor_bins=6)
    assert_whole(binned.outcomes)
    assert binned.balance is not None and binned.balance["migrations"]["cut"] >= 1
    predicted = run("star", predictor=tiny_predictor(4096))
    assert_whole(predicted.outcomes)
    with pytest.raises(ValueError, match="hidden states of size 128"):
        run("star", predictor=tiny_predictor(128))


def test_migrations_keep_engine_drawn_lengths_and_sessions_follow_the_move() -> None:
    """Requests without a forced length: the cut carries the length the first engine drew."""
    schedule = [(0.0, Request(request_id=f"q{i}", prompt_tokens=200, output_tokens=None, session_id="s"))
                for i in range(10)]
    none = simulate(schedule, FLEET, SimOptions(policy="session_affinity", max_output_tokens_default=1500))
    oracle = simulate(schedule, FLEET, SimOptions(policy="session_affinity", max_output_tokens_default=1500,
                                                  reschedule="star-oracle"), wall_clock=ManualClock(0.0))
    assert {o.engine_id for o in none.outcomes} == {E0}  # the session pins every request to one engine
    assert oracle.balance is not None and oracle.balance["migrations"]["resumed"] >= 1
    lengths = {o.request_id: o.output_tokens for o in none.outcomes}
    assert {o.request_id: o.output_tokens for o in oracle.outcomes} == lengths
    assert all(len(o.itl_s) + 1 == o.output_tokens for o in oracle.outcomes)


def test_a_target_that_refuses_falls_back_to_the_source(monkeypatch: pytest.MonkeyPatch) -> None:
    original = SimEngine.add_migrated_request
    refused: list[str] = []

    def refuse_on_engine_1(self: SimEngine, *args: Any, **kwargs: Any) -> None:
        if self.engine_id == E1:
            refused.append(self.engine_id)
            raise MigrationRefused("no room")
        original(self, *args, **kwargs)

    monkeypatch.setattr(SimEngine, "add_migrated_request", refuse_on_engine_1)
    result = run("star-oracle")
    assert_whole(result.outcomes)
    balance = result.balance
    assert balance is not None and refused
    assert balance["migrations"]["fallback"] == balance["migrations"]["cut"] >= 1  # resumed on the source
    assert balance["migrations"]["resumed"] == 0
    assert all(o.engine_id == (E0 if int(o.request_id[1:]) % 2 == 0 else E1) for o in result.outcomes)


def test_no_engine_left_fails_the_request(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: SimEngine, *args: Any, **kwargs: Any) -> None:
        raise MigrationRefused("no room")

    monkeypatch.setattr(SimEngine, "add_migrated_request", refuse)
    result = run("star-oracle")
    balance = result.balance
    assert balance is not None and balance["migrations"]["failed"] == balance["migrations"]["cut"] >= 1
    failed = [o for o in result.outcomes if not o.success]
    assert len(failed) == balance["migrations"]["failed"]
    assert all(o.error is not None and "no engine could resume" in o.error for o in failed)


def test_the_movers_limits_hold_in_virtual_time() -> None:
    strict = run("star-oracle", move_params=MoveParams(max_migrations_per_request=0))
    assert strict.balance is not None and strict.balance["migrations"]["cut"] == 0
    # As live: a request never cut is not excluded up front, the mover's check refuses it (409).
    proposals = strict.balance["proposals"]
    assert proposals and strict.balance["not_started"] == {"409": proposals}
    limits = MoveLimits(MoveParams(max_migrations_per_request=1, request_cooldown_s=5.0,
                                   engine_cooldown_s=1.0))
    a, b = EngineId("a"), EngineId("b")
    limits.begin("r", (a, b))
    assert limits.busy_engines(0.0) == {a, b} and "r" in limits.unmovable_requests(0.0)
    limits.end("r", (a, b), 0.0)
    limits.note_cut("r", 0.0)
    with pytest.raises(MoveError, match="cooling down"):
        limits.check("s", a, None, 0.5)
    limits.check("s", a, None, 1.0)
    with pytest.raises(MoveError, match="1 times"):
        limits.check("r", a, b, 10.0)


def test_prediction_rounds_reach_the_cluster_state_every_k_decode_steps() -> None:
    engine = SimEngine(get_profile(H100))
    in_flight: dict[str, tuple[int, list[float]]] = {}

    def admit(rid: str, now_s: float) -> None:
        engine.add_request(BackendRequest(RequestId(rid), (0,) * 50,
                                          SamplingSpec(max_tokens=100, ignore_eos=True)), now_s)
        in_flight[rid] = (50, [])

    admit("a0", 0.0)
    admit("a1", 0.0)

    def requests() -> list[tuple[str, int, int]]:
        return [(rid, prompt, len(times)) for rid, (prompt, times) in in_flight.items()]

    rounds = PredictionRounds(engine, exact_lengths, requests, round_tokens=3, horizon=4)
    now_s, due = 0.0, []
    for _ in range(7):
        step = engine.step(now_s)
        now_s += step.duration_s
        for rid, _token in step.tokens:
            in_flight[rid][1].append(now_s)
        due.append(rounds.step(step.record.num_decode_seqs > 0))
    assert due == [False, False, False, True, False, False, True]  # the first step is the prefill
    admit("a2", now_s)  # in flight, waiting: no output yet, so not in the round
    star = rounds.take()
    assert [(p.request_id, p.current_tokens, p.generated_tokens, p.predicted_remaining_tokens, p.migratable)
            for p in star.predictions] == [(f"a{i}", 57, 7, 93.0, True) for i in range(2)]
    assert (star.round, star.round_tokens, star.future_load) == (1, 3, (120.0, 126.0, 132.0, 138.0))
    assert rounds.listed == 2 and rounds.empty().predictions == () and rounds.listed == 0

    nopred = PredictionRounds(engine, None, requests, round_tokens=2, horizon=3)
    assert [nopred.step(decoding) for decoding in (False, True, False)] == [False, True, False]  # every k
    assert nopred.take().future_load == (114.0,) * 3  # current tokens held over H, N-hat unknown (0)

    identity = describe_engine("e", engine.profile)
    assert identity.kv_bytes_per_token == engine.profile.model.kv_bytes_per_token > 0
    feed = ReportFeed(engine, identity, interval_s=0.05, delay_s=0.001)
    feed.connect(0.0)
    feed.push_round(0.01, star)
    state = ClusterState()
    state.add_engine(EngineId("e"), 0.0)
    state.on_describe(EngineId("e"), identity)
    state.on_connect(EngineId("e"))
    got = feed.receive(0.2)  # the round's report and later interval ones: the newest carries the round
    assert got is not None and got[0].engine_timestamp_s > 0.01
    assert got[0].future_load == FutureLoad(1, 3, star.future_load)
    state.on_report(EngineId("e"), *got)
    view = state.snapshot(0.2).engines[0]
    assert [(p.request_id, p.current_tokens, p.predicted_remaining_tokens) for p in view.predictions] == [
        (f"a{i}", 57, 93.0) for i in range(2)]
    assert view.kv_bytes_per_token == identity.kv_bytes_per_token and view.last_iteration_s > 0


def test_table_3_bins_quantise_to_their_midpoints() -> None:
    k = 1024
    six = BinnedLengths(6)
    assert list(six(["a"] * 5, [1] * 5, [1] * 5, [100, 3000, 7000, 9000, 40000])) == [
        k, 3 * k, 7 * k, 12 * k, 24 * k]
    two = BinnedLengths(2)
    assert list(two(["a"] * 2, [1] * 2, [1] * 2, [8 * k - 1, 8 * k])) == [4 * k, 20 * k]
    with pytest.raises(ValueError):
        BinnedLengths(3)
    assert remaining_lengths("star-oracle", predictor=None, bins=None, hidden=None) is exact_lengths
    assert remaining_lengths("star-nopred", predictor=None, bins=None, hidden=None) is None
    for arm in ("star", "none"):
        with pytest.raises(ValueError):
            remaining_lengths(arm, predictor=None, bins=None, hidden=None)


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="needs a length predictor"):
        SimOptions(reschedule="star")
    with pytest.raises(ValueError, match="predictor_bins"):
        SimOptions(reschedule="star", predictor_bins=3)
    with pytest.raises(ValueError, match="set by the arm"):
        SimOptions(reschedule="star-oracle", reschedule_params={"kv_link_gbps": 1.0})
    with pytest.raises(ValueError, match="reschedule parameters"):
        SimOptions(reschedule="star-oracle", reschedule_params={"nope": 1})
    with pytest.raises(ValueError, match="reschedule"):
        SimOptions(reschedule="bogus")  # type: ignore[arg-type]
    options = SimOptions(reschedule="star-nopred", reschedule_params={"theta": 0.2}, kv_link_gbps=100.0,
                         prediction_interval=5)
    star = options.star_params()
    assert (star.theta, star.use_prediction, star.kv_link_gbps, star.round_tokens) == (0.2, False, 100.0, 5)
    assert options.records_balance and not SimOptions().records_balance
    assert SimOptions(balance_figures=True).records_balance


def test_balance_figures_pool_the_workers_and_format_a_table() -> None:
    assert exec_time_variance_ms2([0.010, 0.030]) == pytest.approx(100.0)
    assert exec_time_variance_ms2([]) == 0.0
    result = run("star-oracle", deciders=2)
    assert_whole(result.outcomes)
    assert result.balance is not None and len(result.per_decider) == 2
    pooled = balance_figures(result.per_engine, result.per_decider, result.timeline, result.duration_s)
    assert pooled == result.balance
    rows = result.per_decider
    assert pooled["migrations"]["cut"] == sum(d["reschedule"]["migrations"]["cut"] for d in rows)
    table = format_balance_table([{"label": "x", "rate": 1.0, "balance": pooled},
                                  {"label": "y", "rate": 1.0}])
    assert table.startswith("load balance") and len(table.splitlines()) == 4
    assert format_balance_table([{"label": "y", "rate": 1.0}]) == ""


def test_cli_records_the_arm_of_every_run(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    small = ["--data-dir", str(FIXTURES), "--dataset", "azure-conv", "--num-requests", "20", "--rate", "8",
             "--engines", f"{H100}:2", "--no-plots"]
    out = tmp_path / "sim.json"
    assert main(["simulate", *small, "--reschedule", "star-oracle", "--output", str(out)]) == 0
    assert "Migrations (cut/resumed/fallback):" in capsys.readouterr().out
    results = read_results(out)
    assert results.config["reschedule"] == "star-oracle" and results.config["kv_link_gbps"] == 25.0
    outcomes = {"cut", "refused", "resumed", "fallback", "handoff", "failed"}
    assert results.summary["balance"]["migrations"].keys() == outcomes
    cmp_out = tmp_path / "cmp.json"
    assert main(["compare", *small, "--reschedule", "none,star", "--predictor-bins", "4",
                 "--output", str(cmp_out)]) == 0
    printed = capsys.readouterr().out
    assert "round_robin star" in printed and "load balance and migrations" in printed
    doc = json.loads(cmp_out.read_text())
    assert [r["reschedule"] for r in doc["runs"]] == ["none", "star"]
    assert all(r["balance"]["migrations"]["failed"] == 0 for r in doc["runs"])
    assert main(["compare", *small]) == 0 and "load balance" not in capsys.readouterr().out
    for argv, needle in ((["simulate", *small, "--reschedule", "none,star-oracle"], "one --reschedule arm"),
                         (["simulate", *small, "--reschedule", "star"], "needs a length predictor"),
                         (["simulate", *small, "--reschedule", "bogus"], "--reschedule"),
                         (["simulate", *small, "--reschedule", "star", "--predictor", str(tmp_path / "x")],
                          "no such file")):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = int(exc.code or 0)
        assert code == 2 and needle in capsys.readouterr().err


def tiny_predictor(hidden_size: int) -> LengthPredictor:
    """An untrained MLP of the predictor file's shape (its predictions are arbitrary, >= 0)."""
    rng = np.random.default_rng(0)
    mlp = MLP([rng.standard_normal((hidden_size, 4)).astype(np.float32) * 0.05,
               rng.standard_normal((4, 1)).astype(np.float32)],
              [np.zeros(4, dtype=np.float32), np.ones(1, dtype=np.float32)])
    return LengthPredictor(
        mlp=mlp, input_mean=np.zeros(hidden_size, dtype=np.float32),
        input_std=np.ones(hidden_size, dtype=np.float32),
        meta=PredictorMeta(model="llama3-8b", hidden_size=hidden_size, widths=(4,), target_scale=500.0,
                           seed=0),
        history=HistoryTable(edges=np.array([0.0]), means=np.array([500.0])),
        test_request_ids=np.array([], dtype=np.str_))
