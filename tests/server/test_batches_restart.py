"""``carpool serve`` killed with -9 in the middle of a batch resumes it on restart: every
custom_id answered exactly once in the output file, none lost, none twice."""

from __future__ import annotations

import io
import json

import pytest

from carpool.server import start_server_process
from carpool.testing.batch_client import wait_until

openai = pytest.importorskip("openai")

LINES = 150


def _serve_args(batch_dir: str) -> list[str]:
    return ["--model", "tiny-random", "--port", "0", "--embedding-model", "none", "--max-num-seqs", "8",
            "--batch-dir", batch_dir, "--batch-max-inflight", "2"]


def _client(srv):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _lines() -> bytes:
    rows = [{"custom_id": f"t{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "tiny-random", "messages": [{"role": "user", "content": f"n {i}"}],
                      "max_tokens": 12, "ignore_eos": True}} for i in range(LINES)]
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def test_kill_9_mid_batch_then_restart_completes_without_loss_or_duplicates(tmp_path):
    batch_dir = str(tmp_path / "store")
    kills = []
    with start_server_process(_serve_args(batch_dir)) as srv:
        client = _client(srv)
        f = client.files.create(file=("in.jsonl", io.BytesIO(_lines())), purpose="batch")
        batch_id = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                         completion_window="24h").id
        b = wait_until(client, batch_id, lambda b: b.request_counts.completed >= 20)
        assert srv.process is not None
        srv.process.kill()  # SIGKILL: no shutdown hook runs
        srv.process.wait()
        kills.append(b.request_counts.completed)
    with start_server_process(_serve_args(batch_dir)) as srv:
        client = _client(srv)
        b = wait_until(client, batch_id,
                       lambda b: b.request_counts.completed >= kills[0] + 20 or b.status == "completed")
        assert b.status == "in_progress", "the batch must still be running at the second kill"
        assert srv.process is not None
        srv.process.kill()
        srv.process.wait()
        kills.append(b.request_counts.completed)
    with start_server_process(_serve_args(batch_dir)) as srv:
        client = _client(srv)
        b = wait_until(client, batch_id, lambda b: b.status not in ("validating", "in_progress", "finalizing"))
        assert b.status == "completed"
        assert b.request_counts.total == LINES and b.request_counts.completed == LINES
        assert b.request_counts.failed == 0 and b.error_file_id is None
        ids = [json.loads(x)["custom_id"] for x in client.files.content(b.output_file_id).text.splitlines()]
        assert sorted(ids) == sorted(f"t{i}" for i in range(LINES))  # none lost, none twice
        assert client.files.retrieve(f.id).bytes == len(_lines())
    assert kills[0] < LINES and kills[1] < LINES


def test_restart_keeps_journaled_answers_and_cuts_a_half_written_line(tiny_engine, tiny_config, tmp_path):
    """A batch stopped mid-way (here by a server shutdown) resumes from its journal: complete
    lines are kept as they are, a half-written last line is cut and its request answered again."""
    from carpool.server import ServerConfig, start_server

    cfg = ServerConfig(engine=tiny_config, port=0, embedding_model=None, batch_dir=str(tmp_path))
    rows = [{"custom_id": f"t{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "tiny-random", "messages": [{"role": "user", "content": f"n {i}"}], "max_tokens": 2}}
            for i in range(20)]
    with start_server(cfg, engine=tiny_engine) as srv:
        ticket = srv.call(_admit(srv.state))  # an online request waiting: the batch sends nothing yet
        client = _client(srv)
        f = client.files.create(file=("in.jsonl", io.BytesIO("".join(json.dumps(r) + "\n" for r in rows).encode())),
                                purpose="batch")
        batch_id = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                         completion_window="24h").id
        wait_until(client, batch_id, lambda b: b.status == "in_progress")
        assert ticket is not None  # never released: the server stops with the batch held back
    journal = tmp_path / "work" / batch_id / "output.jsonl"
    before = [{"custom_id": f"t{i}", "error": None, "id": f"batch_req_before{i}",
               "response": {"status_code": 200, "request_id": "before", "body": {}}} for i in range(5)]
    journal.write_text("".join(json.dumps(x) + "\n" for x in before) + '{"custom_id":"t5","error":null,"id":"b')
    with start_server(cfg, engine=tiny_engine) as srv:
        client = _client(srv)
        b = wait_until(client, batch_id, lambda b: b.status == "completed")
        out = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
    assert sorted(x["custom_id"] for x in out) == sorted(f"t{i}" for i in range(20))
    assert [x["id"] for x in out[:5]] == [f"batch_req_before{i}" for i in range(5)]  # kept, not redone
    assert b.request_counts.completed == 20 and not (tmp_path / "work" / batch_id).exists()


async def _admit(state):
    return state.admission.try_admit(1, 10)


def test_past_its_window_a_batch_expires_with_an_error_line_per_unanswered_request(tiny_engine, tiny_config,
                                                                                   tmp_path):
    from carpool.server import ServerConfig, start_server
    from carpool.server.batch_store import BatchStore

    cfg = ServerConfig(engine=tiny_config, port=0, embedding_model=None, batch_dir=str(tmp_path))
    rows = [{"custom_id": f"t{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "tiny-random", "messages": [{"role": "user", "content": f"n {i}"}], "max_tokens": 2}}
            for i in range(6)]
    with start_server(cfg, engine=tiny_engine) as srv:
        assert srv.call(_admit(srv.state)) is not None  # held: the batch answers nothing before the stop
        client = _client(srv)
        f = client.files.create(file=("in.jsonl", io.BytesIO("".join(json.dumps(r) + "\n" for r in rows).encode())),
                                purpose="batch")
        batch_id = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                         completion_window="24h").id
        wait_until(client, batch_id, lambda b: b.status == "in_progress")
    (tmp_path / "work" / batch_id / "output.jsonl").write_text(json.dumps(
        {"custom_id": "t0", "error": None, "id": "batch_req_x", "response": {"status_code": 200, "body": {}}}) + "\n")
    store = BatchStore(tmp_path)  # the window passed while the server was down
    batch = store.get_batch(batch_id)
    assert batch is not None
    batch.expires_at = batch.created_at - 1
    store.save_batch(batch)
    store.close()
    with start_server(cfg, engine=tiny_engine) as srv:
        client = _client(srv)
        b = wait_until(client, batch_id, lambda b: b.status not in ("in_progress", "finalizing"))
        assert b.status == "expired" and b.expired_at is not None
        assert (b.request_counts.completed, b.request_counts.failed) == (1, 5)
        errors = [json.loads(x) for x in client.files.content(b.error_file_id).text.splitlines()]
    assert sorted(e["custom_id"] for e in errors) == [f"t{i}" for i in range(1, 6)]
    assert {e["error"]["code"] for e in errors} == {"batch_expired"} and all(e["response"] is None for e in errors)
