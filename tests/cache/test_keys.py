"""Cache keys: every output-changing parameter is in the key, nothing else is."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.cache import cache_key, is_cacheable, normalize_text, scope_key, semantic_text

CHAT = "/v1/chat/completions"
BASE = {
    "messages": [
        {"role": "system", "content": "Answer with one word: positive, negative or neutral."},
        {"role": "user", "content": "The delivery was fast."},
    ],
    "temperature": 0,
    "max_tokens": 8,
}


def key(body: dict, model: str = "smollm2", endpoint: str = CHAT) -> str:
    return cache_key(model=model, endpoint=endpoint, body=body)


def with_(**changes) -> dict:
    body = copy.deepcopy(BASE)
    body.update(changes)
    return body


# Each of these changes what a server returns, so each must change the key.
OUTPUT_CHANGES = {
    "temperature": {"temperature": 0.7},
    "top_p": {"top_p": 0.9},
    "top_k": {"top_k": 40},
    "min_p": {"min_p": 0.1},
    "max_tokens": {"max_tokens": 9},
    "max_completion_tokens": {"max_completion_tokens": 8},
    "stop": {"stop": ["\n"]},
    "seed": {"seed": 1},
    "n": {"n": 2},
    "response_format": {"response_format": {"type": "json_object"}},
    "tools": {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
    "tool_choice": {"tool_choice": "none"},
    "parallel_tool_calls": {"parallel_tool_calls": False},
    "logit_bias": {"logit_bias": {"50256": -100}},
    "presence_penalty": {"presence_penalty": 0.5},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "repetition_penalty": {"repetition_penalty": 1.1},
    "logprobs": {"logprobs": True},
    "top_logprobs": {"top_logprobs": 2},
    "logprobs_completions": {"logprobs": 3},
    "echo": {"echo": True},
    "suffix": {"suffix": "!"},
    "best_of": {"best_of": 2},
    "ignore_eos": {"ignore_eos": True},
    "stop_token_ids": {"stop_token_ids": [2]},
    "min_tokens": {"min_tokens": 4},
    "return_token_ids": {"return_token_ids": True},
    "prompt_logprobs": {"prompt_logprobs": 1},
    "guided_json": {"guided_json": {"type": "object"}},
    "structured_outputs": {"structured_outputs": {"choice": ["a", "b"]}},
    "extra_body": {"extra_body": {"top_k": 5}},
    "reasoning_effort": {"reasoning_effort": "low"},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {}}}},
    "unknown_field": {"some_future_knob": 1},
}


@pytest.mark.parametrize("name", sorted(OUTPUT_CHANGES))
def test_every_output_parameter_changes_the_key(name):
    assert key(with_(**OUTPUT_CHANGES[name])) != key(BASE), name


def test_model_endpoint_and_messages_change_the_key():
    base = key(BASE)
    assert key(BASE, model="qwen2.5-7b") != base
    assert key(BASE, endpoint="/v1/completions") != base
    assert key(BASE, endpoint="http://a:8000/v1/chat/completions") != key(
        BASE, endpoint="http://b:8000/v1/chat/completions"
    )
    changed_system = copy.deepcopy(BASE)
    changed_system["messages"][0]["content"] = "Answer with one word: yes or no."
    assert key(changed_system) != base
    changed_role = copy.deepcopy(BASE)
    changed_role["messages"][1]["role"] = "assistant"
    assert key(changed_role) != base
    named = copy.deepcopy(BASE)
    named["messages"][1]["name"] = "alice"
    assert key(named) != base
    extra_turn = copy.deepcopy(BASE)
    extra_turn["messages"].insert(1, {"role": "user", "content": "Hi"})
    assert key(extra_turn) != base
    swapped = copy.deepcopy(BASE)
    swapped["messages"].reverse()
    assert key(swapped) != base


@pytest.mark.parametrize(
    "field,value",
    [("api_key", "sk-123"), ("request_id", "r1"), ("custom_id", "line-7"), ("user", "u"),
     ("stream", True), ("stream_options", {"include_usage": True}), ("timeout", 30),
     ("metadata", {"job": "x"}), ("store", False), ("service_tier", "auto"), ("model", "ignored")],
)
def test_fields_that_do_not_change_the_output_are_not_in_the_key(field, value):
    assert key(with_(**{field: value})) == key(BASE)


def test_model_comes_from_the_body_when_not_given():
    assert cache_key(model=None, endpoint=CHAT, body=with_(model="smollm2")) == key(BASE)
    assert cache_key(model=None, endpoint=CHAT, body=with_(model="other")) != key(BASE)


@pytest.mark.parametrize(
    "variant",
    [
        "The  delivery was fast.",
        "  The delivery was fast.  ",
        "The delivery\twas fast.",
        "The delivery was fast.\n",
        "The\u00a0delivery was fast.",
        "The deli\u200bvery was fast.",
        "\ufeffThe delivery was fast.",
        "The deliv\u00adery was fast.",
    ],
)
def test_whitespace_and_invisible_variants_collide(variant):
    body = copy.deepcopy(BASE)
    body["messages"][1]["content"] = variant
    assert key(body) == key(BASE)


@pytest.mark.parametrize(
    "variant",
    ["the delivery was fast.", "The delivery was fast!", "The delivery was fast", "The delivery was fast.."],
)
def test_case_and_punctuation_are_kept(variant):
    body = copy.deepcopy(BASE)
    body["messages"][1]["content"] = variant
    assert key(body) != key(BASE)


def test_unicode_nfc_folds_composed_and_decomposed():
    composed = with_(messages=[{"role": "user", "content": "caf\u00e9"}])
    decomposed = with_(messages=[{"role": "user", "content": "cafe\u0301"}])
    assert key(composed) == key(decomposed)
    # NFKC is not applied: a full-width letter is another text.
    assert key(with_(messages=[{"role": "user", "content": "\uff21"}])) != key(
        with_(messages=[{"role": "user", "content": "A"}])
    )


def test_line_structure_and_indentation_are_kept():
    assert normalize_text("a\r\n\r\n\nb") == "a\nb"
    assert normalize_text("if x:\n    y") != normalize_text("if x:\ny")
    assert normalize_text("a\nb") != normalize_text("a b")
    assert normalize_text("a   b  \n  c") == "a b\n  c"


def test_stop_strings_are_not_normalised():
    assert key(with_(stop=[" "])) != key(with_(stop=["  "]))


def test_field_order_only_matters_where_the_model_sees_it():
    reordered = dict(reversed(list(BASE.items())))
    assert key(reordered) == key(BASE)
    message_fields_reordered = copy.deepcopy(BASE)
    message_fields_reordered["messages"] = [{"content": m["content"], "role": m["role"]} for m in BASE["messages"]]
    assert key(message_fields_reordered) == key(BASE)
    schema_a = {"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}}}}}
    schema_b = copy.deepcopy(schema_a)
    props = schema_b["json_schema"]["schema"]["properties"]
    schema_b["json_schema"]["schema"]["properties"] = {"b": props["b"], "a": props["a"]}
    assert key(with_(response_format=schema_a)) != key(with_(response_format=schema_b))


def test_integral_floats_equal_ints_but_absent_is_not_default():
    assert key(with_(temperature=0.0)) == key(with_(temperature=0))
    assert key(with_(max_tokens=8.0)) == key(BASE)
    without = copy.deepcopy(BASE)
    del without["max_tokens"]
    assert key(without) != key(BASE)


def test_text_parts_prompt_and_embedding_input_are_normalised():
    parts = with_(messages=[{"role": "user", "content": [{"type": "text", "text": "a  b "}]}])
    parts2 = with_(messages=[{"role": "user", "content": [{"type": "text", "text": "a b"}]}])
    assert key(parts) == key(parts2)
    assert key({"prompt": "x  y", "temperature": 0}, endpoint="/v1/completions") == key(
        {"prompt": " x y", "temperature": 0}, endpoint="/v1/completions"
    )
    assert key({"input": ["a  b", [1, 2]]}, endpoint="/v1/embeddings") == key(
        {"input": ["a b", [1, 2]]}, endpoint="/v1/embeddings"
    )
    assert key({"input": ["a", [1, 2]]}, endpoint="/v1/embeddings") != key(
        {"input": ["a", [1, 3]]}, endpoint="/v1/embeddings"
    )


def test_endpoint_identity_folds_host_case_and_trailing_slash():
    assert key(BASE, endpoint="HTTP://Host:8000/v1/chat/completions/") == key(
        BASE, endpoint="http://host:8000/v1/chat/completions"
    )


@settings(deadline=None)  # no timing in tests: the machine may be busy
@given(st.text(max_size=60))
def test_normalisation_is_idempotent(text):
    once = normalize_text(text)
    assert normalize_text(once) == once


@settings(deadline=None)
@given(st.lists(st.sampled_from(["word", "Two", "3", "!", "é"]), min_size=1, max_size=8),
       st.lists(st.sampled_from([" ", "  ", "\t", " \u200b", "\u00a0"]), min_size=8, max_size=8))
def test_any_spacing_of_the_same_words_collides(words, gaps):
    plain = " ".join(words)
    spaced = "".join(w + g for w, g in zip(words, gaps, strict=False))
    assert key(with_(messages=[{"role": "user", "content": spaced}])) == key(
        with_(messages=[{"role": "user", "content": plain}])
    )


# -- which requests are cacheable --------------------------------------------------------


def test_sampling_is_not_cached_unless_asked():
    assert is_cacheable(BASE)
    assert is_cacheable(with_(temperature=0.0, n=3))  # greedy: the n choices are equal
    assert not is_cacheable(with_(temperature=0.8))
    absent = copy.deepcopy(BASE)
    del absent["temperature"]
    assert not is_cacheable(absent)  # OpenAI's default temperature is 1.0
    assert is_cacheable(absent, cache_sampled=True)
    assert not is_cacheable(with_(temperature=0.8, n=4))
    assert is_cacheable(with_(temperature=0.8, n=4), cache_sampled=True)
    assert is_cacheable(with_(temperature=0.8, seed=7))  # reproducible by request
    assert not is_cacheable(with_(temperature="hot"))
    assert is_cacheable({"input": ["x"]})  # embeddings are deterministic


def test_semantic_text_only_for_label_like_greedy_chat():
    assert semantic_text(BASE) == "The delivery was fast."
    assert semantic_text(with_(max_tokens=200)) is None  # free text
    assert semantic_text(with_(temperature=0.5)) is None
    absent = copy.deepcopy(BASE)
    del absent["temperature"]
    assert semantic_text(absent) is None
    assert semantic_text(with_(n=2)) is None
    assert semantic_text(with_(tools=[{"type": "function", "function": {"name": "f"}}])) is None
    assert semantic_text(with_(logprobs=True)) is None
    assert semantic_text({"prompt": "x", "temperature": 0, "max_tokens": 2}) is None
    assert semantic_text({"input": "x"}) is None
    assert semantic_text(with_(messages=[{"role": "user", "content": "x" * 2000}])) is None
    last_assistant = with_(messages=[*BASE["messages"], {"role": "assistant", "content": "ok"}])
    assert semantic_text(last_assistant) is None
    enum_schema = {"type": "json_schema", "json_schema": {"name": "label", "schema": {
        "type": "object", "properties": {"label": {"enum": ["pos", "neg"]}, "spam": {"type": "boolean"}}}}}
    long_enum = with_(max_tokens=100, response_format=enum_schema)
    assert semantic_text(long_enum) == "The delivery was fast."
    free_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"summary": {"type": "string"}}}}}
    assert semantic_text(with_(max_tokens=100, response_format=free_schema)) is None


def test_scope_is_everything_but_the_final_user_text():
    other_text = copy.deepcopy(BASE)
    other_text["messages"][1]["content"] = "Something else entirely."
    s = scope_key(model="m", endpoint=CHAT, body=BASE)
    assert scope_key(model="m", endpoint=CHAT, body=other_text) == s
    for name, change in OUTPUT_CHANGES.items():
        assert scope_key(model="m", endpoint=CHAT, body=with_(**change)) != s, name
    other_system = copy.deepcopy(BASE)
    other_system["messages"][0]["content"] = "Is it spam?"
    assert scope_key(model="m", endpoint=CHAT, body=other_system) != s
    assert scope_key(model="other", endpoint=CHAT, body=BASE) != s
    assert scope_key(model="m", endpoint=CHAT, body=BASE) != cache_key(model="m", endpoint=CHAT, body=BASE)
