"""Loaders for token-count-only traces: Azure LLM inference 2023 CSVs and Sarathi/Vidur length statistics.

Owns: parsing those CSVs into ``Request`` records (exact prompt token counts, forced output lengths, and for
Azure the arrival time relative to the first row, computed in integer 100 ns ticks so no precision is lost).
Must not: synthesise prompt text or ids (``synth`` does), shuffle, window or truncate (the registry does).
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import numpy as np

from loadgen.datasets.request import Request
from loadgen.datasets.text import DatasetFormatError

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
LENGTH_COLUMNS = ("num_prefill_tokens", "num_decode_tokens")
TICKS_PER_S = 10_000_000  # Azure timestamps carry 7 fractional digits (100 ns)


def _rows(path: Path, required: tuple[str, ...]) -> Iterator[tuple[int, dict[str, str]]]:
    """(data row, record) per row; a short row's missing cells are None (csv.DictReader's restval)."""
    row = -1
    with path.open("r", encoding="utf-8", newline="") as f:
        try:
            reader = csv.DictReader(f)
            missing = [c for c in required if c not in (reader.fieldnames or ())]
            if missing:
                found = reader.fieldnames
                raise DatasetFormatError(f"{path}: missing CSV column(s) {missing}; found {found}")
            for row, record in enumerate(reader):
                yield row, record
        except (UnicodeDecodeError, csv.Error) as exc:  # not UTF-8, a field over the csv module's limit, ...
            raise DatasetFormatError(f"{path}: data row {row + 1}: unreadable CSV: {exc}") from exc


def _int(path: Path, row: int, record: dict[str, str], column: str) -> int:
    try:
        value = int(float(record[column]))
    except (TypeError, ValueError, OverflowError) as exc:  # OverflowError: "inf", "1e400"
        raise DatasetFormatError(f"{path}: data row {row}: {column}={record[column]!r} is not a number") \
            from exc
    if value < 0:
        raise DatasetFormatError(f"{path}: data row {row}: {column}={value} is negative")
    return value


def parse_azure_timestamp_ticks(text: str) -> int:
    """``YYYY-MM-DD HH:MM:SS[.fffffff]`` (no zone) as integer 100 ns ticks since 0001-01-01."""
    text = text.strip()
    whole, _, fraction = text.partition(".")
    if len(fraction) > 7 or (fraction and not (fraction.isascii() and fraction.isdigit())):
        raise ValueError(f"bad fractional seconds in timestamp {text!r}")
    moment = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S")
    day_s = moment.hour * 3600 + moment.minute * 60 + moment.second
    seconds = (moment - datetime(1, 1, 1)).days * 86_400 + day_s
    return seconds * TICKS_PER_S + int(fraction.ljust(7, "0") or "0")


def load_azure_csv(path: Path, *, name: str) -> list[Request]:
    """Azure LLM inference trace: one request per row, ``arrival_s`` relative to the first row."""
    out: list[Request] = []
    first_ticks: int | None = None
    for row, record in _rows(path, AZURE_COLUMNS):
        if record["TIMESTAMP"] is None:
            raise DatasetFormatError(f"{path}: data row {row}: no TIMESTAMP")
        try:
            ticks = parse_azure_timestamp_ticks(record["TIMESTAMP"])
        except ValueError as exc:
            raise DatasetFormatError(f"{path}: data row {row}: {exc}") from exc
        if first_ticks is None:
            first_ticks = ticks
        out.append(Request(
            request_id=f"{name}-{row}",
            prompt_tokens=_int(path, row, record, "ContextTokens"),
            output_tokens=_int(path, row, record, "GeneratedTokens"),
            arrival_s=(ticks - first_ticks) / TICKS_PER_S,
            metadata={"row": row, "timestamp": record["TIMESTAMP"]},
        ))
    return out


def load_length_csv(path: Path, *, name: str) -> list[Request]:
    """Length statistics (``num_prefill_tokens``, ``num_decode_tokens``): one untimed request per row."""
    return [
        Request(
            request_id=f"{name}-{row}",
            prompt_tokens=_int(path, row, record, "num_prefill_tokens"),
            output_tokens=_int(path, row, record, "num_decode_tokens"),
            metadata={"row": row},
        )
        for row, record in _rows(path, LENGTH_COLUMNS)
    ]


def read_decode_lengths(path: Path) -> np.ndarray:
    """The ``num_decode_tokens`` column of a length-statistics CSV, as int64."""
    return np.asarray([_int(path, row, rec, "num_decode_tokens") for row, rec in _rows(path, LENGTH_COLUMNS)],
                      dtype=np.int64)
