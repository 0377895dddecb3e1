"""The simulated GPU engine: continuous batching, chunked prefill, paged KV accounting and preemption.

Owns: `SimEngine`, one engine stepped one iteration at a time at a caller-given time (invariant I2: the sim
backend drives it in real time, the discrete-event simulator in virtual time): admission, the output length
and token ids each request draws, scheduling, preemption, aborts and stats; and what a step returns
(`StepResult`, `IterationRecord`, and with `record_batches` the iteration's `IterationBatch`).
Must not: read clocks, sleep, do I/O or know asyncio; time enters only as the `now_s` arguments and leaves as
`StepResult.duration_s`.

Scheduling follows vLLM V1: each iteration has a token budget (`max_batched_tokens`) and a sequence cap
(`max_num_seqs`). Running requests go first, in admission order, each computing its remaining uncomputed
tokens up to the budget (1 for a decoding request, a chunk for one still in prefill). A running request that
needs a KV block when none is free preempts by recompute the most recently admitted running request (itself if
it is the last): its blocks are freed, it goes back to the waiting queue with its generated tokens and
recomputes prompt + generated tokens as a prefill. When no preemption happened, waiting requests are admitted
in (priority, arrival) order with the budget left, stopping at the first that does not fit.
A request samples a token in the iteration that computes its last uncomputed token (so the first output token
comes from the iteration completing its prefill). Everything a step produces is visible at now_s + duration_s.

Migration (cutting a decoding request, resuming one cut elsewhere) is `EngineMigration`, `SimEngine`'s
base class in `engine_agent.sim.migration`; it shares the engine's state and adds no work to `step`
beyond loading queued migrants at its start.

Prefill role (CAUCHY's disaggregation, `handoff=True`): a request that samples its first output token in a
step and is not finished by it is cut in that same step (`StepResult.handoffs`, `migrate_out`'s cut: prompt
KV, one output token), so a prefill engine never decodes; the caller ends its stream with the cut after
delivering the token, and a decode engine resumes it (`add_migrated_request`). Like vLLM's prefill instance
(one token, then the KV is handed to the decode instance). Only a request's first token ever triggers it: a
request migrated in (already past its first token) decodes here as on any engine.

LENS (`engine_agent.sim.lens_adapter.SimLens`, optional): when attached, each step asks it for the iteration's
token budget (Algorithm 1's plan, never above `max_batched_tokens`) before scheduling, feeds it the
iteration record and finished requests afterwards, and `stats` carries its state vector. Without it (or with
its planning off) the schedule is unchanged.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from engine_agent.domain import (
    BackendRequest,
    EngineStats,
    FinishEvent,
    FinishReason,
    KvDelta,
    LensFigures,
    RequestId,
    SamplingSpec,
    Timings,
    Usage,
)
from engine_agent.sim.lens_adapter import SimLens
from engine_agent.sim.migration import EngineMigration, MigrationCut
from engine_agent.sim.prefix_cache import PrefixCache
from engine_agent.sim.sequence import DONE, INCOMING, RUNNING, WAITING, Seq
from engine_agent.sim.sequence import LCG_INC as _LCG_INC
from engine_agent.sim.sequence import LCG_MUL as _LCG_MUL
from engine_agent.sim.sequence import MASK64 as _MASK64
from switchyard.perf_model import PerfCoefficients, iteration_time_s
from switchyard.prefix import INDEX_SPAN_TOKENS, block_keys, is_indexed, span_of
from switchyard.profiles import Profile


@dataclass(frozen=True, slots=True)
class IterationRecord:
    """One iteration's shape and time: the sample an online latency model is fitted on."""

    start_s: float
    duration_s: float
    num_prefill_seqs: int
    num_prefill_tokens: int
    num_decode_seqs: int
    num_decode_tokens: int
    batch_context_tokens: int  # sum over scheduled sequences of (computed before + computed now)
    kv_blocks_free_after: int
    num_preempted: int


@dataclass(frozen=True, slots=True)
class IterationBatch:
    """The sequences one iteration computed, as parallel columns, in batch order (CascadeInfer's batch load,
    `engine_agent.qoe_tracker`): only from an engine built with `record_batches`."""

    request_ids: Sequence[RequestId]
    prompt_tokens: Sequence[int]  # I: the prompt (a migrated-in request's original prompt)
    current_tokens: Sequence[int]  # L: tokens in KV after the iteration (prompt + output; a chunk: its end)


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one iteration produced; the caller delivers it at `record.start_s + duration_s`."""

    duration_s: float
    tokens: tuple[tuple[RequestId, int], ...]  # one token per request that produced one, in batch order
    finished: tuple[tuple[RequestId, FinishEvent], ...]
    record: IterationRecord
    # Prefill role: requests cut after their first token in this step (their token is in `tokens`).
    handoffs: tuple[MigrationCut, ...] = ()
    batch: IterationBatch | None = None  # with `record_batches`: the sequences this iteration computed


def _batch_of(seqs: list[Seq]) -> IterationBatch:
    return IterationBatch([s.request_id for s in seqs], [s.prompt_len for s in seqs],
                          [s.num_computed for s in seqs])


def _stable_key(*parts: object) -> int:
    digest = hashlib.blake2b(":".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class SimEngine(EngineMigration):
    """A simulated GPU engine, stepped one iteration at a time (see the module docstring)."""

    __slots__ = ("_profile", "_seed", "_vocab_size", "_eos", "_excluded", "_engine_id", "_coeffs", "_seqs",
                 "_running", "_waiting", "_num_waiting", "_reserved_blocks", "_pending_prefill",
                 "_running_tokens", "_free_blocks", "_order", "_iterations", "_preempted_total",
                 "_last_iteration_s", "_changes", "_incoming", "_lens", "_handoff", "_record_batches",
                 "_cache", "_span")

    def __init__(self, profile: Profile, *, seed: int = 0, vocab_size: int = 32000, eos_token_id: int = 2,
                 special_token_ids: frozenset[int] = frozenset(), engine_id: str = "sim-0",
                 lens: SimLens | None = None, handoff: bool = False, record_batches: bool = False,
                 prefix_caching: bool = False, kv_events: bool = False) -> None:
        """`handoff`: the prefill role (see the module docstring). `record_batches`: each step's result
        carries its `IterationBatch` (one pass over the batch, ~35 us at 1,024 sequences; off by default).
        `prefix_caching`: reuse cached prompt blocks (vLLM's automatic prefix caching). Off by default: a
        caller whose token ids are placeholders, where only their count is meant to matter, would get hits
        between unrelated prompts. Callers whose ids carry content turn it on: the sim agent (real tokens)
        and the simulator's fleet (`PromptIds` make ids share exactly what the trace shares).
        `kv_events`: also key each prompt's index blocks and keep the cache's KV events for
        `drain_kv_events` (needs `prefix_caching`); off, nothing is kept for a reader that does not exist."""
        if kv_events and not prefix_caching:
            raise ValueError("kv_events needs prefix_caching")
        excluded = tuple(sorted(t for t in ({eos_token_id} | special_token_ids) if 0 <= t < vocab_size))
        if vocab_size - len(excluded) <= 0:
            raise ValueError("vocab_size leaves no token ids after excluding eos and special tokens")
        self._profile = profile
        self._seed = seed
        self._vocab_size = vocab_size
        self._eos = eos_token_id
        self._excluded = excluded
        self._engine_id = engine_id
        self._coeffs = PerfCoefficients.from_profile(profile)
        self._seqs: dict[RequestId, Seq] = {}
        self._running: list[Seq] = []
        # Heap of (priority, arrival order, seq); aborted entries are skipped when they reach the top.
        self._waiting: list[tuple[int, int, Seq]] = []
        self._num_waiting = 0
        self._reserved_blocks = 0
        self._pending_prefill = 0
        self._running_tokens = 0
        self._free_blocks = profile.kv_blocks_total
        self._order = 0
        self._iterations = 0
        self._preempted_total = 0
        self._last_iteration_s = 0.0
        self._changes = 0
        self._incoming: list[Seq] = []  # migrated requests not yet running, in arrival order
        self._lens = lens
        self._handoff = handoff
        self._record_batches = record_batches
        self._cache = PrefixCache() if prefix_caching else None
        self._span = span_of(profile.block_size) if kv_events else 0  # 0: no index keys, no events

    @property
    def handoff(self) -> bool:
        """Whether this engine hands every request off after its first token (the prefill role)."""
        return self._handoff

    @property
    def profile(self) -> Profile:
        return self._profile

    @property
    def engine_id(self) -> str:
        return self._engine_id

    @property
    def eos_token_id(self) -> int:
        return self._eos

    @property
    def lens(self) -> SimLens | None:
        """LENS attached to this engine (None: static batching and no state vector)."""
        return self._lens

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The prefix cache (None: prefix caching off)."""
        return self._cache

    def drain_kv_events(self) -> KvDelta:
        """Index blocks stored and evicted since the last call (empty without `kv_events`)."""
        return self._cache.drain() if self._cache is not None else KvDelta()

    def kv_snapshot(self) -> KvDelta:
        """Every index block cached now (none without `kv_events`), as a resync batch (`cleared` first);
        pending events are dropped."""
        return self._cache.snapshot() if self._cache is not None else KvDelta(cleared=True)

    @property
    def change_counter(self) -> int:
        return self._changes

    def has_work(self) -> bool:
        return bool(self._running) or self._num_waiting > 0

    def add_request(self, request: BackendRequest, now_s: float) -> None:
        """Queue a request arriving at `now_s`; ValueError if it can never run or its id is in use."""
        rid = request.request_id
        self._check_admissible(request, ValueError)
        sampling = request.sampling
        base = f"seed:{sampling.seed}" if sampling.seed is not None else f"id:{rid}"
        key = _stable_key(self._seed, base)
        target_len, stop = self._output_length(request, key)
        excluded, token_range = self._exclusions(rid, sampling, ValueError)
        self._order += 1
        seq = Seq(rid, len(request.prompt_token_ids), target_len, stop, request.priority, self._order, now_s,
                  key, excluded, token_range)
        if self._cache is not None:
            ids = request.prompt_token_ids
            ids = ids if isinstance(ids, tuple) else tuple(ids)
            seq.keys = block_keys(ids, self._profile.block_size)
            if self._span:
                seq.index_keys = block_keys(ids, INDEX_SPAN_TOKENS)
        self._seqs[rid] = seq
        self._enqueue(seq)
        self._changes += 1
        if self._lens is not None:
            self._lens.on_request(rid, request.slo_ttft_s, request.slo_tpot_s, self._seqs)

    def _check_admissible(self, request: BackendRequest, error: type[ValueError]) -> None:
        rid = request.request_id
        if rid in self._seqs:
            raise error(f"duplicate request id {rid!r}")
        prompt_len = len(request.prompt_token_ids)
        max_tokens = request.sampling.max_tokens
        if prompt_len <= 0 or max_tokens <= 0:
            raise error(f"request {rid!r}: prompt and max_tokens must be non-empty, got "
                        f"{prompt_len} prompt tokens and max_tokens={max_tokens}")
        target = request.target_output_tokens
        if target is not None and target < 1:
            raise error(f"request {rid!r}: target_output_tokens must be >= 1 (None: not given), got {target}")
        profile = self._profile
        if prompt_len + max_tokens > profile.max_context_tokens:
            raise error(f"request {rid!r}: prompt ({prompt_len}) + max_tokens ({max_tokens}) exceeds "
                        f"the max context of {profile.max_context_tokens} tokens")
        if math.ceil((prompt_len + max_tokens - 1) / profile.block_size) > profile.kv_blocks_total:
            raise error(f"request {rid!r}: {prompt_len + max_tokens} tokens exceed the KV capacity of "
                        f"{profile.kv_capacity_tokens} tokens")

    def _exclusions(self, rid: RequestId, sampling: SamplingSpec,
                    error: type[ValueError]) -> tuple[tuple[int, ...], int]:
        """(sorted token ids never drawn, how many ids are drawn from)."""
        excluded = self._excluded
        if sampling.stop_token_ids:
            extra = {t for t in sampling.stop_token_ids if 0 <= t < self._vocab_size}
            excluded = tuple(sorted(set(excluded) | extra))
        token_range = self._vocab_size - len(excluded)
        if token_range <= 0:
            raise error(f"request {rid!r}: stop_token_ids leave no token ids to draw")
        return excluded, token_range

    def _output_length(self, request: BackendRequest, key: int) -> tuple[int, bool]:
        """(output tokens to produce, whether the last one is EOS: finish "stop" rather than "length")."""
        sampling = request.sampling
        max_tokens = sampling.max_tokens
        if sampling.ignore_eos:
            return max_tokens, False
        if request.target_output_tokens is not None:
            target = min(request.target_output_tokens, max_tokens)
            return target, target < max_tokens
        profile = self._profile
        draw = random.Random(key).lognormvariate(profile.output_len_log_mean, profile.output_len_log_std)
        drawn = round(draw)
        low = min(max(1, sampling.min_tokens), max_tokens)
        target = min(max(drawn, low), max_tokens)
        return target, target < max_tokens

    def _enqueue(self, seq: Seq) -> None:
        """Put a request (new or preempted, holding no KV) in the waiting queue."""
        seq.state = WAITING
        seq.prefill_end = seq.num_tokens
        seq.reserved_blocks = -(-seq.num_tokens // self._profile.block_size)
        self._num_waiting += 1
        self._reserved_blocks += seq.reserved_blocks
        self._pending_prefill += seq.num_tokens
        heapq.heappush(self._waiting, (seq.priority, seq.order, seq))

    def _release(self, seq: Seq) -> None:
        """Free the KV of a running request taken off the running list; forget what it computed."""
        if seq.migration is not None and not seq.migration.recomputed:
            seq.migration.recomputed = seq.num_tokens - 1  # a preempted migrant recomputes what it loaded
        self._free_blocks += self._drop_blocks(seq)
        self._running_tokens -= seq.num_computed
        if seq.num_computed < seq.prefill_end:
            self._pending_prefill -= seq.prefill_end - seq.num_computed
        seq.num_computed = 0

    def _drop_blocks(self, seq: Seq) -> int:
        """Let go of a request's KV blocks; how many become free (its private ones, and cached ones nobody
        else holds, which stay cached until evicted)."""
        n = seq.num_blocks
        seq.num_blocks = 0
        held = seq.held
        if not held:
            return n
        seq.held = []
        seq.hashed = 0
        assert self._cache is not None
        return n - len(held) + self._cache.release(held)

    def abort(self, request_id: RequestId, now_s: float) -> FinishEvent | None:
        """Drop a request and free its KV at once; None when the id is unknown (never added or finished)."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return None
        if seq.state == RUNNING:
            self._running.remove(seq)
            self._release(seq)
        elif seq.state == INCOMING:
            self._drop_incoming(seq)
        else:  # waiting: its heap entry is skipped when it reaches the top
            self._num_waiting -= 1
            self._reserved_blocks -= seq.reserved_blocks
            self._pending_prefill -= seq.prefill_end
        seq.state = DONE
        self._changes += 1
        return FinishEvent("abort", Usage(seq.prompt_len, seq.num_output), self._timings(seq, now_s))

    def decoding_requests(self) -> tuple[list[RequestId], list[int], list[int], list[int]]:
        """Running requests past their prefill: (ids, prompt tokens, output tokens so far, output left).

        For the hidden-state tap: the engine knows each request's remaining output because it decides it.
        """
        ids: list[RequestId] = []
        prompt: list[int] = []
        generated: list[int] = []
        remaining: list[int] = []
        for seq in self._running:
            if seq.num_output and seq.num_computed >= seq.prefill_end:
                ids.append(seq.request_id)
                prompt.append(seq.prompt_len)
                generated.append(seq.num_output)
                remaining.append(seq.target_len - seq.num_output)
        return ids, prompt, generated, remaining

    @staticmethod
    def _timings(seq: Seq, end_s: float) -> Timings:
        if seq.first_scheduled_s < 0:
            return Timings(queue_s=max(0.0, end_s - seq.arrival_s))
        queue_s = seq.first_scheduled_s - seq.arrival_s
        if seq.first_token_s < 0:
            return Timings(queue_s=queue_s, prefill_s=max(0.0, end_s - seq.first_scheduled_s))
        return Timings(queue_s=queue_s, prefill_s=seq.first_token_s - seq.first_scheduled_s,
                       decode_s=max(0.0, end_s - seq.first_token_s))

    def _admit(self, now_s: float, budget: int, free_blocks: int) -> int:
        """Move the head of the waiting queue to the running list if its next chunk fits, reusing the cached
        blocks its prompt starts with; the free blocks those took (cached blocks nobody held), or -1 when
        nothing was admitted."""
        heap = self._waiting
        if len(self._running) >= self._profile.max_num_seqs:
            return -1
        while heap:
            seq = heap[0][2]
            if seq.state == WAITING:
                break
            heapq.heappop(heap)  # aborted while waiting
        else:
            return -1
        bs = self._profile.block_size
        cache = self._cache
        hits = taken = 0
        if cache is not None and seq.keys:
            # vLLM recomputes at least the prompt's last token, so a fully cached prompt gives up its last
            # block.
            hits = cache.match(seq.keys, (seq.num_tokens - 1) // bs)
            if hits:
                taken = cache.evictable_among(seq.keys, hits)
        computed = hits * bs
        left = seq.num_tokens - computed
        chunk = left if left < budget else budget
        if -(-(computed + chunk) // bs) - hits > free_blocks - taken:
            return -1
        heapq.heappop(heap)
        if cache is not None and seq.keys:
            held = seq.keys[:hits]
            cache.acquire(held)
            seq.held = held
            seq.hashed = hits
            seq.num_blocks = hits
            seq.num_computed = computed
            self._running_tokens += computed
            self._pending_prefill -= computed
            cache.queried_blocks_total += len(seq.keys)
            cache.hit_blocks_total += hits
            if seq.first_scheduled_s < 0:
                seq.cached_tokens = computed
        seq.state = RUNNING
        self._running.append(seq)
        self._num_waiting -= 1
        self._reserved_blocks -= seq.reserved_blocks
        if seq.first_scheduled_s < 0:
            seq.first_scheduled_s = now_s
        return taken

    def step(self, now_s: float) -> StepResult:
        """Schedule and run one iteration starting at `now_s`; its effects are visible at now_s + duration_s.

        One pass over the batch: running requests, then admissions (only if nothing was preempted), each
        computed as soon as it is scheduled. Blocks freed by requests finishing in this iteration become free
        after it. With nothing to run it returns a zero-duration empty result and counts no iteration.
        """
        if self._incoming:
            self._load_incoming(now_s)
        running = self._running
        bs = self._profile.block_size
        budget = self._profile.max_batched_tokens
        free = self._free_blocks
        lens = self._lens
        if lens is not None:  # LENS's plan (Algorithm 1) may lower this iteration's token budget
            budget = lens.budget(running, self._waiting, free, budget, now_s)
        eos = self._eos
        tokens: list[tuple[RequestId, int]] = []
        firsts: list[Seq] = []
        done: list[Seq] = []
        handing: list[Seq] = []
        freed = preempted = pending_done = computed_now = context_tokens = 0
        n_pre = pre_tokens = pairs = prior = n_dec = dec_sum = dec_max = 0
        i = 0
        cache = self._cache
        while budget > 0:
            if i == len(running):
                if preempted:
                    break
                taken = self._admit(now_s, budget, free)
                if taken < 0:
                    break
                free -= taken
            seq = running[i]
            i += 1
            c = seq.num_computed
            total = seq.num_tokens
            n = total - c
            if n > budget:
                n = budget
            need = (c + n + bs - 1) // bs - seq.num_blocks
            if need > 0:
                if need > free:
                    self._free_blocks = free
                    victim = seq
                    while need > self._free_blocks:  # preemption by recompute, most recently admitted first
                        victim = running.pop()
                        self._release(victim)
                        self._enqueue(victim)
                        self._preempted_total += 1
                        preempted += 1
                        if victim is seq:
                            break
                    free = self._free_blocks
                    if victim is seq:
                        break
                if cache is not None and need > free - cache.evictable:
                    cache.evict(need - (free - cache.evictable))
                free -= need
                seq.num_blocks += need
            budget -= n
            if n == 1 and seq.num_output:
                n_dec += 1
                dec_sum += c + 1
                if c >= dec_max:
                    dec_max = c + 1
            else:
                n_pre += 1
                pre_tokens += n
                pairs += n * c + n * (n + 1) // 2
                prior += c
            if c < seq.prefill_end:
                pending_done += n
            c += n
            seq.num_computed = c
            if seq.hashed < len(seq.keys) and c >= (seq.hashed + 1) * bs:
                self._register(seq, c)
            computed_now += n
            context_tokens += c
            if c != total:
                continue  # a prefill chunk that does not finish the prompt
            k = seq.num_output + 1
            seq.num_output = k
            seq.num_tokens = total + 1
            if seq.first_token_s < 0:  # its first token here (a recomputing migrant's first on this engine)
                firsts.append(seq)
            if k == seq.target_len and seq.stop_at_target:
                token = eos
            else:
                rng = (seq.rng * _LCG_MUL + _LCG_INC) & _MASK64
                seq.rng = rng
                token = (rng >> 33) % seq.token_range
                for excluded in seq.excluded:
                    if token < excluded:
                        break
                    token += 1
            tokens.append((seq.request_id, token))
            if k == 1 and self._handoff and k < seq.target_len:
                handing.append(seq)
            if k == seq.target_len:
                seq.state = DONE
                freed += self._drop_blocks(seq)
                computed_now -= c
                del self._seqs[seq.request_id]
                done.append(seq)

        self._free_blocks = free
        # The scheduled sequences are running[:i] (a preempted one was popped from the end), read before
        # handoffs release their KV.
        batch = _batch_of(running[:i]) if self._record_batches and i else None
        if not n_pre and not n_dec:
            if preempted:
                self._changes += 1
            return StepResult(0.0, (), (), IterationRecord(now_s, 0.0, 0, 0, 0, 0, 0, free, preempted))
        duration_s = iteration_time_s(self._coeffs, n_pre, pre_tokens, pairs, prior, n_dec, dec_sum, dec_max)
        end_s = now_s + duration_s
        for seq in firsts:
            seq.first_token_s = end_s
        finished: list[tuple[RequestId, FinishEvent]] = []
        if done:
            for seq in done:
                reason: FinishReason = "stop" if seq.stop_at_target else "length"
                usage = Usage(seq.prompt_len, seq.num_output, seq.cached_tokens)
                finished.append((seq.request_id, FinishEvent(reason, usage, self._timings(seq, end_s))))
                if lens is not None:
                    lens.on_finished(seq, end_s)
            self._running = [s for s in running if s.state == RUNNING]
            self._free_blocks = free = free + freed
        self._pending_prefill -= pending_done
        self._running_tokens += computed_now
        handoffs = tuple(self.migrate_out(seq.request_id, end_s) for seq in handing) if handing else ()
        if handoffs:
            free = self._free_blocks
        self._iterations += 1
        self._last_iteration_s = duration_s
        self._changes += 1
        record = IterationRecord(now_s, duration_s, n_pre, pre_tokens, n_dec, n_dec, context_tokens, free,
                                 preempted)
        if lens is not None:
            lens.after_iteration(record, end_s)
        return StepResult(duration_s, tuple(tokens), tuple(finished), record, handoffs, batch)

    def _evict_for(self, blocks: int) -> None:
        """Evict cached blocks until `blocks` free ones hold no cached prefix (the caller checked that many
        are free)."""
        cache = self._cache
        if cache is not None:
            empty = self._free_blocks - cache.evictable
            if blocks > empty:
                cache.evict(blocks - empty)

    def _register(self, seq: Seq, computed: int) -> None:
        """Cache the prompt blocks `seq` has now computed in full (a block another request cached first
        stays this request's private copy)."""
        cache = self._cache
        assert cache is not None
        keys, index_keys, span = seq.keys, seq.index_keys, self._span
        full = min(computed // self._profile.block_size, len(keys))
        for j in range(seq.hashed, full):
            end = j + 1
            index_key = (index_keys[end // span - 1]
                         if span and end % span == 0 and is_indexed(end // span - 1) else None)
            if cache.insert(keys[j], index_key):
                seq.held.append(keys[j])
        seq.hashed = full

    def stats(self, now_s: float) -> EngineStats:
        """The engine's figures after the last step (the driver overrides `draining`); with LENS attached, its
        state vector for the queues now (cached until the engine changes)."""
        lens = self._lens
        figures = (LensFigures() if lens is None
                   else lens.figures(self._running, self._waiting, self._free_blocks, self._changes, now_s))
        return EngineStats(
            timestamp_s=now_s,
            ready=True,
            draining=False,
            num_running=len(self._running),
            num_waiting=self._num_waiting,
            num_preempted_total=self._preempted_total,
            kv_blocks_total=self._profile.kv_blocks_total,
            kv_blocks_free=self._free_blocks,
            kv_blocks_reserved=self._reserved_blocks,
            pending_prefill_tokens=self._pending_prefill,
            running_batch_tokens=self._running_tokens,
            last_iteration_s=self._last_iteration_s,
            iterations_total=self._iterations,
            lens=figures,
        )
