"""pytest-elastic-timer: per-step deadlines for distributed tests.

Timer scopes (``expires()``, ``TimerRequest``) are enforced by a session-scoped watchdog
process that lives outside every test process; the docs (``docs/`` in the source)
describe them in full.

Every public name is imported on first use: a process that only enters scopes never
loads the barriers, events and locks or torch's timer client, and the watchdog process,
which imports its modules from this package, loads none of the scope machinery.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

# public name -> the module that defines it, imported when the name is first used
_LAZY = {
    **dict.fromkeys(
        (
            "ScopeExpired",
            "TimeoutException",
            "TimerRequest",
            "current_scope",
            "expires",
            "set_label",
        ),
        "pytest_elastic_timer.scope.scopes",
    ),
    **dict.fromkeys(("TimerClient", "configure_torch"), "pytest_elastic_timer.scope.torch_compat"),
    **dict.fromkeys(
        (
            "BarrierTimeout",
            "Event",
            "EventTimeout",
            "LockAbandoned",
            "LockTimeout",
            "Party",
            "SessionLock",
            "SyncTimeout",
            "barrier",
            "lock",
        ),
        "pytest_elastic_timer.sync.client",
    ),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


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
