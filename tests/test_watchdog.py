"""The watchdog's event loop driven step by step in this process, with real sockets,
real tables and real signals; and a real client process whose scope it escalates.

The watchdog here serves a private directory (not the session's) and this test process
is its root. Every scope a test opens in its own table is closed long before the
(generous) grace period, and the loop only runs while the test pumps it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator

import psutil
import pytest
from helpers import ENV_DUMP_SIGNAL

from pytest_elastic_timer.core import records, wire
from pytest_elastic_timer.core import table as tbl
from pytest_elastic_timer.scope.client import ENV_ADDRESS
from pytest_elastic_timer.watchdog import proctree
from pytest_elastic_timer.watchdog import server as wd


@pytest.fixture
def dog() -> Iterator[wd.Watchdog]:
    # A short path: AF_UNIX addresses are limited to 108 bytes.
    directory = tempfile.mkdtemp(prefix="pet-unit-")
    root = proctree.ProcessId.of(os.getpid())
    assert root is not None
    watchdog = wd.Watchdog(directory, root=root, grace=30.0, kill_after=1.0, scale=1.0)
    yield watchdog
    for conn in list(watchdog.by_conn):
        conn.close()
    for owner in watchdog.owners.values():
        owner.table.close()
    watchdog.listener.close()
    watchdog.sel.close()
    shutil.rmtree(directory, ignore_errors=True)


def pump(dog: wd.Watchdog, until: Callable[[], bool], timeout: float = 3.0) -> bool:
    """Run the watchdog's loop until ``until()`` holds (True) or ``timeout`` passes."""
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        if until():
            return True
        dog.run_once(max_wait=0.01)
    return until()


class Client:
    """A hand-made client of ``dog``: a socket, a table, and the raw messages."""

    def __init__(self, dog: wd.Watchdog) -> None:
        self.dog = dog
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.connect(dog.address)
        self.sock.settimeout(0)
        self.path = os.path.join(dog.directory, f"table-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.table = tbl.ScopeTable.create(self.path)
        self.answers: list[tuple[str, dict[str, object]]] = []
        pump(dog, lambda: bool(dog.by_conn), 2.0)

    def send(self, data: bytes) -> None:
        self.sock.send(data)

    def ask(self, op: str, **fields: object) -> tuple[str, dict[str, object]] | None:
        before = len(self.answers)
        self.send(wire.encode(op, **fields))
        pump(self.dog, lambda: self.receive() > before, 2.0)
        return self.answers[before] if len(self.answers) > before else None

    def receive(self) -> int:
        try:
            self.answers.append(wire.decode(self.sock.recv(wire.MAX_MESSAGE)))
        except (BlockingIOError, InterruptedError):
            pass
        return len(self.answers)

    def hello(self) -> tuple[str, dict[str, object]] | None:
        return self.ask("hello", pid=os.getpid(), table=self.path, dump="")

    def open_scope(self, after: float, *, serial: int = 1, slot: int = 0) -> float:
        now = time.monotonic()
        sid = self.table.add_string(f"scope-{serial}")
        self.table.write_slot(slot, serial, now + after, now, 1, sid, 0, 0, 0.0, 0, 0)
        self.table.words[tbl.H_HWM] = max(int(self.table.words[tbl.H_HWM]), slot + 1)
        self.send(wire.encode("wake", at=now + after))
        return now + after

    def close(self) -> None:
        for index in range(int(self.table.words[tbl.H_HWM])):
            self.table.clear_slot(index)
        self.sock.close()
        self.table.close()


@pytest.fixture
def connection(dog: wd.Watchdog) -> Iterator[Client]:
    """A client connected to ``dog`` that has not said hello yet."""
    made = Client(dog)
    yield made
    made.close()


@pytest.fixture
def client(connection: Client) -> Client:
    """A client the watchdog welcomed."""
    answer = connection.hello()
    assert answer is not None and answer[0] == "welcome"
    return connection


@pytest.fixture
def interrupts(client: Client) -> Iterator[list[float]]:
    """SIGUSR1 is this client's interrupt signal; the list records when it arrived."""
    arrived: list[float] = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: arrived.append(time.monotonic()))
    client.table.words[tbl.H_INTERRUPT_SIG] = signal.SIGUSR1
    yield arrived
    signal.signal(signal.SIGUSR1, previous)


# -- registration ------------------------------------------------------------------
def test_hello_is_welcomed(dog: wd.Watchdog, connection: Client) -> None:
    answer = connection.hello()
    assert answer is not None
    op, fields = answer
    assert (op, fields["pid"], fields["scale"], fields["grace"]) == (
        "welcome",
        os.getpid(),
        1.0,
        30.0,
    )
    assert os.getpid() in dog.owners
    assert dog.dropped == 0


def test_hello_with_another_pid_is_refused(dog: wd.Watchdog, connection: Client) -> None:
    answer = connection.ask("hello", pid=os.getpid() + 1, table=connection.path, dump="")
    assert answer is not None and answer[0] == "refused"
    assert dog.dropped == 1
    assert os.getpid() not in dog.owners


@pytest.mark.parametrize("where", ["outside", "other-pid", "traversal"])
def test_hello_with_a_table_outside_the_session_is_refused(
    dog: wd.Watchdog, connection: Client, where: str
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


def test_messages_before_hello_are_dropped(dog: wd.Watchdog, connection: Client) -> None:
    connection.send(wire.encode("wake", at=1.0))
    connection.send(wire.encode("expired", serial=1))
    assert pump(dog, lambda: dog.dropped == 2)
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
    ],
)
def test_bad_messages_are_dropped_and_counted(
    dog: wd.Watchdog, client: Client, data: bytes
) -> None:
    client.send(data)
    assert pump(dog, lambda: dog.dropped == 1)
    answer = client.ask("sync")
    assert answer is not None
    assert (answer[0], answer[1]["records"]) == ("synced", 0)


def test_a_process_outside_the_session_is_refused() -> None:
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        root = proctree.ProcessId.of(stranger.pid)
        assert root is not None
        directory = tempfile.mkdtemp(prefix="pet-unit-")
        dog = wd.Watchdog(directory, root=root, grace=30.0)
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.connect(dog.address)
            assert pump(dog, lambda: dog.dropped == 1)
            assert dog.by_conn == {}
            sock.settimeout(2)
            assert sock.recv(100) == b""  # closed by the watchdog
            sock.close()
        finally:
            dog.listener.close()
            dog.sel.close()
            shutil.rmtree(directory, ignore_errors=True)
    finally:
        stranger.kill()
        stranger.wait()


# -- the ladder, first step --------------------------------------------------------
def test_interrupt_at_the_deadline_and_record(
    dog: wd.Watchdog, client: Client, interrupts: list[float]
) -> None:
    deadline = client.open_scope(0.1, serial=5)
    assert pump(dog, lambda: bool(interrupts), 3.0), "no interrupt"
    assert interrupts[0] >= deadline
    owner = dog.owners[os.getpid()]
    assert 5 in owner.expiries
    # The owner raised ScopeExpired, says so and leaves the scope.
    client.send(wire.encode("expired", serial=5, scope="scope-5", stack="the stack"))
    client.table.clear_slot(0)
    assert pump(dog, lambda: bool(dog.records), 3.0)
    (record,) = dog.records
    assert (record.scope, record.action, record.stack) == ("scope-5", "interrupted", "the stack")
    assert record.pid == os.getpid()
    assert record.budget == pytest.approx(0.1)
    assert record.elapsed >= 0.1
    assert records.read_records(dog.records_path) == [record]
    assert len(interrupts) == 1


def test_no_interrupt_before_the_deadline(
    dog: wd.Watchdog, client: Client, interrupts: list[float]
) -> None:
    client.open_scope(0.4)
    assert not pump(dog, lambda: bool(interrupts), 0.2)
    assert pump(dog, lambda: bool(interrupts), 3.0)


def test_a_scope_closed_in_time_costs_nothing(
    dog: wd.Watchdog, client: Client, interrupts: list[float]
) -> None:
    client.open_scope(0.1)
    client.table.clear_slot(0)
    assert not pump(dog, lambda: bool(interrupts), 0.3)
    assert dog.records == []


def test_no_interrupt_while_suspended(
    dog: wd.Watchdog, client: Client, interrupts: list[float]
) -> None:
    client.table.floats[tbl.H_SUSPENDED] = time.monotonic()
    client.open_scope(0.05)
    assert not pump(dog, lambda: bool(interrupts), 0.3)
    client.table.floats[tbl.H_SUSPENDED] = 0.0
    client.send(wire.encode("wake", at=time.monotonic()))
    assert pump(dog, lambda: bool(interrupts), 3.0)


def test_disconnect_after_an_interrupt_ends_the_escalation(
    dog: wd.Watchdog, client: Client, interrupts: list[float]
) -> None:
    client.open_scope(0.05)
    assert pump(dog, lambda: bool(interrupts), 3.0)
    client.sock.close()
    client.table.clear_slot(0)
    assert pump(dog, lambda: not dog.by_conn, 2.0)
    assert pump(dog, lambda: not dog.owners[os.getpid()].expiries, 2.0)
    assert len(interrupts) == 1


@pytest.mark.parametrize("at", [b"NaN", b"Infinity", b"-Infinity"])
def test_nan_wake_does_not_stop_enforcement(
    dog: wd.Watchdog, client: Client, interrupts: list[float], at: bytes
) -> None:
    client.send(b'["wake", {"at": ' + at + b"}]")
    assert pump(dog, lambda: dog.dropped == 1, 1.0), "the non-finite wake was not refused"
    client.open_scope(0.1)
    assert pump(dog, lambda: bool(interrupts), 1.0), "the deadline was never enforced"


def test_far_deadline_does_not_crash_the_loop(
    dog: wd.Watchdog, client: Client, interrupts: list[float]
) -> None:
    client.open_scope(1e7)
    pump(dog, lambda: False, 0.3)  # the wake is read, the near re-check has run
    # One turn as the real loop (Watchdog.serve) runs it, without a cap on the wait; a
    # message is ready, so a working loop returns at once.
    client.send(wire.encode("sync"))
    dog.run_once()
    assert client.receive() == 2  # welcome, synced
    assert client.answers[-1][0] == "synced"
    assert not interrupts
    # A near deadline opened next to the far one is still enforced, in time.
    deadline = client.open_scope(0.1, serial=2, slot=1)
    assert pump(dog, lambda: bool(interrupts), 3.0), "the near deadline was never enforced"
    assert interrupts[0] >= deadline


def test_deeply_nested_message_does_not_crash_the_loop(
    dog: wd.Watchdog, connection: Client
) -> None:
    connection.send(b"[" * 100_000)
    assert pump(dog, lambda: dog.dropped == 1, 1.0)
    # The connection still works: the same client is welcomed afterwards.
    answer = connection.hello()
    assert answer is not None and answer[0] == "welcome"


# -- the control pipe --------------------------------------------------------------
@contextlib.contextmanager
def controlled_dog() -> Iterator[tuple[wd.Watchdog, int]]:
    """A watchdog whose control stream (the pytest process's pipe) this test writes."""
    directory = tempfile.mkdtemp(prefix="pet-unit-")
    read_end, write_end = os.pipe()
    control = os.fdopen(read_end, "rb", buffering=0)
    root = proctree.ProcessId.of(os.getpid())
    assert root is not None
    dog = wd.Watchdog(directory, root=root, control=control, session={"pid": 1})
    try:
        yield dog, write_end
    finally:
        with contextlib.suppress(OSError):
            os.close(write_end)
        control.close()
        dog.listener.close()
        dog.sel.close()
        shutil.rmtree(directory, ignore_errors=True)


def test_stop_command() -> None:
    with controlled_dog() as (dog, pipe):
        os.write(pipe, b"not json\n")
        os.write(pipe, b'{"op": "stop", "session": {"exitstatus": 0}}\n')
        assert pump(dog, lambda: dog.stopping, 2.0)
        assert dog.dropped == 1
        assert dog.session["exitstatus"] == 0
        os.close(pipe)  # the plugin closes its end after "stop"
        pump(dog, lambda: False, 0.1)
        assert not dog.root_died


def test_parent_death_is_noticed() -> None:
    with controlled_dog() as (dog, pipe):
        os.close(pipe)  # what the kernel does when the pytest process dies
        assert pump(dog, lambda: dog.root_died, 2.0)
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


def test_c_loop_owner_is_dumped_and_its_tree_terminated(dog: wd.Watchdog) -> None:
    env = {**os.environ, ENV_ADDRESS: dog.address}
    env.pop(ENV_DUMP_SIGNAL, None)  # the outer session's stack dumps go elsewhere
    proc = subprocess.Popen(
        [sys.executable, "-c", STUCK_CHILD],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
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


# -- process identity --------------------------------------------------------------
def test_process_identity_survives_pid_reuse() -> None:
    me = proctree.ProcessId.of(os.getpid())
    assert me is not None
    assert me.process() is not None
    assert proctree.ProcessId(me.pid, me.started + 1).process() is None
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
