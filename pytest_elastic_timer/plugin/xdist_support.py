"""pytest-xdist integration: a worker the watchdog terminated is reported by scope.

Controller side: xdist reports a dead worker's running test as "worker 'gw0' crashed
while running ...". ``pytest_handlecrashitem`` waits for the watchdog's record of that
worker and turns the report into a timeout report: failed in its real phase, at the
test's location, the scope line first, the stack dump as a section.

Worker side: xdist hands the crashed test back to the scheduler under some ``--dist``
modes (loadscope, loadfile, loadgroup re-queue the whole work unit), to any worker. A
worker never runs a test again whose scope the watchdog already had to terminate: it
tears down what the next test does not need, exactly as pytest would, and reports
nothing, so the test is reported once. Under ``--dist each`` every worker runs every
test and none is handed back: a test ended on one worker still runs on the others.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from _pytest._code.code import ReprFileLocation, TerminalRepr
from _pytest._io import TerminalWriter

from pytest_elastic_timer.core import records, startup, unpatched
from pytest_elastic_timer.core.plain_imports import plainly
from pytest_elastic_timer.plugin import lifecycle, remote_hosts
from pytest_elastic_timer.plugin.lifecycle import SESSION_SCOPE
from pytest_elastic_timer.plugin.state import (
    SESSION,
    SessionState,
    expiry_records,
    is_worker,
    record_text,
    records_beside,
    stack_text,
    worker_id,
)
from pytest_elastic_timer.scope import client, scopes

ADDRESS_KEY = "elastic_timer_address"
EACH_KEY = "elastic_timer_each"  # every worker runs every test (--dist each)
STOPPED_KEY = "elastic_timer_stopped"  # the session stops: why (a replacement worker's)
BUDGETS_KEY = "elastic_timer_budgets"  # a worker's marked tests' budgets, in its output
SCOPE_PROPERTY = "elastic_timer_scope"
HARD_ACTIONS = ("terminated", "killed")
RERUNS_FILE = "reruns"  # in the session directory: a line per run allowed again
# A test may replace time's functions with mocks, and what the plugin does inside that
# test (or inside a session that test runs) must not call them.
_sleep = unpatched.sleep
_monotonic = unpatched.monotonic


class ExpiryRepr(TerminalRepr):
    """The failure text of a test whose process the watchdog ended."""

    def __init__(
        self, record: records.ExpiryRecord, path: str, lineno: int, config: pytest.Config
    ) -> None:
        self.record = record
        self.reprcrash = ReprFileLocation(path, lineno, record.line_text())
        self.text = record_text(config, record, with_stack=False).split("\n", 1)[-1]
        self.stack = stack_text(config, record.stack)

    def toterminal(self, tw: TerminalWriter) -> None:
        tw.line(self.record.line_text(), red=True, bold=True)
        tw.line(self.text)
        if self.stack:
            tw.line("")
            tw.line("stack of the owner when it was ended:")
            tw.line(self.stack.rstrip())


# -- controller ----------------------------------------------------------------------
class WorkerReports:
    """Controller plugin: the one hook every report of the workers goes through. A
    hook implementation costs each report a call, and a session has thousands: the
    records of other hosts that a report carries are handed to this host's watchdog
    here, and a failed report, once that is done, to the failed-report plugins
    (``expiry.note_failed_report``), which load at the first."""

    NAME = "elastic_timer_worker_reports"

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.note_failed: Callable[[pytest.Config, pytest.TestReport], None] | None = None

    # tryfirst: the failed report's facts are in before other plugins (the terminal,
    # JUnit) see it.
    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        found = report.__dict__.pop(remote_hosts.RECORDS_ATTRIBUTE, None)
        if found:
            remote_hosts.forward(found)  # before the failed report looks for them
        if report.failed:
            note_failed = self.note_failed or self._load_failed_reports()
            if note_failed is not None:
                note_failed(self.config, report)

    def _load_failed_reports(self) -> Callable[[pytest.Config, pytest.TestReport], None] | None:
        from pytest_elastic_timer.plugin import running

        if not running.try_watch_failures(self.config):
            return None  # tried again at the next failed report
        with plainly():
            from pytest_elastic_timer.plugin import expiry

        self.note_failed = expiry.note_failed_report
        return self.note_failed


def register_worker_reports(config: pytest.Config) -> None:
    """Register :class:`WorkerReports` (once), in a controller that starts workers."""
    if not config.pluginmanager.has_plugin(WorkerReports.NAME):
        config.pluginmanager.register(WorkerReports(config), WorkerReports.NAME)


def pytest_configure_node(node: Any) -> None:
    address = os.environ.get(client.ENV_ADDRESS)
    if address:
        node.workerinput[ADDRESS_KEY] = address
    # The worker's own config says "no" dist mode (xdist sets it so): tell it this one.
    node.workerinput[EACH_KEY] = node.config.getoption("dist", "no") == "each"
    stopped = node.config.stash.get(STOPPED, "")
    if stopped:
        # A replacement xdist starts for a worker ended for the session's budget.
        node.workerinput[STOPPED_KEY] = stopped
    _offer_host_watchdog(node, address)


def _offer_host_watchdog(node: Any, address: str | None) -> None:
    """Tell the worker how to tell whether it runs on another host, and how to start
    that host's watchdog; records of other hosts come back through the reports."""
    config: pytest.Config = node.config
    state = config.stash.get(SESSION, None)
    if state is None or state.watchdog is None or not address:
        return
    settings = state.settings
    node.workerinput[remote_hosts.HOST_KEY] = remote_hosts.workerinput(
        address, settings.grace, settings.scale
    )
    if not config.pluginmanager.has_plugin(remote_hosts.RemoteRecords.NAME):
        config.pluginmanager.register(
            remote_hosts.RemoteRecords(state), remote_hosts.RemoteRecords.NAME
        )


def wait_for_record(
    config: pytest.Config, records_path: str, nodeid: str, worker: str, patience: float
) -> records.ExpiryRecord | None:
    """The watchdog's record of ``nodeid`` ending on ``worker``; waits while the
    watchdog is still escalating against that worker."""
    explained = config.stash.setdefault(EXPLAINED, set())

    def pick(found: list[records.ExpiryRecord], settled: bool) -> records.ExpiryRecord | None:
        """The record that explains the crash, of the worker's records so far."""
        return _explaining(found, nodeid, explained, settled=settled)

    record = _wait_for(records_path, worker, patience, pick)
    if record is not None:
        explained.add(record.key)
    return record


def _wait_for(
    records_path: str,
    worker: str,
    patience: float,
    pick: Callable[[list[records.ExpiryRecord], bool], records.ExpiryRecord | None],
) -> records.ExpiryRecord | None:
    """The record that ``pick`` chooses among ``worker``'s (given them, and whether the
    watchdog has stopped escalating against the worker); waits while it escalates."""
    give_up = _monotonic() + patience
    while True:
        answer = scopes.process_state().request("sync")
        found = [r for r in records.read_records(records_path) if r.worker == worker]
        pending = answer.get("pending", [])
        busy = any(p.get("worker") == worker for p in pending if isinstance(p, dict))
        record = pick(found, not busy)
        if record is not None:
            return record
        if not busy or _monotonic() > give_up:
            return None
        _sleep(0.02)


def _explaining(
    found: list[records.ExpiryRecord], nodeid: str, explained: set[Any], *, settled: bool
) -> records.ExpiryRecord | None:
    """Of a worker's records, the one that says why it was ended while it ran
    ``nodeid``."""
    for record in reversed(found):
        if record.nodeid == nodeid:
            return record
    # A scope entered outside every test (the session's, at sessionstart) names no
    # test: the worker's hard ending is still what crashed it.
    for record in reversed(found):
        if record.action in HARD_ACTIONS and record.nodeid in ("", nodeid):
            return record
    if settled:
        # A scope of an earlier test that outlived it (a thread's, say) ended the
        # worker while it ran this one: that record, once nothing is escalating, if
        # its owner was the worker itself (a pytest process: it names its phase), not
        # a rank or helper of the worker that the watchdog ended alone.
        for record in reversed(found):
            if record.action in HARD_ACTIONS and record.phase and record.key not in explained:
                return record
    return None


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """The budgets of a worker's tests that differ from the default (see
    :func:`pytest_sessionfinish`), for the outputs of slow phases; and a worker that
    went down for the session's budget stops the session."""
    output = getattr(node, "workeroutput", None) or {}
    state = node.config.stash.get(SESSION, None)
    if state is not None:
        for nodeid, budgets in dict(output.get(BUDGETS_KEY, {})).items():
            state.budgets.reported[str(nodeid)] = tuple(budgets)
    if error is not None and state is not None and state.watchdog is not None:
        _stop_if_down_for_the_session(node, state.watchdog.records_path, state)
    stopped = output.get(lifecycle.STOPPED_IN_SESSIONFINISH)
    if stopped:  # the session's budget ran out in the worker's pytest_sessionfinish
        node.config.stash.setdefault(STOPPED, str(stopped))
        _stop_the_session(node.config, str(stopped))


def _stop_if_down_for_the_session(node: Any, records_path: str, state: SessionState) -> None:
    """A worker that went down without finishing its session (ended by the watchdog,
    stuck outside any test: collecting, say) after the session's budget ran out in it
    stops the session, as when a test is running (:func:`pytest_handlecrashitem`, which
    xdist calls only then). xdist replaces the worker all the same: the replacement
    collects nothing (see :func:`pytest_sessionstart`)."""
    worker = str(getattr(getattr(node, "gateway", None), "id", ""))

    def pick(found: list[records.ExpiryRecord], settled: bool) -> records.ExpiryRecord | None:
        """The worker's latest record of the session's own scope, if any."""
        ours = [r for r in found if r.scope == SESSION_SCOPE]
        return ours[-1] if ours else None

    record = _wait_for(records_path, worker, state.ended_worker_patience(), pick)
    if record is not None:
        _stop_for_the_session_budget(node.config, record)


def _stop_for_the_session_budget(config: pytest.Config, record: records.ExpiryRecord) -> None:
    """Stop the session for the session's budget, run out in a worker that had to be
    ended: with its scope line, phase and worker, as the worker itself says it when it
    fails where it is."""
    reason = lifecycle.session_stop_reason(record.line_text(), record.phase, record.worker)
    config.stash.setdefault(STOPPED, reason)
    _stop_the_session(config, reason)


# trylast: a plugin that runs the test again (pytest-rerunfailures) has said so in
# ``report.outcome`` by then.
@pytest.hookimpl(optionalhook=True, trylast=True)
def pytest_handlecrashitem(crashitem: str, report: pytest.TestReport, sched: Any) -> None:
    config: pytest.Config = sched.config
    state = config.stash.get(SESSION, None)
    if state is None or state.watchdog is None:
        return
    gateway = getattr(report.node, "gateway", None)
    worker = str(getattr(gateway, "id", ""))
    patience = state.ended_worker_patience()
    records_path = state.watchdog.records_path
    record = wait_for_record(config, records_path, crashitem, worker, patience)
    spec = getattr(gateway, "spec", None)
    if record is None and spec is not None and remote_hosts.maybe_remote(spec):
        # Ended on another host by the watchdog there: ask it, through a gateway of
        # its own (the worker's is gone; a socket server it ran in accepts again:
        # RemoteRecords.pytest_testnodedown waited for it).
        token = os.path.basename(state.watchdog.directory)
        remote_hosts.forward(remote_hosts.fetch_from_host(spec, token, worker, patience))
        record = wait_for_record(config, records_path, crashitem, worker, 0.0)
    if record is None:
        return
    outcome: str = report.outcome  # pytest's type knows only its own three outcomes
    again = outcome == "rerun"  # queued again by another plugin, on purpose
    if again:
        _run_again(state.watchdog.directory, crashitem)
    else:
        _mark_done(sched, crashitem)
    _keep_replacements_collections(sched)
    path = crashitem.split("::", 1)[0]
    domain = name_of_test(crashitem, grouped=config.getvalue("dist") == "loadgroup")
    report.when = record.test_phase(domain)  # type: ignore[assignment]  # one of pytest's
    if record.scope.startswith(f"{domain}::"):
        # xdist's report of a crashed worker's test lasts 0 s: --durations, the JUnit
        # time and the slowest tests would have this one among the quickest.
        report.duration = record.elapsed
    lineno = max(record.line - 1, 0) if record.file.endswith(path) else None
    report.location = (path, lineno, domain)
    report.longrepr = ExpiryRepr(record, path, record.line, config)
    if record.stack:
        report.sections.append(("elastic-timer stack dump", stack_text(config, record.stack)))
    report.user_properties.append((SCOPE_PROPERTY, record.scope))
    if record.scope == SESSION_SCOPE:
        _stop_for_the_session_budget(config, record)
    elif not again:
        _count_the_failure(config)


def _run_again(directory: str, nodeid: str) -> None:
    """Let a worker run ``nodeid`` once more although the watchdog ended it (see
    :class:`EndedTests`): a line per run allowed, in the session directory."""
    with unpatched.open(os.path.join(directory, RERUNS_FILE), "a", encoding="utf-8") as f:
        f.write(nodeid + "\n")


def _stop_the_session(config: pytest.Config, reason: str) -> None:
    """No test starts after this one (xdist ends its loop with ``reason``, exit status
    2); a replacement worker would otherwise run the rest. For the session's budget,
    run out in a worker that had to be ended, as when it interrupts a test."""
    dsession = config.pluginmanager.get_plugin("dsession")
    if dsession is not None and not getattr(dsession, "shouldstop", True):
        dsession.shouldstop = reason


def _count_the_failure(config: pytest.Config) -> None:
    """xdist counts a crashed worker's test apart from failures; this one is a test
    that failed by its scope, and counts for ``-x`` / ``--maxfail`` as when its
    worker is interrupted (the same count and words as xdist's own)."""
    dsession = config.pluginmanager.get_plugin("dsession")
    count = getattr(dsession, "countfailures", None)
    if dsession is None or not isinstance(count, int):
        return
    maxfail = getattr(dsession, "maxfail", 0)
    dsession.countfailures = count + 1
    if maxfail and count + 1 >= maxfail:
        _stop_the_session(config, f"stopping after {count + 1} failures")


def name_of_test(nodeid: str, *, grouped: bool = False) -> str:
    """The test's name in ``nodeid``: its last part, and where xdist's ``loadgroup``
    hands out the tests (``grouped``), without the ``@group`` it adds to their nodeids
    on pytest 8 (``test_x.py::test_y[1]@alpha`` -> ``test_y[1]``)."""
    name = nodeid.split("::")[-1]
    head, bracket, tail = name.rpartition("]")  # an "@" in the parameters stays
    if grouped and "@" in tail:
        return head + bracket + tail.split("@", 1)[0]
    return name


def _mark_done(sched: Any, nodeid: str) -> None:
    """Keep a re-queued work unit (loadscope family) from running ``nodeid`` again."""
    workqueue = getattr(sched, "workqueue", None)
    if not isinstance(workqueue, dict):
        return
    _keep_replacements_busy(sched)
    for scope, unit in list(workqueue.items()):
        if isinstance(unit, dict) and nodeid in unit:
            unit[nodeid] = True
        if isinstance(unit, dict) and all(unit.values()):
            # xdist re-queues every unit of the ended worker, those it had finished
            # too. A unit with nothing left to run would be handed to a worker as an
            # empty batch, in place of a test it needs (see below).
            del workqueue[scope]


def _keep_replacements_busy(sched: Any) -> None:
    """A worker runs a test once it has the next one, or shutdown: one left with a
    single test (our marking shrinks re-queued units) holds it until either comes, and
    nothing would send either. After each reschedule, go on giving it units until it
    has two tests or shutdown. A replacement worker whose collection has not come yet
    is left for later: xdist schedules every worker once a replacement's collection
    comes, and one without a collection of its own fails there (a KeyError, an
    INTERNALERROR), which two workers replaced at once make likely."""
    reschedule = getattr(sched, "_reschedule", None)
    pending_of = getattr(sched, "_pending_of", None)
    assigned = getattr(sched, "assigned_work", None)
    collections = getattr(sched, "registered_collections", None)
    if reschedule is None or pending_of is None or assigned is None or collections is None:
        return
    if getattr(reschedule, "_elastic_timer", False):
        return

    def until_it_holds_two(node: Any) -> None:
        if node not in collections:
            return
        reschedule(node)
        work = assigned.get(node)
        # Each turn hands it a unit (the queue shrinks) or shutdown (it ends).
        while work is not None and not node.shutting_down and pending_of(work) < 2:
            reschedule(node)

    until_it_holds_two._elastic_timer = True  # type: ignore[attr-defined]
    sched._reschedule = until_it_holds_two


def _keep_replacements_collections(sched: Any) -> None:
    """``--dist each``: xdist keeps the collection of the first workers only, not of a
    replacement, and so:

    - losing a replacement in turn, it could not name the test that worker ran (a
      KeyError it swallows): that test went unreported, and the tests after it unrun;
    - a replacement for a worker ended in its last test has nothing left to run, and
      was scheduled as a new worker, to run every test;
    - a replacement whose collection had not come yet when another's came was
      scheduled with it, as a new worker.

    The last two failed in the scheduler (a KeyError, an INTERNALERROR). Keep a
    replacement's collection as xdist keeps the first workers', shut down one that has
    nothing to run, and schedule none before its collection has come."""
    add = getattr(sched, "add_node_collection", None)
    schedule = getattr(sched, "schedule", None)
    collections = getattr(sched, "node2collection", None)
    pending = getattr(sched, "node2pending", None)
    started = getattr(sched, "_started", None)
    if add is None or schedule is None or getattr(add, "_elastic_timer", False):
        return
    if not (isinstance(collections, dict) and isinstance(pending, dict)):
        return
    if not isinstance(started, list):
        return

    def add_node_collection(node: Any, collection: Sequence[str]) -> None:
        replacing = bool(getattr(sched, "collection_is_completed", False))
        add(node, collection)
        if not replacing:
            return
        collections.setdefault(node, list(collection))
        if not pending.get(node) and node not in started:
            started.append(node)  # not to be scheduled as a new worker, to run everything
            node.shutdown()

    def schedule_collected() -> None:
        uncollected = [n for n in pending if n not in collections and n not in started]
        started.extend(uncollected)  # passed over now, scheduled once their collection comes
        try:
            schedule()
        finally:
            for node in uncollected:
                started.remove(node)

    add_node_collection._elastic_timer = True  # type: ignore[attr-defined]
    sched.add_node_collection = add_node_collection
    sched.schedule = schedule_collected


# -- worker --------------------------------------------------------------------------
class EndedTests:
    """The nodeids whose process the watchdog ended, read from its records file, less
    the runs the controller allowed again (a test that pytest-rerunfailures runs once
    more): ended more often than allowed again."""

    def __init__(self, records_path: str) -> None:
        self.path = records_path
        self.reruns_path = os.path.join(os.path.dirname(records_path), RERUNS_FILE)
        self.sizes = (-1, -1)
        self.nodeids: set[str] = set()

    def __contains__(self, nodeid: str) -> bool:
        sizes = (_size(self.path), _size(self.reruns_path))
        if sizes[0] <= 0:
            return False
        if sizes != self.sizes:
            self.sizes = sizes
            # Only the endings of a worker itself (a pytest process: it names its
            # phase); a rank or helper the watchdog ended alone crashed no worker.
            ended = Counter(
                r.nodeid
                for r in records.read_records(self.path)
                if r.action in HARD_ACTIONS and r.phase
            )
            try:
                with unpatched.open(self.reruns_path, encoding="utf-8") as f:
                    allowed = Counter(line.rstrip("\n") for line in f)
            except OSError:
                allowed = Counter()
            self.nodeids = {n for n, times in ended.items() if times > allowed[n]}
        return nodeid in self.nodeids


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


# Subscripted in the annotation only (plugin/state.py's SESSION says why).
ENDED: pytest.StashKey[EndedTests] = pytest.StashKey()
# Why the session stops for its budget, run out in a worker that was ended (controller).
STOPPED = pytest.StashKey[str]()
# The records that explained a crashed worker's test already (controller).
EXPLAINED = pytest.StashKey[set[Any]]()


def configure_worker(config: pytest.Config) -> None:
    workerinput: dict[str, Any] = getattr(config, "workerinput", {})
    # Under --dist each no test is handed to another worker: none is skipped.
    skips_ended = not workerinput.get(EACH_KEY, False)
    if remote_hosts.join(config, workerinput.get(remote_hosts.HOST_KEY)):
        # On another host: its own watchdog serves it, and keeps its records.
        address = os.environ.get(client.ENV_ADDRESS)
        if address and skips_ended:
            config.stash[ENDED] = EndedTests(records_beside(address))
        return
    address = os.environ.get(client.ENV_ADDRESS) or workerinput.get(ADDRESS_KEY)
    if not address:
        return
    os.environ[client.ENV_ADDRESS] = address
    # The worker inherited the session's PYTHONPATH, but a plugin that sets it from
    # the ini file (pytest-env) sets it again in each worker, before this runs: the
    # processes the worker starts still get the session's start-up hook first.
    os.environ["PYTHONPATH"] = startup.python_path(os.environ.get("PYTHONPATH"))
    if skips_ended:
        config.stash[ENDED] = EndedTests(records_beside(address))


def warn_if_refused(config: pytest.Config) -> None:
    """Say on the controller that the session's watchdog refused this worker.

    A worker on the controller's host that is not a descendant of its pytest (run by an
    execnet socket server started outside the session) is refused: it enforces its
    scopes in-process. What the worker writes on its stderr goes to that server's
    terminal, not the controller's; a warning reaches the controller's summary (xdist
    forwards it). Called once the worker's connection is made, in configure: waiting
    for the watchdog's answer costs one round trip, and a worker that was refused
    learns it here rather than by the lack of a report later."""
    process = scopes.process_state()
    process.welcome()
    if not process.refused:
        return
    # Its children would be refused too, each with a word on that server's stderr.
    os.environ.pop(client.ENV_ADDRESS, None)
    lifecycle.warn_without_watchdog(
        config,
        f"the session's watchdog refused worker {worker_id(config)} ({process.refused}); "
        "its scopes are enforced in-process only (no stack dumps, no termination of hung "
        "processes), and their expiries are not in the expired scopes' summary nor in the "
        "JSON report",
    )


# tryfirst: before xdist's own, which hands the worker's collection to the controller.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """A worker whose session budget ran out in collection stops before it hands the
    controller its collection."""
    lifecycle.stop_worker_after_the_budget(session)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    lifecycle.stop_worker_after_the_budget(item.session)
    ended = item.config.stash.get(ENDED, None)
    if ended is None or item.nodeid not in ended:
        return None
    setupstate = getattr(item.session, "_setupstate", None)
    if setupstate is not None:
        setupstate.teardown_exact(nextitem)
    return True


def pytest_sessionstart(session: pytest.Session) -> None:
    """A replacement for a worker ended for the session's budget (see
    :func:`_stop_if_down_for_the_session`) starts while the session stops: it fails at
    once (pytest's collection stops at its first collector, Failed), before it imports
    a test module, which would hang it as it hung the worker it replaces."""
    workerinput: dict[str, Any] = getattr(session.config, "workerinput", {})
    stopped = workerinput.get(STOPPED_KEY)
    if stopped:
        session.shouldfail = str(stopped)


# trylast: in the controller, after xdist's own hook, which waits for the workers to end.
@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """A worker hands its tests' budgets that differ from the default (markers) to the
    controller, with the rest of its output. The controller, its workers ended, stops
    the session for the session's budget run out in a worker after the worker had
    handed over its output (in a conftest's ``pytest_unconfigure``): nothing else says
    so, and the tests had all finished."""
    config = session.config
    state = config.stash.get(SESSION, None)
    if state is None:
        return
    output = getattr(config, "workeroutput", None)
    if is_worker(config):
        if output is not None:
            output[BUDGETS_KEY] = state.budgets.marked()
        return
    if (
        not state.settings.session
        or state.watchdog is None
        or getattr(session, "exitstatus", 0) == pytest.ExitCode.INTERRUPTED
    ):
        return
    ran_out = [r for r in expiry_records(config) if r.scope == SESSION_SCOPE and r.worker]
    if ran_out:
        record = ran_out[0]
        reason = lifecycle.session_stop_reason(record.line_text(), record.phase, record.worker)
        lifecycle.stopped_by_a_worker_at_its_end(session, state, reason)
