"""Bad marker and option values: an error of that test alone (a marker) or a usage
error (an option), naming the test and the value, never an INTERNALERROR."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from decimal import Decimal
from fractions import Fraction
from typing import Any

import pytest
from helpers import Session, failure_block, run

import pytest_elastic_timer as et
from pytest_elastic_timer.scope import scopes

# test file name -> (marker arguments, text the error must contain)
BAD_MARKERS = {
    "string": ('("abc")', "'abc'"),
    "bool": ("(True)", "True"),
    "nan": ('(float("nan"))', "nan"),
    "inf": ('(float("inf"))', "inf"),
    "negative": ("(-1)", "-1"),
    "no_argument": ("", "needs the number of seconds"),
    "unknown_keyword": ("(1, foo=2)", "'foo'"),
    "two_positionals": ("(1, 2)", "(1, 2)"),
    "bad_setup": ('(1, setup="x")', "'x'"),
    "bad_teardown": ("(1, teardown=-3)", "-3"),
    "bad_grace": ('(1, grace=float("nan"))', "nan"),
    "unprintable": ("(Unprintable())", "<Unprintable object>"),
}

UNPRINTABLE = """
class Unprintable:
    def __repr__(self):
        raise RuntimeError("no repr")
"""


def bad_marker_module() -> str:
    """One module with a test per bad marker of BAD_MARKERS, and good tests between."""
    source = f"import pytest\n{UNPRINTABLE}\ndef test_good_first():\n    pass\n"
    for name, (arguments, _) in BAD_MARKERS.items():
        source += f"\n@pytest.mark.expires{arguments}\ndef test_bad_{name}():\n    pass\n"
    return source + "\n@pytest.mark.expires(5)\ndef test_good_last():\n    pass\n"


def setup_error(session: Session, name: str) -> str:
    """The text of the error at the setup of test ``name``."""
    block = failure_block(session, name)
    assert block.splitlines()[0].strip("_ ") == f"ERROR at setup of {name}", block
    return block


@pytest.mark.parametrize("phased", [False, True], ids=["", "beside a setup budget"])
def test_each_bad_marker_is_an_error_of_its_test_alone(
    pytester: pytest.Pytester, phased: bool
) -> None:
    """One error per bad marker, at its setup; also where another test's setup budget
    has the plugin watch every test's setup and teardown."""
    source = bad_marker_module()
    if phased:
        source += "\n@pytest.mark.expires(5, setup=1)\ndef test_good_phased():\n    pass\n"
    pytester.makepyfile(test_markers=source)
    session = run(pytester, report=False)
    session.assert_clean()
    # Every bad marker of the module is named, and the module's good tests run.
    session.result.assert_outcomes(passed=2 + phased, errors=len(BAD_MARKERS))
    assert "During handling of the above exception" not in session.stdout
    assert session.result.ret == pytest.ExitCode.TESTS_FAILED
    for name, (_, value) in BAD_MARKERS.items():
        block = setup_error(session, f"test_bad_{name}")
        nodeid = f"test_markers.py::test_bad_{name}"
        errors = [s for s in block.splitlines() if s.startswith(f"{nodeid}: ")]
        assert len(errors) == 1, block
        # The marker as written, then what is wrong with it.
        assert re.match(rf"{re.escape(nodeid)}: @pytest\.mark\.expires\(.*\): \w", errors[0])
        assert value in errors[0], errors[0]
    summary = [s for s in session.lines if s.startswith("ERROR test_markers.py::test_bad_")]
    assert len(summary) == len(BAD_MARKERS), summary


def test_a_bad_marker_is_an_error_of_its_test_under_xdist(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_markers=bad_marker_module())
    session = run(pytester, "-p", "xdist", "-n", "2", report=False)
    session.assert_clean()
    session.result.assert_outcomes(passed=2, errors=len(BAD_MARKERS))
    block = setup_error(session, "test_bad_string")
    assert "test_markers.py::test_bad_string: @pytest.mark.expires('abc'): seconds" in block


def test_a_bad_marker_fails_before_the_tests_fixtures(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_fixture="""
        import pytest

        @pytest.fixture
        def resource():
            raise AssertionError("the fixture of a test with a bad marker was set up")

        @pytest.mark.expires(1, setup="x")
        def test_bad(resource):
            pass
        """
    )
    session = run(pytester, report=False)
    session.assert_clean()
    session.result.assert_outcomes(errors=1)
    block = setup_error(session, "test_bad")
    assert "setup must be a number of seconds, not 'x'" in block
    assert "the fixture of a test with a bad marker was set up" not in session.stdout


@pytest.mark.parametrize(
    "source", ["import pytest\n\n@pytest.mark.expires('abc')\ndef test_bad():\n    pass\n", "def ("]
)
def test_a_bad_marker_or_module_does_not_crash_pytest(
    pytester: pytest.Pytester, source: str
) -> None:
    pytester.makepyfile(test_broken=source)
    session = run(pytester, report=False)
    session.assert_clean()
    session.result.assert_outcomes(errors=1)
    # The short test summary lists the error, and the final summary line follows it.
    assert "ERROR test_broken.py" in session.stdout
    assert re.match(r"^=+ 1 error in [\d.]+s", session.result.outlines[-1])


def test_numeric_string_marker_value_is_an_error(pytester: pytest.Pytester) -> None:
    """Text is for the command line and ini files; a marker takes numbers, even for text
    that reads as one, in the budget and in every keyword."""
    pytester.makepyfile(
        test_str="""
        import pytest

        @pytest.mark.expires("1")
        def test_str():
            pass

        @pytest.mark.expires(1, teardown="0.5")
        def test_keyword():
            pass
        """,
    )
    session = run(pytester, report=False)
    session.assert_clean()
    session.result.assert_outcomes(errors=2)
    errors = [s for s in session.lines if s.startswith("test_str.py::test_str: ")]
    assert len(errors) == 1, session.stdout
    assert errors[0].startswith("test_str.py::test_str: @pytest.mark.expires('1'): seconds")
    errors = [s for s in session.lines if s.startswith("test_str.py::test_keyword: ")]
    assert len(errors) == 1, session.stdout
    assert "teardown must be" in errors[0] and "'0.5'" in errors[0]


@pytest.mark.parametrize(
    ("option", "value_text"),
    [
        ("--expires=abc", "'abc'"),
        ("--expires=-1", "'-1'"),
        ("--expires=nan", "'nan'"),
        ("--expires=inf", "'inf'"),
        ("--elastic-timer-scale=0", "'0'"),
        ("--elastic-timer-grace=x", "'x'"),
        ("--elastic-timer-scale=abc", "'abc'"),
    ],
)
def test_bad_option_values_are_usage_errors(
    pytester: pytest.Pytester, option: str, value_text: str
) -> None:
    pytester.makepyfile(test_ok="def test_ok():\n    pass\n")
    session = run(pytester, option, report=False)
    session.assert_clean()
    assert session.result.ret == pytest.ExitCode.USAGE_ERROR
    flag = option.split("=")[0]
    errors = [s for s in session.stderr.splitlines() if s.startswith(f"ERROR: {flag} ")]
    assert len(errors) == 1, session.stderr
    assert value_text in errors[0]
    if flag == "--elastic-timer-scale":
        assert "seconds" not in errors[0]  # a factor
    assert session.watchdog_pid is None


@pytest.mark.parametrize(
    ("given", "error"),
    [
        ("--elastic-timer-report=", "--elastic-timer-report must be a path, not ''"),
        ("--elastic-timer-trace=  ", "--elastic-timer-trace must be a path, not '  '"),
        (
            'pyproject.toml: elastic_timer_trace = " "',
            "ini option 'elastic_timer_trace' must be a path, not ' '",
        ),
        (
            'pyproject.toml: elastic_timer_report = "a\\u0000b"',
            "ini option 'elastic_timer_report' must be a path, not 'a\\x00b'",
        ),
    ],
)
def test_an_empty_value_is_a_usage_error_not_no_value(
    pytester: pytest.Pytester, given: str, error: str
) -> None:
    """``--elastic-timer-report=$REPORT`` with REPORT unset was no option at all: the
    session ran without its report or trace and said nothing. A blank path wrote a file
    named by blanks, and a NUL byte (which TOML can hold) was an INTERNALERROR."""
    args: tuple[str, ...] = ()
    if given.startswith("pytest.ini: "):
        pytester.makeini(f"[pytest]\n{given.split(': ', 1)[1]}\n")
    elif given.startswith("pyproject.toml: "):
        pytester.makepyprojecttoml(f"[tool.pytest.ini_options]\n{given.split(': ', 1)[1]}\n")
    else:
        args = (given,)
    pytester.makepyfile(test_ok="def test_ok():\n    pass\n")
    before = set(os.listdir(pytester.path))
    session = run(pytester, *args, report=False)
    session.assert_usage_error(error)
    # No file written: the inner pytest's output and its base temporary directory are
    # all that is new.
    new = {name for name in os.listdir(pytester.path) if name not in before}
    assert {name for name in new if not name.startswith("runpytest")} == {"stdout", "stderr"}


def test_an_ini_key_left_empty_is_not_set(pytester: pytest.Pytester) -> None:
    """As pytest has it, an ini key without a value is not set: ``-o key=`` switches
    off what the ini file asks for (a report, a default budget), and a key left empty
    in the file is no error."""
    pytester.makeini("[pytest]\nelastic_timer_report = report.json\nexpires = 0.2\n")
    pytester.makepyfile(test_ok="import time\n\ndef test_ok():\n    time.sleep(0.5)\n")
    as_in_the_file = run(pytester, report=False)
    as_in_the_file.assert_clean()
    as_in_the_file.result.assert_outcomes(failed=1)  # the ini file's budget, 0.2 s
    assert (pytester.path / "report.json").exists()
    (pytester.path / "report.json").unlink()
    switched_off = run(pytester, "-o", "elastic_timer_report=", "-o", "expires=", report=False)
    switched_off.assert_clean()
    switched_off.result.assert_outcomes(passed=1)
    assert not (pytester.path / "report.json").exists()
    pytester.makeini("[pytest]\nelastic_timer_report =\nexpires =\nelastic_timer_leaks =\n")
    left_empty = run(pytester, report=False)
    left_empty.assert_clean()
    left_empty.result.assert_outcomes(passed=1)


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ('elastic_timer_report = ["a"]', "ini option 'elastic_timer_report' must be a path"),
        ('elastic_timer_trace = ["t.json"]', "ini option 'elastic_timer_trace' must be a path"),
        ("expires = [1]", "ini option 'expires' must be a number of seconds, not [1]"),
    ],
)
def test_a_toml_ini_value_of_the_wrong_type_is_a_usage_error(
    pytester: pytest.Pytester, line: str, error: str
) -> None:
    """pyproject.toml gives values of any TOML type: a list where a path or a number
    belongs is a usage error that names the option and the value, not pytest's
    deprecation warning (an INTERNALERROR where warnings are errors)."""
    pytester.makepyprojecttoml(f'[tool.pytest.ini_options]\n{line}\nfilterwarnings = ["error"]\n')
    pytester.makepyfile(test_ok="def test_ok():\n    pass\n")
    session = run(pytester, report=False)
    session.assert_clean()
    assert session.result.ret == pytest.ExitCode.USAGE_ERROR
    assert f"ERROR: {error}" in session.stderr, session.stderr
    assert "INTERNALERROR" not in session.text
    assert "Warning" not in session.text
    assert session.watchdog_pid is None


@pytest.mark.skipif(
    pytest.version_tuple < (9, 2), reason="pytest 9.2 registers an ini key as text or number"
)
@pytest.mark.parametrize("expires", ["1", '"1"', "1.0"])
def test_numbers_in_pytests_own_toml_table(pytester: pytest.Pytester, expires: str) -> None:
    """pytest 9's [tool.pytest] keeps TOML's types: a number (or its text) is a budget,
    and a value of another type is a usage error naming the option and the value."""
    pytester.makepyprojecttoml(
        f"[tool.pytest]\nexpires = {expires}\nelastic_timer_grace = 0.5\n"
        "elastic_timer_scale = 1\nelastic_timer_slow = 0.9\n"
    )
    pytester.makepyfile(test_hang="import time\n\ndef test_hang():\n    time.sleep(30)\n")
    session = run(pytester)
    session.assert_clean()
    session.result.assert_outcomes(failed=1)
    assert session.record("test_hang::call")["budget"] == 1.0
    pytester.makepyprojecttoml("[tool.pytest]\nexpires = true\n")
    refused = run(pytester, report=False)
    refused.assert_clean()
    assert refused.result.ret == pytest.ExitCode.USAGE_ERROR
    assert "config option 'expires' expects one of" in refused.stderr, refused.stderr
    assert "got bool: True" in refused.stderr, refused.stderr


def test_bad_ini_value_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nexpires = abc\n")
    pytester.makepyfile(test_ok="def test_ok():\n    pass\n")
    session = run(pytester, report=False)
    session.assert_clean()
    assert session.result.ret == pytest.ExitCode.USAGE_ERROR
    assert "ERROR: ini option 'expires' must be a number of seconds, not 'abc'" in (session.stderr)
    # The command line wins over the bad ini value.
    fixed = run(pytester, "--expires=1", report=False)
    fixed.assert_clean()
    fixed.result.assert_outcomes(passed=1)


# -- the scope API refuses bad values too ----------------------------------------------
@pytest.mark.parametrize("after", ["x", b"1", True, [1], 1j])
def test_timer_request_rejects_non_numbers(after: object) -> None:
    with pytest.raises(TypeError, match="number of seconds"):
        et.TimerRequest(after)  # type: ignore[arg-type]


@pytest.mark.parametrize("after", [float("nan"), float("inf"), -1, -0.001, 10**400])
def test_timer_request_rejects_bad_numbers(after: float) -> None:
    with pytest.raises(ValueError, match="after must be a finite number >= 0"):
        et.TimerRequest(after)
    with pytest.raises(ValueError, match="grace must be a finite number >= 0"):
        et.expires(1, grace=after)


# -- a number of seconds of another type is the number it holds -------------------------
def numpy() -> Any:
    """numpy, or the test is skipped."""
    return pytest.importorskip("numpy", reason="numpy makes the numbers of other types")


def assert_taken_as(value: object, seconds: float) -> None:
    """Every place that takes seconds in the scope API takes ``value``, and holds it as
    the plain float ``seconds`` (a numpy scalar would reach the JSON report and the
    scope table)."""
    timer = et.TimerRequest(value, grace=value)  # type: ignore[arg-type]
    assert (timer.after, timer.grace) == (seconds, seconds)
    assert type(timer.after) is float and type(timer.grace) is float
    assert et.expires(value).after == seconds  # type: ignore[arg-type]
    later = et.TimerRequest(None)
    later.extend(value)  # type: ignore[arg-type]
    assert later.after == seconds and type(later.after) is float
    later.reschedule(value)  # type: ignore[arg-type]
    assert later.after == seconds and type(later.after) is float
    scale = scopes.process_state().scale
    with et.expires(value, "other-type") as scope:  # type: ignore[arg-type]
        assert scope.budget == pytest.approx(seconds * scale)
        scope.extend(value)  # type: ignore[arg-type]
        assert scope.budget == pytest.approx(2 * seconds * scale)
        scope.reschedule(value)  # type: ignore[arg-type]
        assert 0 < scope.expires() <= seconds * scale
        assert type(scope.deadline) is float


@pytest.mark.parametrize("kind", ["int64", "int32", "uint8", "float16", "float32", "longdouble"])
def test_a_numpy_number_is_taken_as_the_seconds_it_holds(kind: str) -> None:
    """A budget computed with numpy (a world size times a step time) was a TypeError,
    but for float64, which is a float (and was taken)."""
    assert_taken_as(getattr(numpy(), kind)(2), 2.0)


@pytest.mark.parametrize("value", [Fraction(3, 2), Decimal("1.5")], ids=["Fraction", "Decimal"])
def test_a_fraction_or_a_decimal_is_taken_as_the_seconds_it_holds(value: object) -> None:
    assert_taken_as(value, 1.5)


def test_numbers_of_other_types_that_are_no_budget_are_refused_naming_them() -> None:
    """The rule is the one for int and float: finite and >= 0 (a ValueError), a number
    and no bool (a TypeError), and each error names the value as it was given."""
    np = numpy()
    for value in (
        np.float32("nan"),
        np.float64("inf"),
        np.int64(-1),
        np.longdouble("1e400"),  # finite for numpy, too large for a float
        Fraction(-1, 2),
        Fraction(10**400),
        Decimal("NaN"),
        Decimal("sNaN"),  # which float() refuses with a ValueError of its own
    ):
        refused = f"must be a finite number >= 0, not {value!r}"
        with pytest.raises(ValueError, match=re.escape(f"after {refused}")):
            et.TimerRequest(value)
        with pytest.raises(ValueError, match=re.escape(f"grace {refused}")):
            et.expires(1, grace=value)
    # numpy's bool is a bool; an array is no number; a timedelta64 may count anything
    # but seconds; numpy's str is text.
    for value in (np.bool_(True), np.array([1, 2]), np.timedelta64(5, "ms"), np.str_("1")):
        with pytest.raises(TypeError, match=re.escape(f"number of seconds, not {value!r}")):
            et.TimerRequest(value)
        with et.expires(5) as scope, pytest.raises(TypeError, match="seconds must be a number"):
            scope.extend(value)


def test_the_torch_client_takes_a_time_of_another_type() -> None:
    """A Decimal or an integer of another library is a time.time() value too; a numpy
    timedelta64 is none (a TypeError of numpy's own, which named no argument)."""
    np = numpy()
    client = et.TimerClient()
    scale = scopes.process_state().scale
    for value in (Decimal(repr(time.time() + 30)), np.int64(int(time.time()) + 30)):
        client.acquire("other-type", value)
        scope = et.current_scope()
        assert scope is not None and scope.scope == "other-type"
        assert 25 * scale < scope.expires() <= 31 * scale
        client.release("other-type")
        assert et.current_scope() is None
    with pytest.raises(TypeError, match=r"expiration_time must be a time\.time\(\) value"):
        client.acquire("other-type", np.timedelta64(5, "s"))


NUMPY_MARKERS = """
import time
from fractions import Fraction

import numpy as np
import pytest


BUDGETS = {"setup": np.int64(20), "teardown": Fraction(20), "grace": np.int32(1)}


@pytest.mark.expires(np.float32(0.5), **BUDGETS)
def test_hang():
    time.sleep(30)


@pytest.mark.expires(np.int64(20))
def test_steps(elastic_timer):
    assert elastic_timer.budget == 20.0 and type(elastic_timer.budget) is float
    with elastic_timer.step("step", np.float32(2)) as step:
        assert step.budget == 2.0


@pytest.mark.expires(np.float32("nan"))
def test_nan():
    pass


@pytest.mark.expires(1, setup=np.bool_(True))
def test_bool():
    pass
"""


@pytest.mark.parametrize("dist", ["one process", "xdist"])
def test_numpy_numbers_in_a_marker_are_budgets(pytester: pytest.Pytester, dist: str) -> None:
    """A marker takes the numbers the scope API takes, under xdist too (a worker sends
    its budgets to the controller), and the JSON report holds them as numbers; one that
    is no budget is an error of its test alone that names it."""
    numpy()
    pytester.makepyfile(test_np=NUMPY_MARKERS)
    args = ("-p", "xdist", "-n", "1") if dist == "xdist" else ()
    session = run(pytester, *args)
    session.assert_clean()
    session.result.assert_outcomes(passed=1, failed=1, errors=2)
    record = session.assert_expired("test_hang", "test_hang::call", 0.5)
    assert type(record["budget"]) is float
    for test, error in (
        ("test_nan", "seconds must be a finite number >= 0, not np.float32(nan)"),
        ("test_bool", "setup must be a number of seconds, not np.True_"),
    ):
        errors = [s for s in session.lines if s.startswith(f"test_np.py::{test}: ")]
        assert len(errors) == 1 and errors[0].endswith(error), session.stdout


ON_ITS_OWN = {"PYTEST_ELASTIC_TIMER": "", "PYTEST_ELASTIC_TIMER_SCALE": ""}


def run_script(source: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``source`` run by Python in a process of no session (the in-process sentinel
    enforces its scopes), with ``env`` over this one's environment."""
    return subprocess.run(
        [sys.executable, "-W", "error", "-c", source],
        env={**os.environ, **ON_ITS_OWN, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_budget_of_centuries_leaves_the_sentinel_enforcing() -> None:
    """Without a watchdog, a scope of 1e10 s made the sentinel's wait overflow: its
    thread died, and later scopes were noticed only at their end."""
    done = run_script(
        "import time\n"
        "import pytest_elastic_timer as et\n"
        "with et.expires(1e10, 'centuries'):\n"
        "    time.sleep(0.2)\n"
        "try:\n"
        "    with et.expires(0.3, 'short'):\n"
        "        time.sleep(10)\n"
        "except et.ScopeExpired as exc:\n"
        "    print(f'{exc.elapsed:.1f}')\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert float(done.stdout) < 2.0


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf", "abc"])
def test_a_bad_scale_in_the_environment_is_an_error_naming_it(value: str) -> None:
    done = run_script(
        "import pytest_elastic_timer as et\nwith et.expires(5):\n    pass\n",
        PYTEST_ELASTIC_TIMER_SCALE=value,
    )
    assert done.returncode == 1
    assert (
        f"ValueError: PYTEST_ELASTIC_TIMER_SCALE must be a finite number above 0, not {value!r}"
        in done.stderr
    ), done.stderr


def test_a_grace_longer_than_a_slot_holds_is_held_as_forever(pytester: pytest.Pytester) -> None:
    """A finite grace beyond what a slot's field holds (a float32, some 3.4e38 s) is
    as good as forever: the scope works, in code and in the marker, instead of failing
    with an OverflowError when it is entered."""
    with et.expires(5, grace=1e300) as scope:
        pass
    assert scope.grace == pytest.approx(3.4028234663852886e38)
    pytester.makepyfile(
        test_long="""
        import pytest

        @pytest.mark.expires(5, grace=1e39)
        def test_long():
            pass
        """
    )
    session = run(pytester)
    session.assert_clean()
    session.result.assert_outcomes(passed=1)


@pytest.mark.parametrize("expiration", [float("nan"), float("inf"), float("-inf"), 10**400])
def test_the_torch_client_rejects_an_expiration_that_is_no_time(expiration: float) -> None:
    client = et.TimerClient()
    with pytest.raises(ValueError, match=r"expiration_time must be a finite time\.time\(\)"):
        client.acquire("step", expiration)
    client.release("step")  # nothing was opened: a no-op


@pytest.mark.parametrize("expiration", ["1", True, None, b"1"])
def test_the_torch_client_rejects_an_expiration_that_is_no_number(expiration: object) -> None:
    """A string or a bool was taken as a time, None was float()'s own TypeError."""
    client = et.TimerClient()
    with pytest.raises(TypeError, match=r"expiration_time must be a time\.time\(\) value"):
        client.acquire("step", expiration)  # type: ignore[arg-type]
    client.release("step")


def test_timer_request_rejects_a_non_string_scope() -> None:
    with pytest.raises(TypeError, match="scope must be a str"):
        et.TimerRequest(1, scope=5)  # type: ignore[arg-type]


def test_release_twice_raises() -> None:
    timer = et.TimerRequest(5, scope="twice")
    timer.acquire()
    timer.release()
    with pytest.raises(RuntimeError, match="not active"):
        timer.release()


def test_release_before_acquire_raises() -> None:
    with pytest.raises(RuntimeError, match="not active"):
        et.TimerRequest(5).release()


def test_acquire_twice_raises() -> None:
    timer = et.TimerRequest(5, scope="again")
    timer.acquire()
    try:
        with pytest.raises(RuntimeError, match="already active"):
            timer.acquire()
    finally:
        timer.release()


def test_reschedule_and_extend_reject_bad_values() -> None:
    with et.TimerRequest(5) as timer:
        for bad in (float("nan"), -1):
            with pytest.raises(ValueError):
                timer.reschedule(bad)
            with pytest.raises(ValueError):
                timer.extend(bad)
        with pytest.raises(TypeError):
            timer.extend("1")  # type: ignore[arg-type]
        # None: a deadline is moved, never removed (cancel() removes it). An
        # AssertionError without a word, and nothing at all under python -O.
        with pytest.raises(TypeError, match="after must be a number of seconds, not None"):
            timer.reschedule(None)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="seconds must be a number of seconds, not None"):
            timer.extend(None)  # type: ignore[arg-type]
        assert 0 < timer.expires() <= 5
    not_entered = et.TimerRequest(5)
    with pytest.raises(TypeError, match="not None"):
        not_entered.reschedule(None)  # type: ignore[arg-type]


def test_set_label_rejects_non_strings() -> None:
    with pytest.raises(TypeError, match="label must be a str"):
        et.set_label(0)  # type: ignore[arg-type]


def test_bad_marker_on_a_module_or_class_names_each_test(pytester: pytest.Pytester) -> None:
    # Markers of parents are read once per parent: each test gets its own error.
    pytester.makepyfile(
        test_module="""
        import pytest

        pytestmark = pytest.mark.expires(-1)

        def test_in_module():
            pass

        def test_also_in_module():
            pass
        """,
        test_class="""
        import pytest

        @pytest.mark.expires(float("nan"))
        class TestGroup:
            def test_in_class(self):
                pass

        def test_beside_class():
            pass
        """,
        test_good="def test_good():\n    pass\n",
    )
    session = run(pytester, report=False)
    session.assert_clean()
    session.result.assert_outcomes(passed=2, errors=3)
    for nodeid, value in (
        ("test_module.py::test_in_module", "-1"),
        ("test_module.py::test_also_in_module", "-1"),
        ("test_class.py::TestGroup::test_in_class", "nan"),
    ):
        errors = [s for s in session.lines if s.startswith(f"{nodeid}: @pytest.mark.expires(")]
        assert len(errors) == 1, session.stdout
        assert value in errors[0], errors[0]
