"""The agent's NIXL agents run without UCX's progress thread (it spins: a core at 100 % on an idle agent).

Checked here: the engine arguments load the agent's `NixlConnector` with the knob; the config vLLM's worker
builds through the rebound name has the thread off and keeps vLLM's other settings; vLLM's worker still looks
that name up when it runs (what the rebinding relies on); and a NIXL agent built with the knob off starts one
thread fewer than one with it on (in a fresh interpreter, so no UCX thread lingers in the test process). That
the idle agent then costs next to nothing is measured by benchmarks/agent_idle_cpu.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine_agent.backends.vllm import platform
from engine_agent.config import VllmConfig

pytestmark = pytest.mark.filterwarnings("ignore")  # vLLM's own deprecation warnings on import
ENGINE_SIDE = "engine_agent.backends.vllm.engine_side"


def test_engine_args_load_the_agents_nixl_connector_with_the_thread_off(tiny_model_dir: Path) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: PLC0415
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (  # noqa: PLC0415
        NixlConnector as VllmNixlConnector,
    )

    def _kv_transfer(cfg: VllmConfig):  # type: ignore[no-untyped-def]
        return platform.engine_args(str(tiny_model_dir), "tiny", "e-0", cfg, ENGINE_SIDE).kv_transfer_config

    kv = _kv_transfer(VllmConfig())
    assert kv.kv_connector == "NixlConnector"  # vLLM's own checks for NixlConnector keep applying
    assert kv.kv_connector_module_path == platform.__name__
    assert kv.kv_connector_extra_config[platform.PROGRESS_THREAD_KEY] is False
    connector = KVConnectorFactory.get_connector_class(kv)
    assert connector is platform.NixlConnector
    assert issubclass(connector, VllmNixlConnector)

    on = _kv_transfer(VllmConfig(nixl_progress_thread=True))
    assert on.kv_connector_extra_config[platform.PROGRESS_THREAD_KEY] is True
    assert _kv_transfer(VllmConfig(enable_migration=False)) is None


def test_the_config_vllm_builds_through_the_factory_has_no_progress_thread() -> None:
    from nixl._api import nixl_agent_config  # noqa: PLC0415

    # vLLM 0.32's call (NixlBaseConnectorWorker.__init__, UCX only).
    off = platform.nixl_agent_config_factory(nixl_agent_config, False)(num_threads=0, capture_telemetry=True)
    assert off.enable_pthread is False
    assert (off.num_threads, off.capture_telemetry, off.backends) == (0, True, ["UCX"])
    on = platform.nixl_agent_config_factory(nixl_agent_config, True)(num_threads=4, capture_telemetry=True)
    assert on.enable_pthread is True and on.num_threads == 4


def test_vllms_nixl_worker_looks_the_config_name_up_when_it_runs() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker  # noqa: PLC0415

    # The agent's connector rebinds this module global while the worker is built; a vLLM that bound the
    # name some other way (a local import, a default argument) would silently bring the spinning thread back.
    assert "nixl_agent_config" in base_worker.NixlBaseConnectorWorker.__init__.__code__.co_names
    assert base_worker.nixl_agent_config is not None


_COUNT_THREADS = """
import json, os, sys
from nixl._api import nixl_agent, nixl_agent_config
from engine_agent.backends.vllm.platform import nixl_agent_config_factory

def threads():
    return len(os.listdir("/proc/self/task"))

agents = [nixl_agent("warm-up", nixl_agent_config(enable_prog_thread=False))]  # UCX's process-wide threads
added = {}
for progress in (False, True):
    before = threads()
    config = nixl_agent_config_factory(nixl_agent_config, progress)(num_threads=0, capture_telemetry=True)
    agents.append(nixl_agent(f"progress-{progress}", config))
    added[str(progress)] = threads() - before
print(json.dumps(added))
"""


def test_a_nixl_agent_built_with_the_knob_off_starts_no_progress_thread() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _COUNT_THREADS], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    added = json.loads(result.stdout.strip().splitlines()[-1])
    assert added["True"] == added["False"] + 1  # the progress thread (nixlUcxSharedThread)
