"""Cache identity: --cache-namespace, the default TTL, `carpool cache clear --model/--namespace`."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import sys
import time
import uuid

import pytest

from carpool.cache import DEFAULT_TTL_S, SQLiteStore, open_cache
from carpool.cache.keys import cache_key, scope_key
from carpool.jobs.input.tasks import TaskDefaults
from carpool.jobs.options import RunOptions
from carpool.jobs.runner import Runner
from carpool.testing.fault_server import FaultConfig, ThreadedFaultServer

BODY = {"messages": [{"role": "user", "content": "Is this spam?"}], "temperature": 0, "max_tokens": 4}
ANSWER = {"choices": [{"message": {"role": "assistant", "content": "no"}}]}


@pytest.fixture(params=["sqlite", "redis"])
def store(request, tmp_path):
    if request.param == "sqlite":
        s = open_cache(f"sqlite:///{tmp_path}/results.sqlite")
    else:
        s = open_cache(f"{request.getfixturevalue('redis_server')}/0?prefix=id-{uuid.uuid4().hex}:")
    yield s
    s.clear()
    s.close()


def test_without_a_namespace_keys_are_the_ones_written_before_it_existed():
    # Pinned: the keys main wrote before --cache-namespace, so existing caches still hit.
    endpoint = '{"kind":"http","name":"m"}'
    assert cache_key(model="m", endpoint=endpoint, body=BODY) == \
        "43b81076afa14c1603f443b74ee3e2fe82f00983d776bfa96dcb396683443a6d"
    assert cache_key(model="m", endpoint=endpoint, body=BODY, namespace="") == cache_key(
        model="m", endpoint=endpoint, body=BODY)
    assert scope_key(model="m", endpoint="e", body=BODY) == \
        "646be513d0f34724e5bcaa11bcc3ecf0922f9326491db30a3142fe0cf37e4129"


def test_a_namespace_is_part_of_the_key():
    keys = {cache_key(model="m", endpoint="e", body=BODY, namespace=ns) for ns in ("", "a", "b")}
    assert len(keys) == 3
    assert len({scope_key(model="m", endpoint="e", body=BODY, namespace=ns) for ns in ("", "a")}) == 2


def _job(url: str, tmp_path, name: str, **kw) -> dict:
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"custom_id": "q", **BODY}) + "\n")
    opts = RunOptions(input=str(src), output=str(tmp_path / f"{name}.jsonl"), endpoints=[url], progress=False,
                      quiet=True, defaults=TaskDefaults(model="m"), cache=f"sqlite:///{tmp_path}/c.sqlite", **kw)
    return asyncio.run(Runner(opts).run()).to_dict()


def test_namespaces_separate_jobs_and_the_summary_shows_the_ttl(tmp_path):
    with ThreadedFaultServer(FaultConfig(models=["m"])) as srv:
        first = _job(srv.url, tmp_path, "a1", cache_namespace="a")
        assert srv.server.total_requests == 1 and first["cache_hits"] == 0
        assert _job(srv.url, tmp_path, "b1", cache_namespace="b")["cache_hits"] == 0
        assert _job(srv.url, tmp_path, "plain")["cache_hits"] == 0  # no namespace: a cache of its own too
        assert srv.server.total_requests == 3
        again = _job(srv.url, tmp_path, "a2", cache_namespace="a")
        assert again["cache_hits"] == 1 and srv.server.total_requests == 3
    assert first["cache_ttl_s"] == DEFAULT_TTL_S == 7 * 24 * 3600
    assert "ttl 7d" in first["cache"] and "namespace 'a'" in first["cache"]


def test_summary_says_never_when_the_ttl_is_off(tmp_path):
    with ThreadedFaultServer(FaultConfig(models=["m"])) as srv:
        s = _job(srv.url, tmp_path, "x", cache_ttl=None)
    assert s["cache_ttl_s"] is None and "ttl never" in s["cache"]


def test_expired_entries_are_not_served_sqlite(tmp_path):
    now = [1000.0]
    s = SQLiteStore(tmp_path / "c.sqlite", ttl_s=60, clock=lambda: now[0])
    s.put("k", ANSWER, model="m")
    now[0] += 59
    assert s.get("k") == ANSWER
    now[0] += 2
    assert s.get("k") is None and len(s) == 0  # deleted when found expired
    s.put("forever", ANSWER, ttl_s=None)  # the store's default applies
    s.close()


def test_expired_entries_are_not_served_redis(redis_server):
    s = open_cache(f"{redis_server}/0?prefix=ttl-{uuid.uuid4().hex}:", ttl_s=0.05)
    try:
        s.put("k", ANSWER, model="m")
        assert s.get("k") == ANSWER
        time.sleep(0.2)
        assert s.get("k") is None
    finally:
        s.clear()
        s.close()


def test_clear_model_removes_only_that_model(store):
    store.put("a1", ANSWER, model="model-a")
    store.put("a2", ANSWER, model="model-a", namespace="exp")
    store.put("b1", ANSWER, model="model-b")
    store.put("b2", ANSWER, model="model-b", namespace="exp")
    assert store.clear(model="model-a") == 2
    assert [store.get(k) is not None for k in ("a1", "a2", "b1", "b2")] == [False, False, True, True]
    assert store.clear(namespace="exp") == 1
    assert [store.get(k) is not None for k in ("b1", "b2")] == [True, False]
    store.put("b3", ANSWER, model="model-b", namespace="exp")
    assert store.clear(model="model-b", namespace="exp") == 1 and store.get("b1") is not None
    assert store.clear(model="nobody") == 0
    assert store.stats()["entries"] == 1


def test_redis_index_outlives_every_entry_it_lists(redis_server):
    import redis

    prefix = f"idx-{uuid.uuid4().hex}:"
    s = open_cache(f"{redis_server}/0?prefix={prefix}")
    raw = redis.Redis.from_url(f"{redis_server}/0")
    try:
        s.put("long", ANSWER, ttl_s=100, model="m")
        s.put("short", ANSWER, ttl_s=1, model="m")  # must not shorten the index to 1 s
        (index,) = list(raw.scan_iter(match=f"{prefix}__index__:*"))
        assert raw.pttl(index) > 50_000
        s.put("never", ANSWER, ttl_s=None, model="m")
        assert raw.pttl(index) == -1  # an entry that never expires: the index neither
        assert s.stats()["entries"] == 3  # index sets are not entries
    finally:
        s.clear()
        s.close()
    assert not list(raw.scan_iter(match=f"{prefix}*"))


def test_an_old_sqlite_file_stays_readable_and_gets_the_columns(tmp_path):
    path = tmp_path / "old.sqlite"
    con = sqlite3.connect(path)
    con.executescript("""CREATE TABLE entries (key TEXT PRIMARY KEY, value TEXT NOT NULL, size INTEGER NOT NULL,
                         created REAL NOT NULL, expires REAL, last_access REAL NOT NULL);""")
    con.execute("INSERT INTO entries VALUES ('old', ?, 10, 0, NULL, 0)", (json.dumps(ANSWER),))
    con.commit()
    con.close()
    with SQLiteStore(path) as s:
        assert s.get("old") == ANSWER
        s.put("new", ANSWER, model="m")
        assert s.clear(model="m") == 1 and s.get("old") == ANSWER
        assert {"model": None, "namespace": None, "entries": 1} in s.stats()["by_model"]
        assert s.clear() == 1 and len(s) == 0


def cache_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "carpool.cli", "cache", *args], capture_output=True, text=True,
                          timeout=120, check=False)


def test_cache_clear_model_cli(tmp_path):
    url = f"sqlite:///{tmp_path}/c.sqlite"
    with open_cache(url) as s:
        s.put("a", ANSWER, model="model-a")
        s.put("b", ANSWER, model="model-b", namespace="exp")
    p = cache_cli("clear", "--cache", url, "--model", "model-a")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == {"cleared": {"exact": 1}, "selected": {"model": "model-a"}}
    p = cache_cli("clear", "--cache", url, "--namespace", "exp")
    assert json.loads(p.stdout)["cleared"]["exact"] == 1
    assert cache_cli("stats", "--cache", url, "--model", "x").returncode == 2
    with open_cache(url) as s:
        assert len(s) == 0


def test_cache_clear_finds_the_shipped_model_under_its_hugging_face_name(tmp_path):
    # The answers of the shipped model are stored under its canonical name; a user who ran it
    # as HuggingFaceTB/SmolLM2-135M-Instruct clears it by that name.
    url = f"sqlite:///{tmp_path}/c.sqlite"
    with open_cache(url) as s:
        s.put("a", ANSWER, model="smollm2")
        s.put("b", ANSWER, model="model-b")
    p = cache_cli("clear", "--cache", url, "--model", "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["cleared"]["exact"] == 1
    with open_cache(url) as s:
        assert len(s) == 1


def test_the_shipped_model_under_its_two_names_shares_the_cache_and_a_resume(tmp_path):
    # Before: `--model smollm2` and `--model HuggingFaceTB/SmolLM2-135M-Instruct` (the same
    # weights) made other cache keys and another run fingerprint: no hit, and a resume refused.
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"custom_id": c, "messages": [{"role": "user", "content": f"Say {c}"}],
                                       "max_tokens": 2, "temperature": 0}) + "\n" for c in ("hi", "bye")))

    def run(output: str, model: str) -> tuple[subprocess.CompletedProcess, dict]:
        summary = tmp_path / f"{output}-{model.replace('/', '_')}.json"
        p = subprocess.run([sys.executable, "-m", "carpool.cli", "run", str(src), "-o", str(tmp_path / output),
                            "--model", model, "--cache", f"sqlite:///{tmp_path}/c.sqlite", "--quiet",
                            "--summary-json", str(summary)], capture_output=True, text=True, timeout=600,
                           check=False)
        return p, json.loads(summary.read_text()) if summary.exists() else {}

    first, _ = run("a.jsonl", "smollm2")
    assert first.returncode == 0, first.stderr
    other, s = run("b.jsonl", "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert other.returncode == 0, other.stderr
    assert s["cache_hits"] == 2
    resumed, s = run("a.jsonl", "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert resumed.returncode == 0, resumed.stderr
    assert s["skipped_done_before"] == 2 and s["done"] == 0
