"""Barrier, event and lock across processes, decided by the watchdog.

Two kinds of tests. The first drive the real client against a real watchdog that runs
in a thread of this process on a private directory, with threads as parties: quick,
and precise about messages, records and bad input. The second run inner pytest
sessions (a real watchdog process, as a user gets it) whose tests start real rank
processes, kill a lock holder, or coordinate two xdist workers; they write what they
measured to ``timings.json``, and the JSON report is checked for the expiry records.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from helpers import LEAN, RawClient, run

import pytest_elastic_timer as et
from pytest_elastic_timer.core import wire
from pytest_elastic_timer.scope.client import ENV_ADDRESS
from pytest_elastic_timer.sync import protocol
from pytest_elastic_timer.watchdog import proctree
from pytest_elastic_timer.watchdog.loop import ManualClock
from pytest_elastic_timer.watchdog.server import Watchdog
from pytest_elastic_timer.watchdog.wiring import Assembly, build

REPORT_SCHEMA = Path(et.__file__).parent / "core" / "report.schema.json"
SLACK = 0.5  # how long after its timeout a waiter may be released
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")  # when this suite runs under xdist
ME = f"pid {os.getpid()}, {WORKER}" if WORKER else f"pid {os.getpid()}"  # how we are named


@pytest.fixture
def inner_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inner sessions are not xdist workers of this suite, even when it runs under -n."""
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
        monkeypatch.delenv(name, raising=False)


# -- a watchdog in a thread of this process ------------------------------------------
@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Iterator[Assembly]:
    """A watchdog with its intakes, served by a thread of this process."""
    directory = tempfile.mkdtemp(prefix="pet-sync-")  # short: AF_UNIX paths are limited
    root = proctree.ProcessId.of(os.getpid())
    assert root is not None
    assembly = build(directory, root=root, grace=30.0, scale=1.0)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            assembly.dog.run_once(max_wait=0.02)

    thread = threading.Thread(target=serve, name="sync-test-watchdog", daemon=True)
    thread.start()
    monkeypatch.setenv(ENV_ADDRESS, assembly.dog.address)
    yield assembly
    stop.set()
    thread.join(5)
    assert not thread.is_alive()
    assembly.close()
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def dog(served: Assembly) -> Watchdog:
    return served.dog


def in_threads(count: int, target: Any, *args: Any) -> list[Any]:
    """Run ``target(i, *args)`` in ``count`` threads; their results (or exceptions)."""
    results: list[Any] = [None] * count

    def one(i: int) -> None:
        try:
            results[i] = target(i, *args)
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return results


def test_barrier_passes_round_after_round_with_arrival_indices(dog: Watchdog) -> None:
    def party(i: int) -> list[int]:
        return [et.barrier("rounds", 3, 5, label=f"t{i}") for _ in range(20)]

    results = in_threads(3, party)
    for round_no in range(20):
        assert sorted(r[round_no] for r in results) == [0, 1, 2]
    assert dog.session["sync"]["barrier"]["rounds"] == {"rounds": 20, "parties": 3}
    assert dog.records == []
    assert et.barrier("alone", 1, 0) == 0


def test_barrier_timeout_raises_in_every_waiter_at_once(dog: Watchdog) -> None:
    started = time.monotonic()

    def party(i: int) -> float:
        time.sleep(0.1 * i)  # the second arrives later, with the same budget
        et.barrier("start", 3, 0.5, label=f"rank {i}")
        return 0.0

    first, second = in_threads(2, party)
    ended = time.monotonic() - started
    assert isinstance(first, et.BarrierTimeout) and isinstance(second, et.BarrierTimeout)
    assert isinstance(first, et.ScopeExpired) and isinstance(first, TimeoutError)
    # One decision at the first deadline: both raised then, the later one early.
    assert 0.5 <= ended < 0.5 + SLACK
    assert first.elapsed == pytest.approx(0.5, abs=0.1)
    assert second.elapsed == pytest.approx(0.4, abs=0.1)
    for exc in (first, second):
        assert exc.scope == "barrier:start"
        assert exc.name == "start"
        assert exc.budget == 0.5
        assert exc.parties == 3
        assert exc.generation == 0
        assert [p.label for p in exc.arrived] == ["rank 0", "rank 1"]
        assert [p.pid for p in exc.arrived] == [os.getpid()] * 2
        assert len(exc.missing) == 1 and exc.never_arrived == 1
        assert str(exc.missing[0]) == "a party that never arrived"
        assert str(exc) == (
            f"barrier 'start' timed out after {exc.elapsed:.2f}s (budget 0.5s): 2 of 3 parties "
            f"arrived in round 0: rank 0 ({ME}), rank 1 ({ME}); "
            "missing: 1 party never arrived (1 of 3 parties missing)"
        )
    # A round that timed out is over: the barrier gathers the next round from scratch.
    assert sorted(in_threads(3, lambda i: et.barrier("start", 3, 5))) == [0, 1, 2]


def test_barrier_names_a_party_that_died_waiting(dog: Watchdog, served: Assembly) -> None:
    code = "import pytest_elastic_timer as et; et.barrier('b', 2, 30, label='doomed')"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        give_up = time.monotonic() + 10
        while not dog_calls(served):
            assert time.monotonic() < give_up and proc.poll() is None
            time.sleep(0.01)
    finally:
        proc.kill()
        proc.wait()
    with pytest.raises(et.BarrierTimeout) as info:
        et.barrier("b", 2, 0.3, label="waiter")
    (gone,) = info.value.missing
    assert (gone.label, gone.pid) == ("doomed", proc.pid)
    assert gone.note.startswith("arrived, then went away")
    assert info.value.never_arrived == 0


def dog_calls(served: Assembly) -> list[tuple[str, str, Any]]:
    """The calls the watchdog's primitives are waiting on (read from the test thread)."""
    return list(served.sync.calls.values())


def test_barrier_parties_must_agree(dog: Watchdog, served: Assembly) -> None:
    thread_results: list[Any] = []
    thread = threading.Thread(target=lambda: thread_results.append(et.barrier("n", 2, 5)))
    thread.start()
    give_up = time.monotonic() + 3
    while not dog_calls(served):
        assert time.monotonic() < give_up
        time.sleep(0.01)
    with pytest.raises(ValueError, match=r"gathering 2 parties in round 0 .*this call says 3"):
        et.barrier("n", 3, 5)
    assert et.barrier("n", 2, 5) in (0, 1)
    thread.join(5)
    assert thread_results and thread_results[0] in (0, 1)


def test_primitives_that_cannot_be_made_answer_with_an_error_and_the_watchdog_serves_on(
    dog: Watchdog,
    served: Assembly,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """The watchdog makes its primitives at the session's first call of one: when that
    fails, the call gets an error, the next call tries again, and the watchdog goes on
    serving scopes."""
    with monkeypatch.context() as broken:
        # The primitives' module cannot be imported (as a broken install would have it).
        broken.setitem(sys.modules, "pytest_elastic_timer.sync.server", None)
        before = dog.dropped
        with pytest.raises(ValueError, match="sync primitives unavailable"):
            et.barrier("first", 1, 5)
        assert dog.dropped == before + 1
        assert served.sync.server is None
    assert "pytest-elastic-timer: sync primitives:" in capfd.readouterr().err
    # A process of this watchdog's (its address is in the environment) has its scope
    # expire, as before the error.
    code = (
        "import time, pytest_elastic_timer as et\n"
        "try:\n"
        "    with et.expires(0.1, scope='after the error'):\n"
        "        time.sleep(30)\n"
        "except et.ScopeExpired:\n"
        "    print('expired')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout == "expired\n"
    assert et.barrier("second", 1, 5) == 0
    assert served.sync.server is not None


def test_event_wait_timeout_names_waiters_then_set_releases_them(dog: Watchdog) -> None:
    event = et.Event("ready", label="main")
    assert not event.is_set()
    with pytest.raises(et.EventTimeout) as info:
        event.wait(0.2)
    exc = info.value
    assert exc.scope == "event:ready"
    assert exc.set_by is None
    assert [p.label for p in exc.waiting] == ["main"]
    assert str(exc).endswith(f"nobody set it; waiting: main ({ME}) for 0.20s")

    results: list[Any] = []
    waiters = threading.Thread(target=lambda: results.extend(in_threads(2, wait_ready)))
    waiters.start()
    time.sleep(0.2)
    et.Event("ready", label="setter").set()
    waiters.join(5)
    assert results == ["setter", "setter"]
    assert event.is_set() and event.set_by is not None and event.set_by.label == "setter"
    assert event.wait(0)  # set: returns at once
    et.Event("ready", label="clearer").clear()
    with pytest.raises(
        et.EventTimeout, match=rf"set by setter \({ME}\) .*s ago, cleared by clearer \({ME}\) "
    ):
        event.wait(0.1)


def wait_ready(i: int) -> str:
    event = et.Event("ready")
    event.wait(5)
    assert event.set_by is not None
    return event.set_by.label


def test_lock_is_mutually_exclusive_and_a_timeout_names_the_holder(dog: Watchdog) -> None:
    inside: list[int] = []
    overlaps: list[int] = []

    def worker(i: int) -> None:
        for _ in range(20):
            with et.lock("counter", 10, label=f"w{i}"):
                inside.append(i)
                if len(inside) > 1:
                    overlaps.append(i)
                time.sleep(0.001)
                inside.remove(i)

    assert in_threads(4, worker) == [None] * 4
    assert overlaps == []
    assert dog.session["sync"]["lock"]["counter"]["acquired"] == 80

    holding = threading.Event()
    done = threading.Event()

    def holder() -> None:
        with et.lock("gpu", 5, label="holder"):
            holding.set()
            done.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    assert holding.wait(5)
    line = holder.__code__.co_firstlineno + 1
    with pytest.raises(et.LockTimeout) as info, et.lock("gpu", 0.3, label="late"):
        pass
    done.set()
    thread.join(5)
    exc = info.value
    assert exc.scope == "lock:gpu"
    assert exc.holder is not None and exc.holder.label == "holder"
    assert exc.holder.site == f"{__file__}:{line}"
    assert exc.held >= 0.3
    assert [p.label for p in exc.waiting] == ["late"]
    assert f"held by holder ({ME}), acquired at {__file__}:{line}, held for" in str(exc)
    assert "(this very process: the lock is not reentrant)" in str(exc)


def test_lock_of_a_holder_that_went_away_is_handed_on_with_a_warning(dog: Watchdog) -> None:
    dead = et.lock("port", 5, label="doomed")
    dead.acquire()
    assert dead.held
    assert dead._call is not None
    dead._call.close()  # as if its process died: the connection closes without release
    told = r"lock 'port' was abandoned: its holder doomed"
    with pytest.warns(et.LockAbandoned, match=told), et.lock("port", 5) as heir:
        assert heir.abandoned_by is not None
        assert heir.abandoned_by.label == "doomed"
        assert heir.abandoned_by.site.startswith(__file__)
    with et.lock("port", 5) as next_one:
        assert next_one.abandoned_by is None  # told once
    assert dog.session["sync"]["lock"]["port"]["abandoned"] == 1


INTERRUPTED = """
import pytest_elastic_timer as et
for wait in (lambda: et.barrier("never", 2, 30), lambda: et.lock("busy", 30).acquire()):
    try:
        with et.expires(0.3, scope="outer"):
            wait()
    except et.ScopeExpired as exc:
        print(type(exc).__name__, exc.scope)
"""


def test_an_enclosing_scope_interrupts_a_wait_which_leaves_at_once(
    dog: Watchdog, served: Assembly
) -> None:
    holding = threading.Event()
    done = threading.Event()
    thread = threading.Thread(target=hold_until, args=("busy", holding, done))
    thread.start()
    assert holding.wait(5)
    # The child's scope is enforced by this watchdog too (its grace is long: no kill).
    out = subprocess.run(
        [sys.executable, "-c", INTERRUPTED], capture_output=True, text=True, timeout=30
    )
    assert out.stdout.splitlines() == ["ScopeExpired outer", "ScopeExpired outer"], out.stderr
    give_up = time.monotonic() + 3
    while len(dog_calls(served)) > 1:  # the child's calls left; only the holder is left
        assert time.monotonic() < give_up
        time.sleep(0.01)
    with pytest.raises(et.LockTimeout):
        et.lock("busy", 0).acquire()  # 0: one try, no wait
    done.set()
    thread.join(5)
    with et.lock("busy", 0):
        pass
    assert [r.scope for r in dog.records] == ["outer", "outer", "lock:busy"]


def hold_until(name: str, holding: threading.Event, done: threading.Event) -> None:
    with et.lock(name, 5):
        holding.set()
        done.wait(10)


def test_abandoned_lock_with_warnings_as_errors_is_not_kept(dog: Watchdog) -> None:
    dead = et.lock("strict", 5).acquire()
    assert dead._call is not None
    dead._call.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error", et.LockAbandoned)
        with pytest.raises(et.LockAbandoned):
            et.lock("strict", 5).acquire()
    with et.lock("strict", 0.5) as again:  # released on the way out
        assert again.abandoned_by is None


def test_timeouts_are_recorded_like_expired_scopes(dog: Watchdog) -> None:
    dog.scale = 2.0
    line = sys._getframe().f_lineno + 2
    with pytest.raises(et.BarrierTimeout) as info:
        et.barrier("scaled", 2, 0.1, label="rank 0")
    assert info.value.budget == pytest.approx(0.2)
    assert info.value.elapsed == pytest.approx(0.2, abs=0.1)
    (record,) = dog.records
    assert record.scope == "barrier:scaled"
    assert record.action == "interrupted"
    assert record.budget == pytest.approx(0.2)
    assert record.label == "rank 0" and record.pid == os.getpid()
    assert (record.file, record.line) == (__file__, line)
    assert record.nodeid == os.environ["PYTEST_CURRENT_TEST"].rsplit(" (", 1)[0]
    assert record.serial < 0
    assert record.stack.startswith("barrier 'scaled' timed out: 1 of 2 parties arrived")
    assert "test_timeouts_are_recorded_like_expired_scopes" in record.stack
    with open(dog.records_path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert [json.loads(text)["scope"] for text in lines] == ["barrier:scaled"]


@pytest.mark.parametrize(
    ("op", "fields", "error"),
    [
        (protocol.OP_BARRIER, {"name": "x", "parties": 0, "timeout": 1}, "parties must be"),
        (protocol.OP_BARRIER, {"name": "x", "parties": True, "timeout": 1}, "parties"),
        (protocol.OP_BARRIER, {"name": "", "parties": 2, "timeout": 1}, "a name must"),
        (protocol.OP_EVENT_WAIT, {"name": 5, "timeout": 1}, "name"),
        (protocol.OP_EVENT_WAIT, {"name": "e", "timeout": math.nan}, "finite"),
        (protocol.OP_LOCK_ACQUIRE, {"name": "l", "timeout": -1}, "finite"),
        (protocol.OP_LOCK_ACQUIRE, {"name": "l", "timeout": "soon"}, "number"),
        (protocol.OP_LOCK_ACQUIRE, {"name": "l", "timeout": 1, "label": 7}, "label"),
    ],
)
def test_bad_requests_are_answered_and_counted(
    dog: Watchdog, op: str, fields: dict[str, Any], error: str
) -> None:
    before = dog.dropped
    with RawClient(dog.address) as raw:
        answer = raw.ask(wire.encode(op, **fields), timeout=5)
    assert answer is not None
    answer, reply = answer
    assert answer == protocol.ERROR and error in reply["error"]
    assert dog.dropped == before + 1
    assert et.barrier("still-serving", 1, 1) == 0


def test_bad_arguments_are_refused_before_asking(dog: Watchdog) -> None:
    with pytest.raises(TypeError, match="parties must be an int"):
        et.barrier("b", 2.0, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout must be a finite number"):
        et.barrier("b", 2, math.inf)
    with pytest.raises(TypeError, match="timeout must be a number"):
        et.lock("l", None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="name must have 1 to"):
        et.Event("")
    with pytest.raises(RuntimeError, match="not held"):
        et.lock("l", 1).release()


def test_numbers_of_other_types_are_timeouts_and_parties(dog: Watchdog) -> None:
    """A world size or a timeout computed with numpy, or a Fraction, is the number it
    holds (it was a TypeError), sent to the watchdog as a plain number. A float is
    still no count of parties, not even 2.0, and numpy's bool is no number."""
    np = pytest.importorskip("numpy", reason="numpy makes the numbers of other types")
    assert et.barrier("other-type", np.int64(1), np.float32(0.5)) == 0
    with pytest.raises(et.BarrierTimeout) as info:
        et.barrier("other-type-late", np.int32(2), np.float32(0.25), label="rank 0")
    assert info.value.budget == 0.25 and type(info.value.parties) is int
    assert info.value.parties == 2
    (record,) = dog.records
    assert record.scope == "barrier:other-type-late" and record.budget == 0.25
    event = et.Event("other-type")
    event.set()
    assert event.wait(Fraction(1, 2)) is True
    held = et.lock("other-type", np.uint16(5))
    assert held.timeout == 5.0 and type(held.timeout) is float
    with held:
        assert held.held
    for parties in (np.float64(2.0), np.bool_(True)):
        with pytest.raises(TypeError, match=re.escape(f"must be an int, not {parties!r}")):
            et.barrier("b", parties, 1)
    with pytest.raises(ValueError, match=r"timeout must be a finite number >= 0, not np"):
        et.lock("l", np.float32("nan"))


def test_a_timeout_of_centuries_waits_as_forever_does(dog: Watchdog) -> None:
    """A finite timeout longer than a socket's wait can be (some 290 years) is as
    good as forever, not an OverflowError."""
    event = et.Event("centuries")
    setter = threading.Timer(0.2, event.set)
    setter.start()
    try:
        assert event.wait(1e10)
    finally:
        setter.join()
    with et.lock("centuries", 1e300):
        pass
    assert et.barrier("centuries", 1, 1e300) == 0


def test_timeouts_cross_process_boundaries_intact() -> None:
    party = et.Party(42, "rank 2", "x.py:3", "gw1", "passed round 4")
    exc = et.BarrierTimeout(
        "barrier:b", 1.0, 1.01, 7, "interrupted", "t.py:1", "rank 0",
        name="b", detail="1 of 2 parties arrived", arrived=[party], missing=[et.Party(0)],
        parties=2, generation=5,
    )  # fmt: skip
    copy = pickle.loads(pickle.dumps(exc))
    assert type(copy) is et.BarrierTimeout and isinstance(copy, et.SyncTimeout)
    assert str(copy) == str(exc)
    assert (copy.arrived, copy.missing, copy.generation) == ([party], [et.Party(0)], 5)
    assert copy.never_arrived == 1
    lock_exc = pickle.loads(pickle.dumps(et.LockTimeout("lock:l", holder=party, held=2.5)))
    assert lock_exc.holder == party and lock_exc.held == 2.5


def test_without_a_watchdog_every_primitive_says_it_needs_one() -> None:
    code = """
import pytest_elastic_timer as et
for call in (lambda: et.barrier("b", 2, 1), lambda: et.Event("e").wait(1),
             lambda: et.Event("e").set(), lambda: et.lock("l", 1).acquire()):
    try:
        call()
    except RuntimeError as exc:
        print(exc)
"""
    env = {k: v for k, v in os.environ.items() if k != ENV_ADDRESS}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30
    )
    lines = out.stdout.splitlines()
    assert [line.split(" needs")[0] for line in lines] == [
        "barrier 'b'",
        "event 'e'",
        "event 'e'",
        "lock 'l'",
    ], out.stderr
    assert all(
        "needs the pytest session's watchdog, and there is none: PYTEST_ELASTIC_TIMER is not set"
        in line
        for line in lines
    )


# -- the server driven step by step, on a manual clock -------------------------------
@pytest.fixture
def stepped() -> Iterator[tuple[Assembly, ManualClock]]:
    """A watchdog with its intakes on a manual clock, run one turn at a time."""
    directory = tempfile.mkdtemp(prefix="pet-sync-")
    root = proctree.ProcessId.of(os.getpid())
    assert root is not None
    clock = ManualClock()
    assembly = build(directory, root=root, grace=30.0, scale=1.0, clock=clock)
    yield assembly, clock
    assembly.close()
    shutil.rmtree(directory, ignore_errors=True)


class Call:
    """One hand-made call on a connection of its own, as the client makes it, to a
    watchdog that takes one turn to accept it and one to read it."""

    def __init__(self, dog: Watchdog, op: str, **fields: Any) -> None:
        self.raw = RawClient(dog.address)
        self.sock = self.raw.sock
        dog.run_once(max_wait=0)  # accepted
        self.raw.send(wire.encode(op, **fields))
        dog.run_once(max_wait=0)  # read

    def answer(self) -> tuple[str, dict[str, Any]] | None:
        """The answer, if the watchdog gave one."""
        self.sock.settimeout(0)
        try:
            return wire.decode(self.sock.recv(wire.MAX_MESSAGE))
        except BlockingIOError:
            return None


def test_a_barrier_round_times_out_at_its_first_deadline_for_everyone_at_once(
    stepped: tuple[Assembly, ManualClock],
) -> None:
    assembly, clock = stepped
    dog = assembly.dog
    first = Call(dog, protocol.OP_BARRIER, name="b", parties=3, timeout=0.5, label="rank 0")
    clock.advance(0.1)
    second = Call(dog, protocol.OP_BARRIER, name="b", parties=3, timeout=0.5, label="rank 1")
    clock.advance(0.4 - 1e-6)
    dog.run_once(max_wait=0)
    assert (first.answer(), second.answer()) == (None, None)
    clock.advance(1e-6)
    dog.run_once(max_wait=0)
    answers = [first.answer(), second.answer()]
    assert [a[0] if a else None for a in answers] == [protocol.TIMEOUT] * 2
    elapsed = [a[1]["elapsed"] for a in answers if a]
    assert elapsed == [pytest.approx(0.5), pytest.approx(0.4)]
    assert [(r.scope, r.label) for r in dog.records] == [
        ("barrier:b", "rank 0"),
        ("barrier:b", "rank 1"),
    ]
    assert dog.session["sync"]["barrier"]["b"] == {"timeouts": 1, "parties": 3}
    assert assembly.sync.calls == {}
    for call in (first, second):
        call.sock.close()


def test_a_lock_waiter_times_out_at_its_deadline_naming_the_holder(
    stepped: tuple[Assembly, ManualClock],
) -> None:
    assembly, clock = stepped
    dog = assembly.dog
    holder = Call(dog, protocol.OP_LOCK_ACQUIRE, name="gpu", timeout=5, label="holder")
    assert holder.answer() is not None
    clock.advance(1.0)
    waiter = Call(dog, protocol.OP_LOCK_ACQUIRE, name="gpu", timeout=0.25, label="late")
    clock.advance(0.25 - 1e-6)
    dog.run_once(max_wait=0)
    assert waiter.answer() is None
    clock.advance(1e-6)
    dog.run_once(max_wait=0)
    answer = waiter.answer()
    assert answer is not None and answer[0] == protocol.TIMEOUT
    assert answer[1]["holder"]["label"] == "holder"
    assert answer[1]["held"] == pytest.approx(1.25)
    (record,) = dog.records
    assert (record.scope, record.label, record.budget) == ("lock:gpu", "late", 0.25)
    # The holder's connection closes: the lock is free, and nobody waits for it.
    holder.sock.close()
    dog.run_once(max_wait=0)
    assert assembly.sync.calls == {}
    waiter.sock.close()


# -- real processes in inner sessions ------------------------------------------------
RANK = '''
"""A rank: python rank.py MODE, with RANK in its environment."""
import json, os, sys, time
import pytest_elastic_timer as et

mode, rank = sys.argv[1], int(os.environ["RANK"])
out = {"rank": rank, "pid": os.getpid()}


def attempt(name, timeout):
    out["started"] = time.monotonic()  # one clock for every process of the host
    try:
        et.barrier(name, 3, timeout)  # BARRIER LINE
        out["passed"] = True
    except et.BarrierTimeout as exc:
        out.update(
            released=time.monotonic(),
            budget=exc.budget,
            message=str(exc),
            arrived=[[p.label, p.pid] for p in exc.arrived],
            missing=[[p.label, p.pid, p.note] for p in exc.missing],
            never_arrived=exc.never_arrived,
        )


if mode == "missing":  # a 3-party barrier that rank 2 never reaches
    attempt("start", 1.0)
elif mode == "named":  # all three pass round 0; rank 2 then waits for something else
    et.barrier("phase", 3, 10)
    if rank == 2:
        try:
            et.Event("go-on").wait(1.5)
        except et.EventTimeout:
            out["gave_up"] = True
    else:
        attempt("phase", 1.0)
print(json.dumps(out))
'''

RANKS_TEST = """
import json, multiprocessing, os, subprocess, sys, time
import pytest_elastic_timer as et

RANK_PY = os.path.join(os.path.dirname(__file__), "rank.py")


def ranks(mode, which):
    procs = [
        subprocess.Popen(
            [sys.executable, RANK_PY, mode],
            env={**os.environ, "RANK": str(r)},
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in which
    ]
    outs = [json.loads(p.communicate(timeout=30)[0]) for p in procs]
    assert [p.returncode for p in procs] == [0] * len(procs)
    return outs


def save(key, value):
    path = "timings.json"
    data = json.load(open(path)) if os.path.exists(path) else {}
    data[key] = value
    json.dump(data, open(path, "w"))


def released(outs):
    # When each waiter was released, counted from the first call of the round (the
    # round's first deadline is 1 s after that call).
    first = min(o["started"] for o in outs)
    return [o["released"] - first for o in outs]


def test_missing_party_never_arrives():
    outs = ranks("missing", [0, 1])
    after = released(outs)
    assert all(1.0 <= t < 1.5 for t in after), after
    assert max(after) - min(after) < 0.1  # at once
    pids = sorted(o["pid"] for o in outs)
    for out in outs:
        assert sorted(pid for _, pid in out["arrived"]) == pids
        assert sorted(label for label, _ in out["arrived"]) == ["rank 0", "rank 1"]
        assert out["missing"] == [["", 0, "never arrived"]]
        assert out["never_arrived"] == 1
        assert "missing: 1 party never arrived (1 of 3 parties missing)" in out["message"]
    save("missing", after)


def test_missing_party_is_named():
    outs = ranks("named", [0, 1, 2])
    rank2 = outs[2]
    assert rank2.get("gave_up")
    after = released(outs[:2])
    assert all(1.0 <= t < 1.5 for t in after), after
    for out in outs[:2]:
        ((label, pid, note),) = out["missing"]
        assert (label, pid) == ("rank 2", rank2["pid"])
        assert note.startswith("passed round 0 ")
        assert "now waiting for event 'go-on'" in note
        assert f"missing: rank 2 (pid {rank2['pid']}): passed round 0" in out["message"]
    save("named", after)


def party(rank, rounds, counter, result):
    et.set_label(f"rank {rank}")
    behind = 0
    indices = []
    for round_no in range(rounds):
        indices.append(et.barrier("rounds", 3, 10))
        # Every party counted its earlier rounds before this round let anyone pass.
        if counter.value < 3 * round_no:
            behind += 1
        with counter.get_lock():
            counter.value += 1
    result.put((rank, indices, behind))


def test_barrier_reused_for_100_rounds():
    ctx = multiprocessing.get_context("fork")
    counter, result = ctx.Value("i", 0), ctx.Queue()
    started = time.monotonic()
    procs = [ctx.Process(target=party, args=(r, 100, counter, result)) for r in range(3)]
    for p in procs:
        p.start()
    got = sorted(result.get(timeout=30) for _ in procs)
    for p in procs:
        p.join(10)
    seconds = time.monotonic() - started
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert [behind for _, _, behind in got] == [0, 0, 0]
    for round_no in range(100):
        assert sorted(indices[round_no] for _, indices, _ in got) == [0, 1, 2]
    assert counter.value == 300
    save("rounds_100_seconds", seconds)
"""


def timings(pytester: pytest.Pytester) -> dict[str, Any]:
    path = pytester.path / "timings.json"
    data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    return data


@pytest.mark.usefixtures("inner_env")
def test_barrier_across_ranks(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(rank=RANK, test_ranks=RANKS_TEST)
    session = run(pytester, "-q")
    session.assert_clean()
    session.result.assert_outcomes(passed=3)
    measured = timings(pytester)
    print("sync timings:", measured)
    assert session.report is not None
    found = sorted((r["scope"], r["label"]) for r in session.report["expired"] if ":" in r["scope"])
    assert found == [
        ("barrier:phase", "rank 0"),
        ("barrier:phase", "rank 1"),
        ("barrier:start", "rank 0"),
        ("barrier:start", "rank 1"),
        ("event:go-on", "rank 2"),
    ]
    rank_py = (pytester.path / "rank.py").read_text().splitlines()
    line = next(n for n, text in enumerate(rank_py, 1) if text.endswith("# BARRIER LINE"))
    for record in session.report["expired"]:
        assert record["action"] == "interrupted"
        assert record["worker"] == ""
        if record["scope"] == "barrier:start":
            assert record["nodeid"] == "test_ranks.py::test_missing_party_never_arrives"
            # The round ends at its first deadline: a later party waited a little less.
            assert record["budget"] == 1.0 and 0.5 < record["elapsed"] < 1.0 + SLACK
            assert (os.path.basename(record["file"]), record["line"]) == ("rank.py", line)
            assert "1 party never arrived (1 of 3 parties missing)" in record["stack"]
    summary = session.report["session"]["sync"]
    jsonschema.validate(session.report, json.loads(REPORT_SCHEMA.read_text()))
    assert summary["barrier"]["rounds"] == {"rounds": 100, "parties": 3}
    assert summary["barrier"]["start"]["timeouts"] == 1
    # The tests passed: their expiries were caught on purpose, and are counted.
    assert "elastic-timer: expired scopes" in session.stdout
    assert re.search(
        r"^\d+ scopes expired inside tests that passed \(caught on purpose\); -v lists them$",
        session.stdout,
        re.M,
    ), session.stdout


LOCK_TEST = """
import json, multiprocessing, os, signal, threading, time
import pytest
import pytest_elastic_timer as et

LINE = next(
    n for n, text in enumerate(open(__file__).read().splitlines(), 1) if text.endswith("# ACQUIRE")
)


def hold(ready):
    et.set_label("holder")
    et.lock("gpu", 5).acquire()  # ACQUIRE
    ready.set()
    time.sleep(60)


def test_holder_killed_mid_hold():
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    holder = ctx.Process(target=hold, args=(ready,))
    holder.start()
    assert ready.wait(10)
    with pytest.raises(et.LockTimeout) as info:
        with et.lock("gpu", 0.3):
            pass
    exc = info.value
    assert exc.holder.label == "holder" and exc.holder.pid == holder.pid
    assert exc.holder.site == f"{__file__}:{LINE}"
    assert f"held by holder (pid {holder.pid}), acquired at " in str(exc)

    killed = []
    def kill():
        killed.append(time.monotonic())
        os.kill(holder.pid, signal.SIGKILL)
    threading.Timer(0.3, kill).start()
    with pytest.warns(et.LockAbandoned, match="its holder holder"):
        with et.lock("gpu", 10, label="heir") as lk:
            got = time.monotonic()
            assert lk.abandoned_by.pid == holder.pid
            assert lk.abandoned_by.site == f"{__file__}:{LINE}"
            assert lk.abandoned_held >= 0.6
    holder.join(5)
    assert holder.exitcode == -signal.SIGKILL
    json.dump({"lock_handed_on_after_kill": got - killed[0]}, open("timings.json", "w"))
"""


@pytest.mark.usefixtures("inner_env")
def test_lock_holder_killed_mid_hold(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_lock=LOCK_TEST)
    session = run(pytester, "-q", f"--elastic-timer-trace={pytester.path / 'trace.json'}")
    session.assert_clean()
    session.result.assert_outcomes(passed=1)
    measured = timings(pytester)
    print("sync timings:", measured)
    assert measured["lock_handed_on_after_kill"] < SLACK
    assert session.report is not None
    (record,) = session.report["expired"]
    assert record["scope"] == "lock:gpu" and record["budget"] == 0.3
    assert record["nodeid"] == "test_lock.py::test_holder_killed_mid_hold"
    gpu = session.report["session"]["sync"]["lock"]["gpu"]
    assert gpu["abandoned"] == 1 and gpu["longest_hold"] > 0  # seconds: a float
    jsonschema.validate(session.report, json.loads(REPORT_SCHEMA.read_text()))
    trace = json.loads((pytester.path / "trace.json").read_text())
    spans = [e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert spans.count("lock:gpu") >= 2  # the one that timed out, the heir's hold


XDIST_TEST = """
import os
import pytest_elastic_timer as et


def test_setter():
    et.Event("ready").set()
    et.Event("ack").wait(20)  # the waiter answers from its own worker


def test_waiter():
    ready = et.Event("ready")
    assert ready.wait(20)
    assert ready.set_by.worker not in ("", os.environ["PYTEST_XDIST_WORKER"])
    et.Event("ack").set()
"""


@pytest.mark.usefixtures("inner_env")
def test_event_across_xdist_workers(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_events=XDIST_TEST)
    plugins = [("-p", name) for name in LEAN[1::2] if name != "no:xdist"]
    session = run(pytester, *(arg for pair in plugins for arg in pair), "-n", "2", "-v", lean=False)
    session.assert_clean()
    session.result.assert_outcomes(passed=2)
    workers = {line.split("]")[0] for line in session.lines if "PASSED test_events.py" in line}
    assert workers == {"[gw0", "[gw1"}
    assert session.report is not None and session.report["expired"] == []
