"""JUnit XML (``--junitxml``): the testcase of a test that expired scopes failed -- its
own, or one of a process it started (a rank) -- reads as a timeout. Once pytest's
junitxml wrote its file, :func:`fix_junit` gives the test's ``<failure>`` (or
``<error>``) the type ``pytest_elastic_timer.ScopeExpired``, the scope line as message
and first line of its text, the scope's properties, and the properties that
implementations of the expired hook added to the failed report. pytest writes a
testcase's properties from one report only: the teardown's (a copy of the item's), or
a failed call's when its teardown failed too; and none for a crashed xdist worker.
When pytest is killed, the watchdog writes the file instead: :mod:`.junit_fallback`.

Registered in the controller (or only process) of a session run with ``--junitxml``;
it implements the plugin's hooks (:mod:`..plugin.hookspecs`).
"""

from __future__ import annotations

import collections
import os
import sys
import xml.etree.ElementTree as ET
from collections.abc import Generator, Iterable
from typing import Any

import pytest

from pytest_elastic_timer.ci import junit_fallback
from pytest_elastic_timer.ci.junit_fallback import FAILURE_TYPE
from pytest_elastic_timer.core import atomic_file
from pytest_elastic_timer.core.records import ExpiryRecord


class Testcase:
    """One testcase of pytest's file, as the expired hook filled it: the expired scopes
    of its run, and the ``(name, value)`` properties the hook's implementations added
    to its reports, in the order added, each once."""

    __slots__ = ("properties", "records")

    def __init__(self) -> None:
        self.records: list[ExpiryRecord] = []
        self.properties: list[tuple[str, str]] = []

    def add_records(self, found: Iterable[ExpiryRecord]) -> None:
        seen = {(k.host, k.pid, k.scope) for k in self.records}
        for record in found:
            if (record.host, record.pid, record.scope) not in seen:
                seen.add((record.host, record.pid, record.scope))
                self.records.append(record)

    def add_properties(self, pairs: Iterable[tuple[str, str]]) -> None:
        for pair in pairs:
            if pair not in self.properties:
                self.properties.append(pair)


class Testcases:
    """The testcases pytest's junitxml writes for each test, in its order, each with
    the expired scopes of its run and the properties added to its reports (filled by
    the expired hook).

    pytest's rule, followed here: a testcase per run of a test by a worker (the
    report's ``node``; None without xdist), opened by the run's first report and
    closed by its teardown's, and one more for a teardown error after a failed call.
    Under ``--dist each`` every worker runs the test: its testcases are told apart
    only by this order."""

    def __init__(self) -> None:
        self.of_test: dict[str, list[Testcase]] = {}
        self._open: dict[tuple[str, Any], Testcase] = {}
        self._failed_call: set[tuple[str, Any]] = set()

    def current(self, report: pytest.TestReport) -> Testcase:
        """The testcase that ``report`` goes to (the expired hook asks before this
        plugin hears of the report)."""
        key = (report.nodeid, getattr(report, "node", None))
        if report.when == "teardown" and report.failed and key in self._failed_call:
            self._failed_call.discard(key)  # the teardown's error: a testcase of its own
            self._open.pop(key, None)
        run = self._open.get(key)
        if run is None:
            run = self._open[key] = Testcase()
            self.of_test.setdefault(report.nodeid, []).append(run)
        return run

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """``report`` went to its testcase; a teardown's closes it."""
        self.current(report)
        key = (report.nodeid, getattr(report, "node", None))
        if report.when == "call" and report.failed:
            self._failed_call.add(key)
        elif report.when == "teardown":
            self._open.pop(key, None)
            self._failed_call.discard(key)


# Subscripted in the annotation only (plugin/state.py's SESSION says why).
TESTCASES: pytest.StashKey[Testcases] = pytest.StashKey()


def _junit_names(nodeid: str, prefix: str | None) -> tuple[str, str]:
    try:  # pytest's own spelling where it has one
        from _pytest.junitxml import mangle_test_address

        names = mangle_test_address(nodeid)
        classnames = [prefix, *names[:-1]] if prefix else names[:-1]
        return ".".join(classnames), names[-1]
    except Exception:
        return junit_fallback.testcase_names(nodeid, prefix)


def _property_value(value: str) -> str:
    """``value`` as pytest's junitxml writes a property's (its escape, where it has one)."""
    try:
        from _pytest.junitxml import bin_xml_escape

        return bin_xml_escape(value)
    except Exception:
        return junit_fallback.xml_safe(value)


def _pairs(properties: Iterable[object]) -> list[tuple[str, str]]:
    """``user_properties`` as the name/value strings pytest writes of them."""
    return [
        (str(prop[0]), str(prop[1]))
        for prop in properties
        if isinstance(prop, (tuple, list)) and len(prop) == 2  # no file has another
    ]


def _added(before: list[tuple[str, str]], after: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The properties of ``after`` that ``before`` did not hold, in their order."""
    left = collections.Counter(before)
    new = []
    for pair in after:
        if left[pair]:
            left[pair] -= 1
        else:
            new.append(pair)
    return new


def fix_junit(path: str, expired: dict[str, list[Testcase]], prefix: str | None = None) -> int:
    """Give the testcases of ``expired`` tests in pytest's JUnit file at ``path`` the
    ScopeExpired failure type, the scope line, the scope's properties and those the
    expired hook's implementations added (where pytest did not write them). Returns
    how many testcases were changed.

    ``expired`` holds, by node id, each of the test's testcases in the file's order
    (:class:`Testcases`): a test run by several workers has one for each run."""
    tree = ET.parse(path)
    wanted = {_junit_names(nodeid, prefix): runs for nodeid, runs in expired.items()}
    seen: collections.Counter[tuple[str, str]] = collections.Counter()
    changed = 0
    for case in tree.iter("testcase"):
        key = (case.get("classname", ""), case.get("name", ""))
        runs = wanted.get(key)
        if runs is None:
            continue
        index = seen[key]
        seen[key] += 1
        run = runs[index] if index < len(runs) else Testcase()
        found = run.records
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
        # The hook's, after the plugin's as in the report: pytest wrote those of a
        # failed teardown, and of a failed call whose teardown failed too; not the rest.
        written = {(p.get("name"), p.get("value")) for p in props}
        for name, value in run.properties:
            pair = (name, _property_value(value))
            if pair not in written:
                written.add(pair)
                ET.SubElement(props, "property", name=pair[0], value=pair[1])
    if changed:
        text = ET.tostring(tree.getroot(), encoding="unicode")
        atomic_file.write_text(path, '<?xml version="1.0" encoding="utf-8"?>' + text)
    return changed


def junit_path(config: pytest.Config) -> str | None:
    """Where pytest's junitxml writes its file (as its LogXML does), or None."""
    xmlpath = config.getoption("xmlpath", None)
    if not xmlpath:
        return None
    return os.path.normpath(os.path.abspath(os.path.expanduser(os.path.expandvars(str(xmlpath)))))


# -- hooks -----------------------------------------------------------------------------
@pytest.hookimpl(wrapper=True)  # around every implementation: sees what they all add
def pytest_elastic_timer_expired(
    config: pytest.Config, report: pytest.TestReport, records: list[ExpiryRecord]
) -> Generator[None, list[object], list[object]]:
    run = config.stash.setdefault(TESTCASES, Testcases()).current(report)
    run.add_records(records)
    before = _pairs(report.user_properties)
    result = yield
    run.add_properties(_added(before, _pairs(report.user_properties)))
    return result


def pytest_configure(config: pytest.Config) -> None:
    # Every report is seen, in pytest's order, by an object of this session's own.
    testcases = config.stash.setdefault(TESTCASES, Testcases())
    config.pluginmanager.register(testcases, f"{__name__}.testcases")


@pytest.hookimpl(trylast=True)  # after pytest's junitxml wrote the file
def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    path = junit_path(config)
    testcases = config.stash.get(TESTCASES, None)
    expired = testcases.of_test if testcases is not None else {}
    any_expired = any(run.records for runs in expired.values() for run in runs)
    if path and any_expired and os.path.exists(path):
        try:
            fix_junit(path, expired, config.getoption("junitprefix", None))
        except (OSError, ET.ParseError) as exc:
            sys.stderr.write(f"pytest-elastic-timer: cannot amend {path}: {exc}\n")
