"""The ids carpool makes up for repeated custom_ids never equal an id the user gave.

A repeated custom_id is refused with an error line under a name of its own
(``<id>#line-<n>``).  Before, ids ``a``, ``a``, ``a#line-2`` gave two lines under
``a#line-2``, and after an interrupted run a resume never sent the third task (exit 3).
Now the name is made up once the whole input was read, from names no line uses.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections import Counter

import pytest
from reliability_helpers import chat_task, complete_ids, read_jsonl, run_cli, run_cmd, write_jsonl

from carpool.jobs.python_api.run import run_batch
from carpool.testing.fault_server import FaultConfig

PATTERNS = {
    "rename_used_later": ["a", "a", "a#line-2"],
    "rename_used_earlier": ["a#line-2", "a", "a"],
    "chain": ["a", "a", "a#line-2", "a#line-2#2"],
    "two_repeats_both_used": ["a", "a", "a", "a#line-3", "a#line-2"],
    "a_used_name_repeated": ["a#line-2", "a#line-2", "a", "a", "a#line-2#line-2"],
}


def _check(ids: list[str], lines: list[dict], sent: Counter) -> None:
    """One line per input line under distinct ids; each id the user gave once answered (and
    sent once); each repeat one error line under a name no user gave."""
    users = list(dict.fromkeys(ids))  # first uses, in order
    got = Counter(d["custom_id"] for d in lines)
    assert all(n == 1 for n in got.values()), got
    assert len(lines) == len(ids)
    answered = {d["custom_id"] for d in lines if d["error"] is None}
    assert answered == set(users)
    made_up = [d for d in lines if d["error"] is not None]
    assert len(made_up) == len(ids) - len(users)
    assert all(d["error"]["field"] == "custom_id" and d["custom_id"] not in ids for d in made_up), made_up
    assert sent == Counter(users), sent


@pytest.mark.parametrize("name", list(PATTERNS))
def test_made_up_ids_never_equal_a_user_id(logging_fault_server, tmp_path, name):
    ids = PATTERNS[name]
    srv = logging_fault_server(FaultConfig())
    src = write_jsonl(tmp_path / "in.jsonl", [chat_task(cid, f"task {i}") for i, cid in enumerate(ids)])
    out = tmp_path / "out.jsonl"
    run_batch(src, out, endpoints=[srv.url], model="m", cache="off", progress=False)
    _check(ids, read_jsonl(out), Counter(srv.server.seen))
    # The same call again finds every line done (the made-up names are the same) and sends nothing.
    srv.server.reset_counts()
    run_batch(src, out, endpoints=[srv.url], model="m", cache="off", progress=False)
    assert len(read_jsonl(out)) == len(ids) and not srv.server.seen


@pytest.mark.parametrize("name", ["rename_used_later", "two_repeats_both_used"])
def test_a_list_of_rows_gets_each_row_its_own_line(logging_fault_server, name):
    ids = PATTERNS[name]
    srv = logging_fault_server(FaultConfig())
    rows = [chat_task(cid, f"task {i}") for i, cid in enumerate(ids)]
    results = run_batch(rows, endpoints=[srv.url], model="m", cache="off", progress=False)
    first = set()
    for cid, line in zip(ids, results, strict=True):
        if cid in first:  # a repeat: its row holds its error line
            assert line["error"] is not None and line["custom_id"] not in ids
        else:
            assert line["error"] is None and line["custom_id"] == cid
            first.add(cid)


@pytest.mark.parametrize("where", ["start", "end"])
def test_an_interrupted_run_resumes_every_user_task(logging_fault_server, tmp_path, where):
    # 40 ordinary tasks and a colliding pattern at the start or the end of the file; SIGTERM
    # once a few lines are written; the resume sends every task the first run did not answer.
    srv = logging_fault_server(FaultConfig(latency_s=0.2))
    filler = [f"t{i}" for i in range(40)]
    # "a" twice, then the name the second one's error line had (its line number)
    second = 2 if where == "start" else len(filler) + 2
    pattern = ["a", "a", f"a#line-{second}"]
    ids = pattern + filler if where == "start" else filler + pattern
    src = write_jsonl(tmp_path / "in.jsonl", [chat_task(cid, f"task {i}") for i, cid in enumerate(ids)])
    out = tmp_path / "out.jsonl"
    args = [str(src), "-o", str(out), "--endpoint", srv.url, "--model", "m", "--cache", "off",
            "--concurrency", "2", "--no-progress"]
    proc = subprocess.Popen(run_cmd(args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while len(complete_ids(out)) < 4 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err.decode()[-2000:]
    assert len(read_jsonl(out)) < len(ids)
    srv.quiesce()
    again = run_cli(args, timeout=300)
    assert again.returncode == 3, again.stderr.decode()[-2000:]  # the repeat's error line
    _check(ids, read_jsonl(out), Counter(srv.server.seen))


def test_ordered_output_keeps_each_repeat_in_its_place(logging_fault_server, tmp_path):
    # --ordered: the error line of a repeat sits where the repeat was in the input, under a
    # name no line uses, even when the name it would have had comes on a later line.
    ids = ["a", "b", "a", "c", "a#line-3", "a"]
    srv = logging_fault_server(FaultConfig())
    src = write_jsonl(tmp_path / "in.jsonl", [chat_task(cid, f"task {i}") for i, cid in enumerate(ids)])
    out = tmp_path / "out.jsonl"
    run_batch(src, out, endpoints=[srv.url], model="m", cache="off", progress=False, ordered=True)
    got = [d["custom_id"] for d in read_jsonl(out)]
    assert got == ["a", "b", "a#line-3#2", "c", "a#line-3", "a#line-6"]
    _check(ids, read_jsonl(out), Counter(srv.server.seen))
