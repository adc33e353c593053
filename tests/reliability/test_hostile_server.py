"""Arbitrary request bodies against `carpool serve` (in a thread, over the tiny engine).

Hypothesis posts raw bytes, arbitrary JSON, and bodies built from the API's own field
names with values of any type (plus a few hand-made worst cases: nesting past the JSON
decoder's limit, invalid UTF-8, a prompt far past the context).  Whatever comes in:

- never a 5xx;
- an error is OpenAI-shaped: ``{"error": {"message", "type", "param", "code"}}`` with a
  non-empty message;
- a 200 is a well-formed completion (or an SSE stream that ends with ``[DONE]``);
- afterwards /health is OK, a normal request succeeds and the engine holds no request.

(schemathesis is not installed here; hypothesis drives the same idea over /openapi.json's
field names.)
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from carpool.server import ServerConfig, start_server

PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
FIELDS = ["model", "messages", "prompt", "input", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "top_k", "n", "stop", "seed", "stream", "stream_options", "logprobs", "ignore_eos", "stop_token_ids",
          "priority", "response_format", "user", "tools", "encoding_format", "dimensions", "echo", "best_of",
          "logit_bias", "presence_penalty", "frequency_penalty", "min_tokens", "suffix"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=15,
)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                                           "content": st.text(max_size=30) | json_values}), max_size=3)
plausible = {
    "model": st.sampled_from(["tiny-random", "nope", ""]) | json_values,
    "messages": messages | json_values,
    "prompt": st.text(max_size=40) | st.lists(st.integers(-5, 70000), max_size=5) | json_values,
    "input": st.text(max_size=40) | st.lists(st.text(max_size=10), max_size=3) | json_values,
}


@st.composite
def bodies(draw) -> bytes:
    form = draw(st.sampled_from(["raw", "json", "fields", "fields", "fields"]))
    if form == "raw":
        return draw(st.binary(max_size=300))
    if form == "json":
        return json.dumps(draw(json_values)).encode()
    keys = draw(st.lists(st.sampled_from(FIELDS), max_size=8, unique=True))
    body = {k: draw(plausible.get(k, json_values)) for k in keys}
    # Keep generations short so the run stays fast; the types are still anything.
    for k, cap in (("max_tokens", 3), ("max_completion_tokens", 3), ("n", 2), ("best_of", 2)):
        v = body.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > cap:
            body[k] = cap
    if isinstance(body.get("messages"), list) or isinstance(body.get("prompt"), (str, list)):
        body.setdefault("max_tokens", 2)
    return json.dumps(body).encode()


def post(url: str, raw: bytes, headers: dict | None = None) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, data=raw, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def check_answer(status: int, headers: dict, raw: bytes) -> None:
    assert status < 500, (status, raw[:300])
    if status != 200:
        body = json.loads(raw)
        assert set(body) == {"error"}, body
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and err["message"], err
        assert isinstance(err["type"], str) and err["type"]
        return
    if headers.get("Content-Type", "").startswith("text/event-stream"):
        events = [x for x in raw.split(b"\n\n") if x.strip()]
        assert events[-1].strip() == b"data: [DONE]", events[-3:]
        for e in events[:-1]:
            json.loads(e.strip()[len(b"data: "):])
        return
    body = json.loads(raw)
    assert body["object"] in ("chat.completion", "text_completion", "list"), body


@pytest.fixture(scope="module")
def fuzz_server(tiny_engine, tiny_config):
    cfg = ServerConfig(engine=tiny_config, port=0, embedding_model=None, max_queue_size=64)
    with start_server(cfg, engine=tiny_engine) as srv:
        yield srv


def assert_healthy(srv) -> None:
    with urllib.request.urlopen(srv.base_url + "/health", timeout=30) as r:
        assert r.status == 200
    status, _, raw = post(srv.base_url + "/v1/chat/completions",
                                json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode())
    assert status == 200 and json.loads(raw)["choices"][0]["message"]["role"] == "assistant"
    deadline = time.monotonic() + 30
    while srv.engine.stats()["num_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = srv.engine.stats()
    assert stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0


@pytest.mark.slow
@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.data_too_large])
@given(path=st.sampled_from(PATHS), raw=bodies())
def test_arbitrary_bodies_never_5xx_always_openai_errors(fuzz_server, path, raw):
    check_answer(*post(fuzz_server.base_url + path, raw))


@pytest.mark.parametrize("raw", [
    b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"prompt": "x", "extra": ' + b'{"a":' * 50_000 + b"1" + b"}" * 50_000 + b"}",
    # Shallow enough for the JSON decoder, deep for anything that walks the value recursively.
    b'{"messages": [{"role": "user", "content": ' + b"[" * 600 + b"]" * 600 + b"}]}",
    b'{"prompt": "x", "max_tokens": 2, "stop": ' + b"[" * 900 + b"]" * 900 + b"}",
    b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}',
    b'\xef\xbb\xbf{"prompt": "bom", "max_tokens": 2}',
    json.dumps({"prompt": "word " * 200_000, "max_tokens": 2}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "a\x00b"}], "max_tokens": 2}).encode(),
    b"",
    b"null",
], ids=["deep-array", "deep-object", "deep-600", "deep-900", "bad-utf8", "bom", "past-context", "nul", "empty", "null"])
@pytest.mark.parametrize("path", PATHS)
def test_worst_case_bodies(fuzz_server, path, raw):
    check_answer(*post(fuzz_server.base_url + path, raw))


def test_server_is_healthy_after_the_fuzzing(fuzz_server):
    assert_healthy(fuzz_server)


def test_body_past_the_size_limit_is_a_413_error(fuzz_server):
    raw = json.dumps({"prompt": "x" * (33 * 2**20), "max_tokens": 2}).encode()  # the limit is 32 MiB
    try:
        status, headers, body = post(fuzz_server.base_url + "/v1/completions", raw)
    except (ConnectionError, urllib.error.URLError):  # the server may close before the upload ends
        status = None
    if status is not None:
        assert status == 413, status
        check_answer(status, headers, body)
    assert_healthy(fuzz_server)
