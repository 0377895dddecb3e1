"""The cost of CascadeInfer's online QoE fit in an engine agent (`engine_agent.qoe_tracker`, issue 16 item 1).

Measured in the same run, at batches of 256 and 1,024 sequences (prompts of 20-400 tokens, decoding):
- `BatchLoads.add_batch` (one iteration's F added to every member, vectorised) against the baseline of one
  `switchyard.qoe.LifetimeLoad.add` per request (F computed once): microseconds per iteration and the ratio;
- the sim agent's iteration: `SimEngine.step` alone (the baseline) and with `record_batches` plus the
  tracker's `on_iteration`, as `engine_agent.backends.sim.SimBackend` runs it: microseconds per step and the
  added share;
- vLLM's engine side (`engine_side._AgentSchedulerMixin._agent_record_loads`, run after every `schedule()`)
  on stand-in request objects, when vLLM is installed (importing it takes seconds);
- a refit (`QoETracker.report` with a full window of 2,000 samples), which `stats` runs at most every 50
  finished requests.
Results are printed and written as JSON (default results/qoe_tracker_cost.json). Timings are the best of 5
repeats (this machine's noise is large: 2 cores shared with everything else).

    .venv/bin/python benchmarks/qoe_tracker_cost.py [--output PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import sys
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.json_out import write_json  # noqa: E402
from engine_agent.domain import BackendRequest, RequestId, SamplingSpec  # noqa: E402
from engine_agent.qoe_tracker import BatchLoads, QoETracker  # noqa: E402
from engine_agent.sim.engine import SimEngine  # noqa: E402
from switchyard.profiles import get_profile  # noqa: E402
from switchyard.qoe import LifetimeLoad, features  # noqa: E402

BATCHES = (256, 1024)
PROFILE = "h100-llama3-8b"  # max_num_seqs 1024


def best_us(fn: Callable[[], object], number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def batch_columns(n: int) -> tuple[list[str], list[int], list[int]]:
    rng = random.Random(n)
    ids = [f"req-{i:08d}" for i in range(n)]
    prompts = [rng.randint(20, 400) for _ in range(n)]
    return ids, prompts, [p + rng.randint(1, 500) for p in prompts]


def tracker_cost(n: int) -> dict[str, float]:
    ids, prompts, lengths = batch_columns(n)
    loads = BatchLoads()
    loads.add_batch(ids, prompts, lengths)
    vectorised = best_us(lambda: loads.add_batch(ids, prompts, lengths), 200)
    per_request = {rid: LifetimeLoad() for rid in ids}

    def baseline() -> None:
        f = features(prompts, lengths)
        for rid in ids:
            per_request[rid].add(f)

    naive = best_us(baseline, 100)
    return {"add_batch_us": vectorised, "lifetime_load_per_request_us": naive, "ratio": vectorised / naive}


def sim_iteration_cost(n: int) -> dict[str, float]:
    """µs per `step` of an engine holding n decoding sequences, without and with the tracker."""
    out: dict[str, float] = {}
    for label, tracked in (("step_us", False), ("step_with_tracker_us", True)):
        best = float("inf")
        for _ in range(5):
            engine = SimEngine(get_profile(PROFILE), seed=0, record_batches=tracked)
            rng = random.Random(0)
            for i in range(n):
                sampling = SamplingSpec(max_tokens=2000, ignore_eos=True)
                engine.add_request(BackendRequest(RequestId(f"r{i}"), (5,) * rng.randint(20, 200), sampling),
                                   0.0)
            tracker = QoETracker()
            now_s = 0.0
            for _ in range(20):  # past the prefills
                now_s += engine.step(now_s).duration_s
            steps = 100
            start = time.perf_counter()
            for _ in range(steps):
                result = engine.step(now_s)
                now_s += result.duration_s
                batch = result.batch
                if batch is not None:
                    tracker.on_iteration(batch.request_ids, batch.prompt_tokens, batch.current_tokens)
            best = min(best, (time.perf_counter() - start) / steps * 1e6)
            assert engine.stats(now_s).num_running == n
        out[label] = best
    out["added_us"] = out["step_with_tracker_us"] - out["step_us"]
    out["added_share"] = out["added_us"] / out["step_us"]
    return out


def engine_side_cost(n: int) -> dict[str, float] | None:
    if importlib.util.find_spec("vllm") is None:
        return None
    from engine_agent.backends.vllm.engine_side import _AgentSchedulerMixin  # noqa: PLC0415

    ids, prompts, lengths = batch_columns(n)
    requests = {rid: SimpleNamespace(num_prompt_tokens=p, num_computed_tokens=c)
                for rid, p, c in zip(ids, prompts, lengths, strict=True)}
    scheduler = SimpleNamespace(requests=requests, agent_loads=None, agent_finished_loads=None)
    output = SimpleNamespace(num_scheduled_tokens=dict.fromkeys(ids, 1), finished_req_ids=set())
    record = _AgentSchedulerMixin._agent_record_loads
    record(scheduler, output)
    return {"record_loads_per_schedule_us": best_us(lambda: record(scheduler, output), 200)}


def refit_cost() -> dict[str, float]:
    rng = random.Random(1)
    tracker = QoETracker(refit_every=1)
    for i in range(2000):
        prompts = [rng.randint(20, 4000) for _ in range(rng.randint(1, 64))]
        tracker.on_iteration([f"r{i}", *(f"o{j}" for j in range(len(prompts) - 1))], prompts, prompts)
        for j in range(len(prompts) - 1):
            tracker.on_drop(f"o{j}")
        tracker.on_finish(f"r{i}", rng.uniform(0.05, 5.0), rng.randint(1, 200))
    tracker.report()  # scipy imported

    def refit() -> None:
        tracker.on_iteration(["x"], [10], [10])
        tracker.on_finish("x", 1.0, 10)
        tracker.report()

    return {"refit_window_2000_us": best_us(refit, 50)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--output", default=str(REPO / "results" / "qoe_tracker_cost.json"))
    args = parser.parse_args(argv)
    document: dict[str, Any] = {"profile": PROFILE, "batches": {}}
    for n in BATCHES:
        row = {"tracker": tracker_cost(n), "sim_agent_iteration": sim_iteration_cost(n),
               "vllm_engine_side": engine_side_cost(n)}
        document["batches"][str(n)] = row
        sim = row["sim_agent_iteration"]
        side = row["vllm_engine_side"]
        print(f"batch {n:5d}: add_batch {row['tracker']['add_batch_us']:6.1f} us "
              f"(LifetimeLoad per request {row['tracker']['lifetime_load_per_request_us']:6.1f} us); "
              f"sim step {sim['step_us']:6.0f} us, +{sim['added_us']:5.0f} us with the tracker "
              f"({sim['added_share']:.0%}); vLLM engine side "
              + (f"{side['record_loads_per_schedule_us']:6.1f} us/schedule" if side else "skipped (no vLLM)"))
    document["refit"] = refit_cost()
    print(f"refit on a window of 2000: {document['refit']['refit_window_2000_us']:.0f} us")
    write_json(args.output, document)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
