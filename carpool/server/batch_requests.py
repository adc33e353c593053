"""One request of a batch, answered on the server's own engine as the online endpoint would.

The body goes through the same translation (``Translator.prepare``) and response shape
(``ResponseBuilder``) as ``POST /v1/chat/completions``, so a batch line's answer is the body
an online call would have got.  Two differences, both for the online requests' sake:

- every engine request of a batch line is background work (``BACKGROUND_PRIORITY`` added to
  its priority): it sits out each engine step that computes an online prompt, whatever the
  scheduling policy, and under ``--scheduling-policy priority`` an online request is also
  admitted (and kept, when the KV cache runs short) before any batch request;
- batch lines do not go through the admission waiting room: before it enters the engine,
  a request takes its sequences and their KV tokens out of the batch share (``hold``,
  ``batch_budget``), so batch work never takes the seats online requests need.

``answer`` returns (HTTP status, body) the way OpenAI's batch output holds them: 200 and
the response, or the error status and its ``{"error": ...}`` body.  A request the engine
aborted (the server is shutting down) raises ``NotAnswered``: it has no answer to record
and runs again after the restart.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

from carpool.engine.protocol import BACKGROUND_PRIORITY
from carpool.errors import EngineAborted, NotAnswered, OpenAIError
from carpool.openai.generation import run_request
from carpool.openai.requests import grammar_param
from carpool.server.embeddings import embeddings_body
from carpool.server.state import ServerState

log = logging.getLogger("carpool.server.batches")


# ``hold(sequences, kv_tokens)``: the batch share a request takes while it runs (``WorkBudget.hold``).
Hold = Callable[[int, int], AbstractAsyncContextManager[None]]


async def answer(state: ServerState, kind: str, body: dict, hold: Hold) -> tuple[int, dict]:
    """(status, body) of one batch request of ``kind`` (chat | completion | embedding)."""
    body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    try:
        if kind == "embedding":
            async with hold(0, 0):  # no engine sequence, but online requests still come first
                return 200, await embeddings_body(state, body)
        return 200, await _generate(state, kind, body, hold)
    except OpenAIError as e:
        if e.code == "engine_failed" or state.engine.error is not None:
            raise NotAnswered(str(e)) from None  # the engine is gone: answer after a restart
        return e.status, e.body()
    except (NotAnswered, asyncio.CancelledError):
        raise
    except Exception as e:  # a request that broke something still gets its answer line
        log.exception("batch request failed")
        return 500, OpenAIError(500, f"internal error: {e!r}; see the server log", type="server_error").body()


async def _generate(state: ServerState, kind: str, body: dict, hold: Hold) -> dict:
    model = state.resolve_model(body, "generate")
    # Off the event loop, as for an online request: the loop answers every client and /health.
    prepared = await asyncio.to_thread(state.translator.prepare, kind, body)
    if prepared.structured_outputs is not None:  # compiled now, bounded; a refusal is the line's 400
        await state.grammars.check(state.engine, prepared.structured_outputs, grammar_param(body))
    for choice in prepared.choices:  # a line's own priority orders it among batch requests only
        choice.request.priority = max(choice.request.priority, 0) + BACKGROUND_PRIORITY
    kv_tokens = sum(c.prompt_tokens + c.request.params.max_tokens for c in prepared.choices)
    async with hold(len(prepared.choices), kv_tokens):
        try:
            return await run_request(state.engine, prepared, model)
        except EngineAborted:
            raise NotAnswered("the engine aborted the request") from None
