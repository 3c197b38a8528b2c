"""The pytest plugin ``elastic_timer``: the module pytest loads (entry point ``pytest11``).

Hooks are laid out in the order pytest calls them; each hands its work to the module
of that job: :mod:`.options` (options and settings), :mod:`.state` (the session's state
in ``config.stash``), :mod:`.budgets` (each test's budgets), :mod:`.running` (the
per-test path), :mod:`.expiry` (failed reports about expired scopes), :mod:`.lifecycle`
(the watchdog and the session's budget), :mod:`.fixtures`. The CI outputs
(``pytest_elastic_timer.ci``) implement the plugin's own hooks (:mod:`.hookspecs`) and
are registered by name, only when the session uses them.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pytest

from pytest_elastic_timer.core.plain_imports import import_plainly, plainly

# From their bytecode, not compiled again by pytest's assertion rewriting at every
# start where it cannot cache what it compiled (core/plain_imports.py says why).
with plainly():
    from pytest_elastic_timer.core import torch_hook
    from pytest_elastic_timer.plugin import (
        hookspecs,
        in_process_sessions,
        leaks,
        lifecycle,
        real_filesystem,
        running,
    )
    from pytest_elastic_timer.plugin.budgets import BudgetBook, Budgets
    from pytest_elastic_timer.plugin.fixtures import elastic_timer as elastic_timer
    from pytest_elastic_timer.plugin.fixtures import elastic_timer_server as elastic_timer_server
    from pytest_elastic_timer.plugin.options import MARKER, add_options, any_given, read_settings
    from pytest_elastic_timer.plugin.state import (
        SESSION,
        SessionState,
        expiry_records,
        is_worker,
        record_text,
        uses_xdist,
    )
    from pytest_elastic_timer.plugin.torch_timer_file import TorchTimerFile
    from pytest_elastic_timer.scope import scopes

if TYPE_CHECKING:
    from pytest_elastic_timer.core import records

# The CI outputs, by the condition under which a session uses them.
CI_SLOW = "pytest_elastic_timer.ci.slow"
CI_JUNIT = "pytest_elastic_timer.ci.junit"
CI_GITHUB = "pytest_elastic_timer.ci.github"
CI_TRACE = "pytest_elastic_timer.ci.trace"
XDIST_HOOKS = "elastic_timer_xdist"
# The wrappers around other plugins' session hooks, under the session's budget.
SESSION_HOOKS_BUDGET = "elastic_timer_session_hooks_budget"


# -- start-up ------------------------------------------------------------------------
def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    pluginmanager.add_hookspecs(hookspecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER)
    settings = read_settings(config)
    book = BudgetBook(
        Budgets(None, settings.expires or None, None, None),
        settings.scale,
        on_phased=lambda: running.need_phase_budgets(config),
    )
    state = SessionState(
        settings,
        book,
        rootdir=str(config.rootpath),
        ends_with_its_process=lifecycle.ends_with_its_process(config),
        has_no_session_of_its_own=lifecycle.has_no_session_of_its_own(config),
    )
    config.stash[SESSION] = state
    if config.getoption("help", False) or config.getoption("markers", False):
        return  # pytest only shows its help or the markers: no session runs

    # A scope that expires in this process (in a test or beside it) is a failure, and
    # the test it cut short leaves no processes behind.
    def on_expiry() -> None:
        running.note_expiry()
        running.watch_failures_soon(config)

    state.expiry_listener = on_expiry
    scopes.expiry_listeners.append(state.expiry_listener)
    if not state.ends_with_its_process and not state.has_no_session_of_its_own:
        state.put_back_naming = scopes.name_afresh()  # run by a test: as a session of its own
    state.leak_watch = leaks.Watch()
    state.used = any_given(config)
    if settings.session:
        config.pluginmanager.register(
            lifecycle.SessionHooksBudget(state, pytest_terminal_summary), SESSION_HOOKS_BUDGET
        )
    # Orphans are adopted from the end of collection on (where the watchdog's shell has
    # been reaped: the watchdog it leaves is not adopted, nor left to be reaped), before
    # any test runs; under auto, from the first test that uses the plugin.
    state.adopts_orphans = settings.leaks in ("warn", "kill") or (
        settings.leaks == "auto" and state.used
    )
    if is_worker(config):
        xdist_support = _register_xdist_hooks(config)
        xdist_support.configure_worker(config)
        state.put_back_scopes = scopes.set_aside()
        # PYTEST_CURRENT_TEST inherited from an outer session (a pytest run by a test)
        # names a test of that session, not of this one.
        scopes.process_state().set_nodeid("")
        xdist_support.warn_if_refused(config)
        return  # an xdist worker: the controller's watchdog serves it
    _register_ci_outputs(config, state)
    if lifecycle.starts_watchdog_at_once(config, state):
        lifecycle.start_watchdog(config, state)
        _after_watchdog_start(state)
    else:
        lifecycle.defer_watchdog(state)


def _after_watchdog_start(state: SessionState) -> None:
    if state.watchdog is not None:
        scopes.process_state().set_nodeid("")  # register now; not the outer session's test
        # torch.distributed's ops in this process are recorded too.
        state.watching_torch = torch_hook.watch()


def _register_xdist_hooks(config: pytest.Config) -> ModuleType:
    """Import and register the xdist hooks (:mod:`.xdist_support`): only an xdist
    worker, and a controller that starts workers, loads them."""
    with plainly():
        from pytest_elastic_timer.plugin import xdist_support

    if not config.pluginmanager.is_registered(xdist_support):
        config.pluginmanager.register(xdist_support, XDIST_HOOKS)
    return xdist_support


def _register_ci_outputs(config: pytest.Config, state: SessionState) -> None:
    """The CI outputs this session uses, imported and registered by name."""
    wanted: list[str] = []
    if config.getoption("xmlpath", None):
        wanted.append(CI_JUNIT)
    if os.environ.get("GITHUB_ACTIONS") == "true":
        wanted.append(CI_GITHUB)
    if state.settings.trace:
        wanted.append(CI_TRACE)
    for name in wanted:
        _register_module(config, name)


def _register_module(config: pytest.Config, name: str) -> None:
    """Import the plugin module ``name`` and register it under that name, once.

    Not with ``import_plugin``: pytest marks a module it imports so for assertion
    rewriting, and warns when it was imported already (the GitHub output imports the
    slow phases' module), which ``filterwarnings = error`` makes an error of the
    session. These modules assert nothing."""
    manager = config.pluginmanager
    if manager.get_plugin(name) is None and not manager.is_blocked(name):
        manager.register(import_plainly(name), name)


def pytest_report_header(config: pytest.Config) -> str:
    state = config.stash[SESSION]
    s = state.settings
    if state.watchdog is not None:
        dog = f"watchdog pid {state.watchdog.pid}"
    elif state.watchdog_on_demand:
        dog = "watchdog when a test needs one"
    else:
        dog = "no watchdog"
    default = f"{s.expires:g}s" if s.expires else "none"
    return f"elastic-timer: {dog}, default budget {default}, grace {s.grace:g}s, scale {s.scale:g}"


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    config = session.config
    state = config.stash[SESSION]
    # pytester's getnode() calls this inside a test of another session, and runs no
    # session: that test's phase, and its session's budget, stay as they are.
    inside_a_test = state.has_no_session_of_its_own
    if not inside_a_test:
        scopes.process_state().set_phase("sessionstart")
    state.torch_timer_file = TorchTimerFile.of_session()
    if not is_worker(config) and uses_xdist(config):
        # A controller that starts workers: xdist made its session in pytest_configure
        # and starts the workers after this hook (its own is trylast).
        _register_xdist_hooks(config).register_worker_reports(config)
    if state.settings.session and not inside_a_test:
        lifecycle.enter_session_scope(session, state)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_collection(session: pytest.Session) -> Generator[None, None, None]:
    scopes.process_state().set_phase("collection")
    state = session.config.stash[SESSION]
    with lifecycle.collection_of_worker(session):
        collected = yield
    # Read again once the items are final: conftest code and plugins add ``expires``
    # markers in pytest_collection_modifyitems.
    state.budgets.add_items(session.items)
    # Test modules are imported by now, and with them any library they use.
    # Loaded first, they are among what is kept from pyfakefs where it is used.
    in_process_sessions.load_if_tests_run_sessions(session.config, session.items)
    if lifecycle.start_watchdog_if_needed(session.config, state, session.items):
        _after_watchdog_start(state)
        scopes.process_state().set_phase("collection")
        state.torch_timer_file = TorchTimerFile.of_session()
    real_filesystem.keep_if_faked(session.items, str(session.config.rootpath))
    if state.watchdog is not None:
        # Before any test runs: the header (where pytest asks for the pid) is not
        # written under -q or --no-header.
        state.watchdog.reap_its_shell()
    if state.adopts_orphans and state.leak_watch is not None:
        state.leak_watch.adopt_orphans()
    # Collected: until the first test's setup the process waits for it (an xdist
    # worker, for the controller to send one), which its records must not call
    # collection.
    scopes.process_state().set_phase(lifecycle.BETWEEN_TESTS)
    return collected


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Any:
    # Also for items collected outside pytest_collection (pytester's getitems()), run
    # by a test itself: a phase budget's wrappers are registered before they run. Once
    # per collector, not per test. A bad marker is an error of its test alone, at its
    # setup: the module's other tests run, and every bad marker is named.
    report = yield
    if report.passed and report.result:
        collector.config.stash[SESSION].budgets.add_items(report.result)
    return report


# -- running: one scope per phase ----------------------------------------------------
# The per-test path's own functions are the hooks (see running.py): every test pays them.
pytest_runtest_setup = pytest.hookimpl(tryfirst=True)(running.begin)
pytest_runtest_call = pytest.hookimpl(wrapper=True, tryfirst=True)(running.call)
# The outermost wrapper of teardown: the test ends when its teardown does.
pytest_runtest_teardown = pytest.hookimpl(wrapper=True, tryfirst=True)(running.teardown)


def pytest_enter_pdb(config: pytest.Config, pdb: Any) -> None:
    scopes.suspend()


def pytest_leave_pdb(config: pytest.Config, pdb: Any) -> None:
    scopes.resume()


# -- the end -------------------------------------------------------------------------
@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_sessionfinish(
    session: pytest.Session, exitstatus: int | pytest.ExitCode
) -> Generator[None, None, None]:
    state = session.config.stash.get(SESSION, None)
    if state is None or not state.has_no_session_of_its_own:  # see pytest_sessionstart
        scopes.process_state().set_phase("sessionfinish")
    if state is not None:
        # The argument, not session.exitstatus: pytester's getitem() and getnode() call
        # this hook for a session that never ran, which has no such attribute.
        state.exitstatus = int(exitstatus)
        lifecycle.check_watchdog(session, state)
        if state.interrupted_test is not None:  # the session's budget stopped a test
            with plainly():
                from pytest_elastic_timer.plugin import expiry

            expiry.fail_the_interrupted_test(session, state)
    return (yield)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    state = config.stash.get(SESSION, None)
    if state is None:
        return
    state.summary_written = True
    if state.stopped_at_a_worker_end:
        terminalreporter.write_line(f"Interrupted: {state.stopped_at_a_worker_end}")
    if state.lost_watchdog:
        terminalreporter.section("elastic-timer: watchdog lost", sep="=", red=True)
        terminalreporter.write_line(state.lost_watchdog, red=True)
    found = expiry_records(config)
    if found:
        # Expiries interrupted in tests that passed were caught on purpose
        # (pytest.raises): one line says how many, unless -v. Every other one is
        # listed: of a test that failed, or a process that had to be ended (a helper
        # the test left, stuck in C), whatever became of the test.
        verbose = config.get_verbosity() >= 1
        caught = set() if verbose else _in_passed_tests(terminalreporter, found)
        listed = [r for r in found if r.nodeid not in caught or r.action != "interrupted"]
        terminalreporter.section("elastic-timer: expired scopes", sep="=", red=bool(listed))
        for record in listed:
            terminalreporter.write_line(
                record_text(config, record, with_stack=record.action != "interrupted")
            )
        count = len(found) - len(listed)
        if count:  # a passing test's helper that had to be ended is listed, not caught
            terminalreporter.write_line(
                f"{count} scope{'s' if count != 1 else ''} expired inside tests that passed "
                "(caught on purpose); -v lists them"
            )
        _restart_limit_line(terminalreporter, config, found)
    if not is_worker(config):
        _register_slow_if_used(config, state)
        summary = config.hook.pytest_elastic_timer_terminal_summary
        if summary.get_hookimpls():
            facts = lifecycle.facts_for_hooks(config, state)
            summary(config=config, terminalreporter=terminalreporter, records=found, session=facts)


def _register_slow_if_used(config: pytest.Config, state: SessionState) -> None:
    """The slow phases' output, registered at the end of a session that can have any:
    SLOW lines need a budget, the slow and slowest facts a JSON report."""
    if state.settings.report or state.budgets.any_budget():
        _register_module(config, CI_SLOW)


def _in_passed_tests(terminalreporter: Any, found: list[records.ExpiryRecord]) -> set[str]:
    """The node ids of tests that passed (no phase of them failed) among those of
    ``found``, but for the session's own expiry, which ends the session wherever it
    comes (in a session fixture's teardown, say, after the test's call passed)."""
    stats = terminalreporter.stats
    passed = {r.nodeid for r in stats.get("passed", ()) if getattr(r, "when", "") == "call"}
    if passed:
        for key in ("failed", "error"):
            passed.difference_update(getattr(r, "nodeid", "") for r in stats.get(key, ()))
        passed.difference_update(r.nodeid for r in found if r.scope == lifecycle.SESSION_SCOPE)
    return passed & {r.nodeid for r in found}


def _restart_limit_line(
    terminalreporter: Any, config: pytest.Config, found: list[records.ExpiryRecord]
) -> None:
    """Say when the watchdog's terminations of workers used up --max-worker-restart."""
    if is_worker(config) or not uses_xdist(config):
        return
    ended = sorted({r.worker for r in found if r.worker and r.action in ("terminated", "killed")})
    if not ended:
        return
    # xdist's own rule, which this line must agree with: the option, else its default.
    from xdist.dsession import get_default_max_worker_restart  # type: ignore[import-untyped]

    limit: int | None = get_default_max_worker_restart(config)
    if limit is not None and len(ended) > limit:
        why = f"--max-worker-restart={limit}"
        workers = getattr(config.option, "numprocesses", None)
        if getattr(config.option, "maxworkerrestart", None) is None and workers:
            why += f" (xdist's default: {limit // workers} per worker)"
        terminalreporter.write_line(
            f"elastic-timer: the watchdog ended {len(ended)} worker(s) ({', '.join(ended)}) "
            f"for expired scopes; {why} stopped the session early",
            red=True,
            bold=True,
        )


# A wrapper, innermost: the session ends here after every other plugin's hook, also
# where one of them raised (the session's budget running out in a conftest's hook).
@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_unconfigure(config: pytest.Config) -> Generator[None, object, object]:
    state = config.stash.get(SESSION, None)
    before = state is not None and lifecycle.session_budget_ran_out(state)
    process = scopes.current_state()
    if state is not None and process is not None and not state.has_no_session_of_its_own:
        process.set_phase("unconfigure")
    try:
        result = yield
    except BaseException as exc:
        stopped = lifecycle.stopped_in_unconfigure(config, exc, before)
        _end_the_session(config)
        if not stopped:
            raise
        return None
    lifecycle.stopped_in_unconfigure(config, None, before)  # a hook that caught it
    _end_the_session(config)
    return result


def _end_the_session(config: pytest.Config) -> None:
    state = config.stash.get(SESSION, None)
    if state is None:
        return
    if state.expiry_listener in scopes.expiry_listeners:
        scopes.expiry_listeners.remove(state.expiry_listener)
    lifecycle.leave_session_scope(state)
    if state.exitstatus is None and state.session is not None:
        # No pytest_sessionfinish said it: the session stopped in its sessionstart (its
        # budget ran out there), and pytest's status is the session's.
        state.exitstatus = int(getattr(state.session, "exitstatus", 0))
    process = scopes.current_state()
    if process is not None:
        process.flush_trace()
    if state.watchdog is not None:
        end: dict[str, Any] = {"exitstatus": state.exitstatus}
        if state.lost_watchdog:  # this host's, or another host's, whose report this is
            end["watchdog_lost"] = state.lost_watchdog
        _register_slow_if_used(config, state)
        session_end = config.hook.pytest_elastic_timer_session_end
        if session_end.get_hookimpls():
            found = expiry_records(config)
            facts = lifecycle.facts_for_hooks(config, state)
            for more in session_end(config=config, records=found, session=facts):
                end.update(more or {})
        if not state.watchdog.alive() and state.settings.report:
            lifecycle.report_without_watchdog(config, state, end)
        lifecycle.stop_watchdog(config, state, end)
    # Not before: the session's end hooks are given the tests' budgets.
    state.budgets.clear()
    lifecycle.restore_environment(state)
    if state.watching_torch:
        torch_hook.unwatch()
    # The process as the session found it (a pytest run inside a test of another).
    state.put_back_scopes()
    state.put_back_naming()
    if state.leak_watch is not None:
        state.leak_watch.leave()
