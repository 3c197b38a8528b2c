"""Stack dumps: every thread's Python stack of a process, taken from outside.

A process that enters scopes registers faulthandler on a dump signal of its own (the
table's ``H_DUMP_SIG``); every Python process of the session also has the session's
dump signal, installed by the start-up hook. faulthandler's handler is C code that
writes the stacks from the signal handler without the GIL, so a dump works while a C
call holds it. The watchdog sends the signal and reads what was appended to the
process's dump file once it has stopped growing (0.3 s at most).

The processes below an expired scope's owner are asked for their dumps first; the owner
is interrupted as soon as every one of them has written its dump (its handler has
returned: a millisecond or two, 50 ms at most), since a harness tears its ranks down as
soon as the owner fails; the files are read afterwards.

The waits are steps of the escalation ladder: each function here is a generator that
yields the delay until it looks at the file again, and returns the text.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Iterable
from dataclasses import dataclass, field
from typing import Any

import psutil

from pytest_elastic_timer.core import startup
from pytest_elastic_timer.core import table as tbl
from pytest_elastic_timer.watchdog import proctree
from pytest_elastic_timer.watchdog.loop import Clock
from pytest_elastic_timer.watchdog.owners import Owner

DUMP_FRAMES = 25  # innermost frames kept per thread of a faulthandler dump
PATIENCE = 0.3  # the longest wait for a dump file to stop growing
WRITTEN_WITHIN = 0.05  # the longest wait, before an interrupt, for asked dumps
WRITTEN_POLL = 0.001  # how often they are looked at meanwhile (select()'s unit)


class Dumper:
    """Takes the stacks of a scope's owner and of the processes below it."""

    def __init__(self, directory: str, dump_signal: int, clock: Clock) -> None:
        self.directory = directory
        self.dump_signal = dump_signal  # the session's: every Python process of it
        self.clock = clock
        # pid -> (when, the dump asked of it then), to ask a process once per moment
        self._recent: dict[int, tuple[float, ChildDump]] = {}

    def owner(self, owner: Owner) -> Generator[float, None, str]:
        """Every thread's stack of ``owner`` ("" if it has no dump handler or is gone)."""
        signum = int(owner.table.words[tbl.H_DUMP_SIG])
        if not signum or not owner.dump_path or not proctree.alive([owner.proc]):
            return ""
        try:
            offset = os.path.getsize(owner.dump_path)
        except OSError:
            return ""
        proctree.send([owner.proc], signum)
        size, stable_since = offset, self.clock()
        give_up = stable_since + PATIENCE
        while self.clock() < give_up:
            yield 0.002
            try:
                now_size = os.path.getsize(owner.dump_path)
            except OSError:
                return ""
            if now_size != size:
                size, stable_since = now_size, self.clock()
            elif size > offset and self.clock() - stable_since > 0.008:
                break
        return read_from(owner.dump_path, offset)

    def ask_descendants(self, owner: Owner) -> AskedDumps:
        """Send the session's dump signal to every process below ``owner`` that has its
        handler, without waiting: the text is read later (:meth:`AskedDumps.children`)."""
        me = os.getpid()
        # (the watchdog is pytest's child, but nobody's evidence; a zombie, an earlier
        # test's child that nobody reaped yet, is nothing this test runs)
        below = [p for p in proctree.alive(proctree.descendants(owner.proc)) if p.pid != me]
        return self._ask(below, peer=False)

    def ask_peers(self, owner: Owner, pids: Iterable[int], asked: set[int]) -> AskedDumps:
        """:meth:`ask_descendants` for ``pids``, the other ranks of ``owner``'s world,
        but those ``asked`` already (:meth:`AskedDumps.peers`)."""
        known = {owner.pid, os.getpid(), *asked}
        return self._ask(
            [p for p in proctree.alive(_processes(pids)) if p.pid not in known], peer=True
        )

    def _ask(self, processes: list[psutil.Process], *, peer: bool) -> AskedDumps:
        signum = self.dump_signal
        now = self.clock()
        asked = AskedDumps(now + PATIENCE)
        paths: list[tuple[str, int, bool]] = []
        for proc in processes:  # the signals first: the dumps begin while the rest is done
            path = startup.dump_path(self.directory, proc.pid)
            recent = self._recent.get(proc.pid)
            if recent is not None and now - recent[0] < PATIENCE:
                # Asked a moment ago for another expiry (ranks that time one step
                # expire together): that dump serves this one too, and a second would
                # be read with it.
                paths.append((recent[1].path, recent[1].offset, recent[1].main_blocks))
            elif signum and startup.catches(proc.pid, signum):
                offset = _size(path)
                # (a main thread that blocks the signal leaves its handler to another
                # thread, whose end cannot be told from here: its dump counts once begun)
                blocks = startup.handling(proc.pid, signum)
                proctree.send([proc], signum)
                paths.append((path, offset, blocks))
            else:
                paths.append(("", 0, False))
        for proc, (path, offset, blocks) in zip(processes, paths, strict=True):
            info = proctree.describe(proc)
            info["label"] = proctree.label_of(proc)
            why = "" if path else _why_no_stack(proc)
            if why:
                info["no_stack"] = why
            dump = ChildDump(info, path, offset, proc.pid, signum, blocks, peer)
            asked.dumps.append(dump)
            if path:
                self._recent[proc.pid] = (now, dump)
        return asked

    def written(self, asked: AskedDumps) -> Generator[float, None, None]:
        """Wait until every asked dump has been written (``WRITTEN_WITHIN`` at most)."""
        give_up = self.clock() + WRITTEN_WITHIN
        while not asked.written() and self.clock() < give_up:
            yield WRITTEN_POLL

    def finished(self, asked: AskedDumps) -> Generator[float, None, None]:
        """Wait until the asked dump files have stopped growing (until ``PATIENCE``
        after they were asked for, at most)."""
        sizes: list[int] = []
        try:
            while asked.waiting() and self.clock() < asked.give_up:
                yield 0.01
                now_sizes = asked.sizes()
                if asked.begun() and now_sizes == sizes:
                    return
                sizes = now_sizes
        finally:
            asked.settle()


@dataclass
class ChildDump:
    """One process below an owner, and where its dump goes ("" path: none asked)."""

    info: dict[str, Any]  # proctree.describe() and its label
    path: str
    offset: int  # the dump file's size before the signal
    pid: int = 0
    signum: int = 0
    main_blocks: bool = False  # its main thread blocked the signal before it was sent
    peer: bool = False  # another rank of the owner's world, not below the owner
    # The file's size once the dump was written out (None: not known). The file is
    # read later, for the record, when a later expiry may have asked for another dump.
    end: int | None = None

    def written(self) -> bool:
        """Whether the dump was written out: the file grew, and the signal is neither
        pending nor blocked in the process's main thread any more, where the kernel
        runs the handler (a handler runs with its own signal blocked, so a dump that
        has only begun shows as blocked)."""
        if _size(self.path) <= self.offset:
            return False
        return self.main_blocks or not startup.handling(self.pid, self.signum)


@dataclass
class AskedDumps:
    """The dumps asked of the processes below an owner at its scope's expiry.

    faulthandler writes a dump from its C signal handler, a few lines per ``write()``:
    once the handler has returned, the dump is in the file, and reading the files after
    the owner was interrupted still finds the stacks the processes had at expiry, also
    of a process that a harness killed meanwhile.
    """

    give_up: float  # when a dump that has not ended is read as it is
    dumps: list[ChildDump] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.dumps)

    def waiting(self) -> list[ChildDump]:
        """The dumps asked for (processes with the session's dump handler)."""
        return [d for d in self.dumps if d.path]

    def sizes(self) -> list[int]:
        return [_size(d.path) for d in self.waiting()]

    def begun(self) -> bool:
        """Whether every asked process has started writing its dump."""
        return all(_size(d.path) > d.offset for d in self.waiting())

    def written(self) -> bool:
        """Whether every asked process has written its dump out."""
        return all(d.written() for d in self.waiting())

    def settle(self) -> None:
        """Each dump written out by now ends where its file ends now; one that is not
        is read as far as it got when the record is made."""
        for dump in self.waiting():
            if dump.end is None and dump.written():
                dump.end = _size(dump.path)

    def children(self) -> list[dict[str, Any]]:
        """Each process below the owner with the stack written so far (where one was
        asked for)."""
        return self._read(peers=False)

    def peers(self) -> list[dict[str, Any]]:
        """Each peer of the owner with the stack written so far."""
        return self._read(peers=True)

    def _read(self, *, peers: bool) -> list[dict[str, Any]]:
        out = []
        for dump in self.dumps:
            if dump.peer != peers:
                continue
            info = dict(dump.info)
            if dump.path:
                info["stack"] = read_from(dump.path, dump.offset, dump.end)
            out.append(info)
        return out


def _why_no_stack(proc: psutil.Process) -> str:
    """Why a Python process below an owner has no handler for the session's dump
    signal ("" for one that is not Python: none is expected of it)."""
    cmdline = proctree.cmdline_of(proc)
    if not cmdline or not os.path.basename(cmdline[0]).startswith("python"):
        return ""
    try:
        path = proc.environ().get("PYTHONPATH", "")
    except psutil.Error:
        path = None
    if path is not None and startup.PYTHONPATH_DIRECTORY not in path.split(os.pathsep):
        return (
            "its PYTHONPATH lacks the session's start-up directory (an environment built "
            "without os.environ's PYTHONPATH?): no stack, and no collectives recorded"
        )
    return "it does not handle the session's dump signal (it replaced the handler?)"


def read_from(path: str, offset: int, end: int | None = None) -> str:
    """The dump appended to ``path`` after ``offset`` (up to ``end``, where known),
    trimmed ("" if unreadable)."""
    size = 256 * 1024 if end is None else min(max(end - offset, 0), 256 * 1024)
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return trim_dump(f.read(size).decode("utf-8", "replace"))
    except OSError:
        return ""


def trim_dump(text: str, frames: int = DUMP_FRAMES) -> str:
    """Keep the innermost ``frames`` frames of each thread (faulthandler prints the
    most recent call first, so the frames that matter come first)."""
    out: list[str] = []
    kept = dropped = 0
    for line in text.splitlines():
        if line.startswith("  File "):
            if kept < frames:
                out.append(line)
                kept += 1
            else:
                dropped += 1
            continue
        if dropped:
            out.append(f"  ... {dropped} outer frames")
        kept = dropped = 0
        out.append(line)
    if dropped:
        out.append(f"  ... {dropped} outer frames")
    return "\n".join(out) + "\n" if out else ""


def _processes(pids: Iterable[int]) -> list[psutil.Process]:
    found = []
    for pid in pids:
        try:
            found.append(psutil.Process(pid))
        except psutil.Error:
            pass
    return found


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
