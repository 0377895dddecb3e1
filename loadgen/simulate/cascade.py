"""Cascades in the simulator: `CascadeLife` (the gateway's decisions) over simulated stages and a simulated
judge.

Owns: `SimJudge` (the judge as the simulator models it, `SimJudge.parse`'s two kinds: `fixed:SECONDS`, a
verdict a fixed delay after the stage's answer, Cascadia App. H's 0.27 s by default; `pool:MODEL[:rating|
explain]`, the live `cluster` judge: a model of the simulated fleet, each verdict a judge request dispatched
through the runner like a stage, so it queues and batches with the load and its latency is what the fleet
gives. Either scores each stage answer with the quality profile's score of that model on that item; `bias`
and `noise` perturb the verdict the cascade routes on, never the quality it is credited with, as App. K's
weaker judges; the noise of a verdict is drawn per (request, stage), so both kinds route alike on one seed),
the judge's token estimates (`judge_tokens`: FastChat's prompt around the profiled answer lengths, and
`Rating: [[k]]` or `EXPLAIN_JUDGMENT_TOKENS`), `CascadeSim` (what `SimOptions.cascade` holds: the cascade,
its judge, streaming mode and profile), `cascade_requests` (MT-Bench items of a profile subset drawn with
replacement, both turns, a turn 2 with its history) and `CascadeRun` (per run: each request's life, the
judge requests in flight and the verdicts due, the client-facing outcome once the answering stage is known,
and the figures `stage_share`, `escalated_share`, `quality`, `judge`).
Must not: decide anything of the cascade (`gateway.cascade.core.CascadeLife` does, as it does live, judge
failures and the breaker included), route (the runner runs each stage and each pool judge request through
`ChoiceLife` like any request), model engines, or give a judge request a client outcome.

Timing, as the live gateway serves it: a stage's answer is buffered; the judge answers `latency_s` after the
stage's last token (`fixed`), or when its request finishes on the judge model's engines (`pool`: sent at the
stage's last token); an escalation dispatches the next stage then. Judge requests and verdicts become due
events (`next_s`, `run_due`), so every dispatch happens at a sync point of the runner, never inside an
engine's advance. A pool judge request the fleet cannot take (the runner's `on_stage_failed`: no engine of
the model, or refused) is the verdict `unreachable`, as the live `ClusterJudge` answers `NoEngineAvailable`;
`on_judge_failure` and the breaker then apply. The client receives an accepted buffered answer at once when
the verdict comes (TTFT = E2E = verdict time, every token in one burst); the last stage streams live with
`final_live` (its token times), and is released at its finish with `buffered`. Not modelled: the live
judge's `timeout_s` (a slow pool judge is waited for).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from operator import sub
from typing import Any, Literal, cast, get_args

import numpy as np

from gateway.cascade.core import (
    JUDGE_OK,
    Answer,
    AskJudge,
    CascadeLife,
    CascadeSpec,
    Effect,
    Fail,
    JudgeBreaker,
    RunStage,
    shadow_needs,
)
from gateway.cascade.judge_prompt import Output, build_prompt, profile_rating, rating_reply
from gateway.cascade.plan.replan import (
    SHADOW_CONCURRENCY,
    Baseline,
    ReplanParams,
    ShadowRow,
    WorkloadMonitor,
)
from gateway.cascade.quality import (
    SCORE_SCALE,
    SUBSETS,
    ItemScore,
    QualityProfile,
    estimate_tokens,
    prompt_tokens,
)
from loadgen.datasets.request import Message, Request
from loadgen.metrics import Outcome

APP_H_JUDGE_S = 0.27  # Cascadia App. H: GPT-4o's mean judging latency on MT-Bench
FILLER_WORD = "answer "  # a turn-2 history's assistant turn: filler of the profiled answer's length
# `explain`'s judgment: the median estimated length (ceil(bytes/4)) of the 320 GPT-4 judgments in the MT-Bench
# data (RouteLLM's judgements.jsonl; docs/cascadia.md, gateway.cascade.judge_prompt's docstring).
EXPLAIN_JUDGMENT_TOKENS = 153
JUDGE_UNREACHABLE = "unreachable"  # a pool judge request no engine took (the live ClusterJudge's outcome)
JudgeKind = Literal["fixed", "pool"]
JUDGE_KINDS: tuple[str, ...] = get_args(JudgeKind)
OUTPUTS: tuple[str, ...] = get_args(Output)
JUDGE_SYNTAX = (
    f"fixed:SECONDS (e.g. fixed:{APP_H_JUDGE_S}) or pool:MODEL[:rating|explain] (e.g. pool:qwen2.5-14b)"
)


@dataclass(frozen=True)
class SimJudge:
    latency_s: float = APP_H_JUDGE_S  # `fixed` only: the delay of every verdict
    bias: float = 0.0  # points (0-100) added to every verdict
    noise: float = 0.0  # standard deviation (points) of Gaussian noise on every verdict
    kind: JudgeKind = "fixed"
    model: str | None = None  # `pool` only: the fleet's model that judges
    output: Output = "rating"  # what the judge writes: `Rating: [[k]]` alone, or an explanation first

    def __post_init__(self) -> None:
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"judge latency must be >= 0, got {self.latency_s}")
        if not math.isfinite(self.bias) or not (math.isfinite(self.noise) and self.noise >= 0):
            raise ValueError("judge bias must be finite and noise >= 0")
        if self.kind not in JUDGE_KINDS:
            raise ValueError(f"judge kind must be one of {', '.join(JUDGE_KINDS)}, got {self.kind!r}")
        if (self.kind == "pool") != bool(self.model):
            raise ValueError("a pool judge needs a model; a fixed judge takes none")
        if self.output not in OUTPUTS:
            raise ValueError(f"judge output must be one of {', '.join(OUTPUTS)}, got {self.output!r}")

    @classmethod
    def parse(cls, text: str, *, bias: float = 0.0, noise: float = 0.0) -> SimJudge:
        """`fixed:SECONDS` (a judge answering after a fixed delay) or `pool:MODEL[:rating|explain]` (the
        fleet's MODEL judges, each verdict a request it serves; `rating` by default)."""
        kind, _, value = text.partition(":")
        if kind == "fixed":
            try:
                seconds = float(value)
            except ValueError:
                raise ValueError(f"judge {text!r}: {value!r} is not a number of seconds") from None
            return cls(seconds, bias, noise)
        if kind == "pool":
            model, colon, output = value.partition(":")
            if not model.strip():
                raise ValueError(f"judge {text!r}: a pool judge needs a model, pool:MODEL[:rating|explain]")
            output = output if colon else "rating"
            if output not in OUTPUTS:
                raise ValueError(f"judge {text!r}: output {output!r} is not one of {', '.join(OUTPUTS)}")
            return cls(bias=bias, noise=noise, kind="pool", model=model.strip(), output=cast(Output, output))
        raise ValueError(f"judge {text!r}: unknown kind {kind!r}; expected {JUDGE_SYNTAX}")

    def verdict(self, true_score: float, rng: np.random.Generator) -> float:
        """The score (0-100) of the rating the judge gives, by the live profile judge's rule
        (`judge_prompt.profile_rating`): an unperturbed score is the profile's own, as live."""
        score = true_score + self.bias + (float(rng.normal(0.0, self.noise)) if self.noise > 0 else 0.0)
        return SCORE_SCALE * profile_rating(score)

    def completion_tokens(self, score: float) -> int:
        """The judgment's length: `Rating: [[k]]` estimated (as the live profile judge counts it), or
        `EXPLAIN_JUDGMENT_TOKENS` for an explanation."""
        if self.output == "explain":
            return EXPLAIN_JUDGMENT_TOKENS
        return estimate_tokens(rating_reply(score / SCORE_SCALE))


def judge_prompt_tokens(profile: QualityProfile, item_index: int, model: str, output: Output) -> int:
    """The estimated tokens of the judge's prompt for `model`'s answer to item `item_index`: FastChat's
    template (`judge_prompt.build_prompt`) around the item's questions, plus the profiled lengths of the
    answer judged and, at turn 2, of the model's own turn-1 answer (MT-Bench's multi-turn judging; the
    stage's prompt holds the same history, `quality.prompt_tokens`). The answers count at their profiled
    length (the estimate of the real answer's text) rather than as filler text, whose estimate differs."""
    item = profile.items[item_index]
    scores = profile.scores(model)
    history = 0
    if len(item.questions) > 1:
        first = profile.first_turn(item.question_id)
        history = scores[first].answer_tokens if first is not None else 0
    template = build_prompt(item.questions, ("",) * (len(item.questions) - 1), "", output).estimated_tokens
    return template + history + scores[item_index].answer_tokens


@dataclass(frozen=True)
class SimReplan:
    """Re-planning (Cascadia §4.4; `loadgen.simulate.cascade_replan` runs it): the GPUs a plan may use,
    q_min / l_max, the profile and rate the running plan was made for, and the monitor's parameters."""

    gpu: str
    gpus: int  # GPUs a plan may use (the running deployment's budget)
    planned_on: QualityProfile  # the profile the running plan was made on
    rate_rps: float  # the rate it was made for
    q_min: float | None = None
    l_max_s: float | None = None
    judge_latency_s: float = 0.27
    params: ReplanParams = field(default_factory=ReplanParams)
    # What a shift re-runs: (the request, the profile to plan on) -> a plan (thresholds, gpus, shapes,
    # feasible); None: Cascadia's Algorithm 1 (`plan_cascade`). A benchmark passes a baseline's planner so
    # that it re-plans through the same monitor and rollout (`loadgen.simulate.cascade_replan.Planner`).
    planner: Callable[..., Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.q_min is None and self.l_max_s is None:
            raise ValueError("re-planning needs q_min, l_max_s or both (as the plan had)")
        if self.gpus < 1 or not (math.isfinite(self.rate_rps) and self.rate_rps > 0):
            raise ValueError("re-planning needs gpus >= 1 and a positive planned rate")


@dataclass(frozen=True)
class CascadeSim:
    spec: CascadeSpec
    profile: QualityProfile  # the items requests refer to (`Request.metadata["item"]`)
    judge: SimJudge = SimJudge()
    streaming: Literal["final_live", "buffered"] = "final_live"
    failures_to_skip: int = 5
    skip_s: float = 10.0
    replan: SimReplan | None = None  # §4.4: windows, shadows, re-plans and rolling reconfiguration

    def __post_init__(self) -> None:
        for model in self.spec.models:
            self.profile.scores(model)  # QualityProfileError naming a model the profile cannot score


def cascade_requests(
    profile: QualityProfile, subset: str, num_requests: int, *, seed: int, first_model: str
) -> list[Request]:
    """`num_requests` items of `subset` drawn with replacement (seeded). A turn-2 item's prompt holds its
    turn-1 question, a filler assistant turn of `first_model`'s turn-1 answer length, and its question."""
    if subset not in SUBSETS:
        raise ValueError(f"cascade dataset must be one of {', '.join(SUBSETS)}, got {subset!r}")
    pool = [
        i
        for i, item in enumerate(profile.items)
        if subset == "mt-bench" or item.hard == (subset == "mt-bench-hard")
    ]
    rng = np.random.default_rng([seed, 15])
    out: list[Request] = []
    for n, pick in enumerate(rng.integers(0, len(pool), size=num_requests)):
        index = pool[int(pick)]
        item = profile.items[index]
        messages: list[Message] = [("user", item.questions[0])]
        if item.turn == 2:
            first = profile.first_turn(item.question_id)
            filler_tokens = profile.scores(first_model)[first].answer_tokens if first is not None else 0
            messages += [("assistant", (FILLER_WORD * filler_tokens).strip()), ("user", item.questions[1])]
        out.append(
            Request(
                request_id=f"{subset}-{n}-q{item.question_id}t{item.turn}",
                prompt_tokens=prompt_tokens(item, profile, first_model),
                messages=tuple(messages),
                prompt_tokens_estimated=True,
                metadata={"item": index},
            )
        )
    return out


@dataclass
class _Pending:
    index: int
    request: Request
    arrival_s: float
    life: CascadeLife
    item: int
    stage_times: dict[int, list[float]] = dataclasses.field(default_factory=dict)
    stage_tokens: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)
    engines: dict[int, str] = dataclasses.field(default_factory=dict)
    shadowed: bool = False  # the monitor chose it: shadowed once answered


@dataclass(frozen=True, slots=True)
class _SendJudge:
    """Due: dispatch the pool judge's request for the current stage (its score drawn when asked)."""

    stage: int
    score: float
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class _Verdict:
    """Due: the judge's verdict on the current stage reaches the cascade."""

    outcome: str
    score: float | None
    latency_s: float
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True, slots=True)
class _JudgeInFlight:
    index: int  # the client request's schedule index
    sent_s: float
    score: float


@dataclass
class _Shadow:
    pending: _Pending  # the answered client request
    needs: list[str]  # per stage: `gateway.cascade.core.shadow_needs`
    scores: dict[str, ItemScore] = field(default_factory=dict)
    at: int = 0  # the stage being seen to


DispatchStage = Callable[[int, float, Request, str], None]  # (schedule index, now, stage request, model)


class CascadeRun:
    """One simulation's cascade state; the runner feeds it arrivals, stage finishes and failures (of stage
    and judge requests alike: `owns` says which request ids are its own)."""

    def __init__(
        self,
        sim: CascadeSim,
        *,
        seed: int,
        dispatch: DispatchStage,
        finalize: Callable[[int, Outcome, float], None],
        t0: float,
    ) -> None:
        self.sim = sim
        self.seed = seed
        self.breaker = JudgeBreaker(sim.failures_to_skip, sim.skip_s)
        self.rng = np.random.default_rng([seed, 16])
        self.dispatch = dispatch
        self.finalize = finalize
        self.t0 = t0
        self.pending: dict[int, _Pending] = {}
        self.stage_of: dict[str, tuple[int, int]] = {}  # stage request id -> (schedule index, stage)
        self.judge_of: dict[str, _JudgeInFlight] = {}  # pool judge request id -> what it judges
        # (time, seq, schedule index, what is due): verdicts, and pool judge requests to send
        self.due: list[tuple[float, int, int, _SendJudge | _Verdict]] = []
        self.seq = itertools.count()
        self.lives: list[CascadeLife] = []
        self.judge_tokens: dict[tuple[int, int], int] = {}  # (item, stage) -> judge prompt tokens
        self.quality_sum = 0.0
        self.answered = 0
        self.spec = sim.spec  # the thresholds new requests start with (a re-plan swaps them)
        self.monitor: WorkloadMonitor | None = None
        replan = sim.replan
        if replan is not None:
            baseline = Baseline.of_profile(
                replan.planned_on, sim.spec.models, sim.spec.thresholds, replan.rate_rps
            )
            self.monitor = WorkloadMonitor(sim.spec.models, baseline, replan.params, start_s=t0, seed=seed)
        self.shadows_in_flight = 0
        self.shadow_of: dict[str, _Shadow] = {}  # shadow request id -> its shadow (at the stage it runs)
        self.shadow = {
            "requests": 0,
            "rows": 0,
            "partial": 0,  # rows missing a model whose stage no engine took
            "unreached": 0,  # shadow dispatches no engine took
            "dropped": 0,  # shadows that scored no model
            "skipped": 0,
            "dispatches": 0,
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "judge_prompt_tokens": 0,
            "judge_completion_tokens": 0,
        }

    @property
    def next_s(self) -> float:
        return self.due[0][0] if self.due else math.inf

    def arrive(self, index: int, now_s: float, request: Request, *, arrival_s: float | None = None) -> None:
        """The client request's cascade starts at `now_s` (`arrival_s`: when it arrived, if it waited in the
        gateway's admission queue)."""
        item = request.metadata.get("item")
        if not isinstance(item, int):
            raise ValueError(
                f"request {request.request_id}: a cascade request needs metadata['item'] (an MT-Bench "
                "item of the quality profile); use a cascade dataset (mt-bench, mt-bench-hard, "
                "mt-bench-easy)"
            )
        life = CascadeLife(self.spec, self.breaker)
        self.lives.append(life)
        pending = _Pending(index, request, now_s if arrival_s is None else arrival_s, life, item)
        self.pending[index] = pending
        pending.shadowed = self.monitor is not None and self.monitor.on_arrival()
        self._apply(pending, life.start(), now_s)

    def set_thresholds(self, thresholds: Sequence[float]) -> None:
        """A re-plan's thresholds, for requests arriving from now on (those started keep theirs)."""
        self.spec = self.spec.with_thresholds(thresholds)

    def _stage_request(self, pending: _Pending, model: str, rid: str) -> Request:
        profile = self.sim.profile
        return dataclasses.replace(
            pending.request,
            request_id=rid,
            prompt_tokens=prompt_tokens(profile.items[pending.item], profile, model),
            output_tokens=profile.scores(model)[pending.item].answer_tokens,
        )

    def _shadow(self, pending: _Pending, now_s: float) -> None:
        """Footnote 5, as the live gateway shadows (`gateway.cascade.replanner`): once the client's answer is
        out, each stage in turn keeps the cascade's verdict, has the judge score its held answer, or runs
        (a dispatch) and is judged; the row of scores goes to the monitor without the models no engine took
        (dropped only when none scored). Shadow work loads the fleet but is nobody's outcome and is never
        billed. Its verdicts are drawn by the judge's rule when needed (they do not queue on a pool judge)."""
        if self.shadows_in_flight >= SHADOW_CONCURRENCY:  # as live: over the bound, skipped
            self.shadow["skipped"] += 1
            return
        self.shadow["requests"] += 1
        self.shadows_in_flight += 1
        self._shadow_step(_Shadow(pending, shadow_needs(pending.life.stages, self.spec.models)), now_s)

    def _shadow_step(self, shadow: _Shadow, now_s: float) -> None:
        models, pending = self.spec.models, shadow.pending
        while shadow.at < len(models):
            stage, need = shadow.at, shadow.needs[shadow.at]
            if need == "dispatch":
                rid = f"{pending.request.request_id}~x{stage}"
                self.shadow_of[rid] = shadow
                self.shadow["dispatches"] += 1
                self.dispatch(
                    pending.index, now_s, self._stage_request(pending, models[stage], rid), models[stage]
                )
                return
            record = pending.life.stages[stage]
            if need == "scored":
                assert record.score is not None
                shadow.scores[models[stage]] = ItemScore(record.score, record.completion_tokens)
            else:
                self._shadow_verdict(shadow, stage, record.completion_tokens)
            shadow.at += 1
        assert self.monitor is not None
        self.shadows_in_flight -= 1
        if not shadow.scores:
            self.shadow["dropped"] += 1
            return
        self.shadow["rows"] += 1
        if len(shadow.scores) < len(models):
            self.shadow["partial"] += 1
        self.monitor.on_shadow(ShadowRow(self.sim.profile.items[pending.item], shadow.scores))

    def _shadow_verdict(self, shadow: _Shadow, stage: int, completion: int) -> None:
        judge, profile, item = self.sim.judge, self.sim.profile, shadow.pending.item
        model = self.spec.models[stage]
        rng = np.random.default_rng([self.seed, 17, shadow.pending.index, stage])
        score = judge.verdict(profile.scores(model)[item].score, rng)
        shadow.scores[model] = ItemScore(score, completion)
        self.shadow["judge_prompt_tokens"] += judge_prompt_tokens(profile, item, model, judge.output)
        self.shadow["judge_completion_tokens"] += judge.completion_tokens(score)

    def _apply(self, pending: _Pending, effect: Effect, now_s: float) -> None:
        if isinstance(effect, RunStage):
            model = effect.model
            stage_request = self._stage_request(
                pending, model, f"{pending.request.request_id}~s{effect.index}"
            )
            self.stage_of[stage_request.request_id] = (pending.index, effect.index)
            self.dispatch(pending.index, now_s, stage_request, model)
        elif isinstance(effect, AskJudge):
            self._ask_judge(pending, effect.index, now_s)
        elif isinstance(effect, Answer):
            self._answer(pending, effect, now_s)
        else:
            assert isinstance(effect, Fail)
            del self.pending[pending.index]
            self.finalize(
                pending.index,
                Outcome(
                    request_id=pending.request.request_id,
                    success=False,
                    prompt_tokens=pending.request.prompt_tokens,
                    arrival_s=pending.arrival_s - self.t0,
                    start_s=pending.arrival_s - self.t0,
                    error=effect.message,
                ),
                now_s,
            )

    def _ask_judge(self, pending: _Pending, stage: int, now_s: float) -> None:
        """The verdict is drawn now (the same for both kinds on one seed); `fixed` delivers it after its
        delay, `pool` sends its request (due at once: dispatched at the runner's next sync point, `now_s`)."""
        judge = self.sim.judge
        model = self.sim.spec.stages[stage].model
        true_score = self.sim.profile.scores(model)[pending.item].score
        rng = np.random.default_rng([self.seed, 16, pending.index, stage]) if judge.noise > 0 else self.rng
        score = judge.verdict(true_score, rng)
        key = (pending.item, stage)
        prompt = self.judge_tokens.get(key)
        if prompt is None:
            prompt = self.judge_tokens[key] = judge_prompt_tokens(
                self.sim.profile, pending.item, model, judge.output
            )
        completion = judge.completion_tokens(score)
        if judge.kind == "fixed":
            due: _SendJudge | _Verdict = _Verdict(JUDGE_OK, score, judge.latency_s, prompt, completion)
            self._push(now_s + judge.latency_s, pending.index, due)
        else:
            self._push(now_s, pending.index, _SendJudge(stage, score, prompt, completion))

    def _push(self, at_s: float, index: int, due: _SendJudge | _Verdict) -> None:
        heapq.heappush(self.due, (at_s, next(self.seq), index, due))

    def run_due(self, now_s: float) -> None:
        """Apply the verdicts and send the judge requests due by `now_s` (the runner has synced the fleet to
        `now_s`)."""
        while self.due and self.due[0][0] <= now_s:
            at_s, _, index, due = heapq.heappop(self.due)
            pending = self.pending[index]
            if isinstance(due, _SendJudge):
                self._send_judge(pending, due, at_s)
                continue
            effect = pending.life.on_verdict(
                due.outcome,
                due.score,
                prompt_tokens=due.prompt_tokens,
                completion_tokens=due.completion_tokens,
                latency_s=due.latency_s,
                now_s=at_s,
            )
            self._apply(pending, effect, at_s)

    def _send_judge(self, pending: _Pending, send: _SendJudge, now_s: float) -> None:
        model = self.sim.judge.model
        assert model is not None
        rid = f"{pending.request.request_id}~j{send.stage}"
        self.judge_of[rid] = _JudgeInFlight(pending.index, now_s, send.score)
        request = Request(
            request_id=rid,
            prompt_tokens=send.prompt_tokens,
            output_tokens=send.completion_tokens,
            prompt_tokens_estimated=True,
        )
        self.dispatch(pending.index, now_s, request, model)

    def on_stage_finished(
        self, rid: str, times: Sequence[float], prompt: int, completion: int, engine_id: str, now_s: float
    ) -> None:
        shadow = self.shadow_of.pop(rid, None)
        if shadow is not None:
            self.shadow["prompt_tokens"] += prompt
            self.shadow["completion_tokens"] += completion
            self._shadow_verdict(shadow, shadow.at, completion)
            shadow.at += 1
            self._shadow_step(shadow, now_s)
            return
        judged = self.judge_of.pop(rid, None)
        if judged is not None:  # the verdict is due at once: applied at the runner's next sync point
            verdict = _Verdict(JUDGE_OK, judged.score, now_s - judged.sent_s, prompt, completion)
            self._push(now_s, judged.index, verdict)
            return
        index, stage = self.stage_of.pop(rid)
        pending = self.pending[index]
        pending.stage_times[stage] = list(times)
        pending.stage_tokens[stage] = (prompt, completion)
        pending.engines[stage] = engine_id
        self._apply(pending, pending.life.on_stage_done(prompt, completion, now_s), now_s)

    def on_stage_failed(self, rid: str, error: str, now_s: float) -> None:
        shadow = self.shadow_of.pop(rid, None)
        if shadow is not None:  # the row goes on without this model, as live
            self.shadow["unreached"] += 1
            shadow.at += 1
            self._shadow_step(shadow, now_s)
            return
        judged = self.judge_of.pop(rid, None)
        if judged is not None:  # no engine took the judge request: a failed verdict (module doc)
            self._push(now_s, judged.index, _Verdict(JUDGE_UNREACHABLE, None, now_s - judged.sent_s))
            return
        index, _ = self.stage_of.pop(rid)
        pending = self.pending[index]
        self._apply(pending, pending.life.on_stage_unavailable(error), now_s)

    def owns(self, rid: str) -> bool:
        return rid in self.stage_of or rid in self.judge_of or rid in self.shadow_of

    def _answer(self, pending: _Pending, answer: Answer, now_s: float) -> None:
        del self.pending[pending.index]
        stage = answer.index
        times = pending.stage_times.get(stage, [])
        completion = pending.stage_tokens.get(stage, (0, 0))[1]
        last = stage == len(self.sim.spec.stages) - 1
        if last and self.sim.streaming == "final_live" and not answer.degraded and times:
            ttft_s, itl = times[0] - pending.arrival_s, tuple(map(sub, times[1:], times))
        else:  # a buffered answer goes out in one burst when it is released
            ttft_s, itl = now_s - pending.arrival_s, (0.0,) * max(0, len(times) - 1)
        model = self.sim.spec.stages[stage].model
        self.quality_sum += self.sim.profile.scores(model)[pending.item].score
        self.answered += 1
        first_prompt = pending.stage_tokens.get(0, (pending.request.prompt_tokens, 0))[0]
        if self.monitor is not None:
            self.monitor.on_answer(first_prompt, completion)
        self.finalize(
            pending.index,
            Outcome(
                request_id=pending.request.request_id,
                success=True,
                prompt_tokens=first_prompt,
                output_tokens=completion,
                arrival_s=pending.arrival_s - self.t0,
                start_s=pending.arrival_s - self.t0,
                ttft_s=ttft_s,
                itl_s=itl,
                e2e_s=now_s - pending.arrival_s,
                engine_id=pending.engines.get(stage),
            ),
            now_s,
        )
        if pending.shadowed:  # after the client's answer, as live
            self._shadow(pending, now_s)

    def figures(self) -> dict[str, Any]:
        """`cascade` of the results: share of requests reaching each stage, answered by each, escalated
        (answered past stage 0), degraded, the quality Q of the answers (mean profile score, 0-100), and the
        judge's (`judge_figures`)."""
        stages = len(self.sim.spec.stages)
        n = len(self.lives)
        reached = [
            sum(1 for life in self.lives if len(life.stages) > s) / n if n else 0.0 for s in range(stages)
        ]
        answers = [life.answered for life in self.lives if life.answered is not None]
        answer_share = [sum(1 for a in answers if a.index == s) / n if n else 0.0 for s in range(stages)]
        return {
            "name": self.sim.spec.name,
            "models": list(self.sim.spec.models),
            "thresholds": list(self.spec.thresholds),  # the last in force (a re-plan may have swapped them)
            "stage_share": reached,
            "answer_share": answer_share,
            "escalated_share": 1.0 - answer_share[0] if n else 0.0,
            "degraded_share": sum(1 for a in answers if a.degraded) / n if n else 0.0,
            "quality": self.quality_sum / self.answered if self.answered else None,
            "judge": self.judge_figures(),
            **({"shadow": dict(self.shadow)} if self.monitor is not None else {}),
            "stand_ins": {m: self.sim.profile.sources.get(m, m) for m in self.sim.spec.models},
        }

    def judge_figures(self) -> dict[str, Any]:
        """The judge as configured, and as it answered (from the stages' records, as `usage.cascade` has
        them): verdicts, failed ones by outcome (`skipped`: while the breaker was open), the mean and p95
        latency of the verdicts (`pool`: measured, dispatch to finish; `fixed`: its delay), and its tokens."""
        judge = self.sim.judge
        judged = [r for life in self.lives for r in life.stages if r.judge_outcome is not None]
        latencies = [r.judge_latency_s for r in judged if r.judge_outcome == JUDGE_OK]
        failures: dict[str, int] = {}
        for record in judged:
            if record.judge_outcome != JUDGE_OK:
                outcome = str(record.judge_outcome)
                failures[outcome] = failures.get(outcome, 0) + 1
        return {
            "kind": judge.kind,
            "model": judge.model,
            "output": judge.output,
            "latency_s": judge.latency_s if judge.kind == "fixed" else None,
            "bias": judge.bias,
            "noise": judge.noise,
            "skips": self.breaker.skips,
            "verdicts": len(latencies),
            "failures": dict(sorted(failures.items())),
            "mean_latency_s": float(np.mean(latencies)) if latencies else None,
            "p95_latency_s": float(np.percentile(latencies, 95)) if latencies else None,
            "prompt_tokens": sum(r.judge_prompt_tokens for r in judged),
            "completion_tokens": sum(r.judge_completion_tokens for r in judged),
        }
