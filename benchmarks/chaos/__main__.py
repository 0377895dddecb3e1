"""Command line of the chaos and soak harness: arguments to `run.Options`, the run, JSON out, a summary.

    .venv/bin/python -m benchmarks.chaos [--agents 3] [--rate RPS | --load-fraction 0.7] [--duration-s 120]
        [--min-requests 5000] [--kill-every-s 20 40] [--stall-s 20] [--client-timeout-s 10]
        [--soak-minutes 30 [--soak-kills]] [--gateway-arg=--request-timeout-s=30] [--output PATH]

Must not: hold logic of its own beyond argument plumbing (see `benchmarks.chaos.run`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

from benchmarks.chaos import report
from benchmarks.chaos.run import Options, run


def parse(argv: list[str] | None = None) -> tuple[Options, Path, Path | None, bool]:
    d = Options()
    p = argparse.ArgumentParser(prog="python -m benchmarks.chaos", description=__doc__.split("\n")[0])
    p.add_argument("--agents", type=int, default=d.agents)
    p.add_argument("--profile", default=d.profile)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--rate", type=float, default=None, help="requests/s (default: load fraction x capacity)")
    p.add_argument("--load-fraction", type=float, default=d.load_fraction)
    p.add_argument("--capacity-concurrency", type=int, default=d.capacity_concurrency)
    p.add_argument("--capacity-s", type=float, default=d.capacity_s)
    p.add_argument("--duration-s", type=float, default=d.duration_s, help="each pass (at least)")
    p.add_argument(
        "--min-requests",
        type=int,
        default=d.min_requests,
        help="lengthen the passes to send at least this many requests",
    )
    p.add_argument("--max-tokens", type=int, nargs=2, default=d.max_tokens, metavar=("MIN", "MAX"))
    p.add_argument("--slow-fraction", type=float, default=d.slow_fraction)
    p.add_argument("--disconnect-fraction", type=float, default=d.disconnect_fraction)
    p.add_argument(
        "--slow-read-s", type=float, default=d.slow_read_s, help="slow readers' pause per SSE line"
    )
    p.add_argument("--no-kills", action="store_true")
    p.add_argument("--kill-every-s", type=float, nargs=2, default=d.kill_every_s, metavar=("MIN", "MAX"))
    p.add_argument("--down-s", type=float, default=d.down_s, help="a killed agent stays down this long")
    p.add_argument("--stall-at-s", type=float, default=None, help="default: 40%% into the chaos pass")
    p.add_argument("--stall-s", type=float, default=d.stall_s, help="SIGSTOP length (0: no stall)")
    p.add_argument(
        "--client-timeout-s",
        type=float,
        default=d.client_timeout_s,
        help="no byte for this long: the stream is a hang",
    )
    p.add_argument(
        "--gateway-arg",
        action="append",
        default=[],
        help="extra gateway flag (repeatable), e.g. --gateway-arg=--request-timeout-s=30",
    )
    p.add_argument(
        "--gateway-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="environment for the gateway (repeatable), e.g. SWITCHYARD_GATEWAY_ENGINE_STALL_TIMEOUT_S=2",
    )
    p.add_argument(
        "--soak-minutes", type=float, default=0.0, help="soak mode: this long, no faults by default"
    )
    p.add_argument("--soak-warmup-s", type=float, default=d.soak_warmup_s)
    p.add_argument("--soak-kills", action="store_true", help="soak with the kill schedule")
    p.add_argument(
        "--reference-s",
        type=float,
        default=d.reference_s,
        help="soak: length of the undisturbed pass whose requests the soak cycles",
    )
    p.add_argument(
        "--tracemalloc",
        type=int,
        default=0,
        metavar="FRAMES",
        help="soak: run the gateway under tracemalloc; the growth from the warm-up to the end goes to "
        "<output>.tracemalloc.txt (RSS figures are then not the real ones)",
    )
    p.add_argument("--sample-s", type=float, default=d.sample_s, help="gateway RSS/fd sampling period")
    p.add_argument("--log-dir", type=Path, default=None, help="agent and gateway logs (default: a temp dir)")
    p.add_argument(
        "--output",
        type=Path,
        default=None,
        help="JSON (default results/chaos.json, results/chaos_soak.json for a soak)",
    )
    p.add_argument(
        "--dump-records",
        type=Path,
        default=None,
        help="also write one JSON line per stream of the faulted pass here",
    )
    p.add_argument("--quiet", action="store_true", help="no summary on stdout")
    a = p.parse_args(argv)
    log_dir = a.log_dir or Path(tempfile.mkdtemp(prefix="chaos-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    default = "results/chaos_soak.json" if a.soak_minutes > 0 else "results/chaos.json"
    output = (a.output or Path(default)).resolve()
    opts = Options(
        agents=a.agents,
        profile=a.profile,
        seed=a.seed,
        rate_rps=a.rate,
        load_fraction=a.load_fraction,
        capacity_concurrency=a.capacity_concurrency,
        capacity_s=a.capacity_s,
        duration_s=a.duration_s,
        min_requests=a.min_requests,
        max_tokens=tuple(a.max_tokens),
        slow_fraction=a.slow_fraction,
        disconnect_fraction=a.disconnect_fraction,
        slow_read_s=a.slow_read_s,
        kills=not a.no_kills,
        kill_every_s=tuple(a.kill_every_s),
        down_s=a.down_s,
        stall_at_s=a.stall_at_s,
        stall_s=a.stall_s,
        client_timeout_s=a.client_timeout_s,
        gateway_args=tuple(a.gateway_arg),
        gateway_env=tuple(a.gateway_env),
        soak_minutes=a.soak_minutes,
        soak_warmup_s=a.soak_warmup_s,
        soak_kills=a.soak_kills,
        reference_s=a.reference_s,
        sample_s=a.sample_s,
        log_dir=log_dir,
        tracemalloc_frames=a.tracemalloc,
        trace_report=output.with_suffix(".tracemalloc.txt"),
    )
    return opts, output, a.dump_records, a.quiet


def main(argv: list[str] | None = None) -> int:
    opts, output, dump, quiet = parse(argv)
    try:
        import uvloop  # the harness is a __main__: uvloop here only (STYLE.md)
    except ImportError:
        result = asyncio.run(run(opts))
    else:
        result = uvloop.run(run(opts))
    rows = result.pop("records", [])
    if dump is not None:
        dump.parent.mkdir(parents=True, exist_ok=True)
        dump.write_text("".join(json.dumps(row) + "\n" for row in rows))
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2))
    if not quiet:
        print(report.summary(result))
        print(f"  written: {output}; logs: {opts.log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
