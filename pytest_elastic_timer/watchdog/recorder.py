"""Records, the JSON report and the summary printed when pytest was ended.

Every record is appended to ``records.jsonl`` the moment it is made (``O_APPEND``,
then ``fsync``), so it outlives any process, pytest's and the watchdog's included. A
record made early (the owner reported its interrupt, or the watchdog is about to end
pytest itself) is superseded by the final one of the same scope (``ExpiryRecord.key``);
readers keep the last line per scope.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from pytest_elastic_timer.core import records
from pytest_elastic_timer.core import table as tbl
from pytest_elastic_timer.watchdog.loop import Clock
from pytest_elastic_timer.watchdog.owners import Expiry, Owner

Amender = Callable[[records.ExpiryRecord], None]


class Recorder:
    """The session's expiry records, in memory and in ``records.jsonl``."""

    def __init__(self, path: str, clock: Clock) -> None:
        self.path = path
        self.clock = clock
        self.records: list[records.ExpiryRecord] = []
        # Called with every record before it is kept and written, to add facts of
        # their own (what a rank was doing in a collective, say). An amender that
        # fails costs the record nothing.
        self.amenders: list[Amender] = []
        # (key, action) of the records last printed because pytest was ended
        self._printed: set[tuple[records.RecordKey, str]] = set()

    def expired(
        self,
        owner: Owner,
        expiry: Expiry,
        action: str,
        stack: str,
        ended: list[dict[str, Any]],
    ) -> records.ExpiryRecord:
        """Make, keep and write the record of ``expiry``, ended by ``action``."""
        report = expiry.report or {}
        site = expiry.site or str(report.get("site", ""))
        file, line = records.split_site(site)
        now = self.clock()
        budget = expiry.deadline - expiry.start if expiry.start else float(report.get("budget", 0))
        elapsed = (now - expiry.start) if expiry.start else float(report.get("elapsed", 0))
        if report and action == "interrupted":
            elapsed = float(report.get("elapsed", elapsed))
        record = records.ExpiryRecord(
            # A scope entered outside every test (the session's) names the test its
            # process ran when it expired, as the owner's own report of it would.
            nodeid=(
                expiry.nodeid
                or str(report.get("nodeid", ""))
                or owner.test_in_table()
                or owner.started_in
            ),
            scope=expiry.path or str(report.get("scope", "")),
            budget=round(budget, 3),
            elapsed=round(elapsed, 6),
            pid=owner.pid,
            label=owner.header_text(tbl.H_LABEL_SID),
            worker=owner.header_text(tbl.H_WORKER_SID) or owner.started_on,
            file=file,
            line=line,
            action=action,
            stack=stack,
            # As it was when the scope expired: the record is made later (after the
            # grace, or once the owner's report is read), when the owner may be done.
            phase=expiry.phase or owner.phase(),
            children=expiry.children,
            peers=expiry.peers,
            killed=ended,
            deadline=expiry.deadline,
            ended=now,
            serial=expiry.serial,
        )
        self.add(record)
        return record

    def add(self, record: records.ExpiryRecord) -> None:
        """Keep ``record`` (in place of an earlier one of its scope) and append it to
        ``records.jsonl`` now."""
        for amend in self.amenders:
            try:
                amend(record)
            except Exception as exc:
                sys.stderr.write(f"pytest-elastic-timer: amending a record: {exc!r}\n")
        self.records = [r for r in self.records if r.key != record.key]
        self.records.append(record)
        try:
            records.append_record(self.path, record)
        except OSError as exc:
            sys.stderr.write(f"pytest-elastic-timer: cannot write a record: {exc}\n")

    def write_report(self, path: str | None, session: dict[str, Any]) -> None:
        """Write the JSON report to ``path`` (if any) with ``session`` as its facts."""
        if not path:
            return
        try:
            records.write_report(path, self.records, session)
        except OSError as exc:
            sys.stderr.write(f"pytest-elastic-timer: cannot write {path}: {exc}\n")

    def print_summary(self, report_path: str | None) -> None:
        """Print the records on stderr (pytest's terminal) when pytest was ended;
        again only if something changed (a new record, or "terminated" superseded
        by "killed")."""
        shown = {(r.key, r.action) for r in self.records}
        if shown <= self._printed:
            return
        self._printed = shown
        out = sys.stderr
        try:
            title = " elastic-timer: expired scopes (pytest was ended) "
            out.write("\n" + "=" * 20 + title + "=" * 20 + "\n")
            # Whole stacks are in the JSON report; pytest, which could show them with
            # --full-trace, is gone.
            hint = "the JSON report has them" if report_path else "not shown"
            for record in self.records:
                text = records.format_record(record, full_stack=False, hint=hint)
                out.write(text + "\n\n")
            if report_path:
                out.write(f"elastic-timer: JSON report written to {report_path}\n")
            out.flush()
        except (OSError, ValueError):
            pass
