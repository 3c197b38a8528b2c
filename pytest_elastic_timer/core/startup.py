"""Stacks of every Python process of the session, including ones that never import us.

A rank spawned by a harness (torch's ``MultiProcessTestCase``), a helper server, a
``subprocess`` of a subprocess: when a test's scope expires the report must show where
each of them is stuck, and the stacks must be taken before anything is interrupted,
because harnesses tear their ranks down as soon as the test fails.

The plugin writes a ``sitecustomize.py`` into the session directory and puts that
directory first on ``PYTHONPATH``. In every Python process started in the session it
registers :mod:`faulthandler` on one signal (``PYTEST_ELASTIC_TIMER_DUMP_SIGNAL``),
writing to ``dump-<pid>`` in the session directory, and then imports the
``sitecustomize`` it shadows, if any. The watchdog sends that signal only to processes
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


DIRECTORY = "startup"


def session_dump_signal() -> int:
    """The signal every Python process of the session dumps its stacks on (0: none)."""
    if hasattr(signal, "SIGRTMIN"):
        return int(signal.SIGRTMIN) + 7
    return 0


def dump_path(directory: str, pid: int) -> str:
    return os.path.join(directory, f"dump-{pid}")


SITECUSTOMIZE = """\
# Written by pytest-elastic-timer for the processes of one pytest session: each Python
# process dumps its thread stacks into the session directory on a signal, so that the
# session's watchdog can report where it is stuck, and a process that imports
# torch.distributed records its collectives. Then the shadowed sitecustomize runs.
def _pytest_elastic_timer_startup():
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    signum = os.environ.get("PYTEST_ELASTIC_TIMER_DUMP_SIGNAL", "")
    if signum.isdigit() and os.path.isdir(here):
        import faulthandler
        import signal

        def register():
            num = int(signum)
            done = getattr(sys, "_pytest_elastic_timer_dump", None)
            if done is not None and done[2] == os.getpid():
                return  # a nested session's copy of this file ran first: it wins
            if signal.getsignal(num) not in (signal.SIG_DFL, None):
                return  # never replace a handler someone else installed
            path = os.path.join(os.path.dirname(here), "dump-%d" % os.getpid())
            # A bare descriptor, not a file object: no text encoding to name, and
            # nothing for the interpreter to warn about at exit.
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            except OSError:
                return
            try:
                faulthandler.register(num, file=fd, all_threads=True, chain=False)
            except (OSError, ValueError, RuntimeError):
                os.close(fd)
                return
            if done is not None:  # the parent's descriptor, inherited through fork
                try:
                    os.close(done[1])
                except OSError:
                    pass
            sys._pytest_elastic_timer_dump = (num, fd, os.getpid(), path)

        register()
        os.register_at_fork(after_in_child=register)
    # Record torch.distributed's ops from the moment torch.distributed is imported.
    hook = __TORCH_HOOK__
    if os.environ.get("PYTEST_ELASTIC_TIMER_COLLECTIVES", "1") != "0" and os.path.isfile(hook):
        try:
            import importlib.util

            spec = importlib.util.spec_from_file_location("_pytest_elastic_timer_torch_hook", hook)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            module.watch()
        except Exception:
            pass
    # Let the sitecustomize this file shadows run as it would have: take only this
    # directory off sys.path (it is not there without the plugin), so whatever that
    # file adds to sys.path or the import system stays.
    me = sys.modules.pop("sitecustomize", None)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.path_importer_cache.pop(here, None)
    try:
        import sitecustomize  # noqa: F401
    except ImportError as exc:
        if exc.name != "sitecustomize":
            raise  # as site.py does: an import error inside that file is shown
    finally:
        if me is not None:
            sys.modules.setdefault("sitecustomize", me)


_pytest_elastic_timer_startup()
del _pytest_elastic_timer_startup
"""


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


def install(session_dir: str) -> str:
    """Write the session's ``sitecustomize.py``; returns the directory for PYTHONPATH."""
    directory = os.path.join(session_dir, DIRECTORY)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    hook = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_hook.py")
    with open(os.path.join(directory, "sitecustomize.py"), "w", encoding="utf-8") as f:
        f.write(SITECUSTOMIZE.replace("__TORCH_HOOK__", repr(hook)))
    return directory


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (Linux: SigCgt). A process
    that has exited and waits to be reaped (a zombie) still shows its handlers, but
    runs none."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
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
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(("ShdPnd:", "SigPnd:", "SigBlk:")) and (
                    int(line.split()[1], 16) & bit
                ):
                    return True
    except (OSError, ValueError):
        return False
    return False
