"""`switchyard plan-stages`: CascadeInfer's length-aware stage partition (paper 000, §4.2) from the shell.

  switchyard plan-stages --instances E --max-len L (--dataset D | --requests PATH) [--data-dir DIR]
                         [--num-requests N] [--qoe PATH] [--model M] [--bandwidth-gb-s X] [--exact] [--json]
      E instances cut into length stages for the workload's (input, output) lengths; --max-len takes tokens
      (131072) or K = 1024 tokens (128K). Prints the stages, the pipeline quality (lower is better) and the
      planning time; --exact also solves the bucketed DP exactly (exact_quality, exact_ms, exact_stages).

--requests PATH: a JSON array of {"input": TOKENS, "output": TOKENS} objects, or JSONL with one such object
per line (whole numbers >= 0; other keys are ignored). --dataset: a loadgen dataset whose requests all give
an output length (sharegpt, azure-conv, sarathi-sharegpt, ...), from --data-dir, else SWITCHYARD_DATA_DIR,
else ../shared/data. --qoe PATH: {"d": [D0, D1, D2, D3, D4]}, Eq. 1's coefficients; without it
`switchyard.qoe.PROFILED_QOE_D` (§4.1's profile of the simulated h100-llama3-8b, fitted). The hand-over
cost uses --model's KV bytes per token over --bandwidth-gb-s (50 GB/s: the paper's 400 Gb/s ConnectX-7 between
nodes).

Owns: the flags, reading the request file and the QoE file, timing the planner (`plan_ms`, with the clock
passed in), the table and the JSON.
Must not: plan (gateway.planning.stages does) or fit D (switchyard.qoe).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gateway.planning.stages import (
    RequestLengths,
    StagePlan,
    StageProblem,
    TransferCost,
    exact,
    heuristic,
)
from switchyard.hardware import MODELS
from switchyard.qoe import PROFILED_QOE_D, PROFILED_QOE_SOURCE, QoEModel

DEFAULT_MODEL = "llama3-8b"
DEFAULT_BANDWIDTH_GB_S = 50.0


def parse_max_len(text: str) -> int:
    """`131072` or `128K` (K = 1024 tokens)."""
    match = re.fullmatch(r"\s*(\d+)\s*([kK]?)\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r}: give tokens, e.g. 131072 or 128K")
    return int(match.group(1)) * (1024 if match.group(2) else 1)


def read_requests(path: Path) -> list[RequestLengths]:
    """A JSON array or JSONL of {"input", "output"} objects; ValueError naming the bad item."""
    text = path.read_text()
    if text.lstrip().startswith("["):
        rows: list[Any] = json.loads(text)
        where = "item"
    else:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        where = "line"
    requests = []
    for n, row in enumerate(rows, 1):
        pair = (row.get("input"), row.get("output")) if isinstance(row, dict) else (None, None)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in pair):
            raise ValueError(f"{path}: {where} {n} is not {{\"input\": TOKENS, \"output\": TOKENS}} "
                             "with whole numbers >= 0")
        requests.append(RequestLengths(int(pair[0]), int(pair[1])))  # type: ignore[arg-type]
    return requests


def dataset_requests(name: str, data_dir: str | None, num_requests: int | None,
                     seed: int) -> list[RequestLengths]:
    from loadgen.datasets.registry import load_dataset  # noqa: PLC0415
    from loadgen.paths import resolve_data_dir  # noqa: PLC0415

    loaded = load_dataset(name, resolve_data_dir(data_dir), num_requests=num_requests, seed=seed)
    if any(r.output_tokens is None for r in loaded):
        raise ValueError(f"--dataset {name}: the dataset does not give every request's output length")
    return [RequestLengths(r.prompt_tokens, r.output_tokens or 0) for r in loaded]


def read_qoe(path: Path | None) -> QoEModel:
    if path is None:
        return QoEModel(PROFILED_QOE_D)
    doc = json.loads(path.read_text())
    d = doc.get("d") if isinstance(doc, dict) else None
    if not isinstance(d, list) or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in d):
        raise ValueError(f"--qoe {path}: expected {{\"d\": [D0, D1, D2, D3, D4]}}")
    return QoEModel(tuple(float(v) for v in d))  # type: ignore[arg-type]  # QoEModel checks the length


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--instances", type=int, required=True, metavar="E", help="instances to cut into stages")
    p.add_argument("--max-len", type=parse_max_len, required=True, metavar="L",
                   help="longest sequence (prompt + output) served: tokens, or 128K")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--dataset", metavar="D", help="a loadgen dataset name, e.g. sharegpt")
    source.add_argument("--requests", type=Path, metavar="PATH", help="JSON / JSONL of {input, output}")
    p.add_argument("--data-dir", help="dataset root (default: SWITCHYARD_DATA_DIR, else ../shared/data)")
    p.add_argument("--num-requests", type=int, metavar="N", help="with --dataset: the first N (shuffled)")
    p.add_argument("--seed", type=int, default=0, help="with --dataset: its shuffle (0)")
    p.add_argument("--qoe", type=Path, metavar="PATH",
                   help='{"d": [D0..D4]} (default: the profiled h100-llama3-8b fit)')
    p.add_argument("--model", default=DEFAULT_MODEL, help="KV bytes per token of this model (%(default)s)")
    p.add_argument("--bandwidth-gb-s", type=float, default=DEFAULT_BANDWIDTH_GB_S,
                   help="hand-over bandwidth between instances, GB/s (%(default)g)")
    p.add_argument("--exact", action="store_true", help="also solve the bucketed DP exactly")
    p.add_argument("--json", action="store_true", help="print JSON")
    return p


def _stages(plan: StagePlan) -> list[dict[str, int]]:
    return [{"lo": s.lo, "hi": s.hi, "instances": s.instances} for s in plan.stages]


def plan_stages_command(argv: Sequence[str], prog: str = "switchyard plan-stages",
                        clock: Callable[[], float] = time.perf_counter) -> int:
    args = build_parser(prog).parse_args(argv)

    def fail(reason: str) -> int:
        print(f"{prog}: error: {reason}", file=sys.stderr)
        return 2

    if args.model not in MODELS:
        return fail(f"unknown model {args.model!r}; known: {', '.join(sorted(MODELS))}")
    try:
        if args.requests is not None:
            requests, source = read_requests(args.requests), str(args.requests)
        else:
            requests = dataset_requests(args.dataset, args.data_dir, args.num_requests, args.seed)
            source = args.dataset
        if not requests:
            return fail(f"no requests in {source}")
        model = read_qoe(args.qoe)
        transfer = TransferCost.for_model(MODELS[args.model], args.bandwidth_gb_s)
        start = clock()
        plan = heuristic(StageProblem(args.instances, args.max_len, requests, model, transfer))
        plan_ms = (clock() - start) * 1e3
        doc: dict[str, Any] = {
            "stages": _stages(plan), "quality": plan.quality, "plan_ms": plan_ms, "instances": args.instances,
            "max_len": args.max_len, "requests": len(requests), "source": source,
            "qoe": {"d": list(model.d), "source": PROFILED_QOE_SOURCE if args.qoe is None else str(args.qoe)},
            "transfer": {"model": args.model, "kv_bytes_per_token": transfer.kv_bytes_per_token,
                         "bandwidth_gb_s": transfer.bandwidth_gb_s},
        }
        if args.exact:
            start = clock()
            best = exact(StageProblem(args.instances, args.max_len, requests, model, transfer))
            doc |= {"exact_quality": best.quality, "exact_ms": (clock() - start) * 1e3,
                    "exact_stages": _stages(best)}
    except (OSError, ValueError) as exc:  # StagePlanError, JSON errors and a missing data root included
        return fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print_plan(doc)
    return 0


def print_plan(doc: dict[str, Any]) -> None:
    d = ", ".join(f"{v:.3g}" for v in doc["qoe"]["d"])
    print(f"{doc['instances']} instances over lengths [0, {doc['max_len']}], {doc['requests']} requests "
          f"({doc['source']}); QoE D = ({d}) from {doc['qoe']['source']}")
    print(f"  {'stage':<7}{'lengths':<22}{'instances':>9}")
    for n, s in enumerate(doc["stages"], 1):
        lengths = f"[{s['lo']}, {s['hi']})"
        print(f"  {n:<7}{lengths:<22}{s['instances']:>9}")
    print(f"quality {doc['quality']:.6g} (heuristic, {doc['plan_ms']:.2f} ms)")
    if "exact_quality" in doc:
        stages = ", ".join(f"[{s['lo']}, {s['hi']}) x{s['instances']}" for s in doc["exact_stages"])
        print(f"exact   {doc['exact_quality']:.6g} ({doc['exact_ms']:.2f} ms): {stages}")
