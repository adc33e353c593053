"""carpool.openai: the default policy, the body -> engine mapping, the bodies and chunks it builds."""

from __future__ import annotations

import asyncio

import pytest

from carpool.engine.protocol import TokenDelta, Usage
from carpool.errors import OpenAIError, SchemaError
from carpool.openai.accumulator import StreamAccumulator
from carpool.openai.generation import Generation
from carpool.openai.requests import Translator, chat_messages, max_tokens_for
from carpool.openai.responses import ResponseBuilder
from carpool.openai.schema import check_body
from carpool.openai.validation import validate
from carpool.testing.body_diff import answer_diff

USER = [{"role": "user", "content": "hi"}]


def test_developer_becomes_system_and_the_system_messages_merge_first():
    msgs = chat_messages([
        {"role": "user", "content": "q1"},
        {"role": "system", "content": "be brief"},
        {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "name": "bot"},
    ])
    assert msgs == [{"role": "system", "content": "be brief\n\na\nb"},
                    {"role": "user", "content": "q1"},
                    {"role": "assistant", "content": "", "name": "bot"}]
    # without a developer message the order is left as the user wrote it (vLLM merges only then)
    kept = [{"role": "user", "content": "q"}, {"role": "system", "content": "s"}]
    assert chat_messages(kept) == kept


def test_max_tokens_defaults_and_limits():
    assert max_tokens_for({}, 100, 128, "chat", "messages") == 28  # the rest of the context
    assert max_tokens_for({}, 100, 128, "completion", "prompt") == 16
    assert max_tokens_for({}, 120, 128, "completion", "prompt") == 8  # 16 does not fit: what is left
    assert max_tokens_for({"max_completion_tokens": 5, "max_tokens": 9}, 10, 128, "chat", "messages") == 5
    with pytest.raises(OpenAIError) as e:
        max_tokens_for({"max_tokens": 29}, 100, 128, "chat", "messages")
    assert e.value.param == "max_tokens" and e.value.code == "context_length_exceeded" and "at most 28" in str(e.value)
    with pytest.raises(OpenAIError) as e:
        max_tokens_for({}, 128, 128, "chat", "messages")
    assert e.value.param == "messages" and e.value.status == 400


def test_prepare_maps_the_body_and_expands_n(engine):
    t = Translator(engine)
    p = t.prepare("chat", {"messages": USER, "n": 3, "seed": 5, "temperature": 0.5, "top_k": -1,
                           "stop": "x", "stop_token_ids": [7], "ignore_eos": True, "priority": -2,
                           "stream": True, "stream_options": {"include_usage": True}})
    assert p.id.startswith("chatcmpl-") and p.stream and p.include_usage
    assert [c.index for c in p.choices] == [0, 1, 2]
    assert [c.request.params.seed for c in p.choices] == [5, 6, 7]  # seeded choices differ
    assert len({c.request.request_id for c in p.choices}) == 3
    params = p.choices[0].request.params
    assert (params.temperature, params.top_k, params.stop, params.stop_token_ids, params.ignore_eos) == \
        (0.5, 0, ["x"], [7], True)
    assert p.choices[0].request.priority == -2
    n_prompt = p.choices[0].prompt_tokens
    assert params.max_tokens == 128 - n_prompt and p.prompt_tokens == 3 * n_prompt
    # several prompts: choice p*n + i, each prompt's own length check and param name
    c = t.prepare("completion", {"prompt": [[1, 2, 3], [4, 5]], "n": 2, "max_tokens": 4})
    assert [(x.index, x.prompt_index, x.prompt_tokens) for x in c.choices] == [(0, 0, 3), (1, 0, 3), (2, 1, 2),
                                                                                (3, 1, 2)]
    with pytest.raises(OpenAIError) as e:
        t.prepare("completion", {"prompt": ["short", "word " * 300]})
    assert e.value.param == "prompt[1]"


@pytest.mark.parametrize("body, param", [
    ({"messages": USER, "stop": ""}, "stop"),
    ({"messages": USER, "stop": ["a", ""]}, "stop[1]"),
    ({"messages": USER, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": USER, "max_tokens": 129}, "max_tokens"),
    ({"messages": USER, "n": 17}, "n"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].type"),
])
def test_prepare_refuses_what_the_engine_cannot_run_naming_the_field(engine, body, param):
    with pytest.raises(OpenAIError) as e:
        Translator(engine).prepare("chat", body)
    assert e.value.status == 400 and e.value.param == param and f"'{param}'" in e.value.message
    if param.startswith("stop"):
        assert "remove it" in e.value.message  # says why and what to do


def test_any_endpoint_check_is_lenient_where_other_servers_are():
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    assert check_body("chat", {"messages": [image], "logprobs": True, "stop": ""}) is None
    assert check_body("chat", {"messages": [{"role": "assistant", "tool_calls": []}, *USER]}) is None
    err = check_body("chat", {"messages": [{"role": "user", "content": None}]})
    assert err is not None and err.param == "messages[0].content"
    err = check_body("chat", {"messages": USER, "max_completion_tokens": 0})
    assert err is not None and err.param == "max_completion_tokens"


def test_a_long_token_id_prompt_is_checked_whole_and_a_bad_id_named():
    from carpool.openai.schema import completion_request_schema

    schema = completion_request_schema()
    validate({"prompt": list(range(50_000))}, schema)
    with pytest.raises(SchemaError) as e:
        validate({"prompt": [*range(10), -1, 5]}, schema)
    assert e.value.param == "prompt[10]" and ">= 0" in e.value.message  # the token-id form, at its culprit
    with pytest.raises(SchemaError) as e:
        validate({"prompt": "x", "stop_token_ids": [1, 2, True]}, schema)
    assert e.value.param == "stop_token_ids[2]"


def _deltas(rid: str) -> list[TokenDelta]:
    return [TokenDelta(rid, [1], "Hel"), TokenDelta(rid, [2], ""), TokenDelta(rid, [3], "lo"),
            TokenDelta(rid, [4], "!", finish_reason="length", usage=Usage(7, 4, 2))]


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_streamed_chunks_rebuild_the_body(engine, kind):
    body = {"messages": USER} if kind == "chat" else {"prompt": "hi"}
    p = Translator(engine).prepare(kind, {**body, "max_tokens": 4, "n": 2})
    shape = ResponseBuilder(kind, p.id, "m", include_usage=True)
    chunks = shape.role_chunks(p.choices)
    for c in p.choices:
        for d in _deltas(c.request.request_id):
            c.add(d)
            chunks += shape.chunks(c, d)
    chunks.append(shape.usage_chunk(p.choices))
    assert all("usage" in ch for ch in chunks)
    full = shape.body(p.choices)
    assert [c.get("message", {}).get("content", c.get("text")) for c in full["choices"]] == ["Hello!", "Hello!"]
    assert full["usage"] == {"prompt_tokens": 7, "completion_tokens": 8, "total_tokens": 15,
                             "prompt_tokens_details": {"cached_tokens": 2}}  # the prompt counts once
    acc = StreamAccumulator(chat=kind == "chat")
    for ch in chunks:
        acc.add(ch)
    # the client's rebuild of what the server streams is the body the server answers without stream
    assert answer_diff(full, acc.body()) == []
    assert acc.body()["id"] == full["id"]


def test_generation_runs_every_choice_and_aborts_what_is_left_on_close(engine):
    async def go():
        p = Translator(engine).prepare("completion", {"prompt": "a b c", "n": 3, "max_tokens": 50,
                                                      "ignore_eos": True, "temperature": 0})
        gen = Generation(engine, p.choices)
        seen = 0
        async for _ in gen.deltas():
            seen += 1
            if seen == 6:
                break
        await gen.close()
        await asyncio.sleep(0.2)
        return p, engine.stats()

    p, stats = asyncio.run(go())
    assert all(c.finish_reason is None for c in p.choices)  # none ran to its end
    assert stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0  # all three aborted
