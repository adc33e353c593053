"""Async load generator: sends a request set on an arrival schedule and records, per request,
the client-side timestamp of every streamed chunk.

The requests go through the client's own backends (``carpool.client``), the ones a batch
job uses, so bench measures the client users run, and one record format serves both:

* ``http_load_client``: any OpenAI-compatible server (vLLM, SGLang, OpenAI, ``carpool serve``)
  through ``client.http_backend.HttpBackend``: streaming SSE with
  ``stream_options.include_usage`` so token counts are the server's.  ``fresh_connections=True``
  opens a new TCP connection per request (what a client without a pool pays), and every
  record says how long connecting took.
* ``engine_load_client``: carpool's engine in-process through ``client.engine_backend.EngineBackend``
  (the same OpenAI translation as ``carpool serve``).

Timing follows vLLM's ``bench serve``: ``start_time`` is taken just before the request is
sent (after the client's concurrency slot is granted), TTFT is the first chunk that carries
text, ITL is the gap between consecutive text chunks, and latency runs to the end of the
response.  Unlike vLLM, chunks with no text (an OpenAI role-only first delta) are not
counted as tokens, so a server that sends the role at once cannot fake a fast TTFT.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from carpool.bench.arrivals import arrival_offsets
from carpool.bench.datasets import BenchRequest
from carpool.client.base import Backend, CallResult, Request
from carpool.client.pool import Timeouts
from carpool.compat import Self


@dataclass
class RequestRecord:
    """What the client saw of one request (times are ``time.perf_counter()`` seconds)."""

    request_id: str
    prompt_len: int
    success: bool = False
    status: int | None = None  # HTTP status; None for a transport error
    error: str = ""
    scheduled_time: float = 0.0  # when the arrival schedule released the request
    start_time: float = 0.0  # when it was sent (after waiting for a client concurrency slot)
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    new_connection: bool = False
    connect_time: float = 0.0  # seconds spent opening a TCP connection for this request
    retry_after: float | None = None
    server_queue_time: float | None = None  # seconds queued inside the engine, when it says
    generated_text: str = ""

    @property
    def client_wait(self) -> float:
        """Seconds the request sat in the client waiting for a concurrency slot."""
        return max(0.0, self.start_time - self.scheduled_time) if self.scheduled_time else 0.0


def normalize_base_url(url: str) -> str:
    """An OpenAI base URL ends in /v1; accept a bare host:port too."""
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    path = parts.path.rstrip("/")
    for suffix in ("/chat/completions", "/completions"):  # a full route pasted in by mistake
        if path.endswith(suffix):
            path = path[: -len(suffix)]
            break
    if not path:
        path = "/v1"
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def metrics_url(base_url: str) -> str:
    """Prometheus /metrics lives at the server root, not under /v1."""
    parts = urlsplit(normalize_base_url(base_url))
    return urlunsplit((parts.scheme, parts.netloc, "/metrics", "", ""))


def _text_of(body: dict | None) -> str:
    parts = []
    for c in (body or {}).get("choices") or ():
        msg = c.get("message")
        parts.append((msg.get("content") or "") if isinstance(msg, dict) else (c.get("text") or ""))
    return "".join(parts)


class LoadClient:
    """Sends ``BenchRequest``s through one client backend and makes each answer a ``RequestRecord``."""

    _ids = itertools.count()

    def __init__(self, backend: Backend, name: str, model: str = "", temperature: float = 0.0,
                 extra_body: dict | None = None,
                 discover_model: Callable[[], Any] | None = None) -> None:
        self.backend = backend
        self.name = name
        self.model = model
        self.temperature = temperature
        self.extra_body = extra_body or {}
        self._discover_model = discover_model  # async () -> list of served model ids

    async def __aenter__(self) -> Self:
        if not self.model and self._discover_model is not None:
            served = await self._discover_model()
            self.model = served[0] if served else "default"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.backend.close()

    def request(self, req: BenchRequest) -> Request:
        """The OpenAI request of a bench request: chat for messages, a completion for a bare prompt."""
        body: dict[str, Any] = {"max_tokens": req.max_tokens, "temperature": self.temperature,
                                "stream": True, "stream_options": {"include_usage": True}}
        if self.model:
            body["model"] = self.model
        if req.ignore_eos:
            body["ignore_eos"] = True
        body.update(req.extra)
        body.update(self.extra_body)
        if req.messages is not None:
            body["messages"] = req.messages
            kind = "chat"
        else:
            body["prompt"] = req.prompt
            kind = "completion"
        return Request(f"{req.request_id}#{next(self._ids)}", kind, body)

    async def send(self, req: BenchRequest) -> RequestRecord:
        res = await self.backend.call(self.request(req))
        return _record(req, res)


def _record(req: BenchRequest, res: CallResult) -> RequestRecord:
    rec = RequestRecord(request_id=req.request_id, prompt_len=req.prompt_len, status=res.status_code or None,
                        start_time=res.sent_at, latency=res.e2e_s, retry_after=res.retry_after,
                        server_queue_time=res.queue_time_s, chunk_times=list(res.chunk_times or ()))
    if res.chunk_times:
        rec.ttft = res.chunk_times[0] - res.sent_at
        rec.itl = [b - a for a, b in itertools.pairwise(res.chunk_times)]
    if res.connect_s is not None:
        rec.new_connection, rec.connect_time = True, res.connect_s
    if not res.ok:
        rec.error = f"{res.error_kind}: {res.error_message}"
        return rec
    if not rec.chunk_times:
        rec.error = "the answer carried no text"
        return rec
    rec.success = True
    rec.generated_text = _text_of(res.body)
    rec.output_tokens = res.completion_tokens or len(rec.chunk_times)  # no usage: one token per chunk
    rec.prompt_len = res.prompt_tokens or rec.prompt_len
    rec.cached_tokens = res.cached_tokens
    return rec


def http_load_client(base_url: str, model: str | None = None, api_key: str | None = None, max_connections: int = 0,
                     fresh_connections: bool = False, temperature: float = 0.0, timeout_s: float = 6 * 3600,
                     extra_body: dict | None = None) -> LoadClient:
    """Streams chat/completions (or completions for a bare prompt) from an OpenAI-compatible server.
    Without ``model``, the first model the server lists is used."""
    from carpool.client.http_backend import HttpBackend

    key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY", "")
    # Under overload a server may hold the first byte for minutes: only the whole request is bounded.
    backend = HttpBackend([normalize_base_url(base_url)], api_key=key or None,
                          timeouts=Timeouts(connect_s=timeout_s, read_s=timeout_s, total_s=timeout_s),
                          max_connections=max_connections, fresh_connections=fresh_connections, record_chunks=True)
    return LoadClient(backend, "openai", model or "", temperature, extra_body, discover_model=backend.list_models)


def engine_load_client(engine: Any, temperature: float = 0.0) -> LoadClient:
    """Drives an in-process engine (an ``EngineClient``) through the in-process backend."""
    from carpool.client.engine_backend import EngineBackend

    backend = EngineBackend(engine, record_chunks=True)
    return LoadClient(backend, "carpool-engine", backend.model_name, temperature)


@dataclass
class BenchRun:
    """One load level: every request's record plus how the load was offered."""

    records: list[RequestRecord]
    duration: float
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    start_time: float = 0.0
    label: str = ""


async def run_benchmark(
    backend: LoadClient,
    requests: list[BenchRequest],
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    seed: int | None = 0,
    on_done: Callable[[RequestRecord], None] | None = None,
    label: str = "",
) -> BenchRun:
    """Offer ``requests`` at ``request_rate`` (gamma/Poisson gaps), at most ``max_concurrency``
    in flight, and wait for all of them.  Duration runs from the first send slot to the last
    response, as in vLLM."""
    offsets = arrival_offsets(len(requests), request_rate, burstiness, seed)
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    start = time.perf_counter()

    async def one(req: BenchRequest, offset: float) -> RequestRecord:
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        released = time.perf_counter()
        if slots is None:
            rec = await backend.send(req)
        else:
            async with slots:
                rec = await backend.send(req)
        rec.scheduled_time = released
        if on_done is not None:
            on_done(rec)
        return rec

    records = await asyncio.gather(*(one(r, float(o)) for r, o in zip(requests, offsets, strict=False)))
    duration = time.perf_counter() - start
    return BenchRun(
        records=list(records),
        duration=duration,
        request_rate=request_rate,
        burstiness=burstiness,
        max_concurrency=max_concurrency,
        start_time=start,
        label=label,
    )
