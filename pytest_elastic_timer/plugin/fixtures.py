"""The fixtures ``elastic_timer`` (the current test's budget and nested steps) and
``elastic_timer_server`` (where the session's watchdog is)."""

from __future__ import annotations

import math
import os

import pytest

from pytest_elastic_timer.core.seconds import Seconds
from pytest_elastic_timer.plugin.running import current
from pytest_elastic_timer.plugin.state import SESSION
from pytest_elastic_timer.scope import client, scopes
from pytest_elastic_timer.scope.scopes import TimerRequest


class ElasticTimer:
    """The ``elastic_timer`` fixture: the current test's budget and nested steps."""

    def __init__(self, item: pytest.Item) -> None:
        self._item = item

    @property
    def budget(self) -> float | None:
        """The call phase's budget in seconds, scaled (None = unbounded)."""
        book = self._item.config.stash[SESSION].budgets
        return book.scaled(book.of(self._item))[1]

    def remaining(self) -> float:
        """Seconds left in the call phase (``inf`` when unbounded)."""
        running = current(self._item)
        scope = running.call_scope if running is not None else None
        if scope is not None and scope.active:
            return scope.expires()
        budget = self.budget
        return math.inf if budget is None else budget

    def step(self, name: str, after: Seconds | None) -> TimerRequest:
        """A nested scope ``name`` that must end within ``after`` seconds."""
        return TimerRequest(after, name)

    @property
    def env(self) -> dict[str, str]:
        """An environment for subprocesses that keeps them in this session."""
        return dict(os.environ)


class ElasticTimerServer:
    """The ``elastic_timer_server`` fixture: where the session's watchdog is."""

    @property
    def address(self) -> str | None:
        """The watchdog's socket path (None without a watchdog)."""
        return os.environ.get(client.ENV_ADDRESS) or None

    @property
    def pid(self) -> int | None:
        """The watchdog's process id (None without a watchdog)."""
        return scopes.process_state().watchdog_pid or None


@pytest.fixture
def elastic_timer(request: pytest.FixtureRequest) -> ElasticTimer:
    """The current test's timer: ``.budget``, ``.remaining()``, ``.step()``, ``.env``."""
    return ElasticTimer(request.node)


@pytest.fixture(scope="session")
def elastic_timer_server() -> ElasticTimerServer:
    """The session's watchdog: ``.address`` (socket path) and ``.pid``."""
    return ElasticTimerServer()
