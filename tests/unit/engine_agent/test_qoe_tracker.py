"""`engine_agent.qoe_tracker`: batch loads per request, the online fit an agent pushes, and the cross-process
join; `engine_agent.transfer_rate`. Synthetic engines with a known D and fixed seeds."""

from __future__ import annotations

import random

import pytest

from engine_agent.qoe_tracker import BatchLoads, LoadJoin, QoETracker
from engine_agent.transfer_rate import TransferRate
from switchyard.qoe import Features, LifetimeLoad, QoEModel, features

# D of the order the simulated H100 fits (`switchyard.qoe.PROFILED_QOE_D`), D4 non-zero so all five count.
TRUE_D: Features = (7e-3, 3.4e-5, 1.2e-7, 1.4e-12, 2e-8)


def _synthetic_engine(tracker: QoETracker, *, requests: int, seed: int, noise: float) -> dict[str, Features]:
    """Requests in flight on a made-up engine: each iteration's batch is a random subset of them, and a
    member's length grows by a random step (so ΣL does not follow ΣI and their lifetime loads differ in every
    feature); a request finishes after its drawn number of iterations (one output token each) with the
    latency D gives its lifetime-average F, times (1 + uniform noise). Returns each finished request's mean F,
    computed independently of the tracker (`LifetimeLoad`)."""
    rng = random.Random(seed)
    model = QoEModel(TRUE_D)
    flight: dict[str, tuple[int, int, int, LifetimeLoad]] = {}  # id -> (prompt, generated, left, load)
    finished: dict[str, Features] = {}
    started = 0
    while len(finished) < requests:
        while len(flight) < rng.randint(4, 200) and started < 10 * requests:
            flight[f"r{started}"] = (rng.randint(50, 6000), 0, rng.randint(5, 60), LifetimeLoad())
            started += 1
        batch = [rid for rid in flight if rng.random() < 0.7] or [next(iter(flight))]
        prompts = [flight[rid][0] for rid in batch]
        lengths = [flight[rid][0] + flight[rid][1] for rid in batch]
        tracker.on_iteration(batch, prompts, lengths)
        f = features(prompts, lengths)
        for rid in batch:
            prompt, generated, left, load = flight[rid]
            load.add(f)
            if left > 1:
                flight[rid] = (prompt, generated + rng.randint(1, 200), left - 1, load)
                continue
            del flight[rid]
            mean_f = load.mean()
            output_tokens = rng.randint(1, 500)
            q = model.per_request(mean_f) * (1.0 + rng.uniform(-noise, noise))
            assert tracker.on_finish(rid, q * output_tokens, output_tokens)
            finished[rid] = mean_f
    return finished


def test_noise_free_latencies_recover_d_exactly() -> None:
    tracker = QoETracker(window=400, refit_every=1)
    _synthetic_engine(tracker, requests=400, seed=1, noise=0.0)
    fit = tracker.report()
    assert fit is not None and fit.samples == 400
    assert fit.d == pytest.approx(TRUE_D, rel=1e-6)
    assert fit.mean_relative_error < 1e-9


def test_noisy_latencies_recover_d_and_predict_held_out_requests() -> None:
    tracker = QoETracker()  # the agents' defaults: a window of 2000, a refit every 50 samples
    _synthetic_engine(tracker, requests=2000, seed=2, noise=0.02)
    fit = tracker.report()
    assert fit is not None and fit.samples == 2000
    # D1 (n) and D3 (ΣI²) carry a few % of the latency here, so the noise moves them most.
    assert fit.d == pytest.approx(TRUE_D, rel=0.15)
    assert 0.009 < fit.mean_relative_error < 0.011  # the noise: uniform in +-2 %, mean 1 %
    # Requests of another run (another seed), predicted by the fitted D against the true one.
    held_out = _synthetic_engine(QoETracker(), requests=300, seed=3, noise=0.0)
    fitted, true = QoEModel(fit.d), QoEModel(TRUE_D)
    errors = [abs(fitted.per_request(f) / true.per_request(f) - 1.0) for f in held_out.values()]
    assert max(errors) < 0.01


def test_loads_are_per_iteration_means_of_the_batches_a_request_was_in() -> None:
    loads = BatchLoads()
    loads.add_batch(["a", "b"], [100, 10], [100, 10])
    loads.add_batch(["b"], [10, ], [11])
    assert loads.pop("a") == features([100, 10], [100, 10])
    b = LifetimeLoad()
    b.add(features([100, 10], [100, 10]))
    b.add(features([10], [11]))
    assert loads.pop("b") == pytest.approx(b.mean())
    assert loads.pop("b") is None and len(loads) == 0
    with pytest.raises(ValueError, match="parallel"):
        loads.add_batch(["a"], [1, 2], [1])


def test_dropped_and_unseen_requests_never_give_samples() -> None:
    tracker = QoETracker(min_samples=5, refit_every=1)
    tracker.on_iteration(["a", "b", "c"], [10, 20, 30], [11, 21, 31])
    tracker.on_drop("a")  # aborted, cancelled or migrated out
    assert not tracker.on_finish("a", 1.0, 10)
    assert not tracker.on_finish("never-ran", 1.0, 10)  # finished before any iteration here
    assert not tracker.on_finish("b", 1.0, 0)  # no output here
    assert not tracker.on_finish("c", 0.0, 10)  # no positive latency
    tracker.on_drop("unknown")  # a no-op
    assert tracker.samples_total == 0 and len(tracker.loads) == 0
    assert tracker.report() is None


def test_report_refits_only_every_refit_every_samples() -> None:
    tracker = QoETracker(window=100, min_samples=5, refit_every=10)
    rng = random.Random(4)

    def finish(n: int) -> None:
        for _ in range(n):
            rid = f"r{tracker.samples_total}"
            batch = [rid, *(f"x{i}" for i in range(rng.randint(0, 8)))]
            inputs = [rng.randint(10, 500) for _ in batch]
            tracker.on_iteration(batch, inputs, inputs)
            for other in batch[1:]:
                tracker.on_drop(other)
            assert tracker.on_finish(rid, QoEModel(TRUE_D).per_request(features(inputs, inputs)) * 4, 4)

    finish(4)
    assert tracker.report() is None  # below min_samples
    finish(1)
    first = tracker.report()
    assert first is not None and first.samples == 5
    finish(9)
    assert tracker.report() is first  # 9 new samples: no refit
    finish(1)
    second = tracker.report()
    assert second is not None and second is not first and second.samples == 15
    assert tracker.report() is second


def test_memory_is_bounded() -> None:
    loads = BatchLoads(max_requests=8)
    for i in range(20):  # requests never finished nor dropped (a backend that leaks them)
        loads.add_batch([f"r{i}"], [10], [10])
    assert (len(loads), loads.capacity, loads.forgotten) == (8, 8, 12)
    assert loads.request_ids() == [f"r{i}" for i in range(12, 20)]  # the oldest were forgotten
    tracker = QoETracker(window=30, min_samples=5, refit_every=1, max_requests=16)
    for i in range(100):
        tracker.on_iteration([f"r{i}", "other"], [10 + i, 5], [10 + i, 5])
        tracker.on_finish(f"r{i}", 0.01 * (i + 1), 1)
    tracker.on_drop("other")
    fit = tracker.report()
    assert fit is not None and fit.samples == 30 and tracker.samples_total == 100
    assert len(tracker.loads) == 0 and tracker.loads.capacity <= 16


def test_join_pairs_loads_and_finishes_in_either_order() -> None:
    tracker = QoETracker(min_samples=5)
    join = LoadJoin(tracker, max_pending=2)
    f = features([100], [150])
    join.on_finish("a", 2.0, 10)  # the agent saw the finish first
    assert tracker.samples_total == 0 and join.pending == (1, 0)
    join.on_load("a", list(f))
    join.on_load("b", f)  # the engine's load first
    join.on_finish("b", 3.0, 10)
    assert tracker.samples_total == 2 and join.pending == (0, 0)
    for rid in ("c", "d", "e"):  # loads of aborted or cut requests: no finish ever comes
        join.on_load(rid, f)
    assert join.pending == (0, 2)
    join.on_finish("c", 1.0, 10)  # pushed out: waits for a load that already came
    assert tracker.samples_total == 2 and join.pending == (1, 2)
    join.on_load("x", (1.0, 2.0))  # not five features: ignored
    assert join.pending == (1, 2)


def test_transfer_rate_is_an_exponentially_weighted_mean_of_pulls() -> None:
    rate = TransferRate(weight=0.5)
    assert (rate.bytes_per_s, rate.pulls) == (0.0, 0)
    assert not rate.observe(1e6, 0.0) and not rate.observe(0, 1.0)  # nothing moved or no time: not a pull
    assert rate.observe(1e9, 1.0)
    assert rate.bytes_per_s == 1e9
    rate.observe(1e9, 0.5)  # 2e9 B/s
    assert rate.bytes_per_s == pytest.approx(1.5e9) and rate.pulls == 2
    with pytest.raises(ValueError):
        TransferRate(weight=0.0)
