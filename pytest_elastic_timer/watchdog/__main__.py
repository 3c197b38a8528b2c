"""``python -m pytest_elastic_timer.watchdog``: the session's watchdog process."""

import sys

from pytest_elastic_timer.watchdog.server import main

if __name__ == "__main__":
    sys.exit(main())
