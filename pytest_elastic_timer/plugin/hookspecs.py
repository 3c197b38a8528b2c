"""The plugin's own hooks: an extension point for outputs of expired and slow scopes.

The CI outputs of this package (JUnit XML, GitHub Actions, slow phases, the trace) are
implementations of these hooks, registered as plugins when a session uses them; a
``conftest.py`` or another plugin can implement them the same way. Every hook runs in
the process that reports the session: the xdist controller, or the only process.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from pytest_elastic_timer.core.records import ExpiryRecord

hookspec = pytest.hookspec

# (setup, call, teardown) budgets of one test in seconds, scaled; None = unbounded.
PhaseBudgets = tuple[float | None, float | None, float | None]


@dataclass
class SessionFacts:
    """What the plugin knows of the session when it ends."""

    pid: int  # the pytest process (controller or only process)
    args: list[str]  # pytest's command-line arguments
    started: float  # time.time() at configure
    rootdir: str
    scale: float  # the scale factor every budget below is multiplied by
    default_call: float | None  # the call budget of a test without a marker, scaled
    report: str | None  # --elastic-timer-report, or None
    trace: str | None  # --elastic-timer-trace, or None
    slow: float  # --elastic-timer-slow (0 = off)
    directory: str = ""  # the watchdog's session directory ("" without a watchdog)
    exitstatus: int | None = None  # set once the session finished
    # The failed tests that expired scopes failed, by node id (see pytest_elastic_timer_expired).
    expired: Mapping[str, list[ExpiryRecord]] = field(default_factory=dict)
    # The scaled budgets of the tests whose budgets differ from the default, by node id.
    budgets: Mapping[str, PhaseBudgets] = field(default_factory=dict)

    def budget_of(self, nodeid: str, when: str) -> float | None:
        """The scaled budget of phase ``when`` of test ``nodeid`` (None = unbounded)."""
        known = self.budgets.get(nodeid)
        if known is not None:
            return known[("setup", "call", "teardown").index(when)]
        return self.default_call if when == "call" else None


@hookspec
def pytest_elastic_timer_expired(
    config: pytest.Config, report: pytest.TestReport, records: list[ExpiryRecord]
) -> None:
    """A test phase failed because scopes expired: ``records``, the first being the one
    the failure reports (the test's own scope, a scope of a process it started, or the
    scope for which the watchdog ended its xdist worker).

    Called once per failed report, before pytest's own plugins (junitxml, the terminal)
    see it, so an implementation may add ``report.user_properties``.
    """


@hookspec
def pytest_elastic_timer_terminal_summary(
    config: pytest.Config,
    terminalreporter: Any,
    records: list[ExpiryRecord],
    session: SessionFacts,
) -> None:
    """Write to the terminal summary, after the plugin's section of expired scopes
    (``records``: every expired scope of the session so far)."""


@hookspec
def pytest_elastic_timer_session_end(
    config: pytest.Config, records: list[ExpiryRecord], session: SessionFacts
) -> Mapping[str, Any] | None:
    """The session ends and its watchdog is about to stop: the last moment its session
    directory (``session.directory``) exists. ``records``: every expired scope.

    Return facts to add to the ``session`` object of the JSON report (or None). Called
    only when the session has a watchdog.
    """
