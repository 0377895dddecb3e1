"""Goodput-weighted round robin across GPU combos, then a pick inside the combo (CAUCHY §3.4, paper 004).

Owns: `GoodputRRPolicy`, its parameters `GoodputRRParams`, `swrr_pick` (the pure smooth weighted round robin)
and `combo_type`.
Groups: engines of the request's model that are serving (`ClusterSnapshot.serving`) are grouped by their
`combo` label (agent `--combo`, e.g. "1xh800+2xh20#0": the part before "#" is the combo type, the whole label
one deployed instance of it); an engine without a label is a group of its own, named by its engine id.
Weights w_c, by `weights`:
  - "plan": the group's goodput from `goodput` (req/s, by the full label, else its type, else its engines'
    profile); a group missing from a configured map gets the smallest configured figure (never starved).
    With no map, the modelled capacity: the sum over its engines of the catalogue weight of their GPU times
    TP (`static_weighted.gpu_class_weight`, H100 = 1), or 1 per engine for an unknown GPU.
  - "measured": capacity, not the delivered rate (routing by the delivered rate would freeze the first
    split): the sum of the engines' LENS P_max when every serving engine reports LENS, else the "plan" figure;
    then corrected like Dynamo's planner by observed/expected latency: times min(1, TTFT SLO / the group's
    recent mean TTFT) when the request carries a TTFT SLO (or `slo_ttft_s` is set) and the group has
    samples. New weights within `tolerance` (relative, every group) of the weights the picks are counted
    under are not a change: the counted ones are kept, so measurement noise does not restart the sequence.
  - "equal": 1 each: basic round robin over combos (§4.4's "Basic RR").
  - "tokens": not a round robin: the group with the most free KV tokens (reported free blocks times the
    block size, minus tokens dispatched since the report), §4.4's "Token-Weighted RR" baseline.
Across groups (all but "tokens"), nginx's smooth weighted round robin made pure: with n_c the picks counted
for group c under the current weights (`ClusterSnapshot.routes`, kept by `ClusterState` since the weights
last changed), N = sum n_c and W = sum w_c, pick argmax_c ((N+1) w_c - W n_c), ties to the first group in
label order. For fixed weights this is nginx's sequence (its running `current_c` equals N w_c - W n_c);
new weights (a combo joined or left, a new plan, a measured change beyond `tolerance`) start counting anew,
so no group is owed a backlog and there is no burst. Groups of weight 0 get requests only when every weight
is 0 (then all weigh 1). A group whose engines were all tried for this request (`features.exclude`) is
skipped for the next best, without changing the weights.
Inside the group, `intra`: "opportunistic" (§3.4.2, the least-loaded engine by `least_loaded.load_tokens`,
ties by id; and `in_place` is true: in a disaggregated combo the request life lets an idle decode engine
serve a request whole and an idle prefill engine keep one it would hand off, see `gateway.dispatch.life`) or
"rr" (the group's engines in id order, by its pick count n_c).
`choose` returns the pick and the `RouteTag` the ledger counts it under (`WeightedPolicy`); `pick` the engine
alone.
Must not: import asyncio, aiohttp, grpc, prometheus or time; keep mutable state (the counts are the cluster
state's).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import ClassVar, Literal

from pydantic import Field

from gateway.domain import ClusterSnapshot, EngineId, EngineView, RequestFeatures, RouteTag, RouteWeights
from gateway.policies.least_loaded import load_tokens
from gateway.policies.params import NonNegativeFinite, PolicyParams, PositiveFinite
from gateway.policies.static_weighted import gpu_class_weight

# What a layout depends on, for snapshots without a `membership` value.
_IDENTITY = attrgetter("engine_id", "model", "ready", "ejected", "combo", "profile")
_MAX_LAYOUTS = 64  # memoised group layouts (one per distinct set of serving engines); cleared when full
WeightSource = Literal["plan", "measured", "equal", "tokens"]
IntraPolicy = Literal["opportunistic", "rr"]


class GoodputRRParams(PolicyParams):
    weights: WeightSource = "plan"
    goodput: dict[str, NonNegativeFinite] = Field(default_factory=dict)  # combo label / type / profile -> rps
    intra: IntraPolicy = "opportunistic"
    tolerance: NonNegativeFinite = 0.1  # "measured": relative change that counts as new weights
    slo_ttft_s: PositiveFinite | None = None  # "measured": the TTFT target when requests carry none


def combo_type(label: str) -> str:
    """The combo type of a combo label: "1xh800+2xh20#3" -> "1xh800+2xh20"."""
    return label.partition("#")[0]


def swrr_pick(weights: Sequence[float], counts: Sequence[int], allowed: Sequence[bool] | None = None) -> int:
    """Index of the next pick of smooth weighted round robin after `counts` picks of each item under
    `weights`: argmax (N+1) w_i - W n_i over allowed items, ties to the lowest index; -1 when none is allowed.
    Weights must be >= 0; all-zero weights are treated as all 1."""
    total = sum(weights)
    if total <= 0:
        weights = [1.0] * len(weights)
        total = float(len(weights))
    n_next = sum(counts) + 1
    best, best_score = -1, 0.0
    i = 0
    for w, n in zip(weights, counts, strict=True):
        if w > 0 and (allowed is None or allowed[i]):
            score = n_next * w - total * n
            if best < 0 or score > best_score:
                best, best_score = i, score
        i += 1
    if best < 0 and allowed is not None:  # only zero-weight groups are left: round robin among them
        candidates = [i for i, ok in enumerate(allowed) if ok]
        if candidates:
            return min(candidates, key=lambda i: (counts[i], i))
    return best


@dataclass(frozen=True, slots=True)
class _Layout:
    """The groups of one model's serving engines: labels in order, each group's positions in the snapshot,
    and the "plan" and "equal" weights (the part of a pick that changes only when membership does)."""

    labels: tuple[str, ...]
    members: tuple[tuple[int, ...], ...]  # positions in `ClusterSnapshot.engines`
    planned: RouteWeights
    planned_values: tuple[float, ...]
    equal: RouteWeights
    equal_values: tuple[float, ...]
    zeros: tuple[int, ...]


def _free_tokens(engines: Sequence[EngineView]) -> int:
    return sum(e.kv_blocks_free * e.block_size - e.unreported_tokens for e in engines)


class GoodputRRPolicy:
    NAME: ClassVar[str] = "goodput_rr"

    def __init__(self, params: GoodputRRParams | None = None) -> None:
        self._params = params if params is not None else GoodputRRParams()
        self._goodput: Mapping[str, float] = dict(self._params.goodput)
        self._floor = min(self._goodput.values()) if self._goodput else 0.0
        self._source = self._params.weights
        self._rr = self._params.intra == "rr"
        # A memo of `_layout`, a pure function of the snapshot's membership (`ClusterSnapshot.membership`,
        # else the engines' `_IDENTITY`) and the model: it changes no decision, it only spares recomputing the
        # groups and plan weights on every pick.
        self._layouts: dict[Hashable, _Layout] = {}

    @property
    def params(self) -> GoodputRRParams:
        return self._params

    @property
    def in_place(self) -> bool:
        """Whether the request life may run a disaggregated combo's requests in place (`intra`)."""
        return not self._rr

    def pick(self, features: RequestFeatures, snapshot: ClusterSnapshot) -> EngineId | None:
        return self.choose(features, snapshot)[0]

    def choose(
        self, features: RequestFeatures, snapshot: ClusterSnapshot
    ) -> tuple[EngineId | None, RouteTag | None]:
        model = features.model
        layout = self._layout(snapshot, model)
        if not layout.labels:
            return None, None
        engines = snapshot.engines
        exclude = features.exclude
        if exclude:
            members = tuple(tuple(i for i in group if engines[i].engine_id not in exclude)
                            for group in layout.members)
            allowed: list[bool] | None = [bool(group) for group in members]
            if not any(allowed):  # type: ignore[arg-type]
                return None, None
        else:
            members, allowed = layout.members, None
        source = self._source
        if source == "tokens":
            index = max((i for i, group in enumerate(members) if group),
                        key=lambda i: (_free_tokens([engines[j] for j in layout.members[i]]), -i))
            return self._inside(engines, members[index], 0), None
        weights, values = self._weights_for(features, snapshot, layout)
        tally = snapshot.routes.get(model)
        counts = (tally.counts if tally is not None and (tally.weights is weights or tally.weights == weights)
                  else layout.zeros)
        index = swrr_pick(values, counts, allowed)
        return self._inside(engines, members[index], counts[index]), RouteTag(model, weights, index)

    def weights(self, features: RequestFeatures, snapshot: ClusterSnapshot) -> RouteWeights:
        """The weights of the serving engines' groups for this request (empty with none serving)."""
        return self._weights_for(features, snapshot, self._layout(snapshot, features.model))[0]

    def _weights_for(
        self, features: RequestFeatures, snapshot: ClusterSnapshot, layout: _Layout
    ) -> tuple[RouteWeights, Sequence[float]]:
        """The groups' weights by `weights` (equal ones for "tokens", which routes without them), with their
        values alone."""
        if self._source == "measured":
            measured = self._measured(features, snapshot, layout)
            return measured, [w for _, w in measured]
        if self._source == "plan":
            return layout.planned, layout.planned_values
        return layout.equal, layout.equal_values

    def _layout(self, snapshot: ClusterSnapshot, model: str) -> _Layout:
        engines = snapshot.engines
        key: Hashable = ((snapshot.membership, model) if snapshot.membership >= 0
                         else (model, tuple(map(_IDENTITY, engines))))
        layout = self._layouts.get(key)
        if layout is None:
            groups: dict[str, list[int]] = {}
            for i, e in enumerate(engines):  # in id order, kept inside each group
                if e.model == model and e.ready and not e.ejected:
                    groups.setdefault(e.combo or e.engine_id, []).append(i)
            labels = tuple(sorted(groups))
            members = tuple(tuple(groups[c]) for c in labels)
            planned = tuple((c, self._planned(c, [engines[i] for i in m]))
                            for c, m in zip(labels, members, strict=True))
            equal = tuple((c, 1.0) for c in labels)
            layout = _Layout(labels, members, planned, tuple(w for _, w in planned), equal,
                             (1.0,) * len(labels), (0,) * len(labels))
            if len(self._layouts) >= _MAX_LAYOUTS:
                self._layouts.clear()
            self._layouts[key] = layout
        return layout

    def _measured(
        self, features: RequestFeatures, snapshot: ClusterSnapshot, layout: _Layout
    ) -> RouteWeights:
        engines = snapshot.engines
        every_lens = all(engines[i].lens is not None for group in layout.members for i in group)
        slo = features.slo_ttft_s if features.slo_ttft_s is not None else self._params.slo_ttft_s
        fresh: list[tuple[str, float]] = []
        for (c, planned), group in zip(layout.planned, layout.members, strict=True):
            members = [engines[i] for i in group]
            base = (sum(e.lens.peak_throughput_tokens_per_s for e in members if e.lens is not None)
                    if every_lens else planned)
            fresh.append((c, base * _latency_correction(members, slo)))
        tally = snapshot.routes.get(features.model)
        if tally is not None and _within(tally.weights, fresh, self._params.tolerance):
            return tally.weights
        return tuple(fresh)

    def _planned(self, label: str, members: Sequence[EngineView]) -> float:
        goodput = self._goodput
        if goodput:
            for key in (label, combo_type(label), members[0].profile):
                figure = goodput.get(key)
                if figure is not None:
                    return figure
            return self._floor
        total = 0.0
        for e in members:
            weight = gpu_class_weight(e.profile)
            total += weight if weight is not None else 1.0
        return total

    def _inside(self, engines: Sequence[EngineView], group: Sequence[int], count: int) -> EngineId:
        if self._rr:
            return engines[group[count % len(group)]].engine_id
        best = engines[group[0]]
        best_load = load_tokens(best)
        for i in group[1:]:
            e = engines[i]
            load = load_tokens(e)
            if load < best_load:  # ties keep the lower id (the group is in id order)
                best, best_load = e, load
        return best.engine_id


def _latency_correction(members: Sequence[EngineView], slo_ttft_s: float | None) -> float:
    if slo_ttft_s is None:
        return 1.0
    samples = sum(e.recent_latency_samples for e in members)
    if samples == 0:
        return 1.0
    mean_ttft = sum((e.recent_ttft_s or 0.0) * e.recent_latency_samples for e in members) / samples
    return 1.0 if mean_ttft <= slo_ttft_s else slo_ttft_s / mean_ttft


def _within(current: RouteWeights, fresh: Sequence[tuple[str, float]], tolerance: float) -> bool:
    if len(current) != len(fresh):
        return False
    for (c_old, w_old), (c_new, w_new) in zip(current, fresh, strict=True):
        if c_old != c_new or abs(w_new - w_old) > tolerance * max(w_old, 1e-12):
            return False
    return True
