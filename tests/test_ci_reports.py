"""CI outputs: the JSON report against its schema, JUnit XML, GitHub Actions annotations
and step summary, the trace timeline, slow warnings, and the fallback JUnit file the
watchdog writes when pytest was killed."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from helpers import HEADER, LEAN, REPORT_NAME, Session, run, scope_line, wait_gone

from pytest_elastic_timer.ci import github as ci_github
from pytest_elastic_timer.ci import junit_fallback, trace
from pytest_elastic_timer.ci import slow as ci_slow
from pytest_elastic_timer.ci.reports import report_schema
from pytest_elastic_timer.core.records import ExpiryRecord

# Inner sessions under xdist: LEAN without "-p no:xdist".
XDIST = (
    *("-p", "no:cacheprovider", "-p", "no:asyncio", "-p", "no:hypothesispytest"),
    *("-p", "no:timeout", "-n", "2"),
)
FAILURE_TYPE = "pytest_elastic_timer.ScopeExpired"
PROPERTIES = ("scope", "budget", "elapsed", "pid", "label", "action")
CHILD = '''
CHILD = """
import time
import pytest_elastic_timer
with pytest_elastic_timer.expires(0.5, scope='child'):
    time.sleep(30)
"""


def test_rank():
    env = dict(os.environ, RANK="{rank}")
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, timeout=60)
    assert proc.returncode == 0
'''


def record_of(data: dict[str, Any], scope: str) -> ExpiryRecord:
    found = [r for r in data["expired"] if r["scope"] == scope]
    assert len(found) == 1, (scope, [r["scope"] for r in data["expired"]])
    return ExpiryRecord.from_json(found[0])


def line_of(path: Path, text: str) -> int:
    """The 1-based line of ``path`` that holds ``text``."""
    lines = path.read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


def validate(data: dict[str, Any]) -> None:
    jsonschema.Draft202012Validator(report_schema()).validate(data)


def junit_cases(path: Path) -> dict[str, ET.Element]:
    root = ET.parse(path).getroot()
    assert root.tag == "testsuites"
    return {f"{c.get('classname')}::{c.get('name')}": c for c in root.iter("testcase")}


def properties(case: ET.Element) -> dict[str, str]:
    props = case.find("properties")
    assert props is not None, ET.tostring(case, encoding="unicode")
    return {str(p.get("name")): str(p.get("value")) for p in props}


def assert_expired_case(case: ET.Element, record: ExpiryRecord, tag: str = "failure") -> None:
    """A testcase failed by ``record``'s scope, as GitLab and JUnit viewers read it."""
    (problem,) = case.findall(tag)
    line = record.line_text()
    assert problem.get("type") == FAILURE_TYPE
    assert problem.get("message") == line
    assert (problem.text or "").splitlines()[0] == line
    props = properties(case)
    assert {k: props[f"elastic_timer_{k}"] for k in PROPERTIES} == {
        "scope": record.scope,
        "budget": f"{record.budget:g}",
        "elapsed": f"{record.elapsed:.3f}",
        "pid": str(record.pid),
        "label": record.label,
        "action": record.action,
    }


def trace_parts(path: Path) -> tuple[dict[int, str], list[dict[str, Any]], list[dict[str, Any]]]:
    """(process names by pid, complete events, instant events) of a trace file."""
    data = json.loads(path.read_text())
    assert data["otherData"]["generator"] == "pytest-elastic-timer"
    events = data["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    slices = [e for e in events if e["ph"] == "X"]
    instants = [e for e in events if e["ph"] == "i"]
    for event in slices:
        assert event["dur"] >= 0 and event["ts"] >= 0 and event["pid"] in names
    return names, slices, instants


@pytest.fixture(autouse=True)
def not_an_xdist_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inner sessions do not inherit this suite's own xdist worker id (under -n)."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)


def github(monkeypatch: pytest.MonkeyPatch, workspace: Path) -> Path:
    summary = workspace / "step-summary.md"
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.setenv("GITHUB_WORKSPACE", str(workspace))
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    return summary


def annotation_lines(session: Session) -> list[str]:
    return [line for line in session.stdout.splitlines() if line.startswith("::")]


def summary_row(r: ExpiryRecord) -> str:
    return (
        f"| `{r.nodeid}` | `{r.scope}` | {r.budget:g}s | {r.elapsed:.2f}s | {r.action} "
        f"| {r.owner_text()} |"
    )


# -- one single-process session: every output ------------------------------------------
SINGLE = (
    """
import os
import subprocess
import sys
import time

import pytest
import pytest_elastic_timer as et


@pytest.mark.expires(5)
def test_odd():
    with et.expires(0.3, scope="50%,\\nnext: 1"):
        time.sleep(30)


@pytest.fixture
def stuck():
    time.sleep(30)


@pytest.mark.expires(5, setup=0.3)
def test_setup(stuck):
    pass
"""
    + CHILD.format(rank=1)
    + """

@pytest.mark.expires(1)
def test_slow():
    time.sleep(0.45)


def test_many():
    for i in range(11):
        try:
            with et.expires(0.05, scope=f"s{i}"):
                time.sleep(5)
        except et.ScopeExpired:
            pass
"""
)


ODD = "test_odd::call/50%,\nnext: 1"  # test_odd's scope: a comma, a newline, a percent sign


@dataclass
class Outputs:
    """The single-process session over SINGLE, run once for the tests below."""

    path: Path
    source: Path
    session: Session
    data: dict[str, Any]  # the JSON report

    def record(self, scope: str) -> ExpiryRecord:
        return record_of(self.data, scope)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> Outputs:
    """One session with every output on: JUnit, trace, slow phases (the CLI's fraction
    wins over the ini file's) and GitHub Actions."""
    path = tmp_path_factory.mktemp("outputs")
    source = path / "test_ci.py"
    source.write_text(SINGLE)
    (path / "tox.ini").write_text("[pytest]\nelastic_timer_slow = 0.9\n")
    env = {k: v for k, v in os.environ.items() if k not in INNER_UNSET}
    env.update(
        PY_COLORS="0",
        GITHUB_ACTIONS="true",
        GITHUB_WORKSPACE=str(path),
        GITHUB_STEP_SUMMARY=str(path / "step-summary.md"),
    )
    args = [
        *LEAN,
        f"--basetemp={path / 'basetemp'}",
        f"--elastic-timer-report={path / REPORT_NAME}",
        "--junitxml=junit.xml",
        "--elastic-timer-trace=trace.json",
        "--elastic-timer-slow=0.4",
    ]
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *args],
        cwd=path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    seconds = time.monotonic() - started
    stdout, stderr = proc.stdout, proc.stderr
    header = next((m for m in map(HEADER.match, stdout.splitlines()) if m), None)
    watchdog_pid = int(header.group(1)) if header else None
    if watchdog_pid is not None:
        wait_gone(watchdog_pid, 5.0)
    result = pytest.RunResult(proc.returncode, stdout.splitlines(), stderr.splitlines(), seconds)
    data = json.loads((path / REPORT_NAME).read_text())
    return Outputs(path, source, Session(result, seconds, stdout, stderr, data, watchdog_pid), data)


# The variables an inner session must not inherit from this suite's own session.
INNER_UNSET = ("PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER", "PYTEST_ELASTIC_TIMER_DUMP_SIGNAL")


def test_outcomes_count_timeouts_as_failures_and_errors(outputs: Outputs) -> None:
    # TIMEOUT counts as failed in the call phase (test_odd, test_rank) and as an error in
    # setup or teardown (test_setup's fixture), like any other failure there.
    outputs.session.assert_clean()
    outputs.session.result.assert_outcomes(failed=2, passed=2, errors=1)


def test_json_report_records_every_expired_scope(outputs: Outputs) -> None:
    data = outputs.data
    validate(data)
    assert len(data["expired"]) == 14
    odd = outputs.record(ODD)
    child = outputs.record("child")
    outputs.record("test_setup::setup")
    assert odd.line == line_of(outputs.source, "with et.expires(0.3")
    assert (odd.pid, odd.label) == (data["session"]["pid"], "")
    assert child.owner_text().startswith(f"rank 1, pid {child.pid}")
    assert (child.label, child.nodeid, child.file) == (
        "rank 1",
        "test_ci.py::test_rank",
        "<string>",
    )


def test_json_report_has_session_facts_and_slow_phases(outputs: Outputs) -> None:
    facts = outputs.data["session"]
    assert facts["exitstatus"] == 1 and facts["slow_fraction"] == 0.4
    assert facts["root_died"] is False
    (slow,) = facts["slow"]
    assert (slow["nodeid"], slow["scope"], slow["budget"]) == (
        "test_ci.py::test_slow",
        "test_slow::call",
        1.0,
    )
    assert 0.4 <= slow["share"] < 1 and slow["suggested_budget"] > 1
    slowest = {t["nodeid"]: t["scopes"] for t in facts["slowest"]}
    assert slowest["test_ci.py::test_slow"][0]["scope"] == "test_slow::call"
    assert "child" in [s["scope"] for s in slowest["test_ci.py::test_rank"]]  # traced
    assert {"scope": "test_setup::setup", "budget": 0.3}.items() <= slowest[
        "test_ci.py::test_setup"
    ][0].items()


def test_terminal_lists_the_slow_phase_with_its_share(outputs: Outputs) -> None:
    slow_lines = [line for line in outputs.session.lines if line.startswith("SLOW ")]
    assert len(slow_lines) == 1, slow_lines
    assert re.fullmatch(
        r"SLOW test_ci\.py::test_slow call: 0\.\d\ds of 1s budget \((4\d|[5-9]\d)%\); "
        r"suggested budget \d+(\.\d+)?s",
        slow_lines[0],
    ), slow_lines


def test_junit_fails_expired_tests_with_the_scope(outputs: Outputs) -> None:
    cases = junit_cases(outputs.path / "junit.xml")
    assert_expired_case(cases["test_ci::test_odd"], outputs.record(ODD))
    setup = outputs.record("test_setup::setup")
    assert_expired_case(cases["test_ci::test_setup"], setup, tag="error")
    assert_expired_case(cases["test_ci::test_rank"], outputs.record("child"))
    assert "assert 1 == 0" in (cases["test_ci::test_rank"].findtext("failure") or "")
    for name in ("test_slow", "test_many"):
        assert not cases[f"test_ci::{name}"].findall("failure")


def test_github_annotations_are_escaped_and_at_most_ten(outputs: Outputs) -> None:
    odd = outputs.record(ODD)
    setup = outputs.record("test_setup::setup")
    child = outputs.record("child")
    source = outputs.source
    lines = annotation_lines(outputs.session)
    assert len(lines) == 11, lines
    assert lines[0] == (
        f"::error file=test_ci.py,line={odd.line},"
        "title=elastic-timer%3A test_odd%3A%3Acall/50%25%2C%0Anext%3A 1 expired::"
        f"scope 'test_odd::call/50%25,\\nnext: 1' expired after {odd.elapsed:.2f}s "
        f"(budget 0.3s): interrupted%0Atest: test_ci.py::test_odd%0Aprocess: {odd.owner_text()}"
    )
    assert lines[1] == (
        f"::error file=test_ci.py,line={line_of(source, 'def test_setup') - 1},"
        "title=elastic-timer%3A test_setup%3A%3Asetup expired::"
        f"{setup.line_text()}%0Atest: test_ci.py::test_setup%0Aprocess: {setup.owner_text()}"
    )
    # The child entered its scope in `python -c`: the annotation points at the test.
    assert lines[2] == (
        f"::error file=test_ci.py,line={line_of(source, 'def test_rank')},"
        "title=elastic-timer%3A child expired::"
        f"{child.line_text()}%0Atest: test_ci.py::test_rank%0Aprocess: {child.owner_text()}"
    )
    assert all(line.startswith("::error file=test_ci.py,line=") for line in lines[:10])
    assert lines[10] == (
        "::warning title=elastic-timer::4 more expired scope(s) not annotated "
        "(at most 10 per session); see the job summary or the JSON report"
    )


def test_github_step_summary_tables_expired_then_slow(outputs: Outputs) -> None:
    odd = outputs.record(ODD)
    setup = outputs.record("test_setup::setup")
    child = outputs.record("child")
    table = (outputs.path / "step-summary.md").read_text().splitlines()
    assert table[:4] == [
        "### elastic-timer: 14 expired scope(s)",
        "",
        "| test | scope | budget | elapsed | action | process |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    # A cell is one line: the newline of the scope name becomes a space.
    assert table[4] == summary_row(odd).replace("\n", " ")
    assert table[5:7] == [summary_row(setup), summary_row(child)]
    assert len([row for row in table if row.startswith("| `test_ci.py::test_many` |")]) == 11
    assert "### elastic-timer: 1 slow scope(s) (>= 40% of their budget)" in table
    assert re.search(
        r"^\| `test_ci\.py::test_slow` \| `test_slow::call` \| 0\.\d\ds \| 1s \| \d+% \| \S+s \|$",
        "\n".join(table),
        re.M,
    )


def test_trace_has_a_track_per_process_and_every_expiry(outputs: Outputs) -> None:
    data = outputs.data
    facts = data["session"]
    odd = outputs.record(ODD)
    child = outputs.record("child")
    names, slices, instants = trace_parts(outputs.path / "trace.json")
    assert names[facts["pid"]] == f"pytest (pid {facts['pid']})"
    assert names[child.pid] == f"rank 1 (pid {child.pid})"
    paths = {(e["pid"], e["args"]["path"]) for e in slices}
    for scope in ("test_odd::call", odd.scope, "test_rank::call", "test_slow::call"):
        assert (facts["pid"], scope) in paths
    assert (child.pid, "child") in paths
    assert len(instants) == 14
    assert {(e["pid"], e["args"]["scope"]) for e in instants} == {
        (r["pid"], r["scope"]) for r in data["expired"]
    }
    assert all(e["s"] == "p" and e["name"] == f"expired: {e['args']['scope']}" for e in instants)
    expired = {e["args"]["path"] for e in slices if e["args"]["expired"]}
    assert expired == {r["scope"] for r in data["expired"]}


# -- xdist: a worker ended over a C loop, and a rank of another worker -------------------
XDIST_TESTS = """
import os
import subprocess
import sys
import time

import pytest
import pytest_elastic_timer as et


@pytest.mark.expires(1)
def test_gil():
    sum(range(10**11))


def test_steps():
    with et.expires(5, scope="step"):
        time.sleep(0.1)
""" + CHILD.format(rank=0)


def test_xdist_outputs(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    summary = github(monkeypatch, pytester.path)
    source = pytester.makepyfile(test_x=XDIST_TESTS)
    session = run(
        pytester,
        *XDIST,
        "--elastic-timer-grace=0.3",
        "--junitxml=junit.xml",
        "--elastic-timer-trace=trace.json",
        lean=False,
    )
    session.assert_clean()
    session.result.assert_outcomes(failed=2, passed=1)
    data = session.report
    assert data is not None
    validate(data)
    gil = record_of(data, "test_gil::call")
    child = record_of(data, "child")
    assert gil.action in ("terminated", "killed") and re.fullmatch(r"gw\d", gil.worker)
    assert child.label == "rank 0" and re.fullmatch(r"gw\d", child.worker)
    assert data["session"]["slow_fraction"] == 0.8  # the default

    cases = junit_cases(pytester.path / "junit.xml")
    assert_expired_case(cases["test_x::test_gil"], gil)
    assert_expired_case(cases["test_x::test_rank"], child)
    assert not cases["test_x::test_steps"].findall("failure")

    lines = sorted(annotation_lines(session))  # xdist: in the order the tests ended
    assert lines == sorted(
        [
            f"::error file=test_x.py,line={line_of(source, 'mark.expires(1)')},"
            "title=elastic-timer%3A test_gil%3A%3Acall expired::"
            f"{gil.line_text()}%0Atest: test_x.py::test_gil%0Aprocess: {gil.owner_text()}",
            f"::error file=test_x.py,line={line_of(source, 'def test_rank')},"
            "title=elastic-timer%3A child expired::"
            f"{child.line_text()}%0Atest: test_x.py::test_rank%0Aprocess: {child.owner_text()}",
        ]
    )
    table = summary.read_text().splitlines()
    assert table[0] == "### elastic-timer: 2 expired scope(s)"
    assert sorted(table[4:6]) == sorted([summary_row(gil), summary_row(child)])

    names, slices, instants = trace_parts(pytester.path / "trace.json")
    assert names[gil.pid] == f"{gil.worker} (pid {gil.pid})"
    assert names[child.pid] == f"{child.worker} rank 0 (pid {child.pid})"
    # The worker never left its scope: the record gives the slice, ended by the watchdog.
    (gil_slice,) = [e for e in slices if e["args"]["path"] == "test_gil::call"]
    assert gil_slice["pid"] == gil.pid and gil_slice["args"]["expired"] is True
    assert gil_slice["args"]["action"] == gil.action
    assert gil_slice["dur"] >= 1e6
    assert any(e["args"]["path"] == "test_steps::call/step" for e in slices)
    assert sorted((e["pid"], e["args"]["scope"]) for e in instants) == sorted(
        [(gil.pid, gil.scope), (child.pid, "child")]
    )


ENDED_WORKER = """
import time
import pytest
import pytest_elastic_timer as et


def test_before():
    with et.expires(5, scope="step"):
        time.sleep(0.01)


@pytest.mark.expires(30)
def test_gil():
    with et.expires(20, scope="outer"):
        with et.expires(0.5, scope="inner"):
            sum(range(10**11))
"""


def test_trace_keeps_what_a_worker_ended_in_c_did_and_every_scope_it_was_in(
    pytester: pytest.Pytester,
) -> None:
    # One worker runs both tests, the second stuck in C: the watchdog ends the worker.
    pytester.makepyfile(test_e=ENDED_WORKER)
    session = run(
        pytester,
        *XDIST[:-1],
        "1",
        "--elastic-timer-grace=0.3",
        "--elastic-timer-trace=trace.json",
        lean=False,
    )
    session.assert_clean()
    session.result.assert_outcomes(failed=1, passed=1)
    data = session.report
    assert data is not None
    inner = record_of(data, "test_gil::call/outer/inner")
    assert inner.action in ("terminated", "killed")
    names, slices, instants = trace_parts(pytester.path / "trace.json")
    assert names[inner.pid] == f"gw0 (pid {inner.pid})"
    by_path = {e["args"]["path"]: e for e in slices if e["pid"] == inner.pid}
    # What the worker did before the test it was ended in: written when each phase ended.
    for path in ("test_before::setup", "test_before::call/step", "test_before::teardown"):
        assert path in by_path, sorted(by_path)
    assert "test_gil::setup" in by_path
    # The scopes it was in when it was ended: from its scope table, each lasting until
    # the watchdog ended it, the expired one marked as such.
    call, outer, inner_slice = (
        by_path[p] for p in ("test_gil::call", "test_gil::call/outer", inner.scope)
    )
    assert inner_slice["args"]["expired"] is True
    assert inner_slice["args"]["action"] == inner.action
    assert (call["args"]["expired"], outer["args"]["expired"]) == (False, False)
    assert {e["args"]["nodeid"] for e in (call, outer, inner_slice)} == {"test_e.py::test_gil"}
    assert call["ts"] <= outer["ts"] <= inner_slice["ts"]
    ends = [e["ts"] + e["dur"] for e in (call, outer, inner_slice)]
    assert max(ends) - min(ends) < 1e3  # the same end, within rounding
    assert inner_slice["dur"] >= 0.5e6
    assert len({e["tid"] for e in (call, outer, inner_slice)}) == 1
    assert [e["args"]["scope"] for e in instants if e["pid"] == inner.pid] == [inner.scope]


# -- the expired hook's properties in the JUnit file --------------------------------------
HOOK_PROPERTIES_CONFTEST = """
def pytest_elastic_timer_expired(config, report, records):
    report.user_properties.append(("hook_phase", report.when))
    report.user_properties.append(("hook_scope", records[0].scope))
"""
HOOK_PROPERTIES_TESTS = """
import time
import pytest


@pytest.fixture
def stuck_setup():
    time.sleep(30)


@pytest.fixture
def stuck_teardown():
    yield
    time.sleep(30)


@pytest.mark.expires(0.3)
def test_call(record_property):
    record_property("mine", "1")
    time.sleep(30)


@pytest.mark.expires(5, setup=0.3)
def test_setup(stuck_setup):
    pass


@pytest.mark.expires(5, teardown=0.3)
def test_teardown(stuck_teardown):
    pass


@pytest.mark.expires(0.3, teardown=0.3)
def test_both(stuck_teardown):
    time.sleep(30)
"""
# A worker stuck in C, holding the GIL: the watchdog ends it, the controller reports.
HOOK_PROPERTIES_GIL = """
import pytest


@pytest.mark.expires(1)
def test_gil():
    sum(range(10**11))
"""
OWN_PROPERTIES = [f"elastic_timer_{k}" for k in PROPERTIES]


@pytest.mark.parametrize(
    "workers", [[], [*XDIST, "--elastic-timer-grace=0.3"]], ids=["one", "xdist"]
)
def test_junit_has_the_properties_the_expired_hook_added(
    pytester: pytest.Pytester, workers: list[str]
) -> None:
    """What an implementation of the expired hook adds to ``report.user_properties`` is
    in the test's testcase, after the plugin's own, in the order added, each once:
    pytest's junitxml writes only a teardown report's properties (a copy of the
    item's), and none of a worker the watchdog ended."""
    pytester.makeconftest(HOOK_PROPERTIES_CONFTEST)
    pytester.makepyfile(test_p=HOOK_PROPERTIES_TESTS)
    files = ["test_p.py"]
    if workers:
        pytester.makepyfile(test_gil=HOOK_PROPERTIES_GIL)
        files.append("test_gil.py")
    junit = pytester.path / "junit.xml"
    session = run(pytester, *workers, f"--junitxml={junit}", *files, lean=not workers)
    session.assert_clean()
    session.result.assert_outcomes(failed=3 if workers else 2, passed=1, errors=3)
    found: dict[str, list[list[tuple[str, str]]]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        props = case.findall("properties/property")
        pairs = [(str(p.get("name")), str(p.get("value"))) for p in props]
        found.setdefault(str(case.get("name")), []).append(pairs)

    def hooks(when: str, scope: str) -> list[tuple[str, str]]:
        return [("hook_phase", when), ("hook_scope", scope)]

    # By test, each of its testcases: the names before the hook's, and the hook's.
    expected = {
        "test_call": [(["mine", *OWN_PROPERTIES], hooks("call", "test_call::call"))],
        "test_setup": [(OWN_PROPERTIES, hooks("setup", "test_setup::setup"))],
        "test_teardown": [(OWN_PROPERTIES, hooks("teardown", "test_teardown::teardown"))],
        # A failed call, then a failed teardown: two testcases, each with its report's.
        "test_both": [
            (OWN_PROPERTIES, hooks("call", "test_both::call")),
            (OWN_PROPERTIES, hooks("teardown", "test_both::teardown")),
        ],
    }
    if workers:
        expected["test_gil"] = [(OWN_PROPERTIES, hooks("call", "test_gil::call"))]
    assert sorted(found) == sorted(expected)
    for name, runs in expected.items():
        assert len(found[name]) == len(runs), (name, found[name])
        for pairs, (names, hook) in zip(found[name], runs, strict=True):
            assert [n for n, _ in pairs] == [*names, "hook_phase", "hook_scope"], (name, pairs)
            assert pairs[-2:] == hook, (name, pairs)
    assert found["test_call"][0][0] == ("mine", "1")


# -- kill -9 of pytest: the watchdog writes the JUnit file ------------------------------
KILLED = """
import time
import pytest_elastic_timer as et


def test_before():
    pass


def test_stuck():
    try:
        with et.expires(0.3, scope="wait for peer"):
            time.sleep(30)
    except et.ScopeExpired:
        print("caught", flush=True)
    time.sleep(60)
"""


@pytest.mark.parametrize("given", ["path", "with a variable"])
def test_fallback_junit_after_kill_9(pytester: pytest.Pytester, given: str) -> None:
    """The watchdog writes the JUnit file pytest was killed before writing, where pytest
    would have: a path with a variable is expanded, as pytest expands it."""
    pytester.makepyfile(test_k=KILLED)
    junit = pytester.path / "junit.xml"
    output = pytester.path / "output.txt"
    report = pytester.path / REPORT_NAME
    junit_arg = str(junit) if given == "path" else "$ELASTIC_TIMER_TEST_OUT/junit.xml"
    with open(output, "w") as out:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "pytest", *LEAN, "-s"),
                *(f"--junitxml={junit_arg}", f"--elastic-timer-report={report}"),
            ],
            cwd=pytester.path,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={
                **os.environ,
                "PYTHONUNBUFFERED": "1",
                "ELASTIC_TIMER_TEST_OUT": str(pytester.path),
            },
        )
    try:
        give_up = time.monotonic() + 60
        while "caught" not in output.read_text() and time.monotonic() < give_up:
            time.sleep(0.02)
        assert "caught" in output.read_text(), output.read_text()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    match = next(filter(None, map(HEADER.match, output.read_text().splitlines())))
    assert wait_gone(int(match.group(1)), 10.0), "the watchdog outlived the killed pytest"
    data = json.loads(report.read_text())
    validate(data)
    record = record_of(data, "test_stuck::call/wait for peer")

    root = ET.parse(junit).getroot()
    (suite,) = root.findall("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("2", "1", "1")
    cases = junit_cases(junit)
    assert set(cases) == {"test_k::test_stuck", "pytest::session-ended"}
    stuck = cases["test_k::test_stuck"]
    assert stuck.get("file") == "test_k.py"
    assert_expired_case(stuck, record)
    assert scope_line("test_stuck::call/wait for peer", "0.3").match(record.line_text())
    (error,) = cases["pytest::session-ended"].findall("error")
    assert error.get("type") == "pytest_elastic_timer.SessionEnded"
    assert error.get("message") == (
        f"pytest (pid {proc.pid}) was ended before it wrote its JUnit XML report"
    )


# -- off switches and bad values ----------------------------------------------------------
def test_no_github_outputs_outside_github_and_slow_off(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GITHUB_ACTIONS", raising=False)
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(pytester.path / "summary.md"))
    pytester.makepyfile(
        test_off="""
        import time
        import pytest

        @pytest.mark.expires(0.3)
        def test_hang():
            time.sleep(30)

        @pytest.mark.expires(1)
        def test_slow():
            time.sleep(0.3)
        """
    )
    session = run(pytester, "--elastic-timer-slow=0")
    session.assert_clean()
    session.result.assert_outcomes(failed=1, passed=1)
    assert not annotation_lines(session)
    assert not (pytester.path / "summary.md").exists()
    assert "SLOW" not in session.stdout
    assert session.report is not None
    assert session.report["session"]["slow"] == []


def test_slow_lines_without_the_json_report(pytester: pytest.Pytester) -> None:
    """Without the JSON report only groups with a long enough phase are looked at: the
    slow test is named, the fast ones and the warnings' group are not in the way."""
    pytester.makepyfile(
        test_slow="""
        import time
        import warnings
        import pytest

        @pytest.mark.expires(1)
        def test_slow():
            time.sleep(0.5)

        @pytest.mark.parametrize("i", range(5))
        def test_fast(i):
            warnings.warn(UserWarning("fast"))
        """
    )
    session = run(pytester, "--elastic-timer-slow=0.4", report=False)
    session.assert_clean()
    session.result.assert_outcomes(passed=6)
    (line,) = [line for line in session.stdout.splitlines() if "SLOW" in line]
    assert "SLOW test_slow.py::test_slow call: 0.5" in line, session.stdout
    assert "of 1s budget" in line


@pytest.mark.parametrize(
    ("args", "ini", "message"),
    [
        (["--elastic-timer-slow=1.5"], "", "--elastic-timer-slow must be a fraction between "
         "0 and 1, not '1.5'"),
        ([], "elastic_timer_slow = soon", "ini option 'elastic_timer_slow' must be a fraction "
         "between 0 and 1, not 'soon'"),
    ],
)  # fmt: skip
def test_bad_slow_fraction_is_a_usage_error(
    pytester: pytest.Pytester, args: list[str], ini: str, message: str
) -> None:
    pytester.makeini(f"[pytest]\n{ini}\n")
    pytester.makepyfile(test_a="def test_a(): pass")
    session = run(pytester, *args, report=False)
    assert session.result.ret == pytest.ExitCode.USAGE_ERROR
    assert f"ERROR: {message}" in session.stderr
    assert "INTERNALERROR" not in session.text


# -- the pieces, without a session ---------------------------------------------------------
def record(**fields: Any) -> ExpiryRecord:
    base: dict[str, Any] = {
        "nodeid": "tests/test_a.py::test_b",
        "scope": "test_b::call",
        "budget": 2.0,
        "elapsed": 2.004,
        "pid": 42,
        "label": "",
        "worker": "",
        "file": "",
        "line": 0,
        "action": "interrupted",
        "stack": "",
    }
    return ExpiryRecord(**{**base, **fields})


def test_escaping_follows_githubs_rules() -> None:
    assert ci_github.escape_data("100% done\r\nnext: a, b") == "100%25 done%0D%0Anext: a, b"
    assert ci_github.escape_property("100% done\r\nnext: a, b") == (
        "100%25 done%0D%0Anext%3A a%2C b"
    )
    assert ci_github.escape_property("%3A") == "%253A"  # escaped once, not twice
    # No raw control character in a title (an ESC would colour the log, a NUL end it):
    # GitHub has no escape for them, so they read as Python writes them.
    assert ci_github.escape_property("a\x1b[31mb\x00c\td") == "a\\x1b[31mb\\x00c\\x09d"


def test_annotations_cap_and_location(tmp_path: Path) -> None:
    test_file = tmp_path / "tests" / "test_a.py"
    test_file.parent.mkdir()
    test_file.write_text("def test_b():\n    pass\n")
    found = [
        record(file=str(test_file), line=1, scope="a,b:c"),
        record(file="/elsewhere/x.py", line=3, label="rank 2", worker="gw1"),
        record(nodeid="", scope="session", file=str(tmp_path), line=0),
    ]
    locations = {"tests/test_a.py::test_b": ("tests/test_a.py", 0)}
    lines = ci_github.github_annotations(found, str(tmp_path), str(tmp_path), locations, limit=2)
    assert lines == [
        "::error file=tests/test_a.py,line=1,title=elastic-timer%3A a%2Cb%3Ac expired::"
        "scope 'a,b:c' expired after 2.00s (budget 2s): interrupted"
        "%0Atest: tests/test_a.py::test_b%0Aprocess: pid 42",
        # Outside the workspace: the test's own location.
        "::error file=tests/test_a.py,line=1,title=elastic-timer%3A test_b%3A%3Acall expired::"
        "scope 'test_b::call' expired after 2.00s (budget 2s): interrupted"
        "%0Atest: tests/test_a.py::test_b%0Aprocess: rank 2, pid 42, worker gw1",
        "::warning title=elastic-timer::1 more expired scope(s) not annotated "
        "(at most 2 per session); see the job summary or the JSON report",
    ]
    # No file to point at: an annotation without a location.
    (session,) = ci_github.github_annotations(found[2:], str(tmp_path), str(tmp_path))
    assert session == (
        "::error title=elastic-timer%3A session expired::"
        "scope 'session' expired after 2.00s (budget 2s): interrupted%0Aprocess: pid 42"
    )


def test_step_summary_escapes_cells() -> None:
    slow = ci_slow.PhaseTime("t.py::test_x[a|b]", "call", 0.9, 1.0)
    text = ci_github.step_summary([record(scope="pipe|`tick`")], [slow], 0.8)
    assert text.splitlines() == [
        "### elastic-timer: 1 expired scope(s)",
        "",
        "| test | scope | budget | elapsed | action | process |",
        "| --- | --- | --- | --- | --- | --- |",
        "| `tests/test_a.py::test_b` | pipe\\|\\`tick\\` | 2s | 2.00s | interrupted | pid 42 |",
        "",
        "### elastic-timer: 1 slow scope(s) (>= 80% of their budget)",
        "",
        "| test | scope | duration | budget | share | suggested budget |",
        "| --- | --- | --- | --- | --- | --- |",
        "| `t.py::test_x[a\\|b]` | `test_x[a\\|b]::call` | 0.90s | 1s | 90% | 1.5s |",
        "",  # a blank line ends the table before whatever the next step appends
    ]


@pytest.mark.parametrize(
    ("seconds", "nice"),
    [(0.9, 1.0), (1.01, 1.5), (1.6, 2.0), (2.5, 3.0), (4, 5.0), (6, 7.5), (8, 10.0), (0.031, 0.05)],
)
def test_suggested_budgets_are_round(seconds: float, nice: float) -> None:
    assert ci_slow.nice_ceil(seconds) == nice


def test_schema_is_a_valid_versioned_json_schema() -> None:
    schema = report_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["properties"]["version"] == {
        "const": 1,
        "description": schema["properties"]["version"]["description"],
    }
    bad = {"version": 1, "expired": [{"nodeid": "x"}], "session": {}}
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)


def test_trace_merges_files_and_records(tmp_path: Path) -> None:
    def line(pid: int, path: str, start: float, end: float, tid: int, **extra: Any) -> str:
        event = {"pid": pid, "label": "", "worker": "gw0", "path": path, "start": start}
        event.update(end=end, tid=tid, nodeid="t.py::test_a", expired=False)
        event.update(extra)
        return json.dumps(event) + "\n"

    (tmp_path / "trace-10-a").write_text(
        line(10, "test_a::call", 100.0, 101.0, 0)  # outermost scope, thread unknown
        + line(10, "test_a::call/load", 100.2, 100.5, 7)
        + '{"pid": 10, "path": "torn'
    )
    (tmp_path / "trace-11-b").write_text(
        line(11, "child", 100.1, 100.6, 5, label="rank 3", expired=True)
    )
    found = [
        record(pid=11, scope="child", budget=0.5, deadline=100.6, ended=100.6),
        # The worker was ended inside its scope: no trace event, the record has it.
        record(pid=12, scope="test_c::call", budget=1.0, deadline=102.0, ended=102.5, worker="gw1"),
    ]
    events = trace.read_events(str(tmp_path))
    assert len(events) == 3
    out = trace.build(events, found, {"pid": 1})
    json.loads(json.dumps(out))
    names = {e["pid"]: e["args"]["name"] for e in out["traceEvents"] if e["name"] == "process_name"}
    assert names == {10: "gw0 (pid 10)", 11: "gw0 rank 3 (pid 11)", 12: "gw1 (pid 12)"}
    slices = {(e["pid"], e["args"]["path"]): e for e in out["traceEvents"] if e["ph"] == "X"}
    assert slices[(10, "test_a::call")]["tid"] == slices[(10, "test_a::call/load")]["tid"]
    assert slices[(10, "test_a::call")]["ts"] == 0.0
    assert slices[(10, "test_a::call")]["dur"] == pytest.approx(1e6)
    assert slices[(11, "child")]["args"]["expired"] is True
    ended = slices[(12, "test_c::call")]
    assert ended["args"] == {"path": "test_c::call", "expired": True, "nodeid": record().nodeid,
                             "raised": False, "action": "interrupted"}  # fmt: skip
    assert (ended["ts"], ended["dur"]) == (pytest.approx(1e6), pytest.approx(1.5e6))
    instants = [e for e in out["traceEvents"] if e["ph"] == "i"]
    assert [(e["pid"], e["ts"]) for e in instants] == [
        (11, pytest.approx(0.6e6)),
        (12, pytest.approx(2e6)),
    ]
    page = trace.render_html(out)
    assert page.count("<rect") >= 4 and "gw0 rank 3 (pid 11)" in page


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (None, "cannot read the trace"),
        ("{not json", "cannot read the trace"),
        ("{}", "is not a trace written by --elastic-timer-trace"),
        ('{"traceEvents": [1, null]}', "is not a trace written by --elastic-timer-trace"),
        ("[" * 100_000 + "]" * 100_000, "cannot read the trace"),
        ('{"traceEvents": [{"ph": "X"}]}', "has an event this timeline cannot draw"),
    ],
    ids=["missing", "not-json", "not-a-trace", "not-events", "nested-too-deep", "bad-event"],
)
def test_the_timeline_command_names_a_file_it_cannot_draw(
    tmp_path: Path, content: str | None, said: str
) -> None:
    """``python -m pytest_elastic_timer.ci.trace``: a file that is missing, not JSON or
    not a trace is a usage error that names it (exit status 2), and no page is written.
    A missing one was a traceback, and ``{}`` an empty page."""
    path = tmp_path / "trace.json"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    page = tmp_path / "trace.html"
    done = subprocess.run(
        [sys.executable, "-m", "pytest_elastic_timer.ci.trace", str(path), "--html", str(page)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert said in done.stderr and str(path) in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert not page.exists()


@pytest.mark.parametrize("page", ["", " "])
def test_the_timeline_command_refuses_an_empty_page_path(tmp_path: Path, page: str) -> None:
    """``--html "$OUT"`` with OUT unset was "cannot write ''", and a blank one wrote a
    page named by blanks; both are said as what they are."""
    (tmp_path / "trace.json").write_text('{"traceEvents": []}', encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "pytest_elastic_timer.ci.trace", "trace.json", "--html", page],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert f"error: --html must be a path, not {page!r}" in done.stderr, done.stderr
    assert sorted(os.listdir(tmp_path)) == ["trace.json"]


def test_the_timeline_of_a_scope_named_from_a_non_utf8_file_name(
    pytester: pytest.Pytester,
) -> None:
    """A scope name with a lone surrogate (``os.fsdecode`` of a file name that is not
    UTF-8): the page is drawn with "?" for it, as the JSON report says it. The command
    raised UnicodeEncodeError and left an empty page."""
    pytester.makepyfile(
        test_s="""
        import pytest_elastic_timer as et

        def test_named():
            with et.expires(30, "file-\\udcff-name"):
                pass
        """
    )
    session = run(pytester, "--elastic-timer-trace=trace.json")
    session.assert_clean()
    session.result.assert_outcomes(passed=1)
    page = pytester.path / "trace.html"
    done = subprocess.run(
        [sys.executable, "-m", "pytest_elastic_timer.ci.trace", "trace.json", "--html", page],
        cwd=pytester.path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "test_named::call/file-?-name" in page.read_text(encoding="utf-8")


def test_fallback_file_is_valid_xml_with_awkward_text(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "junit.xml"
    stack = 'File "x.py", line 1 <&>\x00\x1b[31m'
    junit_fallback.write(
        str(path),
        [record(stack=stack), record(nodeid="", scope="session", phase="collection")],
        {"pid": 7, "started": 1.0, "ended": 3.5},
    )
    cases = junit_cases(path)
    assert set(cases) == {"tests.test_a::test_b", "pytest::session", "pytest::session-ended"}
    assert_expired_case(cases["tests.test_a::test_b"], record())
    assert "<&>#x00#x1B[31m" in (cases["tests.test_a::test_b"].findtext("failure") or "")
    suite = ET.parse(path).getroot().find("testsuite")
    assert suite is not None and suite.get("time") == "2.500"


def test_fallback_file_has_an_error_for_a_setup_or_teardown_expiry(tmp_path: Path) -> None:
    """As pytest's own file has it (and the plugin's under xdist): a scope expired in a
    test's setup or teardown, or the session's in a session fixture's teardown, is an
    ``<error>``; in the call a ``<failure>``. The fallback had a failure for each."""
    path = tmp_path / "junit.xml"
    teardown = record(nodeid="tests/test_a.py::test_t", scope="test_t::teardown", phase="teardown")
    session_scope = record(nodeid="", scope="session", phase="teardown")
    # A helper process's scope inside the setup: its own process was in no phase.
    helper = record(nodeid="tests/test_a.py::test_h", scope="test_h::setup/serve", phase="")
    call = record(phase="call")
    junit_fallback.write(str(path), [teardown, session_scope, helper, call], {"pid": 7})
    cases = junit_cases(path)
    assert_expired_case(cases["tests.test_a::test_t"], teardown, tag="error")
    assert_expired_case(cases["pytest::session"], session_scope, tag="error")
    assert_expired_case(cases["tests.test_a::test_h"], helper, tag="error")
    assert_expired_case(cases["tests.test_a::test_b"], call)
    suite = ET.parse(path).getroot().find("testsuite")
    assert suite is not None
    assert (suite.get("errors"), suite.get("failures"), suite.get("tests")) == ("4", "1", "5")
    assert "listed as failures (errors where" in (
        cases["pytest::session-ended"].findtext("error") or ""
    )


ANSI = re.compile(r"\x1b\[[0-9;]*m")
RED_TIMEOUT = "\x1b[31mTIMEOUT\x1b[0m"


@pytest.mark.parametrize("dist", ["one process", "xdist"])
def test_an_expired_test_reads_timeout_in_red_on_every_line(
    pytester: pytest.Pytester, dist: str
) -> None:
    # The status word is the same plain, red TIMEOUT in the verbose line and the short
    # summary with every supported pytest (8.0 to 8.2 printed a (word, markup) pair as a
    # tuple in the short summary).
    pytester.makepyfile(
        test_x="""
        import time
        import pytest

        @pytest.mark.expires(0.3)
        def test_x():
            time.sleep(30)
        """
    )
    args = ("-v", "--color=yes", "-rA", *(XDIST if dist == "xdist" else LEAN))
    session = run(pytester, *args, lean=False)
    session.result.assert_outcomes(failed=1)
    assert "('TIMEOUT'" not in session.stdout
    lines = [line for line in session.stdout.splitlines() if RED_TIMEOUT in line]
    plain = [ANSI.sub("", line) for line in lines]
    # The verbose line, then the short summary's.
    assert len(plain) == 2, session.stdout
    # In one process "test_x.py::test_x TIMEOUT", under xdist "[gw0] [100%] TIMEOUT test_x...".
    assert re.search(r"test_x\.py::test_x TIMEOUT\b|\] TIMEOUT test_x\.py::test_x\b", plain[0])
    assert plain[1].startswith("TIMEOUT test_x.py::test_x - scope 'test_x::call'"), plain


@pytest.mark.parametrize("option", ["--elastic-timer-report", "--elastic-timer-trace"])
def test_an_output_path_that_cannot_be_written_is_said_and_leaves_nothing(
    pytester: pytest.Pytester, option: str
) -> None:
    """A report or trace path below a file (its directory cannot be made): the session
    says it cannot write it, keeps its exit status, and leaves no temporary file."""
    pytester.makefile(".txt", taken="a file")
    target = pytester.path / "taken.txt" / "out.json"
    pytester.makepyfile(test_ok="def test_ok():\n    pass\n")
    session = run(pytester, f"{option}={target}", report=False)
    session.assert_clean()
    session.result.assert_outcomes(passed=1)
    assert session.result.ret == 0
    assert f"cannot write {target}" in session.text, session.text
    assert sorted(p.name for p in pytester.path.iterdir() if p.name.startswith("taken")) == [
        "taken.txt"
    ]


@pytest.mark.parametrize("option", ["--elastic-timer-report", "--elastic-timer-trace"])
@pytest.mark.parametrize("workers", [[], ["-p", "xdist", "-n", "2"]], ids=["one", "xdist"])
def test_an_output_path_that_is_a_directory_is_a_usage_error(
    pytester: pytest.Pytester, option: str, workers: list[str]
) -> None:
    """Said before any test runs, naming the option and the path."""
    target = pytester.mkdir("reports")
    pytester.makepyfile(test_ok="def test_ok():\n    pass\n")
    session = run(pytester, f"{option}={target}", *workers, report=False)
    assert session.result.ret == pytest.ExitCode.USAGE_ERROR
    assert f"{option} must be the path of a file, not a directory: '{target}'" in session.text, (
        session.text
    )
    assert "INTERNALERROR" not in session.text
    assert list(target.iterdir()) == []


@pytest.mark.parametrize("option", ["--elastic-timer-report", "--elastic-timer-trace"])
def test_an_output_path_has_its_home_and_variables_expanded(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, option: str
) -> None:
    """As pytest expands ``--junitxml``'s path: ``~`` and ``$VARIABLES`` in the path of
    the report or the trace, on the command line or in the ini file (where no shell
    expands them), name the file they expand to, not a folder named ``$OUT``."""
    pytester.makepyfile(test_ok="def test_ok():\n    pass\n")
    home = pytester.mkdir("home")
    out = pytester.mkdir("artifacts")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("ELASTIC_TIMER_TEST_OUT", str(out))
    by_variable = run(pytester, f"{option}=$ELASTIC_TIMER_TEST_OUT/out.json", report=False)
    by_variable.assert_clean()
    by_variable.result.assert_outcomes(passed=1)
    assert (out / "out.json").is_file()
    ini = option.removeprefix("--").replace("-", "_")
    pytester.makeini(f"[pytest]\n{ini} = ~/out.json\n")
    by_home = run(pytester, report=False)
    by_home.assert_clean()
    by_home.result.assert_outcomes(passed=1)
    assert (home / "out.json").is_file()
    assert not (pytester.path / "$ELASTIC_TIMER_TEST_OUT").exists()
    assert not (pytester.path / "~").exists()


@pytest.mark.parametrize("option", ["--elastic-timer-report", "--elastic-timer-trace"])
def test_an_output_path_that_ends_in_a_separator_is_a_usage_error(
    pytester: pytest.Pytester, option: str
) -> None:
    """``out/`` names a directory, there or not: the output went to a file ``out``."""
    pytester.makepyfile(test_ok="def test_ok():\n    pass\n")
    session = run(pytester, f"{option}=out/", report=False)
    session.assert_clean()
    assert session.result.ret == pytest.ExitCode.USAGE_ERROR
    assert f"ERROR: {option} must be the path of a file, not a directory: 'out/'" in (
        session.stderr
    )
    assert not (pytester.path / "out").exists()


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (
            ("--elastic-timer-report=out.json", "--elastic-timer-trace=./out.json"),
            "--elastic-timer-trace must be a file of its own, not the file of "
            "--elastic-timer-report: './out.json'",
        ),
        (
            ("--junitxml=out.json", "--elastic-timer-report=sub/../out.json"),
            "--elastic-timer-report must be a file of its own, not the file of --junitxml: "
            "'sub/../out.json'",
        ),
        (
            ("--junitxml=out.json", "--elastic-timer-trace=link.json"),
            "--elastic-timer-trace must be a file of its own, not the file of --junitxml: "
            "'link.json'",
        ),
        (
            ("-o", "elastic_timer_report=out.json", "--elastic-timer-trace=out.json"),
            "--elastic-timer-trace must be a file of its own, not the file of "
            "ini option 'elastic_timer_report': 'out.json'",
        ),
    ],
    ids=["report-trace", "junit-report", "junit-trace-by-a-link", "ini-report-trace"],
)
def test_two_outputs_in_one_file_are_a_usage_error(
    pytester: pytest.Pytester, args: tuple[str, ...], error: str
) -> None:
    """The JSON report, the trace and pytest's JUnit XML each overwrote the other when
    given one file: one of them was lost, and nothing said so."""
    pytester.makepyfile(test_ok="def test_ok():\n    pass\n")
    (pytester.path / "link.json").symlink_to("out.json")  # not there yet: it is followed
    session = run(pytester, *args, report=False)
    session.assert_usage_error(error)
    assert not (pytester.path / "out.json").exists()


def test_outputs_may_share_a_file_that_is_not_replaced(pytester: pytest.Pytester) -> None:
    """``/dev/null`` (or a pipe, a terminal) is written into by each output that names
    it, never replaced: several outputs may name it, as a CI job that sends them to its
    log or away does."""
    pytester.makepyfile(test_ok="def test_ok():\n    pass\n")
    session = run(
        pytester,
        "--junitxml=/dev/null",
        "--elastic-timer-report=/dev/null",
        "--elastic-timer-trace=/dev/null",
        report=False,
    )
    session.assert_clean()
    session.result.assert_outcomes(passed=1)


@pytest.mark.parametrize("option", ["--elastic-timer-report", "--elastic-timer-trace"])
def test_an_output_path_that_is_a_link_or_a_pipe_is_written_through(
    pytester: pytest.Pytester, option: str
) -> None:
    """As a plain write does: a symbolic link's target gets the output and the link
    stays; a named pipe (like ``/dev/null``, not a regular file) is written into, never
    replaced by a file."""
    pytester.makepyfile(test_ok="def test_ok():\n    pass\n")
    target = pytester.mkdir("out") / "real.json"
    link = pytester.path / "link.json"
    link.symlink_to(target)
    session = run(pytester, f"{option}={link}", report=False)
    session.result.assert_outcomes(passed=1)
    assert link.is_symlink() and json.loads(target.read_text(encoding="utf-8"))

    pipe = pytester.path / "pipe"
    os.mkfifo(pipe)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(pipe.read_bytes()), daemon=True)
    reader.start()
    try:
        session = run(pytester, f"{option}={pipe}", report=False)
        session.result.assert_outcomes(passed=1)
        reader.join(30)
    finally:
        if reader.is_alive():  # nothing was written: let the reader go
            with open(pipe, "wb"):
                pass
    assert stat.S_ISFIFO(os.lstat(pipe).st_mode)
    assert received and json.loads(received[0])
    assert not [p.name for p in pytester.path.iterdir() if ".tmp" in p.name]


@pytest.mark.parametrize("workers", [[], ["-p", "xdist", "-n", "2"]], ids=["one", "xdist"])
@pytest.mark.parametrize("trace", [[], ["--elastic-timer-trace=trace.json"]], ids=["", "trace"])
def test_ci_outputs_raise_no_warning_under_strict_settings(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    workers: list[str],
    trace: list[str],
) -> None:
    """On GitHub Actions, with JUnit, a JSON report, a budget (and a trace), a passing
    session under ``filterwarnings = error`` passes and warns of nothing: the CI
    outputs' modules are registered without pytest's assertion rewriting, which warned
    that the slow phases' module was imported already (the session failed, and its
    JUnit file was the watchdog's fallback)."""
    github(monkeypatch, pytester.path)
    # pytest-asyncio, loaded in these runs, warns where its loop scope is unset (from
    # 0.24 on); an older one, as goes with pytest 8.0, warns of the option, unknown to it.
    version = importlib.metadata.version("pytest-asyncio").split(".")
    knows_loop_scope = tuple(int(n) for n in version[:2] if n.isdigit()) >= (0, 24)
    loop_scope = "asyncio_default_fixture_loop_scope = function\n" if knows_loop_scope else ""
    pytester.makeini(f"[pytest]\nfilterwarnings = error\n{loop_scope}")
    pytester.makepyfile(
        test_ok="import pytest\n\n@pytest.mark.expires(20)\ndef test_ok():\n    pass\n"
    )
    junit = pytester.path / "junit.xml"
    session = run(pytester, *workers, *trace, f"--junitxml={junit}", lean=False)
    session.assert_clean()
    session.result.assert_outcomes(passed=1)
    assert session.result.ret == 0
    assert "warnings summary" not in session.stdout, session.stdout
    assert "Warning" not in session.stderr, session.stderr
    suite = ET.parse(junit).getroot()
    assert "session-ended" not in junit.read_text()
    assert sum(int(s.get("errors", 0)) for s in suite.iter("testsuite")) == 0
