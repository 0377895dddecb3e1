"""Layering rules over the AST, and a fresh-interpreter import of every module (catches circular imports)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("gateway", "engine_agent", "loadgen", "switchyard")
PURE_FORBIDDEN = frozenset({"asyncio", "aiohttp", "grpc", "prometheus_client", "time"})
PROTO_GEN = "switchyard.proto_gen"
PROTO_IMPORTER = Path("gateway/engines/grpc_client.py")
SKIPPED_PREFIXES = ("engine_agent.backends.vllm",)  # needs vllm, imported lazily on GPU hosts only


def python_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def imported_modules(path: Path) -> set[str]:
    """Every module an import statement anywhere in the file names (also `from a import b` as `a.b`)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def roots(names: set[str]) -> set[str]:
    return {name.split(".")[0] for name in names}


def pure_modules() -> list[Path]:
    return [*python_files(REPO / "gateway" / "policies"), REPO / "gateway" / "domain.py"]


@pytest.mark.parametrize("path", pure_modules(), ids=lambda p: str(p.relative_to(REPO)))
def test_decision_cores_import_no_io_or_time(path: Path) -> None:
    assert roots(imported_modules(path)) & PURE_FORBIDDEN == set()


def test_only_the_grpc_client_imports_generated_proto_code() -> None:
    importers = [
        path.relative_to(REPO)
        for path in python_files(REPO / "gateway")
        if any(name == PROTO_GEN or name.startswith(PROTO_GEN + ".") for name in imported_modules(path))
    ]
    assert importers == [PROTO_IMPORTER]


def test_the_rule_checker_sees_imports_inside_functions(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    import time\n    from switchyard import proto_gen\n")
    assert "time" in roots(imported_modules(sample))
    assert PROTO_GEN in imported_modules(sample)


def all_modules() -> list[str]:
    modules = []
    for package in PACKAGES:
        for path in python_files(REPO / package):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join(parts)
            if not name.startswith(SKIPPED_PREFIXES):
                modules.append(name)
    return modules


# Imports each module as if first: the project's modules are evicted from sys.modules before each one, so an
# import cycle shows whatever the order, while third-party packages stay loaded (one interpreter for all).
_IMPORT_EACH = """
import importlib, sys, traceback, warnings
warnings.simplefilter("error")
warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"google\\.protobuf")
packages = {packages!r}
failures = []
for name in {modules!r}:
    for loaded in [m for m in sys.modules if m.split(".")[0] in packages]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except BaseException:
        failures.append(name + ":\\n" + traceback.format_exc(limit=3))
print("\\n".join(failures))
sys.exit(1 if failures else 0)
"""


def test_every_module_imports_in_a_fresh_interpreter() -> None:
    modules = all_modules()
    assert "gateway.cluster.store" in modules
    script = _IMPORT_EACH.format(packages=PACKAGES, modules=modules)
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout + done.stderr
