"""Slow phases (``--elastic-timer-slow``): test phases that used at least that fraction
of their budget, as ``SLOW`` lines in the terminal summary, and the ``slow`` and
``slowest`` facts of the JSON report. Registered at the end of a session (in the
controller, or the only process) that has a budget or a JSON report; it implements the
plugin's hooks (:mod:`..plugin.hookspecs`).

Nothing here runs for a passing test: phase times are read from the terminal's
reports once the session ends.
"""

from __future__ import annotations

import heapq
import math
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import pytest

if TYPE_CHECKING:
    from pytest_elastic_timer.core.records import ExpiryRecord
    from pytest_elastic_timer.plugin.hookspecs import SessionFacts

SLOWEST_TESTS = 50  # tests listed in the JSON report's session.slowest
SLOWEST_SCOPES = 3  # scopes listed per test there
PHASES = ("setup", "call", "teardown")


# A named tuple and a plain class, not dataclasses: this module loads at the end of
# every session with a budget, and defining a dataclass costs 0.2 to 0.5 ms (see
# docs/design.md, "One dataclass defined at start"); the records it imported only for
# annotations cost some 1.5 ms more.
class PhaseTime(NamedTuple):
    """How long one test phase took, against its budget."""

    nodeid: str
    when: str
    seconds: float
    budget: float | None

    @property
    def scope(self) -> str:
        return f"{self.nodeid.rsplit('::', 1)[-1]}::{self.when}"

    @property
    def share(self) -> float | None:
        return self.seconds / self.budget if self.budget else None

    def suggestion(self, fraction: float) -> float:
        """A budget under which this duration stays well below the slow threshold."""
        return nice_ceil(self.seconds / (fraction * 0.75))

    def to_json(self, fraction: float) -> dict[str, Any]:
        return {
            "nodeid": self.nodeid,
            "scope": self.scope,
            "phase": self.when,
            "seconds": round(self.seconds, 6),
            "budget": self.budget,
            "share": round(self.share or 0.0, 4),
            "suggested_budget": self.suggestion(fraction),
        }


class Phases:
    """The phase times read from the terminal's reports once the session ended."""

    def __init__(self) -> None:
        # Slow phases, the most slow first.
        self.slow: list[PhaseTime] = []
        # (nodeid, when, seconds, budget) per phase of the slowest tests.
        self.slowest: list[tuple[str, str, float, float | None]] = []


# Subscripted in the annotation only (plugin/state.py's SESSION says why).
PHASES_KEY: pytest.StashKey[Phases] = pytest.StashKey()


def nice_ceil(seconds: float) -> float:
    """The smallest of 1, 1.5, 2, 3, 5, 7.5 times a power of ten that is >= ``seconds``."""
    if seconds <= 0:
        return 0.0
    power = 10.0 ** math.floor(math.log10(seconds))
    for step in (1, 1.5, 2, 3, 5, 7.5, 10):
        if step * power >= seconds * (1 - 1e-9):
            return float(f"{step * power:.6g}")
    return 10 * power


def slow_line(phase: PhaseTime, fraction: float) -> str:
    return (
        f"SLOW {phase.nodeid} {phase.when}: {phase.seconds:.2f}s of {phase.budget:g}s budget "
        f"({phase.share or 0:.0%}); suggested budget {phase.suggestion(fraction):g}s"
    )


def slow_phases(config: pytest.Config, session: SessionFacts) -> list[PhaseTime]:
    """Test phases that used at least the slow fraction of their budget (not expired)."""
    return phases_of(config, session).slow if session.slow else []


def phases_of(config: pytest.Config, session: SessionFacts) -> Phases:
    """The session's phase times, read once from the terminal's reports."""
    phases = config.stash.get(PHASES_KEY, None)
    if phases is None:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        stats: dict[str, list[Any]] = getattr(reporter, "stats", None) or {}
        phases = config.stash[PHASES_KEY] = collect_phases(stats, session)
    return phases


def collect_phases(stats: dict[str, list[Any]], session: SessionFacts) -> Phases:
    """Slow phases, and every phase of the slowest tests, from the reports the
    terminal kept (one pass over them all, then one over the few that make the list)."""
    found = Phases()
    budgets = session.budgets
    ranked = session.report is not None  # only the JSON report lists the slowest tests
    # Passed setups and teardowns (the group without a category) matter only to the
    # ranking and to tests with a setup or teardown budget: most sessions skip them.
    phase_budgets = any(b[0] is not None or b[2] is not None for b in budgets.values())
    scanned = [g for key, g in stats.items() if key or ranked or phase_budgets]
    slow = session.slow
    every = [b for known in budgets.values() for b in known if b] + [session.default_call or 0.0]
    smallest = min((b for b in every if b), default=0.0)
    threshold = slow * smallest if slow and smallest else math.inf
    longest: dict[str, float] = {}
    for group in scanned:
        if not ranked and _longest(group) < threshold:
            continue  # nothing in it is slow
        for report in group:
            seconds = getattr(report, "duration", None)  # warnings have none
            if seconds is None or report.when not in PHASES:
                continue
            nodeid = report.nodeid
            if ranked and seconds > longest.get(nodeid, -1.0):
                longest[nodeid] = seconds
            if seconds >= threshold:  # a phase that may be slow: look at its budget
                budget = session.budget_of(nodeid, report.when)
                if budget and slow * budget <= seconds <= budget and nodeid not in session.expired:
                    found.slow.append(PhaseTime(nodeid, report.when, seconds, budget))
    found.slow.sort(key=lambda p: -(p.share or 0.0))
    wanted = set(heapq.nlargest(SLOWEST_TESTS, longest, key=longest.__getitem__))
    if wanted:
        for group in stats.values():
            for report in group:
                if getattr(report, "when", None) in PHASES and report.nodeid in wanted:
                    budget = session.budget_of(report.nodeid, report.when)
                    found.slowest.append((report.nodeid, report.when, report.duration, budget))
    return found


_duration = operator.attrgetter("duration")


def _longest(reports: list[Any]) -> float:
    """The longest duration in ``reports`` (inf if one has none: look at each)."""
    try:
        return max(map(_duration, reports), default=0.0)
    except (AttributeError, TypeError):  # a warnings report, or None
        return math.inf


def slowest(
    phases: Sequence[tuple[str, str, float, float | None]],
    events: list[dict[str, Any]],
    expired: Sequence[ExpiryRecord] = (),
    tests: int = SLOWEST_TESTS,
    per_test: int = SLOWEST_SCOPES,
) -> list[dict[str, Any]]:
    """Per test, its slowest scopes (phases, and traced scopes of every process when
    tracing is on), for the ``tests`` tests whose slowest scope took longest."""
    # First only the longest time per test (one pass, no objects), then the details of
    # the few tests that make the list.
    longest: dict[str, float] = {}
    get = longest.get
    for nodeid, _, seconds, _ in phases:
        if seconds > get(nodeid, -1.0):
            longest[nodeid] = seconds
    timed = [(e, str(e.get("nodeid") or "")) for e in events]
    for event, nodeid in timed:
        if nodeid:
            seconds = float(event["end"]) - float(event["start"])
            if seconds > get(nodeid, -1.0):
                longest[nodeid] = seconds
    top = heapq.nlargest(tests, longest, key=longest.__getitem__)
    wanted = set(top)
    budgets = {(r.nodeid, r.scope): r.budget for r in expired}
    by_test: dict[str, dict[str, dict[str, Any]]] = {nodeid: {} for nodeid in top}
    for nodeid, when, seconds, budget in phases:
        if nodeid in wanted:
            scope = f"{nodeid.rsplit('::', 1)[-1]}::{when}"
            by_test[nodeid][scope] = {
                "scope": scope,
                "seconds": round(seconds, 6),
                "budget": budget,
            }
    for event, nodeid in timed:
        if nodeid not in wanted:
            continue
        seconds = round(float(event["end"]) - float(event["start"]), 6)
        known = by_test[nodeid]
        path = str(event.get("path", ""))
        entry = known.get(path)
        if entry is None or entry["seconds"] < seconds:
            known[path] = {
                "scope": path,
                "seconds": seconds,
                "budget": entry["budget"] if entry else budgets.get((nodeid, path)),
            }
    return [
        {
            "nodeid": nodeid,
            "scopes": sorted(by_test[nodeid].values(), key=lambda s: -s["seconds"])[:per_test],
        }
        for nodeid in top
    ]


# -- the plugin's hooks ----------------------------------------------------------------
def pytest_elastic_timer_terminal_summary(
    config: pytest.Config,
    terminalreporter: Any,
    records: list[ExpiryRecord],
    session: SessionFacts,
) -> None:
    slow = slow_phases(config, session)
    if slow:
        terminalreporter.section(
            f"elastic-timer: slow scopes (>= {session.slow:.0%} of their budget)",
            sep="=",
            yellow=True,
        )
        for phase in slow:
            terminalreporter.write_line(slow_line(phase, session.slow))


def pytest_elastic_timer_session_end(
    config: pytest.Config, records: list[ExpiryRecord], session: SessionFacts
) -> dict[str, Any]:
    events: list[dict[str, Any]] = []
    if session.trace:  # traced scopes of every process count among a test's slowest
        from pytest_elastic_timer.ci.trace import read_events

        events = read_events(session.directory)
    expired = [r for found in session.expired.values() for r in found]
    return {
        "slow_fraction": session.slow,
        "slow": [p.to_json(session.slow) for p in slow_phases(config, session)],
        "slowest": slowest(phases_of(config, session).slowest, events, expired),
    }
