"""The shared-memory scope table: the fast path between a process and its watchdog.

Every process that enters scopes owns one table, a file mapped into memory. The owner
writes one 64-byte slot when it enters a scope and one word when it leaves; it talks to
the watchdog only when a new deadline is earlier than the one the watchdog already
promised to wake for (header word ``ARMED``). The watchdog reads the slots when it wakes,
so a scope that ends in time costs no message at all.

The file lives in the session's private directory and outlives the process that wrote
it, which is how a record can still be built for a process that was killed.

Layout (little endian)::

    header   4096 bytes, 8-byte words (see the ``H_*`` indexes)
    slots    CAPACITY x 64 bytes, ``SLOT`` struct
    strings  STRINGS_SIZE bytes, each entry u32 length + UTF-8 bytes; a string id
             (sid) is its offset + 1, so 0 means "none"

A slot is open when its first word (serial) is non-zero and equal to its last word.
The owner writes the slot like a seqlock: the other fields and the last word with one
``pack_into`` while the first word is 0, then the first word; it clears only the first
word on exit. The watchdog reads the first word first, so a half-written or closed
slot never reads as open, and an open one never shows another entry's fields. The
methods of :class:`ScopeTable` that open, close and move a slot are the only code that
knows this order. This module imports nothing from pytest.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator
from typing import NamedTuple

from pytest_elastic_timer.core import unpatched

MAGIC = 0x3130_4C42_5454_4550  # b"PETTBL01" read as a little-endian u64
VERSION = 1

HEADER_SIZE = 4096
SLOT = struct.Struct("<QddQIIIfHHIQ")
SLOT_SIZE = SLOT.size
# How an owner writes a slot: SLOT with its zero fields as pad bytes (the first word,
# published after the rest, and the reserved word), and for a test phase also its path
# and site sids: fewer values to convert.
OPEN_SLOT = struct.Struct("<8xddQIIIfHH4xQ")
OPEN_PHASE_SLOT = struct.Struct("<8xddQ8xIfHH4xQ")
assert OPEN_SLOT.size == OPEN_PHASE_SLOT.size == SLOT.size
# The largest grace a slot holds (its field is a float32): a longer one is as good as
# forever, and is held as this.
MAX_GRACE = 3.4028234663852886e38
CAPACITY = 65536
# Append-only, and every test writes its entry (about 150 bytes): 64 MiB hold some
# 400,000 tests in one process. The file is sparse: only written pages use memory.
STRINGS_SIZE = 64 * 1024 * 1024
# Bytes of one string at most: a longer one is cut. A test's entry is one (parametrized
# tests' ids can be kilobytes long); the area holds a thousand of them even so.
MAX_STRING = 64 * 1024
SLOTS_OFFSET = HEADER_SIZE
STRINGS_OFFSET = SLOTS_OFFSET + CAPACITY * SLOT_SIZE
FILE_SIZE = STRINGS_OFFSET + STRINGS_SIZE
_U32 = struct.Struct("<I")

# Header word indexes (8-byte words).
H_MAGIC = 0
H_VERSION = 1
H_PID = 2
H_ARMED = 3  # f64: the watchdog wakes for this table at or before this time; 0 = unknown
H_SUSPENDED = 4  # f64: monotonic time since when deadlines are paused (debugger); 0 = running
H_HWM = 5  # u64: no slot at or above this index was ever used
H_STRINGS_USED = 6  # u64: bytes used in the strings area
H_INTERRUPT_SIG = 7  # u64: signal that raises ScopeExpired in the owner
H_DUMP_SIG = 8  # u64: signal that makes faulthandler dump all threads (0 = none)
H_LABEL_SID = 9  # u64: process label, e.g. "rank 0"
H_WORKER_SID = 10  # u64: xdist worker id
H_MAIN_TID = 11  # u64: thread ident of the owner's main thread
H_PHASE_SID = 12  # u64: what the owner's pytest is doing (collection, setup, call, ...)
H_TEST_SID = 13  # u64: the test (its test_entry, or a bare nodeid) the owner runs now

# Slot flags.
FLAG_TEST_PHASE = 1  # the scope of a test phase (setup/call/teardown), entered by the plugin
# Which phase, in bits 1-2 of a test phase's flags. Such a slot may have no path and no
# site of its own: they follow from the test entry its nodeid sid points at.
PHASE_FLAGS = {"setup": 1 << 1, "call": 2 << 1, "teardown": 3 << 1}
_PHASE_NAMES = {code: name for name, code in PHASE_FLAGS.items()}
# How the expiry of a slot that the watchdog wrote for an adopted process (a torch
# file-timer request) ends that process; the owner's own slots never carry these.
FLAG_LEFT_RUNNING = 1 << 3  # the expiry is recorded, the process is not ended
END_SIGNAL_SHIFT = 8  # bits 8-15: the signal that ends it (0: the ladder's SIGTERM)


def end_flags(signum: int) -> int:
    """The flags of a slot whose expiry ends its adopted owner with ``signum`` (torch's
    rule: a signal of 0 or below leaves it running)."""
    return FLAG_LEFT_RUNNING if signum <= 0 else (signum & 0xFF) << END_SIGNAL_SHIFT


def end_signal(flags: int) -> int | None:
    """The signal that :func:`end_flags` put in ``flags``: None to leave the owner
    running, 0 for the ladder's own ending."""
    return None if flags & FLAG_LEFT_RUNNING else (flags >> END_SIGNAL_SHIFT) & 0xFF


def file_name(pid: int) -> str:
    """A new table's file name for process ``pid``: ``table-<pid>-<random>`` (a pid
    reused within a session gets a file of its own)."""
    return f"table-{pid}-{unpatched.random_hex()}"


def pid_of_file(name: str) -> int:
    """The pid a table's file name (:func:`file_name`) is for; -1 for another name."""
    kind, _, rest = name.partition("-")
    pid = rest.partition("-")[0]
    return int(pid) if kind == "table" and pid.isdigit() else -1


def test_entry(nodeid: str, name: str, path: str, line: int) -> str:
    """One test's string in the table: its nodeid, name and ``path:line`` of its
    definition, which the slots of the test's phase scopes point at. Cut to fit
    :data:`MAX_STRING` (ids of parametrized tests can be that long) by its nodeid and
    name, so that it still splits in three."""
    entry = f"{nodeid}\0{name}\0{path}:{line}"
    if len(entry) <= MAX_STRING // 4:  # fits whatever its characters' UTF-8 length
        return entry
    definition = _cut(f"{path}:{line}", MAX_STRING // 2)
    room = MAX_STRING - len(definition.encode("utf-8", "replace")) - 2
    nodeid = _cut(nodeid, room // 2)
    name = _cut(name, room - len(nodeid.encode("utf-8", "replace")))
    return f"{nodeid}\0{name}\0{definition}"


def _cut(text: str, size: int) -> str:
    """``text`` cut to at most ``size`` bytes of UTF-8, at a character's boundary."""
    return text.encode("utf-8", "replace")[:size].decode("utf-8", "ignore")


def split_test_entry(text: str) -> tuple[str, str, str]:
    """(nodeid, name, definition) of a :func:`test_entry` (a bare nodeid: no others)."""
    parts = text.split("\0", 2)
    return (parts[0], parts[1], parts[2]) if len(parts) == 3 else (text, "", "")


def phase_of(flags: int) -> str:
    """The test phase a test phase slot's flags name ("" if none)."""
    return _PHASE_NAMES.get(flags & (3 << 1), "") if flags & FLAG_TEST_PHASE else ""


assert SLOT_SIZE == 64


class SlotView(NamedTuple):
    """A consistent copy of one open slot, as the watchdog sees it."""

    slot_index: int  # not "index": a tuple has a method of that name
    serial: int
    deadline: float
    start: float
    thread_id: int
    path_sid: int
    site_sid: int
    nodeid_sid: int
    grace: float
    depth: int
    flags: int

    @property
    def budget(self) -> float:
        return self.deadline - self.start


class ScopeTable:
    """One process's scope table, mapped from ``path``.

    The owner creates it with :meth:`create`; the watchdog maps the same file with
    :meth:`open`. Anonymous tables (``path=None``) serve in-process enforcement.
    """

    def __init__(self, mm: mmap.mmap, path: str | None) -> None:
        self.mm = mm
        self.path = path
        self.words = memoryview(mm)[:HEADER_SIZE].cast("Q")
        self.floats = memoryview(mm)[:HEADER_SIZE].cast("d")
        # u64 view over the slots: slot i's serial is word i * 8.
        self.slot_words = memoryview(mm)[SLOTS_OFFSET:STRINGS_OFFSET].cast("Q")
        self.slot_floats = memoryview(mm)[SLOTS_OFFSET:STRINGS_OFFSET].cast("d")

    # -- creation -----------------------------------------------------------------
    @classmethod
    def create(cls, path: str | None) -> ScopeTable:
        if path is None:
            mm = mmap.mmap(-1, FILE_SIZE)
        else:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                os.ftruncate(fd, FILE_SIZE)  # sparse: only touched pages cost memory
                mm = mmap.mmap(fd, FILE_SIZE)
            finally:
                os.close(fd)
        table = cls(mm, path)
        table.words[H_VERSION] = VERSION
        table.words[H_PID] = unpatched.getpid()
        table.floats[H_ARMED] = 0.0
        table.words[H_MAGIC] = MAGIC
        return table

    @classmethod
    def open(cls, path: str) -> ScopeTable:
        """Map an existing table; raises ``ValueError`` for anything that is not one."""
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if st.st_size != FILE_SIZE:
                raise ValueError(f"not a scope table (size {st.st_size}): {path}")
            mm = mmap.mmap(fd, FILE_SIZE)
        finally:
            os.close(fd)
        table = cls(mm, path)
        if table.words[H_MAGIC] != MAGIC or table.words[H_VERSION] != VERSION:
            table.close()
            raise ValueError(f"not a scope table (bad magic or version): {path}")
        return table

    def close(self) -> None:
        for view in (self.words, self.floats, self.slot_words, self.slot_floats):
            view.release()
        try:
            self.mm.close()
        except BufferError:  # a caller still holds a view; the mapping dies with it
            pass

    # -- strings ------------------------------------------------------------------
    def add_string(self, text: str) -> int:
        """Append ``text`` and return its sid (0 if the strings area is full)."""
        try:
            data = text.encode()
        except UnicodeEncodeError:  # a lone surrogate; the error handler costs every call
            data = text.encode("utf-8", "replace")
        size = len(data)
        if size > MAX_STRING:
            data = data[:MAX_STRING]
            size = MAX_STRING
        words = self.words
        used = words[H_STRINGS_USED]
        end = used + 4 + size
        if end > STRINGS_SIZE:
            return 0
        # Length and bytes in one write: every test writes one string.
        self.mm[STRINGS_OFFSET + used : STRINGS_OFFSET + end] = _U32.pack(size) + data
        words[H_STRINGS_USED] = end
        return used + 1

    def string(self, sid: int) -> str:
        """The string with id ``sid`` ("" for 0 or an id outside the written area)."""
        # The owner writes the header and the sids: neither is trusted to be in bounds.
        if sid <= 0 or sid > min(self.words[H_STRINGS_USED], STRINGS_SIZE - 4):
            return ""
        offset = STRINGS_OFFSET + sid - 1
        (length,) = _U32.unpack_from(self.mm, offset)
        if offset + 4 + length > FILE_SIZE:
            return ""
        return bytes(self.mm[offset + 4 : offset + 4 + length]).decode("utf-8", "replace")

    # -- slots: the one home of the seqlock order ---------------------------------
    # A writer publishes a slot by its first word (the serial), after every other field
    # and the last word (the serial again); a reader reads the first word first
    # (``unpack_from`` reads in address order) and takes the slot only when the first
    # and last words are equal and non-zero. So whenever it sees a serial it sees that
    # entry's fields, and a slot being written or closed never reads as open.
    def open_slot(
        self,
        index: int,
        serial: int,
        deadline: float,
        start: float,
        thread_id: int,
        path_sid: int,
        site_sid: int,
        nodeid_sid: int,
        grace: float,
        depth: int,
        flags: int,
    ) -> None:
        """Open the closed slot ``index`` (its first word is 0): the fields and the last
        word in one ``pack_into``, then the first word."""
        OPEN_SLOT.pack_into(
            self.mm,
            SLOTS_OFFSET + index * SLOT_SIZE,
            deadline,
            start,
            thread_id,
            path_sid,
            site_sid,
            nodeid_sid,
            grace,
            depth,
            flags,
            serial,
        )
        self.slot_words[index << 3] = serial

    def open_phase_slot(
        self,
        index: int,
        serial: int,
        deadline: float,
        start: float,
        thread_id: int,
        nodeid_sid: int,
        grace: float,
        depth: int,
        flags: int,
    ) -> None:
        """:meth:`open_slot` for a test phase's scope, which has no path and no site of
        its own (the test entry at ``nodeid_sid`` names it); fewer values to convert."""
        OPEN_PHASE_SLOT.pack_into(
            self.mm,
            SLOTS_OFFSET + index * SLOT_SIZE,
            deadline,
            start,
            thread_id,
            nodeid_sid,
            grace,
            depth,
            flags,
            serial,
        )
        self.slot_words[index << 3] = serial

    def write_slot(
        self,
        index: int,
        serial: int,
        deadline: float,
        start: float,
        thread_id: int,
        path_sid: int,
        site_sid: int,
        nodeid_sid: int,
        grace: float,
        depth: int,
        flags: int,
    ) -> None:
        """Open slot ``index`` whether it is open or not: closed first, then opened with
        these fields (a moved deadline under a new serial, a reused slot)."""
        self.slot_words[index << 3] = 0
        self.open_slot(
            index,
            serial,
            deadline,
            start,
            thread_id,
            path_sid,
            site_sid,
            nodeid_sid,
            grace,
            depth,
            flags,
        )

    def clear_slot(self, index: int) -> None:
        """Close slot ``index``: its first word only."""
        self.slot_words[index << 3] = 0

    def move_deadline(self, index: int, deadline: float) -> None:
        """Move the deadline of open slot ``index`` in place, keeping its serial: one
        aligned 8-byte store, which a reader sees whole, before or after."""
        self.slot_floats[(index << 3) + 1] = deadline

    def read_slot(self, index: int) -> SlotView | None:
        """The slot at ``index`` if it is open and consistent, else None."""
        fields = SLOT.unpack_from(self.mm, SLOTS_OFFSET + index * SLOT_SIZE)
        if fields[0] == 0 or fields[0] != fields[-1]:
            return None
        return SlotView(index, *fields[:10])

    def due_slots(self, now: float) -> tuple[float, list[SlotView]]:
        """(earliest deadline after ``now``, the open slots due by ``now``), in one pass
        that builds an object only for a due slot: a table with 100,000 open scopes
        costs the watchdog no memory to scan."""
        hwm = min(int(self.words[H_HWM]), CAPACITY)
        earliest = float("inf")
        due: list[SlotView] = []
        # A view, not a copy: read in address order all the same (first word first).
        with memoryview(self.mm) as whole:
            region = whole[SLOTS_OFFSET : SLOTS_OFFSET + hwm * SLOT_SIZE]
            try:
                for index, fields in enumerate(SLOT.iter_unpack(region)):
                    serial = fields[0]
                    if serial == 0 or serial != fields[11]:
                        continue
                    deadline = fields[1]
                    if deadline > now:
                        if deadline < earliest:
                            earliest = deadline
                    else:
                        due.append(SlotView(index, *fields[:10]))
            finally:
                region.release()
        return earliest, due

    def scope_of(self, slot: SlotView) -> tuple[str, str, str]:
        """(path, site, nodeid) of the scope in ``slot``: a test phase's scope, which
        has no path or site of its own, is named after its test (``test_x::call``)
        and sited at its definition."""
        nodeid, name, definition = split_test_entry(self.string(slot.nodeid_sid))
        path = self.string(slot.path_sid)
        site = self.string(slot.site_sid)
        phase = phase_of(slot.flags)
        if phase and not path:
            path, site = f"{name}::{phase}", site or definition
        return path, site, nodeid

    def open_slots(self) -> Iterator[SlotView]:
        """Every open slot, read in one pass over the used part of the table."""
        hwm = min(int(self.words[H_HWM]), CAPACITY)
        region = self.mm[SLOTS_OFFSET : SLOTS_OFFSET + hwm * SLOT_SIZE]
        for index, fields in enumerate(SLOT.iter_unpack(region)):
            if fields[0] != 0 and fields[0] == fields[-1]:
                yield SlotView(index, *fields[:10])
