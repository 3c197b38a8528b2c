"""Failed reports about expired scopes: the scope line first, sections for expiries in
processes the test started (and for torch.distributed ranks of the test that died in a
collective), the scope's facts as ``user_properties``, the ``TIMEOUT``
status, and the plugin's ``pytest_elastic_timer_expired`` hook.

Nothing here runs, nor is imported, for a passing test: :func:`register_reports`
registers these plugins once a test fails or a scope expires (in an xdist controller,
once a worker's report of a failed test arrives).
"""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any, Literal, cast

import pytest
from _pytest._code.code import ExceptionChainRepr, ReprEntryNative, ReprExceptionInfo

from pytest_elastic_timer.core import records, unpatched
from pytest_elastic_timer.core.plain_imports import plainly
from pytest_elastic_timer.core.records import ExpiryRecord
from pytest_elastic_timer.plugin import running
from pytest_elastic_timer.plugin.lifecycle import SESSION_SCOPE, TEST_PHASES
from pytest_elastic_timer.plugin.state import (
    SESSION,
    SessionState,
    expiry_records,
    is_worker,
    record_text,
    session_directory,
    stack_text,
    uses_xdist,
)
from pytest_elastic_timer.plugin.xdist_support import SCOPE_PROPERTY, ExpiryRepr
from pytest_elastic_timer.scope.scopes import ScopeExpired

PROPERTY_PREFIX = "elastic_timer_"
# A report attribute (it travels with the report to an xdist controller, and is in no
# JUnit file): the pid of a test process that raised a ScopeExpired during the test,
# which the test caught, and then failed for a reason of its own.
CAUGHT_IN = "elastic_timer_caught_in"


def _add_properties(report: pytest.TestReport, record: ExpiryRecord) -> None:
    """The scope's facts as ``user_properties``, named as in the JUnit file (imported
    here: only a failure needs it, and the XML module it brings costs start-up)."""
    with plainly():
        from pytest_elastic_timer.ci.junit_fallback import properties_of

    have = {name for name, _ in report.user_properties}
    for name, value in properties_of(record):
        if name not in have:
            report.user_properties.append((name, value))


def _scope_of(report: pytest.TestReport) -> str | None:
    for name, value in report.user_properties:
        if name == SCOPE_PROPERTY:
            return str(value)
    return None


def _from_properties(report: pytest.TestReport) -> ExpiryRecord | None:
    """The expired scope whose facts a worker attached to ``report``."""
    props = {str(k): v for k, v in report.user_properties}
    if PROPERTY_PREFIX + "action" not in props:
        return None
    try:
        return ExpiryRecord(
            report.nodeid,
            str(props[PROPERTY_PREFIX + "scope"]),
            float(str(props[PROPERTY_PREFIX + "budget"])),
            float(str(props[PROPERTY_PREFIX + "elapsed"])),
            int(str(props[PROPERTY_PREFIX + "pid"])),
            str(props.get(PROPERTY_PREFIX + "label", "")),
            str(getattr(report, "worker_id", "") or ""),
            "",
            0,
            str(props[PROPERTY_PREFIX + "action"]),
            "",
        )
    except (KeyError, ValueError):
        return None


def _expired_of(config: pytest.Config, report: pytest.TestReport) -> list[ExpiryRecord]:
    """The expired scopes a failed report is about: its own (raised in the test's
    process or recorded for a crashed xdist worker) or those of processes it started."""
    if isinstance(report.longrepr, ExpiryRepr):
        return [report.longrepr.record]
    own = _from_properties(report)
    worker = str(getattr(report, "worker_id", "") or "")
    found = _of_run(expiry_records(config), report.nodeid, worker)
    caught_in = getattr(report, CAUGHT_IN, None)
    if caught_in is not None:  # not what failed the test
        found = [r for r in found if (r.pid, r.action) != (caught_in, "interrupted")]
    if own is not None:
        # The watchdog's record knows more (file, line, worker) than the exception.
        same = [r for r in found if (r.pid, r.scope) == (own.pid, own.scope)]
        return same[:1] or [own]
    scope = _scope_of(report)
    if scope is not None:
        return [r for r in found if r.scope == scope][:1] or found
    return found


def _of_run(found: list[ExpiryRecord], nodeid: str, worker: str) -> list[ExpiryRecord]:
    """The records of ``found`` about test ``nodeid`` as ``worker`` ran it ("" outside
    xdist): under ``--dist each`` every worker runs the test, on its host, and each
    run's report is about its own expiries. A record that names no worker (a process
    that left xdist's environment behind) counts for every run of its test."""
    return [r for r in found if r.nodeid == nodeid and (r.worker == worker or not r.worker)]


class ExpiryReports:
    """In the process that ran the test: failed reports get the scope line first, and
    sections for expiries in processes the test started."""

    NAME = "elastic_timer_expiry_reports"

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        describe_failure(item, call, report)
        return report


def describe_failure(
    item: pytest.Item, call: pytest.CallInfo[None], report: pytest.TestReport
) -> None:
    """Lead a failed ``report`` of ``item`` with the line of the scope that expired, and
    add sections for the expiries in processes the test started."""
    if report.failed:
        try:
            _describe_failure(item, call, report)
        except Exception as exc:  # the test's own report stands: never an INTERNALERROR
            report.sections.append(
                ("elastic-timer", f"the expiry details could not be added: {exc!r}")
            )


def _describe_failure(
    item: pytest.Item, call: pytest.CallInfo[None], report: pytest.TestReport
) -> None:
    excinfo = call.excinfo
    exc = _scope_expired_in(excinfo.value) if excinfo is not None else None
    if exc is not None:
        _lead_with_scope_line(report, exc)
        # Its facts travel with the report (to an xdist controller).
        _add_properties(report, _record_of(item, exc))
    elif running.interrupted_here(item):
        setattr(report, CAUGHT_IN, unpatched.getpid())
    _add_process_sections(item, report)
    _add_collective_sections(item, report)


def note_failed_report(config: pytest.Config, report: pytest.TestReport) -> None:
    """In the controller (or only process): a failed ``report`` about expired scopes
    gets their facts as properties (and so the ``TIMEOUT`` status, see
    :class:`TimeoutStatus`), and is handed to the ``pytest_elastic_timer_expired``
    hook."""
    if not report.failed or report.when not in TEST_PHASES:
        return
    found = _expired_of(config, report)
    if not found:
        return
    if _scope_of(report) is None:
        report.user_properties.append((SCOPE_PROPERTY, found[0].scope))
    _add_properties(report, found[0])
    state = config.stash[SESSION]
    known = state.expired.setdefault(report.nodeid, [])
    seen = {(k.host, k.worker, k.pid, k.scope) for k in known}
    known.extend(r for r in found if (r.host, r.worker, r.pid, r.scope) not in seen)
    config.hook.pytest_elastic_timer_expired(config=config, report=report, records=found)


class FailedReports:
    """In a process that runs its tests itself: their failed reports go through
    :func:`note_failed_report` before any other plugin sees them. (An xdist controller
    has its workers' reports go through it in the one hook it has for every report,
    ``xdist_support.WorkerReports``.)"""

    NAME = "elastic_timer_failed_reports"

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        note_failed_report(self.config, report)


class TimeoutStatus:
    """In the controller (or only process): expired tests read ``T`` / ``TIMEOUT`` in
    the progress line and verbose output."""

    NAME = "elastic_timer_timeout_status"

    def pytest_report_teststatus(self, report: pytest.TestReport, config: pytest.Config) -> Any:
        if not report.failed:
            return None
        properties = getattr(report, "user_properties", ())  # a CollectReport has none
        if any(k == SCOPE_PROPERTY for k, _ in properties):
            # Setup and teardown count as errors, as any failure there does.
            category = "failed" if report.when == "call" else "error"
            # A plain word: pytest colours a failed report's word red by itself, and
            # before 8.3 its short summary printed a (word, markup) pair as a tuple.
            return category, "T", "TIMEOUT"
        return None


def register_reports(config: pytest.Config) -> None:
    """Register the failed-report plugins (once).

    :func:`running.watch_failures <pytest_elastic_timer.plugin.running.watch_failures>`
    calls this when a test failed or a scope expired.
    """
    manager = config.pluginmanager
    if not manager.has_plugin(ExpiryReports.NAME):
        manager.register(ExpiryReports(), ExpiryReports.NAME)
    if is_worker(config):
        return
    if not manager.has_plugin(TimeoutStatus.NAME):
        manager.register(TimeoutStatus(), TimeoutStatus.NAME)
    if not uses_xdist(config) and not manager.has_plugin(FailedReports.NAME):
        manager.register(FailedReports(config), FailedReports.NAME)


def fail_the_interrupted_test(session: pytest.Session, state: SessionState) -> None:
    """The test that the session's budget stopped (with Exit, as Ctrl-C does: nothing
    a test catches) fails as a test whose own scope expired, with the session scope's
    line: ``TIMEOUT`` in the summary, a failure in the JUnit file, where Exit left it
    with no outcome. (An xdist worker's test fails by the ScopeExpired itself.)"""
    if state.interrupted_test is None:
        return
    nodeid, when = state.interrupted_test
    state.interrupted_test = None
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or any(
        (getattr(report, "nodeid", ""), getattr(report, "when", "")) == (nodeid, when)
        for reports in reporter.stats.values()
        for report in reports
    ):
        # Its phase has an outcome of its own: in a thread, where the session's budget
        # raises a ScopeExpired, or where the test caught Exit (``except BaseException``).
        return
    item = next((i for i in session.items if i.nodeid == nodeid), None)
    found = [
        r
        for r in expiry_records(session.config)
        if (r.scope, r.nodeid, r.pid) == (SESSION_SCOPE, nodeid, unpatched.getpid())
    ]
    if item is None or not found:
        return
    register_reports(session.config)
    keywords: dict[str, Literal[1]] = {name: 1 for name in item.keywords}
    phase = cast("Literal['setup', 'call', 'teardown']", when)  # one of TEST_PHASES
    failed = pytest.TestReport(
        nodeid,
        item.location,
        keywords,
        "failed",
        ExpiryRepr(found[-1], item.location[0], found[-1].line, session.config),
        phase,
        user_properties=[(SCOPE_PROPERTY, SESSION_SCOPE)],
    )
    item.ihook.pytest_runtest_logreport(report=failed)
    if when != "teardown":  # the JUnit file writes a test's properties at its teardown
        closing = pytest.TestReport(
            nodeid,
            item.location,
            keywords,
            "passed",
            None,
            "teardown",
            user_properties=list(failed.user_properties),
        )
        item.ihook.pytest_runtest_logreport(report=closing)
    item.ihook.pytest_runtest_logfinish(nodeid=nodeid, location=item.location)


def _scope_expired_in(exc: BaseException) -> ScopeExpired | None:
    """The ScopeExpired that ``exc`` is, or that caused it: raised ``from`` it, while
    handling it, in an exception group (a trio nursery, an asyncio task group), or in
    a doctest example (doctest's UnexpectedException keeps it in ``exc_info``)."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, ScopeExpired):
            return current
        todo.extend(e for e in (current.__cause__, current.__context__) if e is not None)
        grouped = getattr(current, "exceptions", ())
        if isinstance(grouped, (list, tuple)):
            todo.extend(e for e in grouped if isinstance(e, BaseException))
        info = getattr(current, "exc_info", None)
        if isinstance(info, tuple) and len(info) == 3 and isinstance(info[1], BaseException):
            todo.append(info[1])
    return None


def _record_of(item: pytest.Item, exc: ScopeExpired) -> ExpiryRecord:
    file, line = records.split_site(exc.site)
    return ExpiryRecord(
        item.nodeid, exc.scope, exc.budget, exc.elapsed, exc.pid, exc.label,
        os.environ.get("PYTEST_XDIST_WORKER", ""), file, line, exc.action, "",
    )  # fmt: skip


def _add_process_sections(item: pytest.Item, report: pytest.TestReport) -> None:
    """Expiries in processes the test started (ranks), and where its children were."""
    me = unpatched.getpid()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    for record in _of_run(expiry_records(item.config), item.nodeid, worker):
        if record.pid != me:
            report.sections.append(
                (
                    f"elastic-timer: expired in {record.owner_text()}",
                    record_text(item.config, record),
                )
            )
        elif record.collective:
            with plainly():
                from pytest_elastic_timer.core import collectives  # only for ranks' records

            line = collectives.collective_line(record.collective, record.rank_stacks())
            report.sections.append(("elastic-timer: collective", line))
        for child in [*record.children, *record.peers]:
            # (on another host, the pid is that host's)
            host = f"host {record.host}" if record.host else ""
            who = ", ".join(
                str(x) for x in (child.get("label"), f"pid {child.get('pid')}", host) if x
            )
            if child.get("stack"):
                report.sections.append(
                    (
                        f"elastic-timer: stack of {who} at expiry",
                        stack_text(item.config, str(child["stack"])),
                    )
                )
            elif child.get("no_stack"):
                report.sections.append(
                    (f"elastic-timer: no stack of {who}", str(child["no_stack"]))
                )


def _add_collective_sections(item: pytest.Item, report: pytest.TestReport) -> None:
    """A rank of the test died (gloo aborts a rank on some mismatches; a rank that
    crashed, or called ``os._exit``, takes the others down with it): what each of the
    test's ranks was in, from their rings."""
    directory = session_directory(item.config)
    if not directory:
        return
    with plainly():
        from pytest_elastic_timer.core import collectives  # a failed test's, once

    found = collectives.rings_of_test(directory, item.nodeid)
    if any(collectives.died(ring) for ring in found):
        report.sections.append(
            (
                "elastic-timer: collectives of the test's ranks",
                collectives.ranks_text(found, unpatched.monotonic()),
            )
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
    elif isinstance(longrepr, str) or hasattr(longrepr, "toterminal"):
        # Another kind of failure text (a doctest's) as text, as xdist sends it anyway.
        report.longrepr = f"{line}\n{longrepr}"
    report.user_properties.append((SCOPE_PROPERTY, exc.scope))
