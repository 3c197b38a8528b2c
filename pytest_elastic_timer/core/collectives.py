"""The collectives ring: the last torch.distributed ops of a process, in shared memory.

Every process of the session that uses torch.distributed records each collective and
point-to-point op it calls (``scope/collectives.py``) into a *ring* of the last
:data:`CAPACITY` ops. The ring is a file of its own in the session directory,
``collectives-<pid>-<id>``, mapped by its process: a rank that never imports the package
has no scope table, and a ring written once per op must not wait for anybody. Like a
scope table, the file outlives its process, so the watchdog can still read what a rank
that was killed (or aborted by gloo) was doing.

Layout (little endian)::

    header   4096 bytes: words (see the ``H_*`` indexes), then text fields
    groups   16 KiB, append-only lines ``name<TAB>rank,rank,...<LF>``: process groups
             and their global member ranks
    entries  CAPACITY x 512 bytes, ``ENTRY`` struct, entry ``n`` (1-based serial) at
             position ``(n - 1) % CAPACITY``

An entry is written like a scope table's slot: its first word cleared, the other fields
and the last word (the serial) with one ``pack_into``, then the first word. A reader
takes an entry only when both words hold the serial it expects at that position. The
end of an op (``complete``) is two later stores into its entry, the end time and then
the state.

:func:`align` is the analysis the watchdog runs at an expiry: given the rings of the
ranks concerned, which collective the waiting ranks block in and which ranks never
entered it (the question PyTorch's Flight Recorder analyzer answers after the fact).
This module imports neither torch, pytest nor psutil.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import struct
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pytest_elastic_timer.core import unpatched
from pytest_elastic_timer.core.procstat import process_alive, process_starttime

MAGIC = 0x3130_4C4F_4354_4550  # b"PETCOL01" read as a little-endian u64
VERSION = 1
CAPACITY = 256
HEADER_SIZE = 4096
GROUPS_SIZE = 16 * 1024
ENTRY = struct.Struct("<QqqdQI4xdI4x32s48s200s160sQ")
ENTRY_SIZE = ENTRY.size
GROUPS_OFFSET = HEADER_SIZE
ENTRIES_OFFSET = GROUPS_OFFSET + GROUPS_SIZE
FILE_SIZE = ENTRIES_OFFSET + CAPACITY * ENTRY_SIZE
PREFIX = "collectives-"
assert ENTRY_SIZE == 512

# Header words (8 bytes each).
H_MAGIC = 0
H_VERSION = 1
H_PID = 2
H_CAPACITY = 3
H_COUNT = 4  # u64: entries begun so far (the serial of the newest one)
H_RANK = 5  # i64: global rank after init_process_group, -1 before
H_WORLD = 6  # i64: world size, 0 before
H_CREATED = 7  # f64: time.time() when the ring was made
H_STARTTIME = 8  # u64: the process's start time in clock ticks (/proc/<pid>/stat)
H_GROUPS_USED = 9  # u64: bytes used in the groups area
H_EXITED = 10  # u64: 1 once the interpreter exits normally
# Text fields of the header: (offset, size), UTF-8, NUL padded.
T_LABEL = (256, 64)  # "rank N"
T_NODEID = (320, 1024)  # the test whose process started this one (PYTEST_CURRENT_TEST)
T_WORLD_ID = (1344, 512)  # how the ranks met: init_method, or MASTER_ADDR:MASTER_PORT
T_WORKER = (1856, 64)  # xdist worker id of the session's worker this process runs below

# Entry fields, in ENTRY's order: serial, seq, peer, start, thread, kind, end, state,
# op, group, site (file:line), tensors (see encode_tensors), serial again.
_END = struct.Struct("<d")  # at offset 48 of an entry
_STATE = struct.Struct("<I")  # at offset 56

# Kinds of op.
COLLECTIVE = 0
SEND = 1
RECV = 2
INIT = 3  # init_process_group: the rendezvous, seq 0 of the default group
# (A batch_isend_irecv is recorded as the isend and irecv ops it is made of.)
KIND_NAMES = {COLLECTIVE: "collective", SEND: "send", RECV: "recv", INIT: "init"}

# States of an entry.
STARTED = 1
COMPLETED = 2
FAILED = 3  # the op raised: no longer blocking
STATE_NAMES = {STARTED: "started", COMPLETED: "completed", FAILED: "completed"}

DEFAULT_GROUP = "default"
# Collectives whose tensors have the same shapes on every rank of a correct program.
SAME_SHAPES = frozenset(
    {
        "all_reduce",
        "all_reduce_coalesced",
        "broadcast",
        "reduce",
        "all_gather",
        "all_gather_into_tensor",
        "_all_gather_base",
        "all_gather_coalesced",
        "reduce_scatter_tensor",
        "_reduce_scatter_base",
    }
)


def ring_path(directory: str, pid: int) -> str:
    """A new ring's file name for process ``pid`` in the session ``directory``."""
    return os.path.join(directory, f"{PREFIX}{pid}-{unpatched.random_hex()}")


def encode_tensors(items: Iterable[tuple[str, tuple[int, ...]]], limit: int = 160) -> bytes:
    """``[("float32", (4, 4)), ...]`` as ``b"float32[4,4];..."``, cut at a whole item
    to fit ``limit`` bytes (a reader sees fewer tensors, never a torn one)."""
    out = b""
    for dtype, shape in items:
        item = f"{dtype}[{','.join(map(str, shape))}]".encode()
        if len(out) + len(item) + 1 > limit:
            break
        out = out + b";" + item if out else item
    return out


def decode_tensors(text: str) -> list[tuple[str, list[int]]]:
    """The inverse of :func:`encode_tensors` (items that do not parse are skipped)."""
    out: list[tuple[str, list[int]]] = []
    for item in text.split(";") if text else ():
        match = _TENSOR.fullmatch(item)
        if match:
            dims = match.group(2)
            out.append((match.group(1), [int(d) for d in dims.split(",")] if dims else []))
    return out


_TENSOR = re.compile(r"([\w.]+)\[([\d,]*)\]")


class RingWriter:
    """One process's ring, as its owner writes it."""

    def __init__(self, path: str, capacity: int = CAPACITY) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, FILE_SIZE)
            self.mm = mmap.mmap(fd, FILE_SIZE)
        finally:
            os.close(fd)
        self.path = path
        self.capacity = min(capacity, CAPACITY)
        self.words = memoryview(self.mm)[:HEADER_SIZE].cast("Q")
        self.signed = memoryview(self.mm)[:HEADER_SIZE].cast("q")
        self.floats = memoryview(self.mm)[:HEADER_SIZE].cast("d")
        self.entry_words = memoryview(self.mm)[ENTRIES_OFFSET:].cast("Q")
        self.count = 0
        pid = unpatched.getpid()
        self.words[H_VERSION] = VERSION
        self.words[H_PID] = pid
        self.words[H_CAPACITY] = self.capacity
        self.signed[H_RANK] = -1
        self.floats[H_CREATED] = unpatched.now()
        self.words[H_STARTTIME] = process_starttime(pid)
        self.words[H_MAGIC] = MAGIC

    def set_text(self, where: tuple[int, int], text: str) -> None:
        """Write one of the header's text fields (``T_*``), cut to fit."""
        offset, size = where
        data = text.encode("utf-8", "replace")[: size - 1]
        self.mm[offset : offset + size] = data.ljust(size, b"\0")

    def set_rank(self, rank: int, world: int, label: str) -> None:
        self.signed[H_RANK] = rank
        self.signed[H_WORLD] = world
        self.set_text(T_LABEL, label)

    def add_group(self, name: str, members: Iterable[int]) -> None:
        """Name a process group and its global member ranks (once per group)."""
        line = f"{name}\t{','.join(map(str, members))}\n".encode()
        used = self.words[H_GROUPS_USED]
        if used + len(line) > GROUPS_SIZE:
            return  # readers fall back to the ranks seen in the group's entries
        start = GROUPS_OFFSET + used
        self.mm[start : start + len(line)] = line
        self.words[H_GROUPS_USED] = used + len(line)

    def begin(
        self,
        kind: int,
        op: bytes,
        group: bytes,
        seq: int,
        peer: int,
        site: bytes,
        tensors: bytes,
        thread: int,
        start: float,
    ) -> int:
        """Record an op that starts now; returns its serial (for :meth:`complete`)."""
        serial = self.count + 1
        self.count = serial
        position = (serial - 1) % self.capacity
        self.entry_words[position * 64] = 0
        ENTRY.pack_into(
            self.mm,
            ENTRIES_OFFSET + position * ENTRY_SIZE,
            0,
            seq,
            peer,
            start,
            thread,
            kind,
            0.0,
            STARTED,
            op,
            group,
            site,
            tensors,
            serial,
        )
        self.entry_words[position * 64] = serial
        self.words[H_COUNT] = serial
        return serial

    def complete(self, serial: int, state: int = COMPLETED, end: float | None = None) -> None:
        """The op ``serial`` ended (``FAILED``: it raised). A no-op once its entry was
        reused for a later op, which a completion from another thread may find."""
        position = (serial - 1) % self.capacity
        if self.entry_words[position * 64] != serial:
            return
        offset = ENTRIES_OFFSET + position * ENTRY_SIZE
        _END.pack_into(self.mm, offset + 48, unpatched.monotonic() if end is None else end)
        _STATE.pack_into(self.mm, offset + 56, state)

    def mark_exited(self) -> None:
        self.words[H_EXITED] = 1

    def close(self) -> None:
        for view in (self.words, self.signed, self.floats, self.entry_words):
            view.release()
        with contextlib.suppress(BufferError):
            self.mm.close()


@dataclass(frozen=True)
class Entry:
    """One op of a ring, as a reader sees it."""

    serial: int
    seq: int
    peer: int
    start: float
    thread: int
    kind: int
    end: float
    state: int
    op: str
    group: str
    site: str
    tensors: str

    @property
    def started(self) -> bool:
        """Still inside the op (not completed, not failed)."""
        return self.state == STARTED

    @property
    def shapes(self) -> list[list[int]]:
        return [shape for _, shape in decode_tensors(self.tensors)]

    @property
    def dtypes(self) -> list[str]:
        return [dtype for dtype, _ in decode_tensors(self.tensors)]

    def describe(self) -> str:
        """``all_reduce #3`` (``send #2 to rank 1`` for point-to-point ops)."""
        text = f"{self.op} #{self.seq}"
        if self.kind == SEND and self.peer >= 0:
            text += f" to rank {self.peer}"
        elif self.kind == RECV:
            text += f" from rank {self.peer}" if self.peer >= 0 else " from any rank"
        return text


@dataclass
class Ring:
    """A snapshot of one process's ring."""

    path: str
    pid: int
    rank: int
    world: int
    created: float
    starttime: int
    exited: bool
    label: str
    nodeid: str
    world_id: str
    worker: str
    groups: dict[str, list[int]] = field(default_factory=dict)
    entries: list[Entry] = field(default_factory=list)
    header_only: bool = False  # read without its groups and entries (read_ring)

    def current(self) -> list[Entry]:
        """The entries since the last ``init_process_group`` (all when there is none in
        the ring): a rank that destroyed its group and made a new one counts anew."""
        for index in range(len(self.entries) - 1, -1, -1):
            if self.entries[index].kind == INIT:
                return self.entries[index:]
        return self.entries

    def blocked(self) -> Entry | None:
        """The op this rank is blocked in: its oldest op that has not ended, but for a
        send or receive with a later op open behind it (an ``isend`` never waited for
        stays open while its rank goes on to other ops; collectives issued with
        ``async_op=True`` are waited for oldest first)."""
        started = [e for e in self.current() if e.started]
        for entry in started[:-1]:
            if entry.kind not in (SEND, RECV):
                return entry
        return started[-1] if started else None

    def last(self) -> Entry | None:
        current = self.current()
        return current[-1] if current else None


def _text(mm: bytes | mmap.mmap, where: tuple[int, int]) -> str:
    offset, size = where
    return bytes(mm[offset : offset + size]).split(b"\0", 1)[0].decode("utf-8", "replace")


def read_ring(path: str, *, header_only: bool = False) -> Ring | None:
    """A snapshot of the ring at ``path`` (None for anything that is not one).
    ``header_only``: without its groups and entries, which are most of the file: what
    tells whose ring it is (pid, rank, test, world) is in the header."""
    try:
        with unpatched.open(path, "rb") as f:
            data = f.read(HEADER_SIZE if header_only else FILE_SIZE + 1)
            if header_only and len(data) == HEADER_SIZE:
                size = os.fstat(f.fileno()).st_size
            else:
                size = len(data)
    except OSError:
        return None
    if size != FILE_SIZE:
        return None
    words = struct.unpack_from(f"<{HEADER_SIZE // 8}Q", data)
    if words[H_MAGIC] != MAGIC or words[H_VERSION] != VERSION:
        return None
    signed = struct.unpack_from("<qq", data, H_RANK * 8)
    (created,) = struct.unpack_from("<d", data, H_CREATED * 8)
    capacity = min(int(words[H_CAPACITY]) or CAPACITY, CAPACITY)
    count = 0 if header_only else int(words[H_COUNT])
    entries: list[Entry] = []
    for serial in range(max(1, count - capacity + 1), count + 1):
        position = (serial - 1) % capacity
        fields = ENTRY.unpack_from(data, ENTRIES_OFFSET + position * ENTRY_SIZE)
        if fields[0] != serial or fields[-1] != serial:
            continue  # being rewritten, or torn
        strings = [b.split(b"\0", 1)[0].decode("utf-8", "replace") for b in fields[8:12]]
        entries.append(Entry(*fields[:8], *strings))
    groups: dict[str, list[int]] = {}
    used = 0 if header_only else min(int(words[H_GROUPS_USED]), GROUPS_SIZE)
    for line in data[GROUPS_OFFSET : GROUPS_OFFSET + used].decode("utf-8", "replace").splitlines():
        name, _, members = line.partition("\t")
        with contextlib.suppress(ValueError):
            groups[name] = [int(m) for m in members.split(",") if m]
    return Ring(
        path=path,
        pid=int(words[H_PID]),
        rank=signed[0],
        world=signed[1],
        created=created,
        starttime=int(words[H_STARTTIME]),
        exited=bool(words[H_EXITED]),
        label=_text(data, T_LABEL),
        nodeid=_text(data, T_NODEID),
        world_id=_text(data, T_WORLD_ID),
        worker=_text(data, T_WORKER),
        groups=groups,
        entries=entries,
        header_only=header_only,
    )


def ring_paths(directory: str, pids: Iterable[int] | None = None) -> list[str]:
    """Ring files in the session ``directory`` (of the processes ``pids`` only)."""
    # os.listdir, not glob: glob's own os is faked while a test fakes the file system.
    try:
        names = unpatched.listdir(directory)
    except OSError:
        return []
    prefixes = (PREFIX,) if pids is None else tuple(f"{PREFIX}{pid}-" for pid in pids)
    return sorted(os.path.join(directory, n) for n in names if n.startswith(prefixes))


def read_rings(paths: Iterable[str], *, header_only: bool = False) -> list[Ring]:
    found = (read_ring(path, header_only=header_only) for path in paths)
    return [ring for ring in found if ring is not None]


def _whole(headers: Iterable[Ring]) -> list[Ring]:
    """The rings of ``headers`` (header-only snapshots) read whole; one that stopped
    being a ring meanwhile is left out."""
    return read_rings(header.path for header in headers)


def world_of(seeds: Iterable[Ring], others: Iterable[Ring]) -> list[Ring]:
    """The rings of the ranks that meet the ranks of ``seeds``: the seeds, and those
    of ``others`` with the same world (``world_id`` and test), the newest ring of a
    rank winning (a rank started again, or a pid reused, leaves older rings behind)."""
    seeds = [r for r in seeds if r.rank >= 0]
    sizes = {(r.world_id, r.nodeid): r.world for r in seeds if r.world_id}
    return newest_per_rank([*seeds, *(r for r in others if _fits(r, sizes))])


def _fits(ring: Ring, sizes: Mapping[tuple[str, str], int]) -> bool:
    """Whether ``ring`` is a rank of one of the worlds that ``sizes`` gives the size of
    (0: not known), by their ``world_id`` and test. A smaller world that met where a
    larger one had (the same ``MASTER_PORT`` again) has none of its higher ranks."""
    size = sizes.get((ring.world_id, ring.nodeid))
    return size is not None and ring.rank >= 0 and (size <= 0 or ring.rank < size)


def newest_per_rank(rings: Iterable[Ring]) -> list[Ring]:
    """One ring per rank, the newest (of equals, the first), ordered by rank."""
    chosen: dict[int, Ring] = {}
    for ring in rings:
        known = chosen.get(ring.rank)
        if known is None or ring.created > known.created:
            chosen[ring.rank] = ring
    return [chosen[rank] for rank in sorted(chosen)]


# -- alignment ---------------------------------------------------------------------
def _members(rings: Mapping[int, Ring], group: str) -> list[int]:
    for ring in rings.values():
        if group in ring.groups:
            return sorted(ring.groups[group])
    if group == DEFAULT_GROUP:
        world = max((r.world for r in rings.values()), default=0)
        if world > 0:
            return list(range(world))
    return sorted(r for r, ring in rings.items() if any(e.group == group for e in ring.current()))


def _at(ring: Ring | None, group: str, seq: int, kinds: tuple[int, ...]) -> Entry | None:
    if ring is None:
        return None
    return next(
        (e for e in ring.current() if e.group == group and e.seq == seq and e.kind in kinds),
        None,
    )


def _rank_view(
    entry: Entry | None, now: float, ring: Ring | None, *, dead: bool = False
) -> dict[str, Any]:
    """What one rank was doing; ``pid``: its process (0 for a rank without a ring);
    ``ended``: how that process had ended (``dead``), "" while it ran."""
    pid = ring.pid if ring is not None else 0
    ended = ("exited" if ring.exited else "died") if dead and ring is not None else ""
    if entry is None:
        return {
            "op": "",
            "seq": 0,
            "state": "none",
            "site": "",
            "shapes": [],
            "since": 0.0,
            "group": "",
            "peer": -1,
            "pid": pid,
            "ended": ended,
        }
    began = entry.start if entry.started or not entry.end else entry.end
    return {
        "op": entry.op,
        "seq": entry.seq,
        "state": STATE_NAMES.get(entry.state, "started"),
        "site": entry.site,
        "shapes": entry.shapes,
        "since": round(max(0.0, now - began), 3),
        "group": entry.group,
        "peer": entry.peer if entry.kind in (SEND, RECV) else -1,
        "pid": pid,
        "ended": ended,
    }


def align(
    rings: Iterable[Ring], now: float, gone: Collection[int] = (), owners: Collection[int] = ()
) -> dict[str, Any] | None:
    """The ``collective`` field of an expiry record, from the rings of the ranks
    concerned (``now``: ``time.monotonic()`` at the expiry), or None when no rank is
    inside a collective or point-to-point op. ``gone``: the pids of processes known to
    have ended before ``now``.

    The collective is the op the longest-waiting rank blocks in, among the ranks that
    are ``owners`` (the pids of the record's owner and of the processes below it) if
    any of them blocks in one: its group and that group's sequence number. (Another
    group's ranks may hang too, for a reason of their own.) ``waiting`` are the
    group's ranks inside an op at that sequence number, ``died`` those that ended
    inside it (their process is in ``gone``), ``missing`` those that never reached it
    (a rank without a ring too);
    ``mismatch`` is ``"op"`` when the ranks at that number are in different ops,
    ``"shape"`` when they are in the same op with different tensor shapes.
    """
    by_rank: dict[int, Ring] = {}
    for ring in rings:
        known = by_rank.get(ring.rank)
        if ring.rank >= 0 and (known is None or ring.created > known.created):
            by_rank[ring.rank] = ring
    blocked = {rank: entry for rank, ring in by_rank.items() if (entry := ring.blocked())}
    if not blocked:
        return None
    # (By pid and start time: a later process may have the pid of one that ended.)
    dead = {
        rank
        for rank, ring in by_rank.items()
        if ring.pid in gone and not process_alive(ring.pid, ring.starttime)
    }
    # The op a live rank waits in, the longest; an owner's first, a dead rank's only
    # when all are dead.
    anchor_rank, anchor = min(
        blocked.items(),
        key=lambda item: (
            item[0] in dead,
            bool(owners) and by_rank[item[0]].pid not in owners,
            item[1].start,
            item[0],
        ),
    )
    group, seq = anchor.group, anchor.seq
    point_to_point = anchor.kind in (SEND, RECV)
    if point_to_point:
        kinds: tuple[int, ...] = (SEND, RECV)
        members = sorted({anchor_rank, *([anchor.peer] if anchor.peer >= 0 else [])})
        here: dict[int, Entry | None] = {anchor_rank: anchor}
        if anchor.peer >= 0:
            # The peer's matching op: the same count of ops between the two, the other way.
            other = SEND if anchor.kind == RECV else RECV
            peer_ring = by_rank.get(anchor.peer)
            here[anchor.peer] = next(
                (
                    e
                    for e in (peer_ring.current() if peer_ring else ())
                    if e.kind == other
                    and e.group == group
                    and e.seq == seq
                    and e.peer in (anchor_rank, -1)
                ),
                None,
            )
    else:
        kinds = (COLLECTIVE, INIT)
        members = _members(by_rank, group)
        if anchor_rank not in members:
            members = sorted({*members, anchor_rank})
        here = {rank: _at(by_rank.get(rank), group, seq, kinds) for rank in members}
    # Beside a point-to-point pair, every other rank blocked in a point-to-point op of
    # the group: a chain of sends and receives that waits on the pair.
    beside = (
        sorted(
            rank
            for rank, entry in blocked.items()
            if entry.kind in kinds
            and entry.group == group
            and rank not in members
            and rank not in dead
        )
        if point_to_point
        else []
    )
    # Those that died inside it stay among the ranks that reached it (``waiting``);
    # ``died`` says which of them no longer wait.
    waiting = sorted(rank for rank in members if (e := here.get(rank)) and e.started)
    died = sorted(set(waiting) & dead)
    missing = sorted(rank for rank in members if here.get(rank) is None)
    present = [e for rank in members if (e := here.get(rank)) is not None]
    mismatch: str | None = None
    if anchor.kind == COLLECTIVE and len({e.op for e in present}) > 1:
        mismatch = "op"
    elif (
        anchor.kind == COLLECTIVE
        and anchor.op in SAME_SHAPES
        and len({tuple(map(tuple, e.shapes)) for e in present}) > 1
    ):
        mismatch = "shape"
    ranks: dict[str, dict[str, Any]] = {}
    for rank in sorted({*members, *beside}):
        entry = here.get(rank)
        rank_ring = by_rank.get(rank)
        if entry is None and rank_ring is not None:
            entry = rank_ring.blocked() or rank_ring.last()
        ranks[str(rank)] = _rank_view(entry, now, rank_ring, dead=rank in dead)
    found: dict[str, Any] = {
        "group": group,
        "seq": seq,
        "op": anchor.op,
        "waiting": waiting,
        "missing": missing,
        "died": died,
        "mismatch": mismatch,
        "ranks": ranks,
    }
    if point_to_point:
        found["peer"] = anchor.peer  # the rank the op sends to or receives from
        found["blocked"] = beside
    return found


# -- text --------------------------------------------------------------------------
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<func>\S+)')
_OWN_FILES = (
    os.sep + os.path.join("pytest_elastic_timer", ""),
    os.sep + os.path.join("torch", "distributed", ""),
)


def innermost_frame(stack: str) -> str:
    """``func at file.py:12``: where a faulthandler dump's main thread is (the thread
    the dump calls current, else the first), outside this package and torch.distributed."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", stack.strip())
    block = next((b for b in blocks if b.startswith("Current thread")), blocks[0] if blocks else "")
    for line in block.splitlines():
        match = _FRAME.match(line)
        if match and not any(part in match.group("file") for part in _OWN_FILES):
            name = os.path.basename(match.group("file"))
            return f"{match.group('func')} at {name}:{match.group('line')}"
    return ""


def _short(site: str) -> str:
    file, _, line = site.rpartition(":")
    return f"{os.path.basename(file)}:{line}" if file else site


def _ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def collective_line(
    collective: Mapping[str, Any], stacks: Mapping[int, str] | None = None, *, ended: bool = False
) -> str:
    """One plain line naming the op and the missing ranks, e.g. ``collective all_reduce
    #3 (group default, 2 ranks): rank 0 waiting 10.0s at train.py:40; rank 1 missing,
    last completed broadcast #2, now in main at train.py:52``. ``stacks``: a rank's
    stack dump, for where a rank that is in no op is; ``ended``: the ranks are gone,
    so they were in the op rather than waiting in it."""
    stacks = stacks or {}
    ranks: Mapping[str, Mapping[str, Any]] = collective.get("ranks") or {}
    parts: list[str] = []
    # Ranks waiting at one place (site, time, and op when the ops differ) read as one.
    by_place: dict[tuple[str, str, str], list[int]] = {}
    mismatch = collective.get("mismatch")
    died = collective.get("died", [])
    for rank in collective.get("waiting", []):
        if rank in died:
            continue  # said below
        view = ranks.get(str(rank), {})
        op = f" in {view.get('op')}" if mismatch == "op" else ""
        site = str(view.get("site", ""))
        where = f" at {_short(site)}" if site else ""
        since = "" if ended else f" {float(view.get('since', 0.0)):.1f}s"
        by_place.setdefault((since, op, where), []).append(rank)
    for (since, op, where), found in by_place.items():
        verb = ("were in it" if len(found) > 1 else "was in it") if ended else "waiting"
        parts.append(f"{_ranks_text(sorted(found))} {verb}{since}{op}{where}")
    for rank in died:
        view = ranks.get(str(rank), {})
        site = str(view.get("site", ""))
        op = f" in {view.get('op')}" if mismatch == "op" else ""
        parts.append(f"rank {rank} died in it{op}" + (f" at {_short(site)}" if site else ""))
    group = collective.get("group")
    for rank in collective.get("missing", []):
        view = ranks.get(str(rank), {})
        state = view.get("state", "none")
        # An op of another group than the collective's says which group.
        of = f" (group {view['group']})" if view.get("group") not in (None, "", group) else ""
        # A rank whose process had ended: crashed or returned, not stuck somewhere.
        text = f"rank {rank} missing" + (f" ({view['ended']})" if view.get("ended") else "")
        if state == "completed":
            text += f", last completed {_op_text(view)}{of}"
        elif state == "started":
            site = view.get("site", "")
            text += f", in {_op_text(view)}{of}" + (f" at {_short(str(site))}" if site else "")
        elif state == "none":
            text += ", no op recorded"
        where = innermost_frame(stacks[rank]) if rank in stacks else ""
        if where and state != "started":
            text += f", now in {where}"
        parts.append(text)
    if mismatch == "shape":
        shapes = ", ".join(
            f"rank {r} {ranks.get(str(r), {}).get('shapes')}"
            for r in sorted(int(k) for k in ranks)
            if ranks.get(str(r), {}).get("state") != "none"
        )
        parts.append(f"shape mismatch: {shapes}")
    elif mismatch == "op":
        parts.append("op mismatch at this sequence number")
    for rank in collective.get("blocked", []):
        view = ranks.get(str(rank), {})
        site = str(view.get("site", ""))
        where = f" at {_short(site)}" if site else ""
        parts.append(f"rank {rank} also blocked, in {_op_text(view)}{where}")
    size = len(ranks)
    if "peer" in collective:  # a point-to-point op: who meets whom, not a group's size
        op = _op_text(collective)
        head = f"{op} (group {collective.get('group')})"
        both = _both_ways(collective)
        if both:
            parts.append(both)
    else:
        head = (
            f"collective {collective.get('op')} #{collective.get('seq')} "
            f"(group {collective.get('group')}, {size} rank{'s' if size != 1 else ''})"
        )
    return f"{head}: {'; '.join(parts)}"


def _op_text(view: Mapping[str, Any]) -> str:
    """``all_reduce #3``, ``send #2 to rank 1``, ``recv #1 from rank 0``."""
    text = f"{view.get('op')} #{view.get('seq')}"
    peer = int(view.get("peer", -1))
    if view.get("op") in ("send", "isend") and peer >= 0:
        text += f" to rank {peer}"
    elif view.get("op") in ("recv", "irecv"):
        text += f" from rank {peer}" if peer >= 0 else " from any rank"
    return text


def _both_ways(collective: Mapping[str, Any]) -> str:
    """For a point-to-point pair that waits on each other the same way (both receive
    from, or both send to, the other): says so."""
    ranks: Mapping[str, Mapping[str, Any]] = collective.get("ranks") or {}
    pair = [*collective.get("waiting", []), *collective.get("missing", [])]
    if len(pair) != 2:
        return ""
    a, b = (ranks.get(str(r), {}) for r in pair)
    if a.get("state") != "started" or b.get("state") != "started" or a.get("op") != b.get("op"):
        return ""
    if a.get("peer") != pair[1] or b.get("peer") != pair[0]:
        return ""
    verb = "receive from" if str(a.get("op")).endswith("recv") else "send to"
    return f"ranks {pair[0]} and {pair[1]} both {verb} each other: nothing matches"


def rank_of_label(label: str) -> int | None:
    """``"rank 3"`` -> 3 (None for any other label)."""
    match = re.fullmatch(r"rank (\d+)", label.strip())
    return int(match.group(1)) if match else None


# -- what the other sides ask of the rings ------------------------------------------
def newest_per_pid(rings: Iterable[Ring]) -> list[Ring]:
    """One ring per pid, the newest (a pid reused in the session leaves older ones)."""
    chosen: dict[int, Ring] = {}
    for ring in rings:
        known = chosen.get(ring.pid)
        if known is None or ring.created > known.created:
            chosen[ring.pid] = ring
    return list(chosen.values())


def as_of(ring: Ring, moment: float) -> Ring:
    """``ring`` as it stood at ``moment`` (same clock as its times): later ops left
    out, ops that ended later still in progress."""
    entries = [
        e if e.started or (e.end and e.end <= moment) else replace(e, state=STARTED, end=0.0)
        for e in ring.entries
        if e.start <= moment
    ]
    return replace(ring, entries=entries)


def collective_for(
    directory: str,
    pids: Iterable[int],
    moment: float,
    gone: Collection[int] = (),
    running: Collection[int] | None = None,
) -> dict[str, Any] | None:
    """The ``collective`` field for an expiry whose owner and descendants are ``pids``,
    at ``moment`` (the deadline): their rings, with every ring of the same world (the
    rank that owns a scope is not the parent of the other ranks, and a rank that died
    is nobody's child), as they stood then, aligned. The rings outlive their processes,
    so this may run after the escalation ended them; ``gone``: the pids known to have
    ended before ``moment``; ``running``, where given: the pids known to run at
    ``moment``, so that a rank's process outside them that has ended by now had ended
    before ``moment`` (a rank that crashed, not one still stuck)."""
    pids = set(pids)
    seeds = [r for r in newest_per_pid(read_rings(ring_paths(directory, pids))) if r.rank >= 0]
    if not seeds:
        return None
    # The session's other rings by their headers first: a long session leaves many.
    others = (
        read_rings(ring_paths(directory), header_only=True)
        if any(r.world_id for r in seeds)
        else []
    )
    world = world_of(seeds, others)
    read = {r.path: r for r in seeds}
    read.update((r.path, r) for r in _whole(r for r in world if r.path not in read))
    rings = [read[r.path] for r in world if r.path in read]
    if running is not None:
        ended = {r.pid for r in rings if not process_alive(r.pid, r.starttime)}
        gone = {*gone, *(ended - set(running))}
    return align([as_of(r, moment) for r in rings], moment, gone, owners=pids)


def peers_of(directory: str, pids: Collection[int]) -> list[int]:
    """The live processes of the other ranks of the worlds that ``pids`` are ranks of
    (the rank that owns a scope is not the parent of the ranks it waits for)."""
    rings = ring_paths(directory, pids)
    seeds = [r for r in newest_per_pid(read_rings(rings, header_only=True)) if r.rank >= 0]
    if not any(r.world_id for r in seeds):
        return []
    world = world_of(seeds, read_rings(ring_paths(directory), header_only=True))
    return [r.pid for r in world if r.pid not in pids and process_alive(r.pid, r.starttime)]


def labels(directory: str, pids: Iterable[int]) -> dict[int, str]:
    """``rank N`` of each of ``pids`` that called init_process_group (by its ring)."""
    rings = read_rings(ring_paths(directory, pids), header_only=True)
    return {r.pid: r.label for r in newest_per_pid(rings) if r.label}


def rings_of_test(directory: str, nodeid: str) -> list[Ring]:
    """The rings of the processes a test started (their ``PYTEST_CURRENT_TEST``), one
    per rank of one world, ordered by rank: the world of the rank that died last, else
    the newest. A test that made worlds one after another (a retry, a smaller world
    after a larger one) shows the one that failed, not a mix of their ranks."""
    headers = read_rings(ring_paths(directory), header_only=True)
    ranks = [r for r in headers if r.nodeid == nodeid and r.rank >= 0]
    if not ranks:
        return []
    last = max([r for r in ranks if died(r)] or ranks, key=lambda r: r.created)
    sizes = {(last.world_id, last.nodeid): last.world}
    return _whole(newest_per_rank(r for r in ranks if _fits(r, sizes)))


def died(ring: Ring) -> bool:
    """The process ended without exiting (killed, aborted, ``os._exit``)."""
    return not ring.exited and not process_alive(ring.pid, ring.starttime)


def ranks_text(rings: list[Ring], now: float) -> str:
    """What each rank was in when the test failed, for a failure section: one line per
    rank (its op in progress or its last op), then the alignment's line."""
    lines = []
    for ring in rings:
        if process_alive(ring.pid, ring.starttime):
            status = "running"
        else:
            status = "exited" if ring.exited else "died"
        head = f"rank {ring.rank}, pid {ring.pid} ({status})"
        blocked, last = ring.blocked(), ring.last()
        if blocked is not None:
            text = f"{head}: in {blocked.describe()} (group {blocked.group})"
            if status == "running":  # a dead rank's time in the op ended with it
                text += f" for {max(0.0, now - blocked.start):.1f}s"
            text += f" at {_short(blocked.site)}"
            if blocked.tensors:
                text += f", {blocked.tensors.replace(';', ', ')}"
            done = [e for e in ring.current() if not e.started]
            if done:
                text += f"; last completed {done[-1].describe()}"
        elif last is not None:
            text = f"{head}: no op in progress; last completed {last.describe()}"
        else:
            text = f"{head}: no op recorded"
        lines.append(text)
    gone = {r.pid for r in rings if not process_alive(r.pid, r.starttime)}
    alive = len(gone) < len(rings)
    # While some ranks run, those that ended are told apart; once all have ended, all
    # were in the op rather than waiting in it.
    collective = align(rings, now, gone if alive else ())
    if collective is not None:
        lines.append(collective_line(collective, ended=not alive))
    return "\n".join(lines)


def trace_events(rings: Iterable[Ring]) -> list[dict[str, Any]]:
    """Every recorded op of ``rings`` as a plain event for the trace timeline: pid,
    rank label, thread, name (``all_reduce #3``), start and end (None: never ended),
    and what the op was."""
    events: list[dict[str, Any]] = []
    for ring in rings:
        for entry in ring.entries:
            events.append(
                {
                    "pid": ring.pid,
                    "label": ring.label,
                    "worker": ring.worker,
                    "tid": entry.thread,
                    "name": entry.describe(),
                    "start": entry.start,
                    "end": entry.end if not entry.started and entry.end else None,
                    "op": entry.op,
                    "group": entry.group,
                    "seq": entry.seq,
                    "state": STATE_NAMES.get(entry.state, "started"),
                    "site": entry.site,
                    "tensors": entry.tensors,
                }
            )
    return events
