"""The gateway under tracemalloc, for benchmarks/gateway_scale.py's `--tracemalloc`: where its memory goes.

    python -X tracemalloc=FRAMES benchmarks/traced_gateway.py REPORT [gateway flags ...]

Owns: running `gateway.__main__.main` with the given flags, and on each SIGUSR1 a snapshot of the traced
allocations: the first is the baseline (REPORT with suffix `.base` says it is taken); each later one writes
REPORT (then renames it into place, so a reader never sees half a file): the allocations grown since the
baseline, grouped by owner, by line and by traceback, largest first, with their count and size per stream when
SWITCHYARD_TRACE_STREAMS names the streams held; SWITCHYARD_TRACE_DUMP=1 also dumps each snapshot (REPORT
with suffix `.snapN`, for `tracemalloc.Snapshot.load`).
Must not: be used for the headline figures (tracing slows allocation and adds its own memory, and a snapshot
holds the event loop for seconds).
"""

from __future__ import annotations

import os
import signal
import sys
import tracemalloc
from collections import Counter
from pathlib import Path
from types import FrameType

TOP = 40
# Who owns an allocation: the most recent frame of its traceback in one of these (the first match wins);
# frames of shared helpers (aiohttp's streams and helpers, asyncio) are looked through to their caller.
_OWNERS = (
    ("/gateway/", None),
    ("aiohttp/client", "aiohttp client (the upstream side)"),
    ("aiohttp/connector", "aiohttp client (the upstream side)"),
    ("aiohttp/web", "aiohttp server (the client side)"),
    ("pydantic/", "pydantic"),
)


def _owner(traceback: tracemalloc.Traceback) -> str:
    for frame in reversed(traceback):  # most recent first
        for marker, label in _OWNERS:
            if marker in frame.filename:
                return label or "gateway/" + frame.filename.rsplit("/gateway/", 1)[1]
    return "other: " + traceback[-1].filename.rsplit("/", 2)[-1]


def _by_owner(snapshot: tracemalloc.Snapshot) -> Counter[str]:
    sizes: Counter[str] = Counter()
    for stat in snapshot.statistics("traceback"):
        sizes[_owner(stat.traceback)] += stat.size
    return sizes


def _report(base: tracemalloc.Snapshot, now: tracemalloc.Snapshot, streams: int) -> str:
    lines: list[str] = []
    total = sum(s.size_diff for s in now.compare_to(base, "filename"))
    per = f", {total / streams / 1024:.2f} KiB per stream over {streams}" if streams else ""
    lines.append(f"traced growth since the baseline: {total / 1024:.0f} KiB{per}")
    lines.append(
        "\n== by owner (the most recent frame in the gateway, aiohttp's client or server, pydantic) =="
    )
    grown = _by_owner(now)
    grown.subtract(_by_owner(base))
    for owner, size in grown.most_common():
        if abs(size) >= 1024:
            each = f"  {size / streams:8.0f} B/stream" if streams else ""
            lines.append(f"{size / 1024:10.1f} KiB{each}  {owner}")
    for key in ("lineno", "traceback"):
        lines.append(f"\n== by {key} ==")
        for stat in now.compare_to(base, key)[:TOP]:
            each = (
                f"  {stat.size_diff / streams:8.0f} B/stream {stat.count_diff / streams:6.2f} blocks/stream"
                if streams
                else ""
            )
            lines.append(f"{stat.size_diff / 1024:10.1f} KiB {stat.count_diff:8d} blocks{each}")
            frames = stat.traceback.format() if key == "traceback" else [str(stat.traceback[0])]
            lines.extend("      " + f.strip() for f in frames if f.strip())
    return "\n".join(lines) + "\n"


def main() -> int:
    report = Path(sys.argv[1])
    streams = int(os.environ.get("SWITCHYARD_TRACE_STREAMS", "0"))
    dump = os.environ.get("SWITCHYARD_TRACE_DUMP") == "1"
    if not tracemalloc.is_tracing():
        tracemalloc.start(25)
    ignore = [
        tracemalloc.Filter(False, tracemalloc.__file__),
        tracemalloc.Filter(False, "<frozen importlib._bootstrap*>"),
    ]
    snapshots: list[tracemalloc.Snapshot] = []

    def snapshot(signum: int, frame: FrameType | None) -> None:
        snapshots.append(tracemalloc.take_snapshot().filter_traces(ignore))
        if dump:
            snapshots[-1].dump(str(report.with_suffix(f".snap{len(snapshots) - 1}")))
        if len(snapshots) == 1:
            report.with_suffix(".base").write_text("baseline taken\n")
        else:
            partial = report.with_suffix(".partial")
            partial.write_text(_report(snapshots[0], snapshots[-1], streams))
            partial.rename(report)

    signal.signal(signal.SIGUSR1, snapshot)
    from gateway.__main__ import main as gateway_main  # noqa: PLC0415 (after tracing started)

    return gateway_main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
