"""The suite's loop guard (tests/conftest.py), run on an inner test file in a pytest subprocess.

Blocking 200 ms in an async test, a task or a loop callback fails that test, naming the culprit; awaiting
200 ms, blocking in a sync test (no loop) and a test marked `allow_loop_blocking` pass.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

INNER = """
import asyncio
import time

import pytest


async def test_blocks_in_the_test() -> None:
    time.sleep(0.2)


async def test_blocks_in_a_task() -> None:
    async def sleepy_worker() -> None:
        time.sleep(0.2)

    await asyncio.create_task(sleepy_worker())


async def test_blocks_in_a_callback() -> None:
    asyncio.get_running_loop().call_soon(time.sleep, 0.2)
    await asyncio.sleep(0.3)


async def test_awaits() -> None:
    await asyncio.sleep(0.2)


def test_sync_sleep_has_no_loop_to_block() -> None:
    time.sleep(0.2)


@pytest.mark.allow_loop_blocking(reason="this test is about blocking")
async def test_marked() -> None:
    time.sleep(0.2)
"""


def test_blocking_fails_the_test_and_names_the_culprit(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--strict-markers",
        "-o", "asyncio_mode=auto", "-o", "asyncio_default_fixture_loop_scope=function",
    )
    # The call phase of every test passes; the guard fails the three blockers at teardown.
    result.assert_outcomes(passed=6, errors=3)
    result.stdout.fnmatch_lines_random([
        "*ERROR at teardown of test_blocks_in_the_test*",
        "*task * running 'test_blocks_in_the_test' blocked its event loop*",
        "*task * running 'test_blocks_in_a_task.<locals>.sleepy_worker' blocked its event loop*",
        "*<Handle sleep(0.2)> blocked its event loop*",
        "*time.sleep(0.2)*",  # the sampled stack shows the blocking line
    ])
    errors = [line for line in result.outlines if line.startswith("ERROR test_inner.py::")]
    errored = {line.split("::")[1].split()[0] for line in errors}
    assert errored == {"test_blocks_in_the_test", "test_blocks_in_a_task", "test_blocks_in_a_callback"}
