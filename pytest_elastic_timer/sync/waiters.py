"""Who waits: the calls the primitives hold, and what the primitives share about them.

Every blocking call of a process comes on a connection of its own (see :mod:`.client`),
so a connection *is* one waiter: the answer goes back on it, and its closing means the
caller went away. :class:`Waits` keeps the open calls, names their parties, says what
else a process is doing, and turns a call that timed out into an expiry record and an
answer. It works through its :class:`~pytest_elastic_timer.watchdog.host.Host` alone.
"""

from __future__ import annotations

import itertools
import math
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pytest_elastic_timer.core import records, wire
from pytest_elastic_timer.sync.protocol import MAX_NAME, MAX_STACK, TIMEOUT
from pytest_elastic_timer.watchdog.host import Host, Identity


@dataclass(eq=False)
class Waiter:
    """One call of one process, on its own connection."""

    conn: socket.socket
    pid: int
    ident: Identity | None
    label: str  # what the call said (its label= argument or its process's label)
    site: str  # file:line of the call
    nodeid: str
    worker: str
    stack: str
    budget: float  # scaled
    since: float
    deadline: float
    acquired: float = 0.0  # locks: when this waiter got the lock
    holding: bool = False  # locks: this waiter holds the lock


Party = dict[str, Any]  # a waiter as the answers and records name it


class Waits:
    """The open calls of every primitive, and the bookkeeping they share."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.calls: dict[socket.socket, tuple[str, str, Waiter]] = {}  # conn -> what it waits on
        self.serials = itertools.count(-1, -1)  # records: negative, apart from scope serials
        self.summary: dict[str, dict[str, dict[str, Any]]] = {}
        self.errors = 0

    def now(self) -> float:
        return self.host.clock()

    def blocking_call(self, conn: socket.socket, fields: dict[str, Any]) -> str:
        """The name a blocking call is about; one such call per connection."""
        if conn in self.calls:
            raise wire.BadMessage("one call per connection")
        return name(fields)

    def waiter(self, conn: socket.socket, peer_pid: int, fields: dict[str, Any]) -> Waiter:
        """The caller of a request, with its deadline (its timeout times the scale)."""
        timeout = fields.get("timeout", 0.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise wire.BadMessage(f"timeout must be a number, not {timeout!r}")
        if not math.isfinite(timeout) or timeout < 0:
            raise ValueError(f"timeout must be a finite number of seconds >= 0, not {timeout!r}")
        budget = float(timeout) * self.host.scale
        now = self.now()
        return Waiter(
            conn=conn,
            pid=peer_pid,
            ident=self.host.identify(peer_pid),
            label=text(fields, "label", MAX_NAME),
            site=text(fields, "site", 4096),
            nodeid=text(fields, "nodeid", 4096),
            worker=text(fields, "worker", 200),
            stack=text(fields, "stack", MAX_STACK),
            budget=budget,
            since=now,
            deadline=now + budget,
        )

    def later(self, when: float, callback: Callable[[], None]) -> None:
        """Run ``callback`` at ``when``; a bug in it must never cost the watchdog."""

        def run() -> None:
            try:
                callback()
            except Exception as exc:
                self.internal_error(exc)

        self.host.call_at(when, run)

    def internal_error(self, exc: Exception) -> None:
        self.errors += 1
        sys.stderr.write(f"pytest-elastic-timer: sync primitives: {exc!r}\n")

    # -- who ----------------------------------------------------------------------
    def label(self, waiter: Waiter) -> str:
        """The call's label, else the label its process set (the owner table)."""
        if waiter.label:
            return waiter.label
        facts = self.host.owner_facts(waiter.pid)
        return facts.label if facts is not None else ""

    def party(self, waiter: Waiter, now: float) -> Party:
        return {
            "pid": waiter.pid,
            "label": self.label(waiter),
            "site": waiter.site,
            "worker": waiter.worker,
            "waited": round(now - waiter.since, 6),
        }

    def activity(self, pid: int, here: tuple[str, str]) -> str:
        """What process ``pid`` is doing now with the primitives other than ``here``
        (kind, name), if anything."""
        doing = []
        now = self.now()
        for kind, call_name, waiter in self.calls.values():
            if waiter.pid != pid or (kind, call_name) == here:
                continue
            since = now - waiter.since
            if kind == "barrier":
                doing.append(f"now waiting at barrier {call_name!r} for {since:.2f}s")
            elif kind == "event":
                doing.append(f"now waiting for event {call_name!r} for {since:.2f}s")
            elif waiter.holding:
                doing.append(f"now holding lock {call_name!r} for {now - waiter.acquired:.2f}s")
            else:
                doing.append(f"now waiting for lock {call_name!r} for {since:.2f}s")
        return ", ".join(doing)

    # -- reports ------------------------------------------------------------------
    def time_out(self, waiter: Waiter, scope: str, detail: str, now: float, **facts: Any) -> None:
        """Record that ``waiter``'s call timed out (first: a record outlives anything),
        then answer it."""
        self.calls.pop(waiter.conn, None)
        self._record(waiter, scope, detail, now)
        self.host.send(
            waiter.conn,
            TIMEOUT,
            budget=waiter.budget,
            elapsed=now - waiter.since,
            detail=detail,
            **facts,
        )

    def _record(self, waiter: Waiter, scope: str, detail: str, now: float) -> None:
        """An expiry record for a call that timed out, like one of an expired scope."""
        facts = self.host.owner_facts(waiter.pid)
        file, line = records.split_site(waiter.site)
        kind, _, call_name = scope.partition(":")
        self.host.add_record(
            records.ExpiryRecord(
                nodeid=waiter.nodeid,
                scope=scope,
                budget=round(waiter.budget, 3),
                elapsed=round(now - waiter.since, 6),
                pid=waiter.pid,
                label=self.label(waiter),
                worker=waiter.worker or (facts.worker if facts else ""),
                file=file,
                line=line,
                action="interrupted",
                stack=f"{kind} {call_name!r} timed out: {detail}\n\n{waiter.stack}",
                phase=facts.phase if facts else "",
                deadline=waiter.deadline,
                ended=now,
                serial=next(self.serials),
            )
        )

    def count(self, kind: str, call_name: str, what: str, **facts: Any) -> None:
        """Per-primitive counts, in the JSON report's ``session.sync``."""
        if not self.summary:
            self.host.set_fact("sync", self.summary)
        entry = self.summary.setdefault(kind, {}).setdefault(call_name, {})
        entry[what] = int(entry.get(what, 0)) + 1
        entry.update(facts)


def name(fields: dict[str, Any]) -> str:
    """The primitive's name in a request."""
    value: str = wire.field(fields, "name", str)
    if not value or len(value) > MAX_NAME:
        raise ValueError(f"a name must have 1 to {MAX_NAME} characters, not {len(value)}")
    return value


def text(fields: dict[str, Any], key: str, limit: int) -> str:
    """A text field of a request, cut to ``limit`` characters ("" if absent)."""
    value = fields.get(key, "")
    if not isinstance(value, str):
        raise wire.BadMessage(f"field {key!r} must be a str")
    return value[:limit]


def name_of(party: Party | None) -> str:
    """How a message names a party: ``rank 0 (pid 12, gw1)``."""
    if party is None:
        return "?"
    pid, label, worker = party.get("pid", 0), party.get("label", ""), party.get("worker", "")
    if not pid:
        return "a party that never arrived"
    where = f"pid {pid}, {worker}" if worker else f"pid {pid}"
    return f"{label} ({where})" if label else where


def names(parties: list[Party], *, waited: bool = False) -> str:
    """Several parties, with how long each waited if ``waited``."""
    if not parties:
        return "none"
    if waited:
        return ", ".join(f"{name_of(p)} for {p.get('waited', 0.0):.2f}s" for p in parties)
    return ", ".join(name_of(p) for p in parties)
