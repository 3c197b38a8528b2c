"""The watchdog of another host, driven step by step (``watchdog/remote_host.py``), and
the intake of the controller's watchdog for records of other hosts
(``watchdog/forwarded.py``).

The end-to-end sessions are in ``test_hosts.py``; here a watchdog built as ``python -m
pytest_elastic_timer.watchdog`` builds it runs in this process, turned by ``run_once``,
and real processes join it, hang up their gateways, or forward records to it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import pump, wait_gone

from pytest_elastic_timer.core import hostlink, records, wire
from pytest_elastic_timer.watchdog import proctree
from pytest_elastic_timer.watchdog import server as wd
from pytest_elastic_timer.watchdog.remote_host import HostRole
from pytest_elastic_timer.watchdog.wiring import Assembly, build

RECORD = records.ExpiryRecord(
    nodeid="test_remote.py::test_gil",
    scope="test_gil::call",
    budget=1.0,
    elapsed=1.5,
    pid=5,
    label="",
    worker="gw3",
    file="/scratch/test_remote.py",
    line=20,
    action="terminated",
    stack="Current thread ...",
    serial=1,
    host="node-b",
    host_key="b0",
)


def make(grace: float = 30.0, host_name: str | None = None, linger: float = 15.0) -> Assembly:
    """A watchdog with everything plugged in, as ``python -m`` runs it; with
    ``host_name``, the watchdog of that host (not the controller's)."""
    directory = tempfile.mkdtemp(prefix="pet-host-")  # short: AF_UNIX paths are limited
    root = proctree.ProcessId.of(os.getpid())
    assert root is not None
    return build(
        directory,
        root=root,
        grace=grace,
        kill_after=1.0,
        scale=1.0,
        host_name=host_name,
        linger=linger,
    )


def close(assembly: Assembly) -> None:
    assembly.close()
    shutil.rmtree(assembly.dog.directory, ignore_errors=True)


def remote(assembly: Assembly) -> tuple[wd.Watchdog, HostRole]:
    assert assembly.remote is not None
    return assembly.dog, assembly.remote


@pytest.fixture
def assembly() -> Iterator[Assembly]:
    made = make()
    yield made
    close(made)


def ask(dog: wd.Watchdog, sock: socket.socket, op: str, **fields: Any) -> tuple[str, Any]:
    sock.send(wire.encode(op, **fields))
    answer: list[tuple[str, Any]] = []

    def answered() -> bool:
        try:
            answer.append(wire.decode(sock.recv(wire.MAX_MESSAGE, socket.MSG_DONTWAIT)))
        except BlockingIOError:
            return False
        return True

    assert pump(dog, answered), f"no answer to {op}"
    return answer[0]


# Another process of the session sends op argv[2] with the fields argv[3] (JSON), and
# prints the answer if one comes (a message that is dropped gets none).
SEND = """
import json, socket, sys
from pytest_elastic_timer.core import wire
sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
sock.connect(sys.argv[1])
sock.send(wire.encode(sys.argv[2], **json.loads(sys.argv[3])))
sock.settimeout(float(sys.argv[4]))
try:
    print(wire.decode(sock.recv(65536))[0])
except TimeoutError:
    print("no answer")
"""


def from_another_process(dog: wd.Watchdog, op: str, patience: float, **fields: Any) -> str:
    """What the watchdog answers to ``op`` sent by another process of the session."""
    child = subprocess.Popen(
        [sys.executable, "-c", SEND, dog.address, op, json.dumps(fields), str(patience)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert pump(dog, lambda: child.poll() is not None, timeout=20)
    out, _ = child.communicate()
    return out.strip()


def test_a_record_of_another_host_is_kept_only_when_the_controller_forwards_it(
    assembly: Assembly,
) -> None:
    dog = assembly.dog
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.connect(dog.address)
        assert ask(dog, sock, "forward", record=RECORD.to_json())[0] == "forwarded"
        # Again, superseding: one record per (host, host_key, pid, serial).
        assert ask(dog, sock, "forward", record=RECORD.to_json())[0] == "forwarded"
        home = {**RECORD.to_json(), "host": ""}
        assert ask(dog, sock, "forward", record=home)[0] == "refused"
        assert ask(dog, sock, "forward", record={**RECORD.to_json(), "pid": "5"})[0] == "refused"
    assert [r.key for r in dog.records] == [("node-b", "b0", 5, 1)]
    assert [r.key for r in records.read_records(dog.records_path)] == [("node-b", "b0", 5, 1)]
    assert "gw3" in dog.workers

    # A process of the session that is not the controller's pytest is refused.
    record = {**RECORD.to_json(), "pid": 6}
    assert from_another_process(dog, "forward", 10, record=record) == "refused"
    assert [r.pid for r in dog.records] == [5]
    assert dog.dropped == 3


def test_records_of_two_hosts_of_the_same_name_are_both_kept(assembly: Assembly) -> None:
    dog = assembly.dog
    clone = {**RECORD.to_json(), "host_key": "b1", "worker": "gw4"}  # same name, pid, serial
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.connect(dog.address)
        assert ask(dog, sock, "forward", record=RECORD.to_json())[0] == "forwarded"
        assert ask(dog, sock, "forward", record=clone)[0] == "forwarded"
        assert ask(dog, sock, "forward", record={**clone, "host_key": 1})[0] == "refused"
    assert [r.worker for r in dog.records] == ["gw3", "gw4"]
    assert [r.worker for r in records.read_records(dog.records_path)] == ["gw3", "gw4"]


@pytest.mark.parametrize("action", records.ACTIONS)
def test_a_record_of_another_host_is_forwarded_whatever_its_action(
    assembly: Assembly, action: str
) -> None:
    """Every action a host's watchdog records reaches the controller's report: a torch
    file-timer request left running ('reported') was refused as no record."""
    dog = assembly.dog
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.connect(dog.address)
        sent = {**RECORD.to_json(), "action": action}
        assert ask(dog, sock, "forward", record=sent)[0] == "forwarded"
        assert ask(dog, sock, "forward", record={**sent, "action": "x"})[0] == "refused"
    assert [r.action for r in dog.records] == [action]


def test_the_controller_names_workers_of_other_hosts_and_nobody_else_does(
    assembly: Assembly,
) -> None:
    dog = assembly.dog
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.connect(dog.address)
        for fields in ({"worker": "gw7"}, {"worker": ""}, {"worker": 7}, {}):
            sock.send(wire.encode("worker", **fields))
        assert pump(dog, lambda: dog.dropped == 3)
    assert "gw7" in dog.workers
    # A process of the session that is not the controller's pytest is not heard.
    assert from_another_process(dog, "worker", 0.5, worker="gw8") == "no answer"
    assert dog.dropped == 4
    assert "gw8" not in dog.workers


JOIN = """
import os, sys, time
from pytest_elastic_timer.core import hostlink
link = hostlink.Link(sys.argv[1], "gw9", [0])   # stdin: the gateway's read side
print("joined", flush=True)
time.sleep(3600)                                # a worker stuck (in C, say)
"""


def test_a_gateway_that_hangs_up_under_its_worker_ends_the_worker_and_the_session() -> None:
    served = make(grace=0.5, host_name="node-b", linger=60.0)
    dog, role = remote(served)
    read_end, write_end = os.pipe()  # the controller's side of a gateway: write_end
    worker = subprocess.Popen(
        [sys.executable, "-c", JOIN, dog.directory], stdin=read_end, stdout=subprocess.PIPE
    )
    os.close(read_end)
    try:
        assert pump(dog, lambda: len(role.gateways) == 1, timeout=20)
        assert worker.stdout is not None and worker.stdout.readline() == b"joined\n"
        worker.stdout.close()
        assert dog.owners.in_session(worker.pid)
        pump(dog, lambda: False, timeout=0.3)
        assert worker.poll() is None, "silence on a gateway ends nobody"

        os.close(write_end)  # the controller is gone
        started = time.monotonic()
        assert pump(dog, lambda: worker.poll() is not None, timeout=10)
        # It had max(2 s, grace) to end by itself first.
        assert time.monotonic() - started >= 1.9
        assert pump(dog, lambda: dog.stopping, timeout=5)
        assert dog.root_died  # the report says the controller went away
    finally:
        if worker.poll() is None:
            worker.kill()
        worker.wait()
        close(served)


def test_a_worker_ended_without_leave_is_awaited_for_a_while() -> None:
    served = make(host_name="node-b", linger=0.5)
    dog, role = remote(served)
    try:
        ended = subprocess.Popen(
            [sys.executable, "-c", JOIN, dog.directory], stdout=subprocess.DEVNULL
        )
        assert pump(dog, lambda: len(role.gateways) == 1, timeout=20)
        ended.kill()
        ended.wait()
        assert pump(dog, lambda: not role.gateways)
        assert role.awaited == 1 and not dog.stopping  # a replacement may come
        # A fetch on the join socket answers and counts as a sign of the controller.
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.connect(os.path.join(dog.directory, hostlink.JOIN_SOCKET))
            op, fields = ask(dog, sock, "fetch", worker="gw9")
        assert (op, fields["records"], fields["pending"], fields["more"]) == (
            "records",
            [],
            False,
            False,
        )
        assert pump(dog, lambda: dog.stopping, timeout=5)  # lingered, then gave up
        assert not dog.root_died
        assert wait_gone(ended.pid, 1)
    finally:
        close(served)


def test_a_join_must_name_the_process_that_sends_it() -> None:
    served = make(host_name="node-b")
    dog, role = remote(served)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.connect(os.path.join(dog.directory, hostlink.JOIN_SOCKET))
            sock.send(wire.encode("join", pid=os.getpid() + 1, worker="gw0"))
            assert pump(dog, lambda: dog.dropped == 1)
        assert not role.gateways
        assert dog.owners.roots == [dog.root]
    finally:
        close(served)


LEAVE = """
import os, sys, time
from pytest_elastic_timer.core import hostlink
link = hostlink.Link(sys.argv[1], sys.argv[2], [])
os.environ["PYTEST_ELASTIC_TIMER"] = os.path.join(sys.argv[1], "watchdog.sock")
import pytest_elastic_timer as et
with et.expires(3600, scope="registers"):   # an owner of the session here
    time.sleep(float(sys.argv[3]))
link.leave()
link.close()
time.sleep(3600)                  # the process serves on (execnet's socket server)
"""


def test_workers_that_leave_end_the_session_at_once_and_are_not_its_strays() -> None:
    served = make(host_name="node-b", linger=60.0)
    dog, role = remote(served)
    workers = [
        subprocess.Popen([sys.executable, "-c", LEAVE, dog.directory, f"gw{n}", str(2 * n + 2)])
        for n in range(2)
    ]
    try:
        assert pump(dog, lambda: len(role.gateways) == 2 and len(dog.owners) == 2, timeout=20)
        assert {"gw0", "gw1"} <= dog.workers
        assert pump(dog, lambda: len(role.gateways) == 1, timeout=5)
        assert not dog.stopping  # one of the two is still here
        assert pump(dog, lambda: dog.stopping, timeout=5)
        assert role.awaited == 0 and not dog.root_died
        dog.finish()
        assert all(w.poll() is None for w in workers), "a worker that left was ended"
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()
        shutil.rmtree(dog.directory, ignore_errors=True)
