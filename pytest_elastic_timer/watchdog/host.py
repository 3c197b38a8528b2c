"""What an intake may ask of the watchdog that hosts it.

An *intake* turns requests that do not come as scopes in a process's own table into
work for the watchdog: the torch ``FileTimerClient`` FIFO (:mod:`.file_timer`) and the
barriers, events and locks (:mod:`pytest_elastic_timer.sync.server`). An intake is
handed a :class:`Host` and uses nothing else of the watchdog: it never reads the
watchdog's attributes, never imports the watchdog's modules, and the watchdog never
imports an intake. The two meet only in the wiring (``python -m
pytest_elastic_timer.watchdog``, :func:`pytest_elastic_timer.watchdog.wiring.build`),
which plugs each intake into the watchdog: ops of the socket to their handlers, a file
descriptor to its reader, the end of a connection or of the session to a callback.

Everything here is a :class:`typing.Protocol` or plain data, and imports only ``core/``:
an intake that depends on it loads neither the watchdog nor psutil.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pytest_elastic_timer.core.records import ExpiryRecord
from pytest_elastic_timer.core.table import ScopeTable


class Identity(Protocol):
    """A process identity that survives pid reuse (pid plus start time)."""

    @property
    def pid(self) -> int: ...

    def alive(self) -> bool:
        """Whether the process with this identity still runs (not a zombie)."""
        ...


@dataclass(frozen=True)
class OwnerFacts:
    """What a registered process says about itself in its table's header."""

    label: str  # e.g. "rank 0"
    worker: str  # xdist worker id
    phase: str  # what its pytest is doing: "setup", "call", ...


class Host(Protocol):
    """The watchdog as its intakes see it."""

    @property
    def scale(self) -> float:
        """The session's scale factor, applied to every budget an intake is given."""
        ...

    def clock(self) -> float:
        """Now, on the watchdog's monotonic clock (the one of every deadline)."""
        ...

    def call_at(self, when: float, callback: Callable[[], None]) -> None:
        """Run ``callback()`` once the clock reaches ``when``, on the watchdog's loop."""
        ...

    def send(self, conn: socket.socket, op: str, /, **fields: Any) -> None:
        """Answer on ``conn``; a peer that went away is no error."""
        ...

    def add_reader(self, fileobj: Any, callback: Callable[[Any], None]) -> None:
        """Call ``callback(fileobj)`` on the watchdog's loop whenever ``fileobj`` is
        readable."""
        ...

    def remove_reader(self, fileobj: Any) -> None:
        """Stop watching ``fileobj`` (nothing happens if it was not watched)."""
        ...

    def drop(self) -> None:
        """Count one malformed or foreign message (``dropped_messages`` of the report)."""
        ...

    def add_record(self, record: ExpiryRecord) -> None:
        """Keep ``record`` for the report and append it to ``records.jsonl`` now."""
        ...

    def set_fact(self, key: str, value: Any) -> None:
        """Put ``value`` under ``key`` in the report's ``session`` facts (kept by
        reference: a dictionary updated later is reported as it is then)."""
        ...

    def owner_facts(self, pid: int) -> OwnerFacts | None:
        """What registered process ``pid`` says about itself, or None if unknown."""
        ...

    def identify(self, pid: int) -> Identity | None:
        """The identity of running process ``pid``, or None if there is none."""
        ...


class Adopted(Protocol):
    """A process of the session with no connection, whose table the watchdog keeps."""

    @property
    def pid(self) -> int: ...

    @property
    def table(self) -> ScopeTable:
        """A table in the watchdog's own memory, which the intake writes slots into."""
        ...

    def environ(self, name: str) -> str:
        """The process's environment variable ``name`` ("" if unset or unreadable)."""
        ...

    def current_test(self) -> str:
        """The nodeid of the test the process runs now ("" if none)."""
        ...


class TableHost(Host, Protocol):
    """A host that also keeps tables for processes that cannot keep their own."""

    def adopt(self, pid: int) -> Adopted | None:
        """The adopted process ``pid`` (adopted now if need be), or None if ``pid`` is
        not a process of this session; a process adopted again after its pid was
        reused gets a fresh table."""
        ...

    def wake(self, pid: int, at: float) -> None:
        """Look at the table of ``pid`` by ``at`` (a deadline written into it)."""
        ...
