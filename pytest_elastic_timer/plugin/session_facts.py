"""What the plugin knows of the session when it ends: :class:`SessionFacts`, the
``session`` argument of the plugin's hooks (:mod:`.hookspecs`, which names it too).
Loaded at the session's end, not at its start (see ``hookspecs.__getattr__``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pytest_elastic_timer.core.records import ExpiryRecord
    from pytest_elastic_timer.plugin.hookspecs import PhaseBudgets


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
