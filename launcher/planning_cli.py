"""CAUCHY's planning commands (paper 004).

  switchyard gpus [--price GPU=USD ...] [--json]
      the GPU catalogue with Table 1's derived columns
  switchyard plan --model M --workload in=337,out=1330|DATASET --slo ttft=MS,tpot=MS [--goodput-rps R]
                  [--budget-usd-h X] [--gpus h800:8,a800:8,h20:8] [--objective co|mce|mc] [--price GPU=USD]
                  [--goodput-table FILE] [--fallback] [--json PATH]
      combos ranked by cost efficiency, then Eq. 16 (gateway.planning); one-line reasons, exit 2, when
      the inputs cannot be met

Owns: parsing the flags, the tables and the `switchyard.plan/1` JSON.
Must not: price or allocate (gateway.planning does).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gateway.planning.cost_model import CostModelError, gpu_efficiency, with_prices
from gateway.planning.plan_file import PLAN_SCHEMA
from switchyard.hardware import GPUS, MODELS, GpuSpec


def _usage_error(prog: str, reason: str) -> int:
    """Print `prog: error: reason` to stderr; the exit status of a refused input (2)."""
    print(f"{prog}: error: {reason}", file=sys.stderr)
    return 2


def parse_prices(items: Sequence[str]) -> dict[str, float]:
    """`GPU=USD` items -> {gpu: price}; ValueError with a one-line reason."""
    prices: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--price {item!r}: expected GPU=USD, e.g. h20=1.2")
        try:
            prices[name.strip().lower()] = float(value)
        except ValueError:
            raise ValueError(f"--price {item!r}: {value!r} is not a number") from None
    return prices


def priced_catalogue(items: Sequence[str]) -> dict[str, GpuSpec]:
    """The catalogue with `--price` items applied; ValueError / CostModelError with a one-line reason."""
    return with_prices(GPUS, parse_prices(items))


def gpus_table(gpus: dict[str, GpuSpec]) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for gpu in sorted(gpus.values(), key=lambda g: -g.dense_bf16_tflops / g.memory_bandwidth_gb_s):
        e = gpu_efficiency(gpu)
        rows.append({
            "gpu": gpu.name, "name": gpu.display_name, "tflops": gpu.dense_bf16_tflops,
            "bandwidth_gb_s": gpu.memory_bandwidth_gb_s, "memory_gb": gpu.memory_gb,
            "usd_per_hour": gpu.hourly_price_usd, "tflops_per_bandwidth": round(e.tflops_per_bandwidth, 4),
            "tflop_per_usd": round(e.tflop_per_usd), "gb_per_usd": round(e.gb_per_usd),
            "recommended": e.recommended,
        })
    return rows


def _si(value: float) -> str:
    return f"{value / 1e6:.2f}M" if value >= 1e6 else f"{value / 1e3:.0f}K"


def gpus(argv: Sequence[str], prog: str = "switchyard gpus") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--price", action="append", default=[], metavar="GPU=USD",
                        help="replace a GPU's hourly price (repeatable)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    try:
        catalogue = priced_catalogue(args.price)
    except (ValueError, CostModelError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    rows = gpus_table(catalogue)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'GPU':<16}{'TFLOPs':>8}{'BW GB/s':>9}{'Mem GB':>8}{'$/h':>7}{'TFLOPs/BW':>11}{'TFLOP/$':>9}"
          f"{'GB/$':>8}  recommended")
    for r in rows:
        print(f"{r['name']!s:<16}{r['tflops']:>8g}{r['bandwidth_gb_s']:>9g}{r['memory_gb']:>8g}"
              f"{r['usd_per_hour']:>7.2f}{r['tflops_per_bandwidth']:>11.2f}{_si(float(str(r['tflop_per_usd']))):>9}"
              f"{_si(float(str(r['gb_per_usd']))):>8}  {r['recommended']}")
    return 0



def parse_pairs(text: str, flag: str) -> dict[str, str]:
    """`a=1,b=2` (or `a:1,b:2`) -> {"a": "1", "b": "2"}; ValueError naming the flag."""
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.replace(":", "=", 1).partition("=")
        if not sep or not key or not value:
            raise ValueError(f"{flag} {text!r}: expected KEY=VALUE pairs, e.g. {flag} a=1,b=2")
        out[key.strip().lower()] = value.strip()
    if not out:
        raise ValueError(f"{flag} is empty")
    return out


def _positive(value: str, what: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{what}: {value!r} is not a number") from None
    if not number > 0:
        raise ValueError(f"{what} must be > 0, got {value}")
    return number


def load_arrivals(text: str, data_dir: str | None) -> list[float]:
    """A timed dataset's arrival times (seconds from its first request), in order; ValueError if untimed."""
    from loadgen.datasets.registry import load_dataset  # noqa: PLC0415
    from loadgen.paths import resolve_data_dir  # noqa: PLC0415

    requests = load_dataset(text, resolve_data_dir(data_dir), shuffle=False)
    arrivals = sorted(r.arrival_s for r in requests if r.arrival_s is not None)
    if len(arrivals) < len(requests) or not arrivals:
        raise ValueError(f"--autoscale needs a timed dataset (e.g. azure-conv); {text} has no timestamps")
    return arrivals


def parse_workload(text: str, data_dir: str | None) -> tuple[Any, str, list[tuple[float, float]] | None]:
    """`in=337,out=1330` or a loadgen dataset name: (the mean lengths as a `Workload`, a label, and for a
    dataset each request's (prompt, output) tokens, for `--length-mix`)."""
    from gateway.planning.cost_model import Workload  # noqa: PLC0415

    if "=" in text and ":" not in text.split("=", 1)[0]:  # in=..,out=.. (not synth:in=..)
        pairs = parse_pairs(text, "--workload")
        unknown = set(pairs) - {"in", "out"}
        if unknown or set(pairs) != {"in", "out"}:
            raise ValueError(f"--workload {text!r}: give in=TOKENS,out=TOKENS or a dataset name")
        r_in, r_out = _positive(pairs["in"], "--workload in"), _positive(pairs["out"], "--workload out")
        return Workload(r_in, r_out), text, None
    from loadgen.datasets.registry import load_dataset  # noqa: PLC0415
    from loadgen.paths import resolve_data_dir  # noqa: PLC0415

    requests = load_dataset(text, resolve_data_dir(data_dir), seed=0)
    if not requests or any(r.output_tokens is None for r in requests):
        raise ValueError(f"--workload {text}: the dataset does not give every request's output length; "
                         "give in=TOKENS,out=TOKENS")
    lengths = [(float(r.prompt_tokens), float(r.output_tokens or 0)) for r in requests]
    mean_in = sum(r_in for r_in, _ in lengths) / len(lengths)
    mean_out = sum(r_out for _, r_out in lengths) / len(lengths)
    return Workload(mean_in, mean_out), f"{text} (means of {len(requests)} requests)", lengths


def model_and_slo(model: str, slo_text: str) -> tuple[Any, Any]:
    """(the catalogue's `ModelShape`, loadgen's `Slo` with TTFT and TPOT only) for the planning commands'
    --model and --slo; ValueError with the one-line reason."""
    from loadgen.metrics import parse_slo  # noqa: PLC0415

    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; known: {', '.join(sorted(MODELS))}")
    slo = parse_slo(slo_text)
    if slo.ttft_ms is None or slo.tpot_ms is None or slo.e2e_ms is not None:
        raise ValueError(f"--slo {slo_text!r}: give ttft=MS,tpot=MS")
    return MODELS[model], slo


def build_plan_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="CAUCHY's combo allocation (paper 004, §3.3): "
                                "candidates by cost efficiency, then Eq. 16 solved by CBC.")
    p.add_argument("--model", required=True, help="a model of the catalogue, e.g. llama3-8b")
    p.add_argument("--workload", required=True, help="in=TOKENS,out=TOKENS (means) or a dataset name")
    p.add_argument("--slo", required=True, help="ttft=MS,tpot=MS")
    p.add_argument("--goodput-rps", type=float, help="goodput demand, requests/s meeting the SLO")
    p.add_argument("--budget-usd-h", type=float, help="the most the plan may cost per hour")
    p.add_argument("--gpus", default="h800:8,a800:8,h20:8", help="inventory GPU:COUNT,... (%(default)s)")
    p.add_argument("--objective", choices=("co", "mce", "mc"), default="co",
                   help="co: Eq. 16 (price / CE), mce: max cost efficiency, mc: min cost (%(default)s)")
    p.add_argument("--price", action="append", default=[], metavar="GPU=USD", help="replace a GPU's price")
    p.add_argument("--goodput-table", type=Path, help="JSON {combo id: req/s}, replacing modelled goodput")
    p.add_argument("--length-mix", action="store_true",
                   help="with a dataset --workload: goodput over its length buckets (base-2 on prompt and "
                   "output tokens, Mélange's size buckets) instead of at its means")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--fallback", action="store_true",
                   help="when the demand cannot be met: the most goodput the GPUs (and budget) allow instead")
    p.add_argument("--data-dir", help="dataset root (default: SWITCHYARD_DATA_DIR, else ../shared/data)")
    p.add_argument("--autoscale", action="store_true",
                   help="replay a timed --workload dataset's QPS through the autoscaler (Algorithm 1) and "
                   "print its actions; without --goodput-rps the first window's mean QPS sizes the start")
    p.add_argument("--autoscale-step-s", type=float, default=10.0, help="seconds per QPS sample (10)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the plan (switchyard.plan/1)")
    return p


def plan(argv: Sequence[str], prog: str = "switchyard plan") -> int:
    from gateway.planning.autoscaler import AutoscalerParams  # noqa: PLC0415
    from gateway.planning.combos import Slo, candidates, fastest_decode_step, length_mix  # noqa: PLC0415
    from gateway.planning.ilp import (  # noqa: PLC0415
        AllocationProblem,
        PulpCbcSolver,
        explain_infeasible,
        summarize,
    )

    args = build_plan_parser(prog).parse_args(argv)

    fail = functools.partial(_usage_error, prog)

    try:
        catalogue = priced_catalogue(args.price)
        shape, targets = model_and_slo(args.model, args.slo)
        slo = Slo(targets.ttft_ms / 1e3, targets.tpot_ms / 1e3)
        inventory: dict[str, int] = {}
        for gpu, count in parse_pairs(args.gpus, "--gpus").items():
            if gpu not in catalogue:
                return fail(f"--gpus: unknown GPU {gpu!r}; known: {', '.join(sorted(catalogue))}")
            if not count.isdigit():
                return fail(f"--gpus {gpu}:{count}: the count must be a whole number")
            inventory[gpu] = int(count)
        arrivals: list[float] = []
        if args.autoscale:
            if "=" in args.workload and ":" not in args.workload.split("=", 1)[0]:
                return fail("--autoscale needs a timed dataset as --workload (e.g. azure-conv)")
            if not args.autoscale_step_s > 0:
                return fail(f"--autoscale-step-s must be > 0, got {args.autoscale_step_s:g}")
            arrivals = load_arrivals(args.workload, args.data_dir)
            if args.goodput_rps is None:
                first = AutoscalerParams().local_window_s
                args.goodput_rps = max(sum(1 for t in arrivals if t < first) / first, 1e-3)
        if args.goodput_rps is None and args.budget_usd_h is None:
            return fail("give --goodput-rps, --budget-usd-h, or both")
        for flag, value in (("--goodput-rps", args.goodput_rps), ("--budget-usd-h", args.budget_usd_h)):
            if value is not None and not value > 0:
                return fail(f"{flag} must be > 0, got {value:g}")
        workload, workload_label, lengths = parse_workload(args.workload, args.data_dir)
        table = None
        if args.goodput_table is not None:
            table = {str(k): float(v) for k, v in json.loads(args.goodput_table.read_text()).items()}
        mix = None
        if args.length_mix:
            if table is not None:
                return fail("--length-mix models goodput over length buckets; --goodput-table replaces it: "
                            "give one")
            if lengths is None:
                return fail("--length-mix needs a dataset as --workload (e.g. sarathi-sharegpt), not means")
            mix = length_mix(lengths)
    except (ValueError, CostModelError, OSError) as exc:
        return fail(str(exc))
    gpus = {g: catalogue[g] for g in inventory}
    cands = candidates(shape, workload, slo, gpus, goodput_table=table, max_num_seqs=args.max_num_seqs,
                       mix=mix)
    if not cands:
        where, step = fastest_decode_step(shape, workload, gpus)
        if slo.tpot_s < step:
            return fail(f"TPOT {slo.tpot_s * 1e3:g} ms < fastest decode step ({where}, {step * 1e3:.1f} ms)")
        return fail(f"no combo of {', '.join(sorted(gpus))} holds {shape.name} and meets TTFT "
                    f"{slo.ttft_s * 1e3:g} ms")
    problem = AllocationProblem(tuple(cands), inventory, args.objective, args.goodput_rps, args.budget_usd_h)
    solver = PulpCbcSolver()
    allocation = solver.solve(problem)
    fallback = None
    if allocation.status != "optimal":
        reason = explain_infeasible(problem)
        if not args.fallback:
            return fail(reason + " (--fallback: plan the most goodput the GPUs allow instead)")
        ceiling = args.budget_usd_h or sum(catalogue[g].hourly_price_usd * n for g, n in inventory.items())
        problem = AllocationProblem(tuple(cands), inventory, args.objective, None, ceiling)
        allocation = solver.solve(problem)
        fallback = reason
        if allocation.status != "optimal" or not allocation.counts:
            return fail(reason + "; the fallback found no allocation either")
    tokens_per_request = workload.input_tokens + workload.output_tokens
    summary = summarize(allocation, cands, tokens_per_request)
    by_id = {c.combo.id: c for c in cands}
    chosen = sorted(((by_id[k], n) for k, n in allocation.counts.items()),
                    key=lambda cn: -cn[0].goodput_rps * cn[1])
    combos = [{
        "combo": c.combo.id, "count": n, "aggregated": c.combo.aggregated, "gpus": c.combo.gpus(),
        "usd_per_hour": c.usd_per_hour, "goodput_rps": c.goodput_rps, "goodput_source": c.goodput_source,
        "goodput_per_usd_h": c.goodput_per_usd_h, "ce_tokens_per_usd": c.ce_tokens_per_usd,
        "tokens_per_usd": c.goodput_rps * tokens_per_request * 3600.0 / c.usd_per_hour,
        "modelled_balanced_tokens_per_usd": c.cost.balanced_tokens_per_usd,
    } for c, n in chosen]
    doc = {
        "schema": PLAN_SCHEMA, "model": shape.name, "workload": workload_label,
        "input_tokens": workload.input_tokens, "output_tokens": workload.output_tokens,
        "slo_ms": {"ttft": slo.ttft_s * 1e3, "tpot": slo.tpot_s * 1e3}, "objective": args.objective,
        "demand_rps": args.goodput_rps, "budget_usd_per_h": args.budget_usd_h, "inventory": inventory,
        "prices": {g: gpus[g].hourly_price_usd for g in sorted(gpus)},
        "fallback": fallback, "candidates": len(cands), "combos": combos,
        "total_usd_per_h": summary.total_usd_per_h, "expected_goodput_rps": summary.goodput_rps,
        "tokens_per_usd": summary.tokens_per_usd, "gpus_used": dict(summary.gpus),
        "solver_ms": allocation.solver_ms, "max_num_seqs": args.max_num_seqs, "goodput_table": table,
        "length_mix": None if mix is None else [
            {"share": share, "input_tokens": w.input_tokens, "output_tokens": w.output_tokens}
            for share, w in mix],
    }
    print(f"{shape.name}, {workload_label}: {workload.input_tokens:.0f} in / {workload.output_tokens:.0f} "
          f"out; SLO TTFT {slo.ttft_s * 1e3:g} ms, TPOT {slo.tpot_s * 1e3:g} ms; objective {args.objective}; "
          f"{len(cands)} candidates")
    if fallback:
        print(f"FALLBACK (--fallback): {fallback}; planned the most goodput the GPUs allow instead")
    print(f"{'combo':<18}{'count':>6}{'$/h':>9}{'goodput':>10}{'req/s per $/h':>15}{'tokens/$':>12}")
    for c, n in chosen:
        tokens_per_usd = c.goodput_rps * tokens_per_request * 3600.0 / c.usd_per_hour
        print(f"{c.combo.id:<18}{n:>6}{c.usd_per_hour:>9.2f}{c.goodput_rps:>10.2f}{c.goodput_per_usd_h:>15.3f}"
              f"{_si(tokens_per_usd):>12}")
    source = "measured" if table else "modelled" if mix is None else f"modelled, {len(mix)} length buckets"
    print(f"total ${summary.total_usd_per_h:.2f}/h, {summary.goodput_rps:.2f} req/s at the SLO ({source}), "
          f"{_si(summary.tokens_per_usd)} tokens/$; GPUs {dict(summary.gpus)}; "
          f"solver {allocation.solver_ms:.1f} ms")
    if args.autoscale:
        doc["autoscale"] = autoscale_timeline(cands, inventory, args.objective, allocation.counts, arrivals,
                                              args.autoscale_step_s)
        print_timeline(doc["autoscale"])
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


def autoscale_timeline(cands: Sequence[Any], inventory: dict[str, int], objective: str,
                       initial: Mapping[str, int], arrivals: Sequence[float],
                       step_s: float) -> dict[str, Any]:
    """Algorithm 1 over the trace's QPS (arrivals per `step_s`), starting from the plan: its actions, the
    capacity and $/h at each sample, and what the fleet cost."""
    from gateway.planning.autoscaler import Autoscaler, QpsMeter, action_row  # noqa: PLC0415
    from gateway.planning.ilp import PulpCbcSolver  # noqa: PLC0415

    scaler = Autoscaler(cands, inventory, PulpCbcSolver(), initial, objective)  # type: ignore[arg-type]
    end = arrivals[-1] if arrivals else 0.0
    meter = QpsMeter(step_s)
    samples_in: list[tuple[float, float]] = []
    for t in arrivals:
        samples_in += meter.arrive(t)
    samples_in += meter.until((int(end // step_s) + 1) * step_s)  # through the bin of the last arrival
    actions: list[dict[str, Any]] = []
    samples: list[list[float]] = []
    usd = 0.0
    for now, qps in samples_in:
        actions += [action_row(action) for action in scaler.observe(now, qps)]
        usd_h = scaler.usd_per_hour(now)
        usd += usd_h * step_s / 3600.0
        samples.append([now, qps, scaler.capacity_rps(), usd_h])
    params = scaler.params
    return {"params": {"ratio": params.ratio, "local_window_s": params.local_window_s,
                       "global_window_s": params.global_window_s, "provisioning_s": params.provisioning_s,
                       "grace_s": params.grace_s, "step_s": step_s},
            "actions": actions, "samples": samples, "usd_total": usd, "requests": len(arrivals),
            "duration_s": end}


def print_timeline(timeline: Mapping[str, Any]) -> None:
    print(f"autoscale over {timeline['requests']} requests, {timeline['duration_s'] / 60:.1f} min:")
    for a in timeline["actions"]:
        combos = a.get("combos", {})
        print(f"  {a['at_s'] / 60:7.1f} min  {a['kind']:<8} {combos or ''}  {a['reason']}")
    print(f"  fleet cost over the trace ${timeline['usd_total']:.2f} ({len(timeline['actions'])} actions)")


def build_profile_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description="Measure each GPU combo's goodput at an SLO in the simulator (CAUCHY §3.2's "
        "profiling): the highest Poisson rate whose SLO attainment stays at or above --attainment. Writes "
        "the {combo: req/s} table `switchyard plan --goodput-table` reads.")
    p.add_argument("--model", required=True, help="a model of the catalogue, e.g. llama3-8b")
    p.add_argument("--workload", required=True,
                   help="a loadgen dataset (azure-conv, sharegpt, synth:in=702,out=42, ...) to replay")
    p.add_argument("--slo", required=True, help="ttft=MS,tpot=MS")
    p.add_argument("--gpus", default="h800,a800,h20", help="GPU types, GPU or GPU:COUNT (%(default)s)")
    p.add_argument("--combos", help="combo ids to profile (default: the planner's candidates for --gpus)")
    p.add_argument("--price", action="append", default=[], metavar="GPU=USD", help="replace a GPU's price")
    p.add_argument("--attainment", type=float, default=0.9, help="SLO attainment a rate must keep (0.9)")
    p.add_argument("--requests", type=int, default=1000, help="workload requests drawn (1000)")
    p.add_argument("--trial-s", type=float, default=300.0,
                   help="seconds of Poisson arrivals per trial rate (300): rate x trial-s requests, the "
                        "workload's cycled; short trials overstate goodput (a slow queue never builds)")
    p.add_argument("--precision", type=float, default=0.05, help="relative width the search stops at (0.05)")
    p.add_argument("--max-rps", type=float, default=1000.0, help="the highest rate tried (1000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", help="dataset root (default: SWITCHYARD_DATA_DIR, else ../shared/data)")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the goodput table here")
    return p


def profile_combos(argv: Sequence[str], prog: str = "switchyard profile-combos") -> int:
    """`switchyard profile-combos`: a goodput table measured on the simulated GPU."""
    from gateway.planning.combos import Slo, candidates  # noqa: PLC0415
    from gateway.planning.cost_model import Workload  # noqa: PLC0415
    from loadgen.datasets.registry import load_dataset  # noqa: PLC0415
    from loadgen.paths import resolve_data_dir  # noqa: PLC0415
    from loadgen.simulate.fleet import combo_engines  # noqa: PLC0415

    args = build_profile_parser(prog).parse_args(argv)

    fail = functools.partial(_usage_error, prog)

    try:
        catalogue = priced_catalogue(args.price)
        shape, slo = model_and_slo(args.model, args.slo)
        if not 0 < args.attainment <= 1:
            return fail(f"--attainment must be in (0, 1], got {args.attainment:g}")
        if args.requests < 10:
            return fail(f"--requests must be >= 10, got {args.requests}")
        if not 0 < args.precision < 1 or not args.max_rps > 0 or not args.trial_s > 0:
            return fail("--precision must be in (0, 1), --max-rps and --trial-s > 0")
        gpu_names = [item.partition(":")[0].strip() for item in args.gpus.split(",") if item.strip()]
        unknown = [g for g in gpu_names if g not in catalogue]
        if unknown:
            return fail(f"--gpus: unknown GPU {unknown[0]!r}; known: {', '.join(sorted(catalogue))}")
        requests = load_dataset(args.workload, resolve_data_dir(args.data_dir), num_requests=args.requests,
                                seed=args.seed)
        if args.combos:
            combo_ids = [c.strip() for c in args.combos.split(",") if c.strip()]
        else:
            outputs = [r.output_tokens for r in requests if r.output_tokens is not None]
            mean_out = sum(outputs) / len(outputs) if outputs else 256.0
            workload = Workload(sum(r.prompt_tokens for r in requests) / len(requests), mean_out)
            gpus = {g: catalogue[g] for g in gpu_names}
            combo_ids = [c.combo.id for c in candidates(shape, workload, Slo(slo.ttft_ms / 1e3,
                                                                            slo.tpot_ms / 1e3), gpus)]
        fleets = {c: combo_engines(c, shape.name) for c in combo_ids}
    except (ValueError, CostModelError, OSError) as exc:
        return fail(str(exc).splitlines()[0])
    table: dict[str, float] = {}
    measured: dict[tuple[tuple[str, str], ...], float] = {}  # one search per multiset of (profile, role)
    for combo, engines in fleets.items():
        key = tuple(sorted(engines))
        if key not in measured:
            measured[key] = combo_goodput(engines, requests, slo, args.attainment, args.precision,
                                          args.max_rps, args.seed, args.trial_s)
        table[combo] = measured[key]
        print(f"{combo:<18} {len(engines)} engine(s)  goodput {table[combo]:8.2f} req/s", flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(table, indent=2) + "\n")
    return 0


def combo_goodput(engines: Sequence[tuple[str, str]], requests: Sequence[Any], slo: Any, attainment: float,
                  precision: float, max_rps: float, seed: int, trial_s: float = 300.0) -> float:
    """The highest Poisson rate (req/s) at which `engines` ((sim profile, role) pairs: a disaggregated
    combo's prefill engines hand off to its decode engines), routed least-loaded (the opportunistic
    intra-combo pick), keep SLO attainment >= `attainment`: each trial replays `trial_s`
    seconds of arrivals at its rate (at least 50 requests, `requests` cycled with fresh ids); doubling from
    0.25 req/s until a rate fails, then bisection to `precision`; 0 when even 0.25 req/s fails."""
    import dataclasses  # noqa: PLC0415

    from loadgen.arrivals import ArrivalSpec, schedule  # noqa: PLC0415
    from loadgen.metrics import summarize  # noqa: PLC0415
    from loadgen.simulate import EngineSpec, SimOptions, simulate  # noqa: PLC0415

    specs = [EngineSpec(profile, 1, role=role) for profile, role in engines]
    options = SimOptions(policy="least_loaded", seed=seed, slo_ttft_s=slo.ttft_ms / 1e3,
                         slo_tpot_s=slo.tpot_ms / 1e3)

    def meets(rate: float) -> bool:
        n = max(50, math.ceil(rate * trial_s))
        drawn = [dataclasses.replace(requests[i % len(requests)], request_id=f"p{i}") for i in range(n)]
        result = simulate(schedule(drawn, ArrivalSpec(rate_per_s=rate, seed=seed)), specs, options)
        summary = summarize(result.outcomes, max(result.duration_s, 1e-9), slo)
        return (summary.slo_attainment or 0.0) >= attainment

    return rate_search(meets, precision, max_rps)


def rate_search(meets: Callable[[float], bool], precision: float, max_rps: float) -> float:
    """The highest rate `meets` accepts, assuming acceptance falls with the rate: doubling from 0.25 until a
    rate fails (or passes `max_rps`), then bisection until the bracket is within `precision` (relative);
    0 when 0.25 already fails."""
    low, high = 0.0, 0.25
    while high <= max_rps and meets(high):
        low, high = high, high * 2
    if low == 0.0:
        return 0.0
    high = min(high, max_rps)
    while (high - low) / low > precision:
        mid = (low + high) / 2
        if meets(mid):
            low = mid
        else:
            high = mid
    return low
