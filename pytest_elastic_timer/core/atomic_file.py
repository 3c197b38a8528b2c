"""Files written in one step: a reader sees the old file or the whole new one.

The JSON report, the trace and the JUnit files are read by other programs (CI, a
test of the suite that waits for the report) while the session may still write them.
"""

from __future__ import annotations

import contextlib
import os
import stat

from pytest_elastic_timer.core import unpatched


def write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it and a rename,
    making the directory if need be. A write that fails (a full disk, a directory at
    ``path``) leaves no temporary file behind.

    As a plain write would: a symbolic link is followed (its target is written, the
    link stays), and what is not a regular file (``/dev/null``, a named pipe) is
    written into, never replaced by a file."""
    target = os.path.realpath(path)
    try:
        mode = os.stat(target).st_mode
    except OSError:
        mode = 0  # nothing there yet: a new file
    if mode and not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        with unpatched.open(target, "w", encoding="utf-8") as f:
            f.write(text)
        return
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = f"{target}.tmp{unpatched.getpid()}"
    try:
        with unpatched.open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
