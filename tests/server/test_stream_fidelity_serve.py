"""A streamed answer of ``carpool serve``, rebuilt by the client, equals the non-streamed one.

A real server on 127.0.0.1 (the room's tiny engine), carpool's real ``HttpBackend`` on both
sides, greedy or seeded requests.  The vLLM side of the same bar replays vLLM's recorded
bytes (tests/client/test_stream_fidelity_vllm.py).
"""

from __future__ import annotations

import asyncio

import pytest

from carpool.client.base import Request
from carpool.client.http_backend import HttpBackend
from carpool.testing.body_diff import answer_diff

MSG = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."}]
COLOUR = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "bright": {"type": "boolean"}},
          "required": ["colour", "bright"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "paint", "description": "Paint the wall", "parameters": COLOUR}}

CASES = [
    ("chat-greedy", "chat", {"messages": MSG, "temperature": 0, "max_tokens": 12, "ignore_eos": True}),
    ("chat-n2-seeded", "chat", {"messages": MSG, "n": 2, "temperature": 0.9, "seed": 5, "max_tokens": 10,
                                "ignore_eos": True}),
    ("chat-stop", "chat", {"messages": MSG, "temperature": 0, "max_tokens": 24, "stop": ["e", "a"]}),
    ("completion-greedy", "completion", {"prompt": "The capital of France is", "temperature": 0,
                                         "max_tokens": 9, "ignore_eos": True}),
    ("completion-two-prompts-n2", "completion", {"prompt": ["Once upon a time", "Roses are red"], "n": 2,
                                                 "temperature": 0.8, "seed": 3, "max_tokens": 7,
                                                 "ignore_eos": True}),
    ("completion-token-ids", "completion", {"prompt": [5, 17, 42, 99], "temperature": 0, "max_tokens": 5}),
    # the OpenAI surface both must serve
    ("chat-logprobs", "chat", {"messages": MSG, "temperature": 0, "max_tokens": 8, "ignore_eos": True,
                               "logprobs": True, "top_logprobs": 4}),
    ("chat-n2-logprobs-penalties", "chat", {"messages": MSG, "n": 2, "temperature": 0.9, "seed": 11,
                                            "max_tokens": 8, "ignore_eos": True, "logprobs": True,
                                            "presence_penalty": 1.0, "frequency_penalty": 0.5,
                                            "repetition_penalty": 1.2, "logit_bias": {"60": 3, "7": -100}}),
    ("completion-logprobs", "completion", {"prompt": ["Once upon a time", "Roses are red"], "temperature": 0,
                                           "max_tokens": 6, "ignore_eos": True, "logprobs": 3}),
    ("chat-json-schema", "chat", {"messages": MSG, "temperature": 0, "max_tokens": 40,
                                  "response_format": {"type": "json_schema", "json_schema": {
                                      "name": "colour", "schema": COLOUR}}}),
    ("chat-tools-required", "chat", {"messages": MSG, "temperature": 0, "max_tokens": 60, "tools": [TOOL],
                                     "tool_choice": "required", "logprobs": True}),
    ("chat-tools-named-n2", "chat", {"messages": MSG, "temperature": 0.8, "seed": 2, "n": 2, "max_tokens": 40,
                                     "tools": [TOOL],
                                     "tool_choice": {"type": "function", "function": {"name": "paint"}}}),
    ("chat-tools-auto", "chat", {"messages": MSG, "temperature": 0, "max_tokens": 8, "tools": [TOOL],
                                 "logprobs": True, "top_logprobs": 1}),
    ("chat-tools-cut-by-length", "chat", {"messages": MSG, "temperature": 0, "max_tokens": 3, "tools": [TOOL],
                                          "tool_choice": "required"}),
]


def _call(base_url: str, kind: str, body: dict, stream: bool):
    backend = HttpBackend([base_url + "/v1"], model="tiny-random", stream=stream)
    req = Request(custom_id="fidelity", kind=kind, body=body, idempotent=True)

    async def go():
        try:
            return await backend.call(req)
        finally:
            await backend.close()

    return asyncio.run(go())


@pytest.mark.parametrize(("name", "kind", "body"), CASES, ids=[c[0] for c in CASES])
def test_rebuilt_stream_equals_plain_answer(server, name, kind, body):
    streamed = _call(server.base_url, kind, body, stream=True)
    plain = _call(server.base_url, kind, body, stream=False)
    assert streamed.ok, streamed.error_message
    assert plain.ok, plain.error_message
    assert answer_diff(streamed.body, plain.body) == []
    prompts = body.get("prompt")
    count = (body.get("n") or 1) * (len(prompts) if isinstance(prompts, list) and isinstance(prompts[0], str) else 1)
    assert [c["index"] for c in streamed.body["choices"]] == list(range(count))
    for c in streamed.body["choices"]:
        answer = c["text"] if kind == "completion" else (c["message"]["content"] or c["message"].get("tool_calls"))
        assert answer, "an empty answer would make the comparison vacuous"
        if body.get("logprobs"):
            assert c["logprobs"], "logprobs were asked"
        if body.get("tool_choice") and c["finish_reason"] != "length":
            assert c["message"]["tool_calls"] and c["message"]["content"] is None
            assert c["finish_reason"] == ("tool_calls" if body["tool_choice"] == "required" else "stop")
    assert streamed.body["usage"]["completion_tokens"] == plain.body["usage"]["completion_tokens"] > 0
    assert streamed.ttft_s is not None and streamed.completion_tokens == plain.completion_tokens > 0


def test_a_task_that_asks_for_a_stream_itself_still_gets_its_usage(server):
    """``stream: true`` in the task without ``include_usage``: the client asks for the usage chunk."""
    body = {"messages": MSG, "temperature": 0, "max_tokens": 5, "ignore_eos": True, "stream": True}
    streamed = _call(server.base_url, "chat", body, stream=False)
    plain = _call(server.base_url, "chat", {k: v for k, v in body.items() if k != "stream"}, stream=False)
    assert streamed.ok and plain.ok
    # (without the client's include_usage, carpool serve streams no usage chunk: the body would lack usage)
    assert streamed.body["usage"]["completion_tokens"] == 5
    assert answer_diff(streamed.body, plain.body) == []
