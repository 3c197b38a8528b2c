"""Expiry records and the JSON report built from them.

The watchdog writes one record per expired scope, as a JSON line appended to the
session's ``records.jsonl`` the moment the escalation ends, so a record survives the
death of any process, pytest's included. The JSON report (``--elastic-timer-report``)
is ``{"version": 1, "expired": [record, ...], "session": {...}}``. This module imports
nothing from pytest.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

from pytest_elastic_timer.core import atomic_file, stacks, unpatched

REPORT_VERSION = 1
RecordKey = tuple[str, str, int, int]  # ExpiryRecord.key
# What ended a scope; "reported": nothing did, a torch file-timer request whose signal
# was 0 or below, whose process is left running (as torch does).
ACTIONS = ("interrupted", "terminated", "killed", "reported")


@dataclass
class ExpiryRecord:
    """What the report says about one expired scope (the contract fields first)."""

    nodeid: str
    scope: str
    budget: float
    elapsed: float
    pid: int
    label: str
    worker: str
    file: str
    line: int
    action: str
    stack: str
    phase: str = ""
    children: list[dict[str, Any]] = field(default_factory=list)
    killed: list[dict[str, Any]] = field(default_factory=list)
    deadline: float = 0.0
    ended: float = 0.0
    serial: int = 0
    host: str = ""  # where the owner ran; "" on the controller's host
    # Which host that was (core/hostid.HostIdentity.key: host name, boot id, pid
    # namespace); "" on the controller's host. Two hosts may share a name (cloned VMs,
    # same-named containers) and then number their processes alike.
    host_key: str = ""
    # The torch.distributed collective the ranks concerned block in (see
    # core/collectives.align); None when no rank is inside one.
    collective: dict[str, Any] | None = None
    # The other ranks of the owner's world (not below it), with their stacks at the
    # expiry: where a missing rank is.
    peers: list[dict[str, Any]] = field(default_factory=list)

    def test_phase(self, name: str = "") -> str:
        """The phase of test ``name`` (its nodeid's last part; the record's own test
        without one) the scope expired in: the one its path names
        (``test_x::setup/step`` -> setup), or for a scope outside the test's (the
        session's, in a session fixture's teardown) the phase its process was in;
        ``call`` otherwise."""
        name = name or self.nodeid.split("::")[-1]
        for when in ("setup", "teardown"):
            if name and self.scope.startswith(f"{name}::{when}"):
                return when
        if not (name and self.scope.startswith(f"{name}::")) and self.phase in (
            "setup",
            "teardown",
        ):
            return self.phase
        return "call"

    def line_text(self) -> str:
        """The one-line summary shared by every report of this expiry."""
        return (
            f"scope {self.scope!r} expired after {self.elapsed:.2f}s "
            f"(budget {self.budget:g}s): {self.action}"
        )

    def owner_text(self) -> str:
        parts = [f"pid {self.pid}"]
        if self.label:
            parts.insert(0, self.label)
        if self.worker:
            parts.append(f"worker {self.worker}")
        if self.host:
            parts.append(f"host {self.host}")
        return ", ".join(parts)

    @property
    def key(self) -> RecordKey:
        """What names one scope in a session: a later record of it supersedes earlier
        ones. Pids repeat across hosts, even across hosts of the same name, so the
        host's key is part of it."""
        return (self.host, self.host_key, self.pid, self.serial)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        if data["collective"] is None:
            del data["collective"]  # a record has it only when ranks were in a collective
        return data

    def rank_stacks(self) -> dict[int, str]:
        """The stacks of the ranks among the owner, its children and its peers, by
        global rank: by the pid the collective gives each rank (a rank labelled
        ``set_label("trainer 1")`` too), else, for a rank whose process is not known
        (no ring), by a ``rank N`` label. A rank's process that had ended has no stack:
        another process labelled as that rank (one it started, which inherited its
        ``RANK``) is not where it is."""
        from pytest_elastic_timer.core import collectives  # only records of ranks ask

        processes = [
            (self.pid, self.label, self.stack),
            *(
                (int(c.get("pid", 0)), str(c.get("label", "")), str(c.get("stack", "")))
                for c in (*self.children, *self.peers)
            ),
        ]
        by_pid = {pid: stack for pid, _, stack in processes if pid and stack}
        stacks: dict[int, str] = {}
        known: set[int] = set()  # the ranks whose process the collective names
        for rank, view in ((self.collective or {}).get("ranks") or {}).items():
            pid = int(view.get("pid", 0))
            if pid:
                known.add(int(rank))
            stack = by_pid.get(pid) if pid else None
            if stack:
                stacks[int(rank)] = stack
        for _, label, stack in processes:
            rank = collectives.rank_of_label(label)
            if rank is not None and rank not in known and stack:
                stacks.setdefault(rank, stack)
        return stacks

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ExpiryRecord:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def split_site(site: str) -> tuple[str, int]:
    """``"path/to/file.py:12"`` -> ``("path/to/file.py", 12)``."""
    file, _, line = site.rpartition(":")
    if not file or not line.isdigit():
        return site, 0
    return file, int(line)


def append_record(path: str, record: ExpiryRecord) -> None:
    line = unpatched.dumps(record.to_json()) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def read_records(path: str) -> list[ExpiryRecord]:
    """Every complete record in ``path`` (a torn last line is skipped); a later record
    of the same scope (``ExpiryRecord.key``) supersedes an earlier one."""
    try:
        with unpatched.open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except FileNotFoundError:
        return []
    found: dict[RecordKey, ExpiryRecord] = {}
    for text in lines:
        try:
            record = ExpiryRecord.from_json(unpatched.loads(text))
        except (ValueError, TypeError):
            continue
        key = record.key
        found.pop(key, None)  # re-insert: order by the latest word on each scope
        found[key] = record
    return list(found.values())


def write_report(path: str, records: list[ExpiryRecord], session: dict[str, Any]) -> None:
    """Write the JSON report atomically (a reader never sees half a file)."""
    report = {
        "version": REPORT_VERSION,
        "expired": [r.to_json() for r in records],
        "session": session,
    }
    write_json(path, report)


def write_json(path: str, report: dict[str, Any]) -> None:
    """Write ``report`` to ``path`` in one step: a temporary file, then a rename."""
    atomic_file.write_text(path, unpatched.dumps(report, indent=2) + "\n")


def shown_file(file: str, rootdir: str = "") -> str:
    """``file`` as terminals show it, as pytest shows paths: normalized, and relative
    to ``rootdir`` when it lies under it."""
    if not file or file.startswith("<"):  # <string>, <stdin>, ...
        return file
    path = os.path.normpath(file)
    if rootdir and os.path.isabs(path):
        root = os.path.normpath(rootdir).rstrip(os.sep) + os.sep
        if path.startswith(root):
            return path[len(root) :]
    return path


def format_record(
    record: ExpiryRecord,
    *,
    with_stack: bool = True,
    rootdir: str = "",
    full_stack: bool = True,
    hint: str = stacks.HINT,
) -> str:
    """A multi-line text block for terminals: summary, where, who, then the stack.
    ``rootdir``: files under it are shown relative to it; ``full_stack=False`` leaves
    out the runner's frames that lead to the test (:func:`stacks.trim_stack`), saying
    where to see them in ``hint``."""
    lines = [record.line_text()]
    if record.nodeid:
        lines.append(f"  test:    {record.nodeid}")
    if record.file:
        file = shown_file(record.file, rootdir)
        lines.append(f"  entered: {file}:{record.line}" if record.line else f"  entered: {file}")
    lines.append(f"  process: {record.owner_text()}")
    if record.collective:
        from pytest_elastic_timer.core import collectives  # only records of ranks have one

        lines.append("  " + collectives.collective_line(record.collective, record.rank_stacks()))
    # A scope whose path does not say its test's phase (one entered outside the
    # test, such as the session's) says in which phase it expired.
    if record.phase and (not record.nodeid or "::" not in record.scope):
        lines.append(f"  phase:   {record.phase}")
    if record.killed:
        names = ", ".join(f"{p.get('pid')} ({p.get('name', '?')})" for p in record.killed)
        lines.append(f"  ended:   {names}")
    if with_stack and record.stack:
        stack = record.stack if full_stack else stacks.trim_stack(record.stack, hint)
        lines.append("  stack:")
        lines.extend("    " + s for s in stack.rstrip().splitlines())
    return "\n".join(lines)
