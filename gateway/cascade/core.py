"""One cascade request's decisions as pure code, run live and simulated (Cascadia Fig. 4).

Owns: `CascadeSpec` (a cascade's stages, thresholds and judge-failure rule, from the config or the CLI's
`name=model:threshold,...,model`), `CascadeLife` (events in, effects out: which stage runs next, when the
judge is asked, what its verdict means, what a failed stage means, which stage answers), `JudgeBreaker` (after
`failures_to_skip` failed verdicts in a row the judge is skipped for `skip_s`), the per-stage `StageRecord`s
that become `usage.cascade`, and `usage_of` (what the client is billed: the stages' tokens summed, the judge's
apart).
Must not: read a clock or draw randomness (times arrive as arguments), do I/O, await, touch metrics, or decide
where a stage runs (each stage is an ordinary dispatch through `gateway.dispatch.life.ChoiceLife`).

Executors: the live gateway (`gateway.cascade.serve`: stages through the `Dispatcher`, buffered until the
answering stage is known, the judge over HTTP) and the simulator (`loadgen.simulate.cascade`: stages on
`SimEngine`s, the judge a fixed or simulated latency), so an escalation decided in simulation is the one the
gateway makes.

The life (C stages, 0-based): `start` runs stage 0. A stage's answer (`on_stage_done`) is final at the last
stage; otherwise the judge is asked (`AskJudge`), unless the breaker is open, which counts as a judge failure
with outcome `skipped`. A verdict at or above the stage's threshold accepts the answer; below it escalates to
the next stage (reason `below_threshold`). A failed verdict (timeout, refusal, 5xx, 429, malformed or
out-of-range rating, skipped) applies `on_judge_failure`: `escalate` (reason `judge_<outcome>`) or `accept`. A
buffered stage whose engine failed mid-stream is run again once, avoiding that engine (no byte of it reached
the client); a stage no engine can run (its pool is empty, or the retry failed too) ends the request with the
answer held from the stage before, marked `degraded`; when nothing is held (the first stage, or every stage
before it, could not run) the next stage runs instead (a plan may give the first model no replica, or a
re-plan may be reloading it), and the request fails only when no stage could run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

JudgeFailure = Literal["escalate", "accept"]
JUDGE_OK = "ok"
JUDGE_SKIPPED = "skipped"
BELOW_THRESHOLD = "below_threshold"
MAX_STAGE_RERUNS = 1  # a buffered stage that failed mid-stream is run again this many times


class CascadeSpecError(ValueError):
    """A cascade that cannot be served: fewer than 2 stages, a threshold missing, misplaced or out of
    range."""


@dataclass(frozen=True, slots=True)
class Stage:
    model: str
    threshold: float | None  # None on the last stage only


@dataclass(frozen=True, slots=True)
class CascadeSpec:
    name: str
    stages: tuple[Stage, ...]
    on_judge_failure: JudgeFailure = "escalate"

    def __post_init__(self) -> None:
        if len(self.stages) < 2:
            raise CascadeSpecError(f"cascade {self.name!r} needs at least 2 stages, got {len(self.stages)}")
        for index, stage in enumerate(self.stages):
            last = index == len(self.stages) - 1
            if last and stage.threshold is not None:
                raise CascadeSpecError(
                    f"cascade {self.name!r}: the last stage ({stage.model}) takes no threshold"
                )
            if not last and (stage.threshold is None or not 0.0 <= stage.threshold <= 100.0):
                raise CascadeSpecError(
                    f"cascade {self.name!r}: stage {index} ({stage.model}) needs a threshold "
                    f"in [0, 100], got {stage.threshold}"
                )

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(s.model for s in self.stages)

    @property
    def thresholds(self) -> tuple[float, ...]:
        return tuple(float(s.threshold) for s in self.stages[:-1] if s.threshold is not None)

    @property
    def text(self) -> str:
        """The CLI's form, `parse_cascade`'s inverse: `name=model:threshold,...,model`."""
        stages = [f"{s.model}:{s.threshold:g}" for s in self.stages[:-1]]
        return f"{self.name}={','.join([*stages, self.stages[-1].model])}"

    def with_thresholds(self, thresholds: Sequence[float]) -> CascadeSpec:
        """The same cascade with new thresholds (a re-plan swaps them in at once)."""
        if len(thresholds) != len(self.stages) - 1:
            raise CascadeSpecError(f"{len(self.stages)} stages take {len(self.stages) - 1} thresholds")
        stages = [Stage(s.model, float(t)) for s, t in zip(self.stages, thresholds, strict=False)]
        return CascadeSpec(self.name, (*stages, self.stages[-1]), self.on_judge_failure)


def parse_cascade(text: str, *, on_judge_failure: JudgeFailure = "escalate") -> CascadeSpec:
    """`name=model:threshold,...,model` (the CLI's form: `cascade-llama3=llama3-8b:90,llama3-70b`)."""
    name, sep, rest = text.partition("=")
    if not sep or not name.strip() or not rest.strip():
        raise CascadeSpecError(f"cascade {text!r}: expected NAME=MODEL:THRESHOLD,...,MODEL")
    stages: list[Stage] = []
    for part in rest.split(","):
        model, colon, threshold = part.strip().partition(":")
        if not model:
            raise CascadeSpecError(f"cascade {text!r}: an empty stage")
        try:
            stages.append(Stage(model, float(threshold) if colon else None))
        except ValueError:
            raise CascadeSpecError(f"cascade {text!r}: threshold {threshold!r} is not a number") from None
    return CascadeSpec(name.strip(), tuple(stages), on_judge_failure)


class JudgeBreaker:
    """Skip the judge for `skip_s` after `failures_to_skip` failed verdicts in a row (one breaker per
    cascade). A success resets the count; the first verdict after a skip starts a new count."""

    __slots__ = ("failures_to_skip", "skip_s", "failures", "skip_until_s", "skips")

    def __init__(self, failures_to_skip: int = 5, skip_s: float = 10.0) -> None:
        if failures_to_skip < 1 or skip_s < 0:
            raise ValueError("failures_to_skip must be >= 1 and skip_s >= 0")
        self.failures_to_skip = failures_to_skip
        self.skip_s = skip_s
        self.failures = 0
        self.skip_until_s = float("-inf")
        self.skips = 0  # times the breaker opened

    def allows(self, now_s: float) -> bool:
        return now_s >= self.skip_until_s

    def record(self, ok: bool, now_s: float) -> None:
        if ok:
            self.failures = 0
            return
        self.failures += 1
        if self.failures >= self.failures_to_skip:
            self.failures = 0
            self.skip_until_s = now_s + self.skip_s
            self.skips += 1


@dataclass(slots=True)
class StageRecord:
    """What happened at one stage; `usage.cascade` lists these."""

    model: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    score: float | None = None
    judge_outcome: str | None = None  # None: not judged (the answering last stage, or a failed stage)
    judge_prompt_tokens: int = 0
    judge_completion_tokens: int = 0
    judge_latency_s: float = 0.0
    decision: str = ""  # "accepted" | "escalated" | "answered" | "failed"
    reason: str = ""  # why it escalated or was accepted without a verdict
    runs: int = 0  # times the stage was dispatched (a mid-stream failure runs it again)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": self.model,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "decision": self.decision,
        }
        if self.reason:
            out["reason"] = self.reason
        if self.judge_outcome is not None:
            out["score"] = self.score
            out["judge"] = {
                "outcome": self.judge_outcome,
                "prompt_tokens": self.judge_prompt_tokens,
                "completion_tokens": self.judge_completion_tokens,
                "latency_s": round(self.judge_latency_s, 6),
            }
        return out


@dataclass(frozen=True, slots=True)
class RunStage:
    """Effect: dispatch stage `index` (its model's pool), avoiding `avoid` (an engine that failed it)."""

    index: int
    model: str
    avoid: str | None = None


@dataclass(frozen=True, slots=True)
class AskJudge:
    """Effect: ask the judge to score stage `index`'s answer (then call `on_verdict`)."""

    index: int


@dataclass(frozen=True, slots=True)
class Answer:
    """Effect: stage `index`'s answer is the response (buffered: replay it; the live last stage: done)."""

    index: int
    degraded: bool = False


@dataclass(frozen=True, slots=True)
class Fail:
    """Effect: no stage can answer (none could run): the request fails with `message`."""

    message: str


Effect = RunStage | AskJudge | Answer | Fail


@dataclass(slots=True)
class CascadeLife:
    """The decisions of one cascade request: build it on arrival, feed it events, apply what it returns."""

    spec: CascadeSpec
    breaker: JudgeBreaker
    stages: list[StageRecord] = field(default_factory=list)
    answered: Answer | None = None
    failed: bool = False

    @property
    def current(self) -> int:
        return len(self.stages) - 1

    @property
    def last(self) -> bool:
        return self.current == len(self.spec.stages) - 1

    def start(self) -> RunStage:
        if self.stages:
            raise RuntimeError("start() twice")
        return self._run(0)

    def _run(self, index: int, avoid: str | None = None) -> RunStage:
        if index == len(self.stages):
            self.stages.append(StageRecord(self.spec.stages[index].model))
        self.stages[index].runs += 1
        return RunStage(index, self.spec.stages[index].model, avoid)

    def on_stage_done(self, prompt_tokens: int, completion_tokens: int, now_s: float) -> Effect:
        """The current stage's answer is complete (buffered, or streamed live at the last stage)."""
        record = self.stages[self.current]
        record.prompt_tokens, record.completion_tokens = prompt_tokens, completion_tokens
        if self.last:
            record.decision = "answered"
            return self._answer(self.current)
        if not self.breaker.allows(now_s):
            record.judge_outcome = JUDGE_SKIPPED
            return self._judge_failed(record)
        return AskJudge(self.current)

    def on_verdict(
        self,
        outcome: str,
        score: float | None,
        *,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        latency_s: float = 0.0,
        now_s: float,
    ) -> Effect:
        """The judge's verdict on the current stage: `outcome` "ok" with a 0-100 `score`, or a failure."""
        record = self.stages[self.current]
        record.judge_outcome, record.score = outcome, score
        record.judge_prompt_tokens, record.judge_completion_tokens = prompt_tokens, completion_tokens
        record.judge_latency_s = latency_s
        ok = outcome == JUDGE_OK and score is not None
        self.breaker.record(ok, now_s)
        if not ok:
            return self._judge_failed(record)
        threshold = self.spec.stages[self.current].threshold
        assert threshold is not None and score is not None
        if score >= threshold:
            record.decision = "accepted"
            return self._answer(self.current)
        record.decision, record.reason = "escalated", BELOW_THRESHOLD
        return self._run(self.current + 1)

    def _judge_failed(self, record: StageRecord) -> Effect:
        reason = f"judge_{record.judge_outcome}"
        if self.spec.on_judge_failure == "accept":
            record.decision, record.reason = "accepted", reason
            return self._answer(self.current)
        record.decision, record.reason = "escalated", reason
        return self._run(self.current + 1)

    def on_stage_broken(self, engine_id: str | None, message: str) -> Effect:
        """The current (buffered) stage failed mid-stream on `engine_id`: run it again elsewhere, once."""
        record = self.stages[self.current]
        if record.runs <= MAX_STAGE_RERUNS:
            return self._run(self.current, avoid=engine_id)
        return self.on_stage_unavailable(message)

    def on_stage_unavailable(self, message: str) -> Effect:
        """No engine could run the current stage: answer with the held answer of the stage before it
        (degraded); with none held (no stage so far could run), run the next stage; fail at the last."""
        record = self.stages[self.current]
        record.decision, record.reason = "failed", message
        held = self.current - 1
        if held >= 0 and self.stages[held].decision != "failed":
            return self._answer(held, degraded=True)
        if not self.last:
            return self._run(self.current + 1)
        self.failed = True
        return Fail(message)

    def _answer(self, index: int, *, degraded: bool = False) -> Answer:
        self.answered = Answer(index, degraded)
        return self.answered

    # ---- what the client sees
    # ---------------------------------------------------------------------------------

    def scores(self) -> list[float | None]:
        """The judge's score per judged stage (None where the verdict failed or was skipped)."""
        return [r.score for r in self.stages if r.judge_outcome is not None]

    def escalation_reasons(self) -> list[str]:
        return [r.reason for r in self.stages if r.decision == "escalated"]

    def usage_of(self) -> dict[str, Any]:
        """`usage` of the response: the stages' tokens summed (what the engines generated for the client),
        the judge's apart, and `cascade` stage by stage."""
        prompt = sum(r.prompt_tokens for r in self.stages)
        completion = sum(r.completion_tokens for r in self.stages)
        out: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "cascade": {
                "name": self.spec.name,
                "answering_stage": self.answered.index if self.answered is not None else None,
                "answering_model": (
                    self.spec.stages[self.answered.index].model if self.answered is not None else None
                ),
                "degraded": self.answered.degraded if self.answered is not None else False,
                "stages": [r.as_dict() for r in self.stages],
                "judge_prompt_tokens": sum(r.judge_prompt_tokens for r in self.stages),
                "judge_completion_tokens": sum(r.judge_completion_tokens for r in self.stages),
            },
        }
        return out


def shadow_needs(stages: Sequence[StageRecord], models: Sequence[str]) -> list[str]:
    """Per stage model, what a shadowed request (Cascadia footnote 5) still needs once its answer is out, live
    and in the simulator alike: "scored" (the cascade's verdict is in hand),
    "judge" (the stage ran, its answer is held, the judge did not score it: the answering last stage, a failed
    verdict) or "dispatch" (the stage did not run, or could not)."""
    needs: list[str] = []
    for index in range(len(models)):
        record = stages[index] if index < len(stages) else None
        if record is None or record.decision == "failed":
            needs.append("dispatch")
        elif record.judge_outcome == "ok" and record.score is not None:
            needs.append("scored")
        else:
            needs.append("judge")
    return needs
