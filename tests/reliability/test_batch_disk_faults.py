"""A batch whose disk fails -- full, read-only, a batch directory that cannot be opened -- says so
and goes on once the cause is gone; it never sits ``in_progress`` doing nothing.

The failing disk is ``carpool.testing.faulty_disk.FaultyDisk``, handed to a real server: every
byte the Files and Batches API writes goes through it, so it stands where a full tmpfs or a
read-only mount would, without root."""

from __future__ import annotations

import io
import json
import time
import urllib.error
import urllib.request

import pytest

from carpool.server import ServerConfig, start_server
from carpool.testing.batch_client import output_lines, request_line, upload, wait_final, wait_until
from carpool.testing.faulty_disk import FaultyDisk

openai = pytest.importorskip("openai")

LINES = 40


def _client(srv):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _served(tiny_engine, tiny_config, tmp_path, disk: FaultyDisk):
    cfg = ServerConfig(engine=tiny_config, port=0, embedding_model=None, batch_dir=str(tmp_path),
                       batch_max_inflight=2)
    return start_server(cfg, engine=tiny_engine, batch_disk=disk)


def _start_with_room(client, disk: FaultyDisk, room: int) -> str:
    """A batch of ``LINES`` requests started on a disk with ``room`` bytes left (its input is linked)."""
    f = upload(client, [request_line(i, max_tokens=2) for i in range(LINES)])
    disk.fill(room)
    return client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id


@pytest.mark.parametrize("fault", ["full", "read_only"])
def test_a_batch_on_a_failing_disk_says_why_keeps_its_counts_and_goes_on_once_it_is_fixed(
        tiny_engine, tiny_config, tmp_path, fault):
    disk = FaultyDisk()
    with _served(tiny_engine, tiny_config, tmp_path, disk) as srv:
        client = _client(srv)
        batch_id = _start_with_room(client, disk, 3000)  # a few answer lines fit, then the disk is full
        if fault == "read_only":
            wait_until(client, batch_id, lambda b: b.request_counts.completed >= 1)
            disk.read_only = True
        stalled = wait_until(client, batch_id, lambda b: b.errors is not None)
        assert stalled.status == "in_progress"
        [why] = stalled.errors.data
        assert why.code == "storage_unavailable" and "goes on by itself" in why.message
        assert 0 < stalled.request_counts.completed < LINES and stalled.request_counts.total == LINES
        with pytest.raises(openai.APIStatusError) as refused:  # an upload meanwhile: the disk's answer, no 500
            upload(client, [request_line(0)])
        assert refused.value.status_code in (503, 507)
        time.sleep(1.5)  # a retry or two later: still stalled, its counts kept
        again = client.batches.retrieve(batch_id)
        assert again.status == "in_progress" and again.request_counts.completed >= stalled.request_counts.completed
        disk.free()
        done = wait_final(client, batch_id, timeout_s=120)
        assert done.status == "completed" and done.errors is None, done.errors
        assert (done.request_counts.completed, done.request_counts.failed) == (LINES, 0)
        ids = [x["custom_id"] for x in output_lines(client, done.output_file_id)]
        assert sorted(ids) == sorted(f"task-{i}" for i in range(LINES))  # each once: the cut line redone
        assert not list((tmp_path / "files").glob("upload-*"))


def test_cancelling_a_stalled_batch_ends_it(tiny_engine, tiny_config, tmp_path):
    disk = FaultyDisk()
    with _served(tiny_engine, tiny_config, tmp_path, disk) as srv:
        client = _client(srv)
        batch_id = _start_with_room(client, disk, 2000)
        wait_until(client, batch_id, lambda b: b.errors is not None)
        assert client.batches.cancel(batch_id).status == "cancelling"
        done = wait_final(client, batch_id, timeout_s=120)
        assert done.status == "cancelled"
        assert done.request_counts.completed == len(output_lines(client, done.output_file_id))


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_batch_directory_that_cannot_be_opened_leaves_the_online_api_up(tiny_engine, tiny_config, tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the batch directory's parent should be")
    where = blocker / "batches"
    cfg = ServerConfig(engine=tiny_config, port=0, embedding_model=None, batch_dir=str(where))
    with start_server(cfg, engine=tiny_engine) as srv:
        client = _client(srv)
        answer = client.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=2)
        assert answer.choices[0].message.role == "assistant"
        status, body = _get(srv.base_url + "/v1/files")
        assert status == 503 and str(where) in body["error"]["message"]
        blocker.unlink()  # fixed while the server runs: the API opens at a next request
        deadline = time.monotonic() + 30
        while _get(srv.base_url + "/v1/files")[0] != 200:
            assert time.monotonic() < deadline
            time.sleep(0.5)
        f = client.files.create(file=("in.jsonl", io.BytesIO(json.dumps(request_line(0)).encode() + b"\n")),
                                purpose="batch")
        b = wait_final(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                     completion_window="24h").id)
        assert b.status == "completed"
