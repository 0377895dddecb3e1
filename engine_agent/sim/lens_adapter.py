"""`SimLens`: LENS (`engine_agent.lens.LensController`) attached to one `SimEngine`.

Owns: what the simulated engine shows LENS and takes back from it: the `QueueView` built from the engine's
running and waiting sequences, the per-iteration token budget taken from a `BatchPlan`, the feedback after
each iteration (`on_iteration`, an inline `maybe_refit`: deterministic in virtual time) and after each
finished request (`on_request_finished`), the queued requests' SLOs, and the state vector (Eq. 8) cached per
engine change.
Must not: read clocks (time enters as `now_s` arguments), schedule or time iterations (that is `SimEngine`),
or run anything in threads or executors.

Semantics, mirroring the vLLM backend (`engine_agent.backends.vllm.backend`):
- The view: running sequences in scheduling order, each with the tokens it would compute now (1 for a decode,
  the uncomputed rest of the prompt for one in chunked prefill); waiting sequences FCFS ((priority, arrival)
  order, as the engine admits them) with their uncomputed tokens (prompt, or prompt + output after a
  preemption); free KV blocks; the tightest TTFT / TPOT SLO among the queued requests that carry one. Only
  the first `max_num_seqs` waiting sequences are ordered (the planner never looks further); the rest follow
  in heap order, which only sums see. Migrated requests still loading are not in the view.
- The plan: `plan.token_budget` replaces the profile's `max_batched_tokens` for that iteration (never above
  it); the sequence cap stays `max_num_seqs` (the vLLM backend, too, applies the budget only). None (no
  plan, planning off, a cold or untrusted model) keeps the static budget. With planning off no view is built:
  the schedule is exactly that of an engine without LENS.
- Feedback: each non-empty iteration is observed at its end time; a request that produced more than one
  token feeds the TTFT-TPOT line with its TTFT (arrival to first token) and TPOT.
- The state vector is computed on demand (`figures(engine, change_counter)`) and cached until the engine's
  change counter moves; `state_vector=False` reports zeros (`LensFigures()`) and skips it entirely.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from typing import TYPE_CHECKING

from engine_agent.domain import LensFigures, RequestId
from engine_agent.lens import LensConfig, LensController, PlanLimits, QueueView
from engine_agent.sim.sequence import WAITING, Seq
from switchyard.profiles import Profile

if TYPE_CHECKING:
    from engine_agent.sim.engine import IterationRecord

_ZERO = LensFigures()


def sim_lens_config(planning: bool) -> LensConfig:
    """The controller configuration the simulator uses: LENS's defaults, planning on or off."""
    return LensConfig(enabled=planning)


class SimLens:
    """LENS for one simulated engine (see the module docstring)."""

    __slots__ = ("controller", "state_vector", "_slos", "_figures", "_figures_version", "_max_seqs")

    def __init__(self, controller: LensController, *, state_vector: bool = True) -> None:
        self.controller = controller
        self.state_vector = state_vector
        self._slos: dict[RequestId, tuple[float | None, float | None]] = {}
        self._figures = _ZERO
        self._figures_version = -1
        self._max_seqs = controller.limits.max_num_seqs

    @classmethod
    def for_profile(cls, profile: Profile, *, planning: bool, state_vector: bool = True) -> SimLens:
        limits = PlanLimits(max_num_seqs=profile.max_num_seqs, max_batched_tokens=profile.max_batched_tokens,
                            block_size=profile.block_size)
        return cls(LensController(limits, sim_lens_config(planning)), state_vector=state_vector)

    @property
    def planning(self) -> bool:
        return self.controller.planning

    # -- requests --------------------------------------------------------------------------------------

    def on_request(self, request_id: RequestId, slo_ttft_s: float | None, slo_tpot_s: float | None,
                   live: Mapping[RequestId, object]) -> None:
        """A request with these SLOs was queued; `live` holds the ids of the requests the engine holds."""
        if slo_ttft_s is None and slo_tpot_s is None:
            return
        slos = self._slos
        slos[request_id] = (slo_ttft_s, slo_tpot_s)
        if len(slos) > 2 * len(live) + 64:  # forget aborted or migrated requests
            self._slos = {rid: v for rid, v in slos.items() if rid in live}

    def on_finished(self, seq: Seq, end_s: float) -> None:
        """`seq` produced its last token in the iteration ending at `end_s`."""
        if self._slos:
            self._slos.pop(seq.request_id, None)
        produced = seq.num_output
        if produced > 1 and seq.migration is None and seq.first_token_s >= 0:
            self.controller.on_request_finished(seq.first_token_s - seq.arrival_s,
                                                (end_s - seq.first_token_s) / (produced - 1), produced)

    # -- iterations ------------------------------------------------------------------------------------

    def view(self, running: list[Seq], waiting: list[tuple[int, int, Seq]], free_blocks: int) -> QueueView:
        """The scheduler's queues now (see the module docstring)."""
        run = [s.num_tokens - s.num_computed for s in running]
        k = self._max_seqs
        if len(waiting) <= k:
            head = sorted(waiting)
            rest: list[tuple[int, int, Seq]] = []
        else:
            head = heapq.nsmallest(k, waiting)
            cut = head[-1][:2]
            rest = [e for e in waiting if e[:2] > cut]
        wait = [e[2].num_tokens for e in head if e[2].state == WAITING]
        wait += [e[2].num_tokens for e in rest if e[2].state == WAITING]
        slo_ttft = slo_tpot = None
        slos = self._slos
        if slos:
            for seq in running:
                got = slos.get(seq.request_id)
                if got is not None:
                    slo_ttft, slo_tpot = _tighter(slo_ttft, got[0]), _tighter(slo_tpot, got[1])
            for entry in waiting:
                seq = entry[2]
                if seq.state == WAITING:
                    got = slos.get(seq.request_id)
                    if got is not None:
                        slo_ttft, slo_tpot = _tighter(slo_ttft, got[0]), _tighter(slo_tpot, got[1])
        return QueueView.of(run, wait, free_blocks, slo_ttft, slo_tpot)

    def budget(self, running: list[Seq], waiting: list[tuple[int, int, Seq]], free_blocks: int,
               static_budget: int, now_s: float) -> int:
        """This iteration's token budget: the plan's when LENS plans, else `static_budget`."""
        controller = self.controller
        if not controller.planning or (not running and not waiting):
            return static_budget
        plan = controller.plan(self.view(running, waiting, free_blocks), now_s)
        if plan is None:
            return static_budget
        budget = plan.token_budget
        return budget if 0 < budget < static_budget else static_budget

    def after_iteration(self, record: IterationRecord, end_s: float) -> None:
        controller = self.controller
        controller.on_iteration(record, end_s)
        controller.maybe_refit(end_s)

    # -- state vector ----------------------------------------------------------------------------------

    def figures(self, running: list[Seq], waiting: list[tuple[int, int, Seq]], free_blocks: int,
                version: int, now_s: float) -> LensFigures:
        """Eq. 8 for the engine's queues now, recomputed only when `version` (the change counter) moved."""
        if not self.state_vector:
            return _ZERO
        if version != self._figures_version:
            self._figures = self.controller.state_vector(self.view(running, waiting, free_blocks), now_s)
            self._figures_version = version
        return self._figures


def _tighter(current: float | None, new: float | None) -> float | None:
    if new is None:
        return current
    return new if current is None or new < current else current
