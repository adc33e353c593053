"""Hostile and careless grammars, with variations: each is refused before it runs, naming its field.

Every class the red team found (too many choices, a schema of megabytes, ``$ref`` loops, counted
repetitions of a million, grammars llguidance builds but cannot start) is tried in several
shapes against the engine's compiler (fast, no HTTP), then through ``carpool serve`` in each
body form a grammar can come in.  Whatever the shape: a ``GrammarError`` / 400 whose message is
words, never llguidance's parser state or a Rust panic; legitimate grammars of the same kinds
(recursive trees, 1,999 choices, anchored counted patterns) still compile.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from carpool.engine.protocol import StructuredOutputs
from carpool.errors import GrammarError
from carpool.server import ServerConfig, start_server

INTERNALS = ("panic", "backtrace", "<state>", "<non-verbose", "Traceback", "Parser: {", "u16::MAX", "NoExtensionBias")


def nested(depth: int, kind: str) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = ({"type": "object", "properties": {"a": schema}, "required": ["a"]} if kind == "object"
                  else {"type": "array", "items": schema})
    return schema


def loop(n: int) -> dict:
    names = [f"d{i}" for i in range(n)]
    return {"$defs": {a: {"$ref": f"#/$defs/{b}"} for a, b in zip(names, names[1:] + names[:1], strict=True)},
            "$ref": "#/$defs/d0"}


REFUSED = {
    # size: entries, bytes per entry, the whole schema
    "choice-100k": StructuredOutputs(choice=[f"c{i}" for i in range(100_000)]),
    "choice-3000": StructuredOutputs(choice=[f"option {i}" for i in range(3000)]),
    "choice-2000": StructuredOutputs(choice=[f"option {i}" for i in range(2000)]),
    "choice-few-but-huge": StructuredOutputs(choice=["x" * 200_000 + str(i) for i in range(5)]),
    "schema-5MB-properties": StructuredOutputs(json={"type": "object", "properties": {
        f"p{i}": {"type": "string", "description": "x" * 40} for i in range(60_000)}}),
    "schema-5MB-enum": StructuredOutputs(json={"enum": [f"value-{i}" for i in range(500_000)]}),
    "schema-5MB-description": StructuredOutputs(json={"type": "string", "description": "d" * 5_000_000}),
    "schema-5MB-as-text": StructuredOutputs(json=json.dumps({"enum": ["v" * 100] * 50_000})),
    # depth
    "nested-objects-200": StructuredOutputs(json=nested(200, "object")),
    "nested-arrays-2000": StructuredOutputs(json=nested(2000, "array")),
    # references that match nothing
    "ref-self": StructuredOutputs(json={"$ref": "#"}),
    "ref-loop-2": StructuredOutputs(json=loop(2)),
    "ref-loop-5": StructuredOutputs(json=loop(5)),
    "ref-anyof-self": StructuredOutputs(json={"anyOf": [{"$ref": "#"}]}),
    "ref-allof-self": StructuredOutputs(json={"allOf": [{"$ref": "#"}]}),
    "ref-missing": StructuredOutputs(json={"$ref": "#/$defs/nope"}),
    # counted repetitions of a million
    "pattern-1M": StructuredOutputs(json={"type": "string", "pattern": "a{1000000}"}),
    "pattern-class-2M": StructuredOutputs(json={"type": "string", "pattern": "^[a-z]{2000000}$"}),
    "pattern-open-range": StructuredOutputs(json={"type": "string", "pattern": "x{5,1000000}"}),
    "pattern-in-items": StructuredOutputs(json={"type": "array", "items": {"type": "string", "pattern": "a{50000}"}}),
    "pattern-properties": StructuredOutputs(json={"type": "object",
                                                  "patternProperties": {"^k{1000000}$": {"type": "string"}}}),
    "lark-1M": StructuredOutputs(grammar='start: "a"{1000000}'),
    "lark-ab-500k": StructuredOutputs(grammar='start: "ab"{500000}'),
    "lark-regex-1M": StructuredOutputs(grammar="start: /a{1000000}/"),
    "lark-100k-alternatives": StructuredOutputs(grammar="start: " + " | ".join(f'"o{i}"' for i in range(100_000))),
    "regex-1M": StructuredOutputs(regex="a{1000000}"),
    # plain mistakes
    "lark-unknown-rule": StructuredOutputs(grammar="start: foo"),
    "regex-unclosed": StructuredOutputs(regex="(("),
    "schema-unsupported-keyword": StructuredOutputs(json={"type": "string", "not": {"type": "string"}}),
}

ACCEPTED = {
    "choice-1999": StructuredOutputs(choice=[f"option {i}" for i in range(1999)]),
    "recursive-tree": StructuredOutputs(json={"type": "object", "properties": {
        "v": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#"}}}, "required": ["v"]}),
    "refs-to-defs": StructuredOutputs(json={"$defs": {"n": {"type": "integer"}}, "type": "object",
                                            "properties": {"a": {"$ref": "#/$defs/n"}}}),
    "anchored-counted-pattern": StructuredOutputs(json={"type": "string", "pattern": "^a{3}-[0-9]{1,4}$"}),
    "nested-objects-20": StructuredOutputs(json=nested(20, "object")),
    "enum-5000": StructuredOutputs(json={"enum": [f"value {i}" for i in range(5000)]}),
    "lark-100": StructuredOutputs(grammar='start: "a"{100}'),
    "regex": StructuredOutputs(regex=r"\d{3}-\d{4}"),
}


def field_of(so: StructuredOutputs) -> str:
    return next(name for name in ("json", "regex", "choice", "grammar") if getattr(so, name) is not None)


@pytest.mark.parametrize("name", list(REFUSED))
def test_hostile_grammars_are_refused_in_words(tiny_engine, name):
    so = REFUSED[name]
    with pytest.raises(GrammarError) as e:
        tiny_engine.check_grammar(so)
    assert e.value.field == field_of(so)
    assert e.value.reason and not any(word in str(e.value) for word in INTERNALS), str(e.value)


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_legitimate_grammars_of_the_same_kinds_compile(tiny_engine, name):
    tiny_engine.check_grammar(ACCEPTED[name])


# --- through the server, in every body form a grammar comes in --------------------------------

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def post(base: str, path: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture(scope="module")
def server(tiny_engine, tiny_config):
    cfg = ServerConfig(engine=tiny_config, port=0, embedding_model=None)
    with start_server(cfg, engine=tiny_engine) as srv:
        yield srv


def _schema(schema: object) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


FORMS = [
    ("/v1/chat/completions", {**CHAT, **_schema({"$ref": "#"})}, "response_format.json_schema.schema"),
    ("/v1/chat/completions", {**CHAT, "stream": True, **_schema(loop(3))}, "response_format.json_schema.schema"),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"json": '{"$ref": "#"}'}}, "structured_outputs.json"),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"choice": [str(i) for i in range(60_000)]}},
     "structured_outputs.choice"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string", "pattern": "b{999999}"}},
                                    "required": ["a"]}}}], "tool_choice": "required"}, "tools"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "structured_outputs": {"grammar": 'start: "a"{1000000}'}},
     "structured_outputs.grammar"),
    ("/v1/completions", {"prompt": ["a", "b"], "n": 2, "max_tokens": 2, "structured_outputs": {"regex": "a{1000000}"}},
     "structured_outputs.regex"),
]


@pytest.mark.parametrize("path, body, param", FORMS,
                         ids=["schema", "stream", "so-json-text", "choice-60k", "tool-pattern", "completion-lark",
                              "completion-n"])
def test_every_body_form_gets_a_400_naming_its_field(server, path, body, param):
    for _ in range(3):
        status, text = post(server.base_url, path, body)
        assert status == 400, text
        err = json.loads(text)["error"]
        assert err["param"] == param and param in err["message"]
        assert not any(word in text for word in INTERNALS), text
    status, text = post(server.base_url, "/v1/chat/completions", CHAT)
    assert status == 200, text
    assert tiny_engine_idle(server)


def tiny_engine_idle(server) -> bool:
    """No request left inside the engine (a refused grammar never reached it)."""
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    gauges = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    lines = [ln for ln in text.splitlines() if ln.startswith(gauges)]
    return bool(lines) and all(float(ln.rsplit(" ", 1)[1]) == 0 for ln in lines)
