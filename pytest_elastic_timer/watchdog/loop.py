"""The watchdog's event loop: one selector for its sockets and pipes, one heap of timers,
one clock.

The clock is a parameter (``time.monotonic`` by default, never the wall clock), so a
test can drive the watchdog step by step with a :class:`ManualClock` and
:meth:`Loop.run_once`, the way torch's timer server is driven by its ``run_once`` and
Trio's ``MockClock`` makes time a parameter: the test moves the clock past a deadline
and runs one turn, instead of sleeping until the deadline comes.

There is no polling interval: a turn sleeps in ``select()`` until the earliest timer or
the next message, whichever comes first.

With an ``on_error`` handler, a callback that fails costs only itself: a failed reader
is no longer watched (it would be ready again at once, and fail again), a failed timer
is gone, and the rest of the loop goes on. The handler decides what an error means; it
re-raises what must end the loop.
"""

from __future__ import annotations

import heapq
import itertools
import selectors
import time
from collections.abc import Callable
from typing import Any

Clock = Callable[[], float]
ErrorHandler = Callable[[Exception, str], None]  # (the error, what failed)
LONGEST_WAIT = 3600.0  # select() refuses timeouts of about 25 days and more


class ManualClock:
    """A monotonic clock that moves only when told to (for tests)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` forward."""
        if seconds < 0:
            raise ValueError("a monotonic clock never goes back")
        self.now += seconds


class Loop:
    """Readers, timers and a clock; :meth:`run_once` is one turn."""

    def __init__(self, clock: Clock = time.monotonic, on_error: ErrorHandler | None = None) -> None:
        self.clock = clock
        self.on_error = on_error
        self._selector = selectors.DefaultSelector()
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()  # equal times run in the order they were set

    def add_reader(self, fileobj: Any, callback: Callable[[Any], None]) -> None:
        """Call ``callback(fileobj)`` whenever ``fileobj`` is readable."""
        self._selector.register(fileobj, selectors.EVENT_READ, callback)

    def remove_reader(self, fileobj: Any) -> None:
        """Stop watching ``fileobj`` (nothing happens if it was not watched)."""
        try:
            self._selector.unregister(fileobj)
        except (KeyError, ValueError):
            pass

    def call_at(self, when: float, callback: Callable[[], None]) -> None:
        """Run ``callback()`` in the first turn at or after ``when`` on the loop's clock."""
        heapq.heappush(self._timers, (when, next(self._order), callback))

    def next_due(self) -> float | None:
        """When the earliest timer is due, or None without timers."""
        return self._timers[0][0] if self._timers else None

    def run_once(self, max_wait: float | None = None) -> None:
        """Wait for a reader or the earliest timer (at most ``max_wait`` seconds), then
        handle every ready reader and every timer that is due."""
        due = self.next_due()
        timeout = None if due is None else min(max(0.0, due - self.clock()), LONGEST_WAIT)
        if max_wait is not None:
            timeout = max_wait if timeout is None else min(timeout, max_wait)
        self._run_readers(timeout)
        self.run_due()

    def run_ready(self) -> int:
        """Handle every reader that is ready now, without waiting; how many were."""
        return self._run_readers(0)

    def _run_readers(self, timeout: float | None) -> int:
        ready = self._selector.select(timeout)
        for key, _ in ready:
            try:
                key.data(key.fileobj)
            except Exception as exc:
                self.report_error(exc, f"the reader of {key.fileobj!r}")
                self.remove_reader(key.fileobj)
        return len(ready)

    def run_due(self) -> None:
        """Run the timers that are due now, earliest first."""
        now = self.clock()
        while self._timers and self._timers[0][0] <= now:
            _, _, callback = heapq.heappop(self._timers)
            try:
                callback()
            except Exception as exc:
                self.report_error(exc, f"the timer {getattr(callback, '__qualname__', callback)!r}")

    def report_error(self, exc: Exception, what: str) -> None:
        """A callback raised ``exc`` (or caught it, and went on without what failed):
        the error handler's to judge; without one, it ends the turn."""
        if self.on_error is None:
            raise exc
        self.on_error(exc, what)

    def close(self) -> None:
        """Let go of the selector (the readers themselves are their owners' to close)."""
        self._selector.close()
