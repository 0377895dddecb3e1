"""Migrating a request off and onto a simulated engine: `MigrationCut` and `SimEngine`'s cut / resume half.

Owns: `MigrationCut` (what another engine needs to continue a request exactly) and `EngineMigration`, the part
of `SimEngine` (its base class, sharing its state) that cuts a decoding request (`migrate_out`), checks and
queues a resumed one (`check_migrated_request`, `add_migrated_request`), gives queued migrants blocks and
starts the loaded ones at a step's start (`_load_incoming`), drops an aborted one (`_drop_incoming`) and
reports how their KV arrives (`next_ready_s`, `migration_stats`).
Must not: schedule or run iterations (that is `SimEngine.step` in `engine_agent.sim.engine`), encode tickets
(that is `engine_agent.sim.ticket`), read clocks, sleep, do I/O or know asyncio.

Migration (STAR, CascadeInfer): `migrate_out` cuts a decoding request at a token boundary and returns its
`MigrationCut` (output count, the LCG state its tokens come from, its decided output length, the KV it holds:
prompt + generated - 1 tokens, the last sampled token has no KV yet, as in vLLM). The sim frees the request's
blocks at the cut rather than holding them until the target has pulled them: the source gets its room back
one transfer time early, which we accept to keep the engine free of timers. `add_migrated_request` resumes a
cut on another engine: the request queues (first come, first served, ahead of waiting requests) until
ceil(kv_tokens / block_size) blocks are free, allocates them, is loaded `transfer_s` later (a modelled pull,
no recompute) and then decodes like any running request, computing only its last sampled token first. With the
LCG state carried, the continuation is the token stream the request would have produced unmigrated.

Resuming without KV (`kv_tokens` 0: the gateway's "recompute anywhere", or its re-ticket after a target died
mid-stream): the cut may carry `after_cut`, output tokens produced after its generator state (what the failed
target streamed and the gateway relayed). The engine replays the generator over them and refuses the cut when
a replayed token differs (the faithfulness check: the continuation would not be the request's own). The
request then queues like a preempted one: one prefill of prompt + every output token (the performance model
times it), after which it samples its next token and decodes on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine_agent.domain import BackendRequest, MigrationRefused, MigrationStats, RequestId
from engine_agent.sim.sequence import (
    DONE,
    INCOMING,
    RUNNING,
    WAITING,
    MigrationLoad,
    Seq,
    draw_token,
)

if TYPE_CHECKING:
    from engine_agent.domain import SamplingSpec
    from switchyard.profiles import Profile


@dataclass(frozen=True, slots=True)
class MigrationCut:
    """A decoding request cut at a token boundary: what another engine needs to continue it exactly."""

    request_id: RequestId
    prompt_len: int
    num_output: int  # output tokens produced so far, on every engine the request ran on
    target_len: int  # the output length the engine decided for the request (its last token may be EOS)
    stop_at_target: bool  # the last token is EOS (finish "stop") rather than the max_tokens limit ("length")
    lcg_state: int  # the per-request token generator's state after the last produced token
    kv_tokens: int  # prompt_len + num_output - 1: the last sampled token has no KV yet
    kv_bytes: int  # kv_tokens x the model's KV bytes per token (whole tensor-parallel group)
    # Without KV (kv_tokens 0) only: output tokens produced after `lcg_state` (a re-ticket), replayed and
    # checked on resume; `num_output` does not count them.
    after_cut: tuple[int, ...] = ()

    @property
    def recompute(self) -> bool:
        """The cut carries no KV: the engine that resumes it recomputes prompt and output."""
        return self.kv_tokens == 0


class EngineMigration:
    """`SimEngine`'s migration methods (see the module docstring); holds no state of its own."""

    if not TYPE_CHECKING:  # no state of its own; hidden from mypy, which would check the annotations below
        __slots__ = ()  # against this empty tuple instead of `SimEngine`'s slots

    if TYPE_CHECKING:  # the `SimEngine` state and helpers these methods share (its __slots__ and methods)
        _profile: Profile
        _seqs: dict[RequestId, Seq]
        _running: list[Seq]
        _incoming: list[Seq]
        _num_waiting: int
        _reserved_blocks: int
        _running_tokens: int
        _free_blocks: int
        _order: int
        _changes: int

        def _check_admissible(self, request: BackendRequest, error: type[ValueError]) -> None: ...

        def _exclusions(self, rid: RequestId, sampling: SamplingSpec,
                        error: type[ValueError]) -> tuple[tuple[int, ...], int]: ...

        def _release(self, seq: Seq) -> None: ...

        def _evict_for(self, blocks: int) -> None: ...

        def _enqueue(self, seq: Seq) -> None: ...

    def migrate_out(self, request_id: RequestId, now_s: float) -> MigrationCut:
        """Cut a decoding request after the last token it produced and free its KV at once.

        Everything a step has produced counts, including a step whose output the caller has not delivered yet:
        the caller delivers it and then ends the request's stream. Raises `MigrationRefused` for unknown or
        finished ids and for requests that hold no complete KV to move (waiting, preempted, in prefill, still
        loading a migrated KV). The cut is instantaneous in the model: `now_s` is its time for the caller's
        record and changes nothing here.
        """
        seq = self._seqs.get(request_id)
        if seq is None:
            raise MigrationRefused(f"request {request_id!r} is not on this engine (unknown or finished)")
        if seq.state == INCOMING:
            raise MigrationRefused(f"request {request_id!r} is still loading its migrated KV")
        if seq.state == WAITING:
            what = "preempted and waiting to recompute" if seq.num_output else "waiting for its prefill"
            raise MigrationRefused(f"request {request_id!r} is {what}: it holds no KV to move")
        if seq.num_output == 0 or seq.num_computed < seq.prefill_end:
            raise MigrationRefused(f"request {request_id!r} is in prefill: its KV is not complete yet")
        kv_tokens = seq.num_tokens - 1
        assert seq.num_computed == kv_tokens, (seq.num_computed, kv_tokens)
        cut = MigrationCut(
            request_id=request_id,
            prompt_len=seq.prompt_len,
            num_output=seq.num_output,
            target_len=seq.target_len,
            stop_at_target=seq.stop_at_target,
            lcg_state=seq.rng,
            kv_tokens=kv_tokens,
            kv_bytes=kv_tokens * self._profile.model.kv_bytes_per_token,
        )
        del self._seqs[request_id]
        self._running.remove(seq)
        self._release(seq)
        seq.state = DONE
        self._changes += 1
        return cut

    def add_migrated_request(self, request: BackendRequest, cut: MigrationCut, now_s: float,
                             transfer_s: float) -> None:
        """Resume a request cut on another engine (see the module docstring).

        `request` is the original request (prompt, sampling) under this engine's id for it; `transfer_s` is
        the modelled KV pull, counted from when this engine has allocated the blocks. Raises
        `MigrationRefused` when the cut cannot continue here (`check_migrated_request`).
        """
        excluded, token_range = self.check_migrated_request(request, cut, transfer_s)
        rid = request.request_id
        prompt_len = len(request.prompt_token_ids)
        self._order += 1
        if cut.recompute:
            rng = self._replay(request, cut, excluded, token_range)
            seq = Seq(rid, prompt_len, cut.target_len, cut.stop_at_target, request.priority, self._order,
                      now_s, rng, excluded, token_range)
            seq.num_output = cut.num_output + len(cut.after_cut)
            seq.num_tokens = prompt_len + seq.num_output
            seq.migration = MigrationLoad(0, 0, 0.0)
            seq.migration.ready_s = now_s
            seq.migration.recomputed = seq.num_tokens - 1
            self._seqs[rid] = seq
            self._enqueue(seq)  # like a preempted request: one prefill of prompt + output, then decode
            self._changes += 1
            return
        seq = Seq(rid, prompt_len, cut.target_len, cut.stop_at_target, request.priority, self._order, now_s,
                  cut.lcg_state, excluded, token_range)
        seq.state = INCOMING
        seq.num_output = cut.num_output
        seq.num_tokens = prompt_len + cut.num_output
        seq.prefill_end = cut.kv_tokens  # nothing to prefill: only the last sampled token is computed
        seq.reserved_blocks = -(-cut.kv_tokens // self._profile.block_size)
        seq.migration = MigrationLoad(cut.kv_tokens, cut.kv_tokens * self._profile.model.kv_bytes_per_token,
                                      transfer_s)
        self._seqs[rid] = seq
        self._incoming.append(seq)
        self._num_waiting += 1
        self._reserved_blocks += seq.reserved_blocks
        self._load_incoming(now_s)
        self._changes += 1

    def check_migrated_request(self, request: BackendRequest, cut: MigrationCut,
                               transfer_s: float) -> tuple[tuple[int, ...], int]:
        """Raise `MigrationRefused` unless `add_migrated_request` would accept the cut (changes nothing)."""
        rid = request.request_id
        self._check_admissible(request, MigrationRefused)
        prompt_len = len(request.prompt_token_ids)
        output = cut.num_output + len(cut.after_cut)
        if cut.after_cut and not cut.recompute:
            raise MigrationRefused(f"request {rid!r}: a cut that carries KV cannot carry output tokens after "
                                   f"it")
        if cut.prompt_len != prompt_len or (
            not cut.recompute and cut.kv_tokens != prompt_len + cut.num_output - 1
        ):
            raise MigrationRefused(f"request {rid!r}: the cut does not match the request ({cut.prompt_len} "
                                   f"prompt and {cut.kv_tokens} KV tokens for a {prompt_len}-token prompt "
                                   f"with {cut.num_output} output tokens)")
        if not 0 < output < cut.target_len <= request.sampling.max_tokens:
            raise MigrationRefused(f"request {rid!r}: nothing left to produce ({output} of "
                                   f"{cut.target_len} output tokens, "
                                   f"max_tokens {request.sampling.max_tokens})")
        if not transfer_s >= 0:
            raise MigrationRefused(f"request {rid!r}: invalid transfer time {transfer_s}")
        excluded, token_range = self._exclusions(rid, request.sampling, MigrationRefused)
        if cut.after_cut:
            self._replay(request, cut, excluded, token_range)
        return excluded, token_range

    def _replay(self, request: BackendRequest, cut: MigrationCut, excluded: tuple[int, ...],
                token_range: int) -> int:
        """The generator state after `cut.after_cut`; `MigrationRefused` when a token differs from what the
        request's generator draws there (the cut would not continue the request's own stream)."""
        rng = cut.lcg_state
        for i, token in enumerate(cut.after_cut):
            rng, expected = draw_token(rng, token_range, excluded)  # never EOS: output < target_len
            if token != expected:
                raise MigrationRefused(
                    f"request {request.request_id!r}: output token {cut.num_output + i + 1} of the ticket "
                    f"({token}) is not the one this request's generator draws ({expected}); resuming would "
                    f"not continue its own stream")
        return rng

    def _load_incoming(self, now_s: float) -> None:
        """Allocate blocks for migrated requests in arrival order; start the ready ones (a step's start)."""
        cap = self._profile.max_num_seqs
        moved = False
        for seq in list(self._incoming):
            migration = seq.migration
            assert migration is not None
            if migration.ready_s < 0:
                if seq.reserved_blocks > self._free_blocks:
                    break  # first come, first served: later arrivals wait too
                self._evict_for(seq.reserved_blocks)
                self._free_blocks -= seq.reserved_blocks
                self._reserved_blocks -= seq.reserved_blocks
                seq.num_blocks, seq.reserved_blocks = seq.reserved_blocks, 0
                migration.ready_s = now_s + migration.transfer_s
                moved = True
            if migration.ready_s > now_s or len(self._running) >= cap:
                continue
            self._incoming.remove(seq)
            self._num_waiting -= 1
            seq.state = RUNNING
            seq.num_computed = migration.kv_tokens
            # Timings on this engine: queue_s covers the wait for blocks and the transfer, then decode.
            seq.first_scheduled_s = seq.first_token_s = now_s
            self._running_tokens += migration.kv_tokens
            self._running.append(seq)
            moved = True
        if moved:
            self._changes += 1

    def _drop_incoming(self, seq: Seq) -> None:
        self._incoming.remove(seq)
        self._num_waiting -= 1
        self._reserved_blocks -= seq.reserved_blocks
        self._free_blocks += seq.num_blocks
        seq.num_blocks = seq.reserved_blocks = 0

    def next_ready_s(self) -> float | None:
        """When the earliest loading migrated request becomes schedulable (None: none is loading).

        A driver whose step came back empty sleeps until then instead of polling.
        """
        ready = [s.migration.ready_s for s in self._incoming if s.migration is not None
                 and s.migration.ready_s >= 0]
        return min(ready) if ready else None

    def migration_stats(self, request_id: RequestId) -> MigrationStats | None:
        """How a migrated request's KV arrived (None: unknown, not migrated, or no blocks allocated yet)."""
        seq = self._seqs.get(request_id)
        migration = seq.migration if seq is not None else None
        if migration is None or migration.ready_s < 0:
            return None
        return MigrationStats(kv_tokens_loaded=migration.kv_tokens, kv_tokens_recomputed=migration.recomputed,
                              kv_bytes_transferred=migration.kv_bytes, transfer_s=migration.transfer_s)
