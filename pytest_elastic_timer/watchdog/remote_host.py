"""The watchdog of a host other than the controller's (``--host-name``).

The controller's watchdog can neither reach nor signal a worker on another host. The
first worker of the session on such a host starts a watchdog there (the same program,
the same ladder); the other workers on that host join it. What differs is who belongs
to the session and when it ends, and that is this module, a part of that watchdog
(not an intake: it decides who the session's roots are, and when the session ends),
plugged in by the wiring (:mod:`.wiring`):

- **Joining.** A worker joins on ``join.sock`` (``core/hostlink.py``) and becomes a root
  of the session here: it and its descendants may register and are enforced.
- **Tied to the gateways.** With the join come the descriptors of the worker's xdist
  gateway, polled for hang-up only (an epoll set of their own, readable when one hangs
  up). A gateway that hangs up while its worker still runs means that its controller is
  gone (killed, say): after a short wait for the worker to end by itself, the worker's
  whole tree is ended. When no gateway is left and none is awaited, the watchdog ends
  the session's processes, as the controller's does when pytest dies, and exits.
- **Replacements.** A worker that ends without saying ``leave`` (the watchdog ended it,
  or it crashed) is replaced by xdist. While such a replacement is awaited and no
  other worker is here, the watchdog lingers (``--linger`` seconds, counted again from
  each ``fetch``), so that the record of the ended worker stays until the controller
  fetches it through a fresh gateway, or the replacement forwards it.

Records are made here with ``host`` set to this host's name and ``host_key`` to its
identity's key (an amender of the recorder): two hosts may share a name, and their
records must not replace each other's. They reach the controller through the workers'
test reports, their ``workeroutput``, or a ``fetch``; the controller's watchdog takes
them in with the intake of ``.forwarded``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import select
import socket
import struct
from dataclasses import dataclass, field
from typing import Any

import psutil

from pytest_elastic_timer.core import hostid, hostlink, records, wire
from pytest_elastic_timer.core import table as tbl
from pytest_elastic_timer.watchdog import proctree
from pytest_elastic_timer.watchdog.server import Watchdog

_UCRED = struct.Struct("3i")
DEFAULT_LINGER = 15.0


@dataclass
class Gateway:
    """A joined worker: its join connection, identity and gateway descriptors."""

    conn: socket.socket
    worker: str
    ident: proctree.ProcessId
    proc: psutil.Process
    fds: list[int] = field(default_factory=list)
    left: bool = False  # said "leave": it ends normally, no replacement comes


class HostRole:
    """The host watchdog's part: joins, gateway hang-ups, lingering, fetches."""

    def __init__(self, dog: Watchdog, hostname: str, linger: float) -> None:
        self.dog = dog
        self.linger = linger
        # This watchdog runs on the host it serves: its identity is the workers'.
        name_host = functools.partial(_name_host, hostname, hostid.current().key())
        dog.recorder.amenders.append(name_host)
        self.conns: set[socket.socket] = set()  # open connections on join.sock
        self.gateways: dict[socket.socket, Gateway] = {}
        self.by_fd: dict[int, Gateway] = {}
        self.awaited = 0  # workers that ended without "leave": replacements to come
        self.controller_gone = False
        self.linger_until = 0.0
        self.hangups = select.epoll()
        dog.add_reader(self.hangups, self._hung_up)
        path = os.path.join(dog.directory, hostlink.JOIN_SOCKET)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(path)
        os.chmod(path, 0o600)
        self.listener.listen(64)
        self.listener.setblocking(False)
        dog.add_reader(self.listener, self._accept)
        dog.on_finish(self.close)

    # -- the join socket -----------------------------------------------------------
    def _accept(self, listener: Any) -> None:
        try:
            conn, _ = self.listener.accept()
        except BlockingIOError:
            return
        pid, uid, _ = _UCRED.unpack(
            conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        )
        if uid != os.getuid():
            self.dog.drop()
            conn.close()
            return
        conn.setblocking(False)
        self.conns.add(conn)
        self.dog.add_reader(conn, functools.partial(self._readable, peer_pid=pid))

    def _readable(self, conn: socket.socket, peer_pid: int) -> None:
        reset_seen = False
        while True:
            try:
                data, fds = wire.receive_with_fds(conn)
            except BlockingIOError:
                return
            except ConnectionResetError:  # see Watchdog._readable: read on once
                if reset_seen:
                    data, fds = b"", []
                else:
                    reset_seen = True
                    continue
            except OSError:
                data, fds = b"", []
            if not data:
                _close_all(fds)
                self._closed(conn)
                return
            try:
                op, fields = wire.decode(data)
                fds = self._dispatch(conn, peer_pid, op, fields, fds)
            except (wire.BadMessage, ValueError, TypeError, OSError):
                self.dog.drop()
            _close_all(fds)  # whatever a message carried that was not kept

    def _dispatch(
        self, conn: socket.socket, peer_pid: int, op: str, fields: dict[str, Any], fds: list[int]
    ) -> list[int]:
        """Handle one message; returns the descriptors it did not keep."""
        if op == "join":
            return self._join(conn, peer_pid, fields, fds)
        if op == "leave":
            gateway = self.gateways.get(conn)
            if gateway is not None:
                gateway.left = True
        elif op == "fetch":
            self._fetch(conn, str(wire.field(fields, "worker", str)))
        else:
            raise wire.BadMessage(f"unknown op {op!r}")
        return fds

    def _join(
        self, conn: socket.socket, peer_pid: int, fields: dict[str, Any], fds: list[int]
    ) -> list[int]:
        if conn in self.gateways or wire.field(fields, "pid", int) != peer_pid:
            raise wire.BadMessage("a join names its own process, once")
        ident = proctree.ProcessId.of(peer_pid)
        proc = ident.process() if ident is not None else None
        if ident is None or proc is None:
            raise wire.BadMessage("the joining worker is gone")
        gateway = Gateway(conn, str(fields.get("worker", "")), ident, proc)
        for fd in fds:
            try:
                # Hang-up only: EPOLLHUP and EPOLLERR come unasked, EPOLLRDHUP is the
                # peer's shutdown of a socket. Never readable: the data is the worker's.
                self.hangups.register(fd, select.EPOLLRDHUP)
            except OSError:
                os.close(fd)
                continue
            gateway.fds.append(fd)
            self.by_fd[fd] = gateway
        self.gateways[conn] = gateway
        self.dog.owners.add_root(ident)
        self.dog.workers.add(gateway.worker)
        self.awaited = max(0, self.awaited - 1)
        with contextlib.suppress(OSError):
            conn.send(wire.encode("joined", pid=os.getpid()))
        return []

    def _fetch(self, conn: socket.socket, worker: str) -> None:
        """Answer with ``worker``'s records, in datagrams of bounded size."""
        self.linger_until = max(self.linger_until, self.dog.clock() + self.linger)
        self.dog.scanner.settle()
        pending = any(
            owner.header_text(tbl.H_WORKER_SID) == worker for owner, _ in self.dog.scanner.pending()
        )
        found = [r.to_json() for r in self.dog.records if r.worker == worker]
        chunks: list[list[dict[str, Any]]] = [[]]
        for record in found:
            if len(wire.encode("records", records=[*chunks[-1], record])) > wire.MAX_MESSAGE // 2:
                chunks.append([])
            if len(wire.encode("records", records=[record])) > wire.MAX_MESSAGE // 2:
                record = {**record, "stack": record.get("stack", "")[-16384:], "children": []}
            chunks[-1].append(record)
        for index, chunk in enumerate(chunks):
            more = index < len(chunks) - 1
            with contextlib.suppress(OSError, wire.BadMessage):
                conn.send(wire.encode("records", records=chunk, pending=pending, more=more))

    def _closed(self, conn: socket.socket) -> None:
        self.dog.loop.remove_reader(conn)
        conn.close()
        self.conns.discard(conn)
        gateway = self.gateways.pop(conn, None)
        if gateway is None:
            return
        # Its descriptors go too: a TCP gateway held open here would hide the worker's
        # end from the controller.
        self._drop_fds(gateway)
        if gateway.left:
            # Done with the session, but maybe not with its process (execnet's socket
            # server runs the worker in its own process, and serves on): not a stray.
            self.dog.owners.release(gateway.ident)
        else:
            self.awaited += 1
            self.linger_until = self.dog.clock() + self.linger
        self._review()

    # -- gateways ------------------------------------------------------------------
    def _hung_up(self, epoll: Any) -> None:
        for fd, _ in self.hangups.poll(0):
            gateway = self.by_fd.get(fd)
            if gateway is None:
                with contextlib.suppress(OSError):
                    self.hangups.unregister(fd)
                continue
            self._drop_fds(gateway)
            if gateway.left or not proctree.alive([gateway.proc]):
                continue  # its link's end is what counts
            # The worker runs, its controller does not talk to it any more: the
            # controller is gone, or gave up on it. A worker that notices ends by
            # itself; one stuck in C does not.
            self.controller_gone = True
            wait = max(2.0, self.dog.grace)
            self.dog.call_at(self.dog.clock() + wait, functools.partial(self._end_worker, gateway))

    def _end_worker(self, gateway: Gateway) -> None:
        if gateway.left or not proctree.alive([gateway.proc]):
            return
        tree = proctree.tree_of(gateway.proc, {os.getpid()})
        self.dog.session.setdefault("stray_processes", []).extend(
            proctree.describe(p) for p in tree
        )
        proctree.end_all(tree, self.dog.kill_after)

    def _drop_fds(self, gateway: Gateway) -> None:
        for fd in gateway.fds:
            self.by_fd.pop(fd, None)
            with contextlib.suppress(OSError):
                self.hangups.unregister(fd)
            with contextlib.suppress(OSError):
                os.close(fd)
        gateway.fds = []

    # -- the end -------------------------------------------------------------------
    def _review(self) -> None:
        """Stop once no worker is here and none is awaited; linger while one is."""
        if self.dog.stopping or self.gateways:
            return
        lingering = self.awaited and not self.controller_gone
        if lingering and self.dog.clock() < self.linger_until:
            self.dog.call_at(self.linger_until, self._review)
            return
        self.dog.root_died = self.controller_gone
        self.dog.stopping = True

    def close(self) -> None:
        for gateway in list(self.gateways.values()):
            self._drop_fds(gateway)
        for fileobj in (self.hangups, self.listener, *self.conns):
            self.dog.loop.remove_reader(fileobj)
        for conn in self.conns:
            conn.close()
        self.hangups.close()
        self.listener.close()


def _name_host(hostname: str, host_key: str, record: records.ExpiryRecord) -> None:
    record.host = hostname
    record.host_key = host_key


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def install(dog: Watchdog, hostname: str, linger: float = DEFAULT_LINGER) -> HostRole:
    """Make ``dog`` the watchdog of ``hostname``, a host other than the controller's."""
    return HostRole(dog, hostname, linger)
