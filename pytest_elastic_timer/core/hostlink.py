"""The link between a host's watchdog and the session's workers and gateways there.

A worker on another host than the controller (``core/hostid.py``) joins the watchdog
of its host on that watchdog's *join socket* (``join.sock`` beside ``watchdog.sock``):

- ``join`` carries the worker's pid and xdist id, and, as ``SCM_RIGHTS``, the file
  descriptors of its xdist gateway (the read side of its connection to the controller:
  a pipe for ``popen`` and ``ssh``, a TCP socket for ``socket``). The watchdog polls them
  for hang-up only, never reads them; a gateway that hangs up while its worker still
  runs means that the controller is gone, and the watchdog ends that worker's tree.
- ``leave`` says the worker ends normally (no replacement is coming for it).
- ``fetch`` asks for the records of one worker, while the watchdog may still be
  escalating against it. The controller sends it through a fresh gateway to that host
  when xdist reports the worker crashed: the crashed worker cannot forward anything.

Each message is one ``SOCK_SEQPACKET`` datagram in the format of ``core/wire.py``. This
module imports neither pytest nor psutil.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from pytest_elastic_timer.core import unpatched, wire

JOIN_SOCKET = "join.sock"


class Link:
    """A worker's joined link to its host's watchdog; open for the worker's life."""

    def __init__(self, directory: str, worker: str, gateway_fds: list[int]) -> None:
        self.sock = unpatched.Socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.settimeout(10.0)
        try:
            unpatched.connect(self.sock, os.path.join(directory, JOIN_SOCKET))
            message = wire.encode("join", pid=unpatched.getpid(), worker=worker)
            wire.send_with_fds(self.sock, message, gateway_fds[: wire.MAX_FDS])
            op, fields = wire.decode(self.sock.recv(wire.MAX_MESSAGE))
        except BaseException:
            self.sock.close()
            raise
        if op != "joined":
            self.sock.close()
            raise wire.BadMessage(f"the host's watchdog answered {op!r}: {fields}")
        self.watchdog_pid = int(fields.get("pid", 0))

    def leave(self) -> None:
        """The worker ends normally (the watchdog waits for its exit before it ends)."""
        try:
            self.sock.send(wire.encode("leave"))
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()


def fetch(directory: str, worker: str, patience: float) -> list[dict[str, Any]]:
    """The records of ``worker`` that the watchdog in ``directory`` made, once it no
    longer escalates against it (or ``patience`` seconds passed); [] without one."""
    give_up = unpatched.monotonic() + patience
    with unpatched.Socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(10.0)
        try:
            unpatched.connect(sock, os.path.join(directory, JOIN_SOCKET))
        except OSError:
            return []
        while True:
            records: list[dict[str, Any]] = []
            try:
                sock.send(wire.encode("fetch", worker=worker))
                while True:  # the answer comes in datagrams of at most wire.MAX_MESSAGE
                    _, fields = wire.decode(sock.recv(wire.MAX_MESSAGE))
                    found = fields.get("records")
                    if isinstance(found, list):
                        records.extend(r for r in found if isinstance(r, dict))
                    if not fields.get("more"):
                        break
            except (OSError, wire.BadMessage):
                return []
            if not fields.get("pending") or unpatched.monotonic() > give_up:
                return records
            unpatched.sleep(0.05)
