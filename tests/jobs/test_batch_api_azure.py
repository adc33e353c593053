"""``carpool run --batch-api azure`` as a user runs it (a subprocess), against the Azure stand-in
(``carpool.testing.azure_batch_server``) in front of a real ``carpool serve``: Azure's paths,
``api-version``, ``api-key`` and lines without ``/v1`` are checked on every call, and the
batches run on the tiny engine.  A client speaking plain OpenAI to it is refused."""

from __future__ import annotations

import io
import json
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from job_helpers import cli, lines

from carpool.engine import EngineConfig
from carpool.server import ServerConfig, start_server
from carpool.testing.azure_batch_server import AzureBatchConfig, ThreadedAzureBatchServer

KEY = "azure-test-key"


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    """A real carpool serve with its own tiny engine (the Batch API runs on it)."""
    cfg = ServerConfig(engine=EngineConfig(model="tiny-random", max_num_seqs=8, max_model_len=256), port=0,
                       embedding_model=None, batch_dir=str(tmp_path_factory.mktemp("store")), batch_max_inflight=4)
    with start_server(cfg) as srv:
        yield srv.base_url


@pytest.fixture
def azure(upstream):
    srv = ThreadedAzureBatchServer(AzureBatchConfig(upstream=upstream, api_key=KEY))
    srv.start()
    yield srv
    srv.stop()


def _tasks(path: Path, n: int) -> list[str]:
    ids = [f"t{i}" for i in range(n)]
    with open(path, "w") as f:
        for i, cid in enumerate(ids):
            f.write(json.dumps({"custom_id": cid, "metadata": {"i": i}, "max_tokens": 4, "ignore_eos": True,
                                "temperature": 0, "messages": [{"role": "user", "content": f"count {i}"}]}) + "\n")
    return ids


def _run(provider: str, url: str, tasks: Path, out: Path, *extra: str):
    return cli(tasks, "-o", out, "--batch-api", provider, "--endpoint", url, "--model", "tiny-random",
               "--api-key", KEY, "--batch-poll", "0.05", "--batch-max-poll", "0.3", "--no-progress",
               "--max-attempts", "1", *extra, timeout=300)


def test_a_job_completes_through_the_azure_shape_with_every_task_answered_once(azure, tmp_path):
    tasks, out = tmp_path / "tasks.jsonl", tmp_path / "out.jsonl"
    ids = _tasks(tasks, 30)
    r = _run("azure", azure.url, tasks, out, "--batch-max-requests", "12")
    assert r.returncode == 0, r.stderr
    got = lines(out)
    assert sorted(x["custom_id"] for x in got) == sorted(ids)  # none lost, none twice
    for x in got:
        assert x["error"] is None and x["response"]["status_code"] == 200, x
        assert x["response"]["body"]["usage"]["completion_tokens"] == 4
        assert x["metadata"] == {"i": int(x["custom_id"][1:])}
    server = azure.server
    assert server.received == Counter({cid: 1 for cid in ids})  # uploaded once each, in 3 batches
    # ``carpool run`` asks Azure's GET /openai/models once at start, with the Azure key and
    # api-version; every call, that one included, passed Azure's checks.
    batch_calls = [c for c in server.calls if c != ("GET", "/openai/models")]
    assert server.calls.count(("GET", "/openai/models")) == 1
    assert all(path.startswith("/openai/") for _, path in batch_calls), batch_calls
    assert server.refused == []
    assert batch_calls.count(("POST", "/openai/batches")) == 3 and batch_calls.count(("POST", "/openai/files")) == 3


def test_a_plain_openai_client_is_refused(azure, tmp_path):
    """The same job sent OpenAI's way (Bearer key, /v1 paths and lines, no api-version) fails."""
    tasks, out = tmp_path / "tasks.jsonl", tmp_path / "out.jsonl"
    _tasks(tasks, 3)
    r = _run("openai", azure.url + "/openai", tasks, out)
    assert r.returncode != 0
    assert "HTTP 401" in r.stderr, r.stderr
    assert azure.server.received == Counter()
    # Refused at the start: Azure answers the Bearer key's GET /openai/models with 401, so nothing
    # is uploaded (the job used to get as far as a refused POST /openai/files).
    assert r.returncode == 2 and "refused the key" in r.stderr, r.stderr
    assert azure.server.refused and all(x.startswith("GET /openai/models:") for x in azure.server.refused), \
        azure.server.refused
    assert not out.exists() or lines(out) == [] or all(x["error"] is not None for x in lines(out))


def _call(url: str, data: bytes | None = None, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=data, headers=headers or {}, method="POST" if data else "GET")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _form(line: dict) -> tuple[bytes, dict]:
    boundary = "azureboundary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n"
            f"Content-Type: application/jsonl\r\n\r\n").encode() + io.BytesIO(json.dumps(line).encode()).read() \
        + f"\r\n--{boundary}--\r\n".encode()
    return body, {"Content-Type": f"multipart/form-data; boundary={boundary}"}


@pytest.mark.parametrize(("query", "headers", "url", "status"), [
    ("?api-version=2024-10-21", {"api-key": KEY}, "/chat/completions", 200),
    ("", {"api-key": KEY}, "/chat/completions", 404),  # no api-version
    ("?api-version=2024-10-21", {"Authorization": f"Bearer {KEY}"}, "/chat/completions", 401),
    ("?api-version=2024-10-21", {"api-key": "wrong"}, "/chat/completions", 401),
    ("?api-version=2024-10-21", {"api-key": KEY}, "/v1/chat/completions", 400),  # OpenAI's url in a line
], ids=["azure-shape", "no-api-version", "bearer-not-api-key", "wrong-key", "v1-in-line"])
def test_every_azure_specific_part_of_an_upload_is_checked(azure, query, headers, url, status):
    line = {"custom_id": "a", "method": "POST", "url": url,
            "body": {"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}}
    body, form_headers = _form(line)
    got, doc = _call(azure.url + "/openai/files" + query, body, {**headers, **form_headers})
    assert got == status, doc
    if status == 200:
        assert doc["object"] == "file" and azure.server.received == Counter({"a": 1})
        bad, err = _call(azure.url + "/openai/batches?api-version=2024-10-21",
                         json.dumps({"input_file_id": doc["id"], "endpoint": "/v1/chat/completions",
                                     "completion_window": "24h"}).encode(),
                         {"api-key": KEY, "Content-Type": "application/json"})
        assert bad == 400 and "endpoint" in err["error"]["message"]  # OpenAI's endpoint on create
    else:
        assert "message" in doc["error"] and azure.server.received == Counter()
