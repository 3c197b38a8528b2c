"""The JSON report (``--elastic-timer-report``, written by the watchdog): its schema,
for checking a report in CI (``jsonschema.validate(report, report_schema())``)."""

from __future__ import annotations

from pytest_elastic_timer.core.schema import report_schema

__all__ = ["report_schema"]
