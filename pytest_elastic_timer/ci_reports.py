"""CI outputs: enriched JUnit XML, GitHub Actions annotations and step summary,
trace timeline, slow-scope warnings. A pytest plugin module registered by
:mod:`.plugin` in ``pytest_configure``.
"""

from __future__ import annotations

from typing import Any

import pytest

HELP = {
    "slow": "list a scope as SLOW in the terminal summary once it used this fraction of "
    "its budget (default 0.8; 0 = off).",
}


def add_options(group: Any, parser: pytest.Parser) -> None:
    """Options of the CI outputs (called from the plugin's ``pytest_addoption``)."""
    group.addoption(
        "--elastic-timer-slow",
        dest="elastic_timer_slow",
        default=None,
        metavar="FRACTION",
        help=HELP["slow"],
    )
    parser.addini("elastic_timer_slow", HELP["slow"], default=None)


def session_end(config: pytest.Config) -> dict[str, Any]:
    """Write the trace timeline while the session directory exists; return facts for
    the JSON report's ``session`` object. Called just before the watchdog stops."""
    return {}
