"""``carpool run --batch-api openai`` against a real ``carpool serve`` (its /v1/files and
/v1/batches, the tiny-random engine): a job split into several batches, and ``kill -9`` of
the run three times at different moments.  What the server received is counted from the
input files of its batches (the Files API), so "submitted twice" is measured, not assumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from job_helpers import cli, lines

from carpool.server import start_server_process

N = 60


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    store = tmp_path_factory.mktemp("store")
    args = ["--model", "tiny-random", "--port", "0", "--embedding-model", "none", "--max-num-seqs", "8",
            "--batch-dir", str(store), "--batch-max-inflight", "2"]
    with start_server_process(args) as srv:
        yield srv.base_url + "/v1"


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def _received(base: str, since: set[str]) -> Counter:
    """custom_id -> times it was in the input file of a batch the server holds (not in ``since``)."""
    counts: Counter = Counter()
    after = None
    while True:
        page = _get(f"{base}/batches?limit=100" + (f"&after={after}" if after else ""))
        for b in page["data"]:
            if b["id"] in since:
                continue
            with urllib.request.urlopen(f"{base}/files/{b['input_file_id']}/content", timeout=30) as r:
                counts.update(json.loads(x)["custom_id"] for x in r.read().decode().splitlines() if x.strip())
        if not page["has_more"]:
            return counts
        after = page["data"][-1]["id"]


def _batch_ids(base: str) -> set[str]:
    return {b["id"] for b in _get(f"{base}/batches?limit=100")["data"]}


def _tasks(path: Path, n: int, max_tokens: int = 8) -> list[str]:
    ids = [f"t{i}" for i in range(n)]
    with open(path, "w") as f:
        for i, cid in enumerate(ids):
            f.write(json.dumps({"custom_id": cid, "metadata": {"i": i}, "max_tokens": max_tokens,
                                "ignore_eos": True, "temperature": 0,
                                "messages": [{"role": "user", "content": f"count {i}"}]}) + "\n")
    return ids


def _args(base: str, tasks: Path, out: Path, *extra: str) -> list:
    return [tasks, "-o", out, "--batch-api", "openai", "--endpoint", base, "--model", "tiny-random",
            "--api-key", "unused", "--batch-poll", "0.05", "--batch-max-poll", "0.3", "--no-progress", *extra]


def _check(out: Path, ids: list[str]) -> None:
    got = lines(out)
    assert sorted(x["custom_id"] for x in got) == sorted(ids)  # none lost, none twice
    for x in got:
        assert x["error"] is None, x
        assert x["response"]["status_code"] == 200
        assert x["response"]["body"]["object"] == "chat.completion"
        assert x["response"]["body"]["usage"]["completion_tokens"] == 8
        assert x["metadata"] == {"i": int(x["custom_id"][1:])}


def test_full_job_through_carpool_serve(serve, tmp_path):
    before = _batch_ids(serve)
    tasks, out = tmp_path / "tasks.jsonl", tmp_path / "out.jsonl"
    ids = _tasks(tasks, N)
    r = cli(*_args(serve, tasks, out, "--batch-max-requests", "25", "--summary-json", tmp_path / "s.json"),
            timeout=300)
    assert r.returncode == 0, r.stderr
    _check(out, ids)
    received = _received(serve, before)
    assert len(_batch_ids(serve) - before) == 3  # 60 tasks, 25 a batch
    assert received == Counter({cid: 1 for cid in ids})
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["done"] == N and summary["sent"] == N and summary["completion_tokens"] == 8 * N
    assert "completed" in r.stderr  # per-batch status


def _popen(args: list) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.endswith("API_KEY")}
    return subprocess.Popen([sys.executable, "-m", "carpool.cli", "run", *map(str, args)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _kill_when(proc: subprocess.Popen, cond, what: str, limit_s: float = 120.0) -> None:
    end = time.monotonic() + limit_s
    while not cond():
        assert proc.poll() is None, f"carpool run ended before {what}"
        assert time.monotonic() < end, f"gave up waiting for {what}"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)


def test_kill_9_three_times_loses_repeats_and_resubmits_nothing(serve, tmp_path):
    before = _batch_ids(serve)
    tasks, out = tmp_path / "tasks.jsonl", tmp_path / "out.jsonl"
    ids = _tasks(tasks, N)
    args = _args(serve, tasks, out, "--batch-max-requests", "15")
    index = tmp_path / "out.jsonl.batches" / "index.json"

    def submitted(n: int):
        def cond() -> bool:
            try:
                doc = json.loads(index.read_text())
            except (OSError, ValueError):
                return False
            return sum(1 for b in doc["batches"] if b["batch_id"]) >= n
        return cond

    def lines_written(n: int):
        return lambda: out.exists() and out.read_bytes().count(b"\n") >= n

    # 1: once the first batch is created (the others may be mid-submission)
    _kill_when(_popen(args), submitted(1), "the first batch was created")
    # 2: once all four are created, before any result is written
    _kill_when(_popen(args), submitted(4), "all batches were created")
    # 3: in the middle of writing results
    _kill_when(_popen(args), lines_written(1), "the first result was written")
    r = cli(*args, timeout=300)
    assert r.returncode == 0, r.stderr
    _check(out, ids)
    assert _received(serve, before) == Counter({cid: 1 for cid in ids})  # 0 tasks submitted twice


def _cancel_first_batch(serve: str, index: Path, proc: subprocess.Popen) -> str:
    """Cancel the run's first batch as soon as it exists (a stand-in for a batch that expires)."""
    end = time.monotonic() + 120
    while True:
        assert proc.poll() is None and time.monotonic() < end, "the batch was never created"
        try:
            batch_id = json.loads(index.read_text())["batches"][0]["batch_id"]
        except (OSError, ValueError, IndexError, KeyError):
            batch_id = None
        if batch_id:
            break
        time.sleep(0.005)
    req = urllib.request.Request(f"{serve}/batches/{batch_id}/cancel", method="POST", data=b"")
    with urllib.request.urlopen(req, timeout=30) as r:
        assert json.loads(r.read())["status"] in ("cancelling", "cancelled", "completed")
    return batch_id


@pytest.mark.parametrize("online", [False, True], ids=["resubmitted", "online-fallback"])
def test_requests_a_cancelled_batch_left_unanswered_are_resubmitted_or_sent_online(serve, tmp_path, online):
    before = _batch_ids(serve)
    tasks, out = tmp_path / "tasks.jsonl", tmp_path / "out.jsonl"
    ids = _tasks(tasks, N, max_tokens=48)
    args = _args(serve, tasks, out, *(["--batch-online-fallback"] if online else []))
    proc = subprocess.Popen([sys.executable, "-m", "carpool.cli", "run", *map(str, args)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _cancel_first_batch(serve, tmp_path / "out.jsonl.batches" / "index.json", proc)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    got = lines(out)
    assert sorted(x["custom_id"] for x in got) == sorted(ids) and all(x["error"] is None for x in got)
    received = _received(serve, before)
    again = sorted(cid for cid, n in received.items() if n == 2)
    assert set(received) == set(ids) and set(received.values()) <= {1, 2}
    if online:
        assert not again and "sending them online" in stderr  # batched once; the rest went online
    else:
        assert again and len(_batch_ids(serve) - before) == 2  # one new batch with what was left


def _post(url: str, data: bytes, headers: dict) -> dict:
    req = urllib.request.Request(url, data=data, headers=headers, method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def _left_submitting(out: Path, local_id: str, ids: list[str]) -> None:
    """The state a run killed between writing down a batch and learning its id leaves."""
    state = Path(str(out) + ".batches")
    state.mkdir()
    (state / f"{local_id}.ids").write_text("".join(json.dumps([c, c, i + 1, {"i": i}]) + "\n"
                                                   for i, c in enumerate(ids)))
    entry = {"local_id": local_id, "group": "tiny-random /v1/chat/completions", "n": len(ids),
             "prepared_at": time.time() - 1, "status": "submitting", "batch_id": None, "file_id": None,
             "state": "", "adopted": False}
    (state / "index.json").write_text(json.dumps({"provider": "openai", "batches": [entry], "attempts": {},
                                                  "online": []}))


@pytest.mark.parametrize("created", [True, False], ids=["create-happened", "create-never-left"])
def test_a_create_whose_answer_was_lost_is_found_by_its_metadata(serve, tmp_path, created):
    before = _batch_ids(serve)
    tasks, out = tmp_path / "tasks.jsonl", tmp_path / "out.jsonl"
    ids = _tasks(tasks, 12)
    local_id = f"cpb_lost_{created}_{os.getpid()}"
    _left_submitting(out, local_id, ids)
    if created:  # what the killed run had sent: its file and the create, metadata included
        body = "".join(json.dumps({"custom_id": x["custom_id"], "method": "POST", "url": "/v1/chat/completions",
                                   "body": {"model": "tiny-random", "messages": x["messages"], "max_tokens": 8,
                                            "ignore_eos": True, "temperature": 0}}) + "\n"
                       for x in lines(tasks)).encode()
        boundary = "carpoolboundary"
        form = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
                f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n"
                f"Content-Type: application/jsonl\r\n\r\n").encode() + body + f"\r\n--{boundary}--\r\n".encode()
        file = _post(f"{serve}/files", form, {"Content-Type": f"multipart/form-data; boundary={boundary}"})
        _post(f"{serve}/batches", json.dumps({"input_file_id": file["id"], "endpoint": "/v1/chat/completions",
                                              "completion_window": "24h",
                                              "metadata": {"carpool_batch": local_id}}).encode(),
              {"Content-Type": "application/json"})
    r = cli(*_args(serve, tasks, out), timeout=300)
    assert r.returncode == 0, r.stderr
    _check(out, ids)
    assert ("created before the last run stopped" in r.stderr) == created
    assert ("was never created" in r.stderr) == (not created)
    assert len(_batch_ids(serve) - before) == 1
    assert _received(serve, before) == Counter({cid: 1 for cid in ids})


def test_sigterm_mid_run_stops_it_as_interrupted_and_the_same_command_finishes(serve, tmp_path):
    """A process manager's SIGTERM while batches run: exit 130 with nothing lost or sent
    twice, and the same command picks the submitted batches up."""
    before = _batch_ids(serve)
    tasks, out = tmp_path / "tasks.jsonl", tmp_path / "out.jsonl"
    ids = _tasks(tasks, N)
    args = _args(serve, tasks, out, "--batch-max-requests", "30")
    index = tmp_path / "out.jsonl.batches" / "index.json"
    proc = subprocess.Popen([sys.executable, "-m", "carpool.cli", "run", *map(str, args)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    end = time.monotonic() + 120
    while not (index.exists() and '"batch_id": "' in index.read_text()):
        assert proc.poll() is None and time.monotonic() < end, "no batch was created"
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    r = cli(*args, timeout=300)
    assert r.returncode == 0, r.stderr
    _check(out, ids)
    assert _received(serve, before) == Counter({cid: 1 for cid in ids})
