"""Run the demo suite and show that every hang was caught and reported.

    python examples/demo.py            # the suite under pytest-xdist (-n 2)
    python examples/demo.py --no-xdist # the same in one process

Exit status 0 when every test marked ``hangs`` expired with the scope it names and
every other test passed. The suite runs with its own ``suite/pytest.ini`` and only
this plugin and pytest-xdist loaded, whatever else the environment holds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    xdist = "--no-xdist" not in sys.argv[1:]
    report = os.path.join(tempfile.mkdtemp(prefix="elastic-timer-demo-"), "report.json")
    junit = os.path.join(os.path.dirname(report), "junit.xml")
    suite = os.path.join(HERE, "suite")
    # The suite's own configuration (suite/pytest.ini, named with -c so that no other
    # file is looked for) and only the plugins it uses: the run stays the same whatever
    # else is installed in this environment.
    argv = [
        sys.executable,
        "-m",
        "pytest",
        suite,
        "-c",
        os.path.join(suite, "pytest.ini"),
        "--rootdir",
        suite,
        "-p",
        "elastic_timer",
        "-p",
        "no:cacheprovider",
        "--elastic-timer-report",
        report,
        "--elastic-timer-grace",
        "1",
        "--junitxml",
        junit,
        "-rA",
    ]
    if xdist:
        argv += ["-p", "xdist", "-n", "2"]
    else:
        # Without xdist a C call that holds the GIL ends the whole session (the watchdog
        # still reports it), so the one-process run leaves that test out.
        argv += ["-k", "not gil_held"]
    print("$", " ".join(argv), flush=True)
    started = time.monotonic()
    subprocess.run(argv, check=False, env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    took = time.monotonic() - started
    with open(report, encoding="utf-8") as f:
        expired = json.load(f)["expired"]
    print(f"\n--- demo summary ({took:.1f}s) ---")
    for record in expired:
        who = ", ".join(x for x in (record["label"], f"pid {record['pid']}", record["worker"]) if x)
        print(
            f"caught: {record['scope']!r} in {record['nodeid'] or '?'} "
            f"after {record['elapsed']:.2f}s ({record['action']}; {who}; "
            f"{os.path.basename(record['file'])}:{record['line']})"
        )
        # A barrier's timeout names who is missing, on the first line of its record.
        first = record["stack"].splitlines()[0] if record["stack"] else ""
        if "; missing: " in first:
            print(f"        missing: {first.split('; missing: ', 1)[1]}")
    expected = _expected_hangs(xdist)
    caught = {r["scope"] for r in expired}
    missing = sorted(expected - caught)
    for scope in missing:
        print(f"NOT caught: {scope!r}")
    print(f"JSON report: {report}\nJUnit XML:   {junit}")
    return 1 if missing else 0


def _expected_hangs(xdist: bool) -> set[str]:
    expected = {
        "test_sleep_forever::call",
        "test_deadlock::call/take-both-locks",
        "barrier:step",
    }
    if xdist:
        expected.add("test_gil_held_in_c::call")
    try:
        import torch.distributed  # noqa: F401

        expected.add("allreduce")
    except ImportError:
        pass
    return expected


if __name__ == "__main__":
    sys.exit(main())
