"""The chaos run's figures: verdict counts, kill and stall latencies, ITL against the baseline, soak trends.

Owns: turning records, verdicts, the fault log and samples into the JSON-ready report and its one-screen
summary: counts per category and the BUG list (request ids and details); per kill, the streams it ended (error
events naming the killed agent's address) and SIGKILL -> error-event latencies; the stall's streams by
outcome; client-side ITL p50/p99 of streams the faults did not touch, against the same requests in the
undisturbed pass (ratio); RSS and fd trends after a warm-up. All figures, no assertions: `targets` says met or
not.
Must not: do I/O beyond returning dicts and strings, or run anything.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from benchmarks.chaos.classify import BUG_CATEGORIES, Verdict
from benchmarks.chaos.client import StreamRecord
from benchmarks.chaos.faults import FaultEvent

KILL_ERROR_TARGET_S = 1.0
ITL_RATIO_TARGET = 1.10
RSS_GROWTH_TARGET = 0.05
MIN_REQUESTS_TARGET = 5000
BUG_LIST_LIMIT = 200
ERROR_LIST_LIMIT = 300


def pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def dist(values: Sequence[float]) -> dict[str, Any]:
    return {
        "n": len(values),
        "p50": pct(values, 50),
        "p99": pct(values, 99),
        "max": max(values) if values else None,
    }


def itl_samples(records: Iterable[StreamRecord]) -> list[float]:
    out: list[float] = []
    for rec in records:
        times = rec.piece_times_s
        out.extend(b - a for a, b in zip(times, times[1:], strict=False))
    return out


def ttft_samples(records: Iterable[StreamRecord]) -> list[float]:
    return [rec.piece_times_s[0] - rec.start_s for rec in records if rec.piece_times_s]


def verdict_counts(verdicts: Sequence[Verdict]) -> dict[str, int]:
    return dict(sorted(Counter(v.category for v in verdicts).items()))


def bug_list(records: Sequence[StreamRecord], verdicts: Sequence[Verdict], t0: float) -> list[dict[str, Any]]:
    return [
        {
            "request_id": r.request_id,
            "category": v.category,
            "detail": v.detail,
            "behaviour": r.behaviour,
            "chars": len(r.text),
            "start_s": round(r.start_s - t0, 3),
            "end_s": round(r.end_s - t0, 3),
        }
        for r, v in zip(records, verdicts, strict=True)
        if v.is_bug
    ][:BUG_LIST_LIMIT]


def _error_message(error: Any) -> str:
    return str(error.get("message", "")) if isinstance(error, dict) else str(error)


def kill_figures(records: Sequence[StreamRecord], events: Sequence[FaultEvent], t0: float) -> dict[str, Any]:
    """Per kill: streams ended by an error event naming the killed agent's address between the kill and
    the restart (plus 2 s), and the SIGKILL -> error-event latency of each (slow readers left out)."""
    kills = [e for e in events if e.kind == "kill"]
    restarts = [e for e in events if e.kind == "restarted"]
    per_kill: list[dict[str, Any]] = []
    all_latencies: list[float] = []
    for kill in kills:
        restarted = next((r.t_s for r in restarts if r.agent == kill.agent and r.t_s > kill.t_s), None)
        window_end = (restarted if restarted is not None else kill.t_s + 30.0) + 2.0
        hit = [
            (rec, t)
            for rec in records
            for t, err in rec.errors
            if kill.t_s <= t <= window_end and kill.address in _error_message(err)
        ]
        # A slow reader sees the error only after the chunks queued before it: its latency is its own.
        latencies = [t - kill.t_s for rec, t in hit if rec.behaviour != "slow"]
        in_flight = sum(1 for rec in records if rec.start_s < kill.t_s < rec.end_s)
        all_latencies.extend(latencies)
        per_kill.append(
            {
                "at_s": round(kill.t_s - t0, 3),
                "agent": kill.agent,
                "in_flight_fleetwide": in_flight,
                "error_events": len(hit),
                "slow_readers": len(hit) - len(latencies),
                "restart_s": None if restarted is None else round(restarted - kill.t_s, 3),
                "error_latency_s": dist(latencies),
            }
        )
    return {
        "count": len(kills),
        "per_kill": per_kill,
        "error_latency_s": dist(all_latencies),
        "over_target": sum(1 for x in all_latencies if x > KILL_ERROR_TARGET_S),
    }


def stall_figures(
    records: Sequence[StreamRecord],
    verdicts: Sequence[Verdict],
    events: Sequence[FaultEvent],
    t0: float,
    addresses: Sequence[str],
) -> dict[str, Any] | None:
    """Streams with a gap of 1 s or more inside the stall window, or ending in an error event during it that
    names the stalled agent or no agent at all (a stall error need not name its engine): their outcomes, and
    the SIGSTOP -> error-event latency of those that got one."""
    stall = next((e for e in events if e.kind == "stall"), None)
    if stall is None:
        return None
    resume = next((e for e in events if e.kind == "resume" and e.t_s >= stall.t_s), None)
    end = resume.t_s if resume is not None else stall.t_s
    others = [a for a in addresses if a != stall.address]

    def from_stall(t: float, err: Any) -> bool:
        message = _error_message(err)
        return stall.t_s <= t <= end + 1.0 and (
            stall.address in message or not any(a in message for a in others)
        )

    outcomes: Counter[str] = Counter()
    latencies: list[float] = []
    for rec, verdict in zip(records, verdicts, strict=True):
        named = [t for t, err in rec.errors if from_stall(t, err)]
        times = [rec.start_s, *rec.piece_times_s, rec.end_s]
        gap = any(b - a >= 1.0 and a < end and b > stall.t_s for a, b in zip(times, times[1:], strict=False))
        if named or (gap and rec.start_s < end):
            outcomes[verdict.category] += 1
            if rec.behaviour != "slow":
                latencies.extend(t - stall.t_s for t in named)
    return {
        "at_s": round(stall.t_s - t0, 3),
        "agent": stall.agent,
        "stall_s": round(end - stall.t_s, 3),
        "affected_by_outcome": dict(sorted(outcomes.items())),
        "error_latency_s": dist(latencies),
    }


def record_rows(
    records: Sequence[StreamRecord], verdicts: Sequence[Verdict], t0: float
) -> list[dict[str, Any]]:
    """One row per stream (for `--dump-records`): times from the pass start, outcome, sizes."""
    return [
        {
            "request_id": r.request_id,
            "behaviour": r.behaviour,
            "start_s": round(r.start_s - t0, 4),
            "end_s": round(r.end_s - t0, 4),
            "status": r.status,
            "category": v.category,
            "detail": v.detail,
            "chars": len(r.text),
            "pieces": len(r.piece_times_s),
            "finish": r.finish_reason,
            "done": r.done,
            "errors": [(round(t - t0, 4), _error_message(e)[:120]) for t, e in r.errors],
            "first_piece_s": round(r.piece_times_s[0] - t0, 4) if r.piece_times_s else None,
            "last_piece_s": round(r.piece_times_s[-1] - t0, 4) if r.piece_times_s else None,
            "transport_error": r.transport_error,
        }
        for r, v in zip(records, verdicts, strict=True)
    ]


def error_list(
    records: Sequence[StreamRecord], verdicts: Sequence[Verdict], t0: float
) -> list[dict[str, Any]]:
    """Every error a client saw (error events and HTTP errors), for diagnosis."""
    out: list[dict[str, Any]] = []
    for rec, verdict in zip(records, verdicts, strict=True):
        for t, err in rec.errors:
            out.append(
                {
                    "request_id": rec.request_id,
                    "kind": "event",
                    "at_s": round(t - t0, 3),
                    "code": err.get("code") if isinstance(err, dict) else None,
                    "message": _error_message(err)[:200],
                    "verdict": verdict.category,
                }
            )
        if rec.status is not None and rec.status != 200:
            err = rec.http_error.get("error") if isinstance(rec.http_error, dict) else rec.http_error
            out.append(
                {
                    "request_id": rec.request_id,
                    "kind": f"http {rec.status}",
                    "at_s": round(rec.end_s - t0, 3),
                    "code": err.get("code") if isinstance(err, dict) else None,
                    "message": _error_message(err)[:200],
                    "verdict": verdict.category,
                }
            )
    return out[:ERROR_LIST_LIMIT]


def itl_figures(
    baseline: Sequence[StreamRecord],
    chaos: Sequence[StreamRecord],
    chaos_verdicts: Sequence[Verdict],
    base_verdicts: Sequence[Verdict],
    events: Sequence[FaultEvent],
) -> dict[str, Any]:
    """Client-side ITL of streams the faults did not touch: completed identically in both passes, read
    normally, not alive during the stall; the same requests' undisturbed ITL is the baseline. `during_kills`
    narrows to streams alive between a kill and its restart + 2 s (the streams on the other agents)."""
    stalls = [
        (e.t_s, next((r.t_s for r in events if r.kind == "resume" and r.t_s >= e.t_s), e.t_s + 1e9))
        for e in events
        if e.kind == "stall"
    ]
    kills = [
        (
            e.t_s,
            next(
                (r.t_s for r in events if r.kind == "restarted" and r.agent == e.agent and r.t_s > e.t_s),
                e.t_s + 30.0,
            )
            + 2.0,
        )
        for e in events
        if e.kind == "kill"
    ]

    def overlaps(rec: StreamRecord, windows: list[tuple[float, float]]) -> bool:
        return any(rec.start_s < b and rec.end_s > a for a, b in windows)

    chosen = [
        i
        for i, (rec, v) in enumerate(zip(chaos, chaos_verdicts, strict=True))
        if v.category == "completed_identical"
        and rec.behaviour == "normal"
        and base_verdicts[i].category == "completed_identical"
        and not overlaps(rec, stalls)
    ]
    during = [i for i in chosen if overlaps(chaos[i], kills)]

    def compare(indices: list[int]) -> dict[str, Any]:
        b = itl_samples(baseline[i] for i in indices)
        c = itl_samples(chaos[i] for i in indices)
        bp, cp = pct(b, 99), pct(c, 99)
        return {
            "streams": len(indices),
            "baseline_ms": {"p50": _ms(pct(b, 50)), "p99": _ms(bp)},
            "chaos_ms": {"p50": _ms(pct(c, 50)), "p99": _ms(cp)},
            "p99_ratio": None if not bp or cp is None else round(cp / bp, 3),
        }

    return {"unaffected": compare(chosen), "during_kills": compare(during)}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def soak_figures(samples: Sequence[tuple[float, int, int]], warmup_s: float) -> dict[str, Any]:
    """RSS growth from just after the warm-up to the end (medians of 3 samples at each end), fds range."""
    after = [s for s in samples if s[0] >= warmup_s]
    if len(after) < 2:
        return {"samples": len(samples), "after_warmup": len(after), "note": "too short for a trend"}
    head, tail = after[:3], after[-3:]
    rss0 = float(np.median([s[1] for s in head]))
    rss1 = float(np.median([s[1] for s in tail]))
    fd0 = float(np.median([s[2] for s in head]))
    fd1 = float(np.median([s[2] for s in tail]))
    fds = [s[2] for s in after]
    return {
        "samples": len(samples),
        "after_warmup": len(after),
        "warmup_s": warmup_s,
        "rss_mib_after_warmup": round(rss0 / 2**20, 2),
        "rss_mib_end": round(rss1 / 2**20, 2),
        "rss_growth_ratio": round(rss1 / rss0 - 1.0, 4),
        "rss_mib_max": round(max(s[1] for s in after) / 2**20, 2),
        "fds_after_warmup": fd0,
        "fds_end": fd1,
        "fds_min": min(fds),
        "fds_max": max(fds),
        "fds_flat": fd1 - fd0 <= max(5.0, 0.05 * fd0),
    }


def targets(
    total: int,
    bugs: int,
    kills: dict[str, Any] | None,
    itl: dict[str, Any] | None,
    idle: bool,
    soak: dict[str, Any] | None,
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "requests_at_least_5000": total >= MIN_REQUESTS_TARGET,
        "zero_bugs": bugs == 0,
        "agents_idle_after": idle,
    }
    if kills is not None and kills["count"]:
        worst = kills["error_latency_s"]["max"]
        out["kill_error_within_1s"] = worst is not None and worst <= KILL_ERROR_TARGET_S
    if itl is not None:
        ratio = itl["unaffected"]["p99_ratio"]
        out["itl_p99_ratio_at_most_1.10"] = ratio is not None and ratio <= ITL_RATIO_TARGET
    if soak is not None and "rss_growth_ratio" in soak:
        out["soak_rss_growth_below_5pct"] = soak["rss_growth_ratio"] < RSS_GROWTH_TARGET
        out["soak_fds_flat"] = soak["fds_flat"]
    return out


def summary(report: dict[str, Any]) -> str:
    lines = [
        f"chaos: {report['mode']}, {report['config']['agents']} agents, {report['rate_rps']:.1f} req/s "
        f"(capacity {report.get('capacity_rps') or 'not measured'})"
    ]
    for name in ("baseline", "reference", "chaos", "soak"):
        p = report.get("passes", {}).get(name)
        if p:
            lines.append(f"  {name}: {p['requests']} requests in {p['wall_s']:.0f} s: {p['categories']}")
    bugs = report.get("bugs", [])
    lines.append(
        f"  BUG streams: {report.get('bug_count', 0)} "
        f"({', '.join(c for c in BUG_CATEGORIES if report.get('bug_categories', {}).get(c))})"
    )
    for bug in bugs[:10]:
        lines.append(f"    {bug['request_id']}: {bug['category']} ({bug['detail']})")
    kills = report.get("kills")
    if kills and kills["count"]:
        lat = kills["error_latency_s"]
        lines.append(
            f"  kills: {kills['count']}, error events {sum(k['error_events'] for k in kills['per_kill'])}, "
            f"SIGKILL->error (normal readers) p50 {_fmt(lat['p50'])} p99 {_fmt(lat['p99'])} "
            f"max {_fmt(lat['max'])} s"
        )
    if report.get("stall"):
        s = report["stall"]
        lines.append(
            f"  stall {s['stall_s']} s: affected {s['affected_by_outcome']}, "
            f"SIGSTOP->error max {_fmt(s['error_latency_s']['max'])} s"
        )
    if report.get("itl"):
        u, k = report["itl"]["unaffected"], report["itl"]["during_kills"]
        lines.append(
            f"  ITL p99 unaffected: {u['baseline_ms']['p99']} -> {u['chaos_ms']['p99']} ms "
            f"(x{u['p99_ratio']}); during kills x{k['p99_ratio']} over {k['streams']} streams"
        )
    lines.append(
        f"  agents idle after: {report['after']['all_idle']}; gateway in flight "
        f"{report['after'].get('gateway_in_flight')}"
    )
    if report.get("soak"):
        s = report["soak"]
        lines.append(
            f"  soak: RSS growth {s.get('rss_growth_ratio')}, fds {s.get('fds_min')}..{s.get('fds_max')}"
        )
    for name, errors in (report.get("log_errors") or {}).items():
        lines.append(f"  {name}: {len(errors)} ERROR/Traceback line(s), first: {errors[0][:140]}")
    lines.append(f"  targets: {report['targets']}")
    return "\n".join(lines)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"
