"""The session's torch file-timer FIFO, looked at after every test.

The session exports ``TORCHELASTIC_TIMER_FILE``, the FIFO its watchdog reads torch's
``FileTimerClient`` requests from. A torch elastic agent that a test starts with
``TORCHELASTIC_ENABLE_FILE_TIMER=1`` (torchrun, ``elastic_launch``) runs a
``FileTimerServer`` of its own at that path: it removes the session's FIFO, makes its
own, and removes that when the agent stops, so every later client of the session would
find nothing there. After each test, the process that ran it looks at the path (one
``stat``); when that changed, it asks its watchdog to put the FIFO back
(:meth:`pytest_elastic_timer.watchdog.file_timer.FileTimerIntake.restore`).
"""

from __future__ import annotations

import os

from pytest_elastic_timer.core import startup
from pytest_elastic_timer.scope import client


class TorchTimerFile:
    """The FIFO at ``path``, as this process last saw it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.seen = startup.file_identity(path)

    @classmethod
    def of_session(cls) -> TorchTimerFile | None:
        """The FIFO of the watchdog this process's environment names; None where the
        session has no watchdog here (scopes enforced in-process), or the environment
        names the user's own file (:func:`named_by_user`)."""
        address = os.environ.get(client.ENV_ADDRESS, "")
        path = os.environ.get(startup.ENV_TORCH_TIMER_FILE, "")
        if not address or path != _fifo_of(address):
            return None
        return cls(path)

    def check(self, process: client.ProcessState) -> None:
        """Have the watchdog put the FIFO back if the path changed since last seen."""
        if startup.file_identity(self.path) == self.seen:
            return
        answer = process.request("torch_timer_file")
        # Without an answer (the watchdog is gone), what is there now: asked only once.
        self.seen = answer["identity"] if "identity" in answer else startup.file_identity(self.path)


def named_by_user() -> bool:
    """Whether ``TORCHELASTIC_TIMER_FILE`` is the user's own: set, and not the FIFO of
    the session whose watchdog the environment names (an outer session's, which a
    session run inside one of its tests inherits). The user's ``FileTimerServer``
    reads it: a session leaves it as it is, and its watchdog gets no requests."""
    path = os.environ.get(startup.ENV_TORCH_TIMER_FILE, "")
    return bool(path) and path != _fifo_of(os.environ.get(client.ENV_ADDRESS, ""))


def _fifo_of(address: str) -> str:
    """The file-timer FIFO of the watchdog at ``address`` ("" for none)."""
    return os.path.join(os.path.dirname(address), startup.TORCH_TIMER_FIFO) if address else ""
