"""Helpers for the tests: run an inner pytest session and read what it reported; talk to
a watchdog by hand (:class:`RawClient`, :func:`pump`, :func:`write_slot`); wait for a
process to go (:func:`wait_gone`)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from pytest_elastic_timer.core import table as tbl
from pytest_elastic_timer.core import wire

try:
    from pytest_elastic_timer.core.startup import ENV_DUMP_SIGNAL
except ImportError:  # a version without start-up stack dumps
    ENV_DUMP_SIGNAL = "PYTEST_ELASTIC_TIMER_DUMP_SIGNAL"

# Inner sessions load only what they need: the plugin under test (autoloaded, as for a
# user), pytest itself, no cache. The heavier third-party plugins of this environment
# would add a second of start-up to every inner session.
LEAN = (
    "-p",
    "no:cacheprovider",
    "-p",
    "no:asyncio",
    "-p",
    "no:hypothesispytest",
    "-p",
    "no:xdist",
    "-p",
    "no:timeout",
    "-p",
    "no:trio",
    # Libraries that tests/test_installed.py runs beside the plugin: where pyfakefs is
    # loaded, the plugin loads its report machinery up front.
    "-p",
    "no:fakefs",
    "-p",
    "no:socket",
)

# A test whose helper process (no scopes of its own, not a rank) sleeps in
# serve_forever() until the test's 2 s budget ends; the helper's pid is in helper.pid.
PLAIN_CHILD_TEST = '''
import subprocess
import sys

import pytest

HELPER = """
import time

def serve_forever():
    time.sleep(3600)

serve_forever()
"""


@pytest.mark.expires(2)
def test_plain():
    helper = subprocess.Popen([sys.executable, "-c", HELPER])
    with open("helper.pid", "w") as f:
        f.write(str(helper.pid))
    try:
        helper.wait()
    finally:
        helper.kill()
        helper.wait()
'''

# torch's own harness (MultiProcessTestCase, two gloo ranks): ``stuck_ranks(body)`` is a
# test module whose test_allreduce runs ``body`` (indented 8) in each rank once the
# process group is up.
STUCK_RANKS = """
import time

import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcessTestCase


class StuckRanks(MultiProcessTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def test_allreduce(self):
        dist.init_process_group(
            "gloo", init_method=f"file://{self.file_name}", rank=self.rank, world_size=2
        )
__BODY__"""


def stuck_ranks(body: str) -> str:
    """The :data:`STUCK_RANKS` module with ``body`` in its test."""
    return STUCK_RANKS.replace("__BODY__", body)


HEADER = re.compile(
    r"^elastic-timer: watchdog pid (\d+), default budget (\S+), grace (\S+), scale (\S+)$"
)
# The line xdist puts first in a worker's failure section.
WORKER_LINE = re.compile(r"^\[gw\d+\] \S+ -- Python ")
REPORT_NAME = "elastic-report.json"
CONTRACT_FIELDS = (
    "nodeid",
    "scope",
    "budget",
    "elapsed",
    "pid",
    "label",
    "worker",
    "file",
    "line",
    "action",
    "stack",
    "host",
)


def scope_line(scope: str, budget: str, action: str = "interrupted") -> re.Pattern[str]:
    """The first line of every report of an expiry, with any elapsed time."""
    return re.compile(
        rf"^scope {re.escape(repr(scope))} expired after (\d+\.\d\d)s "
        rf"\(budget {re.escape(budget)}s\): {action}$"
    )


def loaded_psutil(pid: int) -> bool:
    """Whether process ``pid`` has loaded psutil (its C extension is mapped): a watchdog
    that has loaded its modules."""
    with open(f"/proc/{pid}/maps", encoding="utf-8") as f:
        return "_psutil_linux" in f.read()


def wait_gone(pid: int, timeout: float) -> bool:
    """Whether process ``pid`` ends (or is a zombie) within ``timeout`` seconds."""
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.02)
    return False


# A test module's start: ``_rank(path)``, a process that writes its pid to ``path`` and
# sleeps for an hour (for a test that starts ranks with multiprocessing and hangs).
SLEEPING_RANK = """
import multiprocessing
import os
import time

import pytest


def _rank(path):
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(path + ".tmp", path)
    time.sleep(3600)
"""


def reap(pid: int) -> None:
    """Kill ``pid`` (a process this test made sure is its own to end) and reap it if it
    was adopted by this process (the suite's pytest is a child subreaper too)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, 0)
    assert wait_gone(pid, 5.0)


@dataclass
class Session:
    """One finished inner pytest session."""

    result: pytest.RunResult
    seconds: float
    stdout: str
    stderr: str
    report: dict[str, Any] | None
    watchdog_pid: int | None

    @property
    def text(self) -> str:
        return self.stdout + "\n" + self.stderr

    @property
    def lines(self) -> list[str]:
        return self.text.splitlines()

    def record(self, scope: str) -> dict[str, Any]:
        """The JSON report's record of ``scope`` (exactly one must exist)."""
        assert self.report is not None, "no JSON report was written"
        found = [r for r in self.report["expired"] if r["scope"] == scope]
        scopes = [r["scope"] for r in self.report["expired"]]
        assert len(found) == 1, f"records for {scope!r}: {found!r}; all scopes: {scopes}"
        return found[0]

    def failure_lead(self, name: str) -> str:
        """The first line of the failure (or error) section of test ``name`` (after
        the ``[gw0] linux -- Python ...`` line that xdist puts first)."""
        pattern = re.compile(rf"^_+ (ERROR at \w+ of )?{re.escape(name)} _+$")
        lines = self.stdout.splitlines()
        for index, line in enumerate(lines):
            if pattern.match(line):
                return next(
                    (s for s in lines[index + 1 :] if s.strip() and not WORKER_LINE.match(s)),
                    "",
                )
        raise AssertionError(f"no failure section for {name!r} in:\n{self.stdout}")

    def assert_expired(self, test: str, scope: str, budget: float) -> dict[str, Any]:
        """Test ``test`` failed in about ``budget`` because ``scope`` expired: the scope
        line leads its failure and the JSON report has the record (returned)."""
        lead = self.failure_lead(test)
        assert scope_line(scope, f"{budget:g}").match(lead), lead
        record = self.record(scope)
        assert_in_budget(self, record, budget)
        return record

    def assert_clean(self) -> None:
        """Never an INTERNALERROR or a crash of pytest, and the watchdog is gone."""
        assert "INTERNALERROR" not in self.text
        assert "Traceback (most recent call last)" not in self.stderr, self.stderr
        if self.watchdog_pid is not None:
            assert wait_gone(self.watchdog_pid, 3.0), "the watchdog outlived its session"

    def assert_usage_error(self, error: str) -> None:
        """pytest stopped with a usage error whose one ``ERROR:`` line says ``error``,
        cleanly, before it started a watchdog."""
        self.assert_clean()
        assert self.result.ret == pytest.ExitCode.USAGE_ERROR
        errors = [s for s in self.stderr.splitlines() if s.startswith("ERROR: ")]
        assert errors == [f"ERROR: {error}"], self.stderr
        assert self.watchdog_pid is None


@contextlib.contextmanager
def top_level_environment() -> Iterator[None]:
    """Start a pytest like a user's shell would: without the stack-dump set-up that the
    outer session (the one running these tests) gives every process it starts.

    The outer session's ``PYTEST_ELASTIC_TIMER`` address stays: the inner session
    replaces it with its own watchdog's (see test_nested_session_dumps_stacks for the
    inner session that inherits everything).
    """
    saved = os.environ.pop(ENV_DUMP_SIGNAL, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[ENV_DUMP_SIGNAL] = saved


def run(
    pytester: pytest.Pytester,
    *args: str,
    report: bool = True,
    lean: bool = True,
    nested: bool = False,
    timeout: float = 60,
) -> Session:
    """Run pytest in a subprocess in ``pytester.path`` (a real watchdog starts)."""
    report_path = pytester.path / REPORT_NAME
    extra = [f"--elastic-timer-report={report_path}"] if report else []
    started = time.monotonic()
    with contextlib.nullcontext() if nested else top_level_environment():
        try:
            result = pytester.runpytest_subprocess(
                *(LEAN if lean else ()), *extra, *args, timeout=timeout
            )
        except pytester.TimeoutExpired:
            out, err = _read(pytester.path / "stdout"), _read(pytester.path / "stderr")
            raise AssertionError(
                f"the inner session ran over {timeout}s\n--- stdout\n{out}\n--- stderr\n{err}"
            ) from None
    seconds = time.monotonic() - started
    watchdog_pid = None
    for line in result.outlines:
        match = HEADER.match(line)
        if match:
            watchdog_pid = int(match.group(1))
            break
    # When the watchdog had to end pytest, it writes its summary and the JSON report
    # once pytest is gone: wait for it, then read its output again.
    if watchdog_pid is not None:
        wait_gone(watchdog_pid, 5.0)
    loaded = None
    if report and report_path.exists():
        loaded = json.loads(report_path.read_text())
    return Session(
        result,
        seconds,
        _read(pytester.path / "stdout"),
        _read(pytester.path / "stderr"),
        loaded,
        watchdog_pid,
    )


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""


def assert_in_budget(session: Session, record: dict[str, Any], budget: float) -> None:
    """The scope failed in about its budget: generous bounds, no speed targets."""
    assert session.seconds < budget + 10
    assert record["budget"] == pytest.approx(budget)
    assert budget <= record["elapsed"] < budget + 3


# -- the failure entries of an inner session's terminal output -----------------------
def failure_block(session: Session, name: str) -> str:
    """The text of test ``name``'s failure (or error) entry, up to the next entry."""
    lines = session.stdout.splitlines()
    # xdist's loadgroup may add "@group" to the name (depending on the pytest version).
    head = re.compile(rf"^_+ (ERROR at \w+ of )?{re.escape(name)}(@\w+)? _+$")
    start = next((i for i, line in enumerate(lines) if head.match(line)), None)
    assert start is not None, f"no failure entry for {name!r} in:\n{session.stdout}"
    end = start + 1
    while end < len(lines) and not re.match(r"^(_{3,} \S.* _{3,}|={3,} .* ={3,})$", lines[end]):
        end += 1
    return "\n".join(lines[start:end])


def sections(block: str, title: str) -> list[str]:
    """The texts of every report section in ``block`` (a ``---- title ----`` line and
    what follows) whose title starts with ``title``."""
    lines = block.splitlines()
    head = re.compile(rf"^-+ {re.escape(title)}.* -+$")
    found = []
    for start, line in enumerate(lines):
        if head.match(line):
            end = start + 1
            while end < len(lines) and not re.match(r"^-{3,} .* -{3,}$", lines[end]):
                end += 1
            found.append("\n".join(lines[start + 1 : end]))
    return found


def section(block: str, title: str) -> str:
    """The text of the first report section in ``block`` whose title starts with
    ``title``."""
    found = sections(block, title)
    assert found, f"no section {title!r} in:\n{block}"
    return found[0]


def lead(session: Session, name: str) -> str:
    """The first line of test ``name``'s failure, after xdist's ``[gw0] linux -- ...``."""
    lines = failure_block(session, name).splitlines()[1:]
    return next((s for s in lines if s.strip() and not re.match(r"^\[gw\d+\] ", s)), "")


# -- a watchdog by hand ------------------------------------------------------------------
def pump(dog: Any, until: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Run ``dog``'s loop (a watchdog in this process) step by step until ``until()``
    holds; whether it held within ``timeout`` seconds."""
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        if until():
            return True
        dog.run_once(max_wait=0.01)
    return until()


def write_slot(
    table: tbl.ScopeTable,
    index: int,
    *,
    serial: int,
    deadline: float,
    start: float = 0.0,
    thread_id: int = 1,
    path_sid: int = 0,
    site_sid: int = 0,
    nodeid_sid: int = 0,
    grace: float = 0.0,
    depth: int = 0,
    flags: int = 0,
) -> None:
    """Open slot ``index`` of ``table`` as an owner would, fields by name."""
    table.write_slot(
        index,
        serial,
        deadline,
        start,
        thread_id,
        path_sid,
        site_sid,
        nodeid_sid,
        grace,
        depth,
        flags,
    )


class RawClient:
    """A hand-made connection to a watchdog socket: any datagram, as is. The one raw
    client of the tests (a watchdog run in the test's own process takes :func:`pump`
    between a send and an answer)."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # Large enough for a datagram over wire.MAX_MESSAGE (root may force it).
        with contextlib.suppress(OSError):
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * wire.MAX_MESSAGE)
        with contextlib.suppress(OSError, AttributeError):
            force = getattr(socket, "SO_SNDBUFFORCE", 32)
            self.sock.setsockopt(socket.SOL_SOCKET, force, 4 * wire.MAX_MESSAGE)
        self.sock.connect(address)

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, data: bytes) -> None:
        self.sock.settimeout(10)
        self.sock.send(data)

    def ask(self, data: bytes, timeout: float = 2.0) -> tuple[str, dict[str, Any]] | None:
        """Send ``data``; the answer, or None if none came within ``timeout``."""
        self.send(data)
        self.sock.settimeout(timeout)
        try:
            answer = self.sock.recv(wire.MAX_MESSAGE)
        except (TimeoutError, ConnectionError):
            return None
        return wire.decode(answer) if answer else None

    def closed_by_peer(self, timeout: float = 3.0) -> bool:
        """Whether the other side closed this connection (EOF) within ``timeout``."""
        self.sock.settimeout(timeout)
        try:
            return self.sock.recv(1) == b""
        except TimeoutError:
            return False
        except ConnectionError:
            return True

    def close(self) -> None:
        self.sock.close()
