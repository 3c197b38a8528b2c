"""pytest-elastic-timer: per-step deadlines for distributed tests.

Timer scopes (``expires()``, ``TimerRequest``) are enforced by a session-scoped watchdog
process that lives outside every test process; see https://pytest-elastic-timer docs.
"""

from __future__ import annotations

from .scopes import (
    ScopeExpired,
    TimeoutException,
    TimerRequest,
    current_scope,
    expires,
    set_label,
)
from .torch_compat import TimerClient, configure_torch

__all__ = [
    "ScopeExpired",
    "TimeoutException",
    "TimerClient",
    "TimerRequest",
    "configure_torch",
    "current_scope",
    "expires",
    "set_label",
]

__version__ = "0.1.0"
