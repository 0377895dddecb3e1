"""Training STAR's predictor (§4.4): request-level split, standardisation, early stopping, the search.

Owns: `split_by_request` (70 / 15 / 15 of the distinct request ids, seeded: no request has rows in two
splits), the input standardisation (per-coordinate mean and standard deviation of the training rows), the
target scale, `fit` (mini-batch AdamW on the L1 loss for at most `max_epochs`, validation MAE after each
epoch, stop after `patience` epochs without improvement and keep the best epoch's weights), `search_configs`
(a seeded random sample of §4.4's grid: depth 2-6 layers, hidden widths 256-1024, learning rate 1e-4..1e-3
log-uniform, batch 16-128) and `train_predictor`, which puts them together into a `LengthPredictor` with its
test MAE.
Must not: read or write files (the CLI does), read clocks, or know the agent.

Target scaling: the network predicts y / s with s the training split's mean remaining length (at least 1);
the L1 loss on y / s is the token MAE divided by s, so the optimum is the same and the loss starts near 1.
Inputs are standardised (hidden states have very different scales per coordinate on real models). Each
mini-batch is converted from the shard dtype (float16) and standardised on the fly, so memory stays at the
size of the data as loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from engine_agent.star.history import HistoryTable
from engine_agent.star.mlp import MLP, AdamW, l1_loss, parameter_count
from engine_agent.star.predictor import LengthPredictor, PredictorMeta
from engine_agent.star.shards import HiddenStateData, Vectors

DEFAULT_WIDTHS = (2048, 512, 64)
SPLIT_FRACTIONS = (0.70, 0.15, 0.15)
SEARCH_DEPTHS = (2, 3, 4, 5, 6)  # linear layers (Eq. 2 has 4): depth - 1 hidden layers
SEARCH_WIDTHS = (256, 512, 1024)
SEARCH_LR = (1e-4, 1e-3)
SEARCH_BATCHES = (16, 32, 64, 128)
_EVAL_CHUNK_ROWS = 4096

Log = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class TrainConfig:
    widths: tuple[int, ...] = DEFAULT_WIDTHS
    lr: float = 5e-4
    batch_size: int = 64
    weight_decay: float = 1e-2
    max_epochs: int = 100
    patience: int = 10
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.widths or any(w < 1 for w in self.widths):
            raise ValueError(f"widths must be positive and at least one, got {list(self.widths)}")
        if self.lr <= 0 or self.batch_size < 1 or self.weight_decay < 0:
            raise ValueError(f"bad lr {self.lr}, batch size {self.batch_size} or weight decay "
                             f"{self.weight_decay}")
        if self.max_epochs < 1 or self.patience < 1:
            raise ValueError(f"max_epochs and patience must be >= 1, got {self.max_epochs}, {self.patience}")

    def describe(self) -> dict[str, Any]:
        return {"widths": list(self.widths), "lr": self.lr, "batch_size": self.batch_size,
                "weight_decay": self.weight_decay, "seed": self.seed}


@dataclass(frozen=True, slots=True)
class RequestSplit:
    """Row masks of each split, and the request ids in each."""

    train: npt.NDArray[np.bool_]
    val: npt.NDArray[np.bool_]
    test: npt.NDArray[np.bool_]
    train_requests: npt.NDArray[np.str_]
    val_requests: npt.NDArray[np.str_]
    test_requests: npt.NDArray[np.str_]


def split_by_request(
    request_ids: npt.NDArray[np.str_], seed: int, fractions: Sequence[float] = SPLIT_FRACTIONS
) -> RequestSplit:
    """Shuffle the distinct ids (seeded) and cut them 70 / 15 / 15; every split gets at least one request."""
    ids = np.unique(request_ids)
    n = ids.size
    if n < 3:
        raise ValueError(f"the data holds {n} request(s); a train / validation / test split needs at least 3")
    shuffled = ids[np.random.default_rng([seed, 7]).permutation(n)]
    n_val = max(1, round(fractions[1] * n))
    n_test = max(1, round(fractions[2] * n))
    n_train = n - n_val - n_test
    train_ids, val_ids, test_ids = (
        np.sort(shuffled[:n_train]), np.sort(shuffled[n_train : n_train + n_val]),
        np.sort(shuffled[n_train + n_val :]),
    )
    return RequestSplit(
        train=np.isin(request_ids, train_ids), val=np.isin(request_ids, val_ids),
        test=np.isin(request_ids, test_ids), train_requests=train_ids, val_requests=val_ids,
        test_requests=test_ids,
    )


@dataclass(frozen=True, slots=True)
class Standardiser:
    mean: npt.NDArray[np.float32]
    std: npt.NDArray[np.float32]

    @classmethod
    def fit(cls, vectors: Vectors, rows: npt.NDArray[np.intp]) -> Standardiser:
        """Per-coordinate mean and standard deviation over `rows` (float64 sums, chunked); a constant
        coordinate gets std 1."""
        total = np.zeros(vectors.shape[1])
        squares = np.zeros(vectors.shape[1])
        for start in range(0, rows.size, _EVAL_CHUNK_ROWS):
            chunk = vectors[rows[start : start + _EVAL_CHUNK_ROWS]].astype(np.float64)
            total += chunk.sum(axis=0)
            squares += (chunk * chunk).sum(axis=0)
        mean = total / rows.size
        std = np.sqrt(np.maximum(squares / rows.size - mean * mean, 0.0))
        std[std < 1e-6] = 1.0
        return cls(mean.astype(np.float32), std.astype(np.float32))

    def apply(self, vectors: Vectors) -> npt.NDArray[np.float32]:
        out = vectors.astype(np.float32)
        out -= self.mean
        out /= self.std
        return out


@dataclass(frozen=True, slots=True)
class Fitted:
    mlp: MLP
    config: TrainConfig
    val_mae: float  # tokens, at the best epoch
    best_epoch: int
    epochs_run: int


def predict_tokens(mlp: MLP, standardiser: Standardiser, scale: float, vectors: Vectors,
                   rows: npt.NDArray[np.intp]) -> npt.NDArray[np.float32]:
    """Predicted remaining tokens (clipped at 0) for `rows` of `vectors`."""
    out = np.empty(rows.size, dtype=np.float32)
    for start in range(0, rows.size, _EVAL_CHUNK_ROWS):
        part = rows[start : start + _EVAL_CHUNK_ROWS]
        out[start : start + part.size] = mlp.predict(standardiser.apply(vectors[part]))
    out *= np.float32(scale)
    return np.maximum(out, 0)


def fit(data: HiddenStateData, split: RequestSplit, standardiser: Standardiser, scale: float,
        config: TrainConfig, log: Log | None = None) -> Fitted:
    """Train one network; returns the weights of the epoch with the best validation MAE."""
    vectors = data.rows.vectors
    target = data.rows.remaining_tokens.astype(np.float32) / np.float32(scale)
    train_rows = np.flatnonzero(split.train)
    val_rows = np.flatnonzero(split.val)
    val_y = data.rows.remaining_tokens[val_rows].astype(np.float32)
    mlp = MLP.initialise(data.hidden_size, config.widths, np.random.default_rng([config.seed, 0]),
                         output_bias=float(np.median(target[train_rows])))
    optimiser = AdamW(mlp, lr=config.lr, weight_decay=config.weight_decay)
    order_rng = np.random.default_rng([config.seed, 1])
    best = Fitted(mlp.copy(), config, float("inf"), 0, 0)
    since_best = 0
    epoch = 0
    for epoch in range(1, config.max_epochs + 1):
        order = order_rng.permutation(train_rows)
        for start in range(0, order.size, config.batch_size):
            batch = np.sort(order[start : start + config.batch_size])
            forward = mlp.forward(standardiser.apply(vectors[batch]))
            _, grad = l1_loss(forward.output, target[batch])
            optimiser.step(mlp, mlp.backward(forward, grad))
        val_mae = float(np.abs(predict_tokens(mlp, standardiser, scale, vectors, val_rows) - val_y).mean())
        if val_mae < best.val_mae:
            best = Fitted(mlp.copy(), config, val_mae, epoch, epoch)
            since_best = 0
        else:
            since_best += 1
        if log is not None:
            log(f"epoch {epoch}: validation MAE {val_mae:.1f} tokens "
                f"(best {best.val_mae:.1f} at epoch {best.best_epoch})")
        if since_best >= config.patience:
            break
    return replace(best, epochs_run=epoch)


def search_configs(base: TrainConfig, trials: int) -> list[TrainConfig]:
    """`trials` seeded random points of §4.4's grid (widths non-increasing with depth)."""
    if trials < 1:
        raise ValueError(f"search needs at least one trial, got {trials}")
    rng = np.random.default_rng([base.seed, 11])
    configs = []
    for trial in range(trials):
        depth = int(rng.choice(SEARCH_DEPTHS))
        widths = tuple(sorted((int(w) for w in rng.choice(SEARCH_WIDTHS, depth - 1)), reverse=True))
        lr = float(10 ** rng.uniform(np.log10(SEARCH_LR[0]), np.log10(SEARCH_LR[1])))
        batch = int(rng.choice(SEARCH_BATCHES))
        configs.append(replace(base, widths=widths, lr=lr, batch_size=batch, seed=base.seed + trial))
    return configs


def train_predictor(data: HiddenStateData, config: TrainConfig, *, search_trials: int = 0,
                    log: Log | None = None) -> LengthPredictor:
    """Split by request (seeded by `config.seed`), fit (or search, keeping the best validation MAE), test."""
    rows = data.rows
    split = split_by_request(rows.request_ids, config.seed)
    train_rows = np.flatnonzero(split.train)
    standardiser = Standardiser.fit(rows.vectors, train_rows)
    scale = max(float(rows.remaining_tokens[train_rows].mean()), 1.0)
    candidates = search_configs(config, search_trials) if search_trials else [config]
    trials: list[dict[str, Any]] = []
    best: Fitted | None = None
    for i, candidate in enumerate(candidates):
        if log is not None and search_trials:
            log(f"trial {i + 1}/{len(candidates)}: {candidate.describe()}")
        fitted = fit(data, split, standardiser, scale, candidate, log=None if search_trials else log)
        trials.append({**candidate.describe(), "val_mae": fitted.val_mae, "best_epoch": fitted.best_epoch,
                       "epochs_run": fitted.epochs_run})
        if log is not None and search_trials:
            log(f"trial {i + 1}: validation MAE {fitted.val_mae:.1f} tokens after {fitted.epochs_run} epochs")
        if best is None or fitted.val_mae < best.val_mae:
            best = fitted
    assert best is not None
    test_rows = np.flatnonzero(split.test)
    test_pred = predict_tokens(best.mlp, standardiser, scale, rows.vectors, test_rows)
    test_mae = float(np.abs(test_pred - rows.remaining_tokens[test_rows]).mean())
    figures: dict[str, Any] = {
        "test_mae_tokens": test_mae,
        "val_mae_tokens": best.val_mae,
        "best_epoch": best.best_epoch,
        "epochs_run": best.epochs_run,
        "max_epochs": config.max_epochs,
        "patience": config.patience,
        **best.config.describe(),
        "split_seed": config.seed,
        "requests": {"train": int(split.train_requests.size), "val": int(split.val_requests.size),
                     "test": int(split.test_requests.size)},
        "rows": {"train": int(split.train.sum()), "val": int(split.val.sum()), "test": int(split.test.sum())},
        "parameters": parameter_count(data.hidden_size, best.config.widths),
        "search_trials": trials if search_trials else None,
    }
    return LengthPredictor(
        mlp=best.mlp,
        input_mean=standardiser.mean,
        input_std=standardiser.std,
        meta=PredictorMeta(model=data.model, hidden_size=data.hidden_size, widths=best.config.widths,
                           target_scale=scale, seed=best.config.seed, figures=figures),
        history=HistoryTable.fit(rows.generated_tokens[train_rows], rows.remaining_tokens[train_rows]),
        test_request_ids=split.test_requests,
    )
