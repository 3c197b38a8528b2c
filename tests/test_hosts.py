"""Workers on other hosts: a watchdog on each host enforces their scopes (issue 20).

Every inner session here is an xdist session whose workers run on two stand-in hosts
(``standin_hosts.py``: pid, mount and UTS namespaces with their own host name and
/dev/shm; the file system is shared), two workers on each, through
``--tx popen//python=<wrapper>``. The controller's watchdog can neither reach nor
signal them; each host gets a watchdog of its own, and their records reach the
controller's reports with the host's name.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from pathlib import Path

import execnet
import psutil
import pytest
from helpers import Session, failure_block, lead, run, scope_line, top_level_environment
from standin_hosts import StandInHost, fake_ssh

from pytest_elastic_timer.core import hostid
from pytest_elastic_timer.plugin import launcher, remote_hosts

HOSTS = ("host-a", "host-b")
XDIST = (
    *("-p", "no:cacheprovider", "-p", "no:asyncio", "-p", "no:hypothesispytest"),
    *("-p", "no:timeout", "--dist=load", "-rA"),
)
GRACE = "--elastic-timer-grace=0.5"

# Quick tests, a C loop that holds the GIL far past its budget, a sleep that an
# interrupt ends; each test notes where it ran (host name and worker) in ran/<name>.
TESTS = """
import os
import socket
import time

import pytest


def note(name):
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ran")
    os.makedirs(here, exist_ok=True)
    with open(os.path.join(here, name), "a") as f:
        f.write(f"{socket.gethostname()} {os.environ.get('PYTEST_XDIST_WORKER')} {os.getpid()}\\n")


@pytest.mark.parametrize("n", range(6))
def test_quick(n):
    note(f"test_quick{n}")


@pytest.mark.expires(1)
def test_gil():
    note("test_gil")
    sum(range(10**10))


@pytest.mark.expires(1)
def test_sleep():
    note("test_sleep")
    time.sleep(60)
"""


@pytest.fixture(autouse=True)
def not_an_xdist_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inner sessions do not inherit this suite's own xdist worker id (under -n)."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_TESTRUNUID", raising=False)


def tx(hosts: list[StandInHost], per_host: int = 2) -> list[str]:
    return [arg for host in hosts for arg in ("--tx", f"{per_host}*{host.spec}")]


def ran(pytester: pytest.Pytester, name: str) -> list[list[str]]:
    path = pytester.path / "ran" / name
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def test_remote_workers_are_enforced_and_reported_by_scope_with_their_host(
    pytester: pytest.Pytester, stand_in_hosts: Callable[..., list[StandInHost]]
) -> None:
    hosts = stand_in_hosts(*HOSTS)
    pytester.makepyfile(test_remote=TESTS)
    junit = pytester.path / "junit.xml"
    session = run(
        pytester, *XDIST, GRACE, *tx(hosts), f"--junitxml={junit}", lean=False, timeout=30
    )
    session.assert_clean()
    outcomes = session.result.parseoutcomes()
    assert outcomes.get("passed") == 6, session.stdout
    # The session ended by itself, every quick test ran on a stand-in host.
    assert {ran(pytester, f"test_quick{n}")[0][0] for n in range(6)} <= set(HOSTS)

    gil = session.record("test_gil::call")
    assert gil["action"] in ("terminated", "killed")
    assert gil["host"] == ran(pytester, "test_gil")[0][0]
    assert gil["worker"] == ran(pytester, "test_gil")[0][1]
    assert "test_gil" in gil["stack"]
    block = failure_block(session, "test_gil")
    line = scope_line("test_gil::call", "1", "(?:terminated|killed)")
    assert any(line.match(text) for text in block.splitlines()), block
    assert f"host {gil['host']}" in block

    assert scope_line("test_sleep::call", "1").match(lead(session, "test_sleep"))
    sleep = session.record("test_sleep::call")
    assert sleep["action"] == "interrupted"
    assert sleep["host"] == ran(pytester, "test_sleep")[0][0]

    summary = session.stdout.split("elastic-timer: expired scopes", 1)[-1]
    assert f"host {gil['host']}" in summary and f"host {sleep['host']}" in summary
    cases = {c.get("name"): c for c in ET.parse(junit).getroot().iter("testcase")}
    for name, record in (("test_gil", gil), ("test_sleep", sleep)):
        properties = {p.get("name"): p.get("value") for p in cases[name].iter("property")}
        assert properties["elastic_timer_scope"] == f"{name}::call"
        assert properties["elastic_timer_host"] == record["host"]
    assert session.report is not None
    assert all(r["host"] in HOSTS for r in session.report["expired"])
    assert {gil["worker"], sleep["worker"]} <= set(session.report["session"]["workers"])
    # Every worker of the session, also those that made no record.
    quick = {ran(pytester, f"test_quick{n}")[0][1] for n in range(6)}
    assert quick <= set(session.report["session"]["workers"]), session.report["session"]
    # Ending a worker on a host ends no session: only pytest's own end is said so.
    assert "pytest was ended" not in session.text, session.text


HANG = """
import os, socket, pytest

@pytest.mark.parametrize("n", range({count}))
def test_hang(n):
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ran")
    os.makedirs(here, exist_ok=True)
    open(os.path.join(here, f"{{n}}-{{socket.gethostname()}}"), "w").close()
    sum(range(10**11))
"""


@contextlib.contextmanager
def controller_killed_while_hung(
    pytester: pytest.Pytester, hung: int, *args: str
) -> Iterator[None]:
    """Start a controller whose workers all hang in C, wait until ``hung`` of them do,
    run the body, then kill -9 the controller."""
    controller = subprocess.Popen(
        [sys.executable, "-m", "pytest", *XDIST, "--expires=600", *args],
        cwd=pytester.path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        give_up = time.monotonic() + 60
        while len(list(pytester.path.glob("**/ran/*"))) < hung:
            assert time.monotonic() < give_up, "the workers did not start their tests"
            assert controller.poll() is None, "the controller ended"
            time.sleep(0.1)
        yield
    finally:
        os.kill(controller.pid, signal.SIGKILL)
        controller.wait()


def wait_empty(hosts: list[StandInHost], timeout: float = 15.0) -> dict[str, list[str]]:
    """What still runs on ``hosts`` after waiting up to ``timeout`` for nothing to."""
    give_up = time.monotonic() + timeout
    while True:
        left = {h.name: [_command(p) for p in h.processes()] for h in hosts}
        left = {name: [c for c in procs if c is not None] for name, procs in left.items()}
        if not any(left.values()) or time.monotonic() > give_up:
            return {name: procs for name, procs in left.items() if procs}
        time.sleep(0.1)


def _command(proc: psutil.Process) -> str | None:
    """The command line of a running ``proc``; None once it ended (or is a zombie)."""
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return None


def test_kill_9_of_the_controller_leaves_nothing_running_on_any_host(
    pytester: pytest.Pytester, stand_in_hosts: Callable[..., list[StandInHost]]
) -> None:
    hosts = stand_in_hosts(*HOSTS)
    pytester.makepyfile(test_hang=HANG.format(count=4))
    with controller_killed_while_hung(pytester, 4, *tx(hosts)):
        # Two workers on each host, one watchdog per host.
        for host in hosts:
            watchdogs = [
                p for p in host.processes() if "pytest_elastic_timer.watchdog" in p.cmdline()
            ]
            assert len(watchdogs) == 1, (host.name, watchdogs)
    assert wait_empty(hosts) == {}
    assert not [d for host in hosts for d in host.session_dirs()]


SLEEP = """
import pytest, time


@pytest.mark.expires(1)
def test_sleep():
    time.sleep(60)
"""


def test_two_hosts_of_the_same_name_keep_a_record_each(
    pytester: pytest.Pytester, stand_in_hosts: Callable[..., list[StandInHost]]
) -> None:
    # Cloned VMs: the same host name, and the same pids, as a fresh pid namespace
    # numbers its processes alike (both workers run the test as the same pid).
    hosts = stand_in_hosts("node", "node")
    pytester.makepyfile(test_sleep=SLEEP)
    session = run(pytester, *XDIST, "--dist=each", GRACE, *tx(hosts, 1), lean=False, timeout=30)
    session.assert_clean()
    assert session.report is not None
    found = sorted(session.report["expired"], key=lambda r: r["worker"])
    assert [(r["scope"], r["worker"], r["host"]) for r in found] == [
        ("test_sleep::call", "gw0", "node"),
        ("test_sleep::call", "gw1", "node"),
    ], found
    assert found[0]["pid"] == found[1]["pid"] and found[0]["serial"] == found[1]["serial"]
    assert found[0]["host_key"] != found[1]["host_key"]
    summary = session.stdout.split("elastic-timer: expired scopes", 1)[-1]
    for worker in ("gw0", "gw1"):
        assert f"pid {found[0]['pid']}, worker {worker}, host node" in summary, summary


# -- identity ------------------------------------------------------------------------
IDENTITY = (
    "import json; from pytest_elastic_timer.core import hostid; "
    "print(json.dumps(hostid.current().to_json()))"
)


def identity_on(python: str | Path) -> hostid.HostIdentity:
    out = subprocess.run([str(python), "-c", IDENTITY], capture_output=True, text=True, check=True)
    found = hostid.HostIdentity.from_json(json.loads(out.stdout))
    assert found is not None, out.stdout
    return found


def test_a_process_of_this_host_has_this_hosts_identity() -> None:
    here = hostid.current()
    assert here.same_host(identity_on(sys.executable))
    assert here.hostname == socket.gethostname() and here.boot_id and here.pid_namespace


def test_stand_in_hosts_are_other_hosts_and_each_is_one_host(
    stand_in_hosts: Callable[..., list[StandInHost]],
) -> None:
    a, b = stand_in_hosts(*HOSTS)
    on_a, on_b = identity_on(a.wrapper), identity_on(b.wrapper)
    assert on_a.hostname == "host-a" and on_b.hostname == "host-b"
    assert not hostid.current().same_host(on_a) and not on_a.same_host(on_b)
    assert on_a.same_host(identity_on(a.wrapper))  # a second process there: same host
    assert on_a.key() != on_b.key()
    assert hostid.host_directory("t", on_a) != hostid.host_directory("t", on_b)


def test_an_identity_that_could_not_be_read_is_another_host() -> None:
    here = hostid.current()
    assert not here.same_host(hostid.HostIdentity(here.hostname, "", here.pid_namespace))
    assert hostid.HostIdentity.from_json({"hostname": 1}) is None
    assert hostid.HostIdentity.from_json(here.to_json()) == here


# -- processes started by remote workers ----------------------------------------------
HELPER_TESTS = '''
import subprocess
import sys

CHILD = """
import pytest_elastic_timer as et
et.set_label("helper")
with et.expires(after=1, scope="handshake"):
    sum(range(10**10))   # stuck in C, holding the GIL
"""


def test_helper():
    proc = subprocess.run([sys.executable, "-c", CHILD])
    assert proc.returncode == 0, f"helper exited with {proc.returncode}"
'''


def test_a_process_started_by_a_remote_worker_is_ended_by_its_hosts_watchdog(
    pytester: pytest.Pytester, stand_in_hosts: Callable[..., list[StandInHost]]
) -> None:
    hosts = stand_in_hosts("host-a")
    pytester.makepyfile(test_helper=HELPER_TESTS)
    session = run(pytester, *XDIST, GRACE, *tx(hosts, 1), lean=False, timeout=60)
    session.assert_clean()
    record = session.record("handshake")
    assert record["action"] in ("terminated", "killed")
    assert (record["label"], record["host"], record["worker"]) == ("helper", "host-a", "gw0")
    assert "<string>" in record["stack"]
    block = failure_block(session, "test_helper")
    assert "helper exited with -15" in block or "helper exited with -9" in block
    assert f"expired in helper, pid {record['pid']}, worker gw0, host host-a" in block


# -- socket gateways --------------------------------------------------------------------
SOCKET_SERVER = Path(execnet.__file__).parent / "script" / "socketserver.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# execnet's socket server serving from a thread of its own: every worker it runs is
# outside the main thread, as one is whenever the rsync before it has not let go of the
# server's main thread yet.
THREADED_SOCKET_SERVER = """
import sys
import threading

from execnet.gateway_base import get_execmodel
from execnet.script import socketserver

socketserver.execmodel = get_execmodel("thread")
listening = socketserver.bind_and_listen(sys.argv[1], socketserver.execmodel)
thread = threading.Thread(target=socketserver.startserver, args=(listening, True))
thread.start()
thread.join()
"""


# The guide's way to keep a socket server serving: started again whenever it ends.
SERVER_IN_A_LOOP = """
import subprocess
import sys

while True:
    subprocess.run([sys.executable, *sys.argv[1:]])
"""


def socket_server(
    host: StandInHost, directory: Path, *, threaded: bool = False, loop: bool = False
) -> tuple[psutil.Process, str]:
    """execnet's socket server on ``host`` (``loop``: under a loop that starts it
    again); returns the outermost process and a ``--tx`` spec for it."""
    port = free_port()
    script = SOCKET_SERVER
    if threaded:
        script = directory / "threaded_socket_server.py"
        script.write_text(THREADED_SOCKET_SERVER)
    argv = [str(script), f"127.0.0.1:{port}"]
    if loop:
        (directory / "server_in_a_loop.py").write_text(SERVER_IN_A_LOOP)
        argv.insert(0, str(directory / "server_in_a_loop.py"))
    launcher = subprocess.Popen(
        [str(host.wrapper), *argv],
        cwd=directory,
        stdout=subprocess.DEVNULL,
    )
    give_up = time.monotonic() + 30
    while True:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                break
        assert time.monotonic() < give_up, "the socket server did not start"
        time.sleep(0.05)
    (server,) = psutil.Process(launcher.pid).children()
    return server, f"socket=127.0.0.1:{port}//chdir={directory / 'remote'}"


def test_the_wait_for_a_socket_server_takes_only_one_that_serves() -> None:
    """xdist may report a worker down a moment before the socket server it ran in is
    gone: its port still accepts connections (in the backlog) that the server, busy
    or ending, never serves. The controller waits for one that answers."""
    with socket.socket() as busy:  # listening, never accepting: that server's port
        busy.bind(("127.0.0.1", 0))
        busy.listen(5)
        spec = execnet.XSpec(f"socket=127.0.0.1:{busy.getsockname()[1]}")
        started = time.monotonic()
        remote_hosts.wait_for_socket_server(spec, started + 1.0)
        assert time.monotonic() - started >= 1.0  # not taken: waited to the end
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, str(SOCKET_SERVER), f"127.0.0.1:{port}"], stdout=subprocess.DEVNULL
    )
    try:
        spec = execnet.XSpec(f"socket=127.0.0.1:{port}")
        started = time.monotonic()
        remote_hosts.wait_for_socket_server(spec, started + 60.0)
        assert time.monotonic() - started < 60.0  # came up, and answered
        # It serves on: a worker's gateway still connects after the probes.
        group = execnet.Group()
        try:
            gateway = group.makegateway(f"socket=127.0.0.1:{port}")
            assert gateway.remote_exec("channel.send(6 * 7)").receive(timeout=30) == 42
        finally:
            group.terminate(timeout=10)
    finally:
        server.kill()
        server.wait()


def socket_project(pytester: pytest.Pytester, more_tests: str = "") -> Path:
    """A project of :data:`TESTS` (and ``more_tests``) for a socket server's worker.

    execnet's socket server runs a remote call in its main thread only if the one
    before it (the rsync) has let go of it: otherwise the worker runs in a thread of
    its own, where a thread of the package raises the ScopeExpired, which Python code
    gets and a call blocked in C does not. The sleep polls, so both ways end it; the C
    loop is left out (ending the worker ends the server it runs in: see the test of a
    server started again in a loop).
    """
    project = pytester.mkdir("project")
    tests = textwrap.dedent(TESTS).replace("sum(range(10**10))", "pass")
    tests = tests.replace("time.sleep(60)", "while True:\n        time.sleep(0.05)")
    (project / "test_remote.py").write_text(tests + more_tests)
    return project


def run_through_socket_server(pytester: pytest.Pytester, spec: str, project: Path) -> Session:
    """A session of ``project``'s tests on the socket server of ``spec``."""
    return run(
        pytester,
        *XDIST,
        # A grace no loaded machine outlasts: the sleep must end by its interrupt,
        # since a worker ended on its host takes execnet's socket server with it and
        # xdist then cannot replace the worker.
        "--elastic-timer-grace=10",
        "--tx",
        spec,
        f"--rsyncdir={project}",
        "-W",
        "ignore::DeprecationWarning",
        str(project / "test_remote.py"),
        lean=False,
        timeout=60,
    )


def test_a_socket_gateway_takes_the_same_path(
    pytester: pytest.Pytester, stand_in_hosts: Callable[..., list[StandInHost]]
) -> None:
    (host,) = stand_in_hosts("host-a")
    project = socket_project(pytester)
    server, spec = socket_server(host, pytester.path)
    try:
        session = run_through_socket_server(pytester, spec, project)
        session.assert_clean()
        record = session.record("test_sleep::call")
        assert (record["action"], record["host"]) == ("interrupted", "host-a")
        assert session.result.parseoutcomes().get("passed") == 7
        # The worker ran in the server's own process, which serves on: it was not
        # ended as a stray of the session, and the host's watchdog is gone.
        give_up = time.monotonic() + 5
        while len(host.processes()) > 1 and time.monotonic() < give_up:
            time.sleep(0.05)
        assert [p.pid for p in host.processes()] == [server.pid]
    finally:
        with contextlib.suppress(psutil.Error):
            server.kill()


def test_a_socket_worker_the_controllers_watchdog_refuses_is_warned_about_on_the_controller(
    pytester: pytest.Pytester,
) -> None:
    # A socket server on the controller's own host, started outside the session: not
    # one of its processes, so the controller's watchdog refuses its worker.
    project = socket_project(pytester)
    port = free_port()
    # From a user's shell: nothing of this suite's own session in its environment.
    shell = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_ELASTIC_TIMER")}
    shell.pop("TORCHELASTIC_TIMER_FILE", None)
    server = subprocess.Popen(
        [sys.executable, str(SOCKET_SERVER), f"127.0.0.1:{port}"],
        cwd=pytester.path,
        env=shell,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        spec = execnet.XSpec(f"socket=127.0.0.1:{port}")
        remote_hosts.wait_for_socket_server(spec, time.monotonic() + 30.0)
        spec_text = f"socket=127.0.0.1:{port}//chdir={pytester.path / 'remote'}"
        session = run_through_socket_server(pytester, spec_text, project)
    finally:
        server.kill()
        server.wait()
    session.assert_clean()
    assert session.result.parseoutcomes().get("passed") == 7, session.stdout
    # Enforced in-process all the same, and the controller says so, and what it lacks.
    assert scope_line("test_sleep::call", "1").match(lead(session, "test_sleep"))
    warning = " ".join(session.stdout.split("warnings summary", 1)[-1].split())
    assert "the session's watchdog refused worker gw0" in warning, session.stdout
    assert "not in the expired scopes' summary nor in the JSON report" in warning, warning


def test_a_worker_ended_in_a_socket_server_started_again_in_a_loop_is_replaced(
    pytester: pytest.Pytester, stand_in_hosts: Callable[..., list[StandInHost]]
) -> None:
    """The watchdog there ends a worker stuck in C, and with it the server it ran in;
    the loop starts the server again. The controller waits for it to fetch the
    record, and xdist's replacement worker then finds a server to connect to."""
    (host,) = stand_in_hosts("host-a")
    project = pytester.mkdir("project")
    (project / "test_remote.py").write_text(textwrap.dedent(TESTS))
    looping, spec = socket_server(host, pytester.path, loop=True)
    try:
        session = run(
            pytester,
            *XDIST,
            GRACE,
            *("--tx", spec, f"--rsyncdir={project}", "-W", "ignore::DeprecationWarning"),
            str(project / "test_remote.py"),
            lean=False,
            timeout=60,
        )
        session.assert_clean()
        assert "INTERNALERROR" not in session.text, session.text
        gil = session.record("test_gil::call")
        assert (gil["action"], gil["host"]) in {("terminated", "host-a"), ("killed", "host-a")}
        outcomes = session.result.parseoutcomes()
        assert (outcomes.get("passed"), outcomes.get("failed")) == (6, 2), session.stdout
    finally:
        for proc in [looping, *looping.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                proc.kill()


def test_a_socket_worker_outside_the_main_thread_is_interrupted_on_its_host(
    pytester: pytest.Pytester, stand_in_hosts: Callable[..., list[StandInHost]]
) -> None:
    """No signal handler there: the host's watchdog interrupts it on its channel, and
    the server, which the worker runs in, serves on."""
    (host,) = stand_in_hosts("host-a")
    project = socket_project(
        pytester,
        "\n\ndef test_outside_the_main_thread():\n"
        "    import threading\n"
        "    assert threading.current_thread() is not threading.main_thread()\n",
    )
    server, spec = socket_server(host, pytester.path, threaded=True)
    try:
        session = run_through_socket_server(pytester, spec, project)
        session.assert_clean()
        record = session.record("test_sleep::call")
        assert (record["action"], record["host"]) == ("interrupted", "host-a")
        assert session.result.parseoutcomes().get("passed") == 8
        assert server.is_running()
    finally:
        with contextlib.suppress(psutil.Error):
            server.kill()


def test_a_socket_gateway_whose_controller_is_killed_is_ended_with_its_worker(
    pytester: pytest.Pytester, stand_in_hosts: Callable[..., list[StandInHost]]
) -> None:
    (host,) = stand_in_hosts("host-a")
    project = pytester.mkdir("project")
    (project / "test_hang.py").write_text(textwrap.dedent(HANG.format(count=1)))
    server, spec = socket_server(host, pytester.path)
    try:
        args = ("--tx", spec, f"--rsyncdir={project}", str(project / "test_hang.py"))
        with controller_killed_while_hung(pytester, 1, *args):
            pass
        # The hung worker ran in the server's process: its tree is ended with it.
        assert wait_empty([host]) == {}
    finally:
        with contextlib.suppress(psutil.Error):
            server.kill()


# -- ssh gateways -----------------------------------------------------------------------
def test_an_ssh_gateway_takes_the_same_path(
    pytester: pytest.Pytester,
    stand_in_hosts: Callable[..., list[StandInHost]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hosts = stand_in_hosts(*HOSTS)
    monkeypatch.setenv("PATH", f"{fake_ssh(hosts, pytester.path)}{os.pathsep}{os.environ['PATH']}")
    project = pytester.mkdir("project")
    (project / "test_remote.py").write_text(textwrap.dedent(TESTS))
    specs = [
        arg
        for host in hosts
        for arg in (
            "--tx",
            f"ssh={host.name}//python={sys.executable}//chdir={pytester.path / host.name}",
        )
    ]
    session = run(
        pytester,
        *XDIST,
        GRACE,
        *specs,
        f"--rsyncdir={project}",
        "-W",
        "ignore::DeprecationWarning",
        str(project / "test_remote.py"),
        lean=False,
        timeout=90,
    )
    session.assert_clean()
    assert session.result.parseoutcomes().get("passed") == 6, session.stdout
    gil = session.record("test_gil::call")
    assert gil["action"] in ("terminated", "killed") and gil["host"] in HOSTS
    block = failure_block(session, "test_gil")
    assert f"host {gil['host']}" in block
    sleep = session.record("test_sleep::call")
    assert (sleep["action"], sleep["host"] in HOSTS) == ("interrupted", True)


# A C loop on the host's only worker, the one that started the host's watchdog; then
# another test on its replacement.
LAST_ON_THE_HOST = """
import pytest


@pytest.mark.expires(1)
def test_gil():
    sum(range(10**10))


def test_after():
    pass
"""


def test_ending_the_worker_that_started_a_hosts_watchdog_ends_no_session(
    pytester: pytest.Pytester, stand_in_hosts: Callable[..., list[StandInHost]]
) -> None:
    """The worker that started a host's watchdog is its root, not pytest: ending it
    is the usual worker replacement, and the host's watchdog says nothing on the
    terminal (no "pytest was ended" summary of its own)."""
    hosts = stand_in_hosts("host-a")
    pytester.makepyfile(test_last=LAST_ON_THE_HOST)
    session = run(pytester, *XDIST, GRACE, *tx(hosts, 1), lean=False, timeout=60)
    session.assert_clean()
    session.result.assert_outcomes(passed=1, failed=1)
    record = session.record("test_gil::call")
    assert (record["action"], record["host"]) in {("terminated", "host-a"), ("killed", "host-a")}
    assert "pytest was ended" not in session.text, session.text
    assert session.report is not None and session.report["session"]["root_died"] is False


def test_a_hosts_watchdog_lingering_for_a_replacement_holds_no_output_of_pytest(
    pytester: pytest.Pytester, stand_in_hosts: Callable[..., list[StandInHost]]
) -> None:
    """The last worker of a host is ended and not replaced (--max-worker-restart=0):
    the host's watchdog lingers for a replacement, but pytest's output, read through a
    pipe as CI reads it, ends with pytest. The watchdog had the worker's stderr (the
    controller's, or an ssh channel) and held the pipe open while it lingered."""
    hosts = stand_in_hosts("host-a")
    pytester.makepyfile(test_last=LAST_ON_THE_HOST)
    args = [*XDIST, GRACE, *tx(hosts, 1), "--max-worker-restart=0"]
    with top_level_environment():
        controller = subprocess.Popen(
            [sys.executable, "-m", "pytest", *args],
            cwd=pytester.path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
    try:
        assert controller.stdout is not None
        output = controller.stdout.read().decode(errors="replace")  # until EOF
        assert controller.wait(timeout=30) == pytest.ExitCode.TESTS_FAILED, output
        lingering = [p for p in hosts[0].processes() if _is_watchdog(p)]
        assert lingering, "the host's watchdog ended before the output did"
    finally:
        if controller.poll() is None:
            controller.kill()
            controller.wait()
    assert wait_empty(hosts, timeout=30) == {}
    assert not [d for host in hosts for d in host.session_dirs()]


def _is_watchdog(proc: psutil.Process) -> bool:
    try:
        return "pytest_elastic_timer.watchdog" in proc.cmdline()
    except psutil.Error:
        return False


# The first test kills its host's watchdog; the plugin notices before the next test.
HOST_WATCHDOG_KILLED = """
import os
import signal
import time

import psutil


def test_kill_the_hosts_watchdog(elastic_timer_server):
    os.kill(elastic_timer_server.pid, signal.SIGKILL)
    while psutil.pid_exists(elastic_timer_server.pid):
        if psutil.Process(elastic_timer_server.pid).status() == psutil.STATUS_ZOMBIE:
            break
        time.sleep(0.01)
    time.sleep(1.1)  # the plugin looks at the connection at most once a second


def test_after():
    pass
"""


@pytest.mark.parametrize("in_the_last_test", [False, True])
def test_a_hosts_watchdog_lost_mid_session_fails_the_session(
    pytester: pytest.Pytester,
    stand_in_hosts: Callable[..., list[StandInHost]],
    in_the_last_test: bool,
) -> None:
    """As when the controller's watchdog dies: the loss is summarized on the
    controller's terminal and in its report, naming the host, and the session fails
    although every test passed; also when it died in the worker's last test."""
    hosts = stand_in_hosts("host-a")
    tests = HOST_WATCHDOG_KILLED
    if in_the_last_test:
        tests = tests.split("def test_after", 1)[0]
    pytester.makepyfile(test_lost=tests)
    session = run(pytester, *XDIST, GRACE, *tx(hosts, 1), lean=False, timeout=60)
    session.assert_clean()
    if in_the_last_test:
        session.result.assert_outcomes(passed=1)
        when = "died during the session"
    else:
        session.result.assert_outcomes(passed=2, warnings=1)
        when = "died before test_lost.py::test_after"
    assert session.result.ret == pytest.ExitCode.TESTS_FAILED
    section = session.stdout.split("elastic-timer: watchdog lost", 1)[-1]
    assert re.search(rf"the watchdog \(pid \d+, host host-a\) {when}", section), section
    assert "(worker gw0)" in section, session.stdout
    assert session.report is not None
    lost = session.report["session"]["watchdog_lost"]
    assert when in lost and "host host-a" in lost
    assert session.report["session"]["exitstatus"] == pytest.ExitCode.TESTS_FAILED
    # A watchdog killed with SIGKILL cannot remove its directory: the next session on
    # that host sweeps it (launcher.sweep_stale), as here at once.
    (left,) = hosts[0].session_dirs()
    assert launcher.sweep_stale(hosts[0].shm(), older_than=0) == [left]


LEAVES_A_PROCESS = """
import subprocess
import time

import pytest


@pytest.mark.expires(30)
def test_leaves_a_sleep():
    subprocess.Popen(["sleep", "300"])
    time.sleep(0.2)
"""


def test_pids_of_another_host_are_said_to_be_that_hosts(
    pytester: pytest.Pytester, stand_in_hosts: Callable[..., list[StandInHost]]
) -> None:
    """A worker's leftover process, named by its pid on the controller's terminal, is
    said to be on its host: the same pid there is another process."""
    hosts = stand_in_hosts("host-a")
    pytester.makepyfile(test_leaves=LEAVES_A_PROCESS)
    session = run(pytester, *XDIST, GRACE, *tx(hosts, 1), "--elastic-timer-leaks=kill", lean=False)
    session.assert_clean()
    session.result.assert_outcomes(passed=1, warnings=1)
    assert re.search(
        r"left 1 process\(es\) running after its teardown \(ended, on host host-a\): \d+ "
        r"\(sleep 300\)",
        session.stdout,
    ), session.stdout


CHILD_AT_THE_EXPIRY = """
import subprocess
import sys
import time

import pytest


@pytest.mark.expires(1.5)
def test_with_a_child():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(60)
    finally:
        child.kill()
        child.wait()
"""


def test_a_remote_records_children_are_named_with_their_host(
    pytester: pytest.Pytester, stand_in_hosts: Callable[..., list[StandInHost]]
) -> None:
    """The stack of a child taken at the expiry, a section of the failure, names the
    host its pid belongs to."""
    hosts = stand_in_hosts("host-a")
    pytester.makepyfile(test_child=CHILD_AT_THE_EXPIRY)
    session = run(pytester, *XDIST, GRACE, *tx(hosts, 1), lean=False)
    session.assert_clean()
    record = session.record("test_with_a_child::call")
    (child,) = [c for c in record["children"] if c.get("stack")]
    block = failure_block(session, "test_with_a_child")
    assert f"elastic-timer: stack of pid {child['pid']}, host host-a at expiry" in block, block


def test_a_host_directory_too_long_for_a_socket_is_said_so_and_left_to_nobody(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host without a writable /dev/shm and with a long TMPDIR: joining says which
    socket path is too long on which host, before starting anything, and leaves no
    directory behind (the watchdog died with "AF_UNIX path too long" on stderr, and the
    worker was told only that it did not start)."""
    root = tmp_path / ("t" * 70)
    root.mkdir()
    monkeypatch.setattr(hostid, "session_root", lambda: str(root))
    with pytest.raises(launcher.WatchdogError) as raised:
        launcher.join_host(
            "pytest-elastic-timer-token", grace=1, scale=1, worker="gw0", gateway_fds=[]
        )
    said = str(raised.value)
    assert f"on host {hostid.current().hostname} would be '{root}" in said, said
    assert "longer than a socket address may be (107 bytes)" in said
    assert list(root.iterdir()) == []
