"""The watchdog: one process per session, outside every test process.

It accepts connections from the session's processes on a Unix socket in the session's
private directory, maps each process's scope table, sleeps until the earliest deadline
it was told about, and runs the escalation ladder on every scope still open past its
deadline:

1. interrupt -- the owner's interrupt signal raises ``ScopeExpired`` in the owning thread;
2. dump      -- after the grace period, faulthandler dumps every thread (a signal
   handler in C, so it works while a C call holds the GIL);
3. terminate -- SIGTERM to the owner's process tree, children first, SIGKILL to what
   survives;
4. record    -- one JSON line per expired scope, appended at once to ``records.jsonl``.

It exits by itself when its parent (the pytest process) dies: that closes its stdin.
Nothing here imports pytest. Run as ``python -m pytest_elastic_timer.watchdog``.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import inspect
import itertools
import json
import os
import selectors
import shutil
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import psutil

from pytest_elastic_timer.ci import junit_fallback
from pytest_elastic_timer.core import records, startup, wire
from pytest_elastic_timer.core import table as tbl
from pytest_elastic_timer.sync import server as sync_server
from pytest_elastic_timer.watchdog import file_timer, proctree

SOCKET_NAME = "watchdog.sock"
RECORDS_NAME = "records.jsonl"
_UCRED = struct.Struct("3i")
_CHECK_EVERY = 0.01  # how often a scope in its grace period is looked at
_RECHECK_AFTER = 0.05  # second look after a scan, in case a slot store was not yet visible
_LONGEST_WAIT = 3600.0  # select() refuses timeouts of about 25 days and more


@dataclass
class Expiry:
    """A scope past its deadline, while its escalation runs."""

    slot: int
    serial: int
    path: str
    site: str
    nodeid: str
    start: float
    deadline: float
    grace: float
    thread_id: int
    report: dict[str, Any] | None = None  # what the owner said when it raised
    children: list[dict[str, Any]] = field(default_factory=list)  # their stacks at expiry
    recorded: bool = False  # a preliminary record was written
    steps: Generator[float, None, None] | None = None


@dataclass
class Owner:
    """A registered process: its identity, its table, its connection."""

    ident: proctree.ProcessId
    proc: psutil.Process
    table: tbl.ScopeTable
    conn: socket.socket | None
    dump_path: str
    expiries: dict[int, Expiry] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)
    reports: dict[int, dict[str, Any]] = field(default_factory=dict)
    next_scan: float = float("inf")

    @property
    def pid(self) -> int:
        return self.ident.pid

    def header_text(self, word: int) -> str:
        return self.table.string(int(self.table.words[word]))


class Watchdog:
    """The session's watchdog; :meth:`run_once` is one turn of its event loop."""

    def __init__(
        self,
        directory: str,
        *,
        root: proctree.ProcessId,
        grace: float = 2.0,
        kill_after: float = 1.0,
        scale: float = 1.0,
        report_path: str | None = None,
        session: dict[str, Any] | None = None,
        control: Any = None,
        dump_signal: int = 0,
    ) -> None:
        self.directory = directory
        self.address = os.path.join(directory, SOCKET_NAME)
        self.records_path = os.path.join(directory, RECORDS_NAME)
        self.root = root
        self.grace = grace
        self.kill_after = kill_after
        self.scale = scale
        self.report_path = report_path
        self.dump_signal = dump_signal  # every Python process of the session dumps on it
        self.session = dict(session or {})
        self.session.setdefault("started", time.time())
        self.session.setdefault("host", socket.gethostname())  # what merged reports name
        self.records: list[records.ExpiryRecord] = []
        self.owners: dict[int, Owner] = {}
        self.foreign: dict[int, Owner] = {}  # processes known only from torch file timers
        self.by_conn: dict[socket.socket, Owner | None] = {}
        self.dropped = 0
        self.stopping = False
        self.root_died = False
        self.workers: set[str] = set()
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.sel = selectors.DefaultSelector()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(self.address)
        os.chmod(self.address, 0o600)
        self.listener.listen(128)
        self.listener.setblocking(False)
        self.sel.register(self.listener, selectors.EVENT_READ, self._accept)
        self.control = control
        if control is not None:
            os.set_blocking(control.fileno(), False)
            self.sel.register(control, selectors.EVENT_READ, self._control)
        self._control_buffer = b""
        # Extension points: ops handled outside this module, called as
        # handler(conn, peer_pid, fields); callbacks told of every closed connection;
        # callbacks run at the end of the session with the watchdog as argument.
        self.extensions: dict[str, Callable[[socket.socket, int, dict[str, Any]], None]] = {}
        self.on_disconnect: list[Callable[[socket.socket], None]] = []
        self.on_finish: list[Callable[[Watchdog], None]] = []
        self.junit_fallback: str | None = None  # JUnit XML written if pytest dies first
        self.trace = False  # clients record every scope into trace-<pid>-* files
        # (pid, serial, action) of records already printed because pytest was ended
        self.summary_printed: set[tuple[int, int, str]] = set()
        sync_server.install(self)
        self.file_timers = file_timer.FileTimerIntake(self)
        self.sel.register(self.file_timers.read_fd, selectors.EVENT_READ, self.file_timers.readable)

    def all_owners(self) -> list[Owner]:
        return [*self.owners.values(), *self.foreign.values()]

    # -- the loop -----------------------------------------------------------------
    def serve(self) -> None:
        try:
            while not self.stopping:
                self.run_once()
        except _Terminated:
            self.root_died = True  # whoever ended us may end pytest too: report now
        self.finish()

    def run_once(self, max_wait: float | None = None) -> None:
        """Wait for a message or the next due timer, then handle everything due."""
        now = time.monotonic()
        timeout = max(0.0, self._timers[0][0] - now) if self._timers else None
        if timeout is not None:
            timeout = min(timeout, _LONGEST_WAIT)  # select() refuses ~25 days and more
        if max_wait is not None:
            timeout = max_wait if timeout is None else min(timeout, max_wait)
        for key, _ in self.sel.select(timeout):
            key.data(key.fileobj)
        self._run_due_timers()

    def _run_due_timers(self) -> None:
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            _, _, callback = heapq.heappop(self._timers)
            callback()

    def call_at(self, when: float, callback: Callable[[], None]) -> None:
        heapq.heappush(self._timers, (when, next(self._seq), callback))

    # -- connections --------------------------------------------------------------
    def _accept(self, listener: Any) -> None:
        try:
            conn, _ = self.listener.accept()
        except BlockingIOError:
            return
        if not hasattr(socket, "SO_PEERCRED"):  # not Linux: see docs/platforms.md
            conn.close()
            self.dropped += 1
            return
        pid, uid, _ = _UCRED.unpack(
            conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        )
        if uid != os.getuid() or not proctree.is_descendant(pid, self.root):
            # Another user, or a process of this user outside the session: refused.
            self.dropped += 1
            conn.close()
            return
        conn.setblocking(False)
        self.by_conn[conn] = None
        self.sel.register(conn, selectors.EVENT_READ, lambda c: self._readable(c, pid))

    def _readable(self, conn: socket.socket, peer_pid: int) -> None:
        reset_seen = False
        while True:
            try:
                data = conn.recv(wire.MAX_MESSAGE + 1)
            except BlockingIOError:
                return
            except ConnectionResetError:
                # A peer that closed with an answer of ours unread: Linux says so once,
                # *before* the datagrams it sent (an "expired" report, say), which are
                # still queued. Read on; a second reset ends the connection.
                if reset_seen:
                    data = b""
                else:
                    reset_seen = True
                    continue
            except OSError:
                data = b""
            if not data:
                self._disconnected(conn)
                return
            try:
                op, fields = wire.decode(data)
                self._dispatch(conn, peer_pid, op, fields)
            except (wire.BadMessage, ValueError, TypeError, KeyError, OSError, RecursionError):
                self.dropped += 1

    def _dispatch(
        self, conn: socket.socket, peer_pid: int, op: str, fields: dict[str, Any]
    ) -> None:
        owner = self.by_conn.get(conn)
        extension = self.extensions.get(op)
        if extension is not None:
            # Extension ops (synchronization primitives) need no hello: a peer's
            # credentials were checked when it connected.
            extension(conn, peer_pid, fields)
        elif op == "hello":
            self._hello(conn, peer_pid, fields)
        elif owner is None:
            raise wire.BadMessage(f"{op!r} before hello")
        elif op == "wake":
            at = float(wire.field(fields, "at", (int, float)))
            self.schedule_scan(owner, at)
        elif op == "expired":
            self._reported(owner, fields)
        elif op == "sync":
            self.check_expiries()
            pending = [
                {"pid": o.pid, "worker": o.header_text(tbl.H_WORKER_SID), "nodeid": e.nodeid}
                for o in self.all_owners()
                for e in o.expiries.values()
            ]
            self._send(conn, "synced", records=len(self.records), pending=pending)
        else:
            raise wire.BadMessage(f"unknown op {op!r}")

    def _send(self, conn: socket.socket, op: str, **fields: Any) -> None:
        with contextlib.suppress(OSError):
            conn.send(wire.encode(op, **fields))

    def _hello(self, conn: socket.socket, peer_pid: int, fields: dict[str, Any]) -> None:
        if self.by_conn.get(conn) is not None:
            raise wire.BadMessage("second hello")
        # The pid in the message must be the kernel's word for the peer.
        if wire.field(fields, "pid", int) != peer_pid:
            self._send(conn, "refused", error="pid does not match the connection")
            raise wire.BadMessage("pid mismatch")
        path = os.path.realpath(wire.field(fields, "table", str))
        if os.path.dirname(path) != os.path.realpath(self.directory) or not os.path.basename(
            path
        ).startswith(f"table-{peer_pid}-"):
            self._send(conn, "refused", error="table outside the session directory")
            raise wire.BadMessage("bad table path")
        dump = wire.field(fields, "dump", str)
        if dump and os.path.dirname(os.path.realpath(dump)) != os.path.realpath(self.directory):
            dump = ""
        ident = proctree.ProcessId.of(peer_pid)
        proc = ident.process() if ident else None
        if ident is None or proc is None:
            raise wire.BadMessage("peer is gone")
        table = tbl.ScopeTable.open(path)
        if table.words[tbl.H_PID] != peer_pid:
            table.close()
            raise wire.BadMessage("table of another process")
        owner = Owner(ident, proc, table, conn, dump)
        self.by_conn[conn] = owner
        previous = self.owners.get(peer_pid)
        if previous is not None and previous.conn is not None and previous.conn is not conn:
            self._disconnected(previous.conn)
        self.owners[peer_pid] = owner
        worker = owner.header_text(tbl.H_WORKER_SID)
        if worker:
            self.workers.add(worker)
        self._send(
            conn, "welcome", pid=os.getpid(), scale=self.scale, grace=self.grace, trace=self.trace
        )

    def _disconnected(self, conn: socket.socket) -> None:
        for callback in self.on_disconnect:
            callback(conn)
        owner = self.by_conn.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(conn)
        conn.close()
        if owner is not None:
            owner.conn = None
            # A process that exits with scopes open (killed, os._exit) is looked at
            # once more: its table outlives it, so the record can still be made.
            self._scan(owner)

    def _control(self, stream: Any) -> None:
        try:
            data = os.read(stream.fileno(), 65536)
        except BlockingIOError:
            return
        if not data:  # stdin closed: after "stop", or because the pytest process is gone
            self.root_died = not self.stopping
            self.stopping = True
            self.sel.unregister(stream)
            return
        self._control_buffer += data
        while b"\n" in self._control_buffer:
            line, self._control_buffer = self._control_buffer.split(b"\n", 1)
            try:
                command = json.loads(line)
            except ValueError:
                self.dropped += 1
                continue
            if isinstance(command, dict) and command.get("op") == "stop":
                self.session.update(command.get("session") or {})
                self.stopping = True

    # -- deadlines ----------------------------------------------------------------
    def schedule_scan(self, owner: Owner, at: float, *, recheck: bool = True) -> None:
        if at >= owner.next_scan:
            return
        owner.next_scan = at
        self.call_at(at, lambda: self._scan(owner, recheck=recheck))

    def _scan(self, owner: Owner, *, recheck: bool = True) -> None:
        """Look at every open scope of ``owner``; escalate those past their deadline."""
        if owner is not self.owners.get(owner.pid) and owner is not self.foreign.get(owner.pid):
            return
        now = time.monotonic()
        owner.next_scan = float("inf")
        table = owner.table
        table.floats[tbl.H_ARMED] = 0.0  # until this scan is done, every entry notifies
        suspended = table.floats[tbl.H_SUSPENDED]
        earliest, due = table.due_slots(now)
        busy_threads = {e.thread_id for e in owner.expiries.values()}
        for slot in sorted(due, key=lambda s: s.depth):  # outermost first
            if suspended or slot.serial in owner.expiries or slot.serial in owner.finished:
                continue
            elif slot.thread_id in busy_threads:
                continue  # an enclosing scope of this thread is already escalating
            else:
                busy_threads.add(slot.thread_id)
                self._expire(owner, slot)
        table.floats[tbl.H_ARMED] = earliest
        if earliest < float("inf"):
            self.schedule_scan(owner, earliest)
        if recheck and earliest > now + _RECHECK_AFTER:
            self.schedule_scan(owner, now + _RECHECK_AFTER, recheck=False)

    def _expire(self, owner: Owner, slot: tbl.SlotView) -> None:
        # A second, separate read: the scan's copy of the table has no load order, so
        # only act on a slot that still holds this entry and is still past its deadline.
        again = owner.table.read_slot(slot.index)
        if again is None or again.serial != slot.serial or again.deadline > time.monotonic():
            if again is not None:
                self.schedule_scan(owner, again.deadline)
            return
        slot = again
        table = owner.table
        nodeid, name, definition = tbl.split_test_entry(table.string(slot.nodeid_sid))
        path = table.string(slot.path_sid)
        site = table.string(slot.site_sid)
        phase = tbl.phase_of(slot.flags)
        if phase and not path:  # a test phase's scope: named after its test
            path, site = f"{name}::{phase}", site or definition
        expiry = Expiry(
            slot=slot.index,
            serial=slot.serial,
            path=path,
            site=site,
            nodeid=nodeid,
            start=slot.start,
            deadline=slot.deadline,
            grace=slot.grace if slot.grace > 0 else self.grace,
            thread_id=slot.thread_id,
            report=owner.reports.pop(slot.serial, None),
        )
        owner.expiries[slot.serial] = expiry
        expiry.steps = self._escalate(owner, expiry)
        self._advance(owner, expiry)

    def _reported(self, owner: Owner, fields: dict[str, Any]) -> None:
        """The owner raised ScopeExpired and says where it was."""
        serial = wire.field(fields, "serial", int)
        for name in ("budget", "elapsed"):  # checked now: a record is built from them later
            if name in fields:
                wire.field(fields, name, (int, float))
        expiry = owner.expiries.get(serial)
        if expiry is not None:
            expiry.report = fields
            # Recorded now, so a report made before the scope closes lists it; a later
            # escalation writes a record that supersedes this one.
            self._record(owner, expiry, "interrupted", expiry_stack(expiry), [], final=False)
        elif serial not in owner.finished:
            owner.reports[serial] = fields
            # An expiry the owner noticed first (at scope exit, or before our scan):
            # record it without interrupting again.
            expiry = Expiry(
                slot=-1,
                serial=serial,
                path=str(fields.get("scope", "")),
                site=str(fields.get("site", "")),
                nodeid=str(fields.get("nodeid", "")),
                start=0.0,
                deadline=time.monotonic(),
                grace=self.grace,
                thread_id=0,
                report=fields,
            )
            owner.reports.pop(serial, None)
            owner.expiries[serial] = expiry
            # On disk at once: a record must not wait for the ladder's next step.
            self._record(owner, expiry, "interrupted", expiry_stack(expiry), [], final=False)
            expiry.steps = self._escalate(owner, expiry, interrupt=False)
            self._advance(owner, expiry)

    def _advance(self, owner: Owner, expiry: Expiry) -> None:
        assert expiry.steps is not None
        if inspect.getgeneratorstate(expiry.steps) == inspect.GEN_RUNNING:
            # The ladder reads its owner's connection for a report in flight; a "sync"
            # read there asks to advance the very ladder that is running. It goes on
            # by itself once the read is done.
            return
        try:
            delay = next(expiry.steps)
        except StopIteration:
            return
        self.call_at(time.monotonic() + delay, lambda: self._advance(owner, expiry))

    def check_expiries(self) -> None:
        """Advance every escalation whose scope has closed (used before reporting)."""
        for owner in self.all_owners():
            for expiry in list(owner.expiries.values()):
                if self._closed(owner, expiry):
                    self._advance(owner, expiry)

    def _closed(self, owner: Owner, expiry: Expiry) -> bool:
        if expiry.slot < 0:
            return True
        slot = owner.table.read_slot(expiry.slot)
        return slot is None or slot.serial != expiry.serial or not proctree.alive([owner.proc])

    # -- the ladder ---------------------------------------------------------------
    def _escalate(
        self, owner: Owner, expiry: Expiry, *, interrupt: bool = True
    ) -> Generator[float, None, None]:
        """The escalation ladder for one scope, as steps: each yield is a delay."""
        table = owner.table
        # First the stacks of everything the owner started: once the owner is
        # interrupted, harnesses tear their ranks down and the evidence is gone.
        if interrupt:
            expiry.children = yield from self._dump_descendants(owner)
        signum = int(table.words[tbl.H_INTERRUPT_SIG])
        if interrupt and signum:
            proctree.send([owner.proc], signum)
        # Without an interrupt to give the owner, there is nothing to wait for.
        grace_end = expiry.deadline + (expiry.grace if signum else 0.0)
        while True:
            if self._closed(owner, expiry):
                if owner.conn is not None:
                    self._readable(owner.conn, owner.pid)  # its report may be in flight
                if expiry.recorded:
                    self._forget(owner, expiry)
                elif expiry.report is not None or not proctree.alive([owner.proc]):
                    self._record(owner, expiry, "interrupted", expiry_stack(expiry), [])
                else:
                    owner.finished.add(expiry.serial)  # unwound by an enclosing scope
                    owner.expiries.pop(expiry.serial, None)
                return
            since = table.floats[tbl.H_SUSPENDED]
            now = time.monotonic()
            if since:  # a debugger holds the owner: the grace period waits too
                grace_end = max(grace_end, now + expiry.grace)
            if now >= grace_end:
                break
            yield min(_CHECK_EVERY, grace_end - now)
        # Dump: every thread's Python stack, then who the owner's children are.
        stack = yield from self._dump(owner)
        tree = proctree.tree_of(owner.proc, {os.getpid()})
        if not expiry.children:
            expiry.children = [proctree.describe(p) for p in tree if p.pid != owner.pid]
        ended = [proctree.describe(p) for p in tree]
        if owner.pid == self.root.pid:
            # Ending pytest itself: whoever waits for it must find the report and the
            # summary the moment it is gone, so they come first (and again, final, later).
            self._record(
                owner, expiry, "terminated", stack or expiry_stack(expiry), ended, final=False
            )
            self.root_died = True
            self.write_report()
            self._print_summary()
        proctree.send(tree, signal.SIGTERM)
        proctree.send(tree, signal.SIGCONT)  # a stopped process acts on SIGTERM once it runs
        give_up = time.monotonic() + self.kill_after
        while proctree.alive(tree) and time.monotonic() < give_up:
            yield 0.02
        survivors = proctree.alive(tree)
        action = "terminated"
        if survivors:
            proctree.send(survivors, signal.SIGKILL)
            if owner.proc in survivors:
                action = "killed"
            give_up = time.monotonic() + 2.0
            while proctree.alive(survivors) and time.monotonic() < give_up:
                yield 0.02
        unkillable = [proctree.describe(p) for p in proctree.alive(tree)]
        record = self._record(owner, expiry, action, stack or expiry_stack(expiry), ended)
        if unkillable:
            record_note = f"\n(still alive after SIGKILL: {unkillable})"
            record.stack += record_note

    def _dump_descendants(self, owner: Owner) -> Generator[float, None, list[dict[str, Any]]]:
        """Stacks of the owner's descendants that have the session's dump handler."""
        signum = self.dump_signal
        found: list[tuple[dict[str, Any], str, int]] = []
        for proc in proctree.descendants(owner.proc):
            if proc.pid == os.getpid():
                continue  # pytest's child, but the watchdog is nobody's evidence
            info = proctree.describe(proc)
            info["label"] = proctree.label_of(proc)
            path = startup.dump_path(self.directory, proc.pid)
            if signum and proc.pid != os.getpid() and startup.catches(proc.pid, signum):
                offset = _size(path)
                proctree.send([proc], signum)
                found.append((info, path, offset))
            else:
                found.append((info, "", 0))
        waiting = [(path, offset) for _, path, offset in found if path]
        sizes: dict[str, int] = {}
        give_up = time.monotonic() + 0.3
        while waiting and time.monotonic() < give_up:
            yield 0.01
            now_sizes = {path: _size(path) for path, _ in waiting}
            grown = all(now_sizes[p] > offset for p, offset in waiting)
            if grown and now_sizes == sizes:
                break
            sizes = now_sizes
        out = []
        for info, path, offset in found:
            if path:
                info["stack"] = _read_from(path, offset)
            out.append(info)
        return out

    def _dump(self, owner: Owner) -> Generator[float, None, str]:
        signum = int(owner.table.words[tbl.H_DUMP_SIG])
        if not signum or not owner.dump_path or not proctree.alive([owner.proc]):
            return ""
        try:
            offset = os.path.getsize(owner.dump_path)
        except OSError:
            return ""
        proctree.send([owner.proc], signum)
        size, stable_since, give_up = offset, time.monotonic(), time.monotonic() + 0.3
        while time.monotonic() < give_up:
            yield 0.002
            try:
                now_size = os.path.getsize(owner.dump_path)
            except OSError:
                return ""
            if now_size != size:
                size, stable_since = now_size, time.monotonic()
            elif size > offset and time.monotonic() - stable_since > 0.008:
                break
        return _read_from(owner.dump_path, offset)

    def _record(
        self,
        owner: Owner,
        expiry: Expiry,
        action: str,
        stack: str,
        ended: list[dict[str, Any]],
        *,
        children: list[dict[str, Any]] | None = None,
        final: bool = True,
    ) -> records.ExpiryRecord:
        report = expiry.report or {}
        site = expiry.site or str(report.get("site", ""))
        file, line = records.split_site(site)
        now = time.monotonic()
        budget = expiry.deadline - expiry.start if expiry.start else float(report.get("budget", 0))
        elapsed = (now - expiry.start) if expiry.start else float(report.get("elapsed", 0))
        if report and action == "interrupted":
            elapsed = float(report.get("elapsed", elapsed))
        record = records.ExpiryRecord(
            nodeid=expiry.nodeid or str(report.get("nodeid", "")),
            scope=expiry.path or str(report.get("scope", "")),
            budget=round(budget, 3),
            elapsed=round(elapsed, 6),
            pid=owner.pid,
            label=owner.header_text(tbl.H_LABEL_SID),
            worker=owner.header_text(tbl.H_WORKER_SID),
            file=file,
            line=line,
            action=action,
            stack=stack,
            phase=owner.header_text(tbl.H_PHASE_SID),
            children=expiry.children,
            killed=ended,
            deadline=expiry.deadline,
            ended=now,
            serial=expiry.serial,
        )
        if final:
            self._forget(owner, expiry)
        else:
            expiry.recorded = True
        self.records = [r for r in self.records if (r.pid, r.serial) != (record.pid, record.serial)]
        self.records.append(record)
        records.append_record(self.records_path, record)
        return record

    def _forget(self, owner: Owner, expiry: Expiry) -> None:
        owner.expiries.pop(expiry.serial, None)
        owner.finished.add(expiry.serial)

    # -- the end ------------------------------------------------------------------
    def finish(self) -> None:
        """Close the session: end escalations, stray processes, write the report."""
        give_up = time.monotonic() + self.grace + self.kill_after + 3.0
        while any(o.expiries for o in self.all_owners()) and time.monotonic() < give_up:
            self.run_once(max_wait=0.02)
        self._end_strays()
        self.write_report()
        for callback in self.on_finish:
            try:
                callback(self)
            except Exception as exc:  # an extension must not cost the report
                sys.stderr.write(f"pytest-elastic-timer: {exc!r} at the end of the session\n")
        if self.root_died and self.junit_fallback:
            try:
                junit_fallback.write(self.junit_fallback, self.records, self.session)
            except OSError as exc:
                sys.stderr.write(
                    f"pytest-elastic-timer: cannot write {self.junit_fallback}: {exc}\n"
                )
        if self.root_died and self.records:
            self._print_summary()
        for owner in self.all_owners():
            owner.table.close()
        self.file_timers.close()
        self.listener.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    def write_report(self) -> None:
        """Write the JSON report with the session facts as they stand now."""
        self.session["ended"] = time.time()
        self.session["dropped_messages"] = self.dropped
        # Workers name themselves in their table after the hello: read them now.
        self.workers.update(
            w for o in self.owners.values() if (w := o.header_text(tbl.H_WORKER_SID))
        )
        self.session["workers"] = sorted(self.workers)
        self.session["root_died"] = self.root_died
        if not self.report_path:
            return
        try:
            records.write_report(self.report_path, self.records, self.session)
        except OSError as exc:
            sys.stderr.write(f"pytest-elastic-timer: cannot write {self.report_path}: {exc}\n")

    def _end_strays(self) -> None:
        """Processes of the session still running at its end are ended with their trees."""
        procs: list[psutil.Process] = []
        for owner in self.all_owners():
            if owner.pid == self.root.pid and not self.root_died:
                continue
            if proctree.alive([owner.proc]):
                procs.extend(proctree.tree_of(owner.proc, {os.getpid()}))
        if not procs:
            return
        self.session["stray_processes"] = [proctree.describe(p) for p in procs]
        proctree.end_all(procs, self.kill_after)

    def _print_summary(self) -> None:
        # Print again only when something changed (a new record, or a preliminary one
        # superseded: "terminated" became "killed").
        shown = {(r.pid, r.serial, r.action) for r in self.records}
        if shown <= self.summary_printed:
            return
        self.summary_printed = shown
        out = sys.stderr
        try:
            out.write(
                "\n"
                + "=" * 20
                + " elastic-timer: expired scopes (pytest was ended) "
                + "=" * 20
                + "\n"
            )
            for record in self.records:
                out.write(records.format_record(record) + "\n\n")
            if self.report_path:
                out.write(f"elastic-timer: JSON report written to {self.report_path}\n")
            out.flush()
        except (OSError, ValueError):
            pass


class _Terminated(Exception):
    """SIGTERM or SIGHUP reached the watchdog: finish the session's report and exit."""


def _on_terminate(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    raise _Terminated(signum)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _read_from(path: str, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return trim_dump(f.read(256 * 1024).decode("utf-8", "replace"))
    except OSError:
        return ""


DUMP_FRAMES = 25  # innermost frames kept per thread of a faulthandler dump


def trim_dump(text: str, frames: int = DUMP_FRAMES) -> str:
    """Keep the innermost ``frames`` frames of each thread (faulthandler prints the
    most recent call first, so the frames that matter come first)."""
    out: list[str] = []
    kept = dropped = 0
    for line in text.splitlines():
        if line.startswith("  File "):
            if kept < frames:
                out.append(line)
                kept += 1
            else:
                dropped += 1
            continue
        if dropped:
            out.append(f"  ... {dropped} outer frames")
        kept = dropped = 0
        out.append(line)
    if dropped:
        out.append(f"  ... {dropped} outer frames")
    return "\n".join(out) + "\n" if out else ""


def expiry_stack(expiry: Expiry) -> str:
    return str((expiry.report or {}).get("stack", ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pytest_elastic_timer.watchdog")
    parser.add_argument("--dir", required=True)
    parser.add_argument("--root-pid", type=int, required=True)
    parser.add_argument("--grace", type=float, default=2.0)
    parser.add_argument("--kill-after", type=float, default=1.0)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--report", default=None)
    parser.add_argument("--session", default="{}", help="JSON facts for the report")
    parser.add_argument("--dump-signal", type=int, default=0)
    parser.add_argument("--junit-xml", default=None, help="fallback JUnit XML if pytest dies")
    parser.add_argument("--trace", action="store_true", help="clients record every scope")
    args = parser.parse_args(argv)
    # Ctrl-C reaches the whole process group; pytest decides how the session ends.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_terminate)
    signal.signal(signal.SIGHUP, _on_terminate)
    root = proctree.ProcessId.of(args.root_pid)
    if root is None:
        return 1
    dog = Watchdog(
        args.dir,
        root=root,
        grace=args.grace,
        kill_after=args.kill_after,
        scale=args.scale,
        report_path=args.report,
        session=json.loads(args.session),
        control=sys.stdin.buffer,
        dump_signal=args.dump_signal,
    )
    dog.junit_fallback = args.junit_xml
    dog.trace = args.trace
    sys.stdout.write(f"ready {os.getpid()} {dog.address}\n")
    sys.stdout.flush()
    dog.serve()
    return 0
