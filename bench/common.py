"""Helpers shared by the benchmarks: statistics, the machine, subprocess workers.

Every benchmark module runs as its own script (a fresh interpreter), writes its result
as JSON to the path given with ``--json-out`` and has a ``render(result)`` function that
``run.py`` uses to turn that result into Markdown.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import re
import selectors
import signal
import statistics
import subprocess
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import Any

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
PYTHON = sys.executable

# Variables that would tie a benchmark's processes to another session's watchdog.
_FOREIGN_ENV = (
    "PYTEST_ELASTIC_TIMER",
    "PYTEST_ELASTIC_TIMER_SCALE",
    "PYTEST_ADDOPTS",
    "PYTEST_CURRENT_TEST",
    "PYTEST_XDIST_WORKER",
    "PYTEST_XDIST_WORKER_COUNT",
    "PYTEST_PLUGINS",
    "TORCHELASTIC_TIMER_FILE",
)


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any pytest or elastic-timer session in it."""
    env = {k: v for k, v in os.environ.items() if k not in _FOREIGN_ENV}
    env.update(extra)
    return env


def scrub_own_env() -> None:
    for name in _FOREIGN_ENV:
        os.environ.pop(name, None)


# -- callgrind ------------------------------------------------------------------------
_CALLGRIND_TOTAL = re.compile(rb"^(?:summary|totals):\s+(\d+)", re.MULTILINE)


def callgrind_total(path: str) -> int | None:
    """The instructions a callgrind output file counts in all (None: no total in it)."""
    with open(path, "rb") as f:
        match = _CALLGRIND_TOTAL.search(f.read())
    return int(match.group(1)) if match else None


# -- statistics ----------------------------------------------------------------------
def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile ``q`` (0..100) of ``values``."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def fmt(value: float | None, digits: int = 2, unit: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:,.{digits}f}{unit}"


def verdict(ok: bool | None) -> str:
    if ok is None:
        return "not measured"
    return "**yes**" if ok else "**no**"


# -- the machine ---------------------------------------------------------------------
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total() -> str:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
    except OSError:
        pass
    return "unknown"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _command(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10, cwd=REPO)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip()


def machine() -> dict[str, Any]:
    commit = _command(["git", "rev-parse", "--short", "HEAD"])
    dirty = _command(["git", "status", "--porcelain", "--", "pytest_elastic_timer"])
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory": _mem_total(),
        "kernel": f"{platform.system()} {platform.release()}",
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "packages": {
            name: _version(name)
            for name in (
                "pytest-elastic-timer",
                "pytest",
                "pytest-xdist",
                "pytest-timeout",
                "torch",
                "psutil",
                "pluggy",
                "execnet",
            )
        },
        "valgrind": _command(["valgrind", "--version"]) or "not installed",
        "commit": commit + (" (package modified in the work tree)" if dirty else ""),
    }


def render_machine(info: dict[str, Any]) -> str:
    pkgs = ", ".join(f"{k} {v}" for k, v in info["packages"].items())
    return "\n".join(
        [
            f"- CPU: {info['cpu']}, {info['cores']} cores "
            f"({info['usable_cores']} usable), {info['memory']} memory",
            f"- OS: {info['kernel']}; {info['python']}; {info['valgrind']}",
            f"- Packages: {pkgs}",
            f"- pytest-elastic-timer commit: {info['commit']}",
        ]
    )


# -- scripts -------------------------------------------------------------------------
def script_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="fewer samples, smaller runs")
    parser.add_argument("--json-out", default=None, help="write the result here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


def emit(result: dict[str, Any], path: str | None) -> None:
    text = json.dumps(result, indent=1, sort_keys=True)
    if path:
        with open(path, "w") as f:
            f.write(text)
    else:
        print(text)


def kill_group(proc: subprocess.Popen[Any]) -> None:
    """End ``proc`` and the process group it leads (it was started in its own session)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


class LineWorker:
    """A helper process that answers one JSON line per command line on its stdin."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.argv = argv
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,  # unbuffered: a line read never takes the next one with it
            env=env,
            start_new_session=True,
        )

    def read(self, timeout: float = 120.0) -> dict[str, Any]:
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                raise TimeoutError(f"no answer from {self.argv[-1]} in {timeout}s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.argv[-1]} exited (code {self.proc.poll()})")
        value: dict[str, Any] = json.loads(line)
        return value

    def ask(self, command: str, timeout: float = 120.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command.encode() + b"\n")
        return self.read(timeout)

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            with contextlib.suppress(OSError, ValueError):
                self.proc.stdin.write(b"quit\n")
                self.proc.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(20)
        kill_group(self.proc)


def answer(value: dict[str, Any]) -> None:
    """Worker side of :class:`LineWorker`: one JSON line on stdout."""
    sys.stdout.write(json.dumps(value) + "\n")
    sys.stdout.flush()
