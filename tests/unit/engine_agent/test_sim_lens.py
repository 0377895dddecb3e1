"""LENS in the simulated engine (`SimEngine` + `SimLens`): plan budgets, state vector, planning off = no LENS,
and `loadgen --lens` / `--ablation` end to end on the fixtures."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from engine_agent.domain import BackendRequest, RequestId, SamplingSpec
from engine_agent.lens import LensConfig, LensController, PlanLimits
from engine_agent.lens.perf_model import SATURATED_K, LatencyModel, LatencyParams
from engine_agent.sim.engine import SimEngine
from engine_agent.sim.lens_adapter import SimLens
from loadgen.cli import main
from loadgen.simulate import parse_engines
from switchyard.profiles import get_profile

PROFILE = get_profile("h100-llama3-8b")  # max_batched_tokens 8192
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "data"
SMALL = ["--data-dir", str(FIXTURES), "--dataset", "azure-conv", "--num-requests", "30", "--rate", "4",
         "--slo", "ttft=2000,tpot=50"]


def _request(rid: str, prompt: int, output: int, *, slo_ttft_s: float | None = None,
             slo_tpot_s: float | None = None) -> BackendRequest:
    return BackendRequest(RequestId(rid), (7,) * prompt, SamplingSpec(max_tokens=output, ignore_eos=True),
                          slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s)


def _known_lens(pmax_tokens_per_s: float = 20_000.0) -> SimLens:
    """A planning LENS whose model is given (ready at once): T(B, S) = 5 ms + S / Pmax."""
    params = LatencyParams(tau0_s=0.005, w0_tokens=0.0, ws=1.0, pmax_tokens_per_s=pmax_tokens_per_s,
                           kb_per_seq=SATURATED_K, ks_per_token=SATURATED_K, tau_b_s=0.0, tau_s_s=0.0)
    limits = PlanLimits(PROFILE.max_num_seqs, PROFILE.max_batched_tokens, PROFILE.block_size)
    return SimLens(LensController(limits, LensConfig(enabled=True), model=LatencyModel(params=params)))


def _drive(engine: SimEngine, n: int, seed: int = 3, rate_per_s: float = 20.0) -> list[tuple[object, ...]]:
    """Poisson arrivals stepped back to back; every step's (start, duration, tokens, finished ids)."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate_per_s)
        arrivals.append((t, _request(f"r{i}", rng.randint(16, 3000), rng.randint(1, 300))))
    out: list[tuple[object, ...]] = []
    now, index = 0.0, 0
    while index < n or engine.has_work():
        while index < n and arrivals[index][0] <= now:
            engine.add_request(arrivals[index][1], arrivals[index][0])
            index += 1
        if not engine.has_work():
            now = arrivals[index][0]
            continue
        result = engine.step(now)
        out.append((now, result.duration_s, result.tokens, tuple(rid for rid, _ in result.finished)))
        now += result.duration_s if result.duration_s > 0 else 1e-3
    return out


def test_the_plan_budget_is_the_iteration_budget() -> None:
    lens = _known_lens()
    engine = SimEngine(PROFILE, lens=lens)
    engine.add_request(_request("long", 6000, 4), 0.0)
    record = engine.step(0.0).record
    plan = lens.controller.last_plan
    assert plan is not None and 0 < plan.token_budget < PROFILE.max_batched_tokens
    # T_adaptive is the default TPOT SLO (50 ms) with no TTFT-TPOT line yet: (0.05 - 0.005) * 20000 tokens.
    assert plan.token_budget == 900
    assert record.num_prefill_tokens + record.num_decode_tokens == plan.token_budget
    assert record.num_prefill_seqs == 1


def test_the_tightest_queued_slo_sets_the_target() -> None:
    lens = _known_lens()
    engine = SimEngine(PROFILE, lens=lens)
    engine.add_request(_request("a", 6000, 4, slo_ttft_s=5.0, slo_tpot_s=0.10), 0.0)
    engine.add_request(_request("b", 100, 4, slo_ttft_s=5.0, slo_tpot_s=0.02), 0.0)
    record = engine.step(0.0).record
    plan = lens.controller.last_plan
    assert plan is not None and plan.target_latency_s == pytest.approx(0.02)
    assert record.num_prefill_tokens == plan.token_budget == 300  # (0.02 - 0.005) * 20000


def test_the_state_vector_appears_in_stats_after_warm_up() -> None:
    engine = SimEngine(PROFILE, lens=SimLens.for_profile(PROFILE, planning=False))
    assert engine.stats(0.0).lens.peak_throughput_tokens_per_s == 0.0  # cold: unknown
    _drive(engine, 150)
    engine.add_request(_request("late", 500, 10), 1e6)
    figures = engine.stats(1e6).lens
    assert figures.peak_throughput_tokens_per_s > 0
    assert figures.predicted_batch_latency_s > 0
    assert figures.pending_work_tokens >= 500
    assert engine.lens is not None and engine.lens.controller.model.ready


def test_the_state_vector_can_be_off() -> None:
    engine = SimEngine(PROFILE, lens=SimLens.for_profile(PROFILE, planning=False, state_vector=False))
    _drive(engine, 100)
    engine.add_request(_request("late", 500, 10), 1e6)
    assert engine.stats(1e6).lens.pending_work_tokens == 0.0


def test_planning_off_schedules_exactly_as_without_lens() -> None:
    plain = _drive(SimEngine(PROFILE), 200)
    with_lens = _drive(SimEngine(PROFILE, lens=SimLens.for_profile(PROFILE, planning=False)), 200)
    assert with_lens == plain


def test_planning_on_changes_budgets_within_the_static_cap() -> None:
    lens = SimLens.for_profile(PROFILE, planning=True)
    engine = SimEngine(PROFILE, lens=lens)
    steps = _drive(engine, 200)
    assert lens.controller.model.ready and lens.controller.last_plan is not None
    assert all(len(tokens) <= PROFILE.max_num_seqs for _, _, tokens, _ in steps)  # type: ignore[arg-type]
    finished = {rid for *_, done in steps for rid in done}  # type: ignore[attr-defined]
    assert len(finished) == 200


def test_engine_specs_choose_lens_per_spec() -> None:
    specs = parse_engines("h100-llama3-8b:2:lens,a100-llama3-8b:1:static,a6000-llama3-8b")
    assert [(s.profile, s.count, s.lens) for s in specs] == [
        ("h100-llama3-8b", 2, True), ("a100-llama3-8b", 1, False), ("a6000-llama3-8b", 1, None)]
    with pytest.raises(ValueError, match="'lens' or 'static'"):
        parse_engines("h100-llama3-8b:2:fast")


def test_loadgen_simulate_with_lens_end_to_end(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    code = main(["simulate", *SMALL, "--engines", "h100-llama3-8b:2", "--policy", "prism", "--lens",
                 "--no-plots", "--output", str(out)])
    assert code == 0
    assert "SLO attainment" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["summary"]["completed"] == 30 and doc["config"]["lens"] is True


def test_loadgen_compare_ablation_reports_shares(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "ablation.json"
    code = main(["compare", *SMALL, "--engines", "h100-llama3-8b:1,a6000x2-llama3-8b:1", "--ablation",
                 "--no-plots", "--output", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "request share per engine type" in text and "lens+prism" in text
    runs = json.loads(out.read_text())["runs"]
    assert [(r["label"], r["policy"], r["lens_planning"]) for r in runs] == [
        ("static+round_robin", "round_robin", False), ("lens+round_robin", "round_robin", True),
        ("static+prism", "prism", False), ("lens+prism", "prism", True)]
    for run in runs:
        assert run["summary"]["completed"] == 30
        shares = run["share_by_profile"]
        assert set(shares) == {"h100-llama3-8b", "a6000x2-llama3-8b"}
        assert sum(shares.values()) == pytest.approx(1.0)
    assert runs[0]["share_by_profile"]["h100-llama3-8b"] == pytest.approx(0.5, abs=0.04)  # round robin
