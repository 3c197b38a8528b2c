"""The plugin in real inner pytest sessions, each with its own watchdog process (issue 2)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from xml.etree import ElementTree

import psutil
import pytest
from helpers import (
    CONTRACT_FIELDS,
    HEADER,
    LEAN,
    REPORT_NAME,
    SLEEPING_RANK,
    Session,
    loaded_psutil,
    reap,
    run,
    scope_line,
    top_level_environment,
    wait_gone,
)

from pytest_elastic_timer.plugin import launcher, leaks, lifecycle

BEFORE = """
def test_before():
    pass
"""
AFTER = """
def test_after():
    pass
"""


def marked_hang(budget: float, name: str = "test_x") -> str:
    """A test module whose test ``name`` hangs in a sleep under ``expires(budget)``."""
    return f"""
import time
import pytest

@pytest.mark.expires({budget})
def {name}():
    time.sleep(30)
"""


def _line_of(path: Path, text: str) -> int:
    """The 1-based number of the line of ``path`` that contains ``text``."""
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if text in line:
            return number
    raise AssertionError(f"{text!r} not in {path}")


# -- hangs fail in about their budget, name their scope, and the session runs on ----
HANGS = {
    "sleep": (
        "",
        marked_hang(0.5),
        "test_x::call",
        "@pytest.mark.expires(0.5)",
        "time.sleep(30)",
    ),
    "lock-deadlock": (
        "",
        """
        import threading
        import pytest

        @pytest.mark.expires(0.5)
        def test_x():
            lock = threading.Lock()
            lock.acquire()
            lock.acquire()
        """,
        "test_x::call",
        "@pytest.mark.expires(0.5)",
        "lock.acquire()",
    ),
    "nested-step": (
        "",
        """
        import time
        import pytest_elastic_timer

        def test_x():
            with pytest_elastic_timer.expires(after=0.5, scope="inner-step"):
                time.sleep(30)
        """,
        "test_x::call/inner-step",
        'scope="inner-step"',
        "time.sleep(30)",
    ),
    "session-fixture": (
        """
        import time
        import pytest
        import pytest_elastic_timer

        @pytest.fixture(scope="session")
        def resource():
            with pytest_elastic_timer.expires(after=0.5, scope="resource"):
                time.sleep(30)
            return 1
        """,
        """
        def test_x(resource):
            pass
        """,
        "test_x::setup/resource",
        'scope="resource"',
        "time.sleep(30)",
    ),
}


@pytest.mark.parametrize("kind", list(HANGS))
def test_hang_fails_in_its_budget_naming_the_scope(pytester: pytest.Pytester, kind: str) -> None:
    conftest, body, scope, entered, stuck = HANGS[kind]
    if conftest:
        pytester.makeconftest(conftest)
    path = pytester.makepyfile(test_hang=BEFORE + textwrap.dedent(body) + AFTER)
    session = run(pytester)
    session.assert_clean()
    in_fixture = kind == "session-fixture"
    if in_fixture:  # an expiry in setup is an error (see test_setup_expiry_is_an_error)
        session.result.assert_outcomes(passed=2, errors=1)
    else:
        session.result.assert_outcomes(passed=2, failed=1)
    assert session.result.ret == pytest.ExitCode.TESTS_FAILED
    # The scope line is the first line of the failure, then the traceback where it hung;
    # the JSON report has its record.
    record = session.assert_expired("test_x", scope, 0.5)
    assert stuck in session.stdout
    # The terminal summary lists the expired scope.
    assert "elastic-timer: expired scopes" in session.stdout
    assert any(scope_line(scope, "0.5").match(line) for line in session.result.outlines)
    assert record["nodeid"] == "test_hang.py::test_x"
    assert record["action"] == "interrupted"
    where = pytester.path / "conftest.py" if in_fixture else path
    assert Path(record["file"]) == where
    assert record["line"] == _line_of(where, entered)
    assert stuck in record["stack"]
    assert len(session.report["expired"]) == 1


def test_setup_expiry_is_an_error(pytester: pytest.Pytester) -> None:
    conftest, body = HANGS["session-fixture"][:2]
    pytester.makeconftest(conftest)
    pytester.makepyfile(test_hang=BEFORE + textwrap.dedent(body) + AFTER)
    session = run(pytester, "-v")
    session.assert_clean()
    session.result.assert_outcomes(passed=2, errors=1)
    assert session.result.ret == pytest.ExitCode.TESTS_FAILED
    assert any(re.match(r"^_+ ERROR at setup of test_x _+$", s) for s in session.lines)
    # An error, and still the status word of an expiry.
    assert re.search(r"^test_hang.py::test_x TIMEOUT\b", session.stdout, re.M), session.stdout
    assert "TIMEOUT test_hang.py::test_x - scope 'test_x::setup/resource'" in session.stdout


def test_teardown_expiry_is_an_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_hang=BEFORE
        + """
import time
import pytest

@pytest.fixture
def stuck():
    yield
    time.sleep(30)

@pytest.mark.expires(5, teardown=0.3)
def test_x(stuck):
    pass
"""
        + AFTER
    )
    session = run(pytester, "-v")
    session.assert_clean()
    # The call passed; its teardown is the error.
    session.result.assert_outcomes(passed=3, errors=1)
    assert session.result.ret == pytest.ExitCode.TESTS_FAILED
    lead = session.failure_lead("test_x")
    assert scope_line("test_x::teardown", "0.3").match(lead), lead
    assert any(re.match(r"^_+ ERROR at teardown of test_x _+$", s) for s in session.lines)
    assert re.search(r"^test_hang.py::test_x TIMEOUT\b", session.stdout, re.M), session.stdout
    assert session.record("test_x::teardown")["nodeid"] == "test_hang.py::test_x"


LEAKED_SCOPE = """
import time
import pytest
import pytest_elastic_timer as et

@pytest.fixture
def leaky():
    et.TimerRequest(0.3, scope="fixture-leaked").acquire()  # never released

def test_leaks():
    et.TimerRequest(0.3, scope="leaked").acquire()  # never released

def test_fixture_leaks(leaky):
    pass

def test_unrelated():
    time.sleep(1.5)

def test_after():
    pass
"""


FINISHING_CHILD = """
import subprocess
import sys

CHILDREN = []


def test_returns_before_its_child_ends():
    # Ends by itself 0.3 s after the test, with a status only its parent may collect.
    code = "import sys, time; time.sleep(0.3); sys.exit(3)"
    CHILDREN.append(subprocess.Popen([sys.executable, "-c", code]))


def test_the_childs_status_is_still_its_parents():
    (child,) = CHILDREN
    assert child.wait(timeout=30) == 3
"""


@pytest.mark.parametrize("mode", ["warn", "kill"])
def test_a_child_that_ends_just_after_its_test_is_not_a_leak(
    pytester: pytest.Pytester, mode: str
) -> None:
    """A process a test left that ends by itself within a second of the teardown (a
    producer's last item, a server shutting down) is not reported or ended, and is not
    reaped: its parent still reads its exit status."""
    pytester.makepyfile(test_finishing=FINISHING_CHILD)
    session = run(pytester, "-rA", f"--elastic-timer-leaks={mode}", "-W", "error")
    session.assert_clean()
    session.result.assert_outcomes(passed=2)
    assert "left 1 process(es)" not in session.stdout, session.stdout


@pytest.mark.parametrize("pidfds", [True, False], ids=["pidfd", "polled"])
def test_the_leak_check_waits_for_ending_processes_and_reaps_none(
    monkeypatch: pytest.MonkeyPatch, pidfds: bool
) -> None:
    from pytest_elastic_timer.core import unpatched
    from pytest_elastic_timer.plugin import leaks

    if not pidfds:
        monkeypatch.setattr(unpatched, "pidfd_open", None)
    elif unpatched.pidfd_open is None:
        pytest.skip("this kernel has no pidfds")
    code = "import sys, time; time.sleep(0.2); sys.exit(3)"
    ending = subprocess.Popen([sys.executable, "-c", code])
    staying = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert leaks.still_running_after({ending.pid, staying.pid}, timeout=3.0) == {staying.pid}
        assert ending.wait(timeout=30) == 3  # not reaped by the check
    finally:
        staying.kill()
        staying.wait()
        ending.kill()
        ending.wait()


def test_scope_left_open_by_a_test_does_not_hit_later_tests(pytester: pytest.Pytester) -> None:
    """A scope a test (or its fixture) leaves open ends with the test's phase scope, with
    a RuntimeWarning naming it; it never expires in a later test."""
    pytester.makepyfile(test_leak=LEAKED_SCOPE)
    session = run(pytester, "-v", "--elastic-timer-grace=0.5")
    session.assert_clean()
    assert session.result.ret == pytest.ExitCode.OK
    session.result.assert_outcomes(passed=4, warnings=2)
    for name in ("test_leaks", "test_fixture_leaks", "test_unrelated", "test_after"):
        assert f"test_leak.py::{name} PASSED" in session.stdout
    assert session.report is not None and session.report["expired"] == []
    assert "elastic-timer: expired scopes" not in session.text
    summary = session.stdout.split("warnings summary")[1]
    for phase, leaked in (
        ("test_leaks::call", "leaked"),
        ("test_fixture_leaks::setup", "fixture-leaked"),
    ):
        assert (
            f"RuntimeWarning: scope '{phase}' ended while '{phase}/{leaked}' inside it was "
            "still open" in summary
        ), summary
    assert "test_leak.py::test_leaks\n" in summary
    assert "test_leak.py::test_fixture_leaks\n" in summary
    # Each points where its scope was entered (it pointed into pluggy), and the one a
    # fixture's setup left open says how to bound a fixture's teardown instead.
    for leaked in ("fixture-leaked", "leaked"):
        line = f'et.TimerRequest(0.3, scope="{leaked}").acquire()  # never released'
        assert re.search(rf"test_leak.py:\d+: RuntimeWarning: .*\n\s+{re.escape(line)}", summary)
    assert "pluggy" not in summary, summary
    assert "bound the fixture's teardown with a scope after the yield" in summary, summary


@pytest.mark.parametrize("budget", [(), ("--expires=10",)], ids=["no budget", "budget"])
def test_scope_left_open_under_warnings_as_errors_fails_only_its_test(
    pytester: pytest.Pytester, budget: tuple[str, ...]
) -> None:
    """Under ``-W error`` the warning for a scope left open raises: the test that left
    it fails, once, and pytest's teardown still runs, so the next test does not inherit
    the test ("previous item was not torn down properly")."""
    pytester.makepyfile(test_leak=LEAKED_SCOPE)
    session = run(pytester, "-v", "-W", "error", "--elastic-timer-grace=0.5", *budget)
    session.assert_clean()
    for name in ("test_unrelated", "test_after"):
        assert f"test_leak.py::{name} PASSED" in session.stdout
    outcomes = session.result.parseoutcomes()
    assert outcomes.get("failed", 0) + outcomes.get("errors", 0) == 2, session.text
    assert "not torn down properly" not in session.text
    for phase, leaked in (
        ("test_leaks::call", "leaked"),
        ("test_fixture_leaks::setup", "fixture-leaked"),
    ):
        assert f"scope '{phase}' ended while '{phase}/{leaked}' inside it was" in session.text
    assert session.report is not None and session.report["expired"] == []


def test_json_report_fields(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_x=marked_hang(0.4))
    session = run(pytester)
    session.assert_clean()
    report = session.report
    assert report is not None
    assert report["version"] == 1
    assert isinstance(report["expired"], list)
    (record,) = report["expired"]
    assert set(CONTRACT_FIELDS) <= set(record)
    types = {
        "nodeid": str,
        "scope": str,
        "budget": float,
        "elapsed": float,
        "pid": int,
        "label": str,
        "worker": str,
        "file": str,
        "line": int,
        "action": str,
        "stack": str,
    }
    for name, kind in types.items():
        assert isinstance(record[name], kind), (name, record[name])
    assert record["nodeid"] == "test_x.py::test_x"
    assert record["scope"] == "test_x::call"
    assert record["budget"] == 0.4
    assert record["pid"] not in (0, os.getpid())
    # A process started by an xdist worker (as this inner pytest is, under -n) inherits
    # the worker's id.
    assert (record["label"], record["worker"]) == ("", os.environ.get("PYTEST_XDIST_WORKER", ""))
    assert record["file"] == str(pytester.path / "test_x.py")
    assert record["line"] == 4
    assert record["action"] == "interrupted"
    assert "in test_x" in record["stack"]


def test_json_report_without_expiry_is_empty(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_ok=BEFORE + AFTER)
    session = run(pytester)
    session.assert_clean()
    session.result.assert_outcomes(passed=2)
    assert session.report is not None
    assert session.report["version"] == 1
    assert session.report["expired"] == []
    assert "elastic-timer: expired scopes" not in session.stdout


# -- scopes inside a session: what test_scopes.py cannot see from one process -----------
# (the scope API itself is specified by test_scopes.py)
SCOPES_IN_A_SESSION = """
import os
import subprocess
import sys
import time

import pytest
import pytest_elastic_timer as et


def test_caught():
    with pytest.raises(et.ScopeExpired) as info:
        with et.expires(0.3, scope="caught"):
            time.sleep(30)
    assert info.value.scope == "test_caught::call/caught"


def test_cancelled():
    timer = et.TimerRequest(0.2, scope="cancelled")
    timer.acquire()
    timer.cancel()
    time.sleep(0.5)
    timer.release()


CHILD = '''
import time
import pytest_elastic_timer
with pytest_elastic_timer.expires(0.5, scope='child'):
    time.sleep(30)
'''


def test_subprocess_gets_scope_expired():
    assert os.environ["PYTEST_ELASTIC_TIMER"]
    proc = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0
    assert "pytest_elastic_timer.ScopeExpired: scope 'child' expired after " in proc.stderr
    assert "(budget 0.5s): interrupted" in proc.stderr
"""


def test_scopes_in_a_session_are_named_by_their_test_and_reported(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_api=SCOPES_IN_A_SESSION)
    session = run(pytester, "-v")
    session.assert_clean()
    session.result.assert_outcomes(passed=3)
    report = session.report
    assert report is not None
    caught = session.record("test_caught::call/caught")
    assert caught["nodeid"] == "test_api.py::test_caught"
    assert caught["pid"] == report["session"]["pid"]
    assert not [r for r in report["expired"] if "cancelled" in r["scope"]]
    # The child's expiry reaches the session's watchdog: it owns its scope.
    child = session.record("child")
    assert child["nodeid"] == "test_api.py::test_subprocess_gets_scope_expired"
    assert child["action"] == "interrupted"
    assert child["pid"] != report["session"]["pid"]
    assert child["file"] == "<string>"
    assert child["line"] == 4


RESCHEDULED = """
import json
import time
import pytest_elastic_timer as et

def test_x():
    budgets = {}
    for n in range(3):
        try:
            with et.TimerRequest(30, scope=f"moved{n}") as timer:
                timer.reschedule(0.2)
                time.sleep(30)
        except et.ScopeExpired as exc:
            budgets[exc.scope] = exc.budget
    with open("budgets.json", "w") as f:
        json.dump(budgets, f)
    with et.TimerRequest(30, scope="moved") as timer:
        timer.reschedule(0.3)
        time.sleep(30)
"""


def test_rescheduled_scope_reports_its_moved_budget(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_moved=RESCHEDULED)
    session = run(pytester)
    session.assert_clean()
    session.result.assert_outcomes(failed=1)
    # The budget is from entering the scope to its moved deadline: 0.3 s and the moment
    # between entering and rescheduling (long only on a loaded machine), never the 30 s
    # the scope was entered with.
    record = session.record("test_x::call/moved")
    assert 0.3 <= record["budget"] < 0.3 + 1
    assert record["budget"] <= record["elapsed"] < record["budget"] + 3
    # The exception carries the moved budget too, as the record has it (to the ms).
    lead = session.failure_lead("test_x")
    match = re.match(
        r"^scope 'test_x::call/moved' expired after [\d.]+s \(budget ([\d.]+)s\)", lead
    )
    assert match, lead
    assert float(match.group(1)) == pytest.approx(record["budget"], abs=0.0006)
    budgets = json.loads((pytester.path / "budgets.json").read_text())
    assert len(budgets) == 3
    for scope, budget in budgets.items():
        assert 0.2 <= budget < 0.2 + 1
        assert budget == pytest.approx(session.record(scope)["budget"], abs=0.0006)


def test_rescheduled_scope_budget_is_the_same_everywhere(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_moved=RESCHEDULED)
    session = run(pytester)
    session.assert_clean()
    # Three scopes: that all three moments between entering and rescheduling were whole
    # milliseconds (the roundings agreeing by chance) is one chance in a billion.
    budgets = json.loads((pytester.path / "budgets.json").read_text())
    assert len(budgets) == 3
    for scope, budget in budgets.items():
        assert budget == session.record(scope)["budget"], scope


# -- a C loop that holds the GIL: the watchdog ends pytest and still reports ----------
def test_c_loop_holding_the_gil_is_terminated(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_cloop="""
        import pytest

        def test_before():
            pass

        @pytest.mark.expires(1)
        def test_gil():
            sum(range(10**11))

        def test_after():
            pass
        """
    )
    session = run(pytester, "-v", "--elastic-timer-grace=0.5")
    assert "INTERNALERROR" not in session.text
    assert session.watchdog_pid is not None and wait_gone(session.watchdog_pid, 3)
    assert session.result.ret in (-signal.SIGTERM, -signal.SIGKILL)
    assert session.seconds < 1 + 10
    assert re.search(r"test_cloop.py::test_before PASSED", session.stdout)
    # The watchdog's own report on the terminal (pytest could not print it any more).
    assert "elastic-timer: expired scopes (pytest was ended)" in session.stderr
    line = scope_line("test_gil::call", "1", "(terminated|killed)")
    assert any(line.match(text) for text in session.stderr.splitlines()), session.stderr
    summary = session.stderr.split("pytest was ended")[1]
    assert "test_gil" in summary
    # Its stacks without pytest's own frames, which the JSON report keeps.
    assert "outer frames of pytest and its plugins (the JSON report has them)" in summary
    assert "_pytest/runner.py" not in summary
    assert f"JSON report written to {pytester.path / REPORT_NAME}" in session.stderr
    assert session.stderr.count("elastic-timer: expired scopes (pytest was ended)") == 1
    # ... and in the JSON report.
    record = session.record("test_gil::call")
    assert record["action"] in ("terminated", "killed")
    assert record["nodeid"] == "test_cloop.py::test_gil"
    assert "in test_gil" in record["stack"]
    assert record["budget"] == 1
    assert 1 <= record["elapsed"] < 1 + 0.5 + 3
    assert record["pid"] in [p["pid"] for p in record["killed"]]
    assert session.report["session"]["root_died"] is True


def test_nested_session_dumps_stacks(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_cloop="""
        import pytest

        @pytest.mark.expires(0.5)
        def test_gil():
            sum(range(10**11))
        """
    )
    session = run(pytester, "--elastic-timer-grace=0.3", nested=True)
    assert "INTERNALERROR" not in session.text
    record = session.record("test_gil::call")
    assert record["action"] in ("terminated", "killed")
    assert "in test_gil" in record["stack"]
    assert session.report["session"]["root_died"] is True


HANG_IGNORING_INTERRUPTS = """
import os
import shutil
import signal
import time
import pytest
import pytest_elastic_timer as et

REPORT = {report!r}
STDERR = {stderr!r}

def on_sigterm(signum, frame):
    # What a caller finds the moment pytest is gone.
    if os.path.exists(REPORT):
        shutil.copy(REPORT, "report-at-sigterm.json")
    shutil.copy(STDERR, "stderr-at-sigterm")
    os._exit(1)

@pytest.mark.expires(0.3)
def test_stubborn():
    signal.signal(signal.SIGTERM, {handler})
    while True:
        try:
            time.sleep(10)
        except et.ScopeExpired:
            pass
"""


def stubborn(pytester: pytest.Pytester, handler: str = "on_sigterm") -> None:
    """A test that ignores its interrupts: the watchdog ends pytest (SIGTERM, which
    ``handler`` receives, then SIGKILL)."""
    source = HANG_IGNORING_INTERRUPTS.format(
        report=str(pytester.path / REPORT_NAME),
        stderr=str(pytester.path / "stderr"),  # where runpytest_subprocess puts it
        handler=handler,
    )
    pytester.makepyfile(test_stubborn=source)


def test_report_is_complete_when_the_watchdog_ends_pytest(pytester: pytest.Pytester) -> None:
    stubborn(pytester)
    session = run(pytester, "--elastic-timer-grace=0.3")
    assert "INTERNALERROR" not in session.text
    assert session.result.ret == 1  # the handler's os._exit(1)
    record = session.record("test_stubborn::call")
    assert record["action"] == "terminated"
    assert session.report["session"]["root_died"] is True
    # The report was complete before pytest got its SIGTERM ...
    early = json.loads((pytester.path / "report-at-sigterm.json").read_text())
    (found,) = early["expired"]
    assert (found["scope"], found["nodeid"], found["action"]) == (
        "test_stubborn::call",
        "test_stubborn.py::test_stubborn",
        "terminated",
    )
    assert "in test_stubborn" in found["stack"]
    # ... and so was the watchdog's summary on the terminal, printed once.
    stderr = (pytester.path / "stderr-at-sigterm").read_text()
    assert "elastic-timer: expired scopes (pytest was ended)" in stderr
    line = scope_line("test_stubborn::call", "0.3", "terminated")
    assert any(line.match(text) for text in stderr.splitlines()), stderr
    assert f"JSON report written to {pytester.path / REPORT_NAME}" in stderr
    assert session.stderr.count("elastic-timer: expired scopes (pytest was ended)") == 1


def test_report_written_before_pytest_is_ended_follows_the_schema(
    pytester: pytest.Pytester,
) -> None:
    import jsonschema

    from pytest_elastic_timer.ci.reports import report_schema

    stubborn(pytester)
    session = run(pytester, "--elastic-timer-grace=0.3")
    assert "INTERNALERROR" not in session.text
    early = json.loads((pytester.path / "report-at-sigterm.json").read_text())
    assert early["session"].get("root_died") is True
    jsonschema.Draft202012Validator(report_schema()).validate(early)


def test_summary_of_a_killed_pytest_says_killed(pytester: pytest.Pytester) -> None:
    stubborn(pytester, handler="signal.SIG_IGN")
    session = run(pytester, "--elastic-timer-grace=0.3")
    assert "INTERNALERROR" not in session.text
    assert session.result.ret == -signal.SIGKILL
    assert session.record("test_stubborn::call")["action"] == "killed"
    line = scope_line("test_stubborn::call", "0.3", "killed")
    assert any(line.match(text) for text in session.stderr.splitlines()), session.stderr


# -- the watchdog is gone after every session, also after kill -9 of pytest ----------
class LineReader:
    """Collects a subprocess's output lines in a thread (no blocking reads in tests)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        assert proc.stdout is not None
        self._stream = proc.stdout
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self._stream:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: re.Pattern[str], timeout: float) -> re.Match[str]:
        give_up = time.monotonic() + timeout
        while time.monotonic() < give_up:
            for line in list(self.lines):
                match = pattern.search(line)
                if match:
                    return match
            time.sleep(0.02)
        raise AssertionError(f"{pattern.pattern!r} not in output:\n" + "\n".join(self.lines))

    def close(self) -> None:
        self._thread.join(10)
        self._stream.close()


def test_watchdog_exits_after_pytest_is_killed(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_long="""
        import time
        import pytest_elastic_timer

        def test_long():
            with pytest_elastic_timer.expires(60, scope="long"):
                print("inside the scope", flush=True)
                time.sleep(60)
        """
    )
    report = pytester.path / REPORT_NAME
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", *LEAN, "-s", f"--elastic-timer-report={report}"],
        cwd=pytester.path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    reader = LineReader(proc)
    try:
        watchdog = int(reader.wait_for(HEADER, 60).group(1))
        reader.wait_for(re.compile("inside the scope"), 60)
        assert psutil.Process(watchdog).is_running()
    finally:
        proc.kill()
        proc.wait()
    assert wait_gone(watchdog, 3.0), "the watchdog outlived the killed pytest"
    reader.close()
    assert report.exists()
    data = json.loads(report.read_text())
    assert data["version"] == 1
    assert data["expired"] == []
    assert data["session"]["root_died"] is True
    assert data["session"]["pid"] == proc.pid


# -- turning the plugin on and off -----------------------------------------------------
SLOW_BUT_FINISHING = """
import time
import pytest

@pytest.mark.expires(0.3)
def test_slow():
    time.sleep(1.5)
"""


def test_disabled_with_p_no(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_slow=SLOW_BUT_FINISHING)
    session = run(pytester, "-p", "no:elastic_timer", report=False)
    session.assert_clean()
    session.result.assert_outcomes(passed=1, warnings=1)
    assert "Unknown pytest.mark.expires" in session.stdout
    assert session.watchdog_pid is None
    assert "elastic-timer" not in session.stdout


def test_enabled_with_p_when_autoload_is_off(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makepyfile(test_slow=SLOW_BUT_FINISHING)
    off = run(pytester, report=False)
    off.assert_clean()
    off.result.assert_outcomes(passed=1, warnings=1)
    assert off.watchdog_pid is None
    on = run(pytester, "-p", "elastic_timer")
    on.assert_clean()
    on.result.assert_outcomes(failed=1)
    assert on.watchdog_pid is not None
    on.assert_expired("test_slow", "test_slow::call", 0.3)


# -- options: ini, CLI wins, scale; the header line ------------------------------------
UNMARKED_HANG = """
import time

def test_unmarked():
    time.sleep(30)
"""


@pytest.mark.parametrize("style", ["pytest.ini", "pyproject.toml"])
def test_ini_options_and_cli_wins(pytester: pytest.Pytester, style: str) -> None:
    options = {"expires": "0.3", "elastic_timer_grace": "0.7", "elastic_timer_scale": "1"}
    if style == "pytest.ini":
        pytester.makeini("[pytest]\n" + "".join(f"{k} = {v}\n" for k, v in options.items()))
    else:
        pytester.makepyprojecttoml(
            "[tool.pytest.ini_options]\n" + "".join(f'{k} = "{v}"\n' for k, v in options.items())
        )
    pytester.makepyfile(test_unmarked=UNMARKED_HANG)
    from_ini = run(pytester)
    from_ini.assert_clean()
    from_ini.result.assert_outcomes(failed=1)
    header = next(m for m in map(HEADER.match, from_ini.lines) if m)
    assert header.group(2, 3, 4) == ("0.3s", "0.7s", "1")
    from_ini.assert_expired("test_unmarked", "test_unmarked::call", 0.3)
    from_cli = run(pytester, "--expires=0.6")
    from_cli.assert_clean()
    from_cli.result.assert_outcomes(failed=1)
    from_cli.assert_expired("test_unmarked", "test_unmarked::call", 0.6)


def test_scale_multiplies_budgets(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_scaled=marked_hang(0.5))
    session = run(pytester, "--elastic-timer-scale=2")
    session.assert_clean()
    session.result.assert_outcomes(failed=1)
    session.assert_expired("test_x", "test_x::call", 1.0)  # budget shown: 1s


def test_report_header_line(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_ok=BEFORE)
    session = run(pytester, "--expires=7", "--elastic-timer-grace=0.5", "--elastic-timer-scale=3")
    session.assert_clean()
    session.result.assert_outcomes(passed=1)
    headers = [m for m in map(HEADER.match, session.lines) if m]
    assert len(headers) == 1
    assert headers[0].group(2, 3, 4) == ("7s", "0.5s", "3")
    assert session.watchdog_pid == int(headers[0].group(1))
    default = run(pytester)
    default.assert_clean()
    assert any(
        re.match(r"^elastic-timer: watchdog pid \d+, default budget none, grace 2s, scale 1$", s)
        for s in default.lines
    )


# -- fixtures ------------------------------------------------------------------------
def test_fixtures(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_fixtures="""
        import os
        import stat
        import time
        import psutil
        import pytest

        def test_before():
            pass

        @pytest.mark.expires(5)
        def test_timer(elastic_timer, elastic_timer_server):
            assert elastic_timer.budget == 5
            assert 0 < elastic_timer.remaining() <= 5
            with elastic_timer.step("load", 2) as step:
                assert step.path == "test_timer::call/load"
                assert 0 < step.expires() <= 2
            env = elastic_timer.env
            assert env["PYTEST_ELASTIC_TIMER"] == elastic_timer_server.address
            assert stat.S_ISSOCK(os.stat(elastic_timer_server.address).st_mode)
            assert psutil.Process(elastic_timer_server.pid).is_running()
            print("server pid", elastic_timer_server.pid)

        def test_unbounded(elastic_timer):
            assert elastic_timer.budget is None
            assert elastic_timer.remaining() == float("inf")

        def test_step_expires(elastic_timer):
            with elastic_timer.step("slow-step", 0.3):
                time.sleep(30)

        def test_after():
            pass
        """
    )
    session = run(pytester, "-s")
    session.assert_clean()
    session.result.assert_outcomes(passed=4, failed=1)
    assert f"server pid {session.watchdog_pid}" in session.stdout
    session.assert_expired("test_step_expires", "test_step_expires::call/slow-step", 0.3)


# -- bad messages from inside the session ---------------------------------------------
GARBAGE_SENDER = """
import os
import socket
import time
import pytest

def test_send_garbage():
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(os.environ["PYTEST_ELASTIC_TIMER"])
    for data in {payloads!r}:
        sock.send(data)
    sock.close()

@pytest.mark.expires(0.3)
def test_hang_after_garbage():
    time.sleep(5)
"""


def test_garbage_is_dropped_and_counted(pytester: pytest.Pytester) -> None:
    payloads = [b"not json", b'{"op": "hello"}', b'["wake", {"at": 1}]', b"\xff" * 100]
    pytester.makepyfile(test_garbage=GARBAGE_SENDER.format(payloads=payloads))
    session = run(pytester)
    session.assert_clean()
    session.result.assert_outcomes(passed=1, failed=1)
    session.assert_expired("test_hang_after_garbage", "test_hang_after_garbage::call", 0.3)
    assert session.report["session"]["dropped_messages"] >= len(payloads)


def test_deeply_nested_message_does_not_kill_the_watchdog(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_garbage=GARBAGE_SENDER.format(payloads=[b"[" * 100_000]))
    session = run(pytester)
    assert "INTERNALERROR" not in session.text
    assert "RecursionError" not in session.stderr
    session.assert_clean()
    session.result.assert_outcomes(passed=1, failed=1)
    session.assert_expired("test_hang_after_garbage", "test_hang_after_garbage::call", 0.3)
    assert session.report["session"]["dropped_messages"] >= 1


def test_huge_budget_does_not_kill_the_watchdog(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_huge="""
        import time
        import psutil
        import pytest
        import pytest_elastic_timer as et

        def test_huge(elastic_timer_server):
            with et.expires(1e7, scope="huge"):
                time.sleep(0.5)
            watchdog = psutil.Process(elastic_timer_server.pid)
            assert watchdog.status() != psutil.STATUS_ZOMBIE

        @pytest.mark.expires(0.3)
        def test_later():
            time.sleep(5)
        """
    )
    session = run(pytester)
    assert "INTERNALERROR" not in session.text
    assert "OverflowError" not in session.stderr
    session.assert_clean()
    session.result.assert_outcomes(passed=1, failed=1)
    session.assert_expired("test_later", "test_later::call", 0.3)


def test_parent_markers_and_the_default_budget_reach_every_test(
    pytester: pytest.Pytester,
) -> None:
    """Budgets from a module's pytestmark, a class marker, a test's own marker (which
    wins) and --expires, as the watchdog's records name them."""
    pytester.makepyfile(
        test_budgets="""
        import time
        import pytest

        pytestmark = pytest.mark.expires(0.4)

        def test_module():
            time.sleep(30)

        @pytest.mark.expires(0.6)
        class TestGroup:
            def test_class(self):
                time.sleep(30)

            @pytest.mark.expires(0.3)
            def test_own(self):
                time.sleep(30)
        """,
        test_default="""
        import time

        def test_default():
            time.sleep(30)
        """,
    )
    session = run(pytester, "--expires=0.5")
    session.assert_clean()
    session.result.assert_outcomes(failed=4)
    assert session.report is not None
    budgets = {r["nodeid"]: (r["scope"], r["budget"]) for r in session.report["expired"]}
    assert budgets == {
        "test_budgets.py::test_module": ("test_module::call", 0.4),
        "test_budgets.py::TestGroup::test_class": ("test_class::call", 0.6),
        "test_budgets.py::TestGroup::test_own": ("test_own::call", 0.3),
        "test_default.py::test_default": ("test_default::call", 0.5),
    }
    for record in session.report["expired"]:  # placed where the test is defined
        assert record["file"].endswith(record["nodeid"].split("::")[0])
        assert record["line"] > 0


@pytest.mark.parametrize("workers", [0, 2])
def test_markers_added_while_collection_ends_set_budgets(
    pytester: pytest.Pytester, workers: int
) -> None:
    """Markers that a conftest adds in ``pytest_collection_modifyitems`` count: on a
    test, on its module (read by every test of it), a bad one (that test's error), and
    one on a test deselected afterwards (nothing)."""
    pytester.makeconftest(
        """
        import pytest

        def pytest_collection_modifyitems(config, items):
            for item in items:
                if item.name == "test_added":
                    item.add_marker(pytest.mark.expires(0.4))
                elif item.name == "test_bad":
                    item.add_marker(pytest.mark.expires("soon"))
                elif item.name == "test_first_of_module":
                    item.parent.add_marker(pytest.mark.expires(0.5))
            items[:] = [item for item in items if item.name != "test_deselected"]
        """
    )
    pytester.makepyfile(
        test_added="""
        import time

        def test_added():
            time.sleep(30)

        def test_bad():
            pass

        def test_deselected():
            pass
        """,
        test_module="""
        import time

        def test_first_of_module():
            time.sleep(30)

        def test_second_of_module():
            time.sleep(30)
        """,
    )
    xdist = ["-p", "xdist", "-n", str(workers)] if workers else []
    session = run(pytester, *xdist)
    session.assert_clean()
    session.result.assert_outcomes(failed=3, errors=1)
    session.assert_expired("test_added", "test_added::call", 0.4)
    session.assert_expired("test_first_of_module", "test_first_of_module::call", 0.5)
    session.assert_expired("test_second_of_module", "test_second_of_module::call", 0.5)
    assert "test_added.py::test_bad: @pytest.mark.expires('soon'): seconds" in session.text


def test_an_expiry_after_an_ordinary_failure_still_reads_timeout(
    pytester: pytest.Pytester,
) -> None:
    """Report hooks are registered at the first failure: the first one is a plain
    assertion, the second an expiry, the third passes."""
    pytester.makepyfile(
        test_order="""
        import time
        import pytest

        def test_a_fails():
            assert 1 == 2

        @pytest.mark.expires(0.3)
        def test_b_hangs():
            time.sleep(30)

        def test_c_passes():
            pass
        """
    )
    session = run(pytester, "-v", "-p", "no:randomly")
    session.assert_clean()
    session.result.assert_outcomes(failed=2, passed=1)
    lines = session.lines
    assert any(re.search(r"test_a_fails FAILED", line) for line in lines)
    assert any(re.search(r"test_b_hangs TIMEOUT", line) for line in lines)
    assert any(line.startswith("TIMEOUT test_order.py::test_b_hangs") for line in lines)
    assert any(line.startswith("FAILED test_order.py::test_a_fails") for line in lines)


# -- the plugin's own hooks: an extension point ---------------------------------------
HOOKS_CONFTEST = """
def pytest_elastic_timer_expired(config, report, records):
    config.seen = getattr(config, "seen", []) + [(report.nodeid, report.when, records[0].scope)]


def pytest_elastic_timer_terminal_summary(config, terminalreporter, records, session):
    for nodeid, when, scope in getattr(config, "seen", []):
        terminalreporter.write_line(f"EXPIRED {nodeid} {when} {scope}")
    terminalreporter.write_line(f"SUMMARY {len(records)} {sorted(session.expired)}")


def pytest_elastic_timer_session_end(config, records, session):
    budget = session.budget_of("test_hooks.py::test_stuck", "call")
    return {"from_conftest": [r.scope for r in records], "budget_at_end": budget}
"""
HOOKS_TESTS = """
import time

import pytest


@pytest.mark.expires(0.3)
def test_stuck():
    time.sleep(30)


def test_passes():
    pass
"""


def test_a_conftest_implements_the_plugins_hooks(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(HOOKS_CONFTEST)
    pytester.makepyfile(test_hooks=HOOKS_TESTS)
    session = run(pytester)
    session.assert_clean()
    session.result.assert_outcomes(failed=1, passed=1)
    assert "EXPIRED test_hooks.py::test_stuck call test_stuck::call" in session.lines
    assert "SUMMARY 1 ['test_hooks.py::test_stuck']" in session.lines
    assert session.report is not None
    assert session.report["session"]["from_conftest"] == ["test_stuck::call"]
    # The tests' budgets, as the summary hook is given them (it was None here).
    assert session.report["session"]["budget_at_end"] == 0.3


MODULES_CONFTEST = """
import sys


def pytest_unconfigure(config):
    loaded = sorted(m for m in sys.modules if m.startswith("pytest_elastic_timer.ci."))
    print("CI MODULES", " ".join(loaded))
"""


def test_a_session_imports_only_the_ci_outputs_it_uses(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GITHUB_ACTIONS", raising=False)  # this suite's own CI
    pytester.makeconftest(MODULES_CONFTEST)
    pytester.makepyfile(test_one="def test_one():\n    pass\n")
    plain = run(pytester, report=False)
    plain.result.assert_outcomes(passed=1)
    assert "CI MODULES " in plain.lines  # none: no budget, no report
    ci = "pytest_elastic_timer.ci"
    budget = run(pytester, "--expires=30", report=False)
    budget.result.assert_outcomes(passed=1)
    assert f"CI MODULES {ci}.slow" in budget.lines  # SLOW lines need a budget
    junit = run(pytester, "--junitxml=junit.xml", report=False)
    junit.result.assert_outcomes(passed=1)
    assert f"CI MODULES {ci}.junit {ci}.junit_fallback" in junit.lines


FAILURE_MODULES = (
    "pytest_elastic_timer.core.records",
    "pytest_elastic_timer.core.stacks",
    "pytest_elastic_timer.core.hostlink",
    "pytest_elastic_timer.plugin.expiry",
    "pytest_elastic_timer.plugin.xdist_support",
    "pytest_elastic_timer.plugin.remote_hosts",
)
FAILURE_MODULES_CONFTEST = f"""
import sys

FACTS = "pytest_elastic_timer.plugin.session_facts"
HOOKSPECS = "pytest_elastic_timer.plugin.hookspecs"
at_start = []


def pytest_sessionstart(session):
    # SessionFacts, a dataclass, defined anywhere yet?
    at_start.append(FACTS in sys.modules or "SessionFacts" in vars(sys.modules[HOOKSPECS]))


def pytest_unconfigure(config):
    loaded = [m for m in {FAILURE_MODULES!r} if m in sys.modules]
    print("FAILURE MODULES", " ".join(loaded))
    print("SESSION FACTS AT START", at_start)
    print("SESSION FACTS MADE", FACTS in sys.modules)  # after the terminal summary
"""


def test_a_passing_session_loads_no_failure_machinery(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The modules that read records and make failed reports load with the first
    # failure or expiry, and the xdist ones only where xdist runs the tests.
    monkeypatch.delenv("GITHUB_ACTIONS", raising=False)  # its output implements hooks
    pytester.makeconftest(FAILURE_MODULES_CONFTEST)
    pytester.makepyfile(
        test_one="import time\n\ndef test_one():\n    time.sleep(0.3)\n",
        test_fails="def test_fails():\n    assert False\n",
    )
    # Every plugin of this environment loaded, pytest-xdist too (not used: no -n), but
    # pyfakefs: where it is loaded, the plugin loads its report machinery up front.
    passing = run(pytester, "test_one.py", "-p", "no:fakefs", report=False, lean=False)
    passing.result.assert_outcomes(passed=1)
    assert "FAILURE MODULES " in passing.lines  # none, though the watchdog answered
    # Nor a dataclass defined at start: the hooks' SessionFacts is made at the end, and
    # only for a session with something that implements the hooks (here: nothing).
    assert "SESSION FACTS AT START [False]" in passing.lines
    assert "SESSION FACTS MADE False" in passing.lines
    # A budget brings the slow phases' output at the end, which reads no records.
    budgeted = run(pytester, "test_one.py", "--expires=30", report=False)
    budgeted.result.assert_outcomes(passed=1)
    assert "FAILURE MODULES " in budgeted.lines
    failing = run(pytester, "test_fails.py", report=False)
    failing.result.assert_outcomes(failed=1)
    loaded = next(line for line in failing.lines if line.startswith("FAILURE MODULES"))
    assert "pytest_elastic_timer.plugin.expiry" in loaded.split()
    assert "pytest_elastic_timer.core.hostlink" not in loaded.split()


def test_an_xdist_controller_loads_the_failure_machinery_at_a_failed_report(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each report of the workers goes through one plain hook of the controller, which
    # loads the failed-report plugins only once a failed report arrives; the first
    # one is still shown by the scope that expired (TIMEOUT).
    monkeypatch.delenv("GITHUB_ACTIONS", raising=False)
    pytester.makeconftest(FAILURE_MODULES_CONFTEST)
    pytester.makepyfile(
        test_one="def test_one():\n    pass\n\ndef test_two():\n    pass\n",
        test_over=(
            "import time\n\nimport pytest\n\n\n@pytest.mark.expires(0.3)\n"
            "def test_over():\n    time.sleep(5)\n"
        ),
    )
    passing = run(pytester, "test_one.py", "-p", "xdist", "-n", "2", report=False)
    passing.result.assert_outcomes(passed=2)
    loaded = next(line for line in passing.lines if line.startswith("FAILURE MODULES"))
    assert "pytest_elastic_timer.plugin.xdist_support" in loaded.split(), loaded
    assert "pytest_elastic_timer.plugin.expiry" not in loaded.split(), loaded
    over = run(pytester, "-p", "xdist", "-n", "2", "-rA", report=False)
    over.result.assert_outcomes(passed=2, failed=1)
    assert any(line.startswith("TIMEOUT test_over.py::test_over - ") for line in over.lines)
    loaded = next(line for line in over.lines if line.startswith("FAILURE MODULES"))
    assert "pytest_elastic_timer.plugin.expiry" in loaded.split(), loaded


INNER_SESSIONS = """
import sys

pytest_plugins = ["pytester"]
EXPIRY = "pytest_elastic_timer.plugin.expiry"


def test_inner_sessions_that_fail(pytester):
    pytester.makepyfile(test_fails="def test_fails():\\n    assert False\\n")
    for _ in range(2):
        pytester.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(failed=1)
    # pytester dropped what an inner session imported first: still here, it was
    # loaded by this session, once.
    assert EXPIRY in sys.modules
"""


def test_a_suite_that_runs_sessions_in_process_loads_the_failure_machinery_once(
    pytester: pytest.Pytester,
) -> None:
    """Each inner session with a failure would load the failed-report machinery anew
    (pytester drops the modules an inner session imported first): a session whose
    tests ask for pytester loads it after collection."""
    pytester.makepyfile(test_inner=INNER_SESSIONS)
    session = run(pytester, "-p", "pytester", report=False)
    session.result.assert_outcomes(passed=1)


RAISED_BEFORE_LOADING = """
import sys
import time

import pytest
import pytest_elastic_timer as et

MACHINERY = "pytest_elastic_timer.plugin.expiry"

@pytest.fixture
def stuck():
    with et.expires(0.3, scope="fixture"):
        time.sleep(30)

def test_call():
    try:
        with et.expires(0.3, scope="hang"):
            time.sleep(30)
    except et.ScopeExpired:
        print("LOADED AT THE RAISE:", MACHINERY in sys.modules)
        raise

def test_setup(stuck):
    pass
"""


def test_an_expiry_is_raised_before_the_report_machinery_loads(pytester: pytest.Pytester) -> None:
    # ScopeExpired is raised from the interrupt's signal handler, and loading the
    # modules that make failed reports there held it back by milliseconds at a
    # process's first expiry: they load once the phase has failed, or at its report
    # (a setup that no wrapper of the plugin runs: no setup budget).
    pytester.makepyfile(test_hang=RAISED_BEFORE_LOADING)
    session = run(pytester)
    session.assert_clean()
    session.result.assert_outcomes(failed=1, errors=1)
    assert "LOADED AT THE RAISE: False" in session.lines
    for name in ("test_call", "test_setup"):
        assert re.search(rf"^TIMEOUT test_hang.py::{name}\b", session.stdout, re.M), name
    assert session.record("test_call::call/hang")["action"] == "interrupted"
    assert session.record("test_setup::setup/fixture")["action"] == "interrupted"


FAILED_INSIDE_THE_CALL = """
import time
import unittest

import pytest
import pytest_elastic_timer as et

class T(unittest.TestCase):
    def test_hang(self):
        with et.expires(0.3, scope="hang"):
            time.sleep(30)

@pytest.mark.skipif(pytest.version_tuple < (9,), reason="subtests are built in from pytest 9")
def test_sub(subtests):
    with subtests.test(msg="one"):
        with et.expires(0.3, scope="sub"):
            time.sleep(30)

@pytest.mark.skipif(pytest.version_tuple < (9,), reason="subtests are built in from pytest 9")
def test_asked(request):
    subtests = request.getfixturevalue("subtests")
    with subtests.test(msg="two"):
        with et.expires(0.3, scope="asked"):
            time.sleep(30)
"""


def test_an_expiry_whose_failure_is_reported_inside_the_call_reads_timeout(
    pytester: pytest.Pytester,
) -> None:
    # unittest keeps a test's error, which pytest reads when it makes the report, and a
    # subtest's report is made inside the call: neither failure comes out of the call
    # phase's wrapper, and the report machinery is loaded at the report itself.
    pytester.makepyfile(test_ut=FAILED_INSIDE_THE_CALL)
    session = run(pytester)
    session.assert_clean()
    assert re.search(
        r"^TIMEOUT test_ut.py::T::test_hang - scope 'test_hang::call/hang'", session.stdout, re.M
    ), session.stdout
    if pytest.version_tuple >= (9,):
        for name, msg in (("sub", "one"), ("asked", "two")):
            subfailed = (
                rf"^SUBFAILED\[{msg}\] test_ut.py::test_{name} - scope 'test_{name}::call/{name}'"
            )
            assert re.search(subfailed, session.stdout, re.M), session.stdout


HELD_WHILE_LOADING_CONFTEST = """
import time
from importlib.machinery import PathFinder

import pytest
import pytest_elastic_timer as et

_find_spec = PathFinder.find_spec


def slow_find_spec(name, path=None, target=None):
    # The report machinery takes a while to load, and the scope a conftest's hook
    # wrapper entered around the whole test expires meanwhile. (Python's path finder,
    # which the plugin imports its own modules with.)
    if name == "pytest_elastic_timer.plugin.expiry":
        print("LOADING SLOWLY")
        try:
            time.sleep(0.6)
        except et.ScopeExpired as exc:
            print("RAISED WHILE LOADING", exc.scope)
            raise
    return _find_spec(name, path, target)

PathFinder.find_spec = slow_find_spec

@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item):
    try:
        with et.expires(0.6, scope="protocol"):
            return (yield)
    except et.ScopeExpired:
        return True  # wherever it lands after the loading, the session goes on
"""


def test_an_interrupt_while_the_wrapper_loads_the_report_machinery_is_not_lost(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeconftest(HELD_WHILE_LOADING_CONFTEST)
    pytester.makepyfile(
        test_hang="import time\nimport pytest_elastic_timer as et\n\n"
        "def test_hang():\n    with et.expires(0.3, scope='hang'):\n        time.sleep(30)\n"
    )
    # The wrapper of the call loads the report machinery once the test has failed; the
    # interrupt of the scope around the test waits for it, then comes again.
    session = run(pytester, "-s")
    session.assert_clean()
    assert "LOADING SLOWLY" in session.stdout, session.stdout
    assert "RAISED WHILE LOADING" not in session.stdout, session.stdout
    assert session.record("protocol/hang")["action"] == "interrupted"
    assert session.record("protocol")["action"] == "interrupted"


FIRST_LOAD_FAILS_CONFTEST = """
import os
from importlib.machinery import PathFinder

_find_spec = PathFinder.find_spec


def fails_once_find_spec(name, path=None, target=None):
    # The report modules fail to load the first time they are asked for (as an import
    # interrupted by a signal can fail), then load. (Python's path finder, which the
    # plugin imports its own modules with.)
    if name == "pytest_elastic_timer.plugin.expiry" and not os.path.exists("failed-once"):
        open("failed-once", "w").close()
        raise ImportError("not now")
    return _find_spec(name, path, target)

PathFinder.find_spec = fails_once_find_spec
"""


MACHINERY_FAILS_IN = {
    "call": """
        def test_hang():
            with et.expires(0.3, scope="hang"):
                time.sleep(30)
        """,
    # A setup budget's scope.
    "setup": """
        @pytest.fixture
        def stuck():
            time.sleep(30)

        @pytest.mark.expires(30, setup=0.3)
        def test_hang(stuck):
            pass
        """,
    # A fixture's own scope, in a teardown without a budget.
    "teardown": """
        @pytest.fixture
        def stuck():
            yield
            with et.expires(0.3, scope="hang"):
                time.sleep(30)

        def test_hang(stuck):
            pass
        """,
}


@pytest.mark.parametrize("phase", list(MACHINERY_FAILS_IN))
def test_an_expiry_whose_report_machinery_fails_to_load_is_still_an_expiry(
    pytester: pytest.Pytester, phase: str
) -> None:
    # The phase's wrapper loads the report machinery once the phase has failed: that
    # failing must not replace the ScopeExpired nor keep the watchdog from hearing of
    # it, and a second try loads it before pytest makes the report.
    pytester.makeconftest(FIRST_LOAD_FAILS_CONFTEST)
    source = "import time\nimport pytest\nimport pytest_elastic_timer as et\n"
    pytester.makepyfile(test_hang=source + textwrap.dedent(MACHINERY_FAILS_IN[phase]))
    session = run(pytester)
    session.assert_clean()
    if phase == "call":
        session.result.assert_outcomes(failed=1)
    else:
        session.result.assert_outcomes(passed=int(phase == "teardown"), errors=1)
    assert re.search(r"^TIMEOUT test_hang.py::test_hang\b", session.stdout, re.M), session.stdout
    assert "ImportError" not in session.text
    assert (pytester.path / "failed-once").exists()  # the first load did fail
    scope = "test_hang::setup" if phase == "setup" else f"test_hang::{phase}/hang"
    assert session.record(scope)["action"] == "interrupted"


SLOW_LISTENER_TEST = """
import os
import time

import pytest
import pytest_elastic_timer as et
from pytest_elastic_timer.scope import scopes

def test_nested():
    outer_due = []

    def busy(depth):
        # Deep below the listener, as an import is: still busy when the outer scope is
        # due, and its interrupt comes meanwhile.
        if depth:
            return busy(depth - 1)
        while time.monotonic() < outer_due[0]:
            pass
        os.kill(os.getpid(), scopes.process_state().interrupt_sig)
        end = time.monotonic() + 0.05
        while time.monotonic() < end:
            pass

    def slow_listener():
        if not outer_due:  # the inner scope's expiry
            # The outer scope falls due while the listener runs, however late a loaded
            # machine entered the inner scope or interrupted it.
            outer.reschedule(0.1)
            outer_due.append(outer.deadline + 0.01)
            busy(10)

    with pytest.raises(et.ScopeExpired, match="outer'"):
        with et.expires(30, scope="outer") as outer:
            scopes.expiry_listeners.append(slow_listener)
            try:
                with et.expires(0.1, scope="inner"):
                    time.sleep(5)
            except et.ScopeExpired as exc:
                # Due before the inner one's exception left the handler, the outer
                # scope is credited in its place (the outermost expired one).
                if exc.scope == outer.path:
                    raise
            finally:
                scopes.expiry_listeners.remove(slow_listener)
            time.sleep(5)
"""


def run_one_passing_test(pytester: pytest.Pytester, **files: str) -> Session:
    """The inner session of the test file(s) ``files``: clean, and its one test passed."""
    pytester.makepyfile(**files)
    session = run(pytester)
    session.assert_clean()
    session.result.assert_outcomes(passed=1)
    return session


def test_an_interrupt_that_comes_while_the_expiry_listeners_run_is_not_lost(
    pytester: pytest.Pytester,
) -> None:
    # Raised inside a listener, the enclosing scope's ScopeExpired would end in the
    # listener's error handling: the interrupt is sent again once they are done.
    session = run_one_passing_test(pytester, test_nested=SLOW_LISTENER_TEST)
    assert session.record("test_nested::call/outer/inner")["action"] == "interrupted"
    # Interrupted well inside its grace (2s): not by the escalation at its end. (The
    # whole session's time would count the interpreters' start-up too.)
    outer = session.record("test_nested::call/outer")
    assert outer["action"] == "interrupted"
    assert outer["elapsed"] < outer["budget"] + 1, session.stdout


PENDING_SIGNAL_TEST = """
import signal
import threading
import time

import pytest
import pytest_elastic_timer as et
from pytest_elastic_timer.scope import scopes

def test_pending(monkeypatch):
    main = threading.main_thread().ident
    # A thread that takes the interrupt leaves the main thread as one that got it on its
    # way into a blocking call does: its handler due, and the call blocking on.
    taker = threading.Thread(target=threading.Event().wait, args=(30,), daemon=True)
    taker.start()
    asleep = threading.Event()
    diverted = []
    pthread_kill = signal.pthread_kill

    def divert_once(thread, signum):
        if thread == main and not diverted and main not in scopes._notifying:
            asleep.wait(10)
            time.sleep(0.1)  # well inside its sleep
            diverted.append(signum)
            thread = taker.ident
        pthread_kill(thread, signum)

    monkeypatch.setattr(signal, "pthread_kill", divert_once)
    with pytest.raises(et.ScopeExpired, match="step"):
        with et.expires(0.2, scope="step"):
            with scopes.holding_interrupts():
                time.sleep(0.5)  # the interrupt comes meanwhile: it is sent again
            asleep.set()
            time.sleep(10)
    assert diverted
"""


def test_an_interrupt_that_only_marks_the_handler_due_is_sent_again(
    pytester: pytest.Pytester,
) -> None:
    # The package's thread that interrupts the main thread sends the signal again until
    # the handler has run: the one that came just before a blocking call did not break
    # it, and the scope was terminated at the end of its grace.
    session = run_one_passing_test(pytester, test_pending=PENDING_SIGNAL_TEST)
    assert session.record("test_pending::call/step")["action"] == "interrupted"


# -- start-up: nobody waits for the watchdog ---------------------------------------------
NO_WATCHDOG_SITE = """
import os, sys
if "pytest_elastic_timer.watchdog" in sys.orig_argv:
    os._exit(3)  # a watchdog that never comes up (a broken install, say)
"""


def test_a_watchdog_that_never_starts_leaves_scopes_in_process(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plugin does not wait for its watchdog to come up. One that never does
    closes the socket the plugin made for it by exiting: the standby thread of the
    session's first deadline reads end-of-file instead of the watchdog's answer, and
    the scope is enforced
    in-process, with the warning, and the session fails for the lost guarantees."""
    _watchdog_site(pytester, monkeypatch, NO_WATCHDOG_SITE)
    pytester.makepyfile(
        test_hang="""
        import time
        import pytest_elastic_timer as et

        def test_hang():
            with et.expires(0.5, scope="hang"):
                time.sleep(30)
        """
    )
    session = run(pytester, report=False)
    session.result.assert_outcomes(failed=1)
    assert session.seconds < 25
    assert "scope 'test_hang::call/hang' expired" in session.stdout
    assert "enforcing scopes in-process from now on" in session.text
    assert "elastic-timer: watchdog lost" in session.stdout
    assert session.result.ret == pytest.ExitCode.TESTS_FAILED


GATED_WATCHDOG_SITE = """
import os, sys, time
if "pytest_elastic_timer.watchdog" in sys.orig_argv:
    gate = os.environ["WATCHDOG_GATE"]
    give_up = time.monotonic() + 60
    while not os.path.exists(gate) and time.monotonic() < give_up:
        time.sleep(0.01)  # a watchdog that starts as late as the test says
"""


def _watchdog_site(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, source: str) -> None:
    """Inner sessions' processes run ``source`` as their sitecustomize (it looks at
    ``sys.orig_argv`` to act in the watchdog alone)."""
    site = pytester.mkdir("site")
    (site / "sitecustomize.py").write_text(source)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))


def _gated_watchdog(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The inner session's watchdog comes up only once the returned file exists."""
    _watchdog_site(pytester, monkeypatch, GATED_WATCHDOG_SITE)
    gate = pytester.path / "gate"
    monkeypatch.setenv("WATCHDOG_GATE", str(gate))
    return gate


def _watchdog_pid(lines: list[str]) -> int:
    """The watchdog's pid, from the one report header among ``lines``."""
    (pid,) = [int(m.group(1)) for m in map(HEADER.match, lines) if m]
    return pid


def test_a_session_never_waits_for_its_watchdog_to_come_up(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A watchdog still starting holds nothing up: the session's tests, their scopes
    and its end all pass while it is not up, and once it is, it reads the stop the
    session left it and ends."""
    gate = _gated_watchdog(pytester, monkeypatch)
    pytester.makepyfile(
        test_quick="""
        import pytest
        import pytest_elastic_timer as et

        @pytest.mark.expires(30)
        def test_quick():
            with et.expires(30, scope="step"):
                pass
        """
    )
    result = pytester.runpytest_subprocess(*LEAN)
    result.assert_outcomes(passed=1)
    watchdog = _watchdog_pid(result.outlines)
    assert not gate.exists()  # the whole session ran before the watchdog came up
    assert psutil.pid_exists(watchdog)
    gate.touch()
    assert wait_gone(watchdog, 30.0), "the watchdog did not end once it came up"


def test_a_watchdog_that_comes_up_late_enforces_earlier_deadlines(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scope entered before the watchdog came up is in the table it reads once up:
    an overrun is interrupted and reported like any other."""
    gate = _gated_watchdog(pytester, monkeypatch)
    pytester.makepyfile(
        test_hang=f"""
        import time
        import pytest_elastic_timer as et

        def test_hang():
            with et.expires(0.5, scope="hang"):
                open({str(gate)!r}, "w").close()
                time.sleep(30)
        """
    )
    session = run(pytester)
    session.result.assert_outcomes(failed=1)
    session.assert_expired("test_hang", "test_hang::call/hang", 0.5)
    assert "in-process" not in session.text
    session.assert_clean()


def test_a_deadline_that_passes_before_the_watchdog_is_up_is_interrupted_on_time(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Until the watchdog answers, the thread that waits for its answer stands in for
    it: a scope that expires meanwhile is interrupted at its deadline, not when the
    watchdog comes up (here: only after the scope ended), and the watchdog, once up,
    records it. The scope before it ended in time: the hanging one, later than the
    deadline the first promised, says nothing when entered, and is enforced all the
    same."""
    gate = _gated_watchdog(pytester, monkeypatch)
    pytester.makepyfile(
        test_hang=f"""
        import time
        import pytest_elastic_timer as et

        def test_hang():
            with et.expires(0.2, scope="quick"):
                pass
            time.sleep(0.05)
            scope = et.expires(0.3, scope="hang")
            try:
                with scope:
                    time.sleep(30)
            finally:
                print(f"LATE {{time.monotonic() - scope.deadline:.3f}}")
                open({str(gate)!r}, "w").close()  # the watchdog comes up now
        """
    )
    session = run(pytester, "-s")
    session.result.assert_outcomes(failed=1)
    late = re.search(r"LATE (\S+)", session.stdout)
    assert late is not None and float(late.group(1)) < 5, session.stdout
    session.assert_expired("test_hang", "test_hang::call/hang", 0.3)
    assert "in-process" not in session.text
    session.assert_clean()


def test_a_deadline_before_the_watchdog_is_up_without_descriptors_to_spare(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process that cannot make the descriptors of the thread that waits for the
    watchdog's answer (it has none to spare) waits for the answer itself: the deadline
    that asked for it is still told, enforced once the watchdog is up, and recorded."""
    gate = _gated_watchdog(pytester, monkeypatch)
    pytester.makepyfile(
        test_hang=f"""
        import os
        import resource
        import signal
        import threading
        import time
        import pytest_elastic_timer as et

        def test_hang():
            ready = {str(gate)!r} + ".ready"
            open(ready, "w").close()
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            lowest_free = os.dup(0)
            os.close(lowest_free)

            def open_up():
                # The interrupt is for the main thread: a thread that takes it while the
                # main one sleeps holds it back until the sleep ends.
                signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
                os.rename(ready, {str(gate)!r})  # the watchdog comes up now

            resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))
            threading.Timer(0.5, open_up).start()
            with et.expires(0.3, scope="hang"):
                time.sleep(30)
        """
    )
    session = run(pytester, "-s")
    session.result.assert_outcomes(failed=1)
    session.assert_expired("test_hang", "test_hang::call/hang", 0.3)
    assert "Error" not in session.stdout.split("ScopeExpired")[0], session.stdout
    session.assert_clean()


def test_short_scopes_before_the_watchdog_is_up_do_not_fill_its_connection(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before the watchdog answers, a process tells it of a deadline only when it is
    earlier than those it told already: a loop of short scopes while the watchdog is
    slow to come up does not fill the connection (a full one blocks the next scope
    until the watchdog reads)."""
    gate = _gated_watchdog(pytester, monkeypatch)
    pytester.makepyfile(
        test_loop=f"""
        import time
        import pytest_elastic_timer as et

        def test_loop():
            # Each deadline passes before the next scope: without the rule, each scope
            # would send one, and some 300 fill the connection.
            end = time.monotonic() + 3
            entered = 0
            try:
                while time.monotonic() < end:
                    try:
                        with et.expires(0.002):
                            pass
                    except et.ScopeExpired:
                        pass  # a loaded machine can hold a process up for 2 ms
                    time.sleep(0.003)
                    entered += 1
            finally:
                open({str(gate)!r}, "w").close()  # the watchdog comes up now
            assert entered > 400
        """
    )
    session = run(pytester, timeout=30)
    session.result.assert_outcomes(passed=1)
    assert "in-process" not in session.text
    session.assert_clean()


def test_waiting_for_the_watchdogs_answer_leaves_the_connection_blocking(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Waiting for the watchdog's answer (and for the answer to a request) set a
    timeout on the connection, which makes its file description non-blocking for every
    thread: the standby thread, sending meanwhile what had waited for the watchdog to
    come up, got EAGAIN from its sendall, the process lost the watchdog and the
    expiries it was sending were never recorded (27 of 600 in one loaded run)."""
    gate = _gated_watchdog(pytester, monkeypatch)
    pytester.makepyfile(
        test_wait=f"""
        import fcntl
        import os
        import threading
        import time

        from pytest_elastic_timer.scope import scopes

        def test_wait():
            state = scopes.process_state()
            fd = state.sock.fileno()
            non_blocking = []
            waiting = threading.Event()

            def watch():
                while not waiting.is_set():
                    non_blocking.append(bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK))
                    time.sleep(0.001)

            watcher = threading.Thread(target=watch)
            watcher.start()
            opener = threading.Timer(0.5, lambda: open({str(gate)!r}, "w").close())
            opener.start()
            try:
                state.welcome()  # the watchdog comes up in half a second
                answer = state.request("sync")
            finally:
                waiting.set()
                watcher.join()
                opener.join()
            assert state.welcomed and state.sock is not None
            assert "pending" in answer, answer
            assert non_blocking and not any(non_blocking), sum(non_blocking)
        """
    )
    session = run(pytester, timeout=60)
    session.assert_clean()
    session.result.assert_outcomes(passed=1)
    assert "lost the watchdog" not in session.text, session.text


def test_many_expiries_before_the_watchdog_is_up_block_nothing(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every expiry tells the watchdog where the owner was. Before the watchdog reads
    its connection, hundreds of them filled it, and the next one blocked the process in
    its signal handler until the watchdog read, which it never did: the test was to open
    its gate afterwards (on a loaded machine, even 2 ms scopes expire so). They wait in
    the process and reach the watchdog once it answers: every one is recorded."""
    gate = _gated_watchdog(pytester, monkeypatch)
    pytester.makepyfile(
        test_many=f"""
        import time
        import pytest_elastic_timer as et

        def test_many():
            expired = 0
            try:
                for _ in range(600):
                    try:
                        with et.expires(0.001, scope="short"):
                            while True:
                                time.sleep(0.001)
                    except et.ScopeExpired:
                        expired += 1
            finally:
                open({str(gate)!r}, "w").close()  # the watchdog comes up now
            assert expired == 600
        """
    )
    session = run(pytester, timeout=60)
    session.result.assert_outcomes(passed=1)
    assert session.report is not None
    assert len(session.report["expired"]) == 600, session.text[-3000:]
    assert session.report["session"]["dropped_messages"] == 0
    session.assert_clean()


def test_an_inner_session_ends_a_watchdog_that_is_not_up_yet(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session run in-process by a test leaves no child behind, so it cannot just
    leave its watchdog to finish; one that has not come up yet (it never answered) has
    served nobody, and is ended and reaped at once instead of waited for (here it would
    never come up: the wait would last until the stop's time-out)."""
    gate = _gated_watchdog(pytester, monkeypatch)
    pytester.makepyfile(test_one="def test_one():\n    pass\n")
    before = {p.pid for p in psutil.Process().children()}
    started = time.monotonic()
    result = pytester.runpytest_inprocess(*LEAN)
    seconds = time.monotonic() - started
    result.assert_outcomes(passed=1)
    assert not gate.exists()
    assert seconds < launcher.STOP_TIMEOUT / 2, "the session waited for its watchdog"
    assert {p.pid for p in psutil.Process().children()} == before  # ended and reaped


EARLY_FILE_TIMER_CLIENT = """
import json, os, sys, time

path = os.environ["TORCHELASTIC_TIMER_FILE"]
fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # as torch's FileTimerClient opens it
request = {"version": 1, "pid": os.getpid(), "scope_id": "early.py#3",
           "expiration_time": time.time() + 0.5, "signal": 9}
os.write(fd, (json.dumps(request) + "\\n").encode())
os.close(fd)
open(sys.argv[1], "w").close()
time.sleep(60)
"""


def test_a_torch_file_timer_client_needs_no_watchdog_up_yet(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The torch file-timer FIFO is there, with a reader, from the session's start:
    a FileTimerClient opens it and sends its request before the watchdog runs (torch
    raises BrokenPipeError where nobody reads), and the watchdog, once up, enforces it."""
    gate = _gated_watchdog(pytester, monkeypatch)
    pytester.makepyfile(
        test_early=f"""
        import os, subprocess, sys

        CLIENT = {EARLY_FILE_TIMER_CLIENT!r}

        def test_early_request():
            child = subprocess.Popen([sys.executable, "-c", CLIENT, "sent"])
            while child.poll() is None and not os.path.exists("sent"):
                pass
            assert os.path.exists("sent"), child.wait()
            open({str(gate)!r}, "w").close()
            assert child.wait(timeout=60) < 0  # ended by the watchdog
        """
    )
    session = run(pytester)
    session.result.assert_outcomes(passed=1)
    session.assert_clean()


STRAY_IGNORING_SIGTERM = """
import subprocess
import sys

CODE = '''
import signal, time
import pytest_elastic_timer as et

signal.signal(signal.SIGTERM, signal.SIG_IGN)
with et.expires(600, scope="stray"):  # a process of the session: the watchdog ends it
    print("in", flush=True)
    time.sleep(60)
'''


def test_leaves_a_stray():
    stray = subprocess.Popen(
        [sys.executable, "-c", CODE], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    assert stray.stdout.readline() == b"in\\n"
    stray.stdout.close()
    with open("stray.pid", "w") as f:
        f.write(str(stray.pid))
"""


def test_a_piped_session_ends_while_its_watchdog_still_works(pytester: pytest.Pytester) -> None:
    """pytest's output read through a pipe (a shell, a CI step) ends with pytest: the
    watchdog, which pytest does not wait for, lets go of it on the stop command, though
    it still has a stray process to end (one that ignores SIGTERM takes it a second)."""
    pytester.makepyfile(test_stray=STRAY_IGNORING_SIGTERM)
    argv = [sys.executable, "-m", "pytest", *LEAN, "--elastic-timer-leaks=off"]
    with top_level_environment():
        done = subprocess.run(
            argv, cwd=pytester.path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60
        )
    output = done.stdout.decode()
    assert done.returncode == 0, output
    watchdog = _watchdog_pid(output.splitlines())
    # Still at work, its files open: not a process in the middle of exiting, which
    # is when a watchdog that kept the pipe would let it go.
    assert os.listdir(f"/proc/{watchdog}/fd"), "the watchdog kept the pipe to its end"
    assert wait_gone(watchdog, 30.0)
    stray = int((pytester.path / "stray.pid").read_text())
    assert wait_gone(stray, 10.0)
    with contextlib.suppress(ChildProcessError):  # adopted by this process (subreaper)
        os.waitpid(stray, 0)


# Writes the command line of the session's watchdog to watchdog-argv.txt.
WATCHDOG_ARGV = """
def test_watchdog_argv(elastic_timer_server):
    with open(f"/proc/{elastic_timer_server.pid}/cmdline", "rb") as f:
        argv = f.read().split(b"\\0")
    assert b"pytest_elastic_timer.watchdog" in argv
    with open("watchdog-argv.txt", "wb") as out:
        out.write(b" ".join(argv))
"""


@pytest.mark.parametrize("report", [False, True], ids=["not-waited-for", "report"])
def test_a_watchdog_loads_late_only_where_pytest_does_not_wait_for_it(
    pytester: pytest.Pytester, report: bool
) -> None:
    """Where pytest does not wait for its watchdog at the end, the watchdog loads its
    modules late (``--defer``): a one-test session ends before it loads anything. With
    a report to read back, pytest would wait for that loading at the end: it loads at
    once, beside the session."""
    pytester.makepyfile(test_argv=WATCHDOG_ARGV)
    argv = [sys.executable, "-m", "pytest", *LEAN]
    if report:
        argv += ["--elastic-timer-report", "report.json"]
    with top_level_environment():
        done = subprocess.run(argv, cwd=pytester.path, capture_output=True, timeout=60)
    output = done.stdout.decode()
    assert done.returncode == 0, output
    assert wait_gone(_watchdog_pid(output.splitlines()), 30.0)
    deferred = "--defer" in (pytester.path / "watchdog-argv.txt").read_text()
    assert deferred is not report
    assert os.path.exists(pytester.path / "report.json") is report


def test_a_deadline_the_late_watchdog_would_miss_hurries_it() -> None:
    """The pytest process tells a watchdog that loads late to load now for a deadline
    it would load too late for, once; a later deadline (a 30 s budget) says nothing."""
    handle = launcher.start(grace=1.0, scale=1.0, report=None, session={}, defer=30.0)
    try:
        pid = handle.pid
        told = lifecycle._hurry_for_early_deadlines(handle)
        told(time.monotonic() + 30.0)
        assert not handle.hurried
        told(time.monotonic() + 0.05)
        assert handle.hurried
        give_up = time.monotonic() + 30
        while not loaded_psutil(pid) and time.monotonic() < give_up:
            time.sleep(0.01)
        assert loaded_psutil(pid), "not loaded long before its 30 s"
    finally:
        assert handle.stop({}, wait=True) == 0


@pytest.mark.parametrize("subreaper", [False, True], ids=["orphan", "adopted"])
def test_a_session_with_nothing_to_read_back_does_not_wait_for_its_watchdog(
    subreaper: bool,
) -> None:
    """Stopping a watchdog sends the stop command and returns: without a report to read
    back nothing waits for it. It ends by itself (its socket was listening before it
    ran) and removes its directory. Where this process adopted it (a subreaper), it is
    reaped by the next start or stop; else nothing of it is kept, its pidfd neither."""
    watch = leaks.Watch()
    if subreaper:
        watch.adopt_orphans()
    adopting = leaks.is_subreaper()  # (the session running this test may be one)
    try:
        handle = launcher.start(grace=1.0, scale=1.0, report=None, session={})
        assert os.path.exists(handle.address)  # listening before the process ran
        pid = handle.pid
        assert handle.stop({}, wait=False) is None
        assert handle.returncode is None  # not waited for
        assert (handle.pidfd >= 0) == adopting  # kept only to be reaped
        assert wait_gone(pid, 20.0), "the stopped watchdog did not end by itself"
        launcher.reap_stopped()
        assert handle.returncode == (0 if adopting else None)
        assert pid not in {c.pid for c in psutil.Process().children()}  # reaped
        assert not os.path.exists(handle.directory)
    finally:
        watch.leave()


def test_without_pidfds_the_watchdog_is_a_child_reaped_at_its_stop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where pidfds are missing (an old kernel, valgrind), the watchdog is not started
    as an orphan, which nothing here could watch: it is this process's child, reaped."""
    monkeypatch.setattr(launcher, "_PIDFDS", False)
    handle = launcher.start(grace=1.0, scale=1.0, report=None, session={})
    assert not handle.detached
    assert handle.pid in {c.pid for c in psutil.Process().children()}
    assert handle.stop({}, wait=True) == 0
    assert handle.pid not in {c.pid for c in psutil.Process().children()}
    assert not os.path.exists(handle.directory)


def _is_a_watchdog(pid: int) -> bool:
    cmdline = psutil.Process(pid).cmdline()
    return cmdline[:1] == [sys.executable] and "pytest_elastic_timer.watchdog" in cmdline


def test_the_watchdog_is_started_apart_and_watched_through_a_pidfd() -> None:
    """Started as an orphan (test_installed has a suite that waits for every child of
    its process: this process may be a subreaper, which adopts it back)."""
    handle = launcher.start(grace=1.0, scale=1.0, report=None, session={})
    try:
        assert handle.detached and handle.pidfd >= 0
        # The shell's background child, which becomes the watchdog once it has exec'd.
        give_up = time.monotonic() + 10
        while not _is_a_watchdog(handle.pid) and time.monotonic() < give_up:
            time.sleep(0.01)
        assert _is_a_watchdog(handle.pid)
    finally:
        assert handle.stop({}, wait=True) == 0
    assert not os.path.exists(handle.directory)
    assert handle.pid not in {c.pid for c in psutil.Process().children()}  # nor a zombie


def test_a_session_with_a_report_waits_for_its_watchdog(tmp_path: Path) -> None:
    """With a JSON report to read back, stopping waits until the watchdog wrote it."""
    report = tmp_path / "report.json"
    handle = launcher.start(grace=1.0, scale=1.0, report=str(report), session={"pid": 1})
    assert handle.stop({"exitstatus": 0}) == 0
    assert json.loads(report.read_text())["session"]["exitstatus"] == 0
    assert not os.path.exists(handle.directory)


@pytest.mark.parametrize("shows", ["--help", "--markers"])
def test_help_and_markers_start_no_watchdog(pytester: pytest.Pytester, shows: str) -> None:
    """``pytest --help`` and ``--markers`` run no session: no watchdog starts, no
    report is written, and the plugin's options and marker are listed."""
    report = pytester.path / "report.json"
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    result = pytester.runpytest_subprocess(shows, f"--elastic-timer-report={report}")
    assert result.ret == 0
    expected = "*--elastic-timer-report=PATH*" if shows == "--help" else "*@pytest.mark.expires*"
    result.stdout.fnmatch_lines([expected])
    assert "elastic-timer: watchdog pid" not in result.stdout.str()
    assert not report.exists()
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


ZOMBIE_THEN_HANG = """
import subprocess
import sys
import time

import pytest

KEPT = []


def test_leaves_a_zombie():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    child.kill()
    KEPT.append(child)  # never waited for: a zombie until the session ends
    with open("zombie", "w") as f:
        f.write(str(child.pid))


@pytest.mark.expires(0.5)
def test_hangs_beside_a_child():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    with open("live", "w") as f:
        f.write(str(child.pid))
    try:
        time.sleep(30)
    finally:
        child.kill()
        child.wait()
"""


def test_a_zombie_of_an_earlier_test_is_not_in_a_records_children(
    pytester: pytest.Pytester,
) -> None:
    """The children a record lists are the processes the owner runs when its scope
    expires: a zombie an earlier test left unreaped is not one of them."""
    pytester.makepyfile(test_zombie=ZOMBIE_THEN_HANG)
    session = run(pytester)
    session.assert_clean()
    session.result.assert_outcomes(passed=1, failed=1)
    zombie = int((pytester.path / "zombie").read_text())
    live = int((pytester.path / "live").read_text())
    record = session.record("test_hangs_beside_a_child::call")
    listed = [c["pid"] for c in record["children"]]
    assert live in listed and zombie not in listed, record["children"]


# -- a session outside the main thread -------------------------------------------------
# An xdist worker that execnet's socket server runs in a thread of its own (its main
# thread was still busy with the previous remote call), or a pytest an IDE runs in a
# thread: no signal handler can be installed there.
IN_A_THREAD = """
import sys
import threading

import pytest

codes = []
thread = threading.Thread(target=lambda: codes.append(pytest.main(sys.argv[1:])))
thread.start()
thread.join()
sys.exit(codes[0])
"""
OUTSIDE_MAIN_THREAD = """
import subprocess
import sys
import threading
import time

import pytest


@pytest.mark.expires(1)
def test_busy():
    assert threading.current_thread() is not threading.main_thread()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        while True:
            pass
    finally:
        child.kill()
        child.wait()


@pytest.mark.expires(1)
def test_polling():
    while True:
        time.sleep(0.05)


def test_after():
    pass


@pytest.mark.expires(1)
def test_blocked():
    time.sleep(60)
"""


def test_a_session_outside_the_main_thread_is_interrupted_by_a_thread_of_its_own(
    pytester: pytest.Pytester,
) -> None:
    """Python code gets its ScopeExpired from a thread of the package (no handler can be
    installed); a call blocked in C gets the grace, then the watchdog ends pytest."""
    pytester.makepyfile(in_a_thread=IN_A_THREAD, test_threaded=OUTSIDE_MAIN_THREAD)
    report = pytester.path / REPORT_NAME
    with top_level_environment():
        result = pytester.run(
            sys.executable,
            "in_a_thread.py",
            *LEAN,
            "--elastic-timer-grace=1",
            f"--elastic-timer-report={report}",
            "test_threaded.py",
            timeout=60,
        )
    header = next(HEADER.match(line) for line in result.outlines if HEADER.match(line))
    assert header is not None
    wait_gone(int(header.group(1)), 5.0)  # it writes the report once pytest is gone
    text = "\n".join(result.outlines)
    assert result.ret == -signal.SIGTERM or result.ret == 128 + signal.SIGTERM, text
    # Two tests failed by their ScopeExpired, the next one passed, the last one hung.
    assert "test_threaded.py TT." in text
    expired = {r["scope"]: r for r in json.loads(report.read_text())["expired"]}
    busy = expired["test_busy::call"]
    assert busy["action"] == "interrupted"
    # The stacks of the processes below it, taken before the interrupt, as elsewhere.
    assert any('File "<string>", line 1' in c.get("stack", "") for c in busy["children"]), busy
    assert expired["test_polling::call"]["action"] == "interrupted"
    blocked = expired["test_blocked::call"]
    # Not at the deadline (as without an interrupt to wait for), after the grace.
    assert blocked["action"] == "terminated"
    assert blocked["elapsed"] >= 1.9, blocked


@pytest.mark.parametrize("inherited_worker", ["", "gw5"])
def test_a_session_budget_that_runs_out_in_a_test_stops_the_session_there(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, inherited_worker: str
) -> None:
    """The session stops in the running test, as on Ctrl-C: not by a ScopeExpired,
    which the test may catch (it is a TimeoutError). The test then fails as one whose
    own scope expired, TIMEOUT, also in the JUnit file (Exit left it with no outcome:
    a testcase with no name, no failure). A pytest run by a test of an xdist worker
    inherits PYTEST_XDIST_WORKER, and is no worker all the same."""
    if inherited_worker:
        monkeypatch.setenv("PYTEST_XDIST_WORKER", inherited_worker)
    else:
        monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    pytester.makepyfile(
        test_budget="""
        import time

        def test_long():
            while True:
                try:
                    time.sleep(30)
                except TimeoutError:
                    pass  # a retry loop: it must not keep the session going


        def test_next():
            pass
        """
    )
    session = run(pytester, "-rA", "--expires-session=1", "--junitxml=junit.xml")
    session.assert_clean()
    assert session.result.ret == pytest.ExitCode.INTERRUPTED
    session.result.assert_outcomes(failed=1)  # test_long, stopped; test_next never started
    assert "TIMEOUT test_budget.py::test_long - scope 'session' expired" in session.stdout
    suite = ElementTree.parse(pytester.path / "junit.xml").getroot().find("testsuite")
    assert suite is not None
    (case,) = suite.iter("testcase")
    assert (case.get("name"), suite.get("failures")) == ("test_long", "1")
    failure = case.find("failure")
    assert failure is not None and failure.get("message", "").startswith("scope 'session'")
    properties = {p.get("name"): p.get("value") for p in case.iter("property")}
    assert properties["elastic_timer_scope"] == "session", properties
    exit_line = "! _pytest.outcomes.Exit: scope 'session' expired after"
    assert exit_line in session.stdout, session.stdout
    assert "interrupted (phase call) !" in session.stdout, session.stdout
    assert session.seconds < 20, session.seconds  # not the ladder's termination
    assert session.report is not None
    (record,) = session.report["expired"]
    assert (record["scope"], record["nodeid"]) == ("session", "test_budget.py::test_long")
    assert record["action"] == "interrupted"
    assert session.report["session"]["exitstatus"] == pytest.ExitCode.INTERRUPTED


def test_a_session_budget_outside_the_main_thread_stops_the_session(
    pytester: pytest.Pytester,
) -> None:
    """The session's budget ends pytest where it is; in a thread, where only a
    ScopeExpired can be raised, the test fails by it and no further test starts."""
    pytester.makepyfile(
        in_a_thread=IN_A_THREAD,
        test_budget="""
        def test_long():
            while True:
                pass


        def test_next():
            pass
        """,
    )
    with top_level_environment():
        result = pytester.run(
            sys.executable, "in_a_thread.py", *LEAN, "-rA", "--expires-session=1", timeout=60
        )
    text = "\n".join(result.outlines)
    assert "TIMEOUT test_budget.py::test_long - scope 'session' expired" in text, text
    assert "! Interrupted: scope 'session' expired" in text, text
    result.assert_outcomes(failed=1)  # test_next never started


def test_scopes_outside_the_main_thread_expire_without_a_watchdog(
    pytester: pytest.Pytester,
) -> None:
    """The sentinel, which otherwise signals the main thread, raises in the scope's
    thread itself where the process has no interrupt signal."""
    pytester.makepyfile(
        script="""
        import os
        import threading
        import time

        import pytest_elastic_timer as et

        os.environ.pop("PYTEST_ELASTIC_TIMER", None)
        caught = []

        def step():
            try:
                with et.expires(after=0.3, scope="step"):
                    while True:
                        time.sleep(0.01)
            except et.ScopeExpired as exc:
                caught.append(exc)

        thread = threading.Thread(target=step)
        thread.start()
        thread.join(30)
        print("caught", [(e.scope, e.action, type(e).__name__) for e in caught])
        """
    )
    result = pytester.run(sys.executable, "script.py", timeout=60)
    assert result.ret == 0, result.stderr.str()
    assert "caught [('step', 'interrupted', 'ScopeExpired')]" in result.stdout.str()


ENDED_BEFORE_THEIR_DEADLINES = '''
import os
import signal
import subprocess
import sys
import time

HELPER = """
import os, sys, time
import pytest_elastic_timer as et

if sys.argv[1] == "killed":
    with et.expires(1.5, scope="killed-inside"):
        print("in", flush=True)
        time.sleep(60)
else:
    et.TimerRequest(1.5, scope="acquired-never-released").acquire()
    print("in", flush=True)
    os._exit(0)
"""


def run_helper(how, env):
    helper = subprocess.Popen(
        [sys.executable, "-c", HELPER, how], env=env, stdout=subprocess.PIPE, text=True
    )
    assert helper.stdout.readline() == "in\\n"
    if how == "killed":
        helper.send_signal(signal.SIGKILL)
    helper.wait()
    helper.stdout.close()
    time.sleep(2.5)  # past the helper's deadline


def test_a_helper_killed_inside_its_scope(elastic_timer):
    run_helper("killed", elastic_timer.env)


def test_a_helper_that_exits_with_a_scope_acquired(elastic_timer):
    run_helper("exits", elastic_timer.env)
'''


@pytest.mark.parametrize("workers", [[], ["-p", "xdist", "-n", "2"]], ids=["one", "xdist"])
def test_a_process_that_ended_before_its_deadline_expired_nothing(
    pytester: pytest.Pytester, workers: list[str]
) -> None:
    """A process that ends with a scope open (killed, or gone with a scope acquired and
    never released) before the scope's deadline: no expiry is recorded at the deadline
    it did not live to see, and its test is not failed by one."""
    pytester.makepyfile(test_ended=ENDED_BEFORE_THEIR_DEADLINES)
    session = run(pytester, *workers)
    session.assert_clean()
    session.result.assert_outcomes(passed=2)
    assert session.report is not None and session.report["expired"] == []
    assert "elastic-timer: expired scopes" not in session.text


OWN_ENVIRONMENT = '''
import os
import subprocess
import sys

CHILD = """
import time
import pytest_elastic_timer as et
with et.expires(0.3, scope="child"):
    time.sleep(30)
"""


def test_a_child_with_an_environment_of_its_own():
    # Only what joins the session and finds Python: no PYTEST_CURRENT_TEST, no
    # PYTEST_XDIST_WORKER.
    env = {k: v for k, v in os.environ.items() if k.startswith("PYTEST_ELASTIC_TIMER")}
    env["PATH"] = os.environ["PATH"]
    child = subprocess.run([sys.executable, "-c", CHILD], env=env, timeout=60)
    assert child.returncode == 0
'''


@pytest.mark.parametrize("workers", [[], ["-p", "xdist", "-n", "1"]], ids=["one", "xdist"])
def test_a_child_given_an_environment_of_its_own_is_credited_to_its_test(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, workers: list[str]
) -> None:
    """A child whose environment does not name its test (nor its worker) is credited
    to the test its pytest process ran when it joined: its test is a TIMEOUT."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # this suite's own, under -n
    pytester.makepyfile(test_own=OWN_ENVIRONMENT)
    session = run(pytester, *workers)
    session.assert_clean()
    session.result.assert_outcomes(failed=1)
    nodeid = "test_own.py::test_a_child_with_an_environment_of_its_own"
    assert f"TIMEOUT {nodeid}" in session.text
    assert session.report is not None
    (record,) = session.report["expired"]
    assert (record["scope"], record["nodeid"]) == ("child", nodeid)
    assert record["worker"] == ("gw0" if workers else "")


CAUGHT_AND_GONE = """
import time

import pytest
import pytest_elastic_timer as et


@pytest.mark.expires(0.3)
def test_interrupted():
    time.sleep(30)


@pytest.mark.parametrize("n", range(3))
def test_caught(n):
    with pytest.raises(et.ScopeExpired):
        with et.expires(0.2, scope="probe"):
            time.sleep(5)
"""


def test_a_caught_expiry_is_recorded_in_the_phase_it_expired_in(pytester: pytest.Pytester) -> None:
    """The record of an expiry caught by its test is final once the watchdog sees the
    scope closed, when the test may be over: its phase is the one at the expiry."""
    pytester.makepyfile(test_caught=CAUGHT_AND_GONE)
    session = run(pytester)
    session.assert_clean()
    session.result.assert_outcomes(passed=3, failed=1)
    assert session.report is not None
    phases = [(r["scope"], r["phase"]) for r in session.report["expired"] if "probe" in r["scope"]]
    assert phases == [(f"test_caught[{n}]::call/probe", "call") for n in range(3)], phases


# -- an owner that swallowed its interrupt, waiting for processes it started ----------
JOINS_RANKS_ONE_BY_ONE = (
    SLEEPING_RANK
    + """


@pytest.mark.expires(2)
def test_join_ranks():
    context = multiprocessing.get_context("spawn")
    ranks = [
        context.Process(target=_rank, args=(os.path.abspath(f"rank{r}.pid"),)) for r in range(3)
    ]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join()  # multiprocessing takes the ScopeExpired for an OSError, and goes on


def test_after():
    pass
"""
)


@pytest.mark.parametrize("workers", [[], ["-p", "xdist", "-n", "1"]], ids=["one", "xdist"])
def test_a_test_joining_its_ranks_one_by_one_fails_and_the_session_goes_on(
    pytester: pytest.Pytester, workers: list[str]
) -> None:
    """The interrupt reaches ``Process.join()``, whose wait takes the ScopeExpired for
    an OSError (a TimeoutError is one) and returns; the next join waits again. After the
    grace the owner, asleep, is not terminated with its ranks (pytest itself, without
    xdist: the session ended there, exit 143; the worker, replaced): the ranks end first,
    the owner is interrupted again and its test fails by its scope, and the next test
    runs. multiprocessing's resource tracker is no rank, and is left running."""
    pytester.makepyfile(test_join=JOINS_RANKS_ONE_BY_ONE)
    session = run(pytester, "--elastic-timer-grace=1", *workers)
    pids = [int((pytester.path / f"rank{r}.pid").read_text()) for r in range(3)]
    try:
        session.assert_clean()
        session.result.assert_outcomes(failed=1, passed=1)
        assert session.result.ret == pytest.ExitCode.TESTS_FAILED, session.text
        assert "replacing crashed worker" not in session.text, session.text
        record = session.record("test_join_ranks::call")
        assert record["action"] == "interrupted", record
        assert sorted(p["pid"] for p in record["killed"]) == sorted(pids), record
        assert not session.report.get("root_died"), session.report
        assert all(wait_gone(pid, 5.0) for pid in pids), "a rank outlived its test"
    finally:
        for pid in pids:
            reap(pid)


CHILDREN_WITHOUT_THE_HOOK = """
import os
import subprocess
import sys

import pytest

SLEEPER = "import time; time.sleep(3600)"


@pytest.mark.expires(1)
def test_children():
    replaced = dict(os.environ, PYTHONPATH=os.path.abspath("src"))  # not the session's
    children = [
        subprocess.Popen([sys.executable, "-c", SLEEPER], env=replaced),
        subprocess.Popen([sys.executable, "-c", SLEEPER]),
        subprocess.Popen(["sleep", "3600"]),
    ]
    with open("children.pid", "w") as f:
        f.write(" ".join(str(c.pid) for c in children))
    try:
        children[0].wait()
    finally:
        for child in children:
            child.kill()
            child.wait()
"""


def test_a_python_child_without_the_sessions_pythonpath_is_said_to_have_no_stack(
    pytester: pytest.Pytester,
) -> None:
    """A Python child whose environment replaced PYTHONPATH runs without the session's
    start-up hook: no stack, no collectives, and it was listed like any other process
    without one. Its entry and the failing test now say why; a child that kept the
    session's PYTHONPATH has its stack, a process that is not Python neither."""
    pytester.makepyfile(test_children=CHILDREN_WITHOUT_THE_HOOK)
    session = run(pytester)
    session.assert_clean()
    session.result.assert_outcomes(failed=1)
    replaced, kept, other = map(int, (pytester.path / "children.pid").read_text().split())
    children = {c["pid"]: c for c in session.record("test_children::call")["children"]}
    assert "PYTHONPATH lacks the session's start-up directory" in children[replaced]["no_stack"]
    assert "stack" not in children[replaced], children
    assert '<string>", line 1' in children[kept]["stack"] and "no_stack" not in children[kept]
    assert "stack" not in children[other] and "no_stack" not in children[other], children
    assert f"elastic-timer: no stack of pid {replaced}" in session.stdout, session.stdout
    assert f"elastic-timer: stack of pid {kept} at expiry" in session.stdout, session.stdout
    assert all(wait_gone(pid, 5.0) for pid in (replaced, kept, other))
