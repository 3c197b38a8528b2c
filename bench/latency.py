"""Benchmark 3: how late an expiry is noticed.

Soft: a fresh process attached to its own watchdog enters ``expires(0.02)`` over a busy
Python loop (and, separately, over ``time.sleep``); the sample is ``time.monotonic()``
in the ``except ScopeExpired`` minus the scope's ``deadline``. The same is measured
without a watchdog (the in-process sentinel) for comparison.

In a pytest session: the same busy-loop samples taken inside a test of a real session
(``pytest -p elastic_timer``, the plugin's watchdog), once plain and once after the test
started one Python child process (as a test that spawns a rank does).

Hard: a child process attached to the watchdog (grace 1 s) enters ``expires(0.3)`` and
then runs ``sum(range(10**11))``, a C loop that holds the GIL, so no Python signal
handler can run; the sample is when the parent's ``waitpid`` sees the child die, minus
the scope's deadline plus the grace.
"""

from __future__ import annotations

import json
import math
import os
import select
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common

BUDGET = 0.02
HARD_BUDGET = 0.3
GRACE = 1.0

CHILD = f"""
import sys, pytest_elastic_timer as et
scope = et.expires({HARD_BUDGET}, scope="c-loop")
scope.__enter__()
print(repr(scope.deadline), flush=True)
sum(range(10**11))
print("survived", flush=True)
"""


SESSION_TEST = """
import json, os, subprocess, sys, time
import pytest_elastic_timer as et

def test_latency():
    child = None
    if os.environ["BENCH_CHILD"] == "1":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        time.sleep(1.0)  # started, and its startup hooks ran
    late, missed = [], []
    try:
        for _ in range(int(os.environ["BENCH_SAMPLES"])):
            scope = et.expires(__BUDGET__)
            try:
                with scope:
                    limit = time.monotonic() + 2.0
                    while time.monotonic() < limit:
                        pass
                missed.append(
                    {
                        "delivered": scope._delivered,
                        "expired": scope.expired(),
                        "budget": scope.budget,
                    }
                )
            except et.ScopeExpired:
                late.append(time.monotonic() - scope.deadline)
            time.sleep(0.002)
    finally:
        if child is not None:
            child.kill()
            child.wait()
    with open(os.environ["BENCH_OUT"], "w") as f:
        json.dump({"late": late, "missed": missed}, f)
""".replace("__BUDGET__", repr(BUDGET))


def _summary(late: list[float], missed: int) -> dict[str, Any]:
    ms = [x * 1e3 for x in late]
    return {
        "samples": len(ms),
        "missed": missed,
        "p50_ms": common.percentile(ms, 50),
        "p99_ms": common.percentile(ms, 99),
        "max_ms": max(ms) if ms else math.nan,
        "min_ms": min(ms) if ms else math.nan,
    }


def session_samples(child: bool, quick: bool) -> dict[str, Any]:
    """Busy-loop samples inside a test of a real pytest session."""
    import shutil
    import tempfile

    directory = tempfile.mkdtemp(prefix="bench-latency-")
    try:
        with open(os.path.join(directory, "test_latency.py"), "w") as f:
            f.write(SESSION_TEST)
        with open(os.path.join(directory, "pytest.ini"), "w") as f:
            f.write("[pytest]\n")
        out = os.path.join(directory, "out.json")
        count = (20 if quick else 50) if child else (50 if quick else 150)
        env = common.clean_env(
            PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",
            BENCH_CHILD="1" if child else "0",
            BENCH_SAMPLES=str(count),
            BENCH_OUT=out,
        )
        proc = subprocess.run(
            [
                common.PYTHON,
                "-m",
                "pytest",
                "-p",
                "elastic_timer",
                "-p",
                "no:cacheprovider",
                "-q",
                "test_latency.py",
            ],
            cwd=directory,
            env=env,
            capture_output=True,
            timeout=300,
            start_new_session=True,
        )
        try:
            with open(out) as f:
                data = json.load(f)
        except (OSError, ValueError):
            tail = proc.stdout.decode(errors="replace")[-800:]
            return {"error": f"no result (exit {proc.returncode}): {tail}"}
        summary = _summary(data["late"], len(data["missed"]))
        summary["missed_details"] = data["missed"]
        return summary
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _soft_samples(count: int, mode: str, marks: list[float]) -> dict[str, Any]:
    import pytest_elastic_timer as et

    late: list[float] = []
    handler: list[float] = []
    missed = 0
    for _ in range(count):
        scope = et.expires(BUDGET)
        marks.clear()
        try:
            with scope:
                limit = time.monotonic() + 2.0
                if mode == "busy":
                    while time.monotonic() < limit:
                        pass
                else:
                    time.sleep(2.0)
            missed += 1
        except et.ScopeExpired:
            late.append(time.monotonic() - scope.deadline)
            if marks:
                handler.append(marks[0] - scope.deadline)
        time.sleep(0.002)
    summary = _summary(late, missed)
    ms = [x * 1e3 for x in handler]
    summary["handler_p50_ms"] = common.percentile(ms, 50)
    summary["handler_p99_ms"] = common.percentile(ms, 99)
    return summary


def _mark_handler(signum: int, marks: list[float]) -> None:
    """Note when the interrupt signal's Python handler starts, then run it."""
    import signal

    original = signal.getsignal(signum)
    if not callable(original):
        return

    def marking(sig: int, frame: Any) -> None:
        marks.append(time.monotonic())
        original(sig, frame)

    signal.signal(signum, marking)


def floor_worker(quick: bool) -> None:
    """How late this machine wakes a sleeping process while another one busy-loops."""
    import selectors

    busy = subprocess.Popen([common.PYTHON, "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        late = []
        with selectors.DefaultSelector() as sel:
            for _ in range(100 if quick else 300):
                due = time.monotonic() + BUDGET
                sel.select(BUDGET)
                late.append(time.monotonic() - due)
    finally:
        busy.kill()
        busy.wait()
    common.answer(_summary(late, 0))


def soft_worker(attached: bool, quick: bool) -> None:
    common.scrub_own_env()
    from pytest_elastic_timer.plugin import launcher

    handle = launcher.start(grace=2, scale=1, report=None, session={}) if attached else None
    result: dict[str, Any] = {}
    try:
        if handle is not None:
            os.environ["PYTEST_ELASTIC_TIMER"] = handle.address
        import pytest_elastic_timer as et
        from pytest_elastic_timer.scope import scopes

        with et.expires(30):
            pass
        state = scopes.process_state()
        result["attached"] = state.sock is not None
        marks: list[float] = []
        _mark_handler(state.interrupt_sig, marks)
        busy, sleeping = (100, 40) if quick else (300, 100)
        result["busy"] = _soft_samples(busy, "busy", marks)
        result["sleep"] = _soft_samples(sleeping, "sleep", marks)
        result["attached_after"] = state.sock is not None
        state.close()
    finally:
        if handle is not None:
            handle.stop()
    common.answer(result)


def _wait_dead(pid: int, timeout: float) -> tuple[float, int] | None:
    """(monotonic time the death was observed, wait status) or None on timeout."""
    fd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:
            return None
        _, status = os.waitpid(pid, 0)
        return time.monotonic(), status
    finally:
        os.close(fd)


def hard_worker(quick: bool) -> None:
    common.scrub_own_env()
    import tempfile

    from pytest_elastic_timer.plugin import launcher

    report = tempfile.mktemp(prefix="bench-hard-", suffix=".json")
    handle = launcher.start(grace=GRACE, scale=1, report=report, session={})
    samples: list[dict[str, Any]] = []
    try:
        env = common.clean_env(PYTEST_ELASTIC_TIMER=handle.address)
        for _ in range(3 if quick else 5):
            child = subprocess.Popen(
                [common.PYTHON, "-c", CHILD], env=env, stdout=subprocess.PIPE, text=True
            )
            try:
                assert child.stdout is not None
                deadline = float(child.stdout.readline())
                seen = _wait_dead(child.pid, HARD_BUDGET + GRACE + 15)
                if seen is None:
                    samples.append({"late_ms": None, "how": "still running"})
                    continue
                when, status = seen
                child.returncode = os.waitstatus_to_exitcode(status)
                how = (
                    f"signal {-child.returncode}" if child.returncode < 0 else "exit"
                ) + f" {child.returncode}"
                samples.append({"late_ms": (when - deadline - GRACE) * 1e3, "how": how})
            finally:
                if child.returncode is None:
                    child.kill()
                    child.wait()
    finally:
        handle.stop()
    actions: dict[str, int] = {}
    try:
        with open(report) as f:
            for record in json.load(f).get("expired", []):
                action = record.get("action", "?")
                actions[action] = actions.get(action, 0) + 1
        os.unlink(report)
    except (OSError, ValueError):
        pass
    late = [s["late_ms"] for s in samples if s["late_ms"] is not None]
    common.answer(
        {
            "samples": samples,
            "grace": GRACE,
            "budget": HARD_BUDGET,
            "median_ms": common.median(late),
            "max_ms": max(late) if late else math.nan,
            "actions": actions,
        }
    )


def measure(quick: bool) -> dict[str, Any]:
    here = os.path.abspath(__file__)
    flag = ["--quick"] if quick else []
    result: dict[str, Any] = {}
    for name in ("floor", "soft-attached", "soft-sentinel", "hard"):
        worker = common.LineWorker(
            [common.PYTHON, here, *flag, "--worker", name], env=common.clean_env()
        )
        try:
            result[name] = worker.read(300)
        except (RuntimeError, TimeoutError, ValueError) as exc:
            result[name] = {"error": str(exc)}
        finally:
            worker.close()
    result["session"] = session_samples(False, quick)
    result["session-child"] = session_samples(True, quick)
    return result


def render(result: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    lines = [
        "| Expiry | samples | p50 ms | p99 ms | max ms | missed | owner's handler entered "
        "p50 / p99 ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    floor = result.get("floor", {})
    if floor.get("samples"):
        lines.append(
            f"| floor: a process's {BUDGET * 1e3:g} ms `select()` timer, late by, while "
            f"another process busy-loops | {floor['samples']} | {floor['p50_ms']:.2f} "
            f"| {floor['p99_ms']:.2f} | {floor['max_ms']:.2f} | — | — |"
        )
    for key, who in (("soft-attached", "watchdog"), ("soft-sentinel", "in-process sentinel")):
        r = result.get(key, {})
        for mode, what in (("busy", "busy Python loop"), ("sleep", "blocked in time.sleep")):
            m = r.get(mode)
            if not m:
                continue
            lines.append(
                f"| deadline → ScopeExpired in the owner, {what}, {who} "
                f"| {m['samples']} | {m['p50_ms']:.2f} | {m['p99_ms']:.2f} | {m['max_ms']:.2f} "
                f"| {m['missed']} | {common.fmt(m.get('handler_p50_ms'))} / "
                f"{common.fmt(m.get('handler_p99_ms'))} |"
            )
    for key, what in (
        ("session", "busy loop in a test of a pytest session (plugin's watchdog)"),
        ("session-child", "the same after the test started one Python child process"),
    ):
        m = result.get(key)
        if not m:
            continue
        if "error" in m:
            lines.append(
                f"| deadline → ScopeExpired, {what} | error: {m['error'][:200]} | | | | | |"
            )
            continue
        lines.append(
            f"| deadline → ScopeExpired, {what} | {m['samples']} | {m['p50_ms']:.2f} "
            f"| {m['p99_ms']:.2f} | {m['max_ms']:.2f} | {m['missed']} | n/a |"
        )
    hard = result.get("hard", {})
    late = [s["late_ms"] for s in hard.get("samples", []) if s["late_ms"] is not None]
    missed = sum(1 for s in hard.get("samples", []) if s["late_ms"] is None)
    if hard:
        lines.append(
            f"| deadline + grace ({hard['grace']:g} s) → child death seen by waitpid, "
            f"`sum(range(10**11))` holding the GIL | {len(late)} "
            f"| {common.fmt(common.median(late), 1)} | — "
            f"| {common.fmt(max(late) if late else None, 1)} "
            f"| {missed} | — |"
        )
    text = "\n".join(lines)
    for key in ("session", "session-child"):
        if result.get(key, {}).get("missed_details"):
            text += (
                f"\n\nMissed in `{key}` (the scope ended without ScopeExpired although its "
                f"deadline had passed): {result[key]['missed_details']}"
            )
    if hard:
        hows = sorted({s["how"] for s in hard.get("samples", [])})
        text += (
            f"\n\nThe C-loop children ended by: {', '.join(hows)}; watchdog records: "
            f"{hard.get('actions')}. Attached: {result.get('soft-attached', {}).get('attached')}."
        )
    soft = result.get("soft-attached", {}).get("busy", {})
    p99 = soft.get("p99_ms")
    child = result.get("session-child", {})
    checks = [
        {
            "target": "Deadline → ScopeExpired in a test that started one Python child: "
            "≤ 3 ms p50, ≤ 10 ms max",
            "measured": f"{common.fmt(child.get('p50_ms'), 2)} / "
            f"{common.fmt(child.get('max_ms'), 2)} ms",
            "ok": None
            if "p50_ms" not in child
            else child["p50_ms"] <= 3.0 and child["max_ms"] <= 10.0 and not child.get("missed"),
        },
        {
            "target": "Expiry latency (deadline → ScopeExpired) ≤ 5 ms p99",
            "measured": f"{common.fmt(p99, 2)} ms p99 (busy loop, watchdog)",
            "ok": None if p99 is None else p99 <= 5.0 and not soft.get("missed"),
        },
        {
            "target": "Deadline → hard termination ≤ grace + 50 ms",
            "measured": f"grace + {common.fmt(max(late) if late else None, 1)} ms (worst)",
            "ok": None if not hard else bool(late) and not missed and max(late) <= 50.0,
        },
    ]
    return text, checks


if __name__ == "__main__":
    args = common.script_args(__doc__ or "")
    if args.worker == "soft-attached":
        soft_worker(True, args.quick)
    elif args.worker == "soft-sentinel":
        soft_worker(False, args.quick)
    elif args.worker == "floor":
        floor_worker(args.quick)
    elif args.worker == "hard":
        hard_worker(args.quick)
    else:
        common.emit(measure(args.quick), args.json_out)
