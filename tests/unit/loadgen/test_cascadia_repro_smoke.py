"""benchmarks/cascadia_repro.py's `--quick` path: one case (mt-bench-hard, q_min half-way) planned, served by
every system in the simulator, with the weaker judges; the JSON holds every section, every figure finite, and
each cascade's simulated quality at q_min or within sampling noise of it. And App. G's shifting workload,
shortened (phases of 30/60/30 s, windows of 15 s): both cascades re-plan through the shared monitor."""

from __future__ import annotations

import json
import math
from pathlib import Path

from benchmarks import cascadia_repro as bench

CASCADES = ("cascadia", "cascadeserve", "uniform_parallelism", "uniform_allocation")
Q_TOLERANCE = 3.0  # points: 300 items drawn with replacement, scores' sd ~25 -> sd of the mean ~1.5


def test_quick_run_writes_a_complete_finite_document(tmp_path: Path) -> None:
    out = tmp_path / "cascadia_repro.json"
    assert bench.main(["--quick", "--output", str(out)]) == 0
    text = out.read_text()
    assert "NaN" not in text and "Infinity" not in text
    doc = json.loads(text)
    assert {"config", "traces", "cases", "summary", "judges", "paper", "shift", "wall_s"} <= set(doc)
    assert doc["shift"] is None  # the shift needs the all trace too (the full run)

    trace = doc["traces"]["mt-bench-hard"]
    assert trace["nadir"] < trace["utopia"] and trace["base_s"] > 0 and trace["rate_rps"] > 0

    (case,) = doc["cases"]
    assert set(case["systems"]) == set(bench.SYSTEMS)
    assert trace["nadir"] < case["q_min"] < trace["utopia"]
    for name, run in case["systems"].items():
        assert run["failed"] == 0, name
        assert run["min_slo_scale"] is not None and run["min_slo_scale"] > 0, name
        assert run["p95_s"] == run["min_slo_scale"] * case["base_s"] or math.isclose(
            run["p95_s"], run["min_slo_scale"] * case["base_s"]), name
        assert run["quality_sim"] is not None and run["quality_profile"] is not None, name
        assert run["deployment"]["gpus_used"] <= bench.CLUSTER_GPUS, name
    for name in CASCADES:
        run = case["systems"][name]
        assert run["quality_sim"] >= case["q_min"] - Q_TOLERANCE, (name, run["quality_sim"])
        assert run["deployment"]["thresholds"] is not None
    assert case["systems"]["standalone"]["deployment"]["thresholds"] is None
    assert case["systems"]["cascadia"]["deployment"]["solver_s"] > 0
    for name in bench.BASELINES:
        assert case["ratios"][name] is not None and case["ratios"][name] > 0, name
        assert doc["summary"][name]["mean"] == case["ratios"][name]
    assert doc["summary"]["overall"]["mean"] is not None

    assert set(case["judges"]) == set(bench.WEAK_JUDGES)
    for name, row in case["judges"].items():
        assert row["run"]["min_slo_scale"] is not None, name
        assert row["slo_scale_change_pct"] is not None and row["quality_change_pct"] is not None, name
    assert set(doc["judges"]) == set(bench.WEAK_JUDGES)


def test_shortened_shift_re_plans_both_cascades_and_not_the_single_model() -> None:
    from gateway.cascade.plan.bilevel import DeploymentSolver  # noqa: PLC0415
    from gateway.cascade.plan.replan import ReplanParams  # noqa: PLC0415
    from gateway.cascade.plan.stage_latency import StageLatencyModel  # noqa: PLC0415
    from gateway.cascade.quality import mt_bench_profile  # noqa: PLC0415
    from switchyard.hardware import GPUS  # noqa: PLC0415

    profile = mt_bench_profile()
    est = StageLatencyModel(GPUS[bench.GPU])
    deployer = DeploymentSolver(est, bench.RetryingSolver())
    hard = bench.setup_trace(profile, est, deployer, "mt-bench-hard", 100)
    every = bench.setup_trace(profile, est, deployer, "mt-bench", 100)
    phases = (("mt-bench-hard", 30.0), ("mt-bench", 60.0), ("mt-bench-easy", 30.0))
    shift = bench.run_shift(profile, est, deployer, hard, every, phases, bench.SHIFT_Q_MIN,
                            ReplanParams(window_s=15.0))
    assert shift["requests"] == sum(round(shift["rate_rps"] * s) for _, s in phases)
    assert shift["base_s"] == every.base_s
    runs = shift["systems"]
    assert set(runs) == {"cascadia", "cascadeserve", "standalone"}
    for name in ("cascadia", "cascadeserve"):
        replan = runs[name]["replan"]
        assert replan["replans"] >= 1, name
        assert any(a["kind"] == "rolled_out" for a in replan["actions"]), name
    assert runs["standalone"]["replan"] is None
    for name, run in runs.items():
        assert run["failed"] == 0, name  # a drained first stage sends its requests to the next one
        assert set(run["phase_p95_s"]) == {p for p, _ in phases}, name
        assert all(v is not None and v > 0 for v in run["phase_p95_s"].values()), name
    for name in ("cascadeserve", "standalone"):
        ratio = runs[name]["min_slo_scale"] / runs["cascadia"]["min_slo_scale"]
        assert shift["ratios"][name] == ratio
        assert math.isclose(shift["reduction_pct"][name], (1 - 1 / ratio) * 100)
