"""Benchmark 6: what the plugin adds to the start and end of a session.

A one-test session (the loop of a developer who reruns one test) is timed as a whole
command, wall clock, in two configurations run interleaved: plain pytest and pytest with
this plugin. Both have ``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1`` and load pytest-xdist with
``-p xdist`` (xdist is a dependency of the plugin, so its import is not the plugin's
cost); the second also loads ``-p elastic_timer``. The pairs alternate, so drift of the
machine hits both alike; the result is the median of each configuration and their ratio.
Its output is read through pipes, as a shell or a CI step reads it: the command ends when
the last process holding them lets go, which can be the watchdog. What a run leaves
running (a watchdog that finishes after pytest has gone) is waited for, uncounted,
before the next run starts (this process adopts orphans as a subreaper), and the CPU
time of all of a run's processes is given beside its wall clock. A third configuration,
interleaved with them, gives the plugin a default budget (``--expires=30``): a session
that uses the plugin, whose test runs in phase scopes and whose process becomes the leak
check's subreaper (a session that does not use the plugin is left without one). A full
run also counts the instructions of the pytest process of one session of each, plain
and with the plugin (callgrind; the watchdog runs outside valgrind): repeatable where
the wall clock of a shared machine is not. The pair of plain pytest and the plugin is
timed once more with every process held to one core (``sched_setaffinity``), as in a
container given one CPU, where the watchdog starts on the core that runs pytest.

The package is measured as users get it: built into a wheel and installed in a virtual
environment of its own, which sees this environment's other packages (pytest, xdist,
psutil) through a path file, so nothing is downloaded. In that environment, two more
pairs time the session with plugins loaded from their entry points, pytest's default:
pytest then searches the entry points of every installed distribution once, with the
plugin or without it, where with autoload off each ``-p NAME`` costs that search again
(5 to 10 ms here, where this environment's hundred-odd distributions are visible); and
the same where pytest cannot cache the bytecode it compiles
(``PYTHONDONTWRITEBYTECODE=1``, as many container images set), where it marks every
module of a plugin's distribution for assertion rewriting. A second row times this
checkout as installed for development (``pip install -e``), whose import finder every
process, the watchdog too, loads at start.

A second pair does the same for an inner session started in-process by ``pytester``
(the case of another plugin's own test suite, which runs many such sessions): the time
of ``pytester.runpytest`` of a one-test file, measured inside one outer test, with the
plugin loaded in the inner session or not. The outer session loads the plugin, as it
does where the plugin is installed, so the inner sessions pay its work, not its
imports. Beside the wall clock, the CPU time of the whole machine during each inner
session: a watchdog, were one started, would run in a process of its own.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common

TEST = "def test_one():\n    assert True\n"

INNER = """
import os
import time

import pytest

pytest_plugins = ["pytester"]


def machine_cpu():
    # Busy CPU seconds of the whole machine: a watchdog runs in a process of its own.
    with open("/proc/stat", encoding="ascii") as f:
        ticks = [int(n) for n in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


@pytest.mark.parametrize("plugin", ["plain", "elastic_timer"] * __ROUNDS__)
def test_inner_session(pytester, plugin, record_property):
    pytester.makepyfile(test_one="def test_one():\\n    assert True\\n")
    args = ["-p", "xdist", "-q", "-p", "no:cacheprovider"]
    if plugin == "elastic_timer":
        args += ["-p", "elastic_timer"]
    cpu = machine_cpu()
    start = time.perf_counter()
    result = pytester.runpytest_inprocess(*args)
    elapsed = time.perf_counter() - start
    cpu = machine_cpu() - cpu
    assert result.ret == 0
    with open(__OUT__, "a", encoding="utf-8") as f:
        f.write(f"{plugin} {elapsed} {cpu}\\n")
"""


# The plugin's variants of a session: loaded only; and used, with a default budget
# (phase scopes, the leak check's subreaper), as a suite that asks for it runs.
USED = ("--expires=30",)


def _session_argv(
    directory: str, plugin: bool, python: str = common.PYTHON, extra: tuple[str, ...] = ()
) -> list[str]:
    argv = [python, "-m", "pytest", "-q", "-p", "xdist", "-p", "no:cacheprovider"]
    if plugin:
        argv += ["-p", "elastic_timer", *extra]
    return [*argv, os.path.join(directory, "test_one.py")]


def _time(argv: list[str], env: dict[str, str], cwd: str) -> float:
    """The wall clock of ``argv`` until it exits and its output ends (what a shell or a
    CI step waits for). The processes it leaves running are waited for after that,
    uncounted: a watchdog that finishes once pytest has gone must not run into the
    next command timed (see :func:`_adopt_orphans`)."""
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    _reap_children()
    if done.returncode != 0:
        raise RuntimeError(f"{argv} exited {done.returncode}: {done.stdout[-500:]}")
    return elapsed


def _adopt_orphans() -> None:
    """Make this process a subreaper: the watchdog, which its shell leaves orphaned,
    becomes this process's child, so that :func:`_reap_children` can wait for it."""
    from pytest_elastic_timer.plugin import leaks

    leaks.become_subreaper()


def _reap_children() -> None:
    """Wait for every child of this process to end (orphans adopted included)."""
    while True:
        try:
            os.wait()
        except ChildProcessError:
            return


def _children_cpu() -> float:
    """CPU seconds of this process's children that have ended and been waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _interleaved(
    argvs: dict[str, list[str]], env: dict[str, str], cwd: str, rounds: int
) -> dict[str, list[float]]:
    """Each command of ``argvs`` timed ``rounds`` times, in turn, after one run each that
    warms the file cache and the bytecode; beside each name's times, under
    ``"<name> cpu"``, the CPU time of every process of each run (the watchdog to its
    end included)."""
    for argv in argvs.values():
        _time(argv, env, cwd)
    times: dict[str, list[float]] = {}
    for name in argvs:
        times[name], times[f"{name} cpu"] = [], []
    for _ in range(rounds):
        for name, argv in argvs.items():
            cpu = _children_cpu()
            times[name].append(_time(argv, env, cwd))
            times[f"{name} cpu"].append(_children_cpu() - cpu)
    return times


def _instructions(argv: list[str], env: dict[str, str], cwd: str) -> int | None:
    """The instructions of the pytest process of ``argv`` alone (callgrind; the watchdog
    runs outside valgrind), or None without valgrind. Repeatable from run to run, where
    the wall clock of a shared machine is not."""
    if shutil.which("valgrind") is None:
        return None
    with tempfile.TemporaryDirectory() as out:
        path = os.path.join(out, "callgrind.out")
        done = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={path}", *argv],
            env={**env, "PYTHONHASHSEED": "0"},
            cwd=cwd,
            capture_output=True,
        )
        if done.returncode != 0 or not os.path.exists(path):
            return None
        return common.callgrind_total(path)


def whole_sessions(
    rounds: int, python: str = common.PYTHON, instructions: bool = False, one_core: bool = False
) -> dict[str, Any]:
    env = common.clean_env(PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    with tempfile.TemporaryDirectory() as directory:
        with open(os.path.join(directory, "test_one.py"), "w", encoding="utf-8") as f:
            f.write(TEST)
        argvs = {
            "plain": _session_argv(directory, False, python),
            "plugin": _session_argv(directory, True, python),
            "used": _session_argv(directory, True, python, USED),
        }
        times = _interleaved(argvs, env, directory, rounds)
        counted = {
            name: _instructions(argvs[name], env, directory) if instructions else None
            for name in ("plain", "plugin")
        }
        on_one_core = None
        if one_core:
            pair = {name: argvs[name] for name in ("plain", "plugin")}
            on_one_core = _on_one_core(lambda: _interleaved(pair, env, directory, rounds))
    summary = _summary(times)
    if counted["plain"] and counted["plugin"]:
        summary.update(plain_instructions=counted["plain"], plugin_instructions=counted["plugin"])
    if on_one_core is not None:
        summary["one_core"] = _summary(on_one_core)
    return summary


def _on_one_core(
    run: Callable[[], dict[str, list[float]]],
) -> dict[str, list[float]] | None:
    """``run`` with this process, and so every process it starts, held to one core:
    a container given one CPU, where the watchdog's start competes with pytest for it
    instead of running beside it. None where the affinity cannot be set here."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cores = os.sched_getaffinity(0)
    if len(cores) < 2:
        return None  # one core already: the main pair measured it
    os.sched_setaffinity(0, {min(cores)})
    try:
        return run()
    finally:
        os.sched_setaffinity(0, cores)


def installed_sessions(rounds: int, instructions: bool = False) -> dict[str, Any]:
    """:func:`whole_sessions` with the package installed from its wheel, and under
    ``autoload`` and ``uncached``, :func:`autoloaded_sessions` in the same environment,
    with the bytecode cached and not."""
    with tempfile.TemporaryDirectory() as directory:
        python = _install_wheel(directory)
        result = whole_sessions(rounds, python, instructions, one_core=True)
        for key, cached in (("autoload", True), ("uncached", False)):
            try:
                result[key] = autoloaded_sessions(rounds, python, cached=cached)
            except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
                result[key] = {"error": str(exc)[:500]}
        return result


def autoloaded_sessions(rounds: int, python: str, *, cached: bool) -> dict[str, Any]:
    """The one-test session with plugins loaded from their entry points, pytest's
    default. pytest then looks through the entry points of every installed
    distribution once, with the plugin or without it, where with autoload off each
    ``-p NAME`` costs that search again. The other plugins of this environment are
    blocked (``-p no:NAME``), so that both configurations load xdist and nothing else;
    plain pytest blocks this one too. Not ``cached``: pytest cannot cache the bytecode
    it compiles (``PYTHONDONTWRITEBYTECODE=1``, as many container images set), and it
    marks every module of each plugin's distribution for assertion rewriting."""
    listed = subprocess.run(
        [python, "-c", _LIST_PLUGINS], check=True, capture_output=True, text=True
    ).stdout.split()
    blocked = [arg for name in listed if name not in _KEPT for arg in ("-p", f"no:{name}")]
    env = common.clean_env()
    env.pop("PYTEST_DISABLE_PLUGIN_AUTOLOAD", None)
    if cached:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    else:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    with tempfile.TemporaryDirectory() as directory:
        with open(os.path.join(directory, "test_one.py"), "w", encoding="utf-8") as f:
            f.write(TEST)
        base = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *blocked]
        argvs = {
            "plain": [*base, "-p", "no:elastic_timer", "test_one.py"],
            "plugin": [*base, "test_one.py"],
        }
        times = _interleaved(argvs, env, directory, rounds)
    return _summary(times)


# The names of the pytest plugins installed (entry points of the group pytest11).
_LIST_PLUGINS = (
    "import importlib.metadata as m; "
    "print(*{e.name for d in m.distributions() for e in d.entry_points if e.group == 'pytest11'})"
)
_KEPT = {"elastic_timer", "xdist", "xdist.looponfail"}


def _install_wheel(directory: str) -> str:
    """A virtual environment in ``directory`` with this checkout installed from its
    wheel (bytecode compiled, as pip does), seeing this environment's packages after
    its own; its Python."""
    import sysconfig
    import venv

    wheels = os.path.join(directory, "wheels")
    pip = [common.PYTHON, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", wheels, common.REPO],
        check=True,
        capture_output=True,
    )
    target = os.path.join(directory, "venv")
    venv.create(target, with_pip=False, symlinks=True)
    python = os.path.join(target, "bin", "python")
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (wheel,) = (os.path.join(wheels, name) for name in os.listdir(wheels))
    subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "--target", site, wheel],
        check=True,
        capture_output=True,
    )
    # A path file of plain paths: this environment's packages become importable, but
    # its own path files (a development install's finder) do not run.
    with open(os.path.join(site, "environment.pth"), "w", encoding="utf-8") as f:
        f.write(sysconfig.get_path("purelib") + "\n")
    return python


def inner_sessions(rounds: int) -> dict[str, Any]:
    env = common.clean_env(PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    with tempfile.TemporaryDirectory() as directory:
        out = os.path.join(directory, "times.txt")
        source = INNER.replace("__ROUNDS__", str(rounds)).replace("__OUT__", repr(out))
        with open(os.path.join(directory, "test_inner.py"), "w", encoding="utf-8") as f:
            f.write(source)
        # The outer session loads the plugin, as an environment where it is installed
        # does: its modules stay imported across the inner sessions (pytester drops
        # only the modules an inner session imported for the first time).
        argv = [common.PYTHON, "-m", "pytest", "-q", "-p", "pytester", "-p", "xdist"]
        argv += ["-p", "elastic_timer", "-p", "no:cacheprovider", "test_inner.py"]
        _time(argv, env, directory)
        times: dict[str, list[float]] = {"plain": [], "plugin": []}
        cpu: dict[str, float] = {"plain": 0.0, "plugin": 0.0}
        with open(out, encoding="utf-8") as f:
            for line in f:
                name, seconds, busy = line.split()
                variant = "plugin" if name == "elastic_timer" else "plain"
                times[variant].append(float(seconds))
                cpu[variant] += float(busy)
    # The CPU as a mean over the runs: /proc/stat counts in ticks of 10 ms.
    return {
        **_summary(times),
        "plain_cpu_ms": cpu["plain"] / len(times["plain"]) * 1e3,
        "plugin_cpu_ms": cpu["plugin"] / len(times["plugin"]) * 1e3,
    }


def _summary(times: dict[str, list[float]]) -> dict[str, Any]:
    plain, plugin = common.median(times["plain"]), common.median(times["plugin"])
    summary = {
        "runs": len(times["plain"]),
        "plain_ms": plain * 1e3,
        "plugin_ms": plugin * 1e3,
        "ratio": plugin / plain,
        "plain_all_ms": [t * 1e3 for t in times["plain"]],
        "plugin_all_ms": [t * 1e3 for t in times["plugin"]],
    }
    if times.get("plugin cpu"):
        summary.update(
            plain_session_cpu_ms=common.median(times["plain cpu"]) * 1e3,
            plugin_session_cpu_ms=common.median(times["plugin cpu"]) * 1e3,
        )
    if times.get("used"):
        used = common.median(times["used"])
        summary.update(used_ms=used * 1e3, used_ratio=used / plain)
    return summary


def _compile_package() -> None:
    """Write the package's bytecode, as installing it does: from a source checkout with
    PYTHONDONTWRITEBYTECODE set, every run would compile the modules changed since
    their bytecode was last written, and time that too."""
    import compileall

    compileall.compile_dir(os.path.join(common.REPO, "pytest_elastic_timer"), quiet=1)


def measure(quick: bool) -> dict[str, Any]:
    rounds = 6 if quick else 24
    result: dict[str, Any] = {}
    _compile_package()
    _adopt_orphans()
    runs = (
        # Instructions only in a full run: valgrind takes some seconds a session.
        ("session", lambda rounds: installed_sessions(rounds, instructions=not quick)),
        ("development", whole_sessions),
        ("inner", inner_sessions),
    )
    for name, run in runs:
        try:
            result[name] = run(rounds)
        except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
            result[name] = {"error": str(exc)[:500]}
    return result


def _ratio_row(what: str, r: dict[str, Any]) -> str:
    """The table row of one pair of configurations: its error, or its medians and their
    ratio."""
    if "error" in r:
        return f"| {what} | error: {r['error'][:200]} | | | |"
    return _pair_row(what, r["runs"], r["plain_ms"], r["plugin_ms"])


def _pair_row(what: str, runs: int, plain: float, plugin: float) -> str:
    """A table row: what is compared, over how many runs, both figures, their ratio."""
    return f"| {what} | {runs} | {plain:.0f} | {plugin:.0f} | {plugin / plain:.2f}x |"


def render(result: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    lines = [
        "| One-test session, wall clock | runs | plain ms | with the plugin ms | ratio |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for key, what in (
        (
            "session",
            "`python -m pytest` of one passing test, the package installed from its "
            "wheel (median of interleaved runs)",
        ),
        ("development", "the same, this checkout installed for development (`pip install -e`)"),
        ("inner", "an in-process `pytester` session of one passing test (development)"),
    ):
        r = result.get(key, {})
        if not r:
            continue
        lines.append(_ratio_row(what, r))
        if "error" in r:
            continue
        if "plugin_cpu_ms" in r:
            what = "… its CPU time, every process of the machine (mean; a watchdog runs in a "
            what += "process of its own)"
            lines.append(_pair_row(what, r["runs"], r["plain_cpu_ms"], r["plugin_cpu_ms"]))
        if "plugin_session_cpu_ms" in r:
            what = "… CPU time of the run's processes (pytest, and the watchdog to its end; median)"
            lines.append(
                _pair_row(what, r["runs"], r["plain_session_cpu_ms"], r["plugin_session_cpu_ms"])
            )
        if "plugin_instructions" in r:
            plain_i, plugin_i = r["plain_instructions"], r["plugin_instructions"]
            lines.append(
                f"| … instructions of the pytest process (callgrind, once each; the "
                f"same from run to run) | 1 | {plain_i / 1e6:,.0f} M | "
                f"{plugin_i / 1e6:,.0f} M | {plugin_i / plain_i:.2f}x |"
            )
        if "used_ms" in r:
            what = f"… with `{' '.join(USED)}`: the session uses the plugin (phase scopes, "
            what += "the leak check's subreaper)"
            lines.append(_pair_row(what, r["runs"], r["plain_ms"], r["used_ms"]))
        for variant, what in (
            (
                "one_core",
                "… held to one core, as in a container given one CPU: the watchdog's start "
                "competes with pytest for it",
            ),
            (
                "autoload",
                "… plugins loaded from their entry points, pytest's default (one search "
                "of the installed distributions in both; others than xdist blocked)",
            ),
            (
                "uncached",
                "… the same where pytest cannot cache bytecode (`PYTHONDONTWRITEBYTECODE=1`)",
            ),
        ):
            if r.get(variant):
                lines.append(_ratio_row(what, r[variant]))
    session = result.get("session", {})
    ratio = session.get("ratio")
    checks = [
        {
            "target": "One-test session with the plugin ≤ 1.10x plain pytest (wall clock)",
            "measured": f"{common.fmt(ratio)}x "
            f"({common.fmt(session.get('plugin_ms'), 0)} vs "
            f"{common.fmt(session.get('plain_ms'), 0)} ms)",
            "ok": None if ratio is None else ratio <= 1.10,
        }
    ]
    return "\n".join(lines), checks


if __name__ == "__main__":
    args = common.script_args(__doc__ or "")
    common.emit(measure(args.quick), args.json_out)
