"""The message format between processes and the watchdog.

A message is one ``SOCK_SEQPACKET`` datagram holding a JSON array ``[op, {fields}]``,
dispatched by ``op`` on the receiving side. Messages are rare (registration, a new
earliest deadline, an interrupt's stack); scopes themselves travel through the shared
table. Anything that does not decode to that shape is a :class:`BadMessage`, which the
watchdog counts and drops. A datagram may carry file descriptors (``SCM_RIGHTS``):
a worker's gateway, a process's interrupt channel.
"""

from __future__ import annotations

import array
import math
import socket
from typing import Any

from pytest_elastic_timer.core import unpatched

MAX_MESSAGE = 256 * 1024
MAX_FDS = 4  # descriptors one datagram may carry


class BadMessage(ValueError):
    """A datagram that is not a well-formed message."""


def encode(op: str, /, **fields: Any) -> bytes:
    data = unpatched.dumps([op, fields], separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE:
        raise BadMessage(f"message {op!r} is {len(data)} bytes, over {MAX_MESSAGE}")
    return data


def decode(data: bytes) -> tuple[str, dict[str, Any]]:
    if len(data) > MAX_MESSAGE:
        raise BadMessage(f"message of {len(data)} bytes, over {MAX_MESSAGE}")
    try:
        value = unpatched.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        # RecursionError: b"[" * 100000 is small and nests too deep for the parser.
        raise BadMessage(f"not JSON: {type(exc).__name__}") from None
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not isinstance(value[0], str)
        or not isinstance(value[1], dict)
    ):
        raise BadMessage("not an [op, {fields}] array")
    return value[0], value[1]


def field(fields: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    """``fields[name]`` checked against ``kind`` (bool is never a number here)."""
    value = fields.get(name)
    if isinstance(value, bool) and kind is not bool:
        raise BadMessage(f"field {name!r} must be {kind}, not bool")
    if not isinstance(value, kind):
        raise BadMessage(f"field {name!r} must be {kind}, not {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise BadMessage(f"field {name!r} must be finite, not {value!r}")
    return value


def send_with_fds(sock: socket.socket, data: bytes, fds: list[int]) -> None:
    """Send one datagram with ``fds`` attached (``SCM_RIGHTS``)."""
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sock.sendmsg([data], ancillary)


def receive_with_fds(sock: socket.socket) -> tuple[bytes, list[int]]:
    """One datagram (up to one byte over :data:`MAX_MESSAGE`, to tell one too long) and
    the descriptors attached to it (the caller owns them)."""
    data, ancillary, _, _ = sock.recvmsg(
        MAX_MESSAGE + 1, socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
    )
    fds: list[int] = []
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(payload) - len(payload) % array.array("i").itemsize
            fds.extend(array.array("i", payload[:usable]))
    return data, fds
