"""HTTP helpers every handler uses: read a JSON body, answer JSON, answer an OpenAIError."""

from __future__ import annotations

import json

from aiohttp import web

from carpool.openai.errors import OpenAIError

_encoder = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def dumps(obj: object) -> bytes:
    """Compact UTF-8 JSON, for responses and SSE chunks alike."""
    return _encoder.encode(obj).encode("utf-8")


def json_response(obj: object, status: int = 200) -> web.Response:
    return web.Response(body=dumps(obj), status=status, content_type="application/json")


def error_response(e: OpenAIError) -> web.Response:
    return web.Response(status=e.status, body=dumps(e.body()), content_type="application/json", headers=e.headers)


async def read_json(request: web.Request) -> dict:
    """The request body as a JSON object, or a 400 saying what is wrong with it."""
    raw = await request.read()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:  # json's decoder recurses per nesting level
        raise OpenAIError(400, "request body is not valid JSON: nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, f"request body must be a JSON object, got {type(body).__name__}")
    return body
