"""An OpenAI-compatible HTTP server whose timings are scripted, for benchmark and diagnose tests.

It streams SSE chunks at known times (TTFT, then a list of gaps), and can be built to behave
like the servers diagnose must recognise: unlimited capacity (the client is the bottleneck),
a fixed number of request slots with a FIFO queue behind them (server queueing), a request
rate past which it answers 429, and a cost charged to the first request on every new TCP
connection (a TLS handshake stand-in).  It exposes a vLLM-style Prometheus ``/metrics`` page
(num_requests_running/waiting, kv_cache_usage_perc, queue-time histogram, prefix cache counters)
and records what it did for every request, with ``time.perf_counter()`` stamps that share the
clock of a client in the same process.

Use it from a test either in a background thread (``with ScriptedServer(script) as srv:``) or
in the test's own event loop (``async with ScriptedServer(script) as srv:``); ``srv.url`` is the
OpenAI base URL (``http://127.0.0.1:PORT/v1``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from aiohttp import web

from carpool.compat import Self

from .local_site import LocalSite

QUEUE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class Script:
    ttft_s: float = 0.02  # service start -> first content chunk
    itl_s: float | Sequence[float] = 0.01  # gap(s) between content chunks; a list is used in order
    num_chunks: int | None = None  # None: ceil(max_tokens / tokens_per_chunk)
    tokens_per_chunk: int = 1
    prompt_tokens: int | None = None  # None: whitespace words of the prompt
    capacity: int | None = None  # requests in service at once; the rest queue FIFO
    rate_limit_rps: float | None = None  # token bucket; past it: 429 with Retry-After
    rate_limit_burst: float = 1.0
    new_connection_delay_s: float = 0.0  # charged once per new TCP connection
    # Pause between ``[DONE]`` and the end of the chunked body: what a busy server (or proxy)
    # does at random; a client that stops reading at ``[DONE]`` then cannot reuse the connection.
    eof_delay_s: float = 0.0
    role_chunk: bool = False  # send an OpenAI-style role-only delta at once (no text)
    expose_metrics: bool = True
    prefix_hit_rate: float = 0.0  # fraction of prompt tokens reported as prefix-cache hits
    # Batching cost: every gap (and the TTFT) is stretched by 1 + k * (requests in service - 1),
    # the way a decode step slows as the batch grows on a compute-bound engine.
    slowdown_per_running: float = 0.0
    # The same for the TTFT only: prefill work that grows with the batch, decode unaffected.
    prefill_slowdown_per_running: float = 0.0
    # Reported kv_cache_usage_perc when all ``capacity`` slots are busy; 1.0 makes the slots look
    # like KV-cache blocks running out (a memory-bound server), 0.5 like a max_num_seqs cap.
    kv_usage_at_capacity: float = 0.5
    # A batching engine admits new requests between its steps: each one waits for the next
    # multiple of this (counted as waiting, with its queue time), however many slots are free.
    admit_every_s: float = 0.0
    # What /metrics states as the engine's batch limit (carpool:max_num_seqs); None: not stated.
    max_num_seqs: int | None = None
    # Per-request override: (request index, body) -> (ttft_s, [gap_s, ...]); len(gaps)+1 chunks.
    timing: Callable[[int, dict], tuple[float, list[float]]] | None = None


@dataclass
class Served:
    """What the server did for one request."""

    index: int
    arrival: float
    status: int = 200
    service_start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    end: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    new_connection: bool = False
    body: dict = field(default_factory=dict)


class ScriptedServer:
    def __init__(
        self, script: Script | None = None, host: str = "127.0.0.1", model: str = "scripted"
    ) -> None:
        self.script = script or Script()
        self.host = host
        self.model = model
        self.port = 0
        self.served: list[Served] = []
        self.running = 0
        self.waiting = 0
        self.peak_running = 0
        self.peak_in_flight = 0
        self._queue_times: list[float] = []
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._seen_peers: set[object] = set()  # (host, port) of each connection seen, None when unknown
        self._bucket = self.script.rate_limit_burst
        self._bucket_t = time.perf_counter()
        self._slots: asyncio.Semaphore | None = None
        self._site = LocalSite()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def root(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ---- lifecycle -------------------------------------------------------------------------

    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_get("/v1/models", self._models)
        if self.script.expose_metrics:
            app.router.add_get("/metrics", self._metrics)
        return app

    async def start_async(self) -> None:
        if self.script.capacity:
            self._slots = asyncio.Semaphore(self.script.capacity)
        self.port = await self._site.open(self._app(), self.host, 0)

    async def stop_async(self) -> None:
        await self._site.close()

    async def __aenter__(self) -> Self:
        await self.start_async()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop_async()

    def start(self) -> Self:
        """Serve from a background thread with its own event loop."""
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self.start_async())
            except OSError as e:  # e.g. no free port; surfaced to the caller below
                errors.append(e)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self.stop_async())
            loop.close()

        self._thread = threading.Thread(target=run, name="scripted-server", daemon=True)
        self._thread.start()
        ready.wait(10)
        if errors:
            raise errors[0]
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- behaviour -------------------------------------------------------------------------

    def _take_token(self) -> float | None:
        """Token bucket; returns None when admitted, else seconds until the next token."""
        rate = self.script.rate_limit_rps
        if not rate:
            return None
        now = time.perf_counter()
        self._bucket = min(self.script.rate_limit_burst, self._bucket + (now - self._bucket_t) * rate)
        self._bucket_t = now
        if self._bucket >= 1.0:
            self._bucket -= 1.0
            return None
        return (1.0 - self._bucket) / rate

    def _plan(self, index: int, body: dict) -> tuple[float, list[float]]:
        s = self.script
        if s.timing is not None:
            return s.timing(index, body)
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        n = s.num_chunks or max(1, -(-max_tokens // s.tokens_per_chunk))
        if isinstance(s.itl_s, (int, float)):
            gaps = [float(s.itl_s)] * (n - 1)
        else:
            gaps = [float(g) for g in list(s.itl_s)[: n - 1]]
            gaps += [gaps[-1] if gaps else 0.0] * (n - 1 - len(gaps))
        return s.ttft_s, gaps

    def _prompt_tokens(self, body: dict) -> int:
        if self.script.prompt_tokens is not None:
            return self.script.prompt_tokens
        if "messages" in body:
            return sum(len(str(m.get("content", "")).split()) for m in body["messages"])
        return len(str(body.get("prompt", "")).split())

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        peer = request.transport.get_extra_info("peername") if request.transport else None
        new_connection = peer not in self._seen_peers
        if new_connection:
            self._seen_peers.add(peer)
            if self.script.new_connection_delay_s:
                # Before the request "arrives", as a TLS handshake would be.
                await asyncio.sleep(self.script.new_connection_delay_s)
        arrival = time.perf_counter()
        rec = Served(index=len(self.served), arrival=arrival, new_connection=new_connection, body=body)
        self.served.append(rec)
        wait = self._take_token()
        if wait is not None:
            rec.status = 429
            rec.end = time.perf_counter()
            return web.json_response(
                {"error": {"message": "rate limit exceeded", "type": "rate_limit_error", "code": 429}},
                status=429,
                headers={"Retry-After": f"{wait:.3f}"},
            )
        self.waiting += 1
        self.peak_in_flight = max(self.peak_in_flight, self.running + self.waiting)
        if self._slots is not None:
            await self._slots.acquire()
        step = self.script.admit_every_s
        if step:
            await asyncio.sleep(step - time.perf_counter() % step)
        self.waiting -= 1
        self.running += 1
        self.peak_running = max(self.peak_running, self.running)
        rec.service_start = time.perf_counter()
        self._queue_times.append(rec.service_start - arrival)
        try:
            return await self._serve(request, body, rec)
        finally:
            self.running -= 1
            if self._slots is not None:
                self._slots.release()
            rec.end = time.perf_counter()

    async def _serve(self, request: web.Request, body: dict, rec: Served) -> web.StreamResponse:
        ttft, gaps = self._plan(rec.index, body)
        chat = request.path.endswith("/chat/completions")
        rec.prompt_tokens = self._prompt_tokens(body)
        self._prefix_queries += rec.prompt_tokens
        self._prefix_hits += int(rec.prompt_tokens * self.script.prefix_hit_rate)
        n_chunks = len(gaps) + 1
        per = self.script.tokens_per_chunk
        rec.completion_tokens = n_chunks * per
        usage = {
            "prompt_tokens": rec.prompt_tokens,
            "completion_tokens": rec.completion_tokens,
            "total_tokens": rec.prompt_tokens + rec.completion_tokens,
        }
        k = self.script.slowdown_per_running

        def stretch(t: float) -> float:
            return t * (1.0 + k * (self.running - 1))

        busy = self.running - 1
        targets = [
            rec.service_start + stretch(ttft) * (1.0 + self.script.prefill_slowdown_per_running * busy)
        ]
        for g in gaps:
            targets.append(targets[-1] + g)  # restretched live below when k > 0
        if not body.get("stream"):
            await asyncio.sleep(max(0.0, targets[-1] - time.perf_counter()))
            text = "tok " * rec.completion_tokens
            choice = {"index": 0, "finish_reason": "length"}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            return web.json_response(
                {"id": f"req-{rec.index}", "model": self.model, "choices": [choice], "usage": usage}
            )

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"

        async def send(choices: list[dict], extra: dict | None = None) -> None:
            data = {"id": f"req-{rec.index}", "object": obj, "model": self.model, "choices": choices}
            data.update(extra or {})
            await resp.write(b"data: " + json.dumps(data).encode() + b"\n\n")

        if chat and self.script.role_chunk:
            await send([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        for i, target in enumerate(targets):
            if k and i:
                target = rec.chunk_times[-1] + stretch(gaps[i - 1])
            delay = target - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            rec.chunk_times.append(time.perf_counter())  # stamped before the bytes leave
            text = "tok " * per
            await send(
                [
                    {"index": 0, "finish_reason": None}
                    | ({"delta": {"content": text}} if chat else {"text": text})
                ]
            )
        end: dict[str, object] = {"delta": {}} if chat else {"text": ""}
        await send([{"index": 0, "finish_reason": "length", **end}])
        if (body.get("stream_options") or {}).get("include_usage"):
            await send([], {"usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        if self.script.eof_delay_s:
            await asyncio.sleep(self.script.eof_delay_s)
        await resp.write_eof()
        return resp

    async def _metrics(self, request: web.Request) -> web.Response:
        label = f'{{model_name="{self.model}"}}'
        cap = self.script.capacity
        kv = self.script.kv_usage_at_capacity * self.running / cap if cap else min(0.5, 0.01 * self.running)
        lines = [
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{label} {self.running}",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{label} {self.waiting}",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{label} {kv}",
            "# TYPE vllm:prefix_cache_queries counter",
            f"vllm:prefix_cache_queries_total{label} {self._prefix_queries}",
            "# TYPE vllm:prefix_cache_hits counter",
            f"vllm:prefix_cache_hits_total{label} {self._prefix_hits}",
            "# TYPE vllm:request_queue_time_seconds histogram",
        ]
        qt = list(self._queue_times)
        for le in QUEUE_BUCKETS:
            count = sum(1 for q in qt if q <= le)
            lines.append(
                f'vllm:request_queue_time_seconds_bucket{{le="{le}",model_name="{self.model}"}} {count}'
            )
        lines.append(
            f'vllm:request_queue_time_seconds_bucket{{le="+Inf",model_name="{self.model}"}} {len(qt)}'
        )
        lines.append(f"vllm:request_queue_time_seconds_sum{label} {sum(qt)}")
        lines.append(f"vllm:request_queue_time_seconds_count{label} {len(qt)}")
        if self.script.max_num_seqs is not None:
            lines += ["# TYPE carpool:max_num_seqs gauge", f"carpool:max_num_seqs{label} {self.script.max_num_seqs}"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


def main() -> None:
    """``python -m carpool.testing.scripted_server [--capacity N] [--rate-limit R]``: serve until Ctrl-C."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--ttft", type=float, default=0.05)
    p.add_argument("--itl", type=float, default=0.01)
    p.add_argument("--capacity", type=int, default=None)
    p.add_argument("--rate-limit", type=float, default=None)
    a = p.parse_args()
    srv = ScriptedServer(Script(ttft_s=a.ttft, itl_s=a.itl, capacity=a.capacity, rate_limit_rps=a.rate_limit))
    with srv:
        print(srv.url, flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()


if __name__ == "__main__":
    main()
