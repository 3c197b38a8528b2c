"""Stack dumps: every thread's Python stack of a process, taken from outside.

A process that enters scopes registers faulthandler on a dump signal of its own (the
table's ``H_DUMP_SIG``); every Python process of the session also has the session's
dump signal, installed by the start-up hook. faulthandler's handler is C code that
writes the stacks from the signal handler without the GIL, so a dump works while a C
call holds it. The watchdog sends the signal and reads what was appended to the
process's dump file once it has stopped growing (0.3 s at most).

The waits are steps of the escalation ladder: each function here is a generator that
yields the delay until it looks at the file again, and returns the text.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

from pytest_elastic_timer.core import startup
from pytest_elastic_timer.core import table as tbl
from pytest_elastic_timer.watchdog import proctree
from pytest_elastic_timer.watchdog.loop import Clock
from pytest_elastic_timer.watchdog.owners import Owner

DUMP_FRAMES = 25  # innermost frames kept per thread of a faulthandler dump
PATIENCE = 0.3  # the longest wait for a dump file to stop growing


class Dumper:
    """Takes the stacks of a scope's owner and of the processes below it."""

    def __init__(self, directory: str, dump_signal: int, clock: Clock) -> None:
        self.directory = directory
        self.dump_signal = dump_signal  # the session's: every Python process of it
        self.clock = clock

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

    def descendants(self, owner: Owner) -> Generator[float, None, list[dict[str, Any]]]:
        """The processes below ``owner``, each with its stack where it has the
        session's dump handler."""
        signum = self.dump_signal
        me = os.getpid()
        found: list[tuple[dict[str, Any], str, int]] = []
        for proc in proctree.descendants(owner.proc):
            if proc.pid == me:
                continue  # pytest's child, but the watchdog is nobody's evidence
            info = proctree.describe(proc)
            info["label"] = proctree.label_of(proc)
            path = startup.dump_path(self.directory, proc.pid)
            if signum and startup.catches(proc.pid, signum):
                offset = _size(path)
                proctree.send([proc], signum)
                found.append((info, path, offset))
            else:
                found.append((info, "", 0))
        waiting = [(path, offset) for _, path, offset in found if path]
        sizes: dict[str, int] = {}
        give_up = self.clock() + PATIENCE
        while waiting and self.clock() < give_up:
            yield 0.01
            now_sizes = {path: _size(path) for path, _ in waiting}
            grown = all(now_sizes[p] > offset for p, offset in waiting)
            if grown and now_sizes == sizes:
                break
            sizes = now_sizes
        out = []
        for info, path, offset in found:
            if path:
                info["stack"] = read_from(path, offset)
            out.append(info)
        return out


def read_from(path: str, offset: int) -> str:
    """The dump appended to ``path`` after ``offset``, trimmed ("" if unreadable)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return trim_dump(f.read(256 * 1024).decode("utf-8", "replace"))
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


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
