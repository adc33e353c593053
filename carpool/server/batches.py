"""The OpenAI Files and Batches API on ``carpool serve``: routes, request checks, object shapes.

    POST   /v1/files                 multipart: file, purpose        -> file object
    GET    /v1/files                 after, limit, order, purpose    -> list
    GET    /v1/files/{id}            DELETE /v1/files/{id}           GET /v1/files/{id}/content
    POST   /v1/batches               input_file_id, endpoint, completion_window "24h", metadata
    GET    /v1/batches/{id}          GET /v1/batches (after, limit)  POST /v1/batches/{id}/cancel

The objects have OpenAI's fields, so the openai SDK's ``FileObject`` and ``Batch`` parse them
and its cursor pages (``has_more``, ``after`` = the last id) walk the lists.  The state is on
disk (``batch_store``) and the batches run on the server's engine behind online requests
(``batch_runner``); a restarted server resumes them.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from aiohttp import BodyPartReader, web

from carpool.openai.errors import OpenAIError
from carpool.paths import cache_dir
from carpool.server.batch_input import ENDPOINTS
from carpool.server.batch_metrics import BatchCollector
from carpool.server.batch_runner import FINAL, BatchLimits, BatchRunner
from carpool.server.batch_store import FILE_PURPOSES, BatchStore, new_id
from carpool.server.config import ServerConfig
from carpool.server.http import json_response, read_json
from carpool.server.state import STATE

RUNNER: web.AppKey[BatchRunner] = web.AppKey("carpool_batches", BatchRunner)
COMPLETION_WINDOW_S = {"24h": 24 * 3600}
_CHUNK = 1 << 20


def batch_dir(config: ServerConfig) -> str:
    return config.batch_dir or str(cache_dir() / "batches")


def add_batch_api(app: web.Application, config: ServerConfig) -> None:
    """Register the routes; the store opens (and unfinished batches resume) once the engine runs."""
    r = app.router
    r.add_post("/v1/files", create_file)
    r.add_get("/v1/files", list_files)
    r.add_get("/v1/files/{file_id}", retrieve_file)
    r.add_delete("/v1/files/{file_id}", delete_file)
    r.add_get("/v1/files/{file_id}/content", file_content)
    r.add_post("/v1/batches", create_batch)
    r.add_get("/v1/batches", list_batches)
    r.add_get("/v1/batches/{batch_id}", retrieve_batch)
    r.add_post("/v1/batches/{batch_id}/cancel", cancel_batch)
    limits = BatchLimits(config.max_batch_file_bytes, config.max_batch_requests, config.batch_max_inflight)

    async def start(app: web.Application) -> None:
        store = BatchStore(batch_dir(config))
        app[RUNNER] = runner = BatchRunner(app[STATE], store, limits)
        app[STATE].metrics.registry.register(BatchCollector(runner))
        runner.resume()

    async def stop(app: web.Application) -> None:
        if RUNNER in app:
            await app[RUNNER].stop()
            app[RUNNER].store.close()

    app.on_startup.append(start)
    app.on_shutdown.append(stop)


def _runner(request: web.Request) -> BatchRunner:
    runner = request.app.get(RUNNER)
    if runner is None:
        raise OpenAIError(503, "starting", type="server_error")
    return runner


def _limit(request: web.Request, default: int, most: int) -> int:
    text = request.query.get("limit")
    if text is None:
        return default
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= most:
        raise OpenAIError(400, f"'limit' must be an integer from 1 to {most}, got {text!r}", param="limit")
    return n


def _page(data: list[dict], has_more: bool) -> web.Response:
    return json_response({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                          "last_id": data[-1]["id"] if data else None, "has_more": has_more})


# -- files


async def create_file(request: web.Request) -> web.Response:
    runner = _runner(request)
    if not request.content_type.startswith("multipart/"):
        raise OpenAIError(400, "upload a file as multipart/form-data with the fields 'file' and 'purpose'")
    reader = await request.multipart()
    purpose: str | None = None
    upload: tuple[Path, str] | None = None
    try:
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                continue
            if part.name == "purpose":
                purpose = (await part.text()).strip()
            elif part.name == "file":
                upload = await _receive(part, runner)
        if upload is None:
            raise OpenAIError(400, "Missing required parameter: 'file'.", param="file")
        if purpose not in FILE_PURPOSES:
            raise OpenAIError(400, f"'purpose' must be one of {', '.join(FILE_PURPOSES)}; got {purpose!r}",
                              param="purpose")
        return json_response(runner.store.add_file(upload[0], upload[1], purpose))
    finally:
        if upload is not None and os.path.exists(upload[0]):
            os.unlink(upload[0])


async def _receive(part: BodyPartReader, runner: BatchRunner) -> tuple[Path, str]:
    """Stream one uploaded file to disk (fsync'd), refusing it past the size limit."""
    most = runner.limits.max_file_bytes
    path = runner.store.upload_path()
    size = 0
    try:
        with open(path, "wb") as f:
            while chunk := await part.read_chunk(_CHUNK):
                size += len(chunk)
                if size > most:
                    raise OpenAIError(413, f"File is too large: past the limit of {most:,} bytes "
                                      "(--batch-max-file-mb); split it.", param="file", code="file_too_large")
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path, part.filename or "upload.jsonl"


def _file_or_404(runner: BatchRunner, file_id: str) -> dict:
    found = runner.store.get_file(file_id)
    if found is None:
        raise OpenAIError(404, f"No such File object: {file_id}", param="id", code="file_not_found")
    return found


async def list_files(request: web.Request) -> web.Response:
    order = request.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise OpenAIError(400, f"'order' must be asc or desc, got {order!r}", param="order")
    data, more = _runner(request).store.list_files(after=request.query.get("after"), order=order,
                                                  limit=_limit(request, 10000, 10000),
                                                  purpose=request.query.get("purpose"))
    return _page(data, more)


async def retrieve_file(request: web.Request) -> web.Response:
    return json_response(_file_or_404(_runner(request), request.match_info["file_id"]))


async def delete_file(request: web.Request) -> web.Response:
    runner = _runner(request)
    file_id = request.match_info["file_id"]
    _file_or_404(runner, file_id)
    runner.store.delete_file(file_id)
    return json_response({"id": file_id, "object": "file", "deleted": True})


async def file_content(request: web.Request) -> web.StreamResponse:
    runner = _runner(request)
    file_id = request.match_info["file_id"]
    _file_or_404(runner, file_id)
    return web.FileResponse(runner.store.file_path(file_id), headers={"Content-Type": "application/octet-stream"})


# -- batches


def _check_metadata(meta: object) -> dict | None:
    """OpenAI's metadata rules: at most 16 string pairs, keys to 64 and values to 512 characters."""
    if meta is None:
        return None
    if not isinstance(meta, dict) or len(meta) > 16 or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in meta.items()):
        raise OpenAIError(400, "'metadata' must be an object of at most 16 string values, keys up to 64 and "
                          "values up to 512 characters", param="metadata")
    return meta


async def create_batch(request: web.Request) -> web.Response:
    runner = _runner(request)
    body = await read_json(request)
    for key in ("input_file_id", "endpoint", "completion_window"):
        if not isinstance(body.get(key), str):
            raise OpenAIError(400, f"Missing required parameter: '{key}' (a string).", param=key)
    if body["endpoint"] not in ENDPOINTS:
        raise OpenAIError(400, f"'endpoint' must be one of {', '.join(ENDPOINTS)} here; got {body['endpoint']!r}",
                          param="endpoint")
    window = COMPLETION_WINDOW_S.get(body["completion_window"])
    if window is None:
        raise OpenAIError(400, f"'completion_window' must be '24h', got {body['completion_window']!r}",
                          param="completion_window")
    meta = _check_metadata(body.get("metadata"))
    source = _file_or_404(runner, body["input_file_id"])
    if source["purpose"] != "batch":
        raise OpenAIError(400, f"The file {source['id']} has purpose {source['purpose']!r}; a batch input file "
                          "must be uploaded with purpose 'batch'.", param="input_file_id")
    now = int(time.time())
    doc = {"id": new_id("batch_"), "object": "batch", "endpoint": body["endpoint"], "errors": None,
           "input_file_id": source["id"], "completion_window": body["completion_window"], "status": "validating",
           "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
           "expires_at": now + window, "finalizing_at": None, "completed_at": None, "failed_at": None,
           "expired_at": None, "cancelling_at": None, "cancelled_at": None,
           "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": meta, "model": None,
           "usage": None}
    # The batch keeps its own link to the input, so deleting the file does not pull it from under it.
    work = runner.store.batch_work_dir(doc["id"])
    work.mkdir(parents=True, exist_ok=True)
    try:
        os.link(runner.store.file_path(source["id"]), work / "input.jsonl")
    except OSError:
        shutil.copyfile(runner.store.file_path(source["id"]), work / "input.jsonl")
    runner.store.add_batch(doc)
    runner.launch(doc)
    return json_response(runner.view(doc))


def _batch_or_404(runner: BatchRunner, batch_id: str) -> dict:
    found = runner.get(batch_id)
    if found is None:
        raise OpenAIError(404, f"No batch found with id '{batch_id}'.", param="batch_id", code="batch_not_found")
    return found


async def retrieve_batch(request: web.Request) -> web.Response:
    return json_response(_batch_or_404(_runner(request), request.match_info["batch_id"]))


async def list_batches(request: web.Request) -> web.Response:
    runner = _runner(request)
    docs, more = runner.store.list_batches(after=request.query.get("after"), limit=_limit(request, 20, 100))
    return _page([runner.view(d) for d in docs], more)


async def cancel_batch(request: web.Request) -> web.Response:
    runner = _runner(request)
    batch_id = request.match_info["batch_id"]
    _batch_or_404(runner, batch_id)
    doc = runner.cancel(batch_id)
    assert doc is not None
    if doc["status"] in FINAL:
        raise OpenAIError(409, f"Cannot cancel a batch with status '{doc['status']}'.", code="batch_not_cancellable")
    return json_response(doc)
