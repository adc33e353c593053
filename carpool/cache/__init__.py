"""Result caching: never pay twice for the same work.

* ``cache_key`` / ``is_cacheable`` (keys.py): what identifies a request, what may be reused.
* ``open_cache(url)``: the exact store -- SQLite (default), Redis, or "off".
* ``SemanticCache`` (semantic.py): opt-in near-duplicate reuse for label-like tasks.

See docs/cache.md for the exact rules.
"""

from __future__ import annotations

import errno
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from carpool.cache.keys import (
    cache_key,
    is_cacheable,
    normalize_text,
    scope_key,
    semantic_text,
)
from carpool.cache.sqlite_store import SQLiteStore, default_cache_dir, default_cache_path
from carpool.errors import StartRefused
from carpool.extras import require

# Entries expire after a week unless told otherwise (``--cache-ttl``): a model served under
# a name that moved to other weights without its /v1/models card changing (a hosted alias)
# stops answering from the cache after this long.
DEFAULT_TTL_S = 7 * 24 * 3600.0

__all__ = [
    "DEFAULT_TTL_S",
    "NullStore",
    "RedisStore",
    "SQLiteStore",
    "SemanticCache",
    "cache_key",
    "default_cache_dir",
    "default_cache_path",
    "default_semantic_dir",
    "is_cacheable",
    "normalize_text",
    "open_cache",
    "scope_key",
    "semantic_text",
]


class NullStore:
    """``--cache off``: every lookup misses, nothing is stored."""

    backend = "off"

    def __init__(self) -> None:
        self.misses = 0

    def get(self, key: str) -> dict | None:
        self.misses += 1
        return None

    def put(self, key: str, response: dict, ttl_s: float | None = None, *, model: str | None = None,
            namespace: str = "") -> None:
        return None

    def stats(self) -> dict:
        return {"backend": "off", "location": None, "entries": 0, "bytes": 0, "hits": 0,
                "misses": self.misses, "expired": 0, "puts": 0, "hit_rate": 0.0}

    def clear(self, model: str | None = None, namespace: str | None = None) -> int:
        return 0

    def close(self) -> None:
        return None


def open_cache(url: str | None = None, ttl_s: float | None = None, *, create: bool = True):
    """Open the exact cache named by ``url``.

    * None or "" or "sqlite": ``${CARPOOL_CACHE_DIR:-~/.cache/carpool}/results.sqlite``
    * ``sqlite:///abs/path.sqlite`` (``sqlite://rel/path`` is relative), or a plain path;
      ``?max_mb=N`` caps the payload (least recently used entries go first)
    * ``redis://host:port/db`` or ``rediss://...``; ``?prefix=NAME:`` sets the key prefix
    * "off" / "none": a store that never hits

    ``ttl_s``: time to live of new entries in seconds (None: forever; ``carpool run``
    passes ``DEFAULT_TTL_S`` unless ``--cache-ttl`` says otherwise).  ``create=False``
    (``carpool cache stats`` / ``clear``: looking is no reason to make one): a SQLite file
    that does not exist raises ``FileNotFoundError`` (its ``filename`` the path) instead of
    being made, with its folders.
    """
    if url is None or url.strip() in ("", "sqlite", "default"):
        return _sqlite(default_cache_path(), ttl_s, None, create)
    url = url.strip()
    if url.lower() in ("off", "none", "no", "false", "0"):
        return NullStore()
    lower = url.lower()
    if lower.startswith(("redis://", "rediss://", "unix://")):
        from carpool.cache.redis_store import DEFAULT_PREFIX, RedisStore

        parts = urlsplit(url)
        query = parse_qs(parts.query)
        prefix = query.pop("prefix", [DEFAULT_PREFIX])[0]
        rest = "&".join(f"{k}={v}" for k, vs in query.items() for v in vs)
        clean = parts._replace(query=rest).geturl()
        return RedisStore(clean, ttl_s=ttl_s, prefix=prefix)
    if lower.startswith("sqlite://"):
        parts = urlsplit(url)
        path = (parts.netloc + parts.path) if parts.netloc else parts.path
        query = parse_qs(parts.query)
    elif "://" in url:
        raise StartRefused(
            f"--cache {url!r}: unknown scheme; use sqlite:///path/results.sqlite, "
            "redis://host:6379/0, or off"
        )
    else:
        path, query = url, {}
    if not path:
        raise StartRefused(f"--cache {url!r}: no file path; e.g. sqlite:///tmp/carpool/results.sqlite")
    target = Path(path).expanduser()
    if target.is_dir():
        target = target / "results.sqlite"
    max_bytes = None
    if "max_mb" in query:
        try:
            max_bytes = int(float(query["max_mb"][0]) * 1024 * 1024)
        except ValueError:
            raise StartRefused(f"--cache {url!r}: max_mb must be a number of MiB") from None
    return _sqlite(target, ttl_s, max_bytes, create)


def _sqlite(path: Path, ttl_s: float | None, max_bytes: int | None, create: bool) -> SQLiteStore:
    if not create and not path.exists():
        raise FileNotFoundError(errno.ENOENT, "no cache file", str(path))
    return SQLiteStore(path, ttl_s=ttl_s, max_bytes=max_bytes)


def default_semantic_dir(store=None) -> Path:
    """Where the semantic cache lives: beside the SQLite file, else in the default dir."""
    location = getattr(store, "path", None)
    if location is not None:
        return Path(location).parent / "semantic"
    return default_cache_dir() / "semantic"


def __getattr__(name: str):
    # Lazy: the semantic cache pulls in numpy and faiss, the Redis store pulls in redis.
    if name == "SemanticCache":
        require("cache-semantic", "the semantic cache (--semantic-cache)")
        from carpool.cache.semantic import SemanticCache

        return SemanticCache
    if name == "RedisStore":
        from carpool.cache.redis_store import RedisStore

        return RedisStore
    raise AttributeError(f"module 'carpool.cache' has no attribute {name!r}")
