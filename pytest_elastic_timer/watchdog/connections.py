"""The watchdog's socket: a Unix ``SOCK_SEQPACKET`` socket in the session directory.

One datagram is one message (:mod:`pytest_elastic_timer.core.wire`), so there is no
framing; the connection tells the watchdog at once when a peer goes away. A peer is
accepted only if :meth:`Owners.peer <.owners.Owners.peer>` vouches for it (the kernel's
``SO_PEERCRED``). A datagram that is not a well-formed message, or that its handler
refuses, is dropped and counted; the connection and the watchdog carry on.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable
from typing import Any

from pytest_elastic_timer.core import wire
from pytest_elastic_timer.watchdog.loop import Loop

Dispatch = Callable[[socket.socket, int, str, dict[str, Any]], None]
# What a handler may raise about a message: it is then dropped and counted.
# Connections of processes that started before the watchdog accepts wait in the backlog.
LISTEN_BACKLOG = 128
BAD_MESSAGE = (wire.BadMessage, ValueError, TypeError, KeyError, OSError, RecursionError)


class Connections:
    """Accepts the session's processes, reads their messages, answers them."""

    def __init__(
        self,
        address: str,
        loop: Loop,
        *,
        vouch: Callable[[socket.socket], int | None],
        dispatch: Dispatch,
        drop: Callable[[], None],
        closed: Callable[[socket.socket, int], None],
        listener: socket.socket | None = None,
    ) -> None:
        self.address = address
        self.loop = loop
        # The peer's pid; None for a peer dropped without a word; raises
        # wire.BadMessage for one that is told why it is refused.
        self.vouch = vouch
        self.dispatch = dispatch  # (conn, peer pid, op, fields) of every message
        self.drop = drop
        self.closed = closed  # (conn, peer pid) of every connection that ended
        self.peers: dict[socket.socket, int] = {}  # open connection -> its peer's pid
        # Connections being read: a handler may ask to read its own connection again
        # (the ladder looks for a report in flight), which the read going on does.
        self.reading: set[socket.socket] = set()
        # The descriptors that came with the message being handled: a handler that
        # keeps them takes them (take_received), the rest are closed after it.
        self.received: list[int] = []
        if listener is None:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            listener.bind(address)
            os.chmod(address, 0o600)
            listener.listen(LISTEN_BACKLOG)
        # else: bound and listening already, handed over by the plugin (as socket
        # activation does), so that clients could connect before this process ran.
        self.listener = listener
        self.listener.setblocking(False)
        loop.add_reader(self.listener, self._accept)

    def send(self, conn: socket.socket, op: str, /, **fields: Any) -> None:
        """Send one message on ``conn``; a peer that went away is no error."""
        with contextlib.suppress(OSError):
            conn.send(wire.encode(op, **fields))

    def _accept(self, _listener: Any) -> None:
        # Every connection waiting: a watchdog that comes up late finds its session's
        # processes in the backlog all at once.
        while True:
            try:
                conn, _ = self.listener.accept()
            except BlockingIOError:
                return
            try:
                pid = self.vouch(conn)
            except wire.BadMessage as exc:
                # A process of this user outside the session (an execnet socket server
                # started on its own, say): told why, so that it can say why it
                # enforces its scopes in-process. Its hello is read first: closing a
                # Unix socket with unread data resets the connection, and the peer
                # would read that instead of the answer.
                self.drop()
                self.send(conn, "refused", error=str(exc))
                with contextlib.suppress(OSError):
                    conn.recv(wire.MAX_MESSAGE, socket.MSG_DONTWAIT)
                conn.close()
                continue
            if pid is None:  # another user: not a word
                self.drop()
                conn.close()
                continue
            conn.setblocking(False)
            self.peers[conn] = pid
            self.loop.add_reader(conn, self.read)

    def read(self, conn: socket.socket) -> None:
        """Handle every message waiting on ``conn``; end it if the peer went away."""
        peer_pid = self.peers.get(conn)
        if peer_pid is None or conn in self.reading:
            return  # ended already, or being read: its loop reads on after this handler
        self.reading.add(conn)
        try:
            self._read(conn, peer_pid)
        finally:
            self.reading.discard(conn)

    def _read(self, conn: socket.socket, peer_pid: int) -> None:
        reset_seen = False
        while True:
            fds: list[int] = []
            try:
                data, fds = wire.receive_with_fds(conn)
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
                for fd in fds:
                    os.close(fd)
                self.end(conn)
                return
            # A handler may read another connection (the ladder looks for a report in
            # flight): the descriptors of this message are put back after it.
            outer, self.received = self.received, fds
            try:
                op, fields = wire.decode(data)
                self.dispatch(conn, peer_pid, op, fields)
            except BAD_MESSAGE:
                self.drop()
            finally:
                left, self.received = self.received, outer
                for fd in left:
                    with contextlib.suppress(OSError):
                        os.close(fd)

    def take_received(self) -> list[int]:
        """The descriptors of the message being handled, now the caller's to close."""
        fds, self.received = self.received, []
        return fds

    def end(self, conn: socket.socket) -> None:
        """Close ``conn``, then tell :attr:`closed`."""
        peer_pid = self.peers.pop(conn, None)
        if peer_pid is None:
            return
        self.loop.remove_reader(conn)
        conn.close()
        self.closed(conn, peer_pid)

    def close(self) -> None:
        """Close every connection and the listening socket (no callbacks)."""
        for conn in list(self.peers):
            self.loop.remove_reader(conn)
            conn.close()
        self.peers.clear()
        self.loop.remove_reader(self.listener)
        self.listener.close()
