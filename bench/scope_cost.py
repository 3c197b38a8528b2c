"""Benchmark 1: what one scope enter+exit costs, side by side with torch's timers.

Each variant lives in a fresh worker process of its own (a watchdog-attached process
cannot also be an unattached one); the parent runs the variants round-robin in chunks
of about the same duration, so drift of the machine hits all of them alike, and
reports the median over the chunks of the time per scope.

Variants:
- ``empty``: ``with Empty():`` on a class with empty ``__enter__``/``__exit__`` (floor)
- ``slot``: one 64-byte ``struct.pack_into`` into an mmap plus one word cleared (floor)
- ``bare``: a context manager that does only what any pure-Python scope must: build an
  object, read the clock, write and clear a slot, push and pop a stack, compare the
  deadline at exit (no call site, no name, no nesting rules, no reuse checks) (floor)
- ``ours``: ``with pytest_elastic_timer.expires(30):`` with a real watchdog attached
- ``ours_sentinel``: the same without a watchdog (in-process sentinel thread)
- ``torch_local``: torch ``expires(after=30, scope=..., client=LocalTimerClient(q))``,
  the server in another process; the time includes flushing the queue's feeder thread
- ``torch_local_stack``: the same with ``scope=None`` (torch then calls inspect.stack())
- ``torch_file``: torch ``FileTimerClient``/``FileTimerServer`` (server in another
  process, default 10 s interval); errors such as BlockingIOError are counted

Then a burst of 1,000,000 scopes with ours (fresh process, watchdog attached): no error,
no scope left open, and the watchdog still enforcing afterwards.
"""

from __future__ import annotations

import collections
import math
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common

GROUPS = {
    "floors": ["empty", "slot", "bare"],
    "ours": ["ours", "ours_construct", "ours_reuse"],
    "ours_sentinel": ["ours_sentinel"],
    "torch_local": ["torch_local", "torch_local_stack"],
    "torch_file": ["torch_file"],
}
LABELS = {
    "empty": "empty Python context manager (floor)",
    "slot": "64-byte slot write into shared memory + clear (floor)",
    "bare": "the least a pure-Python scope does: object, clock, slot, stack (floor)",
    "ours": "`pytest_elastic_timer.expires(30)`, watchdog attached",
    "ours_construct": "  of which: `expires(30)` alone (building the TimerRequest, no enter/exit)",
    "ours_reuse": "  of which: enter+exit of one TimerRequest built once (`with scope:`)",
    "ours_sentinel": "`pytest_elastic_timer.expires(30)`, no watchdog (in-process sentinel)",
    "torch_local": "torch `expires(30, scope=...)`, LocalTimerClient + LocalTimerServer",
    "torch_local_stack": "torch `expires(30)` without scope (inspect.stack), LocalTimerClient",
    "torch_file": "torch `expires(30, scope=...)`, FileTimerClient + FileTimerServer",
}
BURST = 1_000_000


# -- worker side ---------------------------------------------------------------------
class Empty:
    __slots__ = ()

    def __enter__(self) -> Empty:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _setup_floors() -> dict[str, Any]:
    import mmap
    import struct

    slot = struct.Struct("<QddQIIIfHHIQ")
    mm = mmap.mmap(-1, 1 << 20)
    words = memoryview(mm).cast("Q")
    pack = slot.pack_into
    monotonic = time.monotonic

    def empty(n: int, errors: collections.Counter[str]) -> None:
        for _ in range(n):
            try:
                with Empty():
                    pass
            except Exception as exc:
                errors[type(exc).__name__] += 1

    def slot_write(n: int, errors: collections.Counter[str]) -> None:
        for i in range(n):
            try:
                index = i & 1023
                now = monotonic()
                pack(mm, index * 64, i + 1, now + 30.0, now, 1, 2, 3, 4, 0.0, 0, 0, 0, i + 1)
                words[index << 3] = 0
            except Exception as exc:
                errors[type(exc).__name__] += 1

    stack: list[Bare] = []

    class Bare:
        __slots__ = ("after", "deadline")

        def __init__(self, after: float) -> None:
            self.after = after

        def __enter__(self) -> Bare:
            now = monotonic()
            deadline = self.deadline = now + self.after
            pack(mm, 64, 1, deadline, now, 1, 2, 3, 4, 0.0, 0, 0, 0, 1)
            stack.append(self)
            return self

        def __exit__(self, *exc: object) -> None:
            stack.pop()
            words[8] = 0
            if monotonic() > self.deadline:
                raise TimeoutError

    def bare(n: int, errors: collections.Counter[str]) -> None:
        for _ in range(n):
            try:
                with Bare(30.0):
                    pass
            except Exception as exc:
                errors[type(exc).__name__] += 1

    return {"runners": {"empty": empty, "slot": slot_write, "bare": bare}, "info": {}}


def _setup_ours(attached: bool) -> dict[str, Any]:
    info: dict[str, Any] = {}
    handle = None
    if attached:
        from pytest_elastic_timer.plugin import launcher

        handle = launcher.start(grace=2, scale=1, report=None, session={})
        os.environ["PYTEST_ELASTIC_TIMER"] = handle.address
    import pytest_elastic_timer as et
    from pytest_elastic_timer.scope import scopes

    with et.expires(30):  # attaches
        pass
    state = scopes.process_state()
    info["attached"] = state.sock is not None
    info["sentinel"] = state.sentinel is not None
    sent: collections.Counter[str] = collections.Counter()
    original_send = state.send

    def counting_send(op: str, **fields: Any) -> None:
        sent[op] += 1
        original_send(op, **fields)

    state.send = counting_send  # type: ignore[method-assign]  # rare path only
    expires = et.expires

    def run(n: int, errors: collections.Counter[str]) -> None:
        for _ in range(n):
            try:
                with expires(30):
                    pass
            except Exception as exc:
                errors[type(exc).__name__] += 1

    def construct(n: int, errors: collections.Counter[str]) -> None:
        for _ in range(n):
            try:
                expires(30)
            except Exception as exc:
                errors[type(exc).__name__] += 1

    reused = et.expires(30)

    def reuse(n: int, errors: collections.Counter[str]) -> None:
        for _ in range(n):
            try:
                with reused:
                    pass
            except Exception as exc:
                errors[type(exc).__name__] += 1

    def final() -> dict[str, Any]:
        return {
            "attached_at_end": state.sock is not None,
            "messages": dict(sent),
            "open_slots": sum(1 for _ in state.table.open_slots()),
        }

    def cleanup() -> None:
        if handle is not None:
            state.close()
            handle.stop()

    runners: dict[str, Any] = {"ours": run, "ours_construct": construct, "ours_reuse": reuse}
    if not attached:
        runners = {"ours_sentinel": run}
    return {"runners": runners, "info": info, "final": final, "cleanup": cleanup}


def _torch_local_server(queue: Any, ready: Any, stop: Any) -> None:
    from torch.distributed.elastic.timer import LocalTimerServer

    server = LocalTimerServer(queue, max_interval=0.01)
    server.start()
    ready.set()
    stop.wait()
    server.stop()


def _setup_torch_local() -> dict[str, Any]:
    import multiprocessing as mp

    from torch.distributed.elastic import timer

    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    ready, stop = ctx.Event(), ctx.Event()
    server = ctx.Process(target=_torch_local_server, args=(queue, ready, stop), daemon=True)
    server.start()
    ready.wait(60)
    client = timer.LocalTimerClient(queue)
    expires = timer.expires

    def flush() -> None:
        buffer = queue._buffer  # type: ignore[attr-defined]  # the feeder thread's backlog
        while buffer:
            time.sleep(0.0001)

    def run(n: int, errors: collections.Counter[str]) -> None:
        for _ in range(n):
            try:
                with expires(after=30, scope="step", client=client):
                    pass
            except Exception as exc:
                errors[type(exc).__name__] += 1
        flush()

    def run_stack(n: int, errors: collections.Counter[str]) -> None:
        for _ in range(n):
            try:
                with expires(after=30, client=client):
                    pass
            except Exception as exc:
                errors[type(exc).__name__] += 1
        flush()

    def cleanup() -> None:
        stop.set()
        server.join(5)
        if server.is_alive():
            server.kill()
            server.join()

    return {
        "runners": {"torch_local": run, "torch_local_stack": run_stack},
        "info": {"server_pid": server.pid},
        "cleanup": cleanup,
    }


def _torch_file_server(path: str, ready: Any) -> None:
    import logging

    from torch.distributed.elastic.timer import FileTimerServer

    logging.disable(logging.CRITICAL)  # its loop logs every expired request
    server = FileTimerServer(path, run_id="bench")  # default max_interval: 10 s
    server.start()
    ready.set()
    while True:
        time.sleep(3600)


def _setup_torch_file() -> dict[str, Any]:
    import multiprocessing as mp
    import shutil

    from torch.distributed.elastic import timer

    directory = tempfile.mkdtemp(prefix="bench-filetimer-")
    path = os.path.join(directory, "timer.fifo")
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    server = ctx.Process(target=_torch_file_server, args=(path, ready), daemon=True)
    server.start()
    ready.wait(60)
    # signal=0: a request whose release was lost must not SIGKILL this worker later.
    # The request sent is the same JSON line, so the cost is the same as with SIGKILL.
    client = timer.FileTimerClient(path, signal=0)
    expires = timer.expires
    progress = {"scopes": 0, "first_error_after": None}

    def run(n: int, errors: collections.Counter[str]) -> None:
        done = progress["scopes"]
        first = progress["first_error_after"]
        for _ in range(n):
            try:
                with expires(after=30, scope="step", client=client):
                    pass
            except Exception as exc:
                errors[type(exc).__name__] += 1
                if first is None:
                    first = done
            done += 1
        progress["scopes"] = done
        progress["first_error_after"] = first

    def final() -> dict[str, Any]:
        return dict(progress)

    def cleanup() -> None:
        server.kill()
        server.join()
        shutil.rmtree(directory, ignore_errors=True)

    return {"runners": {"torch_file": run}, "info": {}, "final": final, "cleanup": cleanup}


def worker(group: str) -> None:
    import warnings

    common.scrub_own_env()
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")  # torch, no numpy
    try:
        setup = {
            "floors": _setup_floors,
            "ours": lambda: _setup_ours(True),
            "ours_sentinel": lambda: _setup_ours(False),
            "torch_local": _setup_torch_local,
            "torch_file": _setup_torch_file,
        }[group]()
    except Exception as exc:  # e.g. torch not installed
        common.answer({"ready": False, "error": f"{type(exc).__name__}: {exc}"})
        return
    common.answer({"ready": True, "info": setup["info"]})
    try:
        for line in sys.stdin:
            words = line.split()
            if not words or words[0] == "quit":
                break
            if words[0] == "final":
                common.answer(setup.get("final", dict)())
                continue
            name, n = words[1], int(words[2])
            errors: collections.Counter[str] = collections.Counter()
            start = time.perf_counter()
            setup["runners"][name](n, errors)
            seconds = time.perf_counter() - start
            common.answer({"seconds": seconds, "n": n, "errors": dict(errors)})
    finally:
        if "cleanup" in setup:
            setup["cleanup"]()


def burst_worker() -> None:
    """1,000,000 scopes back to back, then one scope that must expire."""
    common.scrub_own_env()
    import json

    from pytest_elastic_timer.plugin import launcher

    report = tempfile.mktemp(prefix="bench-burst-", suffix=".json")
    handle = launcher.start(grace=2, scale=1, report=report, session={})
    result: dict[str, Any] = {}
    try:
        os.environ["PYTEST_ELASTIC_TIMER"] = handle.address
        import pytest_elastic_timer as et
        from pytest_elastic_timer.scope import scopes

        with et.expires(30):
            pass
        state = scopes.process_state()
        result["attached"] = state.sock is not None
        sent: collections.Counter[str] = collections.Counter()
        original_send = state.send

        def counting_send(op: str, **fields: Any) -> None:
            sent[op] += 1
            original_send(op, **fields)

        state.send = counting_send  # type: ignore[method-assign]
        errors: collections.Counter[str] = collections.Counter()
        expires = et.expires
        start = time.perf_counter()
        for _ in range(BURST):
            try:
                with expires(30):
                    pass
            except Exception as exc:
                errors[type(exc).__name__] += 1
        seconds = time.perf_counter() - start
        result.update(
            scopes=BURST,
            seconds=seconds,
            errors=dict(errors),
            messages=dict(sent),
            attached_after=state.sock is not None,
            open_slots_after=sum(1 for _ in state.table.open_slots()),
            slots_used=state.hwm,
        )
        # Still enforced: a scope that overruns must raise ScopeExpired.
        raised, latency = False, math.nan
        scope = et.expires(0.2, scope="after-burst")
        try:
            with scope:
                limit = time.monotonic() + 5.0
                while time.monotonic() < limit:
                    pass
        except et.ScopeExpired:
            latency = time.monotonic() - scope.deadline
            raised = True
        result.update(enforced=raised, enforce_latency=latency)
        state.send = original_send  # type: ignore[method-assign]
        state.close()
    finally:
        handle.stop()
    try:
        with open(report) as f:
            data = json.load(f)
        os.unlink(report)
        result["dropped_messages"] = data.get(
            "dropped_messages", data.get("session", {}).get("dropped_messages")
        )
        result["records"] = [(r.get("scope"), r.get("action")) for r in data.get("expired", [])]
    except (OSError, ValueError) as exc:
        result["report_error"] = str(exc)
    common.answer(result)


# -- parent side ---------------------------------------------------------------------
def measure(quick: bool) -> dict[str, Any]:
    target = 0.08 if quick else 0.2  # seconds per chunk
    repeats = 3 if quick else 7
    here = os.path.abspath(__file__)
    workers: dict[str, common.LineWorker] = {}
    result: dict[str, Any] = {"variants": {}, "groups": {}, "repeats": repeats}
    try:
        for group in GROUPS:
            workers[group] = common.LineWorker(
                [common.PYTHON, here, "--worker", group], env=common.clean_env()
            )
        for group, w in workers.items():
            hello = w.read(180)
            result["groups"][group] = hello
        live = [(g, v) for g in GROUPS for v in GROUPS[g] if result["groups"][g].get("ready")]
        sizes: dict[str, int] = {}
        samples: dict[str, list[float]] = {v: [] for _, v in live}
        errors: dict[str, collections.Counter[str]] = {v: collections.Counter() for _, v in live}
        counts = {v: 0 for _, v in live}
        for group, variant in live:  # warm-up and calibration
            probe = 20 if variant == "torch_local_stack" else 2000
            got = workers[group].ask(f"run {variant} {probe}")
            per = got["seconds"] / probe
            sizes[variant] = max(20, min(2_000_000, int(target / max(per, 1e-9))))
            errors[variant].update(got["errors"])
            counts[variant] += probe
        for r in range(repeats):
            order = live[r % len(live) :] + live[: r % len(live)]
            for group, variant in order:
                got = workers[group].ask(f"run {variant} {sizes[variant]}")
                samples[variant].append(got["seconds"] / got["n"] * 1e6)
                errors[variant].update(got["errors"])
                counts[variant] += got["n"]
        finals = {g: workers[g].ask("final") for g in {g for g, _ in live}}
        for group, variant in live:
            result["variants"][variant] = {
                "us": common.median(samples[variant]),
                "min_us": min(samples[variant]),
                "max_us": max(samples[variant]),
                "samples": samples[variant],
                "chunk": sizes[variant],
                "scopes": counts[variant],
                "errors": dict(errors[variant]),
                "info": result["groups"][group].get("info", {}),
                "final": finals.get(group, {}),
            }
    finally:
        for w in workers.values():
            w.close()
    burst = common.LineWorker([common.PYTHON, here, "--worker", "burst"], env=common.clean_env())
    try:
        result["burst"] = burst.read(300)
    finally:
        burst.close()
    return result


def render(result: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    v = result["variants"]
    ours = v.get("ours", {}).get("us")
    floor = v.get("empty", {}).get("us")
    lines = [
        "| Variant | median µs / scope | min-max µs | vs ours | errors / scopes run |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for name, label in LABELS.items():
        if name not in v:
            group = next(g for g, names in GROUPS.items() if name in names)
            why = result["groups"].get(group, {}).get("error", "not run")
            lines.append(f"| {label} | n/a | | | {why} |")
            continue
        row = v[name]
        ratio = f"{row['us'] / ours:.1f}x" if ours else "n/a"
        errs = sum(row["errors"].values())
        err_text = f"{errs:,} / {row['scopes']:,}"
        if errs:
            err_text += " (" + ", ".join(f"{k} {c:,}" for k, c in row["errors"].items()) + ")"
        if name == "torch_file" and row["final"].get("first_error_after") is not None:
            err_text += f"; first error after {row['final']['first_error_after']:,} scopes"
        if name.startswith("ours_") and name != "ours_sentinel":
            err_text = "watchdog attached" if row["info"].get("attached") else "not attached"
        if name == "ours":
            attached = row["info"].get("attached") and row["final"].get("attached_at_end")
            err_text += "; watchdog attached" if attached else "; **NOT attached**"
            msgs = sum(row["final"].get("messages", {}).values())
            err_text += f"; {msgs} message(s) to the watchdog"
        lines.append(
            f"| {label} | {row['us']:.2f} | {row['min_us']:.2f}-{row['max_us']:.2f} "
            f"| {ratio} | {err_text} |"
        )
    text = "\n".join(lines)
    b = result.get("burst", {})
    if b:
        errs = sum(b.get("errors", {}).values())
        text += (
            f"\n\nBurst of {b.get('scopes', 0):,} scopes (watchdog attached): "
            f"{b.get('seconds', math.nan) / max(b.get('scopes', 1), 1) * 1e6:.2f} µs / scope, "
            f"{errs} errors, {sum(b.get('messages', {}).values())} message(s) to the watchdog, "
            f"{b.get('open_slots_after')} slot(s) left open, {b.get('slots_used')} slot(s) "
            f"ever used, attached afterwards: {b.get('attached_after')}, messages dropped by "
            f"the watchdog: {b.get('dropped_messages')}. Enforcement afterwards: a 0.2 s scope "
            f"over a busy loop "
            f"{'raised ScopeExpired' if b.get('enforced') else '**did not raise**'}"
            f" {common.fmt(b.get('enforce_latency', math.nan) * 1e3, 2)} ms after its deadline; "
            f"watchdog records: {b.get('records')}."
        )
    torch_local = v.get("torch_local", {}).get("us")
    checks = [
        {
            "target": "Scope enter+exit ≤ 4x an empty context manager timed beside it",
            "measured": f"{ours / floor:.1f}x ({ours:.2f} vs {floor:.2f} µs)"
            if ours and floor
            else "n/a",
            "ok": (ours / floor <= 4.0) if ours and floor else None,
        },
        {
            "target": "Scope enter+exit, watchdog attached: ≤ 2 µs median",
            "measured": f"{ours:.2f} µs" if ours else "n/a",
            "ok": (ours <= 2.0 and bool(v["ours"]["info"].get("attached"))) if ours else None,
        },
        {
            "target": "≥ 5x faster than torch LocalTimerClient",
            "measured": f"{torch_local / ours:.1f}x" if ours and torch_local else "n/a",
            "ok": (torch_local / ours >= 5) if ours and torch_local else None,
        },
        {
            "target": "Burst of 1,000,000 scopes: no error, no dropped scope, still enforcing",
            "measured": (
                f"{sum(b.get('errors', {}).values())} errors, "
                f"{b.get('open_slots_after')} left open, enforced: {b.get('enforced')}"
            )
            if b
            else "n/a",
            "ok": (
                not b.get("errors")
                and b.get("open_slots_after") == 0
                and bool(b.get("enforced"))
                and bool(b.get("attached_after"))
                and not b.get("dropped_messages")
            )
            if b
            else None,
        },
    ]
    if floor and ours:
        text += (
            f"\n\nOurs costs {ours - floor:.2f} µs over the empty context manager "
            f"({ours / floor:.1f}x the floor)."
        )
    return text, checks


if __name__ == "__main__":
    args = common.script_args(__doc__ or "")
    if args.worker == "burst":
        burst_worker()
    elif args.worker:
        worker(args.worker)
    else:
        common.emit(measure(args.quick), args.json_out)
