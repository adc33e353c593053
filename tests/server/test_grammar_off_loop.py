"""A grammar that takes seconds to compile holds no one else up, and hostile grammars are 400s.

The grammar of a request is compiled when it arrives (``carpool.server.grammar_gate``): on its
own threads, never on the event loop, bounded in size, time and number.  The slow grammar here
is a Lark rule of 100,000 alternatives with the size bound raised: llguidance spends seconds
on it and then fails on an internal limit, which must come back as a 400 naming the field,
without a Rust panic or backtrace.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest

from carpool.server import ServerConfig, start_server

SLOW_LARK = "start: " + " | ".join(json.dumps(f"option {i}") for i in range(100_000))
CHAT = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 2}
INTERNALS = ("panic", "backtrace", "<state>", "<non-verbose", "Traceback", "Parser: {", "u16::MAX")


def post(base: str, body: dict, timeout: float = 300) -> tuple[int, dict]:
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get_health(base: str) -> int:
    with urllib.request.urlopen(base + "/health", timeout=300) as r:
        return r.status


def in_background(base: str, body: dict) -> tuple[threading.Thread, dict]:
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(answer=post(base, body)), daemon=True)
    thread.start()
    return thread, out


def assert_clean_400(status: int, body: dict, param: str) -> None:
    assert status == 400, body
    err = body["error"]
    assert err["param"] == param
    assert param in err["message"]
    assert not any(word in json.dumps(body) for word in INTERNALS), err["message"]


@pytest.fixture(scope="module")
def roomy_server(tiny_engine, tiny_config):
    """Grammar size bound raised far past the slow grammar, so llguidance really works on it."""
    cfg = ServerConfig(engine=tiny_config, port=0, embedding_model=None, max_grammar_bytes=64 * 2**20,
                       grammar_timeout_s=600)
    with start_server(cfg, engine=tiny_engine) as srv:
        yield srv


def test_health_and_chat_answer_while_a_grammar_compiles(roomy_server):
    base = roomy_server.base_url
    for _ in range(3):
        slow, out = in_background(base, {**CHAT, "structured_outputs": {"grammar": SLOW_LARK}})
        # The slow request is sent first; each of these answers while its grammar still compiles.
        assert get_health(base) == 200
        status, body = post(base, CHAT)
        assert status == 200, body
        assert slow.is_alive(), "the slow grammar finished first: nothing shows the loop was free"
        slow.join(300)
        assert_clean_400(*out["answer"], "structured_outputs.grammar")


def test_a_compile_past_the_time_budget_is_a_400_naming_the_field(tiny_engine, tiny_config):
    cfg = ServerConfig(engine=tiny_config, port=0, embedding_model=None, max_grammar_bytes=64 * 2**20,
                       grammar_timeout_s=0.2)
    with start_server(cfg, engine=tiny_engine) as srv:
        status, body = post(srv.base_url, {**CHAT, "structured_outputs": {"grammar": SLOW_LARK}})
        assert_clean_400(status, body, "structured_outputs.grammar")
        assert "--grammar-timeout" in body["error"]["message"]
        assert get_health(srv.base_url) == 200


def test_compiles_past_the_pool_and_its_queue_get_429(tiny_engine, tiny_config):
    cfg = ServerConfig(engine=tiny_config, port=0, embedding_model=None, max_grammar_bytes=64 * 2**20,
                       grammar_timeout_s=600, grammar_workers=1, grammar_max_waiting=0)
    with start_server(cfg, engine=tiny_engine) as srv:
        body = {**CHAT, "structured_outputs": {"grammar": SLOW_LARK}}
        out: dict = {}

        def send_slow() -> None:  # until it holds the worker (a probe's compile may hold it first)
            while (answer := post(srv.base_url, body))[0] == 429:
                pass
            out["answer"] = answer

        slow = threading.Thread(target=send_slow, daemon=True)
        slow.start()

        def small(k: int) -> dict:  # a grammar not compiled before: a cached one needs no worker
            return {**CHAT, "structured_outputs": {"choice": [f"yes {k}", "no"]}}

        k = 0
        busy = post(srv.base_url, small(k))
        while busy[0] != 429 and slow.is_alive():  # until the slow compile holds the only worker
            k += 1
            busy = post(srv.base_url, small(k))
        assert busy[0] == 429, busy
        assert busy[1]["error"]["code"] == "grammar_busy"
        assert slow.is_alive()
        status, body = post(srv.base_url, CHAT)  # no grammar: not behind the compiles at all
        assert status == 200, body
        slow.join(300)
        assert_clean_400(*out["answer"], "structured_outputs.grammar")
        assert post(srv.base_url, small(k + 1))[0] == 200  # the worker is free again


HOSTILE = [
    ({"structured_outputs": {"choice": [f"c{i}" for i in range(100_000)]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": [f"option number {i}" for i in range(2001)]}}, "structured_outputs.choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 40}
                                         for i in range(60_000)}}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "a{1000000}"}}}}, "response_format.json_schema.schema"),
    ({"structured_outputs": {"grammar": 'start: "a"{1000000}'}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a{1000000}"}}, "structured_outputs.regex"),
]


@pytest.mark.parametrize("extra, param", HOSTILE, ids=["choice-100k", "choice-2001", "schema-5MB", "ref-self",
                                                       "ref-loop", "pattern-1M", "lark-1M", "regex-1M"])
def test_hostile_grammars_are_400s_naming_the_field(server, extra, param):
    assert_clean_400(*post(server.base_url, {**CHAT, **extra}), param)
    assert get_health(server.base_url) == 200
    status, body = post(server.base_url, CHAT)
    assert status == 200, body
