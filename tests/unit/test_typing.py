"""`mypy --strict` over the pure decision cores, so CI enforces what `make lint` checks.

The paths are the Makefile's `MYPY_STRICT_PATHS` (read from it, so the two cannot drift apart); mypy's
configuration is pyproject.toml's `[tool.mypy]`.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def strict_paths() -> list[str]:
    makefile = (REPO / "Makefile").read_text()
    match = re.search(r"^MYPY_STRICT_PATHS := ((?:.*\\\n)*.*)$", makefile, flags=re.MULTILINE)
    assert match is not None, "Makefile has no MYPY_STRICT_PATHS"
    return match.group(1).replace("\\\n", " ").split()


def test_the_strict_paths_exist() -> None:
    paths = strict_paths()
    assert "gateway/dispatch/life.py" in paths and "gateway/policies" in paths
    assert all((REPO / p).exists() for p in paths), paths


def test_pure_cores_pass_mypy_strict() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-error-summary", *strict_paths()],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
