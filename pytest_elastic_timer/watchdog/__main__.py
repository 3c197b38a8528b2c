"""``python -m pytest_elastic_timer.watchdog``: the session's watchdog process.

pytest's control pipe is read (:mod:`.control`) before the watchdog's modules load
(:mod:`.wiring`, some 50 ms of a core): a session that ends sooner than that is not
held up by this process, which shares its output.

With ``--defer SECONDS`` (a session whose end pytest does not wait for), those modules
load only once the session has run that long, once pytest says ``hurry`` (a deadline of
its own comes sooner), or once the session has ended and pytest has exited (waited for
as long again at most): the one-test session of a developer's loop then ends before
its watchdog loads anything, and pytest never shares a core with that loading. Until
then the processes of the session wait for the watchdog's answer, as they do while it
starts, and pytest's own deadlines are watched by its standby thread (see
docs/design.md, "A watchdog that loads late").
"""

from __future__ import annotations

import contextlib
import os
import resource
import select
import signal
import sys

from pytest_elastic_timer.watchdog.control import TERMINATING, StdinRelay


def close_descriptors_above_the_limit() -> None:
    """Close what this process inherited at or above its soft limit on open files:
    pytest could not have them closed as it started it (``posix_spawn`` refuses them),
    and a test's pipe must not stay open here."""
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if limit < 0:  # unlimited
        return
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            if int(name) >= limit:
                with contextlib.suppress(OSError):
                    os.close(int(name))


def option(argv: list[str], name: str) -> float:
    """The number after ``name`` in ``argv`` (0 without one): read before the modules
    that parse the command line load."""
    try:
        return max(0.0, float(argv[argv.index(name) + 1]))
    except (ValueError, IndexError):
        return 0.0


def wait_for_exit(pid: int, timeout: float) -> None:
    """Wait at most ``timeout`` seconds for process ``pid`` to end (its pidfd turns
    readable then); not at all where there is no pidfd to wait on."""
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # gone already, or no pidfds here
        return
    try:
        select.select([pidfd], [], [], timeout)
    finally:
        os.close(pidfd)


if __name__ == "__main__":
    # Ctrl-C reaches the whole process group; pytest decides how the session ends.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Held before the relay's thread starts, which inherits the mask.
    signal.pthread_sigmask(signal.SIG_BLOCK, TERMINATING)
    close_descriptors_above_the_limit()
    relay = StdinRelay()
    defer = option(sys.argv, "--defer")
    if defer and relay.wait_for_word(defer) and relay.left_without_waiting():
        # What is left (reading what came before the stop, ending strays, removing the
        # session's directory) waits for pytest's own end, not to take a core from it.
        wait_for_exit(int(option(sys.argv, "--root-pid")), defer)
    from pytest_elastic_timer.watchdog.wiring import main

    sys.exit(main(relay=relay))
