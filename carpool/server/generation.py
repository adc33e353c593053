"""POST /v1/chat/completions and /v1/completions: admission, metrics and HTTP around the translation.

The body becomes engine requests through ``carpool.openai`` (``Translator.prepare``), they
run as one ``Generation`` (``run_request`` when not streamed) and the answer is shaped by
``ResponseBuilder``; this module adds what only a server has: the waiting room (429 when
full), the latency histograms, the SSE transport.  Whatever way a handler ends (finished,
error, the client went away and aiohttp cancelled it), the ``finally`` aborts the engine
requests that still run.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from carpool.engine.protocol import TokenDelta
from carpool.errors import OpenAIError
from carpool.openai.generation import Generation, aborted_error, engine_failure, run_request
from carpool.openai.requests import Prepared, grammar_param
from carpool.openai.responses import Choice, ResponseBuilder
from carpool.server import sse
from carpool.server.admission import Rejection, Ticket
from carpool.server.http import json_response, read_json
from carpool.server.state import STATE, ServerState

# Client went away while we were writing (aiohttp raises one of these, version dependent).
_DISCONNECTED = (ConnectionResetError, ConnectionError)


class _Observer:
    """The server's bookkeeping of one request's generation, as its deltas pass: the waiting-room
    ticket (started at the first delta) and the latency histograms (TTFT, ITL, end to end,
    queue time)."""

    def __init__(self, state: ServerState, ticket: Ticket) -> None:
        self.state = state
        self.ticket = ticket
        self._arrival = time.monotonic()
        self._last_token: dict[int, float] = {}

    def __call__(self, choice: Choice, delta: TokenDelta) -> None:
        now = time.monotonic()
        m = self.state.metrics
        last = self._last_token.get(choice.index)
        if last is None:
            self.ticket.started()
            m.ttft.observe(now - self._arrival)
        elif delta.token_ids:
            m.itl.observe(now - last)
        if delta.token_ids or last is None:
            self._last_token[choice.index] = now
        if delta.finished:
            m.e2e.observe(now - self._arrival)
            queue_time = (delta.metrics or {}).get("queue_time_s")
            if queue_time is not None:
                m.queue_time.observe(queue_time)
            if delta.finish_reason != "abort":
                usage = choice.usage
                assert usage is not None
                m.request_finished(delta.finish_reason or "stop", usage.prompt_tokens, usage.completion_tokens)


def _admit(state: ServerState, prepared: Prepared) -> Ticket:
    ticket = state.admission.try_admit(len(prepared.choices), prepared.prompt_tokens)
    if isinstance(ticket, Rejection):
        state.metrics.rejected(ticket.reason)
        raise OpenAIError(429, ticket.message, code=ticket.reason, type="rate_limit_exceeded",
                          headers={"Retry-After": str(ticket.retry_after_s)})
    return ticket


async def _handle(request: web.Request, kind: str) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_json(request)
    model = state.resolve_model(body, "generate")
    # Validating, templating and tokenizing cost milliseconds for a short prompt and seconds
    # for a long one: never on the event loop, which answers every other client and /health.
    prepared = await asyncio.to_thread(state.translator.prepare, kind, body)
    so = prepared.structured_outputs
    if so is not None:  # compiled now, off the loop and bounded; the engine finds it cached
        await state.grammars.check(state.engine, so, grammar_param(body))
    ticket = _admit(state, prepared)
    observe = _Observer(state, ticket)
    try:
        if prepared.stream:
            shape = ResponseBuilder(kind, prepared.id, model, include_usage=prepared.include_usage)
            gen = Generation(state.engine, prepared.choices)
            try:
                return await _stream(request, gen, observe, shape)
            finally:
                await gen.close()
        return json_response(await run_request(state.engine, prepared, model, observe))
    finally:
        ticket.release()


async def _deltas(gen: Generation, observe: _Observer):
    async for choice, delta in gen.deltas():
        observe(choice, delta)
        yield choice, delta


async def _stream(request: web.Request, gen: Generation, observe: _Observer,
                  shape: ResponseBuilder) -> web.StreamResponse:
    engine = gen.engine
    deltas = _deltas(gen, observe).__aiter__()
    # Wait for the first delta before sending headers, so a request the engine refuses
    # still gets a plain 400 instead of an error inside a 200 stream.
    try:
        first = await deltas.__anext__()
    except StopAsyncIteration:
        first = None
    except Exception as e:  # noqa: BLE001 - every engine failure becomes an OpenAI error body
        raise engine_failure(e, engine) from None
    resp = await sse.open_stream(request)
    try:
        for chunk in shape.role_chunks(gen.choices):
            await sse.send(resp, chunk)
        item = first
        while item is not None:
            choice, delta = item
            if delta.finished and delta.finish_reason == "abort":
                await sse.send(resp, aborted_error().body())
                break
            for chunk in shape.chunks(choice, delta):
                await sse.send(resp, chunk)
            try:
                item = await deltas.__anext__()
            except StopAsyncIteration:
                item = None
            except Exception as e:  # noqa: BLE001 - headers are gone: report in-band, as OpenAI does
                await sse.send(resp, engine_failure(e, engine).body())
                break
        else:
            if shape.include_usage:
                await sse.send(resp, shape.usage_chunk(gen.choices))
        await sse.done(resp)
    except _DISCONNECTED:
        pass  # the client left; close() in the caller aborts the engine requests
    return resp


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "completion")
