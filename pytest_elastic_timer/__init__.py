"""pytest-elastic-timer: per-step deadlines for distributed tests.

Timer scopes (``expires()``, ``TimerRequest``) are enforced by a session-scoped watchdog
process that lives outside every test process; the docs (``docs/`` in the source)
describe them in full.

The pytest plugin is ``elastic_timer``; loaded as a plugin by this package's name, the
package loads it (:func:`pytest_addhooks`). PYTEST_DONT_REWRITE: pytest, asked to load
it by name after it was imported, need not warn that it cannot rewrite its asserts.

Every public name is imported on first use: a process that only enters scopes never
loads the barriers, events and locks or torch's timer client, and the watchdog process,
which imports its modules from this package, loads none of the scope machinery.
"""

from __future__ import annotations

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
    from pytest_elastic_timer.core.plain_imports import import_plainly

    value = getattr(import_plainly(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


def pytest_addhooks(pluginmanager: Any) -> None:
    """Loaded as a pytest plugin by the package's name (``-p pytest_elastic_timer``,
    ``pytest_plugins = ["pytest_elastic_timer"]``), the package loads the plugin,
    ``elastic_timer``, unless it is loaded already or blocked (``-p no:elastic_timer``):
    the package itself has no hooks, and would enforce nothing."""
    if pluginmanager.has_plugin("elastic_timer") or pluginmanager.is_blocked("elastic_timer"):
        return
    from pytest_elastic_timer.plugin import hooks

    if not pluginmanager.is_registered(hooks):
        pluginmanager.register(hooks, "elastic_timer")


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
