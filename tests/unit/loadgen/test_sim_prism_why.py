"""PRISM's reasons in the simulator: every pick is counted by why (`per_decider[*].why`), the same
`Dispatch.why` the live gateway counts in `switchyard_policy_picks_total`."""

from __future__ import annotations

from loadgen.datasets import Request
from loadgen.simulate import EngineSpec, SimOptions, simulate
from switchyard.clock import ManualClock


def run(rate_per_s: float, count: int) -> dict[str, int]:
    plan = [(i / rate_per_s, Request(request_id=f"r{i}", prompt_tokens=500, output_tokens=300))
            for i in range(count)]
    options = SimOptions(policy="prism", slo_ttft_s=0.5, slo_tpot_s=0.05, seed=1)
    result = simulate(plan, [EngineSpec("h100-llama3-8b", 2)], options, wall_clock=ManualClock(0.0))
    assert all(o.success for o in result.outcomes)
    row = result.per_decider[0]
    assert sum(row["why"].values()) == row["decisions"] == count
    return dict(row["why"])


def test_a_light_load_is_scored() -> None:
    assert run(rate_per_s=2.0, count=20) == {"scored": 20}


def test_an_overload_takes_the_soonest_finish_and_says_so() -> None:
    why = run(rate_per_s=400.0, count=600)
    assert why.get("no_feasible_soonest", 0) > 100 and why.get("scored", 0) > 0
