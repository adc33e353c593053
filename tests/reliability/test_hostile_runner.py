"""Hostile input to ``carpool run``: each test is one of the reported repros.

- custom_ids are any non-empty string: ``\\n``, ``\\r``, ``\\0`` used to raise before sending
  (labelled ``engine_error``), and a 10k-character one got the server's 400 (the id travelled
  raw in a header);
- a dedup follower never takes another task's error: two tasks with the same body, the
  leader failing for a reason of its own, used to give both the leader's error line;
- a line past the length limit is one error line, read past without holding it;
- a FIFO (with no writer: the job hung in ``open()``, deaf to SIGTERM and SIGINT) and
  ``/dev/zero`` (grew ~75 MB/s) are refused at start with exit code 2;
- a CR-only file (old Mac) was one error line: it reads as lines, CRLF and LF as before;
- a missing output directory named an internal temp file: now the -o path and the fix (exit 5).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.parse

import pytest
from reliability_helpers import chat_task, read_jsonl, run_cli, run_cmd, write_jsonl

from carpool.client.http_backend import MAX_ID_HEADER, custom_id_header
from carpool.jobs.input.readers import MAX_LINE_BYTES, TooLong, numbered_lines
from carpool.jobs.python_api.run import run_batch
from carpool.testing.fault_server import Fault, FaultConfig

ODD_IDS = ["new\nline", "carriage\rreturn", "nul\0byte", "x" * 10_000, "é ü 日本 \U0001F600", " ",
           "%41 is not A", "a:b;c=d, e"]


def test_any_non_empty_custom_id_travels_over_http(logging_fault_server, tmp_path):
    srv = logging_fault_server(FaultConfig())
    rows = [chat_task(cid, f"task {i}") for i, cid in enumerate(ODD_IDS)]
    out = tmp_path / "out.jsonl"
    run_batch(write_jsonl(tmp_path / "in.jsonl", rows), out, endpoints=[srv.url], model="m", cache="off")
    got = {d["custom_id"]: d for d in read_jsonl(out)}
    assert sorted(got) == sorted(ODD_IDS)
    assert [cid for cid, d in got.items() if d["error"] is not None] == [], \
        {cid[:20]: d["error"] for cid, d in got.items() if d["error"] is not None}
    # The server saw each id (the short ones exactly, percent-decoded), once.
    seen = srv.server.snapshot()
    assert all(seen.get(cid) == ["ok"] for cid in ODD_IDS if cid != "x" * 10_000), seen.keys()
    assert len(seen) == len(ODD_IDS)


def test_the_custom_id_header_is_bounded_and_decodes_back():
    for cid in ODD_IDS:
        value = custom_id_header(cid)
        assert len(value) <= MAX_ID_HEADER and value.isascii() and value.isprintable()
        if len(cid) < 50:
            assert urllib.parse.unquote(value) == cid
    long_a, long_b = "é" * 5000, "é" * 4999 + "e"  # differ only past the cut: the digest tells them apart
    assert custom_id_header(long_a) != custom_id_header(long_b)
    assert "%" not in custom_id_header(long_a).split("~")[0][-2:]  # an escape is never cut in two


def test_a_dedup_follower_never_gets_the_leaders_own_error(logging_fault_server, tmp_path):
    # The leader's failure is its own (a fault keyed on its custom_id, forever); the follower,
    # same body, arrives while the leader is in flight.  Before: both lines were the leader's 500.
    srv = logging_fault_server(FaultConfig(latency_s=0.3, faults=[Fault("500", times=0, match="leader")]))
    body = chat_task("", "the same question")
    rows = [{**body, "custom_id": "leader"}, {**body, "custom_id": "follower"}]
    out = tmp_path / "out.jsonl"
    run_batch(write_jsonl(tmp_path / "in.jsonl", rows), out, endpoints=[srv.url], model="m", cache="off",
              concurrency=2, max_attempts=1)
    got = {d["custom_id"]: d for d in read_jsonl(out)}
    assert got["leader"]["error"]["code"] == "server_error"
    assert got["follower"]["error"] is None, got["follower"]["error"]
    assert srv.server.snapshot()["follower"] == ["ok"]  # it was sent on its own, after the leader failed


def test_the_issues_dedup_repro_a_10k_custom_id_beside_a_short_one(logging_fault_server, tmp_path):
    srv = logging_fault_server(FaultConfig(latency_s=0.2))
    body = chat_task("", "the same question")
    rows = [{**body, "custom_id": "y" * 10_000}, {**body, "custom_id": "short"}]
    out = tmp_path / "out.jsonl"
    s = run_batch(write_jsonl(tmp_path / "in.jsonl", rows), out, endpoints=[srv.url], model="m", cache="off",
                  concurrency=2)
    got = read_jsonl(out)
    assert [d["error"] for d in got] == [None, None]
    assert s["dedup_fanouts"] == 1 and srv.server.total_requests == 1  # dedup still works


def test_numbered_lines_read_past_a_long_line_in_pieces(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"ab\n" + b"x" * 25 + b"\n" + b"0123456789\n" + b"y" * 11 + b"\ntail")
    with open(p, "rb") as f:
        got = list(numbered_lines(f, max_bytes=10))
    assert got == [(1, b"ab\n"), (2, TooLong(26)), (3, b"0123456789\n"), (4, TooLong(12)), (5, b"tail")]
    assert isinstance(got[1][1], TooLong)


def test_a_line_past_the_limit_is_one_error_line_and_the_job_goes_on(logging_fault_server, tmp_path):
    srv = logging_fault_server(FaultConfig())
    src = tmp_path / "in.jsonl"
    with open(src, "wb") as f:
        f.write(json.dumps(chat_task("before", "a")).encode() + b"\n")
        f.write(b'{"custom_id": "huge", "messages": [{"role": "user", "content": "')
        f.write(b"z" * (MAX_LINE_BYTES + 10))
        f.write(b'"}]}\n')
        f.write(json.dumps(chat_task("after", "b")).encode() + b"\n")
    out = tmp_path / "out.jsonl"
    s = run_batch(src, out, endpoints=[srv.url], model="m", cache="off")
    got = {d["custom_id"]: d for d in read_jsonl(out)}
    assert sorted(got) == ["after", "before", "line-2"] and s["done"] == 3
    assert got["before"]["error"] is None and got["after"]["error"] is None
    err = got["line-2"]["error"]
    assert err["code"] == "invalid_input" and err["line"] == 2 and "MiB" in err["message"], err


def test_a_fifo_input_is_refused_at_once(tmp_path):
    fifo = tmp_path / "tasks.jsonl"
    os.mkfifo(fifo)  # nobody will ever write to it: open() would block for ever
    t0 = time.monotonic()
    r = run_cli([str(fifo), "-o", str(tmp_path / "out.jsonl"), "--dry-run", "--cache", "off"], timeout=60)
    assert r.returncode == 2, r.stderr.decode()[-2000:]
    err = r.stderr.decode()
    assert "FIFO" in err and "regular file" in err and "Traceback" not in err, err
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("dev", ["/dev/zero", "/dev/null", "/dev/urandom"])
def test_a_device_input_is_refused(tmp_path, dev):
    r = run_cli([dev, "-o", str(tmp_path / "out.jsonl"), "--dry-run", "--cache", "off"], timeout=60)
    assert r.returncode == 2, r.stderr.decode()[-2000:]
    assert "character device" in r.stderr.decode() and not (tmp_path / "out.jsonl").exists()


def test_a_directory_input_is_refused(tmp_path):
    r = run_cli([str(tmp_path), "-o", str(tmp_path / "out.jsonl"), "--dry-run", "--cache", "off"], timeout=60)
    assert r.returncode == 2 and "a directory" in r.stderr.decode(), r.stderr.decode()[-2000:]


def test_sigterm_stops_like_sigint(logging_fault_server, tmp_path):
    import signal

    srv = logging_fault_server(FaultConfig(latency_s=0.05))
    n = 200
    src = write_jsonl(tmp_path / "in.jsonl", [chat_task(f"t{i}", f"task {i}") for i in range(n)])
    out = tmp_path / "out.jsonl"
    args = [str(src), "-o", str(out), "--endpoint", srv.url, "--model", "m", "--cache", "off",
            "--concurrency", "4", "--no-progress"]
    proc = subprocess.Popen(run_cmd(args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (out.exists() and out.stat().st_size > 0):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Resume with" in err.decode(), err.decode()[-2000:]
    assert 0 < len(read_jsonl(out)) < n  # every line complete
    rerun = subprocess.run(run_cmd(args), capture_output=True, timeout=120, check=False)
    assert rerun.returncode == 0
    assert sorted(d["custom_id"] for d in read_jsonl(out)) == sorted(f"t{i}" for i in range(n))


@pytest.mark.parametrize(("name", "end"), [("cr", b"\r"), ("crlf", b"\r\n"), ("lf", b"\n")])
def test_every_line_ending_reads_as_lines(logging_fault_server, tmp_path, name, end):
    # Old Mac files end their lines in a lone CR: before, the whole file was one line, one
    # invalid_input error and nothing sent.  CRLF (Windows) and LF must read the same.
    srv = logging_fault_server(FaultConfig())
    src = tmp_path / f"{name}.jsonl"
    src.write_bytes(end.join(json.dumps(chat_task(f"t{i}", f"q {i}")).encode() for i in range(5)) + end)
    out = tmp_path / "out.jsonl"
    s = run_batch(src, out, endpoints=[srv.url], model="m", cache="off")
    got = read_jsonl(out)
    assert sorted(d["custom_id"] for d in got) == [f"t{i}" for i in range(5)]
    assert all(d["error"] is None for d in got), [d["error"] for d in got]
    assert s["total"] == 5  # the progress bar's count reads the same line ends


def test_a_cr_only_file_keeps_its_line_numbers_and_the_length_limit(tmp_path):
    p = tmp_path / "mac.jsonl"
    p.write_bytes(b"ab\r" + b"x" * 25 + b"\r0123456789\rtail")
    from carpool.jobs.input.readers import CRLines

    with open(p, "rb") as f:
        got = list(numbered_lines(CRLines(f, chunk=4), max_bytes=10))
    assert got == [(1, b"ab\n"), (2, TooLong(26)), (3, b"0123456789\n"), (4, b"tail")]


def test_a_missing_output_directory_names_the_o_path_and_the_fix(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [chat_task("a", "x")])
    missing = tmp_path / "no" / "such" / "dir"
    r = run_cli([str(src), "-o", str(missing / "out.jsonl"), "--echo-backend", "--cache", "off"], timeout=60)
    err = r.stderr.decode()
    assert r.returncode == 5, err  # the output cannot be written (carpool/jobs/summary/exit_codes.py)
    assert str(missing / "out.jsonl") in err and f"mkdir -p {missing}" in err, err
    assert ".tmp" not in err and "Traceback" not in err, err  # before: named out.jsonl.carpool.tmp
    assert not missing.exists()  # refused, not created
