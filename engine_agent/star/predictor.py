"""`LengthPredictor`: a trained STAR predictor, its `.npz` file, and `predict` (remaining tokens, >= 0).

Owns: the predictor file format (version 1), saving it, loading it with checks (`PredictorFileError`, whose
message names the file and the problem; `expected_hidden_size` refuses a predictor trained for another
model's width), and turning hidden states into predicted remaining tokens: standardise with the training
split's per-coordinate mean and standard deviation, run the MLP, multiply by the target scale, clip at 0.
Must not: train (that is `engine_agent.star.training`), evaluate, or know shards.

File (one `.npz`, no pickles): `W0..W{L-1}`, `b0..b{L-1}` (float32; `Wi` is (fan_in, fan_out)),
`input_mean`, `input_std` (float32, hidden_size), `history_edges`, `history_means` (the `history`
baseline fitted on the training split), `test_request_ids` (the held-out requests, so `eval` scores the same
split), and `meta_json`: the format name and version, model name, hidden size, widths, target scale, seeds and
the training figures (`PredictorMeta.figures`: test MAE, request and row counts per split, search trials).
"""

from __future__ import annotations

import json
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from engine_agent.star.history import HistoryTable
from engine_agent.star.mlp import MLP

FORMAT_NAME = "switchyard-star-length-predictor"
FORMAT_VERSION = 1
_PREDICT_CHUNK_ROWS = 4096


class PredictorFileError(ValueError):
    """A predictor file that cannot be used; the message names the file and why."""


@dataclass(frozen=True, slots=True)
class PredictorMeta:
    model: str  # the served model whose hidden states it reads
    hidden_size: int
    widths: tuple[int, ...]
    # Targets are trained as y / target_scale (the training split's mean remaining length): L1 on the scaled
    # target is L1 in tokens divided by a constant, so the optimum is unchanged and the loss is O(1).
    target_scale: float
    seed: int
    figures: dict[str, Any] = field(default_factory=dict)  # JSON-able training report


@dataclass(frozen=True, slots=True)
class LengthPredictor:
    mlp: MLP
    input_mean: npt.NDArray[np.float32]
    input_std: npt.NDArray[np.float32]
    meta: PredictorMeta
    history: HistoryTable
    test_request_ids: npt.NDArray[np.str_]

    def __post_init__(self) -> None:
        d = self.meta.hidden_size
        if self.mlp.input_size != d or self.input_mean.shape != (d,) or self.input_std.shape != (d,):
            raise ValueError(f"predictor parts disagree on the hidden size {d}")
        if not self.meta.target_scale > 0:
            raise ValueError(f"target scale must be positive, got {self.meta.target_scale}")

    @property
    def hidden_size(self) -> int:
        return self.meta.hidden_size

    def standardise(self, vectors: npt.NDArray[np.floating]) -> npt.NDArray[np.float32]:
        out = np.asarray(vectors, dtype=np.float32) - self.input_mean
        out /= self.input_std
        return out

    def predict(self, vectors: npt.NDArray[np.floating]) -> npt.NDArray[np.float32]:
        """Predicted remaining output tokens (>= 0) for hidden states of shape (n, hidden_size)."""
        if vectors.ndim != 2 or vectors.shape[1] != self.hidden_size:
            raise ValueError(f"expected hidden states of shape (n, {self.hidden_size}), got {vectors.shape}")
        out = np.empty(vectors.shape[0], dtype=np.float32)
        for start in range(0, vectors.shape[0], _PREDICT_CHUNK_ROWS):
            chunk = self.standardise(vectors[start : start + _PREDICT_CHUNK_ROWS])
            out[start : start + chunk.shape[0]] = self.mlp.predict(chunk)
        out *= np.float32(self.meta.target_scale)
        np.maximum(out, 0, out=out)
        return out

    def save(self, path: Path) -> None:
        """Write the file atomically (a temporary name, then a rename)."""
        meta = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "model": self.meta.model,
            "hidden_size": self.meta.hidden_size,
            "widths": list(self.meta.widths),
            "target_scale": self.meta.target_scale,
            "seed": self.meta.seed,
            "figures": self.meta.figures,
        }
        arrays: dict[str, Any] = {  # Any: numpy's stubs type savez's **kwds against its keyword arguments
            "meta_json": np.asarray(json.dumps(meta), dtype=np.str_),
            "input_mean": self.input_mean.astype(np.float32),
            "input_std": self.input_std.astype(np.float32),
            "history_edges": self.history.edges,
            "history_means": self.history.means,
            "test_request_ids": self.test_request_ids.astype(np.str_),
        }
        for i, (w, b) in enumerate(zip(self.mlp.weights, self.mlp.biases, strict=True)):
            arrays[f"W{i}"] = w.astype(np.float32)
            arrays[f"b{i}"] = b.astype(np.float32)
        tmp = path.with_name(path.name + ".tmp")
        with tmp.open("wb") as handle:
            np.savez(handle, **arrays)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path, *, expected_hidden_size: int | None = None) -> LengthPredictor:
        """Read and check a predictor file; `PredictorFileError` says what is wrong."""
        try:
            with np.load(path, allow_pickle=False) as npz:
                arrays = {name: npz[name] for name in npz.files}
        except FileNotFoundError as exc:
            raise PredictorFileError(f"{path}: no such file") from exc
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
            raise PredictorFileError(f"{path}: not a length-predictor file ({exc})") from exc
        try:
            predictor = _from_arrays(arrays)
        except (KeyError, TypeError, ValueError) as exc:
            raise PredictorFileError(f"{path}: not a usable length-predictor file ({_reason(exc)})") from exc
        if expected_hidden_size is not None and predictor.hidden_size != expected_hidden_size:
            raise PredictorFileError(
                f"{path}: the predictor reads hidden states of size {predictor.hidden_size} (model "
                f"{predictor.meta.model!r}), but this engine's are of size {expected_hidden_size}"
            )
        return predictor


def _reason(exc: Exception) -> str:
    return f"missing {exc}" if isinstance(exc, KeyError) else str(exc)


def _from_arrays(arrays: dict[str, npt.NDArray[Any]]) -> LengthPredictor:
    meta = json.loads(str(arrays["meta_json"]))
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise ValueError(f"meta_json does not name the format {FORMAT_NAME!r}")
    if meta.get("version") != FORMAT_VERSION:
        raise ValueError(f"format version {meta.get('version')!r}, this reader knows {FORMAT_VERSION}")
    widths = tuple(int(w) for w in meta["widths"])
    hidden_size = int(meta["hidden_size"])
    n_layers = len(widths) + 1
    weights = [arrays[f"W{i}"].astype(np.float32) for i in range(n_layers)]
    biases = [arrays[f"b{i}"].astype(np.float32) for i in range(n_layers)]
    if f"W{n_layers}" in arrays:
        raise ValueError(f"more weight matrices than the {n_layers} layers of widths {list(widths)}")
    sizes = [hidden_size, *widths, 1]
    for i, w in enumerate(weights):
        if w.shape != (sizes[i], sizes[i + 1]):
            raise ValueError(f"W{i} has shape {w.shape}, expected {(sizes[i], sizes[i + 1])}")
    mlp = MLP(weights, biases)
    input_std = arrays["input_std"].astype(np.float32)
    parts = [*weights, *biases, arrays["input_mean"], input_std]
    if not all(np.all(np.isfinite(p)) for p in parts) or np.any(input_std <= 0):
        raise ValueError("non-finite weights or a non-positive input standard deviation")
    return LengthPredictor(
        mlp=mlp,
        input_mean=arrays["input_mean"].astype(np.float32),
        input_std=input_std,
        meta=PredictorMeta(
            model=str(meta["model"]),
            hidden_size=hidden_size,
            widths=widths,
            target_scale=float(meta["target_scale"]),
            seed=int(meta["seed"]),
            figures=dict(meta.get("figures", {})),
        ),
        history=HistoryTable(edges=arrays["history_edges"].astype(np.float64),
                             means=arrays["history_means"].astype(np.float64)),
        test_request_ids=arrays["test_request_ids"].astype(np.str_),
    )
