# Written by pytest-elastic-timer for the processes of its pytest sessions: the plugin
# puts this directory first on PYTHONPATH. Each Python process of a session dumps its
# thread stacks into the session directory on a signal, so that the session's watchdog
# can report where it is stuck, and a process that imports torch.distributed records its
# collectives. Then the sitecustomize this file shadows runs.
#
# It lies in the installed package, not in the session directory: coverage.py, which
# measures subprocesses from a .pth file before this runs, leaves installed packages
# out, and would otherwise count this file in the user's total, and then miss its source
# once the session directory is gone.
#
# Any Python a test starts reads it, an old one too (a test of a tool that runs Python
# 2.7, say): it is written so that every Python parses it (type comments, no f-strings),
# and only Pythons that can run the session's processes (3.7 and later) do more than
# chain to the sitecustomize it shadows.
"""The start-up hook of pytest-elastic-timer's sessions (see the comment above)."""


def _pytest_elastic_timer_startup():  # type: () -> None
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    # The session this process belongs to: its watchdog's socket lies in the session
    # directory. A process that outlived its session (or left it) does nothing here.
    address = os.environ.get("PYTEST_ELASTIC_TIMER", "")
    session = os.path.dirname(address) if address else ""
    if sys.version_info >= (3, 7) and session and os.path.isdir(session):
        _register_dump(session)
        # Record torch.distributed's ops from the moment torch.distributed is imported.
        if os.environ.get("PYTEST_ELASTIC_TIMER_COLLECTIVES", "1") != "0":
            _watch_torch(os.path.join(os.path.dirname(here), "torch_hook.py"))
    # Let the sitecustomize this file shadows run as it would have: take only this
    # directory off sys.path (it is not there without the plugin), so whatever that
    # file adds to sys.path or the import system stays.
    me = sys.modules.pop("sitecustomize", None)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.path_importer_cache.pop(here, None)
    try:
        import sitecustomize  # type: ignore[import-not-found]  # noqa: F401
    except ImportError as exc:
        # (Python 2's ImportError has no name: its message ends with the module's.)
        name = getattr(exc, "name", None) or str(exc).rsplit(" ", 1)[-1].strip("'")
        if name != "sitecustomize":
            raise  # as site.py does: an import error inside that file is shown
    finally:
        if me is not None:
            sys.modules.setdefault("sitecustomize", me)


def _register_dump(session):  # type: (str) -> None
    """faulthandler on the session's dump signal, into ``dump-<pid>`` of the session
    directory: now, and in every child forked from this process."""
    import os
    import sys

    signum = os.environ.get("PYTEST_ELASTIC_TIMER_DUMP_SIGNAL", "")
    if not signum.isdigit():
        return
    import faulthandler
    import signal

    def register():  # type: () -> None
        num = int(signum)
        done = getattr(sys, "_pytest_elastic_timer_dump", None)
        if done is not None and done[2] == os.getpid():
            return  # a nested session's registration came first: it wins
        if signal.getsignal(num) not in (signal.SIG_DFL, None):
            return  # never replace a handler someone else installed
        path = os.path.join(session, "dump-" + str(os.getpid()))
        # A bare descriptor, not a file object: no text encoding to name, and nothing
        # for the interpreter to warn about at exit.
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
        sys._pytest_elastic_timer_dump = (num, fd, os.getpid(), path)  # type: ignore[attr-defined]

    register()
    os.register_at_fork(after_in_child=register)


def _watch_torch(hook):  # type: (str) -> None
    """Load the torch hook by its path (the package itself is not imported)."""
    import importlib.util
    import os

    if not os.path.isfile(hook):
        return
    try:
        spec = importlib.util.spec_from_file_location("_pytest_elastic_timer_torch_hook", hook)
        if spec is None or spec.loader is None:
            return
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.watch()
    except Exception:
        pass


_pytest_elastic_timer_startup()
