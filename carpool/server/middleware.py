"""Middlewares: every failure becomes an OpenAI error body; the optional bearer-key check."""

from __future__ import annotations

import hmac
import logging

from aiohttp import web

from carpool.openai.errors import OpenAIError
from carpool.server.http import error_response

log = logging.getLogger("carpool.server")


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except OpenAIError as e:
        return error_response(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        # aiohttp's own 404/405/413 in OpenAI's shape
        message = {404: f"no route {request.method} {request.path}",
                   405: f"method {request.method} not allowed on {request.path}",
                   413: "request body too large"}.get(e.status, e.reason)
        return error_response(OpenAIError(e.status, message, code=str(e.status)))
    except Exception:  # the server keeps serving whatever one handler did
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(OpenAIError(500, "internal server error; see the server log", type="server_error"))


def auth_middleware(api_key: str):
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check(request: web.Request, handler):
        if request.path != "/health":
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                what = "provided" if given else "missing; send 'Authorization: Bearer <key>'"
                raise OpenAIError(401, f"Incorrect API key {what}.", code="invalid_api_key",
                                  headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return check
