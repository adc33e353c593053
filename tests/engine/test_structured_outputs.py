"""Grammar-constrained decoding: every output follows its schema, greedy and sampled.

Two models: the packaged SmolLM2 (real outputs of a real extraction prompt) and the
tiny-random model with SmolLM2's tokenizer, whose random weights pick near-arbitrary tokens:
the grammar alone keeps those outputs valid, which is the harder test of the mask.
"""

import json

import jsonschema
import pytest

from carpool.engine import LLM, EngineConfig, EngineError, GenerateRequest, SamplingParams
from carpool.engine.protocol import StructuredOutputs
from carpool.engine.tool_calls import parse_tool_calls, tool_call_constraint

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "city": {"type": "string", "maxLength": 40}},
    "required": ["name", "age", "city"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {
    "customer": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                                  "vip": {"type": "boolean"}},
                 "required": ["name", "vip"], "additionalProperties": False},
    "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "maxLength": 12},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
        "required": ["sku", "qty"], "additionalProperties": False}},
    "status": {"enum": ["new", "paid", "shipped"]}},
    "required": ["customer", "items", "status"], "additionalProperties": False}
REVIEW = {"type": "object", "properties": {
    "sentiment": {"enum": ["positive", "negative", "neutral"]},
    "confidence": {"type": "number", "minimum": 0, "maximum": 1},
    "topics": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4}},
    "required": ["sentiment", "confidence", "topics"], "additionalProperties": False}
REFS = {"$defs": {"addr": {"type": "object", "properties": {
    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "street": {"type": "string", "maxLength": 30}},
    "required": ["zip", "street"], "additionalProperties": False}},
    "type": "object", "properties": {"home": {"$ref": "#/$defs/addr"},
                                     "work": {"anyOf": [{"$ref": "#/$defs/addr"}, {"type": "null"}]}},
    "required": ["home", "work"], "additionalProperties": False}
SCHEMAS = {"person": PERSON, "order": ORDER, "review": REVIEW, "refs": REFS}

TEXTS = [
    "Maria Lopez, 34, lives in Valencia. She ordered 2 units of SKU A-113 and paid; she is a VIP customer. "
    "Her home is at 12 Calle Mayor, zip 46001; she works from home. Review: 'fast delivery, great price'.",
    "Tom (age 61) from Leeds bought one B7 kettle, order still new, not VIP. Address: 4 Park Row, 10115, "
    "office at 9 Mill Lane, 20095. Review: 'the kettle leaks, very disappointed'.",
    "Customer Aiko Tanaka, 27, Osaka, shipped order of 3 x Z-9 and 1 x Q-2, VIP. Lives at 1-2 Umeda 53000. "
    "Review: 'it is fine I guess, nothing special'.",
]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 30},
                                          "unit": {"enum": ["celsius", "fahrenheit"]}},
                                          "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "send_email", "description": "Send an email",
                                      "parameters": {"type": "object", "properties": {
                                          "to": {"type": "string", "maxLength": 40},
                                          "subject": {"type": "string", "maxLength": 40}},
                                          "required": ["to", "subject"], "additionalProperties": False}}},
]
SAMPLINGS = [{"temperature": 0}, {"temperature": 1.0, "seed": 1}, {"temperature": 0.8, "top_p": 0.9, "seed": 2}]


def _extract(rid, text, schema, **sampling):
    msg = [{"role": "system", "content": "Extract the data as JSON matching this schema: " + json.dumps(schema)},
           {"role": "user", "content": text}]
    return GenerateRequest(request_id=rid, messages=msg, params=SamplingParams(
        max_tokens=200, structured_outputs=StructuredOutputs(json=schema), **sampling))


@pytest.fixture(scope="module")
def smollm2():
    loader = pytest.importorskip("carpool.engine.loader")
    loaded = loader.load_model("smollm2")
    return LLM(EngineConfig(model="smollm2", num_kv_blocks=1024, max_num_seqs=64), loaded=loaded)


@pytest.mark.real_model
def test_every_output_is_schema_valid_greedy_and_sampled(smollm2):
    reqs = [_extract(f"{name}-{t}-{s}", text, schema, **sampling)
            for name, schema in SCHEMAS.items() for t, text in enumerate(TEXTS)
            for s, sampling in enumerate(SAMPLINGS)]
    outs = smollm2.generate(reqs)
    for r, o in zip(reqs, outs, strict=True):
        assert o.finish_reason == "stop", (o.request_id, o.text)
        jsonschema.validate(json.loads(o.text), r.params.structured_outputs.json)
    # The constraint really worked: the same requests without it are not all valid JSON.
    free = smollm2.generate([GenerateRequest(request_id=r.request_id, messages=r.messages,
                                             params=SamplingParams(max_tokens=60, temperature=0))
                             for r in reqs[::3]])
    assert not all(_parses(o.text) for o in free)


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


JSON_EXAMPLE = ('Give the name, age and city of the person as JSON, for example: '
                '{"name": "Ann", "age": 40, "city": "Rome"}')


@pytest.mark.real_model
def test_json_object_always_parses(smollm2):
    """Any JSON object: what ends parses.  An unbounded object lets this 135M model ramble on
    (about a third of these run to max_tokens, a valid prefix then); a schema with bounds ends."""
    samplings = [*SAMPLINGS, {"temperature": 1.0, "seed": 7}, {"temperature": 0.7, "seed": 8}]
    reqs = [GenerateRequest(request_id=f"jo{i}-{s}", messages=[{"role": "system", "content": JSON_EXAMPLE},
                                                               {"role": "user", "content": text}],
                            params=SamplingParams(max_tokens=300, **sampling,
                                                  structured_outputs=StructuredOutputs(json_object=True)))
            for i, text in enumerate(TEXTS) for s, sampling in enumerate(samplings)]
    outs = smollm2.generate(reqs)
    for o in outs:
        assert o.finish_reason in ("stop", "length")
        assert o.text.lstrip().startswith("{")
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict), o.text
    assert sum(o.finish_reason == "stop" for o in outs) >= len(outs) // 2


@pytest.mark.real_model
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "send_email"}}],
                         ids=["required", "named"])
def test_tool_calls_parse_to_declared_functions_with_valid_arguments(smollm2, tool_choice):
    """One call per answer (parallel_tool_calls false): allowed a list, this small model repeats
    the same call until max_tokens, a valid prefix but no answer."""
    questions = ["What is the weather in Paris in celsius?", "Email bob@example.com that the report is late.",
                 "Tell me a joke."]
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    so = tool_call_constraint(TOOLS, tool_choice, parallel_tool_calls=False)
    reqs = [GenerateRequest(request_id=f"tc{i}-{s}", messages=[
        {"role": "system", "content": "You can call these functions: " + json.dumps(TOOLS)},
        {"role": "user", "content": q}], params=SamplingParams(max_tokens=200, structured_outputs=so, **sampling))
        for i, q in enumerate(questions) for s, sampling in enumerate(SAMPLINGS)]
    for o in smollm2.generate(reqs):
        assert o.finish_reason == "stop", o.text
        calls = parse_tool_calls(o.text, TOOLS, tool_choice)
        assert calls, o.text
        for c in calls:
            assert c.name in params
            jsonschema.validate(json.loads(c.arguments), params[c.name])
        if isinstance(tool_choice, dict):
            assert [c.name for c in calls] == ["send_email"]


# ------------------------------------------------------------------ tiny random model (fast)


@pytest.fixture(scope="module")
def tiny_llm(tiny_tok):
    return LLM(EngineConfig(model="tiny-random", dtype="float32", num_kv_blocks=512, max_num_seqs=32,
                            num_threads=1), loaded=tiny_tok)


BOUNDED = {  # every string and number bounded, so even random tokens finish within max_tokens
    "person": PERSON,
    "order": ORDER,
    "flags": {"type": "object", "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["a", "b", "c"]},
                                               "n": {"type": "integer", "minimum": -5, "maximum": 5}},
              "required": ["ok", "kind", "n"], "additionalProperties": False},
    "refs": REFS,
}


def test_random_weights_still_give_valid_json(tiny_llm):
    reqs = [GenerateRequest(request_id=f"{name}-{seed}", prompt_token_ids=[1, 100 + seed, 200],
                            params=SamplingParams(temperature=1.0 if seed else 0, seed=seed, max_tokens=400,
                                                  structured_outputs=StructuredOutputs(json=schema)))
            for name, schema in BOUNDED.items() for seed in range(6)]
    outs = tiny_llm.generate(reqs)
    for r, o in zip(reqs, outs, strict=True):
        assert o.finish_reason == "stop", (o.request_id, o.text)
        jsonschema.validate(json.loads(o.text), r.params.structured_outputs.json)


def test_end_of_sequence_only_where_the_grammar_is_complete(tiny_llm, tiny_tok):
    """EOS pushed up by +100: without a grammar the request ends at once; with one, only when complete."""
    eos = tiny_tok.eos_token_ids[0]
    push = {"temperature": 0, "max_tokens": 200, "logit_bias": {eos: 100.0}}
    free, constrained = tiny_llm.generate([
        GenerateRequest(request_id="free", prompt_token_ids=[1, 2, 3], params=SamplingParams(**push)),
        GenerateRequest(request_id="json", prompt_token_ids=[1, 2, 3], params=SamplingParams(
            **push, structured_outputs=StructuredOutputs(json=BOUNDED["flags"])))])
    assert free.token_ids == [eos] and free.text == ""
    assert constrained.finish_reason == "stop"
    jsonschema.validate(json.loads(constrained.text), BOUNDED["flags"])


def test_max_tokens_cuts_with_length_and_ignore_eos_still_ends(tiny_llm):
    so = StructuredOutputs(json=PERSON)
    cut, ignoring = tiny_llm.generate([
        GenerateRequest(request_id="cut", prompt_token_ids=[5, 6], params=SamplingParams(
            temperature=0, max_tokens=3, structured_outputs=so)),
        GenerateRequest(request_id="ign", prompt_token_ids=[5, 6], params=SamplingParams(
            temperature=0, max_tokens=300, ignore_eos=True, min_tokens=250, structured_outputs=so))])
    assert cut.finish_reason == "length" and len(cut.token_ids) == 3
    assert cut.text.lstrip().startswith("{")
    assert ignoring.finish_reason == "stop"  # the grammar was complete: nothing more could follow
    jsonschema.validate(json.loads(ignoring.text), PERSON)


def test_regex_and_choice(tiny_llm):
    outs = tiny_llm.generate([
        GenerateRequest(request_id=f"{kind}{seed}", prompt_token_ids=[7, 8, 9], params=SamplingParams(
            temperature=1.0, seed=seed, max_tokens=40, structured_outputs=so))
        for seed in range(4)
        for kind, so in (("re", StructuredOutputs(regex=r"[A-Z]{2}-[0-9]{3}")),
                         ("ch", StructuredOutputs(choice=["yes", "no", "maybe later"])))])
    import re

    for o in outs:
        assert o.finish_reason == "stop"
        if o.request_id.startswith("re"):
            assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", o.text), o.text
        else:
            assert o.text in ("yes", "no", "maybe later")


def test_grammars_are_compiled_once_per_schema(tiny_llm):
    eng = tiny_llm.engine
    schema = {"type": "object", "properties": {"only": {"enum": ["x"]}}, "required": ["only"]}
    before = eng.grammars.compiles
    tiny_llm.generate([GenerateRequest(request_id=f"c{i}", prompt_token_ids=[1, 2], params=SamplingParams(
        temperature=0, max_tokens=20, structured_outputs=StructuredOutputs(json=dict(schema))))
        for i in range(5)])
    assert eng.grammars.compiles == before + 1


@pytest.mark.parametrize(("so", "field"), [
    (StructuredOutputs(json={"type": "bogus"}), "structured_outputs.json"),
    (StructuredOutputs(json='{"type": '), "structured_outputs.json"),
    (StructuredOutputs(json=[1, 2]), "structured_outputs.json"),
    (StructuredOutputs(regex="(unclosed"), "structured_outputs.regex"),
    (StructuredOutputs(), "structured_outputs needs exactly one"),
    (StructuredOutputs(json=PERSON, json_object=True), "structured_outputs needs exactly one"),
    (StructuredOutputs(choice=[]), "structured_outputs.choice"),
])
def test_bad_grammars_are_refused_naming_the_field(tiny_llm, so, field):
    with pytest.raises(EngineError) as e:
        tiny_llm.engine.make_sequence(GenerateRequest(request_id="bad", prompt_token_ids=[1],
                                                      params=SamplingParams(structured_outputs=so)))
    assert field in str(e.value)


def test_tool_call_constraint_shapes():
    assert tool_call_constraint(TOOLS, "auto") is None  # auto stays free text
    assert tool_call_constraint(TOOLS, "none") is None
    assert tool_call_constraint(None, "required") is None
    named = tool_call_constraint(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    assert named.json == TOOLS[0]["function"]["parameters"]
    single = tool_call_constraint(TOOLS, "required", parallel_tool_calls=False)
    assert single.json["maxItems"] == 1
    with pytest.raises(EngineError, match="not in tools"):
        tool_call_constraint(TOOLS, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(EngineError, match=r"tools\[1\].function.name"):
        tool_call_constraint([TOOLS[0], TOOLS[0]], "required")
    # auto: a call written in the required form is read as one; prose is content.
    text = '[{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]'
    assert [c.name for c in parse_tool_calls(text, TOOLS, "auto")] == ["get_weather"]
    assert parse_tool_calls("It is sunny.", TOOLS, "auto") is None
    assert parse_tool_calls('[{"name": "rm_rf", "arguments": {}}]', TOOLS, "auto") is None
