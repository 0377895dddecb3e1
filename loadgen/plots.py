"""PNG plots of loadgen results: latency CDFs, throughput and in-flight over time, and latency-vs-load curves.

Owns: the figures (matplotlib on the Agg backend, selected here, never a display) and their file names
(``<stem>_latency_cdf.png``, ``<stem>_timeline.png`` and ``<stem>_compare.png`` next to the results JSON).
Must not: compute summaries, run anything, or be imported by the CLI unless plots are wanted (matplotlib is
slow to import): ``loadgen.cli`` imports this module lazily.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot: render to files only, whatever the environment says

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from loadgen.metrics import MS_PER_S, Outcome  # noqa: E402

DPI = 110
COMPARE_PANELS = (
    ("median_ttft_ms", "TTFT p50 (ms)"), ("p99_ttft_ms", "TTFT p99 (ms)"),
    ("median_tpot_ms", "TPOT p50 (ms)"), ("p90_e2el_ms", "E2E p90 (ms)"),
)


def plot_paths(results_path: Path) -> dict[str, Path]:
    """The PNG files written next to ``results_path`` (same folder, same stem)."""
    stem = results_path.with_suffix("")
    kinds = ("latency_cdf", "timeline", "compare")
    return {kind: stem.with_name(f"{stem.name}_{kind}.png") for kind in kinds}


def _cdf(ax: Any, values_ms: Sequence[float], title: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of requests")
    ax.grid(True, alpha=0.3)
    if not values_ms:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        return
    xs = np.sort(np.asarray(values_ms, dtype=np.float64))
    ys = np.arange(1, xs.size + 1) / xs.size
    ax.step(xs, ys, where="post")
    for q in (0.5, 0.9, 0.99):
        ax.axhline(q, color="grey", lw=0.5, ls=":")


def latency_cdf_figure(outcomes: Sequence[Outcome], path: Path, title: str = "") -> Path:
    """Three CDF panels (TTFT, TPOT, E2E, in ms) of the successful requests."""
    done = [o for o in outcomes if o.success]
    ttft = [o.ttft_s * MS_PER_S for o in done if o.ttft_s is not None]
    tpot = [t * MS_PER_S for t in (o.tpot_s for o in done) if t is not None]
    e2e = [o.e2e_s * MS_PER_S for o in done if o.e2e_s is not None]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, values, name in zip(axes, (ttft, tpot, e2e), ("TTFT", "TPOT", "E2E latency"), strict=True):
        _cdf(ax, values, name)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def timeline_figure(timeline: Sequence[Mapping[str, float]], path: Path, title: str = "") -> Path:
    """Output throughput (tokens/s) and in-flight requests (plus running/waiting when known) over time."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    t = [row["t_s"] for row in timeline]
    top.plot(t, [row.get("throughput_tokens_per_s", 0.0) for row in timeline], color="tab:blue")
    top.set_ylabel("output tokens/s")
    top.grid(True, alpha=0.3)
    bottom.plot(t, [row.get("in_flight", 0.0) for row in timeline], label="in flight", color="tab:orange")
    for key, colour in (("running", "tab:green"), ("waiting", "tab:red")):
        if timeline and key in timeline[0]:
            bottom.plot(t, [row.get(key, 0.0) for row in timeline], label=key, color=colour, lw=0.8)
    bottom.set_ylabel("requests")
    bottom.set_xlabel("time (s)")
    bottom.grid(True, alpha=0.3)
    bottom.legend(loc="upper right")
    if not timeline:
        top.text(0.5, 0.5, "no timeline samples", ha="center", va="center", transform=top.transAxes)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def write_run_plots(results_path: Path, outcomes: Sequence[Outcome],
                    timeline: Sequence[Mapping[str, float]], title: str = "") -> list[Path]:
    """The latency CDF and timeline PNGs for one run, next to its results JSON."""
    paths = plot_paths(results_path)
    return [latency_cdf_figure(outcomes, paths["latency_cdf"], title),
            timeline_figure(timeline, paths["timeline"], title)]


def compare_figure(runs: Sequence[Mapping[str, Any]], path: Path, title: str = "") -> Path:
    """Latency against offered load, one line per label: each run is {label, rate, summary}; runs without a
    finite rate are placed by their achieved request throughput."""
    fig, axes = plt.subplots(1, len(COMPARE_PANELS), figsize=(5 * len(COMPARE_PANELS), 4.2))
    labels = list(dict.fromkeys(str(run["label"]) for run in runs))
    for ax, (key, name) in zip(axes, COMPARE_PANELS, strict=True):
        for label in labels:
            points = sorted((_load(run), float(run["summary"][key])) for run in runs if run["label"] == label)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
        ax.set_title(name)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(True, alpha=0.3)
    axes[0].legend(loc="upper left", fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _load(run: Mapping[str, Any]) -> float:
    rate = run.get("rate")
    if isinstance(rate, int | float) and np.isfinite(rate):
        return float(rate)
    return float(run["summary"]["request_throughput"])
