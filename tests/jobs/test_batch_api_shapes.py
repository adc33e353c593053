"""The pieces of the batch path that need no server: custom_id mapping, the OpenAI chat <->
Anthropic Messages translation, the split at the limits, batch prices and ``--estimate``."""

from __future__ import annotations

import json

import pytest
from job_helpers import cli

from carpool.errors import Untranslatable
from carpool.jobs.cost.prices import builtin_prices
from carpool.jobs.provider_batch.anthropic_shapes import chat_to_params, message_to_chat
from carpool.jobs.provider_batch.ids import anthropic_id, fits_anthropic
from carpool.jobs.provider_batch.limits import OPENAI, Chunk, effective


def test_ids_that_fit_are_kept_others_are_mapped_uniquely():
    taken: set[str] = set()
    odd = ["a b", "x" * 65, "ü", "", "a/b"]
    mapped = {cid: anthropic_id(cid, taken) for cid in ["ok_id-1", *odd]}
    assert mapped["ok_id-1"] == "ok_id-1"
    assert all(fits_anthropic(p) for p in mapped.values())
    assert len(set(mapped.values())) == len(mapped)
    # an id that fits and happens to equal another's mapping still gets an id of its own
    clash = anthropic_id(mapped["a b"], taken)
    assert clash != mapped["a b"] and fits_anthropic(clash)


def test_chat_body_to_params_separates_the_system_prompt_and_names_fields_the_anthropic_way():
    body = {"model": "m", "temperature": 0.2, "stop": "END", "max_completion_tokens": 50, "user": "u1",
            "messages": [{"role": "system", "content": "s1"}, {"role": "developer", "content": "s2"},
                         {"role": "user", "content": [{"type": "text", "text": "look"},
                                                      {"type": "image_url",
                                                       "image_url": {"url": "data:image/png;base64,AAAA"}}]},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "42"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            "tool_choice": "required"}
    p = chat_to_params(body, None, 4096)
    assert p["system"] == "s1\n\ns2" and p["max_tokens"] == 50 and p["stop_sequences"] == ["END"]
    assert p["metadata"] == {"user_id": "u1"} and p["tool_choice"] == {"type": "any"}
    assert p["tools"] == [{"name": "f", "input_schema": {"type": "object"}}]
    user, assistant, tool = p["messages"]
    assert user["content"][1]["source"] == {"type": "base64", "media_type": "image/png", "data": "AAAA"}
    assert assistant["content"] == [{"type": "tool_use", "id": "c1", "name": "f", "input": {"x": 1}}]
    assert tool == {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "42"}]}
    assert chat_to_params({"messages": [{"role": "user", "content": "hi"}]}, "over", 7)["max_tokens"] == 7


@pytest.mark.parametrize("field,value", [("n", 2), ("logprobs", True), ("response_format", {"type": "json_object"})])
def test_fields_without_an_anthropic_form_are_refused_by_name(field, value):
    with pytest.raises(Untranslatable) as e:
        chat_to_params({"model": "m", "messages": [], field: value}, None, 10)
    assert e.value.field == field


def test_message_to_chat_completion_maps_content_stop_reason_and_usage():
    msg = {"id": "msg_1", "model": "claude", "stop_reason": "max_tokens",
           "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"},
                       {"type": "tool_use", "id": "t", "name": "f", "input": {"k": 2}}],
           "usage": {"input_tokens": 10, "output_tokens": 3, "cache_read_input_tokens": 5,
                     "cache_creation_input_tokens": 1}}
    body = message_to_chat(msg)
    choice = body["choices"][0]
    assert choice["message"]["content"] == "ab" and choice["finish_reason"] == "length"
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"k": 2}
    assert body["usage"] == {"prompt_tokens": 16, "completion_tokens": 3, "total_tokens": 19,
                             "prompt_tokens_details": {"cached_tokens": 5}}


def test_chunks_stop_at_the_request_and_byte_limits():
    lim = effective(OPENAI, 3, 1000)
    c = Chunk("g", lim)
    line = b"x" * 20
    for _ in range(3):
        assert c.fits(line)
        c.add(line, [])
    assert not c.fits(line)  # the request limit
    big = Chunk("g", effective(OPENAI, None, 100))
    big.add(b"y" * 30, [])
    assert not big.fits(b"z" * 10)  # 64 (envelope) + 31 + 11 > 100 bytes
    with pytest.raises(ValueError, match="--batch-max-requests"):
        effective(OPENAI, 60_000, None)


def test_batch_prices_are_half_and_cached_tokens_have_their_own_rate():
    p = builtin_prices("gpt-4o-mini")
    assert p is not None
    b = p.at_batch_rate()
    assert (b.input_per_m, b.output_per_m, b.cached_per_m) == (0.075, 0.30, 0.0375)
    # 1M prompt tokens of which 400k cached, 100k completion tokens
    assert b.cost(1_000_000, 100_000, 400_000) == pytest.approx(0.6 * 0.075 + 0.4 * 0.0375 + 0.1 * 0.30)


def test_estimate_prices_a_batch_job_at_half(tmp_path):
    tasks = tmp_path / "t.jsonl"
    tasks.write_text("".join(json.dumps({"custom_id": f"t{i}", "max_tokens": 100,
                                         "messages": [{"role": "user", "content": "hello there " * 20}]}) + "\n"
                             for i in range(20)))
    common = [tasks, "--model", "gpt-4o-mini", "--endpoint", "http://127.0.0.1:9/v1", "--estimate",
              "--summary-json", "-", "--quiet"]
    online = json.loads(cli(*common).stdout)
    batch = json.loads(cli(*common, "--batch-api", "openai").stdout)
    assert online["total_usd_max"] > 0
    assert batch["total_usd_max"] == pytest.approx(online["total_usd_max"] / 2, rel=1e-3)
    assert "batch rate" in batch["prices"]["source"]


def test_a_batch_endpoint_must_be_the_files_only_one_and_anthropic_has_no_online_fallback(tmp_path):
    tasks, ep = tmp_path / "t.jsonl", tmp_path / "ep.yaml"
    tasks.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    ep.write_text("endpoints:\n  - {kind: openai-batch, base_url: 'http://127.0.0.1:9/v1', model: m}\n"
                  "  - {kind: openai, base_url: 'http://127.0.0.1:8/v1', model: m}\n")
    r = cli(tasks, "-o", tmp_path / "o.jsonl", "--endpoints", ep)
    assert r.returncode == 2 and "only endpoint" in r.stderr
    r = cli(tasks, "-o", tmp_path / "o.jsonl", "--batch-api", "anthropic", "--endpoint", "http://127.0.0.1:9",
            "--model", "m", "--batch-online-fallback")
    assert r.returncode == 2 and "--batch-online-fallback" in r.stderr
    assert not (tmp_path / "o.jsonl").exists()
