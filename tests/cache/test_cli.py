"""`carpool cache stats|clear` through the real CLI entry point."""

from __future__ import annotations

import json

from carpool.cache import SemanticCache, open_cache
from carpool.cli import main


def test_stats_and_clear_sqlite(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CARPOOL_CACHE_DIR", str(tmp_path))
    store = open_cache(None)
    store.put("a", {"v": 1})
    store.put("b", {"v": 2})
    store.get("a")
    store.close()
    sem = SemanticCache(tmp_path / "semantic", embedder=lambda texts: [[1.0, 0.0]] * len(texts))
    sem.add("scope", "hello", {"v": 3})
    sem.close()

    assert main(["cache", "stats"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["exact"]["entries"] == 2
    assert report["exact"]["lifetime"]["hits"] == 1
    assert report["semantic"]["entries"] == 1

    assert main(["cache", "clear"]) == 0
    assert json.loads(capsys.readouterr().out)["cleared"] == {"exact": 2, "semantic": 1}
    assert main(["cache", "stats", "--cache", f"sqlite:///{tmp_path}/results.sqlite"]) == 0
    assert json.loads(capsys.readouterr().out)["exact"]["entries"] == 0


def test_looking_at_a_cache_that_is_not_there_makes_none(tmp_path, capsys):
    """`stats` and `clear` on a path with no cache file made the file and every folder above it
    (a typo in --cache left a tree behind); they now say there is none and make nothing."""
    where = tmp_path / "typo" / "dir" / "results.sqlite"
    assert main(["cache", "stats", "--cache", f"sqlite://{where}"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["exact"] == {"backend": "sqlite", "location": str(where), "exists": False,
                                            "entries": 0}
    assert f"no cache file at {where}" in out.err
    assert main(["cache", "clear", "--cache", str(where)]) == 0
    assert json.loads(capsys.readouterr().out) == {"cleared": {"exact": 0}}
    assert list(tmp_path.iterdir()) == []


def test_stats_redis(redis_server, capsys):
    url = f"{redis_server}/0?prefix=cli-test:"
    store = open_cache(url)
    store.put("k", {"v": 1})
    store.close()
    assert main(["cache", "stats", "--cache", url]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["exact"]["backend"] == "redis" and report["exact"]["entries"] == 1
    assert main(["cache", "clear", "--cache", url]) == 0
    assert json.loads(capsys.readouterr().out)["cleared"]["exact"] == 1


def test_bad_url_is_a_readable_error(capsys):
    assert main(["cache", "stats", "--cache", "memcached://x"]) == 2
    assert "unknown scheme" in capsys.readouterr().err
