"""Code that runs inside vLLM's own processes: the EngineCore (scheduler) and the model workers.

vLLM's `AsyncLLM` always runs its EngineCore (scheduler, KV manager, executor) in a separate process, so the
agent reaches it through three hooks vLLM provides, all loaded by qualified name in that process:

- `AgentScheduler` / `AgentAsyncScheduler` (`scheduler_cls`): vLLM's scheduler with a per-iteration token
  budget planned by LENS from the latency model the agent pushes (none pushed = vLLM's own budget), each
  scheduled batch's load for CascadeInfer's QoE fit, and the methods below. Importing this module also
  attaches the agent's utility methods to `EngineCore`, which
  `AsyncLLM.engine_core.call_utility_async(name, ...)` calls between engine steps.
- `HiddenStateTap` (`worker_extension_cls`): wraps the model's `compute_logits` so every k-th sampling step
  copies the post-final-norm last-token rows of the batch to host memory; the agent drains them with
  `collective_rpc("agent_tap_drain")`.

Owns: the engine-side halves of engine state (queue lengths, pending prefill tokens, free / reserved KV
blocks), the per-iteration budget, the batch loads of CascadeInfer's QoE fit (every scheduled batch's
F = (1, n, ΣI, ΣI², ΣL) added to its requests' loads, `engine_agent.qoe_tracker.BatchLoads`; a finished
request's lifetime-average F handed to the agent by the next `agent_state` read, which pairs it with the
latency it measured), the migration cut (finish-then-pull over NixlConnector's bidirectional mode) and
forgetting a migrated-in request's transfer params, the hidden-state tap, and the prefix-cache events: with
`kv_events_config.enable_kv_cache_events` on, the scheduler's KV-event publisher is replaced by one that
feeds `kv_events.IndexKeyMapper` in this process, and each `agent_state` read hands over the index keys
stored and removed since the previous read.
Must not: import anything from the agent but this module, the pure `engine_agent.lens` planner, the pure
`engine_agent.qoe_tracker` and the pure `kv_events` mapper (it loads in vLLM's processes), block the engine
loop, or keep references to finished requests.

Batch loads: after each `schedule()`, the batch is `SchedulerOutput.num_scheduled_tokens`' requests (prefill
chunks and decodes), I = `num_prompt_tokens` (a migrated-in request's prompt holds its earlier output: vLLM
resumes it as prompt + output) and L = `num_computed_tokens`, which `schedule()` has already advanced by the
step (the tokens in KV after it). Requests in `SchedulerOutput.finished_req_ids` (finished or aborted since
the previous schedule) have their loads moved to a bounded hand-over dict that `agent_state` empties.
Cost per `schedule()` (`benchmarks/qoe_tracker_cost.py`, this repository's 2-core machine, stand-in request
objects): 50 us at 256 scheduled requests, 175 us at 1,024 (a Python pass over the batch, then the tracker's
numpy update).

Private vLLM attributes touched here (version-checked by the vLLM test module): `Scheduler.connector.
connector_scheduler._reqs_in_batch` (so the NIXL worker tracks the cut request and honours the hold), and
`Request.max_tokens` (the cut).
"""

from __future__ import annotations

import os
from collections import deque
from typing import Any

import numpy as np
from vllm.distributed.kv_events import EventBatch, EventPublisher
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCore
from vllm.v1.request import RequestStatus

from engine_agent.backends.vllm.kv_events import IndexKeyMapper
from engine_agent.lens.perf_model import LatencyParams
from engine_agent.lens.planner import PlanLimits, QueueView, plan_batch
from engine_agent.qoe_tracker import BatchLoads

MIGRATE_OUT_MARKER = "agent_migrate_out"
# Finished requests' loads kept for the agent between two `agent_state` reads (it reads at least every second;
# past this the oldest are dropped: the agent stopped reading).
_FINISHED_LOADS_KEPT = 65536


class _MapperPublisher(EventPublisher):  # type: ignore[misc]
    """vLLM's KV-event publisher interface, in process: each step's batch goes to the index-key mapper, which
    the agent's `agent_state` reads drain (no socket, no thread: vLLM's ZMQ publisher would add both)."""

    def __init__(self, mapper: IndexKeyMapper) -> None:
        super().__init__()
        self._mapper = mapper

    def publish(self, events: EventBatch) -> None:
        self._mapper.feed(events.events)

    def shutdown(self) -> None:
        pass


class _AgentSchedulerMixin:
    """Adds the agent's LENS budget and read-outs to vLLM's scheduler (mixed into both scheduler kinds)."""

    # LENS (Algorithm 1) runs here, before every schedule(), with the latency model the agent fits and pushes:
    # (params, target latency, limits); None = vLLM's static budget.
    agent_lens: tuple[LatencyParams, float, PlanLimits] | None = None
    # CascadeInfer's batch loads (per instance, made at the first schedule) and the finished ones' mean F.
    agent_loads: BatchLoads | None = None
    agent_finished_loads: dict[str, tuple[float, ...]] | None = None
    # Prefix-cache events as the gateway's index keys (`kv_events`), when vLLM's KV events are on.
    agent_kv: IndexKeyMapper | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        if getattr(self, "enable_kv_cache_events", False):
            self.agent_kv = IndexKeyMapper(self.block_size)  # type: ignore[attr-defined]
            self.kv_event_publisher = _MapperPublisher(self.agent_kv)  # replaces vLLM's (null) publisher

    def _agent_todo(self) -> tuple[list[int], list[int]]:
        """Tokens each running request would compute now (>= 1) and each waiting one still needs, FCFS."""
        running = [max(r.num_tokens - r.num_computed_tokens, 1) for r in self.running]  # type: ignore[attr-defined]
        waiting = [max(r.num_tokens - r.num_computed_tokens, 0) for r in self.waiting]  # type: ignore[attr-defined]
        return running, waiting

    def _agent_queue_view(self) -> QueueView:
        running, waiting = self._agent_todo()
        free = self.kv_cache_manager.block_pool.get_num_free_blocks()  # type: ignore[attr-defined]
        return QueueView(np.asarray(running, dtype=np.int64), np.asarray(waiting, dtype=np.int64), int(free))

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        lens = self.agent_lens
        plan = None
        if lens is not None:
            params, target_s, limits = lens
            plan = plan_batch(self._agent_queue_view(), limits, params, target_s)
        if plan is None:
            output = super().schedule(*args, **kwargs)  # type: ignore[misc]
        else:
            configured = self.max_num_scheduled_tokens  # type: ignore[attr-defined]
            self.max_num_scheduled_tokens = max(1, min(plan.token_budget, configured))
            try:
                output = super().schedule(*args, **kwargs)  # type: ignore[misc]
            finally:
                self.max_num_scheduled_tokens = configured
        self._agent_record_loads(output)
        return output

    def _agent_record_loads(self, output: Any) -> None:
        """The scheduled batch's F to its requests' loads; finished requests' loads to the hand-over dict."""
        loads, finished = self.agent_loads, self.agent_finished_loads
        if loads is None or finished is None:
            loads, finished = self.agent_loads, self.agent_finished_loads = BatchLoads(), {}
        scheduled = output.num_scheduled_tokens
        if scheduled:
            requests = self.requests  # type: ignore[attr-defined]
            ids = list(scheduled)
            members = [requests[rid] for rid in ids]
            loads.add_batch(ids, [r.num_prompt_tokens for r in members],
                            [r.num_computed_tokens for r in members])
        for rid in output.finished_req_ids:
            mean = loads.pop(rid)
            if mean is not None:
                finished[rid] = mean
                if len(finished) > _FINISHED_LOADS_KEPT:
                    del finished[next(iter(finished))]

    def agent_take_finished_loads(self) -> dict[str, tuple[float, ...]]:
        """Request id -> lifetime-average F of the requests finished (or aborted) since the last call."""
        finished = self.agent_finished_loads
        if not finished:
            return {}
        self.agent_finished_loads = {}
        return finished

    def agent_state(self, lens: dict[str, Any] | None = None) -> dict[str, Any]:
        """The scheduler's figures; `lens` (when given) updates the LENS plan inputs first."""
        if lens is not None:
            params = lens.get("params")
            self.agent_lens = (
                None
                if params is None
                else (
                    LatencyParams(*params),
                    float(lens["target_s"]),
                    PlanLimits(
                        int(lens["max_num_seqs"]), int(lens["max_batched_tokens"]), int(lens["block_size"])
                    ),
                )
            )
        running = self.running  # type: ignore[attr-defined]
        block_pool = self.kv_cache_manager.block_pool  # type: ignore[attr-defined]
        block_size = self.block_size  # type: ignore[attr-defined]
        run_todo, wait_todo = self._agent_todo()
        prompt_left = sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in running)
        return {
            "num_running": len(run_todo),
            "num_waiting": len(wait_todo),
            "kv_blocks_free": int(block_pool.get_num_free_blocks()),
            "kv_blocks_total": int(block_pool.num_gpu_blocks) - 1,  # block 0 is vLLM's null block
            "kv_blocks_reserved": sum(-(-t // block_size) for t in wait_todo),
            "pending_prefill_tokens": prompt_left + sum(wait_todo),
            "running_batch_tokens": sum(r.num_computed_tokens for r in running),
            "running_tokens": run_todo,
            "waiting_tokens": wait_todo,
            "qoe_loads": self.agent_take_finished_loads(),
            "kv_events": None if self.agent_kv is None else self.agent_kv.drain(),
        }

    def agent_cut(self, request_id: str) -> dict[str, Any]:
        """Make a running request finish after its next token with its KV held and exported.

        The request then ends with FINISHED_LENGTH_CAPPED; NixlConnector's bidirectional mode treats it as a
        decode-side request, holds its blocks (for `decoder_kv_blocks_ttl`) and returns
        `kv_transfer_params` on its last output. Answers {"error": reason} when it cannot.
        """
        req = self.requests.get(request_id)  # type: ignore[attr-defined]
        if req is None or req.is_finished():
            return {"error": "request is not on this engine (finished or unknown)"}
        if req.status != RequestStatus.RUNNING:
            return {
                "error": f"request is not running (status {req.status.name}); only decoding requests move"
            }
        if req.num_computed_tokens < req.num_prompt_tokens or req.num_output_tokens == 0:
            return {"error": "request is still in prefill; only decoding requests move"}
        connector = self.connector  # type: ignore[attr-defined]
        if connector is None or getattr(connector, "connector_scheduler", None) is None:
            return {"error": "this engine has no KV connector (migration is off)"}
        if req.kv_transfer_params:
            return {"error": "request already carries KV transfer state (a migration is in progress)"}
        if req.max_tokens <= req.num_output_tokens + 1:
            return {"error": "request is about to finish (no tokens left to move)"}
        req.kv_transfer_params = {MIGRATE_OUT_MARKER: True}
        connector.connector_scheduler._reqs_in_batch.add(request_id)
        req.max_tokens = req.num_output_tokens + 1
        return {"num_output_tokens": req.num_output_tokens, "num_computed_tokens": req.num_computed_tokens}

    def agent_forget_transfer(self, request_id: str) -> bool:
        """A migrated-in request whose KV has loaded: free its blocks at finish instead of holding them."""
        req = self.requests.get(request_id)  # type: ignore[attr-defined]
        if req is None:
            return False
        req.kv_transfer_params = None
        return True


class AgentScheduler(_AgentSchedulerMixin, Scheduler):
    """vLLM's synchronous scheduler with the agent's hooks (the CPU platform forces this one)."""


class AgentAsyncScheduler(_AgentSchedulerMixin, AsyncScheduler):
    """vLLM's async scheduler with the agent's hooks (the GPU default)."""


def _engine_state(self: EngineCore, lens: dict[str, Any] | None = None) -> dict[str, Any]:
    return self.scheduler.agent_state(lens)  # type: ignore[attr-defined]


def _engine_cut(self: EngineCore, request_id: str) -> dict[str, Any]:
    return self.scheduler.agent_cut(request_id)  # type: ignore[attr-defined]


def _engine_forget_transfer(self: EngineCore, request_id: str) -> bool:
    return self.scheduler.agent_forget_transfer(request_id)  # type: ignore[attr-defined]


EngineCore.agent_state = _engine_state  # type: ignore[attr-defined]
EngineCore.agent_cut = _engine_cut  # type: ignore[attr-defined]
EngineCore.agent_forget_transfer = _engine_forget_transfer  # type: ignore[attr-defined]


class HiddenStateTap:
    """Worker extension: every k-th sampling step, the last-token post-final-norm hidden state per request.

    vLLM adds this class to the worker's bases (`worker_extension_cls`), so `self.model_runner` is the
    worker's model runner. The wrapper sits on `model.compute_logits`, which receives exactly the rows vLLM
    samples from (one per request, in `input_batch.req_ids` order, without speculative decoding); calls of
    another shape (prompt logprobs, dummy runs) are not counted. The model forward itself runs under
    torch.compile / CUDA graphs, so hooks inside it would not fire on replay; the sampling step is eager. Only
    rank 0 records (every tensor-parallel rank holds the full post-norm state).
    """

    def agent_release_held(self, request_id: str) -> bool:
        """Expire the send lease NixlConnector keeps for a cut request's KV (`decoder_kv_blocks_ttl`), so the
        next `get_finished` reports it sent and the scheduler frees the blocks; False when this worker holds
        no lease for it (not yet told of it, already pulled, or no connector)."""
        from vllm.distributed.kv_transfer import (  # noqa: PLC0415 (a worker process)
            get_kv_transfer_group,
            has_kv_transfer_group,
        )

        if not has_kv_transfer_group():
            return False
        leases = getattr(getattr(get_kv_transfer_group(), "connector_worker", None), "_reqs_to_send", None)
        if not isinstance(leases, dict) or request_id not in leases:
            return False
        leases[request_id] = float("-inf")
        return True

    def agent_tap_install(self, interval: int, max_batches: int = 64) -> bool:
        runner = self.model_runner  # type: ignore[attr-defined]
        model = runner.model
        if getattr(model, "_agent_tap_installed", False) or interval <= 0:
            return False
        rank = getattr(self, "rank", 0)
        batches: deque[tuple[int, list[str], list[int], Any]] = deque(maxlen=max_batches)
        self._agent_tap_batches = batches
        original = model.compute_logits
        state = {"step": 0}

        def compute_logits(hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
            input_batch = runner.input_batch
            if hidden_states.shape[0] == input_batch.num_reqs and input_batch.num_reqs > 0:
                state["step"] += 1
                if rank == 0 and state["step"] % interval == 0:
                    n = input_batch.num_reqs
                    req_ids = list(input_batch.req_ids[:n])
                    generated = (
                        input_batch.num_tokens_no_spec[:n] - input_batch.num_prompt_tokens[:n]
                    ).tolist()
                    rows = hidden_states.detach().to("cpu", dtype=_float32(), non_blocking=True)
                    batches.append((state["step"], req_ids, generated, rows))
            return original(hidden_states, *args, **kwargs)

        model.compute_logits = compute_logits
        model._agent_tap_installed = True
        return True

    def agent_pin_compute_thread(self, cores: list[int]) -> list[int]:
        """Bind the calling thread (the worker's main thread, OpenMP's master: it runs the model) to `cores`;
        returns its affinity afterwards. NIXL's worker moved it to the last core when it was built (see
        `platform.default_omp_bind`), where the EngineCore loop, the agent and the gateway run too; NIXL's own
        threads, born during that move, stay there."""
        os.sched_setaffinity(0, set(cores))
        return sorted(os.sched_getaffinity(0))

    def agent_tap_drain(self) -> list[tuple[int, list[str], list[int], bytes, int]]:
        """Batches since the last drain: (step, request ids, generated counts, float32 rows, width)."""
        batches = getattr(self, "_agent_tap_batches", None)
        out: list[tuple[int, list[str], list[int], bytes, int]] = []
        while batches:
            step, req_ids, generated, rows = batches.popleft()
            array = rows.numpy()
            out.append((step, req_ids, generated, array.tobytes(), int(array.shape[1])))
        return out


def _float32() -> Any:
    import torch  # noqa: PLC0415 - torch is vLLM's dependency; imported where the worker already has it

    return torch.float32
