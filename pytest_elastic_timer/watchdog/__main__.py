"""``python -m pytest_elastic_timer.watchdog``: the session's watchdog process.

pytest's control pipe is read (:mod:`.control`) before the watchdog's modules load
(:mod:`.wiring`, some 20 ms): a session that ends sooner than that is not held up by
this process, which shares its output.
"""

from __future__ import annotations

import sys

from pytest_elastic_timer.watchdog.control import StdinRelay

if __name__ == "__main__":
    relay = StdinRelay()
    from pytest_elastic_timer.watchdog.wiring import main

    sys.exit(main(relay=relay))
