"""Run the choices of one prepared request on an engine, as one stream of deltas.

One OpenAI request becomes one engine request per (prompt, choice); ``Generation`` submits
them all through ``EngineClient.submit``, merges their deltas into one async stream
(gathering each into its ``Choice`` on the way) and, on ``close``, aborts whatever still
runs, which frees its KV blocks at once.  ``close`` is safe on every exit path (finished,
failed, cancelled because the client went away), so callers put it in a ``finally``.

``run_request`` is the whole of a request that is not streamed: the ``Generation`` drained,
its failure or abort turned into the error to answer with, the response body built.  The
in-process backend, the server's endpoints and batch lines, and the tuner's engine load
all run requests through it, so each answers the same body and the same errors.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from carpool.engine.protocol import EngineClient, TokenDelta
from carpool.errors import EngineAborted, EngineError, OpenAIError
from carpool.openai.requests import Prepared
from carpool.openai.responses import Choice, ResponseBuilder

log = logging.getLogger("carpool.openai")


class Generation:
    def __init__(self, engine: EngineClient, choices: list[Choice]) -> None:
        self.engine = engine
        self.choices = choices
        self._tasks: list[asyncio.Task] = []
        self._gen: AsyncGenerator[tuple[Choice, TokenDelta], None] | None = None

    def deltas(self) -> AsyncIterator[tuple[Choice, TokenDelta]]:
        """(choice, delta) as the engine produces them, every choice's last one included.

        A failed engine request raises its exception here (``engine_failure`` says which
        error answer it is), and so does a choice the engine ended with finish_reason "error"
        (it failed inside a step and was dropped alone): ``Choice.add`` raises a 500 for this
        request only; the engine serves on."""
        if self._gen is None:
            self._gen = self._deltas()
        return self._gen

    @property
    def aborted(self) -> bool:
        """Some choice ended with finish_reason "abort" (the engine is shutting down)."""
        return any(c.finish_reason == "abort" for c in self.choices)

    async def _deltas(self) -> AsyncGenerator[tuple[Choice, TokenDelta], None]:
        if len(self.choices) == 1:  # the common case: no tasks, no queue
            choice = self.choices[0]
            async for delta in self.engine.submit(choice.request):
                choice.add(delta)  # raises the 500 of a choice the engine failed on
                yield choice, delta
            return
        queue: asyncio.Queue[tuple[Choice, TokenDelta | Exception]] = asyncio.Queue()

        async def pump(choice: Choice) -> None:
            try:
                async for delta in self.engine.submit(choice.request):
                    queue.put_nowait((choice, delta))
            except Exception as e:  # noqa: BLE001 - handed to the consumer, which answers with it
                queue.put_nowait((choice, e))

        self._tasks = [asyncio.create_task(pump(c)) for c in self.choices]
        remaining = len(self.choices)
        while remaining:
            choice, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            choice.add(item)
            if item.finished:
                remaining -= 1
            yield choice, item

    async def close(self) -> None:
        """Abort whatever still runs; safe after cancellation and on every exit path."""
        if self._gen is not None:
            try:
                await self._gen.aclose()
            except Exception:  # closing must go on to the aborts below
                log.debug("closing the delta stream failed", exc_info=True)
        for t in self._tasks:
            t.cancel()
        for c in self.choices:
            if c.finish_reason is None:
                try:
                    await self.engine.abort(c.request.request_id)
                except Exception:
                    log.exception("abort of %s failed", c.request.request_id)


async def run_request(engine: EngineClient, prepared: Prepared, model: str,
                      on_delta: Callable[[Choice, TokenDelta], None] | None = None) -> dict:
    """Run ``prepared``'s choices to their end on ``engine``; the response body (not streamed),
    naming ``model``.  ``on_delta`` sees every delta as it comes (first-token times, metrics).

    Raises the ``OpenAIError`` to answer with: ``engine_failure``'s when the engine failed,
    ``EngineAborted`` when it aborted a choice (it is shutting down).  The engine requests
    still running when it ends (an error, a cancellation) are aborted."""
    gen = Generation(engine, prepared.choices)
    try:
        async for choice, delta in gen.deltas():
            if on_delta is not None:
                on_delta(choice, delta)
    except Exception as e:  # noqa: BLE001 - every engine failure becomes an OpenAI error body
        raise engine_failure(e, engine) from None
    finally:
        await gen.close()
    if gen.aborted:
        raise aborted_error()
    return ResponseBuilder(prepared.kind, prepared.id, model).body(gen.choices)


def engine_failure(e: Exception, engine: EngineClient) -> OpenAIError:
    """The error answer for an exception out of ``Generation.deltas``."""
    if isinstance(e, OpenAIError):
        return e
    if engine.error is not None:  # the engine loop itself died
        log.error("engine loop failed: %r", engine.error)
        return OpenAIError(503, f"the engine has failed and cannot serve: {engine.error!r}",
                           type="server_error", code="engine_failed")
    if isinstance(e, EngineError):
        return OpenAIError(400, str(e))
    log.error("engine failed: %r", e)
    return OpenAIError(500, f"engine error: {e}", type="server_error")


def aborted_error() -> EngineAborted:
    """The answer when the engine aborted a choice."""
    return EngineAborted(503, "the engine aborted the request (is it shutting down?); retry",
                         type="server_error", headers={"Retry-After": "1"})
