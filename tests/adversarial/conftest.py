"""Shared pieces of the adversarial suite.

- :class:`Dog`: a real watchdog process for this test (``launcher.start``, exactly as
  the plugin starts one, with this test process as the session's root) and the
  environment the plugin gives a session's processes, so that the ranks a test starts
  with :meth:`Dog.spawn` are members of that session. :meth:`Dog.stop` ends it the way
  the plugin does and returns the JSON report it wrote.
- :class:`Probe`: a long-lived rank of that session which, on request, enters a real
  scope and reports when ``ScopeExpired`` reached it: "a real scope still expires on
  time" after whatever a test threw at the watchdog.
- :func:`outsider`: a process that is *not* a member of the session (double-forked in a
  new session, adopted by init or an outer subreaper, never by this process).
- ``helpers.RawClient``: a hand-made socket client that sends arbitrary datagrams.

Every test here also runs under the suite's autouse leftover check
(``tests/conftest.py``): no process and no session directory may be left behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import os
import selectors
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from helpers import RawClient, wait_gone

from pytest_elastic_timer.core import startup, wire
from pytest_elastic_timer.plugin import launcher
from pytest_elastic_timer.scope import client
from pytest_elastic_timer.watchdog import file_timer, proctree

GRACE = 0.5  # interrupt-to-terminate grace of every session here
KILL_AFTER = 1.0  # SIGTERM-to-SIGKILL wait (the launcher's default)
ON_TIME = 1.0  # an interrupt this late after its deadline is late (a loaded 2-core box)
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(proctree.__file__)))

# Inner pytest sessions (pytester): only what they need, as in tests/helpers.py, but
# xdist stays available where a session asks for it.
LEAN_WITH_XDIST: tuple[str, ...] = ("-p", "no:cacheprovider", "-p", "no:asyncio")
LEAN_WITH_XDIST += ("-p", "no:hypothesispytest", "-p", "no:timeout")


def session_env(address: str, directory: str) -> dict[str, str]:
    """The environment the plugin gives every process of its session (plugin.py
    ``pytest_configure``), for a watchdog at ``address`` serving ``directory``."""
    env = dict(os.environ)
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT"):
        env.pop(name, None)
    env[client.ENV_ADDRESS] = address
    env[client.ENV_SCALE] = "1.0"
    env[startup.ENV_DUMP_SIGNAL] = str(startup.session_dump_signal())
    env[file_timer.ENV_FILE] = os.path.join(directory, file_timer.FIFO_NAME)
    # As for a session started from a shell: without the start-up code of the session
    # that runs this suite (its sitecustomize would take the stack-dump signal over, the
    # bug tests/test_plugin.py::test_nested_session_dumps_stacks pins).
    outer = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and not _startup_dir(p)]
    env["PYTHONPATH"] = os.pathsep.join([startup.PYTHONPATH_DIRECTORY, PACKAGE_PARENT, *outer])
    return env


def _startup_dir(path: str) -> bool:
    return path == startup.PYTHONPATH_DIRECTORY


class Dog:
    """A real watchdog process whose session root is this test process."""

    def __init__(self, tmp: Path, grace: float = GRACE) -> None:
        self.report_path = tmp / "report.json"
        self.handle = launcher.start(
            grace=grace,
            scale=1.0,
            report=str(self.report_path),
            session={"pid": os.getpid()},
            kill_after=KILL_AFTER,
            dump_signal=startup.session_dump_signal(),
        )
        self.directory = self.handle.directory
        self.address = self.handle.address
        self.fifo = os.path.join(self.directory, file_timer.FIFO_NAME)
        # The launcher does not wait for the watchdog to come up; these tests look at
        # what it makes (the FIFO is made before it serves).
        wait_for(lambda: os.path.exists(self.fifo), 60, "the watchdog's FIFO")
        self.env = session_env(self.address, self.directory)
        root = proctree.ProcessId.of(os.getpid())
        assert root is not None
        self.root = root
        self.procs: list[subprocess.Popen[bytes]] = []
        self.report: dict[str, Any] | None = None

    @property
    def pid(self) -> int:
        return self.handle.pid

    def alive(self) -> bool:
        """The watchdog process still runs (and is no zombie)."""
        return self.handle.alive()

    def spawn(self, code: str, *args: str, **popen: Any) -> subprocess.Popen[bytes]:
        """A rank of this session: ``python -c code`` with the session's environment."""
        popen.setdefault("env", self.env)
        proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], **popen)
        self.procs.append(proc)
        return proc

    def write_fifo(self, data: bytes) -> None:
        """Write ``data`` to the torch file-timer FIFO the way FileTimerClient does."""
        fd = os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK)
        try:
            view = memoryview(data)
            while view:
                try:
                    view = view[os.write(fd, view) :]
                except BlockingIOError:
                    time.sleep(0.005)  # the watchdog reads as fast as it can
        finally:
            os.close(fd)

    def sync(self) -> dict[str, Any]:
        """Ask the watchdog for its "synced" answer: it read everything sent before."""
        with RawClient(self.address) as raw:
            answer = raw.ask(wire.encode("sync"), timeout=10)
        assert answer is not None, "the watchdog did not answer"
        return answer[1]

    def stop(self) -> dict[str, Any]:
        """End the session as the plugin does; returns the JSON report it wrote."""
        if self.report is None:
            for proc in self.procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait(10)
                for stream in (proc.stdin, proc.stdout, proc.stderr):
                    if stream is not None:
                        stream.close()
            self.handle.stop({"exitstatus": 0})
            # A watchdog that died wrote no report: {} (tests that expect one fail).
            exists = self.report_path.exists()
            self.report = json.loads(self.report_path.read_text()) if exists else {}
        return self.report


@pytest.fixture
def dog(tmp_path: Path) -> Iterator[Dog]:
    watchdog = Dog(tmp_path)
    try:
        yield watchdog
    finally:
        watchdog.stop()
        assert wait_gone(watchdog.pid, 5.0), "the watchdog outlived its session"


PROBE = """
import json, os, sys, time
import pytest_elastic_timer as et
from pytest_elastic_timer.scope import scopes

state = scopes.process_state()
print(json.dumps({"pid": os.getpid(), "attached": state.sock is not None}), flush=True)
for n, line in enumerate(sys.stdin):
    budget = float(line)
    start = time.monotonic()
    try:
        with et.expires(budget, scope=f"probe-{n}"):
            time.sleep(30)
        out = {"expired": False}
    except et.ScopeExpired as exc:
        out = {"expired": True, "elapsed": time.monotonic() - start, "scope": exc.scope}
    print(json.dumps(out), flush=True)
"""


class Probe:
    """A rank of ``dog``'s session that enters a real scope whenever asked."""

    def __init__(self, dog: Dog) -> None:
        self.proc = dog.spawn(PROBE, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        hello = self._read(20.0)
        assert hello["attached"], "the probe could not register with the watchdog"
        self.pid = int(hello["pid"])
        self.expiries = 0

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                raise AssertionError(f"the probe said nothing for {timeout}s")
        line = self.proc.stdout.readline()
        assert line, f"the probe exited (code {self.proc.poll()})"
        value: dict[str, Any] = json.loads(line)
        return value

    def expire(self, budget: float = 0.2) -> float:
        """Enter a scope of ``budget`` seconds around a sleep; asserts that it expired on
        time (at its deadline, no later than ``ON_TIME`` after it); returns the elapsed."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{budget}\n".encode())
        self.proc.stdin.flush()
        out = self._read(budget + 20.0)
        assert out["expired"], "the probe's scope never expired"
        self.expiries += 1
        elapsed = float(out["elapsed"])
        assert budget <= elapsed < budget + ON_TIME, f"expired after {elapsed:.3f}s"
        return elapsed


# -- processes outside the session -----------------------------------------------------
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _subreaper() -> bool:
    flag = ctypes.c_int(0)
    _libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0)
    return bool(flag.value)


def _set_subreaper(on: bool) -> None:
    _libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0)


DOUBLE_FORK = """
import os, sys
pid = os.fork()
if pid == 0:
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.execv(sys.executable, [sys.executable, "-c", *sys.argv[1:]])
print(pid, flush=True)
os._exit(0)
"""
SLEEPER = "import time; time.sleep(120)"


@contextlib.contextmanager
def outsider(
    root: proctree.ProcessId, code: str = SLEEPER, *args: str, env: dict[str, str] | None = None
) -> Iterator[psutil.Process]:
    """A process that is no member of ``root``'s session: started in a new session and
    double-forked, so that its parent is init (or an outer session's subreaper), never
    ``root`` or anything below it. Killed at the end."""
    # pytest-elastic-timer makes this process a child subreaper (leaks.py): an orphan
    # would be adopted by it and so be a member of the session after all. Not while we
    # fork this one.
    was_subreaper = _subreaper()
    _set_subreaper(False)
    try:
        middle = subprocess.run(
            [sys.executable, "-c", DOUBLE_FORK, textwrap.dedent(code), *args],
            stdout=subprocess.PIPE,
            start_new_session=True,
            env=env,
            timeout=30,
            check=True,
        )
    finally:
        if was_subreaper:
            _set_subreaper(True)
    proc = psutil.Process(int(middle.stdout))
    try:
        assert not proctree.is_descendant(proc.pid, root), "the outsider is in the session"
        assert proc.ppid() != os.getpid()
        yield proc
    finally:
        with contextlib.suppress(psutil.Error):
            proc.kill()
        wait_gone(proc.pid, 5.0)  # not our child: init (or an outer subreaper) reaps it


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    give_up = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > give_up:
            raise AssertionError(f"{what} within {timeout}s")
        time.sleep(0.02)
