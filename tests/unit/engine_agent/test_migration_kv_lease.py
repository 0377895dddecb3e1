"""The lease on a cut request's KV: `--migration-kv-lease-s` (30 s, not NIXL's 480 s) sets the vLLM engine's
NixlConnector hold time; the sim holds no cut's KV (it frees at the cut), so an `Abort` of a cut id
frees nothing more and finds nothing."""

from __future__ import annotations

import pytest

from engine_agent.__main__ import build_agent_argparser, config_from_args
from engine_agent.backends.sim import SimBackend
from engine_agent.config import VllmConfig
from engine_agent.domain import BackendRequest, RequestId, SamplingSpec, TokenEvent
from switchyard.clock import MonotonicClock
from switchyard.profiles import get_profile


def test_the_lease_flag_defaults_to_30_s_and_sets_the_config() -> None:
    assert VllmConfig().migration_kv_lease_s == 30.0
    assert config_from_args(build_agent_argparser().parse_args([])).vllm.migration_kv_lease_s == 30.0
    args = build_agent_argparser().parse_args(["--migration-kv-lease-s", "12.5"])
    assert config_from_args(args).vllm.migration_kv_lease_s == 12.5
    with pytest.raises(ValueError, match="greater than 0"):
        config_from_args(build_agent_argparser().parse_args(["--migration-kv-lease-s", "0"]))


async def test_an_abort_of_a_cut_id_on_the_sim_finds_nothing_held() -> None:
    profile = get_profile("h100-llama3-8b")
    sim = SimBackend(profile, clock=MonotonicClock(), engine_id="a", vocab_size=1000, eos_token_id=2)
    await sim.start()
    try:
        request = BackendRequest(RequestId("cut"), (9,) * 400, SamplingSpec(max_tokens=200, ignore_eos=True))
        got = 0
        async for event in sim.generate(request):
            if isinstance(event, TokenEvent):
                got += len(event.token_ids)
                if got >= 5 and sim.stats().num_running:
                    held = sim.stats().kv_blocks_free
                    assert held < profile.kv_blocks_total
                    await sim.migrate_out(RequestId("cut"), "b")
        # The source freed the cut's KV at the cut: back to baseline at once, and an abort finds nothing.
        assert sim.stats().kv_blocks_free == profile.kv_blocks_total
        assert not await sim.abort(RequestId("cut"))
        assert sim.stats().kv_blocks_free == profile.kv_blocks_total
    finally:
        await sim.stop()
