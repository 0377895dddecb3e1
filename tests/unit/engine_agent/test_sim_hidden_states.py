"""The sim's synthetic hidden states: shape, determinism, a learnable remaining-length signal, and the
backend's tap cadence (one batch every k decode steps, one vector per decoding request). The cost of a tap
is measured by benchmarks/sim_iteration_time.py."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from engine_agent.backends.sim import SimBackend
from engine_agent.domain import BackendRequest, HiddenStateBatch, RequestId, SamplingSpec
from engine_agent.sim.engine import SimEngine
from engine_agent.sim.hidden_states import HiddenStateNoise, SyntheticHiddenStates
from switchyard.clock import MonotonicClock
from switchyard.profiles import get_profile

PROFILE = get_profile("h100-llama3-8b")
HIDDEN = PROFILE.model.hidden_size


def test_vectors_shape_range_and_persistence() -> None:
    model = SyntheticHiddenStates(HIDDEN, PROFILE.model.name, seed=1)
    v = model.vectors(["a", "b", "c"], [10, 200, 3000], [1, 50, 400], [500, 20, 1])
    assert v.shape == (3, 4096) and v.dtype == np.float32
    assert np.all(np.abs(v) < 1.0) and np.isfinite(v).all()
    assert model.vectors([], [], [], []).shape == (0, 4096)
    # Same model name: the same projection (engines of one model agree); the per-step noise differs.
    other = SyntheticHiddenStates(HIDDEN, PROFILE.model.name, seed=2)
    again = other.vectors(["a", "b", "c"], [10, 200, 3000], [1, 50, 400], [500, 20, 1])
    assert not np.array_equal(v, again)
    assert np.corrcoef(v[0], again[0])[0, 1] > 0.5  # signal and persistent noise are shared
    assert HiddenStateNoise().snr == pytest.approx(1.0)


def _engine_samples(num_requests: int, interval: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Drive a SimEngine in virtual time with ShareGPT-like drawn lengths; tap every `interval` decode steps.

    Returns (vectors, log1p(remaining), request index, number of taps)."""
    engine = SimEngine(PROFILE, seed=5)
    model = SyntheticHiddenStates(HIDDEN, PROFILE.model.name, seed=5)
    rng = np.random.default_rng(11)
    for i in range(num_requests):
        prompt = int(np.clip(rng.lognormal(5.5, 1.0), 4, 4000))
        sampling = SamplingSpec(max_tokens=1024)
        engine.add_request(BackendRequest(RequestId(f"r{i}"), (7,) * prompt, sampling), 0.0)
    vectors, targets, owners = [], [], []
    now_s, decode_steps, taps = 0.0, 0, 0
    while engine.has_work():
        result = engine.step(now_s)
        now_s += result.duration_s
        if not result.record.num_decode_seqs:
            continue
        decode_steps += 1
        if decode_steps % interval:
            continue
        ids, prompt_tokens, generated, remaining = engine.decoding_requests()
        taps += 1
        vectors.append(model.vectors(ids, prompt_tokens, generated, remaining))
        targets.extend(np.log1p(remaining))
        owners.extend(int(rid[1:]) for rid in ids)
    return np.concatenate(vectors), np.asarray(targets), np.asarray(owners), taps


def test_ridge_regression_predicts_log_remaining_on_held_out_requests() -> None:
    x, y, owner, _ = _engine_samples(num_requests=150, interval=32)
    train = owner % 3 != 0  # held-out requests: every third one
    assert 800 < train.sum() < 3000 and (~train).sum() > 300
    mean_x, mean_y = x[train].mean(axis=0), y[train].mean()
    xt = (x[train] - mean_x).astype(np.float64)
    # Ridge regression in its dual form (fewer samples than dimensions): w = X^T (X X^T + lambda I)^-1 y,
    # solved for the true targets and, as a control, for the targets shuffled across samples.
    shuffled = y[np.random.default_rng(0).permutation(len(y))]
    targets = np.stack([y[train], shuffled[train]], axis=1) - mean_y
    gram = xt @ xt.T
    alpha = np.linalg.solve(gram + 10.0 * np.eye(len(gram)), targets)
    predicted, control = ((x[~train] - mean_x) @ (xt.T @ alpha) + mean_y).T
    held_out = y[~train]
    total = ((held_out - held_out.mean()) ** 2).sum()
    r2 = 1.0 - float(((predicted - held_out) ** 2).sum() / total)
    r2_control = 1.0 - float(((control - held_out) ** 2).sum() / total)
    print(f"\nridge on sim hidden states: held-out R^2 of log1p(remaining) {r2:.3f} "
          f"({train.sum()} train / {(~train).sum()} test samples; shuffled-label control {r2_control:.3f})")
    assert r2 > 0.8
    assert r2_control < 0.2


def test_tap_at_256_requests() -> None:
    model = SyntheticHiddenStates(HIDDEN, PROFILE.model.name)
    rng = np.random.default_rng(3)
    ids = [f"req-{i}" for i in range(256)]
    prompt = rng.integers(10, 4000, 256).tolist()
    generated = rng.integers(1, 1000, 256).tolist()
    remaining = rng.integers(1, 1000, 256).tolist()
    model.vectors(ids, prompt, generated, remaining)  # builds the noise bank
    out = model.vectors(ids, prompt, generated, remaining)
    assert out.shape == (256, 4096) and out.dtype == np.float32 and np.isfinite(out).all()


async def test_backend_tap_cadence_and_contents() -> None:
    # Few, short iterations: 4 requests of 120 tokens on a profile capped at 4 sequences.
    profile = dataclasses.replace(PROFILE, max_num_seqs=4)
    backend = SimBackend(profile, clock=MonotonicClock(), engine_id="tap-0", vocab_size=1000, eos_token_id=2,
                         hidden_state_interval=5)
    assert (backend.static.hidden_size, backend.static.hidden_state_interval) == (4096, 5)
    await backend.start()
    batches: list[HiddenStateBatch] = []
    subscription = backend.hidden_states()

    async def consume() -> None:
        async for batch in subscription:
            batches.append(batch)

    consumer = asyncio.create_task(consume())
    await asyncio.sleep(0)  # subscribe before the first step
    try:
        async def run(i: int) -> int:
            count = 0
            request = BackendRequest(RequestId(f"t{i}"), (5,) * (20 + i), SamplingSpec(max_tokens=60,
                                                                                    ignore_eos=True))
            async for event in backend.generate(request):
                count += len(getattr(event, "token_ids", ()))
            return count

        assert await asyncio.gather(*(run(i) for i in range(4))) == [60] * 4
        await asyncio.sleep(0.05)
    finally:
        await backend.stop()
        await asyncio.wait_for(consumer, 1.0)
    # All four prefill together in step 1; decode steps 1..59 produce tokens 2..60 (step 1 also decodes
    # nothing): taps at decode steps 5, 10, ..., 55 with all four requests decoding.
    assert [b.step for b in batches] == list(range(5, 60, 5))
    for batch in batches:
        assert sorted(s.request_id for s in batch.samples) == ["t0", "t1", "t2", "t3"]
        for sample in batch.samples:
            assert sample.vector.shape == (4096,) and sample.vector.dtype == np.float32
            assert sample.generated_tokens == batch.step + 1
    assert [b.timestamp_s for b in batches] == sorted(b.timestamp_s for b in batches)
