"""STAR's remaining-length predictor (paper 003, §4) end to end on sim agents: collect, train, evaluate, cost.

IMPORTANT: the sim backend's hidden states are synthetic. They encode each request's remaining length through
a fixed random projection plus noise (a planted signal: engine_agent/sim/hidden_states.py documents it), so
the MAE figures here test the pipeline (recording, labels, split, training, evaluation), not that real hidden
states predict output length. Real figures need `switchyard predictor collect --backend vllm --model DIR`.

One invocation:
1. collects (unless `--data DIR` names shards already recorded): `--num-requests` ShareGPT requests (loadgen's
   `sharegpt` dataset under the shared data root; output lengths forced to the dataset's) replayed through
   `--agents` sim agents (`--profile`, default h100-llama3-8b: hidden size 4096) with
   `--record-hidden-states`, a tap every 20 decode steps, in real time;
2. trains the MLP (`--widths`, default Eq. 2's 2048/512/64; at most `--epochs`, patience 10; `--search-trials
   N` runs §4.4's random search instead), request-level 70/15/15 split;
3. evaluates on the held-out requests: MAE of `continuous`, `prompt_only`, `history` and `oracle`, overall
   and by generated-token bucket;
4. measures the cost: parameters of Eq. 2 at d = 3584 with m = 2048/512/64 (the paper's 8.4 M) and at 4096,
   and the prediction latency (`LengthPredictor.predict`: standardisation + MLP) per batch of 256 and for one
   request, on ONE CPU core (a child process with OMP/OPENBLAS/MKL_NUM_THREADS=1 set before numpy loads), at
   d = 4096 and d = 3584. The paper's latency is on an H800 (1.33 ms at batch 1); ours is a CPU core.
Writes JSON (default results/star_predictor.json).

    .venv/bin/python benchmarks/star_predictor.py [--num-requests 400] [--agents 1] [--data DIR]
        [--widths 2048,512,64] [--epochs 100] [--search-trials N] [--out results/star_predictor.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PLANTED_NOTE = (
    "sim hidden states carry a planted signal (engine_agent/sim/hidden_states.py: remaining length through a "
    "fixed random projection plus noise); these MAEs test the pipeline, not that real hidden states predict "
    "length"
)
PAPER_WIDTHS = (2048, 512, 64)
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS")


def random_predictor(hidden_size: int, rng: Any, model: str = "random") -> Any:
    """An untrained `LengthPredictor` of Eq. 2's shape (m = 2048/512/64) with random weights, for cost figures
    (its cost does not depend on the weights). Imports numpy only when called, so a caller can set the BLAS
    thread variables first."""
    import numpy as np  # noqa: PLC0415

    from engine_agent.star.history import HistoryTable  # noqa: PLC0415
    from engine_agent.star.mlp import MLP  # noqa: PLC0415
    from engine_agent.star.predictor import LengthPredictor, PredictorMeta  # noqa: PLC0415

    return LengthPredictor(
        mlp=MLP.initialise(hidden_size, PAPER_WIDTHS, rng),
        input_mean=np.zeros(hidden_size, dtype=np.float32),
        input_std=np.ones(hidden_size, dtype=np.float32),
        meta=PredictorMeta(model=model, hidden_size=hidden_size, widths=PAPER_WIDTHS, target_scale=300.0,
                           seed=0),
        history=HistoryTable(edges=np.zeros(1), means=np.zeros(1)),
        test_request_ids=np.array([], dtype=np.str_),
    )


def latency_worker(hidden_sizes: list[int], batch_repeats: int, single_repeats: int) -> dict[str, Any]:
    """Runs in a child with one BLAS thread: time `predict` on random weights of Eq. 2's shape."""
    import numpy as np  # noqa: PLC0415 (after the thread variables are set)

    out: dict[str, Any] = {}
    for d in hidden_sizes:
        rng = np.random.default_rng(0)
        predictor = random_predictor(d, rng)
        timings: dict[str, list[float]] = {}
        for batch, repeats in ((256, batch_repeats), (1, single_repeats)):
            x = rng.standard_normal((batch, d)).astype(np.float32)
            predictor.predict(x)  # warm-up
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                predictor.predict(x)
                samples.append(time.perf_counter() - start)
            timings[str(batch)] = samples
        b256, b1 = timings["256"], timings["1"]
        out[str(d)] = {
            "batch_256_ms": {"median": statistics.median(b256) * 1e3, "min": min(b256) * 1e3},
            "per_request_in_batch_256_ms": statistics.median(b256) * 1e3 / 256,
            "batch_1_ms": {"median": statistics.median(b1) * 1e3, "min": min(b1) * 1e3},
            "repeats": {"batch_256": batch_repeats, "batch_1": single_repeats},
        }
    return out


def measure_latency(batch_repeats: int, single_repeats: int) -> dict[str, Any]:
    env = {**os.environ, **dict.fromkeys(THREAD_VARIABLES, "1")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, __file__, "--latency-worker", "--latency-repeats", str(batch_repeats),
         str(single_repeats)],
        env=env, capture_output=True, text=True, check=True,
    )
    result: dict[str, Any] = json.loads(proc.stdout)
    result["threads"] = "one BLAS thread (" + ", ".join(f"{v}=1" for v in THREAD_VARIABLES) + ")"
    return result


def collect_shards(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from engine_agent.star.collect import CollectOptions, collect  # noqa: PLC0415
    from loadgen.datasets.registry import load_dataset  # noqa: PLC0415
    from loadgen.paths import resolve_data_dir  # noqa: PLC0415

    requests = load_dataset("sharegpt", resolve_data_dir(args.data_dir), num_requests=args.num_requests,
                            seed=args.seed)
    options = CollectOptions(out=out, agents=args.agents, seed=args.seed, profile=args.profile,
                             hidden_state_interval=args.hidden_state_interval)
    report = asyncio.run(collect(requests, options, progress=lambda line: print(f"collect: {line}",
                                                                               file=sys.stderr)))
    if report.failed:
        raise SystemExit(f"collect: {report.failed} request(s) did not complete")
    return {**report.as_dict(), "dataset": "sharegpt", "profile": options.profile, "agents": args.agents,
            "hidden_state_interval": args.hidden_state_interval, "out": str(out)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=400)
    p.add_argument("--agents", type=int, default=1)
    p.add_argument("--profile", default="h100-llama3-8b", help="sim profile (its model sets the hidden size)")
    p.add_argument("--hidden-state-interval", type=int, default=20)
    p.add_argument("--data-dir", default=None, help="data root (default: the shared one)")
    p.add_argument("--data", default=None, help="use shards already recorded here (no collection)")
    p.add_argument("--work-dir", default=str(REPO / "results" / "star_predictor_shards"),
                   help="where collected shards go (emptied of old shards first)")
    p.add_argument("--widths", default=",".join(str(w) for w in PAPER_WIDTHS))
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--patience", type=int, default=10)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--search-trials", type=int, default=0, help="§4.4's random search with N trials")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--latency-repeats", type=int, nargs=2, default=(20, 200), metavar=("BATCH256", "BATCH1"))
    p.add_argument("--out", default=str(REPO / "results" / "star_predictor.json"))
    p.add_argument("--latency-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.latency_worker:
        print(json.dumps(latency_worker([4096, 3584], *args.latency_repeats)))
        return 0

    from engine_agent.star.evaluate import evaluate  # noqa: PLC0415
    from engine_agent.star.mlp import parameter_count  # noqa: PLC0415
    from engine_agent.star.shards import load_shards  # noqa: PLC0415
    from engine_agent.star.training import TrainConfig, train_predictor  # noqa: PLC0415

    result: dict[str, Any] = {"note": PLANTED_NOTE, "load_average": os.getloadavg(), "cpus": os.cpu_count()}
    if args.data is None:
        shards = Path(args.work_dir)
        shards.mkdir(parents=True, exist_ok=True)
        for old in shards.glob("*.npz"):
            old.unlink()
        result["collect"] = collect_shards(args, shards)
    else:
        shards = Path(args.data)
    data = load_shards([shards])
    result["data"] = {"rows": len(data), "requests": data.num_requests, "model": data.model,
                      "hidden_size": data.hidden_size, "dir": str(shards)}
    widths = tuple(int(w) for w in args.widths.split(","))
    config = TrainConfig(widths=widths, lr=args.lr, batch_size=args.batch_size, max_epochs=args.epochs,
                         patience=args.patience, seed=args.seed)
    started = time.perf_counter()
    predictor = train_predictor(data, config, search_trials=args.search_trials,
                                log=lambda line: print(f"train: {line}", file=sys.stderr))
    result["train"] = {**predictor.meta.figures, "train_time_s": time.perf_counter() - started,
                       "threads": "numpy default"}
    result["eval"] = evaluate(predictor, data)
    result["cost"] = {
        "parameters": {
            "d3584_m2048_512_64_eq2_no_bias": parameter_count(3584, PAPER_WIDTHS, biases=False),
            "d3584_m2048_512_64_with_biases": parameter_count(3584, PAPER_WIDTHS),
            "d4096_m2048_512_64_with_biases": parameter_count(4096, PAPER_WIDTHS),
            "paper": "8.4 M (Table 1)",
        },
        "latency_one_core": measure_latency(*args.latency_repeats),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    mae = result["eval"]["mae"]
    lat = result["cost"]["latency_one_core"]
    print(f"{result['data']['rows']} rows of {result['data']['requests']} requests; test MAE (tokens): "
          + ", ".join(f"{k} {v:.1f}" for k, v in mae.items()))
    for d in ("4096", "3584"):
        print(f"d={d}: batch 256 {lat[d]['batch_256_ms']['median']:.1f} ms "
              f"({lat[d]['per_request_in_batch_256_ms']:.3f} ms/request), batch 1 "
              f"{lat[d]['batch_1_ms']['median']:.2f} ms on one core")
    print(f"({PLANTED_NOTE}); wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
