"""The OpenAI Files and Batches API of a real carpool server on 127.0.0.1, driven by the openai SDK."""

from __future__ import annotations

import io
import json
import time

import pytest

from carpool.server import ServerConfig, start_server
from carpool.server.batches import BATCHES
from carpool.testing.batch_client import output_lines, request_line, upload, wait_final

openai = pytest.importorskip("openai")


def test_sdk_workflow_one_line_per_custom_id(client):
    f = upload(client, [request_line(i) for i in range(40)])
    assert f.object == "file" and f.purpose == "batch" and f.filename == "in.jsonl" and f.bytes > 0
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                              metadata={"job": "smoke"})
    assert b.status in ("validating", "in_progress") and b.metadata == {"job": "smoke"}
    b = wait_final(client, b.id)
    assert b.status == "completed", b.errors
    assert b.request_counts.total == 40 and b.request_counts.completed == 40 and b.request_counts.failed == 0
    assert b.model == "tiny-random" and b.error_file_id is None
    assert b.in_progress_at and b.finalizing_at and b.completed_at and b.expires_at == b.created_at + 86400
    out = output_lines(client, b.output_file_id)
    assert sorted(x["custom_id"] for x in out) == sorted(f"task-{i}" for i in range(40))
    first = out[0]
    assert first["error"] is None and first["id"].startswith("batch_req_")
    assert first["response"]["status_code"] == 200
    body = openai.types.chat.ChatCompletion.model_validate(first["response"]["body"])
    assert body.choices[0].message.role == "assistant" and body.usage.completion_tokens <= 3
    assert b.usage.output_tokens == sum(x["response"]["body"]["usage"]["completion_tokens"] for x in out)
    meta = client.files.retrieve(b.output_file_id)
    assert meta.purpose == "batch_output" and meta.bytes == len(client.files.content(b.output_file_id).content)


def test_request_errors_go_to_the_error_file(client):
    bad_body = request_line(1)
    bad_body["body"]["temperature"] = 7  # past OpenAI's range: this request's 400, not the batch's
    f = upload(client, [request_line(0), bad_body, request_line(2)])
    b = wait_final(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                 completion_window="24h").id)
    assert b.status == "completed"
    assert (b.request_counts.completed, b.request_counts.failed) == (2, 1)
    [err] = output_lines(client, b.error_file_id)
    assert err["custom_id"] == "task-1" and err["response"]["status_code"] == 400
    assert "temperature" in err["response"]["body"]["error"]["message"]
    assert {x["custom_id"] for x in output_lines(client, b.output_file_id)} == {"task-0", "task-2"}


@pytest.mark.parametrize(("lines", "code", "line", "param"), [
    ([request_line(0), "{not json"], "invalid_json_line", 2, None),
    ([request_line(0), {k: v for k, v in request_line(1).items() if k != "custom_id"}],
     "missing_required_parameter", 2, "custom_id"),
    ([request_line(0), request_line(1), request_line(0)], "duplicate_custom_id", 3, "custom_id"),
    ([request_line(0, url="/v1/completions")], "url_mismatch", 1, "url"),
    ([request_line(0), request_line(1, method="GET")], "invalid_method", 2, "method"),
    ([request_line(0), request_line(1, body={"model": "other", "messages": []})], "model_mismatch", 2,
     "body.model"),
])
def test_bad_input_file_fails_with_openai_errors(client, lines, code, line, param):
    f = upload(client, lines)
    b = wait_final(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                 completion_window="24h").id)
    assert b.status == "failed" and b.failed_at is not None and b.output_file_id is None
    [e] = b.errors.data
    assert (e.code, e.line, e.param) == (code, line, param), e
    assert e.message


def test_whole_file_limits(client):
    empty = client.files.create(file=("e.jsonl", io.BytesIO(b"\n")), purpose="batch")
    b = wait_final(client, client.batches.create(input_file_id=empty.id, endpoint="/v1/chat/completions",
                                                 completion_window="24h").id)
    assert b.status == "failed" and b.errors.data[0].code == "empty_file"
    many = upload(client, [request_line(i) for i in range(301)])  # the server allows 300
    b = wait_final(client, client.batches.create(input_file_id=many.id, endpoint="/v1/chat/completions",
                                                 completion_window="24h").id)
    assert b.status == "failed" and [e.code for e in b.errors.data] == ["too_many_tasks"]
    unknown = upload(client, [request_line(0, body={"model": "gpt-9", "messages": []})])
    b = wait_final(client, client.batches.create(input_file_id=unknown.id, endpoint="/v1/chat/completions",
                                                 completion_window="24h").id)
    assert b.status == "failed" and b.errors.data[0].code == "model_not_found"


def test_create_refuses_bad_parameters(client):
    f = upload(client, [request_line(0)])
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="1h")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=f.id, endpoint="/v1/images/generations", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-missing", endpoint="/v1/chat/completions", completion_window="24h")
    other = client.files.create(file=("u.jsonl", io.BytesIO(b"{}\n")), purpose="user_data")
    with pytest.raises(openai.BadRequestError, match="purpose 'batch'"):
        client.batches.create(input_file_id=other.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_missing")


def test_batch_list_pagination_newest_first(client):
    f = upload(client, [request_line(0)])
    made = [client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                  completion_window="24h").id for _ in range(5)]
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == made[::-1][:2]
    assert page.has_more is True and page.first_id == made[-1] and page.last_id == made[-2]
    walked = [b.id for b in client.batches.list(limit=2)]  # the SDK follows `after` = last id
    assert walked[:5] == made[::-1] and len(walked) == len(set(walked))
    nxt = client.batches.list(limit=3, after=made[-3])
    assert [b.id for b in nxt.data][:2] == made[::-1][3:5]
    for bid in made:
        wait_final(client, bid)


def test_files_list_retrieve_delete(client):
    a = upload(client, [request_line(0)], name="a.jsonl")
    b = upload(client, [request_line(1)], name="b.jsonl")
    page = client.files.list(limit=1)
    assert [x.id for x in page.data] == [b.id] and page.has_more is True
    asc = client.files.list(order="asc", purpose="batch")
    ids = [x.id for x in asc]
    assert ids.index(a.id) < ids.index(b.id)
    assert client.files.content(a.id).text == json.dumps(request_line(0)) + "\n"
    gone = client.files.delete(a.id)
    assert gone.deleted is True and gone.id == a.id
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(a.id)
    with pytest.raises(openai.NotFoundError):
        client.files.content(a.id)
    assert client.files.retrieve(b.id).filename == "b.jsonl"


def test_upload_past_the_size_limit_is_refused(tiny_engine, tiny_config, tmp_path):
    cfg = ServerConfig(engine=tiny_config, port=0, embedding_model=None, batch_dir=str(tmp_path),
                       max_batch_file_bytes=1000)
    with start_server(cfg, engine=tiny_engine) as srv:
        c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.APIStatusError) as e:
            c.files.create(file=("big.jsonl", io.BytesIO(b"x" * 5000)), purpose="batch")
        assert e.value.status_code == 413
        assert list(c.files.list()) == []
        assert list((tmp_path / "files").iterdir()) == []  # the partial upload is gone


def test_cancel_keeps_the_answers_so_far(client, batch_server):
    lines = [request_line(i, max_tokens=64) for i in range(200)]
    for x in lines:
        x["body"]["ignore_eos"] = True
    f = upload(client, lines)
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 60
    while client.batches.retrieve(b.id).request_counts.completed < 3:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    c = client.batches.cancel(b.id)
    assert c.status in ("cancelling", "cancelled") and c.cancelling_at is not None
    b = wait_final(client, b.id)
    assert b.status == "cancelled" and b.cancelled_at is not None
    assert 3 <= b.request_counts.completed < 200
    out = output_lines(client, b.output_file_id)
    assert len(out) == b.request_counts.completed == len({x["custom_id"] for x in out})
    assert batch_server.app[BATCHES].require().inflight == 0
    stats = batch_server.engine.stats()
    assert stats["num_requests_running"] + stats["num_requests_waiting"] == 0  # aborted, not left running
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(b.id)


def test_batch_waits_while_an_online_request_waits(client, batch_server):
    state = batch_server.state
    ticket = batch_server.call(_admit(state))  # an online request waiting for its first token
    try:
        f = upload(client, [request_line(i) for i in range(5)])
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + 30
        while client.batches.retrieve(b.id).status == "validating":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)
        held = client.batches.retrieve(b.id)
        assert held.status == "in_progress" and held.request_counts.completed == 0
        assert batch_server.app[BATCHES].require().inflight == 0
    finally:
        batch_server.call(_release(ticket))
    assert wait_final(client, b.id).request_counts.completed == 5


async def _admit(state):
    return state.admission.try_admit(1, 10)


async def _release(ticket):
    ticket.release()
