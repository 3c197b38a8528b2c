"""Delivery: how an expired scope reaches the code that runs in it.

The enforcer (the watchdog, or the in-process sentinel) sends the owner its interrupt
signal at a deadline. The signal handler (in ``scopes``, which applies the nesting
rules to choose the scope) delivers :class:`ScopeExpired` with the means here; in a
process that has no interrupt signal a thread of the package does the handler's work:

- in the main thread it is raised by the handler itself;
- in another thread through ``PyThreadState_SetAsyncExc`` (:func:`raise_in_thread`);
- in an asyncio task that entered the scope, by cancelling the task
  (:func:`cancel_task`, asyncio.timeout's way), so the loop is not interrupted
  wherever it happens to be;
- not at all while the process is in the scope machinery's own bookkeeping
  (:func:`in_critical_section`: tried again a moment later), or while a debugger steps
  through it or through the scope's thread (:func:`under_debugger`, :func:`debugged`:
  the deadlines move instead).

Each delivery tells the watchdog where the owner was (:func:`tell_expired`). This
module knows nothing of scopes' nesting: it takes plain values.
"""

from __future__ import annotations

import sys
import threading
import traceback
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

from pytest_elastic_timer.core import afterfork, unpatched
from pytest_elastic_timer.core import table as tbl
from pytest_elastic_timer.scope import client

STACK_FRAMES = 25  # innermost frames kept in a reported stack
EARLY = 0.001  # a signal is honoured up to 1 ms before the deadline (clock granularity)


class ScopeExpired(TimeoutError):
    """A timer scope overran its budget.

    Attributes: ``scope`` (the scope path, e.g. ``test_train::call/allreduce``),
    ``budget`` and ``elapsed`` (seconds), ``pid`` of the owner, ``action`` (what ended
    the scope: ``interrupted`` when raised in the owner), ``site`` (``file:line``
    where the scope was entered) and ``label`` (e.g. ``rank 0``).
    """

    def __init__(
        self,
        scope: str = "",
        budget: float = 0.0,
        elapsed: float = 0.0,
        pid: int = 0,
        action: str = "interrupted",
        site: str = "",
        label: str = "",
    ) -> None:
        self.scope = scope
        self.budget = budget
        self.elapsed = elapsed
        self.pid = pid
        self.action = action
        self.site = site
        self.label = label
        super().__init__(self.line())

    def line(self) -> str:
        """The one-line summary that starts every report of this expiry."""
        return (
            f"scope {self.scope!r} expired after {self.elapsed:.2f}s "
            f"(budget {self.budget:g}s): {self.action}"
        )

    def __str__(self) -> str:
        return self.line()

    def __reduce__(self) -> Any:  # crosses process boundaries (multiprocessing) intact
        return (
            type(self),
            (self.scope, self.budget, self.elapsed, self.pid, self.action, self.site, self.label),
        )


ScopeExpired.__module__ = "pytest_elastic_timer"
TimeoutException = ScopeExpired

# -- another thread ------------------------------------------------------------------
# Exceptions waiting to be raised in threads other than main, by thread ident.
_pending: dict[int, ScopeExpired] = {}


class _AsyncScopeExpired(ScopeExpired):
    """Raised in a non-main thread: ``PyThreadState_SetAsyncExc`` takes a class, so the
    instance picks up the details the handler left for its thread."""

    def __init__(self, *args: Any) -> None:
        if args:
            super().__init__(*args)
            return
        details = _pending.pop(unpatched.get_ident(), None) or ScopeExpired()
        super().__init__(
            details.scope,
            details.budget,
            details.elapsed,
            details.pid,
            details.action,
            details.site,
            details.label,
        )

    def __reduce__(self) -> Any:  # unpickled as what it stands for
        return (ScopeExpired, ScopeExpired.__reduce__(self)[1])


# Tracebacks and reports name it as what it is to the user.
_AsyncScopeExpired.__module__ = "pytest_elastic_timer"
_AsyncScopeExpired.__name__ = _AsyncScopeExpired.__qualname__ = "ScopeExpired"


def raise_in_thread(tid: int, exc: ScopeExpired) -> None:
    """Raise ``exc`` in thread ``tid`` (not the calling one) at its next bytecode."""
    import ctypes

    _pending[tid] = exc
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(tid), ctypes.py_object(_AsyncScopeExpired)
    )


def _forget_after_fork() -> None:
    _pending.clear()  # the child has none of its parent's threads


afterfork.call_in_child(_forget_after_fork)


# -- asyncio -------------------------------------------------------------------------
def cancel_message(path: str) -> str:
    """The message of the cancellation that ends the task of scope ``path``."""
    return f"pytest-elastic-timer: scope {path!r} expired"


def is_our_cancel(exc: BaseException | None, path: str) -> bool:
    """Whether ``exc`` is the cancellation :func:`cancel_task` asked for scope ``path``."""
    aio = sys.modules.get("asyncio")
    return (
        aio is not None
        and isinstance(exc, aio.CancelledError)
        and bool(exc.args)
        and exc.args[0] == cancel_message(path)
    )


def task_runs_at(task: Any, frame: FrameType | None) -> bool:
    """Whether the code of ``task`` (an asyncio task or a :class:`TrioTask`) runs where
    its thread was interrupted (``frame``): an exception raised there unwinds the task,
    as in any code. Elsewhere (the loop waiting for I/O, or a host loop between the steps
    of a trio guest run) it would end the loop, and only a cancellation reaches the
    task."""
    coro = task.task.coro if isinstance(task, TrioTask) else task.get_coro()
    root = getattr(coro, "cr_frame", None)
    while frame is not None and root is not None:
        if frame is root:
            return True
        frame = frame.f_back
    return False


def cancel_task(task: Any, path: str) -> None:
    """Cancel ``task``, which entered scope ``path``; the scope's exit then raises."""
    if isinstance(task, TrioTask):
        task.cancel()
        return
    task.get_loop().call_soon_threadsafe(task.cancel, cancel_message(path))


def task_stacks(tasks: Any) -> str:
    """Where each of ``tasks`` is suspended, innermost frame last."""
    out = []
    for task in tasks:
        if isinstance(task, TrioTask):
            out.append(task.stack())
            continue
        frames = task.get_stack(limit=STACK_FRAMES)
        lines = traceback.format_list(
            [(f.f_code.co_filename, f.f_lineno, f.f_code.co_name, None) for f in frames]
        )
        out.append(f"Task {task.get_name()} ({task.get_coro()!r}):\n" + "".join(lines))
    return "\n".join(out)


# -- trio ----------------------------------------------------------------------------
class TrioTask:
    """A trio task that entered a scope, with the trio cancel scope entered beside it.

    Trio's way to end a task's wait: at the deadline the cancel scope is cancelled
    (through the run's token, which a signal handler or another thread may use), the
    task gets ``trio.Cancelled`` at its next checkpoint, and the scope's exit, having
    left the cancel scope (which takes its own ``Cancelled``), raises ScopeExpired.
    """

    __slots__ = ("cancel_scope", "exited", "task", "token")

    def __init__(self, task: Any, token: Any, cancel_scope: Any) -> None:
        self.task = task
        self.token = token
        self.cancel_scope = cancel_scope
        self.exited = False

    def done(self) -> bool:
        return self.exited

    def cancel(self) -> None:
        self.token.run_sync_soon(self.cancel_scope.cancel)

    def leave(self, exc: BaseException | None) -> bool:
        """Leave the cancel scope with ``exc`` in flight; whether it took ``exc`` (the
        ``Cancelled`` of its own cancellation)."""
        self.exited = True
        return bool(self.cancel_scope.__exit__(type(exc) if exc else None, exc, None))

    def stack(self) -> str:
        frames = [
            (frame.f_code.co_filename, line, frame.f_code.co_name, None)
            for frame, line in self.task.iter_await_frames()
        ][-STACK_FRAMES:]
        return f"Task {self.task.name}:\n" + "".join(traceback.format_list(frames))


def enter_trio_task() -> TrioTask | None:
    """In a trio task: enter a trio cancel scope for a scope being entered, and return
    the task with it. None outside trio (nothing is entered)."""
    trio = sys.modules.get("trio")
    if trio is None:
        return None
    try:
        task = trio.lowlevel.current_task()
        token = trio.lowlevel.current_trio_token()
    except RuntimeError:  # not in a trio task
        return None
    cancel_scope = trio.CancelScope()
    cancel_scope.__enter__()
    return TrioTask(task, token, cancel_scope)


# -- where the owner was -------------------------------------------------------------
def owner_stack(frame: FrameType | None, exc: ScopeExpired) -> str:
    """The stack at ``frame`` (where the owner was interrupted); when an event loop
    runs in the main thread, also where its tasks wait (added to ``exc`` as a note)."""
    stack = "".join(traceback.format_stack(frame, limit=STACK_FRAMES)) if frame else ""
    aio = sys.modules.get("asyncio")
    loop = aio._get_running_loop() if aio is not None else None
    if (
        aio is not None
        and loop is not None
        and threading.current_thread() is threading.main_thread()
    ):
        # The loop was interrupted in its selector: say where its tasks wait.
        tasks = task_stacks(aio.all_tasks(loop))
        if hasattr(exc, "add_note"):  # Python 3.11+
            exc.add_note(f"event loop tasks when the scope expired:\n{tasks}")
        stack = f"{stack}\n{tasks}"
    return stack


def tell_expired(
    state: client.ProcessState,
    serial: int,
    path: str,
    budget: float,
    elapsed: float,
    site: str,
    stack: str,
) -> None:
    """Tell the watchdog that the scope of slot ``serial`` expired here, and where the
    owner was."""
    state.send(
        "expired",
        serial=serial,
        scope=path,
        budget=budget,
        elapsed=elapsed,
        site=site,
        nodeid=state.nodeid,
        stack=stack[-64_000:],
    )


# -- when not to deliver -------------------------------------------------------------
_CRITICAL: set[CodeType] = set()


def mark_critical(*functions: Callable[..., Any]) -> None:
    """Never raise inside ``functions``, nor in anything they call: they keep the table
    and the scope stacks consistent, and an exception half-way would not."""
    _CRITICAL.update(f.__code__ for f in functions)


def in_critical_section(frame: FrameType | None) -> bool:
    """Whether ``frame`` runs in a function of :func:`mark_critical`, at any depth
    below it. The whole stack is looked at: the package's own calls go deep (starting
    its standby thread builds a Condition five calls below ``notify``), and an
    exception raised there would be swallowed on its way up (``except OSError`` around
    socket calls: a ScopeExpired is a TimeoutError), leaving its scope open for good.
    None of these functions calls the user's code."""
    while frame is not None:
        if frame.f_code in _CRITICAL:
            return True
        frame = frame.f_back
    return False


def retry_soon(state: client.ProcessState) -> None:
    """Interrupt this process again in a moment."""
    timer = unpatched.Timer(0.002, state.interrupt)
    timer.daemon = True
    client.start_helper(timer)


def paused(state: client.ProcessState, now: float) -> float:
    """How long the deadlines of this process have been suspended (0 if running)."""
    since = state.table.floats[tbl.H_SUSPENDED]
    return now - since if since else 0.0


_DEBUGGER_MODULES = ("bdb", "pdb", "pydevd", "debugpy", "_pydevd", "pudb", "IPython")


def under_debugger() -> bool:
    """Whether a debugger's trace function runs in this thread (coverage's does not
    count: it is a C tracer from its own module)."""
    trace = sys.gettrace()
    return trace is not None and _is_debugger(trace)


def debugged(frame: FrameType | None) -> bool:
    """Whether a debugger steps through the thread whose innermost frame is ``frame``.

    Another thread's trace function cannot be read, but a debugger marks the frames it
    traces (``f_trace``): a thread stopped at its prompt is deep in the debugger's own
    calls, below the user's frame where it stopped."""
    while frame is not None:
        trace = frame.f_trace
        if trace is not None and _is_debugger(trace):
            return True
        frame = frame.f_back
    return False


def _is_debugger(trace: Callable[..., Any]) -> bool:
    owner = getattr(trace, "__self__", trace)
    bdb = sys.modules.get("bdb")
    if bdb is not None and isinstance(owner, bdb.Bdb):  # pdb and every Bdb subclass
        return True
    module = getattr(type(owner), "__module__", "") or ""
    if module == "builtins":
        module = getattr(trace, "__module__", "") or ""
    return module.split(".")[0] in _DEBUGGER_MODULES


mark_critical(
    tbl.ScopeTable.move_deadline,
    tbl.ScopeTable.open_slot,
    tbl.ScopeTable.open_phase_slot,
    tbl.ScopeTable.write_slot,
    tbl.ScopeTable.clear_slot,
    client.ProcessState.alloc,
    client.ProcessState.lookup_entry,
    client.ProcessState.notify,
    client.ProcessState.send,
    client.ProcessState.sid,
    client.ProcessState.site,
    client.ProcessState.path,
)
