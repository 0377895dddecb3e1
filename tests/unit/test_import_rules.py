"""Layering rules over the AST, and a fresh-interpreter import of every module (catches circular imports).

The rules (docs/architecture.md "Layers"):
- Pure cores (policies, cluster state, the request life and its features, the domain modules, the simulated
  GPU, LENS, and every planner / rescheduler / estimator folder, present or future) import no I/O, no clock
  and no event loop, and only the project modules at or below their own layer.
- `switchyard/` is the ground floor: it imports nothing of the project. `launcher/` is the roof: nothing
  imports it.
- The gateway and the agent share only the ground floor; `gateway/api` does not import `gateway/engines`; in
  the gateway only the gRPC client imports the generated proto code.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("gateway", "engine_agent", "loadgen", "switchyard", "launcher")
PROJECT = frozenset(PACKAGES)
PROTO_GEN = "switchyard.proto_gen"
PROTO_IMPORTERS = ("gateway/engines/grpc_client.py", "gateway/engines/grpc_session.py")
SKIPPED_PREFIXES = ("engine_agent.backends.vllm",)  # needs vllm, imported lazily on GPU hosts only

# What a pure core may not import: I/O, event loops, threads, the wall clock, metrics.
IO_ROOTS = frozenset({
    "asyncio", "aiohttp", "grpc", "prometheus_client", "time", "threading", "socket", "subprocess",
    "multiprocessing", "concurrent", "selectors", "uvloop", "httpx", "requests",
})
IO_MODULES = ("switchyard.clock", "switchyard.proto_gen")


@dataclass(frozen=True)
class PureCore:
    """Files under `path` (a folder or one module) may import only the project modules under `allowed`."""

    path: str
    allowed: tuple[str, ...]


GATEWAY_DOMAIN = ("gateway.domain",)
# GPU datasheets and model shapes, the engine profiles built from them and the roofline over a batch: the
# ground floor's pure engine model, shared by the simulated GPU and the gateway's planners.
CATALOGUE = ("switchyard.hardware", "switchyard.profiles", "switchyard.perf_model")
ROLES = ("switchyard.roles",)  # the engine roles agents and gateway agree on: constants
AGENT_DOMAIN = ("engine_agent.domain",)
PURE_CORES = (
    PureCore("gateway/domain.py", ()),
    PureCore("engine_agent/domain.py", ()),
    PureCore("gateway/policies", (*GATEWAY_DOMAIN, "gateway.policies", *CATALOGUE, "switchyard.prefix")),
    PureCore("gateway/cluster/health.py", ()),
    PureCore("gateway/cluster/state.py", (*GATEWAY_DOMAIN, "gateway.cluster.health",
                                          "gateway.cluster.prefix_index", "switchyard.prefix")),
    PureCore("gateway/cluster/prefix_index.py", GATEWAY_DOMAIN),
    PureCore("gateway/dispatch/features.py", (*GATEWAY_DOMAIN, "switchyard.prefix")),
    PureCore("gateway/dispatch/retry.py", ()),
    PureCore("gateway/access", ("gateway.access", "gateway.config")),
    PureCore("gateway/admission/core.py", GATEWAY_DOMAIN),
    PureCore("gateway/dispatch/life.py", (*GATEWAY_DOMAIN, "gateway.dispatch.features", "gateway.policies",
                                          "gateway.dispatch.retry", "gateway.cluster.health", *ROLES)),
    # Planners and reschedulers (CAUCHY, Cascadia, STAR, CascadeInfer) read snapshots and the engine model.
    PureCore("gateway/estimators", (*GATEWAY_DOMAIN, "gateway.estimators")),
    PureCore("gateway/planning", (*GATEWAY_DOMAIN, "gateway.planning", "gateway.estimators", *CATALOGUE,
                                  "switchyard.qoe")),
    PureCore("gateway/cascade/plan", (*GATEWAY_DOMAIN, "gateway.cascade.plan", "gateway.cascade.quality",
                                      "gateway.planning", *CATALOGUE)),
    PureCore("gateway/rescheduling", (*GATEWAY_DOMAIN, "gateway.rescheduling", "gateway.planning",
                                      "gateway.estimators", "gateway.policies", "switchyard.star_load",
                                      "switchyard.qoe")),
    PureCore("engine_agent/lens", (*AGENT_DOMAIN, "engine_agent.lens")),
    PureCore("engine_agent/sim", (*AGENT_DOMAIN, "engine_agent.lens", "engine_agent.sim", *CATALOGUE,
                                  "switchyard.qoe", "switchyard.prefix")),
    # CascadeInfer's online QoE fit and the KV pull throughput: fed by the backends, pure themselves.
    PureCore("engine_agent/qoe_tracker.py", (*AGENT_DOMAIN, "switchyard.qoe")),
    PureCore("engine_agent/transfer_rate.py", ()),
    PureCore("engine_agent/kv_journal.py", AGENT_DOMAIN),
    # Cascades (Cascadia): the quality profiles, the judge's prompts and parser, and one request's decisions.
    PureCore("gateway/cascade/quality.py", ()),
    PureCore("gateway/cascade/judge_prompt.py", ("gateway.cascade.quality",)),
    PureCore("gateway/cascade/core.py", ()),
    PureCore("switchyard/hardware.py", ()),
    PureCore("switchyard/profiles.py", ("switchyard.hardware",)),
    PureCore("switchyard/perf_model.py", ("switchyard.hardware", "switchyard.profiles")),
    PureCore("switchyard/roles.py", ()),
    PureCore("switchyard/qoe.py", ()),
    # Prefix block keys: the one definition of a shared prefix, for engines, agents and the gateway.
    PureCore("switchyard/prefix.py", ()),
)


@dataclass(frozen=True)
class Forbidden:
    """Files under `path` may not import modules starting with any of `prefixes` (`except_files` excepted)."""

    path: str
    prefixes: tuple[str, ...]
    why: str
    except_files: tuple[str, ...] = ()


LAYER_RULES = (
    Forbidden("switchyard", ("gateway", "engine_agent", "loadgen", "launcher"),
              "the ground floor imports nothing"),
    Forbidden("gateway", ("launcher",), "nothing below the roof imports the CLI"),
    Forbidden("engine_agent", ("launcher",), "nothing below the roof imports the CLI"),
    Forbidden("loadgen", ("launcher",), "nothing below the roof imports the CLI"),
    Forbidden("gateway", ("engine_agent",), "the gateway and the agent share only the ground floor"),
    Forbidden("engine_agent", ("gateway", "loadgen"), "the agent imports nothing of the gateway or loadgen"),
    Forbidden("gateway/api", ("gateway.engines",), "the API knows nothing of engines"),
    Forbidden("gateway", (PROTO_GEN,), "only the gRPC client speaks proto", except_files=PROTO_IMPORTERS),
)


def python_files(folder: Path) -> list[Path]:
    if folder.is_file():
        return [folder]
    return sorted(
        p for p in folder.rglob("*.py") if "__pycache__" not in p.parts and "proto_gen" not in p.parts
    )


def import_statements(path: Path) -> list[tuple[str, tuple[str, ...]]]:
    """Each import statement anywhere in the file (inside functions too): (its module as written, the names it
    binds as dotted paths: `import a.b` -> a.b, `from a import b, c` -> a.b, a.c)."""
    found: list[tuple[str, tuple[str, ...]]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.extend((alias.name, (alias.name,)) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, tuple(f"{node.module}.{alias.name}" for alias in node.names)))
    return found


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _starts(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def violations(root: Path) -> list[str]:
    """Every broken rule under `root` (a repository layout), as 'file: what', one per import statement."""
    found: list[str] = []
    for core in PURE_CORES:
        for path in python_files(root / core.path):
            rel = path.relative_to(root).as_posix()
            own = _module_name(root, path)
            for module, names in import_statements(path):
                if any(n.split(".")[0] in IO_ROOTS or _starts(n, IO_MODULES) for n in names):
                    found.append(f"{rel}: pure core imports I/O or a clock ({module})")
                elif any(n.split(".")[0] in PROJECT and not _starts(n, (*core.allowed, own)) for n in names):
                    found.append(f"{rel}: pure core imports {module}, above its layer")
    for rule in LAYER_RULES:
        for path in python_files(root / rule.path):
            rel = path.relative_to(root).as_posix()
            if rel in rule.except_files:
                continue
            for module, names in import_statements(path):
                if any(_starts(n, rule.prefixes) for n in names):
                    found.append(f"{rel}: imports {module} ({rule.why})")
    return found


def test_the_tree_keeps_its_layers() -> None:
    assert violations(REPO) == []


def test_every_pure_core_that_exists_is_checked() -> None:
    existing = [c.path for c in PURE_CORES if (REPO / c.path).exists()]
    assert {"gateway/policies", "gateway/dispatch/life.py", "engine_agent/sim", "engine_agent/lens"} <= set(
        existing
    )


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize(
    ("rel", "text", "expected"),
    [
        ("gateway/policies/bad.py", "import time\n", "pure core imports I/O or a clock (time)"),
        ("gateway/policies/bad.py", "from switchyard.clock import Clock\n", "a clock (switchyard.clock)"),
        ("gateway/dispatch/life.py", "def f():\n    import asyncio\n", "I/O or a clock (asyncio)"),
        ("engine_agent/sim/bad.py", "from engine_agent.backends.base import X\n", "above its layer"),
        ("gateway/cluster/state.py", "from gateway.engines.base import EngineClient\n", "above its layer"),
        ("gateway/planning/new_solver.py", "from gateway.app import build_app\n", "above its layer"),
        ("gateway/domain.py", "from gateway.policies.base import Policy\n", "above its layer"),
        ("gateway/api/handlers.py", "from gateway.engines.base import X\n", "the API knows nothing"),
        ("loadgen/cli.py", "from launcher.cli import main\n", "nothing below the roof imports the CLI"),
        ("switchyard/clock.py", "import gateway.domain\n", "the ground floor imports nothing"),
        ("gateway/app.py", "from switchyard.proto_gen import engine_agent_pb2\n", "only the gRPC client"),
        ("engine_agent/service.py", "from gateway.domain import X\n", "imports nothing of the gateway"),
    ],
)
def test_a_deliberate_violation_is_caught(tmp_path: Path, rel: str, text: str, expected: str) -> None:
    _write(tmp_path, rel, text)
    found = violations(tmp_path)
    assert len(found) == 1 and found[0].startswith(rel) and expected in found[0], found


def test_allowed_imports_pass(tmp_path: Path) -> None:
    _write(tmp_path, "gateway/policies/ok.py", "from gateway.domain import EngineId\nimport math\n")
    _write(tmp_path, PROTO_IMPORTERS[1], "from switchyard.proto_gen import engine_agent_pb2\n")
    _write(tmp_path, "engine_agent/sim/ok.py", "from engine_agent.lens.perf_model import X\n")
    assert violations(tmp_path) == []


def all_modules() -> list[str]:
    modules = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            name = _module_name(REPO, path)
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
    assert "gateway.cluster.store" in modules and "gateway.dispatch.life" in modules
    script = _IMPORT_EACH.format(packages=PACKAGES, modules=modules)
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout + done.stderr
