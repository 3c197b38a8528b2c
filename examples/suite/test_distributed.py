"""A two-rank gloo job where rank 0 hangs in all_reduce because rank 1 never joins."""

import os
import socket
import time

import pytest

import pytest_elastic_timer as et

torch = pytest.importorskip("torch", reason="the distributed demo needs torch")
dist = pytest.importorskip("torch.distributed")
mp = pytest.importorskip("torch.multiprocessing")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, world: int, port: int) -> None:
    os.environ["RANK"] = str(rank)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    et.set_label(f"rank {rank}")
    if rank == 1:
        time.sleep(3600)  # rank 1 never reaches the collective: rank 0 waits forever
    with et.expires(after=2, scope="allreduce"):
        dist.all_reduce(torch.ones(4))


@pytest.mark.hangs("allreduce")
@pytest.mark.expires(30)
def test_rank_hangs_in_allreduce():
    mp.spawn(_rank, args=(2, _free_port()), nprocs=2, join=True)
