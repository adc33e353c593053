"""``GET /openapi.json`` of a real server lists every route the app registers, the Files and
Batches API included, and the objects that API really answers with validate against it."""

from __future__ import annotations

import io
import json
import time
import urllib.request

import jsonschema
import pytest

from carpool.server import ServerConfig, start_server

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def served(tiny_engine, tiny_config, tmp_path_factory):
    cfg = ServerConfig(engine=tiny_config, port=0, embedding_model=None,
                       batch_dir=str(tmp_path_factory.mktemp("batches")))
    with start_server(cfg, engine=tiny_engine) as srv:
        doc = json.loads(urllib.request.urlopen(srv.base_url + "/openapi.json", timeout=10).read())
        yield srv, doc


def _registered(app) -> set[tuple[str, str]]:
    """(path, method) of every route the app answers, HEAD aside (aiohttp adds one per GET)."""
    out = set()
    for route in app.router.routes():
        if route.method in ("HEAD", "*"):
            continue
        out.add((route.resource.canonical, route.method.lower()))
    return out


def _published(doc: dict) -> set[tuple[str, str]]:
    return {(path, method) for path, ops in doc["paths"].items() for method in ops}


def test_the_document_lists_every_registered_route_and_no_other(served):
    srv, doc = served
    registered = _registered(srv.app)
    # The embeddings route answers 404 when no embedding model is served: the document
    # then leaves it out, as it always has.
    registered.discard(("/v1/embeddings", "post"))
    assert registered == _published(doc)
    ops = {op["operationId"] for ops in doc["paths"].values() for op in ops.values()}
    assert {"createFile", "listFiles", "retrieveFile", "deleteFile", "downloadFile", "createBatch",
            "listBatches", "retrieveBatch", "cancelBatch"} <= ops


def test_the_document_is_valid_openapi(served):
    spec = pytest.importorskip("openapi_spec_validator")
    spec.validate_spec(served[1])


def _json_schema(schema):
    """OpenAPI 3.0's ``nullable: true`` as JSON Schema says it (null is one more choice)."""
    if isinstance(schema, list):
        return [_json_schema(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _json_schema(v) for k, v in schema.items() if k != "nullable"}
    return {"anyOf": [out, {"type": "null"}]} if schema.get("nullable") else out


def _response_schema(doc: dict, path: str, method: str = "get", status: str = "200") -> dict:
    return doc["paths"][path][method]["responses"][status]["content"]["application/json"]["schema"]


def _check(schema: dict, obj: dict) -> None:
    """Valid under both readings of the schema: plain JSON Schema and OpenAPI 3.0's own."""
    jsonschema.Draft7Validator(_json_schema(schema)).validate(obj)
    oas = pytest.importorskip("openapi_schema_validator")
    oas.OAS30Validator(schema).validate(obj)


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def _line(i: int, model: str = "tiny-random") -> str:
    return json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": model, "messages": [{"role": "user", "content": f"hi {i}"}],
                                "max_tokens": 2}})


def _until_final(base: str, batch_id: str) -> dict:
    deadline = time.monotonic() + 120
    while True:
        b = _get(f"{base}/v1/batches/{batch_id}")
        if b["status"] in ("completed", "failed", "cancelled", "expired"):
            return b
        assert time.monotonic() < deadline, b
        time.sleep(0.05)


def test_real_file_and_batch_objects_validate_against_the_published_schemas(served):
    srv, doc = served
    base = srv.base_url
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
    good = client.files.create(file=("in.jsonl", io.BytesIO(("\n".join(_line(i) for i in range(3)) + "\n")
                                                           .encode())), purpose="batch")
    bad = client.files.create(file=("bad.jsonl", io.BytesIO((_line(0) + "\n" + _line(1, "other") + "\n")
                                                           .encode())), purpose="batch")
    _check(_response_schema(doc, "/v1/files", "post"), _get(f"{base}/v1/files/{good.id}"))
    _check(_response_schema(doc, "/v1/files/{file_id}"), _get(f"{base}/v1/files/{good.id}"))
    made = _post(f"{base}/v1/batches", {"input_file_id": good.id, "endpoint": "/v1/chat/completions",
                                        "completion_window": "24h", "metadata": {"k": "v"}})
    batch = _response_schema(doc, "/v1/batches", "post")
    _check(batch, made)  # fresh: most fields still null
    done = _until_final(base, made["id"])
    assert done["status"] == "completed" and done["usage"] is not None
    _check(_response_schema(doc, "/v1/batches/{batch_id}"), done)
    failed = _until_final(base, _post(f"{base}/v1/batches", {"input_file_id": bad.id,
                                                             "endpoint": "/v1/chat/completions",
                                                             "completion_window": "24h"})["id"])
    assert failed["status"] == "failed" and failed["errors"]["data"][0]["line"] == 2
    _check(batch, failed)
    _check(_response_schema(doc, "/v1/batches"), _get(f"{base}/v1/batches?limit=2"))
    _check(_response_schema(doc, "/v1/files"), _get(f"{base}/v1/files?limit=3"))
    _check(_response_schema(doc, "/v1/files/{file_id}", "delete"), client.files.delete(bad.id).model_dump())
    with pytest.raises(urllib.error.HTTPError) as missing:
        _get(f"{base}/v1/batches/batch_missing")
    _check(_response_schema(doc, "/v1/batches/{batch_id}", status="404"), json.loads(missing.value.read()))
    # The schema says something: an object off its shape is refused by it.
    for wrong in ({**done, "status": "running"}, {k: v for k, v in done.items() if k != "request_counts"},
                  {**done, "output_file_id": 7}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.Draft7Validator(_json_schema(batch)).validate(wrong)
