"""Events, in the watchdog: a flag under a name that processes set, clear and wait for.

A wait that times out is answered with who set or cleared the event last and who else
is waiting.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any

from pytest_elastic_timer.sync.protocol import OK
from pytest_elastic_timer.sync.waiters import Party, Waiter, Waits, name, name_of, names


@dataclass
class EventState:
    is_set: bool = False
    set_by: Party | None = None
    cleared_by: Party | None = None
    waiting: list[Waiter] = field(default_factory=list)


class Events:
    """Every event of the session, by name."""

    def __init__(self, waits: Waits) -> None:
        self.waits = waits
        self.events: dict[str, EventState] = {}

    def set(self, conn: socket.socket, peer_pid: int, fields: dict[str, Any]) -> None:
        waits = self.waits
        event_name = name(fields)
        event = self.events.setdefault(event_name, EventState())
        now = waits.now()
        setter = waits.party(waits.waiter(conn, peer_pid, fields), now)
        event.is_set = True
        event.set_by = {**setter, "at": now}
        woke = event.waiting
        event.waiting = []
        for waiter in woke:
            waits.calls.pop(waiter.conn, None)
            waits.host.send(
                waiter.conn, OK, budget=waiter.budget, set_by=setter, waited=now - waiter.since
            )
        waits.count("event", event_name, "sets")
        waits.host.send(conn, OK, woke=len(woke))

    def clear(self, conn: socket.socket, peer_pid: int, fields: dict[str, Any]) -> None:
        waits = self.waits
        event = self.events.setdefault(name(fields), EventState())
        now = waits.now()
        if event.is_set:
            event.cleared_by = {**waits.party(waits.waiter(conn, peer_pid, fields), now), "at": now}
        event.is_set = False
        waits.host.send(conn, OK)

    def get(self, conn: socket.socket, peer_pid: int, fields: dict[str, Any]) -> None:
        event = self.events.get(name(fields))
        is_set = event is not None and event.is_set
        set_by = event.set_by if event is not None and is_set else None
        self.waits.host.send(conn, OK, set=is_set, set_by=set_by)

    def wait(self, conn: socket.socket, peer_pid: int, fields: dict[str, Any]) -> None:
        waits = self.waits
        event_name = waits.blocking_call(conn, fields)
        event = self.events.setdefault(event_name, EventState())
        waiter = waits.waiter(conn, peer_pid, fields)
        waits.count("event", event_name, "waits")
        if event.is_set:
            waits.host.send(conn, OK, budget=waiter.budget, set_by=event.set_by, waited=0.0)
            return
        event.waiting.append(waiter)
        waits.calls[conn] = ("event", event_name, waiter)
        waits.later(waiter.deadline, lambda: self._due(event_name, event))

    def left(self, event_name: str, waiter: Waiter) -> None:
        """``waiter`` went away (its call was interrupted, or its process died)."""
        event = self.events[event_name]
        if waiter in event.waiting:
            event.waiting.remove(waiter)

    def _due(self, event_name: str, event: EventState) -> None:
        waits = self.waits
        now = waits.now()
        due = [w for w in event.waiting if w.deadline <= now]
        if not due:
            return
        waiting = [waits.party(w, now) for w in event.waiting]
        history = "nobody set it"
        if event.set_by is not None:
            history = f"set by {name_of(event.set_by)} {now - event.set_by['at']:.2f}s ago"
        if event.cleared_by is not None:
            ago = now - event.cleared_by["at"]
            history += f", cleared by {name_of(event.cleared_by)} {ago:.2f}s ago"
        for waiter in due:
            event.waiting.remove(waiter)
            waits.count("event", event_name, "timeouts")
            waits.time_out(
                waiter,
                f"event:{event_name}",
                f"{history}; waiting: {names(waiting, waited=True)}",
                now,
                waiting=waiting,
                set_by=event.set_by,
                cleared_by=event.cleared_by,
            )
