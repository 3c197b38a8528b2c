"""Intake of the controller's watchdog: records made on other hosts.

xdist workers on another host are enforced by the watchdog of their host
(:mod:`.remote_host`); its records travel to the controller's pytest with the workers'
test reports, their ``workeroutput``, or a fetch through a fresh gateway. The
controller's pytest hands each to its watchdog as op ``forward``, and this intake keeps
it like one of the watchdog's own, so that the terminal summary, the JSON report, the
JUnit file and the CI outputs all read it from the same place.

Only the controller's pytest may forward (a record names a process the watchdog never
saw), and only records that name their host. Like every intake, it sees the watchdog
only through :class:`~.host.Host`.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from pytest_elastic_timer.core import records, wire
from pytest_elastic_timer.watchdog.host import Host


class ForwardedRecords:
    """Op ``forward``: a record of another host, from the controller's pytest; op
    ``worker``: an xdist worker is up, which may be on another host (those of this
    host register themselves)."""

    def __init__(self, host: Host, controller_pid: int, worker_seen: Callable[[str], None]) -> None:
        self.host = host
        self.controller_pid = controller_pid
        self.worker_seen = worker_seen  # the session's workers include those of other hosts

    def handlers(self) -> dict[str, Any]:
        return {"forward": self.forward, "worker": self.worker}

    def forward(self, conn: socket.socket, peer_pid: int, fields: dict[str, Any]) -> None:
        try:
            record = self._record(peer_pid, fields)
        except (wire.BadMessage, TypeError, ValueError) as exc:
            # Answered all the same: the controller waits for a word.
            self.host.send(conn, "refused", error=str(exc))
            raise wire.BadMessage(str(exc)) from None
        self.host.add_record(record)
        if record.worker:
            self.worker_seen(record.worker)
        self.host.send(conn, "forwarded")

    def worker(self, conn: socket.socket, peer_pid: int, fields: dict[str, Any]) -> None:
        """Op ``worker``: the controller names a worker that came up (no answer)."""
        if peer_pid != self.controller_pid:
            raise wire.BadMessage("workers are named by the controller's pytest")
        name = wire.field(fields, "worker", str)
        if not name or len(name) > 64:
            raise wire.BadMessage("a worker id has 1 to 64 characters")
        self.worker_seen(name)

    def _record(self, peer_pid: int, fields: dict[str, Any]) -> records.ExpiryRecord:
        if peer_pid != self.controller_pid:
            raise wire.BadMessage("records come from the controller's pytest")
        data = wire.field(fields, "record", dict)
        for name in ("pid", "serial", "line"):
            wire.field(data, name, int)
        for name in ("budget", "elapsed"):
            wire.field(data, name, (int, float))
        for name in ("host", "nodeid", "scope", "worker", "action", "stack"):
            wire.field(data, name, str)
        if not isinstance(data.get("host_key", ""), str):
            raise wire.BadMessage("host_key is a string")
        record = records.ExpiryRecord.from_json(data)
        if not record.host or record.action not in records.ACTIONS:
            raise wire.BadMessage("not a record of another host")
        return record
