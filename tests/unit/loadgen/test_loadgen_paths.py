"""Data-root resolution order: --data-dir flag > SWITCHYARD_DATA_DIR > <repo>/../shared/data > error."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadgen.paths import DATA_DIR_ENV, DataDirNotFoundError, default_data_dir, repo_root, resolve_data_dir


@pytest.fixture
def layout(tmp_path: Path) -> dict[str, Path]:
    root = tmp_path / "main"
    shared = tmp_path / "shared" / "data"
    flag = tmp_path / "flagdir"
    env = tmp_path / "envdir"
    for d in (root, shared, flag, env):
        d.mkdir(parents=True)
    return {"root": root, "shared": shared, "flag": flag, "env": env}


def test_flag_beats_env_and_default(layout: dict[str, Path]) -> None:
    got = resolve_data_dir(str(layout["flag"]), env={DATA_DIR_ENV: str(layout["env"])}, root=layout["root"])
    assert got == layout["flag"].resolve()


def test_env_beats_default(layout: dict[str, Path]) -> None:
    got = resolve_data_dir(None, env={DATA_DIR_ENV: str(layout["env"])}, root=layout["root"])
    assert got == layout["env"].resolve()


def test_default_is_shared_data_next_to_repo(layout: dict[str, Path]) -> None:
    assert resolve_data_dir(None, env={}, root=layout["root"]) == layout["shared"].resolve()
    assert resolve_data_dir("", env={DATA_DIR_ENV: ""}, root=layout["root"]) == layout["shared"].resolve()


def test_error_names_flag_and_env(tmp_path: Path) -> None:
    root = tmp_path / "lonely"
    root.mkdir()
    with pytest.raises(DataDirNotFoundError, match=r"--data-dir.*SWITCHYARD_DATA_DIR"):
        resolve_data_dir(None, env={}, root=root)


@pytest.mark.parametrize("source", ["flag", "env"])
def test_explicit_missing_dir_is_an_error_not_a_fallthrough(layout: dict[str, Path], source: str) -> None:
    missing = str(layout["root"] / "nope")
    flag = missing if source == "flag" else None
    env = {DATA_DIR_ENV: missing} if source == "env" else {}
    with pytest.raises(DataDirNotFoundError, match="nope"):
        resolve_data_dir(flag, env=env, root=layout["root"])


def test_repo_root_holds_the_loadgen_package() -> None:
    assert (repo_root() / "loadgen" / "paths.py").is_file()
    assert default_data_dir() == (repo_root().parent / "shared" / "data").resolve()
