"""Deadlines wait while a debugger steps through the process."""

from __future__ import annotations

import bdb
import sys
import threading
import time

import pytest

import pytest_elastic_timer as et


class _Tracer(bdb.Bdb):
    """A debugger that stops nowhere: its trace function is all that matters here."""

    def user_line(self, frame: object) -> None:
        pass


def test_debugger_trace_function_postpones_an_expired_scope() -> None:
    tracer = _Tracer()
    tracer.set_trace()
    try:
        start = time.monotonic()
        with et.expires(0.3, "stepping") as scope:
            time.sleep(0.8)  # past the deadline while "debugged": no ScopeExpired
    finally:
        sys.settrace(None)
    assert scope.deadline - start >= 1.0  # the budget was given again


def test_a_debugger_in_another_thread_postpones_that_threads_scope() -> None:
    # The interrupt reaches the main thread (waiting in join), which is not debugged:
    # the scope's own thread is, and its frames say so.
    outcome: dict[str, object] = {}

    def step_through() -> None:
        tracer = _Tracer()
        tracer.set_trace()
        try:
            start = time.monotonic()
            with et.expires(0.3, "stepping-in-thread") as scope:
                time.sleep(0.8)
            outcome["given"] = scope.deadline - start
        except et.ScopeExpired as exc:
            outcome["expired"] = exc
        finally:
            sys.settrace(None)

    thread = threading.Thread(target=step_through)
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    assert "expired" not in outcome, outcome
    assert isinstance(outcome["given"], float) and outcome["given"] >= 1.0


def test_without_debugger_the_same_scope_expires() -> None:
    with pytest.raises(et.ScopeExpired) as info, et.expires(0.3, "not-stepping"):
        time.sleep(0.8)
    assert info.value.scope.endswith("::call/not-stepping")


def test_coverage_style_tracer_is_not_a_debugger() -> None:
    from pytest_elastic_timer.scope.delivery import under_debugger

    def plain_tracer(frame: object, event: str, arg: object) -> None:
        return None

    sys.settrace(plain_tracer)  # type: ignore[arg-type]
    try:
        assert not under_debugger()
    finally:
        sys.settrace(None)
