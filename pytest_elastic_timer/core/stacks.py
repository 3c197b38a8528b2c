"""Stacks as terminals show them: the frames of pytest and its plugins that lead to the
test's own code are left out, as pytest leaves them out of a test's traceback.

A record keeps its stack whole (the JSON report, the JUnit file); :func:`trim_stack`
makes the text a terminal shows. It reads both kinds of stack a record holds:
faulthandler's dumps (``File "x.py", line 3 in f``, most recent call first, a block per
thread) and Python's tracebacks (``File "x.py", line 3, in f`` with its source lines,
most recent call last). Only the outer end of each block is cut: from the outermost
frame inwards, the frames up to the runner's (pytest, pluggy, xdist, execnet, this
package, the import system) and the runner's are hidden, up to the first other frame,
the test's; every frame from there inwards stays, whoever's it is. A block without
such a frame (a thread of the runner's own) stays whole. This module imports nothing from pytest.
"""

from __future__ import annotations

import os
import re
import sys

# Packages whose frames lead to the test (the tool, not the code under test).
RUNNER_PACKAGES = ("_pytest", "pytest", "pluggy", "xdist", "execnet", "pytest_elastic_timer")
# Python's own frames on the way to pytest's main and to a test module's body.
_LAUNCHERS = (
    "<frozen runpy>",
    "<frozen importlib._bootstrap>",
    "<frozen importlib._bootstrap_external>",
)
_LAUNCHER_FILES = (
    os.sep + "runpy.py",
    os.sep + os.path.join("importlib", "_bootstrap.py"),
    os.sep + os.path.join("importlib", "_bootstrap_external.py"),
)
_SCRIPTS = ("pytest", "py.test")  # the console scripts that start pytest
# This package's frames that run inside the code under test, not around it: the
# collectives recorder's wrapper of a torch.distributed op, called by the test's code.
_INSIDE_THE_TEST = (os.sep + os.path.join("pytest_elastic_timer", "scope", "collectives.py"),)

_FRAME = re.compile(r'^(?P<indent>\s*)File "(?P<file>.*)", line \d+(?P<comma>,?) in ')
_OUTER = re.compile(r"^\s*\.\.\. (\d+) outer frames$")  # what the watchdog's dump cut off
HINT = "--full-trace shows them"


def _runner_dirs() -> tuple[str, ...]:
    """Where the runner's packages were imported from in this process (an editable
    install of this package lies outside site-packages)."""
    dirs = []
    for name in RUNNER_PACKAGES:
        file = getattr(sys.modules.get(name), "__file__", None)
        if file:
            dirs.append(os.path.dirname(os.path.abspath(file)) + os.sep)
    return tuple(dirs)


_RUNNER_DIRS: tuple[str, ...] | None = None
_INSTALLED = tuple(
    os.sep + os.path.join(site, name) + os.sep
    for site in ("site-packages", "dist-packages")
    for name in RUNNER_PACKAGES
)
# The runner's packages that xdist's --rsyncdir copies next to the tests of another
# host, where their frames are neither installed nor imported in this process.
_COPIED_PACKAGES = ("_pytest", "pluggy", "xdist", "execnet")
_COPIED_FILES: tuple[str, ...] | None = None


def _copied_files() -> tuple[str, ...]:
    """Each module file of :data:`_COPIED_PACKAGES` as its path below the package's
    parent (``/_pytest/runner.py``): a copy of it is one of these files wherever it lies.
    Whole module paths, not folder names: a project's own ``tests/xdist/`` is its own."""
    found: list[str] = []
    for name in _COPIED_PACKAGES:
        file = getattr(sys.modules.get(name), "__file__", None)
        if not file:
            continue
        package = os.path.dirname(os.path.abspath(file))
        parent = os.path.dirname(package)
        for directory, _, names in os.walk(package):
            found.extend(
                os.sep + os.path.relpath(os.path.join(directory, n), parent)
                for n in names
                if n.endswith(".py")
            )
    return tuple(found)


def is_runner_frame(file: str) -> bool:
    """Whether a frame in ``file`` belongs to what runs the test, not to the test."""
    global _RUNNER_DIRS, _COPIED_FILES
    if file.endswith(_INSIDE_THE_TEST):
        return False
    if file in _LAUNCHERS or file.endswith(_LAUNCHER_FILES):
        return True
    if os.path.basename(file) in _SCRIPTS:
        return True
    if any(part in file for part in _INSTALLED):
        return True
    if _RUNNER_DIRS is None:
        _RUNNER_DIRS = _runner_dirs()
    if file.startswith(_RUNNER_DIRS):
        return True
    if _COPIED_FILES is None:
        _COPIED_FILES = _copied_files()
    return file.endswith(_COPIED_FILES)


def _test_frame(files: list[str]) -> int:
    """The index of the first frame inside the runner's frames (the test's), counting
    from the outermost; 0 when there is none. Frames outside the runner's before its
    first (the bootstrap of an xdist worker, a script calling ``pytest.main``) are part
    of the way to the test too."""
    runner = [is_runner_frame(file) for file in files]
    start = next((n for n, inside in enumerate(runner) if inside), None)
    if start is None:
        return 0
    return next((n for n in range(start, len(files)) if not runner[n]), 0)


def trim_stack(text: str, hint: str = HINT) -> str:
    """``text`` with the runner's frames at the outer end of each stack left out, and a
    line that says how many there were and, in ``hint``, where to see them."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        match = _FRAME.match(lines[i])
        if match is None:
            out.append(lines[i])
            i += 1
            continue
        indent = match["indent"]
        recent_first = not match["comma"]  # faulthandler's dump
        frames: list[list[str]] = []
        files: list[str] = []
        while i < len(lines):
            match = _FRAME.match(lines[i])
            if match is not None and match["indent"] == indent:
                frames.append([lines[i]])
                files.append(match["file"])
            elif match is None and not recent_first and lines[i].startswith(indent + " "):
                frames[-1].append(lines[i])  # the frame's source line (and its carets)
            else:
                break
            i += 1
        if recent_first:
            frames.reverse()
            files.reverse()
        # frames and files run from the outermost frame inwards now.
        cut = hidden = _test_frame(files)
        if cut and recent_first and i < len(lines):
            outer = _OUTER.match(lines[i])
            if outer is not None:  # frames further out, which the dump left out
                hidden += int(outer[1])
                i += 1
        kept = frames[cut:]
        note = [f"{indent}... {hidden} outer frames of pytest and its plugins ({hint})"]
        if recent_first:
            kept.reverse()
            out.extend(line for frame in kept for line in frame)
            out.extend(note if hidden else [])
        else:
            out.extend(note if hidden else [])
            out.extend(line for frame in kept for line in frame)
    trimmed = "\n".join(out)
    return trimmed + "\n" if text.endswith("\n") and out else trimmed
