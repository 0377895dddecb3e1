"""Facts about the platform vLLM runs on, and the settings the agent derives from them.

Owns: CPU-or-GPU detection, the device name, the OpenMP core binding on the CPU platform, KV dtype sizes,
the engine arguments the agent builds vLLM with, and the agent's `NixlConnector` (vLLM's, with NIXL's progress
thread as configured), which vLLM's connector factory imports from here in the engine processes.
Must not: import vLLM at module import time (the connector class is built on first access).
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any

from engine_agent.config import VllmConfig

# kv_connector_extra_config key read by the agent's NixlConnector (vLLM ignores keys it does not know).
PROGRESS_THREAD_KEY = "agent_nixl_progress_thread"


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform  # noqa: PLC0415

    return bool(current_platform.is_cpu())


def device_name() -> str:
    if is_cpu_platform():
        return "cpu"
    from vllm.platforms import current_platform  # noqa: PLC0415

    with contextlib.suppress(Exception):
        return str(current_platform.getdevice_name())
    return "gpu"


def default_omp_bind(migration: bool) -> str | None:
    """Cores for torch's OpenMP threads (VLLM_CPU_OMP_THREADS_BIND); None = vLLM's own choice.

    - Migration off: None. vLLM's auto binding already keeps a core for the other processes (on 2 cores:
      OpenMP on core 0, core 1 reserved).
    - Migration on, 1 core: None (nothing to split).
    - Migration on, 2 cores or more: all cores but the last. On the CPU platform vLLM's NIXL worker moves the
      thread that builds it, which is OpenMP's master thread (it runs the model), onto the last core
      (`sched_setaffinity(0, <last core of each NUMA node>)` in `NixlBaseConnectorWorker.__init__`). With
      OpenMP on every core, two OpenMP threads then share the last core and each step waits for both; leaving
      it out puts the team on distinct cores (the master on the last, the others on theirs).

    Measured on 2 cores (tiny model, eager, one 48-token greedy request, ms per output token after the first,
    NIXL's progress thread off; median and range of 4-12 requests per setting, on a machine shared with other
    work):
    - all but one (OpenMP on core 0, the master moved to core 1): 2.6 ms (2.4-3.6);
    - all cores: 152 ms (140-159): both OpenMP threads on core 1 after the move. With the master put back on
      core 0, 5.3 ms (2.7-9.1): the second OpenMP thread then competes with the EngineCore and the agent;
    - migration off (vLLM's auto binding, OpenMP on core 0): 2.6 ms (2.1-3.5).
    The 134 ms once blamed on NIXL's spinning progress thread was this move; the thread is off now
    (`nixl_agent_config_factory`). After the engine is built the backend moves the master back onto these
    cores (`VllmBackend._pin_compute_thread`): left on the last core, the model shared it with the EngineCore
    loop, the agent and the gateway, and Switchyard with NIXL on delivered 0.51-0.65x `vllm serve`'s tokens/s
    at c = 1-32; pinned back, 0.83-0.97x (benchmarks/vllm_gateway_vs_serve.py, same runs).
    """
    if not migration:
        return None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    return ",".join(str(c) for c in cores[:-1])


def dtype_bytes(cache_dtype: str, model_dtype: Any) -> int:
    if cache_dtype and cache_dtype != "auto":
        return 1 if "fp8" in cache_dtype else 2
    return int(getattr(model_dtype, "itemsize", 2))


def engine_args(model_dir: str, model_name: str, engine_id: str, cfg: VllmConfig, engine_side: str) -> Any:
    """vLLM's engine arguments for the agent.

    Token ids in and out, our stat logger only, iteration details on, NixlConnector (bidirectional, pull) when
    migration is on, the hidden-state tap as the worker extension, prefix caching with vLLM's KV events on
    unless `enable_prefix_caching` is off.
    """
    from vllm.config import KVEventsConfig, KVTransferConfig  # noqa: PLC0415
    from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: PLC0415

    kv_transfer = None
    if cfg.enable_migration:
        kv_transfer = KVTransferConfig(
            # vLLM's name, so its own checks for NixlConnector still apply; the class is this module's.
            kv_connector="NixlConnector",
            kv_connector_module_path=__name__,
            kv_role="kv_both",
            engine_id=engine_id,
            kv_buffer_device="cpu" if is_cpu_platform() else "cuda",
            kv_connector_extra_config={
                "bidirectional_kv_xfer": True,
                # Always pull migrated KV, however short: recomputing would not be a migration.
                "kv_recompute_threshold": 0,
                "decoder_kv_blocks_ttl": cfg.migration_kv_lease_s,
                # UCX progress threads poll; vLLM's default of 4 starves the engine on a small CPU box.
                "num_threads": cfg.nixl_num_threads
                if cfg.nixl_num_threads is not None
                else (0 if is_cpu_platform() else 4),
                PROGRESS_THREAD_KEY: cfg.nixl_progress_thread,
            },
        )
    return AsyncEngineArgs(
        model=model_dir,
        served_model_name=[model_name],
        skip_tokenizer_init=True,
        max_model_len=cfg.max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        block_size=cfg.block_size,
        dtype=cfg.dtype,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        enforce_eager=cfg.enforce_eager,
        tensor_parallel_size=cfg.tensor_parallel_size,
        disable_log_stats=True,  # our stat logger only; vLLM's per-iteration log lines stay off
        enable_logging_iteration_details=True,
        kv_transfer_config=kv_transfer,
        enable_prefix_caching=cfg.enable_prefix_caching,
        # vLLM's own KV events, published in process to the agent scheduler's mapper (engine_side): the
        # "null" publisher is what the scheduler builds; it replaces it.
        kv_events_config=(KVEventsConfig(enable_kv_cache_events=True, publisher="null")
                          if cfg.enable_prefix_caching else None),
        worker_extension_cls=f"{engine_side}.HiddenStateTap",
    )


def nixl_agent_config_factory(make: Any, progress_thread: bool) -> Any:
    """`make` (nixl's `nixl_agent_config`) with `enable_prog_thread` fixed to `progress_thread`.

    NIXL 1.5.1's Python agent hard-codes the progress thread's poll delay to 0 (`pthrDelay = 0` in
    `nixl_agent.__init__`), so UCX's shared progress thread (`nixlUcxSharedThread::run`) calls `poll()` with a
    0 ms timeout in a loop: one core at 100 % while the agent is idle. Without the thread, NIXL progresses
    UCX inside the calls vLLM already makes every engine step (`transfer`, `check_xfer_state`,
    `get_new_notifs`), and an idle agent costs nothing. Both sides of a migration keep stepping while it is
    pending: the target while its request waits for the KV, the source while it holds the KV for the reader
    (vLLM's `Scheduler.has_finished_requests` counts held requests). That matters where a READ is not
    one-sided: over shared memory on one CPU host the source must progress for the target's read to finish.
    """
    return functools.partial(make, enable_prog_thread=progress_thread)


def _nixl_connector_class() -> type:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker  # noqa: PLC0415
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (  # noqa: PLC0415
        NixlPullConnector,
    )

    class NixlConnector(NixlPullConnector):  # type: ignore[misc]
        """vLLM's pull NixlConnector whose NIXL agent has UCX's progress thread only if the engine's
        `kv_connector_extra_config[PROGRESS_THREAD_KEY]` is true.

        vLLM 0.32 builds the agent inline in `NixlBaseConnectorWorker.__init__` with
        `nixl_agent_config(num_threads=..., capture_telemetry=True)`, a name it resolves in its `base_worker`
        module, and passes no way to set `enable_prog_thread`; so that name is rebound for the duration of
        the worker's construction (one thread, at start-up) and restored after.
        """

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
            make = base_worker.nixl_agent_config
            progress = bool(vllm_config.kv_transfer_config.get_from_extra_config(PROGRESS_THREAD_KEY, False))
            if make is not None:
                base_worker.nixl_agent_config = nixl_agent_config_factory(make, progress)
            try:
                super().__init__(vllm_config, role, kv_cache_config)
            finally:
                base_worker.nixl_agent_config = make

    NixlConnector.__qualname__ = "NixlConnector"  # pickles and logs as engine_agent...platform.NixlConnector
    return NixlConnector


def __getattr__(name: str) -> Any:
    # PEP 562: vLLM's connector factory getattr()s "NixlConnector" on import_module(kv_connector_module_path).
    if name == "NixlConnector":
        cls = _nixl_connector_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
