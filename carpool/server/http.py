"""HTTP helpers every handler uses: read a JSON body, answer JSON, answer an OpenAIError."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from carpool.compat import timeout
from carpool.errors import OpenAIError
from carpool.openai.surrogates import SURROGATE_ESCAPE, lone_surrogate_path, surrogate_error

# Work on a body larger than this (parsing, templating, tokenizing) runs on a worker thread,
# so one big request never stalls the event loop (/health, every other stream); a small
# body takes well under a millisecond, less than the hop to a thread.
OFF_LOOP_BYTES = 16 * 1024

# Seconds a request body may take to arrive (ServerConfig.body_timeout_s, set by build_app).
BODY_TIMEOUT = web.AppKey("body_timeout_s", float)

_encoder = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def dumps(obj: object) -> bytes:
    """Compact UTF-8 JSON, for responses and SSE chunks alike.  A lone surrogate that got this
    far (it has no UTF-8 form) is written as its JSON escape, so the answer is still sent."""
    return _encoder.encode(obj).encode("utf-8", "backslashreplace")


def json_response(obj: object, status: int = 200) -> web.Response:
    return web.Response(body=dumps(obj), status=status, content_type="application/json")


def error_response(e: OpenAIError) -> web.Response:
    return web.Response(status=e.status, body=dumps(e.body()), content_type="application/json", headers=e.headers)


async def read_json(request: web.Request) -> dict:
    """The request body as a JSON object, or a 400 saying what is wrong with it."""
    try:
        async with timeout(request.app[BODY_TIMEOUT]):
            raw = await request.read()
    except (TimeoutError, asyncio.TimeoutError):
        raise OpenAIError(408, f"the request body did not arrive within {request.app[BODY_TIMEOUT]:g} s",
                          code="body_timeout") from None
    try:
        body = await asyncio.to_thread(_loads, raw) if len(raw) > OFF_LOOP_BYTES else _loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:  # json's decoder recurses per nesting level
        raise OpenAIError(400, "request body is not valid JSON: nested too deeply", code="invalid_json") from None
    except ValueError as e:  # an integer literal past Python's 4300-digit conversion limit
        raise OpenAIError(400, f"request body is not usable JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, f"request body must be a JSON object, got {type(body).__name__}")
    if SURROGATE_ESCAPE.search(raw):
        where = lone_surrogate_path(body)
        if where is not None:
            raise surrogate_error(where)
    return body


def _loads(raw: bytes) -> object:
    return json.loads(raw)
