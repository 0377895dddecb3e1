"""The gateway's prefix index (issue 18): routing-decision cost and memory per indexed block.

Builds a `gateway.cluster.prefix_index.PrefixIndex` the way agents' KV events fill it: `--engines` engines,
`--blocks` indexed blocks in all, as chains of `--chain` index blocks (a prompt's 256-token blocks), each
chain held by 1 to 4 engines (shared system prompts are held widely, conversations narrowly). Then times
`match` for requests whose keys follow an indexed chain for a random depth and then leave it (a new turn),
over all engines (the eligible set of one model), and reports the memory the index holds per indexed block
(tracemalloc: the dict, its keys and masks). Targets: <= 20 us per decision at 64 engines and 1 M blocks,
<= 64 bytes per block. Output: results/prefix_index_cost.json.

    .venv/bin/python benchmarks/prefix_index_cost.py [--engines 64] [--blocks 1000000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from json_out import write_json  # noqa: E402

from gateway.cluster.prefix_index import PrefixIndex  # noqa: E402
from gateway.domain import EngineId  # noqa: E402
from switchyard.prefix import KEY_MASK  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--chain", type=int, default=48)
    parser.add_argument("--decisions", type=int, default=20_000)
    parser.add_argument("--output", type=Path, default=REPO / "results" / "prefix_index_cost.json")
    args = parser.parse_args()
    rng = random.Random(0)
    engines = [EngineId(f"e{i}") for i in range(args.engines)]
    chains: list[list[int]] = []
    tracemalloc.start()
    index = PrefixIndex(max_keys=args.blocks)
    while len(index) < args.blocks:
        chain = [rng.getrandbits(64) & KEY_MASK for _ in range(args.chain)]
        chains.append(chain)
        for engine in rng.sample(engines, rng.randint(1, 4)):
            index.apply(engine, chain, ())
    memory = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    requests = []
    for _ in range(args.decisions):
        chain = rng.choice(chains)
        depth = rng.randint(0, len(chain))
        requests.append(chain[:depth] + [rng.getrandbits(64) for _ in range(rng.randint(1, 8))])
    times = []
    for keys in requests:
        started = time.perf_counter_ns()
        index.match(keys, engines)
        times.append(time.perf_counter_ns() - started)
    times.sort()
    doc = {
        "engines": args.engines, "indexed_blocks": len(index), "chain_blocks": args.chain,
        "bytes_per_block": memory / len(index),
        "match_us": {"median": statistics.median(times) / 1e3, "p99": times[int(0.99 * len(times))] / 1e3,
                     "mean": statistics.fmean(times) / 1e3},
        "mean_request_keys": statistics.fmean(len(k) for k in requests),
        "targets": {"match_us_median": 20.0, "bytes_per_block": 64.0},
    }
    print(f"{len(index):,} blocks on {args.engines} engines: match median {doc['match_us']['median']:.1f} us "
          f"(p99 {doc['match_us']['p99']:.1f}), {doc['bytes_per_block']:.0f} bytes per block")
    write_json(args.output, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
