"""What the handlers of one app share, and its lifecycle: the engine, the embedding batcher,
the translator, admission control and metrics.

One ``ServerState`` per app (under the ``STATE`` key), so several servers can live in one
process.  ``start`` builds whatever was not passed in (an ``AsyncEngine`` from the config,
the embedding batcher) and ``stop`` shuts down only what it built.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from aiohttp import web

from carpool import __version__
from carpool.embed.dynamic_batcher import DynamicBatcher
from carpool.engine.protocol import EngineClient
from carpool.errors import OpenAIError
from carpool.openai.openapi import openapi_document
from carpool.openai.requests import Translator
from carpool.openai.schema import embedding_request_schema
from carpool.server.admission import AdmissionController
from carpool.server.batch_input import ENDPOINTS as BATCH_ENDPOINTS
from carpool.server.batch_store import FILE_PURPOSES
from carpool.server.config import ServerConfig
from carpool.server.grammar_gate import GrammarGate
from carpool.server.metrics import ServerMetrics


class ServerState:
    def __init__(self, config: ServerConfig, engine: EngineClient | None, batcher: DynamicBatcher | None) -> None:
        self.config = config
        self._engine = engine
        self.batcher = batcher
        self.owns_engine = engine is None
        self.owns_batcher = batcher is None
        self.model_names = config.model_names()
        self.created = int(time.time())
        self.admission = AdmissionController(config.max_queue_size, config.max_queued_tokens)
        self.metrics = ServerMetrics(self.model_names[0], self._engine_stats)
        self.grammars = GrammarGate(config.grammar_workers, config.grammar_timeout_s, config.max_grammar_bytes,
                                    config.grammar_max_waiting)
        self.ready = False
        self._translator: Translator | None = None
        self.embedding_schema: dict | None = None
        self.embedding_names: list[str] = []

    @property
    def engine(self) -> EngineClient:
        if self._engine is None:
            raise OpenAIError(503, "starting", type="server_error")
        return self._engine

    @property
    def translator(self) -> Translator:
        if self._translator is None:
            raise OpenAIError(503, "starting", type="server_error")
        return self._translator

    def _engine_stats(self) -> dict:
        return self._engine.stats() if self._engine is not None else {}

    # -- lifecycle

    async def start(self) -> None:
        cfg = self.config
        if self._engine is None:
            from carpool.engine.async_engine import AsyncEngine
            from carpool.engine.config import SERVER_MAX_NUM_BATCHED_TOKENS, SERVER_MAX_NUM_SEQS

            engine_cfg = cfg.engine
            if engine_cfg.max_num_batched_tokens is None:  # short steps bound TTFT: not the offline budget
                engine_cfg = dataclasses.replace(engine_cfg, max_num_batched_tokens=SERVER_MAX_NUM_BATCHED_TOKENS)
            if engine_cfg.max_num_seqs is None:  # and the time between two tokens: not the offline batch
                engine_cfg = dataclasses.replace(engine_cfg, max_num_seqs=SERVER_MAX_NUM_SEQS)
            self._engine = await AsyncEngine(engine_cfg).start()
        self._engine.add_step_listener(self.metrics.on_engine_step)
        if self.batcher is None and cfg.embedding_model:
            self.batcher = await self._make_batcher(cfg.embedding_model)
        if self.batcher is not None:
            self.batcher.add_batch_listener(self.metrics.on_embedding_batch)
            name = self.batcher.model_name or cfg.embedding_model or "embedding"
            self.embedding_names = list(dict.fromkeys([name, cfg.embedding_model or name]))
            self.embedding_schema = embedding_request_schema(self.embedding_names, self.batcher.dim)
        self._translator = Translator(self._engine, self.model_names, cfg.max_n, cfg.max_choices_per_request)
        self.ready = True

    async def _make_batcher(self, model: str) -> DynamicBatcher:
        """Load the embedding model (off the loop) and put the dynamic batcher in front of it."""
        from carpool.embed.embedder import Embedder

        cfg = self.config
        embedder = await asyncio.get_running_loop().run_in_executor(None, lambda: Embedder(model=model))
        queue = cfg.embedding_max_queue_size if cfg.embedding_max_queue_size is not None else cfg.max_queue_size
        sizes = list(cfg.preferred_batch_sizes)
        return DynamicBatcher(
            embedder,
            max_queue_delay_us=cfg.max_queue_delay_us,
            preferred_batch_sizes=sizes,
            max_batch_size=max([64, *sizes]),
            max_batch_tokens=cfg.max_batch_tokens,
            max_queue_size=queue or 1024,
            queue_timeout_s=cfg.embedding_queue_timeout_ms / 1000.0 if cfg.embedding_queue_timeout_ms else None,
        )

    async def stop(self) -> None:
        self.ready = False
        self.grammars.close()
        if self.owns_batcher and self.batcher is not None:
            await self.batcher.close()
        if self.owns_engine and self._engine is not None:
            await self._engine.shutdown()

    # -- what requests ask

    def resolve_model(self, body: dict, kind: str) -> str:
        """The served name a request asked for (default: the first), or a 404 naming the choices."""
        name = body.get("model")
        names = self.embedding_names if kind == "embedding" else self.model_names
        if name is None:
            if not names:
                raise OpenAIError(404, "no embedding model is served (start with --embedding-model)",
                                  param="model", code="model_not_found")
            return names[0]
        if not isinstance(name, str):
            raise OpenAIError(400, f"'model' must be a string, got {type(name).__name__}", param="model")
        if name in names:
            return name
        other = self.model_names if kind == "embedding" else self.embedding_names
        hint = ""
        if name in other:
            hint = " (it is an embedding model: use /v1/embeddings)" if kind != "embedding" else (
                " (it is a generation model: use /v1/chat/completions or /v1/completions)")
        available = ", ".join(names) or "none"
        raise OpenAIError(404, f"The model '{name}' does not exist here{hint}; available: {available}",
                          param="model", code="model_not_found")

    def model_cards(self) -> list[dict]:
        cards = [
            {"id": name, "object": "model", "created": self.created, "owned_by": "carpool",
             "root": self.config.engine.model, "max_model_len": self.translator.max_model_len}
            for name in self.model_names
        ]
        cards += [
            {"id": name, "object": "model", "created": self.created, "owned_by": "carpool", "root": name}
            for name in self.embedding_names
        ]
        return cards

    def openapi(self) -> dict:
        return openapi_document(
            chat=self.translator.schemas["chat"],
            completion=self.translator.schemas["completion"],
            embedding=self.embedding_schema,
            version=__version__,
            auth=bool(self.config.keys()),
            batch_endpoints=list(BATCH_ENDPOINTS),
            file_purposes=list(FILE_PURPOSES),
        )


STATE: web.AppKey[ServerState] = web.AppKey("carpool_state", ServerState)
