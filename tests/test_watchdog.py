"""The watchdog, specified by driving it step by step.

Most tests run a watchdog in this process on a :class:`ManualClock`: the test moves the
clock and runs one turn of the loop (:class:`Stepper`), so nothing sleeps while it
waits for a deadline, and "not before the deadline" is checked at the deadline's very
edge. Sockets, tables and signals stay real: the test process registers itself with
the watchdog as a hand-made client (:class:`Client`) and SIGUSR1 is its interrupt.

The tests at the end are about real processes and run on the real clock: a client
stuck in a C call, dumped and terminated with its tree; and a real watchdog process,
which imports nothing of pytest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import psutil
import pytest
from helpers import ENV_DUMP_SIGNAL, RawClient, loaded_psutil, pump, wait_gone, write_slot

from pytest_elastic_timer.ci.reports import report_schema
from pytest_elastic_timer.core import records, startup, wire
from pytest_elastic_timer.core import table as tbl
from pytest_elastic_timer.scope.client import ENV_ADDRESS
from pytest_elastic_timer.watchdog import dumps, proctree
from pytest_elastic_timer.watchdog.loop import Loop, ManualClock
from pytest_elastic_timer.watchdog.server import Watchdog

GRACE = 30.0  # interrupt-to-dump grace of the stepped watchdog: never reached here


# -- one helper per job --------------------------------------------------------------
@contextlib.contextmanager
def serving(root: proctree.ProcessId | None = None, **settings: object) -> Iterator[Watchdog]:
    """A watchdog on a private directory, for the session below ``root`` (default:
    this process), closed and removed afterwards."""
    directory = tempfile.mkdtemp(prefix="pet-unit-")  # short: AF_UNIX paths are limited
    root = root or proctree.ProcessId.of(os.getpid())
    assert root is not None
    dog = Watchdog(directory, root=root, **settings)  # type: ignore[arg-type]
    try:
        yield dog
    finally:
        dog.close()
        shutil.rmtree(directory, ignore_errors=True)


@dataclass
class Stepper:
    """Drives a watchdog on a manual clock: one turn at a time, never waiting."""

    dog: Watchdog
    clock: ManualClock

    def turn(self) -> None:
        """Handle what is ready now: messages already sent, timers already due."""
        self.dog.run_once(max_wait=0)

    def elapse(self, seconds: float) -> None:
        """Let ``seconds`` pass, then take a turn."""
        self.clock.advance(seconds)
        self.turn()


class Client:
    """This process as a client of a stepped watchdog: a socket, a table, raw messages."""

    def __init__(self, step: Stepper) -> None:
        self.step = step
        dog = step.dog
        self.sock = RawClient(dog.address).sock
        self.sock.settimeout(0)
        self.path = os.path.join(dog.directory, f"table-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.table = tbl.ScopeTable.create(self.path)
        self.answers: list[tuple[str, dict[str, object]]] = []
        step.turn()  # accepted
        assert dog.connections.peers

    def send(self, data: bytes) -> None:
        """Send one datagram and let the watchdog read it."""
        self.sock.send(data)
        self.step.turn()

    def ask(self, op: str, **fields: object) -> tuple[str, dict[str, object]] | None:
        """Send a message; the watchdog's answer, if it gave one."""
        before = len(self.answers)
        self.send(wire.encode(op, **fields))
        return self.answers[before] if self.receive() > before else None

    def receive(self) -> int:
        """Read every answer waiting; how many there were in all."""
        with contextlib.suppress(BlockingIOError, InterruptedError):
            while True:
                self.answers.append(wire.decode(self.sock.recv(wire.MAX_MESSAGE)))
        return len(self.answers)

    def hello(self) -> tuple[str, dict[str, object]] | None:
        return self.ask("hello", pid=os.getpid(), table=self.path, dump="")

    def open_scope(self, after: float, *, serial: int = 1, slot: int = 0, depth: int = 0) -> float:
        """Enter a scope of ``after`` seconds (slot and wake, as the scope side does);
        returns its deadline."""
        now = self.step.clock()
        sid = self.table.add_string(f"scope-{serial}")
        write_slot(
            self.table,
            slot,
            serial=serial,
            deadline=now + after,
            start=now,
            path_sid=sid,
            depth=depth,
        )
        self.table.words[tbl.H_HWM] = max(int(self.table.words[tbl.H_HWM]), slot + 1)
        self.send(wire.encode("wake", at=now + after))
        return now + after

    def leave_scope(self, slot: int = 0) -> None:
        self.table.clear_slot(slot)

    def close(self) -> None:
        for index in range(int(self.table.words[tbl.H_HWM])):
            self.table.clear_slot(index)
        self.sock.close()
        self.table.close()


# -- fixtures ------------------------------------------------------------------------
@pytest.fixture
def step() -> Iterator[Stepper]:
    clock = ManualClock()
    with serving(grace=GRACE, kill_after=1.0, scale=1.0, clock=clock) as dog:
        yield Stepper(dog, clock)


@pytest.fixture
def dog(step: Stepper) -> Watchdog:
    return step.dog


@pytest.fixture
def connection(step: Stepper) -> Iterator[Client]:
    """A client connected to the watchdog that has not said hello yet."""
    made = Client(step)
    yield made
    made.close()


@pytest.fixture
def client(connection: Client) -> Client:
    """A client the watchdog welcomed."""
    answer = connection.hello()
    assert answer is not None and answer[0] == "welcome"
    return connection


@pytest.fixture
def interrupts(step: Stepper, client: Client) -> Iterator[list[float]]:
    """SIGUSR1 is the client's interrupt signal; the list says when (on the manual
    clock) each one arrived."""
    arrived: list[float] = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: arrived.append(step.clock()))
    client.table.words[tbl.H_INTERRUPT_SIG] = signal.SIGUSR1
    yield arrived
    signal.signal(signal.SIGUSR1, previous)


# -- registration ------------------------------------------------------------------
def test_hello_is_welcomed(dog: Watchdog, connection: Client) -> None:
    answer = connection.hello()
    assert answer is not None
    op, fields = answer
    assert (op, fields["pid"], fields["scale"], fields["grace"]) == (
        "welcome",
        os.getpid(),
        1.0,
        GRACE,
    )
    assert os.getpid() in dog.owners
    assert dog.dropped == 0


def test_hello_with_another_pid_is_refused(dog: Watchdog, connection: Client) -> None:
    answer = connection.ask("hello", pid=os.getpid() + 1, table=connection.path, dump="")
    assert answer is not None and answer[0] == "refused"
    assert dog.dropped == 1
    assert os.getpid() not in dog.owners


@pytest.mark.parametrize("where", ["outside", "other-pid", "traversal"])
def test_hello_with_a_table_outside_the_session_is_refused(
    dog: Watchdog, connection: Client, where: str
) -> None:
    table = {
        "outside": f"/tmp/table-{os.getpid()}-x",
        "other-pid": os.path.join(dog.directory, "table-1-x"),
        "traversal": os.path.join(dog.directory, "..", f"table-{os.getpid()}-x"),
    }[where]
    answer = connection.ask("hello", pid=os.getpid(), table=table, dump="")
    assert answer is not None and answer[0] == "refused"
    assert dog.dropped == 1
    assert os.getpid() not in dog.owners


def test_messages_before_hello_are_dropped(dog: Watchdog, connection: Client) -> None:
    connection.send(wire.encode("wake", at=1.0))
    connection.send(wire.encode("expired", serial=1))
    assert dog.dropped == 2
    assert connection.hello() is not None  # the connection still works
    assert os.getpid() in dog.owners


@pytest.mark.parametrize(
    "data",
    [
        b"garbage",
        b"\x00\xff" * 50,
        b'{"op": "wake"}',
        b'["nonsense", {}]',
        b'["wake", {"at": "soon"}]',
        b'["wake", {"at": true}]',
        b'["expired", {"serial": "1"}]',
        b'["hello", {"pid": 1, "table": "x", "dump": ""}]',
        b"[" * 100_000,  # nested too deep for the parser
    ],
    ids=lambda data: repr(data[:24]),
)
def test_bad_messages_are_dropped_and_counted(dog: Watchdog, client: Client, data: bytes) -> None:
    client.send(data)
    assert dog.dropped == 1
    answer = client.ask("sync")
    assert answer is not None
    assert (answer[0], answer[1]["records"]) == ("synced", 0)


def test_a_process_outside_the_session_is_refused() -> None:
    """Refused, and told why: its hello (unread by the watchdog) does not turn the
    answer into a reset connection, so the process can say why it enforces in-process."""
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        root = proctree.ProcessId.of(stranger.pid)
        assert root is not None
        with serving(root, grace=GRACE) as dog, RawClient(dog.address) as raw:
            raw.send(wire.encode("hello", pid=os.getpid(), table="/nowhere", dump=""))
            dog.run_once(max_wait=0)
            assert dog.dropped == 1
            assert dog.connections.peers == {}
            raw.sock.settimeout(3.0)
            op, fields = wire.decode(raw.sock.recv(wire.MAX_MESSAGE))
            assert (op, fields["error"]) == ("refused", "not a process of this session")
            assert raw.closed_by_peer()
    finally:
        stranger.kill()
        stranger.wait()


# -- the ladder's first step: the interrupt ------------------------------------------
def test_a_scope_is_interrupted_at_its_deadline_and_not_before(
    step: Stepper, client: Client, interrupts: list[float]
) -> None:
    deadline = client.open_scope(0.1, serial=5)
    step.elapse(0.1 - 1e-6)
    assert interrupts == []
    step.elapse(1e-6)
    assert interrupts == [deadline]
    assert 5 in step.dog.owners[os.getpid()].expiries


def _divide_by_zero() -> None:
    print(1 / 0)


def test_a_failing_part_of_the_watchdog_is_set_aside_and_enforcement_goes_on(
    step: Stepper,
    client: Client,
    interrupts: list[float],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    """A defect in one callback of the watchdog's loop (a reader or a timer that raises)
    costs only that callback: it is said on stderr and in the report, a failed reader is
    no longer watched (it is ready again at once), and a scope that expires afterwards
    is still interrupted."""
    dog = step.dog
    broken, other_end = socket.socketpair()

    def fail_reading(sock: socket.socket) -> None:
        raise RecursionError("a defect")

    dog.loop.add_reader(broken, fail_reading)
    dog.loop.call_at(step.clock(), _divide_by_zero)
    try:
        other_end.send(b"x")
        step.turn()
        assert len(dog.internal_errors) == 2, dog.internal_errors
        step.turn()  # still readable, but no longer watched: no second failure
        assert len(dog.internal_errors) == 2
        deadline = client.open_scope(0.1)
        step.elapse(0.1)
        assert interrupts == [deadline]
    finally:
        broken.close()
        other_end.close()
    err = capsys.readouterr().err
    assert "failed in the watchdog and was set aside" in err
    assert "RecursionError: a defect" in err and "ZeroDivisionError" in err
    dog.report_path = str(tmp_path / "report.json")
    dog.write_report()
    report = json.loads((tmp_path / "report.json").read_text(encoding="utf-8"))
    # (The stepped watchdog has none of a session's facts: only the new key is checked.)
    session_schema = report_schema()["$defs"]["session"]["properties"]
    jsonschema.validate(report["session"]["internal_errors"], session_schema["internal_errors"])
    assert [e.split(": ")[-1] for e in report["session"]["internal_errors"]] == [
        "RecursionError('a defect')",
        "ZeroDivisionError('division by zero')",
    ]


def test_the_loop_without_an_error_handler_lets_errors_through() -> None:
    loop = Loop(ManualClock())
    loop.call_at(0.0, _divide_by_zero)
    with pytest.raises(ZeroDivisionError):
        loop.run_due()


def _open_fds() -> dict[int, str]:
    """This process's descriptors and what they are (the one listing them left out)."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):
            found[int(name)] = os.readlink(f"/proc/self/fd/{name}")
    return found


def test_an_owner_without_a_signal_is_interrupted_on_its_channel_with_its_grace(
    step: Stepper, connection: Client
) -> None:
    """Its hello carries the channel; the watchdog keeps that descriptor only, writes a
    byte on it at the deadline (no signal), and waits the grace before ending it."""
    dog = step.dog
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    extra_read, extra_write = os.pipe()
    before = _open_fds()
    hello = wire.encode("hello", pid=os.getpid(), table=connection.path, dump="")
    wire.send_with_fds(connection.sock, hello, [theirs.fileno(), extra_read])
    step.turn()
    connection.receive()
    assert connection.answers[-1][0] == "welcome"
    # Kept: the table's file and the channel; the pipe's end was closed.
    kept = sorted(target for fd, target in _open_fds().items() if fd not in before)
    assert kept[0] == os.path.realpath(connection.path) and kept[1].startswith("socket:"), kept
    assert len(kept) == 2, kept
    theirs.close()
    os.close(extra_read)
    os.close(extra_write)
    mine.setblocking(False)
    try:
        deadline = connection.open_scope(0.1, serial=7)
        step.elapse(0.1)
        assert mine.recv(16) == b"\0"  # the interrupt
        owner = dog.owners[os.getpid()]
        assert owner.interruptible()
        (expiry,) = owner.expiries.values()
        assert expiry.deadline == deadline
        step.elapse(GRACE / 2)  # within the grace: nothing else happens
        assert dog.records == [] and owner.expiries
        # The exception reaches its thread before the interrupter reports it: the scope
        # may close first. Its report is waited for.
        connection.leave_scope()
        step.elapse(0.5)
        assert dog.records == [] and owner.expiries
        connection.send(wire.encode("expired", serial=7, scope="scope-7", stack="the stack"))
        step.elapse(0.02)
        (record,) = dog.records
        assert (record.action, record.stack) == ("interrupted", "the stack")
        assert owner.expiries == {}
        # A scope that an enclosing one's exception unwound gets no report of its own:
        # let go after a second, with no record.
        connection.open_scope(0.1, serial=8)
        step.elapse(0.1)
        assert mine.recv(16) == b"\0"
        connection.leave_scope()
        step.elapse(0.9)
        assert owner.expiries
        step.elapse(1.0)  # (the children's stacks may have taken part of the second)
        assert owner.expiries == {} and len(dog.records) == 1
    finally:
        mine.close()


def test_descriptors_sent_with_other_messages_are_closed(step: Stepper, client: Client) -> None:
    read_end, write_end = os.pipe()
    before = _open_fds()
    wire.send_with_fds(client.sock, wire.encode("wake", at=1e9), [read_end])
    step.turn()
    assert _open_fds() == before  # the watchdog's copy is gone again
    os.close(read_end)
    os.close(write_end)


def test_the_owners_report_of_an_interrupt_is_its_record(
    step: Stepper, client: Client, interrupts: list[float]
) -> None:
    dog = step.dog
    client.open_scope(0.1, serial=5)
    step.elapse(0.15)
    assert len(interrupts) == 1
    # The owner raised ScopeExpired: it says so, then leaves the scope.
    client.send(wire.encode("expired", serial=5, scope="scope-5", stack="the stack"))
    client.leave_scope()
    step.elapse(0.01)  # the ladder's next look finds the scope closed
    (record,) = dog.records
    assert (record.scope, record.action, record.stack) == ("scope-5", "interrupted", "the stack")
    assert record.pid == os.getpid()
    assert record.budget == pytest.approx(0.1)
    assert record.elapsed == pytest.approx(0.15)  # when the owner said it raised
    assert records.read_records(dog.records_path) == [record]
    assert dog.owners[os.getpid()].expiries == {}
    assert len(interrupts) == 1


def _a_defect(*args: object) -> list[int]:
    raise RecursionError("a defect")


@pytest.mark.parametrize("failing", ["children", "peers"])
def test_a_failing_step_of_an_escalation_leaves_the_scope_enforced(
    step: Stepper,
    client: Client,
    interrupts: list[float],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    failing: str,
) -> None:
    """A defect in a step that only adds to the record (asking the processes below the
    owner for their stacks, before the interrupt, or its other ranks, after it) is said
    on stderr and in the report, and the escalation goes on without that step: the
    owner is interrupted once, and its report is the record. The escalation ended
    there, and the scope was never interrupted nor its owner ended."""
    dog = step.dog
    if failing == "children":
        monkeypatch.setattr(dog.ladder.dumper, "ask_descendants", _a_defect)
    else:
        monkeypatch.setattr(dog.ladder, "peers_of", _a_defect)
    client.open_scope(0.1, serial=5)
    step.elapse(0.15)
    assert len(interrupts) == 1
    client.send(wire.encode("expired", serial=5, scope="scope-5", stack="the stack"))
    client.leave_scope()
    step.elapse(0.01)
    (record,) = dog.records
    assert (record.scope, record.action, record.stack) == ("scope-5", "interrupted", "the stack")
    assert len(interrupts) == 1
    (error,) = dog.internal_errors
    assert "escalation of scope 'scope-5'" in error and "a defect" in error
    assert "RecursionError: a defect" in capsys.readouterr().err


def test_after_a_failed_step_the_report_of_an_owner_interrupted_on_its_channel_is_awaited(
    step: Stepper, connection: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An owner without a signal is interrupted on its channel and reports once its
    scope has unwound; a step that fails after the interrupt (its ranks' stacks) leaves
    that report awaited, and it is the record. It was let go as a scope unwound by an
    enclosing one, and the record was lost."""
    dog = step.dog
    monkeypatch.setattr(dog.ladder, "peers_of", _a_defect)
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    hello = wire.encode("hello", pid=os.getpid(), table=connection.path, dump="")
    wire.send_with_fds(connection.sock, hello, [theirs.fileno()])
    theirs.close()
    step.turn()
    try:
        connection.open_scope(0.1, serial=7)
        step.elapse(0.1)
        assert mine.recv(16) == b"\0"  # the interrupt
        connection.leave_scope()
        step.elapse(0.5)
        assert dog.records == []
        connection.send(wire.encode("expired", serial=7, scope="scope-7", stack="the stack"))
        step.elapse(0.02)
        (record,) = dog.records
        assert (record.action, record.stack) == ("interrupted", "the stack")
        assert len(dog.internal_errors) == 1
    finally:
        mine.close()


def test_a_scope_closed_in_time_costs_nothing(
    step: Stepper, client: Client, interrupts: list[float]
) -> None:
    client.open_scope(0.1)
    client.leave_scope()
    step.elapse(GRACE * 2)
    assert interrupts == []
    assert step.dog.records == []


def test_no_interrupt_while_a_debugger_holds_the_owner(
    step: Stepper, client: Client, interrupts: list[float]
) -> None:
    client.table.floats[tbl.H_SUSPENDED] = step.clock()
    client.open_scope(0.05)
    step.elapse(0.3)
    assert interrupts == []
    client.table.floats[tbl.H_SUSPENDED] = 0.0  # resumed: the owner says so
    client.send(wire.encode("wake", at=step.clock()))
    step.turn()
    assert len(interrupts) == 1


def test_a_disconnect_after_an_interrupt_ends_the_escalation(
    step: Stepper, client: Client, interrupts: list[float]
) -> None:
    dog = step.dog
    client.open_scope(0.05)
    step.elapse(0.05)
    assert len(interrupts) == 1
    client.leave_scope()
    client.sock.close()
    step.turn()
    assert dog.connections.peers == {}
    step.elapse(0.01)  # the ladder's next look
    assert dog.owners[os.getpid()].expiries == {}
    assert dog.records == []  # unwound without a word from the owner: nothing to record
    assert len(interrupts) == 1


def test_a_closed_scopes_escalation_does_not_hold_back_its_threads_next_deadline(
    step: Stepper, client: Client, interrupts: list[float]
) -> None:
    """The thread unwound the scope the watchdog interrupted, and its ladder has not
    looked since (it may still be collecting children's stacks): the thread's next
    scope that expires is interrupted at its own deadline."""
    client.open_scope(0.1, serial=5)
    step.elapse(0.1)
    assert len(interrupts) == 1
    client.leave_scope()
    deadline = client.open_scope(0.0, serial=6)  # due at once, before the ladder's look
    assert interrupts == [deadline, deadline]


def test_a_deadline_held_back_by_an_enclosing_escalation_is_acted_on_once_it_ends(
    step: Stepper, client: Client, interrupts: list[float]
) -> None:
    """A scope inside one that is escalating is not interrupted on its own; once the
    enclosing scope has closed, it is, within the ladder's look interval."""
    client.open_scope(0.1, serial=5, slot=0)
    client.open_scope(0.2, serial=6, slot=1, depth=1)
    step.elapse(0.1)
    assert len(interrupts) == 1
    step.elapse(0.1)  # the inner deadline: its thread is busy with the outer one
    assert len(interrupts) == 1
    client.leave_scope(slot=0)  # a detached enclosing scope released, say
    step.elapse(0.01)
    step.elapse(0.01)
    assert len(interrupts) == 2


@pytest.mark.parametrize("at", [b"NaN", b"Infinity", b"-Infinity"])
def test_a_non_finite_wake_is_dropped_and_enforcement_goes_on(
    step: Stepper, client: Client, interrupts: list[float], at: bytes
) -> None:
    client.send(b'["wake", {"at": ' + at + b"}]")
    assert step.dog.dropped == 1
    deadline = client.open_scope(0.1)
    step.elapse(0.1)
    assert interrupts == [deadline]


def test_a_far_deadline_neither_crashes_the_loop_nor_hides_a_near_one(
    step: Stepper, client: Client, interrupts: list[float]
) -> None:
    client.open_scope(1e7)
    step.elapse(0.1)  # past the second look after the scan
    # One turn as the real loop (Watchdog.serve) runs it, without a cap on the wait:
    # a message is ready, so a working loop returns at once.
    client.sock.send(wire.encode("sync"))
    step.dog.run_once()
    assert client.receive() == 2  # welcome, synced
    assert client.answers[-1][0] == "synced"
    assert interrupts == []
    deadline = client.open_scope(0.1, serial=2, slot=1)
    step.elapse(0.1)
    assert interrupts == [deadline]


# -- the control pipe from the pytest process ------------------------------------------
@contextlib.contextmanager
def controlled() -> Iterator[tuple[Watchdog, int]]:
    """A watchdog whose control stream (the pytest process's pipe) this test writes."""
    read_end, write_end = os.pipe()
    with (
        os.fdopen(read_end, "rb", buffering=0) as control,
        serving(control=control, session={"pid": 1}) as dog,
    ):
        try:
            yield dog, write_end
        finally:
            with contextlib.suppress(OSError):
                os.close(write_end)


def test_stop_ends_the_session_with_the_facts_it_carries() -> None:
    with controlled() as (dog, pipe):
        os.write(pipe, b"not json\n")
        os.write(pipe, b'{"op": "hello"}\n')  # JSON, but no command of the pipe's
        os.write(pipe, b'{"op": "stop", "session": {"exitstatus": 0}}\n')
        dog.run_once(max_wait=0)
        assert dog.stopping
        assert dog.dropped == 2
        assert dog.session["exitstatus"] == 0
        os.close(pipe)  # the plugin closes its end after "stop"
        dog.run_once(max_wait=0)
        assert not dog.root_died


def test_the_death_of_pytest_is_noticed() -> None:
    with controlled() as (dog, pipe):
        os.close(pipe)  # what the kernel does when the pytest process dies
        dog.run_once(max_wait=0)
        assert dog.root_died
        assert dog.stopping


# -- the whole ladder against a real client process ----------------------------------
STUCK_CHILD = """
import subprocess, sys
import pytest_elastic_timer as et
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(grandchild.pid, flush=True)

def crunch():
    with et.expires(0.2, scope="crunch", grace=0.3):
        sum(range(10**11))  # a C loop that holds the GIL

crunch()
"""


def test_a_c_loop_owner_is_dumped_and_its_tree_terminated() -> None:
    with serving(grace=GRACE, kill_after=1.0) as dog:
        env = {**os.environ, ENV_ADDRESS: dog.address}
        env.pop(ENV_DUMP_SIGNAL, None)  # the outer session's stack dumps go elsewhere
        proc = subprocess.Popen(
            [sys.executable, "-c", STUCK_CHILD], env=env, stdout=subprocess.PIPE, text=True
        )
        try:
            assert proc.stdout is not None
            grandchild = int(proc.stdout.readline())
            assert pump(dog, lambda: bool(dog.records), 20.0), "no record"
            (record,) = dog.records
            assert record.scope == "crunch"
            assert record.action in ("terminated", "killed")
            assert record.pid == proc.pid
            assert record.budget == pytest.approx(0.2)
            assert 0.2 <= record.elapsed < 0.2 + 0.3 + 3
            assert "in crunch" in record.stack  # faulthandler's dump while the GIL was held
            assert grandchild in [c["pid"] for c in record.children]
            assert {grandchild, proc.pid} <= {p["pid"] for p in record.killed}
            assert proc.wait(5) in (-signal.SIGTERM, -signal.SIGKILL)
            assert not psutil.pid_exists(grandchild) or (
                psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE
            )
        finally:
            proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


def test_an_owner_gone_by_itself_before_its_termination_is_not_said_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The owner, stuck in a C loop, was dumped at the end of its grace and then ended
    by someone else (its parent, as torch's spawn ends a rank whose sibling died) before
    the watchdog sent anything: the record is ``interrupted`` with nothing in
    ``killed``. It said ``terminated`` (``killed`` for a torch request asking SIGKILL),
    though the watchdog had ended nothing."""
    with serving(grace=GRACE, kill_after=1.0) as dog:
        env = {**os.environ, ENV_ADDRESS: dog.address}
        env.pop(ENV_DUMP_SIGNAL, None)  # the outer session's stack dumps go elsewhere
        proc = subprocess.Popen(
            [sys.executable, "-c", STUCK_CHILD], env=env, stdout=subprocess.PIPE, text=True
        )
        dumped = dog.ladder.dumper.owner

        def dumped_then_gone(owner: object) -> Iterator[float]:
            stack = yield from dumped(owner)  # type: ignore[arg-type]
            proc.kill()  # ended by its parent, as the watchdog was about to
            while psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE:
                time.sleep(0.01)
            return stack

        monkeypatch.setattr(dog.ladder.dumper, "owner", dumped_then_gone)
        grandchild = 0
        try:
            assert proc.stdout is not None
            grandchild = int(proc.stdout.readline())
            assert pump(dog, lambda: bool(dog.records), 20.0), "no record"
            (record,) = dog.records
            assert (record.scope, record.action, record.killed) == ("crunch", "interrupted", [])
            assert "in crunch" in record.stack  # the dump taken before it was gone
        finally:
            proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
            if grandchild:  # left by its parent: ours to end
                with contextlib.suppress(ProcessLookupError):
                    os.kill(grandchild, signal.SIGKILL)
                assert wait_gone(grandchild, 5.0)


# -- the watchdog process imports nothing of pytest ------------------------------------
CLIENT = """
import pytest_elastic_timer as et
try:
    with et.expires(0.1, scope="brief"):
        while True:
            pass
except et.ScopeExpired:
    pass
assert et.barrier("alone", 1, 5) == 0
"""
# What -X importtime names: every module the interpreter imported, with its full name.
IMPORTED = re.compile(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)$", re.MULTILINE)


def _modules_of_a_watchdog_serving(client: str) -> set[str]:
    """Every module a real watchdog process imported (``-X importtime``), started as
    the launcher starts it, while it served ``client`` (a program) and ended its
    session."""
    directory = tempfile.mkdtemp(prefix="pet-unit-")
    watchdog = subprocess.Popen(
        [
            *(sys.executable, "-X", "importtime", "-m", "pytest_elastic_timer.watchdog"),
            *("--dir", directory, "--root-pid", str(os.getpid()), "--grace", "5"),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert watchdog.stdout is not None and watchdog.stdin is not None
        ready, pid, address = watchdog.stdout.readline().split()
        assert (ready, int(pid)) == ("ready", watchdog.pid)
        env = {**os.environ, ENV_ADDRESS: address}
        env.pop(ENV_DUMP_SIGNAL, None)
        subprocess.run([sys.executable, "-c", client], env=env, check=True, timeout=60)
        _, log = watchdog.communicate('{"op": "stop", "session": {}}\n', timeout=30)
    finally:
        if watchdog.poll() is None:
            watchdog.kill()
            watchdog.communicate()
        shutil.rmtree(directory, ignore_errors=True)
    assert watchdog.returncode == 0, log
    imported = set(IMPORTED.findall(log))
    assert {"pytest_elastic_timer.watchdog.server", "psutil"} <= imported  # the log works
    return imported


def test_the_watchdog_process_imports_nothing_of_pytest() -> None:
    """A watchdog that serves a client whose scope expires and which passes a barrier
    did not import one module of pytest (or of pluggy, which only pytest loads) at any
    moment."""
    imported = _modules_of_a_watchdog_serving(CLIENT)
    assert "pytest_elastic_timer.sync.server" in imported
    assert "pytest_elastic_timer.core.collectives" in imported  # read for the record
    pytest_modules = {
        name
        for name in imported
        if name.split(".")[0] in ("pytest", "_pytest", "pluggy", "py")
        or name.startswith("pytest_elastic_timer.plugin")
    }
    assert pytest_modules == set()


QUIET_CLIENT = """
import pytest_elastic_timer as et
with et.expires(30, scope="in time"):
    pass
"""


def test_a_watchdog_loads_the_primitives_and_the_rings_only_when_used() -> None:
    # They would cost its start-up, which pytest's output waits for.
    imported = _modules_of_a_watchdog_serving(QUIET_CLIENT)
    assert "pytest_elastic_timer.sync.server" not in imported
    assert "pytest_elastic_timer.core.collectives" not in imported


# The watchdog's entry as far as its relay, its modules then loading for a minute.
RELAY_THEN_SLOW_LOADING = """
import os, time
from pytest_elastic_timer.watchdog.control import StdinRelay
relay = StdinRelay()
os.write(1, b"relaying\\n")
time.sleep(60)
"""
# The watchdog's entry as far as its relay, then its loop: what the relay passes on.
RELAY_THEN_READ = """
import os, sys
from pytest_elastic_timer.watchdog.control import StdinRelay
relay = StdinRelay()
data = b""
while chunk := os.read(relay.fileno(), 4096):
    data += chunk
sys.stderr.write(data.decode())
"""
STOP_NOT_WAITED = b'{"op": "stop", "session": {"exitstatus": 0}, "waited": false}\n'
STOP_WAITED = b'{"op": "stop", "session": {"exitstatus": 0}, "waited": true}\n'


def test_a_stop_not_waited_for_lets_go_of_the_output_while_the_modules_still_load() -> None:
    """A short session stops before its watchdog has loaded its modules; a shell reading
    pytest's output through a pipe that the watchdog shares must not wait for them."""
    child = subprocess.Popen(
        [sys.executable, "-c", RELAY_THEN_SLOW_LOADING],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert child.stdin is not None and child.stdout is not None and child.stderr is not None
        assert child.stdout.readline() == b"relaying\n"
        child.stdin.write(STOP_NOT_WAITED)
        child.stdin.flush()
        # End-of-file on both, the process still loading (asleep).
        assert select.select([child.stderr], [], [], 30)[0], "the output was not let go"
        assert child.stderr.read() == b""
        assert child.stdout.read() == b""
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()
        for stream in (child.stdin, child.stdout, child.stderr):
            if stream is not None:
                stream.close()


@contextlib.contextmanager
def deferred_watchdog(defer: float, *extra: str) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """A watchdog process started as the launcher starts one for a session that does
    not wait for it (``--defer``), the session's root a sleeping process of ours; the
    watchdog, and the root's pid. Both are ended and reaped at the end."""
    root = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    directory = tempfile.mkdtemp(prefix="pet-unit-")
    watchdog = subprocess.Popen(
        [
            *(sys.executable, "-m", "pytest_elastic_timer.watchdog", "--dir", directory),
            *("--root-pid", str(root.pid), "--defer", repr(defer), *extra),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        yield watchdog, root.pid
    finally:
        for process in (watchdog, root):
            if process.poll() is None:
                process.kill()
            process.wait()
        for stream in (watchdog.stdin, watchdog.stdout):
            if stream is not None:
                stream.close()
        assert not os.path.exists(directory)
        shutil.rmtree(directory, ignore_errors=True)


def test_a_deferred_watchdog_stopped_early_loads_nothing_until_pytest_has_exited() -> None:
    """A short session's stop comes before the deferral is over: the watchdog loads its
    modules only once the root has exited, then finishes the session as usual."""
    with deferred_watchdog(30) as (watchdog, root_pid):
        assert watchdog.stdin is not None
        time.sleep(0.2)
        assert not loaded_psutil(watchdog.pid)
        watchdog.stdin.write(STOP_NOT_WAITED)
        watchdog.stdin.close()
        time.sleep(0.5)  # the stop heard, the root still running
        assert watchdog.poll() is None and not loaded_psutil(watchdog.pid)
        os.kill(root_pid, signal.SIGKILL)
        assert watchdog.wait(timeout=30) == 0


def test_a_deferred_watchdog_loads_once_the_session_has_run_that_long() -> None:
    with deferred_watchdog(0.3) as (watchdog, _):
        assert watchdog.stdin is not None and watchdog.stdout is not None
        started = time.monotonic()
        assert watchdog.stdout.readline().startswith(b"ready ")  # said once it is up
        assert time.monotonic() - started >= 0.3
        assert loaded_psutil(watchdog.pid)
        watchdog.stdin.write(STOP_NOT_WAITED)
        watchdog.stdin.close()
        assert watchdog.wait(timeout=30) == 0


HURRY = b'{"op": "hurry"}\n'


def test_a_hurried_watchdog_loads_at_once_and_still_hears_the_stop(tmp_path: Path) -> None:
    """pytest says hurry (a deadline of its own would come before the deferral ends):
    the watchdog loads at once, counts the word as no bad message, and the stop after
    it still lets go of the output."""
    report = tmp_path / "report.json"
    with deferred_watchdog(60, "--report", str(report)) as (watchdog, _):
        assert watchdog.stdin is not None and watchdog.stdout is not None
        watchdog.stdin.write(HURRY)
        watchdog.stdin.flush()
        assert watchdog.stdout.readline().startswith(b"ready ")  # long before 60 s
        watchdog.stdin.write(STOP_NOT_WAITED)
        watchdog.stdin.close()
        assert watchdog.stdout.read() == b""  # let go of
        assert watchdog.wait(timeout=30) == 0
    assert json.loads(report.read_text())["session"]["dropped_messages"] == 0


def test_pytests_death_ends_a_watchdogs_deferral_at_once(tmp_path: Path) -> None:
    """End-of-file on the control pipe without a stop: pytest died, and the watchdog
    loads at once to end the session, with its report, however long its deferral."""
    report = tmp_path / "report.json"
    with deferred_watchdog(60, "--report", str(report)) as (watchdog, root_pid):
        assert watchdog.stdin is not None
        time.sleep(0.2)
        os.kill(root_pid, signal.SIGKILL)
        watchdog.stdin.close()
        assert watchdog.wait(timeout=30) == 0
    assert json.loads(report.read_text())["session"]["root_died"] is True


def test_sigterm_while_a_watchdog_defers_ends_the_session_with_its_report(tmp_path: Path) -> None:
    """SIGTERM before the watchdog's handlers are in place waits for them: the session
    then ends as one terminated later does, with its report, not the process at once."""
    report = tmp_path / "report.json"
    with deferred_watchdog(1.0, "--report", str(report)) as (watchdog, _):
        time.sleep(0.2)
        watchdog.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert watchdog.poll() is None  # held, not its default action
        assert watchdog.wait(timeout=30) == 0
    assert json.loads(report.read_text())["session"]["root_died"] is True


@pytest.mark.parametrize(
    "command",
    [STOP_WAITED + b"x" * 200_000, b"not a command\n" + STOP_NOT_WAITED],
    ids=["waited", "not-a-command-first"],
)
def test_the_relay_passes_the_control_pipe_on_and_keeps_the_output(command: bytes) -> None:
    """Every byte pytest writes reaches the loop, end-of-file included (more than a
    pipe holds, too); a stop that pytest waits for (a report to read back) leaves the
    output where it is, and so does a first line that is no stop."""
    done = subprocess.run(
        [sys.executable, "-c", RELAY_THEN_READ], input=command, capture_output=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-500:]
    assert done.stderr == command


# The relay of a watchdog started with its standard descriptors closed: its own pipe
# must not take their numbers.
RELAY_WITHOUT_STDIO = """
import os, sys
from pytest_elastic_timer.watchdog.control import StdinRelay
control = int(sys.argv[1])
err = os.dup(2)
for fd in (0, 1, 2):
    os.close(fd)
relay = StdinRelay(control)
data = b""
while chunk := os.read(relay.fileno(), 4096):
    data += chunk
os.write(err, data)
"""


def test_the_relay_keeps_clear_of_closed_standard_descriptors() -> None:
    read_end, write_end = os.pipe()
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", RELAY_WITHOUT_STDIO, str(read_end)],
            pass_fds=(read_end,),
            stderr=subprocess.PIPE,
        )
    finally:
        os.close(read_end)
    with os.fdopen(write_end, "wb") as control:
        control.write(STOP_NOT_WAITED)
    assert child.stderr is not None
    try:
        assert child.stderr.read() == STOP_NOT_WAITED
        assert child.wait(60) == 0
    finally:
        child.kill()
        child.wait()
        child.stderr.close()


# -- process identity --------------------------------------------------------------
HANDLES_SIGUSR2 = """
import signal, time
signal.signal(signal.SIGUSR2, lambda signum, frame: None)
print("ready", flush=True)
time.sleep(60)
"""


def test_a_dump_read_for_a_record_is_the_one_asked_for(tmp_path: Path) -> None:
    """The stacks of a rank are read for the record after the grace, when a later
    expiry may have asked the same rank for another dump: the record has the dump of
    its own expiry alone. It had both."""
    path = tmp_path / "dump-1"
    path.write_text("earlier test's dump\n", encoding="utf-8")
    offset = path.stat().st_size
    dumper = dumps.Dumper(str(tmp_path), 0, time.monotonic)
    asked = dumps.AskedDumps(give_up=time.monotonic() + 5.0)
    # (This process, with a signal it neither blocks nor has pending: written out.)
    dump = dumps.ChildDump({"pid": 1}, str(path), offset, os.getpid(), signal.SIGUSR2)
    asked.dumps.append(dataclasses.replace(dump, peer=True))
    first = 'Current thread 0x1 (most recent call first):\n  File "a.py", line 1 in f\n'
    second = 'Current thread 0x1 (most recent call first):\n  File "b.py", line 2 in g\n'
    with path.open("a", encoding="utf-8") as f:
        f.write(first)
    for _ in dumper.finished(asked):  # the ladder's wait until the dumps stop growing
        pass
    with path.open("a", encoding="utf-8") as f:
        f.write(second)
    assert [p["stack"] for p in asked.peers()] == [first]


def test_a_zombie_is_not_asked_for_its_stacks() -> None:
    """A child that exited and waits to be reaped still shows the handlers it had, but
    runs none: it is not asked for a dump (which the ladder would wait for)."""
    child = subprocess.Popen([sys.executable, "-c", HANDLES_SIGUSR2], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        assert startup.catches(child.pid, signal.SIGUSR2)
        child.kill()
        assert wait_gone(child.pid, 10.0)  # a zombie: nobody reaped it yet
        assert psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE
        assert not startup.catches(child.pid, signal.SIGUSR2)
    finally:
        child.kill()
        child.wait()
        assert child.stdout is not None
        child.stdout.close()


def test_process_identity_survives_pid_reuse() -> None:
    me = proctree.ProcessId.of(os.getpid())
    assert me is not None
    assert me.alive()
    assert not proctree.ProcessId(me.pid, me.started + 1).alive()
    assert proctree.is_descendant(os.getpid(), me)
    assert not proctree.is_descendant(os.getpid(), proctree.ProcessId(me.pid, me.started + 1))
    assert not proctree.is_descendant(1, me) or os.getpid() == 1


def test_tree_of_lists_children_first_and_spares() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        tree = proctree.tree_of(psutil.Process(), set())
        pids = [p.pid for p in tree]
        assert pids.index(child.pid) < pids.index(os.getpid()) == len(pids) - 1
        spared = proctree.tree_of(psutil.Process(), {os.getpid()})
        assert os.getpid() not in [p.pid for p in spared]
        proctree.send([psutil.Process(child.pid)], signal.SIGTERM)
        assert proctree.wait_gone([psutil.Process(child.pid)], 5.0) == []
    finally:
        child.kill()
        child.wait()


# -- socket activation: clients connect before the watchdog runs ------------------------
EARLY_CLIENT = """
import sys, time
import pytest_elastic_timer as et
try:
    with et.expires(0.3, scope="early"):
        time.sleep(30)
except et.ScopeExpired:
    sys.exit(0)
sys.exit(1)
"""


def test_a_client_that_connects_before_the_watchdog_runs_gets_its_scopes_enforced(
    tmp_path: Path,
) -> None:
    """The socket listens before the watchdog process exists (the plugin binds it and
    hands it over, as socket activation does): a process connects, says hello and
    enters a scope while nobody accepts; the watchdog started afterwards on that socket
    accepts it from the backlog and enforces its deadline."""
    directory = tempfile.mkdtemp(prefix="pet-unit-")
    address = os.path.join(directory, "watchdog.sock")
    report = tmp_path / "report.json"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(address)
    listener.listen(8)
    env = {**os.environ, ENV_ADDRESS: address}
    env.pop(ENV_DUMP_SIGNAL, None)
    client = subprocess.Popen([sys.executable, "-c", EARLY_CLIENT], env=env)
    watchdog = None
    try:
        # The client's connection waits in the backlog: nobody has accepted it.
        assert select.select([listener], [], [], 60)[0], "the client never connected"
        watchdog = subprocess.Popen(
            [
                *(sys.executable, "-m", "pytest_elastic_timer.watchdog", "--dir", directory),
                *("--root-pid", str(os.getpid()), "--report", str(report)),
                *("--listen-fd", str(listener.fileno())),
            ],
            pass_fds=(listener.fileno(),),
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
        )
        listener.close()
        assert client.wait(60) == 0, "the scope did not expire"
        watchdog.communicate('{"op": "stop", "session": {}}\n', timeout=30)
        assert watchdog.returncode == 0
        expired = json.loads(report.read_text())["expired"]
        assert [(r["scope"], r["pid"]) for r in expired] == [("early", client.pid)]
    finally:
        listener.close()
        for proc in (client, watchdog):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        shutil.rmtree(directory, ignore_errors=True)
