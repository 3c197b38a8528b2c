"""``python -m pytest_elastic_timer.watchdog``: the session's watchdog process.

pytest's control pipe is read (:mod:`.control`) before the watchdog's modules load
(:mod:`.wiring`, some 20 ms): a session that ends sooner than that is not held up by
this process, which shares its output.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys

from pytest_elastic_timer.watchdog.control import StdinRelay


def close_descriptors_above_the_limit() -> None:
    """Close what this process inherited at or above its soft limit on open files:
    pytest could not have them closed as it started it (``posix_spawn`` refuses them),
    and a test's pipe must not stay open here."""
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if limit < 0:  # unlimited
        return
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            if int(name) >= limit:
                with contextlib.suppress(OSError):
                    os.close(int(name))


if __name__ == "__main__":
    close_descriptors_above_the_limit()
    relay = StdinRelay()
    from pytest_elastic_timer.watchdog.wiring import main

    sys.exit(main(relay=relay))
