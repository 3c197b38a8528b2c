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
"""

from __future__ import annotations

import os
import signal

ENV_DUMP_SIGNAL = "PYTEST_ELASTIC_TIMER_DUMP_SIGNAL"
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
# session's watchdog can report where it is stuck. Then the shadowed sitecustomize runs.
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
            try:
                out = open(os.path.join(here, "..", "dump-%d" % os.getpid()), "a")
                faulthandler.register(num, file=out, all_threads=True, chain=False)
            except (OSError, ValueError, RuntimeError):
                return
            sys._pytest_elastic_timer_dump = (num, out, os.getpid())

        register()
        os.register_at_fork(after_in_child=register)
    # Let the sitecustomize this file shadows run as it would have.
    me = sys.modules.pop("sitecustomize", None)
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    try:
        import sitecustomize  # noqa: F401
    except ImportError:
        pass
    finally:
        sys.path[:] = saved
        if me is not None:
            sys.modules.setdefault("sitecustomize", me)


_pytest_elastic_timer_startup()
del _pytest_elastic_timer_startup
"""


def install(session_dir: str) -> str:
    """Write the session's ``sitecustomize.py``; returns the directory for PYTHONPATH."""
    directory = os.path.join(session_dir, DIRECTORY)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    with open(os.path.join(directory, "sitecustomize.py"), "w", encoding="utf-8") as f:
        f.write(SITECUSTOMIZE)
    return directory


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (Linux: SigCgt)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        return False
    return False
