"""Regenerate the committed stubs from `proto/engine_agent.proto` (`make proto`).

The proto path is mapped onto the package (`switchyard/proto_gen=proto`) so the generated modules import each
other as `switchyard.proto_gen.*` and need no path hacks. `generate(out_root)` is also what the staleness test
calls, into a temporary directory, to compare byte for byte with the committed files.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROTO_DIR = REPO / "proto"
PACKAGE_DIR = Path("switchyard") / "proto_gen"
GENERATED = ("engine_agent_pb2.py", "engine_agent_pb2.pyi", "engine_agent_pb2_grpc.py")


def generate(out_root: Path) -> list[Path]:
    """Run protoc into `out_root`; returns the generated files (under out_root/switchyard/proto_gen)."""
    from grpc_tools import protoc  # test/dev dependency only

    (out_root / PACKAGE_DIR).mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"--proto_path={PACKAGE_DIR.as_posix()}={PROTO_DIR}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        str(PROTO_DIR / "engine_agent.proto"),
    ]
    code = protoc.main(args)
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}")
    return [out_root / PACKAGE_DIR / name for name in GENERATED]


def main() -> int:
    files = generate(REPO)
    for f in files:
        print(f"wrote {f.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
