"""benchmarks/admission_expiry.py end to end on a short run: both arms on the same schedule, and only the arm
with expiry sheds queued requests at their deadline."""

from __future__ import annotations

import json

from benchmarks import admission_expiry as bench


def test_the_benchmark_compares_expiry_with_none_on_the_same_arrivals(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "expiry.json"
    assert bench.main(["--loads", "4", "--duration-s", "10", "--capacity-requests", "512",
                       "--output", str(out)]) == 0
    doc = json.loads(out.read_text())
    [point] = doc["points"]
    expiry, kept = point["expiry"], point["no_expiry"]
    assert expiry["arrivals"] == kept["arrivals"] == round(point["rate_rps"] * 10)
    assert expiry["gate"].get("shed_slo_expired", 0) > 0
    assert "shed_slo_expired" not in kept["gate"]
    assert point["met_slo_ratio"] == expiry["met_slo"] / max(1, kept["met_slo"])
    assert doc["stand_in"].startswith("simulated")
