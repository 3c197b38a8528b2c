"""Watchdog side of the deadline-aware synchronization primitives (barrier, event, lock).

Installed into the watchdog through its extension points (``dog.extensions``,
``dog.on_disconnect``, ``dog.call_at``). Nothing here imports pytest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .watchdog import Watchdog


def install(dog: Watchdog) -> None:
    """Register the synchronization ops with ``dog``."""
