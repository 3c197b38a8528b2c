"""The plugin's own hooks: an extension point for outputs of expired and slow scopes.

The CI outputs of this package (JUnit XML, GitHub Actions, slow phases, the trace) are
implementations of these hooks, registered as plugins when a session uses them; a
``conftest.py`` or another plugin can implement them the same way. Every hook runs in
the process that reports the session: the xdist controller, or the only process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from pytest_elastic_timer.core.plain_imports import plainly

if TYPE_CHECKING:
    from collections.abc import Mapping

    from pytest_elastic_timer.core.records import ExpiryRecord
    from pytest_elastic_timer.plugin.session_facts import SessionFacts as SessionFacts

hookspec = pytest.hookspec

# (setup, call, teardown) budgets of one test in seconds, scaled; None = unbounded.
PhaseBudgets = tuple[float | None, float | None, float | None]


if not TYPE_CHECKING:  # type checkers see the import above, and no name made up

    def __getattr__(name: str) -> Any:
        """``SessionFacts``, the ``session`` argument of the hooks below, is defined in
        :mod:`.session_facts` when first used (at the session's end): a dataclass costs
        every session's start-up some 0.4 ms to define."""
        if name == "SessionFacts":
            with plainly():
                from pytest_elastic_timer.plugin.session_facts import SessionFacts

            return SessionFacts
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@hookspec
def pytest_elastic_timer_expired(
    config: pytest.Config, report: pytest.TestReport, records: list[ExpiryRecord]
) -> None:
    """A test phase failed because scopes expired: ``records``, the first being the one
    the failure reports (the test's own scope, a scope of a process it started, or the
    scope for which the watchdog ended its xdist worker).

    Called once per failed report, before pytest's own plugins (junitxml, the terminal)
    see it, so an implementation may add ``report.user_properties``. With
    ``--junitxml`` they are in the report's testcase, after the plugin's own, in the
    order added: pytest writes only some reports' properties (a teardown's), and the
    plugin adds the others, leaving out any name and value the testcase has already;
    also for an xdist worker the watchdog ended. Not in the file the watchdog writes
    when pytest itself was killed: the hook runs in pytest.
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
