"""Timer scopes: where a deadline is entered, nested and moved.

A scope is a :class:`TimerRequest`. Entering it opens one slot in this process's
shared table (:mod:`pytest_elastic_timer.core.table`); leaving it closes the slot.
Nesting follows Trio's cancel scopes: the earliest deadline among the enclosing scopes
is in force, and when several have passed, the outermost expired scope is credited.

At a deadline the enforcer (the watchdog, or the in-process sentinel) sends this
process its interrupt signal. The handler here applies the nesting rules (which scope
of each thread is credited) and hands :class:`ScopeExpired` to
:mod:`pytest_elastic_timer.scope.delivery` (raise here, in another thread, or cancel an
asyncio task). A scope that is still open at its deadline also raises when it is left,
so an overrun is never silent even if the signal arrives late.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
import threading
import warnings
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from types import FrameType, TracebackType
from typing import Any, TypeVar

from pytest_elastic_timer.core import afterfork, unpatched
from pytest_elastic_timer.core import table as tbl
from pytest_elastic_timer.core.seconds import Seconds, check_seconds
from pytest_elastic_timer.scope import client, delivery, ranklabel
from pytest_elastic_timer.scope.delivery import ScopeExpired, TimeoutException

__all__ = [
    "ScopeExpired",
    "ScopeStack",
    "TimeoutException",
    "TimerRequest",
    "await_in_task_of",
    "close_above",
    "current_scope",
    "current_state",
    "enter_test_phase",
    "expires",
    "expiry_listeners",
    "holding_interrupts",
    "leave_test_phase",
    "name_afresh",
    "phase_scope",
    "process_state",
    "reattach",
    "resume",
    "set_aside",
    "set_label",
    "suspend",
    "thread_stack",
]

_modules = sys.modules
_CO_ASYNC = client.CO_ASYNC
_H_ARMED = tbl.H_ARMED
_MAX_GRACE = tbl.MAX_GRACE
_INF = math.inf
_FLOAT_MAX = sys.float_info.max  # an int above it is no float: not a finite budget
_NUMBERS = (int, float)
_EARLY = delivery.EARLY
monotonic = unpatched.monotonic  # the real clock, even while a test freezes time
T = TypeVar("T")


# Called (without arguments) whenever a ScopeExpired is about to be raised here, after
# the watchdog was told: the plugin starts looking at reports then. They run inside the
# interrupt's signal handler, so one that fails must not replace the ScopeExpired.
expiry_listeners: list[Callable[[], None]] = []
# The threads running the listeners (or other bookkeeping of the plugin's, in
# holding_interrupts): an interrupt that comes meanwhile is sent again a moment later,
# or the ScopeExpired it raised in there would be lost with its error.
_notifying: set[int] = set()


class ScopeStack(deque["TimerRequest"]):
    """The open scopes of one thread, outermost first (:func:`thread_stack`).

    ``tid`` is the thread's ident. ``prefix`` is the path that scopes entered at the
    bottom of the stack are named below: the plugin sets it to the test phase the
    thread is in (``test_x::call``) when that phase has no budget, and so no scope of
    its own to name it. ``base`` is where that bottom is: the number of scopes under it
    that belong to a test running this thread's pytest session inside its own
    (:func:`name_afresh`), and that the session's scopes are not named below.

    A deque: a list that a thread's one scope empties and fills again is shrunk and
    grown (a ``realloc`` each way) by every scope.
    """

    __slots__ = ("base", "prefix", "tid")

    def __init__(self, tid: int) -> None:
        super().__init__()
        self.tid = tid
        self.prefix = ""
        self.base = 0


_tls = threading.local()
_stacks: dict[int, ScopeStack] = {}
_detached: dict[int, TimerRequest] = {}  # open scopes outside every stack, by id()
_state: client.ProcessState | None = None
_state_lock = threading.Lock()
# States that set_aside() put aside, until put back: the scopes of an outer session
# still open use them (a pytest session run inside a test of another).
_aside: list[client.ProcessState] = []


def _thread_stack() -> ScopeStack:
    tid = unpatched.get_ident()
    stack = _tls.stack = ScopeStack(tid)
    if len(_stacks) > 256:  # forget threads that are gone
        alive = sys._current_frames().keys()
        for dead in [t for t in _stacks if t not in alive]:
            del _stacks[dead]
    _stacks[tid] = stack
    return stack


def thread_stack() -> ScopeStack:
    """The calling thread's stack of open scopes."""
    try:
        stack: ScopeStack = _tls.stack
    except AttributeError:
        stack = _thread_stack()
    return stack


def process_state() -> client.ProcessState:
    """This process's state, set up (and connected to the watchdog) on first use."""
    global _state
    state = _state
    if state is None:
        with _state_lock:
            if _state is None:
                _state = client.ProcessState(_on_interrupt)
            state = _state
    return state


def current_state() -> client.ProcessState | None:
    """This process's state if a scope (or :func:`process_state`) set it up already;
    None otherwise, and nothing is set up or connected."""
    return _state


def reattach() -> None:
    """Let the next scope connect anew (the plugin calls it once it started the
    session's watchdog, in case a scope ran earlier against another address)."""
    global _state
    if _state is not None and not any(_stacks.values()):
        old, _state = _state, None
        old.close()


def set_aside() -> Callable[[], None]:
    """Let the next scope connect anew, as :func:`reattach`, and return the function
    that closes that new state and puts this one back: a pytest session run inside a
    test of another leaves the outer session's connection as it found it.

    Scopes open already keep the state they were entered with: it stays connected,
    its watchdog enforces them, and their exit clears their slots in its table."""
    global _state
    previous, _state = _state, None
    if previous is not None:
        _aside.append(previous)

    def put_back() -> None:
        global _state
        current, _state = _state, previous
        if previous is not None and previous in _aside:
            _aside.remove(previous)
        if current is not None and current is not previous:
            current.close()

    return put_back


def name_afresh() -> Callable[[], None]:
    """Name the scopes that the calling thread enters from now on as if no scope were
    open and no test running, and return the function that puts its naming back.

    For a pytest session run inside a test of another (pytester's in-process runs):
    its tests' scopes read ``test_inner::call/step`` as in a session of its own, not
    ``test_outer::call/test_inner::call/step``. The scopes open already stay open and
    enforced."""
    stack = thread_stack()
    base, prefix = stack.base, stack.prefix
    stack.base, stack.prefix = len(stack), ""

    def put_back() -> None:
        stack.base, stack.prefix = base, prefix

    return put_back


def _forget_after_fork() -> None:
    # The child owns none of its parent's scopes: it starts with a table of its own.
    global _state, _state_lock, _tls, _delivering
    for state in (_state, *_aside):
        if state is not None:
            state.forget_descriptors()  # our copies only; the parent's stay open
    _state = None
    _aside.clear()
    _state_lock = threading.Lock()
    _delivering = threading.Lock()  # a thread of the parent may have held it
    _tls = threading.local()
    _stacks.clear()
    _detached.clear()
    _notifying.clear()


afterfork.call_in_child(_forget_after_fork)


def _check_budget(value: object, what: str) -> float | None:
    return None if value is None else check_seconds(value, what)


class TimerRequest:
    """A timer scope: "this block must finish within ``after`` seconds".

    Use it as a context manager (``with TimerRequest(5, scope="load"):``) or with
    :meth:`acquire` / :meth:`release`. ``after=None`` makes a scope without a deadline,
    which only names a step in the scope path. ``grace`` overrides the session's
    interrupt-to-terminate grace for this scope. The budget is multiplied by the
    session's scale factor when the scope is entered.
    """

    # Class-level defaults, for the attributes that entering and leaving do not read;
    # those they read, __init__ stores on the instance (docs/design.md, "What a test
    # costs", says why).
    flags = 0
    # A detached scope is not part of the thread's nesting (nor of scope paths): a
    # session-wide budget around everything, or a torch-style acquire/release.
    detached = False
    # Turns the ScopeExpired about to be raised into another exception (None: none is
    # raised, where the owner has nothing to interrupt).
    on_expire: Callable[[ScopeExpired], BaseException | None] | None = None
    at: tuple[str, int] | None = None  # (file, line) to report instead of the caller's
    path = ""
    _site_sid = 0
    _start = 0.0
    _deadline = _INF
    _slot = -1
    _serial = 0
    _state: client.ProcessState | None = None
    _stack: ScopeStack | None = None
    _delivered = False
    _cancelled = False
    _abandoned = False  # closed because its enclosing scope ended first
    _task: Any = None  # the asyncio task (or delivery.TrioTask) that entered the scope

    def __init__(
        self, after: Seconds | None, scope: str | None = None, *, grace: Seconds | None = None
    ) -> None:
        # The common case (a plain finite number, a str, no grace) is checked cheaply.
        self.after: float | None
        if after.__class__ in _NUMBERS and 0 <= after <= _FLOAT_MAX:
            self.after = after
        else:
            self.after = _check_budget(after, "after")
        if scope is not None and scope.__class__ is not str and not isinstance(scope, str):
            raise TypeError(f"scope must be a str, not {scope!r}")
        self.scope = scope
        self.grace = None if grace is None else min(check_seconds(grace, "grace"), _MAX_GRACE)
        # What __enter__ and __exit__ read (see the class's defaults).
        self.flags = 0
        self.detached = False
        self.at = None
        self._state = None
        self._task = None
        self._delivered = self._cancelled = self._abandoned = False

    # -- entering and leaving -----------------------------------------------------
    def __enter__(self) -> TimerRequest:
        """Start the scope's clock; the scope is entered at the caller's line.

        ``acquire()`` is the same method. The body is one function on purpose: it is
        the hot path of every scope.
        """
        if self._state is not None:
            raise RuntimeError(f"scope {self.path!r} is already active")
        state = _state or process_state()
        try:
            stack: ScopeStack = _tls.stack
        except AttributeError:
            stack = _thread_stack()
        frame = sys._getframe(1)
        detached = self.detached
        depth = len(stack)
        parent = "" if detached else stack[-1].path if depth > stack.base else stack.prefix
        at = self.at
        name = self.scope
        # One int names the call site (code objects hash slowly: CPython recomputes it);
        # the entry keeps code, parent and name to recognise a recycled id or another
        # nesting, which then take the slower dictionary.
        code = frame.f_code
        # (Names are compared by identity first: usually the very same object.)
        entry = state.sites_fast.get(id(code) + frame.f_lasti) if at is None else None
        if (
            entry is None
            or entry[0] is not code
            or entry[1] != parent
            or (entry[2] is not name and entry[2] != name)
        ):
            entry = state.lookup_entry(frame, at, parent, name, self.after is not None)
        _, _, _, site_sid, path, path_sid, in_coroutine = entry
        self._site_sid = site_sid
        self.path = path
        self._state = state
        self._stack = stack
        if self._delivered or self._cancelled or self._abandoned:  # a scope used again
            self._delivered = self._cancelled = self._abandoned = False
        # Inside a running event loop the expiry cancels the task (asyncio.timeout's
        # way, trio's cancel scopes) instead of raising wherever the loop happens to be.
        if in_coroutine if at is None else code.co_flags & _CO_ASYNC:
            self._task = _enter_running_task()
        elif self._task is not None:
            self._task = None
        now = self._start = monotonic()
        after = self.after
        if after is None:
            self._deadline = _INF
            self._slot = -1
        else:
            deadline = self._deadline = now + after * state.scale
            if not path_sid:
                path_sid = state.sid(path)
            free = state.free
            slot = self._slot = free.pop() if free else state.alloc()
            serial = self._serial = next(state.serials)
        # On the stack before its slot opens: the interrupt for it can come at once (a
        # deadline that passed while the watchdog was starting), and the signal handler
        # looks for due scopes on the stacks (it asks again while this method runs).
        if detached:
            _detached[id(self)] = self
        else:
            stack.append(self)
        if after is not None:
            grace = self.grace
            state.table.open_slot(
                slot,
                serial,
                deadline,
                now,
                stack.tid,
                path_sid,
                site_sid,
                state.nodeid_sid,
                0.0 if grace is None else grace,
                depth,
                self.flags,
            )
            armed = state.armed[_H_ARMED]
            if deadline < armed or not armed:
                state.notify(deadline)
        return self

    acquire = __enter__

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """End the scope; raises :class:`ScopeExpired` if it overran its deadline.

        One function on purpose, like ``__enter__``.
        """
        __tracebackhide__ = True
        state = self._state
        if state is None:
            if self._abandoned:  # closed with its enclosing scope: releasing it is fine
                self._abandoned = False
                return
            raise RuntimeError(f"scope {self.path or self.scope!r} is not active")
        self._state = None
        stack = self._stack
        abandoned = None
        if self.detached:
            _detached.pop(id(self), None)
        elif stack:
            if stack[-1] is self:
                stack.pop()
            elif self in stack:
                abandoned = _close_abandoned(stack, self)
        # The current state is always usable; another one (an outer session's, set
        # aside) may be closed, or the parent's, entered before a fork.
        if state is not _state and not state.usable:
            if abandoned:
                _warn_abandoned(abandoned, self.path)
            return
        slot = self._slot
        if slot >= 0:
            state.table.clear_slot(slot)
            state.free.append(slot)
            self._slot = -1
        if state.trace is not None:
            state.traced(
                self.path, self._start, stack.tid if stack is not None else 0, self._delivered
            )
        if abandoned:  # now that this scope is closed and traced too
            _warn_abandoned(abandoned, self.path)
        task = self._task
        if task is not None and _ended_by_its_cancellation(self, task, exc):
            raise _report(self, monotonic(), "interrupted", None, task=task) from exc
        if not self._delivered and slot >= 0 and exc is None and not self._cancelled:
            # Still open past its deadline: the interrupt was late (a loaded machine) or
            # came in the middle of our own bookkeeping. An overrun is never silent.
            now = monotonic()
            if (
                now > self._deadline
                and now > self._deadline + delivery.paused(state, now)
                and not delivery.under_debugger()
            ):
                self._delivered = True
                raise _report(self, now, "interrupted", sys._getframe(1))

    def release(self) -> None:
        """End the scope; raises :class:`ScopeExpired` if it overran its deadline."""
        self.__exit__(None, None, None)

    # -- moving the deadline ------------------------------------------------------
    def cancel(self) -> None:
        """Disarm the scope: it stays open (and in the path) but never expires. A scope
        not entered yet is entered without a deadline."""
        if self._state is None:
            self.after = None
            self._start = 0.0  # as one not entered yet: expires() and budget say after
            return
        self._cancelled = True
        self._deadline = _INF
        state = self._state
        if state is not None and self._slot >= 0 and state.usable:
            state.table.clear_slot(self._slot)
            state.free.append(self._slot)
            self._slot = -1

    def reschedule(self, after: Seconds) -> None:
        """Move the deadline to ``after`` seconds from now (scaled like the budget)."""
        seconds = check_seconds(after, "after")  # None too: a deadline is moved, not removed
        state = self._state
        if state is None:
            self.after = seconds
            self._start = 0.0
            return
        self._set_deadline(monotonic() + seconds * state.scale)

    def extend(self, seconds: Seconds) -> None:
        """Move the deadline ``seconds`` later (scaled like the budget)."""
        more = check_seconds(seconds, "seconds")
        state = self._state
        if state is None:
            self.after = (self.after or 0.0) + more
            self._start = 0.0
            return
        self._set_deadline(self._deadline + more * state.scale)

    def _set_deadline(self, deadline: float) -> None:
        state = self._state
        assert state is not None
        if self._cancelled:
            return
        self._deadline = deadline
        if self._slot < 0 and state.usable:
            self._slot = state.alloc()
        if self._slot >= 0 and state.usable:
            self._serial = next(state.serials)
            stack = self._stack
            state.table.write_slot(
                self._slot,
                self._serial,
                deadline,
                self._start,
                stack.tid if stack is not None else 0,
                state.sid(self.path),
                self._site_sid,
                state.nodeid_sid,
                self.grace if self.grace is not None else 0.0,
                stack.index(self) if stack is not None and self in stack else 0,
                self.flags,
            )
            armed = state.armed[_H_ARMED]
            if deadline < armed or not armed:
                state.notify(deadline)

    # -- asking -------------------------------------------------------------------
    def expires(self) -> float:
        """Seconds left before the deadline (``inf`` without one, negative if past).
        Before the scope is first entered, ``after``; once left, to the deadline of
        its last run."""
        if self._state is None and not self._start:  # never entered
            return _INF if self.after is None else float(self.after)
        return self._deadline - monotonic()

    def expired(self) -> bool:
        """Whether the deadline has passed (or the scope was interrupted)."""
        return self._delivered or (self._state is not None and monotonic() > self._deadline)

    @property
    def deadline(self) -> float:
        """The deadline on the ``time.monotonic()`` clock (``inf`` without one)."""
        return self._deadline

    @property
    def budget(self) -> float:
        """The scaled budget in seconds as entered, with the deadline's moves (``inf``
        without a deadline). Before the scope is first entered, ``after`` as given;
        once left, its last run's."""
        if self._state is None and not self._start:  # never entered
            return _INF if self.after is None else float(self.after)
        # Rounded to the nanosecond: a deadline minus its start is not the budget's
        # float exactly (0.3 came back as 0.30000000000001137).
        budget = self._deadline - self._start
        return round(budget, 9) if budget < _INF else budget

    @property
    def site(self) -> str:
        """``file:line`` where the scope was entered ("" before that)."""
        if self.at is not None:
            return f"{self.at[0]}:{self.at[1]}"
        state = self._state or _state
        if state is None or state.table_closed:  # its session has ended
            return ""
        return state.table.string(self._site_sid)

    @property
    def active(self) -> bool:
        """Whether the scope is entered and not left yet."""
        return self._state is not None

    def __repr__(self) -> str:
        return f"<TimerRequest {self.path or self.scope!r} after={self.after}>"


def phase_scope(
    test: str,
    when: str,
    after: float | None,
    grace: float | None = None,
    at: tuple[str, int] | None = None,
) -> TimerRequest:
    """The scope of the phase ``when`` (``setup``, ``call`` or ``teardown``) of the test
    named ``test``, not entered yet: named ``test::when``, it must end within ``after``
    seconds (None: it only names the phase) and is reported at ``at`` (the test's
    definition). Enter it as a context manager, or with :func:`enter_test_phase`."""
    scope = TimerRequest(after, f"{test}::{when}", grace=grace)
    scope.flags = tbl.FLAG_TEST_PHASE | tbl.PHASE_FLAGS[when]
    scope.at = at
    return scope


def enter_test_phase(scope: TimerRequest, stack: ScopeStack) -> TimerRequest:
    """Enter ``scope``, a :func:`phase_scope` with a budget and a place, on ``stack``,
    the calling thread's (:func:`thread_stack`); returns ``scope``.

    The plugin's path for every test: no call site to look up and no string to write,
    because the watchdog names such a slot after the test entry of the table
    (``ProcessState.set_test``). Leave it with :func:`leave_test_phase`.
    """
    after = scope.after
    if after is None or scope.at is None or not scope.flags & tbl.FLAG_TEST_PHASE:
        raise ValueError(f"{scope!r} is not a phase scope with a budget and a place")
    if scope._state is not None:
        raise RuntimeError(f"scope {scope.path!r} is already active")
    state = _state or process_state()
    name = scope.scope or ""
    depth = len(stack)
    parent = stack[-1].path if depth > stack.base else stack.prefix
    scope.path = f"{parent}/{name}" if parent else name
    scope._state = state
    scope._stack = stack
    grace = scope.grace
    flags = scope.flags
    now = scope._start = monotonic()
    deadline = scope._deadline = now + after * state.scale
    free = state.free
    slot = scope._slot = free.pop() if free else state.alloc()
    serial = scope._serial = next(state.serials)
    stack.append(scope)  # before its slot opens, as in TimerRequest.__enter__
    state.table.open_phase_slot(
        slot,
        serial,
        deadline,
        now,
        stack.tid,
        state.nodeid_sid,
        0.0 if grace is None else grace,
        depth,
        flags,
    )
    armed = state.armed[_H_ARMED]
    if deadline < armed or not armed:
        state.notify(deadline)
    return scope


def leave_test_phase(scope: TimerRequest, exc: BaseException | None) -> None:
    """Leave a scope of :func:`enter_test_phase`; ``exc`` is what ends the phase.

    The common case (in time, innermost, no trace) inline; everything else, and every
    overrun, takes ``__exit__``.
    """
    __tracebackhide__ = True
    state = scope._state
    stack = scope._stack
    if (
        state is None
        or state is not _state
        or scope._delivered
        or state.trace is not None
        or not stack
        or stack[-1] is not scope
        or (exc is None and not scope._cancelled and monotonic() > scope._deadline)
    ):
        scope.__exit__(None if exc is None else type(exc), exc, None)
        if exc is None and scope._delivered:
            # The phase's ScopeExpired was caught by the code under test and the phase
            # went on (it is a TimeoutError, so a library's ``except OSError`` around a
            # wait swallows it): the phase still overran its budget, so it fails.
            raise _overrun(scope)
        return
    scope._state = None
    stack.pop()
    slot = scope._slot
    if slot >= 0:
        state.table.clear_slot(slot)
        state.free.append(slot)
        scope._slot = -1


# ``expires(after, scope=None, *, grace=None)``: a scope that must end within ``after``
# seconds, ``with expires(2, "allreduce"):``; the default scope name is the caller's
# ``file:line``. The class itself, not a factory function: one Python call less on
# the hot path.
expires = TimerRequest


def current_scope() -> TimerRequest | None:
    """The innermost open scope of the calling thread, if any."""
    stack: ScopeStack | None = getattr(_tls, "stack", None)
    return stack[-1] if stack else None


def set_label(label: str) -> None:
    """Name this process in reports (e.g. ``"rank 0"``); default ``rank N`` from
    ``init_process_group``, else from ``RANK``."""
    if not isinstance(label, str):
        raise TypeError(f"label must be a str, not {label!r}")
    state = process_state()
    state.set_label(label)
    state.label_given = True
    ranklabel.set_own(label)


def _label_rank(label: str) -> None:
    """init_process_group named this process ``rank N``: its reports say so too,
    unless it set a label of its own; after destroy_process_group ("") they say what
    they said before."""
    state = _state
    if state is not None and not state.label_given:
        state.set_label(label or client.label_from_env())


ranklabel.listeners.append(_label_rank)


def _enter_running_task() -> Any:
    """The task running this coroutine, which a scope's expiry is to cancel: asyncio's
    current task, or in a trio task a :class:`delivery.TrioTask` whose cancel scope is
    entered now; None outside both."""
    aio = _modules.get("asyncio")
    task = aio.current_task() if aio and aio._get_running_loop() else None
    if task is None and "trio" in _modules:
        task = delivery.enter_trio_task()
    return task


def _ended_by_its_cancellation(scope: TimerRequest, task: Any, exc: BaseException | None) -> bool:
    """The block of ``scope``, whose ``task`` is leaving it with ``exc`` in flight:
    leave the trio cancel scope entered beside it (which takes the ``Cancelled`` of its
    own cancellation), and say whether the cancellation of the scope's expiry is what
    ends the block (asyncio's is uncancelled: the task goes on)."""
    taken = task.leave(exc) if type(task) is delivery.TrioTask else False
    if scope._delivered and (taken or delivery.is_our_cancel(exc, scope.path)):
        if hasattr(task, "uncancel"):  # Python 3.11+
            task.uncancel()
        return True
    return False


async def await_in_task_of(scope: TimerRequest, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` in the running task (asyncio or trio), which ``scope``, an
    open scope entered outside every event loop (a test's phase), cancels at its
    deadline; raises ScopeExpired here when it did.

    Without it, the expiry of such a scope raises wherever the loop happens to be when
    the interrupt comes: in trio's run loop, which then ends for good (the process's
    later trio tests fail), or in the host loop of a guest run. With it, the task is
    cancelled, as for a scope entered in the task, and the loop goes on.
    """
    __tracebackhide__ = True
    task = _enter_running_task()
    if task is None or scope._state is None or scope._task is not None:
        if type(task) is delivery.TrioTask:
            task.leave(None)  # entered for nothing
        return await awaitable
    scope._task = task
    try:
        result = await awaitable
    except BaseException as exc:
        scope._task = None
        if _ended_by_its_cancellation(scope, task, exc):
            expired = _report(scope, monotonic(), "interrupted", None, task=task)
            # With the traceback of the cancellation: the failure shows where the test
            # waited, not the runner's frames above this one.
            raise expired.with_traceback(exc.__traceback__) from exc
        raise
    scope._task = None
    _ended_by_its_cancellation(scope, task, None)
    return result


def _close_abandoned(stack: ScopeStack, scope: TimerRequest) -> list[TimerRequest]:
    """``scope`` ends while scopes it encloses are still open (acquired and never
    released): they end with it, as in Trio, so that no forgotten scope outlives its
    enclosing one (a test's phase) and expires in somebody else's code. Returns them,
    for :func:`_warn_abandoned` once ``scope`` itself is closed."""
    index = stack.index(scope)
    abandoned = _abandon_above(stack, index + 1)
    stack.pop()  # scope itself
    return abandoned


# Every file of the package, whichever subpackage it lies in, ends with this prefix.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside this
    package (the user's ``with`` or ``release()`` line, wherever we were called)."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level


def close_above(stack: ScopeStack, depth: int, ending: str) -> None:
    """Close the scopes of ``stack`` from ``depth`` up, which ``ending`` (a test's
    phase, which the plugin ends) outlived: the warning points where the outermost of
    them was entered, not at pytest's machinery."""
    __tracebackhide__ = True  # a warning made an error: the user's, not ours
    abandoned = _abandon_above(stack, depth)
    if ending.endswith("::setup"):
        advice = (
            "; a fixture's scope around its yield ends with the test's setup: bound the "
            "fixture's teardown with a scope after the yield, and the test with "
            "@pytest.mark.expires"
        )
    else:
        advice = ""
    _warn_abandoned(abandoned, ending, advice=advice, at=abandoned[0].site)


def _abandon_above(stack: ScopeStack, depth: int) -> list[TimerRequest]:
    """Close the scopes of ``stack`` from ``depth`` up, without a word; outermost first."""
    abandoned = [stack.pop() for _ in range(len(stack) - depth)][::-1]
    for inner in abandoned:
        state = inner._state
        inner._state = None
        inner._abandoned = True
        if state is not None and state.usable and inner._slot >= 0:
            state.table.clear_slot(inner._slot)
            state.free.append(inner._slot)
            inner._slot = -1
    return abandoned


def _warn_abandoned(
    abandoned: list[TimerRequest], ending: str, *, advice: str = "", at: str = ""
) -> None:
    """Say that ``ending`` closed the scopes ``abandoned``. Called once every scope is
    closed: under ``-W error`` the warning raises, and nothing may be left open then.
    The warning points at the user's call that ended ``ending``, or at ``at``
    (``file:line``) where given."""
    __tracebackhide__ = True
    names = ", ".join(repr(s.path) for s in abandoned)
    were, they = ("were", "they were") if len(abandoned) > 1 else ("was", "it was")
    message = (
        f"scope {ending!r} ended while {names} inside it {were} still open; "
        f"{they} closed with it (release every scope you acquire){advice}"
    )
    file, _, line = at.rpartition(":")
    if file and line.isdigit() and int(line) > 0:
        warnings.warn_explicit(message, RuntimeWarning, file, int(line), _module_of(file))
    else:
        warnings.warn(message, RuntimeWarning, stacklevel=_user_stacklevel())


def _module_of(file: str) -> str:
    """The name of the imported module of ``file`` (what warning filters match), else
    the file's name without ``.py``."""
    for name, module in list(_modules.items()):
        if getattr(module, "__file__", None) == file:
            return name
    return os.path.splitext(os.path.basename(file))[0]


# -- delivery ------------------------------------------------------------------------
def _budget_of(scope: TimerRequest) -> float:
    """The scope's budget as entered, moved by reschedule() or extend() since."""
    budget = scope._deadline - scope._start
    return round(budget, 3) if budget < _INF else 0.0  # as the watchdog's records say


def _overrun(scope: TimerRequest) -> ScopeExpired:
    """The exception for a scope whose interrupt was delivered and swallowed."""
    return _expired(scope, monotonic(), "interrupted")


def _expired(scope: TimerRequest, now: float, action: str) -> ScopeExpired:
    """The ScopeExpired of ``scope`` as of ``now``, in this process."""
    state = scope._state or _state
    label = state.label if state is not None else ""
    elapsed = now - scope._start
    return ScopeExpired(
        scope.path, _budget_of(scope), elapsed, unpatched.getpid(), action, scope.site, label
    )


def _report(
    scope: TimerRequest,
    now: float,
    action: str,
    frame: FrameType | None,
    *,
    task: Any = None,
) -> ScopeExpired:
    """The exception for ``scope``, after telling the watchdog where the owner was."""
    exc = _expired(scope, now, action)
    _told(scope, now, frame, exc, task=task)
    return exc


def _told(
    scope: TimerRequest, now: float, frame: FrameType | None, exc: ScopeExpired, *, task: Any
) -> None:
    """Tell the watchdog where the owner of ``scope`` was, and the expiry listeners."""
    state = scope._state or _state
    if task is None and state is not None:  # a task's is told when its cancellation is
        _tell_expired(state, scope, now, delivery.owner_stack(frame, exc))
    with holding_interrupts():
        for listener in list(expiry_listeners):
            try:
                listener()
            except Exception:  # the ScopeExpired is what the owner must get
                pass


@contextlib.contextmanager
def holding_interrupts() -> Iterator[None]:
    """Interrupts of this thread wait while the body runs (each is sent again a moment
    later): for the plugin's own bookkeeping, such as loading its report machinery,
    which a ScopeExpired raised inside would cut short, and be lost with its error."""
    thread = unpatched.get_ident()
    if thread in _notifying:  # held already, by an enclosing caller
        yield
        return
    _notifying.add(thread)
    try:
        yield
    finally:
        _notifying.discard(thread)


def _tell_expired(state: client.ProcessState, scope: TimerRequest, now: float, stack: str) -> None:
    delivery.tell_expired(
        state, scope._serial, scope.path, _budget_of(scope), now - scope._start, scope.site, stack
    )


def _on_interrupt(signum: int, frame: FrameType | None) -> None:
    """Signal handler: raise ScopeExpired in every thread whose scope has expired.

    A process without an interrupt signal has a thread of the package call it instead
    (``signum`` 0, no frame): that thread enters no scopes, so every exception goes to
    its thread as an asynchronous one.
    """
    __tracebackhide__ = True
    client.handler_runs += 1  # heard: the thread that sent the signal stops sending it
    # No state between set_aside() and the next one's start: an outer session's scopes
    # may still be open, and due.
    state = _state or (_aside[-1] if _aside else None)
    if state is None or state.table.floats[tbl.H_SUSPENDED]:
        return
    if signum:
        _deliver_due(state, frame)
    elif _delivering.acquire(blocking=False):
        try:
            _deliver_due(state, frame)
        finally:
            _delivering.release()
    else:  # another thread of the package is delivering: again in a moment
        delivery.retry_soon(state)


# Held by the package's thread that delivers (a process without an interrupt signal):
# the interrupter and a retry may both look, and each scope must be delivered once.
_delivering = threading.Lock()


def _deliver_due(state: client.ProcessState, frame: FrameType | None) -> None:
    __tracebackhide__ = True
    now = monotonic()
    if delivery.under_debugger():
        _postpone_expired(now)
        return
    here = unpatched.get_ident()  # the main thread, in the signal handler
    if here in _notifying:
        delivery.retry_soon(state)
        return
    raise_here: BaseException | None = None
    # Reports of the exceptions sent to other threads: after every one of them is
    # out, since a report lets other threads run, which would make where the next
    # thread was found stale.
    reports: list[Callable[[], None]] = []
    detached = list(_detached.values())
    for tid, stack in list(_stacks.items()):
        # Outermost first: detached scopes enclose everything the thread does.
        candidates = [d for d in detached if d._stack is stack] + list(stack)
        for scope in candidates:
            if scope._delivered or scope._cancelled or scope._deadline > now + _EARLY:
                continue
            exc = None if tid == here else _expired(scope, now, "interrupted")
            # Looked at right before the exception goes out: an asynchronous one lands
            # at that thread's next bytecode, which must not be in our bookkeeping.
            where = frame if tid == here else sys._current_frames().get(tid)
            if delivery.in_critical_section(where) or tid in _notifying:
                delivery.retry_soon(state)
                break
            if tid != here and delivery.debugged(where):
                _postpone_expired(now, candidates)
                break
            for inner in candidates[candidates.index(scope) :]:
                inner._delivered = True  # the exception unwinds through them
            task = scope._task
            if task is not None and not task.done() and not delivery.task_runs_at(task, where):
                # The loop is interrupted (waiting, or between steps): only the task's
                # cancellation reaches the task. Its own code gets the exception.
                delivery.cancel_task(task, scope.path)
                told = scope._state or state  # an outer session's scope: its watchdog
                _tell_expired(told, scope, now, delivery.task_stacks([scope._task]))
                break
            if exc is None:
                exc = _expired(scope, now, "interrupted")
                raise_here = scope.on_expire(exc) if scope.on_expire else exc
                # None: nothing to raise here. Cancelled by on_expire: the owner had
                # nothing to interrupt (an xdist worker waiting for its next test, past
                # the session's budget), and is not said to be. Not cancelled: it is
                # interrupted later (an xdist worker in pytest's reporting between two
                # phases of a test), and the watchdog learns where it was now.
                if raise_here is not None or not scope._cancelled:
                    _told(scope, now, where, exc, task=None)
            else:
                delivery.raise_in_thread(tid, exc)
                reports.append(functools.partial(_after_raised, scope, now, where, exc))
            break
    for report in reports:
        report()
    if raise_here is not None:
        raise raise_here


def _after_raised(
    scope: TimerRequest, now: float, where: FrameType | None, exc: ScopeExpired
) -> None:
    """What follows an exception sent to another thread: the report, and the ending of
    a scope that ends more than its test (the session's budget), whose exception of
    another kind cannot be raised in another thread; its side effects (no next test)
    still apply."""
    if scope.on_expire is not None:
        scope.on_expire(exc)
    _told(scope, now, where, exc, task=None)


def _postpone_expired(now: float, scopes: list[TimerRequest] | None = None) -> None:
    """Someone is stepping through this process (or through the thread of ``scopes``):
    expired scopes get their budget again (at least a second) instead of an exception
    in the debugger's face."""
    for scope in _open_scopes() if scopes is None else scopes:
        if not scope._cancelled and scope._deadline <= now + _EARLY and scope.active:
            scope._set_deadline(now + max(1.0, scope._deadline - scope._start))


def _open_scopes() -> list[TimerRequest]:
    """Every open scope of this process: those of every thread's stack, then the
    detached ones."""
    return [s for stack in list(_stacks.values()) for s in list(stack)] + list(_detached.values())


# -- debugger suspension -------------------------------------------------------------
def _states_in_use() -> list[client.ProcessState]:
    """This process's state and those set aside (an outer session's, whose scopes may
    still be open), each with a watchdog that enforces its own table."""
    return [process_state(), *[s for s in _aside if s.usable]]


def suspend() -> None:
    """Pause every deadline of this process (a debugger took over)."""
    now = monotonic()
    for state in _states_in_use():
        if not state.table.floats[tbl.H_SUSPENDED]:
            state.table.floats[tbl.H_SUSPENDED] = now


def resume() -> None:
    """Resume deadlines, each moved later by the time its table was paused."""
    now = monotonic()
    paused: dict[client.ProcessState, float] = {}
    for state in _states_in_use():
        since = state.table.floats[tbl.H_SUSPENDED]
        if since:
            paused[state] = now - since
    if not paused:
        return
    earliest = dict.fromkeys(paused, _INF)
    for scope in _open_scopes():
        own = scope._state
        if own is not None and own in paused and scope._slot >= 0 and not scope._cancelled:
            scope._deadline += paused[own]
            own.table.move_deadline(scope._slot, scope._deadline)
            earliest[own] = min(earliest[own], scope._deadline)
    for state, deadline in earliest.items():
        state.table.floats[tbl.H_SUSPENDED] = 0.0
        if deadline < _INF:
            state.notify(deadline)


delivery.mark_critical(
    TimerRequest.__enter__,
    TimerRequest.__exit__,
    TimerRequest._set_deadline,
    TimerRequest.cancel,
    enter_test_phase,
    leave_test_phase,
    resume,
    _report,
    _told,
    _ended_by_its_cancellation,
)
