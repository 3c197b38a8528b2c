"""The plugin keeps the real file system while a test fakes it (pyfakefs).

While a test uses pyfakefs, every loaded module's ``os``, ``os.path``, ``io``, ``shutil``
and ``pathlib`` are fakes, but in the modules of ``Patcher.SKIPMODULES`` (pyfakefs's own
pytest plugin puts pytest's there). A module imported for the first time during such a
test gets the fakes for good, and pyfakefs drops it from ``sys.modules`` afterwards: a
plugin that loads its report machinery at a test's first expiry would keep a copy bound
to a file system that is gone (an INTERNALERROR at the next expiry).

So where the collected tests use pyfakefs, the modules this plugin loads on first use in
a test's process are imported once the tests are collected, and they and psutil go into
``SKIPMODULES``: a scope in such a test, its report, the leftover-process check and a
forked child's scope table see the real file system. Nothing changes for the test: the
modules it uses are faked as before, and pyfakefs inspects no caller's stack for it (its
``additional_skip_names`` would, at every faked call).

"Use" is looked for where it is cheap to see: a test that asks for one of pyfakefs's
fixtures, or a module of the project (under its rootdir: tests, conftests, helpers) that
names pyfakefs. Merely installed, pyfakefs's own plugin is loaded into every session,
and loading this plugin's first-use modules (psutil among them) would cost every run
tens of milliseconds for nothing.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from types import ModuleType

from pytest_elastic_timer.core.plain_imports import import_plainly
from pytest_elastic_timer.plugin.state import any_item_asks_for

PATCHER_MODULE = "pyfakefs.fake_filesystem_unittest"
# What a test's process loads on first use, after collection: an expiry's report, the
# leftover-process check, the synchronization primitives and torch's timer client.
LOADED_ON_FIRST_USE = (
    "pytest_elastic_timer.plugin.expiry",
    "pytest_elastic_timer.core.records",
    "pytest_elastic_timer.core.stacks",
    "pytest_elastic_timer.core.collectives",
    "pytest_elastic_timer.ci.junit_fallback",
    "pytest_elastic_timer.watchdog.proctree",
    "pytest_elastic_timer.sync.client",
    "pytest_elastic_timer.scope.torch_compat",
    "psutil",
)
KEPT_REAL = ("pytest_elastic_timer", "psutil")
FIXTURES = frozenset({"fs", "fs_class", "fs_module", "fs_session"})  # pyfakefs's


def keep_if_faked(items: Iterable[object], rootdir: str) -> None:
    """If the tests use pyfakefs (``items``: the collected tests; ``rootdir``: the
    project's), load what this plugin uses during tests now, and keep pyfakefs from
    faking the file system for it (see the module's docstring)."""
    patcher_module = sys.modules.get(PATCHER_MODULE)
    patcher = getattr(patcher_module, "Patcher", None)
    skipped = getattr(patcher, "SKIPMODULES", None)
    if not isinstance(skipped, set):
        return
    asked = any_item_asks_for(items, FIXTURES)
    if not asked and not _named_in_project(rootdir):
        return
    for name in LOADED_ON_FIRST_USE:
        import_plainly(name)
    for name, module in list(sys.modules.items()):
        if module is not None and name.split(".", 1)[0] in KEPT_REAL:
            skipped.add(module)


def _named_in_project(rootdir: str) -> bool:
    """Whether a loaded module of the project (its file under ``rootdir``) has pyfakefs,
    or something of it (``Patcher``, its ``TestCase``), among its globals."""
    below = os.path.join(os.path.abspath(rootdir), "")
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if not isinstance(file, str) or not file.startswith(below):
            continue
        for value in list(vars(module).values()):
            name = (
                value.__name__
                if isinstance(value, ModuleType)
                else getattr(value, "__module__", None)
            )
            if isinstance(name, str) and name.split(".", 1)[0] == "pyfakefs":
                return True
    return False
