"""The per-test path: a :class:`RunningTest` from a test's setup to the end of its
teardown, its phases, and the scopes of their budgets.

Every test pays three hook implementations here (see docs/design.md, "What a test
costs"): a plain hook for setup, a wrapper for the call phase and one for the teardown,
which also ends the test. The wrappers that give setup and teardown budgets of their own
(:class:`PhaseBudgets`) are registered only once a collected test has one.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Generator
from typing import Any

import pytest

from pytest_elastic_timer.core import unpatched
from pytest_elastic_timer.core.plain_imports import plainly
from pytest_elastic_timer.plugin import leaks
from pytest_elastic_timer.plugin.budgets import Budgets
from pytest_elastic_timer.plugin.lifecycle import BETWEEN_TESTS, watchdog_lost
from pytest_elastic_timer.plugin.state import SESSION, SessionState, session_directory
from pytest_elastic_timer.scope import scopes
from pytest_elastic_timer.scope.scopes import TimerRequest

# A test may replace time's functions with mocks, and what the plugin does inside that
# test (or inside a session that test runs) must not call them.
_monotonic = unpatched.monotonic


def watch_failures(config: pytest.Config) -> None:
    """From now on, failed reports are looked at (a test failed, or a scope expired).

    The modules that make those reports (:mod:`.expiry`, and :mod:`.xdist_support` and
    the records it reads) are imported here, at the first failure: a session whose
    tests pass never loads them.
    """
    with plainly():
        from pytest_elastic_timer.plugin import expiry

    expiry.register_reports(config)
    config.stash[_WATCHING_FAILURES] = True
    manager = config.pluginmanager
    if manager.has_plugin(ReportsOnFirstUse.NAME):
        manager.unregister(name=ReportsOnFirstUse.NAME)  # the plugins are here now


_WATCHING_FAILURES = pytest.StashKey[bool]()


def watch_failures_soon(config: pytest.Config) -> None:
    """:func:`watch_failures` at the next report pytest makes, for that report too.

    For a scope's expiry: the listeners run inside the interrupt's signal handler,
    before the ScopeExpired is raised, and importing the report plugins there held it
    back by 3 to 15 ms at a process's first expiry. Registering a stand-in costs
    0.2 ms, and covers every report that follows, however it is made (unittest keeps
    a test's error until the report, subtests make theirs inside the call, the
    ScopeExpired may go to another thread)."""
    manager = config.pluginmanager
    if config.stash.get(_WATCHING_FAILURES, False) or manager.has_plugin(ReportsOnFirstUse.NAME):
        return
    manager.register(ReportsOnFirstUse(config), ReportsOnFirstUse.NAME)


class ReportsOnFirstUse:
    """Stands in for the failed-report plugins until the next report is made, then
    loads them and hands them that report (:func:`watch_failures_soon`)."""

    NAME = "elastic_timer_reports_on_first_use"

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        # The plugins registered now take the reports to come; this one is already
        # being made without them.
        with scopes.holding_interrupts():
            try:
                watch_failures(self.config)
            except Exception:
                return report  # tried again at the next failure
            from pytest_elastic_timer.plugin import expiry

            expiry.describe_failure(item, call, report)
        return report


def watch_failures_of(config: pytest.Config, exc: BaseException) -> None:
    """:func:`watch_failures` for a phase that ends in ``exc``, before pytest makes its
    report. A skip is no failure. The phase's own exception is what its report must
    show, so loading that fails here is tried once more, then left for the next
    failure to try again. An interrupt (a scope still open: the session's, one a
    conftest's hook wrapper entered) waits for the loading, which it would cut short
    and be lost in."""
    if not isinstance(exc, pytest.skip.Exception):
        try_watch_failures(config)


def try_watch_failures(config: pytest.Config) -> bool:
    """:func:`watch_failures`, tried twice, with interrupts held meanwhile (see
    :func:`watch_failures_of`); whether the plugins are loaded."""
    with scopes.holding_interrupts():
        for _ in range(2):
            try:
                watch_failures(config)
                return True
            except Exception:
                continue
    return False


class RunningTest:
    """What this process knows of the test it runs, from its setup to the end of its
    teardown."""

    def __init__(self, item: pytest.Item, state: SessionState) -> None:
        self.item = item
        self.nodeid = item.nodeid
        self.name = item.name
        self.state = state
        self.process = scopes.process_state()
        self.stack = scopes.thread_stack()
        self.depth = len(self.stack)  # scopes above this depth are the test's own
        self.outer_prefix = self.stack.prefix
        self.outer_sid = self.process.nodeid_sid
        self.definition = place(item, state)
        self.process.set_test(self.nodeid, self.name, *self.definition)
        self.children: bytes | None = None  # this process's children when the call began
        self.call_scope: TimerRequest | None = None
        self.tracing = self.process.trace is not None
        self.started = 0.0  # when the phase began, for the trace timeline (when tracing)
        self.when = ""
        # A scope of this process expired during the test: its run was cut short by
        # the plugin, so the processes it leaves are ended even under "warn".
        self.interrupted = False

    def switch(self, when: str, *, named: bool = True) -> None:
        """The phase ``when`` begins (once): the phase before it is traced, the table
        names the new one, and scopes the phase before left open are closed.
        ``named``: no scope of its own names the phase, the stack's prefix does."""
        __tracebackhide__ = True  # a warning made an error: the user's, not ours
        ending = self.stack.prefix
        self.stack.prefix = f"{self.name}::{when}" if named else self.outer_prefix
        if self.when != when:
            if self.tracing:
                self._trace_phase(ending)
            self.when = when
            self.process.set_phase(when)
            if len(self.stack) > self.depth:
                # Last: its warning raises under -W error.
                scopes.close_above(self.stack, self.depth, ending)

    def finish(self) -> None:
        """After the test's teardown: its scopes are over, its leftover processes found."""
        __tracebackhide__ = True  # a warning made an error: the user's, not ours
        ending = self.stack.prefix
        if self.tracing:
            self._trace_phase(ending)
        self.when = ""
        if self.interrupted:
            self.item.stash[_INTERRUPTED] = True
        self.stack.prefix = self.outer_prefix
        try:
            if len(self.stack) > self.depth:
                scopes.close_above(self.stack, self.depth, ending)
        finally:  # a warning made an error (-W error) is the test's; the rest still runs
            self._leave()

    def _leave(self) -> None:
        """The process is back between tests, or in the test that runs this one; the
        test's leftover processes are looked for."""
        # Back to the test that runs this session in-process, if any, where the two
        # share the process's scope state (a test that runs items itself).
        outer = _running[-1] if _running else None
        if outer is None or outer.process is not self.process:
            self.process.restore_test("", self.outer_sid, BETWEEN_TESTS)
        else:
            self.process.restore_test(outer.nodeid, self.outer_sid, outer.when)
        before = self.children
        if before is not None:
            after = leaks.snapshot()
            if after != before:
                self._check_leaks(before, after)
        fifo = self.state.torch_timer_file
        if fifo is not None:
            fifo.check(self.process)

    def phase_scope(self, when: str, budgets: Budgets) -> TimerRequest:
        """The scope of phase ``when`` with its budget (not entered yet)."""
        return scopes.phase_scope(
            self.name, when, getattr(budgets, when), budgets.grace, self.definition
        )

    def _trace_phase(self, name: str) -> None:
        """The timeline shows every phase without a scope of its own (``name``, the
        stack's prefix in it). What the phase traced is written now: should the process
        be ended in the next one (stuck in C, where it runs no more Python), it is not
        lost with it."""
        if self.when and name != self.outer_prefix:
            self.process.traced(name, self.started, self.stack.tid, False)
        self.process.flush_trace()
        self.started = _monotonic()

    def _check_leaks(self, before: bytes, after: bytes) -> None:
        state = self.state
        ours = {state.watchdog.pid} if state.watchdog else set()
        new = leaks.pids_of(after) - leaks.pids_of(before) - ours
        if not self.interrupted and not state.warns_of_leaks(
            session_directory(self.item.config), new
        ):
            return  # a session that does not use the plugin: left as it is
        new = {p for p in new if not leaks.is_service(p)}
        if not new:
            return
        if not self.interrupted:
            new = leaks.still_running_after(new)
            if not new:
                return
        mode = state.settings.leaks
        # A test the plugin interrupted did not get to stop what it started (an
        # mp.spawn whose join was cut short would keep pytest from exiting): the
        # interruption is the plugin's, and so is the clean-up.
        end = mode == "kill" or self.interrupted
        left = leaks.end_leaks(new) if end else leaks.describe_running(new)
        if left:
            names = ", ".join(
                f"{p['pid']} ({' '.join(str(p['cmdline']).split())[:80] or p['name']})"
                for p in left
            )
            done = "ended" if end else "still running"
            if state.other_host:  # the pids are that host's
                done += f", on host {state.other_host}"
            warnings.warn(
                pytest.PytestWarning(
                    f"{self.nodeid} left {len(left)} process(es) running after its teardown "
                    f"({done}): {names}"
                ),
                stacklevel=1,
            )


# The tests running in this process, innermost last: a test can run a pytest session
# in-process (pytester), whose tests run inside its call phase. Per process, not per
# session, for that reason.
_running: list[RunningTest] = []


def note_expiry() -> None:
    """A scope of this process expired: the innermost running test was interrupted."""
    if _running:
        _running[-1].interrupted = True


def interrupted_here(item: pytest.Item) -> bool:
    """Whether a scope of this process expired during ``item`` (so far; also once the
    test ended, for the report of its teardown, which pytest makes after that)."""
    running = current(item)
    if running is not None:
        return running.interrupted
    return item.stash.get(_INTERRUPTED, False)


_INTERRUPTED = pytest.StashKey[bool]()


def current(item: pytest.Item) -> RunningTest | None:
    """The running test of ``item``, if this plugin saw its setup begin."""
    return _running[-1] if _running and _running[-1].item is item else None


def place(item: pytest.Item, state: SessionState) -> tuple[str, int]:
    """Where the test is defined: the absolute file and 1-based line of its report."""
    path, line, _ = item.location  # computed (and cached) by pytest before setup
    return state.file_of(path), (line or 0) + 1


def phase_scope(item: pytest.Item, when: str, budgets: Budgets) -> TimerRequest:
    """The scope of the phase ``when`` of ``item`` with its budget (not entered yet)."""
    running = current(item)
    if running is not None:
        return running.phase_scope(when, budgets)
    at = place(item, item.config.stash[SESSION])
    return scopes.phase_scope(item.name, when, getattr(budgets, when), budgets.grace, at)


def budgets_or_fail(item: pytest.Item) -> Budgets:
    """The item's budgets; a bad marker (added after collection) fails the test."""
    try:
        return item.config.stash[SESSION].budgets.of(item)
    except ValueError as exc:
        error = str(exc)
    pytest.fail(error, pytrace=False)  # outside the except: one error, not a chain of two


def begin(item: pytest.Item, *, named: bool = True) -> None:
    """The test's setup begins: the watchdog still there, the test's name for records.
    ``named``: the setup's name is the prefix of the scopes entered in it."""
    running = current(item)
    if running is not None:
        if running.when == "setup":
            return  # a wrapper for the setup budget did it already
        _running.pop().finish()  # the same test runs again (a plugin that reruns tests)
    state = item.config.stash[SESSION]
    if state.budgets.errors:  # a bad marker: this test's error, before its fixtures
        state.budgets.check(item)
    running = RunningTest(item, state)
    _running.append(running)
    running.switch("setup", named=named)
    process = running.process
    if (
        process.sock is not None
        and _monotonic() - process.alive_checked >= 1.0
        and not process.watchdog_alive()
    ):
        watchdog_lost(item)


def call(item: pytest.Item) -> Generator[None, None, None]:
    """The call phase, within the test's call budget."""
    __tracebackhide__ = True  # a failure passing through is the test's, not ours
    running = current(item)
    if running is None:
        return (yield from _call_of_unknown_test(item))
    budgets = running.state.budgets.by_item.get(item) or budgets_or_fail(item)
    if running.state.settings.leaks != "off":
        running.state.watch_for_leaks()
        running.children = leaks.snapshot()
    running.switch("call", named=budgets.call is None)
    try:
        expired = running.state.expired_before_the_call
        if expired is not None:  # the session's budget, in a worker (see lifecycle)
            running.state.expired_before_the_call = None
            raise expired
        if budgets.call is None:
            return (yield)
        scope = running.call_scope = scopes.enter_test_phase(
            running.phase_scope("call", budgets), running.stack
        )
        put_back = run_coroutine_in_task_of(item, scope)
        try:
            result = yield
        except BaseException as exc:
            put_back()
            scopes.leave_test_phase(scope, exc)
            raise
        put_back()
        scopes.leave_test_phase(scope, None)  # raises ScopeExpired if it overran
        return result
    except BaseException as exc:
        watch_failures_of(item.config, exc)
        raise


def run_coroutine_in_task_of(item: pytest.Item, scope: TimerRequest) -> Callable[[], None]:
    """A test function that is a coroutine function (run by pytest-asyncio, pytest-trio
    or anyio's plugin, which read ``item.obj`` when they run it) runs in a task that
    ``scope``, the call phase's, cancels at its deadline
    (:func:`~pytest_elastic_timer.scope.scopes.await_in_task_of`); returns the function
    that puts the test function back."""
    function = getattr(item, "obj", None)
    if not inspect.iscoroutinefunction(function):
        return _nothing
    assert function is not None

    @functools.wraps(function)
    async def in_task_of_the_phase(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        return await scopes.await_in_task_of(scope, function(*args, **kwargs))

    item.obj = in_task_of_the_phase  # type: ignore[attr-defined]  # a pytest.Function's

    def put_back() -> None:
        item.obj = function  # type: ignore[attr-defined]

    return put_back


def _nothing() -> None:
    pass


def _call_of_unknown_test(item: pytest.Item) -> Generator[None, None, None]:
    """The call phase of a test whose setup this plugin did not see begin."""
    __tracebackhide__ = True  # a failure passing through is the test's, not ours
    budgets = budgets_or_fail(item)
    try:
        if budgets.call is None:
            return (yield)
        with phase_scope(item, "call", budgets):
            return (yield)
    except BaseException as exc:
        watch_failures_of(item.config, exc)
        raise


def teardown(item: pytest.Item) -> Generator[None, None, None]:
    """The teardown, then the end of the test (one hook for both)."""
    __tracebackhide__ = True  # a failure passing through is the test's, not ours
    running = current(item)
    if running is None:
        return (yield)
    # Scopes the call left open are closed with a warning: made an error (-W error), it
    # fails this teardown once pytest's ran, or the next test would inherit the test.
    left_open: Exception | None = None
    try:
        running.switch("teardown")
    except Exception as exc:
        left_open = exc
    try:
        result = yield
    except BaseException as exc:
        watch_failures_of(item.config, exc)
        raise
    finally:
        # Leftover processes are found here, inside the teardown: a warning made an
        # error (-W error) fails the test's teardown.
        if _running and _running[-1] is running:
            _running.pop().finish()
    if left_open is not None:
        raise left_open
    return result


class PhaseBudgets:
    """Scopes for setup and teardown budgets (``expires(setup=..., teardown=...)``),
    registered once a collected test has one."""

    NAME = "elastic_timer_phase_budgets"

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, None, None]:
        __tracebackhide__ = True
        try:
            budgets: Budgets | None = item.config.stash[SESSION].budgets.of(item)
        except ValueError:
            budgets = None
        if budgets is None:  # a bad marker: begin() fails the test, inside every wrapper
            return (yield)
        # First: the scope's record names the test; the scope names the phase.
        begin(item, named=budgets.setup is None)
        if budgets.setup is None:
            return (yield)
        try:
            with phase_scope(item, "setup", budgets):
                return (yield)
        except BaseException as exc:
            watch_failures_of(item.config, exc)
            raise

    # Inside the plugin's own teardown wrapper (tryfirst), which began the phase, watches
    # failures when it raises, and ends the test after this scope ended.
    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Generator[None, None, None]:
        __tracebackhide__ = True
        if item in item.config.stash[SESSION].budgets.errors:
            return (yield)  # a bad marker: the test's setup failed with its error already
        budgets = budgets_or_fail(item)
        if budgets.teardown is None:
            return (yield)
        running = current(item)
        if running is not None:
            running.switch("teardown", named=False)  # the budget's scope names the phase
        with phase_scope(item, "teardown", budgets):
            return (yield)


def need_phase_budgets(config: pytest.Config) -> None:
    """Register :class:`PhaseBudgets` (once)."""
    if not config.pluginmanager.has_plugin(PhaseBudgets.NAME):
        config.pluginmanager.register(PhaseBudgets(), PhaseBudgets.NAME)
