"""The collectives ring and its alignment, without torch: unit cases and properties.

Rings are written with :class:`RingWriter` exactly as the recorder writes them (one per
simulated rank, in a temporary session directory) and read back the way the watchdog
reads them, so the format and the analysis are tested together.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_elastic_timer.core import collectives as col

NOW = 1000.0
SITE = b"/work/train.py:40"


class Rank:
    """One simulated rank: its ring, and the sequence numbers the recorder keeps."""

    def __init__(self, directory: Path, rank: int, world: int, *, world_id: str = "w") -> None:
        self.rank = rank
        # A pid of its own in the file name and the header, as separate processes have.
        self.writer = col.RingWriter(col.ring_path(str(directory), 10_000 + rank))
        self.writer.words[col.H_PID] = 10_000 + rank
        self.writer.set_rank(rank, world, f"rank {rank}")
        self.writer.set_text(col.T_WORLD_ID, world_id)
        self.writer.set_text(col.T_NODEID, "test_x.py::test_y")
        self.writer.add_group(col.DEFAULT_GROUP, range(world))
        self.seqs: dict[str, int] = {}
        self.clock = itertools.count(1)

    def init(self, *, done: bool = True) -> int:
        serial = self.writer.begin(
            col.INIT, b"init_process_group", b"default", 0, -1, SITE, b"", 1, 1.0
        )
        if done:
            self.writer.complete(serial, end=2.0)
        return serial

    def op(
        self,
        name: str,
        *,
        done: bool = True,
        group: str = col.DEFAULT_GROUP,
        tensors: bytes = b"float32[4]",
        kind: int = col.COLLECTIVE,
        peer: int = -1,
        site: bytes = SITE,
    ) -> int:
        if kind == col.COLLECTIVE:
            seq = self.seqs[group] = self.seqs.get(group, 0) + 1
        else:
            key = f"{group}/{kind}/{peer}"
            seq = self.seqs[key] = self.seqs.get(key, 0) + 1
        start = 10.0 + next(self.clock)
        serial = self.writer.begin(
            kind, name.encode(), group.encode(), seq, peer, site, tensors, 1, start
        )
        if done:
            self.writer.complete(serial, end=start + 0.5)
        return serial

    def ring(self) -> col.Ring:
        ring = col.read_ring(self.writer.path)
        assert ring is not None
        return ring


@pytest.fixture
def ranks(tmp_path: Path) -> Iterator[Any]:
    made: list[Rank] = []

    def make(world: int, **kwargs: Any) -> list[Rank]:
        new = [Rank(tmp_path, r, world, **kwargs) for r in range(world)]
        made.extend(new)
        for rank in new:
            rank.init()
        return new

    yield make
    for rank in made:
        rank.writer.close()


def rings(ranks: list[Rank]) -> list[col.Ring]:
    return [r.ring() for r in ranks]


def where_and_who(found: dict[str, Any]) -> tuple[str, int, list[int], list[int]]:
    """The op and sequence number of a ``collective`` field, who waits, who is missing."""
    return (found["op"], found["seq"], found["waiting"], found["missing"])


# -- the ring ------------------------------------------------------------------------
def test_layout_constants() -> None:
    assert col.ENTRY_SIZE == 512
    assert struct.pack("<Q", col.MAGIC) == b"PETCOL01"
    assert col.FILE_SIZE == col.HEADER_SIZE + col.GROUPS_SIZE + col.CAPACITY * 512


def test_a_ring_reads_back_what_its_process_wrote(tmp_path: Path) -> None:
    writer = col.RingWriter(col.ring_path(str(tmp_path), os.getpid()))
    try:
        writer.set_rank(3, 4, "rank 3")
        writer.set_text(col.T_NODEID, "test_a.py::test_b")
        writer.set_text(col.T_WORLD_ID, "tcp://127.0.0.1:29500")
        writer.add_group("default", range(4))
        writer.add_group("5", [1, 3])
        first = writer.begin(
            col.COLLECTIVE, b"all_reduce", b"5", 1, -1, SITE, b"float32[2,3]", 7, 5.0
        )
        second = writer.begin(col.SEND, b"send", b"default", 1, 0, SITE, b"int64[1]", 7, 6.0)
        writer.complete(first, end=5.5)
        ring = col.read_ring(writer.path)
    finally:
        writer.close()
    assert ring is not None
    assert (ring.pid, ring.rank, ring.world, ring.label) == (os.getpid(), 3, 4, "rank 3")
    assert (ring.nodeid, ring.world_id) == ("test_a.py::test_b", "tcp://127.0.0.1:29500")
    assert ring.groups == {"default": [0, 1, 2, 3], "5": [1, 3]}
    assert ring.starttime == col.process_starttime(os.getpid()) > 0
    assert not ring.exited
    done, sending = ring.entries
    assert (done.serial, done.op, done.group, done.seq, done.state) == (
        first,
        "all_reduce",
        "5",
        1,
        col.COLLECTIVE + 2,
    )
    assert (done.start, done.end, done.site, done.shapes, done.dtypes) == (
        5.0,
        5.5,
        SITE.decode(),
        [[2, 3]],
        ["float32"],
    )
    assert (sending.serial, sending.kind, sending.peer, sending.started) == (
        second,
        col.SEND,
        0,
        True,
    )
    assert sending.describe() == "send #1 to rank 0"
    assert ring.blocked() == sending and ring.last() == sending


def test_a_ring_keeps_the_last_capacity_ops(tmp_path: Path) -> None:
    writer = col.RingWriter(col.ring_path(str(tmp_path), os.getpid()))
    try:
        for seq in range(1, col.CAPACITY + 11):
            serial = writer.begin(
                col.COLLECTIVE, b"all_reduce", b"default", seq, -1, SITE, b"", 1, float(seq)
            )
            writer.complete(serial, end=seq + 0.1)
        ring = col.read_ring(writer.path)
    finally:
        writer.close()
    assert ring is not None
    assert [e.seq for e in ring.entries] == list(range(11, col.CAPACITY + 11))


def test_a_completion_for_a_reused_entry_is_dropped(tmp_path: Path) -> None:
    """An async op's work completing on another thread after its entry was reused
    must not mark the newer op completed."""
    writer = col.RingWriter(col.ring_path(str(tmp_path), os.getpid()), capacity=2)
    try:
        old = writer.begin(col.COLLECTIVE, b"all_reduce", b"default", 1, -1, SITE, b"", 1, 1.0)
        writer.begin(col.COLLECTIVE, b"broadcast", b"default", 2, -1, SITE, b"", 1, 2.0)
        newer = writer.begin(col.COLLECTIVE, b"barrier", b"default", 3, -1, SITE, b"", 1, 3.0)
        writer.complete(old)
        ring = col.read_ring(writer.path)
    finally:
        writer.close()
    assert ring is not None
    assert [(e.serial, e.started) for e in ring.entries] == [(2, True), (newer, True)]


def test_a_torn_entry_is_skipped(tmp_path: Path) -> None:
    writer = col.RingWriter(col.ring_path(str(tmp_path), os.getpid()))
    try:
        writer.begin(col.COLLECTIVE, b"all_reduce", b"default", 1, -1, SITE, b"", 1, 1.0)
        writer.begin(col.COLLECTIVE, b"all_reduce", b"default", 2, -1, SITE, b"", 1, 2.0)
        writer.entry_words[0] = 0  # the first entry's first word: being rewritten
        ring = col.read_ring(writer.path)
    finally:
        writer.close()
    assert ring is not None and [e.seq for e in ring.entries] == [2]


def test_anything_else_is_not_a_ring(tmp_path: Path) -> None:
    other = tmp_path / f"{col.PREFIX}1-x"
    other.write_bytes(b"\0" * col.FILE_SIZE)
    assert col.read_ring(str(other)) is None
    other.write_bytes(b"short")
    assert col.read_ring(str(other)) is None
    assert col.read_ring(str(tmp_path / "missing")) is None


def test_whose_ring_it_is_reads_from_its_header_alone(ranks: Any, tmp_path: Path) -> None:
    """A long session leaves many rings: they are told apart by their headers, and
    only the rings looked for are read whole."""
    zero, _ = ranks(2)
    zero.op("all_reduce")
    header, whole = col.read_ring(zero.writer.path, header_only=True), zero.ring()
    assert header is not None and (header.entries, header.groups) == ([], {})
    assert header.header_only and not whole.header_only
    fields = ("path", "pid", "rank", "world", "created", "label", "nodeid", "world_id")
    assert [getattr(header, f) for f in fields] == [getattr(whole, f) for f in fields]
    found = col.rings_of_test(str(tmp_path), "test_x.py::test_y")
    assert [(r.rank, len(r.entries)) for r in found] == [(0, 2), (1, 1)]
    cut = tmp_path / "collectives-1-cut"
    cut.write_bytes(Path(zero.writer.path).read_bytes()[: col.HEADER_SIZE])
    assert col.read_ring(str(cut), header_only=True) is None  # not a whole ring file


def test_process_liveness_by_pid_and_start_time() -> None:
    me = os.getpid()
    started = col.process_starttime(me)
    assert col.process_alive(me, started)
    assert not col.process_alive(me, started + 1)  # a later process with this pid
    assert not col.process_alive(2**22 + 1, 0)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["float32", "int64", "bfloat16", "complex64"]),
            st.lists(st.integers(min_value=0, max_value=10**6), max_size=5).map(tuple),
        ),
        max_size=12,
    )
)
def test_tensor_descriptions_round_trip_or_cut_at_a_whole_tensor(items: list[Any]) -> None:
    text = col.encode_tensors(items)
    assert len(text) <= 160
    decoded = col.decode_tensors(text.decode())
    assert decoded == [(d, list(s)) for d, s in items[: len(decoded)]]


# -- alignment: cases ----------------------------------------------------------------
def test_nothing_to_align_when_no_rank_is_inside_an_op(ranks: Any) -> None:
    zero, one = ranks(2)
    zero.op("all_reduce")
    one.op("all_reduce")
    assert col.align(rings([zero, one]), NOW) is None


def test_a_rank_that_never_reaches_all_reduce_is_missing(ranks: Any) -> None:
    zero, one = ranks(2)
    for rank in (zero, one):
        rank.op("all_reduce")
        rank.op("broadcast")
    zero.op("all_reduce", done=False)
    found = col.align(rings([zero, one]), NOW)
    assert found is not None
    assert {k: found[k] for k in ("group", "seq", "op", "waiting", "missing", "mismatch")} == {
        "group": "default",
        "seq": 3,
        "op": "all_reduce",
        "waiting": [0],
        "missing": [1],
        "mismatch": None,
    }
    waiting, missing = found["ranks"]["0"], found["ranks"]["1"]
    assert waiting == {
        "op": "all_reduce",
        "seq": 3,
        "state": "started",
        "site": SITE.decode(),
        "shapes": [[4]],
        "since": pytest.approx(NOW - waiting_start(zero)),
        "group": "default",
        "peer": -1,
        "pid": 10_000,
        "ended": "",
    }
    assert (missing["op"], missing["seq"], missing["state"]) == ("broadcast", 2, "completed")
    line = col.collective_line(found, {1: STACK})
    assert line.startswith("collective all_reduce #3 (group default, 2 ranks): rank 0 waiting ")
    assert (
        "at train.py:40; rank 1 missing, last completed broadcast #2, now in serve at train.py:52"
        in line
    )
    # Once the ranks are gone, the one that was in the op reads as such.
    ended = col.collective_line(found, {1: STACK}, ended=True)
    assert "(group default, 2 ranks): rank 0 was in it at train.py:40; rank 1 missing" in ended


def waiting_start(rank: Rank) -> float:
    blocked = rank.ring().blocked()
    assert blocked is not None
    return blocked.start


STACK = """\
Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait

Current thread 0x00007f0000000002 (most recent call first):
  File "/work/train.py", line 52 in serve
  File "/work/train.py", line 60 in main
"""


def test_the_innermost_frame_of_the_current_thread() -> None:
    assert col.innermost_frame(STACK) == "serve at train.py:52"
    inside = STACK.replace(
        '  File "/work/train.py", line 52',
        '  File "/x/torch/distributed/distributed_c10d.py", line 9 in all_reduce\n'
        '  File "/work/train.py", line 52',
    )
    assert col.innermost_frame(inside) == "serve at train.py:52"
    assert col.innermost_frame("") == ""


def test_ranks_in_different_ops_at_one_sequence_number_are_an_op_mismatch(ranks: Any) -> None:
    zero, one = ranks(2)
    zero.op("broadcast")
    one.op("broadcast")
    zero.op("all_reduce", done=False)
    one.op("broadcast", done=False)
    found = col.align(rings([zero, one]), NOW)
    assert found is not None
    assert (found["seq"], found["op"], found["waiting"], found["missing"], found["mismatch"]) == (
        2,
        "all_reduce",
        [0, 1],
        [],
        "op",
    )
    assert (found["ranks"]["1"]["op"], found["ranks"]["1"]["seq"]) == ("broadcast", 2)
    line = col.collective_line(found)
    assert "rank 0 waiting" in line and "in all_reduce" in line and "in broadcast" in line
    assert line.endswith("op mismatch at this sequence number")


def test_one_op_with_different_shapes_is_a_shape_mismatch(ranks: Any) -> None:
    zero, one, two = ranks(3)
    zero.op("all_reduce", done=False, tensors=b"float32[4]")
    one.op("all_reduce", done=False, tensors=b"float32[5]")
    found = col.align(rings([zero, one, two]), NOW)
    assert found is not None
    assert (found["waiting"], found["missing"], found["mismatch"]) == ([0, 1], [2], "shape")
    assert found["ranks"]["2"]["state"] == "completed"  # its init
    assert "rank 0 [[4]], rank 1 [[5]]" in col.collective_line(found)


def test_shapes_may_differ_where_the_op_allows_it(ranks: Any) -> None:
    zero, one = ranks(2)
    zero.op("gather", done=False, tensors=b"float32[4];float32[4];float32[4]")
    one.op("gather", done=False, tensors=b"float32[4]")
    found = col.align(rings([zero, one]), NOW)
    assert found is not None and found["mismatch"] is None


def test_a_rank_without_a_ring_is_missing_with_no_op(ranks: Any) -> None:
    zero, one, _ = ranks(3)
    zero.op("barrier", done=False, tensors=b"")
    one.op("barrier", done=False, tensors=b"")
    found = col.align(rings([zero, one]), NOW)
    assert found is not None
    assert (found["waiting"], found["missing"]) == ([0, 1], [2])
    assert found["ranks"]["2"] == {
        "op": "",
        "seq": 0,
        "state": "none",
        "site": "",
        "shapes": [],
        "since": 0.0,
        "group": "",
        "peer": -1,
        "pid": 0,
        "ended": "",
    }
    assert "ranks 0, 1 waiting" in col.collective_line(
        found
    ) or "rank 0 waiting" in col.collective_line(found)
    assert "rank 2 missing, no op recorded" in col.collective_line(found)


def test_a_rank_stuck_in_the_rendezvous(tmp_path: Path) -> None:
    zero = Rank(tmp_path, 0, 2)
    try:
        zero.init(done=False)
        found = col.align([zero.ring()], NOW)
    finally:
        zero.writer.close()
    assert found is not None
    assert where_and_who(found) == (
        "init_process_group",
        0,
        [0],
        [1],
    )


def test_subgroups_count_their_own_sequence_numbers(ranks: Any) -> None:
    zero, one, two = ranks(3)
    for rank in (zero, one, two):
        rank.writer.add_group("1", [0, 2])
    for rank in (zero, one, two):
        rank.op("all_reduce")
    zero.op("all_reduce", group="1", done=False)
    one.op("all_reduce", done=False)  # the world's #2: never joined by the others
    found = col.align(rings([zero, one, two]), NOW)
    assert found is not None
    assert (found["group"], found["seq"], found["waiting"], found["missing"]) == ("1", 1, [0], [2])
    assert set(found["ranks"]) == {"0", "2"}


def test_a_recv_whose_sender_never_sent(ranks: Any) -> None:
    zero, one = ranks(2)
    one.op("recv", kind=col.RECV, peer=0)
    zero.op("send", kind=col.SEND, peer=1)
    one.op("recv", kind=col.RECV, peer=0, done=False)
    found = col.align(rings([zero, one]), NOW)
    assert found is not None
    assert where_and_who(found) == ("recv", 2, [1], [0])
    assert (found["ranks"]["0"]["op"], found["ranks"]["0"]["seq"]) == ("send", 1)
    line = col.collective_line(found)
    assert line.startswith("recv #2 from rank 0 (group default): rank 1 waiting "), line
    assert "rank 0 missing, last completed send #1 to rank 1" in line, line


def test_a_send_to_the_wrong_rank_is_named_beside_the_pair_that_waits(ranks: Any) -> None:
    zero, one, _ = ranks(3)
    zero.op("send", kind=col.SEND, peer=1, done=False)  # rank 1 receives from 2 instead
    one.op("recv", kind=col.RECV, peer=2, done=False)
    found = col.align(rings([zero, one]), NOW)
    assert found is not None
    assert (found["op"], found["peer"], found["waiting"], found["missing"]) == ("send", 1, [0], [1])
    line = col.collective_line(found)
    assert line.startswith("send #1 to rank 1 (group default): rank 0 waiting "), line
    assert "rank 1 missing, in recv #1 from rank 2 at train.py:40" in line, line


def test_two_ranks_that_both_receive_from_each_other_are_told(ranks: Any) -> None:
    zero, one = ranks(2)
    zero.op("recv", kind=col.RECV, peer=1, done=False)
    one.op("recv", kind=col.RECV, peer=0, done=False)
    found = col.align(rings([zero, one]), NOW)
    assert found is not None
    line = col.collective_line(found)
    assert "rank 1 missing, in recv #1 from rank 0 at train.py:40" in line, line
    assert line.endswith("ranks 0 and 1 both receive from each other: nothing matches"), line


def test_every_rank_blocked_in_a_point_to_point_op_is_named(ranks: Any) -> None:
    zero, one, two = ranks(3)
    one.op("recv", kind=col.RECV, peer=2, done=False)  # first in: waits for rank 2
    zero.op("all_reduce")
    zero.op("send", kind=col.SEND, peer=1, done=False)  # then rank 0 waits for rank 1
    two.op("all_reduce")  # rank 2 is elsewhere
    found = col.align(rings([zero, one, two]), NOW)
    assert found is not None
    assert (found["peer"], found["waiting"], found["missing"], found["blocked"]) == (
        2,
        [1],
        [2],
        [0],
    )
    line = col.collective_line(found)
    assert line.startswith("recv #1 from rank 2 (group default): rank 1 waiting "), line
    assert "rank 0 also blocked, in send #1 to rank 1 at train.py:40" in line, line


def test_a_rank_that_made_a_new_world_counts_from_its_new_init(ranks: Any) -> None:
    zero, one = ranks(2)
    for rank in (zero, one):
        rank.op("all_reduce")
        rank.op("all_reduce")
        rank.init()  # destroy_process_group, then a new init_process_group
        rank.seqs.clear()
    zero.op("all_reduce", done=False)
    found = col.align(rings([zero, one]), NOW)
    assert found is not None
    assert (found["seq"], found["missing"]) == (1, [1])
    assert found["ranks"]["1"]["op"] == "init_process_group"


def test_the_world_of_a_rank_comes_from_the_rings_of_its_test(ranks: Any, tmp_path: Path) -> None:
    zero, one = ranks(2)
    (tmp_path / "stale").mkdir()
    stale = Rank(tmp_path / "stale", 1, 2)  # a rank 1 of another test on the same port
    stale.writer.set_text(col.T_NODEID, "test_x.py::test_other")
    other_world = ranks(2, world_id="elsewhere")
    try:
        found = col.world_of([zero.ring()], [one.ring(), stale.ring(), *rings(other_world)])
    finally:
        stale.writer.close()
    assert [(r.rank, r.path) for r in found] == [(0, zero.writer.path), (1, one.writer.path)]


def test_a_test_that_made_two_worlds_shows_the_one_that_failed(ranks: Any, tmp_path: Path) -> None:
    """Four ranks that passed, then two that met on the same port, where rank 1 died:
    the failure lists those two. It listed ranks 2 and 3 of the first world beside
    them, and a rank of the second world took its larger world's stale ranks along."""
    first = ranks(4)
    for rank in first:
        rank.op("all_reduce")
        rank.writer.mark_exited()
    zero, one = ranks(2)
    zero.op("all_reduce", done=False)
    one.writer.words[col.H_PID] = dead_pid()
    found = col.rings_of_test(str(tmp_path), "test_x.py::test_y")
    assert [r.path for r in found] == [zero.writer.path, one.writer.path]
    met = col.world_of([zero.ring()], rings([*first, one]))
    assert [r.path for r in met] == [zero.writer.path, one.writer.path]


# -- alignment: properties -----------------------------------------------------------
OPS = st.sampled_from(["all_reduce", "broadcast", "all_gather", "barrier", "reduce_scatter"])


@settings(max_examples=60, deadline=None)
@given(
    world=st.integers(min_value=2, max_value=6),
    program=st.lists(OPS, min_size=1, max_size=12),
    data=st.data(),
)
def test_a_hang_in_a_correct_program_names_who_waits_and_who_is_missing(
    tmp_path_factory: pytest.TempPathFactory, world: int, program: list[str], data: Any
) -> None:
    """All ranks run the same program; every rank got as far as op ``stop``, some went
    into it and wait there, the others are somewhere else. The alignment names op
    ``stop`` and exactly those two sets of ranks, with no mismatch."""
    stop = data.draw(st.integers(min_value=0, max_value=len(program) - 1))
    arrived = data.draw(
        st.sets(st.integers(min_value=0, max_value=world - 1), min_size=1, max_size=world - 1)
    )
    directory = tmp_path_factory.mktemp("rings")
    sim = [Rank(directory, r, world) for r in range(world)]
    try:
        for rank in sim:
            rank.init()
            for name in program[:stop]:
                rank.op(name)
            if rank.rank in arrived:
                rank.op(program[stop], done=False)
        found = col.align(rings(sim), NOW)
    finally:
        for rank in sim:
            rank.writer.close()
    assert found is not None
    assert (found["op"], found["seq"], found["group"]) == (program[stop], stop + 1, "default")
    assert found["waiting"] == sorted(arrived)
    assert found["missing"] == sorted(set(range(world)) - arrived)
    assert found["mismatch"] is None
    assert sorted(found["ranks"], key=int) == [str(r) for r in range(world)]
    for rank in found["missing"]:
        view = found["ranks"][str(rank)]
        assert view["state"] == "completed"
        assert (view["op"], view["seq"]) == (
            (program[stop - 1], stop) if stop else ("init_process_group", 0)
        )


@settings(max_examples=40, deadline=None)
@given(
    world=st.integers(min_value=2, max_value=5),
    ops=st.lists(OPS, min_size=2, max_size=5, unique=True),
    data=st.data(),
)
def test_ranks_blocked_in_different_ops_at_one_number_are_always_an_op_mismatch(
    tmp_path_factory: pytest.TempPathFactory, world: int, ops: list[str], data: Any
) -> None:
    choice = [data.draw(st.sampled_from(ops)) for _ in range(world)]
    if len(set(choice)) == 1:
        choice[0] = next(op for op in ops if op != choice[1])
    directory = tmp_path_factory.mktemp("rings")
    sim = [Rank(directory, r, world) for r in range(world)]
    try:
        for rank in sim:
            rank.init()
            rank.op("all_reduce")
            rank.op(choice[rank.rank], done=False)
        found = col.align(rings(sim), NOW)
    finally:
        for rank in sim:
            rank.writer.close()
    assert found is not None
    assert (found["seq"], found["mismatch"], found["missing"]) == (2, "op", [])
    assert found["waiting"] == list(range(world))


# -- what the watchdog, the plugin and the trace take from the rings -----------------
def test_the_collective_of_an_expiry_comes_from_its_processes_and_their_world(
    ranks: Any, tmp_path: Path
) -> None:
    """The owner of the expired scope is rank 0 alone (under mp.spawn the other rank
    is its sibling): rank 1's ring is found by the world they share."""
    zero, _ = ranks(2)
    zero.op("all_reduce", done=False)
    owner = zero.ring().pid
    found = col.collective_for(str(tmp_path), [owner], NOW)
    assert found is not None and (found["waiting"], found["missing"]) == ([0], [1])
    assert col.collective_for(str(tmp_path), [424242], NOW) is None  # no ring: not a rank
    assert col.labels(str(tmp_path), [owner]) == {owner: "rank 0"}


def test_a_record_with_a_collective_matches_the_schema_and_says_it_in_one_line(
    ranks: Any,
) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    from pytest_elastic_timer.ci import reports as ci_reports
    from pytest_elastic_timer.core import records, schema

    zero, one = ranks(2)
    one.op("broadcast")
    zero.op("broadcast")
    zero.op("all_reduce", done=False, tensors=b"float32[4];int64[2,2]")
    record = records.ExpiryRecord(
        nodeid="test_x.py::test_y",
        scope="allreduce",
        budget=2.0,
        elapsed=3.0,
        pid=zero.ring().pid,
        label="rank 0",
        worker="",
        file="/work/train.py",
        line=40,
        action="terminated",
        stack="",
        children=[{"pid": one.ring().pid, "label": "rank 1", "stack": STACK}],
        collective=col.align(rings([zero, one]), NOW),
    )
    report = {"version": 1, "expired": [record.to_json()], "session": SESSION}
    validator = jsonschema.Draft202012Validator(ci_reports.report_schema())
    validator.validate(report)
    # The package's own check (the merge command's) reads the schema alike.
    assert schema.violations(report, ci_reports.report_schema()) == []
    collective: dict[str, Any] = report["expired"][0]["collective"]  # type: ignore[index]
    collective["ranks"]["zero"] = collective["ranks"]["0"]  # ranks are named by numbers
    assert not validator.is_valid(report)
    assert schema.violations(report, ci_reports.report_schema()) == [
        "$.expired[0].collective.ranks.zero (name): 'zero' does not match '^[0-9]+$'"
    ]
    del collective["ranks"]["zero"]
    assert record.to_json()["collective"]["ranks"]["0"]["shapes"] == [[4], [2, 2]]
    text = records.format_record(record)
    (line,) = [s for s in text.splitlines() if s.startswith("  collective ")]
    assert line.startswith("  collective all_reduce #2 (group default, 2 ranks): rank 0 waiting ")
    assert line.endswith(
        "at train.py:40; rank 1 missing, last completed broadcast #1, now in serve at train.py:52"
    )
    record.collective = None
    assert "collective" not in record.to_json()
    assert "collective" not in records.format_record(record)
    assert records.ExpiryRecord.from_json(record.to_json()).collective is None


SESSION = {
    "pid": 1,
    "started": 0.0,
    "ended": 1.0,
    "workers": [],
    "expires": 0,
    "grace": 2.0,
    "scale": 1.0,
    "root_died": False,
    "host": "h",
}


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_rank_that_died_in_an_op_is_told_apart_from_one_that_exited(ranks: Any) -> None:
    zero, one = ranks(2)
    for rank in (zero, one):
        rank.op("all_reduce")
        rank.writer.set_text(col.T_NODEID, "test_x.py::test_died")
    zero.op("all_reduce", done=False, tensors=b"float32[4]")
    one.op("all_reduce", done=False, tensors=b"float32[1000]")
    zero.writer.words[col.H_PID] = dead_pid()  # aborted by gloo: no normal exit
    one.writer.words[col.H_PID] = dead_pid()
    one.writer.mark_exited()
    found = col.rings_of_test(str(zero.ring().path.rsplit("/", 1)[0]), "test_x.py::test_died")
    assert [r.rank for r in found] == [0, 1]
    assert [col.died(r) for r in found] == [True, False]
    text = col.ranks_text(found, NOW).splitlines()
    assert text[0].startswith(
        f"rank 0, pid {found[0].pid} (died): in all_reduce #2 (group default) at "
    )
    assert text[0].endswith("at train.py:40, float32[4]; last completed all_reduce #1")
    assert text[1].startswith(f"rank 1, pid {found[1].pid} (exited): in all_reduce #2")
    assert "shape mismatch: rank 0 [[4]], rank 1 [[1000]]" in text[2]


def test_every_recorded_op_is_a_trace_event(ranks: Any) -> None:
    zero, _ = ranks(2)
    zero.op("all_reduce")
    zero.op("broadcast", done=False)
    events = col.trace_events([zero.ring()])
    assert [(e["name"], e["state"], e["end"] is None) for e in events] == [
        ("init_process_group #0", "completed", False),
        ("all_reduce #1", "completed", False),
        ("broadcast #2", "started", True),
    ]
    assert {e["label"] for e in events} == {"rank 0"}


def test_the_rings_as_they_stood_at_the_deadline(ranks: Any) -> None:
    """A record is made after the ladder (the ranks may be gone by then): the rings are
    read as they stood at the deadline, later ops left out, later ends undone."""
    zero, one = ranks(2)
    zero.op("all_reduce")  # 11.0 - 11.5
    one.op("all_reduce")
    zero.op("all_reduce")  # starts 12.0, ends 12.5
    one.op("broadcast")  # starts 12.0, never matched: rank 0 moved on before it
    before = col.as_of(zero.ring(), 12.2)
    assert [(e.seq, e.started, e.end) for e in before.current()[1:]] == [
        (1, False, 11.5),
        (2, True, 0.0),
    ]
    assert [e.seq for e in col.as_of(zero.ring(), 11.2).current()[1:]] == [1]
    found = col.collective_for(str(zero.ring().path.rsplit("/", 1)[0]), [10_000], 12.2)
    assert found is not None and (found["seq"], found["mismatch"]) == (2, "op")
    assert found["ranks"]["0"]["since"] == pytest.approx(0.2)


def test_the_watchdog_names_ranks_and_adds_the_collective_to_a_record(ranks: Any) -> None:
    from pytest_elastic_timer.core import records
    from pytest_elastic_timer.watchdog.collectives import CollectivesAmender

    zero, _ = ranks(2)
    zero.op("all_reduce", done=False)
    directory = zero.ring().path.rsplit("/", 1)[0]
    record = records.ExpiryRecord(
        "t.py::t", "t::call", 2.0, 2.1, 4242, "", "", "t.py", 1, "interrupted", "",
        children=[{"pid": 10_000, "label": "rank 7"}, {"pid": 10_001, "label": ""}, {"pid": 5}],
        deadline=NOW,
    )  # fmt: skip
    CollectivesAmender(directory, dict)(record)
    assert [c.get("label") for c in record.children] == ["rank 0", "rank 1", None]
    assert record.collective is not None and record.collective["missing"] == [1]
    elsewhere = dataclasses.replace(record, host="node-2", collective=None)
    CollectivesAmender(directory, dict)(elsewhere)
    assert elsewhere.collective is None  # another host's rings are not here
    # Rank 0's process ended inside the op before the deadline (an earlier escalation
    # ended it): it died in it, it does not wait in it. Ended after: it still waited.
    for ended_at, waiting, died in ((NOW - 5, [0], [0]), (NOW + 1, [0], [])):
        again = dataclasses.replace(record, collective=None)
        CollectivesAmender(directory, functools.partial(dict, {10_000: ended_at}))(again)
        assert again.collective is not None
        assert (again.collective["waiting"], again.collective["died"]) == (waiting, died)


def test_a_rank_that_ended_inside_the_op_died_in_it_and_does_not_wait(ranks: Any) -> None:
    zero, one, two = ranks(3)
    for rank in (zero, one, two):
        rank.op("all_reduce")
    zero.op("all_reduce", done=False)  # the first in: ended there by an earlier expiry
    one.op("all_reduce", done=False)
    found = col.align(rings([zero, one, two]), NOW, gone={zero.writer.words[col.H_PID]})
    assert found is not None
    assert (found["op"], found["seq"]) == ("all_reduce", 2)
    # It reached the op, so it stays among those that did; "died" says it no longer waits.
    assert (found["waiting"], found["died"], found["missing"]) == ([0, 1], [0], [2])
    line = col.collective_line(found)
    assert "rank 1 waiting" in line and "rank 0 died in it at train.py:40" in line
    assert "rank 0 waiting" not in line and "rank 2 missing, last completed all_reduce #1" in line


def test_a_missing_rank_in_an_op_of_another_group_names_that_group(ranks: Any) -> None:
    ranks_ = ranks(4)
    for rank in ranks_:
        rank.writer.add_group("1", [2, 3])
        rank.op("all_reduce")
    zero, one, two, _ = ranks_
    zero.op("all_reduce", done=False)
    one.op("all_reduce", done=False)
    two.op("all_reduce", group="1", done=False)  # its partner, rank 3, never comes
    found = col.align(rings(ranks_), NOW)
    assert found is not None and found["group"] == "default"
    assert found["ranks"]["2"]["group"] == "1"
    assert "rank 2 missing, in all_reduce #1 (group 1) at train.py:40" in col.collective_line(found)


def test_a_send_never_waited_for_is_not_where_its_rank_blocks(ranks: Any) -> None:
    """An isend (alone, or one op of a batch_isend_irecv) stays open in the ring until it
    is waited for, while its rank goes on to the all_reduce it blocks in. The isend was
    named, with nobody missing."""
    zero, one = ranks(2)
    zero.op("isend", kind=col.SEND, peer=1, done=False)
    one.op("recv", kind=col.RECV, peer=0)
    zero.op("all_reduce", done=False)  # rank 1 never comes
    found = col.align(rings([zero, one]), NOW)
    assert found is not None and where_and_who(found) == ("all_reduce", 1, [0], [1])


def test_async_collectives_are_waited_for_oldest_first(ranks: Any) -> None:
    """Rank 0 issued all_reduce #3 to #5 with async_op=True and waits for #3; rank 1
    never got past #2. The first op where they part is #3."""
    zero, one = ranks(2)
    for rank in (zero, one):
        rank.op("all_reduce")
        rank.op("all_reduce")
    for _ in range(3):
        zero.op("all_reduce", done=False)
    found = col.align(rings([zero, one]), NOW)
    assert found is not None and where_and_who(found) == ("all_reduce", 3, [0], [1])


def test_the_owners_collective_is_the_one_of_its_record(ranks: Any) -> None:
    """Two groups hang, each for a reason of its own: the record of a scope of rank 2
    names rank 2's collective, whichever rank has waited longest. It named group 1's,
    where neither rank 2 nor its missing partner appears."""
    ranks_ = ranks(4)
    for rank in ranks_:
        rank.writer.add_group("1", [0, 1])
        rank.writer.add_group("2", [2, 3])
    zero, _, two, _ = ranks_
    zero.op("all_reduce", group="1", done=False)  # first in: waits for rank 1
    two.op("all_reduce", group="2", done=False)  # waits for rank 3
    owner = two.ring().pid
    found = col.align(rings(ranks_), NOW, owners={owner})
    assert found is not None
    assert (found["group"], found["waiting"], found["missing"]) == ("2", [2], [3])
    anyone = col.align(rings(ranks_), NOW)  # no owner given: the longest wait
    assert anyone is not None and (anyone["group"], anyone["missing"]) == ("1", [1])


def test_a_pipeline_stage_waits_on_its_neighbour_alone(ranks: Any) -> None:
    """Three pipeline stages exchanging through batch_isend_irecv, recorded as the isend
    and irecv ops of each batch: stage 1 passed stage 0's activation on and waits for
    stage 2's answer, which never comes. Stage 2 is missing; stage 0, done after its
    one batch, is not (numbered as batches of the group, stage 1's second batch had no
    counterpart on stage 0 and named it missing too)."""
    zero, one, two = ranks(3)
    zero.op("isend", kind=col.SEND, peer=1)  # batch 1 of stage 0
    one.op("irecv", kind=col.RECV, peer=0)  # batch 1 of stage 1
    one.op("isend", kind=col.SEND, peer=2, done=False)  # batch 2 of stage 1
    one.op("irecv", kind=col.RECV, peer=2, done=False)
    found = col.align(rings([zero, one, two]), NOW)
    assert found is not None
    assert where_and_who(found) == ("irecv", 1, [1], [2])
    assert found["peer"] == 2
    line = col.collective_line(found)
    assert line.startswith("irecv #1 from rank 2 (group default): rank 1 waiting "), line
    assert "rank 0" not in line, line


def test_a_ranks_stack_on_the_terminal_keeps_the_frames_around_the_recorder() -> None:
    """The recorder's frame lies between the test's code and torch's: trimming the
    runner's outer frames must not take it for one of them (and cut the test's)."""
    from pytest_elastic_timer.core import stacks

    recorder = os.path.join(os.path.dirname(col.__file__), "..", "scope", "collectives.py")
    recorder = os.path.normpath(recorder)
    dump = (
        "Current thread 0x00007f0000000001 (most recent call first):\n"
        '  File "/env/torch/distributed/distributed_c10d.py", line 3252 in all_reduce\n'
        f'  File "{recorder}", line 411 in all_reduce\n'
        '  File "/home/me/project/test_mptc.py", line 22 in test_allreduce\n'
        '  File "/env/torch/multiprocessing/spawn.py", line 87 in _wrap\n'
        '  File "<string>", line 1 in <module>\n'
    )
    assert stacks.trim_stack(dump) == dump


def test_a_missing_rank_whose_process_had_ended_is_told_apart(ranks: Any) -> None:
    """A rank gone at the amendment whose stack was not taken at the deadline (no live
    process below the owner or of its world) had ended before it: it crashed, it does
    not wait somewhere. One whose stack was taken ended later, as its tree was ended."""
    from pytest_elastic_timer.core import records
    from pytest_elastic_timer.watchdog.collectives import CollectivesAmender

    zero, one, two = ranks(3)
    for rank in (zero, one, two):
        rank.op("all_reduce")
    zero.op("all_reduce", done=False)
    one.writer.words[col.H_PID] = dead_pid()  # crashed before the deadline
    two.writer.words[col.H_PID] = later = dead_pid()  # ended after it
    record = records.ExpiryRecord(
        "t.py::t", "t::call", 2.0, 2.1, 4242, "", "", "t.py", 1, "interrupted", "",
        children=[{"pid": 10_000, "label": "rank 0"}, {"pid": later, "stack": STACK}],
        deadline=NOW,
    )  # fmt: skip
    CollectivesAmender(str(zero.ring().path.rsplit("/", 1)[0]), dict)(record)
    found = record.collective
    assert found is not None and (found["waiting"], found["missing"]) == ([0], [1, 2])
    assert [found["ranks"][r]["ended"] for r in "012"] == ["", "died", ""]
    line = col.collective_line(found, record.rank_stacks())
    assert "; rank 1 missing (died), last completed all_reduce #1; rank 2 missing, last " in line
    assert line.endswith("now in serve at train.py:52")
    one.writer.mark_exited()  # returned from its program instead
    again = dataclasses.replace(record, collective=None)
    CollectivesAmender(str(zero.ring().path.rsplit("/", 1)[0]), dict)(again)
    assert again.collective is not None and again.collective["ranks"]["1"]["ended"] == "exited"
    assert "rank 1 missing (exited), last completed" in col.collective_line(again.collective)


def test_a_rank_that_died_is_not_told_where_a_process_of_its_label_is(ranks: Any) -> None:
    """Rank 1 crashed before the deadline; a process it started (a DataLoader worker,
    which inherits RANK=1 and reads 'rank 1') still runs below the owner, with a stack.
    That stack is not rank 1's: the line says rank 1 died, not that it is 'now in' the
    worker's frame. The stack of a rank is its own process's, by the collective's pid;
    a process's label only stands for a rank whose process is not known."""
    from pytest_elastic_timer.core import records
    from pytest_elastic_timer.watchdog.collectives import CollectivesAmender

    zero, one = ranks(2)
    for rank in (zero, one):
        rank.op("all_reduce")
    zero.op("all_reduce", done=False)
    one.writer.words[col.H_PID] = dead_pid()  # crashed before the deadline
    record = records.ExpiryRecord(
        "t.py::t", "t::call", 2.0, 2.1, 4242, "", "", "t.py", 1, "interrupted", "",
        children=[
            {"pid": 10_000, "label": "rank 0"},
            {"pid": os.getpid(), "label": "rank 1", "stack": STACK},  # rank 1's worker
        ],
        deadline=NOW,
    )  # fmt: skip
    CollectivesAmender(str(zero.ring().path.rsplit("/", 1)[0]), dict)(record)
    found = record.collective
    assert found is not None and (found["missing"], found["ranks"]["1"]["ended"]) == ([1], "died")
    assert 1 not in record.rank_stacks()
    line = col.collective_line(found, record.rank_stacks())
    assert line.endswith("rank 1 missing (died), last completed all_reduce #1"), line
    # A rank with no process known (no ring) is still told by its label.
    del found["ranks"]["1"]["pid"]
    assert record.rank_stacks()[1] == STACK
