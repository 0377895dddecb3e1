"""The simulated fleet: one `SimEngine` per engine, with its report stream and its counters.

Owns: `SimNode` (an engine with its LENS (`SimLens`: planning per `EngineSpec.lens`, else
`SimOptions.lens_planning`; none when neither planning nor `SimOptions.lens_state`), its `ReportFeed`, its
STAR prediction rounds when a rescheduling arm runs, whether an iteration is in flight and that iteration's
result, per-engine totals and load-balance figures), `build_fleet` (engine ids `{profile}-{i}`, numbered
from 0 per profile in spec order, the same model names live agents report; one synthetic hidden-state
generator per model for a length predictor) and `PromptIds` (the prompt token ids a simulated request is
admitted with).
Must not: order events, call policies or read clocks (that is `loadgen.simulate.runner`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

from engine_agent.sim.engine import SimEngine, StepResult
from engine_agent.sim.hidden_states import SyntheticHiddenStates
from engine_agent.sim.lens_adapter import SimLens
from gateway.domain import PREFIX_EVENTS, EngineId
from gateway.policies.base import prefix_source
from gateway.policies.registry import make_policy
from loadgen.datasets.mooncake import HASH_IDS, prompt_ids_of
from loadgen.datasets.request import Request
from loadgen.simulate.predictions import PredictionRounds, remaining_lengths
from loadgen.simulate.reports import ReportFeed, describe_engine
from loadgen.simulate.spec import LENS_STATE_POLICIES, EngineSpec, SimOptions
from switchyard.profiles import TENSOR_PARALLEL_DEGREES, get_profile, known_profiles, profile_name
from switchyard.roles import DECODE_ROLE, PREFILL_ROLE

# Bound on the token ids held by a `PromptIds` cache (8 bytes each): beyond it, tuples are made per request.
MAX_CACHED_PROMPT_TOKENS = 8_000_000
SIM_VOCAB_SIZE = 32_000  # `SimEngine`'s default vocabulary


def reports_kv_events(options: SimOptions) -> bool:
    """Whether engines' reports carry KV events: `options.kv_events`, or when None, whether the policy reads
    them."""
    if options.kv_events is not None:
        return options.kv_events
    return prefix_source(make_policy(options.policy, options.policy_params)) == PREFIX_EVENTS


class PromptIds:
    """Prompt token ids for simulated requests. The engine model reads their count and, for its prefix cache,
    which blocks two prompts share: a prefix trace's prompt follows its `hash_ids` blocks
    (`loadgen.datasets.mooncake`), a request that carries ids keeps them, and any other prompt is two salt
    tokens unique to the request followed by zeros (so no two share a block: nothing the trace does not say
    is shared hits the cache). The zeros are shared tuples by length, cached up to a size bound."""

    __slots__ = ("_by_length", "_cached_tokens", "_max_cached_tokens", "_count", "_vocab_size")

    def __init__(self, max_cached_tokens: int = MAX_CACHED_PROMPT_TOKENS, vocab_size: int = SIM_VOCAB_SIZE
                 ) -> None:
        self._by_length: dict[int, tuple[int, ...]] = {}
        self._cached_tokens = 0
        self._max_cached_tokens = max_cached_tokens
        self._count = 0
        self._vocab_size = vocab_size

    def __call__(self, length: int) -> tuple[int, ...]:
        """A prompt of `length` tokens sharing no block with any other this object made."""
        self._count += 1
        span = self._vocab_size - 1
        head = (1 + self._count // span % span, 1 + self._count % span)
        if length <= 2:
            return head[:length]
        rest = length - 2
        zeros = self._by_length.get(rest)
        if zeros is None:
            zeros = (0,) * rest
            if self._cached_tokens + rest <= self._max_cached_tokens:
                self._by_length[rest] = zeros
                self._cached_tokens += rest
        return head + zeros

    def of(self, request: Request) -> tuple[int, ...]:
        """The token ids `request` is admitted with (see the class docstring)."""
        if request.prompt_token_ids is not None:
            return request.prompt_token_ids
        hash_ids = request.metadata.get(HASH_IDS)
        if isinstance(hash_ids, tuple):
            return prompt_ids_of(hash_ids, request.prompt_tokens, self._vocab_size)
        return self(request.prompt_tokens)


class SimNode:
    """One simulated engine and everything the runner tracks about it."""

    __slots__ = ("engine_id", "profile_name", "model", "engine", "feed", "busy", "done_s", "result",
                 "requests", "output_tokens", "busy_s", "empty_steps", "rounds", "in_flight",
                 "min_free_blocks", "migrations_out", "migrations_in", "combo", "price_usd_h",
                 "billed_from_s", "left_s", "leave_after_s", "joined", "role")

    def __init__(self, engine_id: str, profile_name: str, options: SimOptions,
                 lens_planning: bool | None = None, combo: str = "", billed_from_s: float = 0.0,
                 role: str = "") -> None:
        profile = get_profile(profile_name)
        self.engine_id = EngineId(engine_id)
        self.profile_name = profile_name
        self.model = profile.model.name
        planning = options.lens_planning if lens_planning is None else lens_planning
        state = (options.lens_state if options.lens_state is not None
                 else options.policy in LENS_STATE_POLICIES)
        lens = (SimLens.for_profile(profile, planning=planning, state_vector=state)
                if planning or state else None)
        kv_events = options.prefix_caching and reports_kv_events(options)
        self.engine = SimEngine(profile, seed=options.seed, engine_id=engine_id, lens=lens,
                                handoff=role == PREFILL_ROLE, prefix_caching=options.prefix_caching,
                                kv_events=kv_events)
        self.role = role  # `switchyard.roles`: a prefill engine hands each request off after its first token
        self.feed = ReportFeed(self.engine, describe_engine(engine_id, profile, role=role),
                               interval_s=options.state_interval_s, delay_s=options.report_delay_s,
                               combo=combo, kv_events=kv_events)
        self.combo = combo
        # Billing (CAUCHY): the engine's GPUs cost `price_usd_h` from `billed_from_s` (provisioning starts)
        # until `left_s` (it left the fleet; None: still in it). A draining engine leaves once
        # `leave_after_s` has passed and nothing is in flight.
        self.price_usd_h = profile.hourly_price_usd
        self.billed_from_s = billed_from_s
        self.left_s: float | None = None
        self.leave_after_s = math.inf
        self.joined = False  # connected to the gateway's cluster states (the runner sets it)
        self.busy = False  # an iteration is in flight
        self.done_s = math.inf  # when the iteration in flight completes
        self.result: StepResult | None = None  # the iteration in flight
        self.requests = 0
        self.output_tokens = 0
        self.busy_s = 0.0  # summed iteration time (an empty iteration counts its retry delay)
        self.empty_steps = 0  # iterations that scheduled nothing
        self.rounds: PredictionRounds | None = None  # STAR's prediction rounds (a rescheduling arm runs)
        # Requests in flight here, in arrival order: id -> (prompt tokens, its delivered token times)
        self.in_flight: dict[str, tuple[int, list[float]]] = {}
        self.min_free_blocks = profile.kv_blocks_total  # after any delivered iteration: the peak KV use
        self.migrations_out = 0  # requests cut here
        self.migrations_in = 0  # migrated requests resumed here

    def in_flight_requests(self) -> Iterator[tuple[str, int, int]]:
        """(id, prompt tokens, output tokens delivered so far) of each request in flight here."""
        return ((rid, prompt, len(times)) for rid, (prompt, times) in self.in_flight.items())

    def iterations(self) -> int:
        """Iterations the engine ran (empty ones not counted)."""
        return self.engine.stats(0.0).iterations_total

    def totals(self, balance: bool = False) -> dict[str, Any]:
        """The engine's totals; with `balance`, also its preemptions, its peak KV use (the fullest cache
        after any iteration, a ratio) and the migrations it was the source and the resuming engine of."""
        out: dict[str, Any] = {"profile": self.profile_name, "requests": self.requests,
                               "output_tokens": self.output_tokens, "busy_s": self.busy_s,
                               "iterations": self.iterations()}
        if self.combo:
            out["combo"] = self.combo
        if self.role:
            out["role"] = self.role
        if balance:
            stats = self.engine.stats(0.0)
            total = stats.kv_blocks_total
            out.update(preemptions=stats.num_preempted_total,
                       peak_kv_used_ratio=(total - self.min_free_blocks) / total if total else 0.0,
                       migrations_out=self.migrations_out, migrations_in=self.migrations_in)
        return out


def combo_engines(combo_id: str, model: str) -> list[tuple[str, str]]:
    """(sim profile, role) of each engine that stands for one copy of a combo serving `model`: each side of
    n GPUs of type G becomes n / tp engines of G at the smallest tensor-parallel degree tp that holds the
    model and divides n (the planner merges a side into one TP-n instance; the simulator has profiles for
    the fitting degree and the next only, so it deploys the same GPUs as data-parallel replicas: same GPUs,
    same price). A disaggregated combo ("PxA+DxB") has the roles prefill (its first side) and decode (its
    second; `switchyard.roles`); an aggregated one's engines have none. ValueError when no profile fits."""
    sides = combo_id.split("+")
    if len(sides) > 2:
        raise ValueError(f"bad combo id {combo_id!r}: at most two sides (prefill+decode)")
    roles = (PREFILL_ROLE, DECODE_ROLE) if len(sides) == 2 else ("",)
    engines: list[tuple[str, str]] = []
    for side, role in zip(sides, roles, strict=True):
        count_text, sep, gpu = side.partition("x")
        if not sep or not count_text.isdigit() or int(count_text) < 1 or not gpu:
            raise ValueError(f"bad combo id {combo_id!r}: expected e.g. 1xh800+2xh20 or 2xa800")
        count = int(count_text)
        for tp in TENSOR_PARALLEL_DEGREES:
            name = profile_name(gpu, model, tp)
            if count % tp == 0 and name in known_profiles():
                engines += [(name, role)] * (count // tp)
                break
        else:
            raise ValueError(f"combo {combo_id!r}: no sim profile of {gpu} for {model} fits {count} GPU(s)")
    return engines


def engine_ids(engines: Sequence[EngineSpec], counts: dict[str, int] | None = None
               ) -> list[tuple[EngineSpec, str]]:
    """Each engine of `engines` with its id `{profile}-{i}`, i counted per profile across specs from `counts`
    (engines numbered so far, updated; None: from 0)."""
    counts = {} if counts is None else counts
    out = []
    for spec in engines:
        for _ in range(spec.count):
            index = counts.get(spec.profile, 0)
            counts[spec.profile] = index + 1
            out.append((spec, f"{spec.profile}-{index}"))
    return out


def build_fleet(engines: Sequence[EngineSpec], options: SimOptions,
                counts: dict[str, int] | None = None) -> list[SimNode]:
    """The engines of `engines`, in spec order; ValueError when empty. `counts`: engines numbered so far per
    profile (updated), for engines that join later."""
    if not engines:
        raise ValueError("a simulation needs at least one engine")
    nodes = [SimNode(engine_id, spec.profile, options, spec.lens, spec.combo, role=spec.role)
             for spec, engine_id in engine_ids(engines, counts)]
    if options.reschedule != "none":
        _attach_rounds(nodes, options)
    return nodes


def _attach_rounds(nodes: Sequence[SimNode], options: SimOptions) -> None:
    """Give every engine its STAR prediction rounds (`loadgen.simulate.predictions`)."""
    horizon = 0 if options.reschedule == "length_stages" else options.star_params().horizon
    predictor = options.predictor if options.reschedule == "star" else None
    hidden: dict[str, SyntheticHiddenStates] = {}  # per model: every engine of a model shares one
    for node in nodes:
        shape = node.engine.profile.model
        generator = None
        if predictor is not None:
            if predictor.hidden_size != shape.hidden_size:
                raise ValueError(f"the length predictor reads hidden states of size {predictor.hidden_size} "
                                 f"(model {predictor.meta.model!r}); engine {node.engine_id} serves "
                                 f"{shape.name!r}, of size {shape.hidden_size}")
            generator = hidden.get(shape.name)
            if generator is None:
                generator = SyntheticHiddenStates(shape.hidden_size, shape.name, seed=options.seed)
                hidden[shape.name] = generator
        lengths = remaining_lengths(options.reschedule, predictor=predictor, bins=options.predictor_bins,
                                    hidden=generator)
        node.rounds = PredictionRounds(node.engine, lengths, node.in_flight_requests,
                                       round_tokens=options.prediction_interval, horizon=horizon)
