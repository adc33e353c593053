"""Shard plans cover the file exactly once, at line boundaries, with the right line numbers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.distributed import shards as shards_mod
from carpool.distributed.shards import iter_shard_lines, load_or_make_plan, merge_files, plan_shards
from carpool.errors import PlanMismatch

lines_st = st.lists(st.text(alphabet="ab{}\"é", max_size=30), min_size=0, max_size=60)


@settings(max_examples=150, deadline=None)
@given(lines=lines_st, n=st.integers(1, 9), trailing=st.booleans(), chunk=st.sampled_from([7, 64, 1 << 20]))
def test_plan_covers_every_line_once(tmp_path_factory, lines, n, trailing, chunk):
    path = tmp_path_factory.mktemp("p") / "in.jsonl"
    data = "\n".join(lines) + ("\n" if trailing and lines else "")
    path.write_bytes(data.encode())
    old = shards_mod.CHUNK
    shards_mod.CHUNK = chunk  # small chunks exercise lines that straddle reads
    try:
        plan = plan_shards(path, n)
    finally:
        shards_mod.CHUNK = old
    assert len(plan) <= n
    assert [s.index for s in plan] == list(range(len(plan)))
    raw = path.read_bytes()
    assert b"".join(raw[s.start:s.end] for s in plan) == raw
    got = [(no, line) for s in plan for no, line in iter_shard_lines(path, s)]
    expected = data.encode().split(b"\n")
    if data.endswith("\n"):
        expected = expected[:-1]
    if not data:
        expected = []
    assert got == [(i + 1, line) for i, line in enumerate(expected)]
    assert all(s.start == 0 or raw[s.start - 1:s.start] == b"\n" for s in plan)


def test_plan_is_balanced_on_regular_lines(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(f'{{"prompt": "task {i:04d}"}}\n' for i in range(1000)))
    plan = plan_shards(path, 4)
    assert [s.lines for s in plan] == [250, 250, 250, 250]
    assert [s.first_line for s in plan] == [1, 251, 501, 751]


def test_saved_plan_is_reused_and_guards_other_inputs(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(f"{i}\n" for i in range(100)))
    work = tmp_path / "work"
    first = load_or_make_plan(path, work, 4)
    # A resumed run with another worker count keeps the saved shards (and their journals).
    assert load_or_make_plan(path, work, 7) == first
    (work / "shard-00000.jsonl").write_text("partial\n")
    path.write_text("changed\n")
    with pytest.raises(PlanMismatch, match="remove it"):
        load_or_make_plan(path, work, 4)


def test_merge_keeps_order_and_adds_missing_newline(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    a.write_text("1\n2\n")
    b.write_text("3")
    c.write_text("4\n")
    dest = tmp_path / "out" / "merged.jsonl"
    merge_files([a, b, tmp_path / "missing", c], dest)
    assert dest.read_text() == "1\n2\n3\n4\n"


def test_reorder_puts_a_resumed_shard_back_in_input_order(tmp_path):
    from carpool.distributed.worker import ShardReader, reorder_by_input

    src = tmp_path / "in.jsonl"
    src.write_text("".join(
        (f'{{"custom_id": "c{i}", "prompt": "p{i}"}}\n' if i % 2 else f'{{"prompt": "p{i}"}}\n') for i in range(1, 11)))
    shard = plan_shards(src, 2)[1]  # lines 6..10
    # A resume appended lines 9 and 6 after the earlier run's 7, 10 and 8 (line-N default ids).
    out = tmp_path / "shard.jsonl"
    order = ["c7", "line-10", "line-8", "c9", "line-6"]
    out.write_text("".join(f'{{"custom_id":"{cid}","n":{k}}}\n' for k, cid in enumerate(order)))
    reorder_by_input(out, ShardReader(src, shard))
    assert [line.split('"')[3] for line in out.read_text().splitlines()] == ["line-6", "c7", "line-8", "c9",
                                                                             "line-10"]


def test_a_shard_reads_past_an_overlong_line_as_the_main_reader_does(tmp_path):
    # Before, the shard reader had no limit: a line past 32 MiB was held whole (a file with
    # no newline, the whole shard).  Now both readers give the same tasks and the same error.
    from carpool.distributed.worker import ShardReader
    from carpool.jobs.input.readers import MAX_LINE_BYTES, Reader, TooLong

    path = tmp_path / "in.jsonl"
    with open(path, "wb") as f:
        f.write(b'{"prompt": "one"}\n{"prompt": "')
        f.write(b"z" * (MAX_LINE_BYTES + 10))
        f.write(b'"}\n{"prompt": "three"}\n')
    plan = plan_shards(path, 3)
    lines = [(no, raw) for s in plan for no, raw in iter_shard_lines(path, s)]
    assert [no for no, _ in lines] == [1, 2, 3] and isinstance(lines[1][1], TooLong)
    by_shards = [item for s in plan for item in ShardReader(path, s)]
    whole = list(Reader(path))
    assert [(i.line_no, i.custom_id, type(i).__name__, getattr(i, "message", None)) for i in by_shards] == \
           [(i.line_no, i.custom_id, type(i).__name__, getattr(i, "message", None)) for i in whole]
    assert "32 MiB" in whole[1].message


def test_a_cr_only_file_is_read_as_lines_by_the_shards_too(tmp_path):
    from carpool.distributed.worker import ShardReader

    path = tmp_path / "mac.jsonl"
    path.write_bytes(b'{"prompt": "a"}\r{"prompt": "b"}\r{"prompt": "c"}\r')
    items = [item for s in plan_shards(path, 2) for item in ShardReader(path, s)]
    assert [(i.line_no, type(i).__name__) for i in items] == [(1, "Task"), (2, "Task"), (3, "Task")]
