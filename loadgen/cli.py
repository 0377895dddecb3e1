"""Command line of the load generator: ``python -m loadgen {run,simulate,compare} ...``.

Owns: the flags (shared ones on every command), one-line operator errors (exit 2) for bad flags, a missing
data directory, an unknown dataset or an unreachable target, building the workload (dataset -> prepared
requests -> schedule), calling live replay, the simulator or the comparison (once per STAR rescheduling arm
with ``--reschedule``; each run records its arm and its load-balance figures), printing the summary, and
writing the results JSON and (lazily imported) plots.
Must not: measure requests (``loadgen.live``), model engines or route (``loadgen.simulate``), compute metrics
(``loadgen.metrics``) or install an event loop policy (``loadgen.__main__`` picks the loop).

Live replay of token-count traces (azure-*, sarathi-sharegpt, arxiv) synthesises prompts of the exact length
with the sim agents' tokenizer; against engines with another tokenizer pass ``--tokenizer DIR`` (an HF-style
directory with tokenizer.json and tokenizer_config.json) so the engines see the trace's prompt lengths.
Block prompts (mooncake-*, sessions) go live as token ids of ``--vocab-size`` (default: that tokenizer's
vocabulary). ``--dataset sessions`` makes its own arrivals: ``--rate`` is then session starts per second.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import math
import os
import sys
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

import aiohttp
import orjson
from pydantic import ValidationError

from engine_agent.star.predictor import LengthPredictor
from engine_agent.tokenization import Tokenizer
from gateway.admission.core import AdmissionParams
from gateway.rescheduling.length_stages import StagesConfigError, StagesPlanFile
from loadgen import cascade_plan
from loadgen.arrivals import ArrivalSpec, schedule
from loadgen.cascade_cli import (
    cascade_config,
    cascade_dataset,
    cascade_flags,
    cascade_sim,
    check_cascade_fleet,
    print_cascade,
)
from loadgen.compare import (
    ABLATION_ARMS,
    Variant,
    ablation_variants,
    build_variants,
    comparison_document,
    format_share_table,
    format_table,
    mean_over_seeds,
    run_comparison,
    stages_ablation_variants,
    with_deciders,
)
from loadgen.datasets import (
    OUTPUT_LENGTH_DISTRIBUTIONS,
    Request,
    SessionSpec,
    TurnLengths,
    dataset_names,
    load_dataset,
    with_output_lengths,
)
from loadgen.live import (
    EngineTokenizer,
    LiveOptions,
    LiveResult,
    TargetUnreachableError,
    block_fidelity,
    check_block_vocab,
    fetch_models,
    prepare_requests,
    run_live,
)
from loadgen.metrics import Outcome, Slo, Summary, parse_slo, summarize
from loadgen.paths import DataDirNotFoundError, resolve_data_dir
from loadgen.results import write_results
from loadgen.simulate import DECIDER_ASSIGNMENTS, EngineSpec, SimOptions, parse_engines, simulate
from loadgen.simulate.balance import balance_figures, format_balance_table
from loadgen.simulate.fleet import engine_ids
from loadgen.simulate.spec import PREDICTOR_BINS, RESCHEDULE_ARMS, RescheduleArm, Scaling, SimResult

LoopFactory = Callable[[], asyncio.AbstractEventLoop]


class UsageError(ValueError):
    """A bad flag or flag combination; reported as one line with exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors as one line (``loadgen: error: ...``) with exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _positive_ints(text: str) -> tuple[int, ...]:
    """"1,2,4,8" -> (1, 2, 4, 8): each >= 1, none repeated."""
    values = tuple(_positive_int(part.strip()) for part in text.split(",") if part.strip())
    if not values:
        raise argparse.ArgumentTypeError(f"expected N or N1,N2,..., got {text!r}")
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"values repeat: {text}")
    return values


def _seed_list(text: str) -> tuple[int, ...]:
    """"0,1,2" -> (0, 1, 2): integers, none repeated."""
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 0,1,2, got {text!r}") from None
    if not values or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected distinct integers like 0,1,2, got {text!r}")
    return values


def _arms(text: str) -> tuple[RescheduleArm, ...]:
    """"none,star-oracle" -> ("none", "star-oracle"): known arms, none repeated."""
    arms = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [a for a in arms if a not in RESCHEDULE_ARMS]
    if not arms or unknown or len(set(arms)) != len(arms):
        raise argparse.ArgumentTypeError(f"expected distinct arms among {', '.join(RESCHEDULE_ARMS)}, "
                                         f"got {text!r}")
    return tuple(a for arm in arms for a in RESCHEDULE_ARMS if a == arm)


def _common_flags() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("workload and output (all commands)")
    g.add_argument("--dataset", default="sharegpt", help=f"one of {', '.join(dataset_names())}")
    g.add_argument("--data-dir", metavar="PATH",
                   help="data root (else $SWITCHYARD_DATA_DIR, else ../shared/data)")
    g.add_argument("--rate", type=_positive_float, default=math.inf, metavar="R",
                   help="requests/s (gamma arrivals; default inf: all at t=0)")
    g.add_argument("--burstiness", type=_positive_float, default=1.0, metavar="K",
                   help="gamma shape; 1 = Poisson")
    g.add_argument("--max-concurrency", type=int, metavar="C", help="cap on requests in flight (run only)")
    g.add_argument("--timestamps", action="store_true", help="replay the trace's own arrival times")
    g.add_argument("--speedup", type=_positive_float, default=1.0, metavar="X", help="timestamp replay speed")
    g.add_argument("--start", type=float, default=0.0, metavar="S", help="trace window start (s, timestamps)")
    g.add_argument("--duration", type=_positive_float, metavar="S",
                   help="trace window length (s, timestamps)")
    g.add_argument("--num-requests", type=int, metavar="N", help="requests to replay (default: all)")
    g.add_argument("--output-lengths", choices=tuple(OUTPUT_LENGTH_DISTRIBUTIONS),
                   help="force every request's output length to a seeded draw matching STAR's Table 2 "
                        "(DeepSeek-R1-Distill-Qwen-7B on ShareGPT or Alpaca; prompt + output <= 32768); "
                        "default: the dataset's own")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--slo", metavar="ttft=MS,tpot=MS,e2e=MS", help="SLO for goodput and attainment")
    g.add_argument("--output", metavar="PATH",
                   help="results JSON; PNG plots go next to it with the same stem")
    g.add_argument("--no-plots", action="store_true", help="write no PNG files")
    g.add_argument("--model",
                   help="model name (run: default the target's first model; simulate: the profile's)")
    d = SessionSpec()
    g = p.add_argument_group("sessions (--dataset sessions: a shared system prompt, then a growing history; "
                             "--rate is session starts/s)")
    g.add_argument("--sessions", type=_positive_int, metavar="N", help=f"sessions (default {d.sessions})")
    g.add_argument("--turns-per-session", type=_positive_int, metavar="N",
                   help=f"turns per session (default {d.turns_per_session})")
    g.add_argument("--system-prompt-tokens", type=int, metavar="N",
                   help=f"shared system prompt, a multiple of 512 (default {d.system_prompt_tokens})")
    g.add_argument("--think-time-s", type=float, metavar="S",
                   help=f"pause before a session's next turn (default {d.think_time_s})")
    g.add_argument("--max-session-tokens", type=_positive_int, metavar="N",
                   help=f"a session ends before a turn whose prompt + answer exceed this "
                        f"(default {d.max_session_tokens})")
    return p


def _sim_flags(p: argparse.ArgumentParser, *, single_policy: bool) -> None:
    p.add_argument("--engines", default="h100-llama3-8b:2", metavar="PROFILE:N,...", help="simulated fleet")
    if single_policy:
        p.add_argument("--policy", default="round_robin", help="routing policy name")
    p.add_argument("--policy-param", action="append", default=[], metavar="K=V",
                   help="policy parameter (V parsed as JSON, else a string); repeatable")
    p.add_argument("--state-interval-ms", type=_positive_float, default=50.0,
                   help="engine state report interval")
    p.add_argument("--report-delay-ms", type=float, default=1.0, help="engine -> gateway report delay")
    p.add_argument("--lens", action="store_true",
                   help="LENS plans every engine's per-iteration token budget (Algorithm 1); per engine "
                        "spec: PROFILE:N:lens or PROFILE:N:static")
    p.add_argument("--no-lens-state", action="store_true",
                   help="engines without planning run no LENS model and report no state vector, even for "
                        "prism (by default only prism's runs pay for it: about 2x simulator time)")
    workers = ("gateway worker processes deciding independently (the gateway's --workers N): each with its "
               "own cluster state, in-flight ledger, sessions and counters, all fed the same reports")
    if single_policy:
        p.add_argument("--deciders", type=_positive_int, default=1, metavar="N", help=workers)
    else:
        p.add_argument("--deciders", type=_positive_ints, default=(1,), metavar="N1,N2,...",
                       help=workers + "; a list compares each variant at every count")
    p.add_argument("--no-admission", action="store_true",
                   help="run without the gateway's admission gate (on by default, as in the gateway: a queue "
                        "in front of the fleet's sequence slots that sheds what cannot meet its TTFT SLO)")
    p.add_argument("--decider-assignment", choices=DECIDER_ASSIGNMENTS, default="random",
                   help="how requests reach workers: random (a connection per request, a seeded uniform "
                        "draw) or session (a keep-alive connection per session: a hash of the session id)")
    _star_flags(p.add_argument_group("STAR rescheduling (paper 003; docs/star.md)"), single_policy)
    g = p.add_argument_group("CAUCHY fleets (paper 004; docs/cauchy.md)")
    g.add_argument("--plan", metavar="PATH",
                   help="the fleet is this `switchyard plan --json` plan's combos (instead of --engines); "
                        "the summary gains the bill (cost_usd, tokens_per_usd)")
    g.add_argument("--autoscale", action="store_true",
                   help="with --plan: run the combo autoscaler (Algorithm 1) on the arrivals' QPS; engines "
                        "join after provisioning (90 s) and leave by draining")
    g.add_argument("--autoscale-step-s", type=_positive_float, default=10.0, metavar="S",
                   help="seconds per QPS sample for --autoscale (10, as switchyard plan --autoscale)")
    g.add_argument("--autoscale-param", action="append", default=[], metavar="K=V",
                   help="Algorithm 1's parameters (ratio, local_window_s, global_window_s, provisioning_s, "
                        "grace_s, min_copies), as the gateway's --autoscale-param; repeatable")
    cascade_flags(p.add_argument_group("Cascades (Cascadia, paper 001; docs/cascadia.md)"))


def _star_flags(g: argparse._ArgumentGroup, single_arm: bool) -> None:
    g.add_argument("--reschedule", type=_arms, metavar="ARM" if single_arm else "ARM1,ARM2,...",
                   help=f"one of {', '.join(RESCHEDULE_ARMS)}" + ("" if single_arm else ", or several: every "
                        "variant runs once per arm") + "; given at all, the run records its load-balance "
                        "figures (migrations, splice stall, preemptions, peak KV, execution-time variance)")
    g.add_argument("--reschedule-interval-s", type=_positive_float, default=0.5,
                   help="how often each gateway worker's rescheduler proposes a migration")
    g.add_argument("--reschedule-param", action="append", default=[], metavar="K=V",
                   help="the rescheduler's parameters: STAR's (theta, horizon, beta, "
                        "assume_kv_bytes_per_token) or length_stages' (layout, refine, balance, plan=PATH, "
                        "...); repeatable")
    g.add_argument("--kv-link-gbps", type=_positive_float, default=25.0,
                   help="decode-to-decode KV link in Gbit/s: the rescheduler's C_mig and the modelled pull")
    g.add_argument("--kv-transfer-latency-ms", type=float, default=2.0,
                   help="fixed latency added to every modelled KV pull")
    g.add_argument("--prediction-interval", type=_positive_int, default=20, metavar="K",
                   help="decode steps per prediction round (engines report predictions every K steps)")
    g.add_argument("--predictor", metavar="FILE",
                   help="the star arm's length predictor (switchyard predictor train), read on the sim's "
                        "synthetic hidden states")
    g.add_argument("--predictor-bins", type=int, choices=PREDICTOR_BINS,
                   help="the star arm without a predictor file: the exact remaining length quantised to its "
                        "STAR Table 3 bin's midpoint")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="loadgen",
                     description="Replay LLM request traces live or in the cluster simulator.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    common = _common_flags()
    run = sub.add_parser("run", parents=[common], help="replay live against an OpenAI-compatible URL")
    run.add_argument("--target", required=True, metavar="URL", help="base URL, e.g. http://127.0.0.1:8000")
    run.add_argument("--tokenizer", metavar="DIR", help="HF-style tokenizer dir for synthetic prompts "
                     "(default: the sim agents' tokenizer; pass the engines' own for non-sim engines)")
    run.add_argument("--request-timeout-s", type=_positive_float, default=600.0)
    run.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token, if needed")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--vocab-size", type=_positive_int, metavar="V",
                     help="vocabulary that block prompts (mooncake-*, sessions) are sent in as token ids "
                          "(default: the --tokenizer's, else the sim tokenizer's)")
    run.add_argument("--planned-turns", action="store_true",
                     help="sessions: send every turn at its planned time (as simulate does) instead of "
                          "--think-time-s after the previous turn's response")
    sim = sub.add_parser("simulate", parents=[common], help="replay in the discrete-event cluster simulator")
    _sim_flags(sim, single_policy=True)
    cmp_ = sub.add_parser("compare", parents=[common], help="compare policies or fleets in the simulator")
    _sim_flags(cmp_, single_policy=False)
    cmp_.add_argument("--policies", default="round_robin", metavar="P1,P2,...", help="policies to compare")
    cmp_.add_argument("--engines-list", metavar="MIX;MIX", help="fleets to compare, e.g. 'A:2;B:4'")
    cmp_.add_argument("--rates", metavar="R1,R2,...", help="request-rate sweep (req/s)")
    cmp_.add_argument("--seeds", type=_seed_list, metavar="S1,S2,...",
                      help="replicates: every run once per seed (arrivals, engine sampling, the gateway's "
                           "draws and decider assignment; --seed still picks the requests), plus a table of "
                           "the means")
    cmp_.add_argument("--no-timelines", action="store_true",
                      help="leave the per-second timelines out of the results JSON")
    cmp_.add_argument("--ablation", action="store_true",
                      help="NexusSched's four arms instead of --policies: static budget or LENS, each with "
                           "round_robin and prism")
    cmp_.add_argument("--stages-ablation", action="store_true",
                      help="CascadeInfer's arms instead of --policies (length_stages each, needs "
                           "--reschedule length_stages): the --reschedule-param system, then "
                           "layout=dp|chain|single, refine=count|memory|off, balance=handover|round_robin")
    cascade_plan.add_parser(sub)
    return parser


def _policy_params(items: Sequence[str], flag: str = "--policy-param") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"{flag}: expected KEY=VALUE, got {item!r}")
        try:
            out[key.strip()] = json.loads(raw)
        except ValueError:
            out[key.strip()] = raw
    return out


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, ValidationError):
        return "; ".join(str(e.get("msg", "")).removeprefix("Value error, ") for e in exc.errors())
    return " ".join(str(exc).split()) or type(exc).__name__


SESSION_FIELDS = ("sessions", "turns_per_session", "system_prompt_tokens", "think_time_s",
                  "max_session_tokens")  # SessionSpec fields set by the flags of the same names


def session_spec(args: argparse.Namespace) -> SessionSpec | None:
    """The ``sessions`` dataset's parameters (None for another dataset, whose session flags are errors)."""
    given = {name: getattr(args, name) for name in SESSION_FIELDS if getattr(args, name) is not None}
    if args.dataset != "sessions":
        if given:
            flags = ", ".join("--" + f.replace("_", "-") for f in given)
            raise UsageError(f"{flags}: only for --dataset sessions")
        return None
    window = args.speedup != 1.0 or args.start != 0.0 or args.duration is not None
    if args.timestamps or window or args.output_lengths or getattr(args, "rates", None):
        raise UsageError("--dataset sessions makes its own arrivals (--rate: session starts/s) and output "
                         "lengths (its histories replay them): drop --timestamps, --speedup, --start, "
                         "--duration, --output-lengths, --rates")
    try:
        return SessionSpec(rate_per_s=args.rate, burstiness=args.burstiness, **given)
    except ValueError as exc:
        raise UsageError(f"--dataset sessions: {exc}") from None


def arrival_spec(args: argparse.Namespace) -> ArrivalSpec:
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise UsageError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    fields: dict[str, Any] = {"max_concurrency": args.max_concurrency, "seed": args.seed}
    if session_spec(args) is not None:  # planned arrivals come with the requests
        return ArrivalSpec(timestamps=True, **fields)
    if args.timestamps:
        fields.update(timestamps=True, speedup=args.speedup, start_s=args.start, duration_s=args.duration)
        if not math.isinf(args.rate) or args.burstiness != 1.0:
            raise UsageError("--rate/--burstiness cannot be combined with --timestamps")
    else:
        if args.speedup != 1.0 or args.start != 0.0 or args.duration is not None:
            raise UsageError("--speedup/--start/--duration need --timestamps")
        fields.update(rate_per_s=args.rate, burstiness=args.burstiness)
    try:
        return ArrivalSpec(**fields)
    except ValidationError as exc:
        raise UsageError(_one_line(exc)) from None


def load_requests(args: argparse.Namespace, tokenizer: Tokenizer, *, synthesize: bool) -> list[Request]:
    """The dataset's requests, windowed and cut, with exact prompt lengths for ``tokenizer`` (and output
    lengths drawn from ``--output-lengths`` when given)."""
    if args.num_requests is not None and args.num_requests < 1:
        raise UsageError(f"--num-requests must be >= 1, got {args.num_requests}")
    if getattr(args, "cascade", None):
        return cascade_dataset(args)
    no_files = args.dataset.startswith(("jsonl:", "sharegpt:")) or args.dataset == "sessions"
    try:
        data_dir: Path | None = resolve_data_dir(args.data_dir)
    except DataDirNotFoundError:
        if not no_files:
            raise
        data_dir = None
    window: dict[str, Any] = {"start_s": args.start, "duration_s": args.duration} if args.timestamps else {}
    requests = load_dataset(args.dataset, data_dir, num_requests=args.num_requests, seed=args.seed,
                            sessions=session_spec(args), **window)
    if not requests:
        raise UsageError(f"dataset {args.dataset!r} gave no requests (check --start/--duration)")
    prepared = prepare_requests(requests, EngineTokenizer(tokenizer), seed=args.seed, synthesize=synthesize)
    if args.output_lengths:  # after preparing, so the 32K cut sees exact prompt lengths
        return with_output_lengths(prepared, args.output_lengths, seed=args.seed)
    return prepared


def _slo(args: argparse.Namespace) -> Slo | None:
    return parse_slo(args.slo) if args.slo else None


def _base_config(args: argparse.Namespace, spec: ArrivalSpec) -> dict[str, Any]:
    sessions = session_spec(args)
    lengths = None
    if sessions is not None:
        try:
            lengths = TurnLengths.from_data_dir(resolve_data_dir(args.data_dir)).describe()
        except DataDirNotFoundError:
            lengths = TurnLengths().describe()
    return {"command": args.command, "dataset": args.dataset, "data_dir": args.data_dir,
            "num_requests": args.num_requests, "output_lengths": args.output_lengths, "arrivals": spec,
            "slo": args.slo, "model": args.model, "sessions": sessions, "session_lengths": lengths}


def _print_summary(title: str, summary: Summary) -> None:
    d = summary.to_dict()
    lines = [f"{'=' * 18} {title} {'=' * 18}",
             f"{'Successful requests:':<36}{d['completed']}", f"{'Failed requests:':<36}{d['failed']}",
             f"{'Duration (s):':<36}{d['duration']:.2f}",
             f"{'Request throughput (req/s):':<36}{d['request_throughput']:.2f}",
             f"{'Output token throughput (tok/s):':<36}{d['output_throughput']:.1f}"]
    if d["slo_attainment"] is not None:
        lines += [f"{'SLO attainment:':<36}{d['slo_attainment']:.1%}",
                  f"{'Request goodput (req/s):':<36}{d['request_goodput']:.2f}"]
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E")):
        lines.append(f"{label + ' ms (mean/p50/p90/p99):':<36}{d[f'mean_{name}_ms']:.1f} / "
                     f"{d[f'median_{name}_ms']:.1f} / {d[f'p90_{name}_ms']:.1f} / {d[f'p99_{name}_ms']:.1f}")
    print("\n".join(lines))


def _write(args: argparse.Namespace, summary: dict[str, Any], config: dict[str, Any],
           outcomes: Sequence[Outcome], timeline: Sequence[dict[str, float]], title: str) -> None:
    if not args.output:
        return
    path = write_results(args.output, summary, config, outcomes)
    print(f"results: {path}")
    if not args.no_plots:
        from loadgen.plots import write_run_plots  # noqa: PLC0415 (matplotlib only when plotting)

        for png in write_run_plots(path, outcomes, timeline, title):
            print(f"plot: {png}")


async def _live(args: argparse.Namespace, plan: list[tuple[float, Request]],
                spec: ArrivalSpec) -> tuple[LiveResult, str]:
    """Replay `plan` against the target; the summary, files and plots are made after the loop is done."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        models = await fetch_models(session, args.target)
        model = args.model or (models[0] if models else None)
        if model is None:
            raise UsageError(f"{args.target}/v1/models lists no model; pass --model")
        options = LiveOptions(target=args.target, model=model, max_concurrency=spec.max_concurrency,
                              request_timeout_s=args.request_timeout_s, api_key=args.api_key,
                              vocab_size=args.vocab_size, turns_after_response=not args.planned_turns)
        return await run_live(plan, options, progress=not args.no_progress, session=session), model


def _report_live(args: argparse.Namespace, spec: ArrivalSpec, result: LiveResult, model: str,
                 requests: Sequence[Request]) -> int:
    summary = summarize(result.outcomes, result.duration_s, _slo(args))
    _print_summary(f"live: {args.target}", summary)
    fidelity = block_fidelity(requests, result.outcomes)
    if fidelity is not None:
        share = "-" if fidelity["fidelity"] is None else f"{fidelity['fidelity']:.1%}"
        print(f"{'Block fidelity (token ids):':<36}{share} ({fidelity['exact_blocks']} of "
              f"{fidelity['planned_blocks']} planned 512-token blocks)")
    config = {**_base_config(args, spec), "model": model, "target": args.target, "tokenizer": args.tokenizer,
              "vocab_size": args.vocab_size, "planned_turns": args.planned_turns}
    _write(args, {**summary.to_dict(), "timeline": result.timeline, "block_fidelity": fidelity}, config,
           result.outcomes, result.timeline, f"live {args.dataset} -> {args.target}")
    return 0 if summary.completed else 1


def _sim_options(args: argparse.Namespace, policy: str, engines: Sequence[EngineSpec], deciders: int = 1,
                 arm: RescheduleArm = "none") -> SimOptions:
    """The simulator's options; --slo's TTFT and TPOT travel with every request (as x-slo-* headers would).
    STAR: `arm`; the predictor file, when given, is read here (checked against the first engine's model)."""
    from switchyard.profiles import get_profile  # noqa: PLC0415

    slo = _slo(args)
    ttft_ms, tpot_ms = (slo.ttft_ms, slo.tpot_ms) if slo is not None else (None, None)
    predictor = None
    if args.predictor:
        hidden_size = get_profile(engines[0].profile).model.hidden_size
        predictor = LengthPredictor.load(Path(args.predictor), expected_hidden_size=hidden_size)
    if args.kv_transfer_latency_ms < 0:
        raise UsageError(f"--kv-transfer-latency-ms must be >= 0, got {args.kv_transfer_latency_ms}")
    stages_plan, history = _stages_start(args, engines) if arm == "length_stages" else (None, ())
    return SimOptions(policy=policy, policy_params=_policy_params(args.policy_param),
                      state_interval_s=args.state_interval_ms / 1000.0,
                      report_delay_s=args.report_delay_ms / 1000.0,
                      seed=args.seed, lens_planning=args.lens,
                      lens_state=False if args.no_lens_state else None,
                      slo_ttft_s=ttft_ms / 1000.0 if ttft_ms is not None else None,
                      slo_tpot_s=tpot_ms / 1000.0 if tpot_ms is not None else None,
                      deciders=deciders, decider_assignment=args.decider_assignment,
                      reschedule=arm, reschedule_interval_s=args.reschedule_interval_s,
                      reschedule_params=_policy_params(args.reschedule_param, "--reschedule-param"),
                      kv_link_gbps=args.kv_link_gbps,
                      kv_transfer_latency_s=args.kv_transfer_latency_ms / 1000.0,
                      prediction_interval=args.prediction_interval, predictor=predictor,
                      predictor_bins=args.predictor_bins, balance_figures=args.reschedule is not None,
                      cascade=cascade_sim(args), stages_plan=stages_plan, stages_history=history,
                      admission=None if args.no_admission else AdmissionParams())


STAGES_HISTORY_REQUESTS = 2000  # length_stages' first window: this many dataset requests after the run's


def _stages_start(args: argparse.Namespace, engines: Sequence[EngineSpec]
                  ) -> tuple[StagesPlanFile | None, tuple[tuple[int, int], ...]]:
    """length_stages' first plan: `--reschedule-param plan=PATH` (its named engines checked against the
    fleet's ids), else the lengths of a dataset slice disjoint from the run's (the `STAGES_HISTORY_REQUESTS`
    requests after the run's, same seed; untimed datasets only), else nothing (one stage until re-planned)."""
    params = _policy_params(args.reschedule_param, "--reschedule-param")
    path = params.get("plan")
    if path:
        try:
            doc = json.loads(Path(str(path)).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise UsageError(f"--reschedule-param plan: cannot read {path}: {exc}") from None
        ids = [engine_id for _, engine_id in engine_ids(engines)]
        try:
            plan = StagesPlanFile.parse(doc, "--reschedule-param plan")
            plan.check_engines(ids, "--reschedule-param plan")
        except StagesConfigError as exc:
            raise UsageError(str(exc)) from None
        return plan, ()
    if args.timestamps or args.num_requests is None or args.dataset.startswith(("jsonl:", "sharegpt:")):
        return None, ()
    try:
        return None, _dataset_lengths_after(args.dataset, resolve_data_dir(args.data_dir), args.seed,
                                            args.num_requests)
    except (DataDirNotFoundError, ValueError):
        return None, ()


@functools.lru_cache(maxsize=4)
def _dataset_lengths_after(dataset: str, data_dir: Path | None, seed: int, start: int
                           ) -> tuple[tuple[int, int], ...]:
    """(I, O) of the `STAGES_HISTORY_REQUESTS` requests after the first `start` (read once per run, however
    many variants a comparison simulates)."""
    later = load_dataset(dataset, data_dir, seed=seed)[start:start + STAGES_HISTORY_REQUESTS]
    return tuple((r.prompt_tokens, r.output_tokens) for r in later if r.output_tokens)


def _star_config(args: argparse.Namespace) -> dict[str, Any]:
    """What a results file records of the STAR options (None arms: rescheduling was not simulated)."""
    return {"reschedule_interval_s": args.reschedule_interval_s,
            "reschedule_params": _policy_params(args.reschedule_param, "--reschedule-param"),
            "kv_link_gbps": args.kv_link_gbps, "kv_transfer_latency_ms": args.kv_transfer_latency_ms,
            "prediction_interval": args.prediction_interval, "predictor": args.predictor,
            "predictor_bins": args.predictor_bins}


def _print_balance(balance: dict[str, Any]) -> None:
    moves = balance["migrations"]
    stall = balance["splice_stall_ms"]["p99"]
    print(f"{'Migrations (cut/resumed/fallback):':<36}{moves['cut']} / {moves['resumed']} / "
          f"{moves['fallback']} "
          f"(refused {moves['refused']}, failed {moves['failed']}); KV moved "
          f"{balance['kv_bytes_moved'] / 1e9:.2f} GB; splice stall p99 "
          f"{'-' if stall is None else f'{stall:.1f}'} ms")
    peak = balance["peak_kv_used_ratio"]
    print(f"{'Preemptions; peak KV use:':<36}{balance['preemptions']}; "
          f"{'-' if peak is None else f'{peak:.1%}'}")


def _check_model(args: argparse.Namespace, engines: Sequence[EngineSpec]) -> None:
    from switchyard.profiles import get_profile  # noqa: PLC0415

    if args.cascade:
        check_cascade_fleet(args, engines)
        return
    served = get_profile(engines[0].profile).model.name
    if args.model and args.model != served:
        raise UsageError(f"--model {args.model!r} is not the simulated engines' model {served!r}")


def _cascade_plan(args: argparse.Namespace) -> None:
    """With --cascade, --plan is a `loadgen cascade-plan` file: its thresholds replace the spec's (same
    models, in order) and its replicas are the fleet (`args.cascade_fleet`)."""
    if not getattr(args, "cascade", None) or getattr(args, "plan", None) is None:
        return
    if args.autoscale:
        raise UsageError("--autoscale scales CAUCHY combo plans; a cascade plan (--cascade --plan) is fixed")
    from gateway.cascade.core import CascadeSpecError, parse_cascade  # noqa: PLC0415

    try:
        plan = cascade_plan.read_plan_fleet(Path(args.plan))
        spec = parse_cascade(args.cascade)
        if spec.models != plan.models:
            raise ValueError(f"it plans {','.join(plan.models)}, --cascade serves {','.join(spec.models)}")
        args.cascade = spec.with_thresholds(plan.thresholds).text
    except (ValueError, CascadeSpecError) as exc:
        raise UsageError(f"--plan {args.plan}: {_one_line(exc)}") from None
    args.cascade_fleet = list(plan.engines)
    args.cascade_plan = plan
    args.engines = ",".join(f"{e.profile}:{e.count}" for e in plan.engines)


def _scaling(args: argparse.Namespace) -> Scaling | None:
    """The CAUCHY fleet of --plan [--autoscale], or None (also for a cascade plan: `_cascade_plan`)."""
    if getattr(args, "cascade_fleet", None) is not None:
        return None
    if args.plan is None:
        if args.autoscale:
            raise UsageError("--autoscale needs --plan PATH (a `switchyard plan --json` file)")
        return None
    if args.autoscale_param and not args.autoscale:
        raise UsageError("--autoscale-param is for --autoscale")
    from gateway.planning.autoscaler import AutoscalerParams  # noqa: PLC0415
    from gateway.planning.plan_file import parse_plan  # noqa: PLC0415

    try:
        params = AutoscalerParams(**_policy_params(args.autoscale_param, "--autoscale-param"))
    except (TypeError, ValueError) as exc:
        raise UsageError(f"--autoscale-param: {exc}") from None

    try:
        plan = parse_plan(json.loads(Path(args.plan).read_text()))
    except OSError as exc:
        raise UsageError(f"--plan {args.plan}: {exc.strerror or exc}") from None
    except ValueError as exc:  # json.JSONDecodeError included
        raise UsageError(f"--plan {args.plan}: {_one_line(exc)}") from None
    try:
        return Scaling(plan, autoscale=args.autoscale, params=params, step_s=args.autoscale_step_s)
    except ValueError as exc:
        raise UsageError(f"--plan {args.plan}: {exc}") from None


def _fleet(args: argparse.Namespace, scaling: Scaling | None) -> list[EngineSpec]:
    """The engines the run starts with: the plan's, else --engines."""
    if scaling is None:
        return parse_engines(args.engines)
    from loadgen.simulate.scaling import plan_engines  # noqa: PLC0415

    try:
        return plan_engines(scaling)
    except ValueError as exc:
        raise UsageError(f"--plan {args.plan}: {exc}") from None


def _print_bill(result: SimResult) -> None:
    per_token = "-" if result.tokens_per_usd is None else f"{result.tokens_per_usd / 1e6:.2f}M"
    print(f"{'Fleet cost (USD); tokens per USD:':<36}{result.cost_usd:.4f}; {per_token}")
    if result.handoffs is not None:
        stall = result.handoffs["stall_ms"]
        p50, p99 = (("-" if stall[q] is None else f"{stall[q]:.1f}") for q in ("p50", "p99"))
        print(f"{'Prefill-to-decode hand-offs:':<36}{result.handoffs['handoffs']} "
              f"({result.handoffs['kv_bytes'] / 1e9:.2f} GB of KV; stall p50 {p50} ms, p99 {p99} ms)")
    for action in result.fleet_actions:
        what = action.get("combos") or action.get("engine") or action.get("thresholds") or ""
        print(f"  {action['at_s']:8.1f} s  {action['kind']:<8} {what}  {action.get('reason', '')}")


def _simulate(args: argparse.Namespace, requests: list[Request], spec: ArrivalSpec) -> int:
    from gateway.policies.registry import make_policy  # noqa: PLC0415

    scaling = _scaling(args)
    engines = _fleet(args, scaling)
    _check_model(args, engines)
    if args.reschedule is not None and len(args.reschedule) > 1:
        raise UsageError("simulate runs one --reschedule arm; compare runs several")
    arm: RescheduleArm = args.reschedule[0] if args.reschedule else "none"
    options = _sim_options(args, args.policy, engines, args.deciders, arm)
    make_policy(options.policy, options.policy_params)  # unknown policy or parameter: a usage error, up front
    result = simulate(schedule(requests, spec), [] if scaling is not None else engines, options,
                      scaling=scaling)
    summary = summarize(result.outcomes, max(result.duration_s, 1e-9), _slo(args))
    fleet_label = f"plan {args.plan}" if scaling is not None else args.engines
    _print_summary(f"simulated: {args.policy} on {fleet_label}"
                   + (", autoscaled" if args.autoscale else "")
                   + (f", reschedule {arm}" if args.reschedule else ""), summary)
    _print_bill(result)
    if result.balance is not None:
        _print_balance(result.balance)
    gate = _admission_totals(result.per_decider)
    if gate:
        print(f"{'Admission gate (requests):':<36}{', '.join(f'{k} {v}' for k, v in sorted(gate.items()))}")
    if options.deciders > 1:
        print(f"{'Decisions per decider:':<36}{' / '.join(str(d['decisions']) for d in result.per_decider)} "
              f"({options.decider_assignment})")
    print(f"{'Simulator wall time (s):':<36}{result.wall_s:.2f} "
          f"({result.simulated_s_per_wall_s:.1f} simulated s per wall s)")
    extra = {"per_engine": result.per_engine, "per_decider": result.per_decider, "sim_wall_s": result.wall_s,
             "events_processed": result.events_processed,
             "simulated_s_per_wall_s": result.simulated_s_per_wall_s, "timeline": result.timeline,
             "balance": result.balance, "cost_usd": result.cost_usd, "tokens_per_usd": result.tokens_per_usd,
             "fleet_actions": result.fleet_actions, "handoffs": result.handoffs, "cascade": result.cascade}
    config = {**_base_config(args, spec), "engines": args.engines if scaling is None else None,
              "plan": args.plan, "autoscale": args.autoscale,
              "autoscale_params": dataclasses.asdict(scaling.params) if scaling is not None else None,
              "policy": args.policy,
              "policy_params": dict(options.policy_params), "state_interval_ms": args.state_interval_ms,
              "report_delay_ms": args.report_delay_ms, "lens": args.lens,
              "lens_state": not args.no_lens_state, "deciders": args.deciders,
              "decider_assignment": args.decider_assignment, "admission": not args.no_admission,
              "reschedule": arm if args.reschedule else None, **_star_config(args), **cascade_config(args)}
    if result.cascade is not None:
        print_cascade(result.cascade)
    _write(args, {**summary.to_dict(), **extra}, config, result.outcomes, result.timeline,
           f"simulated {args.dataset}: {args.policy} on {fleet_label}")
    return 0 if summary.completed else 1


def _admission_totals(per_decider: Sequence[Mapping[str, Any]]) -> Counter[str]:
    """The admission gate's outcomes summed over the deciders (empty when it never queued nor shed)."""
    return sum((Counter(row.get("admission", {})) for row in per_decider), Counter())


def _compare(args: argparse.Namespace, requests: list[Request], spec: ArrivalSpec) -> int:
    from gateway.policies.registry import make_policy  # noqa: PLC0415

    if args.ablation and args.stages_ablation:
        raise UsageError("--ablation and --stages-ablation are two different comparisons: pick one")
    if args.stages_ablation and tuple(args.reschedule or ()) != ("length_stages",):
        raise UsageError("--stages-ablation needs --reschedule length_stages (and no other arm)")
    policies = ([arm[1] for arm in ABLATION_ARMS[::2]] if args.ablation
                else ["length_stages"] if args.stages_ablation
                else [p.strip() for p in args.policies.split(",") if p.strip()])
    scaling = _scaling(args)
    if scaling is not None and args.engines_list:
        raise UsageError("--plan sets the fleet: drop --engines-list")
    mixes = ([f"plan {args.plan}"] if scaling is not None
             else [m for m in (args.engines_list or args.engines).split(";") if m.strip()])
    fleets = [_fleet(args, scaling)] if scaling is not None else [parse_engines(m) for m in mixes]
    for fleet in fleets:
        _check_model(args, fleet)
    params = _policy_params(args.policy_param)
    for policy in policies:
        make_policy(policy, params)
    rates = None
    if args.rates:
        try:
            rates = [float(r) for r in args.rates.split(",") if r.strip()]
        except ValueError:
            raise UsageError(f"--rates: expected numbers like 2,4,8, got {args.rates!r}") from None
    variants = with_deciders(ablation_variants(fleets, params) if args.ablation
                             else stages_ablation_variants(fleets, params) if args.stages_ablation
                             else build_variants(policies, fleets, params), args.deciders)
    seeds = args.seeds
    arms = tuple(args.reschedule or ())
    first_arm: RescheduleArm = "length_stages" if "length_stages" in arms else (arms[0] if arms else "none")
    options = _sim_options(args, policies[0], fleets[0], arm=first_arm)
    runs = _arm_runs(args, requests, spec, variants, options, rates, seeds, scaling)
    means = mean_over_seeds(runs) if seeds is not None and len(seeds) > 1 else None
    shown = runs if means is None else [{**run, "label": f"{run['label']} s={run['seed']}"} for run in runs]
    print(format_table(shown))
    shares = format_share_table(shown)
    if shares:
        print(shares)
    balance = format_balance_table(shown)
    if balance:
        print(balance)
    if means is not None:
        print(f"mean over seeds {','.join(str(seed) for seed in seeds)}")
        print(format_table(means))
    if args.output:
        path = Path(args.output)
        path.parent.mkdir(parents=True, exist_ok=True)
        config = {**_base_config(args, spec), "policies": policies, "engines_list": mixes, "rates": rates,
                  "policy_params": params, "lens": args.lens, "lens_state": not args.no_lens_state,
                  "ablation": args.ablation, "stages_ablation": args.stages_ablation,
                  "deciders": list(args.deciders),
                  "decider_assignment": args.decider_assignment, "admission": not args.no_admission,
                  "state_interval_ms": args.state_interval_ms, "report_delay_ms": args.report_delay_ms,
                  "seeds": list(seeds) if seeds is not None else None,
                  "reschedule": list(args.reschedule) if args.reschedule else None, **_star_config(args)}
        document = comparison_document(runs, config, means=means, timelines=not args.no_timelines)
        path.write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2) + b"\n")
        print(f"results: {path}")
        if not args.no_plots:
            from loadgen.plots import compare_figure, plot_paths  # noqa: PLC0415

            png = compare_figure(runs if means is None else means, plot_paths(path)["compare"],
                                 f"{args.dataset}: latency vs load")
            print(f"plot: {png}")
    return 0


def _arm_runs(args: argparse.Namespace, requests: list[Request], spec: ArrivalSpec,
              variants: Sequence[Variant], options: SimOptions, rates: list[float] | None,
              seeds: Sequence[int] | None, scaling: Scaling | None = None) -> list[dict[str, Any]]:
    """`run_comparison` once per `--reschedule` arm (one pass without it), each run recording its arm
    (`reschedule`, None without the flag) and its load-balance figures (`balance`); labels gain the arm when
    there are several. Runs in (rate, seed) order, then arm, then variant."""
    arms: Sequence[RescheduleArm | None] = args.reschedule or (None,)
    per_arm = [replace(options, reschedule=arm or "none")  # every arm checked up front
               if arm == "length_stages" else
               replace(options, reschedule=arm or "none", stages_plan=None, stages_history=())
               for arm in arms]
    runs: list[dict[str, Any]] = []
    for arm, opts in zip(arms, per_arm, strict=True):
        labelled = [replace(v, label=f"{v.label} {arm}") for v in variants] if len(arms) > 1 else variants
        for run in run_comparison(requests, spec, labelled, opts, rates=rates, seeds=seeds, slo=_slo(args),
                                  scaling=scaling,
                                  on_run=lambda run: print(f"done: {run['label']} at rate {run['rate']} seed "
                                                           f"{run['seed']}", file=sys.stderr)):
            run["reschedule"] = arm
            run["balance"] = (None if arm is None else balance_figures(
                run["per_engine"], run["per_decider"], run["timeline"], run["summary"]["duration"]))
            runs.append(run)
    order: dict[tuple[str, Any], int] = {}
    for run in runs:
        order.setdefault((str(run["rate"]), run["seed"]), len(order))
    return sorted(runs, key=lambda run: order[(str(run["rate"]), run["seed"])])


def main(argv: Sequence[str] | None = None, *, loop_factory: LoopFactory | None = None) -> int:
    """Parse ``argv`` and run the command; returns the exit status (2 for operator errors)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "cascade-plan":
        return cascade_plan.run(args)
    try:
        spec = arrival_spec(args)
        if args.slo:
            parse_slo(args.slo)
        tokenizer_dir = getattr(args, "tokenizer", None)
        tokenizer = Tokenizer.load(tokenizer_dir) if tokenizer_dir else Tokenizer.load_sim()
        _cascade_plan(args)
        requests = load_requests(args, tokenizer, synthesize=args.command == "run")
        if args.command == "run":
            args.vocab_size = args.vocab_size or tokenizer.vocab_size
            check_block_vocab(requests, args.vocab_size)
            with asyncio.Runner(loop_factory=loop_factory) as runner:
                result, model = runner.run(_live(args, schedule(requests, spec), spec))
            return _report_live(args, spec, result, model, requests)
        if args.command == "simulate":
            return _simulate(args, requests, spec)
        return _compare(args, requests, spec)
    except (UsageError, ValueError, FileNotFoundError, NotADirectoryError, TargetUnreachableError) as exc:
        print(f"loadgen: error: {_one_line(exc)}", file=sys.stderr)
        return 2
