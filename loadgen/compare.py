"""Policy (or fleet) comparison in the simulator: the same trace and seed under each variant and request rate.

Owns: ``Variant`` (a label, a policy with its parameters, an engine mix, LENS planning on or off and the
number of gateway workers deciding independently), building the variants from policy and fleet lists (and
NexusSched's four ablation arms, ``ablation_variants``, and CascadeInfer's, ``stages_ablation_variants``;
``with_deciders`` repeats them per worker count),
running the simulator once per (variant, rate, seed) on schedules drawn from one request list (one seed, or a
seed sweep for replicates, ``mean_over_seeds``), the side-by-side text table, the request share per engine
type (the paper's Fig. 4b), and the comparison document layout.
Must not: parse command lines, load datasets, plot (``loadgen.plots``) or write files.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from loadgen.arrivals import ArrivalSpec, schedule
from loadgen.datasets import Request
from loadgen.metrics import Slo, summarize
from loadgen.results import to_jsonable
from loadgen.simulate import EngineSpec, Scaling, SimOptions, simulate

COMPARE_SCHEMA = "switchyard.loadgen.compare/1"

# (header, summary key, format) of each table column after the label and rate.
TABLE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("completed", "completed", "{:d}"),
    ("req/s", "request_throughput", "{:.2f}"),
    ("out tok/s", "output_throughput", "{:.0f}"),
    ("TTFT p50", "median_ttft_ms", "{:.1f}"),
    ("TTFT p99", "p99_ttft_ms", "{:.1f}"),
    ("TPOT p50", "median_tpot_ms", "{:.2f}"),
    ("TPOT p99", "p99_tpot_ms", "{:.2f}"),
    ("E2E p50", "median_e2el_ms", "{:.0f}"),
    ("E2E p90", "p90_e2el_ms", "{:.0f}"),
    ("SLO att.", "slo_attainment", "{:.1%}"),
    ("goodput", "request_goodput", "{:.2f}"),
)


def _no_params() -> Mapping[str, object]:
    return MappingProxyType({})


@dataclass(frozen=True)
class Variant:
    """One column of a comparison: a policy with its parameters on an engine mix; `lens_planning` and
    `deciders` (gateway workers deciding independently, `SimOptions.deciders`) None follow the shared
    `SimOptions`; `reschedule_params` (not None) are laid over the shared options' rescheduler parameters."""

    label: str
    policy: str
    engines: tuple[EngineSpec, ...]
    policy_params: Mapping[str, object] = field(default_factory=_no_params)
    lens_planning: bool | None = None
    deciders: int | None = None
    reschedule_params: Mapping[str, object] | None = None


# NexusSched §7.3's ablation: (label, policy, LENS planning).
ABLATION_ARMS: tuple[tuple[str, str, bool], ...] = (
    ("static+round_robin", "round_robin", False),
    ("lens+round_robin", "round_robin", True),
    ("static+prism", "prism", False),
    ("lens+prism", "prism", True),
)


# CascadeInfer §6.5's ablation (`compare --stages-ablation`): (label, policy params, length_stages params
# laid over the command line's). Fig. 14: stage layouts; Fig. 15: boundary refinement; Fig. 16: intra-stage
# balancing (round robin inside a stage routes round robin too).
STAGES_ABLATION_ARMS: tuple[tuple[str, Mapping[str, object], Mapping[str, object]], ...] = (
    ("layout=dp", {}, {"layout": "dp"}),
    ("layout=chain", {}, {"layout": "chain"}),
    ("layout=single", {}, {"layout": "single"}),
    ("refine=count", {}, {"refine": "count"}),
    ("refine=memory", {}, {"refine": "memory"}),
    ("refine=off", {}, {"refine": "off"}),
    ("balance=handover", {}, {"balance": "handover"}),
    ("balance=round_robin", {"within": "round_robin"}, {"balance": "round_robin"}),
)


def stages_ablation_variants(
    fleets: Sequence[Sequence[EngineSpec]], policy_params: Mapping[str, object] | None = None
) -> list[Variant]:
    """`STAGES_ABLATION_ARMS` (`length_stages` each, the full system first: dp, qoe, bidask by default) on
    every fleet; needs the `length_stages` rescheduler."""
    if not fleets:
        raise ValueError("a comparison needs at least one engine mix")
    out = []
    for fleet in fleets:
        for label, extra_policy, extra_reschedule in STAGES_ABLATION_ARMS:
            if len(fleets) > 1:
                label = f"{label} @ {engines_label(fleet)}"
            out.append(Variant(label, "length_stages", tuple(fleet),
                               MappingProxyType({**(policy_params or {}), **extra_policy}),
                               reschedule_params=MappingProxyType(dict(extra_reschedule))))
    return out


def engines_label(engines: Sequence[EngineSpec]) -> str:
    mode = {None: "", True: ":lens", False: ":static"}
    return ",".join(f"{e.profile}:{e.count}{mode[e.lens]}" for e in engines)


def ablation_variants(
    fleets: Sequence[Sequence[EngineSpec]], policy_params: Mapping[str, object] | None = None
) -> list[Variant]:
    """The four ablation arms (static budget or LENS, round robin or PRISM) on every fleet."""
    if not fleets:
        raise ValueError("a comparison needs at least one engine mix")
    params = MappingProxyType(dict(policy_params or {}))
    out = []
    for fleet in fleets:
        for label, policy, lens in ABLATION_ARMS:
            if len(fleets) > 1:
                label = f"{label} @ {engines_label(fleet)}"
            out.append(Variant(label, policy, tuple(fleet), params, lens))
    return out


def share_by_profile(per_engine: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """Fraction of the dispatched requests each engine type (profile) received (the paper's Fig. 4b)."""
    counts: dict[str, int] = {}
    for totals in per_engine.values():
        counts[str(totals["profile"])] = counts.get(str(totals["profile"]), 0) + int(totals["requests"])
    total = sum(counts.values())
    return {profile: (n / total if total else 0.0) for profile, n in sorted(counts.items())}


def build_variants(
    policies: Sequence[str],
    fleets: Sequence[Sequence[EngineSpec]],
    policy_params: Mapping[str, object] | None = None,
) -> list[Variant]:
    """Every policy on every fleet; labels name only what varies (the policy, the fleet, or both)."""
    if not policies or not fleets:
        raise ValueError("a comparison needs at least one policy and one engine mix")
    if len(set(policies)) != len(policies):
        raise ValueError(f"policies repeat: {list(policies)}")
    params = dict(policy_params or {})
    out = []
    for fleet in fleets:
        for policy in policies:
            if len(fleets) == 1:
                label = policy
            elif len(policies) == 1:
                label = engines_label(fleet)
            else:
                label = f"{policy} @ {engines_label(fleet)}"
            out.append(Variant(label, policy, tuple(fleet), MappingProxyType(params)))
    return out


def with_deciders(variants: Sequence[Variant], counts: Sequence[int]) -> list[Variant]:
    """Each variant once per decider count (gateway workers), in that order; with more than one count the
    labels gain " d=N". One count: the variants with it set, labels unchanged."""
    if not counts:
        raise ValueError("a comparison needs at least one decider count")
    if len(set(counts)) != len(counts):
        raise ValueError(f"decider counts repeat: {list(counts)}")
    for count in counts:
        if count < 1:
            raise ValueError(f"decider counts must be >= 1, got {count}")
    if len(counts) == 1:
        return [replace(v, deciders=counts[0]) for v in variants]
    return [replace(v, label=f"{v.label} d={n}", deciders=n) for v in variants for n in counts]


def run_comparison(
    requests: Sequence[Request],
    arrival: ArrivalSpec,
    variants: Sequence[Variant],
    options: SimOptions,
    *,
    rates: Sequence[float] | None = None,
    seeds: Sequence[int] | None = None,
    slo: Slo | None = None,
    on_run: Callable[[dict[str, Any]], None] | None = None,
    scaling: Scaling | None = None,
) -> list[dict[str, Any]]:
    """One simulation per (rate, seed, variant); each returns {label, policy, policy_params, engines, rate,
    seed, lens_planning, deciders, decider_assignment, summary (vLLM-style flat dict), per_engine,
    per_decider, share_by_profile (request share per engine type), timeline, sim_wall_s,
    simulated_s_per_wall_s}. Every variant at a (rate, seed) replays the identical schedule; ``on_run`` sees
    each run as it finishes. ``seeds`` (default: the arrival spec's seed and the options' seed, which should
    agree) replaces both seeds per replicate: the arrival draws, the engines' sampling and the gateway's
    random draws and decider assignment; the request list stays the one given. ``scaling``: every variant
    runs on that CAUCHY fleet (its engines are ignored); the summaries gain cost_usd and tokens_per_usd
    (every run has them: a fixed fleet is billed too) and the runs the autoscaler's fleet_actions."""
    if rates is not None and arrival.timestamps:
        raise ValueError("--rates sweeps the request rate and cannot be combined with --timestamps")
    sweep: list[float | None] = list(rates) if rates else [None]
    for rate in sweep:
        if rate is not None and not rate > 0:
            raise ValueError(f"rates must be > 0, got {rate}")
    if seeds is not None and (not seeds or len(set(seeds)) != len(seeds)):
        raise ValueError(f"seeds must be a non-empty list without repeats, got {list(seeds)}")
    replicates: list[int | None] = list(seeds) if seeds is not None else [None]
    runs = []
    for rate, seed in ((rate, seed) for rate in sweep for seed in replicates):
        spec = arrival if rate is None else ArrivalSpec(**{**arrival.model_dump(), "rate_per_s": rate})
        shared = options
        if seed is not None:
            spec = ArrivalSpec(**{**spec.model_dump(), "seed": seed})
            shared = replace(options, seed=seed)
        plan = schedule(requests, spec)
        if not plan:
            raise ValueError("the schedule is empty: no request to simulate")
        for variant in variants:
            opts = replace(shared, policy=variant.policy, policy_params=variant.policy_params)
            if variant.lens_planning is not None:
                opts = replace(opts, lens_planning=variant.lens_planning)
            if variant.deciders is not None:
                opts = replace(opts, deciders=variant.deciders)
            if variant.reschedule_params is not None:
                opts = replace(opts,
                               reschedule_params={**opts.reschedule_params, **variant.reschedule_params})
            result = simulate(plan, [] if scaling is not None else variant.engines, opts, scaling=scaling)
            summary = summarize(result.outcomes, max(result.duration_s, 1e-9), slo).to_dict()
            summary.update(cost_usd=result.cost_usd, tokens_per_usd=result.tokens_per_usd)
            run = {
                "label": variant.label, "policy": variant.policy,
                "policy_params": dict(variant.policy_params),
                "reschedule_params": dict(opts.reschedule_params),
                "engines": engines_label(variant.engines), "lens_planning": opts.lens_planning,
                "deciders": opts.deciders, "decider_assignment": opts.decider_assignment,
                "rate": spec.rate_per_s, "seed": opts.seed, "summary": summary,
                "per_engine": result.per_engine, "per_decider": result.per_decider,
                "share_by_profile": share_by_profile(result.per_engine), "timeline": result.timeline,
                "sim_wall_s": result.wall_s,
                "simulated_s_per_wall_s": result.simulated_s_per_wall_s,
                "events_processed": result.events_processed,
                "fleet_actions": result.fleet_actions, "handoffs": result.handoffs,
            }
            runs.append(run)
            if on_run is not None:
                on_run(run)
    return runs


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def mean_over_seeds(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The replicates of each (label, rate) folded into one row, in first-seen order: {label, policy,
    engines, deciders, decider_assignment, rate, seeds, summary (the mean of each numeric summary figure,
    None unless every replicate has it), summary_min, summary_max (its extremes over the replicates)}."""
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for run in runs:
        groups.setdefault((str(run["label"]), _rate_text(run["rate"])), []).append(run)
    rows = []
    for group in groups.values():
        first = group[0]
        mean: dict[str, float | None] = {}
        low: dict[str, float | None] = {}
        high: dict[str, float | None] = {}
        for key, value in first["summary"].items():
            if not (value is None or _number(value)):
                continue  # lists, strings: not averaged
            values = [run["summary"].get(key) for run in group]
            if all(_number(v) for v in values):
                numbers = [float(v) for v in values]
                mean[key], low[key], high[key] = math.fsum(numbers) / len(numbers), min(numbers), max(numbers)
            else:
                mean[key] = low[key] = high[key] = None
        rows.append({
            "label": first["label"], "policy": first.get("policy"), "engines": first.get("engines"),
            "deciders": first.get("deciders"), "decider_assignment": first.get("decider_assignment"),
            "rate": first["rate"], "seeds": [run.get("seed") for run in group], "summary": mean,
            "summary_min": low, "summary_max": high,
        })
    return rows


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt == "{:d}":
        return fmt.format(int(value))
    return fmt.format(float(value))


def _rate_text(rate: Any) -> str:
    return "inf" if isinstance(rate, float) and math.isinf(rate) else f"{float(rate):g}"


def format_table(runs: Sequence[Mapping[str, Any]]) -> str:
    """A fixed-width table, one row per run (variant x rate), latencies in ms."""
    headers = ["variant", "rate", *(h for h, _, _ in TABLE_COLUMNS)]
    rows = [[str(run["label"]), _rate_text(run["rate"]),
             *(_cell(run["summary"].get(key), fmt) for _, key, fmt in TABLE_COLUMNS)] for run in runs]
    widths = [max(len(headers[i]), *(len(r[i]) for r in rows)) if rows else len(headers[i])
              for i in range(len(headers))]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths,
                                                                                            strict=True)))]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths, strict=True))))
    return "\n".join(lines)


def format_share_table(runs: Sequence[Mapping[str, Any]]) -> str:
    """Request share per engine type, one row per run; empty when every run has a single engine type."""
    profiles = sorted({p for run in runs for p in run.get("share_by_profile", {})})
    if len(profiles) < 2:
        return ""
    headers = ["variant", "rate", *profiles]
    rows = [[str(run["label"]), _rate_text(run["rate"]),
             *(f"{run['share_by_profile'].get(p, 0.0):.1%}" for p in profiles)] for run in runs]
    widths = [max(len(headers[i]), *(len(r[i]) for r in rows)) for i in range(len(headers))]
    lines = ["request share per engine type",
             "  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths,
                                                                                             strict=True))),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths,
                                                                                            strict=True)))
              for row in rows]
    return "\n".join(lines)


def comparison_document(
    runs: Sequence[Mapping[str, Any]],
    config: Mapping[str, Any],
    *,
    means: Sequence[Mapping[str, Any]] | None = None,
    timelines: bool = True,
) -> dict[str, Any]:
    """The comparison JSON: schema, the shared configuration and every run (without per-request outcomes;
    without the per-second timelines when ``timelines`` is False), plus ``means`` (``mean_over_seeds``)
    when given."""
    kept = [run if timelines else {k: v for k, v in run.items() if k != "timeline"} for run in runs]
    doc = {"schema": COMPARE_SCHEMA, "config": to_jsonable(config), "runs": to_jsonable(kept)}
    if means is not None:
        doc["means"] = to_jsonable(list(means))
    return doc


AGREEMENT_KEYS: tuple[str, ...] = (
    "median_ttft_ms", "p90_ttft_ms", "median_tpot_ms", "p90_tpot_ms", "median_e2el_ms", "p90_e2el_ms",
    "output_throughput",
)


def agreement(live: Mapping[str, Any], simulated: Mapping[str, Any],
              keys: Sequence[str] = AGREEMENT_KEYS) -> dict[str, dict[str, float | None]]:
    """Live against simulated, per summary key: both values, live - sim and live / sim (None if sim is 0)."""
    out: dict[str, dict[str, float | None]] = {}
    for key in keys:
        a, b = float(live[key]), float(simulated[key])
        out[key] = {"live": a, "sim": b, "diff": a - b, "ratio": a / b if b else None}
    return out
