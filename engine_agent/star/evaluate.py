"""Scoring a predictor on held-out requests: MAE per method, overall and by generated-token bucket.

Owns: which rows are scored (the predictor's own test requests when the data holds them, else every row,
said in the report's `split`), the four methods and the report (a JSON-able dict):
- `continuous`: the MLP at every tap (STAR §4.3);
- `prompt_only`: the MLP's prediction at the request's first tap, counted down by the tokens generated since
  (max(ŷ_first - (g - g_first), 0)): one prediction per request, as prompt-time predictors make (our first
  tap is 1..k tokens into the output, not at 0: the tap samples decoding requests only);
- `history`: the mean remaining length given the generated tokens, by bucket, fitted on the training split
  (`engine_agent.star.history`);
- `oracle`: the true remaining length (0 error; the bound the rescheduler's oracle variant assumes).
Buckets are powers of two of generated tokens ([0, 32), [32, 64), ...), in the spirit of the paper's Fig. 7.
Must not: train, read files or print.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from engine_agent.star.history import report_edges
from engine_agent.star.predictor import LengthPredictor
from engine_agent.star.shards import HiddenStateData

METHODS = ("continuous", "prompt_only", "history", "oracle")


def first_tap_countdown(request_ids: npt.NDArray[np.str_], generated: npt.NDArray[np.integer],
                        predicted: npt.NDArray[np.floating]) -> npt.NDArray[np.float64]:
    """Per row: the prediction made at its request's first tap, minus the tokens generated since (>= 0)."""
    order = np.lexsort((generated, request_ids))
    sorted_ids = request_ids[order]
    starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
    group = np.cumsum(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]]) - 1
    first_rows = order[starts]
    first_pred = predicted[first_rows].astype(np.float64)[group]
    first_gen = generated[first_rows].astype(np.float64)[group]
    out = np.empty(request_ids.size)
    out[order] = np.maximum(first_pred - (generated[order] - first_gen), 0.0)
    return out


def evaluate(predictor: LengthPredictor, data: HiddenStateData) -> dict[str, Any]:
    """The report: rows and requests scored, MAE per method, and per generated-token bucket."""
    if data.hidden_size != predictor.hidden_size:
        raise ValueError(f"the data's hidden states have size {data.hidden_size}, the predictor reads "
                         f"{predictor.hidden_size}")
    rows = data.rows
    held_out = np.isin(rows.request_ids, predictor.test_request_ids)
    if held_out.any():
        split = "test: the predictor's held-out requests found in the data"
        mask = held_out
    else:
        split = "all: none of the predictor's held-out requests are in the data, every row is scored"
        mask = np.ones(len(rows), dtype=bool)
    index = np.flatnonzero(mask)
    ids = rows.request_ids[index]
    generated = rows.generated_tokens[index]
    truth = rows.remaining_tokens[index].astype(np.float64)
    continuous = predictor.predict(rows.vectors[index]).astype(np.float64)
    predictions = {
        "continuous": continuous,
        "prompt_only": first_tap_countdown(ids, generated, continuous),
        "history": predictor.history.predict(generated),
        "oracle": truth.copy(),
    }
    errors = {name: np.abs(pred - truth) for name, pred in predictions.items()}
    edges = report_edges(int(generated.max()))
    buckets = []
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        in_bucket = (generated >= lo) & (generated < hi)
        count = int(in_bucket.sum())
        if not count:
            continue
        buckets.append({
            "generated": [lo, hi],
            "rows": count,
            "requests": int(np.unique(ids[in_bucket]).size),
            "mean_remaining": float(truth[in_bucket].mean()),
            "mae": {name: float(err[in_bucket].mean()) for name, err in errors.items()},
        })
    return {
        "model": data.model,
        "hidden_size": data.hidden_size,
        "split": split,
        "rows": int(index.size),
        "requests": int(np.unique(ids).size),
        "mean_remaining": float(truth.mean()),
        "mae": {name: float(errors[name].mean()) for name in METHODS},
        "by_generated_bucket": buckets,
    }
