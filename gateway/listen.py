"""What an aiohttp server of this package needs once it listens: the port it bound, and stopping on signals.

Owns: `bound_port` (the port an `AppRunner`'s site bound, for port 0) and `stop_on_signals` (SIGTERM and
SIGINT set a stop event while the block runs; the handlers are removed after). The gateway (`gateway.app`)
and the judge stub (`gateway.cascade.judge_stub`) both serve through them.
Must not: build applications or decide when to stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator

from aiohttp import web


def bound_port(runner: web.AppRunner, configured: int) -> int:
    """The port the runner's first TCP site listens on (the configured one if it has no address)."""
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            return int(address[1])
    return configured


@contextlib.contextmanager
def stop_on_signals(stop: asyncio.Event, enabled: bool = True) -> Iterator[None]:
    """SIGTERM and SIGINT set `stop` inside the block (when `enabled`, from the main thread on a platform
    with signals; elsewhere nothing is installed)."""
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []
    for sig in (signal.SIGTERM, signal.SIGINT) if enabled else ():
        try:
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
        except (NotImplementedError, RuntimeError):  # not the main thread / platform without signals
            pass
    try:
        yield
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
