"""The official openai SDK against a real carpool server on 127.0.0.1."""

from __future__ import annotations

import re
import urllib.error
import urllib.request

import numpy as np
import pytest

MSG = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."}]
NO_EOS = {"ignore_eos": True}  # vLLM extra: the tiny random model must not stop early


def test_chat_completion_shape_and_usage(openai_client):
    r = openai_client.chat.completions.create(model="tiny-random", messages=MSG, max_tokens=6, temperature=0)
    assert r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-")
    assert r.model == "tiny-random"
    assert len(r.choices) == 1
    c = r.choices[0]
    assert c.index == 0 and c.message.role == "assistant" and isinstance(c.message.content, str)
    assert c.finish_reason in ("stop", "length") and c.logprobs is None
    u = r.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 6
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0
    # greedy is deterministic, and the second run reuses the cached prompt blocks
    again = openai_client.chat.completions.create(model="tiny-random", messages=MSG, max_tokens=6, temperature=0)
    assert again.choices[0].message.content == c.message.content
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_stream_with_include_usage_matches_non_stream(openai_client):
    kwargs = {"model": "tiny-random", "messages": MSG, "max_tokens": 8, "temperature": 0, "extra_body": NO_EOS}
    full = openai_client.chat.completions.create(**kwargs)
    chunks = list(openai_client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}))
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert len({ch.id for ch in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [ch for ch in chunks if ch.choices]
    text = "".join(ch.choices[0].delta.content or "" for ch in with_choices)
    assert text == full.choices[0].message.content
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert all(ch.choices[0].finish_reason is None for ch in with_choices[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 8
    assert last.usage.total_tokens == last.usage.prompt_tokens + 8
    assert all(ch.usage is None for ch in chunks[:-1])


def test_stream_without_usage_has_no_usage_chunk(openai_client):
    chunks = list(openai_client.chat.completions.create(
        model="tiny-random", messages=MSG, max_tokens=3, extra_body=NO_EOS, stream=True))
    assert chunks and all(ch.choices for ch in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_choices(openai_client):
    r = openai_client.chat.completions.create(
        model="tiny-random", messages=MSG, max_tokens=4, n=3, seed=7, extra_body=NO_EOS)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 12  # 3 choices x 4 tokens; the prompt counts once
    assert all(c.finish_reason == "length" for c in r.choices)


def test_completions_prompt_forms(openai_client):
    r = openai_client.completions.create(model="tiny-random", prompt="The sky is", max_tokens=5,
                                         temperature=0, extra_body=NO_EOS)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert len(r.choices) == 1 and r.usage.completion_tokens == 5
    many = openai_client.completions.create(model="tiny-random", prompt=["a", "b c", "d e f"], max_tokens=2,
                                            extra_body=NO_EOS)
    assert [c.index for c in sorted(many.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert many.usage.completion_tokens == 6
    ids = openai_client.completions.create(model="tiny-random", prompt=[[1, 2, 3, 4], [5, 6]], max_tokens=2,
                                           extra_body=NO_EOS)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 6


def test_completions_stream(openai_client):
    chunks = list(openai_client.completions.create(model="tiny-random", prompt="Once upon", max_tokens=4,
                                                   stream=True, extra_body=NO_EOS,
                                                   stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].choices == []
    assert any(ch.choices and ch.choices[0].finish_reason == "length" for ch in chunks)


def test_stop_string_ends_generation(openai_client):
    """A stop string taken from an unconstrained greedy run must cut the output before it."""
    kwargs = {"model": "tiny-random", "prompt": "one two three", "max_tokens": 12, "temperature": 0,
              "extra_body": NO_EOS}
    free = openai_client.completions.create(**kwargs).choices[0].text
    stop = free[len(free) // 2:][:3]
    if not stop.strip():
        pytest.skip("greedy output has no usable stop string")
    cut = openai_client.completions.create(**kwargs, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and stop not in cut.text
    assert free.startswith(cut.text)


def test_models_lists_served_names(openai_client, server):
    ids = [m.id for m in openai_client.models.list().data]
    assert "tiny-random" in ids
    assert openai_client.models.retrieve("tiny-random").id == "tiny-random"
    if server.state.embedding_names:
        assert "all-MiniLM-L6-v2" in ids


def _embedding_server(server):
    if not server.state.embedding_names:
        pytest.skip("carpool.embed.embedder is not available")


def test_embeddings_float_and_base64(openai_client, server):
    _embedding_server(server)
    texts = ["the cat sat on the mat", "a kitten rested on the rug", "quarterly tax filing deadline"]
    b64 = openai_client.embeddings.create(model="all-MiniLM-L6-v2", input=texts)  # the SDK asks for base64
    flt = openai_client.embeddings.create(model="all-MiniLM-L6-v2", input=texts, encoding_format="float")
    a = np.array([d.embedding for d in sorted(b64.data, key=lambda d: d.index)], dtype=np.float32)
    b = np.array([d.embedding for d in sorted(flt.data, key=lambda d: d.index)], dtype=np.float32)
    assert a.shape == (3, 384)
    np.testing.assert_allclose(a, b, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1.0, atol=1e-4)
    sims = a @ a.T
    assert sims[0, 1] > sims[0, 2]  # the two cat sentences are closer than cat vs tax
    assert flt.usage.prompt_tokens > 0 and flt.usage.total_tokens == flt.usage.prompt_tokens
    one = openai_client.embeddings.create(model="all-MiniLM-L6-v2", input="hello", encoding_format="float")
    assert len(one.data) == 1 and len(one.data[0].embedding) == 384


def test_embeddings_dimensions_rejected(openai_client, server):
    import openai

    _embedding_server(server)
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.embeddings.create(model="all-MiniLM-L6-v2", input="x", dimensions=64)
    assert "dimensions" in str(e.value)


def _scrape(server) -> dict[str, float]:
    text = urllib.request.urlopen(server.base_url + "/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r'^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$', line)
        if m and 'le="' not in (m.group(2) or ""):
            key = m.group(1) + (f"{{{m.group(2)[1:-1]}}}" if m.group(2) and "finished_reason" in m.group(2) else "")
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def test_metrics_move(openai_client, server):
    before = _scrape(server)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
        assert name in before, name
    openai_client.chat.completions.create(model="tiny-random", messages=MSG, max_tokens=5, extra_body=NO_EOS)
    after = _scrape(server)
    assert after["vllm:prompt_tokens_total"] > before["vllm:prompt_tokens_total"]
    assert after["vllm:generation_tokens_total"] >= before["vllm:generation_tokens_total"] + 5
    assert after["vllm:prefix_cache_queries_total"] > before["vllm:prefix_cache_queries_total"]
    for hist in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:inter_token_latency_seconds", "vllm:iteration_tokens_total"):
        assert after[hist + "_count"] > before.get(hist + "_count", 0.0), hist
    assert after["vllm:request_queue_time_seconds_count"] > before.get("vllm:request_queue_time_seconds_count", 0)
    if server.state.embedding_names:
        openai_client.embeddings.create(model="all-MiniLM-L6-v2", input=["x", "y"])
        emb = _scrape(server)
        assert emb["carpool:embedding_batch_size_count"] > before.get("carpool:embedding_batch_size_count", 0)
        assert emb["carpool:embedding_queue_delay_seconds_count"] > 0


def test_openapi_document(server):
    import json

    doc = json.loads(urllib.request.urlopen(server.base_url + "/openapi.json", timeout=10).read())
    assert doc["openapi"].startswith("3.")
    chat = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "messages" in chat["required"]
    assert chat["properties"]["model"]["enum"] == ["tiny-random"]
    assert "/v1/completions" in doc["paths"] and "/v1/models" in doc["paths"]


def test_responses_match_the_published_document(server):
    import json

    oas = pytest.importorskip("openapi_schema_validator")
    doc = json.loads(urllib.request.urlopen(server.base_url + "/openapi.json", timeout=10).read())

    def call(path: str, body: dict | None) -> tuple[int, dict]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(server.base_url + path, data=data,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    cases = [("/v1/chat/completions", "post", {"messages": MSG, "max_tokens": 2, "n": 2}, 200),
             ("/v1/completions", "post", {"prompt": ["a", "b"], "max_tokens": 2}, 200),
             ("/v1/models", "get", None, 200),
             ("/v1/chat/completions", "post", {"messages": "nope"}, 400),
             ("/v1/completions", "post", {"model": "x", "prompt": "a"}, 404)]
    if server.state.embedding_names:
        cases.append(("/v1/embeddings", "post", {"input": ["a", "b"], "encoding_format": "float"}, 200))
        cases.append(("/v1/embeddings", "post", {"input": "a", "encoding_format": "base64"}, 200))
    for path, method, body, expected in cases:
        status, payload = call(path, body)
        assert status == expected, (path, payload)
        schema = doc["paths"][path][method]["responses"][str(status)]["content"]["application/json"]["schema"]
        oas.OAS30Validator(schema).validate(payload)
