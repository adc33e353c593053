"""Exact stores: SQLite (several processes on one file) and Redis (a real redis-server)."""

from __future__ import annotations

import multiprocessing as mp
import time
import uuid

import pytest

from carpool.cache import NullStore, SQLiteStore, open_cache

RESPONSE = {"choices": [{"message": {"role": "assistant", "content": "positive"}}], "usage": {"total_tokens": 9}}


@pytest.fixture(params=["sqlite", "redis"])
def store(request, tmp_path):
    if request.param == "sqlite":
        s = open_cache(f"sqlite:///{tmp_path}/results.sqlite")
    else:
        base = request.getfixturevalue("redis_server")
        s = open_cache(f"{base}/0?prefix=test-{uuid.uuid4().hex}:")
    yield s
    s.clear()
    s.close()


def test_put_get_roundtrip_and_stats(store):
    assert store.get("k1") is None
    store.put("k1", RESPONSE)
    store.put("k2", {"data": [{"embedding": [0.1, 0.2]}]})
    assert store.get("k1") == RESPONSE
    stats = store.stats()
    assert stats["entries"] == 2
    assert stats["bytes"] > len("k1") + len("k2")
    assert (stats["hits"], stats["misses"], stats["puts"]) == (1, 1, 2)
    assert stats["lifetime"]["hits"] == 1
    store.clear()
    assert store.get("k1") is None
    assert store.stats()["entries"] == 0


def test_put_replaces(store):
    store.put("k", {"v": 1})
    store.put("k", {"v": 2})
    assert store.get("k") == {"v": 2}
    assert store.stats()["entries"] == 1


def test_ttl_expiry(store):
    store.put("short", RESPONSE, ttl_s=0.3)
    store.put("long", RESPONSE, ttl_s=3600)
    store.put("forever", RESPONSE)
    assert store.get("short") == RESPONSE
    time.sleep(0.6)
    assert store.get("short") is None
    assert store.get("long") == RESPONSE
    assert store.get("forever") == RESPONSE
    assert store.stats()["entries"] == 2


def test_store_default_ttl(tmp_path):
    s = open_cache(f"sqlite:///{tmp_path}/c.sqlite", ttl_s=0.2)
    s.put("a", RESPONSE)
    s.put("b", RESPONSE, ttl_s=3600)  # per-entry TTL wins
    time.sleep(0.4)
    assert s.get("a") is None and s.get("b") == RESPONSE
    assert s.stats()["expired"] == 1
    s.close()


def test_redis_ttl_is_redis_expiry(redis_server):
    import redis

    prefix = f"ttl-{uuid.uuid4().hex}:"
    s = open_cache(f"{redis_server}/0?prefix={prefix}", ttl_s=50)
    s.put("a", RESPONSE)
    ttl_ms = redis.Redis.from_url(f"{redis_server}/0").pttl(prefix + "a")
    assert 0 < ttl_ms <= 50_000
    s.clear()
    s.close()


def test_redis_clear_leaves_other_prefixes(redis_server):
    a = open_cache(f"{redis_server}/0?prefix=a-{uuid.uuid4().hex}:")
    b = open_cache(f"{redis_server}/0?prefix=b-{uuid.uuid4().hex}:")
    a.put("k", {"v": "a"})
    b.put("k", {"v": "b"})
    a.clear()
    assert a.get("k") is None and b.get("k") == {"v": "b"}
    b.clear()


def test_sqlite_persists_across_reopen(tmp_path):
    path = tmp_path / "results.sqlite"
    with SQLiteStore(path) as s:
        s.put("k", RESPONSE)
        s.get("k")
    with SQLiteStore(path) as s:
        assert s.get("k") == RESPONSE
        assert s.stats()["lifetime"]["hits"] == 2  # counters are kept in the file


def test_sqlite_size_cap_evicts_least_recently_used(tmp_path):
    s = SQLiteStore(tmp_path / "c.sqlite", max_bytes=2_000)
    payload = {"text": "x" * 180}
    for i in range(30):
        s.put(f"k{i}", payload)
        if i >= 1:
            s.get("k0")  # keep k0 hot
    s.maintain()
    stats = s.stats()
    assert stats["bytes"] <= 2_000
    assert stats["evicted"] > 0
    assert s.get("k0") == payload
    assert s.get("k1") is None  # the coldest went first
    s.close()


def _writer(path: str, worker: int, n: int, queue) -> None:
    store = SQLiteStore(path)
    seen = 0
    for i in range(n):
        store.put(f"w{worker}-{i}", {"worker": worker, "i": i})
        shared = store.get(f"shared-{i % 10}")
        if shared is None:
            store.put(f"shared-{i % 10}", {"i": i % 10})
        else:
            assert shared == {"i": i % 10}
            seen += 1
        assert store.get(f"w{worker}-{i}") == {"worker": worker, "i": i}
    store.close()
    queue.put((worker, seen))


def test_sqlite_concurrent_writers_in_several_processes(tmp_path):
    path = str(tmp_path / "shared.sqlite")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    n, workers = 150, 4
    procs = [ctx.Process(target=_writer, args=(path, w, n, queue)) for w in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * workers
    results = dict(queue.get(timeout=5) for _ in range(workers))
    assert sum(results.values()) > 0  # the workers read each other's entries
    with SQLiteStore(path) as s:
        assert s.stats()["entries"] == workers * n + 10
        for w in range(workers):
            assert s.get(f"w{w}-{n - 1}") == {"worker": w, "i": n - 1}


def test_open_cache_urls(tmp_path, monkeypatch):
    monkeypatch.setenv("CARPOOL_CACHE_DIR", str(tmp_path / "default"))
    s = open_cache(None)
    assert str(s.path) == str(tmp_path / "default" / "results.sqlite")
    s.close()
    s = open_cache(str(tmp_path))  # a directory
    assert s.path == tmp_path / "results.sqlite"
    s.close()
    s = open_cache(f"sqlite:///{tmp_path}/x.db?max_mb=1")
    assert s.max_bytes == 1024 * 1024
    s.close()
    assert isinstance(open_cache("off"), NullStore)
    off = open_cache("off")
    off.put("k", RESPONSE)
    assert off.get("k") is None
    with pytest.raises(ValueError, match="unknown scheme"):
        open_cache("memcached://x")
    with pytest.raises(ConnectionError, match="cannot reach the Redis cache"):
        open_cache("redis://127.0.0.1:1/0")
