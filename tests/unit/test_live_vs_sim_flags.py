"""benchmarks/live_vs_sim.py's `--reschedule`: the flags it gives the live agents and gateway, parsed by their
own command lines, configure what the simulator's options of the same arm simulate (Algorithm 1's parameters,
the rescheduling interval, the mover's limits, the rounds' interval and the modelled KV link)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from engine_agent.__main__ import build_agent_argparser, config_from_args
from gateway.__main__ import build_argparser, cli_overrides
from gateway.config import build_config
from gateway.dispatch.mover import MoveParams
from gateway.rescheduling.star import StarParams
from loadgen.simulate import SimOptions

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "live_vs_sim.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("live_vs_sim", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("arm", "gateway_arm", "predictor"),
                         [("star-oracle", "star", "oracle"), ("star-nopred", "star-nopred", None)])
def test_live_flags_configure_what_the_simulator_runs(arm: str, gateway_arm: str,
                                                      predictor: str | None) -> None:
    bench = _bench()
    options = SimOptions(reschedule=arm)  # type: ignore[arg-type]
    agent_args, gateway_args = bench.reschedule_flags(arm, options)

    gw = build_config(environ={}, cli=cli_overrides(build_argparser().parse_args(
        ["--engine", "127.0.0.1:1", *gateway_args]))).reschedule
    assert gw.policy == gateway_arm
    star = StarParams(**{**gw.params, "use_prediction": gw.policy == "star"})  # type: ignore[arg-type]
    assert star == options.star_params()
    assert gw.interval_s == options.reschedule_interval_s
    assert MoveParams(gw.max_migrations_per_request, gw.request_cooldown_s,
                      gw.engine_cooldown_s) == options.move_params

    agent = config_from_args(build_agent_argparser().parse_args(
        ["--backend", "sim", "--profile", "h100-llama3-8b", *agent_args]), environ={})
    assert agent.star_rounds
    assert agent.length_predictor == predictor
    assert agent.hidden_state_interval == options.prediction_interval
    assert agent.state_interval_s == options.state_interval_s
    assert agent.sim_kv_link_gbps == options.kv_link_gbps
    assert agent.sim_kv_transfer_latency_s == options.kv_transfer_latency_s
    assert bench.agent_link(agent_args) == (agent.sim_kv_link_gbps, agent.sim_kv_transfer_latency_s)


def test_without_flags_the_agents_link_is_their_default() -> None:
    agent = config_from_args(build_agent_argparser().parse_args(
        ["--backend", "sim", "--profile", "h100-llama3-8b"]), environ={})
    assert _bench().agent_link(()) == (agent.sim_kv_link_gbps, agent.sim_kv_transfer_latency_s)
