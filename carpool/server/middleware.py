"""Middlewares: every failure becomes an OpenAI error body; a body past the limit is refused
before it is read.  The bearer-key check is ``owners.auth_middleware``."""

from __future__ import annotations

import logging

from aiohttp import web

from carpool.errors import OpenAIError
from carpool.server.http import error_response

log = logging.getLogger("carpool.server")


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except OpenAIError as e:
        resp = error_response(e)
        if e.status == 408:  # the rest of the body may still come: do not read it
            resp.force_close()
        return resp
    except web.HTTPException as e:
        if e.status < 400:
            raise
        # aiohttp's own 404/405/413 in OpenAI's shape
        message = {404: f"no route {request.method} {request.path}",
                   405: f"method {request.method} not allowed on {request.path}",
                   413: "request body too large"}.get(e.status, e.reason)
        headers = None
        if isinstance(e, web.HTTPMethodNotAllowed):  # RFC 9110: a 405 says which methods are allowed
            headers = {"Allow": ", ".join(sorted(e.allowed_methods))}
        return error_response(OpenAIError(e.status, message, code=str(e.status), headers=headers))
    except Exception:  # the server keeps serving whatever one handler did
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(OpenAIError(500, "internal server error; see the server log", type="server_error"))


def body_limit_middleware(limit: int, by_path: dict[str, int] | None = None):
    """A Content-Length past ``limit`` is refused before a byte of the body is read (aiohttp
    would read up to the limit first) and the connection closed (the body stays unread).
    ``by_path``: another limit for the POSTs to these paths (file uploads)."""
    by_path = by_path or {}

    @web.middleware
    async def check(request: web.Request, handler):
        most = by_path.get(request.path, limit) if request.method == "POST" else limit
        if request.content_length is not None and request.content_length > most:
            resp = error_response(OpenAIError(
                413, f"request body too large: Content-Length {request.content_length:,} is past the limit of "
                f"{most:,} bytes", code="request_too_large"))
            resp.force_close()
            return resp
        return await handler(request)

    return check
