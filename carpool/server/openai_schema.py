"""Request schemas of the OpenAI endpoints carpool serves, their validator and the OpenAPI document.

The schemas are plain OpenAPI 3.0 schema dicts.  The same dicts validate incoming bodies
and are published at ``/openapi.json``, so the document cannot drift from what the server
accepts.  Parameters carpool does not implement (logprobs, penalties, tools) are declared
with the only value accepted, so a schema-driven fuzzer and a reader both see the truth.
"""

from __future__ import annotations

from typing import Any

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

_UNSUPPORTED = "x-carpool-unsupported"


def _nullable_enum(schema: dict) -> dict:
    """Nullable; OpenAPI 3.0's ``nullable`` does not extend an ``enum``, so null is listed in it."""
    out = {**schema, "nullable": True}
    if "enum" in schema:
        out["enum"] = [*schema["enum"], None]
    return out


def _unsupported(schema: dict, what: str) -> dict:
    return {**_nullable_enum(schema), _UNSUPPORTED: what}


def _sampling_properties(max_model_len: int, max_n: int) -> dict[str, dict]:
    """Parameters shared by chat and completions (OpenAI names plus vLLM's extras)."""
    max_tokens = {"type": "integer", "minimum": 1, "maximum": max_model_len, "nullable": True}
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
        "n": {"type": "integer", "minimum": 1, "maximum": max_n, "nullable": True, "default": 1},
        "stream": {"type": "boolean", "nullable": True, "default": False},
        "stream_options": {
            "type": "object",
            "nullable": True,
            "properties": {"include_usage": {"type": "boolean", "nullable": True}},
        },
        "stop": {
            "anyOf": [  # OpenAPI 3.0: nullable only counts beside a type, so it sits on an option
                {"type": "string", "nullable": True},
                {"type": "array", "items": {"type": "string"}, "maxItems": 16},
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
        # declared, not implemented: only the neutral value passes
        "presence_penalty": _unsupported({"type": "number", "minimum": 0, "maximum": 0}, "presence_penalty"),
        "frequency_penalty": _unsupported({"type": "number", "minimum": 0, "maximum": 0}, "frequency_penalty"),
        "logit_bias": _unsupported({"type": "object", "maxProperties": 0}, "logit_bias"),
    }


def chat_request_schema(models: list[str], max_model_len: int, max_n: int) -> dict:
    text_part = {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}},
    }
    message = {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
            "content": {
                "anyOf": [{"type": "string", "nullable": True}, {"type": "array", "items": text_part}],
            },
            "name": {"type": "string", "nullable": True},
        },
    }
    props = {
        "model": {"type": "string", "enum": models, "description": "served model name; optional"},
        "messages": {"type": "array", "minItems": 1, "items": message},
        "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": max_model_len, "nullable": True},
        **_sampling_properties(max_model_len, max_n),
        "logprobs": _unsupported({"type": "boolean", "enum": [False]}, "logprobs"),
        "top_logprobs": _unsupported({"type": "integer", "minimum": 0, "maximum": 0}, "top_logprobs"),
        "tools": _unsupported({"type": "array", "maxItems": 0, "items": {"type": "object"}}, "tools"),
        "tool_choice": _unsupported({"type": "string", "enum": ["none"]}, "tool_choice"),
        "response_format": _unsupported(
            {
                "type": "object",
                "required": ["type"],
                "properties": {"type": {"type": "string", "enum": ["text"]}},
            },
            "response_format other than text",
        ),
    }
    return {"type": "object", "required": ["messages"], "properties": props}


def completion_request_schema(models: list[str], max_model_len: int, max_n: int) -> dict:
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
        "model": {"type": "string", "enum": models, "description": "served model name; optional"},
        "prompt": prompt,
        **_sampling_properties(max_model_len, max_n),
        "echo": _unsupported({"type": "boolean", "enum": [False]}, "echo"),
        "logprobs": _unsupported({"type": "integer", "minimum": 0, "maximum": 0}, "logprobs"),
        "suffix": _unsupported({"type": "string", "maxLength": 0}, "suffix"),
        "best_of": _unsupported({"type": "integer", "minimum": 1, "maximum": 1}, "best_of other than 1"),
    }
    return {"type": "object", "required": ["prompt"], "properties": props}


def embedding_request_schema(models: list[str], dim: int) -> dict:
    props = {
        "model": {"type": "string", "enum": models, "description": "embedding model name; optional"},
        "input": {
            "anyOf": [{"type": "string"},
                      {"type": "array", "minItems": 1, "maxItems": 2048, "items": {"type": "string"}}]
        },
        "encoding_format": _nullable_enum({"type": "string", "enum": ["float", "base64"], "default": "float"}),
        "dimensions": _unsupported({"type": "integer", "minimum": dim, "maximum": dim}, "dimensions"),
        "user": {"type": "string", "nullable": True},
    }
    return {"type": "object", "required": ["input"], "properties": props}


# ----------------------------------------------------------------------------------------------
# validation


class SchemaError(ValueError):
    """A body that does not match its schema; ``param`` is the dotted path of the culprit."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


_JSON_TYPE_NAMES = {
    bool: "boolean",
    int: "integer",
    float: "number",
    str: "string",
    list: "array",
    dict: "object",
    type(None): "null",
}


def _type_name(value: Any) -> str:
    return _JSON_TYPE_NAMES.get(type(value), type(value).__name__)


def _is_type(value: Any, expected: str) -> bool:
    if expected == "integer":  # as OpenAPI 3.0 (JSON Schema draft 4): 1.0 is a number, not an integer
        return isinstance(value, int) and not isinstance(value, bool)
    if expected == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected == "boolean":
        return isinstance(value, bool)
    if expected == "string":
        return isinstance(value, str)
    if expected == "array":
        return isinstance(value, list)
    if expected == "object":
        return isinstance(value, dict)
    return False


def _fail(path: str, schema: dict, message: str) -> SchemaError:
    what = schema.get(_UNSUPPORTED)
    if what:
        return SchemaError(path, f"'{path}': {what} is not supported by carpool; leave it out")
    return SchemaError(path, f"'{path}': {message}")


def validate(value: Any, schema: dict, path: str = "") -> None:
    """Raise SchemaError naming the first field of ``value`` that breaks ``schema``."""
    if value is None:
        if schema.get("nullable"):
            return
        if "type" in schema and "anyOf" not in schema:
            raise _fail(path, schema, "must not be null")
    if "anyOf" in schema:
        errors = []
        for option in schema["anyOf"]:
            try:
                validate(value, option, path)
                return
            except SchemaError as e:
                errors.append(e)
        # Report the option whose type matched (its message is the precise one), else list the types.
        for option, err in zip(schema["anyOf"], errors, strict=False):
            if "type" in option and _is_type(value, option["type"]):
                raise err
        kinds = " or ".join(_describe(o) for o in schema["anyOf"])
        raise _fail(path, schema, f"must be {kinds}, got {_type_name(value)}")
    expected = schema.get("type")
    if expected and not _is_type(value, expected):
        raise _fail(path, schema, f"must be {_describe(schema)}, got {_type_name(value)}")
    if "enum" in schema and value not in schema["enum"]:
        choices = ", ".join(repr(c) for c in schema["enum"] if c is not None)
        raise _fail(path, schema, f"must be one of {choices}, got {value!r}")
    if expected in ("integer", "number"):
        _check_range(value, schema, path)
    elif expected == "string":
        if "minLength" in schema and len(value) < schema["minLength"]:
            raise _fail(path, schema, f"must have at least {schema['minLength']} characters")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            raise _fail(path, schema, f"must have at most {schema['maxLength']} characters")
    elif expected == "array":
        if "minItems" in schema and len(value) < schema["minItems"]:
            raise _fail(path, schema, f"must have at least {schema['minItems']} item(s)")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            raise _fail(path, schema, f"must have at most {schema['maxItems']} item(s)")
        if "items" in schema:
            for i, item in enumerate(value):
                validate(item, schema["items"], f"{path}[{i}]")
    elif expected == "object":
        if "maxProperties" in schema and len(value) > schema["maxProperties"]:
            raise _fail(path, schema, f"must have at most {schema['maxProperties']} properties")
        # Present fields first: a wrong value ("type": "image_url") explains more than what is missing.
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                validate(value[name], sub, _join(path, name))
        for name in schema.get("required", []):
            if name not in value:
                raise _fail(_join(path, name), {}, "is required")


def _check_range(value: float, schema: dict, path: str) -> None:
    lo, hi = schema.get("minimum"), schema.get("maximum")
    if lo is not None:
        if schema.get("exclusiveMinimum") and value <= lo:
            raise _fail(path, schema, f"must be > {lo}, got {value}")
        if value < lo:
            raise _fail(path, schema, f"must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise _fail(path, schema, f"must be <= {hi}, got {value}")


def _describe(schema: dict) -> str:
    kind = schema.get("type", "value")
    if kind == "array" and "items" in schema:
        return f"an array of {_describe(schema['items'])}s"
    return {"integer": "an integer", "object": "an object", "array": "an array"}.get(kind, f"a {kind}")


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


# ----------------------------------------------------------------------------------------------
# the OpenAPI document


_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": "string", "nullable": True},
                "code": {"type": "string", "nullable": True},
            },
        }
    },
}

_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens": {"type": "integer"},
        "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
        "prompt_tokens_details": {
            "type": "object",
            "nullable": True,
            "properties": {"cached_tokens": {"type": "integer"}},
        },
    },
}


def _completion_response(object_name: str, choice: dict) -> dict:
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string", "enum": [object_name]},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": choice},
            "usage": _USAGE,
        },
    }


_FINISH = {"type": "string", "nullable": True}

_CHAT_RESPONSE = _completion_response(
    "chat.completion",
    {
        "type": "object",
        "required": ["index", "message", "finish_reason"],
        "properties": {
            "index": {"type": "integer"},
            "message": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {"role": {"type": "string"}, "content": {"type": "string", "nullable": True}},
            },
            "finish_reason": _FINISH,
        },
    },
)

_COMPLETION_RESPONSE = _completion_response(
    "text_completion",
    {
        "type": "object",
        "required": ["index", "text", "finish_reason"],
        "properties": {"index": {"type": "integer"}, "text": {"type": "string"}, "finish_reason": _FINISH},
    },
)

_EMBEDDING_RESPONSE = {
    "type": "object",
    "required": ["object", "data", "model", "usage"],
    "properties": {
        "object": {"type": "string", "enum": ["list"]},
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["object", "index", "embedding"],
                "properties": {
                    "object": {"type": "string", "enum": ["embedding"]},
                    "index": {"type": "integer"},
                    "embedding": {"anyOf": [{"type": "array", "items": {"type": "number"}}, {"type": "string"}]},
                },
            },
        },
        "model": {"type": "string"},
        "usage": _USAGE,
    },
}

_MODELS_RESPONSE = {
    "type": "object",
    "required": ["object", "data"],
    "properties": {
        "object": {"type": "string", "enum": ["list"]},
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["id", "object", "created", "owned_by"],
                "properties": {
                    "id": {"type": "string"},
                    "object": {"type": "string", "enum": ["model"]},
                    "created": {"type": "integer"},
                    "owned_by": {"type": "string"},
                },
            },
        },
    },
}


def _strip_private(schema: Any) -> Any:
    """The published copy without carpool's own ``x-`` keys' internals (they stay as hints)."""
    if isinstance(schema, dict):
        out = {k: _strip_private(v) for k, v in schema.items()}
        if _UNSUPPORTED in out:
            out[_UNSUPPORTED] = True
            out.setdefault("description", "not supported by carpool: only the neutral value is accepted")
        return out
    if isinstance(schema, list):
        return [_strip_private(v) for v in schema]
    return schema


def _json(schema: dict) -> dict:
    return {"application/json": {"schema": schema}}


def _errors(*statuses: int) -> dict:
    text = {
        400: "invalid request",
        401: "missing or wrong API key",
        404: "unknown model",
        429: "queue full; retry after the Retry-After header",
        503: "overloaded or waited past the queue timeout",
    }
    return {str(s): {"description": text[s], "content": _json(_ERROR)} for s in statuses}


def openapi_document(
    *, chat: dict, completion: dict, embedding: dict | None, version: str, auth: bool
) -> dict:
    """An OpenAPI 3.0 document of the endpoints, built from the live request schemas."""
    gen_errors = _errors(400, 401, 404, 429, 503) if auth else _errors(400, 404, 429, 503)
    sse = {"text/event-stream": {"schema": {"type": "string"}}}
    paths: dict[str, dict] = {
        "/v1/chat/completions": {
            "post": {
                "operationId": "createChatCompletion",
                "requestBody": {"required": True, "content": _json(_strip_private(chat))},
                "responses": {
                    "200": {"description": "a chat completion, or SSE chunks when stream is true",
                            "content": {**_json(_CHAT_RESPONSE), **sse}},
                    **gen_errors,
                },
            }
        },
        "/v1/completions": {
            "post": {
                "operationId": "createCompletion",
                "requestBody": {"required": True, "content": _json(_strip_private(completion))},
                "responses": {
                    "200": {"description": "a completion, or SSE chunks when stream is true",
                            "content": {**_json(_COMPLETION_RESPONSE), **sse}},
                    **gen_errors,
                },
            }
        },
        "/v1/models": {
            "get": {
                "operationId": "listModels",
                "responses": {"200": {"description": "served models", "content": _json(_MODELS_RESPONSE)},
                              **(_errors(401) if auth else {})},
            }
        },
        "/v1/models/{model}": {
            "get": {
                "operationId": "retrieveModel",
                "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": {"description": "one served model",
                                      "content": _json(_MODELS_RESPONSE["properties"]["data"]["items"])},
                              "404": {"description": "unknown model", "content": _json(_ERROR)},
                              **(_errors(401) if auth else {})},
            }
        },
        "/health": {"get": {"operationId": "health", "responses": {"200": {"description": "serving"},
                                                                   "503": {"description": "not ready"}}}},
    }
    if embedding is not None:
        paths["/v1/embeddings"] = {
            "post": {
                "operationId": "createEmbedding",
                "requestBody": {"required": True, "content": _json(_strip_private(embedding))},
                "responses": {
                    "200": {"description": "embeddings", "content": _json(_EMBEDDING_RESPONSE)},
                    **gen_errors,
                },
            }
        }
    doc: dict = {
        "openapi": "3.0.3",
        "info": {"title": "carpool OpenAI-compatible server", "version": version},
        "paths": paths,
    }
    if auth:
        doc["components"] = {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}
        doc["security"] = [{"bearer": []}]
        paths["/health"]["get"]["security"] = []
    return doc
