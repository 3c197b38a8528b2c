"""Benchmark 7: what the collectives recorder costs per torch.distributed op.

Two gloo ranks on this machine, started the way a session starts its processes (the
session's start-up hook on ``PYTHONPATH``, ``PYTEST_ELASTIC_TIMER`` naming a session
directory), run a loop of small ``all_reduce`` calls (one float32 of 16 elements) in
two configurations, side by side in one run: through ``torch.distributed.all_reduce``
as the recorder left it (recorded), and through the function it wraps (plain). The
batches alternate, so drift of the machine hits both alike; each configuration's
result is the median over batches of the time per op.

The recorder's own cost is measured without communication: the recorder's wrapper
around a function that does nothing (same signature, same tensor), against that
function called directly, in the same rank with its group initialised. A third loop,
padded, calls the plain function after a Python busy loop calibrated to last as long
as that cost: on a loaded machine with two cores, a rank that comes back to the next
all-reduce a few microseconds later can find the other rank's gloo thread asleep, and
the loop's time per op grows by far more than those microseconds. The padded loop shows
how much of the recorded loop's difference is that, and not the recorder.

Needs torch; without it the benchmark reports that it was skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common

RANKS = """
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pytest_elastic_timer.scope import collectives

BATCH, BATCHES, OUT = __BATCH__, __BATCHES__, __OUT__


def per_op(fn, *args):
    start = time.perf_counter()
    for _ in range(BATCH):
        fn(*args)
    return (time.perf_counter() - start) / BATCH * 1e6


def nothing(tensor, op=None, group=None, async_op=False):
    return None


def spin(rounds):
    total = 0
    for i in range(rounds):
        total += i
    return total


def calibrate(seconds):
    # Rounds of spin() that last this many seconds.
    rounds = 1000
    start = time.perf_counter()
    for _ in range(200):
        spin(rounds)
    each = (time.perf_counter() - start) / 200 / rounds
    return max(1, round(seconds / each))


def rank_main(rank, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    recorded = dist.all_reduce
    assert getattr(recorded, "_pytest_elastic_timer_recorded", False), "no recorder"
    plain = recorded.__wrapped__
    wrapped_nothing = collectives.wrap("all_reduce", nothing)
    tensor = torch.ones(16)
    times = {"plain": [], "recorded": [], "padded": [], "nothing": [], "wrapped_nothing": []}
    costs = sorted(per_op(wrapped_nothing, tensor) - per_op(nothing, tensor) for _ in range(9))
    rounds = calibrate(costs[4] / 1e6)  # the same on both ranks: rank 0's
    box = [rounds]
    dist.broadcast_object_list(box, 0)
    rounds = box[0]

    def padded(t):
        spin(rounds)
        return plain(t)

    calls = {"plain": plain, "recorded": recorded, "padded": padded}
    for fn in calls.values():  # warm up
        per_op(fn, tensor)
    for index in range(BATCHES):
        # Which configuration goes first turns too: the first batch after the other
        # rank's turn of the scheduler is not the same as the second.
        names = list(calls)
        order = names[index % 3 :] + names[: index % 3]
        for name in order:
            times[name].append(per_op(calls[name], tensor))
        times["nothing"].append(per_op(nothing, tensor))
        times["wrapped_nothing"].append(per_op(wrapped_nothing, tensor))
    dist.barrier()
    if rank == 0:
        with open(OUT, "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(port,), nprocs=2, join=True)
"""


def measure(quick: bool) -> dict[str, Any]:
    try:
        import torch  # noqa: F401
    except ImportError:
        return {"skipped": "torch is not installed"}
    from pytest_elastic_timer.core import collectives as ring_format
    from pytest_elastic_timer.core import startup

    batch, batches = (200, 10) if quick else (500, 30)
    with tempfile.TemporaryDirectory() as directory:
        out = os.path.join(directory, "times.json")
        program = os.path.join(directory, "ranks.py")
        source = RANKS.replace("__BATCH__", str(batch)).replace("__BATCHES__", str(batches))
        with open(program, "w", encoding="utf-8") as f:
            f.write(source.replace("__OUT__", repr(out)))
        env = common.clean_env(
            PYTHONPATH=startup.python_path(os.environ.get("PYTHONPATH")),
            PYTEST_ELASTIC_TIMER=os.path.join(directory, "watchdog.sock"),
        )
        done = subprocess.run(
            [common.PYTHON, program], env=env, cwd=directory, capture_output=True, text=True
        )
        if done.returncode != 0:
            return {"error": done.stderr[-500:]}
        with open(out, encoding="utf-8") as f:
            times = json.load(f)
        rings = ring_format.read_rings(ring_format.ring_paths(directory))
    result: dict[str, Any] = {
        "batch": batch,
        "batches": batches,
        "rings": len(rings),
        "recorded_entries": max((len(r.entries) for r in rings), default=0),
    }
    for name, values in times.items():
        result[f"{name}_us"] = common.median(values)
    result["all_reduce_cost_us"] = result["recorded_us"] - result["plain_us"]
    result["padded_cost_us"] = result["padded_us"] - result["plain_us"]
    result["recorder_cost_us"] = result["wrapped_nothing_us"] - result["nothing_us"]
    return result


def render(result: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    if "skipped" in result or "error" in result:
        reason = result.get("skipped") or f"error: {result.get('error', '')[:300]}"
        return f"Not measured: {reason}", []
    lines = [
        "| Per op, 2 gloo ranks, float32[16] | plain µs | recorded µs | difference µs |",
        "| --- | ---: | ---: | ---: |",
        f"| a function that does nothing, with `all_reduce`'s signature "
        f"| {result['nothing_us']:.2f} | {result['wrapped_nothing_us']:.2f} "
        f"| {result['recorder_cost_us']:+.2f} |",
        f"| `all_reduce` (median of {result['batches']} batches of {result['batch']}) "
        f"| {result['plain_us']:.1f} | {result['recorded_us']:.1f} "
        f"| {result['all_reduce_cost_us']:+.1f} |",
        f"| `all_reduce` after as long a Python busy loop, no recorder (padded) "
        f"| {result['plain_us']:.1f} | {result['padded_us']:.1f} "
        f"| {result['padded_cost_us']:+.1f} |",
    ]
    cost = result.get("recorder_cost_us")
    checks = [
        {
            "target": "Recorder ≤ 5 µs per op (wrapper around a no-op, in a rank)",
            "measured": f"{common.fmt(cost)} µs",
            "ok": None if cost is None else cost <= 5.0,
        }
    ]
    return "\n".join(lines), checks


if __name__ == "__main__":
    args = common.script_args(__doc__ or "")
    common.emit(measure(args.quick), args.json_out)
