"""Three ranks (plain processes, no torch) meet at a barrier, then rank 2 stalls: ranks
0 and 1 wait at the next round until its deadline, and the timeout names rank 2."""

import multiprocessing
import queue
import time

import pytest

import pytest_elastic_timer as et

WORLD = 3


def _rank(rank: int, failures: "multiprocessing.Queue[str]") -> None:
    et.set_label(f"rank {rank}")
    et.barrier("step", WORLD, timeout=30)  # round 0: every rank arrives
    if rank == WORLD - 1:
        time.sleep(3600)  # rank 2 stalls before round 1 and never arrives
    try:
        et.barrier("step", WORLD, timeout=2)
    except et.BarrierTimeout as exc:
        failures.put(f"rank {rank}: {exc}")


@pytest.mark.hangs("barrier:step")
@pytest.mark.expires(30)
def test_rank_never_reaches_the_barrier():
    # spawn: a fork of a process with threads (an xdist worker) may deadlock.
    ctx = multiprocessing.get_context("spawn")
    failures = ctx.Queue()
    ranks = [ctx.Process(target=_rank, args=(r, failures)) for r in range(WORLD)]
    for proc in ranks:
        proc.start()
    try:
        found = sorted(failures.get(timeout=25) for _ in range(WORLD - 1))
    except queue.Empty:
        found = ["no rank reported a barrier timeout"]
    finally:
        for proc in ranks:
            proc.terminate()  # rank 2 is still stalled
            proc.join()
    pytest.fail("\n".join(found), pytrace=False)
