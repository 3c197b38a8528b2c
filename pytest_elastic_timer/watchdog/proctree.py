"""Process trees: who belongs to the session, and how a tree is ended.

Every process is identified by (pid, start time), never by pid alone, so a recycled pid
is never signalled. This module imports nothing from pytest.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import psutil

# The leftover-process check runs this in a test's process, where a test may have
# replaced os.kill, time.sleep, time.monotonic or open with a mock (psutil's own
# send_signal calls os.kill by name); this module is imported late, so the references
# come from core.unpatched, bound when the package was imported.
from pytest_elastic_timer.core.procstat import process_starttime
from pytest_elastic_timer.core.unpatched import kill as _kill
from pytest_elastic_timer.core.unpatched import listdir as _listdir
from pytest_elastic_timer.core.unpatched import monotonic as _monotonic
from pytest_elastic_timer.core.unpatched import open as _open
from pytest_elastic_timer.core.unpatched import sleep as _sleep


@dataclass(frozen=True)
class ProcessId:
    """A process identity that survives pid reuse: pid plus start time."""

    pid: int
    started: float

    @classmethod
    def of(cls, pid: int) -> ProcessId | None:
        try:
            return cls(pid, start_time(psutil.Process(pid)))
        except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
            return None

    def process(self) -> psutil.Process | None:
        """The live process with this identity, or None (gone, or pid reused)."""
        try:
            proc = psutil.Process(self.pid)
            if start_time(proc) != self.started or proc.status() == psutil.STATUS_ZOMBIE:
                return None
            return proc
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None

    def alive(self) -> bool:
        """Whether the process with this identity still runs (not a zombie)."""
        return self.process() is not None


def describe(proc: psutil.Process) -> dict[str, object]:
    try:
        cmdline = " ".join(proc.cmdline())[:300]
        name = proc.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        cmdline, name = "", "?"
    return {"pid": proc.pid, "name": name, "cmdline": cmdline}


def label_of(proc: psutil.Process) -> str:
    """``rank N`` from the process's RANK / LOCAL_RANK environment, else ""."""
    try:
        env = proc.environ()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return ""
    for name in ("RANK", "LOCAL_RANK"):
        value = env.get(name, "")
        if value.isdigit():
            return f"rank {value}"
    return ""


def _children_pids(pid: int) -> list[int] | None:
    """Direct children from /proc/<pid>/task/*/children (None where unavailable)."""
    try:
        tasks = _listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    pids: list[int] = []
    for task in tasks:
        try:
            with _open(f"/proc/{pid}/task/{task}/children", "rb") as f:
                pids.extend(int(p) for p in f.read().split())
        except (OSError, ValueError):
            return None
    return pids


def descendants(proc: psutil.Process) -> list[psutil.Process]:
    """Everything below ``proc``, parents before children.

    Linux: walks the kernel's children lists (psutil's way reads the stat file of every
    process on the machine, milliseconds an escalation should not wait for)."""
    found: list[psutil.Process] = []
    queue = [proc.pid]
    while queue:
        pids = _children_pids(queue.pop(0))
        if pids is None:
            try:
                return proc.children(recursive=True)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                return []
        for pid in pids:
            try:
                found.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                continue
            queue.append(pid)
    return found


def is_descendant(pid: int, root: ProcessId) -> bool:
    """Whether ``pid`` is ``root`` or runs below it (checked by start times)."""
    try:
        proc = psutil.Process(pid)
        chain = [proc, *proc.parents()]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
    return any(p.pid == root.pid and _started(p) == root.started for p in chain)


def _started(proc: psutil.Process) -> float:
    try:
        return start_time(proc)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return -1.0


def start_time(proc: psutil.Process) -> float:
    """When ``proc`` started, in seconds since the machine booted: what identifies it
    beside its pid. Not psutil's ``create_time()``, seconds since the epoch, which adds
    the boot time as the kernel says it at each call: a step of the system clock (a
    virtual machine's clock set again) moves that by whole seconds, and the session's
    root, compared with what was read at the start, was taken for another process,
    every process of the session refused. Where there is no ``/proc`` to read,
    psutil's ``create_time()``."""
    ticks = process_starttime(proc.pid)
    return ticks / _CLOCK_TICKS if ticks else proc.create_time()


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def tree_of(owner: psutil.Process, spare: set[int]) -> list[psutil.Process]:
    """``owner`` and everything below it, deepest first (children before parents).

    ``spare`` holds pids never to signal (the watchdog itself)."""
    tree = [p for p in descendants(owner) if p.pid not in spare]
    tree.reverse()
    if owner.pid not in spare:
        tree.append(owner)
    return tree


def send(procs: list[psutil.Process], signum: int) -> None:
    """Signal each process of ``procs`` that is still the same process."""
    for proc in procs:
        _signal(proc, signum)


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    """The processes of ``procs`` that still run (zombies count as gone)."""
    out = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


# Helpers multiprocessing starts once and keeps for the life of the process that uses
# it: none of them is a process a test started and waits for.
MULTIPROCESSING_SERVICES = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def is_multiprocessing_service(cmdline: list[str]) -> bool:
    """Whether ``cmdline`` runs one of :data:`MULTIPROCESSING_SERVICES`."""
    joined = " ".join(cmdline)
    return any(name in joined for name in MULTIPROCESSING_SERVICES)


def cmdline_of(proc: psutil.Process) -> list[str]:
    """``proc``'s command line ([] if gone or unreadable)."""
    try:
        return proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return []


def waiting(proc: psutil.Process) -> bool:
    """Whether ``proc``'s main thread sleeps (in a system call: a wait, a read), rather
    than runs (a C loop holding the GIL) or is gone."""
    try:
        return proc.status() in (psutil.STATUS_SLEEPING, psutil.STATUS_DISK_SLEEP)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _signal(proc: psutil.Process, signum: int) -> None:
    try:
        # is_running() compares the start time: a pid reused meanwhile is not signalled.
        if proc.is_running():
            _kill(proc.pid, signum)
    except (psutil.NoSuchProcess, psutil.AccessDenied, OSError, ValueError, OverflowError):
        # Gone, not ours, or not a signal: a signal number read from a process's own
        # table can be anything, and must never end the watchdog.
        pass


def end_all(procs: list[psutil.Process], kill_after: float) -> list[psutil.Process]:
    """SIGTERM ``procs`` (woken if stopped), SIGKILL what survives ``kill_after``;
    returns what still runs after that (a process in D state, say). Blocking: for the
    end of a test or of the session, not for the watchdog's event loop."""
    send(procs, signal.SIGTERM)
    send(procs, signal.SIGCONT)  # a stopped process acts on SIGTERM only once it runs
    survivors = wait_gone(procs, kill_after)
    send(survivors, signal.SIGKILL)
    return wait_gone(survivors, 2.0)


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait up to ``timeout`` for ``procs`` to end; returns those still running."""
    deadline = _monotonic() + timeout
    running = alive(procs)
    while running and _monotonic() < deadline:
        _sleep(0.02)
        running = alive(running)
    return running
