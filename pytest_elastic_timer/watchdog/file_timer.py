"""torch ``FileTimerClient`` requests, enforced by the session's watchdog.

The session exports ``TORCHELASTIC_TIMER_FILE``, the path of a FIFO in its private
directory. torch's ``FileTimerClient`` writes one JSON line per request there:
``{"version": 1, "pid": ..., "scope_id": ..., "expiration_time": <time.time()>,
"signal": ...}``, with a negative ``expiration_time`` for a release. A FIFO carries no
peer credentials, so the pid in the request is honoured only for a process of this
session (a descendant of the pytest process, checked with its start time against pid
reuse); anything else is dropped and counted.

Each requesting process gets a scope table in the watchdog's own memory, into which the
watchdog writes the slots itself: from there the usual scan and escalation ladder apply
(no interrupt -- such a process has no handler for it -- but a stack dump where the
session's start-up hook installed one, then termination of its process tree).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from typing import TYPE_CHECKING, Any

from pytest_elastic_timer.core import startup
from pytest_elastic_timer.core import table as tbl

if TYPE_CHECKING:
    from pytest_elastic_timer.watchdog.server import Owner, Watchdog

FIFO_NAME = "torch-timer.fifo"
ENV_FILE = "TORCHELASTIC_TIMER_FILE"
MAX_LINE = 4096  # torch refuses requests above PIPE_BUF; we allow a little more


class FileTimerIntake:
    """Reads the FIFO and turns requests into slots of per-process tables."""

    def __init__(self, dog: Watchdog) -> None:
        self.dog = dog
        self.path = os.path.join(dog.directory, FIFO_NAME)
        os.mkfifo(self.path, 0o600)
        self.read_fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        # Our own writer keeps the FIFO open: no EOF when the last client closes it.
        self.keep_fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
        self.buffer = b""
        self.scopes: dict[tuple[int, str], int] = {}  # (pid, scope_id) -> slot
        self.free: dict[int, list[int]] = {}
        self.serials = iter(range(1, 1 << 62))

    def close(self) -> None:
        for fd in (self.read_fd, self.keep_fd):
            with contextlib.suppress(OSError):
                os.close(fd)

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
                self.dog.dropped += 1

    def handle(self, line: bytes) -> None:
        request = _parse(line)
        if request is None:
            self.dog.dropped += 1
            return
        pid, scope_id, expiration = request
        owner = self._owner(pid)
        if owner is None:
            self.dog.dropped += 1  # not a process of this session
            return
        key = (pid, scope_id)
        old = self.scopes.pop(key, None)
        if old is not None:
            owner.table.clear_slot(old)
            self.free[pid].append(old)
        if expiration < 0:
            return
        now = time.monotonic()
        deadline = now + (expiration - time.time())
        slot = self._alloc(owner)
        self.scopes[key] = slot
        table = owner.table
        file, _, line_no = scope_id.rpartition("#")  # torch's default: "file#line"
        site = f"{file}:{line_no}" if file and line_no.isdigit() else ""
        nodeid = proctree_env(owner, "PYTEST_CURRENT_TEST").rsplit(" (", 1)[0]
        table.write_slot(
            slot,
            next(self.serials),
            deadline,
            now,
            0,
            table.add_string(scope_id),
            table.add_string(site) if site else 0,
            table.add_string(nodeid) if nodeid else 0,
            0.0,
            0,
            0,
        )
        self.dog.schedule_scan(owner, deadline)

    def _alloc(self, owner: Owner) -> int:
        free = self.free.setdefault(owner.pid, [])
        if free:
            return free.pop()
        index = int(owner.table.words[tbl.H_HWM])
        owner.table.words[tbl.H_HWM] = index + 1
        return index

    def _owner(self, pid: int) -> Owner | None:
        from pytest_elastic_timer.watchdog import proctree
        from pytest_elastic_timer.watchdog.server import Owner

        owner = self.dog.foreign.get(pid)
        if owner is not None and proctree.alive([owner.proc]):
            return owner
        if not proctree.is_descendant(pid, self.dog.root) or pid == os.getpid():
            return None
        ident = proctree.ProcessId.of(pid)
        proc = ident.process() if ident else None
        if ident is None or proc is None:
            return None
        table = tbl.ScopeTable.create(None)
        dump_sig = self.dog.dump_signal
        owner = Owner(ident, proc, table, None, startup.dump_path(self.dog.directory, pid))
        table.words[tbl.H_PID] = pid
        table.words[tbl.H_INTERRUPT_SIG] = 0  # it has no handler: no soft interrupt
        table.words[tbl.H_DUMP_SIG] = dump_sig if startup.catches(pid, dump_sig) else 0
        table.words[tbl.H_LABEL_SID] = table.add_string(proctree.label_of(proc))
        worker = proctree_env(owner, "PYTEST_XDIST_WORKER")
        table.words[tbl.H_WORKER_SID] = table.add_string(worker) if worker else 0
        self.dog.foreign[pid] = owner
        self.free[pid] = []
        return owner


def proctree_env(owner: Owner, name: str) -> str:
    try:
        return str(owner.proc.environ().get(name, ""))
    except Exception:  # gone, or not ours to read
        return ""


def _parse(line: bytes) -> tuple[int, str, float] | None:
    """(pid, scope_id, expiration_time) of a well-formed request, else None."""
    try:
        value = json.loads(line)
    except (ValueError, UnicodeDecodeError):
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
    return pid, scope_id, float(expiration)
