"""Reports of sharded CI runs merge into one report and one summary (issue 20).

Two real sessions write their JSON reports: one on this machine, one on a stand-in
host (``standin_hosts.py``) that plays a second CI machine.
``python -m pytest_elastic_timer.merge`` then prints one summary and writes one report
that the package's JSON Schema accepts, every record naming the machine it came from.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from helpers import LEAN
from standin_hosts import StandInHost

import pytest_elastic_timer
from pytest_elastic_timer import merge as merge_module
from pytest_elastic_timer.core import schema

SCHEMA = Path(pytest_elastic_timer.__file__).parent / "core" / "report.schema.json"

SHARD = """
import time
import pytest

@pytest.mark.expires(0.3)
def test_{name}():
    time.sleep(30)

def test_{name}_passes():
    pass
"""


def run_shard(python: str, directory: Path, name: str) -> Path:
    """A CI machine's run of its shard: one test overruns; returns its JSON report."""
    (directory / f"test_{name}.py").write_text(SHARD.format(name=name))
    report = directory / f"{name}.json"
    done = subprocess.run(
        [python, "-m", "pytest", *LEAN, f"--elastic-timer-report={report}", f"test_{name}.py"],
        cwd=directory,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    return report


def merge(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest_elastic_timer.merge", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture
def two_machines(
    tmp_path: Path, stand_in_hosts: Callable[..., list[StandInHost]]
) -> tuple[Path, Path]:
    (ci2,) = stand_in_hosts("ci-2")
    first = tmp_path / "first"
    second = tmp_path / "second"
    first.mkdir()
    second.mkdir()
    return run_shard(sys.executable, first, "one"), run_shard(str(ci2.wrapper), second, "two")


def test_reports_of_two_machines_merge_into_one_report_and_one_summary(
    two_machines: tuple[Path, Path], tmp_path: Path
) -> None:
    one, two = two_machines
    out = tmp_path / "all.json"
    done = merge(one, two, "-o", out)
    assert done.returncode == 0, done.stderr
    merged: dict[str, Any] = json.loads(out.read_text())
    jsonschema.validate(merged, json.loads(SCHEMA.read_text()))
    hosts = {r["scope"]: r["host"] for r in merged["expired"]}
    assert hosts == {"test_one::call": socket.gethostname(), "test_two::call": "ci-2"}
    session = merged["session"]
    assert session["hosts"] == [socket.gethostname(), "ci-2"]
    assert [s["report"] for s in session["merged"]] == [str(one), str(two)]
    assert [s["exitstatus"] for s in session["merged"]] == [1, 1]
    assert session["exitstatus"] == 1

    text = done.stdout
    assert "elastic-timer: expired scopes (2 reports merged)" in text
    assert "scope 'test_one::call' expired after" in text
    assert "scope 'test_two::call' expired after" in text
    assert f"host {socket.gethostname()}" in text and "host ci-2" in text
    assert f"{two}: host ci-2, 1 expired, exit status 1" in text
    assert f"merged report written to {out}" in text


def test_each_report_keeps_host_empty_for_its_own_machine(
    two_machines: tuple[Path, Path],
) -> None:
    for path, host in zip(two_machines, (socket.gethostname(), "ci-2"), strict=True):
        report = json.loads(path.read_text())
        jsonschema.validate(report, json.loads(SCHEMA.read_text()))
        assert [r["host"] for r in report["expired"]] == [""]
        assert report["session"]["host"] == host


def example_report() -> dict[str, Any]:
    """The real report docs/report.md shows."""
    page = (Path(__file__).parent.parent / "docs" / "report.md").read_text()
    example = page.split("## Example", 1)[1].split("```json\n", 1)[1].split("\n```", 1)[0]
    report: dict[str, Any] = json.loads(example)
    return report


def test_the_report_pages_example_is_a_valid_report() -> None:
    """docs/report.md shows a real report: it has every field the schema requires."""
    jsonschema.validate(example_report(), json.loads(SCHEMA.read_text()))


# Records that the JSON Schema refuses, by what is wrong in them.
WRONG_RECORDS: dict[str, Callable[[dict[str, Any]], None]] = {
    "pid a string": lambda r: r.update(pid="12"),
    "line below 0": lambda r: r.update(line=-1),
    "line not whole": lambda r: r.update(line=1.5),
    "host a number": lambda r: r.update(host=5),
    "unknown action": lambda r: r.update(action="exploded"),
    "stack null": lambda r: r.update(stack=None),
    "nodeid a number": lambda r: r.update(nodeid=1),
    "budget a boolean": lambda r: r.update(budget=True),
    "elapsed below 0": lambda r: r.update(elapsed=-1.0),
    "no label": lambda r: r.pop("label"),
    "a killed process without pid": lambda r: r.update(killed=[{"name": "python"}]),
    "a child's pid a string": lambda r: r.update(children=[{"pid": "7"}]),
}


@pytest.mark.parametrize("wrong", WRONG_RECORDS)
def test_a_report_whose_record_the_schema_refuses_is_refused(tmp_path: Path, wrong: str) -> None:
    """The record went into the merged report as it was (exit 0): a merged report the
    schema refused. The command checks its reports against the schema, which the
    package's own check (no validator library) reads as jsonschema does."""
    report = example_report()
    WRONG_RECORDS[wrong](report["expired"][0])
    assert not jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text())).is_valid(report)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(report))
    done = merge(bad, "-o", tmp_path / "all.json")
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{bad}: not a valid report: $.expired[0]" in done.stderr, done.stderr
    assert not (tmp_path / "all.json").exists()


def test_the_packages_schema_check_reads_patterns_and_boolean_schemas_as_jsonschema() -> None:
    """``false`` refuses, ``true`` takes anything (a boolean schema was a TypeError);
    patterns are read as jsonschema reads them (Python's re: "0\\n" matches
    ``^[0-9]+$``, as it would not in ECMA-262)."""
    rules = {
        "type": "object",
        "propertyNames": {"pattern": "^[0-9]+$"},
        "additionalProperties": {"items": False},
        "properties": {"7": True},
    }
    validator = jsonschema.Draft202012Validator(rules)
    documents = [{"0": []}, {"0\n": []}, {"1": [1]}, {"x": []}, {"7": [1, "a"]}]
    for document in documents:
        found = schema.violations(document, rules)
        assert bool(found) == (not validator.is_valid(document)), (document, found)
    assert [bool(schema.violations(d, rules)) for d in documents] == [0, 0, 1, 1, 0]


def test_the_packages_schema_check_reads_the_schema_as_jsonschema_does() -> None:
    """Valid reports (the docs' example, and its merge) and each wrong record: the
    package's check and jsonschema agree on every one."""
    rules = schema.report_schema()
    validator = jsonschema.Draft202012Validator(rules)
    documents = [example_report()]
    documents.append(merge_module.merge([("ci-1.json", example_report())]))
    for wrong in WRONG_RECORDS.values():
        report = example_report()
        wrong(report["expired"][0])
        documents.append(report)
    for report in documents:
        assert bool(schema.violations(report, rules)) == (not validator.is_valid(report)), report
    assert len([d for d in documents if validator.is_valid(d)]) == 2


def test_a_file_that_is_not_a_report_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": 7, "expired": []}')
    done = merge(bad, "-o", tmp_path / "all.json")
    assert done.returncode == 2
    assert f"{bad}: not a version 1 elastic-timer report" in done.stderr
    assert not (tmp_path / "all.json").exists()


@pytest.mark.parametrize(
    "record", [{"nodeid": 1}, {"nodeid": "t.py::t", "scope": "s"}, "not an object"]
)
def test_a_report_with_a_record_that_is_not_one_is_refused(tmp_path: Path, record: object) -> None:
    """A record without the contract's fields was a traceback (TypeError)."""
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"version": 1, "expired": [record], "session": {}}))
    done = merge(bad, "-o", tmp_path / "all.json")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert f"{bad}: " in done.stderr and "expired" in done.stderr, done.stderr
    assert not (tmp_path / "all.json").exists()


@pytest.mark.parametrize("output", ["", "  "])
def test_an_empty_output_path_is_refused(tmp_path: Path, output: str) -> None:
    """``-o "$OUT"`` with OUT unset merged, printed its summary and wrote nothing, with
    exit status 0 (or wrote a file named by blanks)."""
    report = tmp_path / "one.json"
    report.write_text(json.dumps({"version": 1, "expired": [], "session": {}}))
    done = subprocess.run(
        [sys.executable, "-m", "pytest_elastic_timer.merge", str(report), "-o", output],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert f"error: -o/--output must be a path, not {output!r}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout == ""  # refused before merging
    assert sorted(os.listdir(tmp_path)) == ["one.json"]
