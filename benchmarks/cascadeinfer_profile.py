"""CascadeInfer's QoE-model profiling (paper 000, §4.1 "Fitting the parameters D_k") and its accuracy (§6.5,
Figure 13) on the simulated GPU, so that the QoE model is seeded from the engine model the simulator runs.

EVERY LATENCY HERE IS SIMULATED: one `SimEngine` (the profile's roofline iteration times, vLLM V1 scheduling)
stepped in virtual time; no wall clock enters a figure except `wall_s`.

Procedure (§4.1), and why each choice
- Lengths: the Sarathi ShareGPT length statistics (`sharegpt/sharegpt_8k_filtered_stats_llama2_tokenizer.csv`:
  prompt and output tokens per conversation, 30,731 rows under /work/shared/data, 200 in the committed
  fixtures) under the data root (`--data-dir`, else `SWITCHYARD_DATA_DIR`, else ../shared/data). Each request
  produces exactly its row's output tokens (`ignore_eos`), so a run replays the dataset's lengths.
- Split: the rows are shuffled (`--seed`) and cut into a fitting set (`--fit-fraction`, 0.5) and a validation
  set; "the same benchmarking procedure" runs on each (§4.1 "For validation ..."): D is fitted on the
  fitting run's requests only and judged on the validation run's.
- Buckets: prompt length in exponentially growing ranges [100, 200), [200, 400), ... whose upper end is at
  most `--max-input-tokens` (6400: the data's prompts stop at 8141, and [6400, 12800) holds 3 of the
  fixtures' 200 rows); prompts under 100 tokens are discarded ("discarding those that are too short").
- Batch sizes: 1, 2, 4, ... up to what memory allows: the largest B with B full requests of the bucket
  (the longest prompt + output among its rows) in the KV cache, at most the profile's `max_num_seqs`
  (`--max-batch` lowers it). No preemption can then occur, as on the paper's "fixed memory budget".
- Closed loop: B requests in flight from time 0; whenever one finishes, the next row of the bucket (cycling
  through a seeded shuffle) is enqueued at that instant. Each (bucket, B) runs `--duration-s` virtual seconds
  on a fresh engine; requests still in flight at the end are dropped (a finished request is a sample).
- Per request: q = end-to-end latency (enqueue to last token) / output tokens, and its lifetime-average
  F = (1, n, ΣI, ΣI², ΣL) (`switchyard.qoe.LifetimeLoad`): the F of the instance's requests in flight
  (running or queued: with memory for all B, one waits only for an iteration's token budget) at the start
  of each iteration the request is in, L = prompt + tokens generated so far.
- Fit: non-negative least squares (`switchyard.qoe.fit`): §4.1's regression with D >= 0, on relative
  residuals (the default, `qoe`) and, for comparison, on absolute ones as §4.1 writes it (`qoe_unweighted`).
- Baseline (§6.5): a static predictor returning the fitting run's global mean q for every request; the paper
  reports mean relative errors of 8.9 % (QoE model) vs 64 % (static).

Measured (default run, h100-llama3-8b, 47 configurations per split, 60 virtual s each; 16 to 32 s of wall time
on 2 busy cores): D = (7.11e-3, 3.42e-5, 1.17e-7, 1.44e-12, 0) for (1, n, ΣI, ΣI², ΣL); 16,167 fitting and
16,538 validation requests; validation mean relative error 5.7 % (QoE model), 10.4 % (unweighted fit), 45.9 %
(static mean); median 3.8 % vs 35.8 %. NNLS pins D_4 (ΣL) at 0: here ΣL is ΣI plus the tokens generated so
far, which move with n, so the other columns absorb its share. Shorter runs fit worse (20 virtual s: 9.0 %
vs 58 %), probably because the start-up transient (all B requests prefilling at once) weighs more.

Output: printed summary and JSON (default results/cascadeinfer_profile.json): both fits' D, the errors of
the three predictors on the fitting and validation runs (mean, percentiles, a histogram for Figure 13), and
per (bucket, B) sample counts and errors.

    .venv/bin/python benchmarks/cascadeinfer_profile.py [--profile h100-llama3-8b] [--duration-s 60]
        [--output PATH]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.json_out import write_json  # noqa: E402
from engine_agent.domain import BackendRequest, RequestId, SamplingSpec  # noqa: E402
from engine_agent.sim.engine import SimEngine  # noqa: E402
from loadgen.datasets.registry import SHAREGPT_LENGTHS_FILE  # noqa: E402
from loadgen.datasets.traces import load_length_csv  # noqa: E402
from loadgen.paths import resolve_data_dir  # noqa: E402
from switchyard.profiles import Profile, get_profile  # noqa: E402
from switchyard.qoe import FEATURE_NAMES, LifetimeLoad, QoEModel, Sample, fit, relative_errors  # noqa: E402

DEFAULT_PROFILE = "h100-llama3-8b"
MIN_INPUT_TOKENS = 100
PAPER = {"qoe_mean_relative_error": 0.089, "static_mean_relative_error": 0.64}
HISTOGRAM_EDGES = tuple(round(0.05 * i, 2) for i in range(21))  # relative error 0..1 in 5 % bins, then > 1

Row = tuple[int, int]  # (prompt tokens, output tokens)
Bucket = tuple[int, int]  # [low, high) prompt tokens


@dataclass(slots=True)
class _Flight:
    prompt: int
    arrival_s: float
    load: LifetimeLoad = field(default_factory=LifetimeLoad)


def load_rows(data_dir: Path, profile: Profile) -> list[Row]:
    """(prompt, output) of every row of the ShareGPT length statistics that fits the profile's context."""
    requests = load_length_csv(data_dir / SHAREGPT_LENGTHS_FILE, name="sarathi-sharegpt")
    return [(r.prompt_tokens, r.output_tokens) for r in requests
            if r.prompt_tokens > 0 and r.output_tokens is not None and r.output_tokens > 0
            and r.prompt_tokens + r.output_tokens <= profile.max_context_tokens]


def buckets(max_input_tokens: int) -> list[Bucket]:
    """[100, 200), [200, 400), ... with high <= max_input_tokens."""
    out: list[Bucket] = []
    low = MIN_INPUT_TOKENS
    while 2 * low <= max_input_tokens:
        out.append((low, 2 * low))
        low *= 2
    return out


def batch_sizes(profile: Profile, rows: Sequence[Row], max_batch: int | None) -> list[int]:
    """1, 2, 4, ... while B copies of the bucket's longest request fit the KV cache and B <= max_num_seqs."""
    longest = max(p + o for p, o in rows)
    per_request_blocks = -(-longest // profile.block_size)
    limit = min(profile.max_num_seqs, profile.kv_blocks_total // per_request_blocks)
    if max_batch is not None:
        limit = min(limit, max_batch)
    sizes = []
    b = 1
    while b <= limit:
        sizes.append(b)
        b *= 2
    return sizes


def closed_loop(profile: Profile, rows: Sequence[Row], batch: int, duration_s: float,
                seed: int) -> list[Sample]:
    """One (bucket, B) run: B requests in flight on one engine for `duration_s` virtual seconds; a sample per
    finished request (its lifetime-average F, its normalised latency)."""
    engine = SimEngine(profile, seed=seed)
    order = list(rows)
    random.Random(seed).shuffle(order)
    flights: dict[RequestId, _Flight] = {}
    sums = [0, 0, 0]  # ΣI, ΣI², ΣL over the requests in flight
    issued = 0

    def enqueue(now_s: float) -> None:
        nonlocal issued
        prompt, output = order[issued % len(order)]
        rid = RequestId(f"r{issued}")
        issued += 1
        sampling = SamplingSpec(max_tokens=output, ignore_eos=True)
        engine.add_request(BackendRequest(rid, (100,) * prompt, sampling), now_s)
        flights[rid] = _Flight(prompt, now_s)
        sums[0] += prompt
        sums[1] += prompt * prompt
        sums[2] += prompt

    for _ in range(batch):
        enqueue(0.0)
    samples: list[Sample] = []
    now_s = 0.0
    while now_s < duration_s:
        f = (1.0, float(len(flights)), float(sums[0]), float(sums[1]), float(sums[2]))
        result = engine.step(now_s)
        if result.duration_s <= 0.0:
            raise RuntimeError(f"engine idle with {len(flights)} requests in flight (B={batch})")
        for flight in flights.values():
            flight.load.add(f)
        now_s += result.duration_s
        sums[2] += len(result.tokens)  # every request in flight gains its token's length
        for rid, event in result.finished:
            flight = flights.pop(rid)
            sums[0] -= flight.prompt
            sums[1] -= flight.prompt * flight.prompt
            sums[2] -= flight.prompt + event.usage.completion_tokens
            samples.append((flight.load.mean(), (now_s - flight.arrival_s) / event.usage.completion_tokens))
            enqueue(now_s)
    return samples


def profile_run(profile: Profile, pools: dict[Bucket, list[Row]], max_batch: int | None, duration_s: float,
                seed: int) -> dict[tuple[Bucket, int], list[Sample]]:
    """§4.1's benchmarking procedure over every (bucket, B) on one set of rows."""
    out: dict[tuple[Bucket, int], list[Sample]] = {}
    for bucket, rows in pools.items():
        for b in batch_sizes(profile, rows, max_batch):
            out[(bucket, b)] = closed_loop(profile, rows, b, duration_s, seed)
    return out


def error_summary(errors: np.ndarray) -> dict[str, Any]:
    if errors.size == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    return {"mean": float(errors.mean()), "p50": float(np.percentile(errors, 50)),
            "p90": float(np.percentile(errors, 90)), "p99": float(np.percentile(errors, 99))}


def density(errors: np.ndarray) -> list[float]:
    """Share of requests per relative-error bin of HISTOGRAM_EDGES, the last entry those above 1."""
    counts, _ = np.histogram(np.minimum(errors, 1.0), bins=np.array(HISTOGRAM_EDGES))
    counts[-1] -= int(np.sum(errors > 1.0))
    shares = [*counts.tolist(), int(np.sum(errors > 1.0))]
    return [c / max(1, errors.size) for c in shares]


def static_errors(mean_q: float, samples: Sequence[Sample]) -> np.ndarray:
    q = np.array([s[1] for s in samples])
    return np.abs(mean_q - q) / q


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default=DEFAULT_PROFILE, help="sim profile name")
    parser.add_argument("--duration-s", type=float, default=60.0,
                        help="virtual seconds per (bucket, batch size) configuration")
    parser.add_argument("--max-input-tokens", type=int, default=6400, help="upper end of the last bucket")
    parser.add_argument("--max-batch", type=int, default=None, help="cap on B (default: what memory allows)")
    parser.add_argument("--fit-fraction", type=float, default=0.5,
                        help="share of the rows in the fitting set")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", default=None,
                        help="data root (default: SWITCHYARD_DATA_DIR, else ../shared/data)")
    parser.add_argument("--output", type=Path, default=REPO / "results" / "cascadeinfer_profile.json")
    args = parser.parse_args(argv)
    if args.duration_s <= 0 or not 0 < args.fit_fraction < 1:
        parser.error("--duration-s must be > 0 and --fit-fraction in (0, 1)")
    started = time.perf_counter()
    profile = get_profile(args.profile)
    data_dir = resolve_data_dir(args.data_dir)
    rows = load_rows(data_dir, profile)
    random.Random(args.seed).shuffle(rows)
    cut = round(len(rows) * args.fit_fraction)
    splits = {"fit": rows[:cut], "validation": rows[cut:]}
    pools: dict[str, dict[Bucket, list[Row]]] = {name: {} for name in splits}
    for bucket in buckets(args.max_input_tokens):
        parts = {name: [r for r in split if bucket[0] <= r[0] < bucket[1]] for name, split in splits.items()}
        if all(parts.values()):  # a bucket profiled in one split only would bias the comparison
            for name, part in parts.items():
                pools[name][bucket] = part
    if not pools["fit"]:
        parser.error(f"no bucket of [{MIN_INPUT_TOKENS}, {args.max_input_tokens}) has rows in both splits")

    runs = {name: profile_run(profile, pools[name], args.max_batch, args.duration_s, args.seed + i)
            for i, name in enumerate(splits)}
    samples = {name: [s for config in run.values() for s in config] for name, run in runs.items()}
    fits = {"qoe": fit(samples["fit"]), "qoe_unweighted": fit(samples["fit"], relative=False)}
    mean_q = float(np.mean([s[1] for s in samples["fit"]]))

    def errors_of(predictor: str, part: Sequence[Sample]) -> np.ndarray:
        if predictor == "static":
            return static_errors(mean_q, part)
        return relative_errors(fits[predictor].model, part)

    predictors = (*fits, "static")
    errors = {split: {name: errors_of(name, part) for name in predictors} for split, part in samples.items()}
    val = {name: float(e.mean()) for name, e in errors["validation"].items()}
    configs = []
    for (bucket, b), part in runs["validation"].items():
        configs.append({
            "bucket": list(bucket), "batch": b, "fit_samples": len(runs["fit"].get((bucket, b), [])),
            "validation_samples": len(part),
            "validation_mean_error": {name: error_summary(errors_of(name, part))["mean"]
                                      for name in predictors},
        })
    model: QoEModel = fits["qoe"].model
    document: dict[str, Any] = {
        "profile": profile.name,
        "data_file": str(data_dir / SHAREGPT_LENGTHS_FILE),
        "rows": {name: len(split) for name, split in splits.items()},
        "duration_s_per_config": args.duration_s,
        "buckets": [list(b) for b in pools["fit"]],
        "batch_sizes": {f"{lo}-{hi}": batch_sizes(profile, part, args.max_batch)
                        for (lo, hi), part in pools["fit"].items()},
        "configs_per_split": len(runs["fit"]),
        "fit": {
            name: {"objective": "relative" if name == "qoe" else "absolute (§4.1 as written)",
                   "d": dict(zip(FEATURE_NAMES, f.model.d, strict=True)), "d_list": list(f.model.d),
                   "num_samples": f.num_samples, "mean_relative_error": f.mean_relative_error}
            for name, f in fits.items()
        },
        "static_mean_q_s_per_token": mean_q,
        "samples": {name: len(part) for name, part in samples.items()},
        "errors": {split: {name: error_summary(e) for name, e in by.items()} for split, by in errors.items()},
        "validation": {
            "qoe_mean_relative_error": val["qoe"],
            "qoe_unweighted_mean_relative_error": val["qoe_unweighted"],
            "static_mean_relative_error": val["static"],
            "static_over_qoe": val["static"] / val["qoe"] if val["qoe"] > 0 else None,
        },
        "histogram": {
            "bin_edges": list(HISTOGRAM_EDGES),
            "note": "share of validation requests per relative-error bin; the last entry: error > 1",
            **{name: density(e) for name, e in errors["validation"].items()},
        },
        "configs": configs,
        "paper": PAPER,
        "wall_s": time.perf_counter() - started,
    }
    write_json(args.output, document)
    print(f"profile {profile.name}: {len(pools['fit'])} buckets, {len(runs['fit'])} configs per split, "
          f"{args.duration_s:g} virtual s each")
    print("fitted D: " + ", ".join(f"{n}={v:.4g}" for n, v in zip(FEATURE_NAMES, model.d, strict=True)))
    print(f"samples: fit {len(samples['fit'])}, validation {len(samples['validation'])}")
    print(f"validation mean relative error: QoE model {val['qoe']:.1%} (unweighted fit "
          f"{val['qoe_unweighted']:.1%}), static mean {val['static']:.1%} "
          f"(paper: {PAPER['qoe_mean_relative_error']:.1%} vs {PAPER['static_mean_relative_error']:.0%})")
    print(f"wall {document['wall_s']:.1f} s; wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
