"""The aiohttp application: routes, auth and error middleware, engine lifecycle."""

from __future__ import annotations

import hmac
import json
import logging
import time
from typing import Any

from aiohttp import web

from carpool import __version__
from carpool.engine.protocol import EngineClient
from carpool.server import openai_schema as schema
from carpool.server.admission import AdmissionController
from carpool.server.config import ServerConfig
from carpool.server.errors import ApiError
from carpool.server.jsonutil import dumps
from carpool.server.metrics import CONTENT_TYPE, ServerMetrics

log = logging.getLogger("carpool.server")

STATE: web.AppKey[ServerState] = web.AppKey("carpool_state")


class ServerState:
    """Everything the handlers share; one per app, so several servers can live in one process."""

    def __init__(self, config: ServerConfig, engine: EngineClient | None, batcher: Any | None) -> None:
        self.config = config
        self.engine: EngineClient | None = engine
        self.batcher = batcher  # DynamicBatcher (async embed) or None
        self.embedder: Any | None = None
        self.owns_engine = engine is None
        self.owns_batcher = batcher is None
        self.model_names = config.model_names()
        self.created = int(time.time())
        self.admission = AdmissionController(config.max_queue_size, config.max_queued_tokens)
        self.metrics = ServerMetrics(self.model_names[0], self._engine_stats)
        self.ready = False
        self.chat_schema: dict = {}
        self.completion_schema: dict = {}
        self.embedding_schema: dict | None = None
        self.embedding_names: list[str] = []
        self.embedding_dim = 0

    def _engine_stats(self) -> dict:
        return self.engine.stats() if self.engine is not None else {}

    @property
    def max_model_len(self) -> int:
        assert self.engine is not None
        return int(self.engine.max_model_len)

    def build_schemas(self) -> None:
        n_max, ctx = self.config.max_n, self.max_model_len
        self.chat_schema = schema.chat_request_schema(self.model_names, ctx, n_max)
        self.completion_schema = schema.completion_request_schema(self.model_names, ctx, n_max)
        if self.batcher is not None:
            self.embedding_schema = schema.embedding_request_schema(self.embedding_names, self.embedding_dim)

    def resolve_model(self, body: dict, kind: str) -> str:
        """The served name a request asked for (default: the first), or a 404 naming the choices."""
        name = body.get("model")
        names = self.embedding_names if kind == "embedding" else self.model_names
        if name is None:
            if not names:
                raise ApiError(404, "no embedding model is served (start with --embedding-model)",
                               param="model", code="model_not_found")
            return names[0]
        if not isinstance(name, str):
            raise ApiError(400, f"'model' must be a string, got {type(name).__name__}", param="model")
        if name in names:
            return name
        other = self.model_names if kind == "embedding" else self.embedding_names
        hint = ""
        if name in other:
            hint = " (it is an embedding model: use /v1/embeddings)" if kind != "embedding" else (
                " (it is a generation model: use /v1/chat/completions or /v1/completions)")
        available = ", ".join(names) or "none"
        raise ApiError(404, f"The model '{name}' does not exist here{hint}; available: {available}",
                       param="model", code="model_not_found")


async def read_json(request: web.Request) -> dict:
    raw = await request.read()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:  # json's decoder recurses per nesting level
        raise ApiError(400, "request body is not valid JSON: nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(body).__name__}")
    return body


def json_response(obj: object, status: int = 200) -> web.Response:
    return web.Response(body=dumps(obj), status=status, content_type="application/json")


# ----------------------------------------------------------------------------------------------
# middleware


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as e:
        return e.response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        # aiohttp's own 404/405/413 in OpenAI's shape
        message = {404: f"no route {request.method} {request.path}",
                   405: f"method {request.method} not allowed on {request.path}",
                   413: "request body too large"}.get(e.status, e.reason)
        return ApiError(e.status, message, code=str(e.status)).response()
    except Exception:  # the server keeps serving whatever one handler did
        log.exception("unhandled error in %s %s", request.method, request.path)
        return ApiError(500, "internal server error; see the server log", type="server_error").response()


def auth_middleware(api_key: str):
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check(request: web.Request, handler):
        if request.path != "/health":
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                what = "provided" if given else "missing; send 'Authorization: Bearer <key>'"
                raise ApiError(401, f"Incorrect API key {what}.", code="invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return check


# ----------------------------------------------------------------------------------------------
# small endpoints


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if not state.ready:
        raise ApiError(503, "starting", type="server_error")
    failure = getattr(state.engine, "error", None)
    if failure is not None:
        raise ApiError(503, f"the engine has failed: {failure!r}", type="server_error", code="engine_failed")
    return json_response({"status": "ok"})


def _model_cards(state: ServerState) -> list[dict]:
    cards = [
        {"id": name, "object": "model", "created": state.created, "owned_by": "carpool",
         "root": state.config.engine.model, "max_model_len": state.max_model_len}
        for name in state.model_names
    ]
    cards += [
        {"id": name, "object": "model", "created": state.created, "owned_by": "carpool", "root": name}
        for name in state.embedding_names
    ]
    return cards


async def models(request: web.Request) -> web.Response:
    return json_response({"object": "list", "data": _model_cards(request.app[STATE])})


async def model(request: web.Request) -> web.Response:
    name = request.match_info["model"]
    for card in _model_cards(request.app[STATE]):
        if card["id"] == name:
            return json_response(card)
    raise ApiError(404, f"The model '{name}' does not exist here", param="model", code="model_not_found")


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.Response(body=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


async def openapi(request: web.Request) -> web.Response:
    state = request.app[STATE]
    doc = schema.openapi_document(
        chat=state.chat_schema,
        completion=state.completion_schema,
        embedding=state.embedding_schema,
        version=__version__,
        auth=state.config.api_key is not None,
    )
    return json_response(doc)


# ----------------------------------------------------------------------------------------------
# lifecycle


async def _start(app: web.Application) -> None:
    state = app[STATE]
    cfg = state.config
    if state.engine is None:
        from carpool.engine import AsyncEngine

        engine = AsyncEngine(cfg.engine)
        await engine.start()
        state.engine = engine
    listener = getattr(state.engine, "add_step_listener", None)
    if listener is not None:
        listener(state.metrics.on_engine_step)
    from carpool.server.embeddings import attach_batch_metrics, make_batcher

    if state.batcher is None and cfg.embedding_model:
        state.batcher, state.embedder = await make_batcher(cfg, state.metrics)
    elif state.batcher is not None:
        attach_batch_metrics(state.batcher, state.metrics)
    if state.batcher is not None:
        embedder = state.embedder or getattr(state.batcher, "embedder", None)
        name = getattr(embedder, "name", None) or cfg.embedding_model or "embedding"
        state.embedding_names = list(dict.fromkeys([name, cfg.embedding_model or name]))
        state.embedding_dim = int(getattr(embedder, "dim", 0) or 0)
    state.build_schemas()
    state.ready = True


async def _stop(app: web.Application) -> None:
    state = app[STATE]
    state.ready = False
    if state.owns_batcher and state.batcher is not None:
        close = getattr(state.batcher, "close", None) or getattr(state.batcher, "shutdown", None)
        if close is not None:
            result = close()
            if hasattr(result, "__await__"):
                await result
    if state.owns_engine and state.engine is not None:
        await state.engine.shutdown()  # type: ignore[attr-defined]


def build_app(config: ServerConfig, engine: EngineClient | None = None, batcher: Any | None = None) -> web.Application:
    """The server as an aiohttp app.  Without ``engine``, an AsyncEngine is built from
    ``config.engine`` at startup and shut down with the app (likewise the embedding batcher)."""
    from carpool.server import embeddings, generation

    middlewares = [error_middleware]
    if config.api_key:
        middlewares.append(auth_middleware(config.api_key))
    app = web.Application(middlewares=middlewares, client_max_size=config.client_max_size_mb * 2**20)
    app[STATE] = ServerState(config, engine, batcher)
    app.router.add_post("/v1/chat/completions", generation.chat_completions)
    app.router.add_post("/v1/completions", generation.completions)
    app.router.add_post("/v1/embeddings", embeddings.create_embeddings)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", model)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    app.on_startup.append(_start)
    app.on_cleanup.append(_stop)
    return app
