"""Every test proves that it left no process and no session directory behind.

The autouse fixture ``no_leftovers`` tags the test's environment with a unique value
(inherited by every process the test starts, pytester's inner pytest and its watchdog
included), and after the test, allowing a few seconds for exits, fails the test if

- a child process of this process that was not there before still runs,
- any process carrying the tag still runs (a grandchild that outlived its parent),
- in particular a ``pytest_elastic_timer.watchdog`` process of the test still runs
  although the pytest process that started it is gone,
- a ``/dev/shm/pytest-elastic-timer-*`` directory created during the test remains that
  neither a running watchdog nor a running owner of a scope table in it still uses.

Processes are attributed by the tag, never by name alone: other sessions may run on the
same machine (and other xdist workers of this one), and their processes are not ours.

Stand-in hosts (``standin_hosts.py``, fixture ``stand_in_hosts``) are pid namespaces
whose processes are visible here under their outer pids: they carry the tag like any
other. The check runs while those hosts still exist (ending a host's pid 1 would end
everything in it and hide what was left), looks into each host's private /dev/shm as
well, and only then ends the hosts.
"""

from __future__ import annotations

import glob
import os
import time
import uuid
from collections.abc import Callable, Iterator

import psutil
import pytest
from standin_hosts import StandInHost, require

TAG_ENV = "ELASTIC_TIMER_TEST_TAG"
SESSION_DIRS = "/dev/shm/pytest-elastic-timer-*"
SETTLE = 3.0  # seconds a process or directory may take to go away after the test


def _key(proc: psutil.Process) -> tuple[int, float]:
    try:
        return proc.pid, proc.create_time()
    except psutil.Error:
        return proc.pid, 0.0


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _option(cmdline: list[str], name: str) -> str | None:
    if name in cmdline[:-1]:
        return cmdline[cmdline.index(name) + 1]
    return None


def _watchdogs() -> list[tuple[psutil.Process, list[str]]]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "pytest_elastic_timer.watchdog" in cmdline and _running(proc):
            found.append((proc, cmdline))
    return found


def _root_gone(watchdog: psutil.Process, cmdline: list[str]) -> bool:
    root = _option(cmdline, "--root-pid")
    if root is None or not root.isdigit():
        return False
    try:
        root_proc = psutil.Process(int(root))
        return not _running(root_proc) or root_proc.create_time() > watchdog.create_time()
    except psutil.Error:
        return True


def _tagged(tag: str) -> list[psutil.Process]:
    me = os.getpid()
    found = []
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        try:
            if proc.environ().get(TAG_ENV) == tag and _running(proc):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid} {' '.join(proc.cmdline())[:200]!r}"
    except psutil.Error:
        return f"{proc.pid} (gone)"


class Snapshot:
    """What runs and exists before a test, to compare with after it."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.me = psutil.Process()
        self.children = {_key(p) for p in self.me.children(recursive=True)}
        self.dirs = set(glob.glob(SESSION_DIRS))
        self.started = time.time()
        self.spare: set[tuple[int, float]] = set()  # the test's own helpers (hosts' pid 1)
        self.hosts: list[StandInHost] = []
        self.after_check: list[Callable[[], None]] = []

    def leftovers(self) -> tuple[list[psutil.Process], list[str]]:
        procs = {
            _key(p): p
            for p in self.me.children(recursive=True)
            if _key(p) not in self.children and _key(p) not in self.spare and _running(p)
        }
        tagged = {_key(p): p for p in _tagged(self.tag) if _key(p) not in self.spare}
        for host in self.hosts:  # untagged ones too: nothing else runs there
            tagged.update((_key(p), p) for p in host.processes())
        watchdogs = _watchdogs()
        for proc, cmdline in watchdogs:
            if _key(proc) in tagged and _root_gone(proc, cmdline):
                procs.setdefault(_key(proc), proc)  # an orphaned watchdog of this test
        for key, proc in tagged.items():
            procs.setdefault(key, proc)
        served = {_option(cmdline, "--dir") for _, cmdline in watchdogs}
        dirs = sorted(
            d
            for d in set(glob.glob(SESSION_DIRS)) - self.dirs
            if d not in served and _created(d) >= self.started - 0.5 and not _owners_alive(d)
        )
        # A host's watchdog names its directory as seen on that host.
        served_names = {os.path.basename(d) for d in served if d}
        dirs += sorted(
            d
            for host in self.hosts
            for d in host.session_dirs()
            if os.path.basename(d) not in served_names
        )
        return list(procs.values()), dirs


def _owners_alive(directory: str) -> bool:
    """Whether a process that owns a scope table in ``directory`` still runs."""
    for table in glob.glob(os.path.join(directory, "table-*-*")):
        pid = os.path.basename(table).split("-")[1]
        if pid.isdigit() and psutil.pid_exists(int(pid)):
            try:
                if _running(psutil.Process(int(pid))):
                    return True
            except psutil.Error:
                continue
    return False


def _created(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def _end(procs: list[psutil.Process]) -> None:
    """End processes this test left behind (all were started by this test)."""
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=3)


@pytest.fixture(autouse=True)
def no_leftovers(monkeypatch: pytest.MonkeyPatch) -> Iterator[Snapshot]:
    tag = uuid.uuid4().hex
    monkeypatch.setenv(TAG_ENV, tag)
    snapshot = Snapshot(tag)
    yield snapshot
    give_up = time.monotonic() + SETTLE
    procs, dirs = snapshot.leftovers()
    while (procs or dirs) and time.monotonic() < give_up:
        time.sleep(0.05)
        procs, dirs = snapshot.leftovers()
    try:
        if procs or dirs:
            lines = [f"process left behind: {_describe(p)}" for p in procs]
            lines += [f"session directory left behind: {d}" for d in dirs]
            _end(procs)
            pytest.fail("\n".join(lines), pytrace=False)
    finally:
        for callback in snapshot.after_check:
            callback()


@pytest.fixture
def stand_in_hosts(
    no_leftovers: Snapshot, tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., list[StandInHost]]:
    """``stand_in_hosts("host-a", "host-b")``: stand-in hosts (pid, mount and UTS
    namespaces) that live until the leftover check of the test is done; skips the test
    where namespaces cannot be made."""
    require()
    directory = tmp_path_factory.mktemp("hosts")

    def make(*names: str) -> list[StandInHost]:
        hosts = []
        for name in names:
            host = StandInHost(name, directory)
            no_leftovers.spare.update({_key(psutil.Process(host.holder.pid)), _key(host.init)})
            no_leftovers.hosts.append(host)
            no_leftovers.after_check.append(host.close)
            hosts.append(host)
        return hosts

    return make
