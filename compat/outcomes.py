"""A pytest plugin the compatibility check loads with ``-p outcomes``: it writes each
test's outcome to the JSON file named by ``COMPAT_OUTCOMES``.

The outcome of a test reads as pytest's summary reads it: ``error`` when its setup or
teardown failed, else ``failed``, ``xfailed``, ``xpassed``, ``skipped`` or ``passed``.
Inner sessions the suite starts (pytester) do not load it: only ``-p`` does.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

_outcomes: dict[str, str] = {}
_ORDER = ("passed", "skipped", "xpassed", "xfailed", "failed", "error")


def _outcome(report: pytest.TestReport) -> str:
    if hasattr(report, "wasxfail"):
        return "xfailed" if report.skipped else "xpassed"
    if report.failed:
        return "failed" if report.when == "call" else "error"
    return "skipped" if report.skipped else "passed"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Keep the worst outcome of the test's three phases."""
    outcome = _outcome(report)
    known = _outcomes.get(report.nodeid, "passed")
    _outcomes[report.nodeid] = max(known, outcome, key=_ORDER.index)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A module that fails to import counts as one errored test."""
    if report.failed:
        _outcomes[report.nodeid] = "error"


def pytest_sessionfinish(session: pytest.Session, exitstatus: Any) -> None:
    path = os.environ.get("COMPAT_OUTCOMES")
    if path and not hasattr(session.config, "workerinput"):
        with open(path, "w", encoding="utf-8") as f:
            json.dump(_outcomes, f, indent=1, sort_keys=True)
