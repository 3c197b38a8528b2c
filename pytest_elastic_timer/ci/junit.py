"""JUnit XML (``--junitxml``): the testcase of a test that expired scopes failed -- its
own, or one of a process it started (a rank) -- reads as a timeout. Once pytest's
junitxml wrote its file, :func:`fix_junit` gives the test's ``<failure>`` (or
``<error>``) the type ``pytest_elastic_timer.ScopeExpired``, the scope line as message
and first line of its text, and the scope's properties (pytest writes a call report's
properties only in some cases, and none for a crashed xdist worker). When pytest is
killed, the watchdog writes the file instead: :mod:`.junit_fallback`.

Registered in the controller (or only process) of a session run with ``--junitxml``;
it implements the plugin's hooks (:mod:`..plugin.hookspecs`).
"""

from __future__ import annotations

import collections
import os
import sys
import xml.etree.ElementTree as ET

import pytest

from pytest_elastic_timer.ci import junit_fallback
from pytest_elastic_timer.ci.junit_fallback import FAILURE_TYPE
from pytest_elastic_timer.core import atomic_file
from pytest_elastic_timer.core.records import ExpiryRecord

# The expired scopes of each test, by node id, then by the worker that ran it ("" but
# under xdist), in the order the runs' failed reports came: under ``--dist each`` every
# worker runs the test, and pytest writes a testcase for each run.
EXPIRED = pytest.StashKey[dict[str, dict[str, list[ExpiryRecord]]]]()


def _junit_names(nodeid: str, prefix: str | None) -> tuple[str, str]:
    try:  # pytest's own spelling where it has one
        from _pytest.junitxml import mangle_test_address

        names = mangle_test_address(nodeid)
        classnames = [prefix, *names[:-1]] if prefix else names[:-1]
        return ".".join(classnames), names[-1]
    except Exception:
        return junit_fallback.testcase_names(nodeid, prefix)


def fix_junit(
    path: str, expired: dict[str, dict[str, list[ExpiryRecord]]], prefix: str | None = None
) -> int:
    """Give the testcases of ``expired`` tests in pytest's JUnit file at ``path`` the
    ScopeExpired failure type, the scope line and the scope's properties. Returns how
    many testcases were changed.

    A test run by several workers (``--dist each``) has a testcase per run, in the
    order of their reports: when as many of its testcases failed as runs expired
    scopes, each gets its own run's; otherwise each gets them all."""
    tree = ET.parse(path)
    wanted = {_junit_names(nodeid, prefix): list(runs.values()) for nodeid, runs in expired.items()}
    failed = collections.Counter(
        (case.get("classname", ""), case.get("name", ""))
        for case in tree.iter("testcase")
        if any(c.tag in ("failure", "error") for c in case)
    )
    seen: collections.Counter[tuple[str, str]] = collections.Counter()
    changed = 0
    for case in tree.iter("testcase"):
        key = (case.get("classname", ""), case.get("name", ""))
        runs = wanted.get(key)
        problems = [c for c in case if c.tag in ("failure", "error")]
        if not runs or not problems:
            continue
        one_each = len(runs) == failed[key]
        found = runs[seen[key]] if one_each else [r for run in runs for r in run]
        seen[key] += 1
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
        atomic_file.write_text(path, '<?xml version="1.0" encoding="utf-8"?>' + text)
    return changed


def junit_path(config: pytest.Config) -> str | None:
    """Where pytest's junitxml writes its file (as its LogXML does), or None."""
    xmlpath = config.getoption("xmlpath", None)
    if not xmlpath:
        return None
    return os.path.normpath(os.path.abspath(os.path.expanduser(os.path.expandvars(str(xmlpath)))))


# -- hooks -----------------------------------------------------------------------------
def pytest_elastic_timer_expired(
    config: pytest.Config, report: pytest.TestReport, records: list[ExpiryRecord]
) -> None:
    runs = config.stash.setdefault(EXPIRED, {}).setdefault(report.nodeid, {})
    # A crashed worker's report, which xdist makes, has no worker_id: its record names it.
    worker = getattr(report, "worker_id", "") or (records[0].worker if records else "")
    known = runs.setdefault(str(worker), [])
    seen = {(k.host, k.pid, k.scope) for k in known}
    known.extend(r for r in records if (r.host, r.pid, r.scope) not in seen)


@pytest.hookimpl(trylast=True)  # after pytest's junitxml wrote the file
def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    path = junit_path(config)
    expired = config.stash.get(EXPIRED, None)
    if path and expired and os.path.exists(path):
        try:
            fix_junit(path, expired, config.getoption("junitprefix", None))
        except (OSError, ET.ParseError) as exc:
            sys.stderr.write(f"pytest-elastic-timer: cannot amend {path}: {exc}\n")
