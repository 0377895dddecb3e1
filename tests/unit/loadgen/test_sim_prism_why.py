"""PRISM's reasons in the simulator: every pick is counted by why (`per_decider[*].why`), the same
`Dispatch.why` the live gateway counts in `switchyard_policy_picks_total`."""

from __future__ import annotations

from typing import Any

from loadgen.datasets import Request
from loadgen.metrics import Slo, summarize
from loadgen.simulate import EngineSpec, SimOptions, SimResult, simulate
from switchyard.clock import ManualClock


def sim(rate_per_s: float, count: int, **params: Any) -> SimResult:
    plan = [(i / rate_per_s, Request(request_id=f"r{i}", prompt_tokens=500, output_tokens=300))
            for i in range(count)]
    options = SimOptions(policy="prism", policy_params=params, slo_ttft_s=0.5, slo_tpot_s=0.05, seed=1)
    return simulate(plan, [EngineSpec("h100-llama3-8b", 2)], options, wall_clock=ManualClock(0.0))


def run(rate_per_s: float, count: int) -> dict[str, int]:
    result = sim(rate_per_s, count)
    assert all(o.success for o in result.outcomes)
    row = result.per_decider[0]
    assert sum(row["why"].values()) == row["decisions"] == count
    return dict(row["why"])


def test_a_light_load_is_scored() -> None:
    assert run(rate_per_s=2.0, count=20) == {"scored": 20}


def test_an_overload_takes_the_soonest_finish_and_says_so() -> None:
    why = run(rate_per_s=400.0, count=600)
    assert why.get("no_feasible_soonest", 0) > 100 and why.get("scored", 0) > 0


def test_shedding_at_overload_fails_the_shed_requests_and_counts_them_against_attainment() -> None:
    served, shed = sim(400.0, 600), sim(400.0, 600, overload="shed")
    failed = [o for o in shed.outcomes if not o.success]
    assert len(shed.outcomes) == 600 and failed  # every arrival has an outcome, the shed ones failed
    assert all("within its SLO" in (o.error or "") for o in failed)
    assert shed.per_decider[0]["why"]["no_feasible_shed"] == len(failed)
    assert sum(shed.per_decider[0]["why"].values()) == 600
    slo = Slo(ttft_ms=500.0, tpot_ms=50.0)
    kept, lost = (summarize(r.outcomes, r.duration_s, slo) for r in (served, shed))
    assert lost.slo_attainment is not None and kept.slo_attainment is not None
    good = sum(1 for o in shed.outcomes if o.success and o.ttft_s is not None and o.ttft_s <= 0.5)
    assert lost.slo_attainment <= good / 600 < 1.0  # over all arrivals: a shed request is a miss
    # goodput: the requests kept out leave room for the others (a shed request would have missed anyway)
    assert lost.slo_attainment > kept.slo_attainment
