"""The control pipe: what pytest tells the watchdog of its session, on the watchdog's stdin.

pytest writes one command, a JSON line ``{"op": "stop", "session": {...}, "waited":
bool}``, when its session ends, then closes the pipe. End-of-file without a stop means
that pytest died. The watchdog shares pytest's output (its stderr, where it speaks if
pytest died), and a shell or CI step that reads that output through a pipe sees its end
only once every process holding it has let go; so on a stop that pytest does not wait
for, the watchdog lets go of the output at once (:func:`leave_output`).

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
RELAY_THREAD = "elastic-timer-control"
# What else ends a session, with its report: held from the watchdog's first line (its
# entry module) until its loop runs, so that one that comes while the watchdog loads
# ends the session as a later one does, rather than the process at once.
TERMINATING = (signal.SIGTERM, signal.SIGHUP)


def stop_command(line: bytes) -> dict[str, Any] | None:
    """The stop command that ``line`` (without its newline) is, or None if it is not
    one (another command, or not JSON: dropped by the caller)."""
    try:
        command = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if isinstance(command, dict) and command.get("op") == STOP:
        return command
    return None


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

    def wait_for_end(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for the session's end: pytest's command
        (passed on to the pipe, the output let go of if pytest does not wait), or the
        end of stdin. Whether it came."""
        return self._heard.wait(timeout)

    def left_without_waiting(self) -> bool:
        """Whether pytest said stop and does not wait for this process: it is about
        to exit, and nothing of what is left to do here is read back."""
        return self._stop is not None and self._stop.get("waited") is False

    def _run(self) -> None:
        first_line = b""
        looking = True  # pytest says one command; only the first line is looked at
        try:
            while data := os.read(self._fd, 65536):
                if looking:
                    first_line += data
                    if b"\n" in first_line:
                        looking = False
                        command = self._stop = stop_command(first_line.split(b"\n", 1)[0])
                        if command is not None and command.get("waited") is False:
                            # Out of descriptors, say: the output stays held, but the
                            # stop must still reach the loop (end-of-file without it
                            # would read as pytest's death).
                            with contextlib.suppress(OSError):
                                leave_output()
                view = memoryview(data)
                while view:  # a write into a full pipe may be cut short by a signal
                    view = view[os.write(self._write_end, view) :]
                if not looking:
                    self._heard.set()
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
