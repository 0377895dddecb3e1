"""Facts about the platform vLLM runs on, and the settings the agent derives from them.

Owns: CPU-or-GPU detection, the device name, the OpenMP core binding on the CPU platform, KV dtype sizes,
and the engine arguments the agent builds vLLM with.
Must not: import vLLM at module import time.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from engine_agent.config import VllmConfig


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
    """Leave one core to NIXL's UCX progress thread: measured on 2 cores, a decode step of the tiny model took
    134 ms with torch's OpenMP threads on both cores (their spin barrier fights the progress thread) and 6 ms
    with OpenMP on core 0 only."""
    if not migration:
        return None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    keep = cores[:-1]
    return ",".join(str(c) for c in keep)


def dtype_bytes(cache_dtype: str, model_dtype: Any) -> int:
    if cache_dtype and cache_dtype != "auto":
        return 1 if "fp8" in cache_dtype else 2
    return int(getattr(model_dtype, "itemsize", 2))


def engine_args(model_dir: str, model_name: str, engine_id: str, cfg: VllmConfig, engine_side: str) -> Any:
    """vLLM's engine arguments for the agent.

    Token ids in and out, our stat logger only, iteration details on, NixlConnector (bidirectional, pull) when
    migration is on, the hidden-state tap as the worker extension.
    """
    from vllm.config import KVTransferConfig  # noqa: PLC0415
    from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: PLC0415

    kv_transfer = None
    if cfg.enable_migration:
        kv_transfer = KVTransferConfig(
            kv_connector="NixlConnector",
            kv_role="kv_both",
            engine_id=engine_id,
            kv_buffer_device="cpu" if is_cpu_platform() else "cuda",
            kv_connector_extra_config={
                "bidirectional_kv_xfer": True,
                # Always pull migrated KV, however short: recomputing would not be a migration.
                "kv_recompute_threshold": 0,
                "decoder_kv_blocks_ttl": cfg.kv_hold_ttl_s,
                # UCX progress threads poll; vLLM's default of 4 starves the engine on a small CPU box.
                "num_threads": cfg.nixl_num_threads
                if cfg.nixl_num_threads is not None
                else (0 if is_cpu_platform() else 4),
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
        worker_extension_cls=f"{engine_side}.HiddenStateTap",
    )
