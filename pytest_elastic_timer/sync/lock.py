"""Locks, in the watchdog: held for as long as the connection that acquired them stays
open, so a holder that dies (even by SIGKILL) releases its lock, and the next process
that gets it is told. A wait that times out is answered with who holds the lock, since
when, where it was acquired and what the holder is doing meanwhile.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any

from pytest_elastic_timer.sync.protocol import OK
from pytest_elastic_timer.sync.waiters import Party, Waiter, Waits, name_of, names


@dataclass
class LockState:
    holder: Waiter | None = None
    queue: list[Waiter] = field(default_factory=list)
    abandoned: Party | None = None  # told to the next process that gets the lock


class Locks:
    """Every lock of the session, by name."""

    def __init__(self, waits: Waits) -> None:
        self.waits = waits
        self.locks: dict[str, LockState] = {}

    def acquire(self, conn: socket.socket, peer_pid: int, fields: dict[str, Any]) -> None:
        waits = self.waits
        name = waits.blocking_call(conn, fields)
        lock = self.locks.setdefault(name, LockState())
        waiter = waits.waiter(conn, peer_pid, fields)
        waits.calls[conn] = ("lock", name, waiter)
        if lock.holder is None:
            self._grant(name, lock, waiter, waits.now())
            return
        lock.queue.append(waiter)
        waits.later(waiter.deadline, lambda: self._due(name, lock))

    def release(self, conn: socket.socket, peer_pid: int, fields: dict[str, Any]) -> None:
        call = self.waits.calls.get(conn)
        if call is None or call[0] != "lock":
            return  # already released, timed out or never asked: nothing to do
        _, name, waiter = call
        lock = self.locks[name]
        del self.waits.calls[conn]
        now = self.waits.now()
        if lock.holder is waiter:
            lock.holder = None
            self._note_hold(name, now - waiter.acquired)
            self._grant_next(name, lock, now)
        elif waiter in lock.queue:
            lock.queue.remove(waiter)  # gave up waiting (interrupted)

    def left(self, name: str, waiter: Waiter) -> None:
        """``waiter`` went away: a holder abandons the lock, a waiter leaves the queue."""
        lock = self.locks[name]
        if lock.holder is waiter:
            now = self.waits.now()
            lock.holder = None
            held = now - waiter.acquired
            lock.abandoned = {**self.waits.party(waiter, now), "held": held}
            self.waits.count("lock", name, "abandoned")
            self._grant_next(name, lock, now)
        elif waiter in lock.queue:
            lock.queue.remove(waiter)

    def _grant_next(self, name: str, lock: LockState, now: float) -> None:
        if lock.queue:
            self._grant(name, lock, lock.queue.pop(0), now)

    def _grant(self, name: str, lock: LockState, waiter: Waiter, now: float) -> None:
        lock.holder = waiter
        waiter.acquired = now
        waiter.holding = True
        abandoned, lock.abandoned = lock.abandoned, None
        self.waits.count("lock", name, "acquired")
        self.waits.host.send(
            waiter.conn,
            OK,
            budget=waiter.budget,
            waited=now - waiter.since,
            abandoned_by=abandoned,
        )

    def _due(self, name: str, lock: LockState) -> None:
        waits = self.waits
        now = waits.now()
        due = [w for w in lock.queue if w.deadline <= now]
        holder = lock.holder
        if not due or holder is None:
            return
        held = now - holder.acquired
        doing = waits.activity(holder.pid, ("lock", name))
        holder_party = {**waits.party(holder, now), "note": doing, "held": held}
        ended = holder.ident is not None and not holder.ident.alive()
        state = "; its process has ended" if ended else ""
        text = (
            f"held by {name_of(holder_party)}, acquired at {holder.site or '?'}, "
            f"held for {held:.2f}s{state}" + (f", {doing}" if doing else "")
        )
        for waiter in due:
            lock.queue.remove(waiter)
            mine = " (this very process: the lock is not reentrant)"
            if waiter.pid != holder.pid:
                mine = ""
            waiting = [waits.party(w, now) for w in [waiter, *lock.queue]]
            waits.count("lock", name, "timeouts")
            waits.time_out(
                waiter,
                f"lock:{name}",
                f"{text}{mine}; waiting: {names(waiting, waited=True)}",
                now,
                holder=holder_party,
                held=held,
                waiting=waiting,
            )

    def _note_hold(self, name: str, held: float) -> None:
        entry = self.waits.summary["lock"][name]
        entry["longest_hold"] = round(max(float(entry.get("longest_hold", 0.0)), held), 6)
