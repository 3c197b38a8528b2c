"""The functions of ``time``, ``os``, ``select`` and ``subprocess`` this package calls in
test processes, bound when the package is first imported.

A test may replace ``time.sleep``, ``time.time``, ``os.kill`` or ``subprocess.Popen``
with a mock (to test retry delays, say), and the plugin still works inside that test and
inside a pytest session the test runs: stopping a watchdog, ending a leftover process,
delivering an interrupt. Modules imported late (the process-tree code, which loads
psutil only where a leak is looked at) take these references from here, bound before
any test ran.
"""

from __future__ import annotations

import os
import select as _select_module
import subprocess
import time

sleep = time.sleep
now = time.time
monotonic = time.monotonic
kill = os.kill
select = _select_module.select
Popen = subprocess.Popen
PIPE = subprocess.PIPE
# Starting and reaping the watchdog (plugin/launcher.py): no Popen object is left to
# warn that its process still runs when pytest exits without waiting for it.
posix_spawn = getattr(os, "posix_spawn", None)
waitpid = os.waitpid
waitid = getattr(os, "waitid", None)
pidfd_open = getattr(os, "pidfd_open", None)
