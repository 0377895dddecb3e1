"""What the benchmarks share for their output: the results JSON (`write_json`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: str | Path, document: dict[str, Any]) -> None:
    """Write `document` as indented JSON to `path`, creating its folder."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(document, indent=2))
