"""The test matrix: every supported Python with the declared minimum and the newest
pytest and pytest-xdist.

    nox -s tests                 # all eight combinations
    nox -s "tests-3.10(deps='minimum')"
    nox -s compat                # other plugins' suites with and without this one

The whole suite runs on one combination (Python 3.11 with the newest versions, the
README's test command, which CI runs in its own environment, so CI skips it here);
the others run :data:`SUBSET`. ``FULL=1`` runs the whole suite on every combination. torch is
installed in none of them: the tests that need it skip.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import nox

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - nox itself runs on any supported Python
    import tomli as tomllib

ROOT = Path(__file__).parent
PYTHONS = ["3.10", "3.11", "3.12", "3.13"]
# What the plugin touches of pytest (hooks, reports, status words, terminal output,
# pytester) and of xdist (workers, every scheduler, a worker ended or stopped), and one
# suite of processes that meet without torch (ranks at a barrier). About a minute on two
# cores; the longest xdist tests (C loops in session teardowns, re-queued units) run in
# the whole suite only.
SUBSET = [
    "tests/test_scopes.py",
    "tests/test_plugin.py",
    "tests/test_ci_reports.py::test_an_expired_test_reads_timeout_in_red_on_every_line",
    "tests/test_xdist.py::test_c_loop_in_a_worker_fails_by_its_scope",
    "tests/test_xdist.py::test_soft_interrupt_in_a_worker_just_fails_the_test",
    # Two of its five dist modes (all five run in the whole suite): about a minute less.
    "tests/test_xdist.py::test_expired_test_counted_once_under_each_dist_mode[load]",
    "tests/test_xdist.py::test_expired_test_counted_once_under_each_dist_mode[loadgroup]",
    "tests/test_xdist.py::test_session_fixture_teardown_sleep_is_bounded",
    "tests/test_sync.py::test_barrier_across_ranks",
    # How an interpreter ends differs by version (what it keeps to its very end).
    "tests/test_installed.py::test_at_the_end_of_the_process_nothing_of_the_session_stays_reachable",
]
# The packages whose declared minimum is tested: the lower bound of each in pyproject.
MINIMUM_OF = ("pytest", "pytest-xdist")

nox.options.sessions = ["tests"]
nox.options.default_venv_backend = "venv"


def minimum_pins() -> list[str]:
    """``name==X`` for each package of :data:`MINIMUM_OF` declared as ``name>=X``, so
    the versions tested are the declared ones by construction."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        dependencies = tomllib.load(f)["project"]["dependencies"]
    pins = []
    for requirement in dependencies:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9A-Za-z.]*)", requirement)
        if match and match.group(1).lower() in MINIMUM_OF:
            pins.append(f"{match.group(1)}=={match.group(2)}")
    missing = set(MINIMUM_OF) - {pin.split("==")[0].lower() for pin in pins}
    if missing:
        raise ValueError(f"pyproject declares no lower bound for {sorted(missing)}")
    return pins


@nox.session(python=PYTHONS)
@nox.parametrize("deps", ["minimum", "newest"])
def tests(session: nox.Session, deps: str) -> None:
    """The suite (or :data:`SUBSET`) with the minimum or the newest pytest and xdist."""
    pins = minimum_pins() if deps == "minimum" else []
    session.install("-e", ".[test]", *pins)
    session.run("python", "-m", "pip", "list", "--format=freeze", silent=False)
    full = os.environ.get("FULL") == "1" or (session.python == "3.11" and deps == "newest")
    # Arguments after "--" replace the subset: nox -s "tests-3.10(deps='minimum')" -- tests/x.py
    paths = [] if full or session.posargs else SUBSET
    # pytest's exit status 5 (no test collected) fails the session: every path of the
    # subset has tests, so it would mean the subset went stale.
    session.run(
        "python",
        "-m",
        "pytest",
        "-n",
        "2",
        "-q",
        "-p",
        "no:cacheprovider",
        *paths,
        *session.posargs,
    )


@nox.session(python="3.11")
def compat(session: nox.Session) -> None:
    """Other pytest plugins' own test suites with this plugin installed and without it:
    the same outcomes, test by test (see compat/run.py)."""
    # compat/run.py makes its own environments, with and without this project.
    session.run("python", "compat/run.py", *session.posargs)
