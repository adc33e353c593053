"""Anthropic's Message Batches API: ``POST /v1/messages/batches`` with ``requests:
[{custom_id, params}]``, ``GET .../{id}``, the results JSONL at ``results_url``.

Anthropic batches carry no metadata, so a create whose answer was lost (the process was
killed while it was in flight) is found by what it must look like: created after the
job wrote down its intent, holding exactly that many requests, and not a batch the job
knows.  The job checks the results' custom_ids against the batch's before it adopts them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

from carpool.errors import Untranslatable
from carpool.jobs.input.tasks import Task
from carpool.jobs.provider_batch import limits
from carpool.jobs.provider_batch.anthropic_shapes import chat_to_params, message_to_chat
from carpool.jobs.provider_batch.http import Http
from carpool.jobs.provider_batch.provider import RequestResult, Status, read_jsonl

VERSION = "2023-06-01"
_FINAL_ERRORS = {"invalid_request_error", "authentication_error", "permission_error", "not_found_error",
                 "request_too_large"}
_STATUS = {"invalid_request_error": 400, "authentication_error": 401, "permission_error": 403,
           "not_found_error": 404, "request_too_large": 413, "rate_limit_error": 429, "api_error": 500,
           "overloaded_error": 529}


def _timestamp(text: str | None) -> float:
    if not text:
        return 0.0
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


class AnthropicBatches:
    name = "anthropic"
    ids_must_fit = True

    def __init__(self, url: str, headers: dict[str, str], model: str | None, default_max_tokens: int,
                 lim: limits.Limits = limits.ANTHROPIC, say: Callable[[str], None] | None = None,
                 attempts: int = 6):
        base = url.rstrip("/")
        self.base = base if base.endswith("/v1") else base + "/v1"
        self.http = Http({"anthropic-version": VERSION, "content-type": "application/json", **headers}, say, attempts)
        self.model, self.default_max_tokens, self.limits = model, default_max_tokens, lim

    def group(self, task: Task) -> str:
        return ""

    def request_line(self, pid: str, task: Task) -> bytes:
        if task.request.kind != "chat":
            raise Untranslatable("url", f"Anthropic batches answer chat tasks; this is a {task.request.kind} task")
        params = chat_to_params(task.request.body, self.model, self.default_max_tokens)
        return json.dumps({"custom_id": pid, "params": params}, separators=(",", ":")).encode()

    async def submit(self, local_id: str, lines: list[bytes], uploaded: Callable[[str], None]) -> str:
        body = b'{"requests":[' + b",".join(lines) + b"]}"
        doc = await self.http.call("POST", f"{self.base}/messages/batches", create=True, data=lambda: body)
        return str(doc["id"])

    async def find(self, local_id: str, n_requests: int, prepared_at: float, known: set[str]) -> str | None:
        after: str | None = None
        while True:
            params = {"limit": "100", **({"after_id": after} if after else {})}
            page = await self.http.call("GET", f"{self.base}/messages/batches", params=params)
            for b in page.get("data") or []:
                if _timestamp(b.get("created_at")) < prepared_at - 300:
                    return None  # newest first: everything further is older than the intent
                total = sum((b.get("request_counts") or {}).values())
                if b["id"] not in known and total == n_requests:
                    return str(b["id"])
            if not page.get("has_more") or not page.get("last_id"):
                return None
            after = page["last_id"]

    async def status(self, batch_id: str) -> Status:
        b = await self.http.call("GET", f"{self.base}/messages/batches/{batch_id}")
        counts = {k: int(v) for k, v in (b.get("request_counts") or {}).items()}
        state = str(b.get("processing_status"))
        return Status(batch_id, state, state == "ended", counts, raw=b)

    async def results(self, status: Status, workdir: Path) -> Iterator[RequestResult]:
        url = status.raw.get("results_url") or f"{self.base}/messages/batches/{status.batch_id}/results"
        path = await self.http.call("GET", url, into=workdir / f"{status.batch_id}.results.jsonl")
        return (self._outcome(str(doc.get("custom_id")), doc.get("result") or {}) for doc in read_jsonl(path))

    def _outcome(self, pid: str, result: dict) -> RequestResult:
        kind = result.get("type")
        if kind == "succeeded":
            msg = result.get("message") or {}
            return RequestResult(pid, "ok", 200, message_to_chat(msg), str(msg.get("id", "")))
        if kind in ("expired", "canceled"):
            return RequestResult(pid, "retry", 0, None, code=f"batch_{kind}",
                                 message=f"the provider {kind} the request")
        err = (result.get("error") or {}).get("error") or result.get("error") or {}
        etype = str(err.get("type") or "api_error")
        status = _STATUS.get(etype, 500)
        body = {"error": {"type": etype, "message": err.get("message", "")}}
        final = etype in _FINAL_ERRORS
        return RequestResult(pid, "error" if final else "retry", status, body, code=etype,
                       message=str(err.get("message") or etype))

    async def close(self) -> None:
        await self.http.close()
