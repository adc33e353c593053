"""The Files and Batches part of the OpenAPI document: paths, operationIds as OpenAI names them,
and the objects the server answers with (a file, a batch, their list pages).

Kept apart from ``openapi.py`` because it is a block of its own: its schemas describe what
``carpool.server.batches`` returns, not the OpenAI request schemas the generation routes
validate with.  Fields the server may leave empty are ``nullable`` (OpenAPI 3.0's way),
so a batch still validating, with no output file yet, matches as much as a finished one.
"""

from __future__ import annotations

BATCH_STATUSES = ("validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                  "cancelled")

_INT = {"type": "integer"}
_STRING = {"type": "string"}
_MAYBE_INT = {"type": "integer", "nullable": True}
_MAYBE_STRING = {"type": "string", "nullable": True}

_FILE = {
    "type": "object",
    "required": ["id", "object", "bytes", "created_at", "filename", "purpose"],
    "properties": {
        "id": _STRING,
        "object": {"type": "string", "enum": ["file"]},
        "bytes": _INT,
        "created_at": _INT,
        "filename": _STRING,
        "purpose": _STRING,
        "status": _STRING,
        "expires_at": _MAYBE_INT,
        "status_details": _MAYBE_STRING,
    },
}

_FILE_DELETED = {
    "type": "object",
    "required": ["id", "object", "deleted"],
    "properties": {"id": _STRING, "object": {"type": "string", "enum": ["file"]}, "deleted": {"type": "boolean"}},
}

_METADATA = {
    "type": "object",
    "nullable": True,
    "maxProperties": 16,
    "additionalProperties": {"type": "string", "maxLength": 512},
    "description": "at most 16 string values, keys up to 64 characters",
}

_BATCH_ERROR = {
    "type": "object",
    "required": ["code", "message"],
    "properties": {"code": _STRING, "message": _STRING, "param": _MAYBE_STRING, "line": _MAYBE_INT},
}

_USAGE = {
    "type": "object",
    "nullable": True,
    "required": ["input_tokens", "output_tokens", "total_tokens"],
    "properties": {
        "input_tokens": _INT,
        "input_tokens_details": {"type": "object", "properties": {"cached_tokens": _INT}},
        "output_tokens": _INT,
        "output_tokens_details": {"type": "object", "properties": {"reasoning_tokens": _INT}},
        "total_tokens": _INT,
    },
}

_STAMPS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
           "cancelled_at")


def _batch(endpoints: list[str]) -> dict:
    return {
        "type": "object",
        "required": ["id", "object", "endpoint", "input_file_id", "completion_window", "status", "created_at",
                     "request_counts"],
        "properties": {
            "id": _STRING,
            "object": {"type": "string", "enum": ["batch"]},
            "endpoint": {"type": "string", "enum": endpoints},
            "errors": {"type": "object", "nullable": True, "properties": {
                "object": {"type": "string", "enum": ["list"]}, "data": {"type": "array", "items": _BATCH_ERROR}}},
            "input_file_id": _STRING,
            "completion_window": {"type": "string", "enum": ["24h"]},
            "status": {"type": "string", "enum": list(BATCH_STATUSES)},
            "output_file_id": _MAYBE_STRING,
            "error_file_id": _MAYBE_STRING,
            "created_at": _INT,
            "expires_at": _MAYBE_INT,
            **{stamp: _MAYBE_INT for stamp in _STAMPS},
            "request_counts": {"type": "object", "required": ["total", "completed", "failed"],
                               "properties": {"total": _INT, "completed": _INT, "failed": _INT}},
            "metadata": _METADATA,
            "model": _MAYBE_STRING,
            "usage": _USAGE,
        },
    }


def _page(item: dict) -> dict:
    """A cursor page: ``after`` = the ``last_id`` of the page before."""
    return {
        "type": "object",
        "required": ["object", "data", "has_more"],
        "properties": {"object": {"type": "string", "enum": ["list"]}, "data": {"type": "array", "items": item},
                       "first_id": _MAYBE_STRING, "last_id": _MAYBE_STRING, "has_more": {"type": "boolean"}},
    }


def _create_batch_request(endpoints: list[str]) -> dict:
    return {
        "type": "object",
        "required": ["input_file_id", "endpoint", "completion_window"],
        "properties": {
            "input_file_id": {"type": "string", "description": "a file uploaded with purpose 'batch'"},
            "endpoint": {"type": "string", "enum": endpoints},
            "completion_window": {"type": "string", "enum": ["24h"]},
            "metadata": _METADATA,
        },
    }


def _upload_request(purposes: list[str]) -> dict:
    return {"multipart/form-data": {"schema": {
        "type": "object",
        "required": ["file", "purpose"],
        "properties": {"file": {"type": "string", "format": "binary"},
                       "purpose": {"type": "string", "enum": purposes}},
    }}}


def _path_param(name: str) -> list[dict]:
    return [{"name": name, "in": "path", "required": True, "schema": _STRING}]


def _query(name: str, schema: dict, description: str) -> dict:
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": description}


_LIMIT_TEXT = "how many per page"
_AFTER = _query("after", _STRING, "the last id of the page before (cursor)")


def batch_paths(endpoints: list[str], purposes: list[str], error: dict, auth: bool) -> dict[str, dict]:
    """The Files and Batches paths; ``error`` is the schema of every error body."""

    def ok(what: str, schema: dict) -> dict:
        return {"description": what, "content": {"application/json": {"schema": schema}}}

    def answers(what: str, schema: dict, errors: dict[int, str]) -> dict:
        if auth:
            errors = {**errors, 401: "missing or wrong API key"}
        errors = {**errors, 503: "the server is still starting"}
        return {"200": ok(what, schema),
                **{str(s): {"description": text, "content": {"application/json": {"schema": error}}}
                   for s, text in sorted(errors.items())}}

    batch = _batch(endpoints)
    no_file = {404: "no such file"}
    no_batch = {404: "no such batch"}
    return {
        "/v1/files": {
            "post": {"operationId": "createFile", "requestBody": {"required": True,
                                                                  "content": _upload_request(purposes)},
                     "responses": answers("the file, stored", _FILE,
                                          {400: "no file, or an unknown purpose", 413: "past the size limit"})},
            "get": {"operationId": "listFiles",
                    "parameters": [_query("purpose", _STRING, "only files of this purpose"),
                                   _query("limit", {"type": "integer", "minimum": 1, "maximum": 10000},
                                          _LIMIT_TEXT),
                                   _query("order", {"type": "string", "enum": ["asc", "desc"]},
                                          "by creation time (default desc)"), _AFTER],
                    "responses": answers("a page of files", _page(_FILE), {400: "a bad query parameter"})},
        },
        "/v1/files/{file_id}": {
            "get": {"operationId": "retrieveFile", "parameters": _path_param("file_id"),
                    "responses": answers("the file", _FILE, no_file)},
            "delete": {"operationId": "deleteFile", "parameters": _path_param("file_id"),
                       "responses": answers("the file is gone", _FILE_DELETED, no_file)},
        },
        "/v1/files/{file_id}/content": {
            "get": {"operationId": "downloadFile", "parameters": _path_param("file_id"),
                    "responses": {**answers("", _STRING, no_file),
                                  "200": {"description": "the file's bytes (a batch file: JSONL)", "content": {
                                      "application/octet-stream": {"schema": {"type": "string",
                                                                              "format": "binary"}}}}}},
        },
        "/v1/batches": {
            "post": {"operationId": "createBatch",
                     "requestBody": {"required": True, "content": {"application/json": {
                         "schema": _create_batch_request(endpoints)}}},
                     "responses": answers("the batch, validating", batch,
                                          {400: "a bad parameter, or an input file not of purpose batch",
                                           404: "no such input file"})},
            "get": {"operationId": "listBatches",
                    "parameters": [_query("limit", {"type": "integer", "minimum": 1, "maximum": 100},
                                          _LIMIT_TEXT + " (default 20)"), _AFTER],
                    "responses": answers("a page of batches, newest first", _page(batch),
                                         {400: "a bad query parameter"})},
        },
        "/v1/batches/{batch_id}": {
            "get": {"operationId": "retrieveBatch", "parameters": _path_param("batch_id"),
                    "responses": answers("the batch", batch, no_batch)},
        },
        "/v1/batches/{batch_id}/cancel": {
            "post": {"operationId": "cancelBatch", "parameters": _path_param("batch_id"),
                     "responses": answers("the batch, cancelling (its answers so far are kept)", batch,
                                          {**no_batch, 409: "the batch has ended already"})},
        },
    }
