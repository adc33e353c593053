"""Readers and per-line validation, through the whole pipeline on the echo backend."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from carpool.errors import StartRefused
from carpool.jobs.python_api.run import run_batch


def lines(path):
    return [json.loads(x) for x in open(path)]


def test_bad_lines_are_reported_with_line_and_field_and_the_rest_runs(tmp_path):
    src = tmp_path / "in.jsonl"
    rows = [
        json.dumps({"custom_id": "ok1", "messages": [{"role": "user", "content": "hi"}]}),
        "{not json",
        json.dumps({"custom_id": "nofield", "max_tokens": 3}),
        json.dumps({"custom_id": "badtype", "messages": [{"role": "user", "content": 5}]}),
        json.dumps({"custom_id": "badmax", "prompt": "x", "max_tokens": "ten"}),
        "",
        json.dumps({"custom_id": "ok2", "prompt": "hello"}),
        json.dumps([1, 2]),
        json.dumps({"custom_id": "badurl", "method": "POST", "url": "/v1/images", "body": {}}),
    ]
    src.write_text("\n".join(rows) + "\n")
    out = tmp_path / "out.jsonl"
    summary = run_batch(src, out, echo=True, cache="off")
    got = {d["custom_id"]: d for d in lines(out)}
    assert len(got) == 8  # the blank line is no task
    assert got["ok1"]["error"] is None and got["ok2"]["response"]["status_code"] == 200
    assert got["line-2"]["error"]["line"] == 2 and "not valid JSON" in got["line-2"]["error"]["message"]
    assert got["nofield"]["error"]["field"] == "messages"
    assert got["badtype"]["error"]["field"] == "messages[0].content" and got["badtype"]["error"]["line"] == 4
    assert got["badmax"]["error"]["field"] == "max_tokens"
    assert got["line-8"]["error"]["code"] == "invalid_input"
    assert got["badurl"]["error"]["field"] == "url"
    assert summary["bad_lines"] == 6 and summary["ok"] == 2


def test_openai_batch_format_and_output_shape(tmp_path):
    src = tmp_path / "batch.jsonl"
    with open(src, "w") as f:
        f.writelines(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": "x", "messages": [{"role": "user", "content": f"q{i}"}]}}) + "\n"
                               for i in range(3))
    out = tmp_path / "out.jsonl"
    run_batch(src, out, echo=True, cache="off")
    for d in lines(out):
        assert set(d) == {"id", "custom_id", "response", "error"}
        assert set(d["response"]) == {"status_code", "request_id", "body"}
        assert d["id"].startswith("batch_req_")


def test_csv_with_template(tmp_path):
    src = tmp_path / "reviews.csv"
    src.write_text('id,review,stars\nr1,"great, really",5\nr2,"bad\nvery bad",1\n')
    from carpool.jobs.input.readers import Reader
    from carpool.jobs.input.tasks import Template

    items = list(Reader(src, template=Template("Review: {review} ({stars})", system="Classify.", id_column="id")))
    assert [t.custom_id for t in items] == ["r1", "r2"]
    assert items[1].request.body["messages"][1]["content"] == "Review: bad\nvery bad (1)"
    assert items[0].request.body["messages"][0] == {"role": "system", "content": "Classify."}
    bad = list(Reader(src, template=Template("{missing}")))
    assert bad[0].field == "template" and "missing" in bad[0].reason


def test_parquet_with_template_embeddings(tmp_path):
    src = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": ["a", "b", "c"], "key": ["k1", "k2", "k3"]}), src)
    out = tmp_path / "out.jsonl"
    from carpool.jobs.input.tasks import Template

    run_batch(src, out, echo=True, cache="off", template=Template("{text}", id_column="key", kind="embedding"))
    assert sorted(d["custom_id"] for d in lines(out)) == ["k1", "k2", "k3"]


def test_csv_without_template_says_what_to_do(tmp_path):
    src = tmp_path / "r.csv"
    src.write_text("review\nnice\n")
    out = tmp_path / "out.jsonl"
    with pytest.raises(StartRefused, match=r"no prompt, messages or input column in r.csv \(its columns: review\)"
                                           r".*template='Classify: \{review\}'"):
        run_batch(src, out, echo=True, cache="off")
    assert not out.exists()


def test_an_output_over_the_input_or_a_report_over_the_output_is_refused_before_anything_runs(tmp_path):
    """The output is the job's journal: written over the input it took each task for answered
    (exit 0, nothing run); a report written over the output replaced the answers with HTML."""
    import os
    import subprocess
    import sys

    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    before = src.read_bytes()
    os.link(src, tmp_path / "hard.jsonl")

    def run(*args):
        return subprocess.run([sys.executable, "-m", "carpool.cli", "run", *map(str, args), "--echo",
                               "--cache", "off"], capture_output=True, text=True, timeout=120, cwd=tmp_path)

    for out in ("in.jsonl", "./in.jsonl", tmp_path / "hard.jsonl"):
        p = run("in.jsonl", "-o", out)
        assert p.returncode == 2, p.stderr
        assert "is the input file" in p.stderr and "-o in.results.jsonl" in p.stderr
    p = run("in.jsonl", "-o", "r.jsonl", "--report", "r.jsonl")
    assert p.returncode == 2 and "-o and --report are the same file ('r.jsonl')" in p.stderr, p.stderr
    p = run("in.jsonl", "-o", "r.csv", "--errors", "r.csv.jsonl")
    assert p.returncode == 2 and "-o's journal and --errors are the same file" in p.stderr, p.stderr
    p = run("in.jsonl", "-o", "r.jsonl", "--report", "nodir/r.html")  # found after the whole job, before
    assert p.returncode == 5 and "--report 'nodir/r.html': its directory 'nodir' does not exist" in p.stderr, p.stderr
    (tmp_path / "d.jsonl").mkdir()
    p = run("in.jsonl", "-o", "d.jsonl")  # was exit 5 with a bare "[Errno 21] Is a directory"
    assert p.returncode == 2 and "-o 'd.jsonl' is a directory: name a file in it, e.g. 'd.jsonl/results.jsonl'" \
        in p.stderr, p.stderr
    p = run("in.jsonl", "-o", "r.jsonl", "--report", "d.jsonl")
    assert p.returncode == 2 and "'d.jsonl/report.html'" in p.stderr, p.stderr
    (tmp_path / "d.jsonl").rmdir()
    p = run("in.jsonl", "-o", "r.jsonl", "--summary-json=r.jsonl")
    assert p.returncode == 2 and "-o and --summary-json are the same file" in p.stderr, p.stderr
    assert src.read_bytes() == before
    assert sorted(f.name for f in tmp_path.iterdir()) == ["hard.jsonl", "in.jsonl"]
    with pytest.raises(StartRefused, match=r"output '.*/in.jsonl' is the input file.*output='.*/in.results.jsonl'"):
        run_batch(str(src), str(tmp_path / "in.jsonl"), echo=True, cache="off")
    assert src.read_bytes() == before


def test_a_byte_order_mark_is_not_part_of_the_first_line_or_column(tmp_path):
    """Windows editors and Excel's "CSV UTF-8" start the file with a UTF-8 byte order mark: the
    first JSONL line failed as "not valid JSON" and the first CSV column was named '\\ufefftext'."""
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + b"\r\n".join(
        json.dumps({"custom_id": c, "messages": [{"role": "user", "content": c}]}).encode() for c in "ab") + b"\r\n")
    out = tmp_path / "out.jsonl"
    run_batch(src, out, echo=True, cache="off")
    got = lines(out)
    assert [d["custom_id"] for d in got] == ["a", "b"] and all(d["error"] is None for d in got)
    sheet = tmp_path / "sheet.csv"
    sheet.write_bytes(b"\xef\xbb\xbftext,id\r\nhello,r1\r\nworld,r2\r\n")
    out2 = tmp_path / "out2.jsonl"
    from carpool.jobs.input.tasks import Template

    run_batch(sheet, out2, echo=True, cache="off", template=Template("Say: {text}", id_column="id"))
    got = lines(out2)
    assert [d["custom_id"] for d in got] == ["r1", "r2"] and all(d["error"] is None for d in got)


@pytest.mark.parametrize("compress", ["gzip", "bz2", "lzma"])
def test_a_compressed_input_is_refused_at_the_start_with_the_command_that_decompresses_it(tmp_path, compress):
    """Read as text every line of it failed as "not UTF-8" after the job had started (exit 3)."""
    import importlib

    module = importlib.import_module(compress)
    src = tmp_path / "in.jsonl.z"
    src.write_bytes(module.compress((json.dumps({"custom_id": "a", "prompt": "hi"}) + "\n").encode()))
    out = tmp_path / "out.jsonl"
    kind = {"gzip": "gzip", "bz2": "bzip2", "lzma": "xz"}[compress]
    with pytest.raises(StartRefused, match=rf"'.*in.jsonl.z' is {kind}-compressed: .*decompress it first"):
        run_batch(src, out, echo=True, cache="off")
    assert not out.exists()


def test_a_csv_row_that_is_not_utf8_is_an_error_line_naming_the_column(tmp_path):
    """A CSV saved as Latin-1 had its accented letters replaced by U+FFFD and sent as such,
    every answer about a text the model never saw; the row is now an error line, as a JSONL
    line that is not UTF-8 is, and the other rows run."""
    from carpool.jobs.input.tasks import Template

    src = tmp_path / "latin.csv"
    src.write_bytes(b"text,id\nhello,r1\ncaf\xe9 cr\xe8me,r2\n")
    out = tmp_path / "out.jsonl"
    run_batch(src, out, echo=True, cache="off", template=Template("Say: {text}", id_column="id"))
    got = {d["custom_id"]: d for d in lines(out)}
    assert got["r1"]["error"] is None
    bad = got["line-3"]["error"]
    assert bad["field"] == "text" and bad["line"] == 3 and "not UTF-8 text (byte 0xe9)" in bad["message"]
    assert "\ufffd" not in out.read_text(encoding="utf-8")


def test_the_python_api_names_its_output_argument_in_the_suffix_refusal(tmp_path):
    """run_batch said "-o/--output" and "e.g. -o x.jsonl", flags a Python caller never wrote."""
    out = tmp_path / "x.txt"
    with pytest.raises(StartRefused, match=r"^output '.*x.txt' has suffix '.txt': .* e.g. output='.*/x.jsonl'$"):
        run_batch(["hi"], str(out), echo=True, cache="off")
    assert not out.exists()
