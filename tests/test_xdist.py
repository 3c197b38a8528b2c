"""pytest-xdist: hung workers are terminated, replaced and reported by scope (issue 3).

Every inner session here runs with ``-n 2``. A test that holds the GIL in a C loop
(``sum(range(10**11))`` runs for minutes) cannot be interrupted; the watchdog dumps the
worker's stacks and terminates it, and the controller reports the test by its scope,
once, under every ``--dist`` mode, in the terminal, the JSON report and JUnit XML.
Inner tests write ``pids/<name>`` files (worker id and pid, one line per run) so that
the outer test can count runs and prove that no worker or child is left alive.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from helpers import (
    PLAIN_CHILD_TEST,
    Session,
    failure_block,
    lead,
    run,
    scope_line,
    section,
    wait_gone,
)

# Inner sessions under xdist: the lean plugin set of helpers.LEAN without "-p no:xdist".
XDIST = (
    *("-p", "no:cacheprovider", "-p", "no:asyncio", "-p", "no:hypothesispytest"),
    *("-p", "no:timeout", "-n", "2"),
)
GRACE = "--elastic-timer-grace=0.5"
HARD = "(?:terminated|killed)"
RESULT = re.compile(r"^(PASSED|FAILED|ERROR|TIMEOUT|SKIPPED|XFAIL|XPASS) (\S+)")
SUMMARY = re.compile(r"^=+ (.*) in [\d.]+s(?: \([^)]*\))? =+$")

# Written by each inner test: "<worker id> <pid>" per run, so runs can be counted.
RECORD_PID = """
import os
import subprocess
import sys
import time

import pytest


def record_pid(name, *extra):
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pids")
    os.makedirs(here, exist_ok=True)
    with open(os.path.join(here, name), "a") as f:
        f.write(" ".join([os.environ.get("PYTEST_XDIST_WORKER", "-"), str(os.getpid()), *extra]))
        f.write("\\n")
"""

GIL_TESTS = (
    RECORD_PID
    + '''

def test_before():
    record_pid("test_before")


@pytest.mark.expires(1)
def test_gil():
    """A child of the worker, then a C loop that holds the GIL for minutes."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    record_pid("test_gil", str(child.pid))
    sum(range(10**11))


@pytest.mark.expires(1)
def test_soft():
    record_pid("test_soft")
    time.sleep(60)


def test_after_1():
    record_pid("test_after_1")


def test_after_2():
    record_pid("test_after_2")
'''
)


@pytest.fixture(autouse=True)
def not_an_xdist_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inner sessions do not inherit this suite's own xdist worker id (under -n)."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_TESTRUNUID", raising=False)


def run_xdist(pytester: pytest.Pytester, *args: str, timeout: float = 120) -> Session:
    return run(pytester, *XDIST, *args, lean=False, timeout=timeout)


def results(session: Session) -> collections.Counter[tuple[str, str]]:
    """``-rA`` short summary lines as a count of (status word, nodeid)."""
    found: collections.Counter[tuple[str, str]] = collections.Counter()
    for line in session.stdout.splitlines():
        match = RESULT.match(line)
        if match:
            # Without xdist's "@group" suffix, whether or not loadgroup added one.
            found[match.group(1), re.sub(r"@\w+$", "", match.group(2))] += 1
    return found


def final_line(session: Session) -> str:
    lines = [m.group(1) for line in session.stdout.splitlines() if (m := SUMMARY.match(line))]
    assert lines, session.stdout
    return lines[-1]


def runs(pytester: pytest.Pytester, name: str) -> list[list[str]]:
    """Each run of inner test ``name``: [worker id, pid, extra...]."""
    path = pytester.path / "pids" / name
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def all_pids(pytester: pytest.Pytester) -> set[int]:
    """Every worker and child pid the inner tests wrote down."""
    pids: set[int] = set()
    for path in (pytester.path / "pids").glob("*"):
        for line in path.read_text().splitlines():
            pids.update(int(p) for p in line.split()[1:])
    return pids


def assert_all_gone(session: Session, pids: set[int]) -> None:
    """No worker, child or watchdog of the inner session runs any more."""
    session.assert_clean()
    alive = [pid for pid in sorted(pids) if not wait_gone(pid, 5.0)]
    assert not alive, f"still running after the session: {alive}"


def records_of(session: Session, nodeid: str) -> list[dict[str, Any]]:
    assert session.report is not None, "no JSON report was written"
    # A record names the test as pytest reports it: with xdist's "@group" suffix where
    # loadgroup added one (it depends on the pytest version), as results() ignores it.
    return [r for r in session.report["expired"] if re.sub(r"@\w+$", "", r["nodeid"]) == nodeid]


def junit_cases(path: Path) -> dict[str, list[ET.Element]]:
    root = ET.parse(path).getroot()
    cases: dict[str, list[ET.Element]] = collections.defaultdict(list)
    for case in root.iter("testcase"):
        name = re.sub(r"@\w+$", "", str(case.get("name")))  # xdist's "@group", as results()
        cases[f"{case.get('classname')}::{name}"].append(case)
    return cases


# -- a C loop under -n 2: terminated, reported by scope, the session goes on ----------
GIL_ID = "test_x.py::test_gil"


def test_c_loop_in_a_worker_fails_by_its_scope(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_x=GIL_TESTS)
    session = run_xdist(pytester, GRACE, "-rA")
    gil = runs(pytester, "test_gil")
    assert len(gil) == 1, gil
    worker_id, worker_pid, child_pid = gil[0][0], int(gil[0][1]), int(gil[0][2])

    # Within a few seconds, although the C loop would run for minutes.
    assert session.seconds < 40, session.text
    (record,) = records_of(session, GIL_ID)
    assert record["scope"] == "test_gil::call"
    assert re.fullmatch(HARD, record["action"])
    assert 1 <= record["elapsed"] < 1 + 0.5 + 4
    assert (record["pid"], record["worker"]) == (worker_pid, worker_id)
    assert child_pid in {p["pid"] for p in record["killed"]}  # the worker's whole tree
    # It lasted as long as its scope ran, not the 0 s of xdist's report of a crash
    # (--durations, JUnit and the slowest tests read the report's duration).
    assert session.report is not None
    (slowest,) = [e for e in session.report["session"]["slowest"] if e["nodeid"] == GIL_ID]
    (call,) = [s for s in slowest["scopes"] if s["scope"] == "test_gil::call"]
    assert call["seconds"] == pytest.approx(record["elapsed"], abs=0.01), slowest

    # The failure's first line is the scope line, not xdist's "worker crashed".
    first = lead(session, "test_gil")
    assert scope_line("test_gil::call", "1", HARD).match(first), first
    assert "crashed while running" not in session.text
    assert "worker 'gw" not in session.text
    block = failure_block(session, "test_gil")
    dump = section(block, "elastic-timer stack dump")
    assert re.search(r'File ".*test_x\.py", line \d+ in test_gil', dump), dump

    # The status word, the soft interrupt next door, and the others pass.
    found = results(session)
    assert found == collections.Counter(
        {
            ("TIMEOUT", "test_x.py::test_gil"): 1,
            ("TIMEOUT", "test_x.py::test_soft"): 1,
            ("PASSED", "test_x.py::test_before"): 1,
            ("PASSED", "test_x.py::test_after_1"): 1,
            ("PASSED", "test_x.py::test_after_2"): 1,
        }
    ), found
    assert scope_line("test_soft::call", "1").match(lead(session, "test_soft"))
    (soft,) = records_of(session, "test_x.py::test_soft")
    assert soft["action"] == "interrupted" and soft["killed"] == []

    # The session ends normally: tests failed, nothing interrupted it.
    assert session.result.ret == pytest.ExitCode.TESTS_FAILED
    assert final_line(session) == "2 failed, 3 passed"
    assert "Interrupted" not in session.text
    assert_all_gone(session, all_pids(pytester))


def test_soft_interrupt_in_a_worker_just_fails_the_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_soft=RECORD_PID
        + """

@pytest.mark.expires(1)
def test_hang():
    record_pid("test_hang")
    time.sleep(60)


@pytest.mark.parametrize("n", range(6))
def test_next(n):
    record_pid(f"test_next_{n}")
    time.sleep(0.2)
"""
    )
    session = run_xdist(pytester, GRACE, "-rA")
    assert scope_line("test_hang::call", "1").match(lead(session, "test_hang"))
    expected = {("TIMEOUT", "test_soft.py::test_hang"): 1}
    expected |= {("PASSED", f"test_soft.py::test_next[{n}]"): 1 for n in range(6)}
    assert results(session) == collections.Counter(expected)
    # Nothing was terminated or replaced: each worker id kept its one process.
    names = ["test_hang", *(f"test_next_{n}" for n in range(6))]
    pids = {tuple(run_[:2]) for name in names for run_ in runs(pytester, name)}
    assert len({w for w, _ in pids}) == len(pids) <= 2, pids
    assert "node down" not in session.text and "replacing" not in session.text
    assert session.report is not None
    (record,) = session.report["expired"]
    assert record["action"] == "interrupted" and record["killed"] == []
    assert session.result.ret == pytest.ExitCode.TESTS_FAILED
    assert final_line(session) == "1 failed, 6 passed"
    assert_all_gone(session, all_pids(pytester))


# -- every --dist mode: the expired test is reported once and not run again ----------
# The expired test comes first in its module: what is left of its work unit after the
# worker was ended goes to the replacement in one piece (the layout that used to hang
# is test_requeued_unit_with_one_test_left_does_not_hang). Under pytest 9.2 xdist's
# ``xdist_group`` suffix does not reach the nodeids (xdist sets ``item._nodeid``, which
# pytest no longer reads), so loadgroup schedules every test as a unit of its own here.
DIST_TESTS = (
    RECORD_PID
    + """

pytestmark = pytest.mark.xdist_group("g")


@pytest.mark.expires(1)
def test_gil():
    record_pid("test_gil")
    sum(range(10**11))


def test_first():
    record_pid("test_first")


def test_second():
    record_pid("test_second")


def test_third():
    record_pid("test_third")


def test_fourth():
    record_pid("test_fourth")


class TestGroup:
    def test_fifth(self):
        record_pid("test_fifth")

    def test_sixth(self):
        record_pid("test_sixth")
"""
)
OTHER_TESTS = (
    RECORD_PID
    + """

def test_elsewhere_1():
    record_pid("test_elsewhere_1")


def test_elsewhere_2():
    record_pid("test_elsewhere_2")
"""
)
DIST_PASSING = ("first", "second", "third", "fourth", "fifth", "sixth")


@pytest.mark.parametrize("mode", ["load", "loadscope", "loadfile", "loadgroup", "worksteal"])
def test_expired_test_counted_once_under_each_dist_mode(
    pytester: pytest.Pytester, mode: str
) -> None:
    pytester.makepyfile(test_d=DIST_TESTS, test_e=OTHER_TESTS)
    session = run_xdist(pytester, GRACE, "-rA", f"--dist={mode}", "--junitxml=junit.xml")
    assert session.seconds < 60, session.text
    # Run once: the replacement worker never started it again.
    assert len(runs(pytester, "test_gil")) == 1, runs(pytester, "test_gil")
    for name in (*DIST_PASSING, "elsewhere_1", "elsewhere_2"):
        assert len(runs(pytester, f"test_{name}")) == 1, (name, runs(pytester, f"test_{name}"))

    gil = "test_d.py::test_gil"
    found = results(session)
    assert [k for k in found if k[1] == gil] == [("TIMEOUT", gil)], found
    assert found[("TIMEOUT", gil)] == 1, found
    expected = {f"test_d.py::test_{n}" for n in DIST_PASSING[:4]}
    expected |= {f"test_d.py::TestGroup::test_{n}" for n in DIST_PASSING[4:]}
    expected |= {"test_e.py::test_elsewhere_1", "test_e.py::test_elsewhere_2"}
    passed = {nodeid for (word, nodeid), n in found.items() if word == "PASSED" and n == 1}
    assert passed == expected, found
    assert sum(found.values()) == len(expected) + 1, found
    assert final_line(session) == f"1 failed, {len(expected)} passed"
    assert session.result.ret == pytest.ExitCode.TESTS_FAILED

    (record,) = records_of(session, gil)
    assert re.fullmatch(HARD, record["action"])
    first = lead(session, "test_gil")
    assert scope_line("test_gil::call", "1", HARD).match(first), first
    cases = junit_cases(pytester.path / "junit.xml")
    assert len(cases["test_d::test_gil"]) == 1, {k: len(v) for k, v in cases.items()}
    assert sum(len(v) for v in cases.values()) == len(expected) + 1
    (case,) = cases["test_d::test_gil"]
    assert len(case.findall("failure")) == 1 and not case.findall("error")
    assert_all_gone(session, all_pids(pytester))


HELPER_OF_EACH_WORKER = """
import subprocess
import sys

CHILD = (
    "import os, time\\n"
    "import pytest_elastic_timer as et\\n"
    "et.set_label('helper of ' + os.environ['PYTEST_XDIST_WORKER'])\\n"
    "with et.expires(0.5, scope='handshake'):\\n"
    "    while True:\\n"
    "        time.sleep(0.01)\\n"
)


def test_helper():
    done = subprocess.run([sys.executable, "-c", CHILD])
    assert done.returncode == 0, "the helper failed"
"""


def test_under_dist_each_each_runs_report_names_its_own_helpers_expiry(
    pytester: pytest.Pytester,
) -> None:
    """Every worker runs the test (``--dist each``): each run's failure, its JUnit
    case and its properties are about the expiry of its own helper, not the other
    worker's (records were matched by node id alone)."""
    pytester.makepyfile(test_h=HELPER_OF_EACH_WORKER)
    session = run_xdist(pytester, "--dist=each", "--junitxml=junit.xml")
    session.assert_clean()
    session.result.assert_outcomes(failed=2)
    assert len(records_of(session, "test_h.py::test_helper")) == 2
    cases = junit_cases(pytester.path / "junit.xml")["test_h::test_helper"]
    labels = []
    for case in cases:
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        label = str(props["elastic_timer_label"])
        labels.append(label)
        text = "".join(f.text or "" for f in case.iter("failure"))
        assert set(re.findall(r"helper of gw\d", text)) == {label}, (label, text)
    assert sorted(labels) == ["helper of gw0", "helper of gw1"]


EACH_IN_ITS_ORDER = """
import os
import time

import pytest

WORKER = os.environ["PYTEST_XDIST_WORKER"]


@pytest.fixture
def staggered():
    # gw0's setup ends first and its failure comes last: pytest writes gw0's testcase
    # first, and the failures come in the other order.
    time.sleep(0.3 if WORKER == "gw0" else 0.8)


@pytest.mark.expires(1.5)
def test_both_expire(staggered):
    if WORKER == "gw0":
        sum(range(3 * 10**9))  # in C: ended after the grace
    time.sleep(10)  # interrupted


@pytest.mark.expires(1)
def test_one_expires():
    assert WORKER == "gw1", "a plain failure"  # on gw0's replacement
    time.sleep(10)
"""


def test_under_dist_each_each_junit_testcase_gets_its_own_runs_expiry(
    pytester: pytest.Pytester,
) -> None:
    """pytest writes a testcase per run in the order of the runs' first reports; the
    expiries are matched to them in that order, not in the order the failures came
    (gw0's testcase got gw1's record), and a run that failed by itself keeps its own
    failure (it got the other run's ScopeExpired)."""
    pytester.makepyfile(test_each=EACH_IN_ITS_ORDER)
    session = run_xdist(pytester, "--dist=each", "--elastic-timer-grace=1", "--junitxml=j.xml")
    session.assert_clean()
    session.result.assert_outcomes(failed=4)
    cases = junit_cases(pytester.path / "j.xml")
    actions = []
    for case in cases["test_each::test_both_expire"]:
        (failure,) = case.iter("failure")
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        ended = "crashed" in (failure.text or "") or "terminated" in (failure.text or "")
        assert (props["elastic_timer_action"] != "interrupted") == ended, (props, failure.text)
        assert str(failure.get("message")).endswith(props["elastic_timer_action"])
        actions.append(props["elastic_timer_action"] == "interrupted")
    assert sorted(actions) == [False, True]
    types = sorted(
        str(f.get("type")) for c in cases["test_each::test_one_expires"] for f in c.iter("failure")
    )
    assert len(types) == 2 and types.count("pytest_elastic_timer.ScopeExpired") == 1, types


# The expired test's unit has one test left after it, and the ended worker had one more
# unit queued; the other worker is done and shut down by then. The replacement is handed
# a one-test unit, and an xdist worker holds its last test until it is sent a next one
# or shutdown: the session hung here until xdist_support re-looked after a reschedule.
REQUEUE_TESTS = {
    **{
        f"test_{m}": f"def test_{m}_1():\n    pass\n\n\ndef test_{m}_2():\n    pass\n"
        for m in "abcdef"
    },
    "test_z": """
import pytest


def test_z_1():
    pass


@pytest.mark.expires(1)
def test_gil():
    sum(range(10**11))


def test_z_2():
    pass
""",
}


EACH_TESTS = (
    RECORD_PID
    + """

def test_first():
    record_pid("test_first")
    if os.environ["PYTEST_XDIST_WORKER"] == "gw1":
        time.sleep(4)  # gw0's run of test_hang has been ended by then


@pytest.mark.expires(1, grace=0.3)
def test_hang():
    record_pid("test_hang")
    if os.environ["PYTEST_XDIST_WORKER"] == "gw0":
        sum(range(10**11))
    time.sleep(0.1)


def test_ok():
    record_pid("test_ok")
"""
)


def test_under_dist_each_a_test_ended_on_one_worker_runs_on_the_others(
    pytester: pytest.Pytester,
) -> None:
    """``--dist each``: every worker runs every test. The watchdog's ending of a test on
    one worker keeps no other worker from running (and reporting) it."""
    pytester.makepyfile(test_e=EACH_TESTS)
    session = run_xdist(pytester, "--dist=each", "-rA")
    found = results(session)
    assert found == {
        ("PASSED", "test_e.py::test_first"): 2,
        ("TIMEOUT", "test_e.py::test_hang"): 1,
        ("PASSED", "test_e.py::test_hang"): 1,
        ("PASSED", "test_e.py::test_ok"): 2,
    }, session.text
    assert final_line(session) == "1 failed, 5 passed"
    assert sorted(worker for worker, *_ in runs(pytester, "test_hang")) == ["gw0", "gw1"]
    assert_all_gone(session, all_pids(pytester))


EACH_TWICE_ENDED = (
    RECORD_PID
    + """

@pytest.mark.expires(0.5)
def test_gil_1():
    record_pid("test_gil_1")
    sum(range(10**11))


@pytest.mark.expires(0.5)
def test_gil_2():
    record_pid("test_gil_2")
    sum(range(10**11))


def test_ok():
    record_pid("test_ok")
"""
)


def test_under_dist_each_a_replacement_worker_ended_in_turn_reports_its_test(
    pytester: pytest.Pytester,
) -> None:
    """``--dist each``: each worker is ended in test_gil_1, and its replacement in
    test_gil_2. test_gil_2 went unreported and test_ok unrun (xdist kept no collection
    of a replacement, to name the test it lost), the JUnit file with a nameless
    testcase."""
    pytester.makepyfile(test_e=EACH_TWICE_ENDED)
    session = run_xdist(pytester, "--dist=each", "-rA", GRACE, "--junitxml=junit.xml")
    assert results(session) == {
        ("TIMEOUT", "test_e.py::test_gil_1"): 2,
        ("TIMEOUT", "test_e.py::test_gil_2"): 2,
        ("PASSED", "test_e.py::test_ok"): 2,
    }, session.text
    assert final_line(session) == "4 failed, 2 passed"
    cases = ET.parse(pytester.path / "junit.xml").getroot().iter("testcase")
    names = collections.Counter(case.get("name") for case in cases)
    assert names == {"test_gil_1": 2, "test_gil_2": 2, "test_ok": 2}, names
    assert_all_gone(session, all_pids(pytester))


EACH_LAST_ENDED = (
    RECORD_PID
    + """

@pytest.mark.parametrize("i", range(3))
def test_x(i):
    record_pid("test_x")
    if os.environ["PYTEST_XDIST_WORKER"] == "gw1":
        time.sleep(2)  # still busy when gw0 is ended in its last test


@pytest.mark.expires(0.5)
def test_last():
    record_pid("test_last")
    if os.environ["PYTEST_XDIST_WORKER"] == "gw0":
        sum(range(10**11))
"""
)


def test_under_dist_each_a_worker_ended_in_its_last_test_is_replaced_by_one_that_stops(
    pytester: pytest.Pytester,
) -> None:
    """``--dist each``: gw0 is ended in its last test while gw1 runs on. Its replacement
    has nothing left to run, and stops. It was scheduled as a new worker, to run every
    test, and failed there: an INTERNALERROR (KeyError), gw1's results lost."""
    pytester.makepyfile(test_e=EACH_LAST_ENDED)
    session = run_xdist(pytester, "--dist=each", "-rA", GRACE)
    assert "INTERNALERROR" not in session.text, session.text
    assert results(session) == {
        **{("PASSED", f"test_e.py::test_x[{i}]"): 2 for i in range(3)},
        ("TIMEOUT", "test_e.py::test_last"): 1,
        ("PASSED", "test_e.py::test_last"): 1,
    }, session.text
    assert session.result.ret == pytest.ExitCode.TESTS_FAILED
    assert len(runs(pytester, "test_x")) == 6  # none run again by the replacement
    assert_all_gone(session, all_pids(pytester))


@pytest.mark.parametrize(
    ("nodeid", "grouped", "name"),
    [
        ("test_h.py::test_alpha", True, "test_alpha"),
        ("test_h.py::test_alpha@alpha", True, "test_alpha"),  # loadgroup's, on pytest 8
        ("test_h.py::TestK::test_x[1-b]@group.one", True, "test_x[1-b]"),
        ("test_h.py::test_x[a@b]", True, "test_x[a@b]"),  # an "@" of the parameters
        ("test_h.py::test_x[a@b]@g", True, "test_x[a@b]"),
        ("spec.yaml::user@host", False, "user@host"),  # not loadgroup: an item's own "@"
    ],
)
def test_the_test_name_of_a_nodeid_leaves_out_xdists_group(
    nodeid: str, grouped: bool, name: str
) -> None:
    """An ended worker's test under loadgroup (pytest 8, where xdist hands out nodeids
    with their group) lasted 0 s in --durations and JUnit, and its location named the
    group: its name kept the group, and its scopes' paths, named without, did not
    match it."""
    from pytest_elastic_timer.plugin.xdist_support import name_of_test

    assert name_of_test(nodeid, grouped=grouped) == name


def run_or_kill(pytester: pytest.Pytester, args: list[str], timeout: float) -> int | None:
    """Run an inner pytest; its exit status, or None when it hung (its whole process
    tree is killed then, so nothing is left behind)."""
    with (pytester.path / "output.txt").open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", *args],
            cwd=pytester.path,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        tree = [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]
        for p in tree:
            with contextlib.suppress(psutil.Error):
                p.kill()
        proc.wait()
        psutil.wait_procs(tree, timeout=5)
        return None


@pytest.mark.parametrize("mode", ["loadscope", "loadfile"])
def test_requeued_unit_with_one_test_left_does_not_hang(
    pytester: pytest.Pytester, mode: str
) -> None:
    pytester.makepyfile(**REQUEUE_TESTS)
    # The hang depended on the order of two re-queued units (4 runs in 5 hung).
    for output in three_sessions_that_end(pytester, mode):
        assert "TIMEOUT test_z.py::test_gil" in output and "1 failed, 14 passed" in output


def three_sessions_that_end(pytester: pytest.Pytester, mode: str) -> Iterator[str]:
    """The output of three sessions under ``--dist=mode``, each asserted to have ended
    by itself, with tests failed, and no INTERNALERROR: the first that hangs fails."""
    args = [*XDIST, GRACE, f"--dist={mode}", "-rA"]
    for attempt in range(3):
        status = run_or_kill(pytester, args, timeout=40)
        output = (pytester.path / "output.txt").read_text(errors="replace")
        assert status is not None, f"attempt {attempt + 1} hung:\n{output}"
        assert "INTERNALERROR" not in output, output
        assert status == pytest.ExitCode.TESTS_FAILED, output
        yield output


# A test of each of three files hangs: each of their workers, and replacements, are
# ended. xdist re-queues every unit of an ended worker, those it had finished too, and
# the replacement was handed such an empty unit and one test, which it held waiting
# for a next one, while a unit stayed queued: the session hung (2 runs in 3), or ended
# in an INTERNALERROR (a KeyError: xdist scheduled a replacement whose collection had
# not come yet, another having been replaced at once).
THREE_HANGING_FILES = {
    f"test_{m}": "import pytest\n\n\n@pytest.mark.expires(0.5)\n"
    "def test_hang():\n    sum(range(10**11))\n\n\ndef test_after():\n    pass\n"
    for m in "abc"
}


@pytest.mark.parametrize("mode", ["loadscope", "loadfile"])
def test_workers_ended_in_three_files_leave_no_unit_behind(
    pytester: pytest.Pytester, mode: str
) -> None:
    pytester.makepyfile(**THREE_HANGING_FILES)
    for output in three_sessions_that_end(pytester, mode):
        assert "3 failed, 3 passed" in output, output
        for m in "abc":
            assert f"TIMEOUT test_{m}.py::test_hang" in output, output
            assert f"PASSED test_{m}.py::test_after" in output, output


# -- --max-worker-restart=0 -----------------------------------------------------------
RESTART_TESTS = (
    RECORD_PID
    + """

def test_first():
    record_pid("test_first")


@pytest.mark.expires(1)
def test_gil():
    record_pid("test_gil")
    sum(range(10**11))


def test_third():
    record_pid("test_third")


def test_fourth():
    record_pid("test_fourth")
"""
)


def test_max_worker_restart_0_ends_the_session_with_a_summary_line(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_r=RESTART_TESTS)
    session = run_xdist(pytester, GRACE, "-rA", "--max-worker-restart=0")
    assert session.seconds < 40, session.text
    found = results(session)
    assert found[("TIMEOUT", "test_r.py::test_gil")] == 1, found
    assert len(runs(pytester, "test_gil")) == 1
    first = lead(session, "test_gil")
    assert scope_line("test_gil::call", "1", HARD).match(first), first
    assert "crashed while running" not in session.text
    # The worker was not replaced, and the summary says why the session stopped early.
    assert "replacing crashed worker" not in session.text
    (record,) = records_of(session, "test_r.py::test_gil")
    limit = [line for line in session.lines if "--max-worker-restart" in line]
    assert limit == [
        f"elastic-timer: the watchdog ended 1 worker(s) ({record['worker']}) for expired "
        "scopes; --max-worker-restart=0 stopped the session early"
    ], limit
    assert session.result.ret == pytest.ExitCode.TESTS_FAILED
    assert_all_gone(session, all_pids(pytester))


HANGS_THEN_ONE = """
import pytest


@pytest.mark.expires(0.3, grace=0.2)
@pytest.mark.parametrize("i", range(6))
def test_hang(i):
    sum(range(10**11))


def test_z():
    pass
"""


def test_xdists_default_restart_limit_ends_the_session_with_a_summary_line(
    pytester: pytest.Pytester,
) -> None:
    """Without --max-worker-restart, xdist allows 4 restarts per worker: the fifth
    worker the watchdog ends stops the session, and the summary says so."""
    pytester.makepyfile(test_r=HANGS_THEN_ONE)
    session = run(pytester, "-p", "xdist", "-n", "1", "-rA")
    found = results(session)
    assert sum(n for (word, _), n in found.items() if word == "TIMEOUT") == 5, session.text
    assert ("PASSED", "test_r.py::test_z") not in found
    assert session.report is not None
    ended = sorted({r["worker"] for r in session.report["expired"]})
    assert len(ended) == 5, ended
    limit = [line for line in session.lines if "--max-worker-restart" in line]
    assert limit == [
        f"elastic-timer: the watchdog ended 5 worker(s) ({', '.join(ended)}) for expired "
        "scopes; --max-worker-restart=4 (xdist's default: 4 per worker) stopped the "
        "session early"
    ], limit
    assert_all_gone(session, {r["pid"] for r in session.report["expired"]})


# -- a worker hung in a session fixture's teardown: bounded by --expires-session ------
SESSION_FIXTURE = """
import time

import pytest


@pytest.fixture(scope="session")
def server():
    yield "server"
    {hang}
"""
SESSION_TESTS = (
    RECORD_PID
    + """

def test_one(server):
    record_pid("test_one")


def test_two(server):
    record_pid("test_two")


def test_three(server):
    record_pid("test_three")
"""
)


def test_session_fixture_teardown_sleep_is_bounded(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(SESSION_FIXTURE.format(hang="time.sleep(3600)"))
    pytester.makepyfile(test_s=SESSION_TESTS)
    session = run_xdist(pytester, GRACE, "-rA", "--expires-session=5")
    assert session.seconds < 5 + 20, session.text
    assert session.result.ret == pytest.ExitCode.INTERRUPTED
    assert session.report is not None
    hung = [r for r in session.report["expired"] if r["scope"] == "session"]
    assert hung, session.report["expired"]
    for record in hung:
        assert re.fullmatch(r"gw\d", record["worker"]) and record["action"] == "interrupted"
        assert "in server" in record["stack"] and "time.sleep(3600)" in record["stack"]
    # The stop line names the phase and the worker.
    assert re.search(
        r"scope 'session' expired after [\d.]+s \(budget 5s\): interrupted "
        r"\(phase teardown, gw\d\)",
        session.text,
    ), session.text
    assert ("TIMEOUT", "test_s.py::test_one") not in results(session)  # passed before
    assert all(word in ("PASSED", "TIMEOUT") for word, _ in results(session))
    assert_all_gone(session, all_pids(pytester))


STUCK_THEN_MORE = (
    RECORD_PID
    + """

def test_stuck():
    record_pid("test_stuck")
    sum(range(10**11))


def test_next():
    record_pid("test_next")


def test_last():
    record_pid("test_last")
"""
)


STUCK_WITH_A_BUDGET_THEN_MORE = STUCK_THEN_MORE.replace(
    "\ndef test_stuck", "\n@pytest.mark.expires(1)\ndef test_stuck"
)


def test_a_session_budget_that_ends_a_stuck_worker_stops_the_session(
    pytester: pytest.Pytester,
) -> None:
    """The session's budget runs out while a worker is stuck in a C call: the worker
    is ended, and no test starts after it (a replacement worker would run the rest),
    as when the budget interrupts a test: exit status 2."""
    pytester.makepyfile(test_s=STUCK_THEN_MORE)
    session = run(pytester, "-p", "xdist", "-n", "1", GRACE, "-rA", "--expires-session=2")
    assert session.result.ret == pytest.ExitCode.INTERRUPTED, session.text
    assert list(results(session)) == [("TIMEOUT", "test_s.py::test_stuck")], session.text
    assert sorted(p.name for p in (pytester.path / "pids").iterdir()) == ["test_stuck"]
    assert "Interrupted: scope 'session' expired after" in session.text
    assert session.report is not None
    (record,) = [r for r in session.report["expired"] if r["scope"] == "session"]
    assert re.fullmatch(HARD, record["action"]) and record["worker"] == "gw0"
    # The worker could not say which test it ran: its table does, as for an interrupt.
    assert (record["nodeid"], record["phase"]) == ("test_s.py::test_stuck", "call")
    assert "  phase:   call" in failure_block(session, "test_stuck").splitlines()
    assert_all_gone(session, all_pids(pytester) | {record["pid"]})


# A conftest's reporting hook of test_a in a worker holds it past the session's budget,
# between two phases of the test (pytest makes or logs a phase's report there).
REPORT_HOOK_HOLDS = {
    "makereport-setup": """
import time

import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    if call.when == "setup" and item.name == "test_a":
        time.sleep(4)
    return (yield)
""",
    "logreport-setup": """
import time


def pytest_runtest_logreport(report):
    if report.when == "setup" and report.nodeid.endswith("test_a"):
        time.sleep(4)
""",
    "logreport-call": """
import time


def pytest_runtest_logreport(report):
    if report.when == "call" and report.nodeid.endswith("test_a"):
        time.sleep(4)
""",
}


@pytest.mark.parametrize("hook", list(REPORT_HOOK_HOLDS))
def test_a_worker_whose_session_budget_runs_out_between_phases_of_a_test(
    pytester: pytest.Pytester, hook: str
) -> None:
    """The session's budget runs out in a worker while pytest makes or logs the report
    of test_a's setup (or call), outside the phase where pytest catches a test's
    exceptions: raised there, the ScopeExpired was an internal error of the worker, and
    test_a had no outcome. The hook runs on; after the setup, test_a's call fails by the
    session's scope at once (TIMEOUT), after the call the test keeps its outcome, and no
    test starts after it: exit status 2."""
    pytester.makeconftest(REPORT_HOOK_HOLDS[hook])
    pytester.makepyfile(test_s=TWO_TESTS)
    session = run(pytester, "-p", "xdist", "-n", "1", GRACE, "-rA", "--expires-session=2")
    assert "INTERNALERROR" not in session.text, session.text
    assert session.result.ret == pytest.ExitCode.INTERRUPTED, session.text
    word = "PASSED" if hook.endswith("call") else "TIMEOUT"
    assert list(results(session)) == [(word, "test_s.py::test_a")], session.text
    if word == "TIMEOUT":
        first = lead(session, "test_a")
        assert scope_line("session", "2").match(first), first
    assert "Interrupted: scope 'session' expired after" in session.text, session.text
    assert session.report is not None
    (record,) = [r for r in session.report["expired"] if r["scope"] == "session"]
    assert (record["nodeid"], record["action"]) == ("test_s.py::test_a", "interrupted"), record
    assert_all_gone(session, {record["pid"]})


# -- the session's budget running out during collection ------------------------------
ONE_WORKER_HANGS_IN_COLLECTION = (
    RECORD_PID
    + """

if os.environ["PYTEST_XDIST_WORKER"] == "gw1":
    {hang}


def test_a():
    record_pid("test_a")


def test_b():
    record_pid("test_b")
"""
)
STOP_LINE = re.compile(
    r"Interrupted: scope 'session' expired after [\d.]+s \(budget 3s\): (\w+) "
    r"\(phase collection, (gw\d+)\)"
)


def stop_line(session: Session) -> tuple[str, str]:
    """The action and the worker that the line the session stopped with names."""
    found = [m.groups() for line in session.lines if (m := STOP_LINE.search(line))]
    assert found, session.text
    return found[0]


@pytest.mark.parametrize(
    "hang", ["time.sleep(60)", "sum(range(10**11))"], ids=["interruptible", "gil"]
)
def test_a_worker_waiting_for_tests_lets_the_one_stuck_in_collection_stop_the_session(
    pytester: pytest.Pytester, hang: str
) -> None:
    """--expires-session runs out while gw1 is stuck collecting and gw0, collected,
    waits for tests: the session stops as the guide says, with gw1's scope line
    (interrupted, or terminated out of a C call), no internal error, no test run, and
    gw0 is neither blamed nor ended."""
    pytester.makepyfile(test_c=ONE_WORKER_HANGS_IN_COLLECTION.format(hang=hang))
    session = run_xdist(pytester, GRACE, "--expires-session=3")
    session.assert_clean()
    assert session.result.ret == pytest.ExitCode.INTERRUPTED, session.text
    action, worker = stop_line(session)
    assert worker == "gw1"
    assert action == ("interrupted" if hang.startswith("time") else "terminated")
    assert "elastic-timer: expired scopes" in session.stdout
    assert "Different tests were collected" not in session.stdout  # gw1 handed none
    assert not (pytester.path / "pids").exists()
    assert session.report is not None
    expired = session.report["expired"]
    assert [r["phase"] for r in expired if r["worker"] == "gw1"] == ["collection"], expired
    # gw0 had collected, and waited for a test: not said to be interrupted there (it
    # was not), nor ended. (Its budget may run out later, as the session ends.)
    for record in expired:
        if record["worker"] == "gw0":
            assert record["phase"] != "between tests", record
            assert record["action"] == "interrupted", record
    # Only the worker that had to be ended is replaced (its replacement runs nothing).
    assert ("replacing crashed worker" in session.text) == (action == "terminated")
    assert session.seconds < 3 + 0.5 + 5 + 8, session.text
    assert_all_gone(session, {r["pid"] for r in expired})


EVERY_WORKER_HANGS_IN_COLLECTION = {
    "test_c": RECORD_PID + "\ntime.sleep(60)\n\n\ndef test_c():\n    record_pid('test_c')\n",
    "test_d": RECORD_PID + "\n\ndef test_d():\n    record_pid('test_d')\n",
}


def test_workers_stuck_in_collection_are_not_replaced_by_ones_that_collect_again(
    pytester: pytest.Pytester,
) -> None:
    """Every worker hangs importing test_c.py: the session's budget stops the session
    with a worker's scope line; no replacement worker collects (and hangs) again, and
    no test runs."""
    pytester.makepyfile(**EVERY_WORKER_HANGS_IN_COLLECTION)
    session = run_xdist(pytester, GRACE, "--expires-session=3")
    session.assert_clean()
    assert session.result.ret == pytest.ExitCode.INTERRUPTED, session.text
    assert stop_line(session)[0] == "interrupted"
    assert "replacing crashed worker" not in session.text
    assert session.stdout.count("ERROR collecting test_c.py") <= 2, session.stdout
    assert not (pytester.path / "pids").exists()
    assert session.report is not None
    workers = sorted(r["worker"] for r in session.report["expired"] if r["worker"])
    assert set(workers) <= {"gw0", "gw1"}, workers
    assert session.seconds < 3 + 8, session.text
    assert_all_gone(session, {r["pid"] for r in session.report["expired"]})


def test_a_replacement_for_a_worker_ended_in_collection_collects_nothing(
    pytester: pytest.Pytester,
) -> None:
    """-n 1: the only worker is stuck in a C call while it imports a test module, and is
    ended for the session's budget. The session stops with its line; the replacement
    that xdist starts imports nothing (it would hang again, on a budget of its own)."""
    pytester.makepyfile(test_c="sum(range(10**11))\n\n\ndef test_a():\n    pass\n")
    session = run(pytester, "-p", "xdist", "-n", "1", GRACE, "--expires-session=2")
    session.assert_clean()
    assert session.result.ret == pytest.ExitCode.INTERRUPTED, session.text
    assert re.search(
        r"Interrupted: scope 'session' expired after [\d.]+s \(budget 2s\): "
        rf"{HARD} \(phase collection, gw0\)",
        session.text,
    ), session.text
    assert session.report is not None
    ended = [r for r in session.report["expired"] if r["worker"]]
    assert [r["worker"] for r in ended] == ["gw0"], ended
    assert session.seconds < 2 + 0.5 + 5 + 6, session.text
    assert_all_gone(session, {r["pid"] for r in session.report["expired"]})


# -- the session's budget running out in a worker's sessionstart or sessionfinish -------
WORKER_SESSION_HOOK_HANGS = """
import os
import time


def pytest_{hook}():
    if os.environ.get("PYTEST_XDIST_WORKER") == "gw1":
        {hang}
"""
TWO_TESTS = "def test_a():\n    pass\n\n\ndef test_b():\n    pass\n"
# The same hook, hanging in the one process of a session without xdist.
SESSION_HOOK_HANGS = WORKER_SESSION_HOOK_HANGS.replace(' == "gw1"', " is None")


def run_past_the_session_budget(
    pytester: pytest.Pytester, conftest: str, *, xdist: bool = False
) -> Session:
    """The two tests under ``conftest``, one of whose hooks holds the session past its
    budget (3s with xdist, 1.5s without): the session ends clean, interrupted (status 2)."""
    pytester.makeconftest(conftest)
    pytester.makepyfile(test_s=TWO_TESTS)
    if xdist:
        session = run_xdist(pytester, GRACE, "--expires-session=3")
    else:
        session = run(pytester, "--expires-session=1.5")
    session.assert_clean()
    assert session.result.ret == pytest.ExitCode.INTERRUPTED, session.text
    return session


@pytest.mark.parametrize("hook", ["sessionstart", "sessionfinish", "unconfigure"])
@pytest.mark.parametrize(
    "hang", ["time.sleep(60)", "sum(range(10**11))"], ids=["interruptible", "gil"]
)
def test_a_worker_stuck_in_a_session_hook_stops_the_session_with_its_scope_line(
    pytester: pytest.Pytester, hook: str, hang: str
) -> None:
    """A conftest's pytest_sessionstart (or pytest_sessionfinish or
    pytest_unconfigure, after the tests ran) hangs in gw1 past --expires-session.
    Interrupted, the session stops with gw1's scope line and phase, as for collection:
    no internal error (in sessionstart, the ScopeExpired ended the worker's session as
    an internal error of xdist), and no test runs (or they keep their outcomes); exit
    status 2 (it was 0 after sessionfinish and unconfigure: in unconfigure the worker
    has handed over its results, and the controller learns of it from the watchdog's
    record once the worker has ended). Out of a C call, gw1 is ended; after
    sessionstart its replacement runs the conftest's hook again, and may hang in it
    too before the session ends: the controller's own budget bounds that."""
    session = run_past_the_session_budget(
        pytester, WORKER_SESSION_HOOK_HANGS.format(hook=hook, hang=hang), xdist=True
    )
    assert "INTERNALERROR" not in session.text and "Traceback" not in session.text
    if hook == "sessionstart":
        session.result.assert_outcomes()
    else:
        session.result.assert_outcomes(passed=2)
    assert session.report is not None
    ended = [r for r in session.report["expired"] if r["worker"] == "gw1"]
    assert ended and ended[0]["phase"] == hook, ended
    if hang.startswith("time"):
        assert re.search(
            r"Interrupted: scope 'session' expired after [\d.]+s \(budget 3s\): "
            rf"interrupted \(phase {hook}, gw1\)",
            session.text,
        ), session.text
        assert session.seconds < 3 + 0.5 + 5 + 8, session.text
    else:
        assert re.fullmatch(HARD, ended[0]["action"]), ended
        assert session.seconds < 3 + 2 * 0.5 + 5 + 5 + 8, session.text
    assert_all_gone(session, {r["pid"] for r in session.report["expired"]})


@pytest.mark.parametrize("stop", [["-x"], ["--maxfail=1"]], ids=["x", "maxfail"])
def test_a_test_whose_worker_was_ended_counts_for_maxfail(
    pytester: pytest.Pytester, stop: list[str]
) -> None:
    """``-x``: the test stuck in a C call, whose worker the watchdog ended, is a failure
    like any other: no test starts after it, as for a plain failure (exit status 2,
    xdist's "stopping after 1 failures")."""
    pytester.makepyfile(test_s=STUCK_WITH_A_BUDGET_THEN_MORE)
    session = run(pytester, "-p", "xdist", "-n", "1", GRACE, "-rA", *stop)
    assert session.result.ret == pytest.ExitCode.INTERRUPTED, session.text
    assert list(results(session)) == [("TIMEOUT", "test_s.py::test_stuck")], session.text
    assert sorted(p.name for p in (pytester.path / "pids").iterdir()) == ["test_stuck"]
    assert "Interrupted: stopping after 1 failures" in session.text
    assert session.report is not None
    (record,) = session.report["expired"]
    assert re.fullmatch(HARD, record["action"]), record
    assert_all_gone(session, all_pids(pytester) | {record["pid"]})


def run_teardown_c_loop(pytester: pytest.Pytester) -> Session:
    pytester.makeconftest(SESSION_FIXTURE.format(hang="sum(range(10**11))"))
    pytester.makepyfile(test_s=SESSION_TESTS)
    return run_xdist(pytester, GRACE, "-rA", "--expires-session=5", "--junitxml=junit.xml")


def test_session_fixture_teardown_c_loop_is_bounded(pytester: pytest.Pytester) -> None:
    session = run_teardown_c_loop(pytester)
    # Session budget, the session scope's grace (0.5 + 5) and the controller's margin.
    assert session.seconds < 5 + 5.5 + 20, session.text
    assert session.result.ret not in (pytest.ExitCode.OK, pytest.ExitCode.INTERNAL_ERROR)
    assert session.report is not None
    ended = [r for r in session.report["expired"] if r["scope"] == "session" and r["worker"]]
    assert ended, session.report["expired"]
    for record in ended:
        assert re.fullmatch(r"gw\d", record["worker"]) and re.fullmatch(HARD, record["action"])
        assert record["phase"] == "teardown"
        assert re.search(r'conftest\.py", line \d+ in server', record["stack"]), record["stack"]
        # The terminal summary names the worker.
        assert f"  process: pid {record['pid']}, worker {record['worker']}" in session.lines
    assert_all_gone(session, all_pids(pytester) | {r["pid"] for r in ended})


def test_session_fixture_teardown_c_loop_reported_by_scope(pytester: pytest.Pytester) -> None:
    """Not xdist's "worker 'gw0' crashed while running ...", nor JUnit's "failed on setup":
    the worker ended for the 'session' scope is reported by that scope."""
    session = run_teardown_c_loop(pytester)
    assert "crashed while running" not in session.text, session.text
    found = results(session)
    assert all(word in ("PASSED", "TIMEOUT") for word, _ in found), found
    timeouts = [nodeid for word, nodeid in found if word == "TIMEOUT"]
    assert timeouts, found
    for nodeid in timeouts:
        name = nodeid.split("::")[-1]
        # An error of the test's teardown, where the session fixture's teardown ran.
        assert f" ERROR at teardown of {name} " in session.stdout, session.stdout
        first = lead(session, name)
        assert scope_line("session", "5", HARD).match(first), first
        block = failure_block(session, name).splitlines()
        assert "  phase:   teardown" in block, block
        assert any(re.match(r"^  process: pid \d+, worker gw\d$", line) for line in block), block
    for case in [c for cases in junit_cases(pytester.path / "junit.xml").values() for c in cases]:
        for problem in [*case.findall("failure"), *case.findall("error")]:
            message = problem.get("message") or ""
            assert "crashed" not in message and "failed on setup" not in message, message
            assert message.startswith("scope 'session' expired after"), message


def test_session_scope_record_outside_tests_names_no_outer_test(
    pytester: pytest.Pytester,
) -> None:
    """A pytest run by a test (pytester, CI wrappers) inherits PYTEST_CURRENT_TEST; a
    scope it enters outside every test must not be credited to the outer test."""
    assert os.environ.get("PYTEST_CURRENT_TEST")  # this very test, as the inner pytest sees
    pytester.makeconftest(
        "import time\n\n\ndef pytest_collection_modifyitems(items):\n    time.sleep(5)\n"
    )
    pytester.makepyfile(test_a="def test_a():\n    pass\n")
    session = run(pytester, "--expires-session=1")
    assert session.report is not None
    (record,) = session.report["expired"]
    assert record["scope"] == "session" and record["phase"] == "collection"
    assert record["nodeid"] == "", record["nodeid"]
    assert "  phase:   collection" in session.lines


def test_the_session_expiring_in_a_session_fixtures_teardown_is_listed(
    pytester: pytest.Pytester,
) -> None:
    """The session's budget that runs out in a session fixture's teardown (after the
    last test's call passed) ended the session: its expiry is listed in the summary at
    default verbosity, not counted among those caught on purpose."""
    pytester.makeconftest(
        "import time\nimport pytest\n\n\n@pytest.fixture(scope='session')\n"
        "def slow():\n    yield\n    time.sleep(30)\n"
    )
    pytester.makepyfile(test_a="def test_a(slow):\n    pass\n")
    session = run(pytester, "--expires-session=1.5")
    session.assert_clean()
    assert session.report is not None
    (record,) = session.report["expired"]
    assert record["scope"] == "session" and record["nodeid"] == "test_a.py::test_a"
    assert "caught on purpose" not in session.stdout
    assert any(line.startswith("scope 'session' expired after") for line in session.lines)


def assert_stopped_by_the_session_budget_in(session: Session, phase: str, output: str) -> Any:
    """The session's budget (1.5 s) ran out in a conftest's session hook after the
    tests: ``output`` has the summary's line naming ``phase``, the JSON report has the
    one record (returned) and exit status 2, and the session ended soon after."""
    assert re.search(
        r"^Interrupted: scope 'session' expired after [\d.]+s \(budget 1.5s\): "
        rf"interrupted \(phase {phase}\)$",
        output,
        re.MULTILINE,
    ), session.text
    assert session.report is not None
    (record,) = session.report["expired"]
    assert record["scope"] == "session"
    assert session.report["session"]["exitstatus"] == 2
    assert session.seconds < 1.5 + 8, session.text
    return record


def test_the_session_expiring_in_a_conftest_sessionfinish_ends_with_its_summary(
    pytester: pytest.Pytester,
) -> None:
    """Without xdist: the session's budget runs out in a conftest's pytest_sessionfinish
    after the tests passed. The hook is interrupted; the summary is still written
    (the exception skipped it), with the scope's line and phase, and the exit status is
    2, as when the budget stops the session during the tests (it was 0)."""
    session = run_past_the_session_budget(
        pytester, SESSION_HOOK_HANGS.format(hook="sessionfinish", hang="time.sleep(60)")
    )
    session.result.assert_outcomes(passed=2)
    record = assert_stopped_by_the_session_budget_in(session, "sessionfinish", session.stdout)
    assert "  phase:   sessionfinish" in session.lines
    assert record["phase"] == "sessionfinish"


def test_the_session_expiring_in_a_conftest_terminal_summary_ends_with_status_2(
    pytester: pytest.Pytester,
) -> None:
    """The session's budget runs out in a conftest's pytest_terminal_summary, which
    pytest's terminal reporter calls after every pytest_sessionfinish hook ran: the hook
    is interrupted, the rest of the summary is still written (the exception skipped it,
    the final line included), and the exit status is 2 (it was 0: pytest takes Exit
    there for a note on stderr and keeps the status the tests made)."""
    session = run_past_the_session_budget(
        pytester, SESSION_HOOK_HANGS.format(hook="terminal_summary", hang="time.sleep(60)")
    )
    session.result.assert_outcomes(passed=2)
    record = assert_stopped_by_the_session_budget_in(session, "sessionfinish", session.stdout)
    assert "elastic-timer: expired scopes" in session.stdout, session.text
    assert record["phase"] == "sessionfinish"


def test_the_session_expiring_in_a_conftest_unconfigure_ends_with_status_2(
    pytester: pytest.Pytester,
) -> None:
    """The session's budget runs out in a conftest's pytest_unconfigure: the hook is
    interrupted, pytest exits 2 with the scope's line (it ended with the exception's
    traceback, status 1), and the plugin still ends its session: the watchdog writes
    the report with that exit status (it said pytest had been ended)."""
    session = run_past_the_session_budget(
        pytester, "import time\n\n\ndef pytest_unconfigure(config):\n    time.sleep(60)\n"
    )
    session.result.assert_outcomes(passed=2)
    assert "Traceback" not in session.text and "pytest was ended" not in session.text
    assert_stopped_by_the_session_budget_in(session, "unconfigure", session.text)


def test_the_session_expiring_in_a_conftest_sessionstart_reports_status_2(
    pytester: pytest.Pytester,
) -> None:
    """Without xdist: the session's budget runs out in a conftest's
    pytest_sessionstart. pytest stops there (no pytest_sessionfinish runs) with status
    2, and the JSON report says 2 too (it said null, as for a pytest that never
    finished)."""
    session = run_past_the_session_budget(
        pytester, SESSION_HOOK_HANGS.format(hook="sessionstart", hang="time.sleep(60)")
    )
    assert re.search(
        r"scope 'session' expired after [\d.]+s \(budget 1.5s\): "
        r"interrupted \(phase sessionstart\)",
        session.stderr,
    ), session.text
    assert session.report is not None
    (record,) = session.report["expired"]
    assert (record["scope"], record["phase"]) == ("session", "sessionstart")
    assert session.report["session"]["exitstatus"] == 2
    assert session.seconds < 1.5 + 8, session.text


CAUGHT_IN_HOOK = """
import os
import sys
import time


def pytest_{hook}({arg}):
    if {where}:
        try:
            time.sleep(60)
        except Exception as exc:  # a cleanup that logs what went wrong and goes on
            print("cleanup failed:", type(exc).__name__, file=sys.stderr)
"""


@pytest.mark.parametrize(
    ("hook", "xdist"),
    [
        ("sessionfinish", False),
        ("unconfigure", False),
        ("sessionfinish", True),
        ("unconfigure", True),
    ],
    ids=["sessionfinish", "unconfigure", "sessionfinish-xdist", "unconfigure-xdist"],
)
def test_the_session_expiring_in_a_hook_that_catches_it_still_ends_with_status_2(
    pytester: pytest.Pytester, hook: str, xdist: bool
) -> None:
    """The session's budget runs out in a conftest's pytest_sessionfinish or
    pytest_unconfigure that catches the exception itself (``except Exception``, as
    cleanup code does) and returns. The budget ran out all the same: pytest exits 2
    with the scope's line, as where the hook let the exception through (or where a
    test catches it), and the report says so (it exited 0)."""
    where = 'os.environ.get("PYTEST_XDIST_WORKER") == "gw1"' if xdist else "True"
    arg = "config" if hook == "unconfigure" else "session"
    conftest = CAUGHT_IN_HOOK.format(hook=hook, arg=arg, where=where)
    session = run_past_the_session_budget(pytester, conftest, xdist=xdist)
    assert "cleanup failed: " in session.text, session.text
    session.result.assert_outcomes(passed=2)
    assert re.search(
        r"Interrupted: scope 'session' expired after [\d.]+s \(budget [\d.]+s\): "
        rf"interrupted \(phase {hook}{', gw1' if xdist else ''}\)",
        session.text,
    ), session.text
    assert session.report is not None
    (record,) = session.report["expired"]
    assert record["scope"] == "session"
    assert session.report["session"]["exitstatus"] == 2
    assert session.seconds < (3 + 0.5 + 5 + 8 if xdist else 1.5 + 8), session.text
    assert_all_gone(session, {r["pid"] for r in session.report["expired"]})


# -- processes a test started, under xdist: their records in the failure text --------
CHILDREN = (
    PLAIN_CHILD_TEST
    + '''
import os

CHILD = """
import time
import pytest_elastic_timer
with pytest_elastic_timer.expires(0.5, scope="child"):
    time.sleep(30)
"""


def test_rank():
    env = dict(os.environ, RANK="0")
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, timeout=60)
    assert proc.returncode == 0
'''
)


def test_child_records_in_failure_text_under_xdist(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_c=CHILDREN)
    session = run_xdist(pytester, "-rA")
    assert session.report is not None
    (rank,) = records_of(session, "test_c.py::test_rank")
    assert rank["label"] == "rank 0"
    block = failure_block(session, "test_rank")
    text = section(block, f"elastic-timer: expired in rank 0, pid {rank['pid']}")
    assert "scope 'child' expired" in text, text
    (plain,) = records_of(session, "test_c.py::test_plain")
    (child,) = [c for c in plain["children"] if "serve_forever" in c["cmdline"]]
    block = failure_block(session, "test_plain")
    text = section(block, f"elastic-timer: stack of pid {child['pid']} at expiry")
    assert "in serve_forever" in text, text


# A plugin that sets PYTHONPATH from its settings in every pytest process, before the
# session's plugins are configured (as pytest-env does, from the ini file).
SETS_PYTHONPATH = """
import os


def pytest_load_initial_conftests(early_config, parser, args):
    os.environ["PYTHONPATH"] = os.path.join(os.getcwd(), "extra")
"""


def test_a_worker_whose_pythonpath_a_plugin_set_again_still_dumps_its_children(
    pytester: pytest.Pytester,
) -> None:
    """The processes a worker starts get the session's start-up hook although a plugin
    set PYTHONPATH again in the worker: the stack of the test's child at its expiry."""
    pytester.makepyfile(test_plain=PLAIN_CHILD_TEST, sets_pythonpath=SETS_PYTHONPATH)
    session = run_xdist(pytester, "-p", "sets_pythonpath", "-rA")
    session.assert_clean()
    assert session.report is not None
    (record,) = records_of(session, "test_plain.py::test_plain")
    (child,) = [c for c in record["children"] if "serve_forever" in c["cmdline"]]
    assert "in serve_forever" in child["stack"], child


# What pytest-rerunfailures does with a crashed worker's test, once: queue it again,
# and report this run as a rerun.
RERUNS_ONCE = """
import pytest

queued_again = set()


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    if crashitem not in queued_again:
        queued_again.add(crashitem)
        sched.mark_test_pending(crashitem)
        report.outcome = "rerun"


def pytest_report_teststatus(report):
    if report.outcome == "rerun":
        return "rerun", "R", "RERUN"
"""


def test_a_plugin_may_run_a_test_whose_worker_was_ended_again(
    pytester: pytest.Pytester,
) -> None:
    """A plugin that queues the crashed worker's test again (pytest-rerunfailures)
    gets it run again on the replacement worker, with a budget of its own; the last
    run is the TIMEOUT, and the session fails."""
    pytester.makepyfile(test_s=STUCK_WITH_A_BUDGET_THEN_MORE, reruns_once=RERUNS_ONCE)
    session = run(pytester, "-p", "xdist", "-n", "1", GRACE, "-rA", "-p", "reruns_once")
    assert session.result.ret == pytest.ExitCode.TESTS_FAILED, session.text
    assert ("TIMEOUT", "test_s.py::test_stuck") in results(session), session.text
    summary = next(line for line in reversed(session.lines) if SUMMARY.match(line))
    assert "1 failed, 2 passed, 1 rerun" in summary, summary
    runs = (pytester.path / "pids" / "test_stuck").read_text().split()[1::2]
    assert len(runs) == 2, runs  # two workers, one run each
    assert session.report is not None
    ended = [r for r in session.report["expired"] if r["nodeid"] == "test_s.py::test_stuck"]
    assert len(ended) == 2 and all(re.fullmatch(HARD, r["action"]) for r in ended), ended
    assert_all_gone(session, all_pids(pytester) | {r["pid"] for r in ended})


THREAD_OUTLIVES_ITS_TEST = """
import threading
import time

import pytest
import pytest_elastic_timer as et


@pytest.mark.expires(1)
def test_leaves_a_blocked_scope():
    blocked = threading.Event()

    def wait():
        with et.expires(0.3, scope="in-thread"):
            blocked.wait(10)  # in C: the thread takes no interrupt

    threading.Thread(target=wait, daemon=True).start()
    time.sleep(30)


def test_next():
    time.sleep(5)  # runs when the watchdog ends the worker for the thread's scope
"""


def test_a_worker_ended_for_an_earlier_tests_scope_is_reported_by_that_scope(
    pytester: pytest.Pytester,
) -> None:
    """A thread's scope outlives its test and the watchdog ends the worker while the
    next test runs: that test is reported by the scope that ended the worker (its
    record names the test that entered it), not as a bare "worker crashed"."""
    pytester.makepyfile(test_t=THREAD_OUTLIVES_ITS_TEST)
    session = run(pytester, "-p", "xdist", "-n", "1", "--elastic-timer-grace=1", "-rA")
    session.assert_clean()
    assert "crashed while running" not in session.text, session.text
    assert set(results(session)) == {
        ("TIMEOUT", "test_t.py::test_leaves_a_blocked_scope"),
        ("TIMEOUT", "test_t.py::test_next"),
    }, session.text
    block = failure_block(session, "test_next")
    assert "scope 'in-thread' expired after" in block, block
    assert "  test:    test_t.py::test_leaves_a_blocked_scope" in block, block


HELPER_ENDED_THEN_A_CRASH = """
import os
import signal
import subprocess
import sys

HELPER = '''
import pytest_elastic_timer as et
with et.expires(0.3, scope="helper"):
    sum(range(10**11))  # in C: ended by the watchdog
'''


def test_helper_ended():
    assert subprocess.run([sys.executable, "-c", HELPER], timeout=60).returncode == 0


def test_crashes():
    os.kill(os.getpid(), signal.SIGKILL)  # nothing of the plugin's
"""


def test_a_worker_crash_of_its_own_is_not_blamed_on_a_helper_the_watchdog_ended(
    pytester: pytest.Pytester,
) -> None:
    """A helper of an earlier test that the watchdog ended alone did not end the worker:
    a later crash of the worker stays xdist's "crashed while running"."""
    pytester.makepyfile(test_h=HELPER_ENDED_THEN_A_CRASH)
    session = run(pytester, "-p", "xdist", "-n", "1", GRACE, "-rA", "-p", "no:randomly")
    assert ("TIMEOUT", "test_h.py::test_helper_ended") in results(session), session.text
    assert "crashed while running 'test_h.py::test_crashes'" in session.text, session.text
    assert ("TIMEOUT", "test_h.py::test_crashes") not in results(session)
    assert session.report is not None
    (helper,) = session.report["expired"]
    assert helper["scope"] == "helper" and re.fullmatch(HARD, helper["action"]), helper
    assert helper["phase"] == ""
