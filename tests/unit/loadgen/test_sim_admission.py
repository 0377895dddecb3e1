"""The gateway's admission gate in the simulator (`SimOptions.admission`, the live gate's `ModelQueue`): what
the fleet's sequence slots cannot hold waits in the gateway's queue and goes at the finish that frees a slot;
a full queue or a wait the TTFT SLO cannot absorb sheds the request as a failure; a cascade is admitted on
its first stage's model; off, every request goes to the engines at once."""

from __future__ import annotations

import pytest

from gateway.admission.core import AdmissionParams
from gateway.cascade.core import parse_cascade
from gateway.cascade.quality import mt_bench_profile
from loadgen.cli import main
from loadgen.datasets import Request
from loadgen.simulate import EngineSpec, SimOptions, parse_engines, simulate
from loadgen.simulate.cascade import CascadeSim, SimJudge, cascade_requests

A100 = "a100-llama3-8b"  # 256 sequence slots (vLLM's default for its class)
SLOTS = 256


def burst(n: int, prompt_tokens: int = 100, output_tokens: int = 50, gap_s: float = 1e-4) -> list[
        tuple[float, Request]]:
    return [(gap_s * i, Request(request_id=f"r{i}", prompt_tokens=prompt_tokens, output_tokens=output_tokens))
            for i in range(n)]


def run(schedule: list[tuple[float, Request]], admission: AdmissionParams | None, **options: object):
    return simulate(schedule, [EngineSpec(A100, 1)],
                    SimOptions(record_timeline_s=0.01, admission=admission, **options))  # type: ignore[arg-type]


def test_requests_beyond_the_fleets_slots_wait_at_the_gateway_and_go_as_slots_free() -> None:
    result = run(burst(300), AdmissionParams())
    assert result.per_decider == [{"decisions": 300, "dispatched": 300,
                                   "admission": {"admitted": SLOTS, "queued": 300 - SLOTS}}]
    assert max(row["in_flight"] for row in result.timeline) == SLOTS  # never more at the engine
    assert all(o.success for o in result.outcomes)
    by_id = {o.request_id: o for o in result.outcomes}
    first_finish_s = min(o.arrival_s + (o.e2e_s or 0.0) for o in result.outcomes[:SLOTS])
    for i in range(SLOTS, 300):  # a queued request's TTFT counts its wait from its arrival
        late = by_id[f"r{i}"]
        assert late.arrival_s == pytest.approx(1e-4 * i)
        assert late.arrival_s + (late.ttft_s or 0.0) > first_finish_s


def test_without_the_gate_every_request_goes_to_the_engines_at_once() -> None:
    result = run(burst(300), None)
    assert result.per_decider == [{"decisions": 300, "dispatched": 300}]
    assert max(row["in_flight"] for row in result.timeline) == 300
    assert all(o.success for o in result.outcomes)


def test_a_gate_that_never_queues_leaves_the_run_as_it_was() -> None:
    light = burst(100, gap_s=0.01)
    gated, open_ = run(light, AdmissionParams()), run(light, None)
    assert gated.outcomes == open_.outcomes
    assert gated.per_decider == open_.per_decider  # no admission row: it neither queued nor shed


def test_a_full_queue_sheds_the_newcomer_as_a_failure_at_its_arrival() -> None:
    result = run(burst(300), AdmissionParams(max_queue=10))
    assert result.per_decider[0]["admission"] == {"admitted": SLOTS, "queued": 10, "shed_queue_full": 34}
    failed = [o for o in result.outcomes if not o.success]
    assert [o.request_id for o in failed] == [f"r{i}" for i in range(SLOTS + 10, 300)]
    assert all("fleet saturated" in (o.error or "") and "queue_full" in (o.error or "") for o in failed)
    assert all(o.arrival_s == pytest.approx(1e-4 * int(o.request_id[1:])) for o in failed)


def test_a_wait_the_ttft_slo_cannot_absorb_is_shed_once_the_completion_rate_is_known() -> None:
    """Sustained overload with long outputs: the queue's predicted wait (queued ahead / completion rate)
    exceeds a 1 s TTFT SLO, so newcomers are shed as slo_unattainable; without an SLO nothing is shed on
    prediction (only a full queue sheds)."""
    overload = burst(3000, prompt_tokens=500, output_tokens=400, gap_s=0.01)
    with_slo = run(overload, AdmissionParams(), slo_ttft_s=1.0)
    gate = with_slo.per_decider[0]["admission"]
    assert gate.get("shed_slo_unattainable", 0) > 0
    failed = sum(not o.success for o in with_slo.outcomes)
    assert failed == sum(n for k, n in gate.items() if k.startswith("shed_"))
    no_slo = run(overload, AdmissionParams())
    assert "shed_slo_unattainable" not in no_slo.per_decider[0]["admission"]


def test_a_queued_request_fails_at_its_ttft_deadline_as_the_live_gates_timer_sheds_it() -> None:
    """300 requests at once on 256 slots with a 0.5 s TTFT SLO: no request finishes within 0.5 s, so no
    prediction sheds at arrival and the 44 that queue fail when their deadline passes (slo_expired); with a
    60 s SLO they wait for slots and are served; with expiry off, a 0.5 s SLO leaves them queued too."""
    expiring = run(burst(300), AdmissionParams(), slo_ttft_s=0.5)
    assert expiring.per_decider[0]["admission"] == {"admitted": SLOTS, "queued": 44, "shed_slo_expired": 44}
    failed = [o for o in expiring.outcomes if not o.success]
    assert [o.request_id for o in failed] == [f"r{i}" for i in range(SLOTS, 300)]
    assert all("slo_expired" in (o.error or "") for o in failed)
    assert max(row["in_flight"] for row in expiring.timeline) == SLOTS
    first_finish_s = min(o.arrival_s + (o.e2e_s or 0.0) for o in expiring.outcomes if o.success)
    assert first_finish_s > 0.5 + 1e-4 * 300  # every deadline passed before any slot freed
    patient = run(burst(300), AdmissionParams(), slo_ttft_s=60.0)
    assert patient.per_decider[0]["admission"] == {"admitted": SLOTS, "queued": 44}
    assert all(o.success for o in patient.outcomes)
    kept = run(burst(300), AdmissionParams(shed_expired=False), slo_ttft_s=0.5)
    assert all(o.success for o in kept.outcomes)


def test_the_simulate_command_runs_without_the_gate_on_request(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    args = ["simulate", "--dataset", "synth:in=100,out=50,n=300", "--rate", "inf",
            "--engines", f"{A100}:1", "--seed", "1"]
    assert main([*args, "--output", str(tmp_path / "gated.json")]) == 0
    assert "Admission gate (requests):" in capsys.readouterr().out
    assert main([*args, "--no-admission", "--output", str(tmp_path / "open.json")]) == 0
    assert "Admission gate" not in capsys.readouterr().out


def test_a_cascade_is_admitted_once_on_its_first_stages_model_until_the_clients_answer() -> None:
    """As the live handler: the gate holds a cascade request from arrival to its answer on the first stage's
    slots (one A100 serving llama3-8b: 256), whatever stages it runs; the rest queue, or are shed when the
    queue is full."""
    profile = mt_bench_profile()
    requests = cascade_requests(profile, "mt-bench", 300, seed=3, first_model="llama3-8b")
    schedule = [(1e-4 * i, r) for i, r in enumerate(requests)]
    sim = CascadeSim(parse_cascade("c=llama3-8b:90,llama3-70b"), profile, SimJudge())
    fleet = parse_engines(f"{A100}:1,h100x4-llama3-70b:1")
    gated = simulate(schedule, fleet, SimOptions(cascade=sim, seed=3))
    assert gated.per_decider[0]["admission"] == {"admitted": SLOTS, "queued": 300 - SLOTS}
    assert all(o.success for o in gated.outcomes)
    full = simulate(schedule, fleet, SimOptions(cascade=sim, seed=3, admission=AdmissionParams(max_queue=0)))
    assert full.per_decider[0]["admission"] == {"admitted": SLOTS, "shed_queue_full": 300 - SLOTS}
    shed = [o for o in full.outcomes if not o.success]
    assert len(shed) == 300 - SLOTS and all("'llama3-8b' (queue_full)" in (o.error or "") for o in shed)
