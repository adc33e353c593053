"""Async load generator: sends a request set on an arrival schedule and records, per request,
the client-side timestamp of every streamed chunk.

Two backends share one record format, so metrics, reports and diagnose never care where
the tokens came from:

* ``HttpBackend``: any OpenAI-compatible server (vLLM, SGLang, OpenAI, ``carpool serve``),
  over one aiohttp session; streaming SSE with ``stream_options.include_usage`` so token
  counts are the server's.  ``fresh_connections=True`` opens a new TCP connection per
  request (what a client without a pool pays), and every record says how long connecting took.
* ``EngineBackend``: carpool's engine in-process through ``EngineClient.submit``.

Timing follows vLLM's ``bench serve``: ``start_time`` is taken just before the request is
sent (after the client's concurrency slot is granted), TTFT is the first chunk that carries
text, ITL is the gap between consecutive text chunks, and latency runs to the last data
message.  Unlike vLLM, chunks with no text (an OpenAI role-only first delta) are not
counted as tokens, so a server that sends the role at once cannot fake a fast TTFT.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, Self
from urllib.parse import urlsplit, urlunsplit

import aiohttp

from carpool.bench.arrivals import arrival_offsets
from carpool.bench.datasets import BenchRequest


@dataclass
class RequestRecord:
    """What the client saw of one request (times are ``time.perf_counter()`` seconds)."""

    request_id: str
    prompt_len: int
    success: bool = False
    status: int | None = None  # HTTP status; None for the in-process engine or a transport error
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


class Backend(Protocol):
    name: str
    model: str

    async def __aenter__(self) -> Self: ...

    async def __aexit__(self, *exc: object) -> None: ...

    async def send(self, req: BenchRequest) -> RequestRecord: ...


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


def _chunk_text(choice: dict) -> str:
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


class HttpBackend:
    """Streams chat/completions (or completions for a bare prompt) from an OpenAI-compatible server."""

    name = "openai"

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        api_key: str | None = None,
        max_connections: int = 0,
        fresh_connections: bool = False,
        temperature: float = 0.0,
        timeout_s: float = 6 * 3600,
        extra_body: dict | None = None,
    ) -> None:
        self.base_url = normalize_base_url(base_url)
        self.model = model or ""
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY", "")
        self.max_connections = max_connections
        self.fresh_connections = fresh_connections
        self.temperature = temperature
        self.timeout_s = timeout_s
        self.extra_body = extra_body or {}
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Self:
        trace = aiohttp.TraceConfig()
        trace.on_connection_create_start.append(self._on_connect_start)
        trace.on_connection_create_end.append(self._on_connect_end)
        connector = aiohttp.TCPConnector(
            limit=self.max_connections,
            limit_per_host=self.max_connections,
            force_close=self.fresh_connections,
        )
        self.session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            trace_configs=[trace],
        )
        if not self.model:
            self.model = await self._first_model()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def _on_connect_start(self, session: Any, ctx: Any, params: Any) -> None:
        if isinstance(ctx.trace_request_ctx, dict):
            ctx.trace_request_ctx["connect_start"] = time.perf_counter()

    async def _on_connect_end(self, session: Any, ctx: Any, params: Any) -> None:
        rc = ctx.trace_request_ctx
        if isinstance(rc, dict) and "connect_start" in rc:
            rc["connect_time"] = time.perf_counter() - rc["connect_start"]

    async def _first_model(self) -> str:
        assert self.session is not None
        try:
            async with self.session.get(self.base_url + "/models", headers=self._headers()) as r:
                if r.status == 200:
                    data = (await r.json()).get("data") or []
                    if data:
                        return str(data[0].get("id", ""))
        except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError):
            pass
        return "default"

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _payload(self, req: BenchRequest) -> tuple[str, dict]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": req.max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if req.ignore_eos:
            body["ignore_eos"] = True
        body.update(req.extra)
        body.update(self.extra_body)
        if req.messages is not None:
            body["messages"] = req.messages
            return self.base_url + "/chat/completions", body
        body["prompt"] = req.prompt
        return self.base_url + "/completions", body

    async def send(self, req: BenchRequest) -> RequestRecord:
        assert self.session is not None, "use `async with HttpBackend(...)`"
        url, body = self._payload(req)
        rec = RequestRecord(request_id=req.request_id, prompt_len=req.prompt_len)
        trace_ctx: dict[str, float] = {}
        text_parts: list[str] = []
        finished = False
        st = time.perf_counter()
        rec.start_time = st
        last = st
        try:
            async with self.session.post(
                url, json=body, headers=self._headers(), trace_request_ctx=trace_ctx
            ) as r:
                rec.status = r.status
                if r.status != 200:
                    rec.error = f"HTTP {r.status}: {(await r.text())[:300]}"
                    ra = r.headers.get("Retry-After")
                    if ra:
                        with contextlib.suppress(ValueError):
                            rec.retry_after = float(ra)
                else:
                    async for raw in r.content:
                        line = raw.strip()
                        if not line.startswith(b"data:"):
                            continue  # blank separators, SSE comments/pings, event names
                        payload = line[5:].strip()
                        if payload == b"[DONE]":
                            finished = True
                            break
                        ts = time.perf_counter()
                        data = json.loads(payload)
                        if "error" in data and not data.get("choices"):
                            rec.error = f"stream error: {json.dumps(data['error'])[:300]}"
                            break
                        last = ts
                        for choice in data.get("choices") or []:
                            finished = finished or bool(choice.get("finish_reason"))
                            text = _chunk_text(choice)
                            if text:
                                if not rec.chunk_times:
                                    rec.ttft = ts - st
                                else:
                                    rec.itl.append(ts - rec.chunk_times[-1])
                                rec.chunk_times.append(ts)
                                text_parts.append(text)
                                break
                        usage = data.get("usage")
                        if usage:
                            rec.output_tokens = int(usage.get("completion_tokens") or 0)
                            if usage.get("prompt_tokens"):
                                rec.prompt_len = int(usage["prompt_tokens"])
                            details = usage.get("prompt_tokens_details") or {}
                            rec.cached_tokens = int(details.get("cached_tokens") or 0)
                    if not rec.error:
                        if not finished:
                            # A cut stream is not a result, even with text in it (vLLM would count it).
                            rec.error = (
                                f"the stream ended before [DONE] or a finish_reason, "
                                f"after {len(rec.chunk_times)} text chunks"
                            )
                        elif rec.chunk_times:
                            rec.success = True
                        else:
                            rec.error = "the stream ended without any text chunk"
        except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError, OSError) as e:
            rec.error = f"{type(e).__name__}: {e}"
        rec.latency = last - st
        rec.generated_text = "".join(text_parts)
        if rec.success and not rec.output_tokens:
            rec.output_tokens = len(rec.chunk_times)  # no usage: one token per chunk, an estimate
        if "connect_time" in trace_ctx:
            rec.new_connection = True
            rec.connect_time = trace_ctx["connect_time"]
        return rec


class EngineBackend:
    """Drives an in-process engine (anything with the EngineClient ``submit``)."""

    name = "carpool-engine"
    _ids = itertools.count()

    def __init__(self, engine: Any, temperature: float = 0.0) -> None:
        self.engine = engine
        self.model = str(getattr(engine, "model_name", "engine"))
        self.temperature = temperature

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def send(self, req: BenchRequest) -> RequestRecord:
        from carpool.engine.protocol import EngineError, GenerateRequest, SamplingParams

        params = SamplingParams(
            temperature=self.temperature, max_tokens=req.max_tokens, ignore_eos=req.ignore_eos
        )
        greq = GenerateRequest(
            request_id=f"{req.request_id}#{next(self._ids)}",
            params=params,
            messages=req.messages,
            prompt=req.prompt,
        )
        rec = RequestRecord(request_id=req.request_id, prompt_len=req.prompt_len)
        st = time.perf_counter()
        rec.start_time = st
        last = st
        tokens = 0
        parts: list[str] = []
        try:
            async for delta in self.engine.submit(greq):
                ts = time.perf_counter()
                last = ts
                if delta.token_ids or delta.text:
                    if not rec.chunk_times:
                        rec.ttft = ts - st
                    else:
                        rec.itl.append(ts - rec.chunk_times[-1])
                    rec.chunk_times.append(ts)
                    tokens += len(delta.token_ids)
                    parts.append(delta.text)
                if delta.metrics and delta.metrics.get("queue_time_s") is not None:
                    rec.server_queue_time = float(delta.metrics["queue_time_s"])
                if delta.usage is not None:
                    rec.output_tokens = delta.usage.completion_tokens
                    rec.prompt_len = delta.usage.prompt_tokens or rec.prompt_len
                    rec.cached_tokens = delta.usage.cached_tokens
            rec.success = bool(rec.chunk_times)
            if not rec.success:
                rec.error = "the engine finished without producing a token"
        except EngineError as e:
            rec.error = f"EngineError: {e}"
        rec.latency = last - st
        rec.generated_text = "".join(parts)
        rec.output_tokens = rec.output_tokens or tokens
        return rec


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
    backend: Backend,
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
