"""Runs requests on the in-process engine, through the same ``Backend`` interface as HTTP.

Generation goes through ``EngineClient.submit`` (``carpool.engine.protocol``); embeddings
through the engine room's ``DynamicBatcher`` over an ``Embedder`` (so concurrent single
embedding tasks are batched together).  The response bodies have the same OpenAI shape
as an HTTP server's, so everything above this file cannot tell the two apart.
"""

from __future__ import annotations

import itertools
import time
import uuid
from typing import Any

from carpool.client.base import CallResult, Request
from carpool.client.retry import ErrorKind
from carpool.engine.protocol import EngineError, GenerateRequest, SamplingParams


def _text_of(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: keep the text ones
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def to_generate_request(req: Request, request_id: str) -> GenerateRequest:
    b = req.body
    stop = b.get("stop")
    extra = b.get("extra_body")
    if not isinstance(extra, dict):
        extra = {}
    params = SamplingParams(
        temperature=float(b.get("temperature", 1.0)),
        top_p=float(b.get("top_p", 1.0)),
        top_k=int(b.get("top_k", extra.get("top_k", 0)) or 0),
        max_tokens=int(b.get("max_tokens") or b.get("max_completion_tokens") or 16),
        stop=[stop] if isinstance(stop, str) else list(stop or []),
        seed=b.get("seed"),
        ignore_eos=bool(b.get("ignore_eos", extra.get("ignore_eos", False))),
    )
    if req.kind == "chat":
        msgs = [{"role": m["role"], "content": _text_of(m.get("content"))} for m in b["messages"]]
        return GenerateRequest(request_id=request_id, params=params, messages=msgs)
    return GenerateRequest(request_id=request_id, params=params, prompt=b["prompt"])


class EngineBackend:
    name = "engine"

    def __init__(self, engine, embedder_factory=None, model_name: str | None = None):
        """``engine``: an EngineClient (``AsyncEngine``); ``embedder_factory``: builds a
        DynamicBatcher lazily on the first embedding task (loading MiniLM costs seconds)."""
        self.engine = engine
        self._embedder_factory = embedder_factory
        self._batcher: Any = None  # the embedding batcher, built on the first embedding task
        self.model_name = model_name or getattr(engine, "model_name", "engine")
        self._ids = itertools.count()
        self._run = uuid.uuid4().hex[:8]

    async def close(self) -> None:
        if self._batcher is not None and hasattr(self._batcher, "close"):
            await self._batcher.close()
        self._batcher = None

    def check(self, req: Request) -> tuple[str, str] | None:
        """A request the engine would refuse for its length: (field, reason), before it is queued."""
        if req.kind == "embedding":
            return None
        try:
            greq = to_generate_request(req, "check")
            n = self.engine.count_prompt_tokens(greq)
        except EngineError as e:
            return ("messages" if req.kind == "chat" else "prompt", str(e))
        except (KeyError, TypeError, ValueError) as e:
            return ("body", f"cannot build the request: {e}")
        limit = self.engine.max_model_len
        want = greq.params.max_tokens
        if n + want > limit:
            # The prompt alone fits: max_tokens is the field to change.
            fld = "max_tokens" if n < limit else "messages" if req.kind == "chat" else "prompt"
            reason = (f"the prompt is {n} tokens and max_tokens is {want}: {n + want} is past the model's "
                      f"context of {limit} tokens; shorten the prompt or lower max_tokens")
            return (fld, reason)
        return None

    async def call(self, req: Request) -> CallResult:
        if req.kind == "embedding":
            return await self._embed(req)
        rid = f"{req.custom_id}#{self._run}-{next(self._ids)}"
        t0 = time.monotonic()
        res = CallResult(ok=False, request_id=rid, endpoint="engine")
        try:
            greq = to_generate_request(req, rid)
        except (KeyError, TypeError, ValueError) as e:
            res.status_code, res.error_kind, res.error_message = 400, ErrorKind.CLIENT_ERROR, f"bad request: {e}"
            return res
        pieces: list[str] = []
        finish = None
        usage = None
        n_tokens = 0
        try:
            async for delta in self.engine.submit(greq):
                if delta.token_ids:
                    if res.ttft_s is None:
                        res.ttft_s = time.monotonic() - t0
                    n_tokens += len(delta.token_ids)
                pieces.append(delta.text)
                if delta.finished:
                    finish, usage = delta.finish_reason, delta.usage
        except EngineError as e:
            res.status_code, res.error_kind, res.error_message = 400, ErrorKind.CLIENT_ERROR, str(e)
            res.e2e_s = time.monotonic() - t0
            return res
        res.e2e_s = time.monotonic() - t0
        if finish is None or finish == "abort":
            res.error_kind, res.error_message = ErrorKind.TRUNCATED, "the engine aborted the request"
            return res
        text = "".join(pieces)
        res.prompt_tokens = usage.prompt_tokens if usage else 0
        res.completion_tokens = usage.completion_tokens if usage else n_tokens
        res.cached_tokens = usage.cached_tokens if usage else 0
        usage_d = {"prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens,
                   "total_tokens": res.prompt_tokens + res.completion_tokens,
                   "prompt_tokens_details": {"cached_tokens": res.cached_tokens}}
        if req.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish}
            obj = "text_completion"
        res.body = {"id": rid, "object": obj, "created": int(time.time()), "model": self.model_name,
                    "choices": [choice], "usage": usage_d}
        res.status_code, res.ok = 200, True
        return res

    async def _embed(self, req: Request) -> CallResult:
        t0 = time.monotonic()
        res = CallResult(ok=False, request_id=f"emb-{next(self._ids)}", endpoint="engine")
        if self._batcher is None:
            if self._embedder_factory is None:
                res.status_code, res.error_kind = 400, ErrorKind.CLIENT_ERROR
                res.error_message = "embedding tasks need the embedder (carpool.embed.embedder), not available"
                return res
            self._batcher = self._embedder_factory()
        inp = req.body["input"]
        texts = [inp] if isinstance(inp, str) else list(inp)
        try:
            vecs = await self._batcher.embed(texts)
        except Exception as e:  # noqa: BLE001  (QueueFullError / QueueTimeoutError, or an embedder failure)
            name = type(e).__name__
            kind = ErrorKind.OVERLOADED if "Queue" in name else ErrorKind.ENGINE_ERROR
            res.status_code, res.error_kind, res.error_message = 503, kind, f"{name}: {e}"
            res.retry_after = getattr(e, "retry_after_s", None)
            res.e2e_s = time.monotonic() - t0
            return res
        res.e2e_s = res.ttft_s = time.monotonic() - t0
        count = getattr(getattr(self._batcher, "embedder", None), "count_tokens", None)
        tokens = sum(count(t) for t in texts) if count else sum(len(t) // 4 + 1 for t in texts)
        res.prompt_tokens = tokens
        data = [{"object": "embedding", "index": i, "embedding": [float(x) for x in v]} for i, v in enumerate(vecs)]
        res.body = {"object": "list", "data": data, "model": getattr(self._batcher, "model_name", "all-MiniLM-L6-v2"),
                    "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
        res.status_code, res.ok = 200, True
        return res


def default_embedder_factory():
    """A DynamicBatcher over the packaged all-MiniLM-L6-v2 (imported only when needed)."""
    from carpool.embed.dynamic_batcher import DynamicBatcher
    from carpool.embed.embedder import Embedder

    emb = Embedder()
    batcher = DynamicBatcher(emb, max_queue_delay_us=2000, preferred_batch_sizes=[8, 16, 32],
                             max_batch_tokens=8192, max_queue_size=4096, queue_timeout_s=120.0)
    batcher.embedder = getattr(batcher, "embedder", emb)
    batcher.model_name = getattr(emb, "name", "all-MiniLM-L6-v2")
    return batcher
