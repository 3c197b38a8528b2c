"""The public API as a user's type checker reads it (the package ships ``py.typed``):
every number of seconds that the API takes at run time passes mypy too."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import pytest_elastic_timer

mypy_api = pytest.importorskip("mypy.api", reason="mypy is not installed")

USER_CODE = """
from decimal import Decimal
from fractions import Fraction

import pytest_elastic_timer as et


class Count:
    # An integer of another library: operator.index() takes it.
    def __index__(self) -> int:
        return 3


def budgets() -> None:
    with et.expires(Fraction(1, 2), scope="fraction", grace=Decimal("0.5")):
        pass
    with et.expires(Count()):
        pass
    scope = et.TimerRequest(Decimal("2.5"))
    scope.reschedule(Fraction(3, 2))
    scope.extend(Decimal(1))
    et.barrier("b", 2, timeout=Fraction(5))
    et.Event("e").wait(Decimal(3))
    et.lock("l", timeout=Count())
    et.expires(None)
"""

MISTAKES = """
import pytest_elastic_timer as et

et.expires("5")
et.barrier("b", 2, timeout="1")
"""


def _mypy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str) -> tuple[str, int]:
    """mypy --strict on ``source`` as a user's module; the package is read from this
    checkout, its own errors left out (as they are for an installed package)."""
    (tmp_path / "user.py").write_text(source, encoding="utf-8")
    monkeypatch.setenv("MYPYPATH", os.path.dirname(os.path.dirname(pytest_elastic_timer.__file__)))
    monkeypatch.chdir(tmp_path)
    out, err, status = mypy_api.run(
        ["--strict", "--follow-imports=silent", "--cache-dir", os.devnull, "user.py"]
    )
    return out + err, status


def test_every_kind_of_number_the_api_takes_type_checks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text, status = _mypy(tmp_path, monkeypatch, USER_CODE)
    assert status == 0, text


def test_text_is_no_number_of_seconds_to_the_type_checker_either(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text, status = _mypy(tmp_path, monkeypatch, MISTAKES)
    assert status == 1, text
    assert 'user.py:4: error: Argument 1 to "TimerRequest" has incompatible type "str"' in text
    assert 'user.py:5: error: Argument "timeout" to "barrier" has incompatible type "str"' in text
