"""Server-sent events the way OpenAI streams them: ``data: {json}\\n\\n`` ... ``data: [DONE]\\n\\n``."""

from __future__ import annotations

from aiohttp import web

from carpool.server.http import dumps

DONE = b"data: [DONE]\n\n"


async def open_stream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(
        status=200,
        headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # proxies must not hold chunks back
        },
    )
    await resp.prepare(request)
    return resp


def event(obj: object) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


async def send(resp: web.StreamResponse, obj: object) -> None:
    await resp.write(event(obj))


async def done(resp: web.StreamResponse) -> None:
    await resp.write(DONE)
    await resp.write_eof()
