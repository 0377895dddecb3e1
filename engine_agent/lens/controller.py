"""`LensController`: LENS for one engine, gluing the online model, the adaptive target and Algorithm 1.

Owns: what an engine backend calls around its scheduler: `on_iteration` (feed the model),
`on_request_finished` (feed the target), `plan` (the next iteration's token budget, or None for the backend's
default), the refit policy (`take_refit_job` / `install_refit`, or `maybe_refit` inline) and `state_vector`
(Eq. 8, `LensFigures`).
Must not: read clocks (every method that needs time takes `now_s`), start threads or tasks, or touch a
backend: the caller decides whether a refit runs inline (the simulator: deterministic) or in an executor (a
real-time agent: `job = take_refit_job(now_s)`, `install_refit(await loop.run_in_executor(None, job))`).

Choices:
- B and S of an iteration record: B = prefill sequences + decode sequences, S = prefill tokens + decode tokens
  (every token computed in the iteration); empty iterations are not observed.
- Refit policy: a job is due once `refit_every_observations` iterations have been observed since the last one,
  or `refit_interval_s` has passed with at least one new observation; never two at once. Each job runs the
  short-window linear refit and, when `LatencyModel.structural_due`, the long-window structural fit first.
- Cold start and trust: `plan` returns None (the backend's default batching) until the model is `ready`, and
  whenever its recent a-priori error ratio exceeds `plan_max_error_ratio` (25%): the first samples come from
  the default schedule rather than from a planner driven by an unfitted model, and a model that stopped
  predicting (a drift it has not caught up with yet) degrades to the default batching instead of steering.
- SLOs: the tightest TTFT / TPOT SLO among the queued requests (`QueueView.slo_*_s`), else the configured
  defaults (Algorithm 1, line 7: TargetLatency(Q_wait u Q_run, SLOs)).
- Eq. 8 (`state_vector`):
  L-hat: Predict of the batch the engine would run next: Algorithm 1's plan when LENS plans, else the greedy
  batch under the static limits (Q_max, M_max). W (tokens): pending prefill (running sequences needing more
  than one token + every waiting sequence's uncomputed tokens) + expected decode: L-bar per waiting or
  prefilling request, L-bar / 2 per decoding request (on average half way through its output). M_free: free KV
  blocks minus ceil((uncomputed tokens + L-bar) / block_size) per waiting request, floored at 0. P_max: the
  throughput the model predicts for a full iteration (`planner.peak_tokens_per_s`: M_max tokens over the
  fastest batch size), not Eq. 2's Pmax parameter, which a fit can move by orders of magnitude without
  changing a prediction (issue 17: 9.7e8 tokens/s on a simulated A6000 pair, which drew PRISM's traffic).
  Until the model is ready, L-hat and P_max are reported as 0 (unknown); W, M_free, the a-priori error ratio
  and the SLO risk are always filled. Prefill rate (while LENS plans, else 0): measured, the prefill tokens
  computed per second over the last `prefill_window` planned iterations that began with prefill pending
  (waiting requests or a chunked prefill), once there are `prefill_min_samples` of them; before that, the plan
  for the queue with one more request waiting (a prompt of M_max tokens), its prefill tokens (the budget less
  one token per decoding sequence, at least 1) over its predicted latency. Under a TTFT-bound target the plans
  can leave prefill a small fraction of P_max, down to nothing while a decode-only batch already comes within
  eps of the target (issue 17: an H100 planned to 8 ms iterations prefilled at a median 125 tokens/s with
  requests waiting, against a P_max of 42,000), so a router pricing TTFT needs the measured figure.
- `enabled` = False (ablation: static budget) turns planning off only; the model keeps learning and the state
  vector keeps being computed.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from engine_agent.domain import LensFigures
from engine_agent.lens.perf_model import FitOutcome, LatencyModel, LatencyModelConfig, predict_scalar
from engine_agent.lens.planner import (
    BatchPlan,
    PlanLimits,
    QueueView,
    allocate,
    peak_tokens_per_s,
    plan_batch,
)
from engine_agent.lens.target import AdaptiveTarget, TargetConfig, TargetDecision


class IterationSample(Protocol):
    """What LENS reads of one iteration (the sim's `IterationRecord` has it; so can vLLM's step details)."""

    @property
    def duration_s(self) -> float: ...

    @property
    def num_prefill_seqs(self) -> int: ...

    @property
    def num_prefill_tokens(self) -> int: ...

    @property
    def num_decode_seqs(self) -> int: ...

    @property
    def num_decode_tokens(self) -> int: ...


@dataclass(frozen=True, slots=True)
class LensConfig:
    enabled: bool = True
    default_slo_ttft_s: float = 2.0
    default_slo_tpot_s: float = 0.05
    refit_every_observations: int = 16
    refit_interval_s: float = 1.0
    search_iters: int = 16
    eps_ratio: float = 0.05
    plan_max_error_ratio: float = 0.25
    prefill_window: int = 64  # planned iterations with prefill pending behind the measured prefill rate
    prefill_min_samples: int = 8
    model: LatencyModelConfig = field(default_factory=LatencyModelConfig)
    target: TargetConfig = field(default_factory=TargetConfig)


class LensController:
    """LENS for one engine (see the module docstring). Not thread-safe: call it from the engine's loop."""

    def __init__(self, limits: PlanLimits, config: LensConfig | None = None,
                 model: LatencyModel | None = None, target: AdaptiveTarget | None = None) -> None:
        self._config = cfg = config or LensConfig()
        self._limits = limits
        self._model = model or LatencyModel(cfg.model)
        self._target = target or AdaptiveTarget(cfg.target)
        self._since_fit = 0
        self._last_fit_s = -math.inf
        self._in_flight = False
        self._last_plan: BatchPlan | None = None
        self._pending_prefill = False  # the last plan's queue had prefill pending
        # (prefill tokens, seconds) of recent planned iterations that began with prefill pending, and sums
        self._prefill_samples: deque[tuple[int, float]] = deque()
        self._prefill_tokens = 0
        self._prefill_s = 0.0
        self._peak_of: tuple[object, float] = (None, 0.0)  # (the model's params, their P_max): a memo

    @property
    def config(self) -> LensConfig:
        return self._config

    @property
    def limits(self) -> PlanLimits:
        return self._limits

    @property
    def planning(self) -> bool:
        """LENS steers batching now: enabled, the model ready and its recent error acceptable."""
        model = self._model
        return (self._config.enabled and model.ready
                and model.recent_error_ratio <= self._config.plan_max_error_ratio)

    @property
    def model(self) -> LatencyModel:
        return self._model

    @property
    def target(self) -> AdaptiveTarget:
        return self._target

    @property
    def last_plan(self) -> BatchPlan | None:
        return self._last_plan

    # -- feedback ------------------------------------------------------------------------------------------

    def on_iteration(self, record: IterationSample, now_s: float) -> None:
        """An iteration that ended at `now_s`."""
        batch_size = record.num_prefill_seqs + record.num_decode_seqs
        tokens = record.num_prefill_tokens + record.num_decode_tokens
        if batch_size <= 0 or tokens <= 0 or record.duration_s <= 0.0:
            return
        self._model.observe(batch_size, tokens, record.duration_s, now_s)
        if self._pending_prefill and self._last_plan is not None:
            samples = self._prefill_samples
            samples.append((record.num_prefill_tokens, record.duration_s))
            self._prefill_tokens += record.num_prefill_tokens
            self._prefill_s += record.duration_s
            if len(samples) > self._config.prefill_window:
                old_tokens, old_s = samples.popleft()
                self._prefill_tokens -= old_tokens
                self._prefill_s -= old_s
        self._pending_prefill = False
        self._since_fit += 1
        if self._last_fit_s == -math.inf:
            self._last_fit_s = now_s  # the refit interval runs from the first observation

    def on_request_finished(self, ttft_s: float, tpot_s: float, output_tokens: int) -> None:
        self._target.observe_request(ttft_s, tpot_s, output_tokens)

    # -- refits --------------------------------------------------------------------------------------------

    def refit_due(self, now_s: float) -> bool:
        if self._in_flight or self._since_fit == 0:
            return False
        cfg = self._config
        return (self._since_fit >= cfg.refit_every_observations
                or now_s - self._last_fit_s >= cfg.refit_interval_s)

    def take_refit_job(self, now_s: float) -> Callable[[], FitOutcome] | None:
        """The due refit as a pure callable (None when none is due); call `install_refit` with its result."""
        if not self.refit_due(now_s):
            return None
        self._in_flight = True
        self._since_fit = 0
        self._last_fit_s = now_s
        return self._model.refit_job(now_s)

    def install_refit(self, outcome: FitOutcome) -> None:
        self._model.install(outcome)
        self._in_flight = False

    def abandon_refit(self) -> None:
        """The job failed or was cancelled: allow the next one."""
        self._in_flight = False

    def maybe_refit(self, now_s: float) -> FitOutcome | None:
        """Run the due refit inline (the simulator's deterministic path)."""
        job = self.take_refit_job(now_s)
        if job is None:
            return None
        outcome = job()
        self.install_refit(outcome)
        return outcome

    # -- decisions -----------------------------------------------------------------------------------------

    def decide_target(self, view: QueueView) -> TargetDecision:
        cfg = self._config
        ttft = view.slo_ttft_s if view.slo_ttft_s is not None else cfg.default_slo_ttft_s
        tpot = view.slo_tpot_s if view.slo_tpot_s is not None else cfg.default_slo_tpot_s
        return self._target.target(ttft, tpot, int(view.waiting_tokens.shape[0]))

    def plan(self, view: QueueView, now_s: float) -> BatchPlan | None:
        """Algorithm 1 for the iteration starting at `now_s`; None: use the backend's default batching."""
        del now_s  # the plan depends on the queue and the model only; kept for the backends' call shape
        if not self.planning:
            self._last_plan = None
            return None
        decision = self.decide_target(view)
        cfg = self._config
        plan = plan_batch(view, self._limits, self._model.params, decision.target_latency_s,
                          search_iters=cfg.search_iters, eps_ratio=cfg.eps_ratio)
        self._last_plan = plan
        self._pending_prefill = view.waiting_tokens.shape[0] > 0 or bool((view.running_tokens > 1).any())
        return plan

    @property
    def measured_prefill_rate(self) -> float | None:
        """Prefill tokens per second over the recent planned iterations that began with prefill pending
        (None: fewer than `prefill_min_samples`)."""
        if len(self._prefill_samples) < self._config.prefill_min_samples or self._prefill_s <= 0.0:
            return None
        return self._prefill_tokens / self._prefill_s

    def _prefill_rate(self, view: QueueView, decoding: int) -> float:
        """Prefill tokens per second of the plan for `view` with one more request waiting (docstring)."""
        limits, cfg = self._limits, self._config
        probe = QueueView(view.running_tokens, np.append(view.waiting_tokens, limits.max_batched_tokens),
                          view.free_kv_blocks, view.slo_ttft_s, view.slo_tpot_s)
        plan = plan_batch(probe, limits, self._model.params, self.decide_target(probe).target_latency_s,
                          search_iters=cfg.search_iters, eps_ratio=cfg.eps_ratio)
        if plan is None or plan.predicted_latency_s <= 0.0:
            return 0.0
        return max(plan.token_budget - decoding, 1) / plan.predicted_latency_s

    def _peak(self) -> float:
        """P_max of the current fit (`peak_tokens_per_s`), recomputed when a refit installs new params."""
        params = self._model.params
        if self._peak_of[0] is not params:
            self._peak_of = (params, peak_tokens_per_s(params, self._limits))
        return self._peak_of[1]

    def state_vector(self, view: QueueView, now_s: float) -> LensFigures:
        """Eq. 8 plus the model's recent error and the SLO risk (see the module docstring)."""
        del now_s
        limits = self._limits
        decision = self.decide_target(view)
        l_bar = decision.decode_tokens
        run, wait = view.running_tokens, view.waiting_tokens
        prefilling = run > 1
        n_prefilling = int(np.count_nonzero(prefilling))
        pending_prefill = int(run[prefilling].sum()) + int(wait.sum())
        n_wait = int(wait.shape[0])
        decoding = int(run.shape[0]) - n_prefilling
        work = pending_prefill + l_bar * (n_wait + n_prefilling) + 0.5 * l_bar * decoding
        bs = limits.block_size
        reserved = int(np.sum(np.ceil((wait + l_bar) / bs))) if n_wait else 0
        free = max(view.free_kv_blocks - reserved, 0)
        latency_s = peak = rate = 0.0
        if self._model.ready:
            peak = self._peak()
            plan = None
            if self.planning:
                cfg = self._config
                plan = plan_batch(view, limits, self._model.params, decision.target_latency_s,
                                  search_iters=cfg.search_iters, eps_ratio=cfg.eps_ratio)
                measured = self.measured_prefill_rate
                rate = measured if measured is not None else self._prefill_rate(view, decoding)
            if plan is not None:
                latency_s = plan.predicted_latency_s
            else:
                b, s = allocate(view, limits, limits.max_num_seqs, limits.max_batched_tokens)
                latency_s = predict_scalar(self._model.params, b, s)
        return LensFigures(
            predicted_batch_latency_s=latency_s,
            pending_work_tokens=float(work),
            effective_free_kv_blocks=free,
            peak_throughput_tokens_per_s=peak,
            prediction_error_ratio=self._model.recent_error_ratio,
            slo_risk=decision.slo_risk,
            prefill_tokens_per_s=rate,
        )
