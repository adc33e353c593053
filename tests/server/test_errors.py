"""Bad requests get OpenAI-style error bodies, the API key guards every endpoint but /health,
and the server keeps serving afterwards."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from carpool.server import ServerConfig, start_server

MSG = [{"role": "user", "content": "hi"}]


def _call(url: str, body: bytes | dict | None = None, headers: dict | None = None, method: str | None = None):
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method or ("POST" if data is not None else "GET"),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def _error(status_body) -> dict:
    _status, _, raw = status_body
    body = json.loads(raw)
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    "path, body, status, param, needle",
    [
        ("/v1/chat/completions", b"{not json", 400, None, "JSON"),
        ("/v1/chat/completions", b"[1, 2]", 400, None, "object"),
        ("/v1/chat/completions", {"model": "gpt-nope", "messages": MSG}, 404, "model", "gpt-nope"),
        ("/v1/chat/completions", {"model": "tiny-random"}, 400, "messages", "required"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages", "at least 1"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", "robot"),
        ("/v1/chat/completions", {"messages": MSG, "temperature": "hot"}, 400, "temperature", "number"),
        ("/v1/chat/completions", {"messages": MSG, "max_tokens": 0}, 400, "max_tokens", ">= 1"),
        ("/v1/chat/completions", {"messages": MSG, "max_tokens": 2040}, 400, "max_tokens", "max_tokens"),
        ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": 2045}, 400,
         "max_completion_tokens", "context length"),
        ("/v1/chat/completions", {"messages": MSG, "n": 1000}, 400, "n", "<="),
        ("/v1/chat/completions", {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs", "'logprobs': true"),
        ("/v1/chat/completions", {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs",
         "<= 20"),
        ("/v1/chat/completions", {"messages": MSG, "logit_bias": {"abc": 1}}, 400, "logit_bias.abc", "token ids"),
        ("/v1/chat/completions", {"messages": MSG, "logit_bias": {"5": 300}}, 400, "logit_bias.5", "[-100, 100]"),
        ("/v1/chat/completions", {"messages": MSG, "presence_penalty": 3}, 400, "presence_penalty", "<= 2"),
        ("/v1/chat/completions", {"messages": MSG, "repetition_penalty": 0}, 400, "repetition_penalty", "> 0"),
        ("/v1/chat/completions", {"messages": MSG, "response_format": {"type": "xml"}}, 400,
         "response_format.type", "xml"),
        ("/v1/chat/completions", {"messages": MSG, "response_format": {"type": "json_schema"}}, 400,
         "response_format.json_schema", "schema"),
        ("/v1/chat/completions", {"messages": MSG, "tool_choice": "required"}, 400, "tool_choice", "no 'tools'"),
        ("/v1/chat/completions", {"messages": MSG, "tools": [TOOL],
                                  "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400,
         "tool_choice.function.name", "nope"),
        ("/v1/chat/completions", {"messages": MSG, "tools": [TOOL, TOOL]}, 400, "tools[1]", "twice"),
        ("/v1/chat/completions", {"messages": MSG, "tools": [TOOL], "tool_choice": "required",
                                  "response_format": {"type": "json_object"}}, 400, "tool_choice", "only one"),
        ("/v1/chat/completions", {"messages": MSG, "min_tokens": 9, "max_tokens": 4}, 400, "min_tokens", "more"),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", "<= 20"),
        # vLLM's parameters that carpool's engine does not run: a 400 naming them, never ignored
        ("/v1/chat/completions", {"messages": MSG, "prompt_logprobs": 1}, 400, "prompt_logprobs", "not supported"),
        ("/v1/chat/completions", {"messages": MSG, "use_beam_search": True}, 400, "use_beam_search", "not supported"),
        ("/v1/chat/completions", {"messages": MSG, "continue_final_message": True}, 400, "continue_final_message",
         "not supported"),
        ("/v1/completions", {"prompt": "x", "include_stop_str_in_output": True}, 400, "include_stop_str_in_output",
         "not supported"),
        ("/v1/chat/completions", {"messages": MSG, "stop": 5}, 400, "stop", "string"),
        ("/v1/completions", {"prompt": 12}, 400, "prompt", "must be"),
        ("/v1/completions", {"prompt": "x" * 30000, "max_tokens": 1}, 400, "prompt", "context length"),
        ("/v1/completions", {"model": "all-MiniLM-L6-v2", "prompt": "x"}, 404, "model", "all-MiniLM-L6-v2"),
        ("/v1/embeddings", {"model": "tiny-random", "input": "x"}, 404, "model", "tiny-random"),
    ],
)
def test_bad_request_then_server_still_serves(server, path, body, status, param, needle):
    result = _call(server.base_url + path, body)
    assert result[0] == status, result
    err = _error(result)
    assert err["param"] == param
    assert needle.lower() in err["message"].lower()
    if status == 404:
        assert err["code"] == "model_not_found"
    ok = _call(server.base_url + "/v1/chat/completions", {"messages": MSG, "max_tokens": 2})
    assert ok[0] == 200 and json.loads(ok[2])["object"] == "chat.completion"


def test_unknown_route_and_method_are_openai_errors(server):
    assert _error(_call(server.base_url + "/v1/nothing"))["code"] == "404"
    status, _, _ = _call(server.base_url + "/v1/chat/completions", method="GET")
    assert status == 405


def test_sdk_raises_typed_errors(openai_client):
    import openai

    with pytest.raises(openai.NotFoundError):
        openai_client.chat.completions.create(model="missing", messages=MSG)
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(model="tiny-random", messages=MSG, max_tokens=100000)
    assert "max_tokens" in str(e.value)


@pytest.fixture(scope="module")
def keyed_server(tiny_engine, tiny_config):
    cfg = ServerConfig(engine=tiny_config, port=0, api_key="sekrit", embedding_model=None)
    with start_server(cfg, engine=tiny_engine) as srv:
        yield srv


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 2}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2}),
    ("/v1/embeddings", {"input": "x"}),
    ("/v1/models", None),
    ("/metrics", None),
    ("/openapi.json", None),
])
def test_api_key_required_everywhere_but_health(keyed_server, path, body):
    url = keyed_server.base_url + path
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
        result = _call(url, body, headers)
        assert result[0] == 401, (headers, result)
        assert _error(result)["code"] == "invalid_api_key"
    status, _, _ = _call(url, body, {"Authorization": "Bearer sekrit"})
    assert status in (200, 404)  # 404: this server serves no embedding model


def test_health_is_open_and_sdk_with_key_works(keyed_server):
    import openai

    assert _call(keyed_server.base_url + "/health")[0] == 200
    bad = openai.OpenAI(base_url=keyed_server.base_url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=keyed_server.base_url + "/v1", api_key="sekrit", max_retries=0)
    r = good.chat.completions.create(model="tiny-random", messages=MSG, max_tokens=2)
    assert r.choices[0].message.role == "assistant"


FAIL_AT_ONCE, FAIL_LATER = 666, 667  # seeds the injected sampler fault picks out


@pytest.fixture()
def failing_sampler(monkeypatch):
    """A fault injected into the real engine: the sampler raises for a request seeded FAIL_AT_ONCE
    (at its first token) or FAIL_LATER (once it has 2 tokens); the engine then fails that request
    alone (finish_reason "error") and the rest of the batch goes on."""
    from carpool.engine.sampler import Sampler

    real = Sampler.__call__

    def call(self, logits, seqs):
        for s in seqs:
            if s.params.seed == FAIL_AT_ONCE or (s.params.seed == FAIL_LATER and s.num_output_tokens >= 2):
                raise RuntimeError("injected sampler fault")
        return real(self, logits, seqs)

    monkeypatch.setattr(Sampler, "__call__", call)


def _sse_events(raw: bytes) -> list:
    return [line[6:] if line[6:] == b"[DONE]" else json.loads(line[6:])
            for line in raw.splitlines() if line.startswith(b"data: ")]


def test_a_request_the_engine_fails_on_is_a_500_alone(server, tiny_engine, failing_sampler):
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from carpool.client.base import Request
    from carpool.client.engine_backend import EngineBackend

    url = server.base_url + "/v1/chat/completions"
    good = {"messages": MSG, "max_tokens": 6, "ignore_eos": True}
    with ThreadPoolExecutor(4) as pool:  # a good request in the same batches as the failing ones
        neighbours = [pool.submit(_call, url, good) for _ in range(2)]
        failed = _call(url, {"messages": MSG, "max_tokens": 6, "seed": FAIL_AT_ONCE})
        failed_later = _call(url, {"messages": MSG, "max_tokens": 6, "seed": FAIL_LATER})
        results = [f.result() for f in neighbours]
    for result in (failed, failed_later):
        assert result[0] == 500, result
        err = _error(result)
        assert err["type"] == "server_error" and err["code"] == "engine_request_failed"
        assert "injected sampler fault" in err["message"]
    for status, _, raw in results:
        assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 6

    # Streamed: failing before the first token is a plain 500; after it, the error is in-band.
    status, _, raw = _call(url, {"messages": MSG, "max_tokens": 6, "seed": FAIL_AT_ONCE, "stream": True})
    assert status == 500 and _error((status, None, raw))["code"] == "engine_request_failed"
    status, _, raw = _call(url, {"messages": MSG, "max_tokens": 6, "seed": FAIL_LATER, "stream": True,
                                 "ignore_eos": True})
    events = _sse_events(raw)
    assert status == 200
    assert [e for e in events[:-2] if "error" in e] == []
    assert events[-2]["error"]["code"] == "engine_request_failed" and events[-1] == b"[DONE]"
    assert sum(len(e["choices"][0]["delta"].get("content") or "") > 0 for e in events[:-2]) >= 1

    # In-process: the same answer carpool run writes for that task.
    backend = EngineBackend(tiny_engine)
    res = asyncio.run(backend.call(Request("t", "chat", {"messages": MSG, "max_tokens": 6, "seed": FAIL_AT_ONCE})))
    assert (res.ok, res.status_code, res.body) == (False, 500, json.loads(failed[2]))

    # The server serves on, the engine loop never stopped.
    ok = _call(url, good)
    assert ok[0] == 200 and json.loads(ok[2])["usage"]["completion_tokens"] == 6
    assert tiny_engine.error is None
