"""The plugin's options and marker text, and the session's :class:`Settings` read from
them once (the CLI wins over the ini file). Every number of seconds goes through
:func:`~pytest_elastic_timer.core.seconds.parse_seconds`."""

from __future__ import annotations

import os
import warnings
from typing import Any, NamedTuple

import pytest

from pytest_elastic_timer.core.plain_imports import plainly
from pytest_elastic_timer.core.seconds import parse_fraction, parse_seconds

HELP = {
    "expires": "default call-phase budget in seconds for tests without an expires "
    "marker (0 = none).",
    "grace": "seconds from a scope's interrupt to the termination of its owner's "
    "process tree (default 2).",
    "scale": "multiply every budget by this factor (slow machines, coverage runs).",
    "report": "write a JSON report of expired scopes to this path.",
    "trace": "write a Chrome/Perfetto trace of all scopes to this path.",
    "session": "budget in seconds for the whole session, phases outside tests included (0 = none).",
    "leaks": "what to do with processes a test started in its call phase and left running "
    "after its teardown: warn, kill (also warns), off, or auto (default: warn once the "
    "session uses the plugin, else leave the session untouched).",
    "slow": "list a test phase as SLOW in the terminal summary once it used this fraction "
    "of its budget (default 0.8; 0 = off).",
}
# (CLI flag, ini name, key of HELP, metavar); the ini name is also the option's dest.
OPTIONS = (
    ("--expires", "expires", "expires", "SECONDS"),
    ("--elastic-timer-grace", "elastic_timer_grace", "grace", "SECONDS"),
    ("--elastic-timer-scale", "elastic_timer_scale", "scale", "FACTOR"),
    ("--elastic-timer-report", "elastic_timer_report", "report", "PATH"),
    ("--elastic-timer-trace", "elastic_timer_trace", "trace", "PATH"),
    ("--expires-session", "expires_session", "session", "SECONDS"),
    ("--elastic-timer-leaks", "elastic_timer_leaks", "leaks", "MODE"),
    ("--elastic-timer-slow", "elastic_timer_slow", "slow", "FRACTION"),
)
MARKER = (
    "expires(seconds, *, setup=None, teardown=None, grace=None): the test's call phase "
    "must end within `seconds` (setup and teardown within their keywords); enforced by "
    "the pytest-elastic-timer watchdog."
)
# Options whose value is a number. pytest 9's own TOML table ([tool.pytest]) hands
# the plugin TOML's types, and pytest 9.2 can register an ini key as "a string or a
# number": there, `expires = 60` works as it does in [tool.pytest.ini_options].
NUMBER_METAVARS = ("SECONDS", "FACTOR", "FRACTION")
INI_NUMBERS = pytest.version_tuple >= (9, 2)
DEFAULT_GRACE = 2.0
DEFAULT_SLOW = 0.8
LEAK_MODES = ("kill", "warn", "off", "auto")


class Settings(NamedTuple):
    """The session's options, resolved once (CLI wins over ini)."""

    expires: float = 0.0
    grace: float = DEFAULT_GRACE
    scale: float = 1.0
    report: str | None = None
    trace: str | None = None  # absolute
    session: float = 0.0
    leaks: str = "auto"
    slow: float = DEFAULT_SLOW


def add_options(parser: pytest.Parser) -> None:
    """Each option once for the command line and once for the ini file."""
    group = parser.getgroup("elastic-timer", "per-step deadlines (pytest-elastic-timer)")
    for flag, ini, key, metavar in OPTIONS:
        group.addoption(flag, dest=ini, default=None, metavar=metavar, help=HELP[key])
        if INI_NUMBERS and metavar in NUMBER_METAVARS:
            # A string first: an ini file's "60" stays the text the plugin parses.
            parser.addini(ini, HELP[key], type=str | float, default=None)
        else:
            parser.addini(ini, HELP[key], default=None)


def option(config: pytest.Config, name: str) -> tuple[str, Any]:
    """(where the value came from, raw value) for option ``name``; CLI wins."""
    value = config.getoption(name)
    if value is not None:
        return f"--{name.replace('_', '-')}", value
    with warnings.catch_warnings():
        # A TOML list or table is a value of the wrong type, which read_settings makes
        # a usage error naming it; pytest's deprecation warning for it would be an
        # INTERNALERROR where warnings are errors.
        warnings.simplefilter("ignore", pytest.PytestDeprecationWarning)
        value = config.getini(name)
    # None: the key is not in the file. Empty: set to nothing, which is pytest's way
    # (`-o elastic_timer_report=`) to switch off what an ini file sets. On the command
    # line an empty value is a bad value (read_settings says so): most often a variable
    # that was not set (`--elastic-timer-report=$REPORT`).
    if value not in (None, ""):
        return f"ini option {name!r}", value
    return "", None


def any_given(config: pytest.Config) -> bool:
    """Whether any of the plugin's options but the leak check's own is given, on the
    command line or in the ini file: the session asks for the plugin."""
    return any(
        option(config, ini)[1] is not None
        for _, ini, _, _ in OPTIONS
        if ini != "elastic_timer_leaks"  # its `auto` must not decide for itself
    )


def read_settings(config: pytest.Config) -> Settings:
    """The session's settings; a bad value is a usage error that names where it came from."""

    def seconds(
        name: str, default: float, *, allow_zero: bool = True, kind: str = "a number of seconds"
    ) -> float:
        where, raw = option(config, name)
        if raw is None:
            return default
        try:
            return parse_seconds(raw, where, allow_zero=allow_zero, kind=kind)
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None

    def path(name: str) -> str | None:
        where, raw = option(config, name)
        if raw is None:
            return None
        # Not a string: a TOML list or table. Blank: most often a variable that was not
        # set (`--elastic-timer-report=$REPORT`), which would leave the session without
        # its file, or write one named by blanks. A NUL byte no file name can hold.
        if not isinstance(raw, str) or not raw.strip() or "\0" in raw:
            raise pytest.UsageError(f"{where} must be a path, not {raw!r}")
        # `~` and `$VARIABLES` are expanded, as pytest expands --junitxml's path.
        expanded = os.path.expanduser(os.path.expandvars(raw))
        # Said now, not after every test has run. A path that ends in a separator names
        # a directory too, one that may not be there yet (the output went to a file of
        # that name, without the separator).
        if os.path.isdir(expanded) or expanded.endswith(os.sep):
            raise pytest.UsageError(f"{where} must be the path of a file, not a directory: {raw!r}")
        return expanded

    def choice(name: str, allowed: tuple[str, ...], default: str) -> str:
        where, raw = option(config, name)
        if raw is None:
            return default
        if str(raw).strip() not in allowed:
            raise pytest.UsageError(f"{where} must be one of {', '.join(allowed)}, not {raw!r}")
        return str(raw).strip()

    def fraction(name: str, default: float) -> float:
        where, raw = option(config, name)
        try:
            return default if raw is None else parse_fraction(raw, where)
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None

    settings = Settings(
        expires=seconds("expires", 0.0),
        grace=seconds("elastic_timer_grace", DEFAULT_GRACE),
        scale=seconds("elastic_timer_scale", 1.0, allow_zero=False, kind="a number"),
        report=path("elastic_timer_report"),
        trace=os.path.abspath(trace) if (trace := path("elastic_timer_trace")) else None,
        session=seconds("expires_session", 0.0),
        leaks=choice("elastic_timer_leaks", LEAK_MODES, "auto"),
        slow=fraction("elastic_timer_slow", DEFAULT_SLOW),
    )
    check_distinct_files(config, settings)
    return settings


def check_distinct_files(config: pytest.Config, settings: Settings) -> None:
    """A usage error if two of the session's output files are one file: pytest's JUnit
    XML, the JSON report and the trace would each overwrite the other."""
    junit = config.getoption("xmlpath", None)
    junit_file = None
    if junit:  # the CI outputs load only where they are used
        with plainly():
            from pytest_elastic_timer.ci.junit import junit_path

        junit_file = junit_path(config)
    files = [
        # First: the error names the plugin's own option, the one to change.
        ("--junitxml", junit, junit_file),
        (*option(config, "elastic_timer_report"), settings.report),
        (*option(config, "elastic_timer_trace"), settings.trace),
    ]
    seen: dict[str, str] = {}
    for where, given, path in files:
        if path is None:
            continue
        real = os.path.realpath(path)  # a symbolic link is followed when written
        if os.path.exists(real) and not os.path.isfile(real):
            # Not a file that is replaced (/dev/null, a pipe, a terminal): written into,
            # by each output that names it, as a CI job sends several to its log.
            continue
        if real in seen:
            raise pytest.UsageError(
                f"{where} must be a file of its own, not the file of {seen[real]}: {given!r}"
            )
        seen[real] = where
