"""A process's line of ``/proc/<pid>/stat``: its state, and its start time since boot,
which with the pid tells a process from a later one that reuses the pid. Read by the
collectives rings (a rank's identity) and by the watchdog's process identities.

Since boot, not since the epoch: a step of the system clock (a virtual machine's clock
set again) does not move it.
"""

from __future__ import annotations

from pytest_elastic_timer.core import unpatched


def _fields(pid: int) -> list[bytes] | None:
    """The fields of the stat line after the command name (``[0]`` the state, ``[19]``
    the start time), or None where there is no such file to read."""
    try:
        with unpatched.open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ")".
    return stat[stat.rfind(b")") + 2 :].split()


def process_starttime(pid: int) -> int:
    """The start time of ``pid`` in clock ticks since boot (0 if unknown): with the pid,
    it tells a process from a later one that reuses its pid."""
    fields = _fields(pid)
    try:
        return int(fields[19]) if fields is not None else 0
    except (IndexError, ValueError):
        return 0


def process_alive(pid: int, starttime: int) -> bool:
    """Whether process ``pid`` that started at ``starttime`` still runs (not a zombie)."""
    fields = _fields(pid)
    if not fields or fields[0] in (b"Z", b"X"):
        return False
    return not starttime or (len(fields) > 19 and fields[19] == str(starttime).encode())
