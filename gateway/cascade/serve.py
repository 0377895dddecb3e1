"""The live executor of a cascade request: stages through the dispatcher, buffered until the answer is known.

Owns: `CascadeRunner`: the configured cascades (served as models), their judges and breakers; for one request,
running `CascadeLife` (`gateway.cascade.core`, the decisions the simulator runs too) against real engines:
each stage an ordinary `Dispatcher.run` of the request with the stage's model; earlier stages into a
`StageBuffer` (nothing reaches the client, so a stage that fails mid-stream runs again elsewhere), the judge
asked with the stage's answer, then the answering stage replayed to the client's sink, or (`final_live`) the
last stage streamed straight to it. The response headers `x-switchyard-cascade-stage|model|scores|thresholds`
are set before the first byte; `usage` is the stages' (`CascadeLife.usage_of`). Metrics: answers by stage,
escalations by reason, judge seconds and tokens, each cascade's thresholds. A cascade with `replan:` has a
`CascadeReplanner` (gateway.cascade.replanner): its arrivals and answers are fed to it, a shadowed request's
other stages run after its answer is out (`_shadow_dispatch`, `_shadow_judge`), and `run_replans` is the
background work that re-plans its thresholds (`set_thresholds`). `cluster_complete`: the `cluster` judge's
call through this gateway's own fleet.
Must not: decide anything of the cascade (the life does), route (the policies do), parse HTTP or format chunks
(the API layer does).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gateway.cascade.core import (
    Answer,
    AskJudge,
    CascadeLife,
    CascadeSpec,
    Effect,
    Fail,
    JudgeBreaker,
    RunStage,
    Stage,
)
from gateway.cascade.judge import CompletionResult, Judge, JudgeRequest, JudgeTransportError, Verdict
from gateway.cascade.replanner import CascadeReplanner, StageAnswer, load_planning_profile
from gateway.config import CascadeConfig
from gateway.dispatch.dispatcher import Dispatcher, EventSink, NoEngineAvailable
from gateway.dispatch.features import RoutingHints
from gateway.domain import (
    Admitted,
    ChatTurn,
    Delta,
    EngineEvent,
    EngineId,
    EngineRequest,
    EngineStreamError,
    Finished,
)
from gateway.observability.metrics import GatewayMetrics
from switchyard.clock import Clock

log = logging.getLogger(__name__)

STAGE_HEADER = "x-switchyard-cascade-stage"
MODEL_HEADER = "x-switchyard-cascade-model"
SCORES_HEADER = "x-switchyard-cascade-scores"
DEGRADED_HEADER = "x-switchyard-cascade-degraded"
THRESHOLDS_HEADER = "x-switchyard-cascade-thresholds"  # the thresholds the request ran under (re-planned)


class CascadeUnavailable(Exception):
    """No stage could run: no engine serves any of the cascade's models (nothing held to answer with)."""


def spec_of(config: CascadeConfig) -> CascadeSpec:
    return CascadeSpec(
        config.name, tuple(Stage(s.model, s.threshold) for s in config.stages), config.on_judge_failure
    )


class _StageTokens:
    """A stage stream's exact token counts, as its engine reports them (`Admitted`, then `Finished`)."""

    __slots__ = ("prompt_tokens", "completion_tokens", "finished")

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.finished = False

    def _note(self, event: EngineEvent) -> None:
        if isinstance(event, Admitted):
            self.prompt_tokens = event.prompt_tokens
        elif isinstance(event, Finished):
            self.prompt_tokens = event.prompt_tokens or self.prompt_tokens
            self.completion_tokens = event.completion_tokens
            self.finished = True


class StageBuffer(_StageTokens):
    """An `EventSink` that keeps a buffered stage's events (one choice) and its text."""

    __slots__ = ("events", "texts", "_touch")

    def __init__(self, touch: Callable[[], None]) -> None:
        super().__init__()
        self.events: list[EngineEvent] = []
        self.texts: list[str] = []
        self._touch = touch

    async def on_event(self, index: int, event: EngineEvent) -> None:
        self._touch()  # the engines are not quiet: the client's idle-stream bound must not trip
        self.events.append(event)
        if isinstance(event, Delta):
            self.texts.append(event.text)
        self._note(event)

    @property
    def text(self) -> str:
        return "".join(self.texts)


class _Counting(_StageTokens):
    """The client's sink, noting whether any event reached it (after that, no stage can be taken back); with
    `texts` (a shadowed request) it keeps the text too, for the judge after the answer."""

    __slots__ = ("sink", "events", "texts")

    def __init__(self, sink: EventSink, texts: list[str] | None = None) -> None:
        super().__init__()
        self.sink = sink
        self.events = 0
        self.texts = texts

    async def on_event(self, index: int, event: EngineEvent) -> None:
        self.events += 1
        if self.texts is not None and isinstance(event, Delta):
            self.texts.append(event.text)
        self._note(event)
        await self.sink.on_event(index, event)


def judge_request(request: EngineRequest, answer: str, judged_model: str) -> JudgeRequest:
    """The judge's view of a stage answer: the user's turns, the assistant's earlier turns, the answer."""
    if request.messages is not None:
        questions = tuple(m.content for m in request.messages if m.role == "user") or ("",)
        answers = tuple(m.content for m in request.messages if m.role == "assistant")[: len(questions) - 1]
        answers = answers + ("",) * (len(questions) - 1 - len(answers))
    else:
        questions, answers = (request.prompt_text or "",), ()
    return JudgeRequest(questions=questions, answers=answers, answer=answer, judged_model=judged_model)


class CascadeRunner:
    """The gateway's cascades; `run` serves one request of one of them."""

    def __init__(
        self,
        cascades: Sequence[CascadeConfig],
        *,
        dispatcher: Dispatcher,
        judges: Mapping[str, Judge],
        metrics: GatewayMetrics,
        clock: Clock,
    ) -> None:
        self.configs = {c.name: c for c in cascades}
        self.specs = {c.name: spec_of(c) for c in cascades}
        self.breakers = {c.name: JudgeBreaker(c.judge.failures_to_skip, c.judge.skip_s) for c in cascades}
        self._dispatcher = dispatcher
        self._judges = dict(judges)
        self._metrics = metrics
        self._clock = clock
        for name in self.specs:
            self._show_thresholds(name)
        # Re-planning (`replan:`): ConfigError naming the cascade when its quality profile cannot serve.
        self.replanners: dict[str, CascadeReplanner] = {}
        for index, c in enumerate(cascades):
            if c.replan is not None:
                self.replanners[c.name] = CascadeReplanner(
                    c,
                    load_planning_profile(index, c),
                    current=functools.partial(self._thresholds, c.name),
                    swap=functools.partial(self.set_thresholds, c.name),
                    dispatch=self._shadow_dispatch,
                    judge=functools.partial(self._shadow_judge, c.name),
                    metrics=metrics,
                    clock=clock,
                )

    def names(self) -> list[str]:
        return list(self.specs)

    def set_thresholds(self, name: str, thresholds: Sequence[float]) -> None:
        """Swap a cascade's thresholds (a re-plan): requests already running keep the spec they started
        with."""
        self.specs[name] = self.specs[name].with_thresholds(thresholds)
        self._show_thresholds(name)

    def _thresholds(self, name: str) -> tuple[float, ...]:
        return self.specs[name].thresholds

    def _show_thresholds(self, name: str) -> None:
        for stage, threshold in enumerate(self.specs[name].thresholds):
            self._metrics.cascade_threshold.labels(name, str(stage)).set(threshold)

    async def run_replans(self) -> None:
        """The re-planning cascades' windows, until cancelled (the app's background work)."""
        await asyncio.gather(*(r.run() for r in self.replanners.values()))

    def view(self) -> list[dict[str, Any]]:
        """GET /v1/cascades: each cascade's models and thresholds now, and its re-planning state."""
        out = []
        for name, spec in self.specs.items():
            config = self.configs[name]
            replanner = self.replanners.get(name)
            out.append({
                "name": name, "models": list(spec.models), "thresholds": list(spec.thresholds),
                "streaming": config.streaming, "on_judge_failure": config.on_judge_failure,
                "judge": config.judge.kind,
                "replan": replanner.view() if replanner is not None else None,
            })
        return out

    async def close(self) -> None:
        for replanner in self.replanners.values():
            await replanner.close()  # the shadows use the judges
        for judge in self._judges.values():
            await judge.close()

    async def _shadow_dispatch(self, request: EngineRequest) -> StageAnswer:
        """A shadowed request's stage: an ordinary dispatch, buffered (nothing reaches any client)."""
        buffer = StageBuffer(_nothing)
        await self._dispatcher.run([request], RoutingHints(arrival_s=self._clock.now()), buffer)
        if not buffer.finished:
            raise EngineStreamError(f"{request.model}: the stream ended without a finish")
        return StageAnswer(buffer.text, buffer.prompt_tokens, buffer.completion_tokens)

    async def _shadow_judge(self, name: str, request: EngineRequest, answer: str, model: str) -> Verdict:
        return await self._judges[name].judge(judge_request(request, answer, model))

    async def run(
        self,
        name: str,
        request: EngineRequest,
        hints: RoutingHints,
        sink: EventSink,
        *,
        set_headers: Callable[[Mapping[str, str]], None],
        touch: Callable[[], None],
    ) -> CascadeLife:
        """Serve `request` (one choice, addressed to cascade `name`) into `sink`. Raises what
        `Dispatcher.run` raises for a stage no held answer can stand in for, `CascadeUnavailable` when no
        stage can run; returns the life (its `usage_of` is the response's usage)."""
        spec = self.specs[name]
        config = self.configs[name]
        life = CascadeLife(spec, self.breakers[name])
        buffers: dict[int, StageBuffer] = {}
        live_last = config.streaming == "final_live"
        replanner = self.replanners.get(name)
        shadow = replanner.on_arrival() if replanner is not None else False
        effect: Effect = life.start()
        while True:
            if isinstance(effect, RunStage):
                stage_request = dataclasses.replace(
                    request, model=effect.model, request_id=f"{request.request_id}~s{effect.index}"
                )
                stage_hints = (
                    hints
                    if effect.avoid is None
                    else dataclasses.replace(hints, avoid=frozenset({EngineId(effect.avoid)}))
                )
                if live_last and effect.index == len(spec.stages) - 1:
                    counting = _Counting(sink, [] if shadow else None)
                    set_headers(self._headers(life, effect.index, degraded=False))
                    try:
                        await self._dispatcher.run([stage_request], stage_hints, counting)
                    except NoEngineAvailable as e:
                        if counting.events:
                            raise
                        effect = life.on_stage_unavailable(str(e))
                        continue
                    effect = life.on_stage_done(
                        counting.prompt_tokens, counting.completion_tokens, self._clock.now()
                    )
                    self._count(life)
                    if replanner is not None:
                        texts = {i: b.text for i, b in buffers.items()} if shadow else None
                        if texts is not None and counting.texts is not None:
                            texts[len(spec.stages) - 1] = "".join(counting.texts)
                        replanner.on_answer(request, life, texts)
                    return life
                buffer = StageBuffer(touch)
                buffers[effect.index] = buffer
                try:
                    await self._dispatcher.run([stage_request], stage_hints, buffer)
                except NoEngineAvailable as e:
                    effect = life.on_stage_unavailable(str(e))
                    continue
                except EngineStreamError as e:
                    effect = life.on_stage_broken(e.engine_id, str(e))
                    continue
                effect = life.on_stage_done(buffer.prompt_tokens, buffer.completion_tokens, self._clock.now())
            elif isinstance(effect, AskJudge):
                buffer = buffers[effect.index]
                model = spec.stages[effect.index].model
                verdict = await self._judges[name].judge(judge_request(request, buffer.text, model))
                self._metrics.cascade_judge_seconds.labels(name, verdict.outcome).observe(verdict.latency_s)
                self._metrics.cascade_judge_tokens.labels(name, "prompt").inc(verdict.prompt_tokens)
                self._metrics.cascade_judge_tokens.labels(name, "completion").inc(verdict.completion_tokens)
                if verdict.outcome != "ok":
                    log.info(
                        "cascade %s request %s: judge %s (%s)",
                        name,
                        request.request_id,
                        verdict.outcome,
                        verdict.detail,
                    )
                effect = life.on_verdict(
                    verdict.outcome,
                    verdict.score,
                    prompt_tokens=verdict.prompt_tokens,
                    completion_tokens=verdict.completion_tokens,
                    latency_s=verdict.latency_s,
                    now_s=self._clock.now(),
                )
            elif isinstance(effect, Answer):
                set_headers(self._headers(life, effect.index, degraded=effect.degraded))
                for event in buffers[effect.index].events:
                    await sink.on_event(0, event)
                self._count(life)
                if replanner is not None:
                    texts = {i: b.text for i, b in buffers.items()} if shadow else None
                    replanner.on_answer(request, life, texts)
                return life
            else:
                assert isinstance(effect, Fail)
                self._count(life)
                raise CascadeUnavailable(effect.message)

    def _headers(self, life: CascadeLife, index: int, *, degraded: bool) -> dict[str, str]:
        scores = ",".join("-" if s is None else f"{s:g}" for s in life.scores())
        headers = {
            STAGE_HEADER: str(index),
            MODEL_HEADER: life.spec.stages[index].model,
            SCORES_HEADER: scores,
            THRESHOLDS_HEADER: ",".join(f"{t:g}" for t in life.spec.thresholds),
        }
        if degraded:
            headers[DEGRADED_HEADER] = "true"
        return headers

    def _count(self, life: CascadeLife) -> None:
        name = life.spec.name
        for index, record in enumerate(life.stages):
            if record.decision == "escalated":
                self._metrics.cascade_escalations.labels(name, str(index), record.reason).inc()
        answered = life.answered
        if answered is not None:
            model = life.spec.stages[answered.index].model
            self._metrics.cascade_answers.labels(
                name, str(answered.index), model, "true" if answered.degraded else "false"
            ).inc()


async def cluster_complete(
    dispatcher: Dispatcher,
    clock: Clock,
    model: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    timeout_s: float,
) -> CompletionResult:
    """The `cluster` judge's call: a chat request to `model` through this gateway's fleet."""
    request = EngineRequest(
        request_id=f"judge-{next(_JUDGE_IDS)}",
        model=model,
        messages=tuple(ChatTurn(m["role"], m["content"]) for m in messages),
        max_tokens=max_tokens,
        temperature=0.0,
    )
    buffer = StageBuffer(_nothing)
    try:  # `timeout_s` bounds the call in `ClusterJudge`, which cancels this on expiry
        await dispatcher.run([request], RoutingHints(arrival_s=clock.now()), buffer)
    except NoEngineAvailable as e:
        raise JudgeTransportError("unreachable", str(e)) from None
    except EngineStreamError as e:
        raise JudgeTransportError("http_5xx", str(e)) from None
    finish = next((e for e in reversed(buffer.events) if isinstance(e, Finished)), None)
    return CompletionResult(
        text=buffer.text,
        prompt_tokens=buffer.prompt_tokens,
        completion_tokens=buffer.completion_tokens,
        finish_reason=finish.finish_reason if finish is not None else "stop",
        refusal=None,
    )


_JUDGE_IDS = itertools.count()


def _nothing() -> None:
    return None
