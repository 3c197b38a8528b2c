"""The trace timeline (``--elastic-timer-trace``): every scope of every process of the
session as Chrome trace / Perfetto JSON.

With tracing on, every process of the session appends one JSON line per scope it
leaves to a ``trace-<pid>-<id>`` file in the session directory (see :mod:`.client`).
At the end of the session the plugin merges those files with the watchdog's expiry
records into one trace:

- one track (``pid``) per process, named after its xdist worker and label
  (``gw0 rank 1 (pid 4242)``), the pytest process first;
- one complete event (``"ph": "X"``) per scope, on the thread that entered it; the
  scopes a process was in when the watchdog ended it get theirs from its scope table,
  lasting until it was ended;
- one instant event (``"ph": "i"``) per expired scope, at its deadline;
- one complete event per torch.distributed op a process recorded (the last 256 of each
  process, from its collectives ring), on a ``collectives`` thread of its track: a
  rank missing from a collective shows as the gap where the others' op goes on, and an
  op that never ended lasts to the end of the trace.

Timestamps are microseconds of ``time.monotonic()`` counted from the first scope.
Open the file in https://ui.perfetto.dev or ``chrome://tracing``; or render a small
HTML page with ``python -m pytest_elastic_timer.ci.trace TRACE --html OUT``.
Nothing here imports pytest; the plugin registers this module as the implementation
of its session-end hook when the session is traced.
"""

from __future__ import annotations

import argparse
import glob
import html
import json
import os
import sys
from collections.abc import Iterable
from typing import Any

from pytest_elastic_timer.core import atomic_file
from pytest_elastic_timer.core import collectives as ring_format
from pytest_elastic_timer.core import table as tbl
from pytest_elastic_timer.core.records import ExpiryRecord

TRACE_VERSION = 1
TRACE_GLOB = "trace-*"
TABLE_GLOB = "table-*"  # the scope tables, one per process (see core/table.py)
_TOLERANCE = 0.01  # seconds between a record's start and its scope's traced start
COLLECTIVES_THREAD = -1  # the thread ident that stands for a process's collectives row


def read_events(directory: str) -> list[dict[str, Any]]:
    """Every complete trace event written in the session ``directory``."""
    events: list[dict[str, Any]] = []
    for path in sorted(glob.glob(os.path.join(directory, TRACE_GLOB))):
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.readlines()
        except OSError:
            continue
        for text in lines:
            try:
                event = json.loads(text)
                float(event["start"]), float(event["end"]), int(event["pid"])
            except (ValueError, TypeError, KeyError):
                continue  # a line torn by a process that was killed while writing
            if isinstance(event, dict):
                events.append(event)
    return events


def read_unfinished(directory: str, records: Iterable[ExpiryRecord]) -> list[dict[str, Any]]:
    """Events for the scopes a process was still in when the watchdog ended it: the
    slots its table (a file that outlives it) holds open, each lasting until the
    process was ended. Its expired scope is among them; the scopes around it are
    known from nowhere else."""
    ended: dict[int, list[ExpiryRecord]] = {}
    for record in records:
        if record.action in ("terminated", "killed") and not record.host:  # another
            ended.setdefault(record.pid, []).append(record)  # host's tables are there
    events: list[dict[str, Any]] = []
    for path in sorted(glob.glob(os.path.join(directory, TABLE_GLOB))):
        its_records = ended.get(tbl.pid_of_file(os.path.basename(path)))
        if not its_records:
            continue
        try:
            table = tbl.ScopeTable.open(path)
        except (OSError, ValueError):
            continue
        try:
            slots = list(table.open_slots())
            # The table of the process a record is about: one of its slots is the
            # record's scope (serials restart in every process, so the start too).
            if not any(
                slot.serial == r.serial and abs(slot.start - (r.deadline - r.budget)) < _TOLERANCE
                for slot in slots
                for r in its_records
            ):
                continue  # an earlier process with the same pid
            last = its_records[-1]
            end = max(r.ended or r.deadline for r in its_records)
            for slot in slots:
                scope, _, nodeid = table.scope_of(slot)
                events.append(
                    {
                        "pid": last.pid,
                        "label": last.label,
                        "worker": last.worker,
                        "path": scope,
                        "start": slot.start,
                        "end": max(end, slot.start),
                        "tid": slot.thread_id,
                        "nodeid": nodeid,
                        "expired": False,
                    }
                )
        finally:
            table.close()
    return events


def read_collectives(directory: str) -> list[dict[str, Any]]:
    """Every op recorded in the session ``directory``'s collectives rings, as events
    (see :func:`pytest_elastic_timer.core.collectives.trace_events`)."""
    return ring_format.trace_events(ring_format.read_rings(ring_format.ring_paths(directory)))


class _Tracks:
    """Process and thread ids of the trace: one process per pid, small thread ids."""

    def __init__(self, root_pid: int) -> None:
        self.root_pid = root_pid
        self.names: dict[int, tuple[str, str]] = {}  # pid -> (worker, label)
        self.threads: dict[int, dict[int, int]] = {}  # pid -> thread ident -> tid

    def process(self, pid: int, worker: str, label: str) -> None:
        known = self.names.get(pid)
        if known is None or (not any(known) and (worker or label)):
            self.names[pid] = (worker, label)
        self.threads.setdefault(pid, {})

    def thread(self, pid: int, ident: int) -> int:
        threads = self.threads.setdefault(pid, {})
        if ident not in threads:
            threads[ident] = len(threads) + 1
        return threads[ident]

    def first_thread(self, pid: int) -> int:
        threads = self.threads.get(pid)
        return min(threads.values()) if threads else self.thread(pid, 0)

    def name(self, pid: int) -> str:
        worker, label = self.names.get(pid, ("", ""))
        if pid == self.root_pid:
            head = "pytest"
        else:
            head = " ".join(x for x in (worker, label) if x) or "process"
        return f"{head} (pid {pid})"

    def metadata(self) -> list[dict[str, Any]]:
        order = sorted(
            self.names,
            key=lambda pid: (pid != self.root_pid, *self.names[pid], pid),
        )
        out: list[dict[str, Any]] = []
        for index, pid in enumerate(order):
            out.append(_meta("process_name", pid, 0, name=self.name(pid)))
            out.append(_meta("process_sort_index", pid, 0, sort_index=index))
            label = self.names[pid][1]
            if label:
                out.append(_meta("process_labels", pid, 0, labels=label))
            for ident, tid in sorted(self.threads.get(pid, {}).items(), key=lambda x: x[1]):
                name = f"thread {tid}" + (f" (ident {ident})" if ident else "")
                if ident == COLLECTIVES_THREAD:
                    name = "collectives"
                out.append(_meta("thread_name", pid, tid, name=name))
                out.append(_meta("thread_sort_index", pid, tid, sort_index=tid))
        return out


def _meta(kind: str, pid: int, tid: int, **args: Any) -> dict[str, Any]:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _known_threads(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Events whose thread is unknown (``tid`` 0: some versions leave it out for a
    thread's outermost scope) are put on the thread of a scope they enclose, else on
    the process's busiest thread."""
    unknown = [e for e in events if not e.get("tid")]
    if not unknown:
        return events
    by_pid: dict[int, list[dict[str, Any]]] = {}
    for event in events:
        if event.get("tid"):
            by_pid.setdefault(int(event["pid"]), []).append(event)
    out = []
    for event in events:
        known = by_pid.get(int(event["pid"]), [])
        if event.get("tid") or not known:
            out.append(event)
            continue
        start, end = float(event["start"]), float(event["end"])
        inside = [e for e in known if start <= float(e["start"]) and float(e["end"]) <= end]
        idents = [int(e["tid"]) for e in inside or known]
        out.append({**event, "tid": max(set(idents), key=idents.count)})
    return out


def _slice(path: str, ts: float, seconds: float, pid: int, tid: int) -> dict[str, Any]:
    """A complete event for one scope (``expired`` until a record says otherwise)."""
    return {
        "name": path.rsplit("/", 1)[-1],
        "cat": "scope",
        "ph": "X",
        "ts": ts,
        "dur": round(max(seconds, 0.0) * 1e6, 3),
        "pid": pid,
        "tid": tid,
        "args": {"path": path, "expired": False},
    }


def _record_start(record: ExpiryRecord) -> float | None:
    return record.deadline - record.budget if record.deadline else None


def build(
    events: Iterable[dict[str, Any]],
    records: Iterable[ExpiryRecord],
    session: dict[str, Any] | None = None,
    collectives: Iterable[dict[str, Any]] = (),
) -> dict[str, Any]:
    """The Chrome trace object for ``events`` (from :func:`read_events`), the
    watchdog's expiry ``records`` and the recorded torch.distributed ops
    (``collectives``, from :func:`read_collectives`)."""
    session = dict(session or {})
    collectives = list(collectives)
    events = sorted(
        _known_threads(list(events)), key=lambda e: (float(e["start"]), -float(e["end"]))
    )
    records = list(records)
    tracks = _Tracks(int(session.get("pid", 0) or 0))
    starts = [float(e["start"]) for e in events]
    starts += [s for s in map(_record_start, records) if s is not None]
    starts += [float(c["start"]) for c in collectives]
    zero = min(starts, default=0.0)

    def us(seconds: float) -> float:
        return round((seconds - zero) * 1e6, 3)

    out: list[dict[str, Any]] = []
    # (pid, path) -> [(start, event)]: the scopes a record can be matched with.
    traced: dict[tuple[int, str], list[tuple[float, dict[str, Any]]]] = {}
    for event in events:
        pid = int(event["pid"])
        tracks.process(pid, str(event.get("worker", "")), str(event.get("label", "")))
        path = str(event.get("path", ""))
        start, end = float(event["start"]), float(event["end"])
        item = _slice(
            path, us(start), end - start, pid, tracks.thread(pid, int(event.get("tid") or 0))
        )
        item["args"].update(nodeid=event.get("nodeid", ""), raised=bool(event.get("expired")))
        traced.setdefault((pid, path), []).append((start, item))
        out.append(item)
    for record in records:
        tracks.process(record.pid, record.worker, record.label)
        began = _record_start(record)
        if began is None:
            continue
        candidates = traced.get((record.pid, record.scope), [])
        match = min(candidates, key=lambda c: abs(c[0] - began), default=None)
        if match is not None and abs(match[0] - began) < max(_TOLERANCE, record.budget):
            candidates.remove(match)
            item = match[1]
        else:
            # The process never left the scope (it was ended): the record says how
            # long the scope was open.
            item = _slice(
                record.scope,
                us(began),
                (record.ended or record.deadline) - began,
                record.pid,
                tracks.first_thread(record.pid),
            )
            item["args"].update(nodeid=record.nodeid, raised=False)
            out.append(item)
        item.update(cat="scope,expired", cname="terrible")
        item["args"].update(expired=True, action=record.action)
        out.append(
            {
                "name": f"expired: {record.scope}",
                "cat": "expiry",
                "ph": "i",
                "s": "p",
                "ts": us(record.deadline),
                "pid": record.pid,
                "tid": item["tid"],
                "args": {
                    "scope": record.scope,
                    "nodeid": record.nodeid,
                    "budget": record.budget,
                    "elapsed": record.elapsed,
                    "action": record.action,
                    "label": record.label,
                    "worker": record.worker,
                    "file": record.file,
                    "line": record.line,
                    "stack": record.stack,
                },
            }
        )
    # An op that never ended (its rank hung or died in it) lasts to the trace's end.
    last = max(
        [float(e["end"]) for e in events]
        + [r.ended or r.deadline for r in records]
        + [float(c["end"] or c["start"]) for c in collectives],
        default=zero,
    )
    for op in collectives:
        pid = int(op["pid"])
        tracks.process(pid, str(op.get("worker", "")), str(op.get("label", "")))
        start = float(op["start"])
        ended = op["end"] is not None
        item = _slice(
            str(op["name"]),
            us(start),
            (float(op["end"]) if ended else last) - start,
            pid,
            tracks.thread(pid, COLLECTIVES_THREAD),
        )
        item["cat"] = "collective"
        item["args"] = {key: op[key] for key in ("op", "group", "seq", "state", "site", "tensors")}
        item["args"]["path"] = str(op["name"])
        if not ended:
            item["cname"] = "terrible"
        out.append(item)
    return {
        "traceEvents": tracks.metadata() + out,
        "displayTimeUnit": "ms",
        "otherData": {
            "generator": "pytest-elastic-timer",
            "version": TRACE_VERSION,
            "clock": "time.monotonic",
            "zero": zero,
            "session": session,
        },
    }


def write(
    path: str,
    events: Iterable[dict[str, Any]],
    records: Iterable[ExpiryRecord],
    session: dict[str, Any],
    collectives: Iterable[dict[str, Any]] = (),
) -> dict[str, Any]:
    """Write the trace of ``events`` (see :func:`read_events`), ``records`` and
    ``collectives`` (see :func:`read_collectives`) to ``path``, atomically; returns it."""
    trace = build(events, records, session, collectives)
    atomic_file.write_text(path, json.dumps(trace) + "\n")
    return trace


# -- the plugin's hook (registered with --elastic-timer-trace) ---------------------------
def pytest_elastic_timer_session_end(
    config: Any, records: list[ExpiryRecord], session: Any
) -> None:
    """Write the trace while the session directory still holds the processes' files
    (``session``: the plugin's :class:`~pytest_elastic_timer.plugin.hookspecs.SessionFacts`)."""
    if not session.trace:
        return
    facts = {"pid": session.pid, "started": session.started, "args": session.args}
    try:
        directory = session.directory
        events = read_events(directory) + read_unfinished(directory, records)
        write(session.trace, events, records, facts, read_collectives(directory))
    except OSError as exc:
        sys.stderr.write(f"pytest-elastic-timer: cannot write {session.trace}: {exc}\n")


# -- a small HTML page of a trace (docs, and machines without a trace viewer) -----------
_LEFT, _WIDTH, _ROW, _TOP = 230, 900, 18, 34
_COLOURS = ("#4e79a7", "#59a14f", "#9c755f", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7")


def render_html(trace: dict[str, Any], title: str = "pytest-elastic-timer trace") -> str:
    """A self-contained HTML page with an SVG timeline of ``trace``: one band per
    process, nested scopes stacked, expiries as red markers."""
    events = trace.get("traceEvents", [])
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    order = {
        e["pid"]: e["args"]["sort_index"] for e in events if e.get("name") == "process_sort_index"
    }
    slices = [e for e in events if e.get("ph") == "X"]
    marks = [e for e in events if e.get("ph") == "i"]
    ends = [float(e["ts"]) + float(e["dur"]) for e in slices] + [float(e["ts"]) for e in marks]
    end = max(ends, default=1.0) or 1.0
    scale = _WIDTH / end

    def x(ts: float) -> float:
        return _LEFT + ts * scale

    parts: list[str] = []
    y = _TOP
    for band, pid in enumerate(sorted(names, key=lambda p: order.get(p, 0))):
        rows: list[float] = []  # per depth: where its last slice ends
        placed: list[tuple[int, dict[str, Any]]] = []
        mine = sorted(
            (e for e in slices if e["pid"] == pid), key=lambda e: (e["tid"], e["ts"], -e["dur"])
        )
        lanes: dict[int, int] = {}
        for event in mine:
            base = lanes.setdefault(event["tid"], len(rows))
            depth = base
            while depth < len(rows) and rows[depth] > event["ts"] + 1e-3:
                depth += 1
            if depth == len(rows):
                rows.append(0.0)
            rows[depth] = event["ts"] + event["dur"]
            placed.append((depth, event))
        height = max(len(rows), 1) * _ROW + 8
        parts.append(
            f'<rect x="0" y="{y}" width="{_LEFT + _WIDTH + 10}" height="{height}" '
            f'fill="{"#f4f4f4" if band % 2 else "#ffffff"}"/>'
            f'<text x="6" y="{y + 14}" class="proc">{html.escape(names[pid])}</text>'
        )
        for depth, event in placed:
            top = y + 4 + depth * _ROW
            left, width = x(event["ts"]), max(event["dur"] * scale, 1.0)
            hung = event.get("cname") == "terrible"  # expired, or an op that never ended
            colour = "#e15759" if event["args"].get("expired") or hung else _COLOURS[depth % 7]
            label = html.escape(str(event["name"]))
            tip = html.escape(
                f"{event['args'].get('path')} ({event['dur'] / 1e6:.3f}s)"
                f" {event['args'].get('nodeid', '')}"
            )
            parts.append(
                f'<g><title>{tip}</title><rect x="{left:.1f}" y="{top}" width="{width:.1f}" '
                f'height="{_ROW - 2}" fill="{colour}" rx="2"/>'
            )
            if width > 7 * len(label) * 0.75:
                parts.append(f'<text x="{left + 3:.1f}" y="{top + 12}" class="s">{label}</text>')
            parts.append("</g>")
        for mark in (m for m in marks if m["pid"] == pid):
            mx = x(mark["ts"])
            text = html.escape(f"{mark['name']} ({mark['args'].get('action')})")
            parts.append(
                f'<g><title>{text}</title><line x1="{mx:.1f}" y1="{y}" x2="{mx:.1f}" '
                f'y2="{y + height}" stroke="#c00" stroke-width="2"/>'
                f'<path d="M{mx - 5:.1f},{y} L{mx + 5:.1f},{y} L{mx:.1f},{y + 7} Z" '
                f'fill="#c00"/></g>'
            )
        y += height
    ticks = []
    step = _tick_step(end / 1e6)
    t = 0.0
    while t * 1e6 <= end:
        tx = x(t * 1e6)
        ticks.append(
            f'<line x1="{tx:.1f}" y1="{_TOP - 6}" x2="{tx:.1f}" y2="{y}" stroke="#ddd"/>'
            f'<text x="{tx:.1f}" y="{_TOP - 10}" class="t">{t:g}s</text>'
        )
        t = round(t + step, 6)
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_LEFT + _WIDTH + 20}" '
        f'height="{y + 10}">' + "".join(ticks) + "".join(parts) + "</svg>"
    )
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>"
        "body{font-family:sans-serif;margin:8px}"
        ".proc{font-size:12px;font-weight:bold}.s{font-size:11px;fill:#fff}"
        ".t{font-size:10px;fill:#555;text-anchor:middle}"
        "</style></head><body>" + svg + "</body></html>\n"
    )


def _tick_step(total: float) -> float:
    for step in (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600):
        if total / step <= 12:
            return float(step)
    return 1200.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pytest_elastic_timer.ci.trace")
    parser.add_argument("trace", help="a trace written by --elastic-timer-trace")
    parser.add_argument("--html", required=True, help="write an HTML timeline here")
    args = parser.parse_args(argv)
    if not args.html.strip():  # `--html "$OUT"` with OUT unset, or a file named by blanks
        parser.error(f"--html must be a path, not {args.html!r}")
    try:
        with open(args.trace, encoding="utf-8") as f:
            trace = json.load(f)
    except (OSError, ValueError, RecursionError) as exc:
        parser.error(f"cannot read the trace {args.trace!r}: {exc}")
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        parser.error(f"{args.trace!r} is not a trace written by --elastic-timer-trace")
    try:
        page = render_html(trace, title=os.path.basename(args.trace))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        parser.error(f"{args.trace!r} has an event this timeline cannot draw: {exc!r}")
    try:
        # A name from a file name that is not UTF-8 holds a lone surrogate: "?", as in
        # the JSON report.
        with open(args.html, "w", encoding="utf-8", errors="replace") as f:
            f.write(page)
    except OSError as exc:
        parser.error(f"cannot write {args.html!r}: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
