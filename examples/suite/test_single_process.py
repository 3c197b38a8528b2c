"""Hangs in plain Python code: each fails in about its budget, the rest passes."""

import threading
import time

import pytest

import pytest_elastic_timer as et


def test_quick_step_passes(elastic_timer):
    with elastic_timer.step("warm-up", after=5):
        time.sleep(0.01)
    assert elastic_timer.remaining() > 0


@pytest.mark.hangs("test_sleep_forever::call")
@pytest.mark.expires(1)
def test_sleep_forever():
    time.sleep(3600)


@pytest.mark.hangs("test_deadlock::call/take-both-locks")
def test_deadlock():
    first, second = threading.Lock(), threading.Lock()
    second.acquire()
    with et.expires(after=1, scope="take-both-locks"), first:
        second.acquire()  # never released: a classic deadlock


@pytest.mark.hangs("test_gil_held_in_c::call")
@pytest.mark.expires(1, grace=1)
def test_gil_held_in_c():
    # One C call holding the GIL: no Python-level timer can interrupt it.
    sum(range(10**11))


def test_after_the_hangs_passes():
    assert True
