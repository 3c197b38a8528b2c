"""Watchdog side of the deadline-aware synchronization primitives (barrier, event, lock).

Every blocking call of a process comes on a connection of its own (see :mod:`.client`),
so a connection *is* one waiter (:mod:`.waiters`): the answer goes back on it, and its
closing means the caller went away (its call was interrupted, or its process died). A
lock is held for as long as the connection that acquired it stays open, so a holder
that dies releases it, and the next process that gets the lock is told.

The watchdog alone decides timeouts, on its own clock: when a waiter's deadline passes,
every waiter the timeout concerns is answered at once with who arrived, who is missing,
who holds the lock. Each process that timed out gets an expiry record like an expired
scope (scope ``barrier:<name>``, ``event:<name>`` or ``lock:<name>``, action
``interrupted``), so it appears in the terminal summary and the JSON report. Budgets
are multiplied by the session's scale factor here, once.

An intake of the watchdog: :class:`SyncServer` uses only its
:class:`~pytest_elastic_timer.watchdog.host.Host`; the wiring sends it the ops of
:data:`.protocol.OPS` (:meth:`SyncServer.handlers`) and the end of every connection
(:meth:`SyncServer.disconnected`). Nothing here imports pytest or psutil.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from pytest_elastic_timer.core import wire
from pytest_elastic_timer.sync import protocol
from pytest_elastic_timer.sync.barrier import Barriers
from pytest_elastic_timer.sync.event import Events
from pytest_elastic_timer.sync.lock import Locks
from pytest_elastic_timer.sync.waiters import Waits
from pytest_elastic_timer.watchdog.host import Host

Handler = Callable[[socket.socket, int, dict[str, Any]], None]


class SyncServer:
    """The primitives' state in the watchdog, keyed by name across the session."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.waits = Waits(host)
        self.barriers = Barriers(self.waits)
        self.events = Events(self.waits)
        self.locks = Locks(self.waits)

    @property
    def calls(self) -> dict[socket.socket, tuple[str, str, Any]]:
        """The open calls: connection -> (kind, name, waiter)."""
        return self.waits.calls

    def handlers(self) -> dict[str, Handler]:
        """The handler of each op; a bad request is answered and counted as dropped."""
        table: dict[str, Handler] = {
            protocol.OP_BARRIER: self.barriers.wait,
            protocol.OP_EVENT_SET: self.events.set,
            protocol.OP_EVENT_CLEAR: self.events.clear,
            protocol.OP_EVENT_GET: self.events.get,
            protocol.OP_EVENT_WAIT: self.events.wait,
            protocol.OP_LOCK_ACQUIRE: self.locks.acquire,
            protocol.OP_LOCK_RELEASE: self.locks.release,
        }
        return {op: self._guarded(handler) for op, handler in table.items()}

    def _guarded(self, handler: Handler) -> Handler:
        def run(conn: socket.socket, peer_pid: int, fields: dict[str, Any]) -> None:
            try:
                handler(conn, peer_pid, fields)
            except Exception as exc:
                # A bad request gets an answer (its caller would wait for nothing) and is
                # counted as dropped; a bug here must never cost the session its watchdog.
                if not isinstance(exc, (wire.BadMessage, ValueError, TypeError, KeyError)):
                    self.waits.internal_error(exc)
                self.host.drop()
                self.host.send(conn, protocol.ERROR, error=f"bad request: {exc}")

        return run

    def disconnected(self, conn: socket.socket) -> None:
        """A caller went away: it leaves the barrier or the queue, or releases its lock."""
        call = self.waits.calls.pop(conn, None)
        if call is None:
            return
        kind, name, waiter = call
        try:
            if kind == "barrier":
                self.barriers.left(name, waiter)
            elif kind == "event":
                self.events.left(name, waiter)
            elif kind == "lock":
                self.locks.left(name, waiter)
        except Exception as exc:
            self.waits.internal_error(exc)
