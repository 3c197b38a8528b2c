"""The one rule for a number of seconds given by a user (an option, an ini value, a
marker argument, an argument in code): a finite number >= 0 (or > 0), named in the
error when it is not.

A number is what a user means by one, whatever library made it: an ``int`` or a
``float``, any :class:`numbers.Real` (numpy's scalars, :class:`fractions.Fraction`), a
:class:`decimal.Decimal`, or an object that :func:`operator.index` takes (an integer of
another library). Never a ``bool`` (``expires(True)`` is a mistake, not one second),
and text only where text is the input (an option, an ini value). It is returned as a
plain ``float``, so that nothing downstream (the JSON report, a slot of the shared
table) ever sees a foreign type.
"""

from __future__ import annotations

import decimal
import math
import numbers
import operator
from typing import SupportsFloat, SupportsIndex, TypeAlias

# What the API's type hints take as a number of seconds: anything a float can be made of
# (numpy's scalars, Fraction, Decimal) or an integer of another library. The check at
# run time (check_seconds) is the rule; this is what a type checker can tell of it.
Seconds: TypeAlias = SupportsFloat | SupportsIndex

# int and float first: their subclasses (numpy's float64) pass without the ABC's
# slower check. Decimal is a number although not a numbers.Real: it stays out of that
# ABC only because it does not mix with float in arithmetic, which a budget never does.
_REALS = (int, float, numbers.Real, decimal.Decimal)


def as_number(raw: object) -> float | None:
    """``raw`` as a float if it is a number (see the module), else None. A number too
    large for a float is ``inf``, and one no float can hold (a signaling NaN) is
    ``nan``: neither is finite."""
    if raw.__class__ in (int, float):  # the common case, without the ABC checks
        value: object = raw
    elif isinstance(raw, bool):
        return None
    elif isinstance(raw, _REALS):
        value = raw
    else:
        try:
            # An integer of another library (numpy's are numbers.Real already); numpy's
            # bool is refused here, as bool is above, and so is an array of more than
            # one number.
            value = operator.index(raw)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return None
    try:
        return float(value)  # type: ignore[arg-type]
    except OverflowError:  # an int or a Fraction too large for a float (10**400)
        return math.inf
    except ValueError:  # Decimal("sNaN")
        return math.nan
    except TypeError:
        # A numbers.Real that is no float: numpy's timedelta64, whose unit may be
        # anything but seconds.
        return None


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
    if isinstance(raw, str):
        if not allow_text:
            raise ValueError(f"{what} must be {kind}, not {raw!r}")
        try:
            value = float(raw.strip())
        except ValueError:
            raise ValueError(f"{what} must be {kind}, not {raw!r}") from None
    else:
        number = as_number(raw)
        if number is None:
            raise ValueError(f"{what} must be {kind}, not {raw!r}")
        value = number
    return _checked(value, raw, what, allow_zero)


def _checked(value: float, raw: object, what: str, allow_zero: bool) -> float:
    """``value`` if it is finite and >= 0 (> 0 without ``allow_zero``), else ValueError
    naming ``what`` and the value as given (``raw``)."""
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        limit = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{what} must be a finite number {limit}, not {raw!r}")
    return value


def check_seconds(value: object, what: str) -> float:
    """A number of seconds passed in code (``expires(5)``, ``barrier(..., timeout)``),
    as a plain float: TypeError when ``value`` is no number (text, a ``bool``, None),
    else :func:`parse_seconds`'s rule (finite, >= 0)."""
    number = as_number(value)
    if number is None:
        raise TypeError(f"{what} must be a number of seconds, not {value!r}")
    return _checked(number, value, what, allow_zero=True)


def parse_fraction(raw: object, what: str) -> float:
    """A fraction in [0, 1] from ``raw``, or ValueError naming ``what``."""
    try:
        value = float(str(raw).strip()) if not isinstance(raw, bool) else math.nan
    except ValueError:
        value = math.nan
    if not (0.0 <= value <= 1.0):
        raise ValueError(f"{what} must be a fraction between 0 and 1, not {raw!r}")
    return value
