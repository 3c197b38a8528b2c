"""Starting and stopping the session's watchdog process (no pytest imports here)."""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from pytest_elastic_timer.core import hostid, hostlink, startup, unpatched, wire
from pytest_elastic_timer.scope import client

STOP_TIMEOUT = 15.0

# A session may start and stop inside a test (pytester) that replaced time's, os's or
# subprocess's functions with mocks; Popen.wait(timeout) and Popen.kill() would go
# through time.sleep, time.monotonic and os.kill.
_Popen = unpatched.Popen
_PIPE = unpatched.PIPE
_now = unpatched.now
_kill = unpatched.kill
_select = unpatched.select
_pidfd_open = getattr(os, "pidfd_open", None)


class WatchdogError(RuntimeError):
    """The watchdog could not be started."""


def _session_root_dir() -> str | None:
    # tmpfs keeps the scope tables in memory; fall back to the usual temp dir.
    root = hostid.session_root()
    return root if root != tempfile.gettempdir() else None


def sweep_stale(root: str | None, older_than: float = 60.0) -> list[str]:
    """Remove session directories of ours whose watchdog is gone (it was SIGKILLed).

    A directory is stale when it belongs to this user, is older than ``older_than``
    seconds and nothing accepts connections on its socket.
    """
    removed = []
    pattern = os.path.join(root or tempfile.gettempdir(), "pytest-elastic-timer-*")
    for directory in glob.glob(pattern):
        try:
            st = os.lstat(directory)
        except OSError:
            continue
        if st.st_uid != os.getuid() or _now() - st.st_mtime < older_than:
            continue
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
            try:
                probe.connect(os.path.join(directory, "watchdog.sock"))
                continue  # a live watchdog
            except OSError:
                pass
        shutil.rmtree(directory, ignore_errors=True)
        removed.append(directory)
    return removed


@dataclass
class WatchdogHandle:
    """A running watchdog: its process, socket address and private directory."""

    proc: subprocess.Popen[bytes]
    address: str
    directory: str

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def records_path(self) -> str:
        return os.path.join(self.directory, "records.jsonl")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, session: dict[str, Any] | None = None) -> int | None:
        """Ask the watchdog to write its report and exit; wait for it; clean up."""
        if self.proc.stdin is not None and self.alive():
            try:
                command = json.dumps({"op": "stop", "session": session or {}})
                self.proc.stdin.write(command.encode() + b"\n")
                self.proc.stdin.flush()
                self.proc.stdin.close()
            except (OSError, ValueError):
                pass
        if not _wait_exit(self.proc, STOP_TIMEOUT):
            _end(self.proc)
        code = self.proc.wait()  # it has ended: a blocking waitpid reaps it at once
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        shutil.rmtree(self.directory, ignore_errors=True)
        return code


def _wait_exit(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Whether ``proc`` ended within ``timeout`` seconds, waited for in one poll of a
    pidfd (or of its stdout pipe, which reaches end-of-file when it exits): no clock,
    no sleep loop."""
    pidfd = -1
    if _pidfd_open is not None:
        try:
            pidfd = _pidfd_open(proc.pid)
        except OSError:
            pidfd = -1
    try:
        if pidfd >= 0:
            return bool(_select([pidfd], [], [], timeout)[0])
        if proc.stdout is None:
            return proc.poll() is not None
        fd = proc.stdout.fileno()
        while _select([fd], [], [], timeout)[0]:
            if not os.read(fd, 4096):
                return True  # end-of-file: the watchdog has closed it on exit
        return False
    finally:
        if pidfd >= 0:
            os.close(pidfd)


def _end(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            _kill(proc.pid, signal.SIGKILL)


def start(
    *,
    grace: float,
    scale: float,
    report: str | None,
    session: dict[str, Any],
    kill_after: float = 1.0,
    timeout: float = 30.0,
    dump_signal: int = 0,
    junit_xml: str | None = None,
    trace: bool = False,
) -> WatchdogHandle:
    """Start a watchdog for this process's session; returns once it accepts clients."""
    sweep_stale(_session_root_dir())
    directory = tempfile.mkdtemp(prefix="pytest-elastic-timer-", dir=_session_root_dir())
    os.chmod(directory, 0o700)
    # The folder that holds the package: pytest_elastic_timer/plugin/launcher.py, two up.
    package_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env.pop(client.ENV_ADDRESS, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH", "")) if p)
    argv = [
        sys.executable,
        "-m",
        "pytest_elastic_timer.watchdog",
        "--dir",
        directory,
        "--root-pid",
        str(os.getpid()),
        "--grace",
        repr(grace),
        "--kill-after",
        repr(kill_after),
        "--scale",
        repr(scale),
        "--session",
        json.dumps(session),
    ]
    if report:
        argv += ["--report", os.path.abspath(report)]
    if dump_signal:
        argv += ["--dump-signal", str(dump_signal)]
    if junit_xml:
        argv += ["--junit-xml", os.path.abspath(junit_xml)]
    if trace:
        argv.append("--trace")
    proc = _Popen(argv, stdin=_PIPE, stdout=_PIPE, env=env, close_fds=True)
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        ready = sel.select(timeout)
    line = proc.stdout.readline().decode(errors="replace").split() if ready else []
    if len(line) != 3 or line[0] != "ready":
        _end(proc)
        proc.wait()
        shutil.rmtree(directory, ignore_errors=True)
        raise WatchdogError(f"the watchdog did not start (it said {line!r})")
    return WatchdogHandle(proc, line[2], directory)


@dataclass
class HostWatchdog:
    """The watchdog of this host, which is not the controller's, joined by this worker."""

    directory: str
    link: hostlink.Link

    @property
    def address(self) -> str:
        return os.path.join(self.directory, "watchdog.sock")

    @property
    def records_path(self) -> str:
        return os.path.join(self.directory, "records.jsonl")

    @property
    def startup(self) -> str:
        """The session's start-up directory on this host (for PYTHONPATH)."""
        return os.path.join(self.directory, startup.DIRECTORY)


def join_host(
    token: str,
    *,
    grace: float,
    scale: float,
    worker: str,
    gateway_fds: list[int],
    dump_signal: int = 0,
    kill_after: float = 1.0,
    timeout: float = 30.0,
) -> HostWatchdog:
    """Join the watchdog of session ``token`` on this host; the first worker of the
    session here starts it (under a lock, so that the host gets one)."""
    identity = hostid.current()
    directory = hostid.host_directory(token, identity)
    sweep_stale(_session_root_dir())  # left by watchdogs of this host killed earlier
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(directory)
    if not os.path.isdir(directory) or os.path.islink(directory) or info.st_uid != os.getuid():
        raise WatchdogError(f"{directory} is not a directory of this user")
    lock = os.open(os.path.join(directory, "start.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return HostWatchdog(directory, hostlink.Link(directory, worker, gateway_fds))
        except (OSError, wire.BadMessage):
            pass  # nobody started it yet (or it is ending): start one
        startup.install(directory)
        _spawn_host_watchdog(
            directory, identity.hostname, grace, scale, kill_after, dump_signal, timeout
        )
        return HostWatchdog(directory, hostlink.Link(directory, worker, gateway_fds))
    finally:
        os.close(lock)


def _spawn_host_watchdog(
    directory: str,
    hostname: str,
    grace: float,
    scale: float,
    kill_after: float,
    dump_signal: int,
    timeout: float,
) -> None:
    """Start this host's watchdog in a session of its own: it outlives the worker that
    started it (the watchdog may have to end that very worker), and no Popen object of
    it is left in the worker to warn about a child still running at exit."""
    package_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env.pop(client.ENV_ADDRESS, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH", "")) if p)
    argv = [
        sys.executable,
        "-m",
        "pytest_elastic_timer.watchdog",
        "--dir",
        directory,
        "--root-pid",
        str(os.getpid()),
        "--grace",
        repr(grace),
        "--kill-after",
        repr(kill_after),
        "--scale",
        repr(scale),
        "--host-name",
        hostname,
        "--session",
        json.dumps({"host": hostname}),
    ]
    if dump_signal:
        argv += ["--dump-signal", str(dump_signal)]
    read_end, write_end = os.pipe()
    try:
        pid = os.posix_spawn(
            sys.executable,
            argv,
            env,
            file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                (os.POSIX_SPAWN_DUP2, write_end, 1),
            ],
            setsid=True,
        )
    finally:
        os.close(write_end)
    try:
        ready = _select([read_end], [], [], timeout)[0]
        line = os.read(read_end, 4096).decode(errors="replace").split() if ready else []
    finally:
        os.close(read_end)
    if len(line) != 3 or line[0] != "ready":
        with contextlib.suppress(OSError):
            _kill(pid, signal.SIGKILL)
        raise WatchdogError(f"the watchdog of this host did not start (it said {line!r})")
