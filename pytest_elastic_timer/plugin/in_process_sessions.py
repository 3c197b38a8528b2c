"""Sessions that a session's tests run in-process (pytester's ``runpytest_inprocess``
and ``inline_run``: the test suites of pytest plugins).

pytester puts ``sys.modules`` back as it found it after each such session: a module
that the inner session imported first is dropped, and the next inner session imports
it again. This plugin loads what reports a failure (the failed-report plugins, the
records, the reader of the collectives rings) at a session's first failure, and the
slow phases' output and the facts its hooks are handed at the end of a session with a
budget: each inner session that failed, or had a budget, paid for loading them anew
(2 to 3 ms). So where the collected tests ask for pytester, the session loads them
once, after collection, before any inner session runs.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from pytest_elastic_timer.core.plain_imports import import_plainly
from pytest_elastic_timer.plugin.state import any_item_asks_for

FIXTURES = frozenset({"pytester", "testdir"})
PLUGIN_NAMES = ("pytester", "_pytest.pytester")  # as -p or pytest_plugins name it
LOADED_BY_INNER_SESSIONS = (
    "pytest_elastic_timer.plugin.expiry",
    "pytest_elastic_timer.core.collectives",
    "pytest_elastic_timer.ci.slow",
    "pytest_elastic_timer.plugin.session_facts",
)


def load_if_tests_run_sessions(config: pytest.Config, items: Iterable[object]) -> None:
    """If any of ``items`` (the collected tests) asks for pytester, import now what
    inner sessions would each import again."""
    manager = config.pluginmanager
    if not any(manager.has_plugin(name) for name in PLUGIN_NAMES):
        return  # no test can ask for it: the items are not looked at
    if any_item_asks_for(items, FIXTURES):
        for name in LOADED_BY_INNER_SESSIONS:
            import_plainly(name)
