"""STAR's predictor: exact MLP gradients, a planted signal learnt, the request-level split, the file format
and its errors, the evaluation's methods and buckets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine_agent.star.evaluate import METHODS, evaluate, first_tap_countdown
from engine_agent.star.history import HistoryTable, report_edges
from engine_agent.star.mlp import MLP, AdamW, l1_loss, parameter_count
from engine_agent.star.predictor import LengthPredictor, PredictorFileError
from engine_agent.star.shards import HiddenStateData, ShardRows
from engine_agent.star.training import (
    SEARCH_BATCHES,
    SEARCH_DEPTHS,
    SEARCH_WIDTHS,
    TrainConfig,
    search_configs,
    split_by_request,
    train_predictor,
)


def _numeric_gradient(mlp: MLP, loss, eps: float = 1e-6) -> list[np.ndarray]:  # type: ignore[no-untyped-def]
    grads = []
    for p in mlp.parameters:
        g = np.zeros_like(p)
        for idx in np.ndindex(p.shape):
            old = p[idx]
            p[idx] = old + eps
            up = loss()
            p[idx] = old - eps
            down = loss()
            p[idx] = old
            g[idx] = (up - down) / (2 * eps)
        grads.append(g)
    return grads


def test_backward_matches_finite_differences_float64() -> None:
    rng = np.random.default_rng(0)
    mlp = MLP.initialise(5, (7, 4, 3), rng, output_bias=0.3, dtype=np.float64)
    for b in mlp.biases[:-1]:
        b[:] = rng.standard_normal(b.shape) * 0.1  # biases in play, away from ReLU kinks by chance only
    x = rng.standard_normal((6, 5))
    weights = rng.standard_normal(6)  # a smooth loss: sum_i c_i * y_i
    analytic = mlp.backward(mlp.forward(x), weights)
    numeric = _numeric_gradient(mlp, lambda: float(weights @ mlp.predict(x)))
    for a, n in zip(analytic, numeric, strict=True):
        np.testing.assert_allclose(a, n, rtol=1e-5, atol=1e-8)

    target = rng.standard_normal(6)  # the L1 loss, away from ties
    loss, grad = l1_loss(mlp.forward(x).output, target)
    analytic = mlp.backward(mlp.forward(x), grad)
    numeric = _numeric_gradient(mlp, lambda: l1_loss(mlp.predict(x), target)[0])
    assert loss == pytest.approx(float(np.abs(mlp.predict(x) - target).mean()))
    for a, n in zip(analytic, numeric, strict=True):
        np.testing.assert_allclose(a, n, rtol=1e-5, atol=1e-8)


def test_float32_by_default_and_adamw_decays_weights_not_biases() -> None:
    mlp = MLP.initialise(4, (3,), np.random.default_rng(1))
    assert all(p.dtype == np.float32 for p in mlp.parameters)
    assert mlp.predict(np.ones((2, 4), dtype=np.float32)).dtype == np.float32
    before = mlp.copy()
    optimiser = AdamW(mlp, lr=0.1, weight_decay=0.5)
    optimiser.step(mlp, [np.zeros_like(p) for p in mlp.parameters])
    np.testing.assert_allclose(mlp.weights[0], before.weights[0] * (1 - 0.1 * 0.5), rtol=1e-6)
    np.testing.assert_array_equal(mlp.biases[1], before.biases[1])


def test_parameter_count_of_eq2_at_the_papers_width() -> None:
    assert parameter_count(3584, (2048, 512, 64), biases=False) == 8_421_440  # the paper's "8.4 M"
    assert parameter_count(3584, (2048, 512, 64)) == 8_421_440 + 2048 + 512 + 64 + 1


def planted(
    num_requests: int = 150, rows_per_request: int = 8, d: int = 16, seed: int = 3
) -> HiddenStateData:
    """y = 300 + 120 x0 - 80 x1 + 60 x5 (+ noise 4), clipped at 0; other coordinates are noise."""
    rng = np.random.default_rng(seed)
    n = num_requests * rows_per_request
    x = rng.standard_normal((n, d)).astype(np.float32)
    y = np.clip(300 + 120 * x[:, 0] - 80 * x[:, 1] + 60 * x[:, 5] + rng.normal(0, 4, n), 0, None)
    ids = np.repeat(np.array([f"r{i:03d}" for i in range(num_requests)]), rows_per_request)
    generated = np.tile(np.arange(rows_per_request, dtype=np.int32) * 20 + 5, num_requests)
    remaining = np.round(y).astype(np.int32)
    rows = ShardRows(
        vectors=x.astype(np.float16), request_ids=ids, generated_tokens=generated,
        prompt_tokens=np.full(n, 50, dtype=np.int32), output_tokens=remaining + generated,
        remaining_tokens=remaining,
    )
    return HiddenStateData(rows=rows, model="planted", hidden_size=d, files=())


SMALL = TrainConfig(widths=(32, 16), lr=3e-3, batch_size=32, max_epochs=100, patience=10, seed=0)


@pytest.fixture(scope="module")
def trained() -> tuple[LengthPredictor, HiddenStateData]:
    data = planted()
    return train_predictor(data, SMALL), data


def test_a_planted_signal_is_learnt(trained: tuple[LengthPredictor, HiddenStateData]) -> None:
    predictor, data = trained
    split = split_by_request(data.rows.request_ids, SMALL.seed)
    y = data.rows.remaining_tokens.astype(np.float64)
    mean_mae = float(np.abs(y[split.test] - y[split.train].mean()).mean())
    test_mae = predictor.meta.figures["test_mae_tokens"]
    assert test_mae < 0.2 * mean_mae, (test_mae, mean_mae)  # ~0.09 with this seed
    got = np.abs(predictor.predict(data.rows.vectors[split.test]) - y[split.test]).mean()
    assert got == pytest.approx(test_mae, rel=1e-4)
    figures = predictor.meta.figures
    assert figures["requests"] == {"train": 106, "val": 22, "test": 22}
    assert 1 <= figures["best_epoch"] <= figures["epochs_run"] <= SMALL.max_epochs


def test_no_request_is_in_two_splits() -> None:
    ids = np.repeat(np.array([f"q{i}" for i in range(40)]), 3)
    split = split_by_request(ids, seed=5)
    sets = [set(split.train_requests), set(split.val_requests), set(split.test_requests)]
    assert not (sets[0] & sets[1]) and not (sets[0] & sets[2]) and not (sets[1] & sets[2])
    assert sets[0] | sets[1] | sets[2] == set(ids)
    assert (split.train.astype(int) + split.val + split.test == 1).all()
    assert (len(sets[0]), len(sets[1]), len(sets[2])) == (28, 6, 6)
    for mask, requests in ((split.train, split.train_requests), (split.test, split.test_requests)):
        assert set(ids[mask]) == set(requests)
    again = split_by_request(ids, seed=5)
    assert np.array_equal(again.test_requests, split.test_requests)
    assert not np.array_equal(split_by_request(ids, seed=6).test_requests, split.test_requests)
    with pytest.raises(ValueError, match="at least 3"):
        split_by_request(np.array(["a", "a", "b"]), seed=0)


def test_save_load_round_trip(trained: tuple[LengthPredictor, HiddenStateData], tmp_path: Path) -> None:
    predictor, data = trained
    path = tmp_path / "p.npz"
    predictor.save(path)
    loaded = LengthPredictor.load(path, expected_hidden_size=data.hidden_size)
    x = data.rows.vectors[:50].astype(np.float32)
    np.testing.assert_array_equal(loaded.predict(x), predictor.predict(x))
    assert loaded.meta == predictor.meta
    assert np.array_equal(loaded.test_request_ids, predictor.test_request_ids)
    assert (loaded.predict(x) >= 0).all() and loaded.predict(x).dtype == np.float32


def test_bad_files_and_a_wrong_hidden_size_are_refused(
    trained: tuple[LengthPredictor, HiddenStateData], tmp_path: Path
) -> None:
    predictor, data = trained
    good = tmp_path / "good.npz"
    predictor.save(good)
    with pytest.raises(PredictorFileError, match=r"reads hidden states of size 16 \(model 'planted'\), "
                       r"but this engine's are of size 4096"):
        LengthPredictor.load(good, expected_hidden_size=4096)
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a zip file at all")
    with pytest.raises(PredictorFileError, match="garbage.npz: not a length-predictor file"):
        LengthPredictor.load(garbage)
    other = tmp_path / "other.npz"
    np.savez(other, something=np.zeros(3))
    with pytest.raises(PredictorFileError, match="other.npz: not a usable length-predictor file .missing"):
        LengthPredictor.load(other)
    with np.load(good) as npz:
        arrays = {k: npz[k] for k in npz.files}
    arrays["W1"] = arrays["W1"][:, :3]
    broken = tmp_path / "broken.npz"
    np.savez(broken, **arrays)
    with pytest.raises(PredictorFileError, match="W1 has shape"):
        LengthPredictor.load(broken)
    with pytest.raises(PredictorFileError, match="no such file"):
        LengthPredictor.load(tmp_path / "absent.npz")
    with pytest.raises(ValueError, match=r"shape \(n, 16\)"):
        predictor.predict(np.zeros((2, 7), dtype=np.float32))


def test_history_table_means_by_bucket() -> None:
    generated = np.array([0, 5, 15, 16, 18, 40, 40])
    remaining = np.array([100, 80, 60, 50, 30, 10, 20])
    table = HistoryTable.fit(generated, remaining)
    assert table.edges[:4].tolist() == [0, 16, 19, 22]
    np.testing.assert_allclose(table.predict(np.array([3, 17, 20, 35, 40, 1000])), [80, 40, 40, 40, 15, 15])
    assert report_edges(100) == [0, 32, 64, 128]


def test_first_tap_countdown() -> None:
    ids = np.array(["b", "a", "a", "b", "a"])
    generated = np.array([30, 40, 10, 5, 20])
    predicted = np.array([1.0, 2.0, 100.0, 50.0, 3.0])
    # a: first tap g=10 predicts 100 -> 100 - (g - 10); b: first tap g=5 predicts 50 -> 50 - (g - 5), >= 0
    np.testing.assert_allclose(first_tap_countdown(ids, generated, predicted), [25, 70, 100, 50, 90])


def test_evaluate_reports_every_method_and_bucket(trained: tuple[LengthPredictor, HiddenStateData]) -> None:
    predictor, data = trained
    report = evaluate(predictor, data)
    assert report["split"].startswith("test") and report["requests"] == 22 and report["rows"] == 22 * 8
    assert set(report["mae"]) == set(METHODS) and report["mae"]["oracle"] == 0.0
    assert report["mae"]["continuous"] == pytest.approx(predictor.meta.figures["test_mae_tokens"], rel=1e-4)
    assert report["mae"]["continuous"] < report["mae"]["history"]
    assert sum(b["rows"] for b in report["by_generated_bucket"]) == report["rows"]
    buckets = [b["generated"] for b in report["by_generated_bucket"]]
    assert buckets == [[0, 32], [32, 64], [64, 128], [128, 256]]


def test_search_samples_the_papers_grid_and_keeps_the_best() -> None:
    configs = search_configs(TrainConfig(seed=4), 12)
    for c in configs:
        assert len(c.widths) + 1 in SEARCH_DEPTHS and set(c.widths) <= set(SEARCH_WIDTHS)
        assert list(c.widths) == sorted(c.widths, reverse=True)
        assert 1e-4 <= c.lr <= 1e-3 and c.batch_size in SEARCH_BATCHES
    assert search_configs(TrainConfig(seed=4), 12) == configs
    data = planted(num_requests=30, rows_per_request=4, d=8)
    predictor = train_predictor(data, TrainConfig(max_epochs=3, patience=2), search_trials=2)
    trials = predictor.meta.figures["search_trials"]
    assert len(trials) == 2
    assert predictor.meta.figures["val_mae_tokens"] == min(t["val_mae"] for t in trials)
    assert list(predictor.meta.widths) == min(trials, key=lambda t: t["val_mae"])["widths"]
