"""Calls an OpenAI-compatible endpoint over HTTP (carpool serve, vLLM, SGLang, OpenAI).

Generation requests stream by default (``stream: true`` with usage in the last chunk)
so TTFT and TPOT are measured per request; the streamed pieces are put back together
into the ordinary non-streaming response body, which is what the output file holds.
Every failure is mapped to one error kind of ``retry.py``, together with whether the
request may already have run on the server.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from carpool.client import retry as R
from carpool.client.balancer import Balancer
from carpool.client.base import CallResult, Request
from carpool.client.pool import Timeouts, make_session

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
_loads = json.loads


class HttpBackend:
    name = "http"

    def __init__(self, endpoints: list[str], model: str | None = None, api_key: str | None = None,
                 stream: bool = True, timeouts: Timeouts | None = None, max_connections: int = 0,
                 balancer: Balancer | None = None):
        self.balancer = balancer or Balancer(endpoints)
        self.model = model
        self.stream = stream
        self.timeouts = timeouts or Timeouts()
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = make_session(self._max_connections, self.timeouts)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def prepare_body(self, req: Request) -> dict:
        body = req.body
        if self.model and "model" not in body:
            body = {**body, "model": self.model}
        if self.stream and req.kind != "embedding" and "stream" not in body:
            body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        return body

    async def call(self, req: Request) -> CallResult:
        ep = self.balancer.pick()
        res = CallResult(ok=False, endpoint=ep.url)
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(self.timeouts.total_s):
                await self._call(ep.url, req, res, t0)
        except TimeoutError:
            if res.error_kind is None:
                res.error_kind, res.error_message = R.TOTAL_TIMEOUT, f"no answer within {self.timeouts.total_s:g}s"
                res.endpoint_fault = True
        res.e2e_s = time.monotonic() - t0
        self.balancer.done(ep, res.ok, res.endpoint_fault)
        return res

    async def _call(self, base: str, req: Request, res: CallResult, t0: float) -> None:
        body = self.prepare_body(req)
        streaming = bool(body.get("stream"))
        headers = {**self._headers, "X-Carpool-Custom-Id": req.custom_id}
        got_headers = False
        try:
            async with self.session.post(base + req.path, data=_dumps(body), headers=headers) as resp:
                got_headers = True
                res.status_code = resp.status
                res.request_id = resp.headers.get("x-request-id", "")
                if resp.status != 200:
                    await self._http_error(resp, res)
                    return
                ctype = resp.headers.get("Content-Type", "")
                if streaming and ctype.startswith("text/event-stream"):
                    await self._read_stream(resp, req, res, t0)
                else:
                    raw = await resp.read()
                    res.ttft_s = time.monotonic() - t0
                    try:
                        res.body = _loads(raw)
                    except ValueError:
                        res.error_kind, res.error_message = R.BAD_RESPONSE, f"response is not JSON: {raw[:80]!r}"
                        return
                    if not isinstance(res.body, dict):
                        res.error_kind, res.error_message = R.BAD_RESPONSE, "response is not a JSON object"
                        return
                    _take_usage(res, res.body.get("usage"))
                    res.ok = True
        except aiohttp.ClientConnectorError as e:  # refused, DNS, unreachable: never sent
            res.error_kind, res.error_message, res.endpoint_fault = R.CONNECT, str(e), True
        except aiohttp.ConnectionTimeoutError as e:
            res.error_kind, res.error_message, res.endpoint_fault = R.CONNECT, f"connect timeout: {e}", True
        except aiohttp.SocketTimeoutError:
            res.error_kind = R.READ_TIMEOUT
            res.error_message = f"no data for {self.timeouts.read_s:g}s"
            res.endpoint_fault = True
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
                ConnectionResetError) as e:
            res.endpoint_fault = True
            if got_headers:
                res.error_kind, res.error_message = R.TRUNCATED, f"connection dropped mid-response: {e!r}"
            else:
                res.error_kind, res.error_message = R.RESET, f"connection dropped before a response: {e!r}"
        except aiohttp.ClientError as e:
            res.error_kind, res.error_message, res.endpoint_fault = R.RESET, repr(e), True

    async def _http_error(self, resp: aiohttp.ClientResponse, res: CallResult) -> None:
        raw = await resp.read()
        try:
            res.body = _loads(raw)
        except ValueError:
            res.body = None
        msg = raw[:300].decode("utf-8", "replace")
        if isinstance(res.body, dict) and isinstance(res.body.get("error"), dict):
            msg = str(res.body["error"].get("message", msg))
        res.error_message = f"HTTP {resp.status}: {msg}"
        res.retry_after = R.parse_retry_after(resp.headers.get("Retry-After"))
        if resp.status == 429:
            res.error_kind = R.RATE_LIMITED
        elif resp.status == 503:
            res.error_kind, res.endpoint_fault = R.OVERLOADED, True
        elif resp.status >= 500:
            res.error_kind, res.endpoint_fault = R.SERVER_ERROR, True
        else:
            res.error_kind = R.CLIENT_ERROR

    async def _read_stream(self, resp: aiohttp.ClientResponse, req: Request, res: CallResult, t0: float) -> None:
        acc = StreamAccumulator(chat=req.kind == "chat")
        done = False
        async for line in resp.content:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = True
                break
            try:
                chunk = _loads(payload)
            except ValueError:
                res.error_kind, res.error_message = R.BAD_RESPONSE, f"stream chunk is not JSON: {payload[:80]!r}"
                return
            if res.ttft_s is None and acc.has_content(chunk):
                res.ttft_s = time.monotonic() - t0
            acc.add(chunk)
        if not done:
            res.error_kind, res.error_message = R.TRUNCATED, "stream ended without [DONE]"
            res.endpoint_fault = True
            return
        res.body = acc.body()
        _take_usage(res, res.body.get("usage"))
        if res.completion_tokens == 0:
            res.completion_tokens = acc.pieces  # no usage chunk: count pieces (about one token each)
        res.ok = True


def _take_usage(res: CallResult, usage: dict | None) -> None:
    if isinstance(usage, dict):
        res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        res.completion_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        res.cached_tokens = int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0


class StreamAccumulator:
    """Rebuilds a chat.completion / text_completion body from its stream chunks."""

    def __init__(self, chat: bool):
        self.chat = chat
        self.meta: dict = {}
        self.texts: dict[int, list[str]] = {}
        self.finish: dict[int, str | None] = {}
        self.usage: dict | None = None
        self.pieces = 0

    def has_content(self, chunk: dict) -> bool:
        for c in chunk.get("choices") or ():
            piece = (c.get("delta") or {}).get("content") if self.chat else c.get("text")
            if piece:
                return True
        return False

    def add(self, chunk: dict) -> None:
        if not self.meta:
            self.meta = {k: chunk.get(k) for k in ("id", "created", "model", "system_fingerprint")}
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for c in chunk.get("choices") or ():
            i = c.get("index", 0)
            piece = (c.get("delta") or {}).get("content") if self.chat else c.get("text")
            if piece:
                self.texts.setdefault(i, []).append(piece)
                self.pieces += 1
            else:
                self.texts.setdefault(i, [])
            if c.get("finish_reason"):
                self.finish[i] = c["finish_reason"]

    def body(self) -> dict:
        choices = []
        for i in sorted(self.texts):
            text = "".join(self.texts[i])
            if self.chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                "finish_reason": self.finish.get(i)})
            else:
                choices.append({"index": i, "text": text, "finish_reason": self.finish.get(i)})
        out = {"id": self.meta.get("id"), "object": "chat.completion" if self.chat else "text_completion",
               "created": self.meta.get("created"), "model": self.meta.get("model"), "choices": choices}
        if self.usage is not None:
            out["usage"] = self.usage
        return out
