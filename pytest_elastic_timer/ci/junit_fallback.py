"""A JUnit XML file the watchdog writes when pytest itself was killed.

pytest writes ``--junitxml`` at the end of its session; a pytest process that was
killed (``kill -9``, the OOM killer, a CI step timeout, or the watchdog ending a C call
in a single-process session) leaves no file, and the CI job shows no failed test at
all. The watchdog outlives pytest, so it writes the file instead: one ``<testcase>``
per test with an expired scope, failed with the same ``<failure>`` (``<error>`` in setup
or teardown) and properties that :mod:`.reports` adds to pytest's own file, plus one
``<error>`` testcase ``pytest.session`` that says pytest was ended before it could
write its report.

Nothing here imports pytest: it runs in the watchdog process.
"""

from __future__ import annotations

import platform
import re
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from typing import Any

from pytest_elastic_timer.core import atomic_file
from pytest_elastic_timer.core.records import ExpiryRecord, format_record

FAILURE_TYPE = "pytest_elastic_timer.ScopeExpired"
SESSION_ERROR_TYPE = "pytest_elastic_timer.SessionEnded"
PROPERTY_PREFIX = "elastic_timer_"
# Characters XML 1.0 does not allow, even escaped (pytest's junitxml does the same).
_ILLEGAL = re.compile("[^\u0009\u000a\u000d\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def xml_safe(text: object) -> str:
    """``text`` with every character XML cannot hold replaced by ``#xNN``."""
    return _ILLEGAL.sub(lambda m: f"#x{ord(m.group()):02X}", str(text))


def testcase_names(nodeid: str, prefix: str | None = None) -> tuple[str, str]:
    """(classname, name) of a test in JUnit XML, as pytest's junitxml spells them:
    ``tests/test_a.py::TestB::test_c[x]`` -> ``("tests.test_a.TestB", "test_c[x]")``."""
    head, bracket, params = nodeid.partition("[")
    names = head.split("::")
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    if bracket:
        names[-1] += f"[{params}"
    classnames = names[:-1]
    if prefix:
        classnames.insert(0, prefix)
    return ".".join(classnames), names[-1]


def properties_of(record: ExpiryRecord) -> list[tuple[str, str]]:
    """The ``<property>`` name/value pairs that describe one expired scope."""
    values = {
        "scope": record.scope,
        "budget": f"{record.budget:g}",
        "elapsed": f"{record.elapsed:.3f}",
        "pid": str(record.pid),
        "label": record.label,
        "action": record.action,
    }
    if record.host:  # another host than the controller's
        values["host"] = record.host
    return [(PROPERTY_PREFIX + name, value) for name, value in values.items()]


def failure_text(records: list[ExpiryRecord]) -> str:
    """The body of a ``<failure>``: the scope line first (what GitLab and most CI
    viewers show), then where and in which process, then the stack."""
    return "\n\n".join(format_record(r) for r in records) + "\n"


def _testcase(nodeid: str, records: list[ExpiryRecord]) -> ET.Element:
    classname, name = testcase_names(nodeid) if nodeid else ("pytest", "session")
    file, line = records[0].file, records[0].line
    attrs = {"classname": xml_safe(classname), "name": xml_safe(name), "time": "0.000"}
    if nodeid:
        attrs["file"] = xml_safe(nodeid.split("::", 1)[0])
    elif file:
        attrs["file"] = xml_safe(file)
    if line:
        attrs["line"] = str(max(line - 1, 0))  # pytest writes 0-based lines
    case = ET.Element("testcase", attrs)
    props = ET.SubElement(case, "properties")
    for key, value in properties_of(records[0]):
        ET.SubElement(props, "property", name=key, value=xml_safe(value))
    # As pytest's junitxml has it: a failure in the call, an error in setup or teardown.
    tag = "failure" if records[0].test_phase() == "call" else "error"
    failure = ET.SubElement(case, tag, type=FAILURE_TYPE, message=xml_safe(records[0].line_text()))
    failure.text = xml_safe(failure_text(records))
    return case


def build(records: Iterable[ExpiryRecord], session: dict[str, Any]) -> ET.Element:
    """The ``<testsuites>`` element of the fallback file."""
    by_test: dict[str, list[ExpiryRecord]] = {}
    for record in records:
        by_test.setdefault(record.nodeid, []).append(record)
    cases = [_testcase(nodeid, found) for nodeid, found in by_test.items()]
    pid = session.get("pid", "?")
    ended = ET.Element("testcase", classname="pytest", name="session-ended", time="0.000")
    error = ET.SubElement(
        ended,
        "error",
        type=SESSION_ERROR_TYPE,
        message=f"pytest (pid {pid}) was ended before it wrote its JUnit XML report",
    )
    error.text = xml_safe(
        f"pytest (pid {pid}) was ended before it wrote its JUnit XML report; "
        f"pytest-elastic-timer's watchdog wrote this file instead.\n"
        f"{len(by_test)} test(s) with expired scopes are listed as failures (errors "
        f"where the scope expired in setup or teardown).\n"
    )
    started = float(session.get("started") or time.time())
    ended_at = float(session.get("ended") or time.time())
    errors = sum(1 for case in cases if case.find("error") is not None)
    suite = ET.Element(
        "testsuite",
        name="pytest",
        errors=str(1 + errors),
        failures=str(len(cases) - errors),
        skipped="0",
        tests=str(len(cases) + 1),
        time=f"{max(ended_at - started, 0.0):.3f}",
        timestamp=time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        hostname=xml_safe(platform.node()),
    )
    props = ET.SubElement(suite, "properties")
    for key in ("pid", "root_died", "workers", "scale", "grace", "expires"):
        if key in session:
            ET.SubElement(props, "property", name=PROPERTY_PREFIX + key, value=str(session[key]))
    suite.extend(cases)
    suite.append(ended)
    top = ET.Element("testsuites", name="pytest tests")
    top.append(suite)
    return top


def write(path: str, records: list[ExpiryRecord], session: dict[str, Any]) -> None:
    """Write a valid JUnit XML file at ``path`` naming every expired test."""
    text = ET.tostring(build(records, session), encoding="unicode")
    atomic_file.write_text(path, '<?xml version="1.0" encoding="utf-8"?>' + text + "\n")
