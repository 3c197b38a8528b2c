"""Distributed tests: scopes in spawned ranks, process trees, torch compatibility (issue 4).

Real torch, real gloo: rank 0 hangs in ``all_reduce`` because rank 1 never joins (it
sleeps after ``init_process_group``; a rank that exits would make gloo fail instead of
hang). Torch start-up is slow (seconds per rank import), so the rank tests share inner
sessions: one module with the three ways to time a collective, run once without xdist
and once with ``-n 2``, and one ``MultiProcessTestCase`` session. Ranks write
``pids/<test>-<rank>`` (pid and the time they entered the collective) so the outer test
can find rank 0's pid in the report and prove that no rank outlived its test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from typing import Any

import pytest

from pytest_elastic_timer.core import startup

pytest.importorskip("torch", reason="the distributed tests need torch (gloo backend)")
pytest.importorskip("torch.distributed", reason="torch without torch.distributed")

from helpers import (
    PLAIN_CHILD_TEST,
    SLEEPING_RANK,
    Session,
    failure_block,
    lead,
    reap,
    run,
    scope_line,
    sections,
    stuck_ranks,
    wait_gone,
)

XDIST = (
    *("-p", "no:cacheprovider", "-p", "no:asyncio", "-p", "no:hypothesispytest"),
    *("-p", "no:timeout", "-n", "2"),
)
GRACE = 1.0
HARD = "(?:terminated|killed)"
TORCH_TIMEOUT = 180  # a pytester subprocess running torch ranks on a loaded machine
TORCH_BUDGET = 300  # the outer test's own budget (this suite runs under the plugin too)

RANKS = '''
import multiprocessing
import os
import time

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.distributed.elastic.timer as timer
import torch.multiprocessing as tmp

import pytest_elastic_timer as et

PIDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pids")


def fresh_store():
    # A rendezvous file no group used before: a TCP port found free can be taken by
    # something running beside the session before rank 0 listens on it.
    return os.path.abspath(f"store-{os.getpid()}-{time.monotonic_ns()}")


def join_group(rank, world, store, test):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    os.makedirs(PIDS, exist_ok=True)
    with open(os.path.join(PIDS, f"{test}-{rank}"), "w") as f:
        f.write(f"{os.getpid()} {time.time()}")
    if rank == 1:
        time.sleep(3600)  # never joins the collective, and does not exit either


def rank_expires(rank, world, store):
    et.set_label(f"rank {rank}")
    join_group(rank, world, store, "test_expires")
    with et.expires(after=2, scope="allreduce"):
        dist.all_reduce(torch.ones(4))


def rank_torch_expires(rank, world, store):
    et.configure_torch()
    join_group(rank, world, store, "test_torch_expires")
    with timer.expires(after=2, scope="allreduce"):
        dist.all_reduce(torch.ones(4))


def rank_file_timer(rank, world, store):
    timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
    join_group(rank, world, store, "test_file_timer")
    with timer.expires(after=2, scope="allreduce"):
        dist.all_reduce(torch.ones(4))


def launch(target, world=2):
    """Like a launcher: RANK in each rank's environment from its start (a file-timer
    process is labelled from it); when a rank fails, end the others and raise."""
    ctx = multiprocessing.get_context("spawn")
    store = fresh_store()
    procs = []
    for rank in range(world):
        os.environ["RANK"] = str(rank)
        try:
            proc = ctx.Process(target=target, args=(rank, world, store))
            proc.start()
        finally:
            del os.environ["RANK"]
        procs.append(proc)
    try:
        while all(p.exitcode in (None, 0) for p in procs):
            if all(p.exitcode == 0 for p in procs):
                return
            time.sleep(0.05)
        failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        raise RuntimeError(f"rank(s) failed: {failed}")
    finally:
        for proc in procs:
            if proc.exitcode is None:
                proc.terminate()
        for proc in procs:
            proc.join(10)


@pytest.fixture(autouse=True)
def no_rank_left(request):
    """After the test: which of its ranks still run (written to pids/alive-<test>)."""
    yield
    ended = time.time()
    name = request.node.name
    pids = []
    for rank in (0, 1):
        path = os.path.join(PIDS, f"{name}-{rank}")
        if os.path.exists(path):
            pids.append(int(open(path).read().split()[0]))
    alive = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            proc.wait(10)
        except psutil.NoSuchProcess:
            continue
        except psutil.TimeoutExpired:
            alive.append(pid)
    with open(os.path.join(PIDS, f"alive-{name}"), "w") as f:
        f.write(" ".join(map(str, alive)) + f"\\n{ended}\\n")


@pytest.mark.expires(150)
def test_expires():
    tmp.spawn(rank_expires, args=(2, fresh_store()), nprocs=2, join=True)


@pytest.mark.expires(150)
def test_torch_expires():
    launch(rank_torch_expires)


@pytest.mark.expires(150)
def test_file_timer():
    launch(rank_file_timer)
'''
RANK_TESTS = ("test_expires", "test_torch_expires", "test_file_timer")

MULTI_PROCESS_TEST_CASE = stuck_ranks(
    """\
        if self.rank == 1:
            time.sleep(3600)  # never joins the collective
        dist.all_reduce(torch.ones(4))
"""
)


@pytest.fixture(autouse=True)
def not_an_xdist_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inner sessions do not inherit this suite's own xdist worker id (under -n)."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_TESTRUNUID", raising=False)


@pytest.fixture(autouse=True)
def top_level_pythonpath(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start inner sessions as from a user's shell: without the start-up hook of the
    session running this suite on PYTHONPATH (see
    test_nested_session_child_stack_in_failure_sections for what it does there)."""
    entries = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    kept = [p for p in entries if p and p != startup.PYTHONPATH_DIRECTORY]
    if kept:
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(kept))
    else:
        monkeypatch.delenv("PYTHONPATH", raising=False)


def rank_files(pytester: pytest.Pytester, test: str) -> dict[int, tuple[int, float]]:
    """{rank: (pid, time it entered the collective)} of ``test``'s ranks."""
    found = {}
    for rank in (0, 1):
        path = pytester.path / "pids" / f"{test}-{rank}"
        if path.exists():
            pid, at = path.read_text().split()
            found[rank] = (int(pid), float(at))
    return found


def record_of(session: Session, nodeid: str) -> dict[str, Any]:
    assert session.report is not None, "no JSON report was written"
    found = [r for r in session.report["expired"] if r["nodeid"] == nodeid]
    assert len(found) == 1, (nodeid, session.report["expired"])
    return found[0]


# -- 2 gloo ranks, rank 0 stuck in all_reduce: three ways to time it ------------------
@pytest.mark.expires(TORCH_BUDGET)
@pytest.mark.parametrize("xdist", [False, True], ids=["single", "xdist"])
def test_rank_stuck_in_all_reduce(pytester: pytest.Pytester, xdist: bool) -> None:
    pytester.makepyfile(test_ranks=RANKS)
    args = [f"--elastic-timer-grace={GRACE:g}", "-rA"]
    if xdist:
        session = run(pytester, *XDIST, *args, lean=False, timeout=TORCH_TIMEOUT)
    else:
        session = run(pytester, *args, timeout=TORCH_TIMEOUT)
    session.assert_clean()
    session.result.assert_outcomes(failed=3)
    for test in RANK_TESTS:
        ranks = rank_files(pytester, test)
        assert set(ranks) == {0, 1}, (test, ranks, session.text)
        (rank0, entered), (rank1, _) = ranks[0], ranks[1]
        record = record_of(session, f"test_ranks.py::{test}")
        # Rank 0 owns the scope: its pid and label, not the test process's.
        assert record["scope"] == "allreduce", record
        assert (record["pid"], record["label"]) == (rank0, "rank 0"), record
        assert re.fullmatch(HARD, record["action"]), record
        assert re.search(r"line \d+ in all_reduce\b", record["stack"]), record["stack"]
        assert re.search(rf"line \d+ in rank_{test[5:]}\b", record["stack"]), record["stack"]
        budget = record["budget"]  # a file timer counts from when the watchdog read it
        assert 1.5 < budget <= 2 and budget <= record["elapsed"] < 2 + GRACE + 4, record
        assert {p["pid"] for p in record["killed"]} == {rank0}  # rank 0, not the worker
        if xdist:
            assert re.fullmatch(r"gw\d", record["worker"]), record
        else:
            assert record["worker"] == "", record
        if test != "test_file_timer":  # file-timer requests carry no file:line
            assert record["file"].endswith("test_ranks.py") and record["line"] > 0, record

        # The test failed within seconds of the hang, and no rank outlived it.
        alive, ended = (pytester.path / "pids" / f"alive-{test}").read_text().splitlines()
        assert alive.strip() == "", f"{test}: ranks alive after the test: {alive}"
        assert float(ended) - entered < 2 + GRACE + 15, (test, float(ended) - entered)
        assert wait_gone(rank0, 1.0) and wait_gone(rank1, 1.0)

        # The failure text carries the rank's record.
        block = failure_block(session, test)
        (text,) = sections(block, f"elastic-timer: expired in rank 0, pid {rank0}")
        assert scope_line("allreduce", f"{budget:g}", HARD).match(text.splitlines()[0])
        assert f"test:    test_ranks.py::{test}" in text
        assert re.search(r"line \d+ in all_reduce\b", text), text
    if xdist:
        assert "node down" not in session.text and "replacing" not in session.text
    assert "elastic-timer: expired scopes" in session.stdout


# -- torch's own harness: ranks that never import this package ----------------------
@pytest.mark.expires(TORCH_BUDGET)
def test_multi_process_test_case_bounded_by_expires(pytester: pytest.Pytester) -> None:
    pytest.importorskip("expecttest", reason="torch's MultiProcessTestCase needs expecttest")
    source = pytester.makepyfile(test_mptc=MULTI_PROCESS_TEST_CASE)
    session = run(pytester, "--expires=20", f"--elastic-timer-grace={GRACE:g}", "-rA")
    session.assert_clean()
    session.result.assert_outcomes(failed=1)
    assert session.seconds < 20 + 40, session.seconds  # torch start-up included
    first = lead(session, "StuckRanks.test_allreduce")
    assert scope_line("test_allreduce::call", "20").match(first), first
    record = record_of(session, "test_mptc.py::StuckRanks::test_allreduce")
    assert 20 <= record["elapsed"] < 20 + 3, record

    # The stacks of both stuck ranks, taken before the harness tore them down.
    started = re.findall(r"Started process (\d) with pid (\d+)", session.stdout)
    ranks = [int(pid) for _, pid in started]
    assert len(set(ranks)) == 2, session.stdout
    block = failure_block(session, "StuckRanks.test_allreduce")
    # Named by their ranks (init_process_group), though the harness sets no RANK.
    stacks = {
        int(pid): sections(block, f"elastic-timer: stack of rank {rank}, pid {pid} at expiry")
        for rank, pid in started
    }
    assert all(len(found) == 1 for found in stacks.values()), (stacks, block)
    texts = [found[0] for found in stacks.values()]
    in_all_reduce = [t for t in texts if re.search(r"line \d+ in all_reduce\b", t)]
    assert len(in_all_reduce) == 1, texts  # rank 0
    assert all(re.search(r'test_mptc\.py", line \d+ in test_allreduce', t) for t in texts)
    (rank1,) = [t for t in texts if t not in in_all_reduce]
    line = next(i for i, s in enumerate(source.read_text().splitlines(), 1) if "3600" in s)
    assert f'test_mptc.py", line {line} in test_allreduce' in rank1, rank1  # its sleep
    assert {c["pid"] for c in record["children"] if c.get("stack")} >= set(ranks)
    for pid in ranks:
        assert wait_gone(pid, 5.0), f"rank {pid} outlived the test"


# -- a plain Python child: its stack in the failure ----------------------------------
def test_plain_child_stack_in_failure_sections(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_plain=PLAIN_CHILD_TEST)
    session = run(pytester, "-rA")
    session.assert_clean()
    session.result.assert_outcomes(failed=1)
    helper = int((pytester.path / "helper.pid").read_text())
    record = session.assert_expired("test_plain", "test_plain::call", 2)
    assert helper in {c["pid"] for c in record["children"]}
    block = failure_block(session, "test_plain")
    (text,) = sections(block, f"elastic-timer: stack of pid {helper} at expiry")
    assert re.search(r'File "<string>", line \d+ in serve_forever', text), text
    assert wait_gone(helper, 5.0)


HARNESS_KILLS_AT_ONCE = '''
import os
import subprocess
import sys
import time

import pytest

import pytest_elastic_timer as et

RANK = """
import os, time

def wait_for_peers():
    time.sleep(3600)

open(f"ready-{os.getpid()}", "w").close()
wait_for_peers()
"""


@pytest.mark.parametrize("round", range(3))
def test_ranks(round):
    ranks = [subprocess.Popen([sys.executable, "-c", RANK]) for _ in range(3)]
    with open(f"ranks-{round}.pid", "w") as f:
        f.write(" ".join(str(rank.pid) for rank in ranks))
    try:
        while not all(os.path.exists(f"ready-{rank.pid}") for rank in ranks):
            time.sleep(0.01)  # started, with their dump handlers
        with et.expires(0.5, scope="collective"):
            ranks[0].wait()
    finally:  # as a harness does: the moment the test fails, its ranks are gone
        for rank in ranks:
            rank.kill()
        for rank in ranks:
            rank.wait()
'''


def test_ranks_killed_by_their_harness_at_the_interrupt_keep_their_stacks(
    pytester: pytest.Pytester,
) -> None:
    """The owner is interrupted without waiting for its children's dumps to be complete,
    and the harness kills them the moment it is: their stacks are still reported."""
    pytester.makepyfile(test_harness=HARNESS_KILLS_AT_ONCE)
    session = run(pytester, "-rA")
    session.assert_clean()
    session.result.assert_outcomes(failed=3)
    assert session.report is not None
    for round in range(3):
        test = f"test_ranks[{round}]"
        ranks = [int(p) for p in (pytester.path / f"ranks-{round}.pid").read_text().split()]
        record = record_of(session, f"test_harness.py::{test}")
        stacks = {c["pid"]: c.get("stack", "") for c in record["children"]}
        block = failure_block(session, test)
        for pid in ranks:
            assert re.search(r"line \d+ in wait_for_peers", stacks.get(pid, "")), record
            (text,) = sections(block, f"elastic-timer: stack of pid {pid} at expiry")
            assert re.search(r"line \d+ in wait_for_peers", text), text
            assert wait_gone(pid, 5.0)


def test_nested_session_child_stack_in_failure_sections(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session started inside another one (as pytester does): the inner session's
    start-up hook, first on PYTHONPATH, wins over the outer one it shadows."""
    outer = pytester.mkdir("outer")
    monkeypatch.setenv("PYTHONPATH", startup.PYTHONPATH_DIRECTORY)
    monkeypatch.setenv("PYTEST_ELASTIC_TIMER", str(outer / "watchdog.sock"))
    monkeypatch.setenv(startup.ENV_DUMP_SIGNAL, str(startup.session_dump_signal()))
    pytester.makepyfile(test_plain=PLAIN_CHILD_TEST)
    session = run(pytester, "-rA", nested=True)
    helper = int((pytester.path / "helper.pid").read_text())
    block = failure_block(session, "test_plain")
    (text,) = sections(block, f"elastic-timer: stack of pid {helper} at expiry")
    assert re.search(r'File "<string>", line \d+ in serve_forever', text), text
    assert not (outer / f"dump-{helper}").exists() or not (outer / f"dump-{helper}").stat().st_size


# -- a double-forked daemon: the leak check -------------------------------------------
DAEMON = '''
import os
import subprocess
import sys
import time

DAEMON = """
import os
import sys
import time

if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        with open(sys.argv[1] + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(sys.argv[1] + ".tmp", sys.argv[1])
        time.sleep(3600)
        os._exit(0)
    os._exit(0)
os.wait()
"""


def test_daemon():
    path = os.path.abspath("daemon.pid")
    subprocess.run([sys.executable, "-c", DAEMON, path], check=True, timeout=60)
    while not os.path.exists(path):
        time.sleep(0.01)


def test_after():
    pass
'''
LEFT = "test_daemon.py::test_daemon left 1 process(es) running after its teardown"


@pytest.mark.parametrize("mode", ["kill", "warn", "off"])
def test_double_forked_grandchild(pytester: pytest.Pytester, mode: str) -> None:
    pytester.makepyfile(test_daemon=DAEMON)
    session = run(pytester, "-rA", f"--elastic-timer-leaks={mode}")
    pid = int((pytester.path / "daemon.pid").read_text())
    try:
        session.assert_clean()
        session.result.assert_outcomes(passed=2)
        text = " ".join(session.stdout.split())  # warnings summary lines are wrapped
        if mode == "kill":
            assert f"PytestWarning: {LEFT} (ended): {pid} (" in text, session.stdout
            assert wait_gone(pid, 5.0), "the leak check left the daemon running"
        elif mode == "warn":
            assert f"PytestWarning: {LEFT} (still running): {pid} (" in text, session.stdout
            assert not wait_gone(pid, 1.0), "warn must not kill"
        else:
            assert "left 1 process(es)" not in text, session.stdout
            assert not wait_gone(pid, 1.0), "off must not kill"
    finally:
        if not wait_gone(pid, 0):
            reap(pid)
    assert wait_gone(pid, 1.0)


def test_leak_warning_as_error_fails_the_teardown(pytester: pytest.Pytester) -> None:
    """With ``-W error``, the leak warning is an error in the test's own teardown: the
    test reports an error, the session goes on, and the daemon is still ended."""
    pytester.makepyfile(test_daemon=DAEMON)
    session = run(
        pytester, "-rA", "--elastic-timer-leaks=kill", "-W", "error::pytest.PytestWarning"
    )
    pid = int((pytester.path / "daemon.pid").read_text())
    try:
        session.assert_clean()
        session.result.assert_outcomes(passed=2, errors=1)
        assert "INTERNALERROR" not in session.stdout
        assert "ERROR at teardown of test_daemon" in session.stdout, session.stdout
        assert LEFT in " ".join(session.stdout.split()), session.stdout
        assert wait_gone(pid, 5.0), "the leak check left the daemon running"
    finally:
        if not wait_gone(pid, 0):
            reap(pid)


INTERRUPTED_SPAWN = (
    SLEEPING_RANK
    + """


@pytest.mark.expires(1)
def test_join_cut_short():
    path = os.path.abspath("rank.pid")
    rank = multiprocessing.get_context("spawn").Process(target=_rank, args=(path,))
    rank.start()
    rank.join()  # never returns: the deadline interrupts it
"""
)


def test_processes_of_a_test_the_plugin_interrupted_are_ended_under_warn(
    pytester: pytest.Pytester,
) -> None:
    """Under the default ``warn``, a test cut short by its deadline still leaves nothing:
    its join was interrupted by the plugin, so the plugin ends what it started (a
    multiprocessing child left running would keep pytest from exiting)."""
    pytester.makepyfile(test_spawn=INTERRUPTED_SPAWN)
    session = run(pytester, "-rA")
    pid = int((pytester.path / "rank.pid").read_text())
    try:
        session.assert_clean()
        session.result.assert_outcomes(failed=1)
        text = " ".join(session.stdout.split())
        assert "test_spawn.py::test_join_cut_short left 1 process(es) running" in text
        assert f"(ended): {pid} (" in text, session.stdout
        assert wait_gone(pid, 5.0), "the interrupted test's child is still running"
        assert session.seconds < 30, session.seconds  # pytest did not wait for the child
    finally:
        if not wait_gone(pid, 0):
            reap(pid)


# -- torch's elastic agent takes the session's file-timer FIFO over ----------------------
AGENT_TAKES_THE_FIFO = '''
import os
import subprocess
import sys

from torch.distributed.elastic import timer

PATH = os.environ["TORCHELASTIC_TIMER_FILE"]
CLIENT = """
import os, sys, time
from torch.distributed.elastic import timer
timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
with timer.expires(after=float(sys.argv[1]), scope=sys.argv[2]):
    time.sleep(float(sys.argv[3]))
"""
servers = []


def client(after, scope, sleep):
    """A FileTimerClient in a child process; its exit status."""
    argv = [sys.executable, "-c", CLIENT, str(after), scope, str(sleep)]
    return subprocess.run(argv, timeout=120).returncode


def agent_server():
    """What torch's elastic agent starts with TORCHELASTIC_ENABLE_FILE_TIMER=1."""
    server = timer.FileTimerServer(PATH, run_id="agent", max_interval=0.1, daemon=True)
    server.start()
    return server


def test_agent_in_one_test():
    server = agent_server()
    try:
        assert client(30, "under-agent", 0) == 0
    finally:
        server.stop()
    assert not os.path.exists(PATH)  # the agent removed it


def test_enforced_after_the_agent():
    assert client(0.5, "after-agent", 60) < 0


def test_agent_left_a_fifo_nobody_reads():
    os.remove(PATH)
    os.mkfifo(PATH)  # as an agent killed on the way leaves it


def test_enforced_after_the_dead_agent():
    assert client(0.5, "after-dead-agent", 60) < 0


def test_agent_across_tests_starts():
    servers.append(agent_server())


def test_the_agent_serves_its_clients():
    assert client(30, "under-running-agent", 0) == 0


def test_agent_across_tests_stops():
    servers.pop().stop()


def test_enforced_after_the_agent_across_tests():
    assert client(0.5, "after-agent-across-tests", 60) < 0
'''


@pytest.mark.expires(TORCH_BUDGET)
@pytest.mark.parametrize("xdist", [False, True], ids=["single", "xdist"])
def test_the_file_timer_fifo_is_back_after_a_torch_agent_took_it(
    pytester: pytest.Pytester, xdist: bool
) -> None:
    """torch's elastic agent, started by a test with TORCHELASTIC_ENABLE_FILE_TIMER=1
    (torchrun), runs a FileTimerServer at the session's TORCHELASTIC_TIMER_FILE: it
    removes the session's FIFO, serves its own workers, and removes its FIFO when it
    stops. Every later FileTimerClient of the session found no FIFO and failed with
    BrokenPipeError. After each test the FIFO is made again where nobody reads what is
    at its path, and requests are enforced by the session's watchdog again."""
    pytester.makepyfile(test_agent=AGENT_TAKES_THE_FIFO)
    args = [f"--elastic-timer-grace={GRACE:g}", "-p", "no:randomly"]
    if xdist:
        # One worker: the tests run in order, in the worker, which looks at the FIFO.
        xdist_one = [a if a != "2" else "1" for a in XDIST]
        session = run(pytester, *xdist_one, *args, lean=False, timeout=TORCH_TIMEOUT)
    else:
        session = run(pytester, *args, timeout=TORCH_TIMEOUT)
    session.result.assert_outcomes(passed=8)
    for scope in ("after-agent", "after-dead-agent", "after-agent-across-tests"):
        assert re.fullmatch(HARD, session.record(scope)["action"])
    scopes = sorted(r["scope"] for r in session.report["expired"]) if session.report else []
    assert len(scopes) == 3, scopes
    session.assert_clean()


IN_WORKER_FILE_TIMER = """
import os
import time

from torch.distributed.elastic import timer


def test_in_worker_file_timer():
    timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
    with timer.expires(after=0.5, scope="in-worker"):
        time.sleep(60)


def test_next():
    pass
"""


@pytest.mark.expires(TORCH_BUDGET)
def test_a_file_timer_client_in_an_xdist_worker_names_its_test(pytester: pytest.Pytester) -> None:
    """A FileTimerClient in the xdist worker itself (a process that enters scopes of its
    own too): its expiry ends the worker, and the report names the test and the worker,
    which the worker's table says (its environment in /proc has neither): TIMEOUT by the
    scope, not "worker 'gw0' crashed"."""
    pytester.makepyfile(test_in_worker=IN_WORKER_FILE_TIMER)
    xdist_one = [a if a != "2" else "1" for a in XDIST]
    session = run(pytester, *xdist_one, f"--elastic-timer-grace={GRACE:g}", "-rA", lean=False)
    session.assert_clean()
    session.result.assert_outcomes(passed=1, failed=1)
    assert "crashed while running" not in session.text, session.text
    record = session.record("in-worker")
    assert record["nodeid"] == "test_in_worker.py::test_in_worker_file_timer", record
    assert record["worker"] == "gw0" and re.fullmatch(HARD, record["action"]), record
    assert "TIMEOUT test_in_worker.py::test_in_worker_file_timer" in session.stdout


# -- torch's TimerClient rule: one timer per (pid, scope_id) ---------------------------
TORCH_CLIENT_RULE = """
import threading
import time

import torch.distributed.elastic.timer as timer

import pytest_elastic_timer as et


def test_acquiring_an_open_scope_again_moves_its_deadline():
    client = et.TimerClient()
    for _ in range(6):  # a keep-alive: 1.8s in all, never 1s without an acquire
        client.acquire("heartbeat", time.time() + 1)
        time.sleep(0.3)
    client.release("heartbeat")


def test_another_thread_releases_the_scope():
    client = et.TimerClient()
    client.acquire("background", time.time() + 0.5)
    releaser = threading.Thread(target=client.release, args=("background",))
    releaser.start()
    releaser.join()
    time.sleep(1.2)


def recurse(depth):
    # torch's default scope is the caller's file#line: every level has the same one
    if depth:
        with timer.expires(after=0.3):
            recurse(depth - 1)
            time.sleep(0.15)


def test_a_recursive_expires_is_one_timer():
    et.configure_torch()
    recurse(4)
"""


@pytest.mark.expires(TORCH_BUDGET)
def test_the_torch_client_keeps_one_timer_per_scope_id_as_torch_does(
    pytester: pytest.Pytester,
) -> None:
    """torch's timer servers key timers by (pid, scope_id): acquiring an open scope_id
    again replaces its deadline, and any thread of the process may release it. The
    client nested a new scope per acquire (a keep-alive expired at its first deadline,
    with a warning about the abandoned copies) and released only the calling thread's:
    code that passes under torch failed with ScopeExpired."""
    pytester.makepyfile(test_torch_client=TORCH_CLIENT_RULE)
    session = run(pytester, "-W", "error", "-rA", timeout=TORCH_TIMEOUT)
    session.assert_clean()
    session.result.assert_outcomes(passed=3)
    assert session.report is not None and session.report["expired"] == [], session.report


# -- file-timer requests under the session's rules --------------------------------------
FILE_TIMER_CHILD = '''
import multiprocessing
import os
import time

import torch.distributed.elastic.timer as timer


def child(after, scope, sleep, signum):
    client = timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"], signal=signum)
    timer.configure(client)
    with timer.expires(after=after, scope=scope):
        time.sleep(sleep)


def exitcode(after, scope, sleep, signum=9, start="fork"):
    """A FileTimerClient in a child; its exit status. A spawned one has the session's
    stack dump handler from its start."""
    proc = multiprocessing.get_context(start).Process(
        target=child, args=(after, scope, sleep, signum)
    )
    proc.start()
    proc.join(60)
    return proc.exitcode
'''

FILE_TIMER_SCALED = (
    FILE_TIMER_CHILD
    + """

def test_a_scaled_file_timer_budget():
    assert exitcode(0.3, "scaled", 1.0) == 0  # 0.3s x 10
"""
)


@pytest.mark.expires(TORCH_BUDGET)
def test_the_scale_factor_applies_to_file_timer_requests(pytester: pytest.Pytester) -> None:
    """--elastic-timer-scale multiplies every budget, a file-timer request's too; its
    deadline was taken as torch's wall-clock time, unscaled."""
    pytester.makepyfile(test_scaled=FILE_TIMER_SCALED)
    session = run(pytester, "--elastic-timer-scale=10", "-rA", timeout=TORCH_TIMEOUT)
    session.assert_clean()
    session.result.assert_outcomes(passed=1)
    assert session.report is not None and session.report["expired"] == [], session.report


FILE_TIMER_RECORDS = (
    FILE_TIMER_CHILD
    + """

def test_zero():
    assert exitcode(0, "zero", 60) < 0


def test_negative():
    assert exitcode(-5, "negative", 60) < 0


def test_default_scope():
    assert exitcode(0.3, None, 60) < 0
"""
)


@pytest.mark.expires(TORCH_BUDGET)
def test_file_timer_records_of_a_past_deadline_and_of_torchs_default_scope(
    pytester: pytest.Pytester,
) -> None:
    """A request whose deadline is already past has a budget of 0, as with
    et.TimerClient (after=0 was recorded as -0.01s, after=-5 as -5.004s); torch's
    default scope name is contextlib's line (the frame above expires() inside its
    @contextmanager), which is no site: the record has none rather than contextlib's."""
    pytester.makepyfile(test_records=FILE_TIMER_RECORDS)
    session = run(pytester, f"--elastic-timer-grace={GRACE:g}", "-rA", timeout=TORCH_TIMEOUT)
    session.assert_clean()
    session.result.assert_outcomes(passed=3)
    for scope in ("zero", "negative"):
        record = session.record(scope)
        assert record["budget"] == 0 and re.fullmatch(HARD, record["action"]), record
    assert session.report is not None
    (default,) = [r for r in session.report["expired"] if r["scope"] not in ("zero", "negative")]
    assert re.fullmatch(r".+\.py#\d+", default["scope"]), default  # torch's name for it
    assert (default["file"], default["line"]) == ("", 0), default
    assert "contextlib.py:" not in session.text, session.text


FILE_TIMER_IN_PYTEST = """
import os
import time

import pytest
import torch.distributed.elastic.timer as timer


@pytest.mark.expires(2)
def test_both():
    client = timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"], signal=0)
    timer.configure(client)
    with timer.expires(after=0.3, scope="file-step"):
        time.sleep(1)  # recorded, left running (signal 0)
    time.sleep(60)  # then the test's own budget runs out
"""


@pytest.mark.expires(TORCH_BUDGET)
def test_a_file_timer_request_and_a_scope_of_one_process_keep_a_record_each(
    pytester: pytest.Pytester,
) -> None:
    """The pytest process sends a file-timer request that expires, then its test's call
    phase expires. Both are in the report: the request's record was superseded by the
    phase's, which had the same process and serial."""
    pytester.makepyfile(test_in_pytest=FILE_TIMER_IN_PYTEST)
    session = run(pytester, f"--elastic-timer-grace={GRACE:g}", timeout=TORCH_TIMEOUT)
    session.assert_clean()
    session.result.assert_outcomes(failed=1)
    request, phase = session.record("file-step"), session.record("test_both::call")
    assert (request["action"], phase["action"]) == ("reported", "interrupted")
    assert request["pid"] == phase["pid"] and request["serial"] != phase["serial"]


FILE_TIMER_SIGNALS = (
    FILE_TIMER_CHILD
    + """

def test_signal_zero():
    assert exitcode(0.3, "signal-0", 1.5, 0, "spawn") == 0


def test_sigkill():
    assert exitcode(0.3, "signal-kill", 60, 9, "spawn") == -9


def test_sigusr1():
    assert exitcode(0.3, "signal-usr1", 60, 10, "spawn") == -10
"""
)


@pytest.mark.expires(TORCH_BUDGET)
def test_a_file_timer_request_ends_its_process_with_its_own_signal(
    pytester: pytest.Pytester,
) -> None:
    """torch ends an expired worker with the request's signal (FileTimerClient's default
    is SIGKILL), and "a negative or zero signal will not kill the process". The signal
    was ignored: every expired client got SIGTERM, signal=0 included. Now the stacks
    are dumped first, as before, then the process ends by its signal; with a signal of
    0 it runs on, and the expiry is recorded all the same."""
    pytester.makepyfile(test_signals=FILE_TIMER_SIGNALS)
    session = run(pytester, f"--elastic-timer-grace={GRACE:g}", "-rA", timeout=TORCH_TIMEOUT)
    session.assert_clean()
    session.result.assert_outcomes(passed=3)
    left = session.record("signal-0")
    assert left["action"] == "reported" and left["killed"] == [], left
    assert re.search(r"line \d+ in child\b", left["stack"]), left["stack"]
    for scope, action in (("signal-kill", "killed"), ("signal-usr1", "terminated")):
        record = session.record(scope)
        assert record["action"] == action and len(record["killed"]) == 1, record
        assert re.search(r"line \d+ in child\b", record["stack"]), record["stack"]
    assert "expired after" in session.stdout and ": reported" in session.stdout, session.stdout


# -- the user's own FileTimerServer --------------------------------------------------------
USERS_SERVER = """
import sys
import time

import torch.distributed.elastic.timer as timer


def log(name, request):
    with open(sys.argv[2], "a", encoding="utf-8") as f:
        f.write(f"{name} {request.scope_id if request else ''}\\n")


server = timer.FileTimerServer(sys.argv[1], "user", 0.05, log_event=log)
server.start()
time.sleep(120)  # it ends itself (SIGKILL) once it ended an expired client
"""

USERS_TIMER_FILE = (
    FILE_TIMER_CHILD
    + """
USERS = os.environ["USERS_TIMER_FILE"]


def test_the_users_value_is_kept():
    assert os.environ["TORCHELASTIC_TIMER_FILE"] == USERS


def test_a_session_inside_a_test_sees_it_too(pytester):
    pytester.makepyfile(
        test_inner="import os\\n"
        "def test_inner():\\n"
        "    assert os.environ['TORCHELASTIC_TIMER_FILE'] == os.environ['USERS_TIMER_FILE']\\n"
    )
    pytester.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)
    assert os.environ["TORCHELASTIC_TIMER_FILE"] == USERS


def test_the_users_server_enforces():
    assert exitcode(0.3, "users-step", 60) == -9
"""
)


@pytest.mark.expires(TORCH_BUDGET)
def test_a_torch_timer_file_the_user_set_is_theirs(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TORCHELASTIC_TIMER_FILE set before the session names the user's own
    FileTimerServer: the session exported its FIFO over it, so the user's server got
    no requests, and a session run in-process by a test unset it. It is kept."""
    fifo, log = pytester.path / "users.fifo", pytester.path / "users.log"
    server = subprocess.Popen([sys.executable, "-c", USERS_SERVER, str(fifo), str(log)])
    try:
        deadline = time.monotonic() + 60
        while not log.exists() and time.monotonic() < deadline:  # "watchdog started"
            time.sleep(0.05)
        monkeypatch.setenv("USERS_TIMER_FILE", str(fifo))
        monkeypatch.setenv("TORCHELASTIC_TIMER_FILE", str(fifo))
        pytester.makepyfile(test_users=USERS_TIMER_FILE)
        session = run(pytester, "-rA", "-p", "pytester", timeout=TORCH_TIMEOUT)
        session.assert_clean()
        session.result.assert_outcomes(passed=3)
        assert session.report is not None and session.report["expired"] == [], session.report
        assert "timer expired users-step" in log.read_text(), log.read_text()
        assert server.wait(30) == -9  # torch's server ends itself after a worker
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
