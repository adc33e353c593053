"""The OpenAPI 3.0 document of carpool's server (``GET /openapi.json``).

Built from the live request schemas (``schema.py``), so what it publishes is what the
server validates with; the response schemas below describe the bodies ``responses.py``
builds.  carpool's own ``x-carpool-unsupported`` marks stay in the published copy as a
plain flag with a description.
"""

from __future__ import annotations

from typing import Any

from carpool.openai.openapi_batches import batch_paths
from carpool.openai.validation import UNSUPPORTED

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

_MODEL = {
    "type": "object",
    "required": ["id", "object", "created", "owned_by"],
    "properties": {
        "id": {"type": "string"},
        "object": {"type": "string", "enum": ["model"]},
        "created": {"type": "integer"},
        "owned_by": {"type": "string"},
    },
}

_MODELS_RESPONSE = {
    "type": "object",
    "required": ["object", "data"],
    "properties": {"object": {"type": "string", "enum": ["list"]}, "data": {"type": "array", "items": _MODEL}},
}


def _strip_private(schema: Any) -> Any:
    """The published copy without carpool's own ``x-`` keys' internals (they stay as hints)."""
    if isinstance(schema, dict):
        out = {k: _strip_private(v) for k, v in schema.items()}
        if UNSUPPORTED in out:
            out[UNSUPPORTED] = True
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


def _post(operation: str, request: dict, what: str, response: dict, errors: dict, streams: bool) -> dict:
    content = _json(response)
    if streams:
        content["text/event-stream"] = {"schema": {"type": "string"}}
        what += ", or SSE chunks when stream is true"
    return {"post": {"operationId": operation,
                     "requestBody": {"required": True, "content": _json(_strip_private(request))},
                     "responses": {"200": {"description": what, "content": content}, **errors}}}


def openapi_document(
    *, chat: dict, completion: dict, embedding: dict | None, version: str, auth: bool,
    batch_endpoints: list[str] | None = None, file_purposes: list[str] | None = None,
) -> dict:
    """An OpenAPI 3.0 document of the endpoints, built from the live request schemas.  With
    ``batch_endpoints`` (what a batch may run) it lists the Files and Batches API too."""
    gen_errors = _errors(400, 401, 404, 429, 503) if auth else _errors(400, 404, 429, 503)
    auth_errors = _errors(401) if auth else {}
    paths: dict[str, dict] = {
        "/v1/chat/completions": _post("createChatCompletion", chat, "a chat completion", _CHAT_RESPONSE,
                                      gen_errors, streams=True),
        "/v1/completions": _post("createCompletion", completion, "a completion", _COMPLETION_RESPONSE,
                                 gen_errors, streams=True),
        "/v1/models": {
            "get": {
                "operationId": "listModels",
                "responses": {"200": {"description": "served models", "content": _json(_MODELS_RESPONSE)},
                              **auth_errors},
            }
        },
        "/v1/models/{model}": {
            "get": {
                "operationId": "retrieveModel",
                "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": {"description": "one served model", "content": _json(_MODEL)},
                              "404": {"description": "unknown model", "content": _json(_ERROR)},
                              **auth_errors},
            }
        },
        "/health": {"get": {"operationId": "health", "responses": {"200": {"description": "serving"},
                                                                   "503": {"description": "not ready"}}}},
        "/metrics": {"get": {"operationId": "metrics", "responses": {
            "200": {"description": "Prometheus text exposition",
                    "content": {"text/plain": {"schema": {"type": "string"}}}},
            **auth_errors}}},
        "/openapi.json": {"get": {"operationId": "openapi", "responses": {
            "200": {"description": "this document", "content": _json({"type": "object"})}, **auth_errors}}},
    }
    if embedding is not None:
        paths["/v1/embeddings"] = _post("createEmbedding", embedding, "embeddings", _EMBEDDING_RESPONSE,
                                        gen_errors, streams=False)
    if batch_endpoints is not None:
        paths.update(batch_paths(batch_endpoints, file_purposes or ["batch"], _ERROR, auth))
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
