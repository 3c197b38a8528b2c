"""Compatibility with ``torch.distributed.elastic.timer`` clients.

``TimerClient`` duck-types torch's ``TimerClient`` (``acquire(scope_id,
expiration_time)`` / ``release(scope_id)``), so torch's own ``expires()`` context
manager and code written against torch's timer API are enforced by the session's
watchdog: the scope is interrupted first (``ScopeExpired``), and only then dumped and
terminated, instead of torch's silent SIGKILL of one pid. torch itself is imported only
by :func:`configure_torch`.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from types import FrameType
from typing import Any, cast

from pytest_elastic_timer.core import unpatched
from pytest_elastic_timer.core.seconds import as_number
from pytest_elastic_timer.scope.scopes import TimerRequest

# Frames of these files are skipped when looking for the line that entered a scope:
# torch's expires() calls acquire() from a contextlib generator.
_SKIP_PARTS = (
    os.sep + "contextlib.py",
    os.path.join("torch", "distributed", "elastic", "timer") + os.sep,
    os.path.join("pytest_elastic_timer", "scope", "torch_compat.py"),
)


def _caller(frame: FrameType | None) -> tuple[str, int] | None:
    while frame is not None:
        filename = frame.f_code.co_filename
        if not any(part in filename for part in _SKIP_PARTS):
            return filename, frame.f_lineno
        frame = frame.f_back
    return None


class TimerClient:
    """A torch ``TimerClient`` whose timers are scopes of this session.

    ``expiration_time`` is an absolute ``time.time()`` value, as torch's ``expires()``
    passes it; it is converted to the monotonic clock once, at acquire. As in torch,
    a process has one timer per ``scope_id``: acquiring an open one again moves its
    deadline (a keep-alive loop, a recursive ``expires()`` at one line), and any
    thread of the process may release it.
    """

    def __init__(self) -> None:
        # torch's servers key timers by (pid, scope_id): a forked child's are its own,
        # never the parent's scopes that its copy of this client still lists.
        self._open: dict[tuple[int, str], TimerRequest] = {}
        self._lock = threading.Lock()

    def acquire(self, scope_id: str, expiration_time: float) -> None:
        """Open scope ``scope_id`` that expires at wall-clock ``expiration_time``."""
        # torch's expires() read time.time() just before, as this does: on the same clock
        # (a frozen one, while a test freezes time), whatever the test did to it.
        # Untyped callers pass anything: any number that a budget may be is a time too
        # (a numpy scalar, a Decimal; an int too big for a float is inf), a bool or text
        # is none.
        expiration = as_number(expiration_time)
        if expiration is None:
            raise TypeError(f"expiration_time must be a time.time() value, not {expiration_time!r}")
        if not math.isfinite(expiration):
            raise ValueError(
                f"expiration_time must be a finite time.time() value, not {expiration_time!r}"
            )
        after = round(max(0.0, expiration - time.time()), 3)
        key = (unpatched.getpid(), str(scope_id))
        with self._lock:
            scope = self._open.get(key)
        if scope is not None and scope.active:
            if not scope.expired():
                # torch replaces the timer of an open scope_id: its deadline moves, and
                # the scope stays where it was entered (its site, thread and nesting).
                scope.reschedule(after)
                return
            # Its expiry came, and was caught: that timer is over, a new one starts.
            # (Still undelivered, the overrun raises here, as its release would.)
            with self._lock:
                self._open.pop(key, None)
            scope.release()
        scope = TimerRequest(after, str(scope_id))
        scope.at = _caller(sys._getframe(1))
        scope.acquire()
        with self._lock:
            self._open[key] = scope

    def release(self, scope_id: str) -> None:
        """End the open scope ``scope_id`` of this process, from any thread (no-op if
        none)."""
        with self._lock:
            scope = self._open.pop((unpatched.getpid(), str(scope_id)), None)
        # Not active: already closed, with the test phase (or scope) around it.
        if scope is not None and scope.active:
            scope.release()


def configure_torch() -> TimerClient:
    """``torch.distributed.elastic.timer.configure(TimerClient())``; returns the client."""
    from torch.distributed.elastic.timer import api

    client = TimerClient()
    cast(Any, api).configure(client)  # duck-typed: not a subclass of torch's TimerClient
    return client
