"""Watchdog side of the deadline-aware synchronization primitives (barrier, event, lock).

Every blocking call of a process comes on a connection of its own (see :mod:`.sync`),
so a connection *is* one waiter: the answer goes back on it, and its closing means the
caller went away (its call was interrupted, or its process died). A lock is held for as
long as the connection that acquired it stays open, so a holder that dies releases it,
and the next process that gets the lock is told.

The watchdog alone decides timeouts, on its own clock: when a waiter's deadline passes,
every waiter the timeout concerns is answered at once with who arrived, who is missing,
who holds the lock. Each process that timed out gets an expiry record like an expired
scope (scope ``barrier:<name>``, ``event:<name>`` or ``lock:<name>``, action
``interrupted``), so it appears in the terminal summary and the JSON report. Budgets
are multiplied by the session's scale factor here, once.

Installed into the watchdog through its extension points (``dog.extensions``,
``dog.on_disconnect``, ``dog.call_at``). Nothing here imports pytest.
"""

from __future__ import annotations

import itertools
import math
import socket
import sys
import time
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pytest_elastic_timer.core import records, wire
from pytest_elastic_timer.core import table as tbl

if TYPE_CHECKING:
    from pytest_elastic_timer.watchdog import proctree
    from pytest_elastic_timer.watchdog.server import Watchdog

OP_BARRIER = "sync.barrier"
OP_EVENT_SET = "sync.event.set"
OP_EVENT_CLEAR = "sync.event.clear"
OP_EVENT_GET = "sync.event.get"
OP_EVENT_WAIT = "sync.event.wait"
OP_LOCK_ACQUIRE = "sync.lock.acquire"
OP_LOCK_RELEASE = "sync.lock.release"  # from the holder: release; from a waiter: give up
# Answers.
OK = "sync.ok"
TIMEOUT = "sync.timeout"
ERROR = "sync.error"

MAX_NAME = 1000  # characters of a primitive's name (and of a label)
MAX_PARTIES = 100_000
MAX_STACK = 64_000


@dataclass(eq=False)
class Waiter:
    """One call of one process, on its own connection."""

    conn: socket.socket
    pid: int
    ident: proctree.ProcessId | None
    label: str  # what the call said (its label= argument or its process's label)
    site: str  # file:line of the call
    nodeid: str
    worker: str
    stack: str
    budget: float  # scaled
    since: float
    deadline: float
    acquired: float = 0.0  # locks: when this waiter got the lock


@dataclass
class BarrierState:
    parties: int = 0
    generation: int = 0  # the round now gathering
    waiting: list[Waiter] = field(default_factory=list)
    left: list[dict[str, Any]] = field(default_factory=list)  # arrived, then went away
    # Who took part in the last round that ended, and how it ended: the best guess at
    # who is missing when a round times out.
    last: list[tuple[dict[str, Any], proctree.ProcessId | None]] = field(default_factory=list)
    last_outcome: str = ""
    last_ended: float = 0.0


@dataclass
class EventState:
    is_set: bool = False
    set_by: dict[str, Any] | None = None
    cleared_by: dict[str, Any] | None = None
    waiting: list[Waiter] = field(default_factory=list)


@dataclass
class LockState:
    holder: Waiter | None = None
    queue: list[Waiter] = field(default_factory=list)
    abandoned: dict[str, Any] | None = None  # told to the next process that gets the lock


class SyncServer:
    """The primitives' state in the watchdog, keyed by name across the session."""

    def __init__(self, dog: Watchdog) -> None:
        self.dog = dog
        self.barriers: dict[str, BarrierState] = {}
        self.events: dict[str, EventState] = {}
        self.locks: dict[str, LockState] = {}
        self.calls: dict[socket.socket, tuple[str, str, Waiter]] = {}  # conn -> what it waits on
        self.serials = itertools.count(-1, -1)  # records: negative, apart from scope serials
        self.summary: dict[str, dict[str, dict[str, Any]]] = {}
        self.errors = 0

    # -- wiring -------------------------------------------------------------------
    def handlers(self) -> dict[str, Callable[[socket.socket, int, dict[str, Any]], None]]:
        table: dict[str, Callable[[socket.socket, int, dict[str, Any]], None]] = {
            OP_BARRIER: self.barrier,
            OP_EVENT_SET: self.event_set,
            OP_EVENT_CLEAR: self.event_clear,
            OP_EVENT_GET: self.event_get,
            OP_EVENT_WAIT: self.event_wait,
            OP_LOCK_ACQUIRE: self.lock_acquire,
            OP_LOCK_RELEASE: self.lock_release,
        }
        return {op: self._guarded(handler) for op, handler in table.items()}

    def _guarded(
        self, handler: Callable[[socket.socket, int, dict[str, Any]], None]
    ) -> Callable[[socket.socket, int, dict[str, Any]], None]:
        def run(conn: socket.socket, peer_pid: int, fields: dict[str, Any]) -> None:
            try:
                handler(conn, peer_pid, fields)
            except Exception as exc:
                # A bad request gets an answer (its caller would wait for nothing) and is
                # counted as dropped; a bug here must never cost the session its watchdog.
                if not isinstance(exc, (wire.BadMessage, ValueError, TypeError, KeyError)):
                    self._internal_error(exc)
                self.dog.dropped += 1
                self.dog._send(conn, ERROR, error=f"bad request: {exc}")

        return run

    def _safely(self, callback: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                callback()
            except Exception as exc:
                self._internal_error(exc)

        return run

    def _internal_error(self, exc: Exception) -> None:
        self.errors += 1
        sys.stderr.write(f"pytest-elastic-timer: sync primitives: {exc!r}\n")

    def _safely_disconnected(self, conn: socket.socket) -> None:
        try:
            self.disconnected(conn)
        except Exception as exc:
            self._internal_error(exc)

    def disconnected(self, conn: socket.socket) -> None:
        """A caller went away: it leaves the barrier or the queue, or releases its lock."""
        call = self.calls.pop(conn, None)
        if call is None:
            return
        kind, name, waiter = call
        now = time.monotonic()
        if kind == "barrier":
            barrier = self.barriers[name]
            if waiter in barrier.waiting:
                barrier.waiting.remove(waiter)
                barrier.left.append(self._party(waiter, now))
        elif kind == "event":
            event = self.events[name]
            if waiter in event.waiting:
                event.waiting.remove(waiter)
        elif kind == "lock":
            lock = self.locks[name]
            if lock.holder is waiter:
                lock.holder = None
                held = now - waiter.acquired
                lock.abandoned = {**self._party(waiter, now), "held": held}
                self._count("lock", name, "abandoned")
                self._grant_next(name, lock, now)
            elif waiter in lock.queue:
                lock.queue.remove(waiter)

    # -- barrier ------------------------------------------------------------------
    def barrier(self, conn: socket.socket, peer_pid: int, fields: dict[str, Any]) -> None:
        name = self._blocking_call(conn, fields)
        parties = wire.field(fields, "parties", int)
        if not 1 <= parties <= MAX_PARTIES:
            raise ValueError(f"parties must be between 1 and {MAX_PARTIES}, not {parties}")
        barrier = self.barriers.setdefault(name, BarrierState())
        if barrier.waiting and barrier.parties != parties:
            self.dog._send(
                conn,
                ERROR,
                error=(
                    f"barrier {name!r} is gathering {barrier.parties} parties in round "
                    f"{barrier.generation} ({len(barrier.waiting)} arrived); this call says "
                    f"{parties}"
                ),
            )
            return
        waiter = self._waiter(conn, peer_pid, fields)
        barrier.parties = parties
        barrier.waiting.append(waiter)
        self.calls[conn] = ("barrier", name, waiter)
        if len(barrier.waiting) >= parties:
            self._barrier_pass(name, barrier)
            return
        generation = barrier.generation
        self.dog.call_at(
            waiter.deadline, self._safely(lambda: self._barrier_due(name, barrier, generation))
        )

    def _barrier_pass(self, name: str, barrier: BarrierState) -> None:
        now = time.monotonic()
        generation = barrier.generation
        self._count("barrier", name, "rounds", parties=barrier.parties)
        for index, waiter in enumerate(barrier.waiting):
            self.calls.pop(waiter.conn, None)
            self.dog._send(
                waiter.conn, OK, index=index, generation=generation, budget=waiter.budget
            )
        self._end_round(barrier, "passed", now)

    def _end_round(self, barrier: BarrierState, outcome: str, now: float) -> None:
        barrier.last = [(self._party(w, now), w.ident) for w in barrier.waiting]
        barrier.last_outcome = f"{outcome} round {barrier.generation}"
        barrier.last_ended = now
        barrier.generation += 1
        barrier.waiting = []
        barrier.left = []

    def _barrier_due(self, name: str, barrier: BarrierState, generation: int) -> None:
        if barrier.generation != generation or not barrier.waiting:
            return  # that round passed, or timed out already
        now = time.monotonic()
        if min(w.deadline for w in barrier.waiting) > now:
            return  # the waiter that set this timer left; another timer is due later
        arrived = [self._party(w, now) for w in barrier.waiting]
        missing = self._missing(name, barrier, now)
        detail = (
            f"{len(arrived)} of {barrier.parties} parties arrived in round {generation}: "
            f"{_names(arrived)}; missing: {_missing_text(missing, barrier.parties)}"
        )
        self._count("barrier", name, "timeouts", parties=barrier.parties)
        for waiter in barrier.waiting:
            self._time_out(
                waiter,
                f"barrier:{name}",
                detail,
                now,
                arrived=arrived,
                missing=missing,
                parties=barrier.parties,
                generation=generation,
            )
        self._end_round(barrier, "timed out in", now)

    def _missing(self, name: str, barrier: BarrierState, now: float) -> list[dict[str, Any]]:
        """Who the round waits for: those that left it, those that took part in the
        last round but not in this one, and as many as remain that never arrived."""
        needed = barrier.parties - len(barrier.waiting)
        here = Counter(w.pid for w in barrier.waiting)
        left: list[dict[str, Any]] = []
        for party in barrier.left:
            if here[party["pid"]]:
                here[party["pid"]] -= 1  # it came back
                continue
            note = "arrived, then went away (its call was interrupted or its process ended)"
            left.append({**party, "note": note})
        alive: list[dict[str, Any]] = []
        dead: list[dict[str, Any]] = []
        if len(barrier.last) == barrier.parties:  # the same use of the name, most likely
            ago = now - barrier.last_ended
            for party, ident in barrier.last:
                if here[party["pid"]]:
                    here[party["pid"]] -= 1
                    continue
                note = f"{barrier.last_outcome} {ago:.2f}s ago"
                if ident is None or ident.process() is None:
                    dead.append({**party, "note": f"{note}; its process has ended"})
                else:
                    doing = self._activity(party["pid"], ("barrier", name))
                    alive.append({**party, "note": f"{note}; {doing}" if doing else note})
        named = (left + alive + dead)[:needed]
        unknown = {"pid": 0, "label": "", "site": "", "worker": "", "note": "never arrived"}
        return named + [dict(unknown) for _ in range(needed - len(named))]

    # -- event --------------------------------------------------------------------
    def event_set(self, conn: socket.socket, peer_pid: int, fields: dict[str, Any]) -> None:
        name = _name(fields)
        event = self.events.setdefault(name, EventState())
        now = time.monotonic()
        setter = self._party(self._waiter(conn, peer_pid, fields), now)
        event.is_set = True
        event.set_by = {**setter, "at": now}
        woke = event.waiting
        event.waiting = []
        for waiter in woke:
            self.calls.pop(waiter.conn, None)
            self.dog._send(
                waiter.conn, OK, budget=waiter.budget, set_by=setter, waited=now - waiter.since
            )
        self._count("event", name, "sets")
        self.dog._send(conn, OK, woke=len(woke))

    def event_clear(self, conn: socket.socket, peer_pid: int, fields: dict[str, Any]) -> None:
        name = _name(fields)
        event = self.events.setdefault(name, EventState())
        now = time.monotonic()
        if event.is_set:
            event.cleared_by = {**self._party(self._waiter(conn, peer_pid, fields), now), "at": now}
        event.is_set = False
        self.dog._send(conn, OK)

    def event_get(self, conn: socket.socket, peer_pid: int, fields: dict[str, Any]) -> None:
        event = self.events.get(_name(fields))
        is_set = event is not None and event.is_set
        set_by = event.set_by if event is not None and is_set else None
        self.dog._send(conn, OK, set=is_set, set_by=set_by)

    def event_wait(self, conn: socket.socket, peer_pid: int, fields: dict[str, Any]) -> None:
        name = self._blocking_call(conn, fields)
        event = self.events.setdefault(name, EventState())
        waiter = self._waiter(conn, peer_pid, fields)
        self._count("event", name, "waits")
        if event.is_set:
            self.dog._send(conn, OK, budget=waiter.budget, set_by=event.set_by, waited=0.0)
            return
        event.waiting.append(waiter)
        self.calls[conn] = ("event", name, waiter)
        self.dog.call_at(waiter.deadline, self._safely(lambda: self._event_due(name, event)))

    def _event_due(self, name: str, event: EventState) -> None:
        now = time.monotonic()
        due = [w for w in event.waiting if w.deadline <= now]
        if not due:
            return
        waiting = [self._party(w, now) for w in event.waiting]
        history = "nobody set it"
        if event.set_by is not None:
            history = f"set by {_name_of(event.set_by)} {now - event.set_by['at']:.2f}s ago"
        if event.cleared_by is not None:
            ago = now - event.cleared_by["at"]
            history += f", cleared by {_name_of(event.cleared_by)} {ago:.2f}s ago"
        for waiter in due:
            event.waiting.remove(waiter)
            self._count("event", name, "timeouts")
            self._time_out(
                waiter,
                f"event:{name}",
                f"{history}; waiting: {_names(waiting, waited=True)}",
                now,
                waiting=waiting,
                set_by=event.set_by,
                cleared_by=event.cleared_by,
            )

    # -- lock ---------------------------------------------------------------------
    def lock_acquire(self, conn: socket.socket, peer_pid: int, fields: dict[str, Any]) -> None:
        name = self._blocking_call(conn, fields)
        lock = self.locks.setdefault(name, LockState())
        waiter = self._waiter(conn, peer_pid, fields)
        self.calls[conn] = ("lock", name, waiter)
        if lock.holder is None:
            self._grant(name, lock, waiter, time.monotonic())
            return
        lock.queue.append(waiter)
        self.dog.call_at(waiter.deadline, self._safely(lambda: self._lock_due(name, lock)))

    def lock_release(self, conn: socket.socket, peer_pid: int, fields: dict[str, Any]) -> None:
        call = self.calls.get(conn)
        if call is None or call[0] != "lock":
            return  # already released, timed out or never asked: nothing to do
        _, name, waiter = call
        lock = self.locks[name]
        del self.calls[conn]
        now = time.monotonic()
        if lock.holder is waiter:
            lock.holder = None
            self._note_hold(name, now - waiter.acquired)
            self._grant_next(name, lock, now)
        elif waiter in lock.queue:
            lock.queue.remove(waiter)  # gave up waiting (interrupted)

    def _grant_next(self, name: str, lock: LockState, now: float) -> None:
        if lock.queue:
            self._grant(name, lock, lock.queue.pop(0), now)

    def _grant(self, name: str, lock: LockState, waiter: Waiter, now: float) -> None:
        lock.holder = waiter
        waiter.acquired = now
        abandoned, lock.abandoned = lock.abandoned, None
        self._count("lock", name, "acquired")
        self.dog._send(
            waiter.conn,
            OK,
            budget=waiter.budget,
            waited=now - waiter.since,
            abandoned_by=abandoned,
        )

    def _lock_due(self, name: str, lock: LockState) -> None:
        now = time.monotonic()
        due = [w for w in lock.queue if w.deadline <= now]
        holder = lock.holder
        if not due or holder is None:
            return
        held = now - holder.acquired
        doing = self._activity(holder.pid, ("lock", name))
        holder_party = {**self._party(holder, now), "note": doing, "held": held}
        state = "" if holder.ident is None or holder.ident.process() else "; its process has ended"
        text = (
            f"held by {_name_of(holder_party)}, acquired at {holder.site or '?'}, "
            f"held for {held:.2f}s{state}" + (f", {doing}" if doing else "")
        )
        for waiter in due:
            lock.queue.remove(waiter)
            mine = " (this very process: the lock is not reentrant)"
            if waiter.pid != holder.pid:
                mine = ""
            waiting = [self._party(w, now) for w in [waiter, *lock.queue]]
            self._count("lock", name, "timeouts")
            self._time_out(
                waiter,
                f"lock:{name}",
                f"{text}{mine}; waiting: {_names(waiting, waited=True)}",
                now,
                holder=holder_party,
                held=held,
                waiting=waiting,
            )

    def _note_hold(self, name: str, held: float) -> None:
        entry = self.summary["lock"][name]
        entry["longest_hold"] = round(max(float(entry.get("longest_hold", 0.0)), held), 6)

    # -- who ----------------------------------------------------------------------
    def _blocking_call(self, conn: socket.socket, fields: dict[str, Any]) -> str:
        """The name a blocking call is about; one such call per connection."""
        if conn in self.calls:
            raise wire.BadMessage("one call per connection")
        return _name(fields)

    def _waiter(self, conn: socket.socket, peer_pid: int, fields: dict[str, Any]) -> Waiter:
        timeout = fields.get("timeout", 0.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise wire.BadMessage(f"timeout must be a number, not {timeout!r}")
        if not math.isfinite(timeout) or timeout < 0:
            raise ValueError(f"timeout must be a finite number of seconds >= 0, not {timeout!r}")
        budget = float(timeout) * self.dog.scale
        now = time.monotonic()
        return Waiter(
            conn=conn,
            pid=peer_pid,
            ident=_process_id(peer_pid),
            label=_text(fields, "label", MAX_NAME),
            site=_text(fields, "site", 4096),
            nodeid=_text(fields, "nodeid", 4096),
            worker=_text(fields, "worker", 200),
            stack=_text(fields, "stack", MAX_STACK),
            budget=budget,
            since=now,
            deadline=now + budget,
        )

    def _label(self, waiter: Waiter) -> str:
        """The call's label, else the label its process set (the owner table)."""
        if waiter.label:
            return waiter.label
        owner = self.dog.owners.get(waiter.pid)
        return owner.header_text(tbl.H_LABEL_SID) if owner is not None else ""

    def _party(self, waiter: Waiter, now: float) -> dict[str, Any]:
        return {
            "pid": waiter.pid,
            "label": self._label(waiter),
            "site": waiter.site,
            "worker": waiter.worker,
            "waited": round(now - waiter.since, 6),
        }

    def _activity(self, pid: int, here: tuple[str, str]) -> str:
        """What process ``pid`` is doing now with the primitives other than ``here``
        (kind, name), if anything."""
        doing = []
        now = time.monotonic()
        for kind, name, waiter in self.calls.values():
            if waiter.pid != pid or (kind, name) == here:
                continue
            since = now - waiter.since
            if kind == "barrier":
                doing.append(f"now waiting at barrier {name!r} for {since:.2f}s")
            elif kind == "event":
                doing.append(f"now waiting for event {name!r} for {since:.2f}s")
            elif self.locks[name].holder is waiter:
                doing.append(f"now holding lock {name!r} for {now - waiter.acquired:.2f}s")
            else:
                doing.append(f"now waiting for lock {name!r} for {since:.2f}s")
        return ", ".join(doing)

    # -- reports ------------------------------------------------------------------
    def _time_out(self, waiter: Waiter, scope: str, detail: str, now: float, **facts: Any) -> None:
        """Record that ``waiter``'s call timed out (first: a record outlives anything),
        then answer it."""
        self.calls.pop(waiter.conn, None)
        self._record(waiter, scope, detail, now)
        self.dog._send(
            waiter.conn,
            TIMEOUT,
            budget=waiter.budget,
            elapsed=now - waiter.since,
            detail=detail,
            **facts,
        )

    def _record(self, waiter: Waiter, scope: str, detail: str, now: float) -> None:
        """An expiry record for a call that timed out, like one of an expired scope."""
        dog = self.dog
        owner = dog.owners.get(waiter.pid)
        file, line = records.split_site(waiter.site)
        label = self._label(waiter)
        worker = waiter.worker or (owner.header_text(tbl.H_WORKER_SID) if owner else "")
        kind, _, name = scope.partition(":")
        record = records.ExpiryRecord(
            nodeid=waiter.nodeid,
            scope=scope,
            budget=round(waiter.budget, 3),
            elapsed=round(now - waiter.since, 6),
            pid=waiter.pid,
            label=label,
            worker=worker,
            file=file,
            line=line,
            action="interrupted",
            stack=f"{kind} {name!r} timed out: {detail}\n\n{waiter.stack}",
            phase=owner.header_text(tbl.H_PHASE_SID) if owner else "",
            deadline=waiter.deadline,
            ended=now,
            serial=next(self.serials),
        )
        dog.records.append(record)
        try:
            records.append_record(dog.records_path, record)
        except OSError as exc:
            sys.stderr.write(f"pytest-elastic-timer: cannot write a record: {exc}\n")

    def _count(self, kind: str, name: str, what: str, **facts: Any) -> None:
        """Per-primitive counts, in the JSON report's ``session.sync``."""
        if not self.summary:
            self.dog.session["sync"] = self.summary
        entry = self.summary.setdefault(kind, {}).setdefault(name, {})
        entry[what] = int(entry.get(what, 0)) + 1
        entry.update(facts)


def _name(fields: dict[str, Any]) -> str:
    name: str = wire.field(fields, "name", str)
    if not name or len(name) > MAX_NAME:
        raise ValueError(f"a name must have 1 to {MAX_NAME} characters, not {len(name)}")
    return name


def _text(fields: dict[str, Any], key: str, limit: int) -> str:
    value = fields.get(key, "")
    if not isinstance(value, str):
        raise wire.BadMessage(f"field {key!r} must be a str")
    return value[:limit]


def _name_of(party: dict[str, Any] | None) -> str:
    if party is None:
        return "?"
    pid, label, worker = party.get("pid", 0), party.get("label", ""), party.get("worker", "")
    if not pid:
        return "a party that never arrived"
    where = f"pid {pid}, {worker}" if worker else f"pid {pid}"
    return f"{label} ({where})" if label else where


def _names(parties: list[dict[str, Any]], *, waited: bool = False) -> str:
    if not parties:
        return "none"
    if waited:
        return ", ".join(f"{_name_of(p)} for {p.get('waited', 0.0):.2f}s" for p in parties)
    return ", ".join(_name_of(p) for p in parties)


def _missing_text(missing: list[dict[str, Any]], parties: int) -> str:
    named = [f"{_name_of(p)}: {p['note']}" for p in missing if p.get("pid")]
    unknown = len(missing) - len(named)
    if unknown:
        named.append(f"{unknown} {'party' if unknown == 1 else 'parties'} never arrived")
    return f"{'; '.join(named)} ({len(missing)} of {parties} parties missing)"


_servers: weakref.WeakKeyDictionary[Watchdog, SyncServer] = weakref.WeakKeyDictionary()


def install(dog: Watchdog) -> SyncServer:
    """Register the synchronization ops with ``dog``."""
    server = _servers[dog] = SyncServer(dog)
    dog.extensions.update(server.handlers())
    dog.on_disconnect.append(server._safely_disconnected)
    return server


def server_of(dog: Watchdog) -> SyncServer:
    """The primitives' state in ``dog`` (for tests and debugging)."""
    return _servers[dog]


def _process_id(pid: int) -> proctree.ProcessId | None:
    # Imported here: the module is loaded into every pytest process, psutil is not.
    from pytest_elastic_timer.watchdog import proctree

    return proctree.ProcessId.of(pid)
