"""Resolution of the shared data root for loadgen.

Owns: the precedence rule for finding the data directory (explicit ``--data-dir`` flag value, then the
``SWITCHYARD_DATA_DIR`` environment variable, then ``../shared/data`` next to the repository root) and the
error raised when none applies.
Must not: read any dataset file, parse command lines, or cache a resolved path in module state.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

DATA_DIR_FLAG = "--data-dir"
DATA_DIR_ENV = "SWITCHYARD_DATA_DIR"


class DataDirNotFoundError(FileNotFoundError):
    """No usable data directory: the message names the flag and the environment variable to set."""


def repo_root() -> Path:
    """The repository root (the folder holding the ``loadgen`` package)."""
    return Path(__file__).resolve().parent.parent


def default_data_dir(root: Path | None = None) -> Path:
    """``../shared/data`` relative to the repository root, whether or not it exists."""
    base = repo_root() if root is None else root
    return (base.parent / "shared" / "data").resolve()


def resolve_data_dir(
    flag_value: str | os.PathLike[str] | None,
    env: Mapping[str, str] | None = None,
    root: Path | None = None,
) -> Path:
    """Return the data root: flag value > ``SWITCHYARD_DATA_DIR`` > ``<repo>/../shared/data`` if present.

    ``env`` defaults to ``os.environ``; ``root`` defaults to this repository's root. An explicit flag or
    environment value that is not a directory is an error, never silently skipped.
    """
    if flag_value is not None and str(flag_value) != "":
        return _existing_dir(Path(flag_value), f"{DATA_DIR_FLAG} {flag_value}")
    environ = os.environ if env is None else env
    env_value = environ.get(DATA_DIR_ENV, "")
    if env_value:
        return _existing_dir(Path(env_value), f"{DATA_DIR_ENV}={env_value}")
    fallback = default_data_dir(root)
    if fallback.is_dir():
        return fallback
    raise DataDirNotFoundError(
        f"no data directory found: pass {DATA_DIR_FLAG} PATH or set {DATA_DIR_ENV}=PATH "
        f"(the default {fallback} does not exist)"
    )


def _existing_dir(path: Path, origin: str) -> Path:
    resolved = path.expanduser().resolve()
    if not resolved.is_dir():
        raise DataDirNotFoundError(
            f"data directory from {origin} is not a directory: {resolved} "
            f"(pass {DATA_DIR_FLAG} PATH or set {DATA_DIR_ENV}=PATH)"
        )
    return resolved
