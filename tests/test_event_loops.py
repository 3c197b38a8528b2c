"""A scope in a coroutine ends its task's wait at the deadline, as the event loop's own
timeouts do, and the session's later tests find the loop library whole.

asyncio tasks are cancelled; trio tasks (a run in the main thread, and a guest run
hosted by anyio's test runner) have a trio cancel scope entered with the scope, which is
cancelled. A task busy in its own code gets the ScopeExpired where it is, as any code.
"""

from __future__ import annotations

import importlib.util

import pytest
from helpers import Session, lead, run, scope_line

HAS_TRIO = importlib.util.find_spec("trio") is not None
HAS_ANYIO = importlib.util.find_spec("anyio") is not None
HAS_PYTEST_TRIO = importlib.util.find_spec("pytest_trio") is not None
HAS_PYTEST_ASYNCIO = importlib.util.find_spec("pytest_asyncio") is not None

ASYNCIO_TESTS = """
import asyncio
import os

import pytest
import pytest_elastic_timer as et


async def _sleeping():
    with et.expires(0.3, scope="sleeping"):
        await asyncio.sleep(30)


async def _busy():
    with et.expires(0.3, scope="busy"):
        while True:
            os.times()


@pytest.mark.expires(10)
def test_asyncio_sleeping():
    asyncio.run(_sleeping())


@pytest.mark.expires(10)
def test_asyncio_busy():
    asyncio.run(_busy())


def test_asyncio_after():
    asyncio.run(asyncio.sleep(0.01))
"""

TRIO_TESTS = """
import os

import pytest
import pytest_elastic_timer as et
import trio


async def _sleeping():
    with et.expires(0.3, scope="sleeping"):
        await trio.sleep(30)


async def _busy():
    with et.expires(0.3, scope="busy"):
        while True:
            os.times()


async def _caught():
    with pytest.raises(et.ScopeExpired):
        with et.expires(0.2, scope="caught"):
            await trio.sleep(30)
    await trio.sleep(0.01)  # the run goes on, and so does the task


@pytest.mark.expires(10)
def test_trio_sleeping():
    trio.run(_sleeping)


@pytest.mark.expires(10)
def test_trio_busy():
    trio.run(_busy)


def test_trio_caught():
    trio.run(_caught)


def test_trio_after():
    trio.run(trio.sleep, 0.01)
"""

ANYIO_TESTS = """
import anyio
import pytest
import pytest_elastic_timer as et


@pytest.fixture
def anyio_backend():
    return "trio"


@pytest.mark.expires(10)
@pytest.mark.anyio
async def test_guest_sleeping():
    with et.expires(0.3, scope="sleeping"):
        await anyio.sleep(30)


@pytest.mark.anyio
async def test_guest_after():
    await anyio.sleep(0.01)
"""


def _assert_failed_by_scopes(session: Session, tests: list[tuple[str, str]]) -> None:
    for test, scope in tests:
        session.assert_expired(test, f"{test}::call/{scope}", 0.3)
        assert session.record(f"{test}::call/{scope}")["action"] == "interrupted"
    assert "terminated" not in session.text and "pytest was ended" not in session.text
    session.assert_clean()


def test_asyncio_tasks_end_at_their_deadline(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_loops=ASYNCIO_TESTS)
    session = run(pytester)
    session.result.assert_outcomes(passed=1, failed=2)
    _assert_failed_by_scopes(
        session, [("test_asyncio_sleeping", "sleeping"), ("test_asyncio_busy", "busy")]
    )


@pytest.mark.skipif(not HAS_TRIO, reason="trio is not installed")
def test_trio_tasks_end_at_their_deadline_and_the_run_goes_on(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_loops=TRIO_TESTS)
    session = run(pytester)
    session.result.assert_outcomes(passed=2, failed=2)
    _assert_failed_by_scopes(
        session, [("test_trio_sleeping", "sleeping"), ("test_trio_busy", "busy")]
    )


@pytest.mark.skipif(not (HAS_TRIO and HAS_ANYIO), reason="trio or anyio is not installed")
def test_a_trio_guest_run_ends_at_its_deadline(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_loops=ANYIO_TESTS)
    session = run(pytester, "-p", "anyio")
    session.result.assert_outcomes(passed=1, failed=1)
    _assert_failed_by_scopes(session, [("test_guest_sleeping", "sleeping")])


# Async test functions run by the loop plugins, bounded by their marker: the test's call
# phase is a scope entered outside the loop, whose expiry cancels the test's task.
PLUGIN_RUN_TESTS = """
import asyncio
import os

import anyio
import pytest
import trio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


@pytest.mark.expires(0.5)
@pytest.mark.trio
async def test_trio_waits():
    await trio.sleep(30)


@pytest.mark.expires(0.5)
@pytest.mark.trio
async def test_trio_busy():
    while True:
        os.times()


@pytest.mark.trio
async def test_trio_after():
    await trio.sleep(0.01)


@pytest.mark.expires(0.5)
@pytest.mark.asyncio
async def test_asyncio_waits():
    await asyncio.sleep(30)


@pytest.mark.asyncio
async def test_asyncio_after():
    await asyncio.sleep(0.01)


@pytest.mark.expires(0.5)
@pytest.mark.anyio
async def test_anyio_waits(anyio_backend):
    await anyio.sleep(30)


@pytest.mark.anyio
async def test_anyio_after(anyio_backend):
    await anyio.sleep(0.01)
"""


@pytest.mark.skipif(
    not (HAS_TRIO and HAS_ANYIO and HAS_PYTEST_TRIO and HAS_PYTEST_ASYNCIO),
    reason="needs trio, anyio, pytest-trio and pytest-asyncio",
)
@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one", "xdist"])
def test_a_marker_budget_cancels_the_task_of_an_async_test(
    pytester: pytest.Pytester, workers: list[str]
) -> None:
    """An async test run by pytest-trio, pytest-asyncio or anyio's plugin (both of its
    backends) that waits past its marker's budget fails by its phase's scope, as
    interrupted; nothing is terminated, and the same library's next test passes. Before,
    trio's run ended for good (the next pytest-trio test failed), and under anyio's trio
    runner pytest itself was terminated."""
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    pytester.makepyfile(test_plugin_run=PLUGIN_RUN_TESTS)
    args = ["-p", "no:cacheprovider", "-p", "no:randomly", *workers]
    session = run(pytester, *args, lean=False)
    session.result.assert_outcomes(passed=4, failed=5)
    expired = [
        "test_trio_waits",
        "test_trio_busy",
        "test_asyncio_waits",
        "test_anyio_waits[asyncio]",
        "test_anyio_waits[trio]",
    ]
    for test in expired:
        assert scope_line(f"{test}::call", "0.5").match(lead(session, test)), test
        record = session.record(f"{test}::call")
        assert record["action"] == "interrupted" and record["elapsed"] < 5, record
    assert session.report is not None and not session.report["session"]["root_died"]
    assert "terminated" not in session.text and "pytest was ended" not in session.text
    session.assert_clean()
