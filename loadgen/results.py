"""The loadgen results file: one JSON document with the summary, the run configuration and every outcome.

Owns: the document layout (``schema``, ``summary``, ``config``, ``outcomes``), conversion of numpy scalars and
arrays, dataclasses, pydantic models, tuples and paths to plain JSON (non-finite floats become the strings
"inf", "-inf", "nan", as vLLM writes ``request_rate``), an atomic write, and reading it back.
Must not: compute metrics (``loadgen.metrics``) or decide what goes into ``config``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from pydantic import BaseModel

from loadgen.metrics import Outcome, Summary

RESULTS_SCHEMA = "switchyard.loadgen.results/1"
_OUTCOME_FIELDS = frozenset(f.name for f in dataclasses.fields(Outcome))


@dataclass(frozen=True, slots=True)
class Results:
    """A results file read back: the flat summary dict, the config dict and the outcomes."""

    summary: dict[str, Any]
    config: dict[str, Any]
    outcomes: tuple[Outcome, ...]


def to_jsonable(value: Any) -> Any:
    """Plain JSON data for ``value``; raises TypeError for anything it does not know how to convert."""
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, int | np.integer):
        return int(value)
    if isinstance(value, float | np.floating):
        number = float(value)
        if math.isfinite(number):
            return number
        return "nan" if math.isnan(number) else ("inf" if number > 0 else "-inf")
    if isinstance(value, np.ndarray):
        return [to_jsonable(v) for v in value.tolist()]
    if isinstance(value, Summary):
        return to_jsonable(value.to_dict())
    if isinstance(value, BaseModel):
        return to_jsonable(value.model_dump(mode="python"))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        items = sorted(value, key=repr) if isinstance(value, set | frozenset) else value
        return [to_jsonable(v) for v in items]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"cannot write {type(value).__name__} to a results file: {value!r}")


def results_document(
    summary: Summary | Mapping[str, Any], config: Mapping[str, Any] | BaseModel, outcomes: Sequence[Outcome]
) -> dict[str, Any]:
    """The JSON-ready document (what ``write_results`` writes)."""
    return {
        "schema": RESULTS_SCHEMA,
        "summary": to_jsonable(summary),
        "config": to_jsonable(config),
        "outcomes": [to_jsonable(o) for o in outcomes],
    }


def write_results(
    path: str | os.PathLike[str],
    summary: Summary | Mapping[str, Any],
    config: Mapping[str, Any] | BaseModel,
    outcomes: Sequence[Outcome],
) -> Path:
    """Write the results JSON atomically (temp file + rename), creating parent folders; returns the path."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    data = orjson.dumps(results_document(summary, config, outcomes), option=orjson.OPT_INDENT_2)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_bytes(data + b"\n")
    os.replace(tmp, target)
    return target


def read_results(path: str | os.PathLike[str]) -> Results:
    """Read a results file written by ``write_results``; raises ValueError on a wrong schema or outcome."""
    doc = orjson.loads(Path(path).read_bytes())
    if not isinstance(doc, dict) or doc.get("schema") != RESULTS_SCHEMA:
        found = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(f"{path}: not a loadgen results file (schema {found!r}, want {RESULTS_SCHEMA!r})")
    outcomes = []
    for index, raw in enumerate(doc.get("outcomes", [])):
        unknown = set(raw) - _OUTCOME_FIELDS
        if unknown:
            raise ValueError(f"{path}: outcome {index} has unknown field(s) {sorted(unknown)}")
        outcomes.append(Outcome(**{**raw, "itl_s": tuple(raw.get("itl_s", ()))}))
    return Results(summary=dict(doc.get("summary", {})), config=dict(doc.get("config", {})),
                   outcomes=tuple(outcomes))
