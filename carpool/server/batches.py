"""The OpenAI Files and Batches API on ``carpool serve``: routes, request checks, object shapes.

    POST   /v1/files                 multipart: file, purpose        -> file object
    GET    /v1/files                 after, limit, order, purpose    -> list
    GET    /v1/files/{id}            DELETE /v1/files/{id}           GET /v1/files/{id}/content
    POST   /v1/batches               input_file_id, endpoint, completion_window "24h", metadata
    GET    /v1/batches/{id}          GET /v1/batches (after, limit)  POST /v1/batches/{id}/cancel

The objects have OpenAI's fields, so the openai SDK's ``FileObject`` and ``Batch`` parse them
and its cursor pages (``has_more``, ``after`` = the last id) walk the lists.  The state is on
disk (``batch_store``) and the batches run on the server's engine behind online requests
(``batch_executor``); a restarted server resumes them.  Every route sees only the objects of
the request's API key (``owners``): another key's file or batch is a 404, as one that does
not exist.
"""

from __future__ import annotations

import time

from aiohttp import web

from carpool.errors import OpenAIError
from carpool.server.batch_disk import BatchDisk
from carpool.server.batch_executor import BatchExecutor
from carpool.server.batch_input import ENDPOINTS, shown
from carpool.server.batch_object import Batch
from carpool.server.batch_service import BatchService
from carpool.server.batch_store import FILE_PURPOSES, new_id
from carpool.server.config import ServerConfig
from carpool.server.http import json_response, read_json
from carpool.server.owners import request_owner, request_reader
from carpool.server.state import STATE
from carpool.server.uploads import disk_error, read_form

BATCHES: web.AppKey[BatchService] = web.AppKey("carpool_batches", BatchService)
COMPLETION_WINDOW_S = {"24h": 24 * 3600}


def add_batch_api(app: web.Application, config: ServerConfig, disk: BatchDisk | None = None) -> None:
    """Register the routes; the store opens (and unfinished batches resume) once the engine runs.
    ``disk``: where the API's bytes are written (a test passes one that fails on purpose)."""
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

    async def start(app: web.Application) -> None:
        app[BATCHES] = service = BatchService(app[STATE], config, disk)
        service.open()

    async def stop(app: web.Application) -> None:
        if BATCHES in app:
            await app[BATCHES].close()

    app.on_startup.append(start)
    app.on_shutdown.append(stop)


def _executor(request: web.Request) -> BatchExecutor:
    service = request.app.get(BATCHES)
    if service is None:
        raise OpenAIError(503, "starting", type="server_error")
    return service.require()


def _limit(request: web.Request, default: int, most: int) -> int:
    text = request.query.get("limit")
    if text is None:
        return default
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= most:
        raise OpenAIError(400, f"'limit' must be an integer from 1 to {most}, got {shown(text)}", param="limit")
    return n


def _page(data: list[dict], has_more: bool) -> web.Response:
    return json_response({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                          "last_id": data[-1]["id"] if data else None, "has_more": has_more})


# -- files


async def create_file(request: web.Request) -> web.Response:
    executor = _executor(request)
    if not request.content_type.startswith("multipart/"):
        raise OpenAIError(400, "upload a file as multipart/form-data with the fields 'file' and 'purpose'")
    store = executor.store
    up = await read_form(await request.multipart(), executor.disk, store.upload_path(),
                         executor.limits.max_file_bytes)
    try:
        if up.path is None:
            raise OpenAIError(400, "Missing required parameter: 'file'.", param="file")
        if up.purpose not in FILE_PURPOSES:
            raise OpenAIError(400, f"'purpose' must be one of {', '.join(FILE_PURPOSES)}; got {shown(up.purpose)}",
                              param="purpose")
        try:
            return json_response(store.add_file(up.path, up.filename, up.purpose, request_owner(request)))
        except OSError as e:
            raise disk_error(e) from None
    finally:
        up.discard()  # what add_file did not move under its id


def _file_or_404(executor: BatchExecutor, request: web.Request, file_id: str) -> dict:
    found = executor.store.get_file(file_id, request_reader(request))
    if found is None:
        raise OpenAIError(404, f"No such File object: {shown(file_id)}", param="id", code="file_not_found")
    return found


async def list_files(request: web.Request) -> web.Response:
    order = request.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise OpenAIError(400, f"'order' must be asc or desc, got {shown(order)}", param="order")
    data, more = _executor(request).store.list_files(after=request.query.get("after"), order=order,
                                                     limit=_limit(request, 10000, 10000),
                                                     purpose=request.query.get("purpose"),
                                                     owner=request_reader(request))
    return _page(data, more)


async def retrieve_file(request: web.Request) -> web.Response:
    return json_response(_file_or_404(_executor(request), request, request.match_info["file_id"]))


async def delete_file(request: web.Request) -> web.Response:
    executor = _executor(request)
    file_id = request.match_info["file_id"]
    _file_or_404(executor, request, file_id)
    executor.store.delete_file(file_id)
    return json_response({"id": file_id, "object": "file", "deleted": True})


async def file_content(request: web.Request) -> web.StreamResponse:
    executor = _executor(request)
    file_id = request.match_info["file_id"]
    _file_or_404(executor, request, file_id)
    return web.FileResponse(executor.store.file_path(file_id), headers={"Content-Type": "application/octet-stream"})


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
    executor = _executor(request)
    body = await read_json(request)
    for key in ("input_file_id", "endpoint", "completion_window"):
        if not isinstance(body.get(key), str):
            raise OpenAIError(400, f"Missing required parameter: '{key}' (a string).", param=key)
    if body["endpoint"] not in ENDPOINTS:
        raise OpenAIError(400, f"'endpoint' must be one of {', '.join(ENDPOINTS)} here; got "
                          f"{shown(body['endpoint'])}", param="endpoint")
    window = COMPLETION_WINDOW_S.get(body["completion_window"])
    if window is None:
        raise OpenAIError(400, f"'completion_window' must be '24h', got {shown(body['completion_window'])}",
                          param="completion_window")
    meta = _check_metadata(body.get("metadata"))
    source = _file_or_404(executor, request, body["input_file_id"])
    if source["purpose"] != "batch":
        raise OpenAIError(400, f"The file {source['id']} has purpose {source['purpose']!r}; a batch input file "
                          "must be uploaded with purpose 'batch'.", param="input_file_id")
    now = int(time.time())
    batch = Batch(new_id("batch_"), body["endpoint"], source["id"], body["completion_window"], now, now + window,
                  metadata=meta, owner=request_owner(request))
    # The batch keeps its own link to the input, so deleting the file does not pull it from under it.
    work = executor.store.batch_work_dir(batch.id)
    try:
        work.mkdir(parents=True, exist_ok=True)
        executor.disk.copy(executor.store.file_path(source["id"]), work / "input.jsonl")
        executor.store.add_batch(batch)
    except OSError as e:
        raise disk_error(e) from None
    executor.launch(batch)
    return json_response(executor.view(batch))


def _batch_or_404(executor: BatchExecutor, request: web.Request, batch_id: str) -> Batch:
    found = executor.get(batch_id, request_reader(request))
    if found is None:
        raise OpenAIError(404, f"No batch found with id {shown(batch_id)}.", param="batch_id",
                          code="batch_not_found")
    return found


async def retrieve_batch(request: web.Request) -> web.Response:
    executor = _executor(request)
    return json_response(executor.view(_batch_or_404(executor, request, request.match_info["batch_id"])))


async def list_batches(request: web.Request) -> web.Response:
    executor = _executor(request)
    batches, more = executor.store.list_batches(after=request.query.get("after"), limit=_limit(request, 20, 100),
                                                owner=request_reader(request))
    return _page([executor.view(b) for b in batches], more)


async def cancel_batch(request: web.Request) -> web.Response:
    executor = _executor(request)
    batch_id = request.match_info["batch_id"]
    _batch_or_404(executor, request, batch_id)
    batch = executor.cancel(batch_id, request_reader(request))
    assert batch is not None
    if batch.final:
        raise OpenAIError(409, f"Cannot cancel a batch with status '{batch.status}'.", code="batch_not_cancellable")
    return json_response(executor.view(batch))
