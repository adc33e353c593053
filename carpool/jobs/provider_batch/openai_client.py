"""OpenAI's (and Azure OpenAI's) Batch API: upload a JSONL file (``POST /files``,
``purpose=batch``), ``POST /batches`` on it, poll ``GET /batches/{id}``, then read
``output_file_id`` and ``error_file_id`` (``GET /files/{id}/content``).

Each batch is created with ``metadata: {"carpool_batch": <local id>}``, so a create whose
answer was lost is found again by listing the batches.  Azure differs in paths
(``/openai/files``, ``/openai/batches`` with ``api-version``), in the request lines' url
(``/chat/completions``) and in the model (the deployment's name).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp

from carpool.client.endpoints import AZURE_API_VERSION, is_reasoning_model
from carpool.jobs.input.tasks import Task
from carpool.jobs.provider_batch import limits
from carpool.jobs.provider_batch.http import Http
from carpool.jobs.provider_batch.provider import RequestResult, Status, read_jsonl

METADATA_KEY = "carpool_batch"
_ENDED = {"completed", "failed", "expired", "cancelled"}
_RETRY_CODES = {"batch_expired", "batch_cancelled", "rate_limit_exceeded", "server_error"}


class OpenAIBatches:
    ids_must_fit = False

    def __init__(self, url: str, headers: dict[str, str], model: str | None, *, azure: bool = False,
                 api_version: str | None = None, completion_window: str = "24h",
                 lim: limits.Limits = limits.OPENAI, say: Callable[[str], None] | None = None,
                 attempts: int = 6):
        self.name = "azure" if azure else "openai"
        base = url.rstrip("/")
        self.azure = azure
        self.base = base.removesuffix("/openai") + "/openai" if azure else base
        self.query = {"api-version": api_version or AZURE_API_VERSION} if azure else {}
        self.http = Http(headers, say, attempts)
        self.model, self.window, self.limits = model, completion_window, lim

    def _url_of(self, task: Task) -> str:
        return ("" if self.azure else "/v1") + task.request.path

    def group(self, task: Task) -> str:
        return f"{self.model or task.request.body.get('model')} {self._url_of(task)}"

    def request_line(self, pid: str, task: Task) -> bytes:
        body = dict(task.request.body)
        if self.model:
            body["model"] = self.model
        body.pop("stream", None)
        body.pop("stream_options", None)
        if "max_tokens" in body and "max_completion_tokens" not in body and is_reasoning_model(body.get("model")):
            body["max_completion_tokens"] = body.pop("max_tokens")  # o1, o3, gpt-5, ... refuse max_tokens
        line = {"custom_id": pid, "method": "POST", "url": self._url_of(task), "body": body}
        return json.dumps(line, separators=(",", ":"), ensure_ascii=False).encode()

    async def submit(self, local_id: str, lines: list[bytes], uploaded: Callable[[str], None]) -> str:
        content = b"\n".join(lines) + b"\n"

        def form() -> aiohttp.FormData:
            f = aiohttp.FormData()
            f.add_field("purpose", "batch")
            f.add_field("file", content, filename=f"{local_id}.jsonl", content_type="application/jsonl")
            return f

        file = await self.http.call("POST", f"{self.base}/files", params=self.query, data=form)
        uploaded(str(file["id"]))
        endpoint = json.loads(lines[0])["url"]
        doc = {"input_file_id": file["id"], "endpoint": endpoint, "completion_window": self.window,
               "metadata": {METADATA_KEY: local_id}}
        batch = await self.http.call("POST", f"{self.base}/batches", params=self.query, json=doc, create=True)
        return str(batch["id"])

    async def find(self, local_id: str, n_requests: int, prepared_at: float, known: set[str]) -> str | None:
        after: str | None = None
        while True:
            query = {**self.query, "limit": "100", **({"after": after} if after else {})}
            page = await self.http.call("GET", f"{self.base}/batches", params=query)
            data = page.get("data") or []
            for b in data:
                if (b.get("metadata") or {}).get(METADATA_KEY) == local_id:
                    return str(b["id"])
                if int(b.get("created_at") or 0) < prepared_at - 300:
                    return None  # newest first: everything further is older than the intent
            if not page.get("has_more") or not data:
                return None
            after = str(data[-1]["id"])

    async def status(self, batch_id: str) -> Status:
        b = await self.http.call("GET", f"{self.base}/batches/{batch_id}", params=self.query)
        state = str(b.get("status"))
        counts = {k: int(v) for k, v in (b.get("request_counts") or {}).items() if k != "total"}
        errors = (b.get("errors") or {}).get("data") or []
        detail = "; ".join(f"line {e.get('line')}: {e.get('message')}" if e.get("line") else str(e.get("message"))
                           for e in errors[:3])
        return Status(batch_id, state, state in _ENDED, counts, detail, raw=b)

    async def results(self, status: Status, workdir: Path) -> Iterator[RequestResult]:
        paths: list[Path] = []
        for key in ("output_file_id", "error_file_id"):
            file_id = status.raw.get(key)
            if file_id:
                paths.append(await self.http.call("GET", f"{self.base}/files/{file_id}/content", params=self.query,
                                                  into=workdir / f"{status.batch_id}.{key}.jsonl"))
        return (self._outcome(doc) for path in paths for doc in read_jsonl(path))

    def _outcome(self, doc: dict) -> RequestResult:
        pid = str(doc.get("custom_id"))
        resp = doc.get("response") or {}
        err = doc.get("error") or {}
        status = int(resp.get("status_code") or 0)
        body = resp.get("body") if isinstance(resp.get("body"), dict) else None
        rid = str(resp.get("request_id") or "")
        if not err and status == 200:
            return RequestResult(pid, "ok", 200, body, rid)
        berr = (body or {}).get("error") if isinstance(body, dict) else None
        code = str(err.get("code") or (berr or {}).get("code") or (berr or {}).get("type") or f"http_{status}")
        message = str(err.get("message") or (berr or {}).get("message") or code)
        retry = code in _RETRY_CODES or status == 429 or status >= 500
        return RequestResult(pid, "retry" if retry else "error", status, body, rid, code, message)

    async def close(self) -> None:
        await self.http.close()
