"""The Files and Batches API of a real server fed what a hostile or careless client sends:
ids and texts that are not Unicode, oversized fields, malformed multipart forms."""

from __future__ import annotations

import http.client
import json
from pathlib import Path

import pytest

from carpool.testing.batch_client import output_lines, request_line, start_batch, wait_final

openai = pytest.importorskip("openai")


def test_a_custom_id_with_a_lone_surrogate_is_its_lines_error_and_the_others_are_answered(client):
    lines = [request_line(i) for i in range(15)]
    lonely = request_line(99)
    lonely["custom_id"] = "\ud800lonely-id"  # json.dumps writes the escape "\ud800"
    lines.insert(7, lonely)
    b = wait_final(client, start_batch(client, lines).id)
    assert b.status == "completed", b.errors
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (16, 15, 1)
    [err] = output_lines(client, b.error_file_id)
    assert err["custom_id"] == "\\ud800lonely-id"  # the escape spelled out: the file stays UTF-8
    assert err["response"]["status_code"] == 400 and err["response"]["body"]["error"]["param"] == "custom_id"
    assert sorted(x["custom_id"] for x in output_lines(client, b.output_file_id)) == sorted(
        f"task-{i}" for i in range(15))


def test_message_content_with_a_lone_surrogate_is_a_400_line(client):
    bad = request_line(1)
    bad["body"]["messages"][0]["content"] = "hi \udfff there"
    b = wait_final(client, start_batch(client, [request_line(0), bad]).id)
    assert (b.status, b.request_counts.completed, b.request_counts.failed) == ("completed", 1, 1)
    [err] = output_lines(client, b.error_file_id)
    assert err["custom_id"] == "task-1" and err["response"]["status_code"] == 400
    assert err["response"]["body"]["error"]["param"] == "messages[0].content"


def test_validation_errors_stay_small_whatever_the_lines_hold(client):
    lines = [request_line(i, method="X" * 2_000_000) for i in range(10)]
    b = wait_final(client, start_batch(client, lines).id)
    assert b.status == "failed" and len(b.errors.data) == 10
    assert all(len(e.message) <= 500 for e in b.errors.data)
    raw = client.batches.with_raw_response.retrieve(b.id)
    assert len(raw.content) < 20_000
    listed = client.batches.with_raw_response.list(limit=5)
    assert len(listed.content) < 100_000


def test_a_custom_id_past_the_limit_fails_the_batch_naming_the_line(client):
    b = wait_final(client, start_batch(client, [request_line(0), request_line(1, custom_id="x" * 5000)]).id)
    assert b.status == "failed"
    [e] = b.errors.data
    assert (e.code, e.line, e.param) == ("invalid_value", 2, "custom_id") and len(e.message) < 300


def _multipart(parts: list[tuple[bytes, bytes]]) -> tuple[bytes, str]:
    """A multipart/form-data body of (raw Content-Disposition value, content) parts."""
    boundary = "carpoolboundary7"
    body = b""
    for disposition, content in parts:
        body += (b"--" + boundary.encode() + b"\r\nContent-Disposition: " + disposition + b"\r\n\r\n"
                 + content + b"\r\n")
    body += b"--" + boundary.encode() + b"--\r\n"
    return body, f"multipart/form-data; boundary={boundary}"


def _post_form(server, parts: list[tuple[bytes, bytes]]) -> tuple[int, dict]:
    body, content_type = _multipart(parts)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("POST", "/v1/files", body=body, headers={"Content-Type": content_type})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def _leftovers(server) -> list[str]:
    files = Path(server.state.config.batch_dir) / "files"
    return sorted(p.name for p in files.iterdir() if p.name.startswith("upload-"))


PURPOSE = (b'form-data; name="purpose"', b"batch")


def test_a_form_with_several_file_parts_is_refused_and_leaves_no_file(batch_server):
    parts = [(b'form-data; name="file"; filename="in.jsonl"', json.dumps(request_line(i)).encode())
             for i in range(5)]
    status, body = _post_form(batch_server, [PURPOSE, *parts])
    assert status == 400 and body["error"]["param"] == "file"
    assert _leftovers(batch_server) == []


@pytest.mark.parametrize("filename", [b"in\x00.jsonl", b"a" * 100_000, b"tab\there.jsonl", b"\xff\xfe.jsonl"],
                         ids=["nul", "100k", "tab", "not-utf8"])
def test_a_bad_file_name_is_a_400_not_a_500(batch_server, filename):
    status, body = _post_form(batch_server, [PURPOSE, (b'form-data; name="file"; filename="' + filename + b'"',
                                                       b"{}\n")])
    assert status == 400, body
    assert body["error"]["message"] and _leftovers(batch_server) == []
