"""POST /v1/chat/completions and /v1/completions over the engine's ``submit``.

One HTTP request becomes one engine request per (prompt, choice); their token deltas are
merged into one stream.  Whatever way the handler ends (finished, error, the client went
away and aiohttp cancelled the handler), the ``finally`` aborts the engine requests that are
still running, which frees their KV blocks at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aiohttp import web

from carpool.engine.protocol import EngineError, GenerateRequest, SamplingParams, TokenDelta, Usage
from carpool.server import sse
from carpool.server.admission import Rejection, Ticket
from carpool.server.app import STATE, ServerState, json_response, read_json
from carpool.server.errors import ApiError
from carpool.server.openai_schema import SchemaError, validate

log = logging.getLogger("carpool.server")

# Client went away while we were writing (aiohttp raises one of these, version dependent).
_DISCONNECTED = (ConnectionResetError, ConnectionError)


@dataclass
class _Choice:
    index: int
    prompt_index: int
    request: GenerateRequest
    parts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    arrival: float = 0.0
    last_token: float | None = None


# ----------------------------------------------------------------------------------------------
# request -> engine requests


def _sampling(body: dict, max_tokens: int) -> SamplingParams:
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    top_k = body.get("top_k")
    return SamplingParams(
        temperature=float(1.0 if body.get("temperature") is None else body["temperature"]),
        # A top_p that rounds to 0 in float32 would mask every token; below 1e-6 the nucleus
        # is the top token anyway, so the floor changes no result.
        top_p=max(1e-6, float(1.0 if body.get("top_p") is None else body["top_p"])),
        top_k=int(top_k) if top_k and top_k > 0 else 0,
        max_tokens=max_tokens,
        stop=[s for s in stops if s],  # an empty stop string would end every request at once
        stop_token_ids=[int(t) for t in body.get("stop_token_ids") or []],
        seed=None if body.get("seed") is None else int(body["seed"]),
        ignore_eos=bool(body.get("ignore_eos") or False),
    )


def _messages(raw: list[dict]) -> list[dict]:
    out = []
    for m in raw:
        content = m.get("content")
        if isinstance(content, list):  # text parts, joined as vLLM does
            content = "\n".join(part["text"] for part in content)
        role = "system" if m["role"] == "developer" else m["role"]
        msg = {"role": role, "content": content or ""}
        if m.get("name"):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def _max_tokens(body: dict, prompt_tokens: int, ctx: int, default: int | None, prompt_param: str) -> int:
    """The max_tokens to run with; a 400 naming the field when the context cannot hold it."""
    if prompt_tokens >= ctx:
        raise ApiError(
            400,
            f"This model's maximum context length is {ctx} tokens, and your {prompt_param} has "
            f"{prompt_tokens} tokens; shorten '{prompt_param}'.",
            param=prompt_param, code="context_length_exceeded",
        )
    room = ctx - prompt_tokens
    param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    asked = body.get(param)
    if asked is None:
        return room if default is None else min(default, room)
    asked = int(asked)
    if asked > room:
        raise ApiError(
            400,
            f"'{param}' is too large: {asked}. This model's maximum context length is {ctx} tokens and "
            f"your request has {prompt_tokens} prompt tokens ({asked} > {ctx} - {prompt_tokens}); "
            f"lower '{param}' to at most {room}.",
            param=param, code="context_length_exceeded",
        )
    return asked


def _count(state: ServerState, req: GenerateRequest, param: str) -> int:
    if req.prompt_token_ids is not None:
        return len(req.prompt_token_ids)
    assert state.engine is not None
    try:
        n = int(state.engine.count_prompt_tokens(req))
    except EngineError as e:
        raise ApiError(400, str(e), param=param) from None
    if n <= 0:
        raise ApiError(400, f"'{param}' is empty after tokenization; send some text", param=param)
    return n


def _expand(base: list[GenerateRequest], body: dict, rid: str) -> list[_Choice]:
    """n choices per prompt: choice i of prompt p is index p*n + i, its own engine request."""
    n = int(body.get("n") or 1)
    now = time.monotonic()
    choices = []
    for p, req in enumerate(base):
        for i in range(n):
            params = req.params
            if i and params.seed is not None:  # seeded choices must still differ from each other
                params = dataclasses.replace(params, seed=params.seed + i)
            sub = dataclasses.replace(req, request_id=f"{rid}-{p * n + i}", params=params, arrival_time=now)
            choices.append(_Choice(index=p * n + i, prompt_index=p, request=sub, arrival=now))
    return choices


def _admit(state: ServerState, choices: list[_Choice], prompt_lens: list[int]) -> Ticket:
    tokens = sum(prompt_lens[c.prompt_index] for c in choices)
    ticket = state.admission.try_admit(len(choices), tokens)
    if isinstance(ticket, Rejection):
        state.metrics.rejected(ticket.reason)
        raise ApiError(429, ticket.message, code=ticket.reason, type="rate_limit_exceeded",
                       headers={"Retry-After": str(ticket.retry_after_s)})
    return ticket


def _validate(body: dict, schema: dict) -> None:
    try:
        validate(body, schema)
    except SchemaError as e:
        raise ApiError(400, e.message, param=e.param) from None


# ----------------------------------------------------------------------------------------------
# running


class _Run:
    """The engine requests of one HTTP request, merged into one async stream of deltas."""

    def __init__(self, state: ServerState, choices: list[_Choice], ticket: Ticket) -> None:
        self.state = state
        self.choices = choices
        self.ticket = ticket
        self._tasks: list[asyncio.Task] = []
        self._gen: AsyncIterator | None = None

    def deltas(self) -> AsyncIterator[tuple[_Choice, TokenDelta]]:
        if self._gen is None:
            self._gen = self._deltas()
        return self._gen

    async def _deltas(self) -> AsyncIterator[tuple[_Choice, TokenDelta]]:
        engine = self.state.engine
        assert engine is not None
        if len(self.choices) == 1:  # the common case: no tasks, no queue
            choice = self.choices[0]
            async for delta in engine.submit(choice.request):
                self._observe(choice, delta)
                yield choice, delta
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(choice: _Choice) -> None:
            try:
                async for delta in engine.submit(choice.request):
                    queue.put_nowait((choice, delta))
            except Exception as e:  # noqa: BLE001 - handed to the handler, which answers with it
                queue.put_nowait((choice, e))

        self._tasks = [asyncio.create_task(pump(c)) for c in self.choices]
        remaining = len(self.choices)
        while remaining:
            choice, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            self._observe(choice, item)
            if item.finished:
                remaining -= 1
            yield choice, item

    def _observe(self, choice: _Choice, delta: TokenDelta) -> None:
        now = time.monotonic()
        m = self.state.metrics
        if choice.last_token is None:
            self.ticket.started()
            m.ttft.observe(now - choice.arrival)
        elif delta.token_ids:
            m.itl.observe(now - choice.last_token)
        if delta.token_ids:
            choice.last_token = now
        if delta.text:
            choice.parts.append(delta.text)
        if delta.finished:
            choice.finish_reason = delta.finish_reason
            choice.usage = delta.usage or Usage()
            m.e2e.observe(now - choice.arrival)
            queue_time = (delta.metrics or {}).get("queue_time_s")
            if queue_time is not None:
                m.queue_time.observe(queue_time)
            if delta.finish_reason != "abort":
                m.request_finished(delta.finish_reason or "stop", choice.usage.prompt_tokens,
                                   choice.usage.completion_tokens)

    async def close(self) -> None:
        """Abort whatever still runs; safe after cancellation and on every exit path."""
        self.ticket.release()
        if self._gen is not None:
            try:
                await self._gen.aclose()  # type: ignore[attr-defined]
            except Exception:  # closing must go on to the aborts below
                log.debug("closing the delta stream failed", exc_info=True)
        for t in self._tasks:
            t.cancel()
        engine = self.state.engine
        for c in self.choices:
            if c.finish_reason is None and engine is not None:
                try:
                    await engine.abort(c.request.request_id)
                except Exception:
                    log.exception("abort of %s failed", c.request.request_id)

    def usage(self) -> dict:
        prompt = cached = completion = 0
        seen: set[int] = set()
        for c in self.choices:
            u = c.usage or Usage()
            completion += u.completion_tokens
            if c.prompt_index not in seen:  # a prompt counts once however many choices it has
                seen.add(c.prompt_index)
                prompt += u.prompt_tokens
                cached += u.cached_tokens
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }


def _engine_failure(e: Exception, state: ServerState) -> ApiError:
    if getattr(state.engine, "error", None) is not None:  # the engine loop itself died
        log.error("engine loop failed: %r", state.engine.error)  # type: ignore[union-attr]
        return ApiError(503, f"the engine has failed and cannot serve: {state.engine.error!r}",  # type: ignore[union-attr]
                        type="server_error", code="engine_failed")
    if isinstance(e, EngineError):
        return ApiError(400, str(e))
    log.error("engine failed: %r", e)
    return ApiError(500, f"engine error: {e}", type="server_error")


def _check_abort(choice: _Choice) -> None:
    if choice.finish_reason == "abort":
        raise ApiError(503, "the engine aborted the request (is it shutting down?); retry",
                       type="server_error", headers={"Retry-After": "1"})


class _Shape:
    """What differs between chat and text completions in the response bodies."""

    def __init__(self, chat: bool, rid: str, model: str) -> None:
        self.chat = chat
        self.rid = rid
        self.model = model
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"

    def head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    def final_choice(self, c: _Choice) -> dict:
        text = "".join(c.parts)
        if self.chat:
            return {"index": c.index, "message": {"role": "assistant", "content": text, "refusal": None},
                    "logprobs": None, "finish_reason": c.finish_reason}
        return {"index": c.index, "text": text, "logprobs": None, "finish_reason": c.finish_reason}

    def chunk(self, index: int, text: str | None, finish: str | None, role: bool = False) -> dict:
        if self.chat:
            delta: dict = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {**self.head(self.chunk_object), "choices": [choice]}


async def _respond(request: web.Request, body: dict, run: _Run, shape: _Shape) -> web.StreamResponse:
    try:
        if body.get("stream"):
            return await _stream(request, body, run, shape)
        try:
            async for _ in run.deltas():
                pass
        except Exception as e:  # noqa: BLE001 - every engine failure becomes an OpenAI error body
            raise _engine_failure(e, run.state) from None
        for c in run.choices:
            _check_abort(c)
        out = {**shape.head(shape.object), "choices": [shape.final_choice(c) for c in run.choices],
               "usage": run.usage()}
        return json_response(out)
    finally:
        await run.close()


async def _stream(request: web.Request, body: dict, run: _Run, shape: _Shape) -> web.StreamResponse:
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    deltas = run.deltas().__aiter__()
    # Wait for the first delta before sending headers, so a request the engine refuses
    # still gets a plain 400 instead of an error inside a 200 stream.
    try:
        first = await deltas.__anext__()
    except StopAsyncIteration:
        first = None
    except Exception as e:  # noqa: BLE001 - every engine failure becomes an OpenAI error body
        raise _engine_failure(e, run.state) from None
    resp = await sse.open_stream(request)

    def with_usage(chunk: dict) -> dict:
        if include_usage:
            chunk["usage"] = None
        return chunk

    try:
        if shape.chat:  # the role comes first, on its own chunk, for every choice
            for c in run.choices:
                await sse.send(resp, with_usage(shape.chunk(c.index, "", None, role=True)))
        item = first
        while item is not None:
            choice, delta = item
            if delta.finished and delta.finish_reason == "abort":
                await sse.send(resp, ApiError(503, "the engine aborted the request; retry",
                                              type="server_error").body())
                break
            if delta.text:
                await sse.send(resp, with_usage(shape.chunk(choice.index, delta.text, None)))
            if delta.finished:
                await sse.send(resp, with_usage(shape.chunk(choice.index, None, delta.finish_reason)))
            try:
                item = await deltas.__anext__()
            except StopAsyncIteration:
                item = None
            except Exception as e:  # noqa: BLE001 - headers are gone: report in-band, as OpenAI does
                await sse.send(resp, _engine_failure(e, run.state).body())
                break
        else:
            if include_usage:
                await sse.send(resp, {**shape.head(shape.chunk_object), "choices": [], "usage": run.usage()})
        await sse.done(resp)
    except _DISCONNECTED:
        pass  # the client left; close() in the caller aborts the engine requests
    return resp


# ----------------------------------------------------------------------------------------------
# handlers


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_json(request)
    model = state.resolve_model(body, "generate")
    _validate(body, state.chat_schema)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    base = GenerateRequest(request_id=rid, messages=_messages(body["messages"]),
                           priority=int(body.get("priority") or 0))
    prompt_len = _count(state, base, "messages")
    base.params = _sampling(body, _max_tokens(body, prompt_len, state.max_model_len, None, "messages"))
    choices = _expand([base], body, rid)
    ticket = _admit(state, choices, [prompt_len])
    return await _respond(request, body, _Run(state, choices, ticket), _Shape(True, rid, model))


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_json(request)
    model = state.resolve_model(body, "generate")
    _validate(body, state.completion_schema)
    rid = f"cmpl-{uuid.uuid4().hex}"
    prompt = body["prompt"]
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif all(isinstance(p, int) for p in prompt):
        prompts = [prompt]  # one prompt of token ids
    else:
        prompts = prompt
    base, lens = [], []
    priority = int(body.get("priority") or 0)
    for i, p in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        req = (GenerateRequest(request_id=rid, prompt=p, priority=priority) if isinstance(p, str)
               else GenerateRequest(request_id=rid, prompt_token_ids=[int(t) for t in p], priority=priority))
        n = _count(state, req, param)
        req.params = _sampling(body, _max_tokens(body, n, state.max_model_len, 16, param))
        base.append(req)
        lens.append(n)
    choices = _expand(base, body, rid)
    ticket = _admit(state, choices, lens)
    return await _respond(request, body, _Run(state, choices, ticket), _Shape(False, rid, model))
