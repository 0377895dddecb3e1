"""The simulated fleet: one `SimEngine` per engine, with its report stream and its counters.

Owns: `SimNode` (an engine with its LENS (`SimLens`: planning per `EngineSpec.lens`, else
`SimOptions.lens_planning`; none when neither planning nor `SimOptions.lens_state`), its `ReportFeed`, whether
an iteration is in flight and that iteration's result, per-engine totals), `build_fleet` (engine ids
`{profile}-{i}`, numbered from 0 per profile in spec order, the same model names live agents report) and
`PromptIds` (shared prompt token-id tuples by length).
Must not: order events, call policies or read clocks (that is `loadgen.simulate.runner`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from engine_agent.sim.engine import SimEngine, StepResult
from engine_agent.sim.lens_adapter import SimLens
from engine_agent.sim.profiles import get_profile
from gateway.domain import EngineId
from loadgen.simulate.reports import ReportFeed, describe_engine
from loadgen.simulate.spec import LENS_STATE_POLICIES, EngineSpec, SimOptions

# Bound on the token ids held by a `PromptIds` cache (8 bytes each): beyond it, tuples are made per request.
MAX_CACHED_PROMPT_TOKENS = 8_000_000


class PromptIds:
    """Prompt token ids of a given length: the engine model reads only their count, so every prompt of n
    tokens shares one tuple of n zeros (references to one int), cached per simulation up to a size bound."""

    __slots__ = ("_by_length", "_cached_tokens", "_max_cached_tokens")

    def __init__(self, max_cached_tokens: int = MAX_CACHED_PROMPT_TOKENS) -> None:
        self._by_length: dict[int, tuple[int, ...]] = {}
        self._cached_tokens = 0
        self._max_cached_tokens = max_cached_tokens

    def __call__(self, length: int) -> tuple[int, ...]:
        ids = self._by_length.get(length)
        if ids is None:
            ids = (0,) * length
            if self._cached_tokens + length <= self._max_cached_tokens:
                self._by_length[length] = ids
                self._cached_tokens += length
        return ids


class SimNode:
    """One simulated engine and everything the runner tracks about it."""

    __slots__ = ("engine_id", "profile_name", "model", "engine", "feed", "busy", "done_s", "result",
                 "requests",
                 "output_tokens", "busy_s", "empty_steps")

    def __init__(self, engine_id: str, profile_name: str, options: SimOptions,
                 lens_planning: bool | None = None) -> None:
        profile = get_profile(profile_name)
        self.engine_id = EngineId(engine_id)
        self.profile_name = profile_name
        self.model = profile.model.name
        planning = options.lens_planning if lens_planning is None else lens_planning
        state = (options.lens_state if options.lens_state is not None
                 else options.policy in LENS_STATE_POLICIES)
        lens = (SimLens.for_profile(profile, planning=planning, state_vector=state)
                if planning or state else None)
        self.engine = SimEngine(profile, seed=options.seed, engine_id=engine_id, lens=lens)
        self.feed = ReportFeed(self.engine, describe_engine(engine_id, profile),
                               interval_s=options.state_interval_s, delay_s=options.report_delay_s)
        self.busy = False  # an iteration is in flight
        self.done_s = math.inf  # when the iteration in flight completes
        self.result: StepResult | None = None  # the iteration in flight
        self.requests = 0
        self.output_tokens = 0
        self.busy_s = 0.0  # summed iteration time (an empty iteration counts its retry delay)
        self.empty_steps = 0  # iterations that scheduled nothing

    def iterations(self) -> int:
        """Iterations the engine ran (empty ones not counted)."""
        return self.engine.stats(0.0).iterations_total

    def totals(self) -> dict[str, Any]:
        return {"profile": self.profile_name, "requests": self.requests, "output_tokens": self.output_tokens,
                "busy_s": self.busy_s, "iterations": self.iterations()}


def build_fleet(engines: Sequence[EngineSpec], options: SimOptions) -> list[SimNode]:
    """The engines of `engines`, in spec order; ValueError when empty."""
    if not engines:
        raise ValueError("a simulation needs at least one engine")
    counts: dict[str, int] = {}
    nodes = []
    for spec in engines:
        for _ in range(spec.count):
            index = counts.get(spec.profile, 0)
            counts[spec.profile] = index + 1
            nodes.append(SimNode(f"{spec.profile}-{index}", spec.profile, options, spec.lens))
    return nodes
