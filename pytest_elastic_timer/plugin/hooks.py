"""The pytest plugin ``elastic_timer``: options, marker, phase scopes, fixtures, reports.

Hooks are laid out in the order pytest calls them. State lives in ``config.stash`` and
``item.stash``; the watchdog is started in ``pytest_configure`` of the controller (or
the only process) and stopped in ``pytest_unconfigure``.
"""

from __future__ import annotations

import functools
import math
import os
import time
import warnings
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
from _pytest._code.code import ExceptionChainRepr, ReprEntryNative, ReprExceptionInfo

from pytest_elastic_timer.ci import reports as ci_reports
from pytest_elastic_timer.core import records, startup
from pytest_elastic_timer.plugin import launcher, leaks, xdist_support
from pytest_elastic_timer.scope import client, collectives, scopes
from pytest_elastic_timer.scope.scopes import ScopeExpired, TimerRequest
from pytest_elastic_timer.watchdog import file_timer

HELP = {
    "expires": "default call-phase budget in seconds for tests without an expires "
    "marker (0 = none).",
    "grace": "seconds from a scope's interrupt to the termination of its owner's "
    "process tree (default 2).",
    "scale": "multiply every budget by this factor (slow machines, coverage runs).",
    "report": "write a JSON report of expired scopes to this path.",
    "trace": "write a Chrome/Perfetto trace of all scopes to this path.",
    "session": "budget in seconds for the whole session, phases outside tests included (0 = none).",
    "leaks": "what to do with processes a test started in its call phase and left running "
    "after its teardown: kill (default; also warns), warn, or off.",
}
MARKER = (
    "expires(seconds, *, setup=None, teardown=None, grace=None): the test's call phase "
    "must end within `seconds` (setup and teardown within their keywords); enforced by "
    "the pytest-elastic-timer watchdog."
)
MARKER_KEYWORDS = ("seconds", "setup", "teardown", "grace")
DEFAULT_GRACE = 2.0
SESSION_END_GRACE = 5.0


@dataclass(frozen=True)
class Settings:
    """The session's options, resolved once (CLI wins over ini)."""

    expires: float = 0.0
    grace: float = DEFAULT_GRACE
    scale: float = 1.0
    report: str | None = None
    trace: str | None = None
    session: float = 0.0
    leaks: str = "kill"

    @functools.cached_property
    def default_budgets(self) -> Budgets:
        """The budgets of a test without a marker."""
        return Budgets(None, self.expires or None, None, None)


@dataclass(frozen=True)
class Budgets:
    """One test's phase budgets in seconds (None = unbounded), before scaling."""

    setup: float | None
    call: float | None
    teardown: float | None
    grace: float | None


@dataclass
class SessionState:
    settings: Settings
    watchdog: launcher.WatchdogHandle | None = None
    previous_env: dict[str, str | None] = field(default_factory=dict)
    session_scope: TimerRequest | None = None
    session: pytest.Session | None = None
    lost_watchdog: str = ""  # why and when the watchdog went away mid-session
    expiry_listener: Any = None
    rootdir: str = ""
    # The budgets of tests with a marker, by node id: the others have the default.
    marked: dict[str, Budgets] = field(default_factory=dict)
    # Every collected item's budgets (an item hashes by identity, in C: cheaper for
    # every test than its stash, whose lookup is two Python calls).
    budgets: dict[pytest.Item, Budgets] = field(default_factory=dict)
    # Absolute file of each location path items report, relative to rootdir.
    files: dict[str, str] = field(default_factory=dict)
    leaks: bool = False  # whether tests' leftover processes are looked for
    started: float = field(default_factory=time.time)
    # What leaves the process as the session found it (a pytest run inside a test).
    put_back_scopes: Callable[[], None] = field(default=lambda: None)
    leave_leaks: Callable[[], None] = field(default=lambda: None)


SESSION = pytest.StashKey[SessionState]()
# The same state by config, for the hooks every test pays (see SessionState.budgets).
_states: dict[pytest.Config, SessionState] = {}


# -- options -------------------------------------------------------------------------
def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("elastic-timer", "per-step deadlines (pytest-elastic-timer)")
    options = [
        ("--expires", "expires", "expires", "SECONDS"),
        ("--elastic-timer-grace", "elastic_timer_grace", "grace", "SECONDS"),
        ("--elastic-timer-scale", "elastic_timer_scale", "scale", "FACTOR"),
        ("--elastic-timer-report", "elastic_timer_report", "report", "PATH"),
        ("--elastic-timer-trace", "elastic_timer_trace", "trace", "PATH"),
        ("--expires-session", "expires_session", "session", "SECONDS"),
        ("--elastic-timer-leaks", "elastic_timer_leaks", "leaks", "kill|warn|off"),
    ]
    for flag, ini, key, metavar in options:
        group.addoption(flag, dest=ini, default=None, metavar=metavar, help=HELP[key])
        parser.addini(ini, HELP[key], default=None)
    ci_reports.add_options(group, parser)


def _option(config: pytest.Config, name: str) -> tuple[str, Any]:
    """(where the value came from, raw value) for option ``name``; CLI wins."""
    value = config.getoption(name)
    if value is not None:
        return f"--{name.replace('_', '-')}", value
    value = config.getini(name)
    if value not in (None, ""):
        return f"ini option {name!r}", value
    return "", None


def parse_seconds(raw: object, what: str, *, allow_zero: bool = True) -> float:
    """A finite, non-negative number of seconds from ``raw``, or ValueError naming it."""
    if isinstance(raw, bool):
        raise ValueError(f"{what} must be a number of seconds, not {raw!r}")
    if isinstance(raw, (int, float)):
        try:
            value = float(raw)
        except OverflowError:  # an int too large for a float (10**400): not finite either
            value = math.inf
    elif isinstance(raw, str):
        try:
            value = float(raw.strip())
        except ValueError:
            raise ValueError(f"{what} must be a number of seconds, not {raw!r}") from None
    else:
        raise ValueError(f"{what} must be a number of seconds, not {raw!r}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        limit = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{what} must be a finite number {limit}, not {raw!r}")
    return value


def parse_marker_seconds(raw: object, what: str) -> float:
    """Like :func:`parse_seconds`, but a marker takes numbers only, never text."""
    if isinstance(raw, str):
        raise ValueError(f"{what} must be a number of seconds, not {raw!r}")
    return parse_seconds(raw, what)


def read_settings(config: pytest.Config) -> Settings:
    def seconds(name: str, default: float, *, allow_zero: bool = True) -> float:
        where, raw = _option(config, name)
        if raw is None:
            return default
        try:
            return parse_seconds(raw, where, allow_zero=allow_zero)
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None

    def path(name: str) -> str | None:
        return _option(config, name)[1] or None

    def choice(name: str, allowed: tuple[str, ...], default: str) -> str:
        where, raw = _option(config, name)
        if raw is None:
            return default
        if str(raw).strip() not in allowed:
            raise pytest.UsageError(f"{where} must be one of {', '.join(allowed)}, not {raw!r}")
        return str(raw).strip()

    return Settings(
        expires=seconds("expires", 0.0),
        grace=seconds("elastic_timer_grace", DEFAULT_GRACE),
        scale=seconds("elastic_timer_scale", 1.0, allow_zero=False),
        report=path("elastic_timer_report"),
        trace=path("elastic_timer_trace"),
        session=seconds("expires_session", 0.0),
        leaks=choice("elastic_timer_leaks", ("kill", "warn", "off"), "kill"),
    )


# -- session -------------------------------------------------------------------------
@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER)
    settings = read_settings(config)
    state = SessionState(settings, rootdir=str(config.rootpath), leaks=settings.leaks != "off")
    config.stash[SESSION] = _states[config] = state
    config.pluginmanager.register(ci_reports, "elastic_timer_ci")
    state.expiry_listener = functools.partial(_watch_failures, config)
    scopes.expiry_listeners.append(state.expiry_listener)
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(xdist_support, "elastic_timer_xdist")
    state.leave_leaks = leaks.enter_session(adopt=settings.leaks != "off")
    if hasattr(config, "workerinput"):
        xdist_support.configure_worker(config)
        state.put_back_scopes = scopes.set_aside()
        # PYTEST_CURRENT_TEST inherited from an outer session (a pytest run by a test)
        # names a test of that session, not of this one.
        scopes.process_state().set_nodeid("")
        return  # an xdist worker: the controller's watchdog serves it
    try:
        handle = launcher.start(
            grace=settings.grace,
            scale=settings.scale,
            report=settings.report,
            session={
                "pid": os.getpid(),
                "expires": settings.expires,
                "grace": settings.grace,
                "scale": settings.scale,
                "args": list(config.invocation_params.args),
            },
            dump_signal=startup.session_dump_signal(),
            junit_xml=config.getoption("xmlpath", None),
            trace=bool(settings.trace),
        )
    except (launcher.WatchdogError, OSError) as exc:
        config.issue_config_time_warning(
            pytest.PytestWarning(
                f"pytest-elastic-timer: {exc}; scopes are enforced in-process only"
            ),
            stacklevel=2,
        )
        return
    state.watchdog = handle
    python_path = os.pathsep.join(
        p for p in (startup.install(handle.directory), os.environ.get("PYTHONPATH")) if p
    )
    for name, value in (
        (client.ENV_ADDRESS, handle.address),
        (client.ENV_SCALE, repr(settings.scale)),
        (startup.ENV_DUMP_SIGNAL, str(startup.session_dump_signal())),
        (file_timer.ENV_FILE, os.path.join(handle.directory, file_timer.FIFO_NAME)),
        ("PYTHONPATH", python_path),
    ):
        state.previous_env[name] = os.environ.get(name)
        os.environ[name] = value
    state.put_back_scopes = scopes.set_aside()
    scopes.process_state().set_nodeid("")  # register now; not the outer session's test
    collectives.watch()  # torch.distributed's ops in this process are recorded too


def pytest_report_header(config: pytest.Config) -> str:
    state = config.stash[SESSION]
    s = state.settings
    dog = f"watchdog pid {state.watchdog.pid}" if state.watchdog else "no watchdog"
    default = f"{s.expires:g}s" if s.expires else "none"
    return f"elastic-timer: {dog}, default budget {default}, grace {s.grace:g}s, scale {s.scale:g}"


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    config = session.config
    state = config.stash[SESSION]
    process = scopes.process_state()
    process.set_phase("sessionstart")
    budget = state.settings.session
    if not budget:
        return
    controller = not hasattr(config, "workerinput") and _uses_xdist(config)
    if controller:
        # Workers enforce the same budget on themselves; the controller waits for
        # their reports first, so it gets the ladder's time on top.
        # Past the workers' own ladder (grace + the session's end grace + kill time),
        # so that a hung worker is named by its own expiry first.
        budget += 2 * state.settings.grace + SESSION_END_GRACE + 5.0
    state.session = session
    # After the interrupt the session still has to end (summary, reports): that gets
    # a few seconds on top of the usual grace before the watchdog steps in.
    scope = TimerRequest(budget, "session", grace=state.settings.grace + SESSION_END_GRACE)
    scope.detached = True
    scope.on_expire = lambda exc: _end_session(state, exc)
    scope.at = (str(config.rootpath), 0)
    scope.acquire()
    state.session_scope = scope


def _uses_xdist(config: pytest.Config) -> bool:
    return config.pluginmanager.hasplugin("dsession")


def _end_session(state: SessionState, exc: ScopeExpired) -> BaseException:
    """A session over its budget stops where it is, with the scope line as reason."""
    phase = scopes.process_state().phase()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    where = ", ".join(x for x in (f"phase {phase}" if phase else "", worker) if x)
    reason = f"{exc.line()} ({where})" if where else exc.line()
    if state.session is not None:
        # Where the exception is caught (a fixture finalizer records it as a teardown
        # error), the session must still not start another test.
        state.session.shouldstop = reason
    if worker:
        return exc  # xdist takes Exit in a worker for Ctrl-C: fail where it is instead
    return pytest.exit.Exception(reason)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_collection(session: pytest.Session) -> Generator[None, None, None]:
    scopes.process_state().set_phase("collection")
    return (yield)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> Generator[None, None, None]:
    scopes.process_state().set_phase("sessionfinish")
    ci_reports.worker_output(session)
    state = session.config.stash.get(SESSION, None)
    watchdog = state.watchdog if state is not None else None
    # Died after the last per-test look (in the last test, say): still say so.
    if (
        state is not None
        and watchdog is not None
        and not state.lost_watchdog
        and not watchdog.alive()
    ):
        state.lost_watchdog = (
            f"the watchdog (pid {watchdog.pid}) died during the session; scopes "
            "were enforced in-process from then on"
        )
    if state is not None and state.lost_watchdog and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED  # the guarantees did not hold
    return (yield)


# -- collection: the marker is checked where the test is defined ---------------------
@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Any:
    # Once per collector, not per test: a bad marker fails its module's collection.
    report = yield
    if report.passed and report.result:
        try:
            _budget_items(collector.config, report.result)
        except ValueError as exc:
            report.outcome = "failed"
            report.longrepr = str(exc)
            report.result = []
    return report


def _budget_items(config: pytest.Config, nodes: list[Any]) -> None:
    """Give each item of ``nodes`` its budgets; the markers of their parents are looked
    up once per parent, not once per test."""
    state = config.stash[SESSION]
    default = state.settings.default_budgets
    budgets = state.budgets
    # A collector's items mostly share one parent: remember the last one's marker.
    parent_seen: Any = _budget_items
    parent_mark: pytest.Mark | None = None
    for node in nodes:
        kind = node.__class__
        is_item = _IS_ITEM.get(kind)
        if is_item is None:  # isinstance() of a node class is a call into abc
            is_item = _IS_ITEM[kind] = isinstance(node, pytest.Item)
        if not is_item:
            continue
        mark = None
        for own in node.own_markers:
            if own.name == "expires":
                mark = own
                break
        else:
            parent = node.parent
            if parent is not parent_seen:
                parent_seen, parent_mark = parent, _marker(parent)
            mark = parent_mark
        budgets[node] = default if mark is None else _budgets_from(node, mark)


_IS_ITEM: dict[type, bool] = {}


def _marker(node: pytest.Item | pytest.Collector | None) -> pytest.Mark | None:
    # get_closest_marker() with its two generators costs more than the rest of
    # budgets_of(); the same search, from the node up.
    while node is not None:
        for mark in node.own_markers:
            if mark.name == "expires":
                return mark
        node = node.parent
    return None


def _budgets_from(item: pytest.Item, marker: pytest.Mark) -> Budgets:
    nodeid = item.nodeid
    budgets = _parse_marker(nodeid, marker.args, marker.kwargs)
    if budgets.setup is not None or budgets.teardown is not None:
        _need_phase_budgets(item.config)
    item.config.stash[SESSION].marked[nodeid] = budgets
    return budgets


def budgets_of(item: pytest.Item) -> Budgets:
    """The item's phase budgets (cached); ValueError naming the test for bad input."""
    state = item.config.stash[SESSION]
    budgets = state.budgets.get(item)
    if budgets is None:  # not collected by this session's collection hooks
        marker = _marker(item)
        default = state.settings.default_budgets
        budgets = state.budgets[item] = default if marker is None else _budgets_from(item, marker)
    return budgets


def _parse_marker(nodeid: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Budgets:
    where = f"{nodeid}: @pytest.mark.expires"
    unknown = sorted(set(kwargs) - set(MARKER_KEYWORDS))
    if unknown:
        raise ValueError(
            f"{where}: unknown keyword {unknown[0]!r} (known: {', '.join(MARKER_KEYWORDS)})"
        )
    if len(args) > 1:
        raise ValueError(f"{where} takes one positional argument (seconds), got {args!r}")
    if args and "seconds" in kwargs:
        raise ValueError(f"{where}: seconds given twice")
    if not args and "seconds" not in kwargs:
        raise ValueError(f"{where} needs the number of seconds, e.g. expires(5)")
    raw = args[0] if args else kwargs["seconds"]
    seconds = parse_marker_seconds(raw, f"{where} seconds")

    def keyword(name: str) -> float | None:
        value = kwargs.get(name)
        if isinstance(value, str):
            raise ValueError(f"{where} {name}= must be a number of seconds, not {value!r}")
        return None if value is None else parse_seconds(value, f"{where} {name}=") or None

    return Budgets(keyword("setup"), seconds or None, keyword("teardown"), keyword("grace"))


# -- running: one scope per phase ----------------------------------------------------
# Every hook implementation here is paid by every test (a wrapper costs about twice a
# plain one), so the common case takes three: a plain hook for setup, a wrapper for the
# call phase and one for the teardown, which also ends the test; the wrappers that give
# setup and teardown budgets of their own are registered only once a collected test
# has one.
# The bodies are written for the same reason: no dataclass per test, and one string
# per test written to the scope table (see ``client.ProcessState.set_test``).


class RunningTest:
    """What this process knows of the test it runs, from its setup to the end of its
    teardown."""

    children: bytes | None  # this process's children when the call began
    call_scope: TimerRequest | None
    tracing: bool
    started = 0.0  # when the phase began, for the trace timeline (only when tracing)

    def __init__(self, item: pytest.Item, state: SessionState, named: bool) -> None:
        """``item`` begins its setup in this process; ``named``: the setup's name is
        the prefix of the scopes entered in it (no scope of its own names it)."""
        self.item = item
        nodeid = self.nodeid = item.nodeid
        name = self.name = item.name
        self.state = state
        process = self.process = scopes.process_state()
        stack = self.stack = scopes.thread_stack()
        self.depth = len(stack)  # scopes above this depth are the test's own
        self.outer_prefix = stack.prefix
        self.outer_sid = process.nodeid_sid
        # _place(item, state), inline but for a file not seen before: every test runs it.
        path, line, _ = item.location  # computed (and cached) by pytest before setup
        file = state.files.get(path) or _file_of(path, state)
        line = (line or 0) + 1
        self.definition = (file, line)
        process.set_test(nodeid, name, file, line)
        # Stored, not left to class-level defaults: the phases read them (see
        # TimerRequest's defaults).
        self.children = None
        self.call_scope = None
        # The setup begins (as the call and teardown wrappers begin their phases), for a
        # test that has no phase yet and no scopes.
        if process.trace is None:
            self.tracing = False
        else:
            self.tracing = True
            self.started = time.monotonic()
        self.when = "setup"
        process.set_phase("setup")
        if named:
            stack.prefix = f"{name}::setup"


# The tests running in this process, innermost last: a test can run a pytest session
# in-process (pytester), whose tests run inside its call phase.
_running: list[RunningTest] = []


def _phase_scope(
    item: pytest.Item, when: str, budget: float | None, grace: float | None
) -> TimerRequest:
    # A scope without a deadline is never reported: no place needed.
    at = _definition(item) if budget is not None else None
    return scopes.phase_scope(item.name, when, budget, grace, at)


def _definition(item: pytest.Item) -> tuple[str, int]:
    """Where the test is defined: the file and 1-based line its report points at."""
    running = _current(item)
    if running is not None:
        return running.definition
    return _place(item, item.config.stash[SESSION])


def _place(item: pytest.Item, state: SessionState) -> tuple[str, int]:
    """(absolute file, 1-based line) of ``item``'s location; files cached by path."""
    path, line, _ = item.location  # computed (and cached) by pytest before setup
    return (state.files.get(path) or _file_of(path, state), (line or 0) + 1)


def _file_of(path: str, state: SessionState) -> str:
    """The absolute file of a location's ``path``, now cached in ``state.files``:
    relative to rootdir, unless pytest gave an absolute one."""
    file = state.files[path] = path if path.startswith("/") else f"{state.rootdir}/{path}"
    return file


def _budgets_or_fail(item: pytest.Item) -> Budgets:
    try:
        return budgets_of(item)
    except ValueError as exc:  # a marker added after collection
        pytest.fail(str(exc), pytrace=False)


def _current(item: pytest.Item) -> RunningTest | None:
    return _running[-1] if _running and _running[-1].item is item else None


def _trace_phase(running: RunningTest) -> None:
    """The timeline shows every phase without a scope of its own."""
    stack = running.stack
    if running.when and stack.prefix != running.outer_prefix:
        running.process.traced(stack.prefix, running.started, stack.tid, False)
    running.started = time.monotonic()


def _begin(item: pytest.Item, *, named: bool = True) -> None:
    """The test's setup begins: the watchdog still there, the test's name for records."""
    running = _running[-1] if _running else None
    if running is not None and running.item is item:
        if running.when == "setup":
            return  # a wrapper for the setup budget did it already
        _finish(_running.pop())  # the same test runs again (a plugin that reruns tests)
    config = item.config
    running = RunningTest(item, _states.get(config) or config.stash[SESSION], named)
    _running.append(running)
    process = running.process
    if (
        process.sock is not None
        and time.monotonic() - process.alive_checked >= 1.0
        and not process.watchdog_alive()
    ):
        _watchdog_lost(item)


# The hook is _begin itself: one call less for every test.
pytest_runtest_setup = pytest.hookimpl(tryfirst=True)(_begin)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    running = _running[-1] if _running else None
    if running is None or running.item is not item:
        return (yield from _call_of_unknown_test(item))
    state = running.state
    budgets = state.budgets.get(item) or _budgets_or_fail(item)
    if state.leaks:
        running.children = leaks.snapshot()
    # The call phase begins: the phase word, and the scopes setup left open close.
    if running.tracing:
        _trace_phase(running)
    running.when = "call"
    running.process.set_phase("call")
    stack = running.stack
    if len(stack) > running.depth:
        scopes.close_above(stack, running.depth, stack.prefix)
    after = budgets.call
    if after is None:
        stack.prefix = f"{running.name}::call"  # no scope of its own names the phase
        try:
            return (yield)
        except BaseException:
            _watch_failures(item.config)  # before pytest makes the call's report
            raise
    stack.prefix = running.outer_prefix  # the call's scope names the phase
    try:
        scope = running.call_scope = scopes.enter_test_phase(
            scopes.phase_scope(running.name, "call", after, budgets.grace, running.definition),
            stack,
        )
        try:
            result = yield
        except BaseException as exc:
            scopes.leave_test_phase(scope, exc)
            raise
        scopes.leave_test_phase(scope, None)  # raises ScopeExpired if it overran
        return result
    except BaseException:
        _watch_failures(item.config)
        raise


def _call_of_unknown_test(item: pytest.Item) -> Generator[None, None, None]:
    """The call phase of a test whose setup this plugin did not see begin."""
    budgets = _budgets_or_fail(item)
    try:
        if budgets.call is None:
            return (yield)
        with _phase_scope(item, "call", budgets.call, budgets.grace):
            return (yield)
    except BaseException:
        _watch_failures(item.config)
        raise


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    """The outermost wrapper of teardown: the test ends when its teardown does (one
    hook for both, instead of a teardown and a logfinish hook)."""
    running = _running[-1] if _running else None
    if running is None or running.item is not item:
        return (yield)
    # The teardown begins, as the call began (a wrapper for its budget may have done it).
    if running.when != "teardown":
        if running.tracing:
            _trace_phase(running)
        running.when = "teardown"
        running.process.set_phase("teardown")
        stack = running.stack
        if len(stack) > running.depth:
            scopes.close_above(stack, running.depth, stack.prefix)
        stack.prefix = f"{running.name}::teardown"
    try:
        return (yield)
    finally:
        # Leftover processes are found here, inside the teardown: a warning made an
        # error (-W error) fails the test's teardown.
        if _running and _running[-1] is running:
            _finish(_running.pop())


def _finish(running: RunningTest) -> None:
    """After the test's teardown: its scopes are over, its leftover processes found."""
    if running.tracing:
        _trace_phase(running)
    running.when = ""
    stack = running.stack
    if len(stack) > running.depth:
        scopes.close_above(stack, running.depth, stack.prefix)
    stack.prefix = running.outer_prefix
    # Back to the test that runs this session in-process, if any.
    outer = _running[-1] if _running else None
    if outer is None:
        running.process.restore_test("", running.outer_sid, "between tests")
    else:
        running.process.restore_test(outer.nodeid, running.outer_sid, outer.when)
    before = running.children
    if before is not None:
        after = leaks.snapshot()
        if after != before:
            _check_leaks(running, before, after)


class PhaseBudgets:
    """Scopes for setup and teardown budgets (``expires(setup=..., teardown=...)``),
    registered once a collected test has one."""

    NAME = "elastic_timer_phase_budgets"

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, None, None]:
        budgets = _budgets_or_fail(item)
        # First: the scope's record names the test; the scope names the phase.
        _begin(item, named=budgets.setup is None)
        if budgets.setup is None:
            return (yield)
        with _phase_scope(item, "setup", budgets.setup, budgets.grace):
            return (yield)

    # Inside the plugin's own teardown wrapper (tryfirst), which began the phase and
    # ends the test after this scope ended.
    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Generator[None, None, None]:
        budgets = _budgets_or_fail(item)
        if budgets.teardown is None:
            return (yield)
        running = _current(item)
        if running is not None:  # the budget's scope names the phase
            running.stack.prefix = running.outer_prefix
        with _phase_scope(item, "teardown", budgets.teardown, budgets.grace):
            return (yield)


def _need_phase_budgets(config: pytest.Config) -> None:
    if not config.pluginmanager.has_plugin(PhaseBudgets.NAME):
        config.pluginmanager.register(PhaseBudgets(), PhaseBudgets.NAME)


def _watchdog_lost(item: pytest.Item) -> None:
    """Say it loudly: from here on hung C calls and spawned processes go unchecked."""
    state = item.config.stash[SESSION]
    state.lost_watchdog = (
        f"the watchdog (pid {scopes.process_state().watchdog_pid}) died before "
        f"{item.nodeid}; scopes are enforced in-process from then on (no stack dumps, "
        "no termination of hung processes)"
    )
    reporter = item.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"\nelastic-timer: {state.lost_watchdog}", red=True, bold=True)
    warnings.warn(pytest.PytestWarning(f"elastic-timer: {state.lost_watchdog}"), stacklevel=1)


def _check_leaks(running: RunningTest, before: bytes, after: bytes) -> None:
    state = running.state
    ours = {state.watchdog.pid} if state.watchdog else set()
    new = {
        p for p in leaks.pids_of(after) - leaks.pids_of(before) - ours if not leaks.is_service(p)
    }
    if not new:
        return
    mode = state.settings.leaks
    left = leaks.end_leaks(new) if mode == "kill" else leaks.describe_running(new)
    if left:
        names = ", ".join(
            f"{p['pid']} ({' '.join(str(p['cmdline']).split())[:80] or p['name']})" for p in left
        )
        done = "ended" if mode == "kill" else "still running"
        warnings.warn(
            pytest.PytestWarning(
                f"{running.nodeid} left {len(left)} process(es) running after its teardown "
                f"({done}): {names}"
            ),
            stacklevel=1,
        )


class ExpiryReports:
    """Failed reports get the scope line first, and sections for expiries in processes
    the test started. Registered once a test fails or a scope expires in this process:
    a wrapper around every report would cost every passing test."""

    NAME = "elastic_timer_expiry_reports"

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        if report.failed:
            excinfo = call.excinfo
            if excinfo is not None and isinstance(excinfo.value, ScopeExpired):
                _lead_with_scope_line(report, excinfo.value)
            _add_process_sections(item, report)
            ci_reports.annotate_expiry(item, call, report)
        return report


def _watch_failures(config: pytest.Config) -> None:
    if not config.pluginmanager.has_plugin(ExpiryReports.NAME):
        config.pluginmanager.register(ExpiryReports(), ExpiryReports.NAME)
    ci_reports.watch_failures(config)


def _add_process_sections(item: pytest.Item, report: pytest.TestReport) -> None:
    """Expiries in processes the test started (ranks), and where its children were."""
    me = os.getpid()
    for record in _records(item.config):
        if record.nodeid != item.nodeid:
            continue
        if record.pid != me:
            report.sections.append(
                (f"elastic-timer: expired in {record.owner_text()}", records.format_record(record))
            )
        for child in record.children:
            if child.get("stack"):
                who = ", ".join(
                    str(x) for x in (child.get("label"), f"pid {child.get('pid')}") if x
                )
                report.sections.append(
                    (f"elastic-timer: stack of {who} at expiry", str(child["stack"]))
                )


def _lead_with_scope_line(report: pytest.TestReport, exc: ScopeExpired) -> None:
    """Make the scope line the first line of the failure and its crash message."""
    longrepr = report.longrepr
    line = exc.line()
    if isinstance(longrepr, (ExceptionChainRepr, ReprExceptionInfo)):
        first = (
            longrepr.chain[0][0]
            if isinstance(longrepr, ExceptionChainRepr)
            else (longrepr.reprtraceback)
        )
        first.reprentries = [ReprEntryNative([line + "\n"]), *first.reprentries]
        if longrepr.reprcrash is not None:
            longrepr.reprcrash.message = line
    elif isinstance(longrepr, str):
        report.longrepr = f"{line}\n{longrepr}"
    report.user_properties.append((xdist_support.SCOPE_PROPERTY, exc.scope))


# -- debugger ------------------------------------------------------------------------
def pytest_enter_pdb(config: pytest.Config, pdb: Any) -> None:
    scopes.suspend()


def pytest_leave_pdb(config: pytest.Config, pdb: Any) -> None:
    scopes.resume()


# -- fixtures ------------------------------------------------------------------------
class ElasticTimer:
    """The ``elastic_timer`` fixture: the current test's budget and nested steps."""

    def __init__(self, item: pytest.Item) -> None:
        self._item = item

    @property
    def budget(self) -> float | None:
        """The call phase's budget in seconds, scaled (None = unbounded)."""
        call = budgets_of(self._item).call
        if call is None:
            return None
        return call * scopes.process_state().scale

    def remaining(self) -> float:
        """Seconds left in the call phase (``inf`` when unbounded)."""
        running = _current(self._item)
        scope = running.call_scope if running is not None else None
        if scope is not None and scope.active:
            return scope.expires()
        budget = self.budget
        return math.inf if budget is None else budget

    def step(self, name: str, after: float | None) -> TimerRequest:
        """A nested scope ``name`` that must end within ``after`` seconds."""
        return TimerRequest(after, name)

    @property
    def env(self) -> dict[str, str]:
        """An environment for subprocesses that keeps them in this session."""
        return dict(os.environ)


class ElasticTimerServer:
    """The ``elastic_timer_server`` fixture: where the session's watchdog is."""

    def __init__(self, state: SessionState) -> None:
        self._state = state

    @property
    def address(self) -> str | None:
        return os.environ.get(client.ENV_ADDRESS) or None

    @property
    def pid(self) -> int | None:
        state = scopes.process_state()
        return state.watchdog_pid or None


@pytest.fixture
def elastic_timer(request: pytest.FixtureRequest) -> ElasticTimer:
    """The current test's timer: ``.budget``, ``.remaining()``, ``.step()``, ``.env``."""
    return ElasticTimer(request.node)


@pytest.fixture(scope="session")
def elastic_timer_server(request: pytest.FixtureRequest) -> ElasticTimerServer:
    """The session's watchdog: ``.address`` (socket path) and ``.pid``."""
    return ElasticTimerServer(request.config.stash[SESSION])


# -- reporting -----------------------------------------------------------------------
def _records(config: pytest.Config) -> list[records.ExpiryRecord]:
    """The watchdog's records so far (after a sync); also in an xdist worker, which
    finds them beside the watchdog's socket."""
    state = config.stash.get(SESSION, None)
    if state is None:
        return []
    process = scopes.process_state()
    if state.watchdog is not None:
        path = state.watchdog.records_path
    elif process.sock is not None and process.address:
        path = os.path.join(os.path.dirname(process.address), "records.jsonl")
    else:
        return []
    process.request("sync")
    return records.read_records(path)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    state = config.stash.get(SESSION, None)
    if state is not None and state.lost_watchdog:
        terminalreporter.section("elastic-timer: watchdog lost", sep="=", red=True)
        terminalreporter.write_line(state.lost_watchdog, red=True)
    found = _records(config)
    if not found:
        return
    terminalreporter.section("elastic-timer: expired scopes", sep="=", red=True)
    for record in found:
        terminalreporter.write_line(
            records.format_record(record, with_stack=record.action != "interrupted")
        )
    _restart_limit_line(terminalreporter, config, found)


def _restart_limit_line(
    terminalreporter: Any, config: pytest.Config, found: list[records.ExpiryRecord]
) -> None:
    """Say when the watchdog's terminations of workers used up --max-worker-restart."""
    if hasattr(config, "workerinput") or not _uses_xdist(config):
        return
    ended = sorted({r.worker for r in found if r.worker and r.action in ("terminated", "killed")})
    limit = getattr(config.option, "maxworkerrestart", None)
    if not ended or limit is None:
        return
    if len(ended) > int(limit):
        terminalreporter.write_line(
            f"elastic-timer: the watchdog ended {len(ended)} worker(s) ({', '.join(ended)}) "
            f"for expired scopes; --max-worker-restart={limit} stopped the session early",
            red=True,
            bold=True,
        )


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    state = _states.pop(config, None)
    if state is None:
        return
    state.budgets.clear()
    if state.expiry_listener in scopes.expiry_listeners:
        scopes.expiry_listeners.remove(state.expiry_listener)
    process = scopes.current_state()
    if process is not None:
        process.flush_trace()
    if state.session_scope is not None and state.session_scope.active:
        try:
            state.session_scope.release()
        except ScopeExpired:
            pass  # already reported: the session overran while it was ending
    if state.watchdog is not None:
        end = {"exitstatus": None, **ci_reports.session_end(config)}
        if not state.watchdog.alive() and state.settings.report:
            _report_without_watchdog(config, state, end)
        state.watchdog.stop(end)
    for name, value in state.previous_env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    # The process as the session found it (a pytest run inside a test of another).
    state.put_back_scopes()
    state.leave_leaks()


def _report_without_watchdog(
    config: pytest.Config, state: SessionState, end: dict[str, Any]
) -> None:
    """The watchdog died before the end of the session, so it writes no JSON report:
    write one from the records it made while it ran (later expiries were enforced
    in-process and are in pytest's own reports only)."""
    settings = state.settings
    assert state.watchdog is not None and settings.report
    lost = state.lost_watchdog or f"the watchdog (pid {state.watchdog.pid}) died"
    session = {
        "pid": os.getpid(),
        "expires": settings.expires,
        "grace": settings.grace,
        "scale": settings.scale,
        "args": list(config.invocation_params.args),
        "started": state.started,
        "ended": time.time(),
        "workers": [],
        "root_died": False,
        "watchdog_lost": lost,
        **end,
    }
    found = records.read_records(state.watchdog.records_path)
    try:
        records.write_report(settings.report, found, session)
    except OSError as exc:
        warnings.warn(
            pytest.PytestWarning(f"elastic-timer: cannot write the report: {exc}"), stacklevel=2
        )
