"""Marker and option values from hypothesis: never an INTERNALERROR, always an error
that names the test (for a marker) and the value.

The parsing functions get many examples in this process; real inner sessions get a few
batches (one test per value in one module: a bad marker is an error of its test alone).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from helpers import run
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from pytest_elastic_timer.core.seconds import parse_seconds
from pytest_elastic_timer.plugin.budgets import MARKER_KEYWORDS, parse_marker

NODEID = "test_m.py::test_m"
WHERE = f"{NODEID}: @pytest.mark.expires"


# -- values, each with the source text that makes it ----------------------------------
def literal(value: Any) -> tuple[str, Any]:
    return repr(value), value


bad_floats = st.one_of(
    st.floats(max_value=-1e-9, allow_infinity=False).map(literal),
    st.sampled_from(
        [("float('nan')", math.nan), ("float('inf')", math.inf), ("-float('inf')", -math.inf)]
    ),
    st.integers(309, 500).map(lambda e: (f"1e{e}", math.inf)),  # a literal too large: inf
)
bad_ints = st.one_of(
    st.integers(max_value=-1).map(literal),
    st.integers(310, 1000).map(lambda e: (f"10**{e}", 10**e)),  # too large for a float
)
bad_other = st.one_of(
    st.text(max_size=12).map(literal),  # text, even "1": a marker takes numbers only
    st.booleans().map(literal),
    st.lists(st.integers(0, 9), max_size=3).map(literal),
    st.dictionaries(st.sampled_from("ab"), st.integers(0, 9), max_size=2).map(literal),
    st.just(("1j", 1j)),
    st.just(("b'1'", b"1")),
)
bad_values = bad_floats | bad_ints | bad_other


def mentions(message: str, value: Any) -> bool:
    return repr(value) in message


# -- the parsers, many examples ------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(raw=st.one_of(st.text(max_size=20), st.floats(), st.integers(), st.booleans(), st.none()))
def test_parse_seconds_returns_a_finite_number_or_names_the_value(raw: Any) -> None:
    try:
        value = parse_seconds(raw, "--expires")
    except ValueError as exc:
        assert str(exc).startswith("--expires must be ")
        assert mentions(str(exc), raw), str(exc)
    else:
        assert math.isfinite(value) and value >= 0


@settings(max_examples=300, deadline=None)
@given(
    where=st.sampled_from(["seconds", "positional", "setup", "teardown", "grace"]),
    bad=bad_values,
)
def test_a_bad_marker_value_is_a_value_error_naming_it(where: str, bad: tuple[str, Any]) -> None:
    _, value = bad
    if where == "positional":
        args: tuple[Any, ...] = (value,)
        kwargs: dict[str, Any] = {}
    elif where == "seconds":
        args, kwargs = (), {"seconds": value}
    else:
        args, kwargs = (1,), {where: value}
    with pytest.raises(ValueError) as caught:
        parse_marker(NODEID, args, kwargs)
    message = str(caught.value)
    assert message.startswith(WHERE)
    assert mentions(message, value), message


@settings(max_examples=200, deadline=None)
@given(
    args=st.lists(st.integers(0, 5) | st.floats(0, 5), max_size=3),
    kwargs=st.dictionaries(
        st.sampled_from(["seconds", "setup", "teardown", "grace", "timeout", "after", "x"]),
        st.none() | st.integers(0, 5) | st.floats(0, 5),
        max_size=3,
    ),
)
def test_marker_shapes_are_parsed_or_named(args: list[Any], kwargs: dict[str, Any]) -> None:
    """Any shape of arguments: parsed budgets, or an error that says what is wrong."""
    try:
        budgets = parse_marker(NODEID, tuple(args), kwargs)
    except ValueError as exc:
        message = str(exc)
        assert message.startswith(WHERE)
        unknown = sorted(set(kwargs) - set(MARKER_KEYWORDS))
        if unknown:
            assert repr(unknown[0]) in message
        elif len(args) > 1:
            assert "one positional argument" in message
        else:
            assert "seconds" in message
    else:
        for value in (budgets.setup, budgets.call, budgets.teardown, budgets.grace):
            assert value is None or (math.isfinite(value) and value > 0)


# -- real sessions, a few batches ----------------------------------------------------------
SESSIONS = settings(
    max_examples=2,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: each example is a session
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def test_bad_marker_values_in_a_session_are_errors_of_their_tests_naming_them(
    pytester: pytest.Pytester,
) -> None:
    @SESSIONS
    @given(
        batch=st.lists(
            st.tuples(
                st.sampled_from(["", "seconds=", "setup=", "teardown=", "grace="]), bad_values
            ),
            min_size=3,
            max_size=6,
        )
    )
    def session(batch: list[tuple[str, tuple[str, Any]]]) -> None:
        source = "import pytest\n\ndef test_good():\n    pass\n"
        for i, (keyword, (text, _)) in enumerate(batch):
            plain = keyword in ("", "seconds=")
            arguments = f"{keyword}{text}" if plain else f"1, {keyword}{text}"
            source += f"\n@pytest.mark.expires({arguments})\ndef test_v{i}():\n    pass\n"
        pytester.makepyfile(test_v=source)
        result = run(pytester, report=False)
        result.assert_clean()
        result.result.assert_outcomes(passed=1, errors=len(batch))
        for i, (_, (_, value)) in enumerate(batch):
            errors = [
                line
                for line in result.lines
                if line.startswith(f"test_v.py::test_v{i}: @pytest.mark.expires")
            ]
            assert len(errors) == 1, f"no error line for test_v{i}:\n{result.stdout}"
            assert mentions(errors[0], value), errors[0]

    session()


OPTIONS = ["--expires", "--elastic-timer-grace", "--elastic-timer-scale", "--expires-session"]


def test_bad_option_values_in_a_session_are_usage_errors_naming_them(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_ok="def test_ok():\n    pass\n")

    @SESSIONS
    @given(
        option=st.sampled_from(OPTIONS),
        text=st.one_of(
            st.text(st.characters(blacklist_categories=["Cs", "Cc"]), min_size=1, max_size=10),
            st.sampled_from(["nan", "-inf", "1e999", "-0.5", "0x10", "1_0_", " "]),
        ).filter(lambda t: not _parses(t)),
    )
    def session(option: str, text: str) -> None:
        result = run(pytester, f"{option}={text}", report=False)
        result.assert_clean()
        assert result.result.ret == pytest.ExitCode.USAGE_ERROR
        errors = [s for s in result.stderr.splitlines() if s.startswith(f"ERROR: {option} ")]
        assert len(errors) == 1, result.stderr
        assert repr(text) in errors[0]
        assert result.watchdog_pid is None

    session()


def _parses(text: str) -> bool:
    try:
        value = float(text.strip())
    except ValueError:
        return False
    return math.isfinite(value) and value >= 0
