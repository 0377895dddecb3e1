"""`VllmEngineState` without vLLM: step stats carry the scheduler read forward and ask for a new one only when
the set of requests changes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from engine_agent.backends.vllm.state import VllmEngineState
from switchyard.clock import ManualClock


def _step(running: int, waiting: int, *, prefill: int = 0, decode: int = 0) -> Any:
    details = SimpleNamespace(
        elapsed_ms=5.0, num_ctx_requests=1 if prefill else 0, num_ctx_tokens=prefill,
        num_generation_requests=decode, num_generation_tokens=decode, is_dummy=False,
    )
    return SimpleNamespace(
        num_running_reqs=running, num_waiting_reqs=waiting, num_skipped_waiting_reqs=0, kv_cache_usage=0.25,
        prefix_cache_stats=None, iteration_details=details,
    )


def _read(running: int, waiting: int, *, batch: int, pending: int) -> dict[str, Any]:
    return {
        "num_running": running, "num_waiting": waiting, "kv_blocks_free": 75, "kv_blocks_total": 100,
        "kv_blocks_reserved": 0, "pending_prefill_tokens": pending, "running_batch_tokens": batch,
        "running_tokens": [1] * running, "waiting_tokens": [],
    }


def test_steps_carry_token_figures_and_request_reads_on_membership_change() -> None:
    state = VllmEngineState(ManualClock(), on_iteration=lambda sample: None)
    state.set_capacity(100)
    state.apply(_read(2, 1, batch=600, pending=300))
    asked = state.read_request_version
    # Same requests, decode and a prefill chunk: figures move, no read is asked for.
    state.on_step(_step(2, 1, prefill=128, decode=2))
    state.on_step(_step(2, 1, decode=2))
    assert state.read_request_version == asked
    stats = state.stats(ready=True)
    assert stats.running_batch_tokens == 600 + 130 + 2
    assert stats.pending_prefill_tokens == 300 - 128
    # The waiting request is admitted: one read asked for, not one per step while the change stands.
    state.on_step(_step(3, 0, prefill=172, decode=2))
    state.on_step(_step(3, 0, decode=3))
    assert state.read_request_version == asked + 1
    assert state.stats(ready=True).pending_prefill_tokens == 0
    state.apply(_read(3, 0, batch=900, pending=0))
    assert state.stats(ready=True).running_batch_tokens == 900
    state.on_step(_step(3, 0, decode=3))
    assert state.read_request_version == asked + 1
    state.request_read()  # e.g. LENS installed new parameters
    assert state.read_request_version == asked + 2


def test_nixl_reads_set_the_pull_throughput_scaled_by_the_ranks_reading_at_once() -> None:
    state = VllmEngineState(ManualClock(), on_iteration=lambda sample: None)
    state.set_capacity(100, tensor_parallel=2)
    state.on_step(_step(1, 0, decode=1))  # no connector stats (the test double has none): nothing measured
    assert state.stats(ready=True).transfer_bytes_per_s == 0.0
    step = _step(1, 0, decode=1)
    # Two ranks' READs of one pull (vLLM's NixlKVConnectorStats payload: seconds and bytes per READ).
    step.kv_connector_stats = {"transfer_duration": [0.002, 0.002], "bytes_transferred": [2e6, 2e6],
                               "num_failed_transfers": []}
    state.on_step(step)
    assert state.stats(ready=True).transfer_bytes_per_s == 2 * 1e9
    step.kv_connector_stats = {"transfer_duration": [], "bytes_transferred": [], "num_failed_transfers": [1]}
    state.on_step(step)  # a failed transfer only: not a pull
    assert state.stats(ready=True).transfer_bytes_per_s == 2 * 1e9 and state.transfer.pulls == 2


def test_openmp_bind_list_items() -> None:
    from engine_agent.backends.vllm.backend import _core_range  # noqa: PLC0415 (vLLM itself loads lazily)

    assert list(_core_range("3")) == [3]
    assert list(_core_range("0-2")) == [0, 1, 2]
