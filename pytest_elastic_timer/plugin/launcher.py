"""Starting and stopping the session's watchdog process (no pytest imports here)."""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import resource
import shutil
import signal
import socket
import sys
import tempfile
from typing import TYPE_CHECKING, Any

from pytest_elastic_timer.core import hostid, startup, unpatched, wire
from pytest_elastic_timer.scope import client

if TYPE_CHECKING:
    from pytest_elastic_timer.core import hostlink

STOP_TIMEOUT = 15.0

# A session may start and stop inside a test (pytester) that replaced time's, os's or
# subprocess's functions with mocks.
_now = unpatched.now
_kill = unpatched.kill
_select = unpatched.select
_posix_spawn = unpatched.posix_spawn
_waitpid = unpatched.waitpid
_waitid = unpatched.waitid
_pidfd_open = unpatched.pidfd_open

SOCKET_NAME = "watchdog.sock"  # in the session directory, as the watchdog names it
# Seconds the watchdog of a session whose end pytest does not wait for waits before it
# loads its modules (the ``--defer`` of ``python -m pytest_elastic_timer.watchdog``): a
# one-test session ends sooner, and its watchdog then loads them after pytest has gone,
# where they took a core beside it (or, with one core, half of pytest's). The
# processes of a session wait for the watchdog's answer meanwhile, as while it starts.
DEFER_UNWAITED = 0.3
# A deadline of pytest's own sooner than this after the start hurries such a watchdog:
# it would have loaded too late for it (loading takes some 0.1 s of a core).
HURRY_WITHIN = DEFER_UNWAITED + 0.2
HURRY_COMMAND = b'{"op": "hurry"}\n'
HOST_WATCHDOG_ERRORS = "watchdog.err"  # a host watchdog's stderr, in its directory
MAX_SOCKET_PATH = 107  # bytes of a socket's path: sun_path holds 108, with its NUL
LISTEN_BACKLOG = 128
# As Popen's restore_signals: Python ignores these, a new program should not.
_DEFAULT_SIGNALS = [getattr(signal, n) for n in ("SIGPIPE", "SIGXFSZ") if hasattr(signal, n)]


class WatchdogError(RuntimeError):
    """The watchdog could not be started."""


def sweep_stale(root: str, older_than: float = 60.0) -> list[str]:
    """Remove session directories of ours whose watchdog is gone (it was SIGKILLed).

    A directory is stale when it belongs to this user, is older than ``older_than``
    seconds and nothing accepts connections on its socket.
    """
    removed = []
    pattern = os.path.join(root, "pytest-elastic-timer-*")
    for directory in glob.glob(pattern):
        try:
            st = os.lstat(directory)
        except OSError:
            continue
        if st.st_uid != os.getuid() or _now() - st.st_mtime < older_than:
            continue
        with unpatched.Socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
            try:
                unpatched.connect(probe, os.path.join(directory, SOCKET_NAME))
                continue  # a live watchdog
            except OSError:
                pass
        shutil.rmtree(directory, ignore_errors=True)
        removed.append(directory)
    return removed


class WatchdogHandle:
    """A running watchdog: its process, socket address and private directory.

    The process is started with ``posix_spawn``, not ``subprocess.Popen``: a session
    that has nothing to read back from it does not wait for it to end, and a Popen
    object of a process that still runs warns when it is collected.
    """

    def __init__(
        self,
        pid: int,
        address: str,
        directory: str,
        control: int,
        pidfd: int = -1,
        *,
        shell: tuple[int, int] | None = None,
    ) -> None:
        self._pid = pid
        self.address = address
        self.directory = directory
        self.control = control  # the write end of the watchdog's stdin (-1 once closed)
        self._pidfd = pidfd  # a pidfd of the watchdog, -1 where the kernel has none
        # Not this process's child (see _spawn_detached): watched through its pidfd,
        # and never reaped here. Its pid is read from what its shell says (its pid and
        # the read end of its stdout) when first asked for: by then the shell has said
        # it, and nothing waited for it.
        self.detached = shell is not None
        self._shell = shell
        # Its exit status once it ended; for a detached one, whose status is its new
        # parent's to read, 0 if it ended by itself (it removes its directory), else -1.
        self.returncode: int | None = None
        # Stopped without waiting, and nothing of it kept (see stop): nothing more to
        # learn of it here, and its pid may be another process's by now.
        self.let_go = False
        self.hurried = False  # told to load now (see hurry)

    @property
    def pid(self) -> int:
        self._hear_shell()
        return self._pid

    def hurry(self) -> None:
        """Have a watchdog that loads late (``defer``) load now, once: a deadline of
        this process comes before it would have. Nothing once it was stopped."""
        if self.control >= 0 and not self.hurried:
            self.hurried = True
            with contextlib.suppress(OSError):  # gone: the clients learn it themselves
                unpatched.write(self.control, HURRY_COMMAND)

    @property
    def pidfd(self) -> int:
        self._hear_shell()
        return self._pidfd

    def reap_its_shell(self) -> None:
        """Reap the shell that started a detached watchdog, which has said its pid by
        now: a test that waits for any child of the process (``os.wait()``) must not
        find that shell."""
        self._hear_shell()

    def _hear_shell(self) -> None:
        """A detached watchdog's pid and pidfd, from its shell (once). One whose shell
        said no pid, or that ended already, counts as ended."""
        if self._shell is None:
            return
        (shell, said), self._shell = self._shell, None
        try:
            ready = _select([said], [], [], SPAWN_TIMEOUT)[0]
            text = os.read(said, 64).decode(errors="replace").strip() if ready else ""
        finally:
            os.close(said)
            with contextlib.suppress(ChildProcessError):
                _waitpid(shell, 0)  # it said the pid: it ends now
        assert _pidfd_open is not None  # a detached watchdog is watched through it
        try:
            self._pid = int(text)
            self._pidfd = _pidfd_open(self._pid)
        except (ValueError, OSError):
            self.returncode = -1

    @property
    def records_path(self) -> str:
        return os.path.join(self.directory, "records.jsonl")

    def alive(self) -> bool:
        if self.returncode is not None or self.let_go:
            return False
        if self.pidfd >= 0:
            return not _select([self.pidfd], [], [], 0)[0]
        return not self._reap(block=False)

    def stop(self, session: dict[str, Any] | None = None, wait: bool = True) -> int | None:
        """Ask the watchdog to write its report and exit. With ``wait``, wait for it
        and clean up; without, it is reaped by a later start or stop, or is left to the
        kernel when this process exits (it ends by itself on the stop command, and on
        end-of-file of its stdin)."""
        if self.control >= 0:
            stop = {"op": "stop", "session": session or {}, "waited": wait}
            command = unpatched.dumps(stop).encode() + b"\n"
            with contextlib.suppress(OSError):
                os.write(self.control, command)
            os.close(self.control)
            self.control = -1
        if self.let_go:
            return None
        if not wait and self.pidfd >= 0 and self.alive():
            if self.detached and not self._adopted():
                # Nobody's child here: nothing to reap, and it removes its directory
                # as it ends (sweep_stale, one it left). The process may go on after
                # its session (pytest.main() in a script): no descriptor stays open.
                os.close(self._pidfd)
                self._pidfd = -1
                self.let_go = True
                return None
            _unreaped.append(self)
            return None
        if self.returncode is None and not self._wait(STOP_TIMEOUT):
            self._kill()
        self._reap(block=True)
        return self.returncode

    def _adopted(self) -> bool:
        """Whether this process adopted its detached watchdog (it was a subreaper when
        the watchdog's shell ended: the leak check of a session that uses the plugin),
        and so is to reap it."""
        if _waitid is None:
            return True  # cannot tell: kept, and reaped if it is a child
        try:
            _waitid(os.P_PIDFD, self.pidfd, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return False
        except OSError:
            return True
        return True

    def discard(self) -> None:
        """End a watchdog that has served nobody at once (SIGKILL), reap it and remove
        its directory: for a session that ends before its watchdog came up."""
        if self.control >= 0:
            os.close(self.control)
            self.control = -1
        if self.let_go:
            return
        if self.returncode is None:
            self._kill()
        self._reap(block=True)

    def _kill(self) -> None:
        """SIGKILL, through the pidfd where there is one: a detached watchdog's pid may
        be another process's by now."""
        with contextlib.suppress(OSError):  # ProcessLookupError too: it ended
            if self.pidfd >= 0:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            else:
                _kill(self.pid, signal.SIGKILL)

    def _wait(self, timeout: float) -> bool:
        """Whether the watchdog ended within ``timeout`` seconds, waited for in one
        select on its pidfd: no clock, no sleep loop. Without a pidfd the caller reaps
        it with a blocking waitpid instead."""
        if self.pidfd < 0:
            return True
        return bool(_select([self.pidfd], [], [], timeout)[0])

    def _reap(self, block: bool) -> bool:
        """Collect the watchdog's exit status if it has ended (waiting for it with
        ``block``); whether it has. Once ended, its directory goes too: a watchdog
        removes it itself, unless it never ran or was killed."""
        if self.let_go:
            return True  # not known here, nor to be removed: it may still run
        if self.returncode is None and self.detached and self.pidfd >= 0:
            if not _select([self.pidfd], [], [], None if block else 0)[0]:
                return False
            self.returncode = -1 if os.path.exists(self.directory) else 0
            # Adopted after all where this process is a subreaper (the leak check of a
            # session that runs this one in-process): then it is ours to reap.
            with contextlib.suppress(ChildProcessError):
                _waitpid(self.pid, os.WNOHANG)
        if self.returncode is None:
            flags = 0 if block else os.WNOHANG
            try:
                if self.pidfd >= 0 and _waitid is not None:
                    result = _waitid(os.P_PIDFD, self.pidfd, os.WEXITED | flags)
                    if result is None:
                        return False
                    code = result.si_status
                    self.returncode = -code if result.si_code != os.CLD_EXITED else code
                else:
                    done, status = _waitpid(self.pid, flags)
                    if not done:
                        return False
                    self.returncode = os.waitstatus_to_exitcode(status)
            except ChildProcessError:
                self.returncode = -1  # reaped by someone else (a test's os.wait())
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self._pidfd = -1
        shutil.rmtree(self.directory, ignore_errors=True)
        return True


# Watchdogs stopped without waiting: reaped once they have ended, at the next start or
# stop of a session in this process (pytester's in-process sessions).
_unreaped: list[WatchdogHandle] = []


def reap_stopped() -> None:
    """Reap the watchdogs stopped without waiting that have ended since."""
    _unreaped[:] = [handle for handle in _unreaped if not handle._reap(block=False)]


def _inheritable_fds(keep: set[int]) -> list[int]:
    """This process's inheritable descriptors other than ``keep``: closed in the
    watchdog as Popen's ``close_fds`` would (a test's pipe must not stay open in it).

    Not one at or above the soft limit on open files (opened before the limit was
    lowered): ``posix_spawn`` refuses to close it (EBADF), and the watchdog would not
    start at all. The watchdog closes those itself as it starts."""
    try:
        names = unpatched.listdir("/proc/self/fd")
    except OSError:
        return []
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    found = []
    for name in names:
        fd = int(name)
        if fd in keep or 0 <= limit <= fd:
            continue
        with contextlib.suppress(OSError):
            if os.get_inheritable(fd):
                found.append(fd)
    return found


def start(
    *,
    grace: float,
    scale: float,
    report: str | None,
    session: dict[str, Any],
    kill_after: float = 1.0,
    dump_signal: int = 0,
    junit_xml: str | None = None,
    trace: bool = False,
    defer: float = 0.0,
) -> WatchdogHandle:
    """Start a watchdog for this process's session, without waiting for it.

    With ``defer``, the watchdog loads its modules only once the session has run that
    many seconds, or at its end: for a session whose end this process does not wait
    for (see :data:`DEFER_UNWAITED`).

    The session's socket is bound and listening before the watchdog process starts
    (it inherits the socket, as socket activation does): a process may connect at once,
    and its connection waits in the backlog until the watchdog accepts it. A watchdog
    that never comes up closes the socket by exiting, and its clients read end-of-file.
    The torch file-timer FIFO is made the same way, its read end inherited: a torch
    ``FileTimerClient`` can open it for writing at once (without a reader, the open
    fails and torch raises BrokenPipeError), and its requests wait in the pipe.
    """
    reap_stopped()
    if _posix_spawn is None:
        raise WatchdogError("this platform has no posix_spawn")
    root = hostid.session_root()
    sweep_stale(root)
    directory = tempfile.mkdtemp(prefix="pytest-elastic-timer-", dir=root)
    os.chmod(directory, 0o700)
    address = os.path.join(directory, SOCKET_NAME)
    env = _watchdog_env()
    fifo = os.path.join(directory, startup.TORCH_TIMER_FIFO)
    fifo_fd = -1
    try:
        _check_socket_path(address, "this host")
        os.mkfifo(fifo, 0o600)
        fifo_fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        with unpatched.Socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listener:
            listener.bind(address)
            os.chmod(address, 0o600)
            listener.listen(LISTEN_BACKLOG)
            argv = [
                *_watchdog_argv(directory, grace, kill_after, scale),
                "--session",
                unpatched.dumps(session),
            ]
            if report:
                argv += ["--report", os.path.abspath(report)]
            if dump_signal:
                argv += ["--dump-signal", str(dump_signal)]
            if junit_xml:
                argv += ["--junit-xml", os.path.abspath(junit_xml)]
            if trace:
                argv.append("--trace")
            if defer > 0:
                argv += ["--defer", repr(defer)]
            detached = _spawn_detached(argv, env, listener.fileno(), fifo_fd)
            if detached is None:  # no pidfds or no shell here: a child of this process
                argv += ["--listen-fd", str(listener.fileno()), "--fifo-fd", str(fifo_fd)]
                pid, control = _spawn(argv, env, [listener.fileno(), fifo_fd])
                pidfd = -1
                if _pidfd_open is not None:
                    with contextlib.suppress(OSError):
                        pidfd = _pidfd_open(pid)
                handle = WatchdogHandle(pid, address, directory, control, pidfd)
            else:
                shell, said, control = detached
                handle = WatchdogHandle(0, address, directory, control, shell=(shell, said))
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    finally:
        if fifo_fd >= 0:
            os.close(fifo_fd)  # the watchdog's now
    return handle


# How the watchdog is started apart from pytest: a shell runs it in the background and
# ends, so the watchdog is nobody's child here (init, or a subreaper above, adopts it).
# A suite that waits for all its children (os.wait() until ChildProcessError) would
# otherwise wait for the watchdog, all session long. The shell gets the listening socket
# on 3, the FIFO's read end on 4 and the watchdog's stdin on 5 (a background command's
# stdin is /dev/null otherwise), and says the watchdog's pid on its stdout.
_SHELL = "/bin/sh"
_DETACH = '"$@" --listen-fd 3 --fifo-fd 4 <&5 5<&- >/dev/null & echo $!'
SPAWN_TIMEOUT = 10.0  # seconds the shell may take to say the watchdog's pid


def _spawn_detached(
    argv: list[str], env: dict[str, str], listener: int, fifo: int
) -> tuple[int, int, int] | None:
    """Start ``argv`` as an orphan (see :data:`_DETACH`) with the listening socket and
    the FIFO, without waiting: the shell's pid, the read end of its stdout (where it
    says the watchdog's pid), and the write end of the watchdog's stdin. None where
    that cannot be done here (the watchdog is watched through a pidfd)."""
    if not _pidfds_work() or not os.access(_SHELL, os.X_OK):
        return None
    assert _posix_spawn is not None  # start() checked
    read_end, write_end = os.pipe()
    said, saying = os.pipe()
    # Above 3, 4 and 5, so that putting each in its place overwrites none of the others.
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (listener, fifo, read_end)]
    try:
        actions: list[tuple[Any, ...]] = [
            (os.POSIX_SPAWN_CLOSE, fd) for fd in _inheritable_fds({0, 1, 2})
        ]
        actions += [
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            (os.POSIX_SPAWN_DUP2, saying, 1),
            *((os.POSIX_SPAWN_DUP2, fd, to) for fd, to in zip(high, (3, 4, 5), strict=True)),
        ]
        shell = _posix_spawn(
            _SHELL,
            [_SHELL, "-c", _DETACH, "sh", *argv],
            env,
            file_actions=actions,
            setsigdef=_DEFAULT_SIGNALS,
        )
    except OSError:
        os.close(write_end)
        os.close(said)
        return None
    finally:
        for fd in (*high, read_end, saying):
            os.close(fd)
    return shell, said, write_end


def _pidfds_work() -> bool:
    """Whether this kernel (and whatever runs this process: valgrind has none) gives
    pidfds; asked once."""
    global _PIDFDS
    if _PIDFDS is None:
        _PIDFDS = False
        if _pidfd_open is not None:
            try:
                os.close(_pidfd_open(unpatched.getpid()))
                _PIDFDS = True
            except OSError:
                pass
    return _PIDFDS


_PIDFDS: bool | None = None


def _spawn(argv: list[str], env: dict[str, str], passed: list[int]) -> tuple[int, int]:
    """Start ``argv`` with a pipe as stdin (its write end returned), stdout to
    /dev/null and the descriptors ``passed`` inherited; its pid and the pipe's write
    end."""
    assert _posix_spawn is not None
    read_end, write_end = os.pipe()
    try:
        for fd in passed:
            os.set_inheritable(fd, True)
        actions: list[tuple[Any, ...]] = [
            (os.POSIX_SPAWN_DUP2, read_end, 0),
            (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
        ]
        actions += [(os.POSIX_SPAWN_CLOSE, fd) for fd in _inheritable_fds({0, 1, 2, *passed})]
        pid = _posix_spawn(argv[0], argv, env, file_actions=actions, setsigdef=_DEFAULT_SIGNALS)
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    return pid, write_end


def _check_socket_path(address: str, where: str) -> None:
    """WatchdogError naming ``address`` if it is too long for a socket's address (the
    temp directory of ``where`` is): said as such, not as bind()'s error."""
    if len(os.fsencode(address)) > MAX_SOCKET_PATH:
        raise WatchdogError(
            f"the watchdog's socket on {where} would be {address!r}, longer than a socket "
            f"address may be ({MAX_SOCKET_PATH} bytes): set TMPDIR to a shorter directory "
            "there (or make /dev/shm writable)"
        )


class HostWatchdog:
    """The watchdog of this host, which is not the controller's, joined by this worker."""

    def __init__(self, directory: str, link: hostlink.Link) -> None:
        self.directory = directory
        self.link = link

    @property
    def address(self) -> str:
        return os.path.join(self.directory, "watchdog.sock")

    @property
    def records_path(self) -> str:
        return os.path.join(self.directory, "records.jsonl")


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
    from pytest_elastic_timer.core import hostlink  # only a worker on another host

    identity = hostid.current()
    directory = hostid.host_directory(token, identity)
    _check_socket_path(os.path.join(directory, SOCKET_NAME), f"host {identity.hostname}")
    sweep_stale(hostid.session_root())  # left by watchdogs of this host killed earlier
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
        try:
            _spawn_host_watchdog(
                directory, identity.hostname, grace, scale, kill_after, dump_signal, timeout
            )
        except WatchdogError:
            shutil.rmtree(directory, ignore_errors=True)  # nothing of it is left here
            raise
        return HostWatchdog(directory, hostlink.Link(directory, worker, gateway_fds))
    finally:
        os.close(lock)


_MEASURING = ("COVERAGE_PROCESS_", "COV_CORE_")


def _watchdog_env() -> dict[str, str]:
    """The environment of a watchdog process: this one's, without a session to join,
    with the package importable from where it lies."""
    # The folder that holds the package: pytest_elastic_timer/plugin/launcher.py, two up.
    package_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env.pop(client.ENV_ADDRESS, None)
    # Nor is it measured: coverage.py's subprocess measurement (its .pth file reads
    # these) would write the watchdog's data after pytest-cov combined the tests'.
    for name in [n for n in env if n.startswith(_MEASURING)]:
        del env[name]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH", "")) if p)
    return env


# ``python -m pytest_elastic_timer.watchdog``, with the working directory kept off the
# watchdog's sys.path: a module of the user's project named like one of the standard
# library's (a token.py or a json.py at the project's root) would stand in for it, and
# the watchdog would die at start-up. Python 3.10 has no -P: a bootstrap drops the
# directory, which -c puts first, and runs the module as -m would.
_WATCHDOG_MODULE = (
    [sys.executable, "-P", "-m", "pytest_elastic_timer.watchdog"]
    if sys.version_info >= (3, 11)
    else [
        sys.executable,
        "-c",
        # sys is built in; runpy, and what it imports, comes after the directory went.
        "import sys; del sys.path[0]; import runpy; "
        "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)",
        "pytest_elastic_timer.watchdog",
    ]
)


def _watchdog_argv(directory: str, grace: float, kill_after: float, scale: float) -> list[str]:
    """The command line every watchdog starts with: its directory, the pytest process
    it serves, and the session's grace, kill delay and scale."""
    return [
        *_WATCHDOG_MODULE,
        "--dir",
        directory,
        "--root-pid",
        str(unpatched.getpid()),
        "--grace",
        repr(grace),
        "--kill-after",
        repr(kill_after),
        "--scale",
        repr(scale),
    ]


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
    env = _watchdog_env()
    argv = [
        *_watchdog_argv(directory, grace, kill_after, scale),
        "--host-name",
        hostname,
        "--session",
        unpatched.dumps({"host": hostname}),
    ]
    if dump_signal:
        argv += ["--dump-signal", str(dump_signal)]
    # Its stderr goes to a file of its directory, not the worker's: that is the
    # controller's stderr (or an ssh channel), which a watchdog lingering for a
    # replacement worker would hold open after pytest exits.
    errors = os.path.join(directory, HOST_WATCHDOG_ERRORS)
    read_end, write_end = os.pipe()
    try:
        pid = os.posix_spawn(
            sys.executable,
            argv,
            env,
            file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                (os.POSIX_SPAWN_DUP2, write_end, 1),
                (os.POSIX_SPAWN_OPEN, 2, errors, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600),
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
        said = _last_line(errors) or f"it said {line!r}"
        raise WatchdogError(f"the watchdog of host {hostname} did not start ({said})")


def _last_line(path: str) -> str:
    """The last line of the file ``path`` (a traceback's, the error), or ""."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
            lines = f.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1] if lines else ""
