"""STAR's hidden-state recorder: labels y = final - generated from a sim backend run, drops aborted requests,
bounds its memory, writes readable shards; the agent flag's checks; collect -> train -> eval end to end."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import numpy as np
import pytest

from engine_agent.backends.base import Capabilities
from engine_agent.backends.sim import SimBackend
from engine_agent.config import AgentConfig
from engine_agent.domain import HiddenStateBatch, HiddenStateSample, RequestId
from engine_agent.server import AgentStartupError, open_recorder
from engine_agent.service import AgentService, StreamEnd
from engine_agent.star.recorder import HiddenStateRecorder
from engine_agent.star.shards import ShardError, ShardWriter, load_shards
from engine_agent.tokenization import Tokenizer
from launcher.cli import main as switchyard_main
from switchyard.clock import MonotonicClock
from switchyard.profiles import get_profile
from switchyard.proto_gen import engine_agent_pb2 as pb

PROFILE = get_profile("h100-llama3-8b")
HIDDEN = PROFILE.model.hidden_size


def _writer(directory: Path, hidden_size: int = 4) -> ShardWriter:
    writer = ShardWriter(directory, model="m", hidden_size=hidden_size, prefix="engine/0")
    writer.prepare()
    return writer


def _batch(*samples: tuple[str, int]) -> HiddenStateBatch:
    return HiddenStateBatch(step=0, timestamp_s=0.0, samples=tuple(
        HiddenStateSample(RequestId(rid), g, np.full(4, g, dtype=np.float32)) for rid, g in samples))


async def test_labels_drops_late_samples_and_writes_a_shard_per_n_requests(tmp_path: Path) -> None:
    recorder = HiddenStateRecorder(_writer(tmp_path), shard_requests=2)
    recorder.observe(_batch(("a", 5), ("b", 5), ("c", 5)))
    recorder.observe(_batch(("a", 10), ("b", 10)))
    recorder.on_stream_end(StreamEnd(RequestId("b"), prompt_tokens=3, output_tokens=None))  # aborted: dropped
    recorder.on_stream_end(StreamEnd(RequestId("a"), prompt_tokens=7, output_tokens=12))
    recorder.observe(_batch(("a", 12), ("c", 10)))  # a's late sample is ignored
    assert recorder.buffered_rows == 4  # a's two (pending), c's two (open)
    recorder.on_stream_end(StreamEnd(RequestId("c"), prompt_tokens=9, output_tokens=30))  # 2 done: a shard
    stats = await recorder.aclose()
    assert (stats.requests_written, stats.rows_written, stats.shards_written) == (2, 4, 1)
    assert stats.requests_dropped == 1 and stats.write_errors == 0 and recorder.buffered_rows == 0
    data = load_shards([tmp_path])
    rows = data.rows
    assert data.model == "m" and data.hidden_size == 4
    assert [p.name for p in data.files] == ["engine_0-00000.npz"]
    assert rows.request_ids.tolist() == ["a", "a", "c", "c"]
    assert rows.generated_tokens.tolist() == [5, 10, 5, 10]
    assert rows.remaining_tokens.tolist() == [7, 2, 25, 20]
    assert rows.prompt_tokens.tolist() == [7, 7, 9, 9] and rows.output_tokens.tolist() == [12, 12, 30, 30]
    assert rows.vectors.dtype == np.float16 and rows.vectors[:, 0].tolist() == [5, 10, 5, 10]


async def test_memory_is_bounded(tmp_path: Path) -> None:
    recorder = HiddenStateRecorder(_writer(tmp_path), shard_requests=100, max_buffered_rows=3)
    recorder.observe(_batch(("a", 1), ("b", 1)))
    recorder.observe(_batch(("a", 2), ("b", 2)))  # the 4th sample is over the bound
    assert recorder.buffered_rows == 3 and recorder.stats.samples_dropped == 1
    recorder.on_stream_end(StreamEnd(RequestId("a"), 1, 9))  # 2 pending >= 3 // 2: written at once
    await asyncio.sleep(0)
    stats = await recorder.aclose()
    assert stats.rows_written == 2 and stats.requests_written == 1


def test_a_shard_directory_that_is_missing_or_mixed_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ShardError, match="no such directory"):
        load_shards([tmp_path / "absent"])
    with pytest.raises(ShardError, match="no shards"):
        load_shards([tmp_path])
    (tmp_path / "x.npz").write_bytes(b"junk")
    with pytest.raises(ShardError, match="x.npz: not a hidden-state shard"):
        load_shards([tmp_path])


async def test_sim_run_labels_final_minus_generated_and_drops_aborted(tmp_path: Path) -> None:
    tokenizer = Tokenizer.load_sim()
    backend = SimBackend(PROFILE, clock=MonotonicClock(), engine_id="rec-0", vocab_size=tokenizer.vocab_size,
                         eos_token_id=tokenizer.eos_token_id, hidden_state_interval=3)
    capabilities = Capabilities.of(backend)
    assert capabilities.hidden_state_source is backend
    recorder = HiddenStateRecorder(ShardWriter(tmp_path, model=backend.static.model, hidden_size=HIDDEN,
                                               prefix="rec-0"))
    await asyncio.to_thread(tmp_path.mkdir, exist_ok=True)
    service = AgentService(backend, tokenizer, clock=MonotonicClock(), state_interval_s=0.05,
                           capabilities=capabilities, on_stream_end=recorder.on_stream_end)
    await backend.start()
    service.mark_started()
    task = asyncio.create_task(recorder.run(backend.hidden_states()))

    async def run(rid: str, prompt: int, output: int, stop_after: int | None = None) -> int:
        request = pb.GenerateRequest(request_id=rid, target_output_tokens=output)
        request.prompt_token_ids.ids.extend([200 + i for i in range(prompt)])
        request.sampling.max_tokens = output
        request.sampling.ignore_eos = True
        tokens = 0
        async with service.serving(service.open_generate(request)) as events:
            async for event in events:
                tokens += len(event.delta.token_ids)
                if stop_after is not None and tokens >= stop_after:
                    break  # the client goes away: the request is aborted
        return tokens

    try:
        produced = await asyncio.gather(run("keep-a", 12, 40), run("keep-b", 30, 64), run("gone", 8, 80, 20))
    finally:
        await backend.stop()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    stats = await recorder.aclose()
    assert produced[:2] == [40, 64] and stats.requests_dropped == 1 and stats.requests_written == 2
    rows = load_shards([tmp_path]).rows
    assert set(rows.request_ids.tolist()) == {"keep-a", "keep-b"}
    for rid, prompt, output in (("keep-a", 12, 40), ("keep-b", 30, 64)):
        mine = rows.request_ids == rid
        generated = rows.generated_tokens[mine]
        assert mine.sum() >= 5 and (np.diff(generated) > 0).all()
        np.testing.assert_array_equal(rows.remaining_tokens[mine], output - generated)
        assert (rows.prompt_tokens[mine] == prompt).all() and (rows.output_tokens[mine] == output).all()
    assert rows.vectors.shape[1] == HIDDEN and np.isfinite(rows.vectors).all()


async def test_the_agent_flag_needs_the_tap(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs the hidden-state tap"):
        AgentConfig(record_hidden_states=str(tmp_path), hidden_state_interval=None)
    tokenizer = Tokenizer.load_sim()
    backend = SimBackend(PROFILE, clock=MonotonicClock(), engine_id="rec-1", vocab_size=tokenizer.vocab_size,
                         eos_token_id=tokenizer.eos_token_id, hidden_state_interval=None)
    config = AgentConfig(record_hidden_states=str(tmp_path / "d"))
    with pytest.raises(AgentStartupError, match="needs the hidden-state tap"):
        await open_recorder(config, backend, Capabilities.of(backend))
    blocker = tmp_path / "file"
    await asyncio.to_thread(blocker.write_text, "x")
    tapped = SimBackend(PROFILE, clock=MonotonicClock(), engine_id="rec-2", vocab_size=tokenizer.vocab_size,
                        eos_token_id=tokenizer.eos_token_id, hidden_state_interval=20)
    with pytest.raises(AgentStartupError, match="--record-hidden-states"):
        await open_recorder(AgentConfig(record_hidden_states=str(blocker / "sub")), tapped,
                            Capabilities.of(tapped))


def test_collect_train_eval_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dataset = tmp_path / "d.jsonl"
    lengths = [30, 90, 50, 120, 70, 40, 100, 60, 80, 110, 45, 95]
    dataset.write_text("".join(json.dumps({"prompt": f"question {i} " * (i + 2), "output_tokens": n}) + "\n"
                               for i, n in enumerate(lengths)))
    shards = tmp_path / "shards"
    assert switchyard_main(["predictor", "collect", "--backend", "sim", "--profile", "h100-llama3-8b",
                            "--dataset", f"jsonl:{dataset}", "--num-requests", "12", "--out", str(shards),
                            "--hidden-state-interval", "4", "--agents", "2"]) == 0
    collected = json.loads(capsys.readouterr().out)
    assert collected["completed"] == 12 and collected["failed"] == {} and collected["requests_recorded"] == 12
    assert collected["rows"] >= sum(lengths) // 4 // 2
    model = tmp_path / "p.npz"
    assert switchyard_main(["predictor", "train", "--data", str(shards), "--out", str(model), "--widths",
                            "64,32,16", "--epochs", "3", "--quiet", "--json"]) == 0
    trained = json.loads(capsys.readouterr().out)
    assert trained["requests"] == {"train": 8, "val": 2, "test": 2} and trained["hidden_size"] == HIDDEN
    assert switchyard_main(["predictor", "eval", "--model", str(model), "--data", str(shards), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["requests"] == 2
    assert set(report["mae"]) == {"continuous", "prompt_only", "history", "oracle"}
    assert report["by_generated_bucket"] and report["mae"]["oracle"] == 0.0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["collect", "--dataset", "sharegpt", "--num-requests", "0", "--out", "x"],
         "--num-requests must be >= 1"),
        (["collect", "--profile", "nope", "--dataset", "sharegpt", "--num-requests", "1", "--out", "x"],
         "unknown profile 'nope'"),
        (["collect", "--backend", "vllm", "--dataset", "sharegpt", "--num-requests", "1", "--out", "x"],
         "--backend vllm needs --model"),
        (["collect", "--dataset", "no-such-set", "--num-requests", "1", "--out", "{tmp}"],
         "--dataset no-such-set"),
        (["train", "--data", "{tmp}/absent", "--out", "{tmp}/p.npz"], "absent: no such directory"),
        (["train", "--data", "{tmp}", "--out", "{tmp}/no/p.npz"], "does not exist"),
        (["train", "--data", "{tmp}", "--out", "{tmp}/p.npz", "--widths", "8,x"], "--widths '8,x'"),
        (["eval", "--model", "{tmp}/absent.npz", "--data", "{tmp}"], "absent.npz: no such file"),
    ],
)
def test_cli_errors_are_one_line_exit_2(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = switchyard_main(["predictor", *(a.replace("{tmp}", str(tmp_path)) for a in argv)])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
