"""The plugin keeps the real file system while a test fakes it (pyfakefs).

While a test uses pyfakefs, every loaded module's ``os``, ``os.path``, ``io``, ``shutil``
and ``pathlib`` are fakes, but in the modules of ``Patcher.SKIPMODULES`` (pyfakefs's own
pytest plugin puts pytest's there). A module imported for the first time during such a
test gets the fakes for good, and pyfakefs drops it from ``sys.modules`` afterwards: a
plugin that loads its report machinery at a test's first expiry would keep a copy bound
to a file system that is gone (an INTERNALERROR at the next expiry).

So where pyfakefs is loaded once the tests are collected, the modules this plugin loads
on first use in a test's process are imported then, and they and psutil go into
``SKIPMODULES``: a scope in such a test, its report, the leftover-process check and a
forked child's scope table see the real file system. Nothing changes for the test: the
modules it uses are faked as before, and pyfakefs inspects no caller's stack for it (its
``additional_skip_names`` would, at every faked call).
"""

from __future__ import annotations

import importlib
import sys

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


def keep_if_faked() -> None:
    """If pyfakefs is loaded, load what this plugin uses during tests now, and keep
    pyfakefs from faking the file system for it (see the module's docstring)."""
    patcher_module = sys.modules.get(PATCHER_MODULE)
    patcher = getattr(patcher_module, "Patcher", None)
    skipped = getattr(patcher, "SKIPMODULES", None)
    if not isinstance(skipped, set):
        return
    for name in LOADED_ON_FIRST_USE:
        importlib.import_module(name)
    for name, module in list(sys.modules.items()):
        if module is not None and name.split(".", 1)[0] in KEPT_REAL:
            skipped.add(module)
