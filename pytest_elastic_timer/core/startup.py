"""Stacks of every Python process of the session, including ones that never import us.

A rank spawned by a harness (torch's ``MultiProcessTestCase``), a helper server, a
``subprocess`` of a subprocess: when a test's scope expires the report must show where
each of them is stuck, and the stacks must be taken before anything is interrupted,
because harnesses tear their ranks down as soon as the test fails.

The plugin puts the directory of ``pythonpath/sitecustomize.py`` (in this package)
first on ``PYTHONPATH``. In every Python process started in the session that file
registers :mod:`faulthandler` on one signal (``PYTEST_ELASTIC_TIMER_DUMP_SIGNAL``),
writing to ``dump-<pid>`` in the session directory (where the watchdog's socket,
``PYTEST_ELASTIC_TIMER``, lies), and then imports the ``sitecustomize`` it shadows, if
any. The watchdog sends that signal only to processes
whose ``SigCgt`` mask (``/proc/<pid>/status``) shows the signal caught, so a process
without the handler is never hit by a signal whose default action would end it.

The same file puts the torch hook (``core/torch_hook.py``, loaded by its path, so the
package is not imported) first on ``sys.meta_path``: a process that imports
torch.distributed records its collectives (``scope/collectives.py``); one that does
not pays one string comparison per import until it ends.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys

from pytest_elastic_timer.core import unpatched

ENV_DUMP_SIGNAL = "PYTEST_ELASTIC_TIMER_DUMP_SIGNAL"
# torch's FileTimerClient of every process of the session writes to this FIFO in the
# session directory (the watchdog reads it: watchdog/file_timer.py).
ENV_TORCH_TIMER_FILE = "TORCHELASTIC_TIMER_FILE"
TORCH_TIMER_FIFO = "torch-timer.fifo"


def file_identity(file: str | int) -> list[int] | None:
    """[device, inode] of the file at a path (not followed) or descriptor, as the
    watchdog's answer to op ``torch_timer_file`` names the FIFO; None where there is
    none."""
    try:
        st = os.lstat(file) if isinstance(file, str) else os.fstat(file)
    except OSError:
        return None
    return [st.st_dev, st.st_ino]


# The directory the plugin puts first on PYTHONPATH: the sessions' sitecustomize.py,
# in the installed package (pythonpath/sitecustomize.py says why there).
PYTHONPATH_DIRECTORY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pythonpath")


def session_dump_signal() -> int:
    """The signal every Python process of the session dumps its stacks on (0: none)."""
    if hasattr(signal, "SIGRTMIN"):
        return int(signal.SIGRTMIN) + 7
    return 0


def dump_path(directory: str, pid: int) -> str:
    return os.path.join(directory, f"dump-{pid}")


class DumpRegistration:
    """One registration of :mod:`faulthandler` on a dump signal, into a file of ours."""

    def __init__(self, signum: int, fd: int, path: str) -> None:
        self.signum = signum
        self.fd = fd
        self.path = path


# The registrations in force, oldest first: the start-up one (from the sitecustomize)
# and one per session connected in this process (a pytest run inside a test of another).
_dumps: list[DumpRegistration] = []


def preset_dump() -> tuple[int, str] | None:
    """(signal, file) of the stack dump the sitecustomize registered in this process."""
    done = getattr(sys, "_pytest_elastic_timer_dump", None)
    if done is None or len(done) != 4 or done[2] != unpatched.getpid():
        return None
    return int(done[0]), str(done[3])


def register_dump(signum: int, path: str) -> DumpRegistration:
    """Dump every thread's stack into ``path`` on ``signum``, until :func:`unregister_dump`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        faulthandler.register(signum, file=fd, all_threads=True, chain=False)
    except BaseException:
        os.close(fd)
        raise
    registration = DumpRegistration(signum, fd, path)
    _dumps.append(registration)
    return registration


def unregister_dump(registration: DumpRegistration) -> None:
    """Undo :func:`register_dump`: the registration that was in force before it is again
    (the start-up one, an outer session's), or none; its file is closed."""
    if registration not in _dumps:
        return
    index = _dumps.index(registration)
    del _dumps[index]
    signum = registration.signum
    if not any(d.signum == signum for d in _dumps[index:]):  # it was the one in force
        earlier = [d.fd for d in _dumps[:index] if d.signum == signum]
        if not earlier and preset_dump() is not None:
            num, fd = sys._pytest_elastic_timer_dump[:2]  # type: ignore[attr-defined]
            earlier = [int(fd)] if num == signum else []
        if earlier:
            faulthandler.register(signum, file=earlier[-1], all_threads=True, chain=False)
        else:
            faulthandler.unregister(signum)
    os.close(registration.fd)


def python_path(current: str | None) -> str:
    """``PYTHONPATH`` for the processes of a session: :data:`PYTHONPATH_DIRECTORY` first,
    then ``current`` (without another copy of that directory: a nested session's)."""
    rest = [p for p in (current or "").split(os.pathsep) if p and p != PYTHONPATH_DIRECTORY]
    return os.pathsep.join([PYTHONPATH_DIRECTORY, *rest])


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (Linux: SigCgt). A process
    that has exited and waits to be reaped (a zombie) still shows its handlers, but
    runs none."""
    try:
        with unpatched.open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("State:") and line.split()[1] in ("Z", "X"):
                    return False
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        return False
    return False


def handling(pid: int, signum: int) -> bool:
    """Whether ``signum`` is pending in process ``pid`` or blocked in its main thread, as
    it is while the main thread runs its handler (Linux: ShdPnd, SigPnd, SigBlk)."""
    bit = 1 << (signum - 1)
    try:
        with unpatched.open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(("ShdPnd:", "SigPnd:", "SigBlk:")) and (
                    int(line.split()[1], 16) & bit
                ):
                    return True
    except (OSError, ValueError):
        return False
    return False
