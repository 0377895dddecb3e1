"""LENS's accuracy and cost (issue 6, item 7), on iterations of the simulated GPU.

Measured in one run:
- accuracy: a `SimEngine` (default: h100-llama3-8b) serves a Poisson workload whose rate changes every segment
  (ShareGPT-like prompts and outputs); its `IterationRecord`s are the samples (B = prefill + decode sequences,
  S = prefill + decode tokens, T = duration_s). R^2 on held-out iterations (a second run, other seed and rate
  order) of (a) the online model at the end of the training run, (b) one structural fit on the whole training
  run; and the online model's one-step-ahead R^2 (each iteration predicted before it is observed, after a
  warm-up) over the training run;
- cold start: a `LensController` starting from nothing, fed iteration by iteration with inline refits on its
  policy; held-out R^2 after every refit (of the online model and of its structural anchor); the observations
  and simulated seconds until R^2 first exceeds 0.9 (and 0.95), and until it settles (from there on at least
  90% of the refits are above 0.9); min / median after 30 simulated seconds (the paper's convergence time);
- cost: microseconds per `predict` (scalar, and per element of a 1,000-element array), per `plan_batch` on
  several queues (256 running + 1,000 waiting with Q_max 256 and with the profile's Q_max; and without the
  early exit, every candidate searched), per
  `state_vector`, and milliseconds per refit (structural over 2,000 samples, short-window linear, cold
  saturated). Baselines from the same run: one `predict_scalar` call, and the median simulated iteration.
The engine runs its own default schedule: the controller only observes (`plan` is not applied here).
Results are printed and written as JSON (default results/lens_cost.json).

    .venv/bin/python benchmarks/lens_cost.py [--profile h100-llama3-8b] [--segment-s 30] [--output PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from engine_agent.domain import BackendRequest, RequestId, SamplingSpec
from engine_agent.lens.controller import LensConfig, LensController
from engine_agent.lens.perf_model import (
    LatencyModel,
    LatencyModelConfig,
    Samples,
    fit_saturated,
    fit_structural,
    predict_array,
    predict_scalar,
    prior_params,
    r2_score,
    run_fit,
)
from engine_agent.lens.planner import PlanLimits, QueueView, plan_batch
from engine_agent.sim.engine import IterationRecord, SimEngine
from switchyard.profiles import get_profile

REPO = Path(__file__).resolve().parents[1]
TRAIN_RATES = (20.0, 5.0, 40.0, 10.0, 60.0, 30.0)  # requests per second, one per segment
HELD_OUT_RATES = (10.0, 50.0, 25.0, 5.0, 40.0, 15.0)


def drive(profile_name: str, rates: tuple[float, ...], segment_s: float,
          seed: int) -> list[tuple[IterationRecord, float]]:
    """(record, end time) of every non-empty iteration of a SimEngine under piecewise-Poisson arrivals."""
    rng = random.Random(seed)
    arrivals: list[tuple[float, BackendRequest]] = []
    for k, rate in enumerate(rates):
        t, end = k * segment_s, (k + 1) * segment_s
        while True:
            t += rng.expovariate(rate)
            if t >= end:
                break
            prompt = max(4, min(4096, round(rng.lognormvariate(5.5, 1.0))))
            sampling = SamplingSpec(max_tokens=min(2048, 8192 - prompt))
            arrivals.append((t, BackendRequest(RequestId(f"r{len(arrivals)}"), (100,) * prompt, sampling)))
    engine = SimEngine(get_profile(profile_name), seed=seed)
    out: list[tuple[IterationRecord, float]] = []
    now_s, index = 0.0, 0
    while index < len(arrivals) or engine.has_work():
        while index < len(arrivals) and arrivals[index][0] <= now_s:
            engine.add_request(arrivals[index][1], arrivals[index][0])
            index += 1
        if not engine.has_work():
            now_s = arrivals[index][0]
            continue
        result = engine.step(now_s)
        now_s += result.duration_s
        if result.duration_s > 0:
            out.append((result.record, now_s))
    return out


def as_samples(records: list[tuple[IterationRecord, float]]) -> Samples:
    b = np.array([r.num_prefill_seqs + r.num_decode_seqs for r, _ in records], dtype=np.float64)
    s = np.array([r.num_prefill_tokens + r.num_decode_tokens for r, _ in records], dtype=np.float64)
    t = np.array([r.duration_s for r, _ in records])
    at = np.array([end for _, end in records])
    return Samples(b, s, t, at)


def per_call_us(fn: Callable[[], object], min_time_s: float = 0.2, repeats: int = 5) -> float:
    """Median over `repeats` of the mean wall time of one call (auto-sized loops), in microseconds."""
    n = 1
    while True:
        start = time.perf_counter()
        for _ in range(n):
            fn()
        if time.perf_counter() - start >= min_time_s / repeats:
            break
        n *= 2
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - start) / n)
    return statistics.median(runs) * 1e6


def accuracy(profile_name: str, segment_s: float) -> tuple[dict[str, Any], LensController]:
    profile = get_profile(profile_name)
    train = drive(profile_name, TRAIN_RATES, segment_s, seed=1)
    held = as_samples(drive(profile_name, HELD_OUT_RATES, segment_s, seed=2))
    limits = PlanLimits(profile.max_num_seqs, profile.max_batched_tokens, profile.block_size)
    ctl = LensController(limits, LensConfig())
    curve: list[dict[str, Any]] = []
    first: dict[str, dict[str, float] | None] = {"0.9": None, "0.95": None}
    warmup = 500
    ahead_pred: list[float] = []
    ahead_obs: list[float] = []
    for i, (record, end_s) in enumerate(train):
        b = record.num_prefill_seqs + record.num_decode_seqs
        s = record.num_prefill_tokens + record.num_decode_tokens
        if i >= warmup:
            ahead_pred.append(ctl.model.predict(b, s))
            ahead_obs.append(record.duration_s)
        ctl.on_iteration(record, end_s)
        outcome = ctl.maybe_refit(end_s)
        if outcome is None:
            continue
        r2 = ctl.model.r2(held)
        anchor_r2 = r2_score(held.latency_s, predict_array(ctl.model.anchor, held.batch_size, held.tokens))
        curve.append({"observations": i + 1, "sim_s": end_s, "r2_held_out": r2,
                      "r2_held_out_structural_anchor": anchor_r2, "kind": outcome.kind})
        for key in first:
            if first[key] is None and r2 > float(key):
                first[key] = {"observations": i + 1, "sim_s": end_s}
    late = [p for p in curve if p["sim_s"] >= 30.0]
    late_r2 = np.array([p["r2_held_out"] for p in late])
    late_anchor = np.array([p["r2_held_out_structural_anchor"] for p in late])
    cfg = LatencyModelConfig()
    train_s = as_samples(train)
    offline = fit_structural(train_s.tail(len(train_s)), prior_params(cfg), cfg)
    result = {
        "profile": profile_name,
        "train_iterations": len(train),
        "train_sim_s": train[-1][1],
        "held_out_iterations": len(held),
        "held_out_latency_s": {"min": float(held.latency_s.min()), "median": float(np.median(held.latency_s)),
                               "max": float(held.latency_s.max())},
        "r2_held_out_online_model_end": ctl.model.r2(held),
        "r2_held_out_online_after_30s": {"min": float(late_r2.min()), "median": float(np.median(late_r2)),
                                         "fraction_above_0.9": float(np.mean(late_r2 > 0.9)),
                                         "evaluations": len(late)},
        "r2_held_out_structural_anchor_after_30s": {
            "min": float(late_anchor.min()), "median": float(np.median(late_anchor)),
            "fraction_above_0.9": float(np.mean(late_anchor > 0.9))},
        "r2_held_out_offline_structural_fit": r2_score(
            held.latency_s, predict_array(offline, held.batch_size, held.tokens)),
        "r2_one_step_ahead_after_warmup": r2_score(ahead_obs, ahead_pred),
        "one_step_ahead_warmup_iterations": warmup,
        "recent_error_ratio_end": ctl.model.recent_error_ratio,
        "online_params_end": {k: getattr(ctl.model.params, k) for k in ctl.model.params.__slots__},
        "offline_params": {k: getattr(offline, k) for k in offline.__slots__},
        "convergence": {
            "first_r2_above_0.9": first["0.9"],
            "first_r2_above_0.95": first["0.95"],
            "first_above_0.9_after_which_90pct_of_refits_stay_above": settled(curve, 0.9, 0.9),
            "refits": len(curve),
            "structural_fits": sum(1 for p in curve if p["kind"] == "structural"),
        },
        "convergence_curve_every_25th_refit": curve[::25],
        "_median_iteration_s": float(np.median(train_s.latency_s)),
    }
    return result, ctl


def settled(curve: list[dict[str, Any]], threshold: float, share: float) -> dict[str, float] | None:
    """The first refit from which at least `share` of the refits (it included) have R^2 above `threshold`."""
    above = np.array([p["r2_held_out"] > threshold for p in curve], dtype=np.float64)
    if not above.shape[0]:
        return None
    tail_share = np.cumsum(above[::-1])[::-1] / np.arange(above.shape[0], 0, -1)
    for i, p in enumerate(curve):
        if above[i] and tail_share[i] >= share:
            return {"observations": p["observations"], "sim_s": p["sim_s"]}
    return None


def plan_costs(ctl: LensController, profile_name: str) -> dict[str, Any]:
    profile = get_profile(profile_name)
    rng = np.random.default_rng(0)
    prompts = np.clip(np.round(rng.lognormal(5.5, 1.0, 1000)), 4, 4096).astype(np.int64)
    params = ctl.model.params
    cases: dict[str, tuple[QueueView, PlanLimits]] = {}
    small = PlanLimits(256, profile.max_batched_tokens, profile.block_size)
    full = PlanLimits(profile.max_num_seqs, profile.max_batched_tokens, profile.block_size)
    kv = profile.kv_blocks_total // 2
    decode = np.ones(256, dtype=np.int64)
    cases["run256_wait1000_qmax256"] = (QueueView(decode, prompts, kv), small)
    cases[f"run256_wait1000_qmax{full.max_num_seqs}"] = (QueueView(decode, prompts, kv), full)
    cases["run32_wait1000_qmax256"] = (QueueView(np.ones(32, dtype=np.int64), prompts, kv), small)
    cases["run0_wait1000_qmax256"] = (QueueView(np.zeros(0, dtype=np.int64), prompts, kv), small)
    cases["run256_wait0_qmax256"] = (QueueView(decode, np.zeros(0, dtype=np.int64), kv), small)
    out: dict[str, Any] = {}
    for target_s in (0.03, 0.08):
        for name, (q, limits) in cases.items():
            plan = plan_batch(q, limits, params, target_s)
            us = per_call_us(lambda q=q, limits=limits, t=target_s: plan_batch(q, limits, params, t))
            out[f"{name}_target{int(target_s * 1000)}ms"] = {
                "us_per_plan": us,
                "candidates_tried": plan.candidates_tried if plan else 0,
                "token_budget": plan.token_budget if plan else 0,
                "num_seqs": plan.num_seqs if plan else 0,
                "predicted_latency_s": plan.predicted_latency_s if plan else 0.0,
            }
    # Worst case: no early exit (eps 0), every candidate up to Q_max searched.
    for name in ("run0_wait1000_qmax256", f"run256_wait1000_qmax{full.max_num_seqs}"):
        q, limits = cases[name]
        plan = plan_batch(q, limits, params, 0.05, eps_ratio=0.0)
        out[f"{name}_target50ms_no_early_exit"] = {
            "us_per_plan": per_call_us(lambda q=q, limits=limits: plan_batch(q, limits, params, 0.05,
                                                                            eps_ratio=0.0)),
            "candidates_tried": plan.candidates_tried if plan else 0,
            "token_budget": plan.token_budget if plan else 0,
            "num_seqs": plan.num_seqs if plan else 0,
            "predicted_latency_s": plan.predicted_latency_s if plan else 0.0,
        }
    q, _ = cases["run256_wait1000_qmax256"]
    out["state_vector_us_run256_wait1000"] = per_call_us(lambda: ctl.state_vector(q, 0.0))
    return out


def model_costs(ctl: LensController) -> dict[str, Any]:
    model = ctl.model
    params = model.params
    rng = np.random.default_rng(1)
    b_arr = rng.integers(1, 256, 1000)
    s_arr = rng.integers(1, 8192, 1000)
    predict_us = per_call_us(lambda: model.predict(37, 1500))
    predict_scalar_us = per_call_us(lambda: predict_scalar(params, 37, 1500))
    array_us = per_call_us(lambda: model.predict(b_arr, s_arr))
    data = model.samples()
    cfg = model.config
    long = data.tail(cfg.long_window_samples)
    short = data.tail(cfg.short_window_samples)
    anchor = fit_structural(long, prior_params(cfg), cfg)
    now = float(data.time_s[-1])

    def ms(fn: Callable[[], object]) -> float:
        return per_call_us(fn, min_time_s=1.0, repeats=5) / 1e3

    prior = prior_params(cfg)
    return {
        "predict_scalar_us": predict_us,
        "predict_scalar_function_us": predict_scalar_us,
        "predict_array_1000_us_per_element": array_us / 1000,
        "refit_structural_cold_ms_2000_samples": ms(
            lambda: run_fit(long, short, prior, prior, False, True, len(long), now, cfg)),
        "refit_structural_warm_ms_2000_samples": ms(
            lambda: run_fit(long, short, anchor, anchor, True, True, len(long), now, cfg)),
        "refit_linear_ms_48_samples": ms(
            lambda: run_fit(long, short, anchor, anchor, True, False, len(long), now, cfg)),
        "refit_saturated_ms_2000_samples": ms(lambda: fit_saturated(long, prior, cfg)),
        "refit_job_snapshot_us": per_call_us(lambda: model.refit_job(now)),
        "observe_us": per_call_us(lambda: LatencyModel.observe(model, 37, 1500, 0.03, now)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", default="h100-llama3-8b")
    parser.add_argument("--segment-s", type=float, default=30.0)
    parser.add_argument("--output", type=Path, default=REPO / "results" / "lens_cost.json")
    args = parser.parse_args()
    acc, ctl = accuracy(args.profile, args.segment_s)
    median_iteration_s = acc.pop("_median_iteration_s")
    costs = model_costs(ctl)
    plans = plan_costs(ctl, args.profile)
    base_us = costs["predict_scalar_function_us"]
    headline = plans["run256_wait1000_qmax256_target30ms"]["us_per_plan"]
    result = {
        "accuracy": acc,
        "model_cost": costs,
        "plan_cost": plans,
        "baselines": {
            "predict_scalar_us": base_us,
            "median_sim_iteration_s": median_iteration_s,
            "plan_run256_wait1000_in_predict_calls": headline / base_us,
            "plan_run256_wait1000_fraction_of_median_iteration": headline * 1e-6 / median_iteration_s,
        },
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
