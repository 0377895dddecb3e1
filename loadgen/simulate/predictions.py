"""STAR's prediction rounds in the simulator: what an engine agent reporting STAR rounds sends.

Owns: `PredictionRounds` (one engine's rounds, clocked and built as the agent's
`engine_agent.star.live.StarLive` builds them, into its `StarRound`), the remaining-length sources
(`exact_lengths`, `BinnedLengths`, `MlpLengths`), STAR Table 3's bins (`BIN_EDGES_TOKENS`) and
`remaining_lengths`, which picks the source of a run's arm.
Must not: send reports (the report feed does, `loadgen.simulate.reports.ReportFeed.push_round`, through the
agent's own encoder), change an engine (it reads `SimEngine.decoding_requests`), read clocks or files (a
predictor arrives loaded).

Rounds, per engine, as the live agent sends them (docs/star.md, "Predictions in the agent"):
- Clock: with a length source, a round every k decode steps (iterations with decoding sequences: the
  hidden-state tap's clock), taken right after that iteration is delivered and before the next starts (the
  tap's moment); without one ("star-nopred", the agent's `--star-report`), every k iterations. Each round is
  pushed at once. When the last request in flight leaves after a round that listed some, an empty round is
  pushed at once (`empty`).
- Rows: every request in flight on the engine with output tokens (decoding, preempted with output, or a
  migrated-in request still loading its KV), N(r) = prompt + output tokens so far (earlier engines' included),
  in the order the engine received them.
- N-hat(r), with a source: the decoding requests (the tap's batch) are predicted at the round; every row
  reports its latest prediction on this engine counted down by the tokens generated since (floored at 0), or
  0 when it has none (not migratable). The sources: the exact remaining length ("star-oracle"); a
  `LengthPredictor` on the sim's synthetic hidden states (`engine_agent.sim.hidden_states`, one generator per
  model shared by its engines) or the exact length quantised to the midpoint of its Table 3 bin ("star").
  The future load is `switchyard.star_load.engine_summary` of the rows' (N, N-hat), H rounds of k.
- Without a source: N-hat is 0 and the future load is the current load, sum N(r), held over the H rounds.
- `migratable`: decoding on this engine now (the agent asks its service, which also counts a preempted request
  as decoding; the simulator asks the engine, which knows it is not), and with a source, predicted at this
  round.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import numpy as np

from engine_agent.domain import RequestId
from engine_agent.sim.engine import SimEngine
from engine_agent.sim.hidden_states import SyntheticHiddenStates
from engine_agent.star.live import PredictionRow, StarRound
from engine_agent.star.predictor import LengthPredictor
from switchyard.star_load import engine_summary

K = 1024
# STAR §6.5, Table 3: the remaining-length target partitioned into [0, 8K), [8K, 32K]; [0, 4K), [4K, 8K),
# [8K, 16K), [16K, 32K]; [0, 2K), [2K, 4K), [4K, 6K), [6K, 8K), [8K, 16K), [16K, 32K] (K = 1024 tokens).
# A remaining length past the last edge falls in the last bin.
BIN_EDGES_TOKENS: dict[int, tuple[int, ...]] = {
    2: (0, 8 * K, 32 * K),
    4: (0, 4 * K, 8 * K, 16 * K, 32 * K),
    6: (0, 2 * K, 4 * K, 6 * K, 8 * K, 16 * K, 32 * K),
}


class RemainingLengths(Protocol):
    """N-hat(r) for one round's decoding requests (ids, prompt and generated tokens, exact remaining)."""

    def __call__(self, request_ids: Sequence[str], prompt: Sequence[int], generated: Sequence[int],
                 remaining: Sequence[int]) -> Sequence[float]: ...


def exact_lengths(request_ids: Sequence[str], prompt: Sequence[int], generated: Sequence[int],
                  remaining: Sequence[int]) -> Sequence[float]:
    """STAR Oracle: the remaining lengths the engine decided."""
    return [float(r) for r in remaining]


class BinnedLengths:
    """The exact remaining length quantised to the midpoint of its Table 3 bin (`BIN_EDGES_TOKENS`)."""

    __slots__ = ("_edges", "_midpoints")

    def __init__(self, bins: int) -> None:
        if bins not in BIN_EDGES_TOKENS:
            raise ValueError(f"predictor bins must be one of {sorted(BIN_EDGES_TOKENS)}, got {bins}")
        edges = BIN_EDGES_TOKENS[bins]
        self._edges = np.asarray(edges[1:-1], dtype=np.float64)  # inner edges
        self._midpoints = np.asarray([(a + b) / 2 for a, b in zip(edges, edges[1:], strict=False)])

    def __call__(self, request_ids: Sequence[str], prompt: Sequence[int], generated: Sequence[int],
                 remaining: Sequence[int]) -> Sequence[float]:
        index = np.searchsorted(self._edges, np.asarray(remaining, dtype=np.float64), side="right")
        out: list[float] = self._midpoints[index].tolist()
        return out


class MlpLengths:
    """A trained `LengthPredictor` reading the sim's synthetic hidden states of the round's requests."""

    __slots__ = ("_predictor", "_hidden")

    def __init__(self, predictor: LengthPredictor, hidden: SyntheticHiddenStates) -> None:
        self._predictor = predictor
        self._hidden = hidden

    def __call__(self, request_ids: Sequence[str], prompt: Sequence[int], generated: Sequence[int],
                 remaining: Sequence[int]) -> Sequence[float]:
        if not request_ids:
            return []
        vectors = self._hidden.vectors(request_ids, prompt, generated, remaining)
        out: list[float] = self._predictor.predict(vectors).astype(np.float64).tolist()
        return out


def remaining_lengths(arm: str, *, predictor: LengthPredictor | None, bins: int | None,
                      hidden: SyntheticHiddenStates | None) -> RemainingLengths | None:
    """The source of N-hat for `arm` (see the module docstring; None: "star-nopred" predicts nothing);
    ValueError when "star" has neither a predictor (with its hidden-state generator) nor bins."""
    if arm == "star-oracle":
        return exact_lengths
    if arm in ("star-nopred", "length_stages"):  # lengths only (CascadeInfer reads N(r) and the prompt)
        return None
    if arm == "star":
        if bins is not None:
            return BinnedLengths(bins)
        if predictor is not None and hidden is not None:
            return MlpLengths(predictor, hidden)
        raise ValueError("the 'star' arm needs a length predictor or predictor bins")
    raise ValueError(f"no predictions for the rescheduling arm {arm!r}")


class PredictionRounds:
    """One engine's STAR rounds (see the module docstring): `step` after each delivered iteration, `take` when
    it says a round is due, `empty` when the last request in flight left."""

    __slots__ = ("_engine", "_lengths", "_in_flight", "round_tokens", "_horizon", "_iterations",
                 "_predicted", "rounds", "listed")

    def __init__(self, engine: SimEngine, lengths: RemainingLengths | None,
                 in_flight: Callable[[], Iterable[tuple[str, int, int]]], *, round_tokens: int,
                 horizon: int) -> None:
        """`lengths`: the N-hat source (None: no prediction); `in_flight`: the requests in flight on the
        engine as (id, prompt tokens, output tokens so far), in the order the engine received them."""
        if round_tokens < 1 or horizon < 0:
            raise ValueError(f"need round_tokens >= 1 and horizon >= 0, got {round_tokens}, {horizon}")
        self._engine = engine
        self._lengths = lengths
        self._in_flight = in_flight
        self.round_tokens = round_tokens
        self._horizon = horizon
        self._iterations = 0  # counted iterations since the last round
        self._predicted: dict[str, tuple[float, int]] = {}  # request -> (N-hat when last predicted, output)
        self.rounds = 0  # rounds taken
        self.listed = 0  # rows in the last round

    def step(self, decoding: bool) -> bool:
        """Count one delivered iteration (`decoding`: it had decoding sequences); True when a round is due."""
        if not decoding and self._lengths is not None:
            return False  # the tap's clock counts decode steps only
        self._iterations += 1
        if self._iterations < self.round_tokens:
            return False
        self._iterations = 0
        return True

    def take(self) -> StarRound:
        """The round of the engine's state now."""
        ids, prompt, generated, remaining = self._engine.decoding_requests()
        lengths = self._lengths
        decoding = frozenset(ids)
        rows: list[PredictionRow] = []
        if lengths is None:
            for rid, prompt_tokens, out in self._in_flight():
                if out > 0:
                    rows.append(PredictionRow(RequestId(rid), out, 0.0, prompt_tokens + out, rid in decoding))
            load = [float(sum(r.current_tokens for r in rows))] * self._horizon
            return self._publish(rows, load)
        predicted = self._predicted
        for rid, estimate, g in zip(ids, lengths(ids, prompt, generated, remaining), generated, strict=True):
            predicted[rid] = (float(estimate), g)
        kept: dict[str, tuple[float, int]] = {}
        for rid, prompt_tokens, out in self._in_flight():
            if out <= 0:
                continue
            entry = predicted.get(rid)
            n_hat = 0.0 if entry is None else max(entry[0] - (out - entry[1]), 0.0)
            if entry is not None:
                kept[rid] = entry
            migratable = entry is not None and rid in decoding
            rows.append(PredictionRow(RequestId(rid), out, n_hat, prompt_tokens + out, migratable))
        self._predicted = kept  # requests that left are forgotten
        load = engine_summary(((r.current_tokens, r.predicted_remaining_tokens) for r in rows),
                              self.round_tokens, self._horizon)
        return self._publish(rows, load)

    def empty(self) -> StarRound:
        """The round that follows at once when the last request in flight left after a round that listed
        some (an idle engine does not keep its last requests as its load)."""
        self._predicted = {}
        return self._publish([], [0.0] * self._horizon)

    def _publish(self, rows: list[PredictionRow], load: list[float]) -> StarRound:
        self.rounds += 1
        self.listed = len(rows)
        return StarRound(self.rounds, self.round_tokens, tuple(rows), tuple(load))
