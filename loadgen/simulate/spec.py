"""What a simulation takes and gives back: `EngineSpec`, `parse_engines`, `SimOptions`, `Scaling`,
`SimResult`.

Owns: the public data types of `loadgen.simulate`, the parsing of a fleet description
("h100-llama3-8b:6,a6000-llama3-8b:2", with an optional per-spec LENS mode: "h100-llama3-8b:6:lens"), and
STAR's rescheduling arms (`RESCHEDULE_ARMS`) with the checks of their options.
Must not: run anything, read clocks or files, or hold mutable module state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from engine_agent.star.predictor import LengthPredictor
from gateway.admission.core import AdmissionParams
from gateway.dispatch.mover import MoveParams
from gateway.planning.autoscaler import Action, AutoscalerParams
from gateway.planning.ilp import Solver
from gateway.planning.plan_file import Plan
from gateway.rescheduling.length_stages import LengthStagesParams, StagesConfigError, StagesPlanFile
from gateway.rescheduling.star import StarParams
from loadgen.metrics import Outcome
from loadgen.simulate.cascade import CascadeSim
from loadgen.simulate.deciders import DECIDER_ASSIGNMENTS, DeciderAssignment
from switchyard.profiles import get_profile
from switchyard.roles import DECODE_ROLE, PREFILL_ROLE

# Policies that read the engines' LENS state vector; the simulator runs LENS's model for them by default.
LENS_STATE_POLICIES = frozenset({"prism"})

# STAR's arms (paper 003, §6.1): no rescheduling, Algorithm 1 on current load only, with the length predictor
# (`SimOptions.predictor` or `predictor_bins`), and with the exact remaining lengths; and CascadeInfer's
# length stages (paper 000, `gateway.rescheduling.length_stages`; engines report their requests' lengths).
RescheduleArm = Literal["none", "star-nopred", "star", "star-oracle", "length_stages"]
RESCHEDULE_ARMS: tuple[RescheduleArm, ...] = ("none", "star-nopred", "star", "star-oracle", "length_stages")
PREDICTOR_BINS = (2, 4, 6)  # STAR Table 3's settings
# StarParams fields the simulator's own options set (the arm, --kv-link-gbps, --prediction-interval).
_STAR_FIELDS_OF_OPTIONS = frozenset({"use_prediction", "kv_link_gbps", "round_tokens"})


@dataclass(frozen=True)
class EngineSpec:
    """`count` simulated engines of the sim profile `profile` (ids `{profile}-{i}`, i from 0 per profile).

    `lens`: LENS batch planning for these engines (True "lens", False "static"); None follows
    `SimOptions.lens_planning`. `combo`: the GPU combo label they report (CAUCHY; `Scaling` gives plans'
    engines theirs), "" = none. `role`: `switchyard.roles` (a prefill engine hands each request off to a
    decode engine after its first token), "" = serves whole requests.
    """

    profile: str
    count: int
    lens: bool | None = None
    combo: str = ""
    role: str = ""

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"engine spec {self.profile!r}: count must be >= 1, got {self.count}")
        get_profile(self.profile)  # UnknownProfileError (a ValueError) naming the known profiles


_LENS_MODES = {"lens": True, "static": False}
_ROLES = (PREFILL_ROLE, DECODE_ROLE)


def parse_engines(text: str) -> list[EngineSpec]:
    """Parse "PROFILE:COUNT[:MODE]...,..." (a bare PROFILE means one engine). Modes: lens|static (LENS batch
    planning for that spec, overriding `SimOptions.lens_planning`) and prefill|decode (the engines' role,
    `switchyard.roles`: disaggregated serving), at most one of each; ValueError on a bad item."""
    specs: list[EngineSpec] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        profile, sep, raw = item.partition(":")
        profile = profile.strip()
        count = 1
        lens: bool | None = None
        role = ""
        if sep:
            raw_count, *modes = raw.split(":")
            try:
                count = int(raw_count.strip())
            except ValueError:
                raise ValueError(f"bad engine spec {item!r}: expected PROFILE:COUNT[:lens|static][:prefill|"
                                 f"decode], e.g. h100-llama3-8b:4") from None
            for mode in (m.strip() for m in modes):
                if mode in _LENS_MODES and lens is None:
                    lens = _LENS_MODES[mode]
                elif mode in _ROLES and not role:
                    role = mode
                else:
                    raise ValueError(f"bad engine spec {item!r}: each mode after the count is one of 'lens' "
                                     f"or 'static', and 'prefill' or 'decode', at most one of each; got "
                                     f"{mode!r}")
        specs.append(EngineSpec(profile, count, lens, role=role))
    if not specs:
        raise ValueError(f"no engines in {text!r}: expected e.g. 'h100-llama3-8b:6,a6000-llama3-8b:2'")
    return specs


def _no_params() -> Mapping[str, object]:
    return MappingProxyType({})


@dataclass(frozen=True)
class SimOptions:
    """How to simulate. Policy names and parameters are those of `gateway.policies.registry.make_policy`.

    `state_interval_s`: the agents' WatchState interval (a report at least this often);
    `report_delay_s`: one-way delay from an engine's state reading to the gateway receiving it;
    `stale_after_s`: the gateway's staleness bound; `seed`: engine sampling seed and the dispatcher's random
    draws; `max_output_tokens_default`: max_tokens of requests with no forced output length;
    `record_timeline_s`: the timeline's sampling period.
    `prefix_caching`: engines reuse cached prompt blocks (`engine_agent.sim.prefix_cache`; prompts share
    blocks only where the trace says so, `loadgen.simulate.fleet.PromptIds`); `kv_events`: their reports
    carry the prefix cache's KV events (None, default: only when the policy reads them, `prefix_source`
    "events": keying every prompt's index blocks and indexing the events costs the simulator time).
    `lens_planning`: LENS plans every engine's token budget (Algorithm 1) unless its `EngineSpec.lens` says
    otherwise; `lens_state`: engines run LENS's model and report its state vector (Eq. 8) even without
    planning; None (default) = only when the policy reads it (`LENS_STATE_POLICIES`: running the model costs
    the simulator about 2x); False with planning off: no LENS at all.
    `slo_ttft_s` / `slo_tpot_s`: the SLOs every request carries (to the policy's features and to the
    engine), as the gateway takes them from `x-slo-*` headers; None: none sent.
    `deciders`: gateway worker processes deciding independently (the gateway's `--workers N`): each has its
    own cluster state (its own in-flight ledger, session table and latency window, fed the same engine
    reports), policy instance, dispatch counter and random stream (see `loadgen.simulate.deciders`); 1 is
    the single-process gateway. `decider_assignment`: how requests reach workers, "random" (a connection
    per request: a uniform seeded draw) or "session" (a keep-alive connection per session: a seeded hash of
    the session id; requests without one are drawn).
    STAR (`loadgen.simulate.migrations`, `loadgen.simulate.predictions`): `reschedule` is the arm
    (`RESCHEDULE_ARMS`); every `reschedule_interval_s` each worker's rescheduler proposes a migration per
    model with `gateway.rescheduling.star.propose` (`reschedule_params`: `StarParams` fields, as the gateway's
    `reschedule.params`; `kv_link_gbps` is the link of both C_mig and the modelled transfer, which takes
    `kv_transfer_latency_s` + KV bytes x 8 / (kv_link_gbps x 1e9)), within `move_params` (the live mover's
    limits). Engines report their predictions every `prediction_interval` decode steps (k): exact for
    "star-oracle"; for "star" from `predictor` (a `LengthPredictor` on the sim's synthetic hidden states) or,
    with `predictor_bins` (2, 4 or 6), the exact remaining length quantised to its bin's midpoint; 0
    (unknown) for "star-nopred". `balance_figures`: record the load-balance figures (per engine preemptions,
    peak KV use and migrations; per timeline sample the execution-time variance and the fullest engine's KV
    use; per decider its rescheduler's figures); `records_balance` says whether they are: also whenever
    `reschedule` is not "none".
    `admission`: the gateway's admission gate (`gateway.admission.core.ModelQueue`, the live gate's decisions:
    a priority queue per model in front of the fleet's sequence slots, shedding what cannot meet its TTFT
    SLO), one per decider as each gateway worker has its own, a cascade's requests admitted on its first
    stage's model; on by default with the gateway's defaults, as the live gateway runs it
    (`AdmissionConfig.enabled`); None: off.
    """

    policy: str = "round_robin"
    policy_params: Mapping[str, object] = field(default_factory=_no_params)
    state_interval_s: float = 0.05
    report_delay_s: float = 0.001
    stale_after_s: float = 1.0
    seed: int = 0
    max_output_tokens_default: int = 2048
    record_timeline_s: float = 1.0
    prefix_caching: bool = True
    kv_events: bool | None = None
    lens_planning: bool = False
    lens_state: bool | None = None
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    deciders: int = 1
    decider_assignment: DeciderAssignment = "random"
    reschedule: RescheduleArm = "none"
    reschedule_interval_s: float = 0.5
    reschedule_params: Mapping[str, object] = field(default_factory=_no_params)
    kv_link_gbps: float = 25.0
    kv_transfer_latency_s: float = 0.002
    prediction_interval: int = 20
    predictor: LengthPredictor | None = None
    predictor_bins: int | None = None
    move_params: MoveParams = field(default_factory=MoveParams)
    balance_figures: bool = False
    cascade: CascadeSim | None = None  # requests run a cascade's stages (loadgen.simulate.cascade)
    stages_plan: StagesPlanFile | None = None  # length_stages' first plan (else one stage until re-planned)
    stages_history: tuple[tuple[int, int], ...] = ()  # length_stages: (I, O) of earlier requests, its window
    admission: AdmissionParams | None = field(default_factory=AdmissionParams)

    def __post_init__(self) -> None:
        positive = {"state_interval_s": self.state_interval_s, "stale_after_s": self.stale_after_s,
                    "record_timeline_s": self.record_timeline_s}
        for name, value in positive.items():
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"SimOptions.{name} must be a positive finite number, got {value}")
        if not (math.isfinite(self.report_delay_s) and self.report_delay_s >= 0):
            raise ValueError(f"SimOptions.report_delay_s must be >= 0 and finite, got {self.report_delay_s}")
        for name, slo in (("slo_ttft_s", self.slo_ttft_s), ("slo_tpot_s", self.slo_tpot_s)):
            if slo is not None and not (math.isfinite(slo) and slo > 0):
                raise ValueError(f"SimOptions.{name} must be a positive finite number or None, got {slo}")
        if self.max_output_tokens_default < 1:
            raise ValueError(f"SimOptions.max_output_tokens_default must be >= 1, "
                             f"got {self.max_output_tokens_default}")
        if self.deciders < 1:
            raise ValueError(f"SimOptions.deciders must be >= 1, got {self.deciders}")
        if self.decider_assignment not in DECIDER_ASSIGNMENTS:
            known = ", ".join(DECIDER_ASSIGNMENTS)
            raise ValueError(f"SimOptions.decider_assignment must be one of {known}, "
                             f"got {self.decider_assignment!r}")
        if not isinstance(self.policy_params, MappingProxyType):
            object.__setattr__(self, "policy_params", MappingProxyType(dict(self.policy_params)))
        if not isinstance(self.reschedule_params, MappingProxyType):
            object.__setattr__(self, "reschedule_params", MappingProxyType(dict(self.reschedule_params)))
        self._check_reschedule()

    def _check_reschedule(self) -> None:
        if self.reschedule not in RESCHEDULE_ARMS:
            raise ValueError(f"SimOptions.reschedule must be one of {', '.join(RESCHEDULE_ARMS)}, "
                             f"got {self.reschedule!r}")
        for name, value in (("reschedule_interval_s", self.reschedule_interval_s),
                            ("kv_link_gbps", self.kv_link_gbps)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"SimOptions.{name} must be a positive finite number, got {value}")
        if not (math.isfinite(self.kv_transfer_latency_s) and self.kv_transfer_latency_s >= 0):
            raise ValueError(f"SimOptions.kv_transfer_latency_s must be >= 0 and finite, "
                             f"got {self.kv_transfer_latency_s}")
        if self.prediction_interval < 1:
            raise ValueError(f"SimOptions.prediction_interval must be >= 1, got {self.prediction_interval}")
        if self.predictor_bins is not None and self.predictor_bins not in PREDICTOR_BINS:
            raise ValueError(f"SimOptions.predictor_bins must be one of {PREDICTOR_BINS}, "
                             f"got {self.predictor_bins}")
        if self.predictor is not None and self.predictor_bins is not None:
            raise ValueError("SimOptions: give a predictor or predictor bins, not both")
        if self.reschedule == "star" and self.predictor is None and self.predictor_bins is None:
            raise ValueError("the 'star' arm needs a length predictor (a predictor file) or predictor bins "
                             "(2, 4 or 6); 'star-oracle' uses the exact lengths")
        if self.policy == "length_stages" and self.reschedule != "length_stages":
            raise ValueError("policy length_stages needs --reschedule length_stages: the rescheduler "
                             "publishes the stages it routes by")
        if self.reschedule == "length_stages":
            self.stages_params()
            return
        if self.stages_plan is not None:
            raise ValueError("a stage plan is for --reschedule length_stages")
        clash = sorted(_STAR_FIELDS_OF_OPTIONS & set(self.reschedule_params))
        if clash:
            raise ValueError(f"reschedule parameters {clash} are set by the arm, the KV link and the "
                             f"prediction interval options")
        self.star_params()  # TypeError / ValueError on an unknown or bad parameter

    def stages_params(self) -> LengthStagesParams:
        """CascadeInfer's rescheduler parameters: `reschedule_params` (`LengthStagesParams` keys; the link,
        the interval and a pull's latency are the options'); ValueError naming a bad key."""
        values = {**self.reschedule_params, "kv_link_gbps": self.kv_link_gbps,
                  "interval_s": self.reschedule_interval_s, "transfer_latency_s": self.kv_transfer_latency_s}
        try:
            return LengthStagesParams.from_mapping(values)
        except StagesConfigError as exc:
            raise ValueError(f"reschedule parameters: {exc}") from None

    def star_params(self) -> StarParams:
        """Algorithm 1's parameters: `reschedule_params` over `StarParams`' defaults, with prediction on
        unless the arm is "star-nopred", the KV link of `kv_link_gbps` and k = `prediction_interval`."""
        try:
            return StarParams(**{**self.reschedule_params,  # type: ignore[arg-type]
                                 "use_prediction": self.reschedule != "star-nopred",
                                 "kv_link_gbps": self.kv_link_gbps, "round_tokens": self.prediction_interval})
        except TypeError as exc:
            raise ValueError(f"reschedule parameters: {exc}") from None

    @property
    def records_balance(self) -> bool:
        """Whether the load-balance figures are recorded (`balance_figures`, or any rescheduling arm)."""
        return self.balance_figures or self.reschedule != "none"


@dataclass(frozen=True)
class Scaling:
    """CAUCHY's fleet over a run (paper 004, §3.5): the engines of `plan`'s combos (each copy labelled
    "{combo}#{k}", `loadgen.simulate.fleet.combo_engines` for its engines) instead of an engine list, and
    with `autoscale` Algorithm 1 (`gateway.planning.autoscaler.Autoscaler`, `params`) fed the arrivals' QPS
    every `step_s` (`QpsMeter`, as `switchyard plan --autoscale` samples a trace): a scale-out's engines are
    billed from the decision and join when provisioned; a scale-in's drain (they take nothing new) and leave
    once their grace has passed and nothing is in flight. `solver`: the ILP seam (None: PuLP + CBC).
    `actions`: instead of the autoscaler, these actions (times since the first arrival), applied as they
    come due: a timeline decided elsewhere (`switchyard plan --autoscale`), or a scripted one in tests."""

    plan: Plan
    autoscale: bool = False
    params: AutoscalerParams = field(default_factory=AutoscalerParams)
    step_s: float = 10.0
    solver: Solver | None = None
    actions: tuple[Action, ...] = ()

    def __post_init__(self) -> None:
        if not (math.isfinite(self.step_s) and self.step_s > 0):
            raise ValueError(f"Scaling.step_s must be a positive finite number, got {self.step_s}")
        if not any(n > 0 for n in self.plan.combos.values()):
            raise ValueError("the plan deploys no combo")
        if self.autoscale and self.actions:
            raise ValueError("Scaling: autoscale or scripted actions, not both")


@dataclass
class SimResult:
    """A simulation's outcome. Times in `outcomes` and `timeline` are seconds since the first arrival.

    `duration_s`: first arrival to the last finish (or the last arrival, if later); `wall_s`: wall-clock
    seconds the simulation took; `per_engine`: engine id -> {profile, requests (dispatched and accepted),
    output_tokens, busy_s (summed iteration time), iterations}; `timeline`: one row every `record_timeline_s`
    of {t_s, in_flight (dispatched, not finished), running, waiting (engine totals), throughput_tokens_per_s
    (output tokens over the period ending at t_s)}; `events_processed`: arrivals plus engine iterations
    simulated; `per_decider`: one row per decider (gateway worker) of {decisions (routing decisions it
    made), dispatched (requests it dispatched that the engine accepted)}.
    With `SimOptions.records_balance`: `per_engine` rows also hold preemptions, peak_kv_used_ratio,
    migrations_out and migrations_in; `timeline` rows exec_time_var_ms2 and max_kv_used_ratio; `per_decider`
    rows a `reschedule` dict (that worker's rescheduler: `loadgen.simulate.migrations.MoveStats`); and
    `balance` the run's figures (`loadgen.simulate.balance.balance_figures`); otherwise `balance` is None.
    Billing (CAUCHY): `cost_usd` sums each engine's $/h (its GPUs' catalogue price x TP) over the time it held
    its GPUs within the run (the first arrival to the end of `duration_s`: from then, or from a scale-out's
    decision, until it left or the run ended); `tokens_per_usd` = prompt + output tokens of the successful
    requests / `cost_usd` (None when nothing was billed); timeline rows carry `engines` (in the fleet,
    provisioning or draining included) and `usd_per_h`; `fleet_actions` are the autoscaler's actions
    (`gateway.planning.autoscaler.action_row`, times since the first arrival).
    `handoffs`: with prefill engines in the fleet (disaggregated combos), their hand-offs to decode engines
    (`loadgen.simulate.migrations.Migrations.handoff_figures`); None without.
    """

    outcomes: list[Outcome]
    duration_s: float
    wall_s: float
    per_engine: dict[str, dict[str, Any]]
    timeline: list[dict[str, float]]
    events_processed: int
    per_decider: list[dict[str, Any]] = field(default_factory=list)
    balance: dict[str, Any] | None = None
    cost_usd: float = 0.0
    tokens_per_usd: float | None = None
    fleet_actions: list[dict[str, Any]] = field(default_factory=list)
    handoffs: dict[str, Any] | None = None
    cascade: dict[str, Any] | None = None  # with SimOptions.cascade: `CascadeRun.figures`

    @property
    def simulated_s_per_wall_s(self) -> float:
        return self.duration_s / self.wall_s if self.wall_s > 0 else math.inf
