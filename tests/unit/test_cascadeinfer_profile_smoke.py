"""benchmarks/cascadeinfer_profile.py, shortened (5 virtual s per configuration, the committed length
fixtures): the JSON holds the fitted D and both predictors' errors, every figure finite, and the QoE model
beats the static mean on the validation run."""

from __future__ import annotations

import json
import math
from pathlib import Path

from benchmarks import cascadeinfer_profile as bench

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "data"


def test_short_profile_run_fits_a_model_that_beats_the_static_mean(tmp_path: Path) -> None:
    out = tmp_path / "cascadeinfer_profile.json"
    argv = ["--duration-s", "5", "--data-dir", str(FIXTURES), "--output", str(out)]
    assert bench.main(argv) == 0
    text = out.read_text()
    assert "NaN" not in text and "Infinity" not in text
    doc = json.loads(text)
    assert {"profile", "buckets", "batch_sizes", "fit", "samples", "errors", "validation", "histogram",
            "configs", "paper", "wall_s"} <= set(doc)
    assert doc["profile"] == "h100-llama3-8b"

    assert doc["buckets"][0] == [100, 200] and all(hi == 2 * lo for lo, hi in doc["buckets"])
    for sizes in doc["batch_sizes"].values():
        assert sizes[0] == 1 and all(b == 2 * a for a, b in zip(sizes, sizes[1:], strict=False))

    fitted = doc["fit"]["qoe"]
    assert list(fitted["d"]) == ["one", "n", "sum_input", "sum_input_sq", "sum_len"]
    assert all(v >= 0 for v in fitted["d"].values()) and fitted["d"]["one"] > 0
    assert fitted["num_samples"] == doc["samples"]["fit"] >= 5
    assert doc["samples"]["validation"] == sum(c["validation_samples"] for c in doc["configs"]) > 0

    validation = doc["validation"]
    assert 0 < validation["qoe_mean_relative_error"] < validation["static_mean_relative_error"]
    assert validation["qoe_mean_relative_error"] == doc["errors"]["validation"]["qoe"]["mean"]
    for name in ("qoe", "qoe_unweighted", "static"):
        assert math.isclose(math.fsum(doc["histogram"][name]), 1.0)
