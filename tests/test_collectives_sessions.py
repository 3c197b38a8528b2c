"""Hung collectives named by the watchdog: real gloo ranks in real pytest sessions.

The ranks never import this package: they are started with ``torch.multiprocessing``
from a module (``ranks.py``) that imports torch only, or by torch's own
``MultiProcessTestCase``. The session's start-up hook records their ops; when the test's
scope expires, the watchdog aligns the rings into the record's ``collective`` field,
says it on the terminal in one line, labels the ranks ``rank N``, and when a rank dies
the test's failure shows the collective each rank was in.

Torch starts slowly, so one inner session runs every ``mp.spawn`` case and the tests
below read it (the first test to ask runs it, inside its own leftover check).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="the collective tests need torch (gloo backend)")
pytest.importorskip("torch.distributed", reason="torch without torch.distributed")

from helpers import (
    LEAN,
    REPORT_NAME,
    Session,
    failure_block,
    sections,
    stuck_ranks,
    top_level_environment,
    wait_gone,
)

from pytest_elastic_timer.core import startup

TORCH_TIMEOUT = 300  # an inner session of several torch rank pairs on a loaded machine
TORCH_BUDGET = 400

RANKS = '''
"""Ranks of the inner tests: torch only, pytest_elastic_timer only in missing_in_rank."""
import os
import re
import signal
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))


def note(test, rank, what):
    os.makedirs(os.path.join(HERE, "pids"), exist_ok=True)
    with open(os.path.join(HERE, "pids", f"{test}-{rank}.{what}"), "w") as f:
        f.write(str(os.getpid()))


def join(rank, store, test, world_size=2):
    note(test, rank, "pid")
    # A file, not a TCP port: a port found free can be taken again before rank 0
    # listens on it (EADDRINUSE) while other sessions run beside this one.
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world_size
    )


def missing(rank, store):
    join(rank, store, "test_missing")
    dist.all_reduce(torch.ones(4))  # all_reduce #1
    dist.broadcast(torch.ones(4), 0)  # broadcast #2
    note("test_missing", rank, "ready")
    if rank == 1:
        time.sleep(3600)  # rank 1 never reaches all_reduce #3
    dist.all_reduce(torch.ones(4))  # all_reduce #3: rank 0 waits here


def missing_in_rank(rank, store):
    import pytest_elastic_timer as et

    join(rank, store, "test_missing_in_rank")
    dist.all_reduce(torch.ones(4))  # all_reduce #1
    if rank == 1:
        time.sleep(3600)  # rank 1 never reaches the timed all_reduce #2
    with et.expires(after=1, scope="step"):
        dist.all_reduce(torch.ones(4))  # timed all_reduce #2: rank 0 waits here


def labelled(rank, store):
    import pytest_elastic_timer as et

    et.set_label(f"trainer {rank}")  # the program names its ranks itself
    join(rank, store, "test_labelled")
    dist.all_reduce(torch.ones(4))  # all_reduce #1
    if rank == 1:
        time.sleep(3600)  # trainer 1 never reaches its step
    with et.expires(after=1, scope="step"):
        dist.all_reduce(torch.ones(4))  # the step's all_reduce #2: trainer 0 waits here


def crashed(rank, store):
    join(rank, store, "test_crashed")
    dist.all_reduce(torch.ones(4))  # all_reduce #1
    if rank == 1:
        os._exit(3)  # rank 1 crashes; mp.spawn then ends rank 0, in no op either
    time.sleep(3600)


def crashed_beside_stuck(rank, store):
    join(rank, store, "test_crashed_beside_stuck", world_size=3)
    dist.all_reduce(torch.ones(4))  # all_reduce #1
    note("test_crashed_beside_stuck", rank, "ready")
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # rank 1 crashes
    if rank == 2:
        time.sleep(3600)  # rank 2 is alive, stuck before all_reduce #2
    dist.all_reduce(torch.ones(4))  # all_reduce #2: rank 0 waits here (gloo: for rank 2)


def pipeline(rank, store):
    join(rank, store, "test_pipeline", world_size=3)
    activation, grad = torch.ones(4), torch.zeros(4)
    if rank == 0:  # stage 0: its activation to stage 1, then done
        dist.batch_isend_irecv([dist.P2POp(dist.isend, activation, 1)])[0].wait()
    elif rank == 1:  # stage 1: from stage 0, then to stage 2 and its answer back
        dist.batch_isend_irecv([dist.P2POp(dist.irecv, activation, 0)])[0].wait()
        exchange = [
            dist.P2POp(dist.isend, activation, 2),
            dist.P2POp(dist.irecv, grad, 2),
        ]
        note("test_pipeline", rank, "ready")
        for request in dist.batch_isend_irecv(exchange):  # stage 1 waits here
            request.wait()
    else:
        note("test_pipeline", rank, "ready")
        time.sleep(3600)  # stage 2 never joins its exchange


def desync(rank, store):
    join(rank, store, "test_desync")
    dist.broadcast(torch.ones(4), 0)  # broadcast #1
    note("test_desync", rank, "ready")
    if rank == 0:
        dist.all_reduce(torch.ones(4))  # #2 on rank 0
    else:
        dist.broadcast(torch.ones(4), 1)  # #2 on rank 1


def shapes(rank, store):
    join(rank, store, "test_shapes")
    dist.all_reduce(torch.ones(4))  # all_reduce #1
    dist.all_reduce(torch.ones(4 if rank == 0 else 1000))  # #2: gloo aborts rank 0


def passing(rank, store, out):
    join(rank, store, os.path.basename(out))
    t = torch.arange(4, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(t)
    gathered = [torch.zeros(2) for _ in range(2)]
    dist.all_gather(gathered, torch.full((2,), float(rank)))
    b = torch.full((3,), float(rank))
    dist.broadcast(b, 1)
    objects = [None, None]
    dist.all_gather_object(objects, {"rank": rank})
    work = dist.all_reduce(torch.ones(2), async_op=True)
    work.wait()
    if rank == 0:
        dist.send(torch.tensor([7.0]), 1)
    else:
        got = torch.zeros(1)
        dist.recv(got, 0)
        assert got.item() == 7.0
    if rank == 0:
        with open(out, "w") as f:
            f.write(repr([t.tolist(), [g.tolist() for g in gathered], b.tolist(), objects]))
    dist.destroy_process_group()
'''

TESTS = '''
import os
import re
import time

import pytest
import torch.multiprocessing as mp

import pytest_elastic_timer as et
import ranks

HERE = os.path.dirname(os.path.abspath(__file__))


def fresh_store():
    """A path for the ranks' rendezvous file, used by no group before."""
    os.makedirs(os.path.join(HERE, "stores"), exist_ok=True)
    return os.path.join(HERE, "stores", f"{os.getpid()}-{time.monotonic_ns()}")


def start(target, *args, nprocs=2):
    return mp.start_processes(
        target, args=(fresh_store(), *args), nprocs=nprocs, join=False, start_method="spawn"
    )


def wait_notes(test, ranks_):
    """Until the ranks ``ranks_`` (a string of digits) stand where the test wants them."""
    paths = [os.path.join(HERE, "pids", f"{test}-{r}.ready") for r in ranks_]
    while not all(os.path.exists(p) for p in paths):
        time.sleep(0.05)


def expire_while(waiting):
    """A 2 s scope around a wait for the ranks, which never ends by itself."""
    with et.expires(after=2, scope="collective"):
        while waiting():
            time.sleep(0.05)


def wait_ready(ctx, test):
    """Until both ranks stand where the test wants them (torch starts slowly)."""
    paths = [os.path.join(HERE, "pids", f"{test}-{r}.ready") for r in (0, 1)]
    while not all(os.path.exists(p) for p in paths):
        ctx.join(timeout=0.05)


def end(ctx):
    for proc in ctx.processes:
        if proc.is_alive():
            proc.kill()
        proc.join(30)


def run_ranks(target, *args):
    """Both ranks to their end (the join raises once a rank has failed)."""
    ctx = start(target, *args)
    try:
        while not ctx.join(timeout=0.05):
            pass
    finally:
        end(ctx)


@pytest.mark.expires(120)
def test_missing():
    ctx = start(ranks.missing)
    try:
        wait_ready(ctx, "test_missing")
        time.sleep(0.5)  # rank 0 is in all_reduce #3 by now
        with et.expires(after=2, scope="collective"):
            while not ctx.join(timeout=0.05):
                pass
    finally:
        end(ctx)


@pytest.mark.expires(120)
def test_missing_in_rank():
    run_ranks(ranks.missing_in_rank)  # fails once the watchdog ended rank 0


@pytest.mark.expires(120)
def test_labelled():
    run_ranks(ranks.labelled)  # fails once the watchdog ended trainer 0


@pytest.mark.expires(120)
def test_crashed():
    run_ranks(ranks.crashed)  # fails once rank 1 has crashed


@pytest.mark.expires(120)
def test_crashed_beside_stuck():
    ctx = start(ranks.crashed_beside_stuck, nprocs=3)
    zero, _, two = ctx.processes
    try:
        # (no ctx.join: it raises as soon as rank 1 is gone)
        wait_notes("test_crashed_beside_stuck", "012")
        time.sleep(0.5)  # rank 1 is gone and rank 0 in all_reduce #2 by now
        expire_while(lambda: zero.is_alive() or two.is_alive())
    finally:
        end(ctx)


@pytest.mark.expires(120)
def test_pipeline():
    ctx = start(ranks.pipeline, nprocs=3)
    _, one, _ = ctx.processes
    try:
        wait_notes("test_pipeline", "12")  # stage 0 may be gone (done) by then
        time.sleep(0.5)  # stage 1 is in its exchange by now
        expire_while(one.is_alive)
    finally:
        end(ctx)


@pytest.mark.expires(120)
def test_desync():
    ctx = start(ranks.desync)
    try:
        wait_ready(ctx, "test_desync")
        time.sleep(0.5)
        with et.expires(after=2, scope="collective"):
            while not ctx.join(timeout=0.05):
                pass
    finally:
        end(ctx)


@pytest.mark.expires(120)
def test_shapes():
    run_ranks(ranks.shapes)  # fails once gloo aborted rank 0


@pytest.mark.expires(120)
@pytest.mark.parametrize("recorder", ["on", "off"])
def test_passing(recorder, monkeypatch):
    monkeypatch.setenv("PYTEST_ELASTIC_TIMER_COLLECTIVES", "1" if recorder == "on" else "0")
    out = os.path.join(HERE, f"passing-{recorder}")
    run_ranks(ranks.passing, out)
    directory = os.path.dirname(os.environ["PYTEST_ELASTIC_TIMER"])
    pids = [open(os.path.join(HERE, "pids", f"passing-{recorder}-{r}.pid")).read() for r in (0, 1)]
    rings = [
        n for n in os.listdir(directory) if n.startswith("collectives-") and n.split("-")[1] in pids
    ]
    assert len(rings) == (2 if recorder == "on" else 0), rings
'''


def inner_env() -> dict[str, str]:
    """A user's shell: no outer xdist worker id, no outer start-up hook on the path."""
    env = dict(os.environ)
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_TESTRUNUID", "PYTEST_CURRENT_TEST"):
        env.pop(name, None)
    kept = [
        p
        for p in env.get("PYTHONPATH", "").split(os.pathsep)
        if p and p != startup.PYTHONPATH_DIRECTORY
    ]
    env["PYTHONPATH"] = os.pathsep.join(kept)
    return env


def run_inner(directory: Path, *args: str) -> Session:
    """Run pytest in ``directory`` as a subprocess (a real watchdog starts)."""
    report = directory / REPORT_NAME
    argv = [sys.executable, "-m", "pytest", *LEAN, f"--elastic-timer-report={report}", *args]
    started = time.monotonic()
    with top_level_environment():
        done = subprocess.run(
            argv,
            cwd=directory,
            env=inner_env(),
            capture_output=True,
            text=True,
            timeout=TORCH_TIMEOUT,
            check=False,
        )
    seconds = time.monotonic() - started
    result = pytest.RunResult(
        done.returncode, done.stdout.splitlines(), done.stderr.splitlines(), seconds
    )
    loaded = json.loads(report.read_text()) if report.exists() else None
    return Session(result, seconds, done.stdout, done.stderr, loaded, None)


_SESSIONS: dict[str, tuple[Path, Session]] = {}


@pytest.fixture
def spawned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Session]:
    """The inner session of the ``mp.spawn`` cases (run by the first test that asks)."""
    if "spawned" not in _SESSIONS:
        directory = tmp_path_factory.mktemp("spawned")
        (directory / "ranks.py").write_text(RANKS, encoding="utf-8")
        (directory / "test_ranks.py").write_text(TESTS, encoding="utf-8")
        trace = f"--elastic-timer-trace={directory / 'trace.json'}"
        _SESSIONS["spawned"] = (directory, run_inner(directory, "-rA", trace))
    return _SESSIONS["spawned"]


def record_of(session: Session, test: str) -> dict[str, Any]:
    assert session.report is not None, session.text
    found = [r for r in session.report["expired"] if r["nodeid"] == f"test_ranks.py::{test}"]
    assert len(found) == 1, (test, session.report["expired"], session.text)
    return found[0]


def rank_pids(directory: Path, test: str) -> dict[int, int]:
    found = {}
    for rank in (0, 1):
        path = directory / "pids" / f"{test}-{rank}.pid"
        if path.exists():
            found[rank] = int(path.read_text())
    return found


def says(session: Session, pattern: str) -> bool:
    """Whether a line of the session's terminal output matches ``pattern``."""
    return any(re.search(pattern, line) for line in session.stdout.splitlines())


def line_of(directory: Path, marker: str) -> int:
    text = (directory / "ranks.py").read_text(encoding="utf-8").splitlines()
    return next(i for i, line in enumerate(text, 1) if marker in line)


@pytest.mark.expires(TORCH_BUDGET)
def test_the_sessions_outcomes(spawned: tuple[Path, Session]) -> None:
    _, session = spawned
    assert "INTERNALERROR" not in session.text
    session.result.assert_outcomes(failed=8, passed=2)


@pytest.mark.expires(TORCH_BUDGET)
def test_a_rank_that_never_reaches_all_reduce_is_named_missing(
    spawned: tuple[Path, Session],
) -> None:
    directory, session = spawned
    record = record_of(session, "test_missing")
    collective = record["collective"]
    assert {k: collective[k] for k in ("group", "seq", "op", "waiting", "missing", "mismatch")} == {
        "group": "default",
        "seq": 3,
        "op": "all_reduce",
        "waiting": [0],
        "missing": [1],
        "mismatch": None,
    }
    ranks_py = str(directory / "ranks.py")
    zero, one = collective["ranks"]["0"], collective["ranks"]["1"]
    assert zero["site"] == f"{ranks_py}:{line_of(directory, '# all_reduce #3')}"
    assert (zero["state"], zero["shapes"]) == ("started", [[4]])
    assert 2.0 <= zero["since"] < 60, zero
    assert (one["op"], one["seq"], one["state"]) == ("broadcast", 2, "completed")
    # The children are labelled by their ranks without a RANK variable or set_label.
    labels = {
        c["label"]
        for c in record["children"]
        if c["pid"] in rank_pids(directory, "test_missing").values()
    }
    assert labels == {"rank 0", "rank 1"}, record["children"]
    # One plain line, in the terminal summary and in the test's failure.
    sleep = line_of(directory, "time.sleep(3600)")
    pattern = (
        r"collective all_reduce #3 \(group default, 2 ranks\): rank 0 waiting \d+\.\ds at "
        rf"ranks\.py:{line_of(directory, '# all_reduce #3')}; rank 1 missing, last completed "
        rf"broadcast #2, now in missing at ranks\.py:{sleep}"
    )
    assert says(session, pattern), session.stdout
    block = failure_block(session, "test_missing")
    stacks = sections(block, "elastic-timer: stack of rank 1, pid")
    assert len(stacks) == 1 and f"line {sleep} in missing" in stacks[0], block


@pytest.mark.expires(TORCH_BUDGET)
def test_a_rank_that_times_its_own_step_is_told_where_the_missing_rank_is(
    spawned: tuple[Path, Session],
) -> None:
    """The scope is rank 0's own, so rank 1 is no process below its owner: it is a
    peer of rank 0's world, whose stack is taken with rank 0's and says where it is."""
    directory, session = spawned
    record = record_of(session, "test_missing_in_rank")
    assert record["scope"] == "step" and record["label"] == "rank 0", record
    assert (record["collective"]["waiting"], record["collective"]["missing"]) == ([0], [1])
    (peer,) = record["peers"]
    assert peer["label"] == "rank 1"
    assert peer["pid"] == rank_pids(directory, "test_missing_in_rank")[1]
    sleep = line_of(directory, "never reaches the timed all_reduce #2")
    assert f"line {sleep} in missing_in_rank" in peer["stack"], peer
    pattern = (
        r"collective all_reduce #2 \(group default, 2 ranks\): rank 0 waiting \d+\.\ds at "
        rf"ranks\.py:{line_of(directory, 'timed all_reduce #2: rank 0')}; rank 1 missing, "
        rf"last completed all_reduce #1, now in missing_in_rank at ranks\.py:{sleep}"
    )
    assert re.search(pattern, session.stdout), session.stdout
    block = failure_block(session, "test_missing_in_rank")
    assert "elastic-timer: stack of rank 1, pid" in block, block


@pytest.mark.expires(TORCH_BUDGET)
def test_a_missing_rank_that_has_a_label_of_its_own_is_told_where_it_is(
    spawned: tuple[Path, Session],
) -> None:
    """The program labels its ranks ``trainer N``: the collective still says where the
    missing rank is, from the stack of its process (found by its pid, not its label)."""
    directory, session = spawned
    record = record_of(session, "test_labelled")
    assert (record["scope"], record["label"]) == ("step", "trainer 0"), record
    collective = record["collective"]
    assert (collective["waiting"], collective["missing"]) == ([0], [1])
    pids = rank_pids(directory, "test_labelled")
    assert {r: collective["ranks"][str(r)]["pid"] for r in (0, 1)} == pids
    (peer,) = record["peers"]
    assert (peer["label"], peer["pid"]) == ("trainer 1", pids[1])
    sleep = line_of(directory, "trainer 1 never reaches its step")
    pattern = (
        r"collective all_reduce #2 \(group default, 2 ranks\): rank 0 waiting \d+\.\ds at "
        rf"ranks\.py:{line_of(directory, 'trainer 0 waits here')}; rank 1 missing, "
        rf"last completed all_reduce #1, now in labelled at ranks\.py:{sleep}"
    )
    assert re.search(pattern, session.stdout), session.stdout


@pytest.mark.expires(TORCH_BUDGET)
def test_a_rank_that_crashed_outside_an_op_is_named_with_its_last_op(
    spawned: tuple[Path, Session],
) -> None:
    """No scope expired, and no rank died inside an op: rank 1 ended through os._exit
    after its first op. The failure says which rank died, after which op."""
    directory, session = spawned
    block = failure_block(session, "test_crashed")
    (text,) = sections(block, "elastic-timer: collectives of the test's ranks")
    one = rank_pids(directory, "test_crashed")[1]
    assert f"rank 1, pid {one} (died): no op in progress; last completed all_reduce #1" in text


@pytest.mark.expires(TORCH_BUDGET)
def test_a_missing_rank_that_crashed_is_told_apart_from_one_that_is_stuck(
    spawned: tuple[Path, Session],
) -> None:
    """Rank 1 killed itself before the deadline, rank 2 sleeps: both are missing from
    all_reduce #2, and the record says which one's process had ended."""
    directory, session = spawned
    record = record_of(session, "test_crashed_beside_stuck")
    collective = record["collective"]
    assert {k: collective[k] for k in ("op", "seq", "waiting", "missing", "died")} == {
        "op": "all_reduce",
        "seq": 2,
        "waiting": [0],
        "missing": [1, 2],
        "died": [],
    }
    pids = {
        r: int((directory / "pids" / f"test_crashed_beside_stuck-{r}.pid").read_text())
        for r in (0, 1, 2)
    }
    views = collective["ranks"]
    assert {r: (views[str(r)]["pid"], views[str(r)]["ended"]) for r in (0, 1, 2)} == {
        0: (pids[0], ""),
        1: (pids[1], "died"),
        2: (pids[2], ""),
    }
    sleep = line_of(directory, "rank 2 is alive, stuck before all_reduce #2")
    pattern = (
        r"collective all_reduce #2 \(group default, 3 ranks\): rank 0 waiting \d+\.\ds at "
        rf"ranks\.py:{line_of(directory, 'rank 0 waits here (gloo: for rank 2)')}; "
        r"rank 1 missing \(died\), last completed all_reduce #1; "
        rf"rank 2 missing, last completed all_reduce #1, now in crashed_beside_stuck at "
        rf"ranks\.py:{sleep}$"
    )
    assert says(session, pattern), session.stdout


@pytest.mark.expires(TORCH_BUDGET)
def test_a_pipeline_stage_is_missing_from_its_neighbours_exchange_alone(
    spawned: tuple[Path, Session],
) -> None:
    """Three stages exchanging through batch_isend_irecv, as many times as a stage has
    neighbours: stage 1 waits on stage 2, which never joins. Stage 2 is missing, and
    stage 0 (done after its one batch) is not."""
    directory, session = spawned
    collective = record_of(session, "test_pipeline")["collective"]
    assert {k: collective[k] for k in ("op", "seq", "peer", "waiting", "missing")} == {
        "op": "irecv",
        "seq": 1,
        "peer": 2,
        "waiting": [1],
        "missing": [2],
    }
    site = line_of(directory, "# stage 1 waits here")
    assert collective["ranks"]["1"]["site"] == f"{directory / 'ranks.py'}:{site}"
    sleep = line_of(directory, "stage 2 never joins its exchange")
    pattern = (
        r"irecv #1 from rank 2 \(group default\): rank 1 waiting \d+\.\ds at "
        rf"ranks\.py:{site}; rank 2 missing, last completed init_process_group #0, "
        rf"now in pipeline at ranks\.py:{sleep}$"
    )
    assert says(session, pattern), session.stdout


@pytest.mark.expires(TORCH_BUDGET)
def test_ranks_in_different_ops_at_one_sequence_number_are_an_op_mismatch(
    spawned: tuple[Path, Session],
) -> None:
    _, session = spawned
    collective = record_of(session, "test_desync")["collective"]
    assert (collective["seq"], collective["waiting"], collective["missing"]) == (2, [0, 1], [])
    assert collective["mismatch"] == "op"
    ops = {r: collective["ranks"][str(r)]["op"] for r in (0, 1)}
    assert ops == {0: "all_reduce", 1: "broadcast"}
    assert collective["op"] in ops.values()
    assert any(
        s.strip().startswith("collective ") and "op mismatch at this sequence number" in s
        for s in session.stdout.splitlines()
    ), session.stdout


@pytest.mark.expires(TORCH_BUDGET)
def test_a_shape_mismatch_that_kills_a_rank_shows_what_each_rank_was_in(
    spawned: tuple[Path, Session],
) -> None:
    directory, session = spawned
    block = failure_block(session, "test_shapes")
    assert "SIGABRT" in block, block
    (text,) = sections(block, "elastic-timer: collectives of the test's ranks")
    lines = text.strip().splitlines()
    site = f"ranks.py:{line_of(directory, '# #2: gloo aborts rank 0')}"
    pids = rank_pids(directory, "test_shapes")
    assert lines[0].startswith(f"rank 0, pid {pids[0]} (died): in all_reduce #2 (group default)")
    assert f"at {site}, float32[4]; last completed all_reduce #1" in lines[0], text
    # Rank 1 may have finished its all_reduce #2 (it sent, and got its 4 floats) before
    # the harness ended it, and on a busy machine even returned and exited by itself
    # first: either way it is named, gone, with that op.
    assert re.match(rf"rank 1, pid {pids[1]} \((died|exited)\): ", lines[1]), text
    assert "all_reduce #2" in lines[1], text
    assert "shape mismatch: rank 0 [[4]], rank 1 [[1000]]" in lines[2], text


@pytest.mark.expires(TORCH_BUDGET)
def test_a_passing_multi_rank_test_is_unchanged_by_the_recorder(
    spawned: tuple[Path, Session],
) -> None:
    directory, session = spawned
    assert "PASSED test_ranks.py::test_passing[on]" in session.stdout
    assert "PASSED test_ranks.py::test_passing[off]" in session.stdout
    on, off = ((directory / f"passing-{k}").read_text() for k in ("on", "off"))
    assert (
        on
        == off
        == repr(
            [
                [0.0, 3.0, 6.0, 9.0],
                [[0.0, 0.0], [1.0, 1.0]],
                [1.0, 1.0, 1.0],
                [{"rank": 0}, {"rank": 1}],
            ]
        )
    )


@pytest.mark.expires(TORCH_BUDGET)
def test_collectives_are_slices_on_each_ranks_track(spawned: tuple[Path, Session]) -> None:
    """The trace shows the gap: rank 0's all_reduce #3 runs to the end of the trace,
    rank 1 has none, its last op is broadcast #2."""
    directory, _ = spawned
    trace = json.loads((directory / "trace.json").read_text())["traceEvents"]
    pids = rank_pids(directory, "test_missing")
    names = {e["pid"]: e["args"]["name"] for e in trace if e.get("name") == "process_name"}
    assert names[pids[0]] == f"rank 0 (pid {pids[0]})", names
    assert names[pids[1]] == f"rank 1 (pid {pids[1]})", names
    ops = {
        rank: [e for e in trace if e.get("cat") == "collective" and e["pid"] == pid]
        for rank, pid in pids.items()
    }
    assert [e["name"] for e in ops[0]] == [
        "init_process_group #0",
        "all_reduce #1",
        "broadcast #2",
        "all_reduce #3",
    ]
    assert [e["name"] for e in ops[1]] == ["init_process_group #0", "all_reduce #1", "broadcast #2"]
    hung = ops[0][-1]
    assert (hung["args"]["state"], hung.get("cname")) == ("started", "terrible")
    assert hung["dur"] > 2e6  # past the 2 s scope
    assert all(e["args"]["state"] == "completed" for e in ops[1])
    threads = {e["tid"] for e in ops[0]}
    assert len(threads) == 1
    (row,) = [e for e in trace if e.get("name") == "thread_name" and e["pid"] == pids[0]]
    assert row["args"]["name"] == "collectives" and row["tid"] in threads


@pytest.mark.expires(TORCH_BUDGET)
def test_no_rank_outlives_its_test(spawned: tuple[Path, Session]) -> None:
    directory, _ = spawned
    pids = sorted(int(p.read_text()) for p in (directory / "pids").glob("*.pid"))
    assert len(pids) == 22, pids  # eight tests of two ranks, two of three
    assert all(wait_gone(pid, 5.0) for pid in pids)


# -- torch's own harness: ranks named rank N without being told ----------------------
MULTI_PROCESS_TEST_CASE = stuck_ranks(
    """\
        dist.all_reduce(torch.ones(2, 2))
        if self.rank == 1:
            time.sleep(3600)  # never joins the second all_reduce
        dist.all_reduce(torch.ones(2, 2))
"""
)


@pytest.mark.expires(TORCH_BUDGET)
def test_multi_process_test_case_ranks_are_labelled_without_being_told(
    tmp_path: Path,
) -> None:
    pytest.importorskip("expecttest", reason="torch's MultiProcessTestCase needs expecttest")
    (tmp_path / "test_mptc.py").write_text(MULTI_PROCESS_TEST_CASE, encoding="utf-8")
    session = run_inner(tmp_path, "--expires=20", "--elastic-timer-grace=1", "-rA")
    assert "INTERNALERROR" not in session.text
    session.result.assert_outcomes(failed=1)
    assert session.report is not None
    (record,) = session.report["expired"]
    ranks = {int(p) for p in re.findall(r"Started process \d with pid (\d+)", session.stdout)}
    assert {c["label"] for c in record["children"] if c["pid"] in ranks} == {"rank 0", "rank 1"}
    collective = record["collective"]
    assert (collective["op"], collective["seq"], collective["waiting"], collective["missing"]) == (
        "all_reduce",
        2,
        [0],
        [1],
    )
    assert collective["ranks"]["0"]["shapes"] == [[2, 2]]
    block = failure_block(session, "StuckRanks.test_allreduce")
    for rank in (0, 1):
        assert len(sections(block, f"elastic-timer: stack of rank {rank}, pid")) == 1, block
    assert all(wait_gone(pid, 5.0) for pid in ranks)
