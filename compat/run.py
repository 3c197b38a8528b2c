"""Compatibility check: other pytest plugins' own test suites give the same outcomes
with this plugin installed (and so loaded into every session, theirs and their inner
pytester sessions) and without it.

    python compat/run.py                      # every plugin of PLUGINS
    python compat/run.py pytest-mock          # some of them
    python compat/run.py --workdir DIR        # keep the environments and logs in DIR

For each plugin: its source distribution (which carries its tests) is downloaded and
unpacked; two virtual environments get the same packages (the plugin, what its tests
need, pytest, pytest-xdist and psutil), one of them this project as well (built and
installed as users get it, not for development); the plugin's
suite runs in each. The counts of outcomes and every test's outcome are compared; a
test whose outcome differs is run again in both environments, and a difference that
comes back is reported. Exit status 1 when one does, 2 when a suite could not run.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Plugin:
    """A plugin whose own suite is run: its pinned version, the paths of its tests in
    its source distribution, and what its tests need beyond the plugin itself."""

    requirement: str
    tests: tuple[str, ...]
    needs: tuple[str, ...] = ()
    args: tuple[str, ...] = field(default=())


PLUGINS = {
    "pytest-mock": Plugin("pytest-mock==3.17.0", ("tests",), ("mock", "pytest-asyncio")),
    "pytest-rerunfailures": Plugin("pytest-rerunfailures==16.7", ("tests",)),
    "pytest-timeout": Plugin("pytest-timeout==2.4.0", ("test_pytest_timeout.py",), ("pexpect",)),
    "pytest-xdist": Plugin("pytest-xdist==3.8.0", ("testing",), ("filelock",)),
    "pytest-asyncio": Plugin("pytest-asyncio==1.5.0", ("tests",), ("hypothesis",)),
    # Coverage of subprocesses and xdist workers, which start through the same
    # interpreter start-up as the plugin's sitecustomize.
    "pytest-cov": Plugin(
        "pytest-cov==7.1.0",
        ("tests",),
        ("coverage[toml]", "process-tests", "virtualenv"),
    ),
    # anyio's pytest plugin, and its tests that start child Python processes.
    "anyio": Plugin(
        "anyio==4.16.0",
        (
            "tests/test_pytest_plugin.py",
            "tests/test_subprocesses.py",
            "tests/test_to_process.py",
            "tests/test_signals.py",
        ),
        (
            "trio>=0.32.0",
            "blockbuster>=1.5.29",
            "coverage[toml]>=7",
            "hypothesis>=4.18.2",
            "pytest-mock>=3.14",
            "pytest-timeout>=2.4.0",
            "trustme>=1.0.0",
            "truststore>=0.9.1",
            "uvloop>=0.22.1",
        ),
    ),
    # pytest's own suite (its "dev" extra, without coverage): thousands of pytester
    # sessions, in-process and in subprocesses. Two workers keep it to minutes.
    "pytest": Plugin(
        "pytest==9.2.0",
        ("testing",),
        (
            "argcomplete",
            "attrs>=23.1",
            "hypothesis>=6.75",
            "mock",
            "numpy>=1.26",
            "pexpect>=4.9",
            "pyyaml",
            "requests",
            "setuptools",
            "xmlschema",
            "pygments",
        ),
        ("-n", "2"),
    ),
}
# What this project installs besides itself, in both environments, so that the one
# difference between them is this plugin.
SHARED = ("pytest", "pytest-xdist", "psutil")
# Variables of an enclosing session (this project's own, when run from its tests) that
# must not reach the suites.
DROPPED = ("PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTEST_DISABLE_PLUGIN_AUTOLOAD")


def sh(*argv: str | Path, cwd: Path | None = None, log: Path | None = None) -> None:
    """Run a set-up command; its output goes to ``log`` (shown when it fails)."""
    with open(log or os.devnull, "a", encoding="utf-8") as out:
        done = subprocess.run([str(a) for a in argv], cwd=cwd, stdout=out, stderr=out)
    if done.returncode != 0:
        text = log.read_text(encoding="utf-8")[-4000:] if log else ""
        raise SystemExit(f"failed ({done.returncode}): {' '.join(map(str, argv))}\n{text}")


def unpack(plugin: Plugin, work: Path) -> Path:
    """Download the plugin's source distribution and unpack it; its directory."""
    download = work / "sdist"
    download.mkdir(exist_ok=True)
    before = set(download.iterdir())
    sh(sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:", "--no-deps",
       "-d", download, plugin.requirement, log=work / "setup.log")  # fmt: skip
    found = (set(download.iterdir()) - before) or set(download.glob("*.tar.gz"))
    (archive,) = found
    with tarfile.open(archive) as tar:
        tar.extractall(work, filter="data") if sys.version_info >= (3, 12) else tar.extractall(work)
    return work / archive.name.removesuffix(".tar.gz")


def environment(work: Path, source: Path, plugin: Plugin, with_this: bool) -> Path:
    """A virtual environment with the plugin and its tests' needs (and this project)."""
    venv = work / ("with" if with_this else "without")
    log = work / "setup.log"
    sh(sys.executable, "-m", "venv", venv, log=log)
    python = venv / "bin" / "python"
    sh(python, "-m", "pip", "install", "-q", "--upgrade", "pip", log=log)
    # Built and installed as users get it, not for development: pytest then marks the
    # package's modules for assertion rewriting, as it does in their environments.
    this = (ROOT,) if with_this else ()
    sh(python, "-m", "pip", "install", "-q", source, *plugin.needs, *SHARED, *this, log=log)
    return python


def installed(python: Path) -> set[str]:
    out = subprocess.run(
        [str(python), "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True
    ).stdout
    return {line.split("==")[0].lower() for line in out.splitlines() if "==" in line}


def run_suite(
    python: Path, source: Path, plugin: Plugin, out: Path, nodeids: list[str] | None = None
) -> dict[str, str]:
    """Run the plugin's suite (or ``nodeids`` of it); each test's outcome."""
    env = {k: v for k, v in os.environ.items() if k not in DROPPED}
    env = {k: v for k, v in env.items() if not k.startswith("PYTEST_ELASTIC_TIMER")}
    env["COMPAT_OUTCOMES"] = str(out.with_suffix(".json"))
    # A temporary directory of its own: pytest removes all but the newest three
    # pytest-of-<user> directories, also those of another session running meanwhile.
    tmp = out.parent / f"{out.name}-tmp"
    tmp.mkdir(exist_ok=True)
    env["TMPDIR"] = str(tmp)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    argv = [str(python), "-m", "pytest", "-p", "outcomes", "-p", "no:cacheprovider", "-rA"]
    argv += [*plugin.args, *(nodeids or plugin.tests)]
    with open(out.with_suffix(".log"), "w", encoding="utf-8") as log:
        status = subprocess.run(argv, cwd=source, env=env, stdout=log, stderr=log).returncode
    if status not in (0, 1) or not out.with_suffix(".json").exists():
        # 5: no test collected; 2, 3, 4: interrupted, internal or usage error.
        raise RuntimeError(f"pytest exited {status} (see {out.with_suffix('.log')})")
    outcomes: dict[str, str] = json.loads(out.with_suffix(".json").read_text(encoding="utf-8"))
    return outcomes


def loaded_this(log: Path) -> bool:
    """Whether the session's header lists this plugin (proof that it was loaded)."""
    for line in log.read_text(encoding="utf-8").splitlines():
        if line.startswith("plugins:"):
            return "elastic-timer" in line
    return False


def counts(outcomes: dict[str, str]) -> dict[str, int]:
    return dict(sorted(collections.Counter(outcomes.values()).items()))


def check(name: str, plugin: Plugin, work: Path) -> bool:
    """Run one plugin's suite with and without this plugin; whether they agree."""
    work.mkdir(parents=True, exist_ok=True)
    source = unpack(plugin, work)
    started = time.monotonic()
    pythons = {
        side: environment(work, source, plugin, side == "with") for side in ("with", "without")
    }
    extra = installed(pythons["with"]) - installed(pythons["without"])
    if extra != {"pytest-elastic-timer"}:
        raise RuntimeError(f"the environments differ by {sorted(extra)}, not by this plugin alone")
    results = {side: run_suite(py, source, plugin, work / side) for side, py in pythons.items()}
    if not loaded_this(work / "with.log") or loaded_this(work / "without.log"):
        raise RuntimeError("this plugin was not loaded in exactly the 'with' run")
    seconds = time.monotonic() - started
    print(f"{name} ({plugin.requirement}), {seconds:.0f}s:")
    for side in ("with", "without"):
        print(f"  {side:8} this plugin: {counts(results[side])}")
    differ = sorted(
        n for n in results["with"].keys() | results["without"].keys()
        if results["with"].get(n) != results["without"].get(n)
    )  # fmt: skip
    if not differ:
        print("  same outcome for every test")
        return True
    # Run the differing tests again in both environments: a difference that does not come
    # back is a flaky test of that suite, not this plugin's doing.
    again = {
        side: run_suite(
            py, source, plugin, work / f"{side}-again", [n for n in differ if "::" in n]
        )
        for side, py in pythons.items()
    }
    same = True
    for nodeid in differ:
        first = (results["with"].get(nodeid), results["without"].get(nodeid))
        second = (again["with"].get(nodeid), again["without"].get(nodeid))
        # A collection error (a nodeid without "::") is not run again: it always counts.
        kept = second[0] != second[1] or "::" not in nodeid
        same = same and not kept
        verdict = "DIFFERS" if kept else "flaky (agrees when run again)"
        print(f"  {verdict}: {nodeid}: with {first[0]}, without {first[1]}; again {second}")
    print(f"  logs: {work}")
    return same


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("plugins", nargs="*", metavar="PLUGIN", help=", ".join(PLUGINS))
    parser.add_argument("--workdir", type=Path, help="keep environments and logs here")
    args = parser.parse_args()
    names = args.plugins or list(PLUGINS)
    unknown = sorted(set(names) - set(PLUGINS))
    if unknown:
        parser.error(f"unknown plugins {unknown}; known: {', '.join(PLUGINS)}")
    if args.workdir is not None and args.workdir.resolve().is_relative_to(HERE):
        # HERE is on the suites' PYTHONPATH (for the outcomes plugin): their files there
        # would be importable as packages, which changes what some tests see.
        parser.error(f"--workdir must be outside {HERE}")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="elastic-timer-compat-"))
    agree = True
    for name in names:
        try:
            agree = check(name, PLUGINS[name], work / name) and agree
        except (RuntimeError, SystemExit) as exc:
            print(f"{name}: could not compare: {exc}")
            return 2
    print("compatible: every suite gave the same outcomes" if agree else "NOT compatible")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
