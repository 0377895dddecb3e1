"""Suite-wide test hygiene: any test that blocks an event loop for more than 100 ms fails (STYLE.md, Async).

Every asyncio callback runs through `asyncio.Handle._run` (task steps, `call_soon`/`call_later` callbacks,
I/O callbacks), so timing that one method sees every stretch the loop cannot serve anything else, on any
loop of this process: pytest-asyncio's, and ones a test starts itself (`asyncio.run` in a CLI under test,
in a worker thread or not). A callback that keeps its loop for `LOOP_BLOCK_LIMIT_S` or more is recorded;
the autouse fixture `_fail_if_a_loop_blocks` fails the test at teardown, naming the callback (for a task
step: the task and its coroutine) and the stack a watchdog thread sampled while it was blocking (the line
of the `time.sleep`, the synchronous HTTP call, the heavy computation).

Not flaky on a loaded machine: time a thread spends runnable but waiting for a CPU (Linux schedstat
`run_delay`, read from /proc/thread-self/schedstat) is not blocking and is subtracted, so a 1 ms callback
that the scheduler leaves off-CPU for 300 ms passes, while a callback that sleeps, waits on I/O or computes
for 100 ms fails whatever the load. Where schedstat is missing (not Linux) the wall time counts as is.
Garbage-collector pauses are subtracted too (timed through `gc.callbacks`): a full collection of the suite's
large heap, triggered by whichever allocation happens to cross the threshold, is the interpreter's cost, not
the test's blocking call, and would otherwise fail an arbitrary test late in a long run.

Time another thread of this process holds the GIL while the loop thread wants it does count: that is the
loop kept from running too.

Why not asyncio debug mode (`loop.set_debug(True)`, `slow_callback_duration`): it times callbacks the same
way, but also captures a traceback on every handle and future, tracks coroutine origins, logs unclosed
resources and raises on cross-thread misuse: it changes behaviour, and on a loop of no-op callbacks it costs
18 us per callback against 2.3 us plain. This guard adds 0.6 us per callback (the unit suite runs ~6,000:
milliseconds in all) plus a watchdog thread waking every 20 ms, and changes nothing else.

A test that must block a loop on purpose carries `@pytest.mark.allow_loop_blocking(reason=...)`.
Blocking outside any test (a wider-scoped fixture's setup or teardown) is reported by the next test.
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from time import perf_counter
from types import FrameType

import _pytest
import pluggy
import pytest
import pytest_asyncio

LOOP_BLOCK_LIMIT_S = 0.1
WATCHDOG_PERIOD_S = 0.02  # how often the watchdog looks for a callback past the limit to sample its stack
RUN_DELAY_REFRESH_S = 0.01  # a callback's runqueue wait is counted from a reading at most this old
SCHEDSTAT = "/proc/thread-self/schedstat"  # "<on-CPU ns> <runnable-but-waiting ns> <timeslices>"
MARKER = "allow_loop_blocking"
_NOT_OURS = (  # frames left out of a sampled stack: the loop's, the test runner's, the guard's
    *(os.path.dirname(m.__file__) + os.sep for m in (asyncio, _pytest, pluggy, pytest, pytest_asyncio)),
    "<frozen ",
    __file__,
)
_LIBRARIES = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix})


def _run_delay_s() -> float:
    """Seconds this thread has spent runnable but waiting for a CPU, since it started."""
    fd = os.open(SCHEDSTAT, os.O_RDONLY)
    try:
        return int(os.read(fd, 128).split()[1]) / 1e9
    finally:
        os.close(fd)


def _schedstat_works() -> bool:
    try:
        _run_delay_s()
    except (OSError, IndexError, ValueError):
        return False
    return True


@dataclass(frozen=True)
class Block:
    """One callback that kept its loop for `blocked_s` (wall time less runqueue wait)."""

    callback: str
    thread: str
    blocked_s: float
    wall_s: float
    stack: str | None

    def describe(self) -> str:
        where = (f"\n  stack sampled while blocked:\n{self.stack}" if self.stack else
                 "\n  (no stack sampled: the callback held the GIL throughout, e.g. in C code)")
        return (f"{self.callback} blocked its event loop (thread {self.thread}) "
                f"for {self.blocked_s * 1e3:.0f} ms (wall {self.wall_s * 1e3:.0f} ms){where}")


def _describe(handle: asyncio.Handle) -> str:
    owner = getattr(getattr(handle, "_callback", None), "__self__", None)
    if isinstance(owner, asyncio.Task):  # a task step: the coroutine is what the reader wants
        coro = owner.get_coro()
        return f"task {owner.get_name()!r} running {getattr(coro, '__qualname__', coro)!r}"
    return repr(handle)


def _own_frames(frame: FrameType, innermost: int = 3, project: int = 5) -> str:
    """Where a blocked callback was: its `project` innermost frames outside the standard library and
    site-packages (the code to fix), then the `innermost` frames of the stack (what it was doing there),
    less the event loop's and the test runner's frames."""
    frames = [f for f in traceback.extract_stack(frame) if not f.filename.startswith(_NOT_OURS)]
    ours = [i for i, f in enumerate(frames) if not f.filename.startswith(_LIBRARIES)][-project:]
    keep = sorted({*ours, *range(max(0, len(frames) - innermost), len(frames))})
    shown = traceback.format_list([frames[i] for i in keep])
    return "".join(shown) or "    (no Python frame: the callback itself)\n"


class LoopGuard:
    """Times every `Handle._run` in the process; keeps the slow ones until a test collects them."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.blocks: list[Block] = []
        self._running: dict[int, tuple[float, asyncio.Handle]] = {}  # thread id -> (start, handle)
        self._stacks: dict[tuple[int, float], str] = {}  # (thread id, start) -> stack sampled by the watchdog
        self._run_delay: dict[int, tuple[float, float]] = {}  # thread id -> (read at, run_delay_s)
        self._gc_started: dict[int, float] = {}  # thread id -> when its collection in progress started
        self._gc_total_s: dict[int, float] = {}  # thread id -> seconds spent in the collector so far
        self._schedstat = _schedstat_works()
        self._original = asyncio.Handle._run
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="loop-guard-watchdog", daemon=True)

    def install(self) -> None:
        guard, original = self, self._original

        def _run(handle: asyncio.Handle) -> None:
            tid = threading.get_ident()
            start = perf_counter()
            if guard._schedstat:
                seen = guard._run_delay.get(tid)
                if seen is None or start - seen[0] > RUN_DELAY_REFRESH_S:
                    guard._run_delay[tid] = (start, _run_delay_s())
            guard._running[tid] = (start, handle)
            gc_before_s = guard._gc_total_s.get(tid, 0.0)
            try:
                original(handle)
            finally:
                del guard._running[tid]
                wall_s = perf_counter() - start
                if wall_s >= guard.limit_s:
                    gc_s = guard._gc_total_s.get(tid, 0.0) - gc_before_s
                    guard._record(tid, start, wall_s, handle, gc_s)

        asyncio.Handle._run = _run  # type: ignore[method-assign]
        gc.callbacks.append(self._on_gc)
        self._watchdog.start()

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        tid = threading.get_ident()
        if phase == "start":
            self._gc_started[tid] = perf_counter()
        elif (started := self._gc_started.pop(tid, None)) is not None:
            self._gc_total_s[tid] = self._gc_total_s.get(tid, 0.0) + perf_counter() - started

    def uninstall(self) -> None:
        asyncio.Handle._run = self._original  # type: ignore[method-assign]
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        self._stop.set()
        self._watchdog.join()

    def take(self) -> list[Block]:
        blocks, self.blocks = self.blocks, []
        self._stacks.clear()
        return blocks

    def _record(self, tid: int, start: float, wall_s: float, handle: asyncio.Handle, gc_s: float) -> None:
        # The last run_delay reading is from this callback's start or at most RUN_DELAY_REFRESH_S before it,
        # so the wait subtracted can only be too large (by that much): the guard errs towards passing.
        waited_s = _run_delay_s() - self._run_delay[tid][1] if self._schedstat else 0.0
        blocked_s = wall_s - waited_s - gc_s
        stack = self._stacks.pop((tid, start), None)
        if blocked_s >= self.limit_s:
            name = next((t.name for t in threading.enumerate() if t.ident == tid), str(tid))
            self.blocks.append(Block(_describe(handle), name, blocked_s, wall_s, stack))

    def _watch(self) -> None:
        while not self._stop.wait(WATCHDOG_PERIOD_S):
            now = perf_counter()
            for tid, (start, _) in list(self._running.items()):
                if now - start >= self.limit_s and (tid, start) not in self._stacks:
                    frame = sys._current_frames().get(tid)
                    if frame is not None:
                        self._stacks[(tid, start)] = _own_frames(frame)


_GUARD = LoopGuard(LOOP_BLOCK_LIMIT_S)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(reason): the test blocks an event loop on purpose; the loop guard does not fail it",
    )
    _GUARD.install()


def pytest_unconfigure(config: pytest.Config) -> None:
    _GUARD.uninstall()


@pytest.fixture(autouse=True)
def _fail_if_a_loop_blocks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails the test at teardown if a callback kept an event loop for `LOOP_BLOCK_LIMIT_S` or more during
    its setup, call or teardown. Autouse and dependency-free, so set up first and torn down last."""
    before = _GUARD.take()  # wider-scoped fixtures set up for this test, or blocking between tests
    yield
    during = _GUARD.take()
    if (before or during) and request.node.get_closest_marker(MARKER) is None:
        earlier = "before this test's function-scoped fixtures (a wider-scoped fixture, or between tests): "
        lines = "\n".join([*(earlier + b.describe() for b in before), *(b.describe() for b in during)])
        pytest.fail(f"an event loop was blocked for {LOOP_BLOCK_LIMIT_S * 1e3:.0f} ms or more "
                    f"(move blocking work to asyncio.to_thread / run_in_executor):\n{lines}", pytrace=False)
