"""Benchmark 4: the watchdog at rest and under load.

- Idle CPU: the watchdog's CPU time (psutil ``cpu_times``) and wake-ups (voluntary
  context switches) over a few seconds while a client is connected and has a 60 s scope
  open.
- Throughput: 4 processes attached to the same watchdog enter and leave scopes as fast
  as they can at the same time; scopes per second in total, and the watchdog's CPU time
  meanwhile.
- Memory: the watchdog's RSS and USS before and after the same 4 processes hold 100,000
  open scopes (``TimerRequest(600).acquire()`` without release, from 100 threads per
  process, since acquires in one thread nest), after the watchdog
  has scanned every table once (each process enters and leaves a 0.3 s scope, which
  makes the watchdog wake and read all of that process's slots), again after a few
  idle seconds with all of them open (CPU too), and after the processes exit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common

PROCESSES = 4
OPEN_SCOPES = 100_000

CHILD = """
import json, sys, threading, time
import pytest_elastic_timer as et
from pytest_elastic_timer.scope import scopes

def say(**fields):
    sys.stdout.write(json.dumps(fields) + "\\n")
    sys.stdout.flush()

def in_thread(fn):
    t = threading.Thread(target=fn)
    t.start()
    t.join()

def wake_watchdog(after, hold):
    # A deadline earlier than the one promised: the watchdog wakes then and reads
    # every slot of this table; the scope itself ends in time.
    short = et.TimerRequest(after).acquire()
    time.sleep(hold)
    short.release()

with et.expires(30):
    pass
say(attached=scopes.process_state().sock is not None)
n, count, probe = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
expires = et.expires
while True:
    command = sys.stdin.readline().strip()
    start = time.perf_counter()
    for _ in range(n):
        with expires(30):
            pass
    say(scopes=n, seconds=time.perf_counter() - start)
    if command == "go":
        break

batches = []
def nest():  # acquire() without release nests: the cost of one at growing depth
    mine = []
    for _ in range(probe // 1000):
        t = time.perf_counter()
        for _ in range(1000):
            mine.append(et.TimerRequest(600).acquire())
        batches.append((time.perf_counter() - t) / 1000)
    for scope in reversed(mine):
        scope.release()
if probe:
    in_thread(nest)

held = []
THREADS = 100  # spread over threads: nesting depth count / THREADS
def hold():
    for _ in range(count // THREADS):
        held.append(et.TimerRequest(600).acquire())
start = time.perf_counter()
for _ in range(THREADS):
    in_thread(hold)
say(held=len(held), acquire_seconds=time.perf_counter() - start,
    depth_us=[b * 1e6 for b in batches],
    open_slots=sum(1 for _ in scopes.process_state().table.open_slots()))
sys.stdin.readline()  # scan
wake_watchdog(0.3, 0.1)
time.sleep(0.4)  # past the wake at 0.3 s and the watchdog's second look 50 ms later
say(attached=scopes.process_state().sock is not None)
while sys.stdin.readline().strip() == "rescan":
    wake_watchdog(0.05, 0.01)
    time.sleep(0.3)
    say(rescanned=True)
# exit with every scope still open
"""


def _usage(proc: Any) -> dict[str, float]:
    cpu = proc.cpu_times()
    ctx = proc.num_ctx_switches()
    mem = proc.memory_full_info()
    return {
        "cpu": cpu.user + cpu.system,
        "wakeups": ctx.voluntary,
        "rss": mem.rss,
        "uss": mem.uss,
        "time": time.monotonic(),
    }


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    seconds = after["time"] - before["time"]
    return {
        "seconds": seconds,
        "cpu_seconds": after["cpu"] - before["cpu"],
        "cpu_percent": (after["cpu"] - before["cpu"]) / seconds * 100,
        "wakeups_per_s": (after["wakeups"] - before["wakeups"]) / seconds,
    }


def measure(quick: bool) -> dict[str, Any]:
    import psutil

    common.scrub_own_env()
    from pytest_elastic_timer.plugin import launcher

    idle_seconds = 2.0 if quick else 5.0
    burst = 50_000 if quick else 300_000
    handle = launcher.start(grace=2, scale=1, report=None, session={})
    children: list[subprocess.Popen[bytes]] = []
    result: dict[str, Any] = {"idle_seconds": idle_seconds, "processes": PROCESSES}
    try:
        dog = psutil.Process(handle.pid)
        os.environ["PYTEST_ELASTIC_TIMER"] = handle.address
        import pytest_elastic_timer as et
        from pytest_elastic_timer.scope import scopes

        scope = et.TimerRequest(60, scope="idle").acquire()
        result["attached"] = scopes.process_state().sock is not None
        time.sleep(0.5)  # past the watchdog's post-wake recheck
        start = _usage(dog)
        time.sleep(idle_seconds)
        result["idle"] = _delta(start, _usage(dog))
        scope.release()
        result["rss_start"], result["uss_start"] = start["rss"], start["uss"]

        env = common.clean_env(PYTEST_ELASTIC_TIMER=handle.address)
        per = OPEN_SCOPES // PROCESSES
        probe = 2000 if quick else 5000
        for i in range(PROCESSES):
            children.append(
                subprocess.Popen(
                    [common.PYTHON, "-c", CHILD, str(burst), str(per), str(probe if i == 0 else 0)],
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    bufsize=0,  # unbuffered: a line read never takes the next one with it
                )
            )
        hello = [_read(c) for c in children]
        result["children_attached"] = all(h.get("attached") for h in hello)
        solo = _ask(children[0], "solo")
        before = _usage(dog)
        for c in children:
            _send(c, "go")
        runs = [_read(c) for c in children]
        during = _usage(dog)
        longest = max(r["seconds"] for r in runs)
        result["throughput"] = {
            "scopes": sum(r["scopes"] for r in runs),
            "seconds": longest,
            "per_second": sum(r["scopes"] for r in runs) / longest,
            "per_process_us": [r["seconds"] / r["scopes"] * 1e6 for r in runs],
            "solo_us": solo["seconds"] / solo["scopes"] * 1e6,
            "watchdog": _delta(before, during),
        }
        held = [_read(c, 300) for c in children]
        time.sleep(0.5)
        filled = _usage(dog)
        for c in children:
            _send(c, "scan")
        scanned = [_read(c, 60) for c in children]
        time.sleep(1.5)  # every scan (about 3 µs per open slot) is over
        after_scan = _usage(dog)
        time.sleep(idle_seconds)
        rested = _usage(dog)
        _ask(children[0], "rescan")
        time.sleep(0.2)
        rescanned = _usage(dog)
        result["held"] = {
            "scopes": sum(h["held"] for h in held),
            "open_slots": sum(h["open_slots"] for h in held),
            "acquire_us": sum(h["acquire_seconds"] for h in held)
            / sum(h["held"] for h in held)
            * 1e6,
            "attached": all(s.get("attached") for s in scanned),
            "depth_us": held[0].get("depth_us", []),
            "filled": {"rss": filled["rss"], "uss": filled["uss"]},
            "while_filling": _delta(during, filled),
            "scanned": {"rss": after_scan["rss"], "uss": after_scan["uss"]},
            "scan": _delta(filled, after_scan),
            "rested": {"rss": rested["rss"], "uss": rested["uss"]},
            "idle": _delta(after_scan, rested),
            "one_wake_cpu": rescanned["cpu"] - rested["cpu"],
        }
        for c in children:
            assert c.stdin is not None
            c.stdin.close()
            c.wait(30)
        time.sleep(0.5)
        after = _usage(dog)
        result["rss_after_exit"], result["uss_after_exit"] = after["rss"], after["uss"]
        scopes.process_state().close()
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
                c.wait()
        handle.stop()
    return result


def _send(child: subprocess.Popen[bytes], line: str) -> None:
    assert child.stdin is not None
    child.stdin.write(line.encode() + b"\n")


def _ask(child: subprocess.Popen[bytes], line: str) -> dict[str, Any]:
    _send(child, line)
    return _read(child)


def _read(child: subprocess.Popen[bytes], timeout: float = 120) -> dict[str, Any]:
    import json
    import selectors

    assert child.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(child.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise TimeoutError("a load child did not answer")
    line = child.stdout.readline()
    if not line:
        raise RuntimeError(f"a load child exited (code {child.poll()})")
    value: dict[str, Any] = json.loads(line)
    return value


def _mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 1024 / 1024:.1f} MiB"


def render(result: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    idle = result["idle"]
    thr = result["throughput"]
    held = result["held"]
    n = result["processes"]
    per = held["scopes"] // n
    lines = [
        "| Watchdog | CPU | wake-ups / s | RSS | USS |",
        "| --- | ---: | ---: | ---: | ---: |",
        f"| idle {idle['seconds']:.1f} s, one client with a 60 s scope open "
        f"| {idle['cpu_seconds'] * 1e3:.1f} ms ({idle['cpu_percent']:.2f} % of a core) "
        f"| {idle['wakeups_per_s']:.1f} | {_mib(result['rss_start'])} "
        f"| {_mib(result['uss_start'])} |",
        f"| {n} processes x {thr['scopes'] // n:,} scopes at the same time, as fast as "
        f"they can: {thr['per_second'] / 1e3:,.0f} k scopes/s in total "
        f"({', '.join(f'{u:.2f}' for u in thr['per_process_us'])} µs / scope each; "
        f"{thr['solo_us']:.2f} µs for one process alone) "
        f"| {thr['watchdog']['cpu_seconds'] * 1e3:.1f} ms "
        f"| {thr['watchdog']['wakeups_per_s']:.1f} | | |",
        f"| {held['scopes']:,} open scopes in {n} processes (100 threads each, so nested "
        f"{per // 100} deep; {held['acquire_us']:.2f} µs / acquire), not read yet "
        f"| {held['while_filling']['cpu_seconds'] * 1e3:.1f} ms "
        f"| {held['while_filling']['wakeups_per_s']:.1f} "
        f"| {_mib(held['filled']['rss'])} | {_mib(held['filled']['uss'])} |",
        f"| each table read once (one wake per process, and its second look) "
        f"| {held['scan']['cpu_seconds'] * 1e3:.1f} ms "
        f"| {held['scan']['wakeups_per_s']:.1f} "
        f"| {_mib(held['scanned']['rss'])} | {_mib(held['scanned']['uss'])} |",
        f"| idle {held['idle']['seconds']:.1f} s with all {held['scopes']:,} open "
        f"| {held['idle']['cpu_seconds'] * 1e3:.1f} ms ({held['idle']['cpu_percent']:.2f} %) "
        f"| {held['idle']['wakeups_per_s']:.1f} | {_mib(held['rested']['rss'])} "
        f"| {_mib(held['rested']['uss'])} |",
        f"| one more wake for a table with {per:,} open slots "
        f"| {held['one_wake_cpu'] * 1e3:.1f} ms | | | |",
        f"| after those processes exited (their tables stay mapped for the records) | | "
        f"| {_mib(result['rss_after_exit'])} | {_mib(result['uss_after_exit'])} |",
    ]
    text = "\n".join(lines)
    depth = held.get("depth_us") or []
    if depth:
        text += (
            "\n\nOne acquire() nested inside the ones before it (acquire without release in "
            "one thread nests) costs, per 1,000 at growing depth: "
            + ", ".join(f"{(i + 1) * 1000:,}: {us:.0f} µs" for i, us in enumerate(depth))
            + "."
        )
    text += (
        f"\n\nAll attached: {result['attached'] and result['children_attached']}; open slots "
        f"seen in the tables: {held['open_slots']:,}. RSS counts the pages of the shared "
        "tables the watchdog has read (shared with their owners); USS is the watchdog's "
        "private memory. CPU is user+system time of the watchdog process in that phase."
    )
    growth = held["rested"]["uss"] - result["uss_start"]
    checks = [
        {
            "target": "Watchdog CPU near zero when idle (no busy polling)",
            "measured": f"{idle['cpu_percent']:.2f} % of a core, "
            f"{idle['wakeups_per_s']:.1f} wake-ups/s; "
            f"{held['idle']['cpu_percent']:.2f} % with {held['scopes']:,} scopes open",
            "ok": idle["cpu_percent"] < 0.5 and held["idle"]["cpu_percent"] < 0.5,
        },
        {
            "target": "Watchdog memory flat with 100,000 open scopes (USS grows < 1 MiB)",
            "measured": f"USS {_mib(result['uss_start'])} → {_mib(held['rested']['uss'])} "
            f"({growth / 1024 / 1024:+.1f} MiB; "
            f"{(held['filled']['uss'] - result['uss_start']) / 1024 / 1024:+.1f} MiB "
            "before it read the tables)",
            "ok": growth < 1024 * 1024,
        },
    ]
    return text, checks


if __name__ == "__main__":
    args = common.script_args(__doc__ or "")
    common.emit(measure(args.quick), args.json_out)
