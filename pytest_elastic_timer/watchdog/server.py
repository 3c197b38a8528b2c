"""The watchdog of one session: its parts put together, its messages, its end.

The parts, one job each:

- :mod:`.loop`        the event loop: readers, a timer heap, an injectable clock;
- :mod:`.connections` the Unix socket: peers of the session, messages in and out;
- :mod:`.owners`      registered processes and their mapped tables (``SO_PEERCRED``);
- :mod:`.scanner`     scans of the tables: where a deadline is enforced;
- :mod:`.ladder`      the escalation ladder of one expired scope, step by step;
- :mod:`.dumps`       every thread's stack of a process, taken from outside;
- :mod:`.recorder`    records (``records.jsonl``), the JSON report, the summary.

:class:`Watchdog` dispatches the messages of the socket (``hello``, ``wake``,
``expired``, ``sync``, and the ops of plugged-in intakes), reads the control pipe from
the pytest process, and ends the session. It is also the :class:`~.host.Host` of its
intakes. It exits by itself when the pytest process dies: that closes its stdin.
Nothing here imports pytest; the wiring is in :mod:`.wiring`.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Collection
from typing import Any

import psutil

from pytest_elastic_timer.core import table as tbl
from pytest_elastic_timer.core import wire
from pytest_elastic_timer.core.records import ExpiryRecord
from pytest_elastic_timer.watchdog import control, proctree
from pytest_elastic_timer.watchdog.collectives import CollectivesAmender
from pytest_elastic_timer.watchdog.connections import Connections
from pytest_elastic_timer.watchdog.dumps import Dumper
from pytest_elastic_timer.watchdog.host import OwnerFacts
from pytest_elastic_timer.watchdog.ladder import Ladder
from pytest_elastic_timer.watchdog.loop import Clock, Loop
from pytest_elastic_timer.watchdog.owners import Owner, Owners, Refused
from pytest_elastic_timer.watchdog.recorder import Recorder
from pytest_elastic_timer.watchdog.scanner import Scanner

SOCKET_NAME = "watchdog.sock"
RECORDS_NAME = "records.jsonl"
DRAIN_SECONDS = 1.0  # at most, reading what processes sent before the stop
Handler = Callable[[socket.socket, int, dict[str, Any]], None]


class Terminated(Exception):
    """SIGTERM or SIGHUP reached the watchdog: finish the session's report and exit."""


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
        trace: bool = False,
        clock: Clock = time.monotonic,
        listener: socket.socket | None = None,
        root_is_pytest: bool = True,
    ) -> None:
        self.directory = directory
        self.address = os.path.join(directory, SOCKET_NAME)
        self.root = root
        # False for the watchdog of another host, whose root is the worker that
        # started it: ending that worker ends no session, and pytest's terminal is the
        # controller's, whose watchdog prints what it must.
        self.root_is_pytest = root_is_pytest
        self.grace = grace
        self.kill_after = kill_after
        self.scale = scale
        self.report_path = report_path
        self.trace = trace  # clients record every scope into trace-<pid>-* files
        self.session = dict(session or {})
        self.session.setdefault("started", time.time())
        self.session.setdefault("host", socket.gethostname())  # what merged reports name
        self.dropped = 0
        self.internal_errors: list[str] = []
        self.stopping = False
        self.root_died = False
        self.workers: set[str] = set()
        self.loop = Loop(clock, on_error=self._internal_error)
        self.owners = Owners(directory, root, dump_signal)
        self.recorder = Recorder(os.path.join(directory, RECORDS_NAME), clock)
        # What the ranks concerned were doing in torch.distributed, from their rings.
        self.recorder.amenders.append(CollectivesAmender(directory, self._ended_processes))
        self.ladder = Ladder(
            clock=clock,
            dumper=Dumper(directory, dump_signal, clock),
            recorder=self.recorder,
            kill_after=kill_after,
            root_pid=root.pid if root_is_pytest else 0,
            read_pending=self._read_pending,
            ending_root=self._ending_root,
            peers_of=self._peers_of,
            on_error=self.loop.report_error,
        )
        self.scanner = Scanner(self.loop, self.owners, self.ladder, grace)
        self.connections = Connections(
            self.address,
            self.loop,
            vouch=self.owners.peer,
            dispatch=self._dispatch,
            drop=self.drop,
            closed=self._disconnected,
            listener=listener,
        )
        self.control = control
        self._control_buffer = b""
        if control is not None:
            os.set_blocking(control.fileno(), False)
            self.loop.add_reader(control, self._control)
        self._handlers: dict[str, Handler] = {}
        self._on_disconnect: list[Callable[[socket.socket], None]] = []
        self._on_finish: list[Callable[[], None]] = []

    @property
    def records(self) -> list[ExpiryRecord]:
        """The session's records so far."""
        return self.recorder.records

    @property
    def records_path(self) -> str:
        return self.recorder.path

    # -- plugging intakes in (see .host) ------------------------------------------
    def handle(self, op: str, handler: Handler) -> None:
        """Send every ``op`` message to ``handler(conn, peer_pid, fields)``. Such ops
        need no hello: a peer's credentials were checked when it connected."""
        self._handlers[op] = handler

    def add_reader(self, fileobj: Any, callback: Callable[[Any], None]) -> None:
        """Call ``callback(fileobj)`` whenever ``fileobj`` is readable."""
        self.loop.add_reader(fileobj, callback)

    def remove_reader(self, fileobj: Any) -> None:
        """Stop watching ``fileobj`` (nothing happens if it was not watched)."""
        self.loop.remove_reader(fileobj)

    def on_disconnect(self, callback: Callable[[socket.socket], None]) -> None:
        """Tell ``callback`` of every connection that ended."""
        self._on_disconnect.append(callback)

    def on_finish(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` at the end of the session, after the report was written."""
        self._on_finish.append(callback)

    # -- the host interface -------------------------------------------------------
    def clock(self) -> float:
        return self.loop.clock()

    def call_at(self, when: float, callback: Callable[[], None]) -> None:
        self.loop.call_at(when, callback)

    def send(self, conn: socket.socket, op: str, /, **fields: Any) -> None:
        self.connections.send(conn, op, **fields)

    def drop(self) -> None:
        self.dropped += 1

    def add_record(self, record: ExpiryRecord) -> None:
        self.recorder.add(record)

    def set_fact(self, key: str, value: Any) -> None:
        self.session[key] = value

    def owner_facts(self, pid: int) -> OwnerFacts | None:
        owner = self.owners.get(pid)
        if owner is None:
            return None
        return OwnerFacts(
            label=owner.header_text(tbl.H_LABEL_SID),
            worker=owner.header_text(tbl.H_WORKER_SID),
            phase=owner.header_text(tbl.H_PHASE_SID),
        )

    def identify(self, pid: int) -> proctree.ProcessId | None:
        return proctree.ProcessId.of(pid)

    def adopt(self, pid: int) -> Owner | None:
        return self.owners.adopt(pid)

    def wake(self, pid: int, at: float) -> None:
        # The adopted one first: a process that enters scopes of its own (a registered
        # owner) may also send torch file-timer requests, which go to its adopted table.
        owner = self.owners.adopted.get(pid) or self.owners.get(pid)
        if owner is not None:
            self.scanner.schedule_scan(owner, at)

    # -- the loop -----------------------------------------------------------------
    def run_once(self, max_wait: float | None = None) -> None:
        """One turn: wait for a message or the next due timer (at most ``max_wait``
        seconds), then handle everything due."""
        self.loop.run_once(max_wait)

    def serve(self, held: Collection[int] = ()) -> None:
        """Run until stopped, then finish the session. The signals ``held`` (blocked
        until now) are let through first: one that came meanwhile ends the session as a
        later one does."""
        try:
            if held:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, held)
            while not self.stopping:
                self.run_once()
        except Terminated:
            self.root_died = True  # whoever ended us may end pytest too: report now
        self.finish()

    def _internal_error(self, exc: Exception, what: str) -> None:
        """A callback of the loop failed (a defect of the watchdog): said on pytest's
        stderr and in the report, and the session's other scopes are still enforced."""
        if isinstance(exc, Terminated):
            raise exc
        self.internal_errors.append(f"{what}: {exc!r}")
        trace = "".join(traceback.format_exception(exc))
        sys.stderr.write(
            f"pytest-elastic-timer: {what} failed in the watchdog and was set aside;"
            f" the other scopes are still enforced:\n{trace}"
        )

    # -- messages -----------------------------------------------------------------
    def _read_pending(self, owner: Owner) -> None:
        if owner.conn is not None:
            self.connections.read(owner.conn)

    def _dispatch(
        self, conn: socket.socket, peer_pid: int, op: str, fields: dict[str, Any]
    ) -> None:
        handler = self._handlers.get(op)
        if handler is not None:
            handler(conn, peer_pid, fields)
            return
        if op == "hello":
            self._hello(conn, peer_pid, fields)
            return
        owner = self.owners.on(conn, peer_pid)
        if owner is None:
            raise wire.BadMessage(f"{op!r} before hello")
        if op == "wake":
            at = float(wire.field(fields, "at", (int, float)))
            self.scanner.schedule_scan(owner, at)
        elif op == "expired":
            self.scanner.reported(owner, fields)
        elif op == "sync":
            self.scanner.settle()
            pending = [
                {"pid": o.pid, "worker": o.header_text(tbl.H_WORKER_SID), "nodeid": e.nodeid}
                for o, e in self.scanner.pending()
            ]
            self.send(conn, "synced", records=len(self.records), pending=pending)
        else:
            raise wire.BadMessage(f"unknown op {op!r}")

    def _hello(self, conn: socket.socket, peer_pid: int, fields: dict[str, Any]) -> None:
        if self.owners.on(conn, peer_pid) is not None:
            raise wire.BadMessage("second hello")
        try:
            owner = self.owners.admit(conn, peer_pid, fields)
        except Refused as exc:
            self.send(conn, "refused", error=str(exc))
            raise
        fds = self.connections.take_received()
        for extra in fds[1:]:
            os.close(extra)
        if fds:  # it has no interrupt signal: its interrupter waits on this socket
            try:
                owner.interrupt_channel = socket.socket(fileno=fds[0])
            except OSError:
                os.close(fds[0])
        previous = self.owners.get(peer_pid)
        if previous is not None:
            if previous.conn is not None:
                self.connections.end(previous.conn)
            previous.let_go()
        self.owners.add(owner)
        worker = owner.header_text(tbl.H_WORKER_SID)
        if worker:
            self.workers.add(worker)
        self.send(
            conn, "welcome", pid=os.getpid(), scale=self.scale, grace=self.grace, trace=self.trace
        )

    def _peers_of(self, owner: Owner) -> list[int]:
        """The other ranks of the worlds of ``owner`` and the processes below it: the
        ranks they wait for, whose stacks are taken with theirs."""
        # Loaded where ranks wrote rings: a session without torch never reads one.
        from pytest_elastic_timer.core import collectives

        directory = self.owners.directory
        if not collectives.ring_paths(directory):
            return []
        pids = {owner.pid, *(p.pid for p in proctree.descendants(owner.proc))}
        return collectives.peers_of(directory, pids)

    def _ended_processes(self) -> dict[int, float]:
        """When processes of the session are known to have ended (pid -> clock): those
        an escalation ended, and registered ones whose connection closed as they went."""
        ended = {
            int(p["pid"]): record.ended
            for record in self.recorder.records
            if record.action != "interrupted" and not record.host
            for p in record.killed
            if "pid" in p
        }
        for owner in self.owners.values():
            if owner.conn is None and not proctree.alive([owner.proc]):
                ended.setdefault(owner.pid, owner.seen_alive)
        return ended

    def _disconnected(self, conn: socket.socket, peer_pid: int) -> None:
        for callback in self._on_disconnect:
            callback(conn)
        owner = self.owners.on(conn, peer_pid)
        if owner is not None:
            owner.conn = None
            owner.seen_alive = self.loop.clock()  # its connection was open until now
            if not proctree.alive([owner.proc]):
                owner.let_go()
            # (A process still running keeps its channel: one that dropped its
            # connection may still be interrupted there, and gets its grace.)
            # A process that exits with scopes open (killed, os._exit) is looked at
            # once more: its table outlives it, so the record can still be made.
            self.scanner.scan(owner)

    def _control(self, stream: Any) -> None:
        try:
            data = os.read(stream.fileno(), 65536)
        except BlockingIOError:
            return
        if not data:  # stdin closed: after "stop", or because the pytest process is gone
            self.root_died = not self.stopping
            self.stopping = True
            self.loop.remove_reader(stream)
            return
        self._control_buffer += data
        while b"\n" in self._control_buffer:
            line, self._control_buffer = self._control_buffer.split(b"\n", 1)
            command = control.command_of(line)
            if command.get("op") == control.HURRY:
                continue  # the relay heard it: this process is up
            if command.get("op") != control.STOP:
                self.drop()
                continue
            self.session.update(command.get("session") or {})
            self.stopping = True
            if command.get("waited") is False:
                control.leave_output()  # the relay did so already, where there is one

    # -- the end ------------------------------------------------------------------
    def _ending_root(self) -> None:
        self.root_died = True
        self.write_report()
        self.recorder.print_summary(self.report_path)

    def finish(self) -> None:
        """Close the session: end escalations, stray processes, write the report."""
        clock = self.loop.clock
        # First what processes sent before the stop: a connection not accepted yet, a
        # report not read yet (a watchdog that came up after the session's last test
        # still records the expiries their owners reported). Bounded: processes that
        # keep sending do not hold the end up.
        drain_until = clock() + DRAIN_SECONDS
        while self.loop.run_ready() and clock() < drain_until:
            pass
        give_up = clock() + self.grace + self.kill_after + 3.0
        while self.scanner.pending() and clock() < give_up:
            self.run_once(max_wait=0.02)
        self.end_strays()
        self.write_report()
        for callback in self._on_finish:
            try:
                callback()
            except Exception as exc:  # an intake must not cost the report
                sys.stderr.write(f"pytest-elastic-timer: {exc!r} at the end of the session\n")
        if self.root_died and self.records and self.root_is_pytest:
            self.recorder.print_summary(self.report_path)
        self.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    def write_report(self) -> None:
        """Write the JSON report with the session facts as they stand now."""
        self.session["ended"] = time.time()
        self.session["dropped_messages"] = self.dropped
        if self.internal_errors:
            self.session["internal_errors"] = list(self.internal_errors)
        # Workers name themselves in their table after the hello: read them now.
        self.workers.update(self.owners.workers())
        self.session["workers"] = sorted(self.workers)
        self.session["root_died"] = self.root_died
        self.recorder.write_report(self.report_path, self.session)

    def end_strays(self) -> None:
        """Processes of the session still running at its end are ended with their trees."""
        # By pid: an owner below another owner (a child of a pytest that died) is in
        # both trees, and is one stray.
        found: dict[int, psutil.Process] = {}
        for owner in self.owners.everyone():
            if owner.pid == self.root.pid and not self.root_died:
                continue
            if proctree.alive([owner.proc]):
                for proc in proctree.tree_of(owner.proc, {os.getpid()}):
                    found.setdefault(proc.pid, proc)
        if not found:
            return
        procs = list(found.values())
        self.session["stray_processes"] = [proctree.describe(p) for p in procs]
        proctree.end_all(procs, self.kill_after)

    def close(self) -> None:
        """Close the socket and every connection, unmap the tables, stop the loop
        (the session directory is left as it is)."""
        self.connections.close()
        self.owners.close()
        self.loop.close()
