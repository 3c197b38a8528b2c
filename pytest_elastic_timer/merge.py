"""Merge the JSON reports of several runs into one report and one summary.

A suite sharded over several CI machines writes one ``--elastic-timer-report`` per
machine. ``python -m pytest_elastic_timer.merge a.json b.json -o all.json`` prints
the expired scopes of all of them, as the terminal summary of one session would, and
writes one report of the same format (version 1). In each report, records made on the
controller's own host have ``host: ""``; in the merged report they name that host
(the report's ``session.host``, or the report's file name for reports that lack it),
so every record says where it ran. This module imports nothing from pytest.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, TextIO

from pytest_elastic_timer.core import records, schema


class BadReport(ValueError):
    """A file that is not a JSON report of a known version."""


def load(path: str) -> dict[str, Any]:
    """The report in ``path``, checked for the shape this command relies on."""
    try:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
    except (OSError, ValueError) as exc:
        raise BadReport(f"{path}: {exc}") from None
    if not isinstance(report, dict) or report.get("version") != records.REPORT_VERSION:
        raise BadReport(f"{path}: not a version {records.REPORT_VERSION} elastic-timer report")
    expired, session = report.get("expired"), report.get("session", {})
    if not isinstance(expired, list) or not all(isinstance(r, dict) for r in expired):
        raise BadReport(f"{path}: 'expired' is not a list of records")
    if not isinstance(session, dict):
        raise BadReport(f"{path}: 'session' is not an object")
    found = schema.violations(report, schema.report_schema())
    if found:  # its records would go on into the merged report as they are
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise BadReport(f"{path}: not a valid report: {found[0]}{more}")
    for index, data in enumerate(expired):
        try:  # as print_summary will: a record it cannot print is no record
            records.format_record(records.ExpiryRecord.from_json(data), with_stack=True)
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise BadReport(f"{path}: expired[{index}] is not an expiry record: {exc}") from None
    return report


def source_host(path: str, session: dict[str, Any]) -> str:
    """The controller's host of one report: its ``session.host``, else its file name."""
    host = session.get("host")
    if isinstance(host, str) and host:
        return host
    return os.path.splitext(os.path.basename(path))[0]


def merge(reports: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """One report from ``(path, report)`` pairs, in the order given."""
    expired: list[dict[str, Any]] = []
    sources: list[dict[str, Any]] = []
    workers: set[str] = set()
    strays: list[dict[str, Any]] = []
    hosts: list[str] = []
    for path, report in reports:
        session: dict[str, Any] = report.get("session") or {}
        home = source_host(path, session)
        hosts.append(home)
        for record in report["expired"]:
            merged = dict(record)
            if not merged.get("host"):
                merged["host"] = home
            elif merged["host"] not in hosts:
                hosts.append(str(merged["host"]))
            expired.append(merged)
        workers.update(str(w) for w in session.get("workers") or [])
        strays.extend({**p, "host": home} for p in session.get("stray_processes") or [])
        sources.append(
            {
                "report": path,
                "host": home,
                "pid": session.get("pid"),
                "args": session.get("args", []),
                "started": session.get("started"),
                "ended": session.get("ended"),
                "exitstatus": session.get("exitstatus"),
                "workers": session.get("workers", []),
                "root_died": bool(session.get("root_died", False)),
                "expired": len(report["expired"]),
            }
        )
    started = [s["started"] for s in sources if isinstance(s["started"], (int, float))]
    ended = [s["ended"] for s in sources if isinstance(s["ended"], (int, float))]
    statuses = [s["exitstatus"] for s in sources if isinstance(s["exitstatus"], int)]
    session_out: dict[str, Any] = {
        "merged": sources,
        "hosts": list(dict.fromkeys(hosts)),
        "started": min(started) if started else 0.0,
        "ended": max(ended) if ended else 0.0,
        # The worst outcome: one failed shard fails the whole run.
        "exitstatus": max(statuses) if statuses else None,
        "dropped_messages": sum(
            int(r.get("session", {}).get("dropped_messages", 0) or 0) for _, r in reports
        ),
        "workers": sorted(workers),
        "root_died": any(s["root_died"] for s in sources),
    }
    if strays:
        session_out["stray_processes"] = strays
    return {"version": records.REPORT_VERSION, "expired": expired, "session": session_out}


def print_summary(report: dict[str, Any], out: TextIO) -> None:
    """The expired scopes of ``report`` as the terminal summary prints them."""
    sources = report["session"]["merged"]
    title = f" elastic-timer: expired scopes ({len(sources)} reports merged) "
    out.write(title.center(80, "=") + "\n")
    for data in report["expired"]:
        record = records.ExpiryRecord.from_json(data)
        out.write(records.format_record(record, with_stack=record.action != "interrupted"))
        out.write("\n\n")
    if not report["expired"]:
        out.write("no scope expired\n\n")
    for source in sources:
        status = source["exitstatus"]
        out.write(
            f"{source['report']}: host {source['host']}, {source['expired']} expired, "
            f"exit status {'unknown' if status is None else status}\n"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pytest_elastic_timer.merge",
        description="Merge elastic-timer JSON reports (e.g. of sharded CI runs) into one.",
    )
    parser.add_argument("reports", nargs="+", metavar="REPORT", help="JSON reports to merge")
    parser.add_argument("-o", "--output", metavar="PATH", help="write the merged report here")
    parser.add_argument("-q", "--quiet", action="store_true", help="do not print the summary")
    args = parser.parse_args(argv)
    if args.output is not None and not args.output.strip():
        # `-o "$OUT"` with OUT unset: said, not a merge that writes nothing.
        parser.error(f"-o/--output must be a path, not {args.output!r}")
    try:
        loaded = [(path, load(path)) for path in args.reports]
    except BadReport as exc:
        sys.stderr.write(f"pytest_elastic_timer.merge: {exc}\n")
        return 2
    merged = merge(loaded)
    if not args.quiet:
        print_summary(merged, sys.stdout)
    if args.output:
        try:
            records.write_json(args.output, merged)
        except OSError as exc:
            sys.stderr.write(f"pytest_elastic_timer.merge: cannot write {args.output}: {exc}\n")
            return 2
        if not args.quiet:
            sys.stdout.write(f"elastic-timer: merged report written to {args.output}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
