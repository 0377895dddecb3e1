"""Re-planning a served cascade on workload shift (Cascadia §4.4, footnote 5, App. G), live.

Owns: `CascadeReplanner`, one per cascade with `replan:` configured, fed by `gateway.cascade.serve`:
- every request of the cascade counts as an arrival (`WorkloadMonitor.on_arrival`, which says whether to
  shadow it); an answered one gives its first stage's prompt tokens and its answering stage's completion
  tokens (the engines' exact counts) to the window's sample;
- a shadowed request, once its client's answer is out, runs in a background task: every stage the cascade did
  not run for it (an ordinary dispatch of the same request to that model, buffered), the judge on every stage
  answer the cascade did not score, and the row of each model's score and answer length goes to the monitor.
  A model whose stage or verdict failed is left out of the row (it counts for the others: a plan may give
  a model no replica); a row with no model is dropped; more than `SHADOW_CONCURRENCY` at once are skipped.
  Shadow work is never billed: it is in no client's usage, only in `switchyard_cascade_shadow_*`;
- a background task wakes when a window ends (`next_close_s`, on the injected clock) and closes it. On a
  `Shift` it re-runs Algorithm 1 (`plan_cascade`) in a worker thread, never on the event loop, on the shadowed
  rows' profile (or the profile of the last plan when too few), swaps the thresholds (`swap`: requests already
  started keep theirs) and tests later windows against the workload the new plan was made for
  (`adopted_baseline`). One re-plan at a time per cascade: the task awaits it before it closes another window.
The gateway cannot move GPUs: the new plan's GPUs and shapes per stage are published (`view`, GET
/v1/cascades, with the rollout steps from the previous target) and logged; reconfiguring replicas is an
operator's or the simulator's (`loadgen simulate`).
Must not: decide a shift (`gateway.cascade.plan.replan` does), plan (`gateway.cascade.plan` does), delay or
alter a client's response, or touch the cascade's judge breaker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import time
import zlib
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.cascade.core import CascadeLife, StageRecord, shadow_needs
from gateway.cascade.judge import Verdict
from gateway.cascade.plan import CascadePlan, PlanRequest, plan_cascade
from gateway.cascade.plan.replan import (
    SHADOW_CONCURRENCY,
    Baseline,
    ReplanParams,
    ShadowRow,
    Shift,
    Step,
    WorkloadMonitor,
    adopted_baseline,
    replicas,
    rollout,
    servable_thresholds,
    shadow_item,
)
from gateway.cascade.quality import ItemScore, QualityProfile, QualityProfileError, load_profile
from gateway.config import CascadeConfig, ConfigError, ReplanConfig
from gateway.domain import EngineRequest
from gateway.observability.metrics import GatewayMetrics
from switchyard.clock import Clock

log = logging.getLogger(__name__)

HISTORY_KEPT = 100  # re-plan records kept for GET /v1/cascades

Planner = Callable[[PlanRequest, QualityProfile], CascadePlan]


@dataclass(frozen=True, slots=True)
class StageAnswer:
    """A shadow stage's buffered answer (the engines' exact counts)."""

    text: str
    prompt_tokens: int
    completion_tokens: int


# An ordinary dispatch of a request, buffered; raises when no answer comes.
ShadowDispatch = Callable[[EngineRequest], Awaitable[StageAnswer]]
# The cascade's judge on (the request, an answer, the model that wrote it).
ShadowJudge = Callable[[EngineRequest, str, str], Awaitable[Verdict]]


def _plan_with_timer(request: PlanRequest, profile: QualityProfile) -> CascadePlan:
    return plan_cascade(request, profile, timer=time.perf_counter)


# ---- pure helpers ----------------------------------------------------------------------------------------


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def plan_summary(plan: CascadePlan, request: PlanRequest, dataset: str) -> dict[str, Any]:
    """The plan as `loadgen cascade-plan` writes it (its main fields; infinite latencies as None)."""
    return {
        "models": list(plan.models),
        "gpu": plan.gpu,
        "thresholds": list(plan.thresholds),
        "gpus": list(plan.gpus),
        "shapes": [[list(group) for group in stage] for stage in plan.shapes],
        "L_s": [_finite(v) for v in plan.stage_p95_s],
        "L": _finite(plan.latency_s),
        "Q": plan.quality,
        "J": _finite(plan.objective),
        "e2e_p95_s": _finite(plan.e2e_p95_s),
        "feasible": plan.feasible,
        "stage_share": list(plan.stage_share),
        "answer_share": list(plan.answer_share),
        "stage_rate_rps": list(plan.stage_rate_rps),
        "stage_capacity_rps": [_finite(v) for v in plan.stage_capacity_rps],
        "iterations": plan.iterations,
        "evaluations": plan.evaluations,
        "solver_s": plan.solver_s,
        "request": {"gpus": request.gpus, "rate_rps": request.rate_rps, "q_min": request.q_min,
                    "l_max_s": request.l_max_s, "judge_latency_s": request.judge_latency_s,
                    "dataset": dataset},
    }


def rollout_steps(models: Sequence[str], old_shapes: Sequence[Sequence[Sequence[int]]],
                  new_shapes: Sequence[Sequence[Sequence[int]]], total_gpus: int) -> list[dict[str, Any]]:
    """`replan.rollout` from one plan's shapes to another's, as JSON rows."""

    def replica(r: Any) -> dict[str, Any]:
        return {"model": r.model, "tp": r.tensor_parallel, "pp": r.pipeline_parallel}

    def row(step: Step) -> dict[str, Any]:
        return {"remove": replica(step.remove) if step.remove is not None else None,
                "add": [replica(r) for r in step.add], "gap": step.gap}

    steps = rollout(replicas(models, old_shapes), replicas(models, new_shapes), total_gpus)
    return [row(s) for s in steps]


def user_turns(request: EngineRequest) -> tuple[str, ...]:
    """The request's user turns (a completion's prompt is one), the texts a shadowed item is made of."""
    if request.messages is not None:
        return tuple(m.content for m in request.messages if m.role == "user") or ("",)
    return (request.prompt_text or "",)


# ---- the live side --------------------------------------------------------------------------------------


def load_planning_profile(index: int, config: CascadeConfig) -> QualityProfile:
    """The profile subset the configured thresholds were planned on; ConfigError naming the cascade's path
    when it cannot be read or lacks a stage model."""
    assert config.replan is not None
    replan = config.replan
    path = f"cascades.{index}.replan"
    try:
        profile = load_profile(Path(replan.quality_profile) if replan.quality_profile else None)
        profile = profile.subset(replan.dataset)
        for stage in config.stages:
            profile.scores(stage.model)
    except QualityProfileError as e:
        raise ConfigError(f"{path}: {' '.join(str(e).split())}") from None
    return profile


class CascadeReplanner:
    """One cascade's windows, shadows and re-plans. `current()` gives the thresholds serving now, `swap` sets
    new ones; `dispatch` and `judge` run a shadow's stages and verdicts. Times in `view` are seconds since
    start."""

    def __init__(
        self,
        config: CascadeConfig,
        profile: QualityProfile,
        *,
        current: Callable[[], tuple[float, ...]],
        swap: Callable[[Sequence[float]], None],
        dispatch: ShadowDispatch,
        judge: ShadowJudge,
        metrics: GatewayMetrics,
        clock: Clock,
        planner: Planner | None = None,
    ) -> None:
        assert config.replan is not None
        self.name = config.name
        self.config: ReplanConfig = config.replan
        self.models = tuple(s.model for s in config.stages)
        r = self.config
        self.params = ReplanParams(window_s=r.window_s, sample_size=r.sample_size,
                                   shadow_share=r.shadow_share, alpha=r.alpha, min_shadow=r.min_shadow)
        self.profile = profile  # the profile the running plan was made on
        self.planner: Planner = planner or _plan_with_timer  # called in a worker thread
        self._current = current
        self._swap = swap
        self._dispatch = dispatch
        self._judge = judge
        self._metrics = metrics
        self._clock = clock
        self._t0 = clock.now()
        baseline = Baseline.of_profile(profile, self.models, current(), r.rate_rps)
        seed = zlib.crc32(config.name.encode())
        self.monitor = WorkloadMonitor(self.models, baseline, self.params, start_s=self._t0, seed=seed)
        self._window = Counter[str]()  # this window's arrivals, shadowed, answered, shadow_rows
        self._shadows: set[asyncio.Task[None]] = set()
        self._shadow_ids = itertools.count()
        self.shadow_outcomes = Counter[str]()
        self.replans: list[dict[str, Any]] = []
        self.replanning = False
        self.target: dict[str, Any] | None = None  # the last plan's document (what the GPUs should serve)
        for kind in ("prompt", "completion", "judge"):
            metrics.cascade_shadow_tokens.labels(self.name, kind)
        metrics.cascade_replans.labels(self.name)

    def _rel(self, t: float) -> float:
        return t - self._t0

    # ---- fed by the runner ---------------------------------------------------------------------------------

    def on_arrival(self) -> bool:
        """A request of the cascade arrived; True: shadow it once answered."""
        shadow = self.monitor.on_arrival()
        self._window["arrivals"] += 1
        self._window["shadowed"] += shadow
        return shadow

    def on_answer(self, request: EngineRequest, life: CascadeLife, texts: Mapping[int, str] | None) -> None:
        """The client's answer is out. `texts`: the stages' answers, given only for a shadowed request."""
        answered = life.answered
        if answered is None or not life.stages:
            return
        self.monitor.on_answer(life.stages[0].prompt_tokens, life.stages[answered.index].completion_tokens)
        self._window["answered"] += 1
        if texts is not None:
            self._spawn_shadow(request, tuple(life.stages), dict(texts))

    # ---- shadows -----------------------------------------------------------------------------------------

    def _count(self, outcome: str) -> None:
        self.shadow_outcomes[outcome] += 1
        self._metrics.cascade_shadow_requests.labels(self.name, outcome).inc()

    def _spawn_shadow(self, request: EngineRequest, stages: tuple[StageRecord, ...],
                      texts: dict[int, str]) -> None:
        if len(self._shadows) >= SHADOW_CONCURRENCY:
            self._count("skipped")
            return
        n = next(self._shadow_ids)
        task = asyncio.create_task(self._shadow(n, request, stages, texts), name=f"shadow:{self.name}:{n}")
        self._shadows.add(task)
        task.add_done_callback(self._shadows.discard)

    async def _shadow(self, n: int, request: EngineRequest, stages: tuple[StageRecord, ...],
                      texts: dict[int, str]) -> None:
        try:
            outcome = await self._shadow_row(n, request, stages, texts)
        except asyncio.CancelledError:
            self._count("cancelled")
            raise
        self._count(outcome)

    async def _shadow_row(self, n: int, request: EngineRequest, stages: tuple[StageRecord, ...],
                          texts: dict[int, str]) -> str:
        tokens = self._metrics.cascade_shadow_tokens
        scores: dict[str, ItemScore] = {}
        missing = ""  # why the first model left out of the row is missing (its stage or verdict failed)
        needs = shadow_needs(stages, self.models)
        for index, (model, need) in enumerate(zip(self.models, needs, strict=True)):
            if need == "scored":
                record = stages[index]
                assert record.score is not None
                scores[model] = ItemScore(record.score, record.completion_tokens)
                continue
            text = texts.get(index) if need == "judge" else None
            if text is not None:
                length = stages[index].completion_tokens
            else:
                stage_request = dataclasses.replace(
                    request, model=model, request_id=f"{request.request_id}~shadow{n}.{index}"
                )
                try:
                    answer = await self._dispatch(stage_request)
                except Exception as e:  # noqa: BLE001 (any failure of the stage: the row goes on without it)
                    log.info("cascade %s shadow %d: stage %d (%s) failed: %s", self.name, n, index, model, e)
                    missing = missing or "stage_failed"
                    continue
                tokens.labels(self.name, "prompt").inc(answer.prompt_tokens)
                tokens.labels(self.name, "completion").inc(answer.completion_tokens)
                text, length = answer.text, answer.completion_tokens
            try:
                verdict = await self._judge(request, text, model)
            except Exception as e:  # noqa: BLE001 (a judge that raises is a failed verdict)
                log.info("cascade %s shadow %d: judge on %s raised: %s", self.name, n, model, e)
                missing = missing or "judge_failed"
                continue
            tokens.labels(self.name, "judge").inc(verdict.prompt_tokens + verdict.completion_tokens)
            if verdict.outcome != "ok" or verdict.score is None:
                missing = missing or "judge_failed"
                continue
            scores[model] = ItemScore(verdict.score, length)
        if not scores:
            return missing
        self.monitor.on_shadow(ShadowRow(shadow_item(n, user_turns(request)), scores))
        self._window["shadow_rows"] += 1
        return "partial" if missing else "recorded"

    # ---- windows and re-plans ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Close each window when it ends, re-planning on a shift, until cancelled."""
        while True:
            await asyncio.sleep(max(0.0, self.monitor.next_close_s - self._clock.now()))
            try:
                await self.tick()
            except Exception:  # a bug must not end re-planning for good: logged, the next window is tested
                log.exception("cascade %s: closing a window failed", self.name)

    async def tick(self) -> dict[str, Any] | None:
        """Close the windows ended by now; on a shift, re-plan (off the loop) and adopt. Returns the re-plan's
        record, if one was made."""
        now = self._clock.now()
        if now < self.monitor.next_close_s:
            return None
        shift = self.monitor.close(now)
        self._window.clear()
        if shift is None:
            return None
        thresholds = self._current()
        if shift.rate_rps <= 0:  # nothing arrived: nothing to plan for; the first arrivals will be a shift
            log.info("cascade %s: no arrivals in the window ending at %.0f s; thresholds kept, the next "
                     "arrivals re-plan", self.name, self._rel(shift.at_s))
            self.monitor.adopt(Baseline.of_profile(self.profile, self.models, thresholds, 0.0))
            return None
        return await self._replan(shift, thresholds)

    async def _replan(self, shift: Shift, old: tuple[float, ...]) -> dict[str, Any]:
        r = self.config
        profile = shift.profile if shift.profile is not None else self.profile
        gpu, count = r.gpu
        record: dict[str, Any] = {
            "at_s": self._rel(shift.at_s), "reasons": list(shift.reasons), "rate_rps": shift.rate_rps,
            "profile": "shadowed" if shift.profile is not None else "previous",
            "profile_items": len(profile.items), "old_thresholds": list(old),
        }
        planner = self.planner

        def solve() -> tuple[CascadePlan, PlanRequest, float]:  # runs in a worker thread
            started = time.perf_counter()
            request = PlanRequest(self.models, gpu, count, shift.rate_rps, q_min=r.q_min, l_max_s=r.l_max_s,
                                  judge_latency_s=r.judge_latency_s)
            plan = planner(request, profile)
            return plan, request, time.perf_counter() - started

        self.replanning = True
        try:
            plan, request, took_s = await asyncio.to_thread(solve)
        except Exception as e:  # noqa: BLE001 (a planner failure keeps the running plan; the next shift retries)
            record |= {"adopted": False, "error": f"{type(e).__name__}: {e}"}
            self._record(record)
            log.warning("cascade %s: re-plan failed (%s): %s; thresholds kept", self.name,
                        "; ".join(shift.reasons), record["error"])
            return record
        finally:
            self.replanning = False
        if not plan.feasible:  # no routing keeps up at this rate on these GPUs: keep serving as is
            record |= {"adopted": False, "error": f"infeasible: nothing keeps up with {shift.rate_rps:.3g} "
                                                  f"req/s on {r.gpus}"}
            self._record(record)
            log.warning("cascade %s: re-plan infeasible (%s); thresholds kept", self.name,
                        "; ".join(shift.reasons))
            return record
        solver_s = plan.solver_s if plan.solver_s is not None else took_s
        thresholds, notes = servable_thresholds(plan.thresholds)
        document = plan_summary(plan, request, r.dataset)
        steps: list[dict[str, Any]] | None = None
        if self.target is not None:
            try:
                steps = rollout_steps(self.models, self.target["shapes"], document["shapes"], count)
            except ValueError as e:
                notes += (f"no rollout: {e}",)
        self._swap(thresholds)
        self.profile = profile
        self.target = document
        self.monitor.adopt(adopted_baseline(profile, self.models, thresholds, shift,
                                            shadowed=shift.profile is not None, sample_size=r.sample_size))
        record |= {"adopted": True, "new_thresholds": list(thresholds), "notes": list(notes),
                   "solver_s": solver_s, "plan": document, "rollout": steps}
        self._record(record)
        self._metrics.cascade_replans.labels(self.name).inc()
        self._metrics.cascade_replan_solver_seconds.observe(solver_s)
        shapes = "; ".join(
            f"{m} {g} GPU(s) " + ",".join(f"{c}x(tp{tp},pp{pp})" for tp, pp, c in stage)
            for m, g, stage in zip(self.models, plan.gpus, plan.shapes, strict=True)
        )
        log.info("cascade %s re-planned at %.0f s (%s): thresholds %s -> %s; target deployment on %s: %s "
                 "(published at GET /v1/cascades; the gateway does not move GPUs); solver %.2f s",
                 self.name, record["at_s"], "; ".join(shift.reasons), list(old), list(thresholds), r.gpus,
                 shapes, solver_s)
        return record

    def _record(self, record: dict[str, Any]) -> None:
        self.replans.append(record)
        del self.replans[:-HISTORY_KEPT]

    async def close(self) -> None:
        """Cancel the shadows in flight (shutdown)."""
        tasks = list(self._shadows)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- what GET /v1/cascades shows ---------------------------------------------------------------------

    def view(self) -> dict[str, Any]:
        p, r, base = self.params, self.config, self.monitor.baseline
        start = self.monitor.next_close_s - p.window_s
        return {
            "gpus": r.gpus, "rate_rps": r.rate_rps, "q_min": r.q_min, "l_max_s": r.l_max_s,
            "dataset": r.dataset, "quality_profile": r.quality_profile, "judge_latency_s": r.judge_latency_s,
            "params": dataclasses.asdict(p),
            "baseline": {"rate_rps": base.rate_rps, "prompt_samples": len(base.prompt_tokens),
                         "answer_samples": len(base.answer_tokens),
                         "scored_items": {m: len(s) for m, s in base.scores.items()}},
            "window": {"start_s": self._rel(start), "closes_at_s": self._rel(self.monitor.next_close_s),
                       **{k: self._window[k] for k in ("arrivals", "shadowed", "answered", "shadow_rows")}},
            "windows_closed": self.monitor.windows,
            "last_tests": dict(self.monitor.last_tests),
            "shadow": {"in_flight": len(self._shadows), "concurrency": SHADOW_CONCURRENCY,
                       "outcomes": dict(self.shadow_outcomes)},
            "replanning": self.replanning,
            "idle": base.rate_rps == 0,  # a window had no arrivals: the next arrivals re-plan
            "replans": list(self.replans),
            "target": self.target,
        }
