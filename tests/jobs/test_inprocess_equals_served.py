"""The same task file gives the same bodies in-process and through a real `carpool serve`.

`carpool run` on the embedded engine and `carpool run --endpoint` against `carpool serve` (a
subprocess on 127.0.0.1) both go through carpool.openai; this runs one file both ways on the
packaged SmolLM2 (greedy, one task at a time, so both engines see the same batches) and compares
the output lines.  The file covers each point where the copies used to disagree: a chat without
max_tokens (the rest of the context, not 16), a completion without it (16), a developer message
(-> system, merged with the system message), content parts (joined with "\\n"), n=2 with a seed,
and lines both must refuse naming the same field (an empty stop string, top_logprobs without
logprobs).  And the OpenAI surface both serve: logprobs (chat and completions), a JSON schema,
JSON mode, tools under "required" and a named function, penalties with logit_bias and a seed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from carpool.server.launcher import start_server_process
from carpool.testing.body_diff import answer_diff

MODEL = "smollm2"

TASKS = [
    {"custom_id": "chat-default-length", "temperature": 0,  # SmolLM2 answers in 27 tokens, then EOS
     "messages": [{"role": "user", "content": "Say hello in French and in Spanish."}]},
    {"custom_id": "developer-and-parts", "temperature": 0, "max_tokens": 12,
     "messages": [{"role": "system", "content": "You are terse."},
                  {"role": "developer", "content": "Answer with one word."},
                  {"role": "user", "content": [{"type": "text", "text": "Name a colour"},
                                               {"type": "text", "text": "of the sky."}]}]},
    {"custom_id": "completion-default-length", "temperature": 0, "prompt": "Once upon a time, in a small village,"},
    {"custom_id": "n2-seeded", "temperature": 0.8, "seed": 7, "n": 2, "max_tokens": 6,
     "prompt": "The three best fruits are"},
    {"custom_id": "chat-stop-list", "temperature": 0, "max_completion_tokens": 24, "stop": [".", "!"],
     "messages": [{"role": "user", "content": "Tell me about the sea."}]},
    {"custom_id": "empty-stop", "temperature": 0, "max_tokens": 4, "stop": ["x", ""],
     "messages": [{"role": "user", "content": "hi"}]},
    {"custom_id": "top-logprobs-alone", "temperature": 0, "max_tokens": 4, "top_logprobs": 2,
     "messages": [{"role": "user", "content": "hi"}]},
    # the OpenAI surface both must serve
    {"custom_id": "chat-logprobs", "temperature": 0, "max_tokens": 6, "logprobs": True, "top_logprobs": 3,
     "messages": [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]},
    {"custom_id": "completion-logprobs", "temperature": 0, "max_tokens": 5, "logprobs": 2,
     "prompt": "A list of fruits: apple, banana,"},
    {"custom_id": "json-schema", "temperature": 0, "max_tokens": 60,
     "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": {
         "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                          "sunny": {"type": "boolean"}},
         "required": ["city", "sunny"], "additionalProperties": False}}},
     "messages": [{"role": "user", "content": "It is sunny in Lisbon today. Reply in JSON."}]},
    {"custom_id": "json-object", "temperature": 0, "max_tokens": 40, "response_format": {"type": "json_object"},
     "messages": [{"role": "user", "content": "Give me a JSON object with your name."}]},
    {"custom_id": "tools-required", "temperature": 0, "max_tokens": 60, "tool_choice": "required",
     "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
         "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
         "additionalProperties": False}}}],
     "messages": [{"role": "user", "content": "What is the weather in Oslo?"}]},
    {"custom_id": "tools-named-logprobs", "temperature": 0, "max_tokens": 40, "logprobs": True,
     "tool_choice": {"type": "function", "function": {"name": "get_time"}},
     "tools": [{"type": "function", "function": {"name": "get_time", "parameters": {
         "type": "object", "properties": {"zone": {"enum": ["Asia/Tokyo", "Europe/Paris", "America/Lima"]}},
         "required": ["zone"], "additionalProperties": False}}}],
     "messages": [{"role": "user", "content": "What time is it in Tokyo?"}]},
    {"custom_id": "penalties-bias-seed", "temperature": 0.7, "seed": 3, "max_tokens": 12, "presence_penalty": 0.5,
     "frequency_penalty": 0.3, "repetition_penalty": 1.1, "logit_bias": {"28": -100, "30": 5},
     "messages": [{"role": "user", "content": "Write a short line about rain."}]},
]
REFUSED = {"empty-stop": "stop[1]", "top-logprobs-alone": "top_logprobs"}


def _run(src, out, *extra: str) -> None:
    cmd = [sys.executable, "-m", "carpool.cli", "run", str(src), "-o", str(out), "--model", MODEL,
           "--concurrency", "1", "--cache", "off", "--quiet", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=os.environ.copy())
    assert proc.returncode in (0, 3), proc.stderr  # 3: some tasks failed (the two refused ones)


def _lines(path) -> dict[str, dict]:
    return {d["custom_id"]: d for d in map(json.loads, path.read_text().splitlines())}


def _body(line: dict) -> dict:
    body = json.loads(json.dumps(line["response"]["body"]))
    body.pop("id")
    body.pop("created")
    for choice in body["choices"]:  # tool call ids are drawn per answer
        for call in (choice.get("message") or {}).get("tool_calls") or ():
            call.pop("id")
    return body


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("parity")
    src = d / "tasks.jsonl"
    src.write_text("".join(json.dumps(t) + "\n" for t in TASKS))
    _run(src, d / "inprocess.jsonl")
    # A fresh server per run: a warm prefix cache changes the prefill's shapes, and in bf16 that
    # may flip a greedy near-tie, so every run starts from the same (empty) cache.
    for name, extra in (("served", ["--no-stream"]), ("streamed", [])):
        with start_server_process(["--model", MODEL, "--port", "0", "--embedding-model", "none"]) as srv:
            _run(src, d / f"{name}.jsonl", "--endpoint", srv.base_url + "/v1", *extra)
    return _lines(d / "inprocess.jsonl"), _lines(d / "served.jsonl"), _lines(d / "streamed.jsonl")


def test_every_answer_is_the_same_body(outputs):
    inproc, served, _ = outputs
    assert set(inproc) == set(served) == {t["custom_id"] for t in TASKS}
    for cid in set(inproc) - set(REFUSED):
        assert inproc[cid]["error"] is None and served[cid]["error"] is None, (cid, inproc[cid], served[cid])
        assert _body(inproc[cid]) == _body(served[cid]), cid


def test_the_policy_is_the_one_documented(outputs):
    inproc, _, _ = outputs
    chat = _body(inproc["chat-default-length"])
    # no max_tokens on a chat: not cut at 16 tokens, it ran to its own end (EOS)
    assert chat["choices"][0]["finish_reason"] == "stop" and chat["usage"]["completion_tokens"] > 16
    completion = _body(inproc["completion-default-length"])
    assert completion["usage"]["completion_tokens"] == 16 and completion["choices"][0]["finish_reason"] == "length"
    n2 = _body(inproc["n2-seeded"])
    assert [c["index"] for c in n2["choices"]] == [0, 1]
    assert n2["usage"]["prompt_tokens"] == n2["usage"]["total_tokens"] - n2["usage"]["completion_tokens"]


def test_the_new_fields_are_in_the_answers(outputs):
    inproc, _, _ = outputs
    lp = _body(inproc["chat-logprobs"])["choices"][0]
    assert len(lp["logprobs"]["content"]) == _body(inproc["chat-logprobs"])["usage"]["completion_tokens"]
    assert all(len(t["top_logprobs"]) == 3 for t in lp["logprobs"]["content"])
    cl = _body(inproc["completion-logprobs"])["choices"][0]
    assert "".join(cl["logprobs"]["tokens"]) == cl["text"] and len(cl["logprobs"]["text_offset"]) == 5
    city = json.loads(_body(inproc["json-schema"])["choices"][0]["message"]["content"])
    assert set(city) == {"city", "sunny"} and isinstance(city["sunny"], bool)
    obj = _body(inproc["json-object"])["choices"][0]  # free keys: SmolLM2 may run on to max_tokens
    assert obj["message"]["content"].lstrip().startswith("{")
    if obj["finish_reason"] == "stop":
        assert isinstance(json.loads(obj["message"]["content"]), dict)
    req = _body(inproc["tools-required"])["choices"][0]
    assert req["finish_reason"] == "tool_calls" and req["message"]["content"] is None
    assert req["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert "city" in json.loads(req["message"]["tool_calls"][0]["function"]["arguments"])
    named = _body(inproc["tools-named-logprobs"])["choices"][0]
    assert named["finish_reason"] == "stop" and named["message"]["tool_calls"][0]["function"]["name"] == "get_time"
    assert named["logprobs"]["content"]
    ids = inproc["tools-required"]["response"]["body"]["choices"][0]["message"]["tool_calls"][0]["id"]
    assert ids.startswith("call_")


def test_both_refuse_the_same_lines_naming_the_same_field(outputs):
    inproc, served, _ = outputs
    for cid, field in REFUSED.items():
        mine, theirs = inproc[cid]["error"], served[cid]["error"]
        assert mine["field"] == theirs["field"] == field, (mine, theirs)
        # the server's own words reach the in-process line too
        assert served[cid]["response"]["body"]["error"]["message"] in mine["message"], (mine, theirs)


def test_streamed_answers_rebuild_to_the_same_bodies(outputs):
    # Streamed (the default of carpool run --endpoint), rebuilt by the client: the same answer, field
    # for field, apart from what is per response (answer_diff: ids, created, null vs absent).
    inproc, _, streamed = outputs
    for cid in set(inproc) - set(REFUSED):
        assert streamed[cid]["error"] is None, streamed[cid]
        assert answer_diff(inproc[cid]["response"]["body"], streamed[cid]["response"]["body"]) == [], cid
