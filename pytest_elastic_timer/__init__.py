"""pytest-elastic-timer: per-step deadlines for distributed tests.

Timer scopes (``expires()``, ``TimerRequest``) are enforced by a session-scoped watchdog
process that lives outside every test process; see https://pytest-elastic-timer docs.
"""

from __future__ import annotations

from pytest_elastic_timer.scope.scopes import (
    ScopeExpired,
    TimeoutException,
    TimerRequest,
    current_scope,
    expires,
    set_label,
)
from pytest_elastic_timer.scope.torch_compat import TimerClient, configure_torch
from pytest_elastic_timer.sync.client import (
    BarrierTimeout,
    Event,
    EventTimeout,
    LockAbandoned,
    LockTimeout,
    Party,
    SessionLock,
    SyncTimeout,
    barrier,
    lock,
)

__all__ = [
    "BarrierTimeout",
    "Event",
    "EventTimeout",
    "LockAbandoned",
    "LockTimeout",
    "Party",
    "ScopeExpired",
    "SessionLock",
    "SyncTimeout",
    "TimeoutException",
    "TimerClient",
    "TimerRequest",
    "barrier",
    "configure_torch",
    "current_scope",
    "expires",
    "lock",
    "set_label",
]

__version__ = "0.1.0"
