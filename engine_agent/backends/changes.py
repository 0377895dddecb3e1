"""`VersionSignal`: the counter behind `EngineBackend.wait_for_change`, with its asyncio waiters.

Owns: the visible version, advancing it, and waiting (with a timeout) until it passes a given value.
Must not: decide what counts as a significant change (each backend does: `sim_changes.ChangeVersion`,
`vllm.state.VllmEngineState`) or read clocks (timeouts are asyncio's).
"""

from __future__ import annotations

import asyncio
import contextlib


class VersionSignal:
    __slots__ = ("_version", "_changed")

    def __init__(self) -> None:
        self._version = 0
        self._changed = asyncio.Event()

    @property
    def version(self) -> int:
        return self._version

    def advance(self) -> None:
        """A significant change: bump the version and wake every waiter."""
        self._version += 1
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def wait(self, after_version: int, timeout_s: float) -> int:
        """The version once above `after_version`, or at the timeout (at once when `timeout_s` <= 0)."""
        if self._version > after_version or timeout_s <= 0:
            return self._version
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._version <= after_version:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
        return self._version
