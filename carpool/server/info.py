"""The small GET endpoints: /health, /v1/models, /v1/models/{model}, /metrics, /openapi.json."""

from __future__ import annotations

from aiohttp import web

from carpool.errors import OpenAIError
from carpool.server.http import json_response
from carpool.server.metrics import CONTENT_TYPE
from carpool.server.state import STATE


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if not state.ready:
        raise OpenAIError(503, "starting", type="server_error")
    failure = state.engine.error
    if failure is not None:
        raise OpenAIError(503, f"the engine has failed: {failure!r}", type="server_error", code="engine_failed")
    return json_response({"status": "ok"})


async def models(request: web.Request) -> web.Response:
    return json_response({"object": "list", "data": request.app[STATE].model_cards()})


async def model(request: web.Request) -> web.Response:
    name = request.match_info["model"]
    for card in request.app[STATE].model_cards():
        if card["id"] == name:
            return json_response(card)
    raise OpenAIError(404, f"The model '{name}' does not exist here", param="model", code="model_not_found")


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[STATE].metrics.render(), headers={"Content-Type": CONTENT_TYPE})


async def openapi(request: web.Request) -> web.Response:
    return json_response(request.app[STATE].openapi())
