"""CI outputs: enriched JUnit XML, GitHub Actions annotations and step summary,
trace timeline, slow-scope warnings. A pytest plugin module registered by
:mod:`.plugin` in ``pytest_configure``.

Where each output comes from:

- **JUnit XML** (``--junitxml``): a test with an expired scope -- its own, or one of a
  process it started (a rank) -- gets the scope's facts as ``user_properties``
  (``elastic_timer_scope``, ``_budget``, ``_elapsed``, ``_pid``, ``_label``,
  ``_action``). Once pytest's junitxml wrote its file, :func:`fix_junit` gives the
  test's ``<failure>`` (or ``<error>``) the type ``pytest_elastic_timer.ScopeExpired``,
  the scope line as message and first line of its text, and the properties (pytest
  writes a call report's properties only in some cases, and none for a crashed xdist
  worker). When pytest is killed, the watchdog writes the file: :mod:`.junit_fallback`.
- **GitHub Actions** (``GITHUB_ACTIONS=true``): one ``::error`` workflow command per
  expired scope (at most :data:`ANNOTATION_LIMIT`) in the terminal summary, and a
  Markdown table appended to ``$GITHUB_STEP_SUMMARY``.
- **Slow scopes** (``--elastic-timer-slow``): test phases that used at least that
  fraction of their budget, in the terminal summary and the JSON report.
- **Trace** (``--elastic-timer-trace``) and the session facts of the JSON report:
  :func:`session_end`, called by the plugin just before the watchdog stops.
"""

from __future__ import annotations

import heapq
import json
import math
import operator
import os
import sys
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import pytest

from pytest_elastic_timer.ci import junit_fallback, trace
from pytest_elastic_timer.ci.junit_fallback import FAILURE_TYPE, PROPERTY_PREFIX
from pytest_elastic_timer.core import records
from pytest_elastic_timer.core.records import ExpiryRecord
from pytest_elastic_timer.plugin import hooks as plugin
from pytest_elastic_timer.plugin import xdist_support
from pytest_elastic_timer.scope import scopes
from pytest_elastic_timer.scope.scopes import ScopeExpired

HELP = {
    "slow": "list a test phase as SLOW in the terminal summary once it used this fraction "
    "of its budget (default 0.8; 0 = off).",
}
DEFAULT_SLOW = 0.8
ANNOTATION_LIMIT = 10  # GitHub shows at most 10 error annotations per step anyway
SLOWEST_TESTS = 50  # tests listed in the JSON report's session.slowest
SLOWEST_SCOPES = 3  # scopes listed per test there
SCHEMA = "report.schema.json"
PHASES = ("setup", "call", "teardown")
REPORTER_NAME = "elastic_timer_ci_session"


def add_options(group: Any, parser: pytest.Parser) -> None:
    """Options of the CI outputs (called from the plugin's ``pytest_addoption``)."""
    group.addoption(
        "--elastic-timer-slow",
        dest="elastic_timer_slow",
        default=None,
        metavar="FRACTION",
        help=HELP["slow"],
    )
    parser.addini("elastic_timer_slow", HELP["slow"], default=None)


def report_schema() -> dict[str, Any]:
    """The JSON Schema of the JSON report (``--elastic-timer-report``)."""
    text = resources.files("pytest_elastic_timer.core").joinpath(SCHEMA).read_text(encoding="utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema


@dataclass(frozen=True)
class PhaseTime:
    """How long one test phase took, against its budget."""

    nodeid: str
    when: str
    seconds: float
    budget: float | None

    @property
    def scope(self) -> str:
        return f"{self.nodeid.rsplit('::', 1)[-1]}::{self.when}"

    @property
    def share(self) -> float | None:
        return self.seconds / self.budget if self.budget else None

    def suggestion(self, fraction: float) -> float:
        """A budget under which this duration stays well below the slow threshold."""
        return nice_ceil(self.seconds / (fraction * 0.75))

    def to_json(self, fraction: float) -> dict[str, Any]:
        return {
            "nodeid": self.nodeid,
            "scope": self.scope,
            "phase": self.when,
            "seconds": round(self.seconds, 6),
            "budget": self.budget,
            "share": round(self.share or 0.0, 4),
            "suggested_budget": self.suggestion(fraction),
        }


@dataclass
class CiState:
    """What the CI outputs collect over the session (controller or single process)."""

    slow: float
    junit: str | None
    junit_prefix: str | None
    trace: str | None = None
    expired: dict[str, list[ExpiryRecord]] = field(default_factory=dict)
    locations: dict[str, tuple[str, int | None]] = field(default_factory=dict)
    # (nodeid, when, seconds, budget) per phase of the slowest tests, and the
    # slow phases: read from the terminal's reports once the session ends.
    raw_phases: list[tuple[str, str, float, float | None]] = field(default_factory=list)
    slow_found: list[PhaseTime] = field(default_factory=list)
    # Budgets of tests that differ from the default (a marker), scaled: from the items,
    # or from each xdist worker's output.
    budgets: dict[str, tuple[float | None, float | None, float | None]] = field(
        default_factory=dict
    )
    collected: bool = False

    exitstatus: int | None = None


CI = pytest.StashKey[CiState]()


# -- configuration -------------------------------------------------------------------
def parse_fraction(raw: object, what: str) -> float:
    """A fraction in [0, 1] from ``raw``, or ValueError naming ``what``."""
    try:
        value = float(str(raw).strip()) if not isinstance(raw, bool) else math.nan
    except ValueError:
        value = math.nan
    if not (0.0 <= value <= 1.0):
        raise ValueError(f"{what} must be a fraction between 0 and 1, not {raw!r}")
    return value


def pytest_configure(config: pytest.Config) -> None:
    where, raw = plugin._option(config, "elastic_timer_slow")
    try:
        slow = DEFAULT_SLOW if raw is None else parse_fraction(raw, where)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    junit = None
    if not hasattr(config, "workerinput"):
        xmlpath = config.getoption("xmlpath", None)
        if xmlpath:  # where pytest's junitxml writes it (as LogXML.__init__ does)
            junit = os.path.normpath(
                os.path.abspath(os.path.expanduser(os.path.expandvars(xmlpath)))
            )
    state = config.stash[CI] = CiState(slow, junit, config.getoption("junitprefix", None))
    trace_path = config.stash[plugin.SESSION].settings.trace
    state.trace = os.path.abspath(trace_path) if trace_path else None
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(SessionReports(config, state), REPORTER_NAME)


# -- reports -------------------------------------------------------------------------
# Nothing here runs for a passing test: phase times are read from the terminal's
# reports at the end, and the hooks below are registered once a test fails.
def annotate_expiry(
    item: pytest.Item, call: pytest.CallInfo[None], report: pytest.TestReport
) -> None:
    """An expiry raised in this process adds its facts to the failed report as user
    properties (they travel to an xdist controller with it)."""
    if not report.failed or call.excinfo is None:
        return
    exc = call.excinfo.value
    if isinstance(exc, ScopeExpired) and _scope_of(report) == exc.scope:
        file, line = records.split_site(exc.site)
        record = ExpiryRecord(
            item.nodeid, exc.scope, exc.budget, exc.elapsed, exc.pid, exc.label,
            os.environ.get("PYTEST_XDIST_WORKER", ""), file, line, exc.action, "",
        )  # fmt: skip
        _add_properties(report, record)


def _scope_of(report: pytest.TestReport) -> str | None:
    for name, value in report.user_properties:
        if name == xdist_support.SCOPE_PROPERTY:
            return str(value)
    return None


def _add_properties(report: pytest.TestReport, record: ExpiryRecord) -> None:
    have = {name for name, _ in report.user_properties}
    for name, value in junit_fallback.properties_of(record):
        if name not in have:
            report.user_properties.append((name, value))


def _from_properties(report: pytest.TestReport) -> ExpiryRecord | None:
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


class SessionReports:
    """The hooks of the controller (or only) process that need its config: they collect
    expired tests and phase times from reports, and write the outputs at the end."""

    def __init__(self, config: pytest.Config, state: CiState) -> None:
        self.config = config
        self.state = state

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        if plugin._uses_xdist(self.config):  # workers' failures arrive at any time
            watch_failures(self.config)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        """An xdist worker's budgets that differ from the default (see worker_output)."""
        output = getattr(node, "workeroutput", None) or {}
        for nodeid, budgets in dict(output.get(BUDGETS_KEY, {})).items():
            self.state.budgets[str(nodeid)] = tuple(budgets)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        state = self.state
        state.exitstatus = int(exitstatus)
        collect_phases(session, state)
        if state.junit and state.expired and os.path.exists(state.junit):
            try:
                fix_junit(state.junit, state.expired, state.junit_prefix)
            except (OSError, ET.ParseError) as exc:
                sys.stderr.write(f"pytest-elastic-timer: cannot amend {state.junit}: {exc}\n")

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        state, config = self.state, self.config
        slow = slow_phases(state)
        if slow:
            terminalreporter.section(
                f"elastic-timer: slow scopes (>= {state.slow:.0%} of their budget)",
                sep="=",
                yellow=True,
            )
            for phase in slow:
                terminalreporter.write_line(slow_line(phase, state.slow))
        if os.environ.get("GITHUB_ACTIONS") != "true":
            return
        found = plugin._records(config)
        root = os.environ.get("GITHUB_WORKSPACE") or str(config.rootpath)
        for text in github_annotations(found, root, str(config.rootpath), state.locations):
            terminalreporter.write_line(text)
        summary = os.environ.get("GITHUB_STEP_SUMMARY")
        if summary and (found or slow):
            try:
                with open(summary, "a", encoding="utf-8") as f:
                    f.write(step_summary(found, slow, state.slow))
            except OSError as exc:
                terminalreporter.write_line(f"pytest-elastic-timer: cannot write {summary}: {exc}")


class FailedReports:
    """Failed reports about expired scopes, in the controller (or only) process: their
    facts as user properties, their record for the JUnit file and the summary, and the
    ``TIMEOUT`` status. Registered once a test fails (always in an xdist controller)."""

    NAME = "elastic_timer_failed_reports"

    def __init__(self, config: pytest.Config, state: CiState) -> None:
        self.config = config
        self.state = state

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if not report.failed or report.when not in PHASES:
            return
        found = _expired_of(self.config, report)
        if found:
            if _scope_of(report) is None:
                report.user_properties.append((xdist_support.SCOPE_PROPERTY, found[0].scope))
            _add_properties(report, found[0])
            known = self.state.expired.setdefault(report.nodeid, [])
            seen = {(k.pid, k.scope) for k in known}
            known.extend(r for r in found if (r.pid, r.scope) not in seen)

    def pytest_report_teststatus(self, report: pytest.TestReport, config: pytest.Config) -> Any:
        """Expired tests read ``T`` / ``TIMEOUT`` in the progress line and verbose output."""
        if not report.failed:
            return None
        properties = getattr(report, "user_properties", ())  # a CollectReport has none
        if any(k == xdist_support.SCOPE_PROPERTY for k, _ in properties):
            # Setup and teardown count as errors, as any failure there does.
            category = "failed" if report.when == "call" else "error"
            return category, "T", ("TIMEOUT", {"red": True})
        return None


def watch_failures(config: pytest.Config) -> None:
    """From now on, failed reports are looked at (a test failed, or a scope expired)."""
    state = config.stash.get(CI, None)
    if state is None or hasattr(config, "workerinput"):
        return
    if not config.pluginmanager.has_plugin(FailedReports.NAME):
        config.pluginmanager.register(FailedReports(config, state), FailedReports.NAME)


BUDGETS_KEY = "elastic_timer_budgets"


def worker_output(session: pytest.Session) -> None:
    """An xdist worker hands its tests' budgets that differ from the default (markers)
    to the controller, with the rest of its output."""
    output = getattr(session.config, "workeroutput", None)
    if output is None:
        return
    output[BUDGETS_KEY] = _item_budgets(session)


def _item_budgets(
    session: pytest.Session,
) -> dict[str, tuple[float | None, float | None, float | None]]:
    state = session.config.stash[plugin.SESSION]
    scale = state.settings.scale
    return {
        nodeid: tuple(  # type: ignore[misc]
            None if b is None else b * scale
            for b in (budgets.setup, budgets.call, budgets.teardown)
        )
        for nodeid, budgets in state.marked.items()
    }


def collect_phases(session: pytest.Session, state: CiState) -> None:
    """Slow phases, and every phase of the slowest tests, from the reports the
    terminal kept (one pass over them all, then one over the few that make the list)."""
    if state.collected:
        return
    state.collected = True
    settings = session.config.stash[plugin.SESSION].settings
    call_default = settings.expires * settings.scale if settings.expires else None
    if not hasattr(session.config, "workerinput"):
        state.budgets.update(_item_budgets(session))
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    stats: dict[str, list[Any]] = getattr(reporter, "stats", None) or {}
    groups = list(stats.values())
    budgets = state.budgets
    ranked = settings.report is not None  # only the JSON report lists the slowest tests
    # Passed setups and teardowns (the group without a category) matter only to the
    # ranking and to tests with a setup or teardown budget: most sessions skip them.
    phase_budgets = any(b[0] is not None or b[2] is not None for b in budgets.values())
    scanned = [g for key, g in stats.items() if key or ranked or phase_budgets]
    index = {"setup": 0, "call": 1, "teardown": 2}
    slow = state.slow

    def budget_of(nodeid: str, when: str) -> float | None:
        known = budgets.get(nodeid)
        if known is not None:
            return known[index[when]]
        return call_default if when == "call" else None

    every = [b for known in budgets.values() for b in known if b] + [call_default or 0.0]
    smallest = min((b for b in every if b), default=0.0)
    threshold = slow * smallest if slow and smallest else math.inf
    # The hot loop of the session's end: every report once, and only with a JSON
    # report is every phase's test looked at.
    longest: dict[str, float] = {}
    get = longest.get
    for group in scanned:
        if not ranked and _longest(group) < threshold:
            continue  # nothing in it is slow: skipped without a Python step per report
        for report in group:
            seconds = getattr(report, "duration", None)  # warnings have none
            if seconds is None or report.when not in index:
                continue
            if ranked:
                nodeid = report.nodeid
                if seconds > get(nodeid, -1.0):
                    longest[nodeid] = seconds
            if seconds >= threshold:  # a phase that may be slow: look at its budget
                nodeid, when = report.nodeid, report.when
                budget = budget_of(nodeid, when)
                if budget and slow * budget <= seconds <= budget and nodeid not in state.expired:
                    state.slow_found.append(PhaseTime(nodeid, when, seconds, budget))
    state.slow_found.sort(key=lambda p: -(p.share or 0.0))
    wanted = set(heapq.nlargest(SLOWEST_TESTS, longest, key=longest.__getitem__))
    wanted.update(state.expired)  # where GitHub annotations of expired tests point
    if not wanted:
        return
    for group in groups:
        for report in group:
            if getattr(report, "when", None) not in index:
                continue
            nodeid = report.nodeid
            if nodeid in wanted:
                if nodeid in longest:
                    state.raw_phases.append(
                        (
                            nodeid,
                            report.when,
                            report.duration,
                            budget_of(nodeid, report.when),
                        )
                    )
                state.locations.setdefault(nodeid, (report.location[0], report.location[1]))


_duration = operator.attrgetter("duration")


def _longest(reports: list[Any]) -> float:
    """The longest duration in ``reports`` (inf if one has none: look at each)."""
    try:
        return max(map(_duration, reports), default=0.0)
    except (AttributeError, TypeError):  # a warnings report, or None
        return math.inf


def _expired_of(config: pytest.Config, report: pytest.TestReport) -> list[ExpiryRecord]:
    """The expired scopes a failed report is about: its own (raised in the test's
    process or recorded for a crashed xdist worker) or those of processes it started."""
    if isinstance(report.longrepr, xdist_support.ExpiryRepr):
        return [report.longrepr.record]
    own = _from_properties(report)
    found = [r for r in plugin._records(config) if r.nodeid == report.nodeid]
    if own is not None:
        # The watchdog's record knows more (file, line, worker) than the exception.
        same = [r for r in found if (r.pid, r.scope) == (own.pid, own.scope)]
        return same[:1] or [own]
    scope = _scope_of(report)
    if scope is not None:
        return [r for r in found if r.scope == scope][:1] or found
    return found


# -- JUnit XML -----------------------------------------------------------------------
def _junit_names(nodeid: str, prefix: str | None) -> tuple[str, str]:
    try:  # pytest's own spelling where it has one
        from _pytest.junitxml import mangle_test_address

        names = mangle_test_address(nodeid)
        classnames = [prefix, *names[:-1]] if prefix else names[:-1]
        return ".".join(classnames), names[-1]
    except Exception:
        return junit_fallback.testcase_names(nodeid, prefix)


def fix_junit(path: str, expired: dict[str, list[ExpiryRecord]], prefix: str | None = None) -> int:
    """Give the testcases of ``expired`` tests in pytest's JUnit file at ``path`` the
    ScopeExpired failure type, the scope line and the scope's properties. Returns how
    many testcases were changed."""
    tree = ET.parse(path)
    wanted = {_junit_names(nodeid, prefix): found for nodeid, found in expired.items()}
    changed = 0
    for case in tree.iter("testcase"):
        found = wanted.get((case.get("classname", ""), case.get("name", "")))
        problems = [c for c in case if c.tag in ("failure", "error")]
        if not found or not problems:
            continue
        changed += 1
        first = found[0]
        line = first.line_text()
        problem = next((p for p in problems if p.tag == "failure"), problems[0])
        problem.set("type", FAILURE_TYPE)
        problem.set("message", junit_fallback.xml_safe(line))
        text = problem.text or ""
        if not text.startswith(line):
            lead = "\n".join(r.line_text() for r in found)
            where = "\n".join(
                f"  in {r.owner_text()}" + (f", entered at {r.file}:{r.line}" if r.file else "")
                for r in found
            )
            problem.text = junit_fallback.xml_safe(f"{lead}\n{where}\n\n{text}")
        props = case.find("properties")
        if props is None:
            props = ET.Element("properties")
            case.insert(0, props)
        have = {p.get("name") for p in props}
        for name, value in junit_fallback.properties_of(first):
            if name not in have:
                ET.SubElement(props, "property", name=name, value=junit_fallback.xml_safe(value))
    if changed:
        text = ET.tostring(tree.getroot(), encoding="unicode")
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write('<?xml version="1.0" encoding="utf-8"?>' + text)
        os.replace(tmp, path)
    return changed


# -- terminal summary: slow scopes, GitHub Actions -----------------------------------
def slow_phases(state: CiState) -> list[PhaseTime]:
    """Test phases that used at least the slow fraction of their budget (not expired)."""
    return state.slow_found if state.slow else []


def nice_ceil(seconds: float) -> float:
    """The smallest of 1, 1.5, 2, 3, 5, 7.5 times a power of ten that is >= ``seconds``."""
    if seconds <= 0:
        return 0.0
    power = 10.0 ** math.floor(math.log10(seconds))
    for step in (1, 1.5, 2, 3, 5, 7.5, 10):
        if step * power >= seconds * (1 - 1e-9):
            return float(f"{step * power:.6g}")
    return 10 * power


def slow_line(phase: PhaseTime, fraction: float) -> str:
    return (
        f"SLOW {phase.nodeid} {phase.when}: {phase.seconds:.2f}s of {phase.budget:g}s budget "
        f"({phase.share or 0:.0%}); suggested budget {phase.suggestion(fraction):g}s"
    )


def escape_data(text: str) -> str:
    """A workflow command's message, escaped as GitHub's runner un-escapes it."""
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(text: str) -> str:
    """A workflow command's property value (``file=``, ``title=``), escaped."""
    return escape_data(text).replace(":", "%3A").replace(",", "%2C")


def _where(
    record: ExpiryRecord,
    workspace: str,
    rootdir: str,
    locations: Mapping[str, tuple[str, int | None]],
) -> tuple[str, int]:
    """(file relative to ``workspace``, 1-based line) to annotate, or ("", 0)."""

    def inside(path: str) -> str:
        rel = os.path.relpath(os.path.abspath(path), os.path.abspath(workspace))
        return "" if rel.startswith("..") else rel

    if record.file and os.path.isfile(record.file) and inside(record.file):
        return inside(record.file), record.line
    location = locations.get(record.nodeid)
    if location is not None:  # a scope entered outside any file (python -c): the test
        rel = inside(os.path.join(rootdir, location[0]))
        if rel:
            return rel, (location[1] or 0) + 1
    return "", 0


def github_annotations(
    found: list[ExpiryRecord],
    workspace: str,
    rootdir: str,
    locations: Mapping[str, tuple[str, int | None]] | None = None,
    limit: int = ANNOTATION_LIMIT,
) -> list[str]:
    """GitHub Actions ``::error`` commands, one per expired scope (at most ``limit``,
    then one ``::warning`` saying how many were left out)."""
    out = []
    for record in found[:limit]:
        file, line = _where(record, workspace, rootdir, locations or {})
        props = []
        if file:
            props.append(f"file={escape_property(file)}")
            if line:
                props.append(f"line={line}")
        props.append(f"title={escape_property(f'elastic-timer: {record.scope} expired')}")
        message = [record.line_text()]
        if record.nodeid:
            message.append(f"test: {record.nodeid}")
        message.append(f"process: {record.owner_text()}")
        out.append(f"::error {','.join(props)}::{escape_data(chr(10).join(message))}")
    if len(found) > limit:
        left = len(found) - limit
        out.append(
            f"::warning title=elastic-timer::{left} more expired scope(s) not annotated "
            f"(at most {limit} per session); see the job summary or the JSON report"
        )
    return out


def _cell(text: object, code: bool = False) -> str:
    value = " ".join(str(text).split()).replace("|", "\\|")
    if code and value and "`" not in value:
        return f"`{value}`"
    return value.replace("`", "\\`")


def step_summary(found: list[ExpiryRecord], slow: list[PhaseTime], fraction: float) -> str:
    """Markdown for ``$GITHUB_STEP_SUMMARY``: the expired scopes, then the slow ones."""
    out = []
    if found:
        out += [
            f"### elastic-timer: {len(found)} expired scope(s)",
            "",
            "| test | scope | budget | elapsed | action | process |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        out += [
            f"| {_cell(r.nodeid or '(session)', True)} | {_cell(r.scope, True)} "
            f"| {r.budget:g}s | {r.elapsed:.2f}s | {r.action} | {_cell(r.owner_text())} |"
            for r in found
        ]
        out.append("")
    if slow:
        out += [
            f"### elastic-timer: {len(slow)} slow scope(s) (>= {fraction:.0%} of their budget)",
            "",
            "| test | scope | duration | budget | share | suggested budget |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        out += [
            f"| {_cell(p.nodeid, True)} | {_cell(p.scope, True)} | {p.seconds:.2f}s "
            f"| {p.budget:g}s | {p.share or 0:.0%} | {p.suggestion(fraction):g}s |"
            for p in slow
        ]
        out.append("")
    return "\n".join(out) + "\n"


# -- end of the session: trace and facts for the JSON report --------------------------
def session_end(config: pytest.Config) -> dict[str, Any]:
    """Write the trace timeline while the session directory exists; return facts for
    the JSON report's ``session`` object. Called just before the watchdog stops."""
    state = config.stash.get(CI, None)
    session = config.stash.get(plugin.SESSION, None)
    if state is None or session is None or session.watchdog is None:
        return {}
    events: list[dict[str, Any]] = []
    path = state.trace
    if path:
        process = scopes.current_state()
        if process is not None:
            process.flush_trace()  # scopes that ended after the plugin's flush
        events = trace.read_events(session.watchdog.directory)
        facts = {
            "pid": os.getpid(),
            "started": session.started,
            "args": list(config.invocation_params.args),
        }
        try:
            trace.write(path, events, plugin._records(config), facts)
        except OSError as exc:
            sys.stderr.write(f"pytest-elastic-timer: cannot write {path}: {exc}\n")
    return {
        "exitstatus": state.exitstatus,
        "slow_fraction": state.slow,
        "slow": [p.to_json(state.slow) for p in slow_phases(state)],
        "slowest": slowest(
            state.raw_phases, events, [r for v in state.expired.values() for r in v]
        ),
    }


def slowest(
    phases: Sequence[tuple[str, str, float, float | None]],
    events: list[dict[str, Any]],
    expired: Sequence[ExpiryRecord] = (),
    tests: int = SLOWEST_TESTS,
    per_test: int = SLOWEST_SCOPES,
) -> list[dict[str, Any]]:
    """Per test, its slowest scopes (phases, and traced scopes of every process when
    tracing is on), for the ``tests`` tests whose slowest scope took longest."""
    # First only the longest time per test (one pass, no objects), then the details of
    # the few tests that make the list.
    longest: dict[str, float] = {}
    get = longest.get
    for nodeid, _, seconds, _ in phases:
        if seconds > get(nodeid, -1.0):
            longest[nodeid] = seconds
    timed = [(e, str(e.get("nodeid") or "")) for e in events]
    for event, nodeid in timed:
        if nodeid:
            seconds = float(event["end"]) - float(event["start"])
            if seconds > get(nodeid, -1.0):
                longest[nodeid] = seconds
    top = heapq.nlargest(tests, longest, key=longest.__getitem__)
    wanted = set(top)
    budgets = {(r.nodeid, r.scope): r.budget for r in expired}
    by_test: dict[str, dict[str, dict[str, Any]]] = {nodeid: {} for nodeid in top}
    for nodeid, when, seconds, budget in phases:
        if nodeid in wanted:
            scope = f"{nodeid.rsplit('::', 1)[-1]}::{when}"
            by_test[nodeid][scope] = {
                "scope": scope,
                "seconds": round(seconds, 6),
                "budget": budget,
            }
    for event, nodeid in timed:
        if nodeid not in wanted:
            continue
        seconds = round(float(event["end"]) - float(event["start"]), 6)
        known = by_test[nodeid]
        path = str(event.get("path", ""))
        entry = known.get(path)
        if entry is None or entry["seconds"] < seconds:
            known[path] = {
                "scope": path,
                "seconds": seconds,
                "budget": entry["budget"] if entry else budgets.get((nodeid, path)),
            }
    ranked = [
        {
            "nodeid": nodeid,
            "scopes": sorted(by_test[nodeid].values(), key=lambda s: -s["seconds"])[:per_test],
        }
        for nodeid in top
    ]
    return ranked
