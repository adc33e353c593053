"""A local stand-in for Anthropic's Message Batches API, with faults on purpose.

Built from Anthropic's documented API so that ``carpool run --batch-api anthropic`` can be
tested without a hosted provider: ``POST /v1/messages/batches`` (``requests: [{custom_id,
params}]``), ``GET /v1/messages/batches`` (list, newest first, ``limit`` / ``after_id``),
``GET /v1/messages/batches/{id}``, ``GET /v1/messages/batches/{id}/results`` (JSONL, one
``{custom_id, result}`` a request: ``succeeded`` with a Message, ``errored``, ``canceled``,
``expired``) and ``POST /v1/messages/batches/{id}/cancel``.  Every call must carry the
``x-api-key`` and ``anthropic-version`` headers, as the real API requires.

Answers are made up: each request is answered with ``canned`` text, or (``canned`` None)
an echo of the last user message, so a test can check that a prompt went to the right
custom_id and came back.  Params are checked when a batch is processed, as Anthropic does:
a request without ``max_tokens`` or ``messages`` ends ``errored`` (invalid_request_error).

Faults (``AnthropicBatchConfig``): the first ``create_429`` creates are refused with 429
and ``retry-after``; ``expire_batches`` batches end with every request ``expired``;
requests whose custom_id contains a key of ``errors`` end ``errored`` (the value: how many
times; the error type is ``api_error``, retryable) and of ``expire_ids`` end ``expired``;
``poll_delay_s`` slows every GET of a batch and the first ``poll_529`` of them answer 529
(overloaded); ``create_delay_s`` answers a create that late (the batch exists from the
start: a client killed meanwhile has created it without knowing its id); ``shuffle``
returns results out of order.
``received`` counts every request a create accepted, per custom_id, so a test can assert
that no task was submitted twice.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from aiohttp import web

from .local_site import LocalAppServer
from .threaded import ThreadedServer

API_VERSION = "2023-06-01"
MAX_REQUESTS = 100_000
MAX_BYTES = 256 * 1024 * 1024
_CUSTOM_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass
class AnthropicBatchConfig:
    api_key: str = "test-key"
    process_s: float = 0.3  # how long a batch stays in_progress
    canned: str | None = None  # None: echo the last user message
    create_429: int = 0  # the first N creates are refused with 429
    retry_after_s: float = 0.2
    expire_batches: int = 0  # the first N batches end with every request expired
    errors: dict[str, int] = field(default_factory=dict)  # custom_id substring -> times errored
    expire_ids: dict[str, int] = field(default_factory=dict)  # custom_id substring -> times expired
    poll_delay_s: float = 0.0
    poll_529: int = 0  # the first N GETs of a batch answer 529 overloaded_error
    create_delay_s: float = 0.0  # the batch exists at once, its id is answered this much later
    shuffle: bool = False


@dataclass
class _Batch:
    id: str
    requests: list[dict]
    created: float
    ends: float
    expire_all: bool
    canceled: bool = False
    results: list[dict] | None = None


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")


def _error(status: int, kind: str, message: str, headers: dict | None = None) -> web.Response:
    return web.json_response({"type": "error", "error": {"type": kind, "message": message}}, status=status,
                             headers=headers)


def _text_of(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(b.get("text", "") for b in content if isinstance(b, dict))
    return ""


class AnthropicBatchServer(LocalAppServer):
    def __init__(self, config: AnthropicBatchConfig | None = None, host: str = "127.0.0.1", port: int = 0):
        super().__init__(host, port)
        self.config = config or AnthropicBatchConfig()
        self.batches: dict[str, _Batch] = {}
        self.received: Counter[str] = Counter()  # custom_id -> times a create accepted it
        self.creates = 0  # create calls, refused ones included
        self.polls = 0
        self.credentials_seen: list[str] = []  # every request's x-api-key and Authorization values
        self._errors_left = dict(self.config.errors)
        self._expire_left = dict(self.config.expire_ids)

    def _app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BYTES + 1024, middlewares=[self._auth])
        app.router.add_post("/v1/messages/batches", self._create)
        app.router.add_get("/v1/messages/batches", self._list)
        app.router.add_get("/v1/messages/batches/{id}", self._retrieve)
        app.router.add_get("/v1/messages/batches/{id}/results", self._results)
        app.router.add_post("/v1/messages/batches/{id}/cancel", self._cancel)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.credentials_seen += [v for k in ("x-api-key", "Authorization") if (v := request.headers.get(k))]
        if request.headers.get("x-api-key") != self.config.api_key:
            return _error(401, "authentication_error", "invalid x-api-key")
        if not request.headers.get("anthropic-version"):
            return _error(400, "invalid_request_error", "anthropic-version: header is required")
        return await handler(request)

    # -- handlers ---------------------------------------------------------------------------
    async def _create(self, request: web.Request) -> web.Response:
        self.creates += 1
        if self.creates <= self.config.create_429:
            return _error(429, "rate_limit_error", "too many batch creations",
                          {"retry-after": f"{self.config.retry_after_s:g}"})
        try:
            doc = await request.json()
        except ValueError:
            return _error(400, "invalid_request_error", "body is not JSON")
        reqs = doc.get("requests") if isinstance(doc, dict) else None
        problem = self._check_requests(reqs)
        if problem:
            return _error(400, "invalid_request_error", problem)
        assert isinstance(reqs, list)
        now = time.time()
        expire_all = len(self.batches) < self.config.expire_batches
        b = _Batch("msgbatch_" + os.urandom(12).hex(), reqs, now, now + self.config.process_s, expire_all)
        self.batches[b.id] = b
        for r in reqs:
            self.received[r["custom_id"]] += 1
        if self.config.create_delay_s:  # a client killed meanwhile never learns the id
            await asyncio.sleep(self.config.create_delay_s)
        return web.json_response(self._doc(b))

    def _check_requests(self, reqs: object) -> str | None:
        if not isinstance(reqs, list) or not reqs:
            return "requests: must be a non-empty list"
        if len(reqs) > MAX_REQUESTS:
            return f"requests: at most {MAX_REQUESTS} requests in a batch"
        seen: set[str] = set()
        for i, r in enumerate(reqs):
            cid = r.get("custom_id") if isinstance(r, dict) else None
            if not isinstance(cid, str) or not _CUSTOM_ID.match(cid):
                return f"requests.{i}.custom_id: must match ^[a-zA-Z0-9_-]{{1,64}}$, got {cid!r}"
            if cid in seen:
                return f"requests.{i}.custom_id: {cid!r} is not unique in the batch"
            seen.add(cid)
            if not isinstance(r.get("params"), dict):
                return f"requests.{i}.params: must be an object"
        return None

    async def _list(self, request: web.Request) -> web.Response:
        limit = int(request.query.get("limit", "20"))
        newest = sorted(self.batches.values(), key=lambda b: b.created, reverse=True)
        after = request.query.get("after_id")
        if after:
            ids = [b.id for b in newest]
            newest = newest[ids.index(after) + 1:] if after in ids else []
        page = newest[:limit]
        return web.json_response({"data": [self._doc(b) for b in page], "has_more": len(newest) > limit,
                                  "first_id": page[0].id if page else None,
                                  "last_id": page[-1].id if page else None})

    async def _retrieve(self, request: web.Request) -> web.Response:
        self.polls += 1
        if self.config.poll_delay_s:
            await asyncio.sleep(self.config.poll_delay_s)
        if self.polls <= self.config.poll_529:
            return _error(529, "overloaded_error", "overloaded")
        b = self.batches.get(request.match_info["id"])
        if b is None:
            return _error(404, "not_found_error", "no such message batch")
        return web.json_response(self._doc(b))

    async def _results(self, request: web.Request) -> web.Response:
        b = self.batches.get(request.match_info["id"])
        if b is None:
            return _error(404, "not_found_error", "no such message batch")
        if not self._ended(b):
            return _error(400, "invalid_request_error", "results are available once processing has ended")
        lines = list(self._results_of(b))
        if self.config.shuffle:
            random.shuffle(lines)
        body = "".join(json.dumps(x) + "\n" for x in lines)
        return web.Response(text=body, content_type="application/binary")

    async def _cancel(self, request: web.Request) -> web.Response:
        b = self.batches.get(request.match_info["id"])
        if b is None:
            return _error(404, "not_found_error", "no such message batch")
        if not self._ended(b):
            b.canceled = True
            b.ends = time.time()
        return web.json_response(self._doc(b))

    # -- processing -------------------------------------------------------------------------
    def _ended(self, b: _Batch) -> bool:
        return time.time() >= b.ends

    def _results_of(self, b: _Batch) -> list[dict]:
        if b.results is None:
            b.results = [{"custom_id": r["custom_id"], "result": self._answer(b, r)} for r in b.requests]
        return b.results

    def _take(self, left: dict[str, int], cid: str) -> bool:
        for key, n in left.items():
            if key in cid and n > 0:
                left[key] = n - 1
                return True
        return False

    def _answer(self, b: _Batch, r: dict) -> dict:
        cid, params = r["custom_id"], r["params"]
        if b.canceled:
            return {"type": "canceled"}
        if b.expire_all or self._take(self._expire_left, cid):
            return {"type": "expired"}
        if self._take(self._errors_left, cid):
            return {"type": "errored", "error": {"type": "error", "error": {"type": "api_error",
                                                                             "message": "injected fault"}}}
        missing = [f for f in ("model", "max_tokens", "messages") if f not in params]
        if missing:
            return {"type": "errored", "error": {"type": "error", "error": {
                "type": "invalid_request_error", "message": f"{missing[0]}: Field required"}}}
        msgs = params["messages"]
        last = _text_of(msgs[-1].get("content")) if msgs and isinstance(msgs[-1], dict) else ""
        text = self.config.canned if self.config.canned is not None else f"echo: {last}"
        words = max(1, len(text.split()))
        prompt = sum(len(_text_of(m.get("content")).split()) for m in msgs if isinstance(m, dict))
        prompt += len(_text_of(params.get("system")).split())
        return {"type": "succeeded", "message": {
            "id": "msg_" + os.urandom(8).hex(), "type": "message", "role": "assistant", "model": params["model"],
            "content": [{"type": "text", "text": text}], "stop_reason": "end_turn", "stop_sequence": None,
            "usage": {"input_tokens": prompt, "output_tokens": words, "cache_creation_input_tokens": 0,
                      "cache_read_input_tokens": 0}}}

    def _doc(self, b: _Batch) -> dict:
        ended = self._ended(b)
        counts = {"processing": 0, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
        if ended:
            for x in self._results_of(b):
                counts[x["result"]["type"]] += 1
        else:
            counts["processing"] = len(b.requests)
        status = "ended" if ended else "canceling" if b.canceled else "in_progress"
        return {"id": b.id, "type": "message_batch", "processing_status": status, "request_counts": counts,
                "ended_at": _iso(b.ends) if ended else None, "created_at": _iso(b.created),
                "expires_at": _iso(b.created + timedelta(hours=24).total_seconds()),
                "archived_at": None, "cancel_initiated_at": _iso(b.ends) if b.canceled else None,
                "results_url": f"{self.url}/v1/messages/batches/{b.id}/results" if ended else None}


class ThreadedAnthropicBatchServer(ThreadedServer):
    """The server on its own loop in a daemon thread, for sync tests driving subprocesses."""

    def __init__(self, config: AnthropicBatchConfig | None = None):
        super().__init__(AnthropicBatchServer(config))
