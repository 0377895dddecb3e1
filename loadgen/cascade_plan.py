"""`loadgen cascade-plan`: Cascadia's Algorithm 1 on a quality profile, written as a plan file (issue 15 part
7).

Owns: the subcommand's flags, one-line errors (exit 2) for bad ones, timing the solver (the planner is pure
and reads no clock) and the plan JSON: `thresholds, gpus, shapes, L_s, Q, J, iterations, solver_s`, plus the
stage shares and rates, L, the end-to-end p95 estimate with the judge, the capacities, the request and the
stand-in labels of the profile's models. Infinite latencies (nothing keeps up) are written as null.
`plan_fleet` / `read_plan_fleet` read a plan back for `loadgen simulate --cascade SPEC --plan FILE`.
Must not: plan (that is `gateway.cascade.plan`), simulate or serve.

    loadgen cascade-plan --gpus h100:32 --cascade llama3-8b,llama3-70b --dataset mt-bench-hard --rate 10 \\
        --q-min 90 --output plan.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.cascade.plan import CascadePlan, PlanRequest, plan_cascade
from gateway.cascade.plan.bilevel import JUDGE_LATENCY_S
from gateway.cascade.quality import SUBSETS, QualityProfileError, load_profile
from loadgen.simulate.spec import EngineSpec
from switchyard.profiles import profile_name


def _gpus(text: str) -> tuple[str, int]:
    name, sep, count = text.partition(":")
    try:
        n = int(count)
    except ValueError:
        n = 0
    if not sep or not name or n < 1:
        raise argparse.ArgumentTypeError(f"expected GPU:COUNT like h100:32, got {text!r}")
    return name, n


def _models(text: str) -> tuple[str, ...]:
    models = tuple(m.strip() for m in text.split(",") if m.strip())
    if len(models) < 2:
        raise argparse.ArgumentTypeError(
            f"a cascade needs at least two models, e.g. llama3-8b,llama3-70b; got {text!r}"
        )
    if len(set(models)) != len(models):
        raise argparse.ArgumentTypeError(f"a model repeats in {text!r}")
    return models


def _number(text: str, *, strict: bool) -> float:
    """A finite number > 0 (`strict`) or >= 0, for argparse."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0 or (strict and value == 0):
        raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} 0, got {text}")
    return value


def _positive(text: str) -> float:
    return _number(text, strict=True)


def _non_negative(text: str) -> float:
    return _number(text, strict=False)


def add_parser(sub: Any) -> None:
    """Register `cascade-plan` on the loadgen CLI's subparsers."""
    p = sub.add_parser("cascade-plan", help="plan a cascade's thresholds and GPUs (Cascadia Algorithm 1)")
    p.add_argument(
        "--gpus", type=_gpus, required=True, metavar="GPU:N", help="GPU type and count, e.g. h100:32"
    )
    p.add_argument(
        "--cascade",
        type=_models,
        required=True,
        metavar="M1,M2[,M3]",
        help="the cascade's models, smallest first",
    )
    p.add_argument("--dataset", choices=SUBSETS, default="mt-bench", help="the quality profile's subset")
    p.add_argument("--rate", type=_positive, required=True, metavar="R", help="arrival rate (req/s)")
    p.add_argument(
        "--q-min", type=_non_negative, metavar="Q", help="quality floor on the profile's 0-100 scale"
    )
    p.add_argument(
        "--l-max",
        type=_positive,
        metavar="S",
        help="latency budget in seconds: maximise quality under it instead (App. C)",
    )
    p.add_argument(
        "--judge-latency-s",
        type=_non_negative,
        default=JUDGE_LATENCY_S,
        metavar="S",
        help="judge latency per judged stage for the end-to-end estimate (App. H: 0.27)",
    )
    p.add_argument(
        "--profile",
        type=Path,
        metavar="PATH",
        help="a quality profile JSON (default: the shipped MT-Bench profile)",
    )
    p.add_argument("--output", type=Path, required=True, metavar="FILE", help="where to write the plan JSON")


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def plan_document(
    plan: CascadePlan, request: PlanRequest, dataset: str, sources: dict[str, str]
) -> dict[str, Any]:
    return {
        "thresholds": list(plan.thresholds),
        "gpus": list(plan.gpus),
        "shapes": [[list(group) for group in stage] for stage in plan.shapes],
        "L_s": [_finite(v) for v in plan.stage_p95_s],
        "Q": plan.quality,
        "J": _finite(plan.objective),
        "iterations": plan.iterations,
        "solver_s": plan.solver_s,
        "L": _finite(plan.latency_s),
        "e2e_p95_s": _finite(plan.e2e_p95_s),
        "feasible": plan.feasible,
        "models": list(plan.models),
        "gpu": plan.gpu,
        "stage_share": list(plan.stage_share),
        "answer_share": list(plan.answer_share),
        "stage_rate_rps": list(plan.stage_rate_rps),
        "stage_capacity_rps": [_finite(v) for v in plan.stage_capacity_rps],
        "evaluations": plan.evaluations,
        "milp_solves": plan.milp_solves,
        "request": {
            "gpus": request.gpus,
            "rate_rps": request.rate_rps,
            "q_min": request.q_min,
            "l_max_s": request.l_max_s,
            "judge_latency_s": request.judge_latency_s,
            "dataset": dataset,
        },
        "stand_ins": {m: sources[m] for m in plan.models if m in sources},
        "history": [
            {"thresholds": list(t), "L": _finite(lat), "Q": q, "J": _finite(j)}
            for t, lat, q, j in plan.history
        ],
    }


def run(args: argparse.Namespace) -> int:
    """Plan and write the file; 2 with one line on stderr for a bad flag value."""
    gpu, count = args.gpus
    try:
        if args.q_min is None and args.l_max is None:
            raise ValueError("give --q-min, --l-max, or both")
        profile = load_profile(args.profile).subset(args.dataset)
        request = PlanRequest(
            tuple(args.cascade),
            gpu,
            count,
            args.rate,
            q_min=args.q_min,
            l_max_s=args.l_max,
            judge_latency_s=args.judge_latency_s,
        )
        plan = plan_cascade(request, profile, timer=time.perf_counter)
    except (ValueError, QualityProfileError) as exc:
        print(f"loadgen: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    document = plan_document(plan, request, args.dataset, profile.sources)
    try:
        args.output.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    except OSError as exc:
        print(f"loadgen: error: cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    if not plan.feasible:
        print(f"loadgen: no deployment of {count} {gpu} GPUs keeps up with {args.rate:g} req/s under any "
              f"routing; the plan in {args.output} is marked infeasible", file=sys.stderr)
        return 1
    shapes = "; ".join(
        ",".join(f"{c}x(tp{tp},pp{pp})" for tp, pp, c in stage) or "-" for stage in plan.shapes
    )
    print(f"thresholds {list(plan.thresholds)}  gpus {list(plan.gpus)}  shapes {shapes}")
    print(
        f"L {plan.latency_s:.3f}s  L_s {[round(v, 3) for v in plan.stage_p95_s]}  Q {plan.quality:.2f}  "
        f"J {plan.objective:.3f}  e2e p95 {plan.e2e_p95_s:.3f}s  iterations {plan.iterations}  "
        f"solver {plan.solver_s or 0.0:.2f}s -> {args.output}"
    )
    return 0


@dataclass(frozen=True)
class PlanFleet:
    """What `loadgen simulate --cascade SPEC --plan FILE` takes from a cascade plan: the stage models, the
    thresholds and the engines (each stage's replicas as `EngineSpec`s of shape profiles
    `{gpu}x{tp}p{pp}-{model}`, `switchyard.profiles.shape_profile`)."""

    models: tuple[str, ...]
    thresholds: tuple[float, ...]
    engines: tuple[EngineSpec, ...]
    gpus: int  # GPUs the replicas hold (a plan may leave some of its budget idle)
    gpu: str = "h100"
    budget_gpus: int = 0  # what the plan was given (`--gpus`): a re-plan's budget
    rate_rps: float = 0.0  # the request the plan answers, for re-planning
    q_min: float | None = None
    l_max_s: float | None = None
    judge_latency_s: float = JUDGE_LATENCY_S
    dataset: str = "mt-bench"


def plan_fleet(document: dict[str, Any]) -> PlanFleet:
    """A `plan_document` read back; ValueError (one line) for a file that is not one, or a plan that cannot be
    served: no replica for a stage that gets traffic, or a threshold the gateway does not take (the routing
    search's 101, escalate-all, leaves a stage that answers nothing: plan without that model instead)."""
    try:
        models = tuple(str(m) for m in document["models"])
        thresholds = tuple(float(t) for t in document["thresholds"])
        gpu = str(document["gpu"])
        shapes = [[(int(tp), int(pp), int(count)) for tp, pp, count in stage] for stage in document["shapes"]]
        share = [float(s) for s in document["stage_share"]]
        request = document["request"]
        budget, rate = int(request["gpus"]), float(request["rate_rps"])
        q_min = None if request.get("q_min") is None else float(request["q_min"])
        l_max = None if request.get("l_max_s") is None else float(request["l_max_s"])
        judge_s, dataset = float(request["judge_latency_s"]), str(request["dataset"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(
            f"not a cascade plan (loadgen cascade-plan --output): {type(exc).__name__} {exc}"
        ) from None
    if len(thresholds) != len(models) - 1 or len(shapes) != len(models) or len(share) != len(models):
        raise ValueError(
            f"{len(models)} models take {len(models) - 1} thresholds, {len(models)} shape lists "
            f"and stage shares"
        )
    for index, threshold in enumerate(thresholds):
        if not 0.0 <= threshold <= 100.0:
            raise ValueError(
                f"stage {index} ({models[index]}) has threshold {threshold:g}: it escalates "
                "every request and answers none; plan the cascade without that model"
            )
    engines: list[EngineSpec] = []
    held = 0
    for model, stage, reached in zip(models, shapes, share, strict=True):
        if reached > 0 and not any(count > 0 for _, _, count in stage):
            raise ValueError(f"the plan gives {model} no replica but routes it {reached:.1%} of requests")
        for tp, pp, count in stage:
            if count > 0:
                engines.append(EngineSpec(profile_name(gpu, model, tp, pp), count))
                held += tp * pp * count
    return PlanFleet(
        models, thresholds, tuple(engines), held, gpu, budget, rate, q_min, l_max, judge_s, dataset
    )


def read_plan_fleet(path: Path) -> PlanFleet:
    """`plan_fleet` of a file; ValueError naming the problem in one line."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"cannot read it: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(document, dict):
        raise ValueError("not a cascade plan (a JSON object)")
    return plan_fleet(document)
