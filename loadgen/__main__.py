"""``python -m loadgen``: the load generator's command line (``loadgen.cli``) on uvloop when installed.

Owns: choosing the event loop (uvloop is installed in ``__main__`` modules only, by the style guide).
Must not: parse flags or run anything itself.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable

from loadgen.cli import main


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop  # noqa: PLC0415
    except ImportError:
        return None
    return uvloop.new_event_loop


if __name__ == "__main__":
    sys.exit(main(loop_factory=loop_factory()))
