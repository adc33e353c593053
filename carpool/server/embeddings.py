"""POST /v1/embeddings through the Triton-style dynamic batcher."""

from __future__ import annotations

import asyncio
import base64
import math
from typing import Any

import numpy as np
from aiohttp import web

from carpool.server.app import STATE, json_response, read_json
from carpool.server.config import ServerConfig
from carpool.server.errors import ApiError
from carpool.server.metrics import ServerMetrics
from carpool.server.openai_schema import SchemaError, validate


async def make_batcher(cfg: ServerConfig, metrics: ServerMetrics) -> tuple[Any, Any]:
    """Load the embedding model (off the loop) and put the dynamic batcher in front of it."""
    from carpool.embed.dynamic_batcher import DynamicBatcher
    from carpool.embed.embedder import Embedder

    loop = asyncio.get_running_loop()
    embedder = await loop.run_in_executor(None, lambda: Embedder(model=cfg.embedding_model))
    queue = cfg.embedding_max_queue_size if cfg.embedding_max_queue_size is not None else cfg.max_queue_size
    sizes = list(cfg.preferred_batch_sizes)
    batcher = DynamicBatcher(
        embedder,
        max_queue_delay_us=cfg.max_queue_delay_us,
        preferred_batch_sizes=sizes,
        max_batch_size=max([64, *sizes]),
        max_batch_tokens=cfg.max_batch_tokens,
        max_queue_size=queue or 1024,
        queue_timeout_s=cfg.embedding_queue_timeout_ms / 1000.0 if cfg.embedding_queue_timeout_ms else None,
    )
    attach_batch_metrics(batcher, metrics)
    return batcher, embedder


def attach_batch_metrics(batcher: Any, metrics: ServerMetrics) -> None:
    def on_batch(event: dict) -> None:
        metrics.embedding_batch_size.observe(event["batch_size"])
        for delay in event.get("queue_delays_s", ()):
            metrics.embedding_queue_delay.observe(delay)

    add = getattr(batcher, "add_batch_listener", None)
    if add is not None:
        add(on_batch)


def _encode(vec: np.ndarray, fmt: str) -> list[float] | str:
    if fmt == "base64":  # what the openai SDK asks for by default: little-endian float32 bytes
        return base64.b64encode(np.ascontiguousarray(vec, dtype="<f4").tobytes()).decode("ascii")
    return vec.astype(np.float32).tolist()


async def create_embeddings(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_json(request)
    model = state.resolve_model(body, "embedding")  # 404 when no embedding model is served
    inp = body.get("input")
    if isinstance(inp, list) and inp and all(isinstance(x, (int, list)) for x in inp):
        raise ApiError(400, "'input': token-id input is not supported for embeddings; send strings",
                       param="input")
    try:
        validate(body, state.embedding_schema or {})
    except SchemaError as e:
        raise ApiError(400, e.message, param=e.param) from None
    texts: list[str] = [inp] if isinstance(inp, str) else list(inp)
    try:
        vectors = await state.batcher.embed(texts)
    except Exception as e:  # noqa: BLE001 - queue errors become 429/503, others propagate
        raise _batcher_error(state, e) from None
    tokens = _count_tokens(state.embedder, texts)
    fmt = body.get("encoding_format") or "float"
    data = [{"object": "embedding", "index": i, "embedding": _encode(v, fmt)} for i, v in enumerate(vectors)]
    return json_response({"object": "list", "data": data, "model": model,
                          "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def _count_tokens(embedder: Any, texts: list[str]) -> int:
    batch = getattr(embedder, "count_tokens_batch", None)
    if batch is not None:
        return int(sum(batch(texts)))
    one = getattr(embedder, "count_tokens", None)
    return sum(int(one(t)) for t in texts) if one is not None else 0


def _batcher_error(state, e: Exception) -> Exception:
    name = type(e).__name__
    if name == "QueueFullError":
        state.metrics.rejected("embedding_queue_full")
        retry = max(1, math.ceil(float(getattr(e, "retry_after_s", 1) or 1)))
        return ApiError(429, f"{e}", code="queue_full", headers={"Retry-After": str(retry)})
    if name == "QueueTimeoutError":
        state.metrics.rejected("embedding_queue_timeout")
        return ApiError(503, f"embedding request waited past --embedding-queue-timeout-ms ({e}); retry",
                        code="queue_timeout", type="server_error", headers={"Retry-After": "1"})
    return e
