"""Labelled hidden-state samples on disk: the shard format, its atomic writer and the reader of a directory.

Owns: `ShardRows` (one shard's columns), `ShardWriter` (numbered `.npz` files in one directory, each written
to a temporary name and renamed, so a reader never sees half a shard), `load_shards` (every shard of the
given directories or files, checked and concatenated into one `HiddenStateData`) and `ShardError`, whose
message names the file and what is wrong with it.
Must not: know engines, the event loop or the predictor; decide when to write (that is
`engine_agent.star.recorder`).

Format (version 1), one `.npz` per shard, uncompressed (hidden states barely compress):
- `vectors` (n, hidden_size) float16 or float32: the tap's final-layer state of the request's last token;
- `request_ids` (n,) unicode; `generated_tokens`, `prompt_tokens`, `output_tokens`, `remaining_tokens` (n,)
  int32: output tokens when the state was taken, the prompt's length, the request's final output length, and
  the label y = output_tokens - generated_tokens (>= 0);
- `model` (0-d unicode), `hidden_size` and `format_version` (0-d int64).
Request ids are assumed unique across the shards read together (`switchyard predictor collect` gives every run
its own prefix); the rows of one id form one request for the split and the evaluation.
"""

from __future__ import annotations

import os
import re
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

FORMAT_VERSION = 1
SHARD_SUFFIX = ".npz"
_COLUMNS = ("request_ids", "generated_tokens", "prompt_tokens", "output_tokens", "remaining_tokens")
_INT_COLUMNS = _COLUMNS[1:]
_VECTOR_DTYPES = (np.dtype(np.float16), np.dtype(np.float32))

IntArray = npt.NDArray[np.int32]
Vectors = npt.NDArray[np.float16] | npt.NDArray[np.float32]


class ShardError(ValueError):
    """A shard or shard directory that cannot be read; the message names the path."""


@dataclass(frozen=True, slots=True)
class ShardRows:
    """Columns of labelled samples (one row per tap sample); all of length n."""

    vectors: Vectors
    request_ids: npt.NDArray[np.str_]
    generated_tokens: IntArray
    prompt_tokens: IntArray
    output_tokens: IntArray
    remaining_tokens: IntArray

    def __len__(self) -> int:
        return int(self.vectors.shape[0])

    @classmethod
    def concatenate(cls, parts: Sequence[ShardRows]) -> ShardRows:
        if not parts:
            raise ValueError("no rows to concatenate")
        return cls(
            vectors=np.concatenate([p.vectors for p in parts]),
            request_ids=np.concatenate([p.request_ids for p in parts]),
            generated_tokens=np.concatenate([p.generated_tokens for p in parts]),
            prompt_tokens=np.concatenate([p.prompt_tokens for p in parts]),
            output_tokens=np.concatenate([p.output_tokens for p in parts]),
            remaining_tokens=np.concatenate([p.remaining_tokens for p in parts]),
        )


@dataclass(frozen=True, slots=True)
class HiddenStateData:
    """Every row of the shards read, with the model they came from."""

    rows: ShardRows
    model: str
    hidden_size: int
    files: tuple[Path, ...]

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def num_requests(self) -> int:
        return int(np.unique(self.rows.request_ids).size)


def safe_name(text: str) -> str:
    """`text` reduced to characters that are safe in a file name."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("._") or "engine"


class ShardWriter:
    """Writes shards `<prefix>-<index:05d>.npz` into `directory` (created if missing).

    `next_path` is cheap and called where the shard is decided (on the event loop); `write` is blocking file
    I/O (run it in an executor). Several writers may share a directory as long as their prefixes differ.
    """

    def __init__(self, directory: Path, *, model: str, hidden_size: int, prefix: str) -> None:
        if hidden_size <= 0:
            raise ValueError(f"hidden_size must be positive, got {hidden_size}")
        self.directory = directory
        self.model = model
        self.hidden_size = hidden_size
        self._prefix = safe_name(prefix)
        self._index = 0

    def prepare(self) -> None:
        """Create the directory (blocking); raises OSError when it cannot be created or written."""
        self.directory.mkdir(parents=True, exist_ok=True)
        if not os.access(self.directory, os.W_OK):
            raise PermissionError(f"{self.directory} is not writable")

    def next_path(self) -> Path:
        path = self.directory / f"{self._prefix}-{self._index:05d}{SHARD_SUFFIX}"
        self._index += 1
        return path

    def write(self, path: Path, rows: ShardRows) -> Path:
        """Write `rows` to `path` atomically (a temporary name, then a rename)."""
        if rows.vectors.ndim != 2 or rows.vectors.shape[1] != self.hidden_size:
            raise ValueError(f"vectors of shape {rows.vectors.shape}, expected (n, {self.hidden_size})")
        tmp = path.with_name(path.name + ".tmp")
        with tmp.open("wb") as handle:
            np.savez(
                handle,
                vectors=rows.vectors,
                request_ids=rows.request_ids.astype(np.str_),
                generated_tokens=rows.generated_tokens.astype(np.int32),
                prompt_tokens=rows.prompt_tokens.astype(np.int32),
                output_tokens=rows.output_tokens.astype(np.int32),
                remaining_tokens=rows.remaining_tokens.astype(np.int32),
                model=np.asarray(self.model, dtype=np.str_),
                hidden_size=np.asarray(self.hidden_size, dtype=np.int64),
                format_version=np.asarray(FORMAT_VERSION, dtype=np.int64),
            )
        os.replace(tmp, path)
        return path


def shard_files(paths: Sequence[Path]) -> list[Path]:
    """The shard files named by `paths` (directories: their `*.npz`, sorted; files as given)."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.suffix == SHARD_SUFFIX and p.is_file())
            if not found:
                raise ShardError(f"{path}: no shards (*{SHARD_SUFFIX}) in this directory")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise ShardError(f"{path}: no such directory or file")
    return files


def read_shard(path: Path) -> tuple[ShardRows, str, int]:
    """One shard's rows, model name and hidden size; `ShardError` naming the problem."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise ShardError(f"{path}: not a hidden-state shard ({exc})") from exc
    missing = [k for k in ("vectors", *_COLUMNS, "model", "hidden_size", "format_version") if k not in arrays]
    if missing:
        raise ShardError(f"{path}: not a hidden-state shard (missing {', '.join(missing)})")
    version = int(arrays["format_version"])
    if version != FORMAT_VERSION:
        raise ShardError(f"{path}: shard format version {version}, this reader knows {FORMAT_VERSION}")
    hidden_size = int(arrays["hidden_size"])
    vectors = arrays["vectors"]
    if vectors.dtype not in _VECTOR_DTYPES or vectors.ndim != 2 or vectors.shape[1] != hidden_size:
        raise ShardError(f"{path}: vectors are {vectors.dtype} {vectors.shape}, expected float16/32 "
                         f"(n, {hidden_size})")
    n = vectors.shape[0]
    for name in _COLUMNS:
        if arrays[name].shape != (n,):
            raise ShardError(f"{path}: column {name} has shape {arrays[name].shape}, expected ({n},)")
    for name in _INT_COLUMNS:
        if arrays[name].dtype.kind not in "iu":
            raise ShardError(f"{path}: column {name} is {arrays[name].dtype}, expected integers")
    remaining = arrays["remaining_tokens"].astype(np.int32)
    if np.any(remaining < 0):
        raise ShardError(f"{path}: negative remaining_tokens labels")
    rows = ShardRows(
        vectors=vectors,
        request_ids=arrays["request_ids"].astype(np.str_),
        generated_tokens=arrays["generated_tokens"].astype(np.int32),
        prompt_tokens=arrays["prompt_tokens"].astype(np.int32),
        output_tokens=arrays["output_tokens"].astype(np.int32),
        remaining_tokens=remaining,
    )
    return rows, str(arrays["model"]), hidden_size


def load_shards(paths: Sequence[Path]) -> HiddenStateData:
    """Every shard under `paths`, concatenated (float32 vectors if any shard has them, else float16).

    All shards must come from one model and hidden size; `ShardError` names the first that does not.
    """
    files = shard_files(paths)
    if not files:
        raise ShardError("no shard directories or files given")
    parts: list[ShardRows] = []
    model, hidden_size = "", 0
    for i, path in enumerate(files):
        rows, shard_model, shard_hidden = read_shard(path)
        if i == 0:
            model, hidden_size = shard_model, shard_hidden
        elif (shard_model, shard_hidden) != (model, hidden_size):
            raise ShardError(f"{path}: model {shard_model!r} with hidden size {shard_hidden}, but {files[0]} "
                             f"has {model!r} with {hidden_size}: shards of different models cannot mix")
        parts.append(rows)
    if any(p.vectors.dtype == np.float32 for p in parts):
        parts = [
            ShardRows(p.vectors.astype(np.float32), p.request_ids, p.generated_tokens, p.prompt_tokens,
                      p.output_tokens, p.remaining_tokens)
            for p in parts
        ]
    rows = ShardRows.concatenate(parts)
    if not len(rows):
        raise ShardError(f"{', '.join(str(p) for p in paths)}: the shards hold no rows")
    return HiddenStateData(rows=rows, model=model, hidden_size=hidden_size, files=tuple(files))


def count_rows(files: Sequence[Path]) -> tuple[int, int]:
    """(rows, distinct requests) in these shards, reading only their request ids."""
    ids: list[npt.NDArray[np.str_]] = []
    for path in files:
        try:
            with np.load(path, allow_pickle=False) as npz:
                ids.append(npz["request_ids"])
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
            raise ShardError(f"{path}: not a hidden-state shard ({exc})") from exc
    if not ids:
        return 0, 0
    every = np.concatenate(ids)
    return int(every.size), int(np.unique(every).size)
