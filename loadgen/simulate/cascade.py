"""Cascades in the simulator: `CascadeLife` (the gateway's decisions) over simulated stages and a simulated
judge.

Owns: `SimJudge` (the judge as the simulator models it: `fixed:SECONDS`, Cascadia App. H's 0.27 s by default,
scoring each stage answer with the quality profile's score of that model on that item; `bias` and `noise`
perturb the verdict the cascade routes on, never the quality it is credited with, as App. K's weaker judges),
`CascadeSim` (what `SimOptions.cascade` holds: the cascade, its judge, streaming mode and profile),
`cascade_requests` (MT-Bench items of a profile subset drawn with replacement, both turns, a turn 2 with its
history) and `CascadeRun` (per run: each request's life, the verdicts due, the client-facing outcome once the
answering stage is known, and the figures `stage_share`, `escalated_share`, `quality`).
Must not: decide anything of the cascade (`gateway.cascade.core.CascadeLife` does, as it does live), route
(the runner runs each stage through `ChoiceLife` like any request), or model engines.

Timing, as the live gateway serves it: a stage's answer is buffered; the judge answers `latency_s` after the
stage's last token; an escalation dispatches the next stage then. The client receives an accepted buffered
answer at once when the verdict comes (TTFT = E2E = verdict time, every token in one burst); the last stage
streams live with `final_live` (its token times), and is released at its finish with `buffered`.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import sub
from typing import Any, Literal

import numpy as np

from gateway.cascade.core import (
    Answer,
    AskJudge,
    CascadeLife,
    CascadeSpec,
    Effect,
    Fail,
    JudgeBreaker,
    RunStage,
)
from gateway.cascade.judge_prompt import profile_rating
from gateway.cascade.quality import SCORE_SCALE, SUBSETS, QualityProfile, prompt_tokens
from loadgen.datasets.request import Message, Request
from loadgen.metrics import Outcome

APP_H_JUDGE_S = 0.27  # Cascadia App. H: GPT-4o's mean judging latency on MT-Bench
FILLER_WORD = "answer "  # a turn-2 history's assistant turn: filler of the profiled answer's length


@dataclass(frozen=True)
class SimJudge:
    latency_s: float = APP_H_JUDGE_S
    bias: float = 0.0  # points (0-100) added to every verdict
    noise: float = 0.0  # standard deviation (points) of Gaussian noise on every verdict

    def __post_init__(self) -> None:
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"judge latency must be >= 0, got {self.latency_s}")
        if not math.isfinite(self.bias) or not (math.isfinite(self.noise) and self.noise >= 0):
            raise ValueError("judge bias must be finite and noise >= 0")

    @classmethod
    def parse(cls, text: str, *, bias: float = 0.0, noise: float = 0.0) -> SimJudge:
        """`fixed:SECONDS` (a judge answering after a fixed delay)."""
        kind, _, value = text.partition(":")
        if kind != "fixed":
            raise ValueError(f"judge {text!r}: expected fixed:SECONDS (e.g. fixed:{APP_H_JUDGE_S})")
        try:
            return cls(float(value), bias, noise)
        except ValueError:
            raise ValueError(f"judge {text!r}: {value!r} is not a number of seconds") from None

    def verdict(self, true_score: float, rng: np.random.Generator) -> float:
        """The score (0-100) of the rating the judge gives, by the live profile judge's rule
        (`judge_prompt.profile_rating`): an unperturbed score is the profile's own, as live."""
        score = true_score + self.bias + (float(rng.normal(0.0, self.noise)) if self.noise > 0 else 0.0)
        return SCORE_SCALE * profile_rating(score)


@dataclass(frozen=True)
class CascadeSim:
    spec: CascadeSpec
    profile: QualityProfile  # the items requests refer to (`Request.metadata["item"]`)
    judge: SimJudge = SimJudge()
    streaming: Literal["final_live", "buffered"] = "final_live"
    failures_to_skip: int = 5
    skip_s: float = 10.0

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


DispatchStage = Callable[[int, float, Request, str], None]  # (schedule index, now, stage request, model)


class CascadeRun:
    """One simulation's cascade state; the runner feeds it arrivals, stage finishes and failures."""

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
        self.breaker = JudgeBreaker(sim.failures_to_skip, sim.skip_s)
        self.rng = np.random.default_rng([seed, 16])
        self.dispatch = dispatch
        self.finalize = finalize
        self.t0 = t0
        self.pending: dict[int, _Pending] = {}
        self.stage_of: dict[str, tuple[int, int]] = {}  # stage request id -> (schedule index, stage)
        self.due: list[tuple[float, int, int, float]] = []  # (time, seq, schedule index, verdict score)
        self.seq = itertools.count()
        self.lives: list[CascadeLife] = []
        self.quality_sum = 0.0
        self.answered = 0

    @property
    def next_s(self) -> float:
        return self.due[0][0] if self.due else math.inf

    def arrive(self, index: int, now_s: float, request: Request) -> None:
        item = request.metadata.get("item")
        if not isinstance(item, int):
            raise ValueError(
                f"request {request.request_id}: a cascade request needs metadata['item'] (an MT-Bench "
                "item of the quality profile); use a cascade dataset (mt-bench, mt-bench-hard, "
                "mt-bench-easy)"
            )
        life = CascadeLife(self.sim.spec, self.breaker)
        self.lives.append(life)
        pending = _Pending(index, request, now_s, life, item)
        self.pending[index] = pending
        self._apply(pending, life.start(), now_s)

    def _apply(self, pending: _Pending, effect: Effect, now_s: float) -> None:
        if isinstance(effect, RunStage):
            model = effect.model
            profile = self.sim.profile
            item = profile.items[pending.item]
            stage_request = dataclasses.replace(
                pending.request,
                request_id=f"{pending.request.request_id}~s{effect.index}",
                prompt_tokens=prompt_tokens(item, profile, model),
                output_tokens=profile.scores(model)[pending.item].answer_tokens,
            )
            self.stage_of[stage_request.request_id] = (pending.index, effect.index)
            self.dispatch(pending.index, now_s, stage_request, model)
        elif isinstance(effect, AskJudge):
            model = self.sim.spec.stages[effect.index].model
            true_score = self.sim.profile.scores(model)[pending.item].score
            score = self.sim.judge.verdict(true_score, self.rng)
            heapq.heappush(self.due, (now_s + self.sim.judge.latency_s, next(self.seq), pending.index, score))
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

    def run_due(self, now_s: float) -> None:
        """Apply the verdicts due by `now_s` (the runner has synced the fleet to `now_s`)."""
        while self.due and self.due[0][0] <= now_s:
            at_s, _, index, score = heapq.heappop(self.due)
            pending = self.pending[index]
            effect = pending.life.on_verdict("ok", score, latency_s=self.sim.judge.latency_s, now_s=at_s)
            self._apply(pending, effect, at_s)

    def on_stage_finished(
        self, rid: str, times: Sequence[float], prompt: int, completion: int, engine_id: str, now_s: float
    ) -> None:
        index, stage = self.stage_of.pop(rid)
        pending = self.pending[index]
        pending.stage_times[stage] = list(times)
        pending.stage_tokens[stage] = (prompt, completion)
        pending.engines[stage] = engine_id
        self._apply(pending, pending.life.on_stage_done(prompt, completion, now_s), now_s)

    def on_stage_failed(self, rid: str, error: str, now_s: float) -> None:
        index, _ = self.stage_of.pop(rid)
        pending = self.pending[index]
        self._apply(pending, pending.life.on_stage_unavailable(error), now_s)

    def owns(self, rid: str) -> bool:
        return rid in self.stage_of

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

    def figures(self) -> dict[str, Any]:
        """`cascade` of the results: share of requests reaching each stage, answered by each, escalated
        (answered past stage 0), degraded, and the quality Q of the answers (mean profile score, 0-100)."""
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
            "thresholds": list(self.sim.spec.thresholds),
            "stage_share": reached,
            "answer_share": answer_share,
            "escalated_share": 1.0 - answer_share[0] if n else 0.0,
            "degraded_share": sum(1 for a in answers if a.degraded) / n if n else 0.0,
            "quality": self.quality_sum / self.answered if self.answered else None,
            "judge": {
                "latency_s": self.sim.judge.latency_s,
                "bias": self.sim.judge.bias,
                "noise": self.sim.judge.noise,
                "skips": self.breaker.skips,
            },
            "stand_ins": {m: self.sim.profile.sources.get(m, m) for m in self.sim.spec.models},
        }
