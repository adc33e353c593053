"""POST /v1/embeddings through the Triton-style dynamic batcher (``carpool.embed``)."""

from __future__ import annotations

import asyncio
import math

from aiohttp import web

from carpool.errors import OpenAIError, QueueFullError, QueueTimeoutError, SchemaError
from carpool.openai.responses import embedding_body
from carpool.openai.validation import validate
from carpool.server.http import json_response, read_json
from carpool.server.state import STATE, ServerState


async def create_embeddings(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_json(request)
    return json_response(await embeddings_body(state, body))


async def embeddings_body(state: ServerState, body: dict) -> dict:
    """The answer to one embeddings request body (a batch's lines come here too); raises
    OpenAIError."""
    model = state.resolve_model(body, "embedding")  # 404 when no embedding model is served
    inp = body.get("input")
    if isinstance(inp, list) and inp and all(isinstance(x, (int, list)) for x in inp):
        raise OpenAIError(400, "'input': token-id input is not supported for embeddings; send strings",
                          param="input")
    try:
        validate(body, state.embedding_schema or {})
    except SchemaError as e:
        raise OpenAIError(400, e.message, param=e.param) from None
    assert state.batcher is not None  # resolve_model found an embedding model
    assert inp is not None  # the schema requires it
    texts: list[str] = [inp] if isinstance(inp, str) else list(inp)
    try:
        vectors = await state.batcher.embed(texts)
    except (QueueFullError, QueueTimeoutError) as e:
        raise _queue_error(state, e) from None
    # Tokenizing takes milliseconds even for a short input: never on the event loop.
    tokens = sum(await asyncio.to_thread(state.batcher.count_tokens, texts))
    return embedding_body(vectors, model, tokens, body.get("encoding_format"))


def _queue_error(state: ServerState, e: QueueFullError | QueueTimeoutError) -> OpenAIError:
    if isinstance(e, QueueFullError):
        state.metrics.rejected("embedding_queue_full")
        retry = max(1, math.ceil(e.retry_after_s or 1))
        return OpenAIError(429, f"{e}", code="queue_full", headers={"Retry-After": str(retry)})
    state.metrics.rejected("embedding_queue_timeout")
    return OpenAIError(503, f"embedding request waited past --embedding-queue-timeout-ms ({e}); retry",
                       code="queue_timeout", type="server_error", headers={"Retry-After": "1"})
