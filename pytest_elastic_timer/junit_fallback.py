"""A JUnit XML file the watchdog writes when pytest itself was killed.

Nothing here imports pytest: it runs in the watchdog process.
"""

from __future__ import annotations

from typing import Any

from .records import ExpiryRecord


def write(path: str, records: list[ExpiryRecord], session: dict[str, Any]) -> None:
    """Write a valid JUnit XML file at ``path`` naming every expired test."""
