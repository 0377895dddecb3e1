"""`switchyard predictor collect|train|eval`: STAR's remaining-length predictor from data to figures.

  switchyard predictor collect --backend sim|vllm (--profile P | --model DIR) --dataset D --num-requests N
                               --out DIR [--agents 1] [--hidden-state-interval 20] [--model-lengths] ...
  switchyard predictor train --data DIR [DIR ...] --out FILE.npz [--search [--search-trials 8]]
                             [--widths 2048,512,64] [--epochs 100] [--patience 10] [--seed 0] [--json]
  switchyard predictor eval --model FILE.npz --data DIR [DIR ...] [--json]

Owns: argument parsing, checking arguments and paths with one-line errors (exit 2; 1 when agents fail to
start), calling `collect` / `train_predictor` / `evaluate`, and printing (a summary, or JSON with `--json`).
Must not: load datasets itself (the launcher passes a `RequestLoader`: this package may not import loadgen),
or implement collection, training or scoring.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine_agent.star.collect import CollectError, CollectOptions, RequestLoader, collect
from engine_agent.star.evaluate import METHODS, evaluate
from engine_agent.star.predictor import LengthPredictor, PredictorFileError
from engine_agent.star.shards import ShardError, count_rows, load_shards
from engine_agent.star.training import DEFAULT_WIDTHS, TrainConfig, train_predictor
from switchyard.profiles import UnknownProfileError, get_profile, known_profiles

PROG = "switchyard predictor"


class UsageError(Exception):
    """A bad argument or path: printed as one line, exit 2."""


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="STAR's remaining-length predictor (paper §4).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{collect,train,eval}")

    c = sub.add_parser("collect", help="replay a dataset through agents that record labelled hidden states")
    c.add_argument("--backend", choices=["sim", "vllm"], default="sim")
    c.add_argument("--profile", default=None, help="sim profile (default h100-llama3-8b)")
    c.add_argument("--model", metavar="DIR", help="vllm: the model directory to serve")
    c.add_argument("--dataset", required=True, help="a loadgen dataset name, e.g. sharegpt, jsonl:PATH")
    c.add_argument("--data-dir", default=None,
                   help="data root (default: SWITCHYARD_DATA_DIR, else ../shared/data)")
    c.add_argument("--num-requests", type=int, required=True)
    c.add_argument("--out", required=True, metavar="DIR", help="shard directory (created; may hold shards)")
    c.add_argument("--agents", type=int, default=1, help="agent processes (requests round robin)")
    c.add_argument("--concurrency", type=int, default=256, help="requests in flight per agent")
    c.add_argument("--hidden-state-interval", type=int, default=20, help="decode steps between taps")
    c.add_argument("--seed", type=int, default=0, help="dataset shuffle and agent seeds")
    c.add_argument("--model-lengths", action="store_true",
                   help="let the model stop (within --max-tokens) instead of forcing the dataset's lengths")
    c.add_argument("--max-tokens", type=int, default=2048, help="output cap when lengths are not forced")
    c.add_argument("--start-timeout-s", type=float, default=None)
    c.add_argument("--sim-max-num-seqs", type=int, default=None, help="the sim engines' batch cap")

    t = sub.add_parser("train", help="train the MLP on recorded shards (request-level 70/15/15 split)")
    t.add_argument("--data", nargs="+", required=True, metavar="DIR", help="shard directories or files")
    t.add_argument("--out", required=True, metavar="FILE.npz")
    t.add_argument("--widths", default=",".join(str(w) for w in DEFAULT_WIDTHS),
                   help="hidden widths, comma-separated (Eq. 2: 2048,512,64)")
    defaults = TrainConfig()
    t.add_argument("--lr", type=float, default=defaults.lr)
    t.add_argument("--batch-size", type=int, default=defaults.batch_size)
    t.add_argument("--weight-decay", type=float, default=defaults.weight_decay)
    t.add_argument("--epochs", type=int, default=defaults.max_epochs, help="at most this many epochs")
    t.add_argument("--patience", type=int, default=defaults.patience, help="early stopping on validation MAE")
    t.add_argument("--seed", type=int, default=defaults.seed, help="split, initialisation and batch order")
    t.add_argument("--search", action="store_true",
                   help="random search over §4.4's grid (depth 2-6, widths 256-1024, lr 1e-4..1e-3, batch "
                   "16-128); best validation MAE wins (--widths, --lr, --batch-size are then unused)")
    t.add_argument("--search-trials", type=int, default=8)
    t.add_argument("--json", action="store_true", help="print the training figures as JSON")
    t.add_argument("--quiet", action="store_true", help="no per-epoch / per-trial lines")

    e = sub.add_parser("eval", help="MAE per method and per generated-token bucket on held-out requests")
    e.add_argument("--model", required=True, metavar="FILE.npz")
    e.add_argument("--data", nargs="+", required=True, metavar="DIR")
    e.add_argument("--json", action="store_true")
    return parser


def _err(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _widths(text: str) -> tuple[int, ...]:
    try:
        widths = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise UsageError(f"--widths {text!r}: expected positive integers separated by commas") from None
    if not widths or any(w < 1 for w in widths):
        raise UsageError(f"--widths {text!r}: expected positive integers separated by commas")
    return widths


def _run_collect(args: argparse.Namespace, load_requests: RequestLoader | None) -> int:
    if args.backend == "vllm":
        if not args.model:
            raise UsageError("--backend vllm needs --model DIR (a model directory)")
        if args.profile:
            raise UsageError("--profile is for --backend sim (vllm agents serve --model)")
        if not (Path(args.model) / "config.json").is_file():
            raise UsageError(f"--model {args.model}: not a model directory (no config.json)")
    elif args.model:
        raise UsageError("--model is for --backend vllm (sim agents take --profile)")
    profile = args.profile or "h100-llama3-8b"
    if args.backend == "sim":
        try:
            get_profile(profile)
        except UnknownProfileError:
            known = ", ".join(known_profiles())
            raise UsageError(f"unknown profile {profile!r}; known profiles: {known}") from None
    for flag, value in (("--num-requests", args.num_requests), ("--agents", args.agents),
                        ("--concurrency", args.concurrency), ("--max-tokens", args.max_tokens),
                        ("--hidden-state-interval", args.hidden_state_interval)):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {args.out}: exists and is not a directory")
    if load_requests is None:
        raise UsageError("dataset loading is not available here (run it as `switchyard predictor collect`)")
    try:
        requests = load_requests(args.dataset, args.data_dir, args.num_requests, args.seed)
    except (ValueError, OSError) as exc:
        raise UsageError(f"--dataset {args.dataset}: {exc}") from None
    extra = ("--sim-max-num-seqs", str(args.sim_max_num_seqs)) if args.sim_max_num_seqs else ()
    options = CollectOptions(
        out=out.resolve(), backend=args.backend, profile=profile,
        model_dir=str(Path(args.model).resolve()) if args.model else None, agents=args.agents,
        concurrency=args.concurrency, hidden_state_interval=args.hidden_state_interval, seed=args.seed,
        force_lengths=not args.model_lengths, max_tokens=args.max_tokens,
        start_timeout_s=args.start_timeout_s, agent_args=extra,
    )
    try:
        report = asyncio.run(collect(requests, options, progress=lambda line: _err(f"collect: {line}")))
    except CollectError as exc:
        _err(f"{PROG} collect: error: {exc}")
        return 1
    rows, request_count = count_rows(report.new_shards)
    summary = {**report.as_dict(), "rows": rows, "requests_recorded": request_count, "out": str(out)}
    print(json.dumps(summary))
    return 0


def _run_train(args: argparse.Namespace) -> int:
    out = Path(args.out).expanduser()
    if not out.parent.is_dir():
        raise UsageError(f"--out {args.out}: the directory {out.parent} does not exist")
    try:
        config = TrainConfig(widths=_widths(args.widths), lr=args.lr, batch_size=args.batch_size,
                             weight_decay=args.weight_decay, max_epochs=args.epochs, patience=args.patience,
                             seed=args.seed)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.search and args.search_trials < 1:
        raise UsageError(f"--search-trials must be >= 1, got {args.search_trials}")
    try:
        data = load_shards([Path(p).expanduser() for p in args.data])
    except ShardError as exc:
        raise UsageError(str(exc)) from None
    started = time.perf_counter()
    log = None if args.quiet else (lambda line: _err(f"train: {line}"))
    try:
        predictor = train_predictor(data, config, search_trials=args.search_trials if args.search else 0,
                                    log=log)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    predictor.save(out)
    elapsed_s = round(time.perf_counter() - started, 2)
    figures: dict[str, Any] = {**predictor.meta.figures, "train_time_s": elapsed_s, "model": data.model,
                               "hidden_size": data.hidden_size, "out": str(out)}
    if args.json:
        print(json.dumps(figures))
    else:
        req = figures["requests"]
        print(f"trained {list(predictor.meta.widths)} on {data.model} (hidden {data.hidden_size}): "
              f"{req['train']}/{req['val']}/{req['test']} requests; best epoch {figures['best_epoch']} of "
              f"{figures['epochs_run']}; validation MAE {figures['val_mae_tokens']:.1f}, test MAE "
              f"{figures['test_mae_tokens']:.1f} tokens; wrote {out}")
    return 0


def _run_eval(args: argparse.Namespace) -> int:
    try:
        predictor = LengthPredictor.load(Path(args.model).expanduser())
        data = load_shards([Path(p).expanduser() for p in args.data])
    except (PredictorFileError, ShardError) as exc:
        raise UsageError(str(exc)) from None
    try:
        report = evaluate(predictor, data)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{report['model']}: {report['rows']} rows of {report['requests']} requests ({report['split']})")
    print(f"{'generated':>14} {'rows':>7} " + " ".join(f"{m:>12}" for m in METHODS))
    print(f"{'all':>14} {report['rows']:>7} " + " ".join(f"{report['mae'][m]:>12.1f}" for m in METHODS))
    for bucket in report["by_generated_bucket"]:
        lo, hi = bucket["generated"]
        label = f"[{lo}, {hi})"
        print(f"{label:>14} {bucket['rows']:>7} " + " ".join(f"{bucket['mae'][m]:>12.1f}" for m in METHODS))
    return 0


def main(argv: Sequence[str] | None = None, *, prog: str = PROG,
         load_requests: RequestLoader | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        if args.command == "collect":
            return _run_collect(args, load_requests)
        if args.command == "train":
            return _run_train(args)
        return _run_eval(args)
    except UsageError as exc:
        _err(f"{prog} {args.command}: error: {exc}")
        return 2
