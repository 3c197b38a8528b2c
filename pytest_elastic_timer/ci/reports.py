"""The JSON report (``--elastic-timer-report``, written by the watchdog): its schema,
for checking a report in CI (``jsonschema.validate(report, report_schema())``)."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

SCHEMA = "report.schema.json"


def report_schema() -> dict[str, Any]:
    """The JSON Schema of the JSON report (``--elastic-timer-report``)."""
    text = resources.files("pytest_elastic_timer.core").joinpath(SCHEMA).read_text(encoding="utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema
