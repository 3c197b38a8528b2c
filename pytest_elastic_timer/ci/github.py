"""GitHub Actions (``GITHUB_ACTIONS=true``): one ``::error`` workflow command per expired
scope (at most :data:`ANNOTATION_LIMIT`) in the terminal summary, and a Markdown table
of the expired and the slow scopes appended to ``$GITHUB_STEP_SUMMARY``. Registered in
the controller (or only process) of a session that runs under GitHub Actions; it
implements the plugin's hooks (:mod:`..plugin.hookspecs`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import pytest

from pytest_elastic_timer.ci.slow import PhaseTime, slow_phases
from pytest_elastic_timer.core.records import ExpiryRecord
from pytest_elastic_timer.plugin.hookspecs import SessionFacts

ANNOTATION_LIMIT = 10  # GitHub shows at most 10 error annotations per step anyway


def escape_data(text: str) -> str:
    """A workflow command's message, escaped as GitHub's runner un-escapes it."""
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


# Control characters but line ends, as Python writes them (``\x1b``): raw, a scope's
# name would reach the log (an ESC starts a terminal's escape sequence, a NUL ends
# text), and GitHub's runner has no escape for them.
_CONTROLS = {c: f"\\x{c:02x}" for c in [*range(0x20), 0x7F] if chr(c) not in "\r\n"}


def escape_property(text: str) -> str:
    """A workflow command's property value (``file=``, ``title=``), escaped."""
    return escape_data(text.translate(_CONTROLS)).replace(":", "%3A").replace(",", "%2C")


def _where(
    record: ExpiryRecord,
    workspace: str,
    rootdir: str,
    locations: Mapping[str, tuple[str, int | None]],
) -> tuple[str, int]:
    """(file relative to ``workspace``, 1-based line) to annotate, or ("", 0)."""

    def inside(path: str) -> str:
        rel = os.path.relpath(os.path.abspath(path), os.path.abspath(workspace))
        return "" if rel.startswith("..") else rel

    if record.file and os.path.isfile(record.file) and inside(record.file):
        return inside(record.file), record.line
    location = locations.get(record.nodeid)
    if location is not None:  # a scope entered outside any file (python -c): the test
        rel = inside(os.path.join(rootdir, location[0]))
        if rel:
            return rel, (location[1] or 0) + 1
    return "", 0


def github_annotations(
    found: list[ExpiryRecord],
    workspace: str,
    rootdir: str,
    locations: Mapping[str, tuple[str, int | None]] | None = None,
    limit: int = ANNOTATION_LIMIT,
) -> list[str]:
    """GitHub Actions ``::error`` commands, one per expired scope (at most ``limit``,
    then one ``::warning`` saying how many were left out)."""
    out = []
    for record in found[:limit]:
        file, line = _where(record, workspace, rootdir, locations or {})
        props = []
        if file:
            props.append(f"file={escape_property(file)}")
            if line:
                props.append(f"line={line}")
        props.append(f"title={escape_property(f'elastic-timer: {record.scope} expired')}")
        message = [record.line_text()]
        if record.nodeid:
            message.append(f"test: {record.nodeid}")
        message.append(f"process: {record.owner_text()}")
        out.append(f"::error {','.join(props)}::{escape_data(chr(10).join(message))}")
    if len(found) > limit:
        left = len(found) - limit
        out.append(
            f"::warning title=elastic-timer::{left} more expired scope(s) not annotated "
            f"(at most {limit} per session); see the job summary or the JSON report"
        )
    return out


def _cell(text: object, code: bool = False) -> str:
    value = " ".join(str(text).split()).replace("|", "\\|")
    if code and value and "`" not in value:
        return f"`{value}`"
    return value.replace("`", "\\`")


def step_summary(found: list[ExpiryRecord], slow: list[PhaseTime], fraction: float) -> str:
    """Markdown for ``$GITHUB_STEP_SUMMARY``: the expired scopes, then the slow ones."""
    out = []
    if found:
        out += [
            f"### elastic-timer: {len(found)} expired scope(s)",
            "",
            "| test | scope | budget | elapsed | action | process |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        out += [
            f"| {_cell(r.nodeid or '(session)', True)} | {_cell(r.scope, True)} "
            f"| {r.budget:g}s | {r.elapsed:.2f}s | {r.action} | {_cell(r.owner_text())} |"
            for r in found
        ]
        out.append("")
    if slow:
        out += [
            f"### elastic-timer: {len(slow)} slow scope(s) (>= {fraction:.0%} of their budget)",
            "",
            "| test | scope | duration | budget | share | suggested budget |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        out += [
            f"| {_cell(p.nodeid, True)} | {_cell(p.scope, True)} | {p.seconds:.2f}s "
            f"| {p.budget:g}s | {p.share or 0:.0%} | {p.suggestion(fraction):g}s |"
            for p in slow
        ]
        out.append("")
    return "\n".join(out) + "\n"


def locations_of(
    terminalreporter: Any, nodeids: Mapping[str, Any]
) -> dict[str, tuple[str, int | None]]:
    """Where the terminal's reports place the tests ``nodeids``: (path, 0-based line)."""
    stats: dict[str, list[Any]] = getattr(terminalreporter, "stats", None) or {}
    found: dict[str, tuple[str, int | None]] = {}
    for group in stats.values():
        for report in group:
            nodeid = str(getattr(report, "nodeid", ""))
            if nodeid in nodeids and nodeid not in found and hasattr(report, "location"):
                found[nodeid] = (report.location[0], report.location[1])
    return found


@pytest.hookimpl(trylast=True)  # after the other outputs' lines
def pytest_elastic_timer_terminal_summary(
    config: pytest.Config,
    terminalreporter: Any,
    records: list[ExpiryRecord],
    session: SessionFacts,
) -> None:
    rootdir = session.rootdir
    root = os.environ.get("GITHUB_WORKSPACE") or rootdir
    locations = locations_of(terminalreporter, session.expired)
    for text in github_annotations(records, root, rootdir, locations):
        terminalreporter.write_line(text)
    slow = slow_phases(config, session)
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary and (records or slow):
        try:
            with open(summary, "a", encoding="utf-8") as f:
                f.write(step_summary(records, slow, session.slow))
        except OSError as exc:
            terminalreporter.write_line(f"pytest-elastic-timer: cannot write {summary}: {exc}")
