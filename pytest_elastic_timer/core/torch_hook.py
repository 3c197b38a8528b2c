"""Noticing that ``torch.distributed`` is imported, without importing torch.

The collectives recorder (``scope/collectives.py``) has to wrap torch.distributed's
functions before user code takes references to them (``from torch.distributed import
all_reduce``), and it must cost nothing in a process that never imports torch. So
:func:`watch` puts a one-shot finder first on ``sys.meta_path``: it answers no import
but ``torch.distributed``, for which it asks the other finders for the real module spec
and wraps its loader, so that :func:`on_import` runs right after the module's own code.
The finder then leaves ``sys.meta_path``: once torch.distributed is in, no import pays
for it any more.

Only the standard library is used here: the session's ``sitecustomize`` loads this file
by its path, in every Python process of the session, before anything else is imported.
"""

from __future__ import annotations

import sys

# Not from typing: importing typing would cost every process of the session some
# milliseconds at start-up (mypy knows this name all the same).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from importlib.machinery import ModuleSpec
    from types import ModuleType
    from typing import Any

TARGET = "torch.distributed"
RECORDER = "pytest_elastic_timer.scope.collectives"
_MARK = "_pytest_elastic_timer_torch_hook"  # on the finder; copies of this file agree


def on_import(module: ModuleType | None = None) -> None:
    """torch.distributed is imported: install the recorder. Nothing here may break
    the user's import, so any failure leaves torch as it is."""
    try:
        # From the bytecode compiled at installation, past pytest's assertion rewriting
        # (core/plain_imports.py says why): pytest would compile the recorder from
        # source in every process of the session that imports torch.distributed.
        from pytest_elastic_timer.core.plain_imports import import_plainly

        import_plainly(RECORDER).install()
    except Exception:  # the recorder is a diagnostic: never the reason an import fails
        pass


class _Loader:
    """The real loader of torch.distributed, with :func:`on_import` after it."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self.loader.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        try:
            self.loader.exec_module(module)
        finally:
            # Whoever looks at the module later sees torch's own loader.
            module.__loader__ = self.loader
            if module.__spec__ is not None:
                module.__spec__.loader = self.loader
        on_import(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


class Finder:
    """A meta path finder that finds nothing, and notices torch.distributed."""

    _pytest_elastic_timer_torch_hook = True

    def find_spec(
        self, fullname: str, path: Any = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != TARGET:
            return None
        unwatch()
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is None:
                continue
            spec: ModuleSpec | None = find_spec(fullname, path, target)
            if spec is None:
                continue
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _Loader(spec.loader)  # type: ignore[assignment]
            return spec
        return None


def unwatch() -> None:
    """Stop waiting for torch.distributed to be imported (once it is; or a session
    that ends in a process that goes on: ``pytest.main()`` in a script)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, _MARK, False)]


def watch() -> bool:
    """Install the recorder once torch.distributed is imported (now, if it is). True
    if this call put the finder on ``sys.meta_path``."""
    if TARGET in sys.modules:
        on_import(sys.modules[TARGET])
    elif not any(getattr(f, _MARK, False) for f in sys.meta_path):
        sys.meta_path.insert(0, Finder())
        return True
    return False
