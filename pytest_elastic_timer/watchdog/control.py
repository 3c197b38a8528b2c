"""The control pipe: what pytest tells the watchdog of its session, on the watchdog's stdin.

pytest writes one command, a JSON line ``{"op": "stop", "session": {...}, "waited":
bool}``, when its session ends, then closes the pipe. End-of-file without a stop means
that pytest died. Before it, a watchdog that loads late (``--defer``) may be told
``{"op": "hurry"}``, once: a deadline of pytest's own comes before it would have
loaded. The watchdog shares pytest's output (its stderr, where it speaks if pytest
died), and a shell or CI step that reads that output through a pipe sees its end only
once every process holding it has let go; so on a stop that pytest does not wait for,
the watchdog lets go of the output at once (:func:`leave_output`).

A short session says stop before its watchdog has loaded its modules: the
:class:`StdinRelay` reads the pipe from the start of the watchdog's entry module, before
those modules load, in a thread of its own; it lets go of the output as soon as such a
stop comes, and passes every byte on to the watchdog's loop. This module imports only a
few small modules of the standard library: it is loaded before the watchdog's own.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import threading
from typing import Any

STOP = "stop"
HURRY = "hurry"
RELAY_THREAD = "elastic-timer-control"
# What else ends a session, with its report: held from the watchdog's first line (its
# entry module) until its loop runs, so that one that comes while the watchdog loads
# ends the session as a later one does, rather than the process at once.
TERMINATING = (signal.SIGTERM, signal.SIGHUP)


def command_of(line: bytes) -> dict[str, Any]:
    """The command that ``line`` (without its newline) is: its JSON object, or an empty
    one if it is none (not JSON: dropped by the caller)."""
    try:
        command = json.loads(line)
    except (ValueError, RecursionError):
        return {}
    return command if isinstance(command, dict) else {}


def leave_output() -> None:
    """Let go of the output this process shares with pytest, which ended its session
    normally and does not wait: only a pytest that died has anything to hear from the
    watchdog."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            os.dup2(devnull, fd)
    finally:
        os.close(devnull)


class StdinRelay:
    """This process's stdin read from now on by a thread, which passes it on through a
    pipe (:meth:`fileno`, for the watchdog's loop) and lets go of pytest's output at a
    stop that pytest does not wait for, however far the main thread has got.

    The thread ends with the pipe: at end-of-file of stdin it closes the relay's write
    end, so the loop reads end-of-file too.
    """

    def __init__(self, fd: int = 0) -> None:
        self._fd = fd
        # Read blocking, whatever the descriptor's flags were (a blocking read is the
        # thread's whole job).
        with contextlib.suppress(OSError):
            os.set_blocking(fd, True)
        # Above the standard descriptors: one of them closed at start would otherwise be
        # the relay's own pipe, read as stdin or overwritten by leave_output().
        self._read_end, self._write_end = (_above_stdio(end) for end in os.pipe())
        # Set once pytest's command has come whole, or stdin ended without one.
        self._heard = threading.Event()
        self._stop: dict[str, Any] | None = None  # that command, if it is a stop
        self.thread = threading.Thread(target=self._run, name=RELAY_THREAD, daemon=True)
        self.thread.start()

    def fileno(self) -> int:
        """The read end of the relay's pipe."""
        return self._read_end

    def wait_for_word(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for a word from pytest: its stop (passed on
        to the pipe, the output let go of if pytest does not wait), a ``hurry``, or the
        end of stdin. Whether one came."""
        return self._heard.wait(timeout)

    def left_without_waiting(self) -> bool:
        """Whether pytest said stop and does not wait for this process: it is about
        to exit, and nothing of what is left to do here is read back."""
        return self._stop is not None and self._stop.get("waited") is False

    def _run(self) -> None:
        unread = b""
        # pytest says one command, after at most a hurry: the first line that is no
        # hurry is looked at, and nothing after it.
        looking = True
        try:
            while data := os.read(self._fd, 65536):
                if looking:
                    unread += data
                while looking and b"\n" in unread:
                    line, unread = unread.split(b"\n", 1)
                    command = command_of(line)
                    if command.get("op") != HURRY:
                        looking = False
                        self._stop = command if command.get("op") == STOP else None
                    if self.left_without_waiting():
                        # Out of descriptors, say: the output stays held, but the stop
                        # must still reach the loop (end-of-file without it would read
                        # as pytest's death).
                        with contextlib.suppress(OSError):
                            leave_output()
                    self._heard.set()
                view = memoryview(data)
                while view:  # a write into a full pipe may be cut short by a signal
                    view = view[os.write(self._write_end, view) :]
        except OSError:
            pass  # stdin went bad: its end-of-file, as far as the loop can tell
        finally:
            os.close(self._write_end)
            self._heard.set()


def _above_stdio(fd: int) -> int:
    """``fd``, or a copy of it numbered 3 or above (``fd`` closed) if it is 0, 1 or 2."""
    if fd > 2:
        return fd
    try:
        return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    finally:
        os.close(fd)
