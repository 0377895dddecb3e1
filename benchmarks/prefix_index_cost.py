"""The gateway's prefix index (issue 18): routing-decision cost and memory per indexed block.

Builds a `gateway.cluster.prefix_index.PrefixIndex` the way agents' KV events fill it: `--engines` engines,
`--blocks` indexed blocks in all, as chains of `--chain` indexed keys (a long prompt's: past the first
1,024 tokens only one index block in several has a key, `switchyard.prefix.INDEX_TIERS`), keys drawn from
`switchyard.prefix.KEY_MASK`, each chain held by 1 to 4 engines (shared system prompts are held widely,
conversations narrowly). Then times `match` for requests whose keys follow an indexed chain for a random
depth and then leave it (a new turn), over all engines (the eligible set of one model), and reports the
memory the index holds per indexed block (tracemalloc, which sees numpy's arrays: checked first, and the
chains are drawn before tracing starts, so only the index is counted), against the baseline of a plain dict
of int masks holding the same blocks (the index's storage before, with its own key and mask ints). Also
the cost of `apply` per key, stored and removed. Targets: <= 20 us per decision at 64 engines and 1 M
blocks, <= 64 bytes per block. Output: results/prefix_index_cost.json.

    .venv/bin/python benchmarks/prefix_index_cost.py [--engines 64] [--blocks 1000000] [--chain 16]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from json_out import write_json  # noqa: E402

from gateway.cluster.prefix_index import PrefixIndex  # noqa: E402
from gateway.domain import EngineId  # noqa: E402
from switchyard.prefix import KEY_MASK  # noqa: E402


def traced_bytes(build: Callable[[], object]) -> int:
    """Bytes still held, as tracemalloc counts them, once `build()` has returned (what it built is kept)."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = build()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    del kept
    return int(held)


def tracemalloc_sees_numpy() -> bool:
    """numpy reports its data buffers to tracemalloc (numpy >= 1.13): a 1 MiB array must show."""
    return traced_bytes(lambda: np.zeros(1 << 20, np.uint8)) >= 1 << 20


def percentiles(times_ns: list[int]) -> dict[str, float]:
    times_ns = sorted(times_ns)
    return {"median": statistics.median(times_ns) / 1e3, "p99": times_ns[int(0.99 * len(times_ns))] / 1e3,
            "mean": statistics.fmean(times_ns) / 1e3}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--chain", type=int, default=16)
    parser.add_argument("--decisions", type=int, default=20_000)
    parser.add_argument("--output", type=Path, default=REPO / "results" / "prefix_index_cost.json")
    args = parser.parse_args()
    if not tracemalloc_sees_numpy():
        raise SystemExit("tracemalloc does not see numpy's allocations: the bytes per block would be wrong")
    rng = random.Random(0)
    engines = [EngineId(f"e{i}") for i in range(args.engines)]
    # Drawn before tracing: distinct keys, so the index ends with exactly --blocks blocks.
    keys = list(dict.fromkeys(rng.getrandbits(64) & KEY_MASK for _ in range(args.blocks + args.blocks // 64)))
    keys = keys[:args.blocks]
    chains = [keys[i:i + args.chain] for i in range(0, len(keys), args.chain)]
    holders = [rng.sample(engines, rng.randint(1, 4)) for _ in chains]

    index = PrefixIndex(max_keys=args.blocks)

    def build_index() -> PrefixIndex:
        for chain, held_by in zip(chains, holders, strict=True):
            for engine in held_by:
                index.apply(engine, chain, ())
        return index

    started = time.perf_counter()
    index_bytes = traced_bytes(build_index)
    build_s = time.perf_counter() - started
    slot_of = {engine: i for i, engine in enumerate(engines)}

    def build_baseline() -> dict[int, int]:
        owners: dict[int, int] = {}  # filled as the previous index was: a fresh mask int per update
        for chain, held_by in zip(chains, holders, strict=True):
            fresh = [int.from_bytes(key.to_bytes(8, "little"), "little") for key in chain]  # decoded keys
            for engine in held_by:
                bit = 1 << slot_of[engine]
                for key in fresh:
                    owners[key] = owners.get(key, 0) | bit
        return owners

    baseline_bytes = traced_bytes(build_baseline)

    requests = []
    for _ in range(args.decisions):
        chain = rng.choice(chains)
        depth = rng.randint(0, len(chain))
        requests.append(chain[:depth] + [rng.getrandbits(64) & KEY_MASK for _ in range(rng.randint(1, 8))])
    times = []
    for request in requests:
        started_ns = time.perf_counter_ns()
        index.match(request, engines)
        times.append(time.perf_counter_ns() - started_ns)
    deep = []  # a whole chain held: the walk goes to its end
    for n in range(min(args.decisions, len(chains))):
        chain = chains[n]
        started_ns = time.perf_counter_ns()
        index.match(chain, engines)
        deep.append(time.perf_counter_ns() - started_ns)

    churn = chains[:2000]  # each chain's first holder evicts it and stores it again
    started_ns = time.perf_counter_ns()
    for chain, held_by in zip(churn, holders[:len(churn)], strict=True):
        index.apply(held_by[0], (), chain)
    removed_ns = time.perf_counter_ns() - started_ns
    started_ns = time.perf_counter_ns()
    for chain, held_by in zip(churn, holders[:len(churn)], strict=True):
        index.apply(held_by[0], chain, ())
    stored_ns = time.perf_counter_ns() - started_ns
    churned = sum(len(chain) for chain in churn)

    blocks = len(index)
    doc = {
        "engines": args.engines, "indexed_blocks": blocks, "chain_keys": args.chain,
        "key_bits": KEY_MASK.bit_length(),
        "bytes_per_block": index_bytes / blocks,
        "baseline_dict_bytes_per_block": baseline_bytes / blocks,
        "bytes_ratio_to_baseline": index_bytes / baseline_bytes,
        "match_us": percentiles(times),
        "match_whole_chain_us": percentiles(deep),
        "mean_request_keys": statistics.fmean(len(k) for k in requests),
        "apply_us_per_key": {"removed": removed_ns / churned / 1e3, "stored": stored_ns / churned / 1e3},
        "build_s_traced": build_s,
        "tracemalloc_sees_numpy": True,
        "targets": {"match_us_median": 20.0, "bytes_per_block": 64.0},
    }
    print(f"{blocks:,} blocks on {args.engines} engines: match median {doc['match_us']['median']:.1f} us "
          f"(p99 {doc['match_us']['p99']:.1f}; whole chain {doc['match_whole_chain_us']['median']:.1f}), "
          f"{doc['bytes_per_block']:.1f} bytes per block (a dict: "
          f"{doc['baseline_dict_bytes_per_block']:.1f}, "
          f"x{doc['bytes_ratio_to_baseline']:.2f}); apply {doc['apply_us_per_key']['stored']:.2f} us per key "
          f"stored, {doc['apply_us_per_key']['removed']:.2f} removed")
    write_json(args.output, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
