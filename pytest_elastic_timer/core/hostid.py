"""Which host a process runs on, told by identity rather than by a failed connect.

Two processes are on the same host, for this package, when the session's watchdog could
serve both: the same kernel (boot id), the same pid namespace (the watchdog signals by
pid) and the same host name (a machine, or a container of its own, names itself). An
xdist worker compares its identity with the controller's, which the controller hands
it in ``workerinput``; a worker on another host starts (or joins) the watchdog of its
own host (``watchdog/remote_host.py``) instead of the unreachable socket of the controller's.

This module imports neither pytest nor psutil: it runs in workers on any host, and in
the short-lived gateways that fetch a host's records.
"""

from __future__ import annotations

import hashlib
import os
import socket
import tempfile
from typing import Any, NamedTuple

from pytest_elastic_timer.core import unpatched

HOST_DIR_PREFIX = "pytest-elastic-timer-host-"


class HostIdentity(NamedTuple):
    """What tells one host from another: host name, boot id, pid namespace."""

    hostname: str
    boot_id: str
    pid_namespace: str

    def key(self) -> str:
        """A short name for this host, safe in a file name."""
        text = "\0".join((self.hostname, self.boot_id, self.pid_namespace))
        return hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()[:12]

    def same_host(self, other: HostIdentity) -> bool:
        """Whether a watchdog on ``other``'s host can serve a process on this one.

        Any part that differs, or that one side could not read, means another host:
        a second watchdog costs little, a watchdog that cannot reach its processes
        enforces nothing."""
        return self == other and all((self.hostname, self.boot_id, self.pid_namespace))

    def to_json(self) -> dict[str, str]:
        return self._asdict()

    @classmethod
    def from_json(cls, data: Any) -> HostIdentity | None:
        """The identity in ``data`` (as :meth:`to_json` made it), or None if malformed."""
        if not isinstance(data, dict):
            return None
        hostname, boot_id, namespace = (data.get(k) for k in cls._fields)
        if not (isinstance(hostname, str) and isinstance(boot_id, str)):
            return None
        if not isinstance(namespace, str):
            return None
        return cls(hostname, boot_id, namespace)


def _read(path: str) -> str:
    try:
        with unpatched.open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return ""


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def current() -> HostIdentity:
    """The identity of the host this process runs on."""
    return HostIdentity(
        hostname=socket.gethostname(),
        boot_id=_read("/proc/sys/kernel/random/boot_id"),
        pid_namespace=_readlink("/proc/self/ns/pid"),
    )


def temp_dir() -> str:
    """``tempfile.gettempdir()``, without caching it in ``tempfile.tempdir`` as that
    function does the first time: a test that sets ``TMPDIR`` later finds its own."""
    cached = tempfile.tempdir
    try:
        return tempfile.gettempdir()
    finally:
        tempfile.tempdir = cached


def session_root() -> str:
    """Where a session's private directory goes on this host: tmpfs keeps the scope
    tables in memory; the usual temp directory where there is no writable /dev/shm."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return temp_dir()


def host_directory(token: str, identity: HostIdentity, root: str | None = None) -> str:
    """The private directory of the session ``token``'s watchdog on ``identity``'s host.

    Every worker of the session on that host finds the same one, so they share one
    watchdog; the host key keeps two hosts apart where the temp directory is shared.
    Named by a digest of the two: the sockets inside must fit a socket address (107
    bytes), which a long temp directory leaves little room for."""
    text = f"{token}\0{identity.key()}"
    digest = hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()[:12]
    return os.path.join(root or session_root(), f"{HOST_DIR_PREFIX}{digest}")
