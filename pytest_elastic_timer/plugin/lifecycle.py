"""The session around the tests: the watchdog started and stopped, the environment
that keeps child processes in the session, the session's own budget
(``--expires-session``), and a watchdog lost on the way."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Callable, Generator, Iterator, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

import pytest

from pytest_elastic_timer.core import startup, unpatched
from pytest_elastic_timer.core.plain_imports import plainly
from pytest_elastic_timer.plugin import launcher, leaks, torch_timer_file
from pytest_elastic_timer.plugin.state import (
    SESSION,
    SessionState,
    any_item_asks_for,
    is_worker,
    uses_xdist,
    worker_id,
)
from pytest_elastic_timer.scope import client, scopes
from pytest_elastic_timer.scope.scopes import ScopeExpired, TimerRequest

if TYPE_CHECKING:
    from pytest_elastic_timer.plugin.session_facts import SessionFacts

SESSION_END_GRACE = 5.0  # for the session's end (summary, reports) after its interrupt
SESSION_SCOPE = "session"  # the name of the session's own scope (--expires-session)
# The phase of a pytest process after collection and between two tests: in an xdist
# worker, xdist's loop that waits for the controller's next test.
BETWEEN_TESTS = "between tests"
TEST_PHASES = ("setup", "call", "teardown")


def session_facts(config: pytest.Config, state: SessionState) -> dict[str, Any]:
    """The facts of the JSON report's ``session`` object that the plugin knows."""
    settings = state.settings
    return {
        "pid": unpatched.getpid(),
        "expires": settings.expires,
        "grace": settings.grace,
        "scale": settings.scale,
        "args": list(config.invocation_params.args),
    }


def start_watchdog(config: pytest.Config, state: SessionState) -> None:
    """Start the session's watchdog and export where it is to every child process; a
    watchdog that cannot start leaves scopes enforced in-process, with a warning.

    Nothing waits for the watchdog to come up: its socket listens already, and this
    process's first deadline has a thread wait for its answer. One that never comes up
    is noticed by that thread and the other clients, as end-of-file on their
    connections."""
    settings = state.settings
    state.children_before = leaks.pids_of(leaks.snapshot())
    defer = 0.0 if waits_for_watchdog(config, state) else launcher.DEFER_UNWAITED
    try:
        handle = launcher.start(
            grace=settings.grace,
            scale=settings.scale,
            report=settings.report,
            session=session_facts(config, state),
            dump_signal=startup.session_dump_signal(),
            junit_xml=_junit_path(config),
            trace=bool(settings.trace),
            defer=defer,
        )
    except (launcher.WatchdogError, OSError) as exc:  # spawning it failed
        warn_without_watchdog(config, f"{exc}; scopes are enforced in-process only")
        if not state.ends_with_its_process:
            _on_its_own(state)  # not on the outer session's watchdog either
        return
    state.watchdog = handle
    _export(
        state,
        _but_the_users_timer_file(
            {
                client.ENV_ADDRESS: handle.address,
                client.ENV_SCALE: repr(settings.scale),
                client.ENV_TRACE: "1" if settings.trace else None,
                startup.ENV_DUMP_SIGNAL: str(startup.session_dump_signal()),
                startup.ENV_TORCH_TIMER_FILE: os.path.join(
                    handle.directory, startup.TORCH_TIMER_FIFO
                ),
                "PYTHONPATH": startup.python_path(os.environ.get("PYTHONPATH")),
            }
        ),
    )
    state.put_back_scopes = scopes.set_aside()
    # Connect now; the answer to our hello is not waited for (see ProcessState).
    process = scopes.process_state()
    process.welcome_in_background = True
    if defer:
        process.before_welcome = _hurry_for_early_deadlines(handle)


def _hurry_for_early_deadlines(handle: launcher.WatchdogHandle) -> Callable[[float], None]:
    """What this process does with a deadline it enters before its watchdog, which
    loads late, has answered: hurry it if it would load too late for that deadline."""
    hurry_before = unpatched.monotonic() + launcher.HURRY_WITHIN

    def deadline_before_welcome(deadline: float) -> None:
        if deadline < hurry_before:
            handle.hurry()

    return deadline_before_welcome


def _junit_path(config: pytest.Config) -> str | None:
    """The file pytest's JUnit XML goes to, for the watchdog's fallback file: with
    ``~`` and ``$VARIABLES`` expanded, as pytest does (the CI outputs load only where
    they are used)."""
    if not config.getoption("xmlpath", None):
        return None
    with plainly():
        from pytest_elastic_timer.ci.junit import junit_path

    return junit_path(config)


def warn_without_watchdog(config: pytest.Config, text: str) -> None:
    """Say that a watchdog could not start, with a warning; where warnings are errors
    (``-W error``, ``filterwarnings = error``), on stderr instead. Raised during
    configure, the warning would end pytest with an INTERNALERROR before any test ran,
    where the session runs on with its scopes enforced in-process."""
    warning = pytest.PytestWarning(f"pytest-elastic-timer: {text}")
    try:
        config.issue_config_time_warning(warning, stacklevel=3)
    except pytest.PytestWarning:
        sys.stderr.write(f"{warning}\n")


def _but_the_users_timer_file(values: dict[str, str | None]) -> dict[str, str | None]:
    """``values`` without ``TORCHELASTIC_TIMER_FILE`` where the user set it to a
    ``FileTimerServer`` of their own (checked before the address changes): their
    server enforces their requests, and a session inside a test sees what it saw."""
    if not torch_timer_file.named_by_user():
        return values
    return {k: v for k, v in values.items() if k != startup.ENV_TORCH_TIMER_FILE}


def _export(state: SessionState, values: dict[str, str | None]) -> None:
    """Set the session's environment (None: unset, not inherited from an outer session
    either); :func:`restore_environment` puts back what each name was before the
    session first set it."""
    for name, value in values.items():
        state.previous_env.setdefault(name, os.environ.get(name))
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def starts_watchdog_at_once(config: pytest.Config, state: SessionState) -> bool:
    """Whether the session starts its watchdog at configure.

    The command line's session does, always: any test may start a process that enters
    scopes. A session that a test runs in-process (pytester, ``pytest.main``) does only
    where an option or ini value of the plugin is given, or it starts xdist workers;
    otherwise :func:`defer_watchdog`. Another plugin's test suite runs thousands of
    such sessions, most of which use nothing of this plugin, and a watchdog costs a
    Python process's start: more CPU than such a session's own run."""
    if state.has_no_session_of_its_own:
        return False
    # xdist registers its controller (uses_xdist) after this plugin's configure.
    starts_workers = config.getoption("dist", "no") not in ("no", None)
    return state.ends_with_its_process or state.used or starts_workers or uses_xdist(config)


def defer_watchdog(state: SessionState) -> None:
    """Leave the watchdog of a session run in-process by a test (see
    :func:`starts_watchdog_at_once`) to :func:`start_watchdog_if_needed`.

    Until it starts, the session is on its own: its scopes, and those of the processes
    its tests start, are enforced in-process (the environment names no watchdog, not
    even an outer session's, whose records they must not join).

    A configuration with no session of its own (:func:`has_no_session_of_its_own`)
    never starts one, and leaves the process as the calling test has it: the scopes
    of items that test runs itself are that test's session's."""
    state.watchdog_on_demand = True
    if not state.has_no_session_of_its_own:
        _on_its_own(state)


def _on_its_own(state: SessionState) -> None:
    """A session run in-process with no watchdog of its own (not yet, or one that
    could not start): the environment names none, and the process's scope state is
    set aside, as for a watchdog of its own."""
    _export(
        state,
        _but_the_users_timer_file(
            {
                client.ENV_ADDRESS: None,
                client.ENV_SCALE: repr(state.settings.scale),
                client.ENV_TRACE: None,
                startup.ENV_DUMP_SIGNAL: None,
                startup.ENV_TORCH_TIMER_FILE: None,
            }
        ),
    )
    state.put_back_scopes = scopes.set_aside()
    scopes.process_state().set_nodeid("")  # not the outer session's test


# What a test asks for when it asks for the session's watchdog.
WATCHDOG_FIXTURES = frozenset({"elastic_timer", "elastic_timer_server"})


def start_watchdog_if_needed(
    config: pytest.Config, state: SessionState, items: Sequence[pytest.Item]
) -> bool:
    """After collection, for a session whose watchdog waits for a need: start it if
    a test to run (``items``, the selected ones) has a budget or asks for a fixture of
    the plugin by its arguments. True if it started; one that cannot start leaves the
    session on its own, with a warning."""
    if not state.watchdog_on_demand or config.getoption("collectonly", False):
        return False
    if not state.budgets.any_budget_among(items) and not any_item_asks_for(
        items, WATCHDOG_FIXTURES
    ):
        return False
    state.watchdog_on_demand = False
    put_back, state.put_back_scopes = state.put_back_scopes, _nothing
    put_back()  # closes the in-process state of collection; a connected one follows
    start_watchdog(config, state)
    return state.watchdog is not None


def _nothing() -> None:
    pass


def stop_watchdog(config: pytest.Config, state: SessionState, end: dict[str, Any]) -> None:
    """Stop the session's watchdog; wait for it only where something must be read back
    or nothing would be left to reap it."""
    assert state.watchdog is not None
    process = scopes.current_state()
    if process is not None:
        process.send_unsent_before_leaving()
    nested = not state.ends_with_its_process
    if nested and not _writes_files(config, state) and _not_up_and_alone(state):
        state.watchdog.discard()  # waiting would cost its whole start-up
    else:
        state.watchdog.stop(end, wait=waits_for_watchdog(config, state))


def waits_for_watchdog(config: pytest.Config, state: SessionState) -> bool:
    """Whether this session waits for its watchdog at its end: it writes files the user
    reads after pytest, or it runs in-process inside another pytest (pytester), which it
    leaves as it found it: no child to reap later, no pidfd open."""
    return _writes_files(config, state) or not state.ends_with_its_process


def _writes_files(config: pytest.Config, state: SessionState) -> bool:
    """Whether the watchdog writes files the user reads after pytest: the JSON report,
    and the JUnit file, which is the watchdog's only if pytest died (waited for all the
    same)."""
    return bool(state.settings.report or config.getoption("xmlpath", None))


def _not_up_and_alone(state: SessionState) -> bool:
    """Whether the watchdog has not answered this process's hello, the first connection
    it serves (so it has looked at no table and made no record), and no other process
    of the session is left that it would end at the session's end."""
    process = scopes.current_state()
    if process is None or process.answered() or state.watchdog is None:
        return False
    started = leaks.pids_of(leaks.snapshot()) - state.children_before
    return started <= {state.watchdog.pid}


def ends_with_its_process(config: pytest.Config) -> bool:
    """Whether ``config``'s session is the command line's own, the only one on the
    stack, so its process is not a session's that goes on after it (pytester's
    in-process runs, ``pytest.main`` in a test, and pytester's ``getitem()``,
    ``parseconfigure()`` and the like, which configure pytest without a session): that
    one is left as this session found it, with no child to reap later.

    Sessions are pytest's own ``wrap_session`` frames: every way to start a session
    in-process passes through it, on every pytest this plugin supports, and its
    ``config`` says whose it is."""
    sessions = _sessions_on_the_stack()
    if not sessions:  # configured with no session at all, not inside one either
        return True
    return len(sessions) == 1 and sessions[0] is config


def has_no_session_of_its_own(config: pytest.Config) -> bool:
    """Whether ``config`` is configured inside another session without a session of
    its own: pytester's ``getitem()``, ``getitems()``, ``getmodulecol()`` and
    ``parseconfigure()``, which collect (or only configure) within the calling test
    and run no test loop, and are unconfigured only at that test's teardown."""
    sessions = _sessions_on_the_stack()
    return bool(sessions) and all(session is not config for session in sessions)


def _sessions_on_the_stack() -> list[object]:
    """The configs of pytest's ``wrap_session`` frames on the calling thread's stack,
    innermost first."""
    frame: FrameType | None = sys._getframe(1)
    sessions: list[object] = []
    while frame is not None:
        code = frame.f_code
        if code.co_name == "wrap_session" and code.co_filename.endswith(_PYTEST_MAIN):
            sessions.append(frame.f_locals.get("config"))
        frame = frame.f_back
    return sessions


_PYTEST_MAIN = os.path.join("_pytest", "main.py")


def restore_environment(state: SessionState) -> None:
    for name, value in state.previous_env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def enter_session_scope(session: pytest.Session, state: SessionState) -> None:
    """The session's budget (``--expires-session``) begins."""
    config = session.config
    budget = state.settings.session
    if not is_worker(config) and uses_xdist(config):
        # Workers enforce the same budget on themselves; the controller waits for
        # their reports first, so it gets the ladder's time on top: past the workers'
        # own ladder (grace + the session's end grace + kill time), so that a hung
        # worker is named by its own expiry first.
        budget += 2 * state.settings.grace + SESSION_END_GRACE + 5.0
    state.session = session
    # After the interrupt the session still has to end (summary, reports): that gets
    # a few seconds on top of the usual grace before the watchdog steps in.
    scope = TimerRequest(budget, SESSION_SCOPE, grace=state.settings.grace + SESSION_END_GRACE)
    scope.detached = True
    scope.on_expire = lambda exc: _end_session(state, exc)
    scope.at = (str(config.rootpath), 0)
    scope.acquire()
    state.session_scope = scope


def leave_session_scope(state: SessionState) -> None:
    if state.session_scope is not None and state.session_scope.active:
        try:
            state.session_scope.release()
        except ScopeExpired:
            pass  # already reported: the session overran while it was ending


def _end_session(state: SessionState, exc: ScopeExpired) -> BaseException | None:
    """A session over its budget stops where it is, with the scope line as reason."""
    phase = scopes.process_state().phase()
    session = state.session
    # This session's own worker id: a pytest run by a worker's test inherits the
    # worker's PYTEST_XDIST_WORKER, and is no worker.
    worker = worker_id(session.config) if session is not None else ""
    reason = state.stop_reason = session_stop_reason(exc.line(), phase, worker)
    if worker:
        return _end_worker_session(state, exc, reason, phase)
    if session is not None:
        # Where the exception is caught (a fixture finalizer records it as a teardown
        # error), the session must still not start another test.
        session.shouldstop = reason
    if phase in TEST_PHASES:
        state.interrupted_test = (scopes.process_state().nodeid, phase)
    # Not a ScopeExpired, even in a test: code may catch that (it is a TimeoutError),
    # and it may land in the reporting hooks after a phase, outside pytest's catch.
    return pytest.exit.Exception(reason)


def session_stop_reason(line: str, phase: str, worker: str) -> str:
    """Why the session stops for its budget: the scope line, then where it ran out
    (``... expired after 3.00s (budget 3s): interrupted (phase collection, gw1)``), as
    a worker says it and as the controller says it for a worker it had to see ended."""
    where = ", ".join(x for x in (f"phase {phase}" if phase else "", worker) if x)
    return f"{line} ({where})" if where else line


def _end_worker_session(
    state: SessionState, exc: ScopeExpired, reason: str, phase: str
) -> BaseException | None:
    """An xdist worker over the session's budget fails where it is and stops; the
    controller stops the whole session with ``reason``.

    Not with Exit, nor ``shouldstop``, which pytest's collection turns into Interrupted:
    xdist takes either in a worker for Ctrl-C, and replaces the worker, which collects
    (and hangs) again. ``shouldfail`` stops collection (with Failed, at the next
    collector) and xdist's test loop (after the test) the same way, and the worker hands
    it to the controller, which stops the session with it."""
    if state.session is not None:
        state.session.shouldfail = reason
    if phase == BETWEEN_TESTS:
        # In xdist's loop, waiting for the controller's next test (or its shutdown):
        # nothing of the worker's own to interrupt, and an exception there would be an
        # internal error of xdist. It starts no test from now on (see
        # stop_worker_after_the_budget), and is not ended either: a worker stuck in
        # a test or in collection, whose expiry comes at the same time, is the one
        # that names why the session stops. The controller's own, longer budget
        # bounds the wait.
        if state.session_scope is not None:
            state.session_scope.cancel()
        return None
    if phase in ("setup", "call") and _between_phases():
        # pytest makes or logs the phase's report (a conftest's hook that takes long):
        # raised there, outside the phase, where nothing catches a test's exception,
        # it would be an internal error of the worker, and the test would have no
        # outcome. The hook runs on (one that hangs is ended by the ladder, as a test
        # in a C call is); a test whose setup is over fails at the start of its call,
        # by this exception (see running.call), one whose call is over keeps its
        # outcome, and the worker starts no test after it.
        if phase == "setup":
            state.expired_before_the_call = exc
        return None
    return exc


def _between_phases() -> bool:
    """Whether the calling thread is in pytest's own running of a test's protocol but
    not inside one of its phases (``CallInfo.from_call``, which catches what a phase
    raises): making or logging a phase's report. Looked at only as the session's budget
    runs out, in its signal handler, whose frames lead to where it landed."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_filename.endswith(_PYTEST_RUNNER):
            if code.co_name == "from_call":
                return False
            if code.co_name in ("call_and_report", "runtestprotocol"):
                return True
        frame = frame.f_back
    return False


_PYTEST_RUNNER = os.path.join("_pytest", "runner.py")


class SessionHooksBudget:
    """The session's budget running out in another plugin's ``pytest_sessionstart`` or
    ``pytest_sessionfinish`` (a conftest hook that starts or tears down a cluster,
    say): registered where the session has a budget, its wrappers are the innermost,
    around every such hook, and catch the exception that ended the hook.

    In an xdist worker's sessionstart, the ScopeExpired would end the worker's session
    as an internal error (of xdist's too): the worker goes on to its collection
    instead, which stops at once (:func:`collection_of_worker`) with the reason the
    controller stops the session with. In sessionfinish, after the tests ran, the
    exception would skip the summary and leave the exit status as the tests made it:
    the summary is written, the exit status is 2 (as when the budget stops the
    session during the tests), and a worker hands the reason to the controller
    (:data:`STOPPED_IN_SESSIONFINISH`), which stops the session with it. The same in
    ``pytest_terminal_summary``, which the terminal reporter calls after every
    ``pytest_sessionfinish`` hook ran (outside their wrappers): pytest takes the Exit
    there for a note on stderr and keeps the status the tests made.

    ``own_summary`` is the plugin's own ``pytest_terminal_summary``, written all the
    same where another one was cut short before it."""

    def __init__(
        self, state: SessionState, own_summary: Callable[[Any, int, pytest.Config], None]
    ) -> None:
        self.state = state
        self.own_summary = own_summary

    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_sessionstart(self, session: pytest.Session) -> Generator[None, object, object]:
        try:
            return (yield)
        except ScopeExpired:
            if not (is_worker(session.config) and self._ran_out_here(session)):
                raise
            return None

    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> Generator[None, object, object]:
        # Run out before (in a test, say): the session was stopped there already.
        before = session_budget_ran_out(self.state)
        try:
            result = yield
        except (ScopeExpired, pytest.exit.Exception):
            if before or not self._ran_out_here(session):
                raise
        else:
            # Also where the hook caught the exception itself (``except Exception``):
            # the budget ran out all the same, as a test that catches it stops the
            # session all the same.
            if before or not self._ran_out_here(session):
                return result
        reason = self.state.stop_reason
        _interrupted(self.state)
        output: dict[str, Any] | None = getattr(session.config, "workeroutput", None)
        if is_worker(session.config) and output is not None:
            output[STOPPED_IN_SESSIONFINISH] = reason
        else:
            reporter = session.config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                reporter.write_line(f"Interrupted: {reason}")
        return None

    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_terminal_summary(
        self, terminalreporter: Any, exitstatus: int, config: pytest.Config
    ) -> Generator[None, object, object]:
        before = session_budget_ran_out(self.state)
        session = self.state.session
        try:
            result = yield
        except (ScopeExpired, pytest.exit.Exception):
            if before or session is None or not self._ran_out_here(session):
                raise
        else:
            if before or session is None or not self._ran_out_here(session):
                return result
        _interrupted(self.state)
        terminalreporter.write_line(f"Interrupted: {self.state.stop_reason}")
        if not self.state.summary_written:  # cut short before the plugin's own ran
            self.own_summary(terminalreporter, exitstatus, config)
        return None

    def _ran_out_here(self, session: pytest.Session) -> bool:
        state = self.state
        return (
            bool(state.stop_reason) and state.session is session and session_budget_ran_out(state)
        )


def stopped_in_unconfigure(config: pytest.Config, exc: BaseException | None, before: bool) -> bool:
    """Whether the session's budget ran out in the other plugins' ``pytest_unconfigure``
    (``before``: whether it had run out before them): ``exc`` raised by one of them is
    that budget's, or None where they returned (a hook that caught the exception
    itself). If so, the session ends with exit status 2 and the reason on stderr (the
    exception would end pytest with a traceback, status 1)."""
    state = config.stash.get(SESSION, None)
    if (
        state is None
        or (exc is None and before)
        or (exc is not None and not isinstance(exc, (ScopeExpired, pytest.exit.Exception)))
        or not state.stop_reason
        or not session_budget_ran_out(state)
    ):
        return False
    _interrupted(state)
    if not is_worker(config) or state.other_host:
        # A worker on the controller's host is not heard: its controller, which finds
        # the watchdog's record once the worker has ended, says it (see
        # stopped_by_a_worker_at_its_end).
        sys.stderr.write(f"Interrupted: {state.stop_reason}\n")
    return True


def stopped_by_a_worker_at_its_end(
    session: pytest.Session, state: SessionState, reason: str
) -> None:
    """The session's budget ran out in an xdist worker after the worker had finished
    its session and handed over its results (in a conftest's ``pytest_unconfigure``):
    the controller learns it from the watchdog's record once the worker has ended, and
    the session ends as one its budget stopped; the summary says why."""
    state.stop_reason = state.stopped_at_a_worker_end = reason
    _interrupted(state)


def _interrupted(state: SessionState) -> None:
    """The session ends as one its budget stopped: exit status 2."""
    state.exitstatus = int(pytest.ExitCode.INTERRUPTED)
    if state.session is not None:
        state.session.exitstatus = pytest.ExitCode.INTERRUPTED


# The key of an xdist worker's output that says why the session stops: its budget ran
# out in the worker's pytest_sessionfinish (see SessionHooksBudget).
STOPPED_IN_SESSIONFINISH = "elastic_timer_stopped_in_sessionfinish"


def session_budget_ran_out(state: SessionState) -> bool:
    """Whether the session's own budget (``--expires-session``) has run out."""
    scope = state.session_scope
    return scope is not None and scope.expired()


@contextlib.contextmanager
def collection_of_worker(session: pytest.Session) -> Iterator[None]:
    """Around an xdist worker's collection: a ScopeExpired of the session's budget that
    left it outside every collector (a plugin's hook) would be an internal error; the
    worker stops (Failed) instead, with the reason the controller stops the session
    with (see :func:`stop_worker_after_the_budget`)."""
    stop_worker_after_the_budget(session)  # it ran out in the worker's sessionstart
    try:
        yield
    except ScopeExpired as exc:
        if not is_worker(session.config) or exc.scope != SESSION_SCOPE or not session.shouldfail:
            raise
        raise session.Failed(session.shouldfail) from exc


def stop_worker_after_the_budget(session: pytest.Session) -> None:
    """An xdist worker whose session budget ran out (in collection, or while it waited
    for a test) stops: Failed, with the reason the controller stops the session with,
    before it hands the controller its collection (which would differ from the other
    workers') or starts a test."""
    if not session.shouldfail:  # every test asks: the common answer first
        return
    state = session.config.stash.get(SESSION, None)
    if state is not None and is_worker(session.config) and session_budget_ran_out(state):
        raise session.Failed(session.shouldfail)


def watchdog_lost(item: pytest.Item) -> None:
    """Say it loudly: from here on hung C calls and spawned processes go unchecked."""
    state = item.config.stash[SESSION]
    process = scopes.process_state()
    pid = state.watchdog.pid if state.watchdog else process.watchdog_pid
    if process.refused:
        what = f"the session's watchdog refused this process ({process.refused})"
    elif process.welcomed:
        what = f"{state.watchdog_named(pid)} died"
    else:  # no answer to the hello ever came: it ended before it served anyone
        what = f"{state.watchdog_named(pid)} did not start, or ended,"
    why = (
        f"{what} before {item.nodeid}; scopes are enforced in-process from then on "
        "(no stack dumps, no termination of hung processes)"
    )
    state.lose_watchdog(why)
    reporter = item.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"\nelastic-timer: {why}", red=True, bold=True)
    warnings.warn(pytest.PytestWarning(f"elastic-timer: {why}"), stacklevel=1)


def check_watchdog(session: pytest.Session, state: SessionState) -> None:
    """At the session's end: a watchdog that died after the last per-test look (in the
    last test, say) is still reported, and fails the session."""
    watchdog = state.watchdog
    told = watchdog is not None and state.watchdog_named(watchdog.pid) in state.lost_watchdog
    if watchdog is not None and not told and not watchdog.alive():
        state.watchdog_died(watchdog.pid)
    if state.lost_watchdog and state.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED  # the guarantees did not hold
        state.exitstatus = int(session.exitstatus)  # as the report and the hooks say it


def facts_for_hooks(config: pytest.Config, state: SessionState) -> SessionFacts:
    """What the plugin's session hooks are given."""
    with plainly():  # at the end only
        from pytest_elastic_timer.plugin.session_facts import SessionFacts

    settings = state.settings
    book = state.budgets
    return SessionFacts(
        pid=unpatched.getpid(),
        args=list(config.invocation_params.args),
        started=state.started,
        rootdir=str(config.rootpath),
        scale=settings.scale,
        default_call=book.default_call(),
        report=settings.report,
        trace=settings.trace,
        slow=settings.slow,
        directory=state.watchdog.directory if state.watchdog else "",
        exitstatus=state.exitstatus,
        expired=state.expired,
        budgets=book.marked(),
    )


def report_without_watchdog(
    config: pytest.Config, state: SessionState, end: dict[str, Any]
) -> None:
    """The watchdog died before the end of the session, so it writes no JSON report:
    write one from the records it made while it ran (later expiries were enforced
    in-process and are in pytest's own reports only)."""
    settings = state.settings
    assert state.watchdog is not None and settings.report
    lost = state.lost_watchdog or f"the watchdog (pid {state.watchdog.pid}) died"
    session = {
        **session_facts(config, state),
        "started": state.started,
        "ended": unpatched.now(),
        "workers": [],
        "root_died": False,
        "watchdog_lost": lost,
        **end,
    }
    from pytest_elastic_timer.core import records  # only a watchdog that died leaves this to do

    found = records.read_records(state.watchdog.records_path)
    try:
        records.write_report(settings.report, found, session)
    except OSError as exc:
        warnings.warn(
            pytest.PytestWarning(f"elastic-timer: cannot write the report: {exc}"), stacklevel=2
        )
