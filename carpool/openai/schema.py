"""Request schemas of the OpenAI endpoints, as plain OpenAPI 3.0 schema dicts.

Two strictnesses of the same schemas:

- ``carpool=True``: what carpool's engine runs (the server and the in-process backend).
  Parameters carpool does not implement (echo, suffix, best_of > 1, dimensions) are
  declared with the only value accepted, so a schema-driven fuzzer and a reader both see the truth, and
  a body that asks for them gets a 400 naming the field instead of an answer without them.
- ``carpool=False``: what any OpenAI-compatible endpoint may accept (vLLM, OpenAI): the
  types and ranges of the well-known fields only.  ``carpool run`` checks each input line
  with it before anything is sent, whatever the endpoint.

The same dicts validate incoming bodies (``validation.validate``) and are published at
``/openapi.json`` (``openapi.openapi_document``), so the document cannot drift from what
the server accepts.
"""

from __future__ import annotations

from carpool.errors import SchemaError
from carpool.openai.validation import HINT, UNSUPPORTED, validate

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

ROLES = ("system", "developer", "user", "assistant", "tool")


def nullable_enum(schema: dict) -> dict:
    """Nullable; OpenAPI 3.0's ``nullable`` does not extend an ``enum``, so null is listed in it."""
    out = {**schema, "nullable": True}
    if "enum" in schema:
        out["enum"] = [*schema["enum"], None]
    return out


def _unsupported(schema: dict, what: str, carpool: bool) -> dict:
    """A parameter carpool does not implement: only its neutral value (strict), anything (lenient)."""
    return {**nullable_enum(schema), UNSUPPORTED: what} if carpool else {}


def _bounded(schema: dict, key: str, bound: int | None) -> dict:
    return {**schema, key: bound} if bound is not None else schema


def _model(models: list[str] | None, what: str) -> dict:
    schema = {"type": "string", "description": f"{what}; optional"}
    return {**schema, "enum": list(models)} if models is not None else schema


def _named_schema(schema_field: str) -> dict:
    """A response format's ``json_schema`` and a tool's ``function``: a name, a description,
    a JSON Schema under ``schema_field`` and the ``strict`` flag."""
    return {
        "type": "object",
        "required": ["name"],
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 64},
            "description": {"type": "string", "nullable": True},
            schema_field: {"type": "object", "nullable": True, "description": "a JSON Schema"},
            "strict": {"type": "boolean", "nullable": True},
        },
    }


RESPONSE_FORMAT = {
    "type": "object",
    "nullable": True,
    "required": ["type"],
    "properties": {
        "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
        "json_schema": _named_schema("schema"),
    },
}
# vLLM's own structured-output parameter (0.32's name): exactly one constraint.
STRUCTURED_OUTPUTS = {
    "type": "object",
    "nullable": True,
    "properties": {
        "json": {"anyOf": [{"type": "object", "nullable": True}, {"type": "string"}]},
        "json_object": {"type": "boolean", "nullable": True},
        "regex": {"type": "string", "nullable": True},
        "choice": {"type": "array", "nullable": True, "minItems": 1, "items": {"type": "string"}},
        "grammar": {"type": "string", "nullable": True},
    },
}
TOP_LOGPROBS_MAX = 20  # OpenAI's and vLLM's bound
_TOOL = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"type": "string", "enum": ["function"]},
        "function": _named_schema("parameters"),
    },
}
TOOL_CHOICE = {
    "anyOf": [
        nullable_enum({"type": "string", "enum": ["none", "auto", "required"]}),
        {
            "type": "object",
            "required": ["type", "function"],
            "properties": {
                "type": {"type": "string", "enum": ["function"]},
                "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}},
            },
        },
    ],
}


_NULL_ONLY: dict[str, list] = {"enum": []}  # nullable_enum turns it into "only null"


def _vllm_unimplemented(kind: str, carpool: bool) -> dict[str, dict]:
    """vLLM 0.32 parameters that change the answer and that carpool's engine does not run: only
    their neutral value passes, anything else is a 400 naming the field (instead of an answer
    that silently lacks it, then cached).  Fields that do not change the answer (``user``,
    ``cache_salt``, ``request_id``, ``stream_interval``, ...) stay ignored, as vLLM ignores
    unknown ones."""
    neutral: dict[str, dict] = {
        "use_beam_search": {"type": "boolean", "enum": [False]},
        "length_penalty": {"type": "number", "enum": [1, 1.0]},
        "include_stop_str_in_output": {"type": "boolean", "enum": [False]},
        "skip_special_tokens": {"type": "boolean", "enum": [True]},
        "spaces_between_special_tokens": {"type": "boolean", "enum": [True]},
        "truncate_prompt_tokens": _NULL_ONLY,
        "truncation_side": _NULL_ONLY,
        "prompt_logprobs": _NULL_ONLY,
        "logprob_token_ids": _NULL_ONLY,
        "allowed_token_ids": _NULL_ONLY,
        "bad_words": {"type": "array", "maxItems": 0},
        "add_special_tokens": {"type": "boolean", "enum": [kind != "chat"]},
        "return_tokens_as_token_ids": {"type": "boolean", "enum": [False]},
        "return_token_ids": {"type": "boolean", "enum": [False]},
        "return_token_offsets": {"type": "boolean", "enum": [False]},
        "watermarking": {"type": "boolean", "enum": [False]},
        "repetition_detection": _NULL_ONLY,
        "thinking_token_budget": _NULL_ONLY,
    }
    if kind == "chat":
        neutral |= {
            "echo": {"type": "boolean", "enum": [False]},
            "add_generation_prompt": {"type": "boolean", "enum": [True]},
            "continue_final_message": {"type": "boolean", "enum": [False]},
            "documents": _NULL_ONLY,
            "chat_template": _NULL_ONLY,
            "chat_template_kwargs": _NULL_ONLY,
        }
    else:
        neutral["prompt_embeds"] = _NULL_ONLY
    if not carpool:
        return {}
    return {name: _unsupported(schema, name, carpool) for name, schema in neutral.items()}


def _sampling_properties(max_model_len: int | None, max_n: int | None, carpool: bool) -> dict[str, dict]:
    """Parameters shared by chat and completions (OpenAI names plus vLLM's extras)."""
    max_tokens = _bounded({"type": "integer", "minimum": 1, "nullable": True}, "maximum", max_model_len)
    # vLLM refuses an empty stop string (it would end every answer at once); so does carpool.
    stop_string: dict[str, object] = {"type": "string"}
    if carpool:
        stop_string = {**stop_string, "minLength": 1, HINT: "an empty stop string would end every answer at once; "
                                                            "remove it"}
    return {
        "max_tokens": {**max_tokens, "description": "tokens to generate at most"},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2, "nullable": True, "default": 1.0},
        "top_p": {
            "type": "number",
            "minimum": 0,
            "exclusiveMinimum": True,
            "maximum": 1,
            "nullable": True,
            "default": 1.0,
        },
        "n": _bounded({"type": "integer", "minimum": 1, "nullable": True, "default": 1}, "maximum", max_n),
        "stream": {"type": "boolean", "nullable": True, "default": False},
        "stream_options": {
            "type": "object",
            "nullable": True,
            "properties": {"include_usage": {"type": "boolean", "nullable": True}},
        },
        "stop": {
            "anyOf": [  # OpenAPI 3.0: nullable only counts beside a type, so it sits on an option
                {**stop_string, "nullable": True},
                {"type": "array", "items": stop_string, "maxItems": 16},
            ],
        },
        "seed": {"type": "integer", "minimum": INT64_MIN, "maximum": INT64_MAX, "nullable": True},
        "user": {"type": "string", "nullable": True},
        # vLLM extras
        "top_k": {"type": "integer", "minimum": -1, "nullable": True, "description": "0 or -1: off"},
        "ignore_eos": {"type": "boolean", "nullable": True, "default": False},
        "priority": {"type": "integer", "minimum": INT64_MIN, "maximum": INT64_MAX, "nullable": True},
        "stop_token_ids": {
            "type": "array",
            "nullable": True,
            "items": {"type": "integer", "minimum": 0, "maximum": INT64_MAX},
        },
        # OpenAI's penalties (over the generated tokens) and vLLM's repetition penalty
        "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2, "nullable": True, "default": 0},
        "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2, "nullable": True, "default": 0},
        "repetition_penalty": {"type": "number", "minimum": 0, "exclusiveMinimum": True, "nullable": True,
                               "default": 1, "description": "vLLM/HF: 1 off, > 1 discourages repeats"},
        # token id (as a string key) -> bias in [-100, 100]; the keys and values are checked in requests.py
        "logit_bias": {"type": "object", "nullable": True},
        "min_tokens": {"type": "integer", "minimum": 0, "nullable": True, "default": 0},
        "min_p": {"type": "number", "minimum": 0, "maximum": 1, "nullable": True, "default": 0},
        # Any endpoint: a response_format of a type carpool does not know may be that endpoint's own.
        "response_format": RESPONSE_FORMAT if carpool else {"type": "object", "nullable": True},
        "structured_outputs": STRUCTURED_OUTPUTS if carpool else {"type": "object", "nullable": True},
    }


def chat_request_schema(models: list[str] | None = None, max_model_len: int | None = None,
                        max_n: int | None = None, *, carpool: bool = True) -> dict:
    """``models``/``max_model_len``/``max_n`` None: not bounded (an endpoint whose limits are unknown)."""
    if carpool:
        part = {
            "type": "object",
            "required": ["type", "text"],
            "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}},
        }
    else:  # image and audio parts are some endpoint's business
        part = {"type": "object", "required": ["type"], "properties": {"type": {"type": "string"}}}
    message = {
        "type": "object",
        # An assistant message that carries tool calls may have no content (check_body's rule).
        "required": ["role", "content"] if carpool else ["role"],
        "properties": {
            "role": {"type": "string", "enum": list(ROLES)},
            "content": {
                "anyOf": [{"type": "string", "nullable": True}, {"type": "array", "items": part}],
            },
            "name": {"type": "string", "nullable": True},
        },
    }
    max_completion = _bounded({"type": "integer", "minimum": 1, "nullable": True}, "maximum", max_model_len)
    props = {
        "model": _model(models, "served model name"),
        "messages": {"type": "array", "minItems": 1, "items": message},
        "max_completion_tokens": max_completion,
        **_sampling_properties(max_model_len, max_n, carpool),
        "logprobs": {"type": "boolean", "nullable": True, "default": False},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": TOP_LOGPROBS_MAX, "nullable": True},
        # Any endpoint: other tool types exist (OpenAI's "custom"); carpool runs functions.
        "tools": {"type": "array", "nullable": True, "items": _TOOL if carpool else {"type": "object"},
                  "maxItems": 128},
        "tool_choice": TOOL_CHOICE if carpool else {},
        "parallel_tool_calls": {"type": "boolean", "nullable": True, "default": True},
        **_vllm_unimplemented("chat", carpool),
    }
    return {"type": "object", "required": ["messages"], "properties": props}


def completion_request_schema(models: list[str] | None = None, max_model_len: int | None = None,
                              max_n: int | None = None, *, carpool: bool = True) -> dict:
    token_ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": INT64_MAX}}
    prompt = {
        "anyOf": [
            {"type": "string"},
            {"type": "array", "minItems": 1, "items": {"type": "string"}},
            token_ids,
            {"type": "array", "minItems": 1, "items": token_ids},
        ]
    }
    props = {
        "model": _model(models, "served model name"),
        "prompt": prompt,
        **_sampling_properties(max_model_len, max_n, carpool),
        **_vllm_unimplemented("completion", carpool),
        "echo": _unsupported({"type": "boolean", "enum": [False]}, "echo", carpool),
        "logprobs": {"type": "integer", "minimum": 0, "maximum": TOP_LOGPROBS_MAX, "nullable": True},
        "suffix": _unsupported({"type": "string", "maxLength": 0}, "suffix", carpool),
        "best_of": _unsupported({"type": "integer", "minimum": 1, "maximum": 1}, "best_of other than 1", carpool),
    }
    return {"type": "object", "required": ["prompt"], "properties": props}


def embedding_request_schema(models: list[str] | None = None, dim: int | None = None, *,
                             carpool: bool = True) -> dict:
    dimensions = {"type": "integer", "minimum": dim, "maximum": dim} if dim is not None else {"type": "integer"}
    props = {
        "model": _model(models, "embedding model name"),
        "input": {
            "anyOf": [{"type": "string"},
                      {"type": "array", "minItems": 1, "maxItems": 2048, "items": {"type": "string"}}]
        },
        "encoding_format": nullable_enum({"type": "string", "enum": ["float", "base64"], "default": "float"}),
        "dimensions": _unsupported(dimensions, "dimensions", carpool),
        "user": {"type": "string", "nullable": True},
    }
    return {"type": "object", "required": ["input"], "properties": props}


# What any OpenAI-compatible endpoint may accept, per task kind (built once: they take no limits).
_ANY_ENDPOINT = {
    "chat": chat_request_schema(carpool=False),
    "completion": completion_request_schema(carpool=False),
    "embedding": embedding_request_schema(carpool=False),
}


def check_body(kind: str, body: dict) -> SchemaError | None:
    """The first field of an OpenAI request body of ``kind`` ("chat" | "completion" | "embedding")
    that no OpenAI-compatible endpoint would take, or None."""
    try:
        validate(body, _ANY_ENDPOINT[kind])
    except SchemaError as e:
        return e
    if kind == "chat":  # a rule the schema cannot say: only an assistant message may go without content
        for i, m in enumerate(body["messages"]):
            if m.get("content") is None and m["role"] != "assistant":
                return SchemaError(f"messages[{i}].content",
                                   f"a {m['role']} message needs content: a string or a list of parts")
    return None
