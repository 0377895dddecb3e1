"""`loadgen simulate|compare --cascade`: the flags, the MT-Bench item requests and the results of a cascade
run.

Owns: the cascade flag group (`--cascade NAME=MODEL:THRESHOLD,...,MODEL`, `--judge fixed:SECONDS`,
`--judge-bias`, `--judge-noise`, `--cascade-streaming`, `--quality-profile`), turning them into
`loadgen.simulate.cascade.CascadeSim`, the requests of a cascade run (`--dataset mt-bench|mt-bench-hard|
mt-bench-easy`: items of the quality profile drawn with replacement, `--num-requests` of them, 500 by
default), the fleet check (every stage model has engines), and the summary lines and config of the results
file.
Must not: simulate (the runner does) or decide anything of the cascade (`gateway.cascade.core` does).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gateway.cascade.core import CascadeSpecError, parse_cascade
from gateway.cascade.quality import SUBSETS, QualityProfileError, load_profile
from loadgen.datasets.request import Request
from loadgen.simulate.cascade import APP_H_JUDGE_S, CascadeSim, SimJudge, cascade_requests
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
        metavar="fixed:SECONDS",
        help="the simulated judge: a fixed delay per verdict (Cascadia App. H: 0.27 s), scores "
        "from the quality profile",
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
        args.cascade_sim = CascadeSim(spec, profile, judge, streaming=args.cascade_streaming)
        return args.cascade_sim
    except (CascadeSpecError, QualityProfileError) as exc:
        raise ValueError(f"--cascade: {exc}") from None


def cascade_dataset(args: argparse.Namespace) -> list[Request]:
    sim = cascade_sim(args)
    assert sim is not None
    if args.dataset not in SUBSETS:
        raise ValueError(
            f"--cascade takes --dataset {' | '.join(SUBSETS)} (MT-Bench items of the quality "
            f"profile), got {args.dataset!r}"
        )
    count = args.num_requests if args.num_requests is not None else DEFAULT_CASCADE_REQUESTS
    return cascade_requests(sim.profile, args.dataset, count, seed=args.seed, first_model=sim.spec.models[0])


def check_cascade_fleet(args: argparse.Namespace, engines: Sequence[EngineSpec]) -> None:
    """Every stage model has engines; `--model` makes no sense with a cascade (the stages name theirs)."""
    sim = cascade_sim(args)
    assert sim is not None
    if args.model:
        raise ValueError("--model does not go with --cascade: each stage runs its own model")
    served = {get_profile(e.profile).model.name for e in engines}
    missing = [m for m in sim.spec.models if m not in served]
    if missing:
        raise ValueError(
            f"--cascade: no engine serves {', '.join(missing)} (the fleet serves {', '.join(sorted(served))})"
        )


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
    }


def print_cascade(figures: dict[str, Any]) -> None:
    shares = " / ".join(f"{s:.1%}" for s in figures["stage_share"])
    quality = figures["quality"]
    print(f"{'Cascade stage share; escalated:':<36}{shares}; {figures['escalated_share']:.1%}")
    print(
        f"{'Cascade quality Q (0-100):':<36}{'-' if quality is None else f'{quality:.2f}'} "
        f"(stand-ins: {', '.join(f'{k}={v}' for k, v in figures['stand_ins'].items())})"
    )
