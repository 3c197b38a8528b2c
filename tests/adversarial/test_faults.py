"""Faults: pytest or the watchdog killed, Ctrl-C, and processes that will not die.

Inner sessions are real pytest processes started as a user's shell would (their own
process group, no stack-dump set-up inherited from the session running this suite).
Each test proves what was not lost (records, the JSON report, the JUnit file on disk)
and that no process was left behind (here, and in the suite's autouse check).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import psutil
import pytest
from helpers import HEADER, LEAN, REPORT_NAME, pump, run, wait_gone

from pytest_elastic_timer.core import startup
from pytest_elastic_timer.scope import client
from pytest_elastic_timer.watchdog import proctree

from .conftest import (
    GRACE,
    KILL_AFTER,
    LEAN_WITH_XDIST,
    Dog,
    running,
    wait_for,
)
from .test_fuzz import Local

FEW_SECONDS = 5.0  # "gone within a few seconds"
SCHEMA = Path(startup.__file__).with_name("report.schema.json")


@pytest.fixture
def top_level(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inner sessions start like one from a shell: without this suite's session's
    stack-dump start-up code (which would take the dump signal over in their processes,
    the bug tests/test_plugin.py::test_nested_session_dumps_stacks pins)."""
    monkeypatch.delenv(startup.ENV_DUMP_SIGNAL, raising=False)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    kept = [p for p in paths if p and p != startup.PYTHONPATH_DIRECTORY]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(kept))


class Inner:
    """An inner pytest session in its own process group, output to a file."""

    def __init__(self, pytester: pytest.Pytester, *args: str, xdist: bool = False) -> None:
        self.path = pytester.path
        self.report = self.path / REPORT_NAME
        self.junit = self.path / "junit.xml"
        self.output = self.path / "output.txt"
        argv = [
            sys.executable,
            "-m",
            "pytest",
            *(LEAN_WITH_XDIST if xdist else LEAN),
            f"--elastic-timer-report={self.report}",
            f"--junitxml={self.junit}",
            f"--elastic-timer-grace={GRACE}",
            *args,
        ]
        with open(self.output, "wb") as out:
            self.proc = subprocess.Popen(
                argv,
                cwd=self.path,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                start_new_session=True,
            )

    @property
    def text(self) -> str:
        return self.output.read_text(errors="replace")

    def watchdog_pid(self, timeout: float = 60) -> int:
        found: list[int] = []

        def header() -> bool:
            found.extend(int(m.group(1)) for m in map(HEADER.match, self.text.splitlines()) if m)
            return bool(found)

        wait_for(header, timeout, "the session's header line")
        return found[0]

    def wait_json(self, name: str, timeout: float = 60) -> dict[str, Any]:
        path = self.path / name
        wait_for(lambda: path.exists() or self.proc.poll() is not None, timeout, name)
        assert path.exists(), f"{name} never written:\n{self.text}"
        value: dict[str, Any] = json.loads(path.read_text())
        return value

    def wait(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            # Where it hung, for the message: pytest's faulthandler prints the stack of
            # every thread of the session's process on SIGABRT.
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGABRT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)
            self.kill_group()
            raise AssertionError(f"the session hung:\n{self.text}") from None

    def kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def inner_sessions(top_level: None) -> Iterator[list[Inner]]:
    """Inner sessions a test starts; their process groups are ended afterwards."""
    started: list[Inner] = []
    yield started
    for session in started:
        if session.proc.poll() is None:
            session.kill_group()


def reap(*pids: int) -> None:
    """Collect processes that were adopted by this process (a subreaper) and ended."""
    for pid in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


def load_json(path: Path) -> dict[str, Any]:
    assert path.exists(), f"{path.name} is not on disk"
    value: dict[str, Any] = json.loads(path.read_text())
    return value


# -- pytest killed with SIGKILL --------------------------------------------------------
KILLED_SESSION = """
import json, os, subprocess, sys, time
import pytest
import pytest_elastic_timer as et

RANK = '''
import subprocess, sys, time
import pytest_elastic_timer as et
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
with et.expires(120, scope="rank-long"):
    print(child.pid, flush=True)
    time.sleep(120)
'''

@pytest.mark.expires(0.3)
def test_first():
    time.sleep(30)

def test_spawns_and_hangs():
    rank = subprocess.Popen([sys.executable, "-c", RANK], stdout=subprocess.PIPE, text=True)
    grandchild = int(rank.stdout.readline())
    pids = {"pytest": os.getpid(), "rank": rank.pid, "grandchild": grandchild}
    with open("pids.tmp", "w") as f:
        json.dump(pids, f)
    os.rename("pids.tmp", "pids.json")
    with et.expires(120, scope="long"):
        time.sleep(120)
"""


def test_pytest_killed_with_sigkill_leaves_report_junit_and_no_process(
    pytester: pytest.Pytester, inner_sessions: list[Inner]
) -> None:
    pytester.makepyfile(test_killed=KILLED_SESSION)
    session = Inner(pytester, "-s")
    inner_sessions.append(session)
    watchdog = session.watchdog_pid()
    pids = session.wait_json("pids.json")
    os.kill(pids["pytest"], signal.SIGKILL)
    assert session.wait() == -signal.SIGKILL
    killed_at = time.monotonic()
    for name in ("watchdog", "rank", "grandchild"):
        pid = watchdog if name == "watchdog" else pids[name]
        assert wait_gone(pid, FEW_SECONDS), f"the {name} outlived the killed pytest"
    assert time.monotonic() - killed_at < FEW_SECONDS
    reap(pids["rank"], pids["grandchild"])
    # The watchdog wrote the JSON report: the expiry before the kill, the session's end.
    report = load_json(session.report)
    (record,) = report["expired"]
    assert (record["nodeid"], record["scope"]) == ("test_killed.py::test_first", "test_first::call")
    assert record["action"] == "interrupted" and record["budget"] == 0.3
    assert report["session"]["root_died"] is True
    assert report["session"]["pid"] == pids["pytest"]
    listed = [p["pid"] for p in report["session"]["stray_processes"]]
    assert {pids["rank"], pids["grandchild"]} <= set(listed)
    assert len(listed) == len(set(listed)), listed  # the rank is an owner and a child
    # ... and the fallback JUnit file that pytest could no longer write.
    suite = ET.parse(session.junit).getroot().find("testsuite")
    assert suite is not None
    cases = {c.get("name"): c for c in suite.iter("testcase")}
    assert set(cases) == {"test_first", "session-ended"}
    failure = cases["test_first"].find("failure")
    assert failure is not None and "test_first::call" in (failure.get("message") or "")
    error = cases["session-ended"].find("error")
    assert error is not None and str(pids["pytest"]) in (error.get("message") or "")


# -- the watchdog killed mid-session ------------------------------------------------------
WATCHDOG_KILLED = """
import os, signal, subprocess, sys, time
import jsonschema  # type: ignore[import-untyped]
import psutil
import pytest
import pytest_elastic_timer as et

RANK = '''
import time
import pytest_elastic_timer as et
try:
    with et.expires(0.3, scope="rank-after-loss"):
        time.sleep(30)
except et.ScopeExpired:
    print("rank expired", flush=True)
'''

def test_before_the_loss():
    with pytest.raises(et.ScopeExpired):
        with et.expires(0.3, scope="before-loss"):
            time.sleep(30)

def test_kill_the_watchdog(elastic_timer_server):
    pid = elastic_timer_server.pid
    time.sleep(0.2)  # the previous test's report is read and recorded before the loss
    os.kill(pid, signal.SIGKILL)
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.01)
    time.sleep(1.1)  # the plugin looks at the connection at most once a second

def test_scope_still_enforced():
    start = time.monotonic()
    with pytest.raises(et.ScopeExpired):
        with et.expires(0.5, scope="after-loss"):
            time.sleep(30)
    assert time.monotonic() - start < 5

@pytest.mark.xfail(raises=et.ScopeExpired, strict=True, reason="enforced in-process")
@pytest.mark.expires(0.5)
def test_phase_budget_still_enforced():
    time.sleep(30)

def test_a_rank_started_now_enforces_its_own_scopes():
    out = subprocess.run([sys.executable, "-c", RANK], capture_output=True, text=True, timeout=30)
    assert "rank expired" in out.stdout
    assert "cannot reach the watchdog" in out.stderr
"""


def test_watchdog_killed_mid_session_is_loud_falls_back_and_fails_the_session(
    pytester: pytest.Pytester, top_level: None
) -> None:
    pytester.makepyfile(test_lost=WATCHDOG_KILLED)
    junit = pytester.path / "junit.xml"
    session = run(pytester, "-rA", f"--junitxml={junit}", f"--elastic-timer-grace={GRACE}")
    session.assert_clean()
    # Every test passed or failed as it should: later scopes were enforced in-process.
    session.result.assert_outcomes(passed=4, xfailed=1, warnings=1)
    # Loud: a red line at the test where it was noticed, and a warning in the summary.
    lost = re.compile(
        rf"^elastic-timer: the watchdog \(pid {session.watchdog_pid}\) died before "
        r"test_lost.py::test_scope_still_enforced; scopes are enforced in-process from then on"
    )
    assert any(lost.match(line) for line in session.lines), session.stdout
    assert "PytestWarning: elastic-timer: the watchdog" in session.stdout
    # The session fails although every test passed: its guarantees did not hold.
    assert session.result.ret == pytest.ExitCode.TESTS_FAILED
    assert session.seconds < 30  # and it never hung
    # pytest's own JUnit file has every test.
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite is not None and suite.get("tests") == "5"


def test_watchdog_killed_mid_session_keeps_the_records_it_made(
    pytester: pytest.Pytester, top_level: None
) -> None:
    """The plugin writes the JSON report the dead watchdog cannot: the records made
    before the loss, and why the rest is missing."""
    pytester.makepyfile(test_lost=WATCHDOG_KILLED)
    session = run(pytester, f"--elastic-timer-grace={GRACE}")
    session.assert_clean()
    report = session.report
    assert report is not None, "no JSON report"
    jsonschema.validate(report, json.loads(SCHEMA.read_text()))
    (record,) = report["expired"]
    assert record["scope"] == "test_before_the_loss::call/before-loss"
    assert record["action"] == "interrupted"
    assert record["nodeid"] == "test_lost.py::test_before_the_loss"
    assert report["session"]["watchdog_lost"].startswith(
        f"the watchdog (pid {session.watchdog_pid}) died before "
    )
    assert report["session"]["root_died"] is False
    # Every test passed, and the session failed all the same: the report says so too.
    assert report["session"]["exitstatus"] == session.result.ret == 1


# -- tests that fight the ladder, under xdist ----------------------------------------------
HOSTILE = """
import os, signal, stat, time
import pytest
import pytest_elastic_timer as et

@pytest.mark.expires(0.5)
def test_ignores_sigterm_in_a_c_loop():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sum(range(10**12))  # holds the GIL

@pytest.mark.expires(0.5)
def test_blocks_the_interrupt_and_dump_signals():
    signal.pthread_sigmask(signal.SIG_BLOCK, range(signal.SIGRTMIN, signal.SIGRTMAX + 1))
    time.sleep(60)

@pytest.mark.expires(0.5)
def test_catches_base_exception():
    while True:
        try:
            time.sleep(10)
        except BaseException:
            pass

@pytest.mark.expires(0.5)
def test_stops_itself():
    os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(60)

@pytest.mark.expires(0.5)
def test_closes_stdout_and_stderr():
    os.close(1)
    os.close(2)
    time.sleep(60)

def test_own_handlers_are_untouched():
    hits = []
    def handler(signum, frame):
        hits.append(signum)
    mine = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM)
    for signum in mine:
        signal.signal(signum, handler)
    with pytest.raises(et.ScopeExpired):
        with et.expires(0.5, scope="own-handlers"):
            time.sleep(30)
    assert [signal.getsignal(s) for s in mine] == [handler] * 3
    os.kill(os.getpid(), signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGUSR2)
    signal.setitimer(signal.ITIMER_REAL, 0.05)
    time.sleep(0.5)
    assert sorted(hits) == sorted(mine)

def test_endpoints_are_private():
    address = os.environ["PYTEST_ELASTIC_TIMER"]
    assert stat.S_IMODE(os.stat(os.path.dirname(address)).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(address).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.environ["TORCHELASTIC_TIMER_FILE"]).st_mode) == 0o600

def test_after():
    pass
"""
# test name -> actions the ladder may end it with, and whether its stack must be there.
FIGHTERS = {
    "test_ignores_sigterm_in_a_c_loop": ({"killed"}, True),
    "test_blocks_the_interrupt_and_dump_signals": ({"terminated", "killed"}, False),
    "test_catches_base_exception": ({"terminated", "killed"}, True),
    "test_stops_itself": ({"terminated", "killed"}, False),
    "test_closes_stdout_and_stderr": ({"interrupted"}, True),
}


def test_tests_that_fight_the_ladder_are_ended_and_reported(
    pytester: pytest.Pytester, top_level: None
) -> None:
    pytester.makepyfile(test_hostile=HOSTILE)
    session = run(
        pytester,
        "-n",
        "2",
        "--max-worker-restart=10",
        f"--elastic-timer-grace={GRACE}",
        lean=False,
        timeout=120,
    )
    assert "INTERNALERROR" not in session.text
    session.result.assert_outcomes(failed=len(FIGHTERS), passed=3)
    assert session.report is not None
    by_nodeid = {r["nodeid"]: r for r in session.report["expired"]}
    workers_ended = set()
    for name, (actions, with_stack) in FIGHTERS.items():
        record = by_nodeid[f"test_hostile.py::{name}"]
        assert record["scope"] == f"{name}::call"
        assert record["action"] in actions, (name, record["action"])
        assert record["budget"] == 0.5 and record["elapsed"] >= 0.5
        assert record["worker"] in ("gw0", "gw1", "gw2", "gw3", "gw4", "gw5", "gw6")
        assert record["file"].endswith("test_hostile.py") and record["line"] > 0
        if with_stack:
            assert name in record["stack"], (name, record["stack"])
        if record["action"] != "interrupted":
            assert record["pid"] in [p["pid"] for p in record["killed"]]
            workers_ended.add(record["pid"])
    own = [r for r in session.report["expired"] if r["scope"].endswith("/own-handlers")]
    assert len(own) == 1 and own[0]["action"] == "interrupted"
    # The processes the ladder ended are gone (the autouse check finds any other).
    assert all(not running(pid) for pid in workers_ended)
    assert session.watchdog_pid is not None and wait_gone(session.watchdog_pid, 3)


CLOOP_IGNORING_SIGTERM = """
import signal
import pytest

def test_before():
    pass

@pytest.mark.expires(0.5)
def test_gil():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sum(range(10**12))
"""


def test_pytest_itself_ignoring_sigterm_in_a_c_loop_is_killed_and_reported(
    pytester: pytest.Pytester, top_level: None
) -> None:
    pytester.makepyfile(test_cloop=CLOOP_IGNORING_SIGTERM)
    junit = pytester.path / "junit.xml"
    session = run(pytester, f"--elastic-timer-grace={GRACE}", f"--junitxml={junit}")
    assert session.result.ret == -signal.SIGKILL
    assert session.seconds < 0.5 + GRACE + KILL_AFTER + 10
    record = session.record("test_gil::call")
    assert record["action"] == "killed"
    assert "in test_gil" in record["stack"]
    assert session.report is not None and session.report["session"]["root_died"] is True
    cases = {c.get("name") for c in ET.parse(junit).getroot().iter("testcase")}
    assert cases == {"test_gil", "session-ended"}
    assert session.watchdog_pid is not None and wait_gone(session.watchdog_pid, 3)


# -- Ctrl-C -----------------------------------------------------------------------------
CTRL_C = """
import json, os, signal, subprocess, sys, time
import pytest_elastic_timer as et

RANK = '''
import signal, sys, time
import pytest_elastic_timer as et
if sys.argv[1] == "deaf":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a rank that ignores Ctrl-C
with et.expires(120, scope="rank"):
    print("ready", flush=True)
    time.sleep(120)
'''

def test_long():
    ranks = [
        subprocess.Popen([sys.executable, "-c", RANK, kind], stdout=subprocess.PIPE, text=True)
        for kind in ("plain", "deaf")
    ]
    for rank in ranks:
        assert rank.stdout.readline() == "ready\\n"
    with open("pids.tmp", "w") as f:
        json.dump({"plain": ranks[0].pid, "deaf": ranks[1].pid}, f)
    os.rename("pids.tmp", "pids.json")
    with et.expires(120, scope="long"):
        time.sleep(120)
"""


def _asleep(pid: int) -> bool:
    """Whether the main thread of ``pid`` is blocked in a sleep, as its kernel wait
    channel says (False where the kernel does not say)."""
    try:
        with open(f"/proc/{pid}/wchan", encoding="ascii") as f:
            return "nanosleep" in f.read()
    except OSError:
        return False


def test_ctrl_c_ends_the_session_and_every_process(
    pytester: pytest.Pytester, inner_sessions: list[Inner]
) -> None:
    pytester.makepyfile(test_ctrl_c=CTRL_C)
    session = Inner(pytester)
    inner_sessions.append(session)
    watchdog = session.watchdog_pid()
    pids = session.wait_json("pids.json")
    # Ctrl-C once the test sleeps. A SIGINT that comes on its way into time.sleep(120),
    # after the interpreter last looked for signals, only marks the handler as due:
    # CPython sleeps on, as it would for any program (a second Ctrl-C ends it).
    give_up = time.monotonic() + 10  # then on, where the kernel does not say
    while not _asleep(session.proc.pid) and time.monotonic() < give_up:
        time.sleep(0.02)
    os.killpg(session.proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
    assert session.wait(30) == pytest.ExitCode.INTERRUPTED
    assert "KeyboardInterrupt" in session.text
    for name, pid in [("watchdog", watchdog), *pids.items()]:
        assert wait_gone(pid, FEW_SECONDS), f"the {name} process outlived Ctrl-C"
    reap(*pids.values())
    report = load_json(session.report)
    assert report["session"]["root_died"] is False
    assert report["expired"] == []
    strays = {p["pid"] for p in report["session"].get("stray_processes", [])}
    assert pids["deaf"] in strays  # ended by the watchdog at the session's end
    assert session.junit.exists()  # pytest wrote its own


# -- a process that does not die -----------------------------------------------------------
UNREAPED = """
import signal, time
import pytest_elastic_timer as et
signal.signal(signal.SIGTERM, signal.SIG_IGN)
with et.expires(0.3, scope="stubborn"):
    sum(range(10**12))
"""


def test_a_killed_owner_left_unreaped_counts_as_ended(dog: Dog) -> None:
    """A process killed with SIGKILL whose parent does not reap it stays a zombie; the
    ladder counts a zombie as gone: the record says killed, and nobody waits for it."""
    rank = dog.spawn(UNREAPED)
    wait_for(lambda: psutil.Process(rank.pid).status() == psutil.STATUS_ZOMBIE, 15, "a zombie")
    assert rank.returncode is None  # not reaped: this test is its parent and waits
    report = dog.stop()
    (record,) = report["expired"]
    assert (record["pid"], record["action"]) == (rank.pid, "killed")
    assert "still alive after SIGKILL" not in record["stack"]
    took = record["ended"] - record["deadline"]
    assert took < GRACE + 0.3 + KILL_AFTER + 1.0  # no waiting for the zombie to go
    assert rank.wait(1) == -signal.SIGKILL


SURVIVOR = """
import os, signal, sys, time
import pytest_elastic_timer as et
from pytest_elastic_timer.scope import scopes
signal.signal(signal.SIGTERM, signal.SIG_IGN)
state = scopes.process_state()
print(os.getpid(), state.sock is not None, flush=True)
with et.expires(0.2, scope="unkillable"):
    while True:
        try:
            time.sleep(10)
        except BaseException:
            pass
"""


def test_a_process_that_survives_sigkill_is_reported_and_nothing_hangs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """No process can be made to survive SIGKILL portably (D state needs a stuck disk
    or FUSE): this watchdog's SIGKILL is swallowed for one real process instead. The
    record notes the survivor, the ladder gives up after its wait and the session's end
    does not hang on it."""
    local = Local(grace=GRACE)  # this process registers too, but never opens a scope
    survivor: subprocess.Popen[str] | None = None
    try:
        real_signal = proctree._signal

        def signal_except_sigkill(proc: psutil.Process, signum: int) -> None:
            if survivor is not None and proc.pid == survivor.pid and signum == signal.SIGKILL:
                return
            real_signal(proc, signum)

        monkeypatch.setattr(proctree, "_signal", signal_except_sigkill)
        env = {**os.environ, client.ENV_ADDRESS: local.dog.address}
        env.pop(startup.ENV_DUMP_SIGNAL, None)
        rank = survivor = subprocess.Popen(
            [sys.executable, "-c", SURVIVOR], env=env, stdout=subprocess.PIPE, text=True
        )
        assert pump(local.dog, lambda: rank.pid in local.dog.owners, 20)
        owner = local.dog.owners[rank.pid]
        started = time.monotonic()
        assert pump(local.dog, lambda: bool(local.dog.records) and not owner.expiries, 20)
        (record,) = [r for r in local.dog.records if r.pid == rank.pid]
        assert record.action == "killed"  # what was done, not what it achieved:
        assert "still alive after SIGKILL" in record.stack  # ... the record says so
        assert time.monotonic() - started < 0.2 + GRACE + KILL_AFTER + 2.0 + 3.0
        assert rank.poll() is None
        # The session's end: strays are ended, survivors given up on, no hang.
        began = time.monotonic()
        local.dog.end_strays()
        assert time.monotonic() - began < KILL_AFTER + 2.0 + 1.0
        assert rank.poll() is None
        assert local.dog.session["stray_processes"][0]["pid"] == rank.pid
    finally:
        monkeypatch.undo()
        if survivor is not None:
            survivor.kill()
            survivor.wait()
            if survivor.stdout is not None:
                survivor.stdout.close()
        local.close()


def test_zombie_and_reused_pids_read_as_gone_in_proctree() -> None:
    """What the ladder's ``alive()`` means: a zombie is gone (it cannot run again)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    wait_for(lambda: psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE, 10, "zombie")
    proc = psutil.Process(child.pid)
    assert proctree.alive([proc]) == []
    assert proctree.wait_gone([proc], 0.1) == []
    ident = proctree.ProcessId.of(child.pid)
    assert ident is None or ident.process() is None
    child.wait()
