"""The output-is-the-journal recovery, on its own."""

import json

import numpy as np

from carpool.journal.done import DoneSet, id_hash
from carpool.journal.journal import Journal
from carpool.journal.recovery import recover_file
from carpool.journal.writer import Appender, ResultWriter, error_line, success_line


def test_recover_cuts_partial_line_and_reads_escaped_ids(tmp_path):
    out = tmp_path / "o.jsonl"
    ids = ['plain', 'quo"te', "uni-\u00e9\u4e2d", "back\\slash", "line-7"]
    with open(out, "wb") as f:
        f.writelines(success_line(cid, 200, "r", {"x": 1}) for cid in ids)
        f.write(b'{"custom_id":"half","id":"x","resp')
    hashes, cut = recover_file(out)
    assert cut > 0 and out.read_bytes().endswith(b"\n")
    done = DoneSet(np.array(hashes, dtype=np.uint64))
    assert all(cid in done for cid in ids) and "half" not in done and "other" not in done


def test_a_line_break_inside_an_id_or_answer_keeps_its_line_whole(tmp_path):
    # U+0085 and U+2028/9 end a line for str.splitlines() (and the last two for JavaScript); left
    # unescaped, one answer read back as two broken lines.
    weird = "a\x85b\u2028c\u2029d"
    out = tmp_path / "o.jsonl"
    with open(out, "wb") as f:
        f.write(success_line(weird, 200, "r", {"content": weird}))
        f.write(error_line("e" + weird, "invalid_input", "bad " + weird, 1, "messages"))
    lines = out.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 2
    ok, bad = (json.loads(x) for x in lines)
    assert ok["custom_id"] == weird and ok["response"]["body"]["content"] == weird
    assert bad["custom_id"] == "e" + weird and weird in bad["error"]["message"]
    hashes, cut = recover_file(out)
    assert cut == 0 and weird in DoneSet(np.array(hashes, dtype=np.uint64))


def test_journal_counts_both_files_and_reset(tmp_path):
    out, err = tmp_path / "o.jsonl", tmp_path / "e.jsonl"
    w = ResultWriter(Appender(out), Appender(err))
    w.emit(0, success_line("a", 200, "r", {}), False)
    w.emit(1, error_line("b", "invalid_input", "line 2: bad", 2, "messages"), True)
    w.close()
    j = Journal(out, err)
    assert j.exists()
    done = j.recover()
    assert "a" in done and "b" in done and len(done) == 2
    j.reset()
    assert not out.exists() and not err.exists()


def test_ordered_writer_holds_until_the_gap_fills(tmp_path):
    out = tmp_path / "o.jsonl"
    freed = []
    w = ResultWriter(Appender(out), ordered=True)
    w.emit(1, success_line("b", 200, "", {}), done=lambda: freed.append(1))
    w.emit(2, success_line("c", 200, "", {}), done=lambda: freed.append(2))
    assert w.held == 2 and freed == []
    w.emit(0, success_line("a", 200, "", {}), done=lambda: freed.append(0))
    w.close()
    assert freed == [0, 1, 2] and w.held == 0
    assert [line.split('"')[3] for line in out.read_text().splitlines()] == ["a", "b", "c"]


def test_id_hash_is_stable():
    assert id_hash("x") == id_hash("x") != id_hash("y")
