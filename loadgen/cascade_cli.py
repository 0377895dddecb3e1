"""`loadgen simulate|compare --cascade`: the flags, the MT-Bench item requests and the results of a cascade
run.

Owns: the cascade flag group (`--cascade NAME=MODEL:THRESHOLD,...,MODEL`, `--judge fixed:SECONDS |
pool:MODEL[:rating|explain]`, `--judge-bias`, `--judge-noise`, `--cascade-streaming`, `--quality-profile`),
turning them into `loadgen.simulate.cascade.CascadeSim`, the requests of a cascade run (`--dataset mt-bench|
mt-bench-hard|mt-bench-easy`: items of the quality profile drawn with replacement, `--num-requests` of them,
500 by default), the fleet check (every stage model has engines, and a pool judge's model too), and the
summary lines (stage shares, quality, the judge) and config of the results file.
Must not: simulate (the runner does) or decide anything of the cascade (`gateway.cascade.core` does).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gateway.cascade.core import CascadeSpecError, parse_cascade
from gateway.cascade.plan.replan import ReplanParams
from gateway.cascade.quality import SUBSETS, QualityProfile, QualityProfileError, load_profile
from loadgen.datasets.request import Request
from loadgen.simulate.cascade import (
    APP_H_JUDGE_S,
    EXPLAIN_JUDGMENT_TOKENS,
    CascadeSim,
    SimJudge,
    SimReplan,
    cascade_requests,
)
from loadgen.simulate.spec import EngineSpec
from switchyard.profiles import get_profile

DEFAULT_CASCADE_REQUESTS = 500


def cascade_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--cascade",
        metavar="NAME=MODEL:T,...,MODEL",
        help="requests run this cascade (e.g. cascade-llama3=llama3-8b:90,llama3-70b): a stage "
        "answers, the judge scores it, below the threshold T (0-100) it escalates; the dataset "
        f"is then one of {', '.join(SUBSETS)} (MT-Bench items, both turns, drawn with "
        "replacement) and the fleet must serve every stage model",
    )
    g.add_argument(
        "--judge",
        default=f"fixed:{APP_H_JUDGE_S}",
        metavar="fixed:SECONDS|pool:MODEL[:rating|explain]",
        help="the simulated judge, scoring from the quality profile: fixed:SECONDS, a fixed delay per "
        "verdict (Cascadia App. H: 0.27 s); pool:MODEL, a model the fleet serves (e.g. pool:qwen2.5-14b), "
        "each verdict a request to it that queues and batches with the load, writing Rating: [[k]] "
        f"(rating, the default) or an explanation first (explain, {EXPLAIN_JUDGMENT_TOKENS} tokens)",
    )
    g.add_argument(
        "--judge-bias",
        type=float,
        default=0.0,
        metavar="POINTS",
        help="added to every verdict (0-100 scale; routing only, not the quality credited)",
    )
    g.add_argument(
        "--judge-noise",
        type=float,
        default=0.0,
        metavar="POINTS",
        help="standard deviation of Gaussian noise on every verdict (routing only)",
    )
    g.add_argument(
        "--cascade-streaming",
        choices=("final_live", "buffered"),
        default="final_live",
        help="final_live: the last stage streams as generated; buffered: every answer is released whole",
    )
    g.add_argument(
        "--quality-profile",
        metavar="PATH",
        help="a quality profile JSON (gateway/cascade/assets format); default the shipped MT-Bench "
        "one (Mixtral-8x7B for llama3-8b, GPT-4 for llama3-70b, a synthetic qwen2.5-14b)",
    )

    g.add_argument(
        "--replan",
        action="store_true",
        help="with --plan: re-plan on workload shift (Cascadia §4.4): 5-minute windows, 50 sampled and 5 %% "
        "shadowed requests, Algorithm 1 re-run on a shift, thresholds swapped, replicas reconfigured one at "
        "a time",
    )
    g.add_argument(
        "--replan-param",
        action="append",
        default=[],
        metavar="K=V",
        help="the monitor's parameters (window_s, sample_size, shadow_share, alpha, min_rate_change, "
        "min_shadow, history_windows); repeatable",
    )


def replan_params(pairs: Sequence[str]) -> ReplanParams:
    """`--replan-param K=V` pairs as `ReplanParams` (ValueError naming the bad one)."""
    fields = {f.name: f.type for f in dataclasses.fields(ReplanParams)}
    values: dict[str, Any] = {}
    for pair in pairs:
        key, eq, text = pair.partition("=")
        if not eq or key not in fields:
            raise ValueError(f"--replan-param {pair!r}: expected K=V with K one of {', '.join(fields)}")
        try:
            values[key] = int(text) if fields[key] == "int" else float(text)
        except ValueError:
            raise ValueError(f"--replan-param {pair!r}: {text!r} is not a number") from None
    return ReplanParams(**values)


def _replan(args: argparse.Namespace, profile: QualityProfile) -> SimReplan | None:
    if not getattr(args, "replan", False):
        if getattr(args, "replan_param", None):
            raise ValueError("--replan-param is for --replan")
        return None
    plan = getattr(args, "cascade_plan", None)
    if plan is None:
        raise ValueError("--replan needs --plan FILE (a loadgen cascade-plan file: the budget and q_min)")
    return SimReplan(
        plan.gpu,
        plan.budget_gpus,
        profile.subset(plan.dataset),
        plan.rate_rps,
        plan.q_min,
        plan.l_max_s,
        plan.judge_latency_s,
        replan_params(args.replan_param),
    )


def cascade_sim(args: argparse.Namespace) -> CascadeSim | None:
    """The run's `CascadeSim`, built (its profile read) once per parsed command line."""
    if not getattr(args, "cascade", None):
        return None
    built = getattr(args, "cascade_sim", None)
    if isinstance(built, CascadeSim):
        return built
    try:
        spec = parse_cascade(args.cascade)
        profile = load_profile(Path(args.quality_profile) if args.quality_profile else None)
        judge = SimJudge.parse(args.judge, bias=args.judge_bias, noise=args.judge_noise)
        sim = CascadeSim(
            spec, profile, judge, streaming=args.cascade_streaming, replan=_replan(args, profile)
        )
    except (CascadeSpecError, QualityProfileError) as exc:
        raise ValueError(f"--cascade: {exc}") from None
    args.cascade_sim = sim
    return sim


def cascade_phases(text: str) -> list[tuple[str, float]]:
    """`SUBSET@SECONDS,...` (a workload that shifts: App. G's `mt-bench-hard@480,mt-bench@960,
    mt-bench-easy@600`), as (subset, seconds) pairs."""
    phases: list[tuple[str, float]] = []
    for part in text.split(","):
        subset, at, seconds = part.strip().partition("@")
        try:
            duration = float(seconds)
        except ValueError:
            duration = -1.0
        if subset not in SUBSETS or not at or not duration > 0:
            raise ValueError(
                f"--dataset {text!r}: a shifting cascade workload is SUBSET@SECONDS,... with SUBSET one of "
                f"{', '.join(SUBSETS)}"
            )
        phases.append((subset, duration))
    return phases


def cascade_dataset(args: argparse.Namespace) -> list[Request]:
    """`--num-requests` items of one subset; or, for `SUBSET@SECONDS,...`, rate x seconds items of each
    subset in turn (the arrivals then follow the phases)."""
    sim = cascade_sim(args)
    assert sim is not None
    first = sim.spec.models[0]
    if "@" in args.dataset:
        if not math.isfinite(args.rate):
            raise ValueError("a shifting cascade workload (SUBSET@SECONDS,...) needs --rate")
        if args.num_requests is not None:
            raise ValueError("--num-requests does not go with SUBSET@SECONDS phases (rate x seconds each)")
        requests: list[Request] = []
        for k, (subset, seconds) in enumerate(cascade_phases(args.dataset)):
            drawn = cascade_requests(
                sim.profile, subset, round(args.rate * seconds), seed=args.seed + k, first_model=first
            )
            requests += [dataclasses.replace(r, request_id=f"p{k}-{r.request_id}") for r in drawn]
        return requests
    if args.dataset not in SUBSETS:
        raise ValueError(
            f"--cascade takes --dataset {' | '.join(SUBSETS)} (MT-Bench items of the quality "
            f"profile) or SUBSET@SECONDS,... phases, got {args.dataset!r}"
        )
    count = args.num_requests if args.num_requests is not None else DEFAULT_CASCADE_REQUESTS
    return cascade_requests(sim.profile, args.dataset, count, seed=args.seed, first_model=first)


def check_cascade_fleet(args: argparse.Namespace, engines: Sequence[EngineSpec]) -> None:
    """Every stage model has engines, and a pool judge's model; `--model` makes no sense with a cascade (the
    stages name theirs)."""
    sim = cascade_sim(args)
    assert sim is not None
    if args.model:
        raise ValueError("--model does not go with --cascade: each stage runs its own model")
    served = {get_profile(e.profile).model.name for e in engines}
    fleet = ", ".join(sorted(served))
    missing = [m for m in sim.spec.models if m not in served]
    if missing:
        raise ValueError(f"--cascade: no engine serves {', '.join(missing)} (the fleet serves {fleet})")
    judge = sim.judge.model
    if judge is not None and judge not in served:
        raise ValueError(f"--judge: no engine serves the judge model {judge} (the fleet serves {fleet})")


def cascade_config(args: argparse.Namespace) -> dict[str, Any]:
    if not getattr(args, "cascade", None):
        return {"cascade": None}
    return {
        "cascade": args.cascade,
        "judge": args.judge,
        "judge_bias": args.judge_bias,
        "judge_noise": args.judge_noise,
        "cascade_streaming": args.cascade_streaming,
        "quality_profile": args.quality_profile,
        "replan": bool(getattr(args, "replan", False)),
        "replan_params": list(getattr(args, "replan_param", [])),
    }


def print_cascade(figures: dict[str, Any]) -> None:
    shares = " / ".join(f"{s:.1%}" for s in figures["stage_share"])
    quality = figures["quality"]
    print(f"{'Cascade stage share; escalated:':<36}{shares}; {figures['escalated_share']:.1%}")
    print(
        f"{'Cascade quality Q (0-100):':<36}{'-' if quality is None else f'{quality:.2f}'} "
        f"(stand-ins: {', '.join(f'{k}={v}' for k, v in figures['stand_ins'].items())})"
    )
    print(f"{'Cascade judge:':<36}{judge_line(figures['judge'])}")


def judge_line(judge: dict[str, Any]) -> str:
    """`pool qwen2.5-14b (rating): 120 verdicts, latency mean 0.061 s / p95 0.094 s; tokens 95k prompt /
    480 completion`, then the failed verdicts by outcome and the breaker's skips, if any."""
    kind = f"pool {judge['model']}" if judge["kind"] == "pool" else f"fixed {judge['latency_s']:g} s"
    mean, p95 = judge["mean_latency_s"], judge["p95_latency_s"]
    latency = "-" if mean is None else f"mean {mean:.3f} s / p95 {p95:.3f} s"
    line = (
        f"{kind} ({judge['output']}): {judge['verdicts']} verdicts, latency {latency}; tokens "
        f"{_count(judge['prompt_tokens'])} prompt / {_count(judge['completion_tokens'])} completion"
    )
    failures = judge["failures"]
    if failures:
        line += "; failed " + ", ".join(f"{outcome} {n}" for outcome, n in failures.items())
    if judge["skips"]:
        line += f"; breaker opened {judge['skips']}x"
    return line


def _count(tokens: int) -> str:
    return (
        f"{tokens / 1e6:.2f}M" if tokens >= 1e6 else f"{tokens / 1e3:.1f}k" if tokens >= 1e4 else str(tokens)
    )
