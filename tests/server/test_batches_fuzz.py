"""Property-based tests of the Batch API: whatever the lines, ids and forms hold, nothing crashes,
every batch ends, every request is answered exactly once and every answer file is UTF-8 JSON.

These would have found the lone surrogate that froze a batch, the unbounded validation
messages, the leaked upload files and the 500s of malformed multipart headers."""

from __future__ import annotations

import http.client
import io
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from carpool.server.batch_input import MAX_MESSAGE_CHARS, MAX_REPORTED_ERRORS, check_input, iter_requests
from carpool.server.batch_journal import journal_id
from carpool.testing.batch_client import output_lines, wait_final

openai = pytest.importorskip("openai")

# Any character, lone surrogates included (only a JSON escape can carry them).
any_char = st.characters(exclude_categories=()) | st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
texts = st.text(any_char, max_size=12)
json_values = st.recursive(st.none() | st.booleans() | st.integers() | texts,
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
                           max_leaves=8)


@st.composite
def batch_lines(draw) -> bytes:
    """A batch input file: mostly lines of the right shape with arbitrary ids and texts, some not."""
    out = []
    for i in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["good", "good", "good", "odd_field", "raw"]))
        line = {"custom_id": draw(texts) or f"id-{i}", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "tiny-random", "max_tokens": 2,
                         "messages": [{"role": "user", "content": draw(texts)}]}}
        if kind == "odd_field":
            line[draw(st.sampled_from(["custom_id", "method", "url", "body"]))] = draw(json_values)
        out.append(json.dumps(line).encode() if kind != "raw" else draw(st.binary(max_size=40)).replace(b"\n", b""))
    return b"\n".join(out) + b"\n"


@given(batch_lines())
@settings(max_examples=300, deadline=None)
def test_the_input_check_never_raises_and_its_errors_stay_small(tmp_path_factory, raw):
    path = tmp_path_factory.mktemp("in") / "input.jsonl"
    path.write_bytes(raw)
    check = check_input(path, "/v1/chat/completions", max_requests=1000)
    assert len(check.errors) <= MAX_REPORTED_ERRORS
    assert all(len(e.message) <= MAX_MESSAGE_CHARS for e in check.errors)
    if not check.errors:
        lines = list(iter_requests(path))
        assert len(lines) == check.total
        assert len({x.custom_id for x in lines}) == len(lines)  # one journal name per request
        for x in lines:
            x.custom_id.encode("utf-8")  # every journal name is UTF-8 text


@given(texts)
def test_journal_ids_are_utf8_and_leave_unicode_ids_as_they_are(custom_id):
    name = journal_id(custom_id)
    name.encode("utf-8")
    try:
        custom_id.encode("utf-8")
    except UnicodeEncodeError:
        assert name != custom_id
    else:
        assert name == custom_id


@given(raw=batch_lines())
# Found by this test: a custom_id of U+0085, written unescaped, split the output line in two for a
# reader that splits on str.splitlines() (as output_lines does).
@example(raw=b'{"custom_id": "\\u0085", "method": "POST", "url": "/v1/chat/completions", "body": '
             b'{"model": "tiny-random", "max_tokens": 2, "messages": [{"role": "user", "content": ""}]}}\n')
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_every_batch_ends_and_answers_each_request_once(client, raw):
    f = client.files.create(file=("in.jsonl", io.BytesIO(raw)), purpose="batch")
    b = wait_final(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                 completion_window="24h").id, timeout_s=120)
    assert b.status in ("completed", "failed"), b.errors
    if b.status == "failed":
        assert b.errors.data and b.output_file_id is None
        return
    answered = output_lines(client, b.output_file_id) + output_lines(client, b.error_file_id)
    ids = [x["custom_id"] for x in answered]
    assert len(ids) == len(set(ids)) == b.request_counts.total
    assert (b.request_counts.completed, b.request_counts.failed) == (
        len(output_lines(client, b.output_file_id)), len(output_lines(client, b.error_file_id)))


PART_NAMES = st.sampled_from(["file", "file", "purpose", "other", ""])
header_bytes = st.binary(max_size=30) | st.text(any_char, max_size=20).map(
    lambda t: t.encode("utf-8", "surrogatepass"))


@given(parts=st.lists(st.tuples(PART_NAMES, header_bytes, st.binary(max_size=50)), max_size=5))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_no_multipart_form_gets_a_500_or_leaves_a_file_behind(batch_server, parts):
    boundary = b"fuzzboundary3"
    body = b""
    for name, filename, content in parts:
        disposition = b'form-data; name="' + name.encode() + b'"; filename="' + filename + b'"'
        body += b"--" + boundary + b"\r\nContent-Disposition: " + disposition + b"\r\n\r\n" + content + b"\r\n"
    body += b"--" + boundary + b"--\r\n"
    conn = http.client.HTTPConnection("127.0.0.1", batch_server.port, timeout=60)
    try:
        conn.request("POST", "/v1/files", body=body,
                     headers={"Content-Type": "multipart/form-data; boundary=" + boundary.decode()})
        resp = conn.getresponse()
        status, answer = resp.status, json.loads(resp.read())
    finally:
        conn.close()
    assert status < 500, answer
    assert status == 200 or answer["error"]["message"]
    files = Path(batch_server.state.config.batch_dir) / "files"
    assert not list(files.glob("upload-*"))
