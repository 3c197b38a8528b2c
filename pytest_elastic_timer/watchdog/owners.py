"""Who owns scopes: the processes registered with the watchdog, and their tables.

A process connects, and the kernel tells who it is (``SO_PEERCRED``): a peer of
another user, or one that is not a descendant of the pytest process that started the
session (checked by pid and start time), is refused before it says a word. Its
``hello`` must then carry its real pid and name a table that lies in the session
directory, is named after that pid and carries that pid in its header. So a scope
always belongs to the process that entered it, and no message can make the watchdog
signal a process outside the session.

Processes that cannot keep a table of their own (torch file-timer clients) are
*adopted*: the watchdog keeps a table for them in its own memory.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import psutil

from pytest_elastic_timer.core import startup, wire
from pytest_elastic_timer.core import table as tbl
from pytest_elastic_timer.watchdog import proctree

_UCRED = struct.Struct("3i")


@dataclass(eq=False)
class Expiry:
    """A scope past its deadline, while its escalation runs."""

    slot: int  # -1: known only from the owner's report
    serial: int
    path: str
    site: str
    nodeid: str
    start: float  # 0.0: known only from the owner's report
    deadline: float
    grace: float
    thread_id: int
    phase: str = ""  # what the owner's pytest was doing at the expiry (its table's word)
    flags: int = 0  # the slot's (for an adopted owner: how the expiry ends it)
    report: dict[str, Any] | None = None  # what the owner said when it raised
    children: list[dict[str, Any]] = field(default_factory=list)  # their stacks at expiry
    # reads the stacks the processes below the owner were asked for (their dump files)
    read_children: Callable[[], list[dict[str, Any]]] | None = None
    peers: list[dict[str, Any]] = field(default_factory=list)  # other ranks of its world
    read_peers: Callable[[], list[dict[str, Any]]] | None = None
    recorded: bool = False  # a preliminary record was written
    interrupted: bool = False  # the owner was sent its interrupt
    by_channel: bool = False  # ... on its connection (it has no signal): it reports later
    # A step failed: the escalation went on without the other processes' stacks.
    plain: bool = False
    steps: Generator[float, None, None] | None = None  # the ladder, step by step

    def reported_stack(self) -> str:
        """The stack the owner sent when it raised ("" if it did not)."""
        return str((self.report or {}).get("stack", ""))


@dataclass(eq=False)
class Owner:
    """A process that owns scopes: its identity, its table, its connection, and the
    escalations running against it."""

    ident: proctree.ProcessId
    proc: psutil.Process
    table: tbl.ScopeTable
    conn: socket.socket | None  # None for an adopted process (or a closed connection)
    dump_path: str
    expiries: dict[int, Expiry] = field(default_factory=dict)  # serial -> escalation
    finished: set[int] = field(default_factory=set)  # serials whose escalation ended
    next_scan: float = float("inf")
    # When the process was last known to run (a scan found it running, or its
    # connection was still open): a deadline it did not live to see is no expiry.
    seen_alive: float = float("-inf")
    # For an adopted process that also enters scopes of its own (the pytest process, an
    # xdist worker): that registered owner, whose table says what the process is.
    registered_as: Owner | None = None
    # Where a process without an interrupt signal (its pytest runs outside the main
    # thread) takes its interrupt: a byte written here wakes its interrupter thread.
    interrupt_channel: socket.socket | None = None
    # The test its nearest pytest ancestor ran when it joined, and that ancestor's
    # xdist worker: what started it, for a process whose environment does not say (a
    # child given an environment of its own).
    started_in: str = ""
    started_on: str = ""
    # Whether the watchdog keeps this owner's table itself (a torch file-timer
    # client's): only then do its slots' flags say how an expiry ends the process.
    adopted: bool = False

    def interruptible(self) -> bool:
        """Whether the owner can be given its interrupt (a signal, or its channel)."""
        return bool(self.table.words[tbl.H_INTERRUPT_SIG]) or self.interrupt_channel is not None

    def interrupt(self) -> None:
        """Give the owner its interrupt: the signal its table names, or a byte on its
        interrupt channel (nothing if it has neither)."""
        signum = int(self.table.words[tbl.H_INTERRUPT_SIG])
        if signum:
            proctree.send([self.proc], signum)
        elif self.interrupt_channel is not None:
            with contextlib.suppress(OSError):  # full (it is being interrupted) or gone
                self.interrupt_channel.send(b"\0", socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)

    def let_go(self) -> None:
        """Close what the watchdog holds of the owner beside its table."""
        if self.interrupt_channel is not None:
            self.interrupt_channel.close()
            self.interrupt_channel = None

    @property
    def pid(self) -> int:
        return self.ident.pid

    def header_text(self, word: int) -> str:
        """The string a header word of the table points at (label, worker, phase)."""
        return self.table.string(int(self.table.words[word]))

    def environ(self, name: str) -> str:
        """The process's environment variable ``name`` ("" if unset or unreadable)."""
        try:
            return str(self.proc.environ().get(name, ""))
        except Exception:  # gone, or not ours to read
            return ""

    def current_test(self) -> str:
        """The nodeid of the test the process runs now ("" if none): as its own table
        says (a process of the session's pytest), else its environment's
        ``PYTEST_CURRENT_TEST`` (a child that a test started; the variable a pytest
        process sets later is not in what /proc shows of its environment), else the
        test that started it (:attr:`started_in`: a child given an environment of
        its own)."""
        own = self.registered_as or self
        return (
            own.test_in_table()
            or self.environ("PYTEST_CURRENT_TEST").rsplit(" (", 1)[0]
            or self.started_in
        )

    def phase(self) -> str:
        """What the process's pytest is doing now, as its own table says ("" for a
        process that runs no pytest)."""
        return (self.registered_as or self).header_text(tbl.H_PHASE_SID)

    def test_in_table(self) -> str:
        """The nodeid of the test its table says the process runs ("" if none)."""
        sid = int(self.table.words[tbl.H_TEST_SID])
        return tbl.split_test_entry(self.table.string(sid))[0] if sid else ""


class Refused(wire.BadMessage):
    """A hello refused with an answer that says why (and counted as dropped)."""


class Owners(Mapping[int, Owner]):
    """The registered processes by pid (a mapping), and the adopted ones in
    :attr:`adopted`."""

    def __init__(self, directory: str, root: proctree.ProcessId, dump_signal: int) -> None:
        self.directory = directory
        self.root = root
        # Whose descendants belong to the session: pytest; on a host other than the
        # controller's, every worker that joined (see .remote_host).
        self.roots = [root]
        self.dump_signal = dump_signal  # every Python process of the session dumps on it
        self.registered: dict[int, Owner] = {}
        self.adopted: dict[int, Owner] = {}

    def __getitem__(self, pid: int) -> Owner:
        return self.registered[pid]

    def __iter__(self) -> Iterator[int]:
        return iter(self.registered)

    def __len__(self) -> int:
        return len(self.registered)

    def everyone(self) -> list[Owner]:
        """Registered and adopted processes."""
        return [*self.registered.values(), *self.adopted.values()]

    def is_current(self, owner: Owner) -> bool:
        """Whether ``owner`` is still the one kept for its pid (not replaced)."""
        return owner is self.registered.get(owner.pid) or owner is self.adopted.get(owner.pid)

    def workers(self) -> set[str]:
        """The xdist worker ids the registered processes name in their tables."""
        return {w for o in self.registered.values() if (w := o.header_text(tbl.H_WORKER_SID))}

    # -- registration -------------------------------------------------------------
    def in_session(self, pid: int) -> bool:
        """Whether ``pid`` is a root of the session or runs below one."""
        return any(proctree.is_descendant(pid, root) for root in self.roots)

    def add_root(self, root: proctree.ProcessId) -> None:
        """Make ``root`` and its descendants processes of the session."""
        self.roots.append(root)

    def release(self, root: proctree.ProcessId) -> None:
        """``root`` is done with the session, though its process may serve on: it is
        no longer one of its roots, nor a registered owner (a stray at the end)."""
        self.roots = [r for r in self.roots if r != root]
        owner = self.registered.get(root.pid)
        if owner is not None and owner.ident == root:
            del self.registered[root.pid]
            owner.let_go()

    def peer(self, conn: socket.socket) -> int | None:
        """The pid of the process at the other end of ``conn``, if it may talk to the
        watchdog: the same user, and a process of this session. None for another user;
        raises :class:`Refused` for a process of this user outside the session."""
        if not hasattr(socket, "SO_PEERCRED"):  # not Linux: see docs/platforms.md
            return None
        pid, uid, _ = _UCRED.unpack(
            conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        )
        if uid != os.getuid():
            return None  # not a word to another user
        if not self.in_session(pid):
            raise Refused("not a process of this session")
        return int(pid)

    def admit(self, conn: socket.socket, peer_pid: int, fields: dict[str, Any]) -> Owner:
        """The owner the hello of the peer of ``conn`` describes, its table mapped
        (registered with :meth:`add`). Raises :class:`Refused` or ``BadMessage``."""
        # The pid in the message must be the kernel's word for the peer.
        if wire.field(fields, "pid", int) != peer_pid:
            raise Refused("pid does not match the connection")
        path = os.path.realpath(wire.field(fields, "table", str))
        if (
            os.path.dirname(path) != os.path.realpath(self.directory)
            or tbl.pid_of_file(os.path.basename(path)) != peer_pid
        ):
            raise Refused("table outside the session directory")
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
        self.note_starter(owner)
        return owner

    def note_starter(self, owner: Owner) -> None:
        """Set ``owner.started_in`` and ``started_on`` from the nearest registered
        process above it that runs a test (a pytest process names its test in its
        table), if any."""
        roots = {root.pid for root in self.roots}
        proc: psutil.Process | None = owner.proc
        while proc is not None and proc.pid not in roots:  # nothing of ours above a root
            try:
                proc = proc.parent()
            except psutil.Error:
                return
            above = self.registered.get(proc.pid) if proc is not None else None
            if above is not None and proctree.ProcessId.of(above.pid) == above.ident:
                test = above.test_in_table()
                if test:
                    owner.started_in = test
                    owner.started_on = above.header_text(tbl.H_WORKER_SID)
                    return

    def add(self, owner: Owner) -> None:
        """Register ``owner``, in place of an earlier process of its pid."""
        self.registered[owner.pid] = owner

    def on(self, conn: socket.socket, peer_pid: int) -> Owner | None:
        """The owner registered on ``conn``, if its peer said hello there."""
        owner = self.registered.get(peer_pid)
        return owner if owner is not None and owner.conn is conn else None

    def adopt(self, pid: int) -> Owner | None:
        """The adopted process ``pid``, adopted now (with a fresh table) unless it
        already is and still runs; None for a process outside the session."""
        owner = self.adopted.get(pid)
        if owner is not None and proctree.alive([owner.proc]):
            return owner
        if not self.in_session(pid) or pid == os.getpid():
            return None
        ident = proctree.ProcessId.of(pid)
        proc = ident.process() if ident else None
        if ident is None or proc is None:
            return None
        table = tbl.ScopeTable.create(None)
        owner = Owner(ident, proc, table, None, startup.dump_path(self.directory, pid))
        owner.adopted = True
        self.note_starter(owner)
        registered = self.registered.get(pid)
        if registered is not None and registered.ident == ident:
            # It says what it is in its own table (its environment, as /proc shows it,
            # is what it started with: no xdist worker id there).
            owner.registered_as = registered
            label = registered.header_text(tbl.H_LABEL_SID)
            worker = registered.header_text(tbl.H_WORKER_SID)
        else:
            label = proctree.label_of(proc)
            worker = owner.environ("PYTEST_XDIST_WORKER")
        dump_sig = self.dump_signal
        table.words[tbl.H_PID] = pid
        table.words[tbl.H_INTERRUPT_SIG] = 0  # it has no handler: no soft interrupt
        table.words[tbl.H_DUMP_SIG] = dump_sig if startup.catches(pid, dump_sig) else 0
        table.words[tbl.H_LABEL_SID] = table.add_string(label) if label else 0
        table.words[tbl.H_WORKER_SID] = table.add_string(worker) if worker else 0
        self.adopted[pid] = owner
        return owner

    def close(self) -> None:
        """Unmap every table."""
        for owner in self.everyone():
            owner.table.close()
            owner.let_go()
