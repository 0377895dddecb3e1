"""Loaders for datasets with prompt text: ShareGPT, MT-Bench / Spec-Bench questions, Alpaca, custom JSONL.

Owns: parsing each file format into ``Request`` records in file order, with token counts exact (tokenizer
given) or estimated (``ceil(utf8 bytes / 4)``), and forced output lengths where the format provides one.
Must not: shuffle, window or truncate (the registry does), synthesise prompts, or resolve the data directory.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from loadgen.datasets.request import Request, TokenizerLike, count_tokens, text_request

HUMAN_ROLES = frozenset({"human", "user"})


class DatasetFormatError(ValueError):
    """A dataset file does not match its expected schema; the message names the file and the record. The
    loaders raise it, and only it, for any content of a file they can read (OSError stays OSError)."""


def read_json(path: Path) -> Any:
    with path.open("rb") as f:
        try:
            return json.load(f)
        except (ValueError, RecursionError) as exc:  # invalid JSON or UTF-8, or nested too deep
            raise DatasetFormatError(f"{path}: invalid JSON: {exc}") from exc


def read_jsonl(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(1-based line number, object) for each non-blank line."""
    rows: list[tuple[int, dict[str, Any]]] = []
    line_no = 0
    with path.open("r", encoding="utf-8") as f:
        try:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except (ValueError, RecursionError) as exc:
                    raise DatasetFormatError(f"{path}:{line_no}: invalid JSON: {exc}") from exc
                if not isinstance(obj, dict):
                    raise DatasetFormatError(f"{path}:{line_no}: expected a JSON object per line")
                rows.append((line_no, obj))
        except UnicodeDecodeError as exc:
            raise DatasetFormatError(f"{path}:{line_no + 1}: not UTF-8: {exc}") from exc
    return rows


def _human(turn: dict[str, Any]) -> bool:
    role = turn.get("from")
    return isinstance(role, str) and role in HUMAN_ROLES


def load_sharegpt(
    path: Path,
    *,
    name: str,
    tokenizer: TokenizerLike | None,
    fallback_output_tokens: Sequence[int] | np.ndarray | None,
    seed: int,
) -> list[Request]:
    """ShareGPT (vLLM bench schema): the first human turn is the prompt.

    The output length is the token count of the following reply when the record has one; otherwise it is
    drawn, in file order with ``default_rng([seed, 1])``, from ``fallback_output_tokens`` (an error if None).
    Records with no human turn are skipped.
    """
    records = read_json(path)
    if not isinstance(records, list):
        raise DatasetFormatError(f"{path}: expected a JSON array of conversations")
    rng = np.random.default_rng([seed, 1])
    fallback = None if fallback_output_tokens is None else np.asarray(fallback_output_tokens, dtype=np.int64)
    out: list[Request] = []
    for row, record in enumerate(records):
        turns = record.get("conversations") if isinstance(record, dict) else None
        if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
            raise DatasetFormatError(f"{path}: record {row} has no 'conversations' list of objects")
        first = next((i for i, t in enumerate(turns) if _human(t)), None)
        if first is None:
            continue
        prompt = str(turns[first].get("value", ""))
        reply = turns[first + 1] if first + 1 < len(turns) else None
        output_tokens: int | None
        if reply is not None and not _human(reply):
            output_tokens, _ = count_tokens(str(reply.get("value", "")), tokenizer)
            length_source = "reply"
        elif fallback is not None and fallback.size > 0:
            output_tokens = int(rng.choice(fallback))
            length_source = "sampled"
        else:
            raise DatasetFormatError(
                f"{path}: record {row} has no reply turn and no output-length statistics were given to "
                f"sample its output length from"
            )
        meta = {"source_id": record.get("id"), "row": row, "output_length_source": length_source}
        out.append(text_request(f"{name}-{row}", prompt, tokenizer=tokenizer, output_tokens=output_tokens,
                                metadata=meta))
    return out


def load_questions(path: Path, *, name: str, tokenizer: TokenizerLike | None) -> list[Request]:
    """MT-Bench / Spec-Bench ``question.jsonl``: the first turn is the prompt; output length is not forced."""
    out: list[Request] = []
    for line_no, obj in read_jsonl(path):
        turns = obj.get("turns")
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise DatasetFormatError(f"{path}:{line_no}: expected a non-empty 'turns' list of strings")
        question_id = obj.get("question_id", line_no)
        meta = {"question_id": question_id, "category": obj.get("category"), "num_turns": len(turns)}
        out.append(text_request(f"{name}-{question_id}", turns[0], tokenizer=tokenizer, metadata=meta))
    return out


def alpaca_prompt(instruction: str, input_text: str) -> str:
    """``instruction`` + (``"\\n\\n"`` + ``input`` when the input is non-empty)."""
    return instruction + ("\n\n" + input_text if input_text else "")


def load_alpaca(path: Path, *, name: str, tokenizer: TokenizerLike | None) -> list[Request]:
    """Alpaca JSON array of {instruction, input, output}; the reference output's length is forced."""
    records = read_json(path)
    if not isinstance(records, list):
        raise DatasetFormatError(f"{path}: expected a JSON array of {{instruction, input, output}}")
    out: list[Request] = []
    for row, record in enumerate(records):
        if not isinstance(record, dict) or not isinstance(record.get("instruction"), str):
            raise DatasetFormatError(f"{path}: record {row} has no 'instruction' string")
        prompt = alpaca_prompt(record["instruction"], str(record.get("input") or ""))
        reference = str(record.get("output") or "")
        output_tokens = count_tokens(reference, tokenizer)[0] if reference else None
        out.append(text_request(f"{name}-{row}", prompt, tokenizer=tokenizer, output_tokens=output_tokens,
                                metadata={"row": row}))
    return out


def load_custom_jsonl(path: Path, *, name: str, tokenizer: TokenizerLike | None) -> list[Request]:
    """vLLM custom dataset JSONL: ``{"prompt": str, "output_tokens": int?}`` per line.

    The timed variant adds ``"timestamp"`` (seconds) on every line; rows are then ordered by timestamp
    (stable) and ``arrival_s`` is relative to the earliest one. Optional ``request_id`` and ``session_id`` are
    kept; other keys go to metadata.
    """
    rows = read_jsonl(path)
    timed = [("timestamp" in obj) for _, obj in rows]
    if any(timed) and not all(timed):
        raise DatasetFormatError(f"{path}: either every line or no line must carry 'timestamp'")
    parsed: list[tuple[float | None, Request]] = []
    for row, (line_no, obj) in enumerate(rows):
        prompt = obj.get("prompt")
        if not isinstance(prompt, str):
            raise DatasetFormatError(f"{path}:{line_no}: 'prompt' must be a string")
        output_tokens = obj.get("output_tokens")
        if output_tokens is not None and (
            isinstance(output_tokens, bool) or not isinstance(output_tokens, int) or output_tokens < 0
        ):
            raise DatasetFormatError(f"{path}:{line_no}: 'output_tokens' must be a non-negative integer")
        timestamp = obj.get("timestamp")
        number = isinstance(timestamp, int | float) and not isinstance(timestamp, bool)
        if timestamp is not None and not (number and math.isfinite(timestamp)):  # json reads NaN, Infinity
            raise DatasetFormatError(f"{path}:{line_no}: 'timestamp' must be a finite number of seconds")
        known = {"prompt", "output_tokens", "timestamp", "request_id", "session_id"}
        meta = {k: v for k, v in obj.items() if k not in known} | {"row": row}
        session = obj.get("session_id")
        req = text_request(str(obj.get("request_id", f"{name}-{row}")), prompt, tokenizer=tokenizer,
                           output_tokens=output_tokens, session_id=None if session is None else str(session),
                           metadata=meta)
        parsed.append((None if timestamp is None else float(timestamp), req))
    stamped = [(ts, req) for ts, req in parsed if ts is not None]
    if not stamped:
        return [req for _, req in parsed]
    stamped.sort(key=lambda item: item[0])
    t0 = stamped[0][0]
    return [dataclasses.replace(req, arrival_s=ts - t0) for ts, req in stamped]
