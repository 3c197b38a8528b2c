"""README's first command: the demo runs its own suite with its own configuration,
catches every hang, names the rank missing at a barrier, and prints no warning."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import top_level_environment

DEMO = Path(__file__).parent.parent / "examples" / "demo.py"


@pytest.mark.expires(240)
def test_the_demo_catches_every_hang_and_prints_no_warning(tmp_path: Path) -> None:
    # From another directory, as README runs it: nothing of this project's configuration
    # (its pytest settings name options of plugins the demo does not load) may reach it.
    with top_level_environment():
        done = subprocess.run(
            [sys.executable, str(DEMO)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=200,
        )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    # No warning of any category, nor a logged WARNING (the tracebacks of the failed demo
    # tests may quote source lines such as "log.warning(...)").
    assert not re.search(r"\w*Warning:|^WARNING ", out, re.M), out
    assert "configfile: pytest.ini" in out, out
    assert "NOT caught" not in out
    # Ranks 0 and 1 each report the barrier's timeout, naming rank 2 as missing.
    assert out.count("caught: 'barrier:step' in test_ranks.py::") == 2, out
    assert len(re.findall(r"^ +missing: rank 2 \(pid ", out, re.M)) == 2, out
