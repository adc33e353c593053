"""The aiohttp application: middlewares, routes and the lifecycle hooks, wired together.

Everything the handlers share is in ``state.py``; the handlers are in ``generation.py``
(chat and text completions), ``embeddings.py`` and ``info.py`` (health, models, metrics,
OpenAPI), ``batches.py`` (the Files and Batches API); the OpenAI translation itself is
``carpool.openai``.
"""

from __future__ import annotations

from aiohttp import web

from carpool.embed.dynamic_batcher import DynamicBatcher
from carpool.engine.protocol import EngineClient
from carpool.server import embeddings, generation, info
from carpool.server.batch_disk import BatchDisk
from carpool.server.batches import add_batch_api
from carpool.server.config import ServerConfig
from carpool.server.http import BODY_TIMEOUT
from carpool.server.middleware import body_limit_middleware, error_middleware
from carpool.server.owners import Keys, auth_middleware
from carpool.server.state import STATE, ServerState


async def _start(app: web.Application) -> None:
    await app[STATE].start()


async def _stop(app: web.Application) -> None:
    await app[STATE].stop()


def build_app(config: ServerConfig, engine: EngineClient | None = None,
              batcher: DynamicBatcher | None = None, batch_disk: BatchDisk | None = None) -> web.Application:
    """The server as an aiohttp app.  Without ``engine``, an AsyncEngine is built from
    ``config.engine`` at startup and shut down with the app (likewise the embedding batcher).
    ``batch_disk``: where the Files and Batches API writes (default: the batch directory as is)."""
    limit = config.client_max_size_mb * 2**20
    # an upload streams to disk: its own limit (plus room for the multipart framing)
    uploads = {"/v1/files": config.max_batch_file_bytes + 2**20}
    middlewares = [error_middleware, body_limit_middleware(limit, uploads)]
    if config.keys():
        middlewares.append(auth_middleware(Keys(config.keys())))
    app = web.Application(middlewares=middlewares, client_max_size=limit)
    app[STATE] = ServerState(config, engine, batcher)
    app[BODY_TIMEOUT] = config.body_timeout_s
    app.router.add_post("/v1/chat/completions", generation.chat_completions)
    app.router.add_post("/v1/completions", generation.completions)
    app.router.add_post("/v1/embeddings", embeddings.create_embeddings)
    app.router.add_get("/v1/models", info.models)
    app.router.add_get("/v1/models/{model:.+}", info.model)
    app.router.add_get("/health", info.health)
    app.router.add_get("/metrics", info.metrics)
    app.router.add_get("/openapi.json", info.openapi)
    app.on_startup.append(_start)
    app.on_cleanup.append(_stop)
    add_batch_api(app, config, batch_disk)  # after _start: its startup needs the engine
    return app
