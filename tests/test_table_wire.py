"""Plain unit tests of the shared scope table, the wire format and the records."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import write_slot
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pytest_elastic_timer.core import records, wire
from pytest_elastic_timer.core import table as tbl

U64 = st.integers(min_value=1, max_value=2**64 - 1)
U32 = st.integers(min_value=0, max_value=2**32 - 1)
U16 = st.integers(min_value=0, max_value=2**16 - 1)
TIME = st.floats(min_value=0, max_value=1e9, allow_nan=False)


@pytest.fixture
def table(tmp_path: Path) -> Iterator[tbl.ScopeTable]:
    created = tbl.ScopeTable.create(str(tmp_path / "table-1-a"))
    yield created
    created.close()


@pytest.fixture(scope="module")
def shared_table(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tbl.ScopeTable]:
    """One table for the property tests (hypothesis runs many examples per test)."""
    created = tbl.ScopeTable.create(str(tmp_path_factory.mktemp("tables") / "table-1-b"))
    yield created
    created.close()


# -- the table ---------------------------------------------------------------------
def test_layout_constants() -> None:
    assert tbl.SLOT_SIZE == 64
    assert tbl.SLOTS_OFFSET == tbl.HEADER_SIZE
    assert tbl.FILE_SIZE == tbl.HEADER_SIZE + tbl.CAPACITY * 64 + tbl.STRINGS_SIZE
    assert struct.pack("<Q", tbl.MAGIC) == b"PETTBL01"


def test_create_writes_the_header(table: tbl.ScopeTable) -> None:
    assert table.words[tbl.H_MAGIC] == tbl.MAGIC
    assert table.words[tbl.H_VERSION] == tbl.VERSION
    assert table.words[tbl.H_PID] == os.getpid()
    assert table.floats[tbl.H_ARMED] == 0.0
    assert os.path.getsize(table.path) == tbl.FILE_SIZE
    assert os.stat(table.path).st_mode & 0o777 == 0o600


def test_create_refuses_an_existing_path(table: tbl.ScopeTable) -> None:
    with pytest.raises(FileExistsError):
        tbl.ScopeTable.create(table.path)


def test_open_sees_what_the_owner_writes(table: tbl.ScopeTable) -> None:
    other = tbl.ScopeTable.open(table.path)
    try:
        sid = table.add_string("test_x::call/load")
        write_slot(
            table,
            0,
            serial=7,
            deadline=12.5,
            start=10.0,
            thread_id=99,
            path_sid=sid,
            grace=1.5,
            flags=tbl.FLAG_TEST_PHASE,
        )
        table.words[tbl.H_HWM] = 1
        (slot,) = other.open_slots()
        assert other.string(slot.path_sid) == "test_x::call/load"
        assert (slot.serial, slot.deadline, slot.start, slot.thread_id) == (7, 12.5, 10.0, 99)
        assert slot.budget == 2.5
        assert slot.flags == tbl.FLAG_TEST_PHASE
        table.clear_slot(0)
        assert list(other.open_slots()) == []
    finally:
        other.close()


def test_open_rejects_what_is_not_a_table(tmp_path: Path) -> None:
    small = tmp_path / "small"
    small.write_bytes(b"x" * 100)
    with pytest.raises(ValueError, match="size"):
        tbl.ScopeTable.open(str(small))
    zeros = tmp_path / "zeros"
    with zeros.open("wb") as f:
        f.truncate(tbl.FILE_SIZE)
    with pytest.raises(ValueError, match="magic"):
        tbl.ScopeTable.open(str(zeros))


def test_open_does_not_follow_symlinks(table: tbl.ScopeTable, tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(table.path)
    with pytest.raises(OSError):
        tbl.ScopeTable.open(str(link))


def test_anonymous_table() -> None:
    anonymous = tbl.ScopeTable.create(None)
    try:
        assert anonymous.path is None
        write_slot(anonymous, 3, serial=1, deadline=2.0, start=1.0, thread_id=5)
        anonymous.words[tbl.H_HWM] = 4
        assert [s.slot_index for s in anonymous.open_slots()] == [3]
    finally:
        anonymous.close()


SLOT_FIELDS = st.tuples(
    U64,  # serial
    TIME,  # deadline
    TIME,  # start
    U64,  # thread id
    U32,  # path sid
    U32,  # site sid
    U32,  # nodeid sid
    st.sampled_from([0.0, 0.5, 2.0, 30.0]),  # grace (a float32: exact values only)
    U16,  # depth
    U16,  # flags
)


@settings(max_examples=200, deadline=None)
@given(index=st.integers(min_value=0, max_value=tbl.CAPACITY - 1), fields=SLOT_FIELDS)
def test_slot_round_trip(
    shared_table: tbl.ScopeTable, index: int, fields: tuple[int | float, ...]
) -> None:
    shared_table.write_slot(index, *fields)  # type: ignore[arg-type]
    try:
        slot = shared_table.read_slot(index)
        assert slot is not None
        assert slot.slot_index == index
        assert tuple(slot)[1:] == fields
    finally:
        shared_table.clear_slot(index)
    assert shared_table.read_slot(index) is None


def test_torn_slot_is_not_open(table: tbl.ScopeTable) -> None:
    write_slot(table, 2, serial=41, deadline=5.0, start=1.0)
    table.words[tbl.H_HWM] = 3
    assert table.read_slot(2) is not None
    # The last word (a copy of the serial) is written last: until then, not open.
    struct.pack_into("<Q", table.mm, tbl.SLOTS_OFFSET + 2 * 64 + 56, 40)
    assert table.read_slot(2) is None
    assert list(table.open_slots()) == []


def test_open_slots_stop_at_the_high_water_mark(table: tbl.ScopeTable) -> None:
    for index in (0, 1, 5):
        write_slot(table, index, serial=index + 1, deadline=1.0)
    table.words[tbl.H_HWM] = 2
    assert [s.slot_index for s in table.open_slots()] == [0, 1]
    table.words[tbl.H_HWM] = 6
    assert [s.slot_index for s in table.open_slots()] == [0, 1, 5]
    table.words[tbl.H_HWM] = 2**63  # nonsense from a broken owner is capped
    assert [s.slot_index for s in table.open_slots()] == [0, 1, 5]


@given(texts=st.lists(st.text(max_size=50), min_size=1, max_size=20))
def test_strings_round_trip(shared_table: tbl.ScopeTable, texts: list[str]) -> None:
    sids = [shared_table.add_string(t) for t in texts]
    for sid, text in zip(sids, texts, strict=True):
        assert sid > 0
        assert shared_table.string(sid) == text.encode("utf-8", "replace").decode(
            "utf-8", "replace"
        )


def test_string_ids_outside_the_written_area(table: tbl.ScopeTable) -> None:
    sid = table.add_string("only")
    assert table.string(0) == ""
    assert table.string(-5) == ""
    assert table.string(sid + 1000) == ""
    assert table.string(sid) == "only"


def test_long_strings_are_cut(table: tbl.ScopeTable) -> None:
    assert table.string(table.add_string("x" * 10_000)) == "x" * 10_000
    too_long = "x" * (tbl.MAX_STRING + 10)
    assert table.string(table.add_string(too_long)) == "x" * tbl.MAX_STRING


# -- the wire format ---------------------------------------------------------------
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**53), max_value=2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=60)
@given(op=st.text(max_size=20), fields=st.dictionaries(st.text(max_size=10), JSON_VALUES))
def test_encode_decode_round_trip(op: str, fields: dict[str, object]) -> None:
    assert wire.decode(wire.encode(op, **fields)) == (op, fields)


@settings(max_examples=300)
@given(data=st.binary(max_size=3000))
@example(b"")
@example(b"\xff\xfe\x00")
@example(b'["wake",{"at":NaN}]')
@example(b"1" * 5000)
@example(b"[" + b"1" * 5000 + b",{}]")
def test_decode_random_bytes_raises_only_bad_message(data: bytes) -> None:
    try:
        op, fields = wire.decode(data)
    except wire.BadMessage:
        return
    assert isinstance(op, str)
    assert isinstance(fields, dict)


JSONISH = st.text(alphabet='[]{}",:0123456789aez.-+ \\ntrufalsNI', max_size=300)


@settings(max_examples=300)
@given(text=JSONISH)
def test_decode_json_like_text_raises_only_bad_message(text: str) -> None:
    try:
        op, fields = wire.decode(text.encode())
    except wire.BadMessage:
        return
    assert isinstance(op, str) and isinstance(fields, dict)


@given(depth=st.integers(min_value=1, max_value=200_000), tail=st.binary(max_size=10))
@example(depth=100_000, tail=b"")
@example(depth=1, tail=b'"op",{}]')
def test_decode_deeply_nested_raises_only_bad_message(depth: int, tail: bytes) -> None:
    try:
        op, fields = wire.decode(b"[" * depth + tail)
    except wire.BadMessage:
        return
    # Only an array at the top can be a message: one "[" and a tail that ends it.
    assert depth == 1
    assert isinstance(op, str) and isinstance(fields, dict)


@pytest.mark.parametrize(
    "data",
    [b"{}", b"[]", b'["op"]', b"[1, {}]", b'["op", []]', b'["op", {}, 3]', b'"op"', b"null"],
)
def test_decode_rejects_other_shapes(data: bytes) -> None:
    with pytest.raises(wire.BadMessage, match="array"):
        wire.decode(data)


def test_size_limits() -> None:
    with pytest.raises(wire.BadMessage, match="over"):
        wire.encode("big", blob="x" * wire.MAX_MESSAGE)
    with pytest.raises(wire.BadMessage, match="over"):
        wire.decode(b" " * (wire.MAX_MESSAGE + 1))
    assert len(wire.encode("ok", blob="x" * (wire.MAX_MESSAGE - 100))) <= wire.MAX_MESSAGE


def test_field_checks_types() -> None:
    fields = {"at": 1.5, "n": 3, "flag": True, "name": "x"}
    assert wire.field(fields, "at", (int, float)) == 1.5
    assert wire.field(fields, "n", int) == 3
    assert wire.field(fields, "flag", bool) is True
    with pytest.raises(wire.BadMessage, match="bool"):
        wire.field(fields, "flag", int)
    with pytest.raises(wire.BadMessage, match="str"):
        wire.field(fields, "name", int)
    with pytest.raises(wire.BadMessage, match="NoneType"):
        wire.field(fields, "missing", str)
    assert issubclass(wire.BadMessage, ValueError)


# -- records -----------------------------------------------------------------------
def _record(**changes: object) -> records.ExpiryRecord:
    values: dict[str, object] = {
        "nodeid": "test_a.py::test_x",
        "scope": "test_x::call/load",
        "budget": 0.5,
        "elapsed": 0.5012,
        "pid": 123,
        "label": "rank 1",
        "worker": "gw0",
        "file": "/src/test_a.py",
        "line": 7,
        "action": "terminated",
        "stack": 'File "/src/test_a.py", line 9 in test_x\n',
    }
    values.update(changes)
    return records.ExpiryRecord(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("site", "expected"),
    [
        ("/a/b.py:12", ("/a/b.py", 12)),
        ("C:\\x\\y.py:3", ("C:\\x\\y.py", 3)),
        ("<string>:4", ("<string>", 4)),
        ("nowhere", ("nowhere", 0)),
        ("file.py:", ("file.py:", 0)),
        ("", ("", 0)),
    ],
)
def test_split_site(site: str, expected: tuple[str, int]) -> None:
    assert records.split_site(site) == expected


def test_format_record() -> None:
    text = records.format_record(_record(killed=[{"pid": 123, "name": "python"}]))
    lines = text.splitlines()
    assert lines[0] == "scope 'test_x::call/load' expired after 0.50s (budget 0.5s): terminated"
    assert "  test:    test_a.py::test_x" in lines
    assert "  entered: /src/test_a.py:7" in lines
    assert "  process: rank 1, pid 123, worker gw0" in lines
    assert "  ended:   123 (python)" in lines
    assert '    File "/src/test_a.py", line 9 in test_x' in lines
    short = records.format_record(_record(), with_stack=False)
    assert "stack" not in short


def test_records_file_survives_a_torn_last_line(tmp_path: Path) -> None:
    path = str(tmp_path / "records.jsonl")
    assert records.read_records(path) == []
    records.append_record(path, _record(serial=1))
    records.append_record(path, _record(serial=2, scope="other"))
    with open(path, "a") as f:
        f.write('{"nodeid": "torn')
    found = records.read_records(path)
    assert [(r.serial, r.scope) for r in found] == [(1, "test_x::call/load"), (2, "other")]


def test_write_report(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "report.json"
    records.write_report(str(path), [_record()], {"pid": 1})
    data = json.loads(path.read_text())
    assert data["version"] == records.REPORT_VERSION == 1
    assert data["session"] == {"pid": 1}
    (record,) = data["expired"]
    assert record["scope"] == "test_x::call/load"
    assert records.ExpiryRecord.from_json({**record, "unknown": 1}) == _record()
    assert [p.name for p in path.parent.iterdir()] == ["report.json"]


def test_test_entry_round_trip(table: tbl.ScopeTable) -> None:
    entry = tbl.test_entry("t.py::Test::test_x[a::b]", "test_x[a::b]", "/r/t.py", 12)
    sid = table.add_string(entry)
    assert tbl.split_test_entry(table.string(sid)) == (
        "t.py::Test::test_x[a::b]",
        "test_x[a::b]",
        "/r/t.py:12",
    )
    assert tbl.split_test_entry("t.py::test_plain") == ("t.py::test_plain", "", "")


@pytest.mark.parametrize("length", [2_030, 40_000, 100_000])
def test_a_long_test_entry_keeps_its_three_parts(table: tbl.ScopeTable, length: int) -> None:
    """A parametrized test's id kilobytes long: its nodeid and name whole while they
    fit, else cut, never the separators or the definition."""
    name = f"test_long[{'é' * length}]"
    nodeid = f"t.py::{name}"
    sid = table.add_string(tbl.test_entry(nodeid, name, "/r/t.py", 12))
    got_nodeid, got_name, definition = tbl.split_test_entry(table.string(sid))
    assert definition == "/r/t.py:12"
    if length * 2 * 2 < tbl.MAX_STRING:  # two bytes a character, nodeid and name
        assert (got_nodeid, got_name) == (nodeid, name)
    else:
        assert nodeid.startswith(got_nodeid) and name.startswith(got_name)
        assert len(got_nodeid) > 1000 and len(got_name) > 1000


def test_a_lone_surrogate_is_replaced_not_an_error(table: tbl.ScopeTable) -> None:
    sid = table.add_string("scope-\udc80-end")
    assert table.string(sid) == "scope-?-end"


def test_phase_flags_name_the_phase() -> None:
    for phase, bits in tbl.PHASE_FLAGS.items():
        assert tbl.phase_of(tbl.FLAG_TEST_PHASE | bits) == phase
        assert tbl.phase_of(bits) == ""  # not a test phase's scope
    assert tbl.phase_of(0) == ""


def test_long_strings_are_cut_at_max_string_bytes(table: tbl.ScopeTable) -> None:
    sid = table.add_string("é" * tbl.MAX_STRING)
    assert len(table.string(sid).encode("utf-8", "replace")) <= tbl.MAX_STRING
    assert table.string(table.add_string("next")) == "next"


def test_due_slots_splits_open_slots_at_now(table: tbl.ScopeTable) -> None:
    table.words[tbl.H_HWM] = 4
    write_slot(table, 0, serial=11, deadline=5.0, start=1.0, thread_id=7)  # due
    write_slot(table, 1, serial=12, deadline=20.0, start=1.0, thread_id=7, depth=1)  # later
    write_slot(table, 2, serial=13, deadline=15.0, start=1.0, thread_id=7, depth=2)  # earliest
    write_slot(table, 3, serial=14, deadline=2.0, start=1.0, thread_id=7, depth=3)
    table.clear_slot(3)  # closed: neither due nor counted
    earliest, due = table.due_slots(10.0)
    assert earliest == 15.0
    assert [(s.slot_index, s.serial) for s in due] == [(0, 11)]


def test_strings_area_holds_400000_test_entries() -> None:
    """Every test writes its entry (about 150 bytes); a long single-process session
    must not run out of names for its records. When the area is full, the sid is 0."""
    table = tbl.ScopeTable.create(None)
    try:
        entry = tbl.test_entry(
            "tests/unit/test_module_name.py::TestClass::test_something[param-a-1]",
            "test_something[param-a-1]",
            "/home/ci/work/project/tests/unit/test_module_name.py",
            123,
        )
        assert 140 <= len(entry.encode()) <= 160
        sids = [table.add_string(entry) for _ in range(400_000)]
        assert all(sids) and table.string(sids[-1]) == entry
        while table.add_string(entry):
            pass
        assert table.add_string(entry) == 0
        assert table.string(sids[-1]) == entry  # what was written stays readable
    finally:
        table.close()
