"""torch ``FileTimerClient`` requests, enforced by the session's watchdog.

The session exports ``TORCHELASTIC_TIMER_FILE``, the path of a FIFO in its private
directory. torch's ``FileTimerClient`` writes one JSON line per request there:
``{"version": 1, "pid": ..., "scope_id": ..., "expiration_time": <time.time()>,
"signal": ...}``, with a negative ``expiration_time`` for a release. A FIFO carries no
peer credentials, so the pid in the request is honoured only for a process of this
session (a descendant of the pytest process, checked with its start time against pid
reuse); anything else is dropped and counted.

Each requesting process is adopted by the watchdog, which keeps a scope table for it in
its own memory; this intake writes the slots into it. From there the usual scan and
escalation ladder apply (no interrupt -- such a process has no handler for it -- but a
stack dump where the session's start-up hook installed one, then the end of its process
tree, by the request's signal as torch's server sends it; a signal of 0 or below leaves
the process running, as torch does, and the expiry is only recorded).

torch's elastic agent takes the path over when the code under test starts it with
``TORCHELASTIC_ENABLE_FILE_TIMER=1`` (torchrun, ``elastic_launch``): its
``FileTimerServer`` removes the FIFO there, makes its own, and removes that when it
stops. Its workers' requests are then enforced by that server, as the test asked. A
process of the session that finds the path changed after a test asks for op
``torch_timer_file`` (:mod:`pytest_elastic_timer.plugin.torch_timer_file`), and the FIFO
is made again where no server reads what is there now.

An intake: it uses only its :class:`~.host.TableHost` and is plugged into the watchdog
by the wiring (:func:`pytest_elastic_timer.watchdog.wiring.build`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import signal
import socket
import stat
import time
from collections.abc import Iterator
from typing import Any

from pytest_elastic_timer.core import startup
from pytest_elastic_timer.core import table as tbl
from pytest_elastic_timer.watchdog.host import Adopted, TableHost

FIFO_NAME = startup.TORCH_TIMER_FIFO
ENV_FILE = startup.ENV_TORCH_TIMER_FILE
MAX_LINE = 4096  # torch refuses requests above PIPE_BUF; we allow a little more
# A process's requests are numbered from here up: a record is known by its process and
# serial, and the process's own scopes count from 1 (the session's barrier, event and
# lock timeouts from -1 down). A request's record superseded a scope's of the same
# number, in the pytest process that also runs the test's phase scopes.
FIRST_SERIAL = (1 << 32) + 1


class FileTimerIntake:
    """Reads the FIFO and turns requests into slots of adopted processes' tables."""

    def __init__(self, host: TableHost, directory: str, read_fd: int = -1) -> None:
        """Serve the FIFO in ``directory``: the one whose read end ``read_fd`` is (made
        by the plugin, so torch clients can open it before this process runs), or a
        new one."""
        self.host = host
        self.path = os.path.join(directory, FIFO_NAME)
        if read_fd < 0:
            os.mkfifo(self.path, 0o600)
            read_fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        self.read_fd = read_fd
        # Our own writer keeps the FIFO open: no EOF when the last client closes it.
        self.keep_fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
        self.buffer = b""
        self.scopes: dict[tuple[int, str], int] = {}  # (pid, scope_id) -> slot
        self.tables: dict[int, tbl.ScopeTable] = {}  # pid -> the table its slots are in
        self.free: dict[int, list[int]] = {}
        self.serials: dict[int, Iterator[int]] = {}  # pid -> its requests' serials

    def close(self) -> None:
        for fd in (self.read_fd, self.keep_fd):
            with contextlib.suppress(OSError):
                os.close(fd)

    def handlers(self) -> dict[str, Any]:
        return {"torch_timer_file": self.keep_in_place}

    def keep_in_place(self, conn: socket.socket, peer_pid: int, fields: dict[str, Any]) -> None:
        """Op ``torch_timer_file``: put the FIFO back at its path if it is gone; the
        answer names what is at the path now, so that the asker knows it next time."""
        self.restore()
        self.host.send(conn, "torch_timer_file", identity=startup.file_identity(self.path))

    def restore(self) -> bool:
        """Make a new FIFO at the path, and read it, unless the path is this intake's
        FIFO or a FIFO that another server reads (torch's, while its agent runs: it
        removes the path when it stops). Whether a new one was made."""
        at_path = startup.file_identity(self.path)
        if at_path == startup.file_identity(self.read_fd) or (at_path and _has_reader(self.path)):
            return False
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a FIFO nobody reads (its server was killed), or worse
        os.mkfifo(self.path, 0o600)
        read_fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        keep_fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
        self.readable()  # what the old FIFO still holds
        self.host.remove_reader(self.read_fd)
        self.close()
        self.read_fd, self.keep_fd, self.buffer = read_fd, keep_fd, b""
        self.host.add_reader(read_fd, self.readable)
        return True

    def readable(self, _fd: Any = None) -> None:
        while True:
            try:
                data = os.read(self.read_fd, 65536)
            except BlockingIOError:
                return
            if not data:
                return
            self.buffer += data
            while b"\n" in self.buffer:
                line, self.buffer = self.buffer.split(b"\n", 1)
                self.handle(line)
            if len(self.buffer) > MAX_LINE:  # a line that never ends is dropped
                self.buffer = b""
                self.host.drop()

    def handle(self, line: bytes) -> None:
        request = _parse(line)
        if request is None:
            self.host.drop()
            return
        pid, scope_id, expiration, signum = request
        owner = self._owner(pid)
        if owner is None:
            self.host.drop()  # not a process of this session
            return
        key = (pid, scope_id)
        old = self.scopes.pop(key, None)
        if old is not None:
            owner.table.clear_slot(old)
            self.free[pid].append(old)
        if expiration < 0:
            return
        now = self.host.clock()
        # torch's deadline is wall-clock time: what is left of it is the budget, scaled
        # like every budget of the session; one already past is a budget of 0, as for
        # et.TimerClient (after=0 reaches us a few milliseconds late).
        deadline = now + max(0.0, expiration - time.time()) * self.host.scale
        slot = self._alloc(owner)
        self.scopes[key] = slot
        table = owner.table
        site = _site_of(scope_id)
        nodeid = owner.current_test()
        table.write_slot(
            slot,
            next(self.serials.setdefault(pid, itertools.count(FIRST_SERIAL))),
            deadline,
            now,
            0,
            table.add_string(scope_id),
            table.add_string(site) if site else 0,
            table.add_string(nodeid) if nodeid else 0,
            0.0,
            0,
            tbl.end_flags(signum),
        )
        self.host.wake(pid, deadline)

    def _alloc(self, owner: Adopted) -> int:
        free = self.free.setdefault(owner.pid, [])
        if free:
            return free.pop()
        index = int(owner.table.words[tbl.H_HWM])
        owner.table.words[tbl.H_HWM] = index + 1
        return index

    def _owner(self, pid: int) -> Adopted | None:
        owner = self.host.adopt(pid)
        if owner is not None and self.tables.get(pid) is not owner.table:
            # Adopted anew (a first request, or its pid was reused): a fresh table.
            self.tables[pid] = owner.table
            self.free[pid] = []
            self.scopes = {k: v for k, v in self.scopes.items() if k[0] != pid}
        return owner


def _site_of(scope_id: str) -> str:
    """``file:line`` of torch's default scope name, ``"file#line"`` ("" for another).

    torch's ``expires()`` names the frame above its own, which, inside its
    ``@contextmanager``, is contextlib's ``__enter__``, not the ``with`` line: a site
    that says nothing, and the request carries no other. Such a scope has no site."""
    file, _, line_no = scope_id.rpartition("#")
    if not file or not line_no.isdigit() or os.path.basename(file) == "contextlib.py":
        return ""
    return f"{file}:{line_no}"


def _has_reader(path: str) -> bool:
    """Whether a process reads the FIFO at ``path`` (opening it to write, without
    blocking, fails where none does; what is not a FIFO has none)."""
    try:
        if not stat.S_ISFIFO(os.lstat(path).st_mode):
            return False
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return False
    os.close(fd)
    return True


def _parse(line: bytes) -> tuple[int, str, float, int] | None:
    """(pid, scope_id, expiration_time, signal) of a well-formed request, else None.

    The signal is torch's: the one that ends the process at the expiry, or 0 or below
    to leave it running. One that is missing or no signal of this system is the
    SIGTERM of the session's ladder, so that the scope is still enforced."""
    try:
        value = json.loads(line)
    except (ValueError, UnicodeDecodeError, RecursionError):  # b"[" * 1000 nests too deep
        return None
    if not isinstance(value, dict):
        return None
    pid, scope_id, expiration = (
        value.get("pid"),
        value.get("scope_id"),
        value.get("expiration_time"),
    )
    if (
        not isinstance(pid, int)
        or isinstance(pid, bool)
        or pid <= 0
        or not isinstance(scope_id, str)
        or len(scope_id) > MAX_LINE
        or not isinstance(expiration, (int, float))
        or isinstance(expiration, bool)
        or not math.isfinite(expiration)
    ):
        return None
    signum = value.get("signal")
    if not isinstance(signum, int) or isinstance(signum, bool) or signum >= signal.NSIG:
        signum = signal.SIGTERM
    return pid, scope_id, float(expiration), signum
