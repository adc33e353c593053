"""A local stand-in for Azure OpenAI's Batch API that checks Azure's request shape and runs the
batches on a real ``carpool serve``.

Azure's batch REST API is OpenAI's under other paths and auth, as Azure documents it:
``POST {endpoint}/openai/files`` (multipart ``purpose=batch`` + ``file``), ``GET
/openai/files/{id}/content``, ``POST /openai/batches`` (``endpoint: "/chat/completions"``),
``GET /openai/batches/{id}``, ``GET /openai/batches`` (``limit``, ``after``) and ``POST
/openai/batches/{id}/cancel``; every call carries the ``api-version`` query parameter and the
key in an ``api-key`` header; the request lines of an input file name the url without
``/v1`` (``/chat/completions``) and the deployment as ``body.model``.

Every call is checked for that shape and refused the way Azure answers (404 "Resource not
found" without a known api-version, 401 without the key), so a client speaking plain OpenAI
to it fails.  A right call is forwarded to ``upstream`` (a ``carpool serve``'s OpenAI Files
and Batches API) with the ``/v1`` put back into the lines and the batch's endpoint, and the
answer's endpoint turned back into Azure's.  One simplification: Azure finds a line with a
wrong url when it validates the batch; this stand-in refuses the upload at once (400 naming
the line), which a test sees more plainly.

``received`` counts every custom_id an accepted upload of purpose batch held (a test asserts
no task was submitted twice); ``refused`` keeps why each refused call was refused; ``calls``
is every (method, path) seen.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import BodyPartReader, web

from carpool.errors import AzureRefusal

from .local_site import LocalAppServer
from .threaded import ThreadedServer

URLS = ("/chat/completions", "/completions", "/embeddings")  # what an Azure batch line may name


@dataclass
class AzureBatchConfig:
    upstream: str  # a carpool serve: http://127.0.0.1:PORT (its /v1/files and /v1/batches)
    api_key: str = "test-key"
    api_versions: tuple[str, ...] = ("2024-10-21",)  # the data-plane versions this resource knows


def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message}}, status=status)


def _check_lines(content: bytes) -> tuple[bytes, list[str]]:
    """The lines with ``/v1`` put in front of their url, and their custom_ids; ``AzureRefusal`` when a
    line is not Azure's shape."""
    out, ids = [], []
    for n, raw in enumerate(content.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except ValueError:
            raise AzureRefusal(400, "invalidPayload", f"line {n}: not JSON") from None
        url = line.get("url") if isinstance(line, dict) else None
        if url not in URLS:
            raise AzureRefusal(400, "invalidPayload", f"line {n}: url {url!r} is not one of {', '.join(URLS)} "
                          "(Azure's batch lines name no /v1)")
        if not isinstance(line.get("body"), dict) or not isinstance(line["body"].get("model"), str):
            raise AzureRefusal(400, "invalidPayload", f"line {n}: body.model must name the deployment")
        ids.append(str(line.get("custom_id")))
        out.append(json.dumps({**line, "url": "/v1" + url}).encode())
    return b"\n".join(out) + b"\n", ids


def _to_azure(batch: dict) -> dict:
    """A batch object as Azure shows it: its endpoint without ``/v1``."""
    endpoint = batch.get("endpoint")
    if isinstance(endpoint, str) and endpoint.startswith("/v1/"):
        return {**batch, "endpoint": endpoint[3:]}
    return batch


class AzureBatchServer(LocalAppServer):
    def __init__(self, config: AzureBatchConfig, host: str = "127.0.0.1", port: int = 0):
        super().__init__(host, port)
        self.config = config
        self.received: Counter[str] = Counter()
        self.refused: list[str] = []
        self.calls: list[tuple[str, str]] = []
        self._session: aiohttp.ClientSession | None = None

    def _app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 2**20, middlewares=[self._shape])
        r = app.router
        r.add_get("/openai/models", self._models)
        r.add_post("/openai/files", self._upload)
        r.add_get("/openai/files/{id}/content", self._content)
        r.add_post("/openai/batches", self._create)
        r.add_get("/openai/batches", self._list)
        r.add_get("/openai/batches/{id}", self._retrieve)
        r.add_post("/openai/batches/{id}/cancel", self._cancel)
        return app

    async def start(self) -> str:
        # The session forwards uploads and downloads to the upstream batch server.
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120))
        return await super().start()

    async def stop(self) -> None:
        await super().stop()
        if self._session is not None:
            await self._session.close()
            self._session = None

    @web.middleware
    async def _shape(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Azure's checks of every call: the key in ``api-key``, a known ``api-version``."""
        self.calls.append((request.method, request.path))
        try:
            if request.headers.get("api-key") != self.config.api_key:
                raise AzureRefusal(401, "401", "Access denied due to invalid subscription key or wrong API endpoint.")
            if request.query.get("api-version") not in self.config.api_versions:
                raise AzureRefusal(404, "404", "Resource not found")
            return await handler(request)
        except AzureRefusal as e:
            self.refused.append(f"{request.method} {request.path}: {e}")
            return _error(e.status, e.code, str(e))
        except web.HTTPNotFound:
            self.refused.append(f"{request.method} {request.path}: no such route")
            return _error(404, "404", "Resource not found")

    async def _forward(self, method: str, path: str, **kw: Any) -> tuple[int, bytes, str]:
        assert self._session is not None
        async with self._session.request(method, self.config.upstream + path, **kw) as resp:
            return resp.status, await resp.read(), resp.content_type

    async def _forward_json(self, method: str, path: str, azure: bool = False, **kw: Any) -> web.Response:
        status, body, _ = await self._forward(method, path, **kw)
        doc = json.loads(body)
        if azure and status == 200:
            doc = {**doc, "data": [_to_azure(b) for b in doc["data"]]} if doc.get("object") == "list" \
                else _to_azure(doc)
        return web.json_response(doc, status=status)

    # -- handlers ---------------------------------------------------------------------------
    async def _upload(self, request: web.Request) -> web.Response:
        fields: dict[str, Any] = {}
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if isinstance(part, BodyPartReader) and part.name in ("purpose", "file"):
                fields[part.name] = (await part.read(), part.filename)
        if "file" not in fields or "purpose" not in fields:
            raise AzureRefusal(400, "invalidPayload", "multipart fields 'file' and 'purpose' are required")
        purpose = fields["purpose"][0].decode()
        content, filename = fields["file"]
        ids: list[str] = []
        if purpose == "batch":
            content, ids = _check_lines(content)
        form = aiohttp.FormData()
        form.add_field("purpose", purpose)
        form.add_field("file", content, filename=filename or "upload.jsonl", content_type="application/jsonl")
        status, body, _ = await self._forward("POST", "/v1/files", data=form)
        if status == 200:
            self.received.update(ids)
        return web.json_response(json.loads(body), status=status)

    async def _models(self, request: web.Request) -> web.Response:
        """Models - List: the models the resource serves (the upstream's)."""
        status, body, ctype = await self._forward("GET", "/v1/models")
        return web.Response(body=body, status=status, content_type=ctype)

    async def _content(self, request: web.Request) -> web.Response:
        status, body, ctype = await self._forward("GET", f"/v1/files/{request.match_info['id']}/content")
        return web.Response(body=body, status=status, content_type=ctype)

    async def _create(self, request: web.Request) -> web.Response:
        doc = await request.json()
        endpoint = doc.get("endpoint") if isinstance(doc, dict) else None
        if endpoint not in URLS:
            raise AzureRefusal(400, "invalidPayload", f"endpoint {endpoint!r} is not one of {', '.join(URLS)}")
        return await self._forward_json("POST", "/v1/batches", azure=True, json={**doc, "endpoint": "/v1" + endpoint})

    async def _list(self, request: web.Request) -> web.Response:
        query = {k: v for k, v in request.query.items() if k in ("limit", "after")}
        return await self._forward_json("GET", "/v1/batches", azure=True, params=query)

    async def _retrieve(self, request: web.Request) -> web.Response:
        return await self._forward_json("GET", f"/v1/batches/{request.match_info['id']}", azure=True)

    async def _cancel(self, request: web.Request) -> web.Response:
        return await self._forward_json("POST", f"/v1/batches/{request.match_info['id']}/cancel", azure=True)


class ThreadedAzureBatchServer(ThreadedServer):
    """The stand-in on its own loop in a daemon thread, for sync tests driving subprocesses."""

    def __init__(self, config: AzureBatchConfig):
        super().__init__(AzureBatchServer(config))
