"""Workers on other hosts: a watchdog on each host enforces their scopes (issue 20).

Every inner session here is an xdist session whose workers run on two stand-in hosts
(``standin_hosts.py``: pid, mount and UTS namespaces with their own host name and
/dev/shm; the file system is shared), two workers on each, through
``--tx popen//python=<wrapper>``. The controller's watchdog can neither reach nor
signal them; each host gets a watchdog of its own, and their records reach the
controller's reports with the host's name.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import failure_block, run, scope_line
from standin_hosts import StandInHost

from pytest_elastic_timer.core import hostid

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


@pytest.mark.xfail(strict=True, reason="issue 20: workers on other hosts are not enforced yet")
def test_remote_workers_are_enforced_and_reported_by_scope_with_their_host(
    pytester: pytest.Pytester,
    stand_in_hosts: Callable[..., list[StandInHost]],
    request: pytest.FixtureRequest,
) -> None:
    hosts = stand_in_hosts(*HOSTS)
    request.addfinalizer(lambda: [host.close() for host in hosts])  # until issue 20 is done
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
    assert scope_line("test_gil::call", "1", "(?:terminated|killed)").search(block), block
    assert f"host {gil['host']}" in block

    sleep = session.assert_expired("test_sleep", "test_sleep::call", 1.0)
    assert sleep["host"] == ran(pytester, "test_sleep")[0][0]

    summary = session.stdout.split("elastic-timer: expired scopes", 1)[-1]
    assert f"host {gil['host']}" in summary and f"host {sleep['host']}" in summary
    cases = {c.get("name"): c for c in ET.parse(junit).getroot().iter("testcase")}
    assert "test_gil::call" in ET.tostring(cases["test_gil"], encoding="unicode")
    assert session.report is not None
    assert all(r["host"] in HOSTS for r in session.report["expired"])


@pytest.mark.xfail(strict=True, reason="issue 20: workers on other hosts are not enforced yet")
def test_kill_9_of_the_controller_leaves_nothing_running_on_any_host(
    pytester: pytest.Pytester,
    stand_in_hosts: Callable[..., list[StandInHost]],
    request: pytest.FixtureRequest,
) -> None:
    hosts = stand_in_hosts(*HOSTS)
    request.addfinalizer(lambda: [host.close() for host in hosts])  # until issue 20 is done
    pytester.makepyfile(
        test_hang="""
        import os, socket, pytest

        @pytest.mark.parametrize("n", range(4))
        def test_hang(n):
            here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ran")
            os.makedirs(here, exist_ok=True)
            open(os.path.join(here, f"{n}-{socket.gethostname()}"), "w").close()
            sum(range(10**11))
        """
    )
    controller = subprocess.Popen(
        [sys.executable, "-m", "pytest", *XDIST, "--expires=600", *tx(hosts)],
        cwd=pytester.path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        give_up = time.monotonic() + 60
        while len(list((pytester.path / "ran").glob("*"))) < 4:
            assert time.monotonic() < give_up, "the four workers did not start their tests"
            time.sleep(0.1)
        # Two workers on each host, one watchdog per host.
        for host in hosts:
            watchdogs = [
                p for p in host.processes() if "pytest_elastic_timer.watchdog" in p.cmdline()
            ]
            assert len(watchdogs) == 1, (host.name, watchdogs)
    finally:
        os.kill(controller.pid, signal.SIGKILL)
        controller.wait()
    give_up = time.monotonic() + 15
    left = {host.name: host.processes() for host in hosts}
    while any(left.values()) and time.monotonic() < give_up:
        time.sleep(0.1)
        left = {host.name: host.processes() for host in hosts}
    assert not any(left.values()), {
        name: [" ".join(p.cmdline()) for p in procs] for name, procs in left.items()
    }
    assert not [d for host in hosts for d in host.session_dirs()]


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
