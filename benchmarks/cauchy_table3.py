"""CAUCHY §4.5 / Table 3 in the simulator: the instance scheduler inside disaggregated 1PxD combos (issue 14).

Combos 1xh800+Xxh20 (X = 1, 2, 3; H800 prefill, H20 decode, llama3-8b) on the simulated GPU, ShareGPT
requests. Every request starts on the prefill engine, which hands it off after its first token
(`--role prefill`); the KV pull is modelled (`--kv-link-gbps`, default 100 Gb/s, plus 2 ms). Arms:
  - basic-rr: goodput_rr intra=rr: prefill then decode, hand-offs round robin over the decode engines (the
    combo's pick count; policy round_robin would not do: its counter also counts the arrivals, and with
    arrivals and hand-offs alternating every hand-off of a 1P2D combo lands on the same decode engine);
  - opportunistic: goodput_rr intra=opportunistic: hand-offs to the least-loaded decode engine, and in-place
    execution on idle engines (an idle decode engine serves a request whole; an idle prefill engine keeps a
    request when every decode engine is busy; `gateway.dispatch.life`).
Per combo and arm: the max goodput (the highest Poisson rate with SLO attainment >= `--attainment`, by
`launcher.planning_cli.rate_search`, `--trial-s` seconds per trial), the max CE (prompt + output tokens of the
successful requests per dollar in the run at that rate, thousands), and at one common rate (basic-rr's max
goodput, so both arms see the same load) the mean E2E, TTFT and TBT (time between tokens: mean inter-token
gap). Ratios are opportunistic against basic-rr, in the same invocation. Written as JSON.

    .venv/bin/python benchmarks/cauchy_table3.py [--dataset sharegpt] [--slo ttft=1000,tpot=50] \
        [--trial-s 300] [--output results/cauchy_table3.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
from typing import Any

from json_out import write_json

from launcher.planning_cli import rate_search
from loadgen.arrivals import ArrivalSpec, schedule
from loadgen.datasets.registry import load_dataset
from loadgen.metrics import Slo, summarize
from loadgen.paths import resolve_data_dir
from loadgen.simulate import EngineSpec, SimOptions, SimResult, simulate

ARMS: dict[str, tuple[str, dict[str, Any]]] = {
    "basic-rr": ("goodput_rr", {"intra": "rr"}),
    "opportunistic": ("goodput_rr", {"intra": "opportunistic"}),
}


def fleet(decode: int) -> list[EngineSpec]:
    combo = f"1xh800+{decode}xh20#0"
    return [EngineSpec("h800-llama3-8b", 1, combo=combo, role="prefill"),
            EngineSpec("h20-llama3-8b", decode, combo=combo, role="decode")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="sharegpt")
    parser.add_argument("--data-dir")
    parser.add_argument("--num-requests", type=int, default=500)
    parser.add_argument("--slo", default="ttft=1000,tpot=50")
    parser.add_argument("--attainment", type=float, default=0.9)
    parser.add_argument("--trial-s", type=float, default=300.0)
    parser.add_argument("--precision", type=float, default=0.03)
    parser.add_argument("--kv-link-gbps", type=float, default=100.0)
    parser.add_argument("--decode", default="1,2,3", help="decode engines per combo, one run each")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--output", default="results/cauchy_table3.json")
    args = parser.parse_args()
    slo_ms = dict(item.split("=") for item in args.slo.split(","))
    slo = Slo(ttft_ms=float(slo_ms["ttft"]), tpot_ms=float(slo_ms["tpot"]))
    requests = load_dataset(args.dataset, resolve_data_dir(args.data_dir), num_requests=args.num_requests,
                            seed=args.seed)

    def run(decode: int, arm: str, rate: float) -> SimResult:
        policy, params = ARMS[arm]
        n = max(50, math.ceil(rate * args.trial_s))
        drawn = [dataclasses.replace(requests[i % len(requests)], request_id=f"t{i}") for i in range(n)]
        options = SimOptions(policy=policy, policy_params=params, seed=args.seed,
                             kv_link_gbps=args.kv_link_gbps, slo_ttft_s=slo.ttft_ms / 1e3,
                             slo_tpot_s=slo.tpot_ms / 1e3)
        return simulate(schedule(drawn, ArrivalSpec(rate_per_s=rate, seed=args.seed)), fleet(decode), options)

    def attained(result: SimResult) -> float:
        return summarize(result.outcomes, max(result.duration_s, 1e-9), slo).slo_attainment or 0.0

    rows: dict[str, dict[str, dict[str, Any]]] = {}
    for decode in (int(x) for x in args.decode.split(",")):
        label = f"1P{decode}D"
        rows[label] = {}
        for arm in ARMS:
            goodput = rate_search(lambda rate, d=decode, a=arm: attained(run(d, a, rate)) >= args.attainment,
                                  args.precision, 200.0)
            at_max = run(decode, arm, goodput) if goodput > 0 else None
            ce = (at_max.tokens_per_usd or 0.0) / 1e3 if at_max is not None else None
            rows[label][arm] = {"max_goodput_rps": goodput, "max_ce_ktokens_per_usd": ce}
        common = rows[label]["basic-rr"]["max_goodput_rps"]
        for arm in ARMS:
            result = run(decode, arm, common)
            ok = [o for o in result.outcomes if o.success]
            gaps = [gap for o in ok for gap in o.itl_s]
            rows[label][arm].update(
                rate_rps=common, completed=len(ok), slo_attainment=attained(result),
                mean_e2e_s=statistics.fmean(o.e2e_s for o in ok),
                mean_ttft_ms=1e3 * statistics.fmean(o.ttft_s for o in ok if o.ttft_s is not None),
                mean_tbt_ms=1e3 * statistics.fmean(gaps) if gaps else None,
                handoffs=(result.handoffs or {}).get("handoffs", 0),
                engine_requests={e: v["requests"] for e, v in result.per_engine.items()})
        base, opp = rows[label]["basic-rr"], rows[label]["opportunistic"]
        opp["vs_basic_rr"] = {key: (opp[key] / base[key] - 1.0) if base[key] else None
                              for key in ("max_ce_ktokens_per_usd", "max_goodput_rps", "mean_e2e_s",
                                          "mean_ttft_ms", "mean_tbt_ms")}
        for arm in ARMS:
            row = rows[label][arm]
            ce = row["max_ce_ktokens_per_usd"]
            print(f"{label} {arm:<14} max CE {'-' if ce is None else f'{ce:8.1f}'} K tok/$  "
                  f"max goodput {row['max_goodput_rps']:6.2f} req/s  at {common:.2f} req/s: "
                  f"E2E {row['mean_e2e_s']:6.2f} s  TTFT {row['mean_ttft_ms']:7.1f} ms  "
                  f"TBT {row['mean_tbt_ms']:6.2f} ms  hand-offs {row['handoffs']}", flush=True)
    out = {"benchmark": "cauchy_table3", "dataset": args.dataset, "num_requests": len(requests),
           "slo_ms": {"ttft": slo.ttft_ms, "tpot": slo.tpot_ms}, "attainment": args.attainment,
           "trial_s": args.trial_s, "precision": args.precision, "kv_link_gbps": args.kv_link_gbps,
           "seed": args.seed, "stand_in": "simulated GPU (h800 prefill, h20 decode); modelled KV pull",
           "combos": rows}
    write_json(args.output, out)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
