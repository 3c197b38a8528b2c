"""Load: many processes entering nested scopes at a steady rate, some expiring on purpose.

    python bench/load.py [--workers 16] [--rate 1000] [--depth 8] [--duration 60]
                         [--quick] [--json-out PATH]

One watchdog (started as the plugin starts it, this process as the session's root) and
``--workers`` processes attached to it. Each enters ``--rate`` scopes per second, as
nests ``--depth`` deep (budgets of 30 s: they end in time), for ``--duration`` seconds
(``--quick``: 10 s). Every ``--expire-every`` seconds each worker instead opens the same
nest whose innermost scope has a budget of ``--budget`` seconds and sleeps for 2 s in
it, so that scope expires at a known deadline. Measured:

- lost expiries (no ``ScopeExpired`` within 1.9 s of the deadline, or none at all) and
  late ones (over 100 ms), with the latency distribution from the deadline to the
  moment ``ScopeExpired`` reached the worker (``time.monotonic()`` is one clock for
  every process of the machine);
- that the JSON report has a record for every expiry the workers saw;
- the watchdog's RSS over time (sampled each second: flat or growing?); the watchdog
  keeps every expiry record for the JSON report, so it grows by the size of a record
  (a few KiB, mostly the stack) per expiry, and not at all with scopes that end in time
  (``--expire-every 1e9``: no expiries);
- the watchdog's CPU share (``psutil`` ``cpu_times``, user + system, over the run);
- scopes per second entered and left by all workers together.

Prints a Markdown table. Not a test: nothing here passes or fails a build. It follows
the protocol of ``bench/run.py`` (``--quick``, ``--json-out``, :func:`render`).
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common

LATE = 0.100  # an expiry delivered later than this after its deadline is late
LOST = 1.9  # ... and this late (the sleep inside the scope is 2 s) it was never delivered
SLEEP_IN_EXPIRING = 2.0

WORKER = (
    """
import json, os, sys, time
import pytest_elastic_timer as et
from pytest_elastic_timer.scope import scopes

rate, depth, duration, every, budget, offset = map(float, sys.argv[1:7])
depth = int(depth)
attached = scopes.process_state().sock is not None
print(json.dumps({"attached": attached, "pid": os.getpid()}), flush=True)
start = float(sys.stdin.readline())  # the same start for every worker
while time.monotonic() < start:
    time.sleep(start - time.monotonic())
expires, monotonic = et.expires, time.monotonic
end = start + duration
period = depth / rate  # one nest every period: `rate` scopes a second
scopes_done = nests = 0
latencies = []
next_expiry = start + offset
next_nest = start

def nest(level):
    if level:
        with expires(30):
            nest(level - 1)

current = []

def expiring(level):
    if level > 1:
        with expires(30):
            return expiring(level - 1)
    inner = expires(budget, scope="on-purpose")
    current[:] = [inner]
    with inner:
        time.sleep("""
    + repr(SLEEP_IN_EXPIRING)
    + """)

while True:
    now = monotonic()
    if now >= end:
        break
    if now >= next_expiry:
        next_expiry += every
        try:
            expiring(depth)
        except et.ScopeExpired:
            latencies.append(monotonic() - current[0].deadline)
        scopes_done += depth
        continue
    nest(depth)
    scopes_done += depth
    nests += 1
    next_nest += period
    pause = next_nest - monotonic()
    if pause > 0:
        time.sleep(pause)
    elif pause < -1.0:
        next_nest = monotonic()  # hopelessly behind: do not try to catch up in a burst
print(json.dumps({
    "scopes": scopes_done, "nests": nests, "latencies": latencies,
    "seconds": monotonic() - start,
}), flush=True)
"""
)


def _read(proc: subprocess.Popen[bytes], timeout: float) -> dict[str, Any]:
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise TimeoutError(f"worker {proc.pid} said nothing in {timeout:.0f}s")
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"worker {proc.pid} exited (code {proc.poll()})")
    value: dict[str, Any] = json.loads(line)
    return value


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import psutil

    common.scrub_own_env()
    from pytest_elastic_timer.plugin import launcher

    report = os.path.join(tempfile.mkdtemp(prefix="pet-load-"), "report.json")
    handle = launcher.start(grace=0.5, scale=1.0, report=report, session={})
    dog = psutil.Process(handle.pid)
    env = common.clean_env(PYTEST_ELASTIC_TIMER=handle.address)
    workers: list[subprocess.Popen[bytes]] = []
    samples: list[tuple[float, int, float]] = []  # (seconds since start, rss, cpu seconds)
    try:
        for i in range(args.workers):
            offset = args.expire_every * (i + 1) / (args.workers + 1)  # staggered
            argv = [common.PYTHON, "-c", WORKER]
            argv += [str(v) for v in (args.rate, args.depth, args.duration, args.expire_every)]
            argv += [str(args.budget), str(offset)]
            workers.append(
                subprocess.Popen(
                    argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0
                )
            )
        hello = [_read(w, 120) for w in workers]
        start = time.monotonic() + 1.0
        for w in workers:
            assert w.stdin is not None
            w.stdin.write(f"{start}\n".encode())
        cpu0 = dog.cpu_times()
        while time.monotonic() < start:
            time.sleep(0.01)
        cpu_start = cpu0.user + cpu0.system
        wall_start = time.monotonic()
        while time.monotonic() < start + args.duration + 0.5:
            cpu = dog.cpu_times()
            samples.append(
                (time.monotonic() - start, dog.memory_info().rss, cpu.user + cpu.system - cpu_start)
            )
            time.sleep(1.0)
        runs = [_read(w, SLEEP_IN_EXPIRING + 120) for w in workers]
        cpu1 = dog.cpu_times()
        wall = time.monotonic() - wall_start
        watchdog_cpu = cpu1.user + cpu1.system - cpu_start
        for w in workers:
            w.wait(30)
        handle.stop({"exitstatus": 0})
        with open(report) as f:
            records = json.load(f)["expired"]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
        if handle.alive():
            handle.proc.kill()
    latencies = [lat for r in runs for lat in r["latencies"]]
    expected = sum(len(_expiry_times(args, i)) for i in range(args.workers))
    scopes = sum(r["scopes"] for r in runs)
    rss = [s[1] for s in samples]
    third = max(len(rss) // 3, 1)
    return {
        "workers": args.workers,
        "attached": sum(1 for h in hello if h["attached"]),
        "rate": args.rate,
        "depth": args.depth,
        "duration": args.duration,
        "budget": args.budget,
        "expire_every": args.expire_every,
        "scopes": scopes,
        "scopes_per_s": scopes / max(max(r["seconds"] for r in runs), 1e-9),
        "target_per_s": args.rate * args.workers,
        "expiries_scheduled": expected,
        "expiries_seen": len(latencies),
        "records": sum(1 for r in records if r["scope"].endswith("on-purpose")),
        "lost": sum(1 for lat in latencies if lat >= LOST) + max(expected - len(latencies), 0),
        "late": sum(1 for lat in latencies if LATE < lat < LOST),
        "latency_ms": {
            "p50": common.percentile(latencies, 50) * 1e3,
            "p90": common.percentile(latencies, 90) * 1e3,
            "p99": common.percentile(latencies, 99) * 1e3,
            "max": max(latencies, default=float("nan")) * 1e3,
            "min": min(latencies, default=float("nan")) * 1e3,
        },
        "rss_mib": {
            "first": rss[0] / 2**20 if rss else float("nan"),
            "max": max(rss, default=0) / 2**20,
            "last": rss[-1] / 2**20 if rss else float("nan"),
            "first_third_mean": sum(rss[:third]) / third / 2**20 if rss else float("nan"),
            "last_third_mean": sum(rss[-third:]) / third / 2**20 if rss else float("nan"),
        },
        "rss_samples": [(round(t, 1), round(r / 2**20, 2)) for t, r, _ in samples],
        "watchdog_cpu_seconds": watchdog_cpu,
        "watchdog_cpu_percent_of_one_core": watchdog_cpu / wall * 100,
        "watchdog_cpu_percent_of_machine": watchdog_cpu / wall / (os.cpu_count() or 1) * 100,
        "wall_seconds": wall,
        "load_average": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def _expiry_times(args: argparse.Namespace, i: int) -> list[float]:
    """When worker ``i`` starts an expiring nest (seconds after the start), at most."""
    offset = args.expire_every * (i + 1) / (args.workers + 1)
    times, t = [], offset
    while t < args.duration:
        times.append(t)
        t += args.expire_every
    return times


def render(result: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    lat, rss = result["latency_ms"], result["rss_mib"]
    growth = rss["last_third_mean"] - rss["first_third_mean"]
    # Records are kept for the JSON report: memory grows with expiries, not with scopes.
    grown = (rss["last"] - rss["first"]) * 1024
    seen = result["expiries_seen"]
    per_record = f"{grown / seen:.1f} KiB" if seen else "n/a (no expiries)"
    rows = [
        ("workers attached to the watchdog", f"{result['attached']} of {result['workers']}"),
        (
            "scopes entered and left, all workers",
            f"{result['scopes']:,} ({result['scopes_per_s']:,.0f}/s; target "
            f"{result['target_per_s']:,.0f}/s, nests {result['depth']} deep)",
        ),
        (
            "expiries on purpose: scheduled (at most) / delivered / in the JSON report",
            f"{result['expiries_scheduled']} / {result['expiries_seen']} / {result['records']}",
        ),
        ("lost expiries (none within 1.9 s)", str(result["lost"])),
        (f"late expiries (> {LATE * 1e3:.0f} ms)", str(result["late"])),
        (
            "deadline → ScopeExpired in the worker, p50 / p90 / p99 / max",
            f"{lat['p50']:.1f} / {lat['p90']:.1f} / {lat['p99']:.1f} / {lat['max']:.1f} ms",
        ),
        (
            "watchdog RSS: first / max / last sample",
            f"{rss['first']:.1f} / {rss['max']:.1f} / {rss['last']:.1f} MiB",
        ),
        ("watchdog RSS: last third minus first third (mean)", f"{growth:+.2f} MiB"),
        ("watchdog RSS growth per expiry record", per_record),
        (
            "watchdog CPU (user + system) over the run",
            f"{result['watchdog_cpu_seconds']:.2f} s = "
            f"{result['watchdog_cpu_percent_of_one_core']:.1f} % of one core "
            f"({result['watchdog_cpu_percent_of_machine']:.1f} % of the machine)",
        ),
        ("run", f"{result['wall_seconds']:.0f} s, load average {result['load_average']}"),
    ]
    table = "| Load | Measured |\n| --- | --- |\n" + "\n".join(f"| {a} | {b} |" for a, b in rows)
    checks = [
        {
            "target": "no lost expiry under load",
            "measured": f"{result['lost']} lost of {result['expiries_seen']}",
            "ok": result["lost"] == 0,
        },
        {
            "target": "every expiry in the JSON report",
            "measured": f"{result['records']} records for {result['expiries_seen']} expiries",
            "ok": result["records"] >= result["expiries_seen"],
        },
        {
            "target": "watchdog memory flat under load (only records grow it: < 4 KiB each)",
            "measured": f"{growth:+.2f} MiB over the run, {per_record} per record",
            "ok": grown <= 4.0 * max(seen, 1) + 512,
        },
    ]
    return table, checks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--rate", type=float, default=1000.0, help="scopes per second per worker")
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--duration", type=float, default=None, help="seconds (default 60)")
    parser.add_argument("--expire-every", type=float, default=1.0, help="seconds per worker")
    parser.add_argument("--budget", type=float, default=0.05, help="budget of expiring scopes")
    parser.add_argument("--quick", action="store_true", help="10 s instead of 60 s")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    if args.duration is None:
        args.duration = 10.0 if args.quick else 60.0
    result = measure(args)
    if args.json_out:
        common.emit(result, args.json_out)
    print(render(result)[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
