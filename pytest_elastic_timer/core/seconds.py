"""The one rule for a number of seconds given by a user (an option, an ini value, a
marker argument): a finite number >= 0 (or > 0), named in the error when it is not."""

from __future__ import annotations

import math


def parse_seconds(
    raw: object,
    what: str,
    *,
    allow_zero: bool = True,
    allow_text: bool = True,
    kind: str = "a number of seconds",
) -> float:
    """A finite, non-negative number of seconds from ``raw``, or ValueError naming
    ``what``. ``allow_zero=False`` also refuses 0; ``allow_text=False`` refuses text
    (a marker takes numbers only; an option or ini value arrives as text); ``kind``
    is what the error says was expected (a factor is no number of seconds)."""
    if isinstance(raw, bool) or (isinstance(raw, str) and not allow_text):
        raise ValueError(f"{what} must be {kind}, not {raw!r}")
    if isinstance(raw, (int, float)):
        try:
            value = float(raw)
        except OverflowError:  # an int too large for a float (10**400): not finite either
            value = math.inf
    elif isinstance(raw, str):
        try:
            value = float(raw.strip())
        except ValueError:
            raise ValueError(f"{what} must be {kind}, not {raw!r}") from None
    else:
        raise ValueError(f"{what} must be {kind}, not {raw!r}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        limit = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{what} must be a finite number {limit}, not {raw!r}")
    return value


def check_seconds(value: object, what: str) -> float:
    """A number of seconds passed in code (``expires(5)``, ``barrier(..., timeout)``):
    TypeError when ``value`` is not an int or a float, else :func:`parse_seconds`'s
    rule (finite, >= 0)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number of seconds, not {value!r}")
    return parse_seconds(value, what, allow_text=False)


def parse_fraction(raw: object, what: str) -> float:
    """A fraction in [0, 1] from ``raw``, or ValueError naming ``what``."""
    try:
        value = float(str(raw).strip()) if not isinstance(raw, bool) else math.nan
    except ValueError:
        value = math.nan
    if not (0.0 <= value <= 1.0):
        raise ValueError(f"{what} must be a fraction between 0 and 1, not {raw!r}")
    return value
