"""The openai SDK's structured outputs, tools and logprobs against a real carpool serve (tiny engine).

``parse`` with a Pydantic model is what a user writes for extraction: the SDK turns the model
into a strict ``json_schema`` response_format and reads the answer back into the model, so it
works only if the server constrains the output to the schema and finishes it.  The SDK's own
stream helper rebuilds our stream independently of carpool's accumulator.
"""

from __future__ import annotations

import json
from typing import Literal

import pytest

pydantic = pytest.importorskip("pydantic")
openai = pytest.importorskip("openai")

MSG = [{"role": "system", "content": "Describe the wall."}, {"role": "user", "content": "The wall is bright red."}]


class Wall(pydantic.BaseModel):
    colour: Literal["red", "green", "blue"]
    bright: bool
    coats: Literal[1, 2, 3]


def _parse(client):
    # openai>=1.92 has parse on chat.completions; older releases only under beta
    completions = client.chat.completions if hasattr(client.chat.completions, "parse") else \
        client.beta.chat.completions
    return completions.parse


def test_sdk_parse_with_a_pydantic_model(openai_client):
    parse = _parse(openai_client)
    for seed in range(4):  # sampled: four different answers, each one must parse
        r = parse(model="tiny-random", messages=MSG, response_format=Wall, temperature=1.0, seed=seed,
                  max_tokens=60)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(msg.parsed, Wall), msg.content
        assert Wall.model_validate_json(msg.content) == msg.parsed


def test_sdk_parse_with_a_pydantic_tool(openai_client):
    parse = _parse(openai_client)
    tool = openai.pydantic_function_tool(Wall, name="paint")
    # one call (parallel_tool_calls false): a random model would otherwise list calls until max_tokens
    r = parse(model="tiny-random", messages=MSG, tools=[tool], tool_choice="required", parallel_tool_calls=False,
              temperature=0, max_tokens=80)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.function.name == "paint" and isinstance(call.function.parsed_arguments, Wall)
    assert call.id.startswith("call_")


def test_sdk_logprobs_types(openai_client):
    r = openai_client.chat.completions.create(model="tiny-random", messages=MSG, max_tokens=5, temperature=0,
                                              logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0 and bytes(t.bytes).decode("utf-8", "replace")
        assert t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob  # most likely first
    c = openai_client.completions.create(model="tiny-random", prompt="Roses are", max_tokens=4, temperature=0,
                                         logprobs=2, extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    assert "".join(lp.tokens) == c.choices[0].text and len(lp.text_offset) == 4
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(4)]


def test_the_sdk_rebuilds_our_stream_into_our_body(openai_client):
    kwargs = {"model": "tiny-random", "messages": MSG, "temperature": 0, "max_tokens": 60,
              "response_format": Wall}
    plain = _parse(openai_client)(**kwargs)
    with openai_client.chat.completions.stream(**kwargs) if hasattr(openai_client.chat.completions, "stream") \
            else openai_client.beta.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.content == plain.choices[0].message.content
    assert final.choices[0].message.parsed == plain.choices[0].message.parsed
    assert final.choices[0].finish_reason == plain.choices[0].finish_reason == "stop"
    assert json.loads(final.choices[0].message.content)["colour"] in ("red", "green", "blue")
