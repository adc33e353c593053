"""A small OpenAI-shaped HTTP server that injects faults on purpose.

It answers ``/v1/chat/completions``, ``/v1/completions`` (streaming or not) and
``/v1/embeddings`` with made-up but well-formed responses, and can be told to
misbehave: 429 with Retry-After, 500/503, connection resets before or after the
request body was read, stalls past the client's read timeout, truncated SSE
streams, invalid JSON, and a capacity limit that 429s everything past N requests
in flight.  It counts what it saw per custom_id (``X-Carpool-Custom-Id`` header, percent-encoded,
else the body's hash) so tests can assert "this was not sent twice".

Start it in-process (``async with FaultServer(cfg) as srv``), in a background
thread (``ThreadedFaultServer``, for sync tests) or as a separate process
(``python -m carpool.testing.fault_server --port 0``, for benchmarks).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import random
import time
import urllib.parse
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from aiohttp import web

from .local_site import LocalAppServer
from .threaded import ThreadedServer

FAULT_KINDS = (
    "429", "500", "502", "503", "400",
    "reset_before_body",  # close the socket before reading the request body
    "reset_after_body",  # read (and count) the body, then close without answering
    "stall",  # sleep ``stall_s`` before answering (past the client's read timeout)
    "stall_mid_stream",  # send some chunks, then sleep ``stall_s``
    "truncate",  # stream part of the answer, then close without ``[DONE]``
    "error_mid_stream",  # stream part of the answer, then an in-band ``{"error": ...}`` event and ``[DONE]``
    "invalid_json",  # 200 with a body that is not JSON
    # a stream that sends only SSE comments (": keep-alive") for ``stall_s``: no read timeout
    # fires, so only the client's total timeout (or its stop) ends it; not streamed: a stall
    "keepalive_only",
)


@dataclass
class Fault:
    """One misbehaviour.  Applies to requests whose custom_id or body contains ``match``
    (all requests when empty), ``times`` times (0: forever) or with probability ``rate``."""

    kind: str
    times: int = 1
    match: str = ""
    rate: float | None = None
    retry_after: float | None = None  # seconds, for 429/503
    stall_s: float = 5.0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; one of {', '.join(FAULT_KINDS)}")


@dataclass
class FaultConfig:
    latency_s: float = 0.0  # before the first token / the response
    token_latency_s: float = 0.0  # between streamed tokens
    completion_tokens: int | None = None  # None: the request's max_tokens (capped at 16)
    capacity: int | None = None  # 429 past this many requests in flight
    capacity_retry_after: float | None = 0.05
    # At most this many answered at once; the rest wait their turn in arrival order, as in a
    # batching server past its batch (which queues instead of refusing).
    serve_at_once: int | None = None
    # At most this many in their ``latency_s`` (the prefill) at once; the rest wait for their
    # first token in arrival order while the earlier ones stream on, as in a batching server
    # whose prefill is the bottleneck (first bytes come late and one by one, answers later).
    prefill_at_once: int | None = None
    faults: list[Fault] = field(default_factory=list)
    embedding_dim: int = 8
    seed: int = 0
    zero_latency: bool = False  # smallest possible answers, no sleeps: for client overhead
    # What /v1/models lists (a name, or a whole model card) and the only models a request may
    # name (404 model_not_found otherwise), as a real server does.  None: no /v1/models (404)
    # and any model name is accepted, as some gateways do.
    models: list[str | dict] | None = None
    # Headers (case-insensitive names) and query parameters every request must carry, else a
    # 401 naming what was missing (as OpenAI and Azure refuse a missing or wrong key).
    require_headers: dict[str, str] = field(default_factory=dict)
    require_query: dict[str, str] = field(default_factory=dict)
    # Answer with the last user message (or the prompt) as it is, finish_reason "stop": a
    # model that says what the test wrote (e.g. the JSON a structured-output test needs).
    echo: bool = False
    # A prefix cache of this many blocks (64 characters of the prompt each, least recently
    # used out): answers then report usage.prompt_tokens_details.cached_tokens as vLLM does,
    # and prefix_queries / prefix_hits count prompt tokens as vLLM's /metrics counters do.
    prefix_cache_blocks: int | None = None
    # A vLLM-style /metrics page publishing this KV cache (vllm:cache_config_info, blocks of
    # 16 tokens) and the prefix-cache counters; None: no /metrics (404).
    kv_cache_tokens: int | None = None

    @classmethod
    def zero(cls) -> FaultConfig:
        return cls(zero_latency=True)


class FaultServer(LocalAppServer):
    def __init__(self, config: FaultConfig | None = None, host: str = "127.0.0.1", port: int = 0):
        super().__init__(host, port)
        self.config = config or FaultConfig()
        self._rng = random.Random(self.config.seed)
        self._fault_left = [f.times for f in self.config.faults]
        self._turns: asyncio.Semaphore | None = None  # serve_at_once
        self._prefill_turns: asyncio.Semaphore | None = None  # prefill_at_once
        self.reset_counts()

    def _words(self, body: dict, key: str, n: int) -> list[str]:
        """The answer's pieces: made-up words (from the key), or what the request said (``echo``)."""
        return [_said(body)] if self.config.echo else _words(key, n)

    # -- counters -------------------------------------------------------------------------
    def reset_counts(self) -> None:
        self.seen: Counter[str] = Counter()  # custom_id (or body hash) -> requests received
        self.order: list[str] = []  # keys in arrival order (first 100k)
        self.completed: Counter[str] = Counter()  # answered with a 200
        self.faults_injected: Counter[str] = Counter()
        self.status_counts: Counter[int] = Counter()
        self.in_flight = 0
        self.max_in_flight = 0
        self.total_requests = 0
        # What was received, for tests that check what a client sent (the first 1000):
        # {"method", "path", "query", "headers", "body"}.
        self.received: list[dict] = []
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def counts(self) -> dict:
        return {
            "total_requests": self.total_requests,
            "seen": dict(self.seen),
            "completed": dict(self.completed),
            "faults_injected": dict(self.faults_injected),
            "status_counts": {str(k): v for k, v in self.status_counts.items()},
            "max_in_flight": self.max_in_flight,
        }

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    # -- lifecycle ------------------------------------------------------------------------
    # Load tests open many connections at once; the default backlog would refuse some.
    _backlog = 1024

    def _app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_post("/v1/completions", self._handle)
        app.router.add_post("/v1/embeddings", self._handle)
        # Azure OpenAI's deployment-style paths (the deployment is in the URL, ?api-version=...).
        for kind in ("chat/completions", "completions", "embeddings"):
            app.router.add_post(f"/openai/deployments/{{deployment}}/{kind}", self._handle)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/openai/models", self._models)
        app.router.add_get("/stats", self._stats)
        app.router.add_get("/metrics", self._metrics)
        return app

    # -- handlers -------------------------------------------------------------------------
    def _cards(self) -> list[dict]:
        return [m if isinstance(m, dict) else {"id": m, "object": "model", "owned_by": "fault-server"}
                for m in self.config.models or []]

    async def _metrics(self, request: web.Request) -> web.Response:
        kv = self.config.kv_cache_tokens
        if kv is None:
            return web.Response(status=404, text="no /metrics here")
        refused = self._auth_problem(request)
        if refused is not None:
            return refused
        info = f'block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="{kv // 16}"'
        lines = ["# TYPE vllm:cache_config_info gauge", f"vllm:cache_config_info{{{info}}} 1.0",
                 "# TYPE vllm:num_requests_running gauge", f'vllm:num_requests_running{{engine="0"}} {self.in_flight}',
                 "# TYPE vllm:prefix_cache_queries counter",
                 f'vllm:prefix_cache_queries_total{{engine="0"}} {self.prefix_queries}',
                 "# TYPE vllm:prefix_cache_hits counter",
                 f'vllm:prefix_cache_hits_total{{engine="0"}} {self.prefix_hits}']
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _models(self, request: web.Request) -> web.Response:
        refused = self._auth_problem(request)
        if refused is not None:
            return refused
        if self.config.models is None:
            return self._error(404, "no /v1/models here", None)
        return web.json_response({"object": "list", "data": self._cards()})

    def _auth_problem(self, request: web.Request) -> web.Response | None:
        for name, value in self.config.require_headers.items():
            if request.headers.get(name) != value:
                return self._error(401, f"header {name} missing or wrong", None)
        for name, value in self.config.require_query.items():
            if request.query.get(name) != value:
                return self._error(401, f"query parameter {name} missing or wrong", None)
        return None

    def _record(self, request: web.Request, raw: bytes) -> None:
        if len(self.received) >= 1000:
            return
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        self.received.append({"method": request.method, "path": request.path, "query": dict(request.query),
                              "headers": dict(request.headers), "body": body})

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.counts())

    def _pick_fault(self, key: str, raw: bytes | None) -> Fault | None:
        for i, f in enumerate(self.config.faults):
            if f.kind == "reset_before_body":
                continue
            if f.match and f.match not in key and (raw is None or f.match.encode() not in raw):
                continue
            if self._fires(i, f):
                return f
        return None

    def _fires(self, i: int, f: Fault) -> bool:
        """Whether matching fault ``i`` acts on this request: by its rate, always (times=0),
        or while it has times left."""
        if f.rate is not None:
            return self._rng.random() < f.rate
        if f.times == 0:
            return True
        if self._fault_left[i] > 0:
            self._fault_left[i] -= 1
            return True
        return False

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.total_requests += 1
        cid = urllib.parse.unquote(request.headers.get("X-Carpool-Custom-Id", ""))  # the client encodes it
        # Faults that act before the body is read can only match on the custom_id.
        early = self._pick_early_fault(cid)
        if early is not None:
            self.faults_injected[early.kind] += 1
            _abort_connection(request)
            return web.Response(status=499)
        raw = await request.read()
        self._record(request, raw)
        refused = self._auth_problem(request)
        if refused is not None:
            return refused
        key = cid or "body:" + hashlib.sha256(raw).hexdigest()[:16]
        self.seen[key] += 1
        if len(self.order) < 100_000:
            self.order.append(key)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._answer(request, raw, key)
        except ConnectionResetError:  # the client went away mid-answer: nothing to report
            return web.Response(status=499)
        finally:
            self.in_flight -= 1

    def _pick_early_fault(self, cid: str) -> Fault | None:
        for i, f in enumerate(self.config.faults):
            if f.kind != "reset_before_body" or (f.match and f.match not in cid):
                continue
            if self._fires(i, f):
                return f
        return None

    async def _answer(self, request: web.Request, raw: bytes, key: str) -> web.StreamResponse:
        cfg = self.config
        if cfg.capacity is not None and self.in_flight > cfg.capacity:
            return self._error(429, "over capacity", cfg.capacity_retry_after)
        if cfg.serve_at_once is not None:
            if self._turns is None:
                self._turns = asyncio.Semaphore(cfg.serve_at_once)  # made on the server's own loop
            async with self._turns:
                return await self._answer_now(request, raw, key)
        return await self._answer_now(request, raw, key)

    async def _answer_now(self, request: web.Request, raw: bytes, key: str) -> web.StreamResponse:
        cfg = self.config
        fault = self._pick_fault(key, raw)
        if fault is not None and fault.kind != "reset_before_body":
            self.faults_injected[fault.kind] += 1
            if fault.kind in ("429", "503"):
                return self._error(int(fault.kind), "injected", fault.retry_after)
            if fault.kind in ("500", "502", "400"):
                return self._error(int(fault.kind), "injected", None)
            if fault.kind == "reset_after_body":
                _abort_connection(request)
                return web.Response(status=499)
            if fault.kind == "stall" or (fault.kind == "keepalive_only" and not _wants_stream(raw)):
                await asyncio.sleep(fault.stall_s)
            if fault.kind == "invalid_json":
                self.status_counts[200] += 1
                return web.Response(status=200, text="{not json", content_type="application/json")
        try:
            body = json.loads(raw)
        except ValueError:
            return self._error(400, "request body is not JSON", None)
        if cfg.models is not None and "deployment" not in request.match_info \
                and body.get("model") not in {c["id"] for c in self._cards()}:
            return self._error(404, f"The model {body.get('model')!r} does not exist", None)
        path = request.path
        if cfg.latency_s and not cfg.zero_latency:
            await self._prefill(cfg.latency_s)
        if path.endswith("/embeddings"):
            return self._embeddings(body, key)
        n_tokens = cfg.completion_tokens or min(int(body.get("max_tokens") or 16), 16)
        if cfg.zero_latency:
            n_tokens = 1
        chat = path.endswith("/chat/completions")
        if body.get("stream"):
            return await self._stream(request, body, key, n_tokens, chat, fault)
        if cfg.token_latency_s and not cfg.zero_latency:
            await asyncio.sleep(cfg.token_latency_s * n_tokens)
        text = " ".join(self._words(body, key, n_tokens))
        usage = self._usage(body, n_tokens)
        finish = "stop" if cfg.echo else "length"
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
            out = {"id": "chatcmpl-" + key[-12:], "object": "chat.completion", "created": int(time.time()),
                   "model": body.get("model", "fault-model"), "choices": [choice], "usage": usage}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish}
            out = {"id": "cmpl-" + key[-12:], "object": "text_completion", "created": int(time.time()),
                   "model": body.get("model", "fault-model"), "choices": [choice], "usage": usage}
        self.completed[key] += 1
        self.status_counts[200] += 1
        return web.json_response(out)

    async def _prefill(self, seconds: float) -> None:
        if self.config.prefill_at_once is None:
            await asyncio.sleep(seconds)
            return
        if self._prefill_turns is None:
            self._prefill_turns = asyncio.Semaphore(self.config.prefill_at_once)  # on the server's loop
        async with self._prefill_turns:
            await asyncio.sleep(seconds)

    def _embeddings(self, body: dict, key: str) -> web.Response:
        inputs = body.get("input")
        inputs = inputs if isinstance(inputs, list) else [inputs]
        data = []
        for i, text in enumerate(inputs):
            h = hashlib.sha256(str(text).encode()).digest()
            vec = [(b - 128) / 128 for b in h[: self.config.embedding_dim]]
            data.append({"object": "embedding", "index": i, "embedding": vec})
        tokens = sum(max(1, len(str(t)) // 4) for t in inputs)
        self.completed[key] += 1
        self.status_counts[200] += 1
        return web.json_response({"object": "list", "data": data, "model": body.get("model", "fault-model"),
                                  "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    async def _stream(self, request: web.Request, body: dict, key: str, n_tokens: int, chat: bool,
                      fault: Fault | None) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        cid = ("chatcmpl-" if chat else "cmpl-") + key[-12:]
        model = body.get("model", "fault-model")
        words = self._words(body, key, n_tokens)
        if fault is not None and fault.kind == "keepalive_only":
            end = time.monotonic() + fault.stall_s
            while time.monotonic() < end:
                await resp.write(b": keep-alive\n\n")
                await asyncio.sleep(min(0.5, max(0.0, end - time.monotonic())))
        for i, w in enumerate(words):
            if fault is not None and fault.kind in ("truncate", "stall_mid_stream", "error_mid_stream") \
                    and i == max(1, n_tokens // 2):
                if fault.kind == "truncate":
                    _abort_connection(request)
                    return resp
                if fault.kind == "error_mid_stream":  # as vLLM and OpenAI report a failure after the headers
                    err = {"error": {"message": "injected failure mid-stream", "type": "server_error", "code": 500}}
                    await resp.write(b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n")
                    await resp.write_eof()
                    self.status_counts[200] += 1
                    return resp
                await asyncio.sleep(fault.stall_s)
            piece = w if i == 0 else " " + w
            if chat:
                delta = {"content": piece} if i else {"role": "assistant", "content": piece}
                choice = {"index": 0, "delta": delta, "finish_reason": None}
                chunk = {"id": cid, "object": "chat.completion.chunk", "model": model, "choices": [choice]}
            else:
                chunk = {"id": cid, "object": "text_completion", "model": model,
                         "choices": [{"index": 0, "text": piece, "finish_reason": None}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if self.config.token_latency_s and not self.config.zero_latency:
                await asyncio.sleep(self.config.token_latency_s)
        finish = "stop" if self.config.echo else "length"
        last_choice = ({"index": 0, "delta": {}, "finish_reason": finish} if chat
                       else {"index": 0, "text": "", "finish_reason": finish})
        last = {"id": cid, "object": "chat.completion.chunk" if chat else "text_completion", "model": model,
                "choices": [last_choice]}
        await resp.write(b"data: " + json.dumps(last).encode() + b"\n\n")
        if (body.get("stream_options") or {}).get("include_usage"):
            usage_chunk = {"id": cid, "object": last["object"], "model": model, "choices": [],
                           "usage": self._usage(body, n_tokens)}
            await resp.write(b"data: " + json.dumps(usage_chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        self.completed[key] += 1
        self.status_counts[200] += 1
        return resp

    def _usage(self, body: dict, n_tokens: int) -> dict:
        usage = _usage(body, n_tokens)
        size = self.config.prefix_cache_blocks
        if size is None:
            return usage
        text = json.dumps(body.get("messages") or body.get("prompt") or "")
        h, matched, hit = 0, 0, True
        for i in range(0, len(text) - 63, 64):  # whole blocks only, as a paged KV cache
            h = hash((h, text[i:i + 64]))
            if hit and h in self._blocks:
                matched += 64
            else:
                hit = False
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > size:
            self._blocks.popitem(last=False)
        cached = min(matched // 4, usage["prompt_tokens"])
        self.prefix_queries += usage["prompt_tokens"]
        self.prefix_hits += cached
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    def _error(self, status: int, message: str, retry_after: float | None) -> web.Response:
        self.status_counts[status] += 1
        headers = {"Retry-After": f"{retry_after:g}"} if retry_after is not None else {}
        err = {"error": {"message": message, "type": "fault_injected", "code": status}}
        return web.json_response(err, status=status, headers=headers)


def _wants_stream(raw: bytes) -> bool:
    try:
        return bool(json.loads(raw).get("stream"))
    except (ValueError, AttributeError):
        return False


def _abort_connection(request: web.Request) -> None:
    transport = request.transport
    if transport is not None:
        transport.abort()  # RST-like: the client sees a reset / server disconnect


def _said(body: dict) -> str:
    """The last user message's text, or the prompt (``FaultConfig.echo``)."""
    for m in reversed(body.get("messages") or []):
        if isinstance(m, dict) and m.get("role") == "user" and isinstance(m.get("content"), str):
            return m["content"]
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else ""


def _words(key: str, n: int) -> list[str]:
    vocab = ("positive", "negative", "neutral", "yes", "no", "maybe", "ok", "done")
    h = int(hashlib.md5(key.encode()).hexdigest()[:8], 16)
    return [vocab[(h + i) % len(vocab)] for i in range(n)]


def _usage(body: dict, n_tokens: int) -> dict:
    text = json.dumps(body.get("messages") or body.get("prompt") or "")
    prompt = max(1, len(text) // 4)
    return {"prompt_tokens": prompt, "completion_tokens": n_tokens, "total_tokens": prompt + n_tokens}


class ThreadedFaultServer(ThreadedServer):
    """The fault server on its own event loop in a daemon thread (for sync tests/subprocesses)."""

    def __init__(self, config: FaultConfig | None = None):
        super().__init__(FaultServer(config))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="OpenAI-shaped fault-injecting server")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--zero-latency", action="store_true")
    p.add_argument("--latency", type=float, default=0.0)
    p.add_argument("--token-latency", type=float, default=0.0)
    p.add_argument("--capacity", type=int, default=None)
    p.add_argument("--retry-after", type=float, default=0.05)
    a = p.parse_args(argv)
    cfg = FaultConfig(latency_s=a.latency, token_latency_s=a.token_latency, capacity=a.capacity,
                      capacity_retry_after=a.retry_after, zero_latency=a.zero_latency)

    async def serve() -> None:
        srv = FaultServer(cfg, port=a.port)
        url = await srv.start()
        print(json.dumps({"url": url, "port": srv.port}), flush=True)
        while True:
            await asyncio.sleep(3600)

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())


if __name__ == "__main__":
    main()
