"""The OpenAI shapes of logprobs and tool calls, and the tools prompt."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from carpool.openai.logprobs import CompletionLogprobs, chat_logprobs
from carpool.openai.tools import (
    delta_tool_calls,
    finish_reason,
    history_content,
    message_tool_calls,
    tools_prompt,
    with_tools_prompt,
)


@dataclass
class Top:
    token: str
    logprob: float
    bytes: list[int] = field(default_factory=list)


@dataclass
class Tok(Top):
    top_logprobs: list[Top] = field(default_factory=list)


@dataclass
class Call:
    name: str
    arguments: str


def test_chat_logprobs_shape_and_infinity():
    entries = [Tok("Hi", -0.1, [72, 105], [Top("Hi", -0.1, [72, 105]), Top("Hey", -2.5, [72, 101, 121])]),
               Tok("!", -math.inf, [33], [])]
    out = chat_logprobs(entries)
    assert out == {"refusal": None, "content": [
        {"token": "Hi", "logprob": -0.1, "bytes": [72, 105],
         "top_logprobs": [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105]},
                          {"token": "Hey", "logprob": -2.5, "bytes": [72, 101, 121]}]},
        {"token": "!", "logprob": -9999.0, "bytes": [33], "top_logprobs": []},
    ]}
    json.dumps(out, allow_nan=False)  # valid JSON: no infinity


def test_completion_logprobs_offsets_run_across_pieces_and_include_the_sampled_token():
    acc = CompletionLogprobs(start_offset=5)
    first = acc.piece([Tok(" Paris", -0.2, [], [Top(" Lyon", -1.0)])])
    second = acc.piece([Tok(",", -0.3, [], [Top(",", -0.3), Top(".", -1.5)]), Tok(" and", -0.9, [], [])])
    assert first == {"tokens": [" Paris"], "token_logprobs": [-0.2],
                     "top_logprobs": [{" Lyon": -1.0, " Paris": -0.2}], "text_offset": [5]}
    assert second["text_offset"] == [11, 12]
    assert second["top_logprobs"] == [{",": -0.3, ".": -1.5}, {" and": -0.9}]
    whole = CompletionLogprobs(start_offset=5).piece([Tok(" Paris", -0.2, [], [Top(" Lyon", -1.0)]),
                                                      Tok(",", -0.3, [], [Top(",", -0.3), Top(".", -1.5)]),
                                                      Tok(" and", -0.9, [], [])])
    assert whole == {k: first[k] + second[k] for k in whole}  # a stream's pieces concatenate to the body


WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "noop"}}]


def test_tools_prompt_names_every_function_and_the_reply_format():
    text = tools_prompt(TOOLS, "required")
    assert "- get_weather: Weather in a city. Parameters (JSON Schema): " in text and "- noop. " in text
    assert '"city"' in text and "JSON array of one or more calls" in text and "in words" not in text
    assert "exactly one call" in tools_prompt(TOOLS, "required", parallel_tool_calls=False)
    assert "in words" in tools_prompt(TOOLS, "auto")
    named = tools_prompt(TOOLS, {"type": "function", "function": {"name": "noop"}})
    assert "Call noop: reply with its arguments as one JSON object" in named


def test_the_tools_prompt_joins_the_first_system_message_or_comes_first():
    body = {"tools": TOOLS, "tool_choice": "required"}
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Oslo?"}]
    out = with_tools_prompt(msgs, body)
    assert out[0]["content"].startswith("Be brief.\n\nYou can call these functions:") and out[1:] == msgs[1:]
    out = with_tools_prompt(msgs[1:], body)
    assert out[0]["role"] == "system" and out[1:] == msgs[1:]
    assert with_tools_prompt(msgs, {"tools": TOOLS, "tool_choice": "none"}) == msgs
    assert with_tools_prompt(msgs, {}) == msgs


def test_calls_in_message_and_delta_shapes_and_finish_reasons():
    calls = [Call("get_weather", '{"city": "Oslo"}'), Call("noop", "{}")]
    ids = ["call_a", "call_b"]
    assert message_tool_calls(calls, ids) == [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "noop", "arguments": "{}"}}]
    assert [d["index"] for d in delta_tool_calls(calls, ids)] == [0, 1]
    assert finish_reason("required") == "tool_calls" and finish_reason("auto") == "tool_calls"
    assert finish_reason({"type": "function", "function": {"name": "noop"}}) == "stop"


def test_history_shows_earlier_calls_in_the_reply_format():
    msg = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}
    assert json.loads(history_content(msg)) == [{"name": "get_weather", "arguments": {"city": "Oslo"}}]
    assert history_content({"role": "tool", "tool_call_id": "c1", "content": "sunny"}) is None
