"""Who may talk to the watchdog, and whom it may signal.

Each test runs a real watchdog process (``conftest.Dog``) whose session root is the
test process, attacks it from inside and outside the session, then proves that the
watchdog still enforces a real scope on time (``Probe``), that exactly the attacks were
counted as dropped in its JSON report, that nothing outside the session was signalled,
and (the suite's autouse check) that no process was left behind.
"""

from __future__ import annotations

import glob
import json
import os
import pwd
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from helpers import RawClient

from pytest_elastic_timer.core import startup, wire
from pytest_elastic_timer.core import table as tbl
from pytest_elastic_timer.watchdog import proctree

from .conftest import (
    GRACE,
    KILL_AFTER,
    SLEEPER,
    Dog,
    Probe,
    outsider,
    running,
    wait_for,
)

# Long enough for any escalation the watchdog might (wrongly) start to have signalled.
LADDER = GRACE + KILL_AFTER + 0.5


def records_of(report: dict[str, Any]) -> dict[int, list[dict[str, Any]]]:
    by_pid: dict[int, list[dict[str, Any]]] = {}
    for record in report["expired"]:
        by_pid.setdefault(record["pid"], []).append(record)
    return by_pid


def assert_only_probe_records(report: dict[str, Any], probe: Probe) -> None:
    """Every record is one of the probe's own expiries (interrupted in time)."""
    assert set(records_of(report)) <= {probe.pid}, report["expired"]
    assert len(report["expired"]) == probe.expiries
    assert {r["action"] for r in report["expired"]} <= {"interrupted"}


def table_path_of(dog: Dog, pid: int) -> str:
    (path,) = glob.glob(os.path.join(dog.directory, f"table-{pid}-*"))
    return path


# -- the endpoints are private ---------------------------------------------------------
def test_session_directory_socket_fifo_and_tables_are_private(dog: Dog) -> None:
    probe = Probe(dog)
    directory = os.stat(dog.directory)
    assert stat.S_IMODE(directory.st_mode) == 0o700
    assert directory.st_uid == os.getuid()
    sock = os.stat(dog.address)
    assert stat.S_ISSOCK(sock.st_mode) and stat.S_IMODE(sock.st_mode) == 0o600
    fifo = os.stat(dog.fifo)
    assert stat.S_ISFIFO(fifo.st_mode) and stat.S_IMODE(fifo.st_mode) == 0o600
    table = os.stat(table_path_of(dog, probe.pid))
    assert stat.S_IMODE(table.st_mode) == 0o600 and table.st_uid == os.getuid()
    probe.expire()
    report = dog.stop()
    assert report["session"]["dropped_messages"] == 0
    assert_only_probe_records(report, probe)


# -- another user ----------------------------------------------------------------------
def _connect_as(uid: int, gid: int, address: str) -> dict[str, Any]:
    """Fork; the child drops to ``uid`` and tries to register with the watchdog."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        result: dict[str, Any] = {}
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            raw = RawClient(address)
            result["connected"] = True
            try:
                answer = raw.ask(wire.encode("hello", pid=os.getpid(), table="x", dump=""))
                result["answer"] = answer and answer[0]
            except OSError as exc:  # the watchdog closed the connection at once
                result["answer"] = type(exc).__name__
            result["closed"] = raw.closed_by_peer()
        except OSError as exc:
            result["error"] = type(exc).__name__
        finally:
            os.write(write_end, json.dumps(result).encode())
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    value: dict[str, Any] = json.loads(data)
    return value


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a client as another user")
def test_another_user_cannot_connect_even_with_loosened_modes(dog: Dog) -> None:
    nobody = pwd.getpwnam("nobody")
    probe = Probe(dog)
    # The private directory keeps the other user from the socket altogether.
    assert _connect_as(nobody.pw_uid, nobody.pw_gid, dog.address) == {"error": "PermissionError"}
    # Even where the modes were loosened (a careless umask, a chmod), the watchdog checks
    # the peer's credentials (SO_PEERCRED) and closes the connection without a word.
    os.chmod(dog.directory, 0o711)
    os.chmod(dog.address, 0o777)
    try:
        result = _connect_as(nobody.pw_uid, nobody.pw_gid, dog.address)
    finally:
        os.chmod(dog.directory, 0o700)
        os.chmod(dog.address, 0o600)
    assert result["connected"] is True
    assert result["answer"] in (None, "BrokenPipeError", "ConnectionResetError")
    assert result["closed"] is True
    assert dog.alive()
    probe.expire()
    report = dog.stop()
    assert report["session"]["dropped_messages"] == 1  # the refused connection
    assert_only_probe_records(report, probe)


# -- a member of the session lying about who it is ---------------------------------------
def test_hello_for_another_process_or_a_foreign_table_is_refused(dog: Dog, tmp_path: Path) -> None:
    probe = Probe(dog)
    me = os.getpid()
    outside_table = tbl.ScopeTable.create(str(tmp_path / f"table-{me}-outside"))
    link = os.path.join(dog.directory, f"table-{me}-link")
    os.symlink(outside_table.path or "", link)
    forged = tbl.ScopeTable.create(os.path.join(dog.directory, f"table-{me}-forged"))
    with outsider(dog.root) as stranger:
        forged.words[tbl.H_PID] = stranger.pid  # a table that says it is the stranger's
        in_dir = os.path.join(dog.directory, f"table-{stranger.pid}-x")
        refused: dict[str, dict[str, Any]] = {
            "the stranger's pid": dict(pid=stranger.pid, table=in_dir),
            "init's pid": dict(pid=1, table=os.path.join(dog.directory, "table-1-x")),
            "the probe's pid and table": dict(pid=probe.pid, table=table_path_of(dog, probe.pid)),
            "a table outside": dict(pid=me, table=outside_table.path),
            "a symlink to it": dict(pid=me, table=link),
            "a path out of the directory": dict(
                pid=me, table=os.path.join(dog.directory, "..", f"table-{me}-outside")
            ),
            "another process's table name": dict(pid=me, table=table_path_of(dog, probe.pid)),
        }
        for what, fields in refused.items():
            with RawClient(dog.address) as raw:
                answer = raw.ask(wire.encode("hello", dump="", **fields))
            assert answer is not None and answer[0] == "refused", what
        # A table in the directory, named for this process, that says it is another's:
        # dropped without an answer.
        with RawClient(dog.address) as raw:
            assert raw.ask(wire.encode("hello", pid=me, table=forged.path, dump=""), 1.0) is None
        assert dog.alive()
        probe.expire()
        time.sleep(LADDER)  # nothing may have been started against the stranger
        assert running(stranger.pid)
    report = dog.stop()
    forged.close()
    outside_table.close()
    assert report["session"]["dropped_messages"] == len(refused) + 1
    assert_only_probe_records(report, probe)


# -- a process outside the session -------------------------------------------------------
STRANGER_CLIENT = """
import json, os, socket, sys, time
import pytest_elastic_timer as et
from pytest_elastic_timer.core import wire
from pytest_elastic_timer.scope import scopes

result = {"pid": os.getpid()}
scopes.process_state()  # connects and says hello; the answer is read when needed
raw = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
raw.connect(os.environ["PYTEST_ELASTIC_TIMER"])
raw.settimeout(5)
try:  # told why, then closed
    op, fields = wire.decode(raw.recv(wire.MAX_MESSAGE))
    result["raw_refused"] = f"{op}: {fields.get('error')}"
    result["raw_closed"] = raw.recv(1) == b""
except (OSError, wire.BadMessage) as exc:
    result["raw_closed"] = repr(exc)
try:  # its own scope is enforced in-process only: the watchdog does not know it
    with et.expires(0.3, scope="stranger"):
        time.sleep(10)
    result["expired"] = False
except et.ScopeExpired:
    result["expired"] = True
# Refused: it learnt so at its first deadline, which waits for the watchdog's answer.
result["attached"] = scopes.process_state().sock is not None
with open(sys.argv[1] + ".tmp", "w") as f:
    json.dump(result, f)
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(120)  # stays until the test ends it: it must never be signalled before
"""


def test_a_process_outside_the_session_cannot_register(dog: Dog, tmp_path: Path) -> None:
    probe = Probe(dog)
    out = tmp_path / "stranger.json"
    with outsider(dog.root, STRANGER_CLIENT, str(out), env=dog.env) as stranger:
        wait_for(out.exists, 30, "the stranger's result")
        result = json.loads(out.read_text())
        assert result == {
            "pid": stranger.pid,
            "attached": False,
            "raw_refused": "refused: not a process of this session",
            "raw_closed": True,
            "expired": True,
        }
        probe.expire()
        time.sleep(LADDER)
        assert running(stranger.pid)
    report = dog.stop()
    assert report["session"]["dropped_messages"] == 2  # its two connections
    assert_only_probe_records(report, probe)


# -- torch file timers: the pid in a FIFO request proves nothing -------------------------
def _request(pid: object, scope_id: str, expiration: float) -> bytes:
    fields = {"version": 1, "pid": pid, "scope_id": scope_id, "expiration_time": expiration}
    return json.dumps({**fields, "signal": signal.SIGKILL}).encode() + b"\n"


def test_file_timer_requests_for_processes_outside_the_session_are_dropped(dog: Dog) -> None:
    probe = Probe(dog)
    member = dog.spawn(SLEEPER)  # a member of the session that never says hello
    # Once its start-up code (the session's sitecustomize) registered the stack dump.
    dump = startup.session_dump_signal()
    wait_for(lambda: startup.catches(member.pid, dump), 10, "the member's dump handler")
    with outsider(dog.root) as stranger:
        now = time.time()
        dropped = [
            _request(1, "init", now - 10),
            _request(stranger.pid, "stranger#1", now - 10),
            _request(stranger.pid, "stranger#2", now + 0.2),
            _request(os.getppid(), "parent#3", now - 10),  # this test's own parent
        ]
        # The member's own request is honoured: the FIFO path works and enforces.
        dog.write_fifo(b"".join([*dropped, _request(member.pid, "member.py#12", now + 0.3)]))
        # No interrupt for torch timers: its stack dump, then the request's signal.
        assert member.wait(15) == -signal.SIGKILL
        time.sleep(LADDER)
        assert running(stranger.pid)
        assert running(os.getppid())
        probe.expire()
    report = dog.stop()
    assert report["session"]["dropped_messages"] == len(dropped)
    by_pid = records_of(report)
    assert set(by_pid) <= {probe.pid, member.pid}
    (record,) = by_pid[member.pid]
    assert (record["scope"], record["action"]) == ("member.py#12", "killed")
    assert (record["file"], record["line"]) == ("member.py", 12)
    assert 0 < record["budget"] <= 0.3  # counted from when the watchdog read the request
    assert member.pid in [p["pid"] for p in record["killed"]]
    assert "line 1" in record["stack"], json.dumps(record)  # its faulthandler dump


# -- pid reuse: identities are (pid, start time) ------------------------------------------
def test_process_identity_is_pid_and_start_time() -> None:
    child = subprocess.Popen([sys.executable, "-c", SLEEPER])
    try:
        ident = proctree.ProcessId.of(child.pid)
        assert ident is not None and ident.process() is not None
        # The same pid with another start time is another process: not ours, not alive,
        # not a root of anything.
        other = proctree.ProcessId(child.pid, ident.started + 0.01)
        assert other.process() is None
        me = proctree.ProcessId.of(os.getpid())
        assert me is not None
        assert proctree.is_descendant(child.pid, me)
        assert not proctree.is_descendant(child.pid, proctree.ProcessId(me.pid, me.started + 1))
        assert proctree.ProcessId.of(-1) is None
        assert proctree.ProcessId.of(2**40) is None
    finally:
        child.kill()
        child.wait()
    assert ident.process() is None  # gone (reaped)


def test_process_identity_survives_a_step_of_the_system_clock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """psutil's create_time() adds the boot time as the kernel says it at each call,
    which moves by whole seconds where the system clock is set again (a virtual
    machine's): the session's root then read as another process, and the watchdog
    refused every process of the session. The identity is the time since boot."""
    import psutil

    child = subprocess.Popen([sys.executable, "-c", SLEEPER])
    try:
        me = proctree.ProcessId.of(os.getpid())
        ident = proctree.ProcessId.of(child.pid)
        assert me is not None and ident is not None
        before = psutil.Process(child.pid).create_time()
        stepped = psutil.boot_time() + 1.0
        monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: stepped)
        assert psutil.Process(child.pid).create_time() == before + 1.0  # psutil's moved
        assert ident.process() is not None
        assert proctree.is_descendant(child.pid, me)
        assert proctree.ProcessId.of(child.pid) == ident
    finally:
        child.kill()
        child.wait()


NS_LAST_PID = "/proc/sys/kernel/ns_last_pid"


def _start_with_pid(pid: int) -> subprocess.Popen[bytes] | None:
    """A new sleeper that gets ``pid`` (Linux, root: the kernel's next-pid knob)."""
    for _ in range(30):
        try:
            with open(NS_LAST_PID, "w") as f:
                f.write(str(pid - 1))
        except OSError:
            return None
        proc = subprocess.Popen([sys.executable, "-c", SLEEPER])
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    return None


@pytest.mark.skipif(
    not os.access(NS_LAST_PID, os.W_OK), reason=f"{NS_LAST_PID} is not writable (needs root)"
)
def test_a_reused_pid_is_never_signalled() -> None:
    first = subprocess.Popen([sys.executable, "-c", SLEEPER])
    time.sleep(0.05)  # start times have clock-tick (10 ms) resolution
    stale = psutil.Process(first.pid)
    ident = proctree.ProcessId.of(first.pid)
    assert ident is not None
    first.kill()
    first.wait()
    time.sleep(0.05)
    second = _start_with_pid(first.pid)
    if second is None:
        pytest.skip("could not get the kernel to hand out the same pid again")
    try:
        assert second.pid == ident.pid
        # Every way the watchdog looks at a process it knew refuses the newcomer.
        assert ident.process() is None
        assert proctree.alive([stale]) == []
        assert not proctree.is_descendant(second.pid, ident)  # not the root it was
        proctree.send([stale], signal.SIGTERM)
        proctree.send(proctree.tree_of(stale, set()), signal.SIGKILL)
        time.sleep(0.3)
        assert second.poll() is None, "the process that reused the pid was signalled"
    finally:
        second.kill()
        second.wait()
