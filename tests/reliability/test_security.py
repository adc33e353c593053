"""Security: where the server listens, what the API key guards, and that the cache never
hands one model's or parameter scope's answer to another.

Decided: with --api-key, every route requires ``Authorization: Bearer KEY`` except
``/health`` (liveness probes carry no secrets) -- including /metrics (it names the model
and shows traffic) and /openapi.json (it lists the served models), and unknown paths (a
401 before routing, so an unauthenticated client learns nothing about the routes).
The route list is read from the server's own app, so a new route is covered at once.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from reliability_helpers import FaultConfig, chat_task, read_jsonl, write_jsonl

from carpool.jobs.python_api.run import run_batch
from carpool.server import ServerConfig
from carpool.server.app import build_app
from carpool.server.launcher import start_server_process

KEY = "s3cr3t-key"


def _call(url: str, method: str = "GET", body: dict | None = None, headers: dict | None = None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _listening_addresses(pid: int) -> list[tuple[str, int]]:
    """(ip, port) of the TCP sockets in LISTEN state that process ``pid`` holds, from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().as_posix()
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            hexip, hexport = local.split(":")
            raw = bytes.fromhex(hexip)
            if width == 8:
                ip = socket.inet_ntop(socket.AF_INET, raw[::-1])
            else:  # four little-endian 32-bit words
                ip = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
            out.append((ip, int(hexport, 16)))
    return out


def _other_local_ip() -> str | None:
    """A non-loopback address of this machine, if it has one (to try reaching the server)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.1", 9))  # TEST-NET: no packet is sent for a UDP connect
        ip = s.getsockname()[0]
    except OSError:
        return None
    finally:
        s.close()
    return None if ip.startswith("127.") else ip


def _routes() -> list[tuple[str, str]]:
    app = build_app(ServerConfig(port=0, api_key=KEY, embedding_model=None))
    return sorted({(r.method, r.resource.canonical) for r in app.router.routes()})


@pytest.fixture(scope="module")
def keyed_process():
    args = ["--model", "tiny-random", "--port", "0", "--embedding-model", "none", "--api-key", KEY]
    with start_server_process(args) as srv:  # note: no --host
        yield srv


@pytest.mark.slow
def test_binds_loopback_only_by_default(keyed_process):
    addrs = _listening_addresses(keyed_process.process.pid)
    assert addrs == [("127.0.0.1", keyed_process.port)], addrs
    assert keyed_process.base_url.startswith("http://127.0.0.1:")
    other = _other_local_ip()
    if other is not None:  # reachable on loopback only
        with pytest.raises(OSError):
            socket.create_connection((other, keyed_process.port), timeout=2).close()


@pytest.mark.slow
def test_every_route_but_health_requires_the_key(keyed_process):
    base = keyed_process.base_url
    routes = _routes()
    assert ("GET", "/metrics") in routes and ("GET", "/openapi.json") in routes  # covered, as decided
    bodies = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
              "/v1/completions": {"prompt": "hi", "max_tokens": 2}, "/v1/embeddings": {"input": "hi"},
              "/v1/batches": {"input_file_id": "file-none", "endpoint": "/v1/chat/completions",
                              "completion_window": "24h"}}
    for method, path in routes:
        body = bodies.get(path) if method == "POST" else None
        if path == "/health":
            assert _call(base + path, method)[0] == 200
            continue
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                        {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"}):
            status, raw = _call(base + path, method, body, headers)
            assert status == 401, (method, path, headers, status)
            if method != "HEAD":
                assert json.loads(raw)["error"]["code"] == "invalid_api_key"
        status, _ = _call(base + path, method, body, {"Authorization": f"Bearer {KEY}"})
        # 404: no embedding model is served, no such file or batch; 400: a JSON body is no file upload
        allowed = (200, 400) if (method, path) == ("POST", "/v1/files") else (200, 404)
        assert status in allowed, (method, path, status)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/nowhere", "/v1/", "/health/../v1/models", "/v1/models/", "//v1/models",
                                  "/HEALTH", "/health%2F..%2Fv1%2Fmodels"])
def test_unknown_and_tricky_paths_are_401_without_the_key(keyed_process, path):
    status, raw = _call(keyed_process.base_url + path)
    if status == 200:  # only the open /health may answer (after normalisation)
        assert json.loads(raw) == {"status": "ok"}, (path, raw)
    else:
        assert status == 401, (path, status)


# -- the cache never crosses scopes ---------------------------------------------------------


def _texts(path) -> dict[str, dict]:
    return {d["custom_id"]: d["response"] for d in read_jsonl(path)}


def test_exact_cache_never_serves_another_model_or_parameter_scope(logging_fault_server, tmp_path):
    # The cache names the model by what the endpoint reports (/v1/models), not by its URL:
    # b serves other weights under the same name (another root), c is a replica of a.
    cards = [{"id": "m1", "object": "model", "owned_by": "vllm", "root": "/weights/m1"},
             {"id": "m2", "object": "model", "owned_by": "vllm", "root": "/weights/m2"}]
    a = logging_fault_server(FaultConfig(models=cards))
    b = logging_fault_server(FaultConfig(models=[{**cards[0], "root": "/weights/m1-retrained"}]))
    cache = f"sqlite:///{tmp_path / 'cache.sqlite'}"
    base = [chat_task(f"c{i}", f"classify item {i}", temperature=0.0, max_tokens=4) for i in range(6)]
    src = write_jsonl(tmp_path / "base.jsonl", base)
    run_batch(src, tmp_path / "first.jsonl", endpoints=[a.url], model="m1", cache=cache)
    assert a.server.total_requests == 6
    variants = {
        "model": ({}, "m2", a),
        "endpoint": ({}, "m1", b),
        "max_tokens": ({"max_tokens": 5}, "m1", a),
        "seed": ({"seed": 1}, "m1", a),
        "top_p": ({"top_p": 0.5}, "m1", a),
        "stop": ({"stop": ["\n"]}, "m1", a),
        "system": ("system", "m1", a),
    }
    for name, (change, model, srv) in variants.items():
        if change == "system":
            rows = [{**r, "messages": [{"role": "system", "content": "Be terse."}, *r["messages"]]} for r in base]
        else:
            rows = [{**r, **change} for r in base]
        vsrc = write_jsonl(tmp_path / f"{name}.jsonl", rows)
        before = srv.server.total_requests
        s = run_batch(vsrc, tmp_path / f"{name}.out.jsonl", endpoints=[srv.url], model=model, cache=cache)
        assert s["cache_hits"] == 0, (name, s["cache_hits"])
        assert srv.server.total_requests - before == 6, name  # every task went to the server
        for resp in _texts(tmp_path / f"{name}.out.jsonl").values():
            assert resp["body"]["model"] == model and not resp["request_id"].startswith("cache"), name
    # The positive controls: the very same tasks again, and on a replica of a (another URL),
    # are all served from the cache.
    s = run_batch(src, tmp_path / "again.jsonl", endpoints=[a.url], model="m1", cache=cache)
    assert s["cache_hits"] == 6
    c = logging_fault_server(FaultConfig(models=cards))
    s = run_batch(src, tmp_path / "replica.jsonl", endpoints=[c.url], model="m1", cache=cache)
    assert s["cache_hits"] == 6 and c.server.total_requests == 0
    assert _texts(tmp_path / "again.jsonl") == {k: {**v, "request_id": "cache:exact"}
                                                for k, v in _texts(tmp_path / "first.jsonl").items()}


def test_semantic_cache_never_crosses_model_or_system_prompt(logging_fault_server, tmp_path):
    pytest.importorskip("carpool.embed.embedder")
    srv = logging_fault_server(FaultConfig())
    cache = f"sqlite:///{tmp_path / 'c' / 'results.sqlite'}"

    def task(cid, text, system="Label the sentiment."):
        return {"custom_id": cid, "temperature": 0, "max_tokens": 3,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": text}]}

    seed_text = "The battery lasts all day and I love this phone."
    para = "I love this phone and the battery lasts all day."

    def run(name, rows, model):
        src = write_jsonl(tmp_path / f"{name}.jsonl", rows)
        return run_batch(src, tmp_path / f"{name}.out.jsonl", endpoints=[srv.url], model=model, cache=cache,
                         semantic_cache=0.85, concurrency=1)

    assert run("seed", [task("s0", seed_text)], "m1")["semantic_hits"] == 0
    # Another model, another system prompt: near-identical text, but never a hit.
    s = run("other-model", [task("p1", para)], "m2")
    assert s["semantic_hits"] == 0 and srv.server.events["p1"] == ["ok"]
    s = run("other-system", [task("p2", para, system="Translate to French.")], "m1")
    assert s["semantic_hits"] == 0 and srv.server.events["p2"] == ["ok"]
    # The control: the same scope does hit, without a request.
    s = run("same-scope", [task("p3", para)], "m1")
    assert s["semantic_hits"] == 1 and "p3" not in srv.server.events
