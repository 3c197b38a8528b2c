"""Processes a test leaves running: found after the test, reported, and ended.

A process is a test's leak when it became a child of the test process during the test's
call phase (fixtures start their servers in setup, which is left out) and still runs
when the test's teardown is over. The pytest process is made a child subreaper (Linux),
so a double-forked daemon or a grandchild whose parent exited is adopted by it and seen
too. Children are read from ``/proc/self/task/*/children``: two small reads per test,
compared as bytes.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from typing import TYPE_CHECKING, Any

from pytest_elastic_timer.core import afterfork, unpatched
from pytest_elastic_timer.core import table as tbl
from pytest_elastic_timer.core.plain_imports import plainly
from pytest_elastic_timer.scope import client

if TYPE_CHECKING:
    import psutil

# psutil and proctree are imported where a leak is looked at: loading psutil into every
# pytest process costs start-up time and some 2,000 objects that every full garbage
# collection walks.

# Seconds a process a test left has to end by itself before it counts as left running:
# a producer finishing its last item, a server shutting down, a child not joined yet.
SETTLE = 1.0

_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37


@functools.cache
def _prctl() -> Any:
    # Loaded by the first session that adopts orphans: one that does not never pays
    # for ctypes. The process's own symbols include libc's: ctypes.util.find_library
    # would run ldconfig in a subprocess.
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl


def become_subreaper() -> bool:
    """Adopt orphaned descendants (Linux); False where the system does not support it."""
    return _set_subreaper(1)


def _set_subreaper(value: int) -> bool:
    if not os.path.exists("/proc/self/task"):
        return False
    try:
        return bool(_prctl()(_PR_SET_CHILD_SUBREAPER, value, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def is_subreaper() -> bool:
    """Whether this process adopts its orphaned descendants (Linux)."""
    if not os.path.exists("/proc/self/task"):
        return False
    try:
        import ctypes

        flag = ctypes.c_int(0)
        return bool(_prctl()(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) == 0 and flag)
    except (OSError, AttributeError):
        return False


class Watch:
    """This process, ready to look for the leaks of a session's tests: made a
    subreaper when the session asks for it (:meth:`adopt_orphans`), and left as it was
    found (:meth:`leave`), for a session run inside a test of another."""

    def __init__(self) -> None:
        self.adopting = False
        self._was_subreaper = False
        self._files = dict(_children_fds)
        self._main = _main_children[0]

    def adopt_orphans(self) -> None:
        """Become a subreaper (once): orphaned descendants are adopted from now on."""
        if not self.adopting:
            self.adopting = True
            self._was_subreaper = is_subreaper()
            if not self._was_subreaper:
                become_subreaper()

    def leave(self) -> None:
        """The subreaper flag off again if it was off (orphans adopted meanwhile stay
        children: the kernel has no way back), the procfs files this session opened
        closed."""
        reap_adopted()
        if self.adopting and not self._was_subreaper:
            _set_subreaper(0)
        opened = [k for k, fd in _children_fds.items() if self._files.get(k) != fd]
        for key in opened:
            _close_children_file(key)
        if _main_children[0] != self._main:
            with contextlib.suppress(OSError):
                unpatched.close(_main_children[0])
            _main_children[0] = self._main


def joined_the_session(directory: str, pids: set[int]) -> bool:
    """Whether any of ``pids`` entered a scope of the session in ``directory`` (its
    scope table is there)."""
    try:
        names = unpatched.listdir(directory) if directory else []
    except OSError:
        return False
    return any(tbl.pid_of_file(name) in pids for name in names)


_children_fds: dict[tuple[int, str], int] = {}  # (pid, task) -> open procfs fd


def _read_children(task: str) -> bytes:
    # A kept-open procfs file read again at offset 0 is generated anew: one pread
    # instead of open+read+close for every test.
    key = (unpatched.getpid(), task)
    fd = _children_fds.get(key)
    if fd is None:
        fd = _children_fds[key] = _open_children(task)
    data = unpatched.pread(fd, 4096, 0)
    while len(data) % 4096 == 0 and data:  # more children than one page holds
        more = unpatched.pread(fd, 4096, len(data))
        if not more:
            break
        data += more
    return data


def _open_children(task: str) -> int:
    return unpatched.open_fd(f"/proc/self/task/{task}/children", os.O_RDONLY)


def snapshot() -> bytes:
    """This process's children (any thread's) as the kernel lists them: compared as
    bytes first, so that a test that started nothing costs one read and no parsing."""
    # threading.active_count() without its lock: a thread starting right now is one
    # the test started, and its children are read after the test anyway.
    if (len(_active) == 1 or _only_our_threads_beside_main()) and not _limbo:
        fd = _main_children[0]
        if fd >= 0 or (fd := _main_fd()) >= 0:
            # Small enough for Python's own allocator: a page-sized buffer would cost
            # a malloc, a realloc and a free for every test.
            data = unpatched.pread(fd, _FIRST_READ, 0)
            if len(data) < _FIRST_READ:
                return data
    main = threading.main_thread().native_id or unpatched.getpid()
    try:
        tasks = unpatched.listdir("/proc/self/task")
    except OSError:
        tasks = [str(main)]
    _close_files_of_ended_threads(tasks)
    parts = []
    for task in tasks:
        try:
            parts.append(_read_children(task))
        except OSError:
            _close_children_file((unpatched.getpid(), task))
    return b" ".join(parts)


def _close_files_of_ended_threads(tasks: list[str]) -> None:
    # A suite whose fixture starts a thread for every test would otherwise keep a file
    # open for each thread it ever had, until the open fails ("Too many open files").
    if len(_children_fds) > len(tasks):
        pid = unpatched.getpid()
        alive = set(tasks)
        for key in [key for key in _children_fds if key[0] != pid or key[1] not in alive]:
            _close_children_file(key)


def _close_children_file(key: tuple[int, str]) -> None:
    """Close the kept-open children file of ``key`` (pid, task), if there is one."""
    fd = _children_fds.pop(key, -1)
    if fd >= 0:
        with contextlib.suppress(OSError):
            unpatched.close(fd)


def _only_our_threads_beside_main() -> bool:
    """Whether every thread but the main one is one of the package's own, which start
    no processes (the standby thread while the watchdog comes up, say)."""
    main = threading.main_thread()
    return all(
        thread is main or thread.name.startswith(client.THREAD_PREFIX)
        for thread in list(_active.values())
    )


_active: dict[int, threading.Thread] = threading._active  # type: ignore[attr-defined]
_limbo: dict[object, object] = threading._limbo  # type: ignore[attr-defined]
_main_children = [-1]  # open procfs fd of the main thread's children (-1: none yet)
_FIRST_READ = 256  # bytes: some forty children, in the common case of the main thread


def _main_fd() -> int:
    fd = _main_children[0]
    if fd < 0:
        main = threading.main_thread().native_id or unpatched.getpid()
        try:
            fd = _main_children[0] = _open_children(str(main))
        except OSError:
            return -1
    return fd


def _forget_after_fork() -> None:
    # The child's main thread has another id: its parent's files name the parent.
    for fd in [*_children_fds.values(), _main_children[0]]:
        if fd >= 0:
            with contextlib.suppress(OSError):
                unpatched.close(fd)
    _children_fds.clear()
    _main_children[0] = -1


afterfork.call_in_child(_forget_after_fork)


def pids_of(listing: bytes) -> set[int]:
    """The pids of a :func:`snapshot`."""
    return {int(p) for p in listing.split() if p.isdigit()}


# The watchdog of a pytest session the test ran (pytester's runpytest_subprocess, say)
# whose pytest ended through os._exit or a kill: the subreaper adopted it. It is this
# plugin's own machinery, not the test's leak, and it ends by itself within a second
# of its pytest process, after writing that session's report: neither ended nor named.
_MACHINERY = "pytest_elastic_timer.watchdog"
_adopted: set[int] = set()  # such watchdogs, reaped once they have ended


def is_service(pid: int) -> bool:
    """Whether ``pid`` is one of multiprocessing's long-lived helper processes, or the
    watchdog of a pytest session run inside the test, left to end by itself."""
    import psutil

    with plainly():
        from pytest_elastic_timer.watchdog import proctree

    reap_adopted()
    try:
        cmdline = psutil.Process(pid).cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    if _MACHINERY in cmdline and "--root-pid" in cmdline:
        _adopted.add(pid)
        return True
    # Multiprocessing's helpers, kept for the life of the process: not leaks.
    return proctree.is_multiprocessing_service(cmdline)


def reap_adopted() -> None:
    """Reap the adopted watchdogs of inner sessions that have ended."""
    for pid in list(_adopted):
        try:
            done, _ = unpatched.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            _adopted.discard(pid)


def end_leaks(pids: set[int], kill_after: float = 1.0) -> list[dict[str, object]]:
    """End the trees of ``pids`` that still run; reap those that are our children.

    Returns a description of each process that was still running.
    """
    import psutil

    with plainly():
        from pytest_elastic_timer.watchdog import proctree

    procs: list[psutil.Process] = []
    for pid in sorted(pids):
        try:
            proc = psutil.Process(pid)
        except psutil.NoSuchProcess:
            continue
        if proc.status() == psutil.STATUS_ZOMBIE:
            _reap(pid)
            continue
        procs.extend(proctree.tree_of(proc, {unpatched.getpid()}))
    if not procs:
        return []
    described = [proctree.describe(p) for p in procs]
    proctree.end_all(procs, kill_after)
    for pid in pids:
        _reap(pid)
    return described


def still_running_after(pids: set[int], timeout: float = SETTLE) -> set[int]:
    """Those of ``pids`` that still run after waiting up to ``timeout`` seconds for them
    to end by themselves (returns as soon as all have). None is reaped: whoever started
    them still collects its exit status (multiprocessing and subprocess need it)."""
    deadline = unpatched.monotonic() + timeout
    if unpatched.pidfd_open is None:
        return _poll_until_ended(pids, deadline)
    waiting: dict[int, int] = {}  # pidfd -> pid; a pidfd reads ready once its process ended
    try:
        for pid in pids:
            try:
                waiting[unpatched.pidfd_open(pid)] = pid
            except ProcessLookupError:
                continue  # ended and reaped already
            except OSError:  # no pidfds here after all
                return _poll_until_ended(pids, deadline)
        while waiting:
            left = deadline - unpatched.monotonic()
            if left <= 0:
                break
            for fd in unpatched.select(list(waiting), [], [], left)[0]:
                del waiting[fd]
                unpatched.close(fd)
        return set(waiting.values())
    finally:
        for fd in waiting:
            unpatched.close(fd)


def _poll_until_ended(pids: set[int], deadline: float) -> set[int]:
    import psutil

    with plainly():
        from pytest_elastic_timer.watchdog import proctree

    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.append(psutil.Process(pid))
    while (procs := proctree.alive(procs)) and unpatched.monotonic() < deadline:
        unpatched.select([], [], [], 0.02)
    return {proc.pid for proc in procs}


def describe_running(pids: set[int]) -> list[dict[str, object]]:
    """A description of each of ``pids`` that still runs (left running)."""
    import psutil

    with plainly():
        from pytest_elastic_timer.watchdog import proctree

    procs = []
    for pid in sorted(pids):
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    return [proctree.describe(p) for p in proctree.alive(procs)]


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError, OSError):
        unpatched.waitpid(pid, os.WNOHANG)
