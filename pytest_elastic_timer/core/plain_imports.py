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
    original = sys.meta_path
    # A new list for the block, not the list changed in place: another thread importing
    # meanwhile walks the list it started with, and one finder removed from under its
    # walk would shift the next one past it (a spurious ModuleNotFoundError there).
    ours = [finder, *original]
    sys.meta_path = ours
    try:
        yield
    finally:
        if sys.meta_path is not ours:  # replaced within the block: that list stays
            sys.meta_path = [f for f in sys.meta_path if f is not finder]
        else:
            # The original list object goes back, not a copy: the interpreter keeps a
            # reference to the list it started with until its very end, and pytest
            # removes its rewriting hook (which holds its whole session) from whichever
            # list is current. A copy left current would keep that hook, and every
            # module, alive in the original list to the end of the process (and
            # CPython then takes milliseconds longer to end it).
            kept = [f for f in ours if f is not finder]
            if not _same_items(kept, original):  # the block added or removed finders
                original[:] = kept
            sys.meta_path = original


def _same_items(a: Sequence[object], b: Sequence[object]) -> bool:
    """Whether ``a`` and ``b`` hold the very same objects, in the same order."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def import_plainly(name: str) -> ModuleType:
    """``importlib.import_module(name)`` within :func:`plainly`."""
    with plainly():
        return importlib.import_module(name)
