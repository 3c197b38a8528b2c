"""Importing this package's own modules from their bytecode, past pytest's assertion
rewriting.

pytest marks every module of a plugin's distribution for assertion rewriting (when it
loads plugins from entry points, its default), and its import hook then reads the
source, rewrites it and compiles it. It caches what it compiled beside the source, but
where it cannot write there (``PYTHONDONTWRITEBYTECODE=1``, as many container images
set, or an installation the user cannot write to), it compiles every one of them again
at every start of pytest and of each xdist worker: about 100 ms for the modules the
plugin loads at start, half of a one-test session. Those modules have nothing for
pytest to rewrite: their few asserts guard the plugin's own invariants.

:func:`plainly` lets Python's own path finder import them for as long as it is entered,
ahead of pytest's hook, so that the bytecode compiled at installation is used. Only
names of this package are answered, and only while it is entered: the rest of the
process imports as before.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator, Sequence
from importlib.machinery import ModuleSpec, PathFinder
from types import ModuleType

_OWN_PREFIX = __name__.partition(".")[0] + "."


class _OwnModulesFinder:
    """A meta path finder for the submodules of this package: found as Python finds
    them without import hooks (``PathFinder``), on the parent package's path."""

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if not name.startswith(_OWN_PREFIX):
            return None
        return PathFinder.find_spec(name, path, target)


@contextlib.contextmanager
def plainly() -> Iterator[None]:
    """Within this block, this package's modules are imported from their bytecode,
    not through pytest's assertion rewriting (see the module's docstring)."""
    finder = _OwnModulesFinder()
    # A new list each way, not the list changed in place: another thread importing
    # meanwhile walks the list it started with, and one finder removed from under its
    # walk would shift the next one past it (a spurious ModuleNotFoundError there).
    sys.meta_path = [finder, *sys.meta_path]
    try:
        yield
    finally:
        # By identity: the block may have added or removed other finders.
        sys.meta_path = [f for f in sys.meta_path if f is not finder]


def import_plainly(name: str) -> ModuleType:
    """``importlib.import_module(name)`` within :func:`plainly`."""
    with plainly():
        return importlib.import_module(name)
