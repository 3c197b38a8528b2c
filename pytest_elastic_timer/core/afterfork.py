"""What a forked child forgets of its parent: callbacks run in the child after a fork.

``os.register_at_fork`` keeps what it is given until the interpreter's last clean-up
step, after every module has been torn down. A module-level function given to it keeps
its module's globals, and all they reach (most of the package), alive to that point, and
CPython 3.11 then takes about 4 ms longer to end every process that imported the
package (docs/design.md, "Fork handling"). The hook registered here holds the function
weakly instead: the function goes with its module, and the hook does nothing after that.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable

__all__ = ["call_in_child"]


class _WeakCallback:
    """Calls a function while it is alive; it keeps nothing else alive."""

    __slots__ = ("ref",)

    def __init__(self, callback: Callable[[], None]) -> None:
        self.ref = weakref.ref(callback)

    def __call__(self) -> None:
        callback = self.ref()
        if callback is not None:
            callback()


def call_in_child(callback: Callable[[], None]) -> None:
    """Call ``callback`` in the child after each fork of this process (POSIX).

    ``callback`` must be a module-level function: it is held weakly, so a lambda or a
    closure that nothing else holds would be gone before the first fork. As with
    ``os.register_at_fork``, an exception it raises is reported and the child goes on.
    """
    if hasattr(os, "register_at_fork"):  # on Windows nothing forks
        os.register_at_fork(after_in_child=_WeakCallback(callback))
