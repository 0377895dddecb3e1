"""CascadeInfer's arrival routing (paper 000, §3, §4.4): the earliest length stage that covers the request,
then the bid winner there.

Owns: `LengthStagesPolicy` and its parameters `LengthStagesPolicyParams`; `engine_load` and `bid_winner`,
§4.4's receiver choice, shared with the rescheduler (`gateway.rescheduling.length_stages`, which moves running
requests with the same rule).
Formula: the request's length is its prompt estimate (plus, for a follow, the tokens it already generated:
`RequestFeatures.resumed_tokens`). The layout is the model's `ClusterSnapshot.stages` entry, published by
the `length_stages` rescheduler (the gateway refuses this policy without it); the stage is the first whose
upper bound exceeds the length (the last otherwise); when no engine of that stage is eligible, the next
later stage with one, then earlier ones. Without a layout (before the rescheduler's first tick), every
eligible engine is one stage. Among the stage's eligible engines:
- `within="bid"`: `bid_winner`: each engine bids its load (`engine_load`) and its earliest start (tokens it
  won in bid-ask and has not received, `StageLayout.pending_tokens`, times its KV bytes per token over its
  measured transfer throughput, else `kv_link_gbps`); the higher-load half is dropped (ceil(n/2) kept), the
  3 earliest starts kept (equal starts: the lower loads), and the freshest report wins (the paper's
  "selects the one that replies first"),
  ties by the request's `rand`;
- `within="round_robin"`: the stage's engines in turn by `dispatch_seq` (§6.5's round-robin arm).
Must not: import asyncio, aiohttp, grpc, prometheus or time; keep mutable state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar, Literal

from gateway.domain import ClusterSnapshot, EngineId, EngineView, RequestFeatures
from gateway.policies.base import eligible
from gateway.policies.params import PolicyParams, PositiveFinite

BID_KEEP_EARLIEST = 3  # §4.4: "keeps the three receivers with the earliest transmission start times"


class LengthStagesPolicyParams(PolicyParams):
    within: Literal["bid", "round_robin"] = "bid"
    kv_link_gbps: PositiveFinite = 25.0  # a receiver's transfer throughput when it reports none


def engine_load(view: EngineView, pending_tokens: int = 0) -> int:
    """A bid's load: the context tokens of its running batch and its pending prefill (both in every state
    report), the prompts dispatched since its report, and `pending_tokens` won and not yet received. (Not
    the request rows' N(r): those come every k decode steps, and a dispatch leaves `unreported_*` at the
    next state report, so a load built on them would forget the newest requests for up to k steps.)"""
    return (view.running_batch_tokens + view.pending_prefill_tokens + view.unreported_prompt_tokens
            + pending_tokens)


def bid_winner(receivers: Sequence[EngineView], pending: Mapping[EngineId, int], link_bytes_per_s: float,
               rand: Callable[[], float]) -> EngineView | None:
    """§4.4's choice among bidding `receivers` (see the module docstring); `rand` breaks exact ties of
    report age."""
    if not receivers:
        return None
    by_load = sorted(receivers, key=lambda e: (engine_load(e, pending.get(e.engine_id, 0)), e.engine_id))
    half = by_load[: (len(by_load) + 1) // 2]

    def start_s(e: EngineView) -> float:
        waiting_bytes = pending.get(e.engine_id, 0) * max(e.kv_bytes_per_token, 1)
        return waiting_bytes / (e.transfer_bytes_per_s if e.transfer_bytes_per_s > 0 else link_bytes_per_s)

    earliest = sorted(half, key=start_s)[:BID_KEEP_EARLIEST]  # stable: equal starts stay in load order
    freshest = max(e.reported_at_s for e in earliest)  # the youngest report
    tied = [e for e in earliest if e.reported_at_s == freshest]
    return tied[min(int(rand() * len(tied)), len(tied) - 1)]


def stage_candidates(features: RequestFeatures, snapshot: ClusterSnapshot) -> tuple[EngineView, ...]:
    """The eligible engines of the stage that should take the request (see the module docstring)."""
    engines = eligible(features, snapshot)
    layout = snapshot.stages.get(features.model)
    if layout is None or not layout.stages or not engines:
        return engines
    by_id = {e.engine_id: e for e in engines}
    length = features.prompt_tokens + features.resumed_tokens
    last = len(layout.stages) - 1
    first = next((i for i, s in enumerate(layout.stages) if length < s.hi), last)
    for index in (*range(first, last + 1), *range(first - 1, -1, -1)):
        members = tuple(by_id[e] for e in layout.stages[index].engines if e in by_id)
        if members:
            return members
    return engines  # no staged engine is eligible: the engines that joined since the last layout


class LengthStagesPolicy:
    NAME: ClassVar[str] = "length_stages"

    def __init__(self, params: LengthStagesPolicyParams | None = None) -> None:
        self._params = params if params is not None else LengthStagesPolicyParams()
        self._link_bytes_per_s = self._params.kv_link_gbps * 1e9 / 8

    @property
    def params(self) -> LengthStagesPolicyParams:
        return self._params

    def pick(self, features: RequestFeatures, snapshot: ClusterSnapshot) -> EngineId | None:
        candidates = stage_candidates(features, snapshot)
        if not candidates:
            return None
        if self._params.within == "round_robin":
            ordered = sorted(candidates, key=lambda e: e.engine_id)
            return ordered[features.dispatch_seq % len(ordered)].engine_id
        layout = snapshot.stages.get(features.model)
        pending = layout.pending_tokens if layout is not None else {}
        winner = bid_winner(candidates, pending, self._link_bytes_per_s, lambda: features.rand)
        return winner.engine_id if winner is not None else None
