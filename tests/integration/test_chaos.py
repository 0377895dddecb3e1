"""Chaos, short: the gateway's streaming contract while agents are killed, one stalls and clients misbehave.

Runs the chaos harness (`python -m benchmarks.chaos`, docs/chaos.md) in a subprocess with a compressed
schedule: three sim agents behind a gateway, seeded requests at a fixed rate well under this machine's
capacity, an undisturbed pass (the reference text of every request) and then the same requests while an agent
is SIGKILLed and restarted every 8-12 s, the last agent is SIGSTOPped for 8 s, 5 % of clients close
mid-stream and 5 % read slowly. The gateway's engine-stall timeout is 2 s, under the clients' 6 s inactivity
timeout, so a stream on the stopped agent must end with an error event (or be retried before its first
event), never hang.

Asserted: every stream of the faulted pass either completed with exactly the undisturbed text or ended with
exactly one OpenAI error event after a prefix of it (no different text, no duplicate, no silent truncation,
no hang, no malformed stream); the faults happened and reached streams; afterwards every agent reports zero
running and waiting requests and all KV blocks free, and the gateway has nothing in flight. Latencies (kill
to error event, ITL against the baseline) are figures for the benchmark, not asserted here.
About 80 s; deselect with `-m "not chaos"`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

REPO = Path(__file__).resolve().parents[2]
RATE_RPS = 20
DURATION_S = 30


def test_streams_complete_identically_or_end_with_one_error_event(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.chaos",
        "--agents",
        "3",
        "--seed",
        "7",
        "--rate",
        str(RATE_RPS),
        "--duration-s",
        str(DURATION_S),
        "--min-requests",
        "0",
        "--max-tokens",
        "48",
        "128",
        "--slow-fraction",
        "0.05",
        "--disconnect-fraction",
        "0.05",
        "--kill-every-s",
        "8",
        "12",
        "--down-s",
        "1",
        "--stall-at-s",
        "12",
        "--stall-s",
        "8",
        "--client-timeout-s",
        "6",
        "--gateway-env",
        "SWITCHYARD_GATEWAY_ENGINE_STALL_TIMEOUT_S=2",
        "--sample-s",
        "2",
        "--output",
        str(out),
        "--log-dir",
        str(tmp_path / "logs"),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"harness failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    print(proc.stdout)
    report = json.loads(out.read_text())

    baseline = report["passes"]["baseline"]
    assert baseline["categories"] == {"completed_identical": baseline["requests"]}, baseline

    chaos = report["passes"]["chaos"]
    assert chaos["requests"] == baseline["requests"]
    assert report["bug_count"] == 0, json.dumps(report["bugs"][:20], indent=1)

    # The faults happened and reached streams (otherwise the run proved nothing).
    assert report["kills"]["count"] >= 2, report["faults"]
    assert report["kills"]["error_latency_s"]["n"] >= 1, report["kills"]
    assert report["stall"] is not None and sum(report["stall"]["affected_by_outcome"].values()) >= 1
    assert chaos["categories"].get("client_disconnected", 0) >= 1
    assert chaos["categories"].get("completed_identical", 0) >= baseline["requests"] // 2

    after = report["after"]
    assert after["all_idle"], after["agents"]
    assert after["gateway_in_flight"] == 0
