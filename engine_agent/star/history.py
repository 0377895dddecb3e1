"""The `history` baseline: mean remaining length given the tokens generated so far, by generated-token bucket.

Owns: `HistoryTable` (bucket edges and the mean label of each bucket, fitted on the training split's rows and
stored in the predictor file) and the buckets the evaluation reports (`report_edges`: powers of two).
Must not: read files or know the MLP; it is data in, numbers out.

The table's buckets are quarter-octaves above 16 tokens (0, 16, 19, 22, 27, 32, 38, ...) up to the largest
generated count seen: fine enough to follow the curve, coarse enough to have rows in each. A bucket without
training rows takes the mean of the nearest bucket below it that has some (the first: the overall mean).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

_FIRST_EDGE = 16.0
_STEP = 2.0**0.25


@dataclass(frozen=True, slots=True)
class HistoryTable:
    edges: npt.NDArray[np.float64]  # increasing, edges[0] == 0; bucket i is [edges[i], edges[i+1])
    means: npt.NDArray[np.float64]  # one per bucket (the last is open-ended)

    def __post_init__(self) -> None:
        if self.edges.ndim != 1 or self.edges.shape != self.means.shape or not self.edges.size:
            raise ValueError("history table: edges and means must be equal-length non-empty vectors")
        if self.edges[0] != 0 or np.any(np.diff(self.edges) <= 0) or not np.all(np.isfinite(self.means)):
            raise ValueError("history table: edges must start at 0 and increase; means must be finite")

    @classmethod
    def fit(cls, generated: npt.NDArray[np.integer], remaining: npt.NDArray[np.integer]) -> HistoryTable:
        if generated.shape != remaining.shape or not generated.size:
            raise ValueError("history table: fit needs equal-length, non-empty generated and remaining")
        top = float(generated.max())
        edges = [0.0]
        edge = _FIRST_EDGE
        while edge <= top:
            edges.append(float(np.floor(edge)))
            edge *= _STEP
        grid = np.unique(np.asarray(edges))
        index = np.searchsorted(grid, generated, side="right") - 1
        sums = np.bincount(index, weights=remaining.astype(np.float64), minlength=grid.size)
        counts = np.bincount(index, minlength=grid.size)
        means = np.empty(grid.size)
        previous = float(remaining.mean())
        for i in range(grid.size):
            if counts[i]:
                previous = sums[i] / counts[i]
            means[i] = previous
        return cls(edges=grid, means=means)

    def predict(self, generated: npt.NDArray[np.integer]) -> npt.NDArray[np.float64]:
        index = np.searchsorted(self.edges, generated, side="right") - 1
        return self.means[np.clip(index, 0, self.means.size - 1)]


def report_edges(max_generated: int) -> list[int]:
    """Reporting buckets over generated tokens: [0, 32), [32, 64), [64, 128), ... past `max_generated`."""
    edges = [0, 32]
    while edges[-1] <= max_generated:
        edges.append(edges[-1] * 2)
    return edges
