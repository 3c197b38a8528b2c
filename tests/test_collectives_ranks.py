"""The collectives recorder in real gloo ranks that never import this package.

Each test runs a plain Python program (no pytest) the way a session's processes run:
with the session's start-up hook first on ``PYTHONPATH`` and ``PYTEST_ELASTIC_TIMER``
naming a session directory. The ranks import torch only; the hook notices
torch.distributed and installs the recorder, and the test reads the rings the ranks
left in the directory after they exited.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pytest_elastic_timer.core import collectives as col
from pytest_elastic_timer.core import startup

TIMEOUT = 120  # torch's start-up, twice, on a loaded machine


def session_env(directory: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = startup.python_path(env.get("PYTHONPATH"))
    env["PYTEST_ELASTIC_TIMER"] = str(directory / "watchdog.sock")
    env.pop("PYTEST_CURRENT_TEST", None)
    env.update(extra)
    return env


def run_program(
    directory: Path, source: str, *args: str, **extra: str
) -> subprocess.CompletedProcess[str]:
    program = directory / "program.py"
    program.write_text(textwrap.dedent(source), encoding="utf-8")
    return subprocess.run(
        [sys.executable, "-W", "error", str(program), *args],
        env=session_env(directory, **extra),
        cwd=directory,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )


def lines_of(directory: Path, marker: str) -> int:
    """The line of ``program.py`` that holds ``marker``."""
    text = (directory / "program.py").read_text(encoding="utf-8").splitlines()
    return next(i for i, line in enumerate(text, 1) if marker in line)


def test_a_process_without_torch_loads_neither_torch_nor_the_package(tmp_path: Path) -> None:
    done = run_program(
        tmp_path,
        """
        import sys

        loaded = [m for m in sys.modules if m.split(".")[0] in ("torch", "pytest_elastic_timer")]
        mark = "_pytest_elastic_timer_torch_hook"
        hooks = [type(f).__name__ for f in sys.meta_path if hasattr(f, mark)]
        print(loaded, hooks)
        """,
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.strip() == "[] ['Finder']"


torch = pytest.importorskip("torch", reason="the recorder tests need torch (gloo backend)")
pytest.importorskip("torch.distributed", reason="torch without torch.distributed")

RANKS = """
import os
import socket
import sys

import torch
import torch.multiprocessing as mp
from torch.distributed import all_reduce, init_process_group  # before the group exists
import torch.distributed as dist


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def own_ring():
    from pytest_elastic_timer.core import collectives as col

    (path,) = col.ring_paths(os.path.dirname(os.environ["PYTEST_ELASTIC_TIMER"]), [os.getpid()])
    return col.read_ring(path)


def rank_main(rank, port):
    init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t = torch.ones(4)
    all_reduce(t)  # all_reduce #1
    dist.broadcast(torch.zeros(2, 3, dtype=torch.int64), 0)  # broadcast #2
    if rank == 0:
        work = dist.irecv(t, 1)  # irecv from rank 1
        dist.barrier()  # barrier #3
        assert own_ring().entries[-2].started, "irecv ended before its send"
        dist.barrier()  # barrier #4
        work.wait()
        assert not own_ring().entries[-3].started, "irecv never completed"
    else:
        dist.barrier()  # barrier #3
        dist.barrier()  # barrier #4
        dist.send(t, 0)  # send to rank 0
    gathered = [None, None]
    dist.all_gather_object(gathered, rank)  # all_gather_object #5
    sub = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(1), group=sub)  # subgroup #1
    work = dist.all_reduce(t, async_op=True)  # async all_reduce #6
    work.wait()
    for _ in range(2):  # two batches of a send and a receive
        pair = [
            dist.P2POp(dist.isend, torch.ones(2), 1 - rank),
            dist.P2POp(dist.irecv, torch.zeros(2), 1 - rank),
        ]
        for request in dist.batch_isend_irecv(pair):
            request.wait()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(rank_main, args=(free_port(),), nprocs=2, join=True)
"""


def test_ranks_record_every_op_through_the_session_start_up_hook(tmp_path: Path) -> None:
    done = run_program(tmp_path, RANKS)
    assert done.returncode == 0, done.stderr
    rings = col.read_rings(col.ring_paths(str(tmp_path)))
    by_rank = {ring.rank: ring for ring in rings}
    assert sorted(by_rank) == [0, 1], rings
    program = str(tmp_path / "program.py")
    sub = None
    for rank, ring in by_rank.items():
        assert (ring.world, ring.label, ring.exited) == (2, f"rank {rank}", True)
        assert ring.world_id.startswith("tcp://127.0.0.1:")
        assert ring.groups["default"] == [0, 1]
        ops = [(e.op, e.group, e.seq, e.state) for e in ring.entries]
        sub = next(
            e.group for e in ring.entries if e.group != "default" and e.kind == col.COLLECTIVE
        )
        assert ring.groups[sub] == [0, 1]
        p2p = (
            ("irecv", "default", 1, col.COMPLETED)
            if rank == 0
            else ("send", "default", 1, col.COMPLETED)
        )
        expected = [
            ("init_process_group", "default", 0, col.COMPLETED),
            ("all_reduce", "default", 1, col.COMPLETED),
            ("broadcast", "default", 2, col.COMPLETED),
            *([p2p] if rank == 0 else []),
            ("barrier", "default", 3, col.COMPLETED),
            ("barrier", "default", 4, col.COMPLETED),
            *([p2p] if rank == 1 else []),
            ("all_gather_object", "default", 5, col.COMPLETED),  # its inner ops are not counted
            ("all_reduce", sub, 1, col.COMPLETED),
            ("all_reduce", "default", 6, col.COMPLETED),
            # A batch's ops, numbered per direction and peer as the isend and irecv
            # they are: rank 0's first send to rank 1 meets rank 1's first receive
            # from rank 0, whatever came before it unbatched.
            *(
                [
                    ("isend", "default", 1, col.COMPLETED),
                    ("irecv", "default", 2, col.COMPLETED),
                    ("isend", "default", 2, col.COMPLETED),
                    ("irecv", "default", 3, col.COMPLETED),
                ]
                if rank == 0
                else [
                    ("isend", "default", 2, col.COMPLETED),
                    ("irecv", "default", 1, col.COMPLETED),
                    ("isend", "default", 3, col.COMPLETED),
                    ("irecv", "default", 2, col.COMPLETED),
                ]
            ),
        ]
        assert ops == expected, ops
        entries = {(e.op, e.seq): e for e in ring.entries if e.group == "default"}
        assert entries["all_reduce", 1].site == f"{program}:{lines_of(tmp_path, '# all_reduce #1')}"
        assert entries["all_reduce", 1].tensors == "float32[4]"
        assert entries["broadcast", 2].tensors == "int64[2,3]"
        init_line = lines_of(tmp_path, "init_process_group(")
        assert entries["init_process_group", 0].site == f"{program}:{init_line}"
        peer = next(e for e in ring.entries if e.kind in (col.SEND, col.RECV))
        assert peer.peer == 1 - rank
        batched = ring.entries[-4:]
        batch_line = lines_of(tmp_path, "dist.batch_isend_irecv(pair)")
        assert {(e.peer, e.site, e.tensors) for e in batched} == {
            (1 - rank, f"{program}:{batch_line}", "float32[2]")
        }, batched
        assert all(e.end >= e.start > 0 for e in ring.entries)


def test_the_recorder_is_off_outside_a_session(tmp_path: Path) -> None:
    done = run_program(
        tmp_path,
        """
        import torch.distributed as dist

        print(getattr(dist.all_reduce, "_pytest_elastic_timer_recorded", False))
        """,
        PYTEST_ELASTIC_TIMER_COLLECTIVES="0",
    )
    assert (done.returncode, done.stdout.strip()) == (0, "False"), done.stderr
    assert not col.ring_paths(str(tmp_path))


LABEL = """
import os
import sys
import tempfile

import torch.distributed as dist

from pytest_elastic_timer.scope import scopes

from pytest_elastic_timer.core import collectives as col

store = dist.FileStore(tempfile.mktemp(dir=os.getcwd()), 1)
if sys.argv[1:] == ["named"]:
    scopes.set_label("trainer")
state = scopes.process_state()  # the process's table exists before the group
before = state.label
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
if sys.argv[1:] == ["named-later"]:
    scopes.set_label("trainer")
(path,) = col.ring_paths(os.path.dirname(os.environ["PYTEST_ELASTIC_TIMER"]), [os.getpid()])
in_group, in_ring = state.label, col.read_ring(path).label
dist.destroy_process_group()
print(repr(before), repr(in_group), repr(in_ring), repr(state.label))
state.close()
"""


@pytest.mark.parametrize(
    ("args", "labels"),
    [
        ((), "'' 'rank 0' 'rank 0' ''"),
        (("named",), "'trainer' 'trainer' 'trainer' 'trainer'"),
        (("named-later",), "'' 'trainer' 'trainer' 'trainer'"),
    ],
    ids=["unnamed", "named", "named-later"],
)
def test_init_process_group_names_the_process_after_its_rank(
    tmp_path: Path, args: tuple[str, ...], labels: str
) -> None:
    """A process whose scope table exists is labelled ``rank N`` by init_process_group
    (its global rank), until destroy_process_group; a label the process set itself
    stays, and its ring says it too, so that the records of the other ranks name it
    so (they said ``rank 0``). (No watchdog answers in this directory: the process
    enforces its scopes in-process and says so.)"""
    done = run_program(tmp_path, LABEL, *args)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == labels


ENV_RANK = """
import torch
import torch.distributed as dist

dist.init_process_group("gloo")  # rank, world size and address from the environment
dist.all_reduce(torch.ones(3))
dist.barrier()
dist.destroy_process_group()
"""


# The same ranks, meeting through a store of their own wrapped in a PrefixStore.
PREFIXED_STORE = ENV_RANK.replace(
    'dist.init_process_group("gloo")  # rank, world size and address from the environment',
    """import datetime
import os

rank = int(os.environ["RANK"])
tcp = dist.TCPStore(
    "127.0.0.1", int(os.environ["MASTER_PORT"]), 2, rank == 0,
    timeout=datetime.timedelta(seconds=60),
)
dist.init_process_group("gloo", store=dist.PrefixStore("job", tcp), rank=rank, world_size=2)""",
)


@pytest.mark.parametrize("program_text", [ENV_RANK, PREFIXED_STORE], ids=["env", "prefix_store"])
def test_env_style_ranks_are_recorded_as_one_world(tmp_path: Path, program_text: str) -> None:
    """Ranks started the way torchrun starts them: RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT in their environment, init_process_group without arguments; or with a
    store of their own in a PrefixStore, which names the place of the store it wraps."""
    program = tmp_path / "program.py"
    program.write_text(program_text, encoding="utf-8")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = session_env(tmp_path, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    procs = [
        subprocess.Popen(
            [sys.executable, "-W", "error", str(program)],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            cwd=tmp_path,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        errors = [proc.communicate(timeout=TIMEOUT)[1] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [proc.returncode for proc in procs] == [0, 0], errors
    rings = sorted(col.read_rings(col.ring_paths(str(tmp_path))), key=lambda r: r.rank)
    assert [(r.rank, r.world, r.label, r.pid) for r in rings] == [
        (rank, 2, f"rank {rank}", proc.pid) for rank, proc in enumerate(procs)
    ]
    world = f"tcp://127.0.0.1:{port}" if program_text == ENV_RANK else f"TCPStore:127.0.0.1:{port}"
    assert {r.world_id for r in rings} == {world}
    for ring in rings:
        assert [(e.op, e.seq, e.state) for e in ring.entries] == [
            ("init_process_group", 0, col.COMPLETED),
            ("all_reduce", 1, col.COMPLETED),
            ("barrier", 2, col.COMPLETED),
        ]


FORKED_RANKS = """
import multiprocessing
import os
import socket
import sys

import torch
import torch.distributed as dist


def rank_main(rank, port):
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )
    dist.all_reduce(torch.ones(2))
    dist.destroy_process_group()
    if rank == 1 and sys.argv[1] == "crash":
        os._exit(3)


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = multiprocessing.get_context("fork")
    ranks = [context.Process(target=rank_main, args=(r, port)) for r in (0, 1)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(60)
    print([process.exitcode for process in ranks])
"""


@pytest.mark.parametrize("how", ["return", "crash"])
def test_a_forked_rank_that_returned_exited_and_one_that_crashed_died(
    tmp_path: Path, how: str
) -> None:
    """multiprocessing's forked children end through os._exit, after its own exit
    functions and not atexit's: one that returned still reads as exited."""
    done = run_program(tmp_path, FORKED_RANKS, how)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ("[0, 0]" if how == "return" else "[0, 3]")
    rings = sorted(col.read_rings(col.ring_paths(str(tmp_path))), key=lambda r: r.rank)
    assert [r.rank for r in rings] == [0, 1]
    assert [col.died(r) for r in rings] == ([False, False] if how == "return" else [False, True])
