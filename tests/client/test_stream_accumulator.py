"""The folding rules of the stream accumulator and the SSE event reader, one rule per test.

The chunks here are written by hand to pin down one rule each (fields vLLM's recordings do
not exercise: refusal, reasoning, audio, OpenAI's obfuscation, split tool-call deltas of
several calls).  The end-to-end check against real servers is test_stream_fidelity.py.
"""

from __future__ import annotations

import json

import pytest

from carpool.client.sse_reader import SSEReader
from carpool.errors import EventTooLarge
from carpool.openai.accumulator import StreamAccumulator


def _chat_chunk(choices, **top):
    return {"id": "c1", "object": "chat.completion.chunk", "created": 5, "model": "m", **top, "choices": choices}


def _rebuild(chunks, chat=True):
    acc = StreamAccumulator(chat=chat)
    for ch in chunks:
        acc.add(ch)
    return acc.body()


def test_tool_calls_join_arguments_by_index_and_keep_first_id_type_name():
    chunks = [
        _chat_chunk([{"index": 0, "delta": {"role": "assistant", "content": None}}]),
        _chat_chunk([{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]}}]),
        _chat_chunk([{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}}]),
        # a second call starts while the first is open; deltas interleave by index
        _chat_chunk([{"index": 0, "delta": {"tool_calls": [
            {"index": 1, "id": "call_b", "type": "function",
             "function": {"name": "get_time", "arguments": '{"tz"'}}]}}]),
        _chat_chunk([{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}}]),
        _chat_chunk([{"index": 0, "delta": {"tool_calls": [{"index": 1, "function": {"arguments": ': "UTC"}'}}]}}]),
        _chat_chunk([{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]),
    ]
    body = _rebuild(chunks)
    msg = body["choices"][0]["message"]
    assert msg == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}},
        ],
    }
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert body["object"] == "chat.completion"


def test_choices_interleave_by_index_and_logprobs_concatenate():
    lp = lambda tok: {"content": [{"token": tok, "logprob": -0.5, "bytes": list(tok.encode()), "top_logprobs": []}],  # noqa: E731
                          "refusal": None}
    chunks = [
        _chat_chunk([{"index": 1, "delta": {"role": "assistant", "content": ""}, "logprobs": None}]),
        _chat_chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}]),
        _chat_chunk([{"index": 0, "delta": {"content": "Hel"}, "logprobs": lp("Hel")}]),
        _chat_chunk([{"index": 1, "delta": {"content": "Bye"}, "logprobs": lp("Bye")}]),
        _chat_chunk([{"index": 0, "delta": {"content": "lo"}, "logprobs": lp("lo"), "finish_reason": "stop",
                      "stop_reason": 2}]),
        _chat_chunk([{"index": 1, "delta": {}, "logprobs": None, "finish_reason": "length", "stop_reason": None}]),
        _chat_chunk([], usage={"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}),
    ]
    body = _rebuild(chunks)
    c0, c1 = body["choices"]
    assert (c0["index"], c1["index"]) == (0, 1)
    assert c0["message"]["content"] == "Hello" and c1["message"]["content"] == "Bye"
    assert [t["token"] for t in c0["logprobs"]["content"]] == ["Hel", "lo"]
    assert c0["logprobs"]["refusal"] is None
    assert (c0["finish_reason"], c0["stop_reason"]) == ("stop", 2)
    assert (c1["finish_reason"], c1["stop_reason"]) == ("length", None)
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


def test_refusal_reasoning_and_unknown_top_level_fields_are_kept():
    chunks = [
        _chat_chunk([{"index": 0, "delta": {"role": "assistant", "content": "", "refusal": None}}],
                    system_fingerprint="fp_1", service_tier="default", obfuscation="Xy"),
        _chat_chunk([{"index": 0, "delta": {"reasoning_content": "The user asks"}}], obfuscation="abc"),
        _chat_chunk([{"index": 0, "delta": {"reasoning_content": " for harm."}}], obfuscation="q"),
        _chat_chunk([{"index": 0, "delta": {"refusal": "I can't"}}]),
        _chat_chunk([{"index": 0, "delta": {"refusal": " help with that."}}], prompt_token_ids=None),
        _chat_chunk([{"index": 0, "delta": {}, "finish_reason": "stop"}], kv_transfer_params={"a": 1}),
    ]
    body = _rebuild(chunks)
    assert body["choices"][0]["message"] == {
        "role": "assistant", "content": "", "refusal": "I can't help with that.",
        "reasoning_content": "The user asks for harm.",
    }
    assert body["system_fingerprint"] == "fp_1" and body["service_tier"] == "default"
    assert body["kv_transfer_params"] == {"a": 1} and body["prompt_token_ids"] is None
    assert "obfuscation" not in body  # OpenAI's per-chunk padding is not part of the answer


def test_audio_and_legacy_function_call_merge():
    chunks = [
        _chat_chunk([{"index": 0, "delta": {"role": "assistant",
                                            "audio": {"id": "au_1", "data": "AAA", "transcript": "He"}}}]),
        _chat_chunk([{"index": 0, "delta": {"audio": {"data": "BBB", "transcript": "llo", "expires_at": 9}}}]),
        _chat_chunk([{"index": 0, "delta": {"function_call": {"name": "f", "arguments": "{\"x\""}}}]),
        _chat_chunk([{"index": 0, "delta": {"function_call": {"arguments": ": 1}"}},
                      "finish_reason": "function_call"}]),
    ]
    msg = _rebuild(chunks)["choices"][0]["message"]
    assert msg["audio"] == {"id": "au_1", "data": "AAABBB", "transcript": "Hello", "expires_at": 9}
    assert msg["function_call"] == {"name": "f", "arguments": '{"x": 1}'}


def test_completion_text_and_logprob_lists_concatenate():
    def piece(text, offset, index=0, finish=None):
        return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
                "choices": [{"index": index, "text": text, "finish_reason": finish,
                             "logprobs": {"tokens": [text], "token_logprobs": [-1.0], "top_logprobs": [{text: -1.0}],
                                          "text_offset": [offset]}, "token_ids": [offset]}]}
    chunks = [piece(" Paris", 24), piece(",", 30), piece(" Rome", 0, index=1), piece(" and", 31, finish="length")]
    body = _rebuild(chunks, chat=False)
    c0, c1 = body["choices"]
    assert c0["text"] == " Paris, and" and c1["text"] == " Rome"
    assert c0["logprobs"] == {"tokens": [" Paris", ",", " and"], "token_logprobs": [-1.0, -1.0, -1.0],
                              "top_logprobs": [{" Paris": -1.0}, {",": -1.0}, {" and": -1.0}],
                              "text_offset": [24, 30, 31]}
    assert c0["token_ids"] == [24, 30, 31] and c0["finish_reason"] == "length"
    assert body["object"] == "text_completion"


def test_has_content_marks_the_first_answer_piece():
    acc = StreamAccumulator(chat=True)
    assert not acc.has_content(_chat_chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}}]))
    assert acc.has_content(_chat_chunk([{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "x"}]}}]))
    assert acc.has_content(_chat_chunk([{"index": 0, "delta": {"reasoning_content": "hm"}}]))
    assert not StreamAccumulator(chat=False).has_content({"choices": [{"index": 0, "text": ""}]})


def _events(raw: bytes, piece: int) -> list[bytes]:
    r = SSEReader()
    out = []
    for i in range(0, len(raw), piece):
        out += r.feed(raw[i:i + piece])
    return out + r.close()


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"])
def test_sse_reader_any_split_any_line_ending(piece, newline):
    events = [{"a": 1}, {"b": "x" * 50}, "[DONE]"]
    raw = b""
    for e in events:
        data = e.encode() if isinstance(e, str) else json.dumps(e).encode()
        raw += b": keep-alive" + newline + b"event: message" + newline + b"data: " + data + newline + newline
    assert _events(raw, piece) == [json.dumps(events[0]).encode(), json.dumps(events[1]).encode(), b"[DONE]"]


def test_sse_reader_joins_data_lines_and_flushes_an_unterminated_event():
    raw = b'data: {"a":\ndata:  1}\n\ndata: [DONE]'
    assert _events(raw, 4) == [b'{"a":\n 1}', b"[DONE]"]


def test_sse_reader_takes_an_event_larger_than_aiohttps_line_limit():
    big = json.dumps({"x": "y" * 300_000}).encode()
    assert _events(b"data: " + big + b"\n\n", 65536) == [big]


def test_sse_reader_bounds_a_runaway_event():
    r = SSEReader(max_event_bytes=1000)
    with pytest.raises(EventTooLarge):
        for _ in range(100):
            r.feed(b"data: " + b"z" * 100)
