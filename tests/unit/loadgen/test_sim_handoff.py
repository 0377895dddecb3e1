"""Disaggregated serving in the simulator (CAUCHY): prefill engines hand every request off after its first
token, the request life resumes it on a decode engine of the combo, and the modelled KV pull separates the two
tokens. Nothing is lost or repeated: each request's output equals the aggregated run's."""

from __future__ import annotations

import random

import pytest

from gateway.planning.combos import Slo
from gateway.planning.cost_model import Workload
from gateway.planning.plan_file import Plan
from loadgen.datasets import Request
from loadgen.simulate import EngineSpec, Scaling, SimOptions, simulate
from loadgen.simulate.fleet import combo_engines
from loadgen.simulate.scaling import plan_engines
from loadgen.simulate.spec import parse_engines
from switchyard.hardware import MODELS
from switchyard.profiles import get_profile

H800, H20 = "h800-llama3-8b", "h20-llama3-8b"


def poisson(n: int, rate: float, seed: int = 1) -> list[tuple[float, Request]]:
    rng = random.Random(seed)
    t = 0.0
    out = []
    for i in range(n):
        t += rng.expovariate(rate)
        out.append((t, Request(f"r{i}", rng.randint(20, 1500), output_tokens=rng.choice((1, 2, 40, 300)))))
    return out


def test_a_disaggregated_fleet_serves_every_token_of_the_aggregated_run() -> None:
    schedule = poisson(300, 8.0)
    options = SimOptions(policy="least_loaded", kv_link_gbps=100.0, kv_transfer_latency_s=0.002)
    disagg = simulate(schedule, [EngineSpec(H800, 1, combo="c#0", role="prefill"),
                                 EngineSpec(H20, 2, combo="c#0", role="decode")], options)
    whole = simulate(schedule, [EngineSpec(H800, 1), EngineSpec(H20, 2)], options)
    assert all(o.success for o in disagg.outcomes) and len(disagg.outcomes) == 300
    mine = {o.request_id: o for o in disagg.outcomes}
    for o in whole.outcomes:
        assert mine[o.request_id].output_tokens == o.output_tokens
        assert len(mine[o.request_id].itl_s) == o.output_tokens - 1
    prefill, decode = disagg.per_engine[f"{H800}-0"], [disagg.per_engine[f"{H20}-{i}"] for i in (0, 1)]
    # Every request started on the prefill engine, which produced exactly its first token.
    assert prefill["requests"] == 300 and prefill["output_tokens"] == 300 and prefill["role"] == "prefill"
    assert all(d["requests"] == 0 and d["role"] == "decode" for d in decode)
    multi = [o for o in disagg.outcomes if o.output_tokens > 1]
    assert disagg.handoffs is not None and disagg.handoffs["handoffs"] == len(multi)
    assert sum(d["output_tokens"] for d in decode) == sum(o.output_tokens - 1 for o in multi)
    kv_per_token = get_profile(H800).model.kv_bytes_per_token
    assert disagg.handoffs["kv_bytes"] == sum(o.prompt_tokens * kv_per_token for o in multi)
    # The second token comes no sooner than the modelled KV pull of the prompt allows.
    for o in multi:
        assert o.itl_s[0] >= 0.002 + o.prompt_tokens * kv_per_token * 8 / 100e9 - 1e-12
    assert whole.handoffs is None


def test_hand_offs_stay_in_their_combo() -> None:
    schedule = poisson(200, 6.0, seed=3)
    specs = [EngineSpec(H800, 1, combo="x#0", role="prefill"), EngineSpec(H20, 1, combo="x#0", role="decode"),
             EngineSpec(H800, 1, combo="x#1", role="prefill"), EngineSpec(H20, 1, combo="x#1", role="decode")]
    result = simulate(schedule, specs, SimOptions(policy="round_robin", balance_figures=True))
    rows = result.per_engine
    assert all(o.success for o in result.outcomes)
    # Each decode engine decoded what its own combo's prefill engine handed off, and nothing else.
    for prefill, decode in ((f"{H800}-0", f"{H20}-0"), (f"{H800}-1", f"{H20}-1")):
        assert rows[decode]["migrations_in"] == rows[prefill]["migrations_out"] > 0


def test_engine_specs_and_plans_carry_roles() -> None:
    assert [(s.profile, s.count, s.lens, s.role) for s in parse_engines(
        f"{H800}:1:prefill,{H20}:2:static:decode,{H20}")] == [
        (H800, 1, None, "prefill"), (H20, 2, False, "decode"), (H20, 1, None, "")]
    for bad in (f"{H800}:1:prefill:decode", f"{H800}:1:lens:static", f"{H800}:1:middle"):
        with pytest.raises(ValueError, match="at most one of each"):
            parse_engines(bad)
    assert combo_engines("1xh800+2xh20", "llama3-8b") == [
        (H800, "prefill"), (H20, "decode"), (H20, "decode")]
    assert combo_engines("2xh800", "llama3-8b") == [(H800, ""), (H800, "")]
    plan = Plan(model=MODELS["llama3-8b"], workload=Workload(300.0, 100.0), slo=Slo(2.0, 0.1), objective="co",
                inventory={"h800": 4, "h20": 4}, prices={}, combos={"1xh800+2xh20": 1, "1xh800": 1},
                goodput_rps={"1xh800+2xh20": 4.0, "1xh800": 3.0})
    specs = plan_engines(Scaling(plan))
    assert sorted((s.profile, s.combo, s.role) for s in specs) == [
        (H20, "1xh800+2xh20#0", "decode"), (H20, "1xh800+2xh20#0", "decode"),
        (H800, "1xh800#0", ""), (H800, "1xh800+2xh20#0", "prefill")]
    result = simulate(poisson(100, 4.0, seed=5), [], SimOptions(policy="goodput_rr"), scaling=Scaling(plan))
    assert all(o.success for o in result.outcomes)
    assert result.handoffs is not None and result.handoffs["handoffs"] > 0


def test_opportunistic_scheduling_decodes_in_place_on_the_prefill_engine() -> None:
    schedule = poisson(300, 12.0, seed=7)
    specs = [EngineSpec(H800, 1, combo="c#0", role="prefill"), EngineSpec(H20, 1, combo="c#0", role="decode")]
    strict = simulate(schedule, specs, SimOptions(policy="goodput_rr", policy_params={"intra": "rr"}))
    opportunistic = simulate(schedule, specs, SimOptions(policy="goodput_rr",
                                                         policy_params={"intra": "opportunistic"}))
    for result in (strict, opportunistic):
        assert all(o.success for o in result.outcomes) and len(result.outcomes) == 300
    assert strict.per_engine[f"{H800}-0"]["output_tokens"] == 300  # first tokens only
    kept = opportunistic.per_engine[f"{H800}-0"]["output_tokens"] - 300
    assert kept > 0  # it decoded some requests in place ...
    assert opportunistic.handoffs is not None and strict.handoffs is not None
    assert opportunistic.handoffs["kv_bytes"] < strict.handoffs["kv_bytes"]  # ... whose KV never moved
    by_id = {o.request_id: o.output_tokens for o in strict.outcomes}
    assert {o.request_id: o.output_tokens for o in opportunistic.outcomes} == by_id


def test_hand_offs_and_star_migrations_run_together() -> None:
    # The sync that advances the prefill engines also follows the STAR cuts due by then; the main loop must
    # not follow them a second time.
    specs = [EngineSpec(H800, 1, role="prefill"), EngineSpec(H20, 2, role="decode"), EngineSpec(H800, 2)]
    result = simulate(poisson(300, 6.0, seed=11), specs,
                      SimOptions(policy="least_loaded", reschedule="star-oracle"))
    assert all(o.success for o in result.outcomes) and len(result.outcomes) == 300
    assert result.handoffs is not None and result.handoffs["handoffs"] > 0
    assert result.balance is not None and result.balance["migrations"]["cut"] > 0
