"""STAR's rounds in the agent (`engine_agent.star.live`): oracle and MLP predictions on a sim backend, counted
down between taps; a round's push carries the predictions and `engine_summary` of them, other pushes carry
none; ended requests disappear; current lengths only without a predictor; what may be cut; start-up errors."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
from pydantic import ValidationError

from engine_agent.__main__ import main as agent_main
from engine_agent.backends.base import Capabilities
from engine_agent.backends.sim import SimBackend
from engine_agent.config import AgentConfig
from engine_agent.domain import HiddenStateBatch, HiddenStateSample, RequestId
from engine_agent.server import AgentStartupError, StarSetup, open_star
from engine_agent.service import AgentService
from engine_agent.star.history import HistoryTable
from engine_agent.star.live import MlpPredictor, PredictionRow, RunningRequest, StarLive
from engine_agent.star.mlp import MLP
from engine_agent.star.predictor import LengthPredictor, PredictorMeta
from engine_agent.tokenization import Tokenizer
from switchyard.clock import MonotonicClock
from switchyard.profiles import get_profile
from switchyard.proto_gen import engine_agent_pb2 as pb
from switchyard.star_load import DEFAULT_HORIZON, engine_summary

PROFILE = get_profile("h100-llama3-8b")
HIDDEN = PROFILE.model.hidden_size
K = 5  # tap interval (decode steps per round) in these tests
TOKENIZER = Tokenizer.load_sim()


def constant_predictor(hidden_size: int, tokens: float) -> LengthPredictor:
    """An MLP that predicts `tokens` for every hidden state (zero first layer, bias 1, scale `tokens`)."""
    mlp = MLP([np.zeros((hidden_size, 1), np.float32), np.ones((1, 1), np.float32)],
              [np.ones(1, np.float32), np.zeros(1, np.float32)])
    return LengthPredictor(
        mlp=mlp, input_mean=np.zeros(hidden_size, np.float32), input_std=np.ones(hidden_size, np.float32),
        meta=PredictorMeta(model="m", hidden_size=hidden_size, widths=(1,), target_scale=tokens, seed=0),
        history=HistoryTable(edges=np.zeros(1), means=np.zeros(1)), test_request_ids=np.array([], np.str_),
    )


def _backend(engine_id: str, interval: int | None = K) -> SimBackend:
    return SimBackend(PROFILE, clock=MonotonicClock(), engine_id=engine_id, vocab_size=TOKENIZER.vocab_size,
                      eos_token_id=TOKENIZER.eos_token_id, hidden_state_interval=interval)


def _request(rid: str, prompt: int, output: int) -> pb.GenerateRequest:
    request = pb.GenerateRequest(request_id=rid)
    request.prompt_token_ids.ids.extend([200 + i for i in range(prompt)])
    request.sampling.max_tokens = output
    request.sampling.ignore_eos = True  # the sim's decided length is max_tokens
    return request


@dataclass
class Agent:
    """A sim backend, a service with STAR's rounds, the rounds' task and one WatchState watcher."""

    backend: SimBackend
    service: AgentService
    live: StarLive
    pushes: list[pb.EngineState]
    tasks: list[asyncio.Task[None]]

    async def run(self, rid: str, prompt: int, output: int) -> int:
        tokens = 0
        async with self.service.serving(self.service.open_generate(_request(rid, prompt, output))) as events:
            async for event in events:
                tokens += len(event.delta.token_ids)
        return tokens

    def rounds(self) -> list[pb.EngineState]:
        return [p for p in self.pushes if p.HasField("future_load")]


@contextlib.asynccontextmanager
async def agent(config: AgentConfig, engine_id: str) -> AsyncIterator[Agent]:
    backend = _backend(engine_id, config.hidden_state_interval)
    setup = await open_star(config, backend, Capabilities.of(backend))
    assert setup is not None
    live = setup.live
    service = AgentService(backend, TOKENIZER, clock=MonotonicClock(), state_interval_s=0.05,
                           on_stream_end=lambda end: live.forget(end.request_id), star=live)
    await backend.start()
    setup.check_hidden_size(backend)
    service.mark_started()
    pushes: list[pb.EngineState] = []

    async def watch() -> None:
        async for state in service.WatchState(pb.WatchStateRequest(interval_ms=30), None):  # type: ignore[arg-type]
            pushes.append(state)

    tasks = [asyncio.create_task(setup.run(backend, service, 0.01)), asyncio.create_task(watch())]
    try:
        yield Agent(backend, service, live, pushes, tasks)
    finally:
        await backend.stop()
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _summary(state: pb.EngineState) -> list[float]:
    pairs = [(p.current_tokens, p.predicted_remaining_tokens) for p in state.predictions]
    return engine_summary(pairs, state.future_load.tokens_per_round, DEFAULT_HORIZON)


PROMPTS = {"a": 12, "b": 30, "c": 7}
OUTPUTS = {"a": 60, "b": 90, "c": 45}


async def test_oracle_rounds_carry_exact_remaining_and_the_summary_once_each() -> None:
    async with agent(AgentConfig(length_predictor="oracle", hidden_state_interval=K), "live-0") as a:
        produced = await asyncio.gather(*(a.run(rid, PROMPTS[rid], OUTPUTS[rid]) for rid in PROMPTS))
        await asyncio.sleep(0.1)  # the empty round after the last request, and a push of it
    assert produced == [OUTPUTS[rid] for rid in PROMPTS]
    rounds = a.rounds()
    numbers = [p.future_load.round for p in rounds]
    assert len(rounds) >= 5 and numbers == sorted(set(numbers))  # each round in one push only
    between = [p for p in a.pushes if not p.HasField("future_load")]
    assert between and all(not p.predictions for p in between)  # pushes between rounds carry none
    predicted = [p for p in rounds if p.predictions]
    assert len(predicted) >= 4
    for state in predicted:
        assert state.future_load.tokens_per_round == K and len(state.future_load.load) == DEFAULT_HORIZON
        assert list(state.future_load.load) == pytest.approx(_summary(state))
        for p in state.predictions:
            assert p.current_tokens == PROMPTS[p.request_id] + p.generated_tokens
            # exact, at the round's generated count (the tap's prediction counted down since)
            assert p.predicted_remaining_tokens == OUTPUTS[p.request_id] - p.generated_tokens
    seen = {p.request_id: [] for p in predicted[0].predictions}  # type: dict[str, list[float]]
    for state in predicted:
        for p in state.predictions:
            seen.setdefault(p.request_id, []).append(p.predicted_remaining_tokens)
    assert all(v == sorted(v, reverse=True) and len(v) >= 2 for v in seen.values())  # counted down
    assert any(p.migratable for state in predicted for p in state.predictions)
    assert a.live.latest is not None and rounds[-1].future_load.round == a.live.latest.round
    assert not rounds[-1].predictions and list(rounds[-1].future_load.load) == [0.0] * DEFAULT_HORIZON
    assert a.live.tracked == 0  # ended requests are forgotten


async def test_mlp_predictions_reach_the_push(tmp_path: Path) -> None:
    path = tmp_path / "p.npz"
    await asyncio.to_thread(constant_predictor(HIDDEN, 400.0).save, path)
    config = AgentConfig(length_predictor=str(path), hidden_state_interval=K)
    async with agent(config, "live-1") as a:
        await asyncio.gather(a.run("a", 12, 60), a.run("b", 30, 90))
    predicted = [p for p in a.rounds() if p.predictions]
    assert len(predicted) >= 4
    for state in predicted:
        assert list(state.future_load.load) == pytest.approx(_summary(state))
        for p in state.predictions:
            # 400 at the tap, counted down by the few tokens generated since
            assert 400 - 2 * K <= p.predicted_remaining_tokens <= 400
    stats = a.live.stats
    assert stats.batches_predicted >= 4 and stats.predict_s_total > 0 and stats.loop_blocked_s_max < 0.05


async def test_current_lengths_only_without_a_predictor() -> None:
    async with agent(AgentConfig(star_report=True, hidden_state_interval=None), "live-2") as a:
        await asyncio.gather(a.run("a", 12, 80), a.run("b", 30, 120))
        await asyncio.sleep(0.1)
    rounds = a.rounds()
    predicted = [p for p in rounds if p.predictions]
    assert len(predicted) >= 3 and a.live.round_tokens == 20
    for state in predicted:
        total = sum(p.current_tokens for p in state.predictions)
        assert list(state.future_load.load) == [float(total)] * DEFAULT_HORIZON
        for p in state.predictions:
            assert p.predicted_remaining_tokens == 0.0 and p.current_tokens == PROMPTS[p.request_id] + \
                p.generated_tokens
    assert any(p.migratable for state in predicted for p in state.predictions)
    assert not rounds[-1].predictions  # the last request ended: an empty round


class _Fixed:
    """A predictor answering fixed values per request id (NaN for unknown ones)."""

    def __init__(self, values: Mapping[str, float]) -> None:
        self.values = values

    async def predict(self, samples: Sequence[HiddenStateSample]) -> Any:
        return np.array([self.values.get(s.request_id, np.nan) for s in samples], dtype=np.float64)


@dataclass
class _Req:
    prompt_tokens: int
    output_tokens: int
    migratable: bool = True


def _batch(*samples: tuple[str, int]) -> HiddenStateBatch:
    return HiddenStateBatch(step=0, timestamp_s=0.0, samples=tuple(
        HiddenStateSample(RequestId(rid), g, np.zeros(4, np.float32)) for rid, g in samples))


def _rows(live: StarLive) -> dict[str, PredictionRow]:
    assert live.latest is not None
    return {r.request_id: r for r in live.latest.predictions}


async def test_count_down_between_taps_and_what_is_migratable() -> None:
    running: dict[RequestId, RunningRequest] = {
        RequestId("x"): _Req(10, 27), RequestId("y"): _Req(5, 3), RequestId("z"): _Req(8, 0),
    }
    live = StarLive(round_tokens=K, predictor=_Fixed({"x": 100.0, "y": 50.0}))
    live.attach(lambda: running)
    await live.on_batch(_batch(("x", 20), ("y", 3)))
    rows = _rows(live)
    assert set(rows) == {"x", "y"}  # z is in its prefill: not reported
    assert rows["x"].predicted_remaining_tokens == 93  # 100 at 20 generated, 7 more since
    assert rows["x"].current_tokens == 37 and rows["x"].migratable
    running[RequestId("x")] = _Req(10, 40)
    running[RequestId("y")] = _Req(5, 9, migratable=False)  # e.g. being cut
    live._predictor = _Fixed({"y": 44.0})
    await live.on_batch(_batch(("y", 9)))  # x not in this tap: its older prediction counts down
    rows = _rows(live)
    assert rows["x"].predicted_remaining_tokens == 80 and not rows["x"].migratable  # not decoding at the tap
    assert rows["y"].predicted_remaining_tokens == 44 and not rows["y"].migratable
    running[RequestId("w")] = _Req(4, 2)  # never predicted: N-hat 0, not migratable
    await live.on_batch(_batch(("x", 40)))
    rows = _rows(live)
    assert rows["w"].predicted_remaining_tokens == 0 and not rows["w"].migratable
    assert live.latest is not None and live.latest.round == 3
    del running[RequestId("x")]
    live.forget(RequestId("x"))
    assert live.tracked == 1  # y
    for rid in ("y", "z", "w"):
        del running[RequestId(rid)]
        live.forget(RequestId(rid))
    assert live.tracked == 0 and live.latest.round == 4 and not live.latest.predictions


async def test_a_request_being_cut_or_still_loading_is_not_migratable() -> None:
    source, target = _backend("cut-0", None), _backend("cut-1", None)
    services = [AgentService(b, TOKENIZER, clock=MonotonicClock(), state_interval_s=0.05)
                for b in (source, target)]
    for b, s in zip((source, target), services, strict=True):
        await b.start()
        s.mark_started()

    class Context:
        def __init__(self) -> None:
            self.admitted, self.first_token = asyncio.Event(), asyncio.Event()

        async def write(self, event: pb.GenerateEvent) -> None:
            self.admitted.set()
            if event.delta.token_ids:
                self.first_token.set()

        async def abort(self, code: Any, message: str) -> None:
            raise AssertionError(f"{code}: {message}")

    try:
        rid = RequestId("m")
        async with services[0].serving(services[0].open_generate(_request(rid, 20, 200))) as events:
            stream = aiter(events)
            while services[0].running_requests()[rid].output_tokens < 10:
                await anext(stream)
            assert services[0].running_requests()[rid].migratable
            cut = asyncio.create_task(services[0].MigrateOut(  # type: ignore[arg-type]
                pb.MigrateOutRequest(request_id=rid, target="cut-1"), Context()))
            await asyncio.sleep(0)
            assert not services[0].running_requests()[rid].migratable  # being cut
            async for _ in stream:
                pass
        ticket = await cut
        context = Context()
        resumed = asyncio.create_task(services[1].MigrateIn(  # type: ignore[arg-type]
            pb.MigrateInRequest(ticket=ticket), context))
        await context.admitted.wait()
        loading = services[1].running_requests()[rid]
        assert loading.output_tokens == len(ticket.output_token_ids.ids) and not loading.migratable
        await context.first_token.wait()
        assert loading.migratable  # it produced a token here
        await resumed
    finally:
        for b in (source, target):
            await b.stop()


async def test_start_up_errors(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="--length-predictor needs the hidden-state tap"):
        AgentConfig(length_predictor="oracle", hidden_state_interval=None)
    with pytest.raises(ValidationError, match="--length-predictor oracle needs the sim backend"):
        AgentConfig(backend="vllm", model_dir="/m", length_predictor="oracle")
    backend = _backend("err-0")
    junk = tmp_path / "junk.npz"
    await asyncio.to_thread(junk.write_bytes, b"not a zip")
    with pytest.raises(AgentStartupError, match=r"--length-predictor .*junk.npz: not a length-predictor"):
        await open_star(AgentConfig(length_predictor=str(junk)), backend, Capabilities.of(backend))
    with pytest.raises(AgentStartupError, match=r"absent.npz: no such file"):
        await open_star(AgentConfig(length_predictor=str(tmp_path / "absent.npz")), backend,
                        Capabilities.of(backend))
    narrow = tmp_path / "narrow.npz"
    await asyncio.to_thread(constant_predictor(8, 10.0).save, narrow)
    with pytest.raises(AgentStartupError, match=f"size 8 .*this engine's are of size {HIDDEN}"):
        await open_star(AgentConfig(length_predictor=str(narrow)), backend, Capabilities.of(backend))
    # vLLM knows its hidden size only once started: the check then
    setup = StarSetup(StarLive(round_tokens=K), None, MlpPredictor(constant_predictor(8, 10.0)))
    with pytest.raises(AgentStartupError, match=f"size 8, but this engine's are of size {HIDDEN}"):
        setup.check_hidden_size(backend)
    untapped = _backend("err-1", None)
    config = AgentConfig.model_construct(**{**AgentConfig().model_dump(), "length_predictor": "oracle"})
    with pytest.raises(AgentStartupError, match="needs the hidden-state tap"):
        await open_star(config, untapped, Capabilities.of(untapped))
    assert await open_star(AgentConfig(), backend, Capabilities.of(backend)) is None


def _watch(service: AgentService) -> AsyncGenerator[pb.EngineState, None]:
    """One WatchState watcher at the agent's own interval (the servicer's generator; no gRPC context)."""
    watcher = service.WatchState(pb.WatchStateRequest(), None)  # type: ignore[arg-type]
    return cast(AsyncGenerator[pb.EngineState, None], watcher)


async def test_a_new_round_is_pushed_at_once_and_to_each_watcher_once() -> None:
    backend = _backend("push-0", None)
    live = StarLive(round_tokens=K)
    running: dict[RequestId, RunningRequest] = {RequestId("x"): _Req(10, 5)}
    live.attach(lambda: running)
    service = AgentService(backend, TOKENIZER, clock=MonotonicClock(), state_interval_s=10.0, star=live)
    first_watcher = _watch(service)
    try:
        first = await anext(first_watcher)
        assert not first.HasField("future_load") and not first.predictions
        pending = asyncio.ensure_future(anext(first_watcher))
        await asyncio.sleep(0.05)
        assert not pending.done()  # nothing changed: the next push waits for the 10 s interval
        live.round_now()
        state = await asyncio.wait_for(pending, 1.0)  # the round is pushed at once
        assert state.future_load.round == 1 and [p.request_id for p in state.predictions] == ["x"]
        assert list(state.future_load.load) == [15.0] * DEFAULT_HORIZON
        late_watcher = _watch(service)
        try:
            joined = await anext(late_watcher)  # a new watcher's first push has the latest round
            assert joined.future_load.round == 1 and len(joined.predictions) == 1
        finally:
            await late_watcher.aclose()
        pending = asyncio.ensure_future(anext(first_watcher))
        await asyncio.sleep(0.05)
        assert not pending.done()  # the round was sent to this watcher already
        pending.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pending
    finally:
        await first_watcher.aclose()


def test_a_bad_predictor_file_stops_the_agent_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.npz"
    bad.write_text(json.dumps({"not": "a predictor"}))
    assert agent_main(["--length-predictor", str(bad), "--port", "0"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(err) == 1 and "engine_agent: error: --length-predictor" in err[0] and "bad.npz" in err[0], err
