"""Deadline-aware synchronization across the session's processes: barrier, event, lock.

Their classic failure is silence: a barrier that one rank never reaches just waits.
These always have a deadline, and when it passes they say who did not arrive, who
waited, who holds the lock (and since where, for how long).

The session's watchdog keeps their state and decides every timeout (:mod:`.server`).
Each blocking call opens a connection of its own to the watchdog (the socket named by
``PYTEST_ELASTIC_TIMER``), so it works from any thread, never takes an answer meant for
the process's scope connection, and its closing tells the watchdog that the caller went
away: a lock is held for as long as the connection that acquired it stays open, so a
holder that dies releases it. Without a watchdog (plain ``python``) every call raises
:class:`RuntimeError`.
"""

from __future__ import annotations

import contextlib
import operator
import os
import socket
import sys
import threading
import traceback
import warnings
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

from pytest_elastic_timer.core import afterfork, unpatched, wire
from pytest_elastic_timer.core.seconds import Seconds, check_seconds
from pytest_elastic_timer.scope import client, scopes
from pytest_elastic_timer.scope.scopes import ScopeExpired
from pytest_elastic_timer.sync import protocol

STACK_FRAMES = 25
_ANSWER_MARGIN = 10.0  # seconds past its budget that a call waits for the watchdog's word
_QUICK = 10.0  # seconds an immediate request (set, clear, is_set) may take
# The longest a call waits for an answer: a socket's timeout has a limit (some 290
# years), and a longer budget waits as long as forever does.
_LONGEST_WAIT = 86400.0 * 365

_open: set[socket.socket] = set()  # connections of calls in progress, for after a fork
_open_lock = threading.Lock()


def _forget_after_fork() -> None:
    # A forked child must not keep its parent's lock (or waits) alive: close its copies.
    global _open_lock
    for sock in list(_open):
        sock.close()
    _open.clear()
    _open_lock = threading.Lock()


afterfork.call_in_child(_forget_after_fork)


@dataclass(frozen=True)
class Party:
    """A process taking part in a primitive, as the watchdog saw it.

    ``pid`` is 0 for a barrier party that never arrived. ``label`` is the call's
    ``label=``, else its process's label (:func:`set_label`, default from ``RANK``).
    ``site`` is the ``file:line`` of its call (for a lock holder: where it acquired the
    lock), ``note`` what else is known (e.g. ``passed round 4 0.31s ago; now waiting at
    barrier 'b'``), ``waited`` how long it had been waiting, in seconds.
    """

    pid: int
    label: str = ""
    site: str = ""
    worker: str = ""
    note: str = ""
    waited: float = 0.0

    @classmethod
    def from_wire(cls, data: Any) -> Party:
        """A party as the watchdog's answer describes it (``unknown`` if unreadable)."""
        if not isinstance(data, dict):
            return cls(0, note="unknown")
        return cls(
            pid=int(data.get("pid") or 0),
            label=str(data.get("label") or ""),
            site=str(data.get("site") or ""),
            worker=str(data.get("worker") or ""),
            note=str(data.get("note") or ""),
            waited=float(data.get("waited") or 0.0),
        )

    def __str__(self) -> str:
        if not self.pid:
            return "a party that never arrived"
        where = f"pid {self.pid}, {self.worker}" if self.worker else f"pid {self.pid}"
        return f"{self.label} ({where})" if self.label else where


# -- timeouts ------------------------------------------------------------------------
class SyncTimeout(ScopeExpired):
    """A barrier, event wait or lock acquisition that ran out of time.

    A :class:`ScopeExpired` (so a :class:`TimeoutError`) whose ``scope`` is
    ``"<kind>:<name>"``; ``name`` is the primitive's name and ``detail`` the watchdog's
    account of who was there, which ends the message.
    """

    kind = "sync"

    def __init__(
        self,
        scope: str = "",
        budget: float = 0.0,
        elapsed: float = 0.0,
        pid: int = 0,
        action: str = "interrupted",
        site: str = "",
        label: str = "",
        *,
        name: str = "",
        detail: str = "",
    ) -> None:
        self.name = name
        self.detail = detail
        super().__init__(scope, budget, elapsed, pid, action, site, label)

    def line(self) -> str:
        return (
            f"{self.kind} {self.name!r} timed out after {self.elapsed:.2f}s "
            f"(budget {self.budget:g}s): {self.detail}"
        )

    def __reduce__(self) -> Any:  # every attribute crosses process boundaries
        args = (self.scope, self.budget, self.elapsed, self.pid, self.action, self.site)
        return (type(self), (*args, self.label), dict(self.__dict__))


class BarrierTimeout(SyncTimeout):
    """Raised in every process waiting at a barrier when its round times out.

    Attributes: ``arrived`` and ``missing`` (lists of :class:`Party`; ``missing`` has
    one entry per missing party, and a party the watchdog never heard of has
    ``pid == 0``), ``never_arrived`` (how many of those), ``parties`` and
    ``generation`` (the round that timed out, counted from 0).
    """

    kind = "barrier"

    def __init__(
        self,
        *args: Any,
        arrived: list[Party] | None = None,
        missing: list[Party] | None = None,
        parties: int = 0,
        generation: int = 0,
        **kwargs: Any,
    ) -> None:
        self.arrived = list(arrived or [])
        self.missing = list(missing or [])
        self.parties = parties
        self.generation = generation
        super().__init__(*args, **kwargs)

    @property
    def never_arrived(self) -> int:
        """How many of the missing parties never called the barrier (no pid known)."""
        return sum(1 for p in self.missing if not p.pid)


class EventTimeout(SyncTimeout):
    """Raised by :meth:`Event.wait` when nobody set the event in time.

    Attributes: ``waiting`` (every :class:`Party` waiting for the event at that moment,
    this one included), ``set_by`` and ``cleared_by`` (the last to set and to clear
    it, or None).
    """

    kind = "event"

    def __init__(
        self,
        *args: Any,
        waiting: list[Party] | None = None,
        set_by: Party | None = None,
        cleared_by: Party | None = None,
        **kwargs: Any,
    ) -> None:
        self.waiting = list(waiting or [])
        self.set_by = set_by
        self.cleared_by = cleared_by
        super().__init__(*args, **kwargs)


class LockTimeout(SyncTimeout):
    """Raised when a :func:`lock` is not acquired in time.

    Attributes: ``holder`` (a :class:`Party`; its ``site`` is where it acquired the
    lock), ``held`` (seconds it had held it) and ``waiting`` (this process first, then
    the queue behind it).
    """

    kind = "lock"

    def __init__(
        self,
        *args: Any,
        holder: Party | None = None,
        held: float = 0.0,
        waiting: list[Party] | None = None,
        **kwargs: Any,
    ) -> None:
        self.holder = holder
        self.held = held
        self.waiting = list(waiting or [])
        super().__init__(*args, **kwargs)


for _cls in (SyncTimeout, BarrierTimeout, EventTimeout, LockTimeout):
    _cls.__module__ = "pytest_elastic_timer"


class LockAbandoned(RuntimeWarning):
    """Warned by the process that gets a lock whose previous holder went away holding it
    (its process died, or closed the lock's connection without releasing it)."""


LockAbandoned.__module__ = "pytest_elastic_timer"


# -- the connection of one call ------------------------------------------------------
class _Call:
    """One call's own connection to the session's watchdog."""

    def __init__(self, what: str) -> None:
        address = os.environ.get(client.ENV_ADDRESS)
        if not address:
            raise RuntimeError(
                f"{what} needs the pytest session's watchdog, and there is none: "
                f"{client.ENV_ADDRESS} is not set. The synchronization primitives work in a "
                "pytest session with the elastic_timer plugin and in processes its tests "
                "start (they inherit the variable)."
            )
        self.what = what
        sock = unpatched.Socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.settimeout(_QUICK)
            unpatched.connect(sock, address)
        except OSError as exc:
            sock.close()
            raise RuntimeError(
                f"{what}: cannot reach the session's watchdog at {address} ({exc})"
            ) from None
        self.sock = sock
        with _open_lock:
            _open.add(sock)

    def ask(self, op: str, wait: float, **fields: Any) -> tuple[str, dict[str, Any]]:
        """Send ``op``; the watchdog's answer, waiting up to ``wait`` seconds for it."""
        sock = self.sock
        try:
            sock.settimeout(_QUICK)
            sock.sendall(wire.encode(op, **fields))
            sock.settimeout(wait)
            data = sock.recv(wire.MAX_MESSAGE)
        except ScopeExpired:
            raise  # an enclosing scope expired while we waited (it is a TimeoutError)
        except TimeoutError:
            raise RuntimeError(
                f"{self.what}: the session's watchdog did not answer within {wait:g}s"
            ) from None
        except OSError as exc:
            raise RuntimeError(f"{self.what}: lost the session's watchdog ({exc})") from None
        if not data:
            raise RuntimeError(
                f"{self.what}: the session's watchdog closed the connection (it is gone, or "
                "this process is not part of its session)"
            )
        answer, fields = wire.decode(data)
        if answer == protocol.ERROR:
            raise ValueError(str(fields.get("error", f"{self.what}: refused")))
        return answer, fields

    def tell(self, op: str, **fields: Any) -> None:
        try:
            self.sock.send(wire.encode(op, **fields))
        except OSError:
            pass  # the watchdog is gone; closing is all that is left to do

    def close(self) -> None:
        with _open_lock:
            _open.discard(self.sock)
        self.sock.close()


def _caller(frame: FrameType | None, label: str | None) -> dict[str, Any]:
    """Who calls and from where: the fields every request carries."""
    state = scopes.current_state()
    if state is None and threading.current_thread() is threading.main_thread():
        state = scopes.process_state()  # registers this process and its label
    if label is None:
        label = state.label if state is not None else client.label_from_env()
    nodeid = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    site = f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else ""
    stack = "".join(traceback.format_stack(frame, limit=STACK_FRAMES)) if frame else ""
    return {
        "label": label,
        "site": site,
        "nodeid": nodeid or (state.nodeid if state is not None else ""),
        "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
        "stack": stack[-protocol.MAX_STACK :],
    }


def _traced(scope: str, start: float, expired: bool) -> None:
    """The wait as a span of the trace timeline (``--elastic-timer-trace``)."""
    state = scopes.current_state()
    if state is not None and state.trace is not None and state.pid == unpatched.getpid():
        state.traced(scope, start, unpatched.get_ident(), expired)


def _check_name(name: object, what: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"{what} name must be a str, not {name!r}")
    if not 1 <= len(name) <= protocol.MAX_NAME:
        raise ValueError(f"{what} name must have 1 to {protocol.MAX_NAME} characters")
    return name


def _check_timeout(timeout: object, what: str) -> float:
    return check_seconds(timeout, f"{what} timeout")


def _check_parties(parties: object) -> int:
    # An integer of any library (numpy's int64 from a world size), as a plain int for
    # the wire; never a bool, nor a float, even 2.0.
    if not isinstance(parties, bool):
        with contextlib.suppress(TypeError, ValueError):
            return operator.index(parties)  # type: ignore[arg-type]
    raise TypeError(f"barrier parties must be an int, not {parties!r}")


def _check_label(label: object) -> str | None:
    if label is not None and not isinstance(label, str):
        raise TypeError(f"label must be a str or None, not {label!r}")
    return label


def _wait_for(budget: float) -> float:
    # The watchdog applies the scale factor; the wait for its answer allows for it.
    state = scopes.current_state()
    scale = state.scale if state is not None else client.scale_from_env()
    return min(budget * max(scale, 1.0) + _ANSWER_MARGIN, _LONGEST_WAIT)


def _wait(
    what: str, scope: str, frame: FrameType, label: str | None, seconds: float, **fields: Any
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """One blocking call of barrier or event ``scope`` on its own connection:
    (answer op, answer, the caller's fields)."""
    kind, _, name = scope.partition(":")
    call = _Call(what)
    start = unpatched.monotonic()
    try:
        who = _caller(frame, label)
        op, answer = call.ask(
            _WAIT_OPS[kind], _wait_for(seconds), name=name, timeout=seconds, **fields, **who
        )
    finally:
        call.close()
    _traced(scope, start, op == protocol.TIMEOUT)
    return op, answer, who


_WAIT_OPS = {"barrier": protocol.OP_BARRIER, "event": protocol.OP_EVENT_WAIT}


def _party(data: Any) -> Party | None:
    return Party.from_wire(data) if data else None


def _parties(data: Any) -> list[Party]:
    return [Party.from_wire(p) for p in data] if isinstance(data, list) else []


def _timeout_args(
    scope: str, name: str, who: dict[str, Any], answer: dict[str, Any]
) -> dict[str, Any]:
    return {
        "scope": scope,
        "budget": float(answer.get("budget", 0.0)),
        "elapsed": float(answer.get("elapsed", 0.0)),
        "pid": unpatched.getpid(),
        "site": str(who["site"]),
        "label": str(who["label"]),
        "name": name,
        "detail": str(answer.get("detail", "")),
    }


# -- barrier -------------------------------------------------------------------------
def barrier(name: str, parties: int, timeout: Seconds, *, label: str | None = None) -> int:
    """Wait until ``parties`` processes of the session reached barrier ``name``.

    Returns this process's arrival index in the round (0 for the first to arrive, as
    :meth:`threading.Barrier.wait`). The barrier is reusable: once a round passes (or
    times out) the next call starts the next round. ``timeout`` is in seconds,
    multiplied by the session's scale factor; when the first deadline of a round
    passes, every waiting process raises :class:`BarrierTimeout` naming who arrived and
    who is missing. All parties of a round must agree on ``parties`` (else
    :class:`ValueError`). ``label`` names this party in reports instead of the
    process's label.
    """
    __tracebackhide__ = True  # pytest shows the caller's line, not ours
    _check_name(name, "barrier")
    parties = _check_parties(parties)
    if not 1 <= parties <= protocol.MAX_PARTIES:
        raise ValueError(f"barrier parties must be between 1 and {protocol.MAX_PARTIES}")
    seconds = _check_timeout(timeout, "barrier")
    _check_label(label)
    scope = f"barrier:{name}"
    op, answer, who = _wait(
        f"barrier {name!r}", scope, sys._getframe(1), label, seconds, parties=parties
    )
    if op == protocol.TIMEOUT:
        raise BarrierTimeout(
            arrived=_parties(answer.get("arrived")),
            missing=_parties(answer.get("missing")),
            parties=parties,
            generation=int(answer.get("generation", 0)),
            **_timeout_args(scope, name, who, answer),
        )
    return int(answer.get("index", 0))


# -- event ---------------------------------------------------------------------------
class Event:
    """An event shared by the session's processes: any of them :meth:`set` it, others
    :meth:`wait` for it, with a deadline.

    Events are named across the whole session: ``Event("ready")`` in two processes is
    one event. It stays set until :meth:`clear`. ``label`` names this process in
    reports instead of its process label. After :meth:`wait` or :meth:`is_set`,
    ``set_by`` is the :class:`Party` that set it.
    """

    def __init__(self, name: str, *, label: str | None = None) -> None:
        self.name = _check_name(name, "event")
        self.label = _check_label(label)
        self.set_by: Party | None = None

    def set(self) -> None:
        """Set the event; every process waiting for it returns."""
        self._quick(protocol.OP_EVENT_SET, sys._getframe(1))

    def clear(self) -> None:
        """Reset the event: later waits block until it is set again."""
        self._quick(protocol.OP_EVENT_CLEAR, sys._getframe(1))

    def is_set(self) -> bool:
        """Whether the event is set now."""
        answer = self._quick(protocol.OP_EVENT_GET, sys._getframe(1))
        self._note_setter(answer)
        return bool(answer.get("set"))

    def wait(self, timeout: Seconds) -> bool:
        """Block until the event is set; returns True. After ``timeout`` seconds
        (scaled) raises :class:`EventTimeout` naming who waited and whether anybody
        ever set it."""
        __tracebackhide__ = True
        seconds = _check_timeout(timeout, "event")
        scope = f"event:{self.name}"
        op, answer, who = _wait(
            f"event {self.name!r}", scope, sys._getframe(1), self.label, seconds
        )
        if op == protocol.TIMEOUT:
            raise EventTimeout(
                waiting=_parties(answer.get("waiting")),
                set_by=_party(answer.get("set_by")),
                cleared_by=_party(answer.get("cleared_by")),
                **_timeout_args(scope, self.name, who, answer),
            )
        self._note_setter(answer)
        return True

    def _quick(self, op: str, frame: FrameType) -> dict[str, Any]:
        call = _Call(f"event {self.name!r}")
        try:
            _, answer = call.ask(op, _QUICK, name=self.name, **_caller(frame, self.label))
        finally:
            call.close()
        return answer

    def _note_setter(self, answer: dict[str, Any]) -> None:
        if answer.get("set_by"):
            self.set_by = Party.from_wire(answer["set_by"])

    def __repr__(self) -> str:
        return f"<Event {self.name!r}>"


# -- lock ----------------------------------------------------------------------------
class SessionLock:
    """A lock shared by the session's processes (made by :func:`lock`).

    Use it as a context manager, or with :meth:`acquire` / :meth:`release`. It is not
    reentrant: acquiring a lock that this process already holds times out, naming this
    process as the holder. The lock is held by the connection that acquired it: if the
    holder dies, the watchdog releases the lock, and the next process to get it is told
    twice: a :class:`LockAbandoned` warning, and ``abandoned_by`` (the dead holder, a
    :class:`Party`, its ``site`` where it acquired the lock) is set on this object
    until its next acquisition. ``waited`` is how long the last acquisition waited.
    """

    def __init__(self, name: str, timeout: Seconds, *, label: str | None = None) -> None:
        self.name = _check_name(name, "lock")
        self.timeout = _check_timeout(timeout, "lock")
        self.label = _check_label(label)
        self.abandoned_by: Party | None = None
        self.abandoned_held = 0.0  # how long the dead holder had held it
        self.waited = 0.0
        self._call: _Call | None = None
        self._pid = 0
        self._start = 0.0

    @property
    def held(self) -> bool:
        """Whether this object holds the lock (in this process)."""
        return self._call is not None and self._pid == unpatched.getpid()

    def acquire(self) -> SessionLock:
        """Wait for the lock, up to the timeout (scaled); raises :class:`LockTimeout`."""
        __tracebackhide__ = True
        return self._acquire(sys._getframe(1))

    def __enter__(self) -> SessionLock:
        __tracebackhide__ = True
        return self._acquire(sys._getframe(1))

    def _acquire(self, frame: FrameType) -> SessionLock:
        __tracebackhide__ = True
        if self.held:
            raise RuntimeError(f"lock {self.name!r} is already held by this object")
        scope = f"lock:{self.name}"
        call = _Call(f"lock {self.name!r}")
        start = unpatched.monotonic()
        try:
            who = _caller(frame, self.label)
            op, answer = call.ask(
                protocol.OP_LOCK_ACQUIRE,
                _wait_for(self.timeout),
                name=self.name,
                timeout=self.timeout,
                **who,
            )
        except BaseException:
            call.tell(protocol.OP_LOCK_RELEASE)  # interrupted: leave the queue (or let go)
            call.close()
            raise
        if op == protocol.TIMEOUT:
            call.close()
            _traced(scope, start, True)
            raise LockTimeout(
                holder=_party(answer.get("holder")),
                held=float(answer.get("held", 0.0)),
                waiting=_parties(answer.get("waiting")),
                **_timeout_args(scope, self.name, who, answer),
            )
        self._call, self._pid, self._start = call, unpatched.getpid(), start
        self.waited = float(answer.get("waited", 0.0))
        abandoned = answer.get("abandoned_by")
        self.abandoned_by = Party.from_wire(abandoned) if abandoned else None
        self.abandoned_held = float(abandoned.get("held", 0.0)) if abandoned else 0.0
        if self.abandoned_by is not None:
            try:
                warnings.warn(LockAbandoned(self._abandoned_text()), stacklevel=3)
            except BaseException:  # warnings as errors: do not keep the lock on the way out
                self.release()
                raise
        return self

    def _abandoned_text(self) -> str:
        dead = self.abandoned_by
        assert dead is not None
        return (
            f"lock {self.name!r} was abandoned: its holder {dead} (acquired at "
            f"{dead.site or '?'}) went away after holding it for {self.abandoned_held:.2f}s "
            "without releasing it; the watchdog released it and this process holds it now"
        )

    def release(self) -> None:
        """Release the lock (the next waiting process gets it)."""
        call = self._call
        if call is None or self._pid != unpatched.getpid():
            raise RuntimeError(f"lock {self.name!r} is not held by this object")
        self._call = None
        call.tell(protocol.OP_LOCK_RELEASE)
        call.close()
        _traced(f"lock:{self.name}", self._start, False)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.held:
            self.release()

    def __repr__(self) -> str:
        return f"<SessionLock {self.name!r} held={self.held}>"


def lock(name: str, timeout: Seconds, *, label: str | None = None) -> SessionLock:
    """A lock across the session's processes: ``with et.lock("port-8000", 10): ...``.

    ``timeout`` is how long an acquisition may wait, in seconds (scaled); it raises
    :class:`LockTimeout` naming the holder, where it acquired the lock and for how long
    it has held it. See :class:`SessionLock` for what happens when a holder dies.
    """
    return SessionLock(name, timeout, label=label)
