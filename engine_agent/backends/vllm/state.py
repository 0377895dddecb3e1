"""The vLLM engine's dynamic state as the agent sees it, and the stat logger that feeds it.

Two sources: vLLM calls our stat logger in this process once per EngineCore output batch with that step's
`SchedulerStats` (queue counts, KV usage, iteration details: the samples the LENS latency model is fitted on);
the backend reads the scheduler-side figures (exact free blocks, reserved blocks, pending prefill tokens, the
per-request token view LENS plans with) with the `agent_state` utility and applies them here. That read is
asked for (`wait_for_read_request`) only when the step stats show the set of requests changed (an arrival, a
finish, a preemption) or LENS has new parameters; between reads each step's iteration details carry the
token figures forward (computed tokens join the running batch, prefill tokens leave the pending count).
Watchers are woken only on a significant change (running or waiting counts move, or free KV moves by at least
1% of the cache); the rest reaches them on the WatchState interval, as with the sim backend.

KV pull throughput (CascadeInfer, `EngineStats.transfer_bytes_per_s`): NIXL measures every READ it completes
and vLLM hands the measurements to the stat logger in `SchedulerStats.kv_connector_stats`
(`transfer_duration`, seconds, and `bytes_transferred`, one entry per READ). With the agent's NixlConnector in
pull mode every READ on this engine is a migrated-in request's pull, so each counts in a `TransferRate`. With
tensor parallelism each rank reads its own shard, one entry per rank; the ranks read at once, so the engine's
throughput is taken as the per-READ figure times the tensor-parallel size (set by `set_capacity`). Handshakes
and queueing before the READ are not in NIXL's duration.

Owns: `VllmEngineState`, `IterationSample`, `make_stat_logger`.
Must not: call into vLLM (it receives what the logger and the poller read) or read the wall clock directly.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine_agent.backends.changes import VersionSignal
from engine_agent.domain import EngineStats, LensFigures, QoEFigures
from engine_agent.transfer_rate import TransferRate
from switchyard.clock import Clock

_ITERATIONS_KEPT = 4096


@dataclass(frozen=True, slots=True)
class IterationSample:
    """One engine iteration as vLLM reported it: what the LENS latency model is fitted on."""

    timestamp_s: float
    num_prefill_seqs: int
    num_prefill_tokens: int
    num_decode_seqs: int
    num_decode_tokens: int
    elapsed_s: float

    @property
    def duration_s(self) -> float:  # the name LENS reads (`engine_agent.lens.IterationSample`)
        return self.elapsed_s


class VllmEngineState:
    """Counts, KV and iterations of one engine; `on_iteration` is called for every recorded iteration."""

    def __init__(self, clock: Clock, *, on_iteration: Callable[[IterationSample], None]) -> None:
        self._clock = clock
        self._on_iteration = on_iteration
        self._iterations: deque[IterationSample] = deque(maxlen=_ITERATIONS_KEPT)
        self._iterations_total = 0
        self._last_iteration_s = 0.0
        self._num_running = 0
        self._num_waiting = 0
        self._num_preempted = 0
        self._kv_total = 0
        self._kv_free = 0
        self._sched: dict[str, Any] = {}
        self._signal = VersionSignal()
        self._published: tuple[int, int, int] = (0, 0, -1)
        self._read_members: tuple[int, int] = (-1, -1)  # (running, waiting) at the last scheduler read
        self._read_request = VersionSignal()
        self._transfer = TransferRate()
        self._pull_ranks = 1  # tensor-parallel ranks reading a pull's shards at once
        self.lens = LensFigures()

    @property
    def iterations(self) -> tuple[IterationSample, ...]:
        return tuple(self._iterations)

    def set_capacity(self, kv_blocks_total: int, *, tensor_parallel: int = 1) -> None:
        self._kv_total = self._kv_free = kv_blocks_total
        self._pull_ranks = max(tensor_parallel, 1)
        self.publish()

    @property
    def transfer(self) -> TransferRate:
        """The per-READ throughput of this engine's KV pulls (one rank's, see the module docstring)."""
        return self._transfer

    def stats(self, *, ready: bool, qoe: QoEFigures | None = None) -> EngineStats:
        sched = self._sched
        return EngineStats(
            timestamp_s=self._clock.now(),
            ready=ready,
            draining=False,
            num_running=self._num_running,
            num_waiting=self._num_waiting,
            num_preempted_total=self._num_preempted,
            kv_blocks_total=self._kv_total,
            kv_blocks_free=self._kv_free,
            kv_blocks_reserved=int(sched.get("kv_blocks_reserved", 0)),
            pending_prefill_tokens=int(sched.get("pending_prefill_tokens", 0)),
            running_batch_tokens=int(sched.get("running_batch_tokens", 0)),
            last_iteration_s=self._last_iteration_s,
            iterations_total=self._iterations_total,
            lens=self.lens,
            qoe=qoe,
            transfer_bytes_per_s=self._transfer.bytes_per_s * self._pull_ranks,
        )

    async def wait_for_change(self, after_version: int, timeout_s: float) -> int:
        return await self._signal.wait(after_version, timeout_s)

    async def wait_for_read_request(self, after_version: int, timeout_s: float) -> int:
        """The read-request version once above `after_version` (a scheduler read is due), or at timeout."""
        return await self._read_request.wait(after_version, timeout_s)

    @property
    def read_request_version(self) -> int:
        return self._read_request.version

    def request_read(self) -> None:
        """Ask for a scheduler read now (e.g. LENS has new parameters for the engine-side planner)."""
        self._read_request.advance()

    def apply(self, state: dict[str, Any]) -> None:
        """The scheduler's own figures (the `agent_state` utility): exact, they replace the estimates."""
        self._sched = state
        self._num_running = int(state["num_running"])
        self._num_waiting = int(state["num_waiting"])
        self._read_members = (self._num_running, self._num_waiting)
        self._kv_free = int(state["kv_blocks_free"])
        self._kv_total = int(state["kv_blocks_total"]) or self._kv_total
        self.publish()

    def on_step(self, scheduler_stats: Any, iteration_stats: Any = None) -> None:
        """The stat logger's callback: one EngineCore step's stats (None on output-only batches)."""
        if scheduler_stats is not None:
            self._num_running = int(scheduler_stats.num_running_reqs)
            self._num_waiting = int(
                scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
            )
            # kv_cache_usage = 1 - free / (num_gpu_blocks - 1); free counts evictable prefix-cached blocks.
            self._kv_free = round((1.0 - float(scheduler_stats.kv_cache_usage)) * self._kv_total)
            prefix = scheduler_stats.prefix_cache_stats
            if prefix is not None:
                self._num_preempted += int(getattr(prefix, "preempted_requests", 0) or 0)
            details = scheduler_stats.iteration_details
            if details is not None and not getattr(details, "is_dummy", False):
                self._record(details)
            self._record_pulls(getattr(scheduler_stats, "kv_connector_stats", None))
            members = (self._num_running, self._num_waiting)
            if members != self._read_members:
                self._read_members = members  # asked once per change; `apply` sets the exact figures
                self._read_request.advance()
        self.publish()

    def _record(self, details: Any) -> None:
        elapsed_s = float(details.elapsed_ms) / 1000.0
        sample = IterationSample(
            timestamp_s=self._clock.now(),
            num_prefill_seqs=int(details.num_ctx_requests),
            num_prefill_tokens=int(details.num_ctx_tokens),
            num_decode_seqs=int(details.num_generation_requests),
            num_decode_tokens=int(details.num_generation_tokens),
            elapsed_s=elapsed_s,
        )
        self._iterations_total += 1
        self._last_iteration_s = elapsed_s
        sched = self._sched
        if sched:  # carry the last scheduler read forward by what this step computed
            computed = sample.num_prefill_tokens + sample.num_decode_tokens
            sched["running_batch_tokens"] = int(sched["running_batch_tokens"]) + computed
            pending = int(sched["pending_prefill_tokens"]) - sample.num_prefill_tokens
            sched["pending_prefill_tokens"] = max(pending, 0)
        self._iterations.append(sample)
        self._on_iteration(sample)

    def _record_pulls(self, connector_stats: Any) -> None:
        """NIXL's READs completed since the last step (module docstring); nothing without a connector."""
        if not isinstance(connector_stats, dict):
            return
        durations = connector_stats.get("transfer_duration")
        sizes = connector_stats.get("bytes_transferred")
        if not durations or not sizes or len(durations) != len(sizes):
            return
        for seconds, kv_bytes in zip(durations, sizes, strict=True):
            self._transfer.observe(float(kv_bytes), float(seconds))

    def publish(self) -> None:
        """Advance the visible version on a significant change and wake `wait_for_change`."""
        key = (self._num_running, self._num_waiting, self._kv_free // max(self._kv_total // 100, 1))
        if key == self._published:
            return
        self._published = key
        self._signal.advance()


def make_stat_logger(on_step: Callable[[Any, Any], None], vllm_config: Any, engine_index: int) -> Any:
    """A vLLM `StatLoggerBase` that hands every step's stats to `on_step` (vLLM imported only here)."""
    from vllm.v1.metrics.loggers import StatLoggerBase  # noqa: PLC0415

    class AgentStatLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(
            self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
        ) -> None:
            on_step(scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            pass

    return AgentStatLogger(vllm_config, engine_index)
