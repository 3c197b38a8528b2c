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
from pytest_elastic_timer import scopes

def say(**fields):
    sys.stdout.write(json.dumps(fields) + "\\n")
    sys.stdout.flush()

def in_thread(fn):
    t = threading.Thread(target=fn)
    t.start()
    t.join()

with et.expires(30):
    pass
say(attached=scopes.process_state().sock is not None)
n, count, probe = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
sys.stdin.readline()  # go
expires = et.expires
start = time.perf_counter()
for _ in range(n):
    with expires(30):
        pass
say(scopes=n, seconds=time.perf_counter() - start)

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
acquire_seconds = time.perf_counter() - start
short = et.TimerRequest(0.3).acquire()  # earlier than promised: the watchdog wakes at 0.3 s
time.sleep(0.1)
short.release()
time.sleep(0.4)  # the watchdog's scan at the deadline has read all slots
say(held=len(held), acquire_seconds=acquire_seconds, depth_us=[b * 1e6 for b in batches],
    open_slots=sum(1 for _ in scopes.process_state().table.open_slots()),
    attached=scopes.process_state().sock is not None)
sys.stdin.readline()  # exit with every scope still open
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
    from pytest_elastic_timer import launcher

    idle_seconds = 2.0 if quick else 5.0
    burst = 50_000 if quick else 300_000
    handle = launcher.start(grace=2, scale=1, report=None, session={})
    children: list[subprocess.Popen[str]] = []
    result: dict[str, Any] = {"idle_seconds": idle_seconds, "processes": PROCESSES}
    try:
        dog = psutil.Process(handle.pid)
        os.environ["PYTEST_ELASTIC_TIMER"] = handle.address
        import pytest_elastic_timer as et
        from pytest_elastic_timer import scopes

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
                    text=True,
                )
            )
        hello = [_read(c) for c in children]
        result["children_attached"] = all(h.get("attached") for h in hello)
        before = _usage(dog)
        for c in children:
            assert c.stdin is not None
            c.stdin.write("go\n")
            c.stdin.flush()
        runs = [_read(c) for c in children]
        during = _usage(dog)
        longest = max(r["seconds"] for r in runs)
        result["throughput"] = {
            "scopes": sum(r["scopes"] for r in runs),
            "seconds": longest,
            "per_second": sum(r["scopes"] for r in runs) / longest,
            "per_process_us": [r["seconds"] / r["scopes"] * 1e6 for r in runs],
            "watchdog": _delta(before, during),
        }
        held = [_read(c, 120) for c in children]
        loaded = _usage(dog)
        result["held"] = {
            "scopes": sum(h["held"] for h in held),
            "open_slots": sum(h["open_slots"] for h in held),
            "acquire_us": sum(h["acquire_seconds"] for h in held)
            / sum(h["held"] for h in held)
            * 1e6,
            "attached": all(h["attached"] for h in held),
            "depth_us": held[0].get("depth_us", []),
            "rss": loaded["rss"],
            "uss": loaded["uss"],
            "watchdog_while_filling": _delta(during, loaded),
        }
        time.sleep(idle_seconds)
        rested = _usage(dog)
        result["held"]["idle"] = _delta(loaded, rested)
        result["held"]["rss_rested"], result["held"]["uss_rested"] = rested["rss"], rested["uss"]
        for c in children:
            assert c.stdin is not None
            c.stdin.write("exit\n")
            c.stdin.flush()
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


def _read(child: subprocess.Popen[str], timeout: float = 120) -> dict[str, Any]:
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
    lines = [
        "| Watchdog | CPU | wake-ups / s | RSS | USS |",
        "| --- | ---: | ---: | ---: | ---: |",
        f"| idle {idle['seconds']:.1f} s, one client with a 60 s scope open "
        f"| {idle['cpu_seconds'] * 1e3:.1f} ms ({idle['cpu_percent']:.2f} % of a core) "
        f"| {idle['wakeups_per_s']:.1f} | {_mib(result['rss_start'])} "
        f"| {_mib(result['uss_start'])} |",
        f"| {result['processes']} processes x {thr['scopes'] // result['processes']:,} scopes "
        f"as fast as they can ({thr['per_second'] / 1e3:,.0f} k scopes/s in total, "
        f"{', '.join(f'{u:.2f}' for u in thr['per_process_us'])} µs / scope each) "
        f"| {thr['watchdog']['cpu_seconds'] * 1e3:.1f} ms "
        f"| {thr['watchdog']['wakeups_per_s']:.1f} | | |",
        f"| {held['scopes']:,} open scopes in {result['processes']} processes (100 threads "
        f"each, so nested 250 deep), every table scanned once "
        f"({held['acquire_us']:.2f} µs / acquire) "
        f"| {held['watchdog_while_filling']['cpu_seconds'] * 1e3:.1f} ms "
        f"| {held['watchdog_while_filling']['wakeups_per_s']:.1f} "
        f"| {_mib(held['rss'])} | {_mib(held['uss'])} |",
        f"| the same {held['idle']['seconds']:.1f} s later, all still open "
        f"| {held['idle']['cpu_seconds'] * 1e3:.1f} ms ({held['idle']['cpu_percent']:.2f} %) "
        f"| {held['idle']['wakeups_per_s']:.1f} | {_mib(held['rss_rested'])} "
        f"| {_mib(held['uss_rested'])} |",
        f"| after those processes exited | | | {_mib(result['rss_after_exit'])} "
        f"| {_mib(result['uss_after_exit'])} |",
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
        "tables the watchdog has read (they are shared with their owners); USS is the "
        "watchdog's private memory."
    )
    growth = held["uss_rested"] - result["uss_start"]
    checks = [
        {
            "target": "Watchdog CPU near zero when idle (no busy polling)",
            "measured": f"{idle['cpu_percent']:.2f} % of a core, "
            f"{idle['wakeups_per_s']:.1f} wake-ups/s; "
            f"{held['idle']['cpu_percent']:.2f} % with {held['scopes']:,} scopes open",
            "ok": idle["cpu_percent"] < 0.5 and held["idle"]["cpu_percent"] < 0.5,
        },
        {
            "target": "Watchdog memory flat with 100,000 open scopes",
            "measured": f"USS {_mib(result['uss_start'])} → {_mib(held['uss_rested'])} "
            f"({growth / 1024 / 1024:+.1f} MiB)",
            "ok": growth < 16 * 1024 * 1024,
        },
    ]
    return text, checks


if __name__ == "__main__":
    args = common.script_args(__doc__ or "")
    common.emit(measure(args.quick), args.json_out)
