"""The layer's stream chunks, rebuilt by the client's accumulator, equal its body: the paths a tiny
random model does not reach (an "auto" answer that is a call, logprobs of held-back text)."""

from __future__ import annotations

import pytest

from carpool.engine.protocol import GenerateRequest, SamplingParams, TokenDelta, TokenLogprob, TopLogprob, Usage
from carpool.errors import OpenAIError
from carpool.openai.accumulator import StreamAccumulator
from carpool.openai.responses import Choice, ResponseBuilder
from carpool.testing.body_diff import answer_diff

TOOLS = [{"type": "function", "function": {"name": "paint", "parameters": {"type": "object"}}}]


def _lp(text: str, k: int) -> TokenLogprob:
    tops = [TopLogprob(token_id=i, token=f"{text}{i}", bytes=list(f"{text}{i}".encode()), logprob=-1.0 - i)
            for i in range(k)]
    return TokenLogprob(token_id=99, token=text, bytes=list(text.encode()), logprob=-0.5, top_logprobs=tops)


def _run(kind: str, pieces: list[str], finish: str = "stop", logprobs: int | None = None,
         tools=None, tool_choice="auto"):
    """Body and rebuilt stream of one choice whose engine output is ``pieces`` (one token each)."""
    def make() -> Choice:
        req = GenerateRequest(request_id="r-0", params=SamplingParams(logprobs=logprobs))
        return Choice(index=0, prompt_index=0, request=req, prompt_tokens=3, tools=tools, tool_choice=tool_choice)

    def deltas():
        for i, text in enumerate(pieces):
            last = i == len(pieces) - 1
            yield TokenDelta(request_id="r-0", token_ids=[i], text=text,
                             logprobs=[_lp(text or "\ufffd", logprobs)] if logprobs is not None else None,
                             finish_reason=finish if last else None,
                             usage=Usage(3, len(pieces)) if last else None)

    plain = make()
    for d in deltas():
        plain.add(d)
    body = ResponseBuilder(kind, "id-1", "m").body([plain])
    streamed = make()
    shape = ResponseBuilder(kind, "id-2", "m", include_usage=True)
    acc = StreamAccumulator(chat=kind == "chat")
    for chunk in shape.role_chunks([streamed]):
        acc.add(chunk)
    for d in deltas():
        streamed.add(d)
        for chunk in shape.chunks(streamed, d):
            acc.add(chunk)
    acc.add(shape.usage_chunk([streamed]))
    return body, acc.body()


@pytest.mark.parametrize("pieces, is_call", [
    (["  ", '[{"name": "paint", ', '"arguments": {}}]'], True),  # "auto" that is a call: held from the "["
    (["  ", "Sure", ", red."], False),  # "auto" that is words: streamed once the "S" shows
    (['{"name": "paint", "arguments": {}}'], True),  # one call object
    (["[", '{"name": "nope"'], False),  # looks like a call, is not: the held text goes out as content
    ([""], False),  # nothing at all
])
def test_auto_tool_answers(pieces, is_call):
    body, rebuilt = _run("chat", pieces, logprobs=2, tools=TOOLS)
    assert answer_diff(rebuilt, body) == []
    msg = body["choices"][0]["message"]
    assert bool(msg.get("tool_calls")) == is_call
    assert body["choices"][0]["finish_reason"] == ("tool_calls" if is_call else "stop")
    assert (msg["content"] is None) == is_call
    assert len(body["choices"][0]["logprobs"]["content"]) == len(pieces)


def test_logprobs_of_held_back_text_reach_the_stream():
    # The detokenizer holds a half character back: its token's logprob rides on the next chunk.
    for kind in ("chat", "completion"):
        body, rebuilt = _run(kind, ["a", "", "\u00e9b", ""], finish="length", logprobs=1)
        assert answer_diff(rebuilt, body) == [], kind
        lp = body["choices"][0]["logprobs"]
        assert len(lp["content"] if kind == "chat" else lp["tokens"]) == 4


def test_a_request_that_failed_inside_a_step_is_an_error():
    choice = Choice(index=0, prompt_index=0, request=GenerateRequest(request_id="r"), prompt_tokens=1)
    with pytest.raises(OpenAIError) as e:
        choice.add(TokenDelta(request_id="r", token_ids=[], text="", finish_reason="error", error="NaN in logits"))
    assert e.value.status == 500 and "NaN in logits" in e.value.message
