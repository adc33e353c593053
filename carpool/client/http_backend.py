"""Calls an OpenAI-compatible endpoint over HTTP (carpool serve, vLLM, SGLang, OpenAI).

Generation requests stream by default (``stream: true`` with usage in the last chunk)
so TTFT and TPOT are measured per request; the streamed chunks are put back together
(``carpool/openai/accumulator.py``) into the body the server returns without streaming,
field for field, which is what the output file and the result cache hold.  An error sent
inside a 200 stream is an error, not a short answer.
Every failure is mapped to one error kind of ``retry.py``, together with whether the
request may already have run on the server.  Whether the endpoint answered at all goes to
its circuit breaker (``breaker.py``); while a breaker is open this backend probes the
endpoint until it answers again.  ``record_chunks=True`` (bench) also stamps
every chunk that carries text and the time spent opening a new connection, so TTFT and
ITL come from the same client code a batch job uses.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import json
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from carpool.client.affinity import Affinity, prefix_keys
from carpool.client.balancer import Balancer, Endpoint
from carpool.client.base import CallResult, Request
from carpool.client.breaker import NO_ANSWER, BreakerPolicy, OutageGate, State
from carpool.client.endpoints import EndpointSpec, auth_headers, plain_specs
from carpool.client.pool import Timeouts, make_session
from carpool.client.retry import ErrorKind, parse_retry_after
from carpool.client.sse_reader import SSEReader
from carpool.compat import timeout
from carpool.errors import EventTooLarge
from carpool.openai.accumulator import StreamAccumulator

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
_loads = json.loads


class HttpBackend:
    name = "http"
    engine_start_s: float | None = None  # no engine runs in this process
    engine_start_overlap_s: float | None = None
    engine_max_num_seqs: int | None = None

    def __init__(self, endpoints: list[str] | list[EndpointSpec] | None, model: str | None = None,
                 api_key: str | None = None, stream: bool = True, timeouts: Timeouts | None = None,
                 max_connections: int = 0, balancer: Balancer | None = None, breaker: BreakerPolicy | None = None,
                 *, fresh_connections: bool = False, record_chunks: bool = False, prefix_routing: bool = True):
        """``endpoints``: base URLs (``api_key`` as a Bearer token for all) or ``EndpointSpec``s
        (each with its own headers, model, dialect; ``api_key`` unused); ``model``: sent when a
        request names none and its endpoint has no model of its own; ``prefix_routing``: a
        request follows its prefix group's endpoint (``carpool.client.affinity``)."""
        if balancer is None:
            specs = [e if isinstance(e, EndpointSpec) else plain_specs([e], api_key)[0] for e in endpoints or []]
            balancer = Balancer(specs, breaker=breaker,
                                affinity=Affinity() if prefix_routing and len(specs) > 1 else None)
        self.balancer = balancer
        self.model = model
        self.stream = stream
        self.timeouts = timeouts or Timeouts()
        # per endpoint URL: time to the first byte of its last answers (see read_timeout)
        self._first_bytes: collections.defaultdict[str, collections.deque[float]] = \
            collections.defaultdict(lambda: collections.deque(maxlen=64))
        self._max_connections = max_connections
        self._fresh_connections = fresh_connections
        self.record_chunks = record_chunks
        self._session: aiohttp.ClientSession | None = None
        self._probe_session: aiohttp.ClientSession | None = None
        self._prober: asyncio.Task | None = None
        self._headers = {"Content-Type": "application/json"}
        # For endpoints of a balancer passed in as plain URLs (their specs carry no key).
        self._default_auth = auth_headers("openai", api_key)

    @property
    def gate(self) -> OutageGate:
        """Every endpoint's breaker as one: the executor waits here while all are down."""
        return self.balancer.gate

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            traces = [_connect_trace()] if self.record_chunks else None
            self._session = make_session(self._max_connections, self.timeouts,
                                         fresh_connections=self._fresh_connections, trace_configs=traces)
        return self._session

    def _spec(self, ep: Endpoint) -> EndpointSpec:
        assert ep.spec is not None  # Endpoint.__post_init__ gives every endpoint one
        return ep.spec

    def _auth(self, spec: EndpointSpec) -> dict[str, str]:
        """``spec``'s headers, with the backend's key when the spec brings none."""
        names = {k.lower() for k in spec.headers}
        if self._default_auth and not names & {"authorization", "api-key"}:
            return {**self._default_auth, **spec.headers}
        return spec.headers

    async def list_models(self) -> list[str]:
        """The model ids the first endpoint serves (``GET /models``); empty when it will not say."""
        spec = self._spec(self.balancer.endpoints[0])
        try:
            async with self.session.get(spec.models_url(), headers=self._auth(spec), params=spec.params) as r:
                if r.status != 200:
                    return []
                data = (await r.json(content_type=None)).get("data") or []
                return [str(m.get("id", "")) for m in data if isinstance(m, dict)]
        except (TimeoutError, asyncio.TimeoutError, aiohttp.ClientError, ValueError, AttributeError):
            return []

    async def close(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._prober
            self._prober = None
        for s in (self._session, self._probe_session):
            if s is not None:
                await s.close()
        self._session = self._probe_session = None

    def prepare_body(self, req: Request, spec: EndpointSpec | None = None) -> dict:
        """The body sent for ``req`` (to the endpoint of ``spec``: its model, its name for the
        token limit)."""
        body = req.body
        if spec is not None and spec.model and body.get("model") != spec.model:
            body = {**body, "model": spec.model}  # an endpoint's own model is what it is sent
        elif self.model and "model" not in body:
            body = {**body, "model": self.model}
        if req.kind == "embedding":
            return body
        if spec is not None:
            body = spec.prepare_limits(body)
        if self.stream and "stream" not in body:
            body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        elif body.get("stream") and not (body.get("stream_options") or {}).get("include_usage"):
            # A streamed answer without the usage chunk would be rebuilt without ``usage``,
            # unlike the same answer not streamed; usage costs one chunk.
            options = body.get("stream_options")
            if not isinstance(options, dict):
                options = {}
            body = {**body, "stream_options": {**options, "include_usage": True}}
        return body

    async def call(self, req: Request, *, prepared: object = None,
                   on_first_token: Callable[[], None] | None = None) -> CallResult:
        """One attempt (``Backend.call``); an HTTP request is prepared per endpoint, so
        ``prepared`` is never anything here."""
        keys = prefix_keys(req.body) if self.balancer.affinity is not None else ()
        ep = self.balancer.pick(req.est_tokens, keys)
        if ep.budget is not None:
            # The endpoint's own RPM/TPM (the job's is the executor's): counted as in flight
            # on it meanwhile, so the balancer sends the next requests elsewhere.
            await ep.budget.acquire(1, req.est_tokens)
        t0 = time.perf_counter()
        res = _Reply()
        firsts = self._first_bytes[ep.url]
        streamed_first = False

        def first_token() -> None:
            nonlocal streamed_first
            streamed_first = True
            # Kept as it comes, not when the answer ends: a batching server streams the first
            # tokens of a burst one by one long before any of its answers is whole, and those
            # are what show that the requests still waiting are queued, not lost.
            firsts.append(time.perf_counter() - t0)
            if on_first_token is not None:
                on_first_token()

        watch: _ReadWatch | None = None
        try:
            async with timeout(self.timeouts.total_s), timeout(None) as idle:
                watch = _ReadWatch(idle, self.timeouts.read_s, lambda: self.read_timeout(ep.url))
                try:
                    await self._call(self._spec(ep), req, res, t0, watch, first_token)
                finally:
                    watch.close()
        except (TimeoutError, asyncio.TimeoutError):
            if watch is not None and watch.fired:
                res.error_kind = ErrorKind.READ_TIMEOUT
                res.error_message = f"no data for {watch.waited:.3g}s"
                res.endpoint_fault = True
            elif res.error_kind is None:
                res.error_kind = ErrorKind.TOTAL_TIMEOUT
                res.error_message = f"no answer within {self.timeouts.total_s:g}s"
                res.endpoint_fault = True
        e2e_s = time.perf_counter() - t0
        if res.ok and res.ttft_s is not None and not streamed_first:
            firsts.append(res.ttft_s)  # not streamed: the whole answer is its first byte
        used = res.prompt_tokens + res.completion_tokens
        if ep.budget is not None and used and req.est_tokens:
            ep.budget.adjust(used - req.est_tokens)
        self.balancer.done(ep, res.ok, res.endpoint_fault)
        down = self._tell_breaker(ep, res)
        return res.result(endpoint=ep.url, sent_at=t0, e2e_s=e2e_s, endpoint_down=down)

    def read_timeout(self, url: str) -> float:
        """How long a request to ``url`` may go without a byte now: ``read_s``, or twice the
        slowest of the endpoint's last 64 first bytes when that is longer (at most ``total_s``);
        asked again each time the wait passes it (``_ReadWatch``).

        A server past its batch queues requests (vLLM, carpool serve; no 429), and a request
        behind a long queue waits longer than ``read_s`` for its first token: timed out, it
        would be sent again and its work done twice (measured: 49 of 120 long-prompt tasks at
        256 in flight against carpool serve).  The queue grows gradually, so the answers that
        came back meanwhile show how long one can take; a hung server sends nothing, so its
        requests still time out after ``read_s``."""
        seen = self._first_bytes.get(url)
        slowest = max(seen) if seen else 0.0
        return min(self.timeouts.total_s, max(self.timeouts.read_s, 2.0 * slowest))

    # -- circuit breakers -----------------------------------------------------------------
    def _tell_breaker(self, ep: Endpoint, res: _Reply) -> bool:
        """Tell ``ep``'s breaker whether it answered; whether the endpoint is down now."""
        if res.ok or res.status_code or res.error_kind not in NO_ANSWER:
            ep.breaker.on_answer()  # an HTTP answer of any status: the endpoint is there
            return False
        assert res.error_kind is not None
        ep.breaker.on_no_answer(res.error_kind, res.error_message)
        if ep.breaker.closed:
            return False
        if self._prober is None or self._prober.done():
            self._prober = asyncio.get_running_loop().create_task(self._probe_while_down())
        return True

    async def _probe_while_down(self) -> None:
        """Probe every open endpoint when its breaker says so, until all are closed."""
        while True:
            now = time.monotonic()
            down = [e for e in self.balancer.endpoints if not e.breaker.closed]
            if not down:
                return
            due = [e for e in down if e.breaker.probe_due(now)]
            if due:
                await asyncio.gather(*(self._probe(e) for e in due))
                continue
            waits = [e.breaker.next_probe - now for e in down if e.breaker.state == State.OPEN]
            await asyncio.sleep(max(0.01, min(waits, default=0.05)))

    async def _probe(self, ep: Endpoint) -> None:
        """``GET <base>/models`` on a fresh connection: any HTTP answer below 500 closes the breaker."""
        b = ep.breaker
        b.start_probe()
        if self._probe_session is None:
            # A connection of the pool may be one the outage killed: each probe opens its own.
            self._probe_session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                                        skip_auto_headers=("User-Agent",))
        spec = self._spec(ep)
        try:
            async with timeout(b.policy.probe_timeout_s), \
                    self._probe_session.get(spec.models_url(), headers=self._auth(spec),
                                            params=spec.params) as resp:
                status = resp.status
                await resp.read()
        except (TimeoutError, asyncio.TimeoutError, aiohttp.ClientError, OSError) as e:
            b.probe_failed(_why(e))
            return
        if status >= 500:
            b.probe_failed(f"probe GET /models: HTTP {status}")
        else:
            b.on_answer()

    async def _call(self, spec: EndpointSpec, req: Request, res: _Reply, t0: float, watch: _ReadWatch,
                    first_token: Callable[[], None] | None) -> None:
        body = self.prepare_body(req, spec)
        streaming = bool(body.get("stream"))
        headers = {**self._headers, **self._auth(spec), "X-Carpool-Custom-Id": custom_id_header(req.custom_id)}
        url = spec.request_url(req.path, body.get("model"))
        got_headers = False
        trace: dict[str, float] = {}
        try:
            async with self.session.post(url, data=_dumps(body), headers=headers, params=spec.params or None,
                                         trace_request_ctx=trace) as resp:
                got_headers = True
                watch.data()
                res.connect_s = trace.get("connect_s")
                res.status_code = resp.status
                res.request_id = resp.headers.get("x-request-id", "")
                if resp.status != 200:
                    await self._http_error(resp, res)
                    return
                ctype = resp.headers.get("Content-Type", "")
                if streaming and ctype.startswith("text/event-stream"):
                    await self._read_stream(resp, req, res, t0, watch, first_token)
                else:
                    raw = await resp.read()
                    res.ttft_s = time.perf_counter() - t0
                    try:
                        res.body = _loads(raw)
                    except ValueError:
                        res.error_kind = ErrorKind.BAD_RESPONSE
                        res.error_message = f"response is not JSON: {raw[:80]!r}"
                        return
                    if not isinstance(res.body, dict):
                        res.error_kind, res.error_message = ErrorKind.BAD_RESPONSE, "response is not a JSON object"
                        return
                    _take_usage(res, res.body.get("usage"))
                    res.ok = True
        except aiohttp.ClientConnectorError as e:  # refused, DNS, unreachable: never sent
            res.error_kind, res.error_message, res.endpoint_fault = ErrorKind.CONNECT, _connect_why(e), True
        except aiohttp.ConnectionTimeoutError as e:
            res.error_kind, res.error_message, res.endpoint_fault = ErrorKind.CONNECT, f"connect timeout: {e}", True
        except aiohttp.SocketTimeoutError:  # a socket read timeout a caller's session may set
            res.error_kind = ErrorKind.READ_TIMEOUT
            res.error_message = f"no data for {self.timeouts.read_s:g}s"
            res.endpoint_fault = True
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
                ConnectionResetError) as e:
            res.endpoint_fault = True
            if got_headers:
                res.error_kind, res.error_message = ErrorKind.TRUNCATED, f"connection dropped mid-response: {e!r}"
            else:
                res.error_kind, res.error_message = ErrorKind.RESET, f"connection dropped before a response: {e!r}"
        except aiohttp.ClientError as e:
            res.error_kind, res.error_message, res.endpoint_fault = ErrorKind.RESET, repr(e), True

    async def _http_error(self, resp: aiohttp.ClientResponse, res: _Reply) -> None:
        raw = await resp.read()
        try:
            res.body = _loads(raw)
        except ValueError:
            res.body = None
        msg = raw[:300].decode("utf-8", "replace")
        if isinstance(res.body, dict) and isinstance(res.body.get("error"), dict):
            msg = str(res.body["error"].get("message", msg))
        res.error_message = f"HTTP {resp.status}: {msg}"
        res.retry_after = parse_retry_after(resp.headers.get("Retry-After"))
        if resp.status == 429:
            res.error_kind = ErrorKind.RATE_LIMITED
        elif resp.status == 503:
            res.error_kind, res.endpoint_fault = ErrorKind.OVERLOADED, True
        elif resp.status >= 500:
            res.error_kind, res.endpoint_fault = ErrorKind.SERVER_ERROR, True
        else:
            res.error_kind = ErrorKind.CLIENT_ERROR

    async def _read_stream(self, resp: aiohttp.ClientResponse, req: Request, res: _Reply, t0: float,
                           watch: _ReadWatch, first_token: Callable[[], None] | None) -> None:
        acc = StreamAccumulator(chat=req.kind == "chat")
        sse = SSEReader()
        done = False
        if self.record_chunks:
            res.chunk_times = []
        try:
            async for data in resp.content.iter_any():
                watch.data()
                for payload in sse.feed(data):
                    done = self._take_event(payload, acc, res, t0, first_token)
                    if done or res.error_kind:
                        break
                if done or res.error_kind:
                    break
            else:
                for payload in sse.close():
                    done = self._take_event(payload, acc, res, t0, first_token)
                    if done or res.error_kind:
                        break
        except EventTooLarge as e:
            res.error_kind, res.error_message = ErrorKind.BAD_RESPONSE, str(e)
            return
        if res.error_kind:
            return
        if not done:
            res.error_kind, res.error_message = ErrorKind.TRUNCATED, "stream ended without [DONE]"
            res.endpoint_fault = True
            return
        res.body = acc.body()
        _take_usage(res, res.body.get("usage"))
        if res.completion_tokens == 0:
            res.completion_tokens = acc.pieces  # no usage chunk: count pieces (about one token each)
        res.ok = True
        await _drain(resp)

    @staticmethod
    def _take_event(payload: bytes, acc: StreamAccumulator, res: _Reply, t0: float,
                    first_token: Callable[[], None] | None = None) -> bool:
        """Folds one event into ``acc``; True at ``[DONE]``; sets ``res.error_*`` on a bad or error event."""
        payload = payload.strip()
        if payload == b"[DONE]":
            return True
        if not payload:
            return False
        try:
            chunk = _loads(payload)
        except ValueError:
            res.error_kind, res.error_message = ErrorKind.BAD_RESPONSE, f"stream chunk is not JSON: {payload[:80]!r}"
            return False
        if not isinstance(chunk, dict):
            res.error_kind = ErrorKind.BAD_RESPONSE
            res.error_message = f"stream chunk is not a JSON object: {payload[:80]!r}"
            return False
        if "error" in chunk and "choices" not in chunk:
            # An error after the 200 headers (OpenAI, vLLM and carpool serve send it in-band):
            # the answer so far is partial and must not pass for a whole one.
            _in_band_error(res, chunk["error"])
            return False
        if acc.has_content(chunk):
            now = time.perf_counter()
            if res.ttft_s is None:
                res.ttft_s = now - t0
                if first_token is not None:
                    first_token()  # the limiter counts the request as decoding from now on
            if res.chunk_times is not None:
                res.chunk_times.append(now)
        acc.add(chunk)
        return False


@dataclass(slots=True)
class _Reply:
    """What one attempt has got so far, filled in as its answer is read.  Mutable, unlike the
    ``CallResult`` it becomes: a timeout may cut the reading at any point, and what came
    before still counts (a status says the endpoint answered, a first token was timed)."""

    ok: bool = False
    status_code: int = 0
    body: dict | None = None
    request_id: str = ""
    error_kind: ErrorKind | None = None
    error_message: str = ""
    retry_after: float | None = None
    endpoint_fault: bool = False
    ttft_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_reported: bool = False
    chunk_times: list[float] | None = None
    connect_s: float | None = None

    def result(self, endpoint: str, sent_at: float, e2e_s: float, endpoint_down: bool) -> CallResult:
        """The attempt as a value, with what only the caller knows."""
        return CallResult(
            ok=self.ok, status_code=self.status_code, body=self.body, request_id=self.request_id,
            error_kind=self.error_kind, error_message=self.error_message, retry_after=self.retry_after,
            endpoint_fault=self.endpoint_fault, endpoint_down=endpoint_down, ttft_s=self.ttft_s, e2e_s=e2e_s,
            prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens, cached_reported=self.cached_reported, endpoint=endpoint,
            sent_at=sent_at, chunk_times=self.chunk_times, connect_s=self.connect_s)


class _ReadWatch:
    """The read timeout of one request: it fails (``fired``) once no byte came for longer than
    ``patience()`` allows, asked only when a wait passes ``read_s`` and again each time it
    passes the answer (a queue that grows while the request waits raises it meanwhile).

    Done here rather than as aiohttp's ``sock_read``, which is fixed when a request is sent:
    the requests of a burst are all sent before any answer shows how long the queue is."""

    def __init__(self, idle, read_s: float, patience: Callable[[], float]):
        self._idle = idle  # a timeout() context with no deadline, moved to now to fire
        self._read_s = read_s
        self._patience = patience
        self._loop = asyncio.get_running_loop()
        self._last = self._loop.time()
        self.fired = False
        self.waited = 0.0
        self._check_at = self._loop.call_at(self._last + read_s, self._check)

    def data(self) -> None:
        self._last = self._loop.time()  # the pending check sees it: no re-arming per chunk

    def _check(self) -> None:
        now = self._loop.time()
        due = self._last + self._read_s
        if now >= due:
            due = self._last + max(self._read_s, self._patience())
        if now < due:
            self._check_at = self._loop.call_at(due, self._check)
            return
        self.fired, self.waited = True, now - self._last
        self._idle.reschedule(now)

    def close(self) -> None:
        self._check_at.cancel()


# Longer ids are cut and end in a digest: a header line has a size limit (8 KiB in aiohttp,
# vLLM's uvicorn and most proxies), and a 10k-character custom_id is a valid one.
MAX_ID_HEADER = 256


def custom_id_header(custom_id: str) -> str:
    """The task's custom_id as a header value (it tells the server's logs which task a request
    is; the fault server keys its faults on it).  Percent-encoded, so any string is safe
    (``\n``, ``\r`` or ``\0`` in a raw header would be refused before sending), and at most
    ``MAX_ID_HEADER`` characters.  ``urllib.parse.unquote`` gives the id back."""
    value = urllib.parse.quote(custom_id, safe="")
    if len(value) <= MAX_ID_HEADER:
        return value
    digest = hashlib.sha256(custom_id.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    head = value[: MAX_ID_HEADER - 20]
    head = head[: head.rfind("%")] if "%" in head[-2:] else head  # never cut an escape in two
    return f"{head}~{digest}"


def _connect_why(e: aiohttp.ClientConnectorError) -> str:
    where = f"{e.host}:{e.port}"
    if isinstance(e.os_error, ConnectionRefusedError):
        return f"cannot connect to {where}: connection refused"
    return f"cannot connect to {where}: {e.os_error.strerror or e.os_error}"


def _why(e: BaseException) -> str:
    """Why a probe failed, in a few words."""
    if isinstance(e, aiohttp.ClientConnectorError):
        return _connect_why(e)
    if isinstance(e, (TimeoutError, asyncio.TimeoutError)):
        return "no answer to a probe"
    return str(e) or type(e).__name__


def _in_band_error(res: _Reply, err: object) -> None:
    message = err.get("message") if isinstance(err, dict) else err
    code = err.get("code") if isinstance(err, dict) else None
    res.error_message = f"error inside the stream: {message}"
    res.body = {"error": err}
    res.endpoint_fault = True
    if code in (429, "429"):
        res.error_kind = ErrorKind.RATE_LIMITED
    elif code in (503, "503"):
        res.error_kind = ErrorKind.OVERLOADED
    elif isinstance(code, int) and 400 <= code < 500:
        res.error_kind, res.endpoint_fault = ErrorKind.CLIENT_ERROR, False
    else:
        res.error_kind = ErrorKind.SERVER_ERROR


async def _drain(resp: aiohttp.ClientResponse) -> None:
    """Read what follows ``[DONE]`` (the end of the chunked body) so the connection goes back to
    the pool: released with bytes still unread, aiohttp closes it, and the next request pays for a
    new connection (on a busy machine the end often arrives just after ``[DONE]``)."""
    if resp.content.at_eof():
        return
    try:
        async with timeout(_DRAIN_S):
            await resp.content.read()
    except (TimeoutError, asyncio.TimeoutError, aiohttp.ClientError):
        pass  # the answer is whole; only this connection is not reused


_DRAIN_S = 1.0  # a server that keeps the stream open past [DONE] is not waited for longer


def _connect_trace() -> aiohttp.TraceConfig:
    """Puts the seconds spent opening a new connection into the request's trace context."""
    trace = aiohttp.TraceConfig()

    async def start(session, ctx, params) -> None:
        if isinstance(ctx.trace_request_ctx, dict):
            ctx.trace_request_ctx["connect_start"] = time.perf_counter()

    async def end(session, ctx, params) -> None:
        rc = ctx.trace_request_ctx
        if isinstance(rc, dict) and "connect_start" in rc:
            rc["connect_s"] = time.perf_counter() - rc["connect_start"]

    trace.on_connection_create_start.append(start)
    trace.on_connection_create_end.append(end)
    return trace


def _take_usage(res: _Reply, usage: dict | None) -> None:
    if isinstance(usage, dict):
        res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        res.completion_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        res.cached_reported = isinstance(details, dict) and details.get("cached_tokens") is not None
        res.cached_tokens = int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0
