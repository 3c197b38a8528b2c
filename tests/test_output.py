"""What the terminal shows of expired scopes: stacks without the frames of pytest and
its plugins that lead to the test (whole with --full-trace or -vv), expiries caught in
passing tests in one line (listed with -v), and files as pytest shows them."""

from __future__ import annotations

import fnmatch
import re
import sys
import traceback

import pytest
from helpers import failure_block, run, section

from pytest_elastic_timer.core.stacks import trim_stack

RUNNER_FRAME = re.compile(r'File ".*/(_pytest|pluggy|xdist)/[^"]*", line \d+')
HIDDEN = re.compile(
    r"^\s*\.\.\. \d+ outer frames of pytest and its plugins \(--full-trace shows them\)$"
)

# A worker stuck in a C call that holds the GIL: the watchdog dumps its stacks and ends it.
STUCK_WORKER = """
import pytest

@pytest.mark.expires(1)
def test_gil():
    spin()

def spin():
    sum(range(10**11))
"""


def summary_section(stdout: str) -> str:
    """The text of the "elastic-timer: expired scopes" section of the terminal summary."""
    after = stdout.split(" elastic-timer: expired scopes ", 1)
    assert len(after) == 2, stdout
    return re.split(r"^=+ .* =+$", after[1].split("\n", 1)[1], maxsplit=1, flags=re.M)[0]


def test_stacks_leave_out_the_runners_frames_before_the_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_stuck=STUCK_WORKER)
    session = run(pytester, "-p", "xdist", "-n", "1", "--elastic-timer-grace=0.5")
    session.result.assert_outcomes(failed=1)
    record = session.record("test_gil::call")
    assert record["action"] in ("terminated", "killed")
    # The JSON record keeps the whole stack.
    assert RUNNER_FRAME.search(record["stack"]), record["stack"]
    block = failure_block(session, "test_gil")
    shown = {
        "failure": block.split("stack of the owner when it was ended:", 1)[1],
        "failure's section": section(block, "elastic-timer stack dump"),
        "terminal summary": summary_section(session.stdout),
    }
    for where, text in shown.items():
        # From the test's frames inwards, everything; nothing of the way there.
        main = text.split("Current thread", 1)[1]
        frames = [s.strip() for s in main.splitlines() if s.strip()][1:]
        assert re.match(r'File ".*test_stuck\.py", line \d+ in spin$', frames[0]), (where, text)
        assert re.match(r'File ".*test_stuck\.py", line \d+ in test_gil$', frames[1]), where
        assert HIDDEN.match(frames[2]), (where, text)
        assert not RUNNER_FRAME.search(text), (where, text)


def test_a_traceback_keeps_its_frames_from_the_test_on() -> None:
    """Python's own format (most recent call last, source lines): the same cut."""
    text = "".join(traceback.format_stack())
    assert RUNNER_FRAME.search(text)
    lines = trim_stack(text).splitlines()
    assert HIDDEN.match(lines[0]), lines
    assert re.match(r'  File ".*test_output\.py", line \d+, in test_a_traceback_keeps', lines[1])
    assert lines[2].strip() == 'text = "".join(traceback.format_stack())'
    assert len(lines) == 3, lines


def test_the_runners_frames_copied_to_another_host_are_left_out_too() -> None:
    """xdist's --rsyncdir copies pytest, pluggy and xdist next to the tests of another
    host: their frames there are the runner's, though nothing here imported them."""
    remote = "/home/ci/remote-run"
    dump = "\n".join(
        [
            "Current thread 0x00007f (most recent call first):",
            f'  File "{remote}/project/test_x.py", line 9 in spin',
            f'  File "{remote}/project/test_x.py", line 5 in test_gil',
            f'  File "{remote}/_pytest/python.py", line 157 in pytest_pyfunc_call',
            f'  File "{remote}/pluggy/_callers.py", line 121 in _multicall',
            f'  File "{remote}/_pytest/runner.py", line 174 in pytest_runtest_call',
            f'  File "{remote}/xdist/remote.py", line 195 in run_one_test',
            f'  File "{remote}/execnet/gateway_base.py", line 1291 in executetask',
        ]
    )
    lines = trim_stack(dump).splitlines()
    assert lines[1:3] == dump.splitlines()[1:3], lines
    assert HIDDEN.match(lines[3]) and lines[3].strip().startswith("... 5 outer frames"), lines
    assert len(lines) == 4, lines
    # A project's own folder of that name is the project's.
    own = dump.replace(f"{remote}/project/test_x.py", f"{remote}/tests/xdist/test_x.py")
    assert trim_stack(own).splitlines()[1:3] == own.splitlines()[1:3]


@pytest.mark.parametrize("flag", ["--full-trace", "-vv"])
def test_full_trace_or_vv_shows_stacks_whole(pytester: pytest.Pytester, flag: str) -> None:
    pytester.makepyfile(test_stuck=STUCK_WORKER)
    session = run(pytester, "-p", "xdist", "-n", "1", "--elastic-timer-grace=0.5", flag)
    session.result.assert_outcomes(failed=1)
    block = failure_block(session, "test_gil")
    dump = section(block, "elastic-timer stack dump")
    for text in (block, dump, summary_section(session.stdout)):
        assert RUNNER_FRAME.search(text), text
        assert not any(HIDDEN.match(s) for s in text.splitlines()), text


CAUGHT = """
import time

import pytest
import pytest_elastic_timer as et


@pytest.mark.parametrize("n", range(3))
def test_caught(n):
    with pytest.raises(et.ScopeExpired):
        with et.expires(0.1, scope=f"caught{n}"):
            time.sleep(30)


def test_caught_then_failed():
    with pytest.raises(et.ScopeExpired):
        with et.expires(0.1, scope="then"):
            time.sleep(30)
    assert False, "failed after the expiry"


def test_not_caught():
    with et.expires(0.1, scope="hung"):
        time.sleep(30)
"""


def test_expiries_caught_in_passing_tests_are_one_line(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_caught=CAUGHT)
    session = run(pytester)
    session.assert_clean()
    session.result.assert_outcomes(passed=3, failed=2)
    assert session.report is not None and len(session.report["expired"]) == 5
    text = summary_section(session.stdout)
    assert "3 scopes expired inside tests that passed (caught on purpose); -v lists them" in (
        text.splitlines()
    ), text
    assert "caught0" not in text and "caught2" not in text
    # Those of failed tests are listed in full.
    for scope in ("test_caught_then_failed::call/then", "test_not_caught::call/hung"):
        assert f"scope '{scope}' expired after" in text, text


HELPER_ENDED_IN_A_PASSING_TEST = '''
import subprocess
import sys
import time

import pytest

import pytest_elastic_timer as et

HELPER = """
import pytest_elastic_timer as et

with et.expires(0.5, scope="helper-stuck"):
    print("in", flush=True)
    sum(range(10**11))
"""


def test_leaves_a_helper_that_gets_stuck(elastic_timer):
    helper = subprocess.Popen(
        [sys.executable, "-c", HELPER], env=elastic_timer.env, stdout=subprocess.PIPE
    )
    assert helper.stdout.readline() == b"in\\n"
    helper.wait(30)  # ended by the watchdog, after its grace
    helper.stdout.close()


def test_catches_its_own():
    with pytest.raises(et.ScopeExpired):
        with et.expires(0.1, scope="caught"):
            time.sleep(30)
'''


def test_a_process_ended_in_a_passing_test_is_listed_not_counted_as_caught(
    pytester: pytest.Pytester,
) -> None:
    """Only an interrupt caught in a passing test is "caught on purpose": a process that
    had to be ended (a helper stuck in C) is listed in full, whatever its test did."""
    pytester.makepyfile(test_helper=HELPER_ENDED_IN_A_PASSING_TEST)
    session = run(pytester, "--elastic-timer-grace=0.5")
    session.assert_clean()
    session.result.assert_outcomes(passed=2)
    text = summary_section(session.stdout)
    assert re.search(
        r"scope 'helper-stuck' expired after [\d.]+s \(budget 0\.5s\): (terminated|killed)", text
    ), text
    assert "1 scope expired inside tests that passed (caught on purpose)" in text, text


def test_no_count_of_caught_expiries_when_none_was_caught(pytester: pytest.Pytester) -> None:
    """A passing test whose helper had to be ended, and no interrupt caught: the helper
    is listed, and no line counts "0 scopes" caught on purpose."""
    pytester.makepyfile(test_helper=HELPER_ENDED_IN_A_PASSING_TEST)
    session = run(pytester, "--elastic-timer-grace=0.5", "-k", "test_leaves_a_helper")
    session.assert_clean()
    session.result.assert_outcomes(passed=1, deselected=1)
    text = summary_section(session.stdout)
    assert "scope 'helper-stuck' expired after" in text, text
    assert "caught on purpose" not in text, text


def test_v_lists_expiries_caught_in_passing_tests(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_caught=CAUGHT)
    session = run(pytester, "-v")
    session.result.assert_outcomes(passed=3, failed=2)
    text = summary_section(session.stdout)
    for n in range(3):
        assert f"scope 'test_caught[{n}]::call/caught{n}' expired after" in text, text
    assert "caught on purpose" not in text


PATHS_CONFTEST = """
import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
# Paths as some tools put them on sys.path: not normalized.
sys.path.insert(0, os.path.join(here, "sub", "..", "lib"))
sys.path.insert(0, os.path.join(here, "..", "outside"))
"""

STEP = """
import time

import pytest_elastic_timer as et


def {name}():
    with et.expires(0.1, scope="{name}"):
        time.sleep(30)
"""


def test_entered_files_are_normalized_and_relative_to_rootdir(
    pytester: pytest.Pytester,
) -> None:
    project = pytester.mkdir("project")
    (project / "pytest.ini").write_text("[pytest]\n")
    (project / "sub").mkdir()
    (project / "lib").mkdir()
    (project / "lib" / "inside.py").write_text(STEP.format(name="inside"))
    outside = pytester.mkdir("outside")
    (outside / "beyond.py").write_text(STEP.format(name="beyond"))
    (project / "conftest.py").write_text(PATHS_CONFTEST)
    (project / "test_paths.py").write_text(
        "import beyond\nimport inside\n\n\n"
        "def test_inside():\n    inside.inside()\n\n\n"
        "def test_beyond():\n    beyond.beyond()\n"
    )
    session = run(pytester, "project")
    session.assert_clean()
    session.result.assert_outcomes(failed=2)
    text = summary_section(session.stdout)
    entered = [s.strip() for s in text.splitlines() if s.strip().startswith("entered:")]
    # Under rootdir: relative to it; elsewhere: absolute; never with "..".
    assert entered == [
        "entered: lib/inside.py:8",
        f"entered: {outside / 'beyond.py'}:8",
    ], text
    assert session.record("test_inside::call/inside")["file"] == str(project / "lib/inside.py")
    assert session.record("test_beyond::call/beyond")["file"] == str(outside / "beyond.py")


RELAYED = """
import contextlib
import time

import pytest_elastic_timer as et


@contextlib.contextmanager
def step(name):
    with contextlib.ExitStack() as stack:
        stack.enter_context(et.expires(0.1, scope=name))  # GENERATOR LINE
        yield


def test_exit_stack():
    with contextlib.ExitStack() as stack:
        stack.enter_context(et.expires(0.1, scope="stack"))  # STACK LINE
        time.sleep(30)


def test_contextmanager():
    with step("generator"):
        time.sleep(30)


def test_unnamed():
    with contextlib.ExitStack() as stack:
        stack.enter_context(et.expires(0.1))  # UNNAMED LINE
        time.sleep(30)
"""


def test_a_scope_entered_through_contextlib_names_the_users_line(
    pytester: pytest.Pytester,
) -> None:
    path = pytester.makepyfile(test_relayed=RELAYED)
    lines = path.read_text().splitlines()
    line = {
        tag: next(n for n, text in enumerate(lines, 1) if text.endswith(f"# {tag} LINE"))
        for tag in ("GENERATOR", "STACK", "UNNAMED")
    }
    session = run(pytester)
    session.assert_clean()
    session.result.assert_outcomes(failed=3)
    text = summary_section(session.stdout)
    assert "contextlib" not in text, text
    # Each scope names its own line, though contextlib entered all three at one line.
    for scope, tag in (
        ("test_exit_stack::call/stack", "STACK"),
        ("test_contextmanager::call/generator", "GENERATOR"),
        (f"test_unnamed::call/test_relayed.py:{line['UNNAMED']}", "UNNAMED"),
    ):
        record = session.record(scope)
        assert (record["file"], record["line"]) == (str(path), line[tag]), record
        assert f"  entered: test_relayed.py:{line[tag]}" in text.splitlines(), text


CAUGHT_THEN_FAILED = """
import time

import pytest
import pytest_elastic_timer as et


@pytest.fixture
def failing_teardown():
    yield
    assert False, "unrelated teardown failure"


def test_caught_then_teardown_fails(failing_teardown):
    with pytest.raises(et.ScopeExpired):
        with et.expires(0.2, scope="caught-1"):
            time.sleep(5)


def test_caught_then_fails():
    with pytest.raises(et.ScopeExpired):
        with et.expires(0.2, scope="caught-2"):
            time.sleep(5)
    assert 1 == 2, "unrelated assertion"


def test_wrapped():
    try:
        with et.expires(0.2, scope="wrapped"):
            time.sleep(5)
    except et.ScopeExpired as exc:
        raise RuntimeError("step failed") from exc


def test_grouped():
    try:
        with et.expires(0.2, scope="grouped"):
            time.sleep(5)
    except et.ScopeExpired as exc:
        raise ExceptionGroup("tasks", [exc])
"""


@pytest.mark.parametrize("workers", [[], ["-p", "xdist", "-n", "2"]], ids=["one", "xdist"])
def test_an_expiry_caught_on_purpose_is_not_what_failed_the_test(
    pytester: pytest.Pytester, workers: list[str]
) -> None:
    """A test that catches its scope's ScopeExpired and then fails for a reason of its
    own fails by that reason (FAILED / ERROR, its own message, in JUnit too); one that
    raises another exception from the ScopeExpired, or puts it in an exception group,
    failed by the expiry (TIMEOUT, the scope line first)."""
    if sys.version_info < (3, 11):
        pytest.skip("ExceptionGroup is new in 3.11")
    pytester.makepyfile(test_caught=CAUGHT_THEN_FAILED)
    junit = pytester.path / "junit.xml"
    session = run(pytester, *workers, f"--junitxml={junit}", "-rfE", lean=not workers)
    session.assert_clean()
    session.result.assert_outcomes(passed=1, failed=3, errors=1)
    summary = session.result.outlines
    for line in (
        "FAILED test_caught.py::test_caught_then_fails - AssertionError*",
        "ERROR test_caught.py::test_caught_then_teardown_fails - AssertionError*",
        "TIMEOUT test_caught.py::test_wrapped - scope 'test_wrapped::call/wrapped'*",
        "TIMEOUT test_caught.py::test_grouped - scope 'test_grouped::call/grouped'*",
    ):
        assert any(fnmatch.fnmatch(s, line) for s in summary), (line, session.stdout)
    xml = junit.read_text()
    assert xml.count('type="pytest_elastic_timer.ScopeExpired"') == 2, xml
    assert 'message="AssertionError: unrelated assertion' in xml


def test_a_doctest_that_expires_leads_with_the_scope_line(pytester: pytest.Pytester) -> None:
    """A doctest example that runs past the default budget: its failure reads TIMEOUT
    and begins with the scope line, as any test's does."""
    pytester.makepyfile(mod='def f():\n    """\n    >>> import time; time.sleep(30)\n    """\n')
    session = run(pytester, "--doctest-modules", "--expires=0.5", "mod.py")
    session.assert_clean()
    session.result.assert_outcomes(failed=1)
    lines = session.stdout.splitlines()
    title = next(i for i, s in enumerate(lines) if "[doctest] mod.f" in s)
    assert lines[title + 1].startswith("scope 'mod.f::call' expired after"), lines[title + 1]
    assert "TIMEOUT mod.py::mod.f" in session.stdout


def test_a_failure_to_describe_an_expiry_leaves_the_report_as_it_is(
    pytester: pytest.Pytester,
) -> None:
    """Whatever goes wrong while the plugin adds its details to a failed report, the
    test's own report stands, with a section saying so: never an INTERNALERROR, and the
    next test runs."""
    pytester.makeconftest(
        """
        from pytest_elastic_timer.plugin import expiry

        def _broken(item, report):
            raise RuntimeError("records unreadable")

        expiry._add_process_sections = _broken
        """
    )
    pytester.makepyfile(
        test_broken="""
        import pytest

        @pytest.mark.expires(1)
        def test_spins():
            while True:
                pass

        def test_after():
            pass
        """
    )
    session = run(pytester, "-p", "xdist", "-n", "1")
    session.result.assert_outcomes(failed=1, passed=1)
    assert session.result.ret == pytest.ExitCode.TESTS_FAILED
    assert "INTERNALERROR" not in session.stdout
    block = failure_block(session, "test_spins")
    assert "scope 'test_spins::call' expired" in block
    assert "the expiry details could not be added: RuntimeError('records unreadable')" in block
